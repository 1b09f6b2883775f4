// report.html (see report_html.hpp). Every string that comes from the run or the dump goes
// through xml_escape; the page holds no script and references nothing outside itself.
#include "src/report/report_html.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <map>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

#include "src/report/diagnosis_report.hpp"
#include "src/report/json_layout.hpp"
#include "src/report/report_summary.hpp"
#include "src/report/svg_chart.hpp"
#include "src/verdict/signoff.hpp"

namespace kvaudit {
namespace {

using Html = fmt::memory_buffer;

template <typename... Args>
void put(Html& html, fmt::format_string<Args...> format, Args&&... args) {
  fmt::format_to(std::back_inserter(html), format, std::forward<Args>(args)...);
}

std::string esc(const std::string& text) { return xml_escape(text); }

constexpr const char* kStyle = R"(
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;margin:0;
color:#1f2328;background:#fff;line-height:1.45}
main{max-width:1180px;margin:0 auto;padding:0 20px 40px}
h1{margin:0;font-size:30px}h2{margin:28px 0 8px;font-size:20px;border-bottom:1px solid #d0d7de;
padding-bottom:4px}h3{font-size:15px;margin:14px 0 4px}
.verdict{padding:16px 20px;border-radius:8px;margin:18px 0 10px;border:2px solid}
.verdict.pass{background:#dafbe1;border-color:#1a7f37}.verdict.fail{background:#ffebe9;
border-color:#cf222e}.verdict.pass h1{color:#1a7f37}.verdict.fail h1{color:#cf222e}
.verdict p{margin:6px 0}.muted{color:#59636e}.small{font-size:12px}
table{border-collapse:collapse;margin:6px 0 12px;font-size:13px}
th,td{border:1px solid #d0d7de;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f6f8fa}td.num{text-align:right;font-variant-numeric:tabular-nums}
code,.mono{font-family:ui-monospace,"DejaVu Sans Mono",monospace;font-size:12px;
overflow-wrap:anywhere}
ul.summary{list-style:none;padding:0}ul.summary li{margin:6px 0;padding-left:4px}
.badge{display:inline-block;min-width:42px;text-align:center;font-size:11px;font-weight:bold;
border-radius:10px;padding:1px 8px;margin-right:8px;color:#fff;background:#6e7781}
.badge.PASS{background:#1a7f37}.badge.FAIL{background:#cf222e}.badge.NOT-MEASURED{
background:#9a6700}.badge.REPORT-ONLY{background:#bc4c00}
.failure{border-left:4px solid #cf222e;padding:4px 12px;margin:10px 0;background:#fff8f7}
.failure.report-only{border-color:#bc4c00;background:#fff8f0}
.cause{margin:4px 0}.charts{display:flex;flex-wrap:wrap;gap:12px;align-items:flex-start}
.legend span{display:inline-block;width:14px;height:10px;margin:0 4px 0 10px;
border:1px solid #999;vertical-align:middle}
@media print{.verdict{break-inside:avoid}svg{break-inside:avoid}}
)";

// ---- data from the run -------------------------------------------------------------------------

using Site = std::tuple<int, int, Comparison>;  // step, layer, comparison

std::map<Site, const ComparisonResult*> results_by_site(const CheckRun& run) {
  std::map<Site, const ComparisonResult*> sites;
  for (const ComparisonResult& r : run.comparisons) sites[{r.step, r.layer_id, r.comparison}] = &r;
  return sites;
}

std::optional<double> rel_l2_limit(const CheckRun& run, Comparison comparison) {
  return limit_value(limits_for(run.policy, comparison), Limit::kRelL2);
}

std::string comparison_title(Comparison comparison) {
  switch (comparison) {
    case Comparison::kKernel:
      return "kernel (backend vs R8\u2032)";
    case Comparison::kCache:
      return "cache (R8\u2032 vs R8)";
    case Comparison::kQuantization:
      return "quantization (R8 vs Rs)";
    case Comparison::kTotal:
      return "total (backend vs Rs)";
    case Comparison::kCaptured:
      return "captured (dump out vs R8)";
    case Comparison::kCapturedRead:
      return "captured read (dump out vs R8 on the captured pool)";
    case Comparison::kCapturedCache:
      return "captured cache (R8 on the captured pool vs R8)";
  }
  return comparison_name(comparison);
}

std::string result_tooltip(const CheckRun& run, const ComparisonResult& r) {
  const ComparisonMetrics& m = r.metrics;
  const std::optional<double> limit = rel_l2_limit(run, r.comparison);
  return fmt::format("step {} layer {} {}: rel_l2 {} ({}), max_abs {} at {}, cos_diff {}{} - {}",
                     r.step, r.layer_id, comparison_name(r.comparison), short_number(m.rel_l2),
                     limit ? "limit " + short_number(*limit) : "no limit", short_number(m.max_abs),
                     location_text(worst_location(r)), short_number(m.cos_diff),
                     m.has_lse ? ", lse error " + short_number(m.lse_max_abs) : "", result_text(r));
}

// ---- the top: verdict, sign-off, summary, failures, diagnosis ----------------------------------

// "48 comparisons measured over 3 layers x 4 steps (kernel 12, cache 12, ...)".
std::string rests_on_text(const ReportModel& model) {
  const CheckRun& run = model.run;
  std::map<Comparison, int> per;
  for (const ComparisonResult& r : run.comparisons) ++per[r.comparison];
  std::vector<std::string> parts;
  for (const Comparison c : all_comparisons()) {
    if (per.count(c) != 0) parts.push_back(fmt::format("{} {}", comparison_name(c), per[c]));
  }
  const RunCounts& counts = model.counts;
  const std::string unmeasured =
      counts.unmeasured == 0 ? "nothing left unmeasured"
                             : fmt::format("{} step-layer comparisons not measured: {}",
                                           counts.unmeasured, gaps_headline(model.unmeasured));
  return fmt::format(
      "Rests on {} comparisons measured over {} layers x {} steps ({}) and {} cache integrity "
      "checks, judged with policy {}; {}.",
      counts.comparisons, run_layers(run).size(), run_steps(run).size(), fmt::join(parts, ", "),
      counts.integrity_checks, run.policy.name, unmeasured);
}

void verdict_header(Html& html, const ReportModel& model) {
  const CheckRun& run = model.run;
  const bool pass = model.pass;
  const RunCounts& counts = model.counts;
  put(html, "<header class=\"verdict {}\" id=\"verdict\"><h1>{}</h1>", pass ? "pass" : "fail",
      pass ? "PASS" : "FAIL");
  put(html,
      "<p><strong>{}</strong> on <code>{}</code> with policy <code>{}</code>: {} comparisons, {} "
      "failed{}; {} integrity checks, {} failed.</p>",
      esc(backend_machine_text(run)), esc(run.dump_path), esc(run.policy.name), counts.comparisons,
      counts.failed,
      counts.failed_report_only > 0
          ? fmt::format(" ({} more failed report-only)", counts.failed_report_only)
          : "",
      counts.integrity_checks, counts.integrity_failed);
  if (gaps_fail_run(run)) {
    put(html, "<p><strong>Sign-off incomplete:</strong> {}.</p>",
        esc(gaps_headline(model.unmeasured)));
  }
  put(html, "<p class=\"muted\">{}</p>", esc(rests_on_text(model)));
  if (run.first_divergence) {
    const Divergence& d = *run.first_divergence;
    put(html, "<p>First divergence ({}): step {} layer {} request {} row {} head {}: {}</p>",
        comparison_name(d.comparison), d.step, d.layer_id, d.request, d.row, d.head, esc(d.reason));
  }
  put(html, "</header>\n");
}

void signoff_block(Html& html, const std::optional<SignOffRecord>& signoff) {
  if (!signoff) return;
  auto text = [](const std::string& given) {
    return given.empty() ? std::string("(not given)") : esc(given);
  };
  put(html, "<section id=\"signoff\"><h2>Sign-off</h2><table>");
  put(html, "<tr><th>signed by</th><td>{}</td></tr><tr><th>model</th><td>{}</td></tr>",
      text(signoff->signer.signed_by), text(signoff->signer.model));
  put(html, "<tr><th>deployment</th><td>{}</td></tr>", text(signoff->signer.deployment));
  put(html, "<tr><th>public key (Ed25519)</th><td><code class=\"digest\">{}</code></td></tr>",
      esc(signoff->signer.public_key));
  put(html,
      "<tr><th>report checksum (SHA-256)</th><td><code class=\"digest\">{}</code></td></tr>"
      "</table><p class=\"small muted\">The signature is <code>report.sig</code>, an Ed25519 "
      "signature over <code>report.manifest.json</code>, which lists the SHA-256 of report.json, "
      "report.md and report.html (this file) and the checksum of report.json ({}). Check all of "
      "it with <code>kvaudit verify-report DIR --public-key KEY</code>, KEY the signer's public "
      "key.</p></section>\n",
      esc(signoff->digest.value), esc(signoff->digest.covers));
}

// Without --signoff: report.json's checksum, called what it is (no signature: nobody vouches for
// it).
void checksum_section(Html& html, const std::optional<ReportDigest>& checksum) {
  if (!checksum) return;
  put(html,
      "<section id=\"checksum\"><h2>Checksum</h2><table><tr><th>report checksum (SHA-256)</th>"
      "<td><code class=\"digest\">{}</code></td></tr></table><p class=\"small muted\">This "
      "report is not signed (made without <code>--signoff</code>). report.json states the "
      "checksum above ({}). It is a checksum, not a signature: it detects a report.json changed "
      "by accident, but anyone who edits the report can compute it again. Recompute it with "
      "<code>kvaudit verify-report DIR</code>.</p></section>\n",
      esc(checksum->value), esc(checksum->covers));
}

std::string badge(LineState state) {
  switch (state) {
    case LineState::kPass:
      return "<span class=\"badge PASS\">PASS</span>";
    case LineState::kFail:
      return "<span class=\"badge FAIL\">FAIL</span>";
    case LineState::kReportOnly:
      return "<span class=\"badge REPORT-ONLY\">OVER (report-only)</span>";
    case LineState::kUnmeasured:
      return "<span class=\"badge NOT-MEASURED\">NOT MEASURED</span>";
    case LineState::kInfo:
      return "<span class=\"badge\">INFO</span>";
  }
  return "";
}

void summary_section(Html& html, const CheckRun& run) {
  put(html, "<section id=\"summary\"><h2>Summary</h2><ul class=\"summary\">");
  for (const SummaryLine& line : summary_lines(run)) {
    put(html, "<li>{}{}</li>", badge(line.state), esc(line.text));
  }
  put(html, "</ul></section>\n");
}

void failures_section(Html& html, const CheckRun& run) {
  const std::vector<FailureItem> items = failure_items(run);
  if (items.empty()) return;
  put(html, "<section id=\"failures\"><h2>Failures and their likely cause</h2>");
  for (const FailureItem& item : items) {
    put(html, "<div class=\"failure{}\"><h3>{}{}</h3><ul>", item.sets_exit ? "" : " report-only",
        esc(item.title), item.sets_exit ? "" : " (report-only)");
    for (const std::string& detail : item.details) put(html, "<li>{}</li>", esc(detail));
    put(html, "</ul>");
    if (!item.likely_cause.empty()) {
      put(html, "<p class=\"cause\"><strong>Likely cause:</strong> {}</p>", esc(item.likely_cause));
    }
    put(html, "</div>");
  }
  put(html, "</section>\n");
}

// A table of an array of objects (json_layout.hpp).
void json_table(Html& html, const JsonTable& table, const char* css_class) {
  put(html, "<table class=\"{}\"><tr>", css_class);
  for (const std::string& column : table.columns) put(html, "<th>{}</th>", esc(column));
  put(html, "</tr>");
  for (const std::vector<std::string>& row : table.rows) {
    put(html, "<tr>");
    for (const std::string& text : row) put(html, "<td>{}</td>", esc(text));
    put(html, "</tr>");
  }
  put(html, "</table>");
}

// The convention-mismatch diagnosis and the server's pool cost (diagnosis_report.hpp), shown when
// the run has either.
void diagnosis_section(Html& html, const CheckRun& run) {
  const std::optional<std::string> pool_cost = captured_pool_cost_text(run);
  if (run.diagnosis.empty() && !pool_cost) return;
  put(html, "<section id=\"diagnosis\"><h2>Diagnosis</h2>");
  if (!run.diagnosis.empty()) {
    put(html,
        "<p>{}</p><table><tr><th>step</th><th>layer</th><th>comparison</th><th>finding</th>"
        "<th>error before &rarr; after</th></tr>",
        esc(kDiagnosisIntroduction));
    for (const DiagnosisRow& row : diagnosis_rows(run)) {
      put(html, "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>", row.step,
          row.layer_id, esc(row.comparison), esc(row.finding), esc(row.error_change));
    }
    put(html, "</table>");
  }
  if (pool_cost) put(html, "<p>The server's pool: {}.</p>", esc(*pool_cost));
  put(html, "</section>\n");
}

// ---- charts ------------------------------------------------------------------------------------

std::string gap_tooltip(const CheckRun& run, int step, int layer, Comparison comparison) {
  for (const StepLayerCoverage& site : run.coverage) {
    if (site.step != step || site.layer_id != layer) continue;
    if (site.tokens_without_source > 0 &&
        (comparison == Comparison::kQuantization || comparison == Comparison::kTotal)) {
      return fmt::format(
          "step {} layer {} {}: not measured ({} of {} tokens read have no source "
          "value)",
          step, layer, comparison_name(comparison), site.tokens_without_source, site.tokens_read);
    }
  }
  return fmt::format("step {} layer {} {}: not measured", step, layer, comparison_name(comparison));
}

Heatmap heatmap_of(const CheckRun& run, Comparison comparison,
                   const std::map<Site, const ComparisonResult*>& sites) {
  Heatmap map;
  map.title = comparison_title(comparison);
  map.id = comparison_name(comparison);
  map.limit = rel_l2_limit(run, comparison);
  const std::vector<int> layers = run_layers(run);
  const std::vector<int> steps = run_steps(run);
  for (const int layer : layers) map.row_labels.push_back(fmt::format("L{}", layer));
  for (const int step : steps) map.column_labels.push_back(std::to_string(step));
  for (const int layer : layers) {
    std::vector<HeatCell> row;
    for (const int step : steps) {
      const auto it = sites.find({step, layer, comparison});
      HeatCell cell;
      if (it == sites.end()) {
        cell.tooltip = gap_tooltip(run, step, layer, comparison);
      } else {
        const ComparisonResult& r = *it->second;
        cell = {true, r.metrics.rel_l2, !r.judgement.pass, result_tooltip(run, r)};
      }
      row.push_back(std::move(cell));
    }
    map.cells.push_back(std::move(row));
  }
  return map;
}

void heatmap_section(Html& html, const CheckRun& run) {
  const auto sites = results_by_site(run);
  put(html,
      "<section id=\"heatmaps\"><h2>Error by layer and step</h2><p class=\"small muted\">rel_l2 "
      "of each (layer, step). Blue: below the limit, in proportion to the share of the limit "
      "used (palest near 0, half depth at half the limit, deepest just under it), so the paler "
      "the cell the more headroom; red with a black outline: at or over the limit; white: "
      "exactly 0; hatched grey: not measured. Hover a cell for its numbers.</p><div "
      "class=\"charts\">");
  for (const Comparison comparison : heatmap_comparisons()) {
    put(html, "{}", heatmap_svg(heatmap_of(run, comparison, sites)));
  }
  put(html, "</div></section>\n");
}

struct SeriesStyle {
  Comparison comparison;
  const char* colour;
  int shape;
};
constexpr SeriesStyle kSeriesStyles[] = {
    {Comparison::kKernel, "#0969da", 0}, {Comparison::kQuantization, "#bc4c00", 1},
    {Comparison::kTotal, "#8250df", 2},  {Comparison::kCaptured, "#1a7f37", 3},
    {Comparison::kCache, "#cf222e", 0},
};

std::vector<LimitLine> limit_lines(const CheckRun& run, const std::set<Comparison>& drawn) {
  std::vector<LimitLine> lines;
  for (const SeriesStyle& style : kSeriesStyles) {
    const std::optional<double> limit = rel_l2_limit(run, style.comparison);
    if (!drawn.count(style.comparison) || !limit || *limit <= 0) continue;
    lines.push_back(
        {fmt::format("{} limit {}", comparison_name(style.comparison), short_number(*limit)),
         *limit, style.colour});
  }
  return lines;
}

void layer_chart_section(Html& html, const CheckRun& run) {
  const auto extents = layer_extents(run);
  LogChart chart;
  chart.title = "Worst rel_l2 per layer, over its steps, with the policy's limits";
  chart.id = "layers";
  chart.y_label = "rel_l2 (log)";
  for (const auto& [layer, per] : extents) chart.x_labels.push_back(fmt::format("L{}", layer));
  std::set<Comparison> drawn;
  for (const SeriesStyle& style : kSeriesStyles) {
    if (style.comparison == Comparison::kCache) continue;  // 0 while intact: the heatmap shows it
    Series series{comparison_name(style.comparison), style.colour, style.shape, {}, {}};
    for (const auto& [layer, per] : extents) {
      const auto it = per.find(style.comparison);
      series.values.push_back(it == per.end() ? std::nullopt
                                              : std::optional<double>(it->second.rel_l2));
      series.tooltips.push_back(
          it == per.end() ? ""
                          : fmt::format("layer {} {}: worst rel_l2 {} at step {}", layer,
                                        comparison_name(style.comparison),
                                        short_number(it->second.rel_l2), it->second.step));
    }
    if (std::any_of(series.values.begin(), series.values.end(), [](auto v) { return v; })) {
      drawn.insert(style.comparison);
      chart.series.push_back(std::move(series));
    }
  }
  chart.limits = limit_lines(run, drawn);
  put(html, "<section id=\"per-layer\"><h2>Error per layer</h2>{}</section>\n",
      log_chart_svg(chart));
}

// The served scale against the recommended one: per layer, FP8-storage error against the
// candidate scales (the error-versus-scale curve), the served and recommended scales marked.
// Layers: every one up to 16, past that the failing ones (a 78-layer run stays readable).
void scales_section(Html& html, const CheckRun& run) {
  if (run.scales.empty()) return;
  constexpr std::size_t kChartEveryLayerUpTo = 16;
  put(html,
      "<section id=\"scales\"><h2>Scales: error versus kv_scale</h2><p class=\"small muted\">"
      "FP8-storage error alone (out rel_l2 of attention on the source quantized with the scale, "
      "against the source) for each scale measured. One scale serves K and V (MLA caches one "
      "tensor: k_scale = v_scale). A served scale fails above the quantization limit or {}x the "
      "recommended scale's error.</p>\n",
      short_number(run.policy.scale_error_factor));
  for (const ScaleFailure& failure : scale_failures(run)) {
    put(html, "<p class=\"fail\">{}</p>\n", esc(failure.sentence));
  }
  const std::optional<double> limit = run.policy.quantization.rel_l2;
  for (const LayerScaleCheck& layer : run.scales) {
    const bool fails = judge_served_scale(run.policy, layer).has_value();
    if (run.scales.size() > kChartEveryLayerUpTo && !fails) continue;
    LogChart chart;
    chart.title = fmt::format("layer {}: out rel_l2 against kv_scale", layer.layer_id);
    chart.id = fmt::format("scale-L{}", layer.layer_id);
    chart.y_label = "rel_l2 (log)";
    Series curve{"every scale measured", "#1f77b4", 0, {}, {}};
    Series served{"served (the dump's kv_scale)", "#d62728", 1, {}, {}};
    Series recommended{"recommended", "#2ca02c", 2, {}, {}};
    for (const ScalePoint& point : layer.curve) {
      chart.x_labels.push_back(short_number(point.scale));
      curve.values.push_back(point.rel_l2);
      curve.tooltips.push_back(fmt::format("kv_scale {}: rel_l2 {}, {}% saturated",
                                           short_number(point.scale), short_number(point.rel_l2),
                                           short_number(100.0 * point.saturated_fraction)));
      const auto mark = [&](Series& series, double scale, const char* what) {
        const bool here = point.scale == scale;
        series.values.push_back(here ? std::optional<double>(point.rel_l2) : std::nullopt);
        series.tooltips.push_back(here ? fmt::format("{} kv_scale {}", what, short_number(scale))
                                       : "");
      };
      mark(served, layer.served_scale, "served");
      mark(recommended, layer.recommended_scale, "recommended");
    }
    chart.join = true;
    chart.series = {curve, served, recommended};
    if (limit && *limit > 0) {
      chart.limits.push_back(
          {fmt::format("quantization limit {}", short_number(*limit)), *limit, "#d62728"});
    }
    put(html, "{}\n", log_chart_svg(chart));
  }
  put(html, "</section>\n");
}

// Whether step i of the dump is a prefill (dump summary "steps"[i].kind).
std::vector<bool> prefill_steps(const CheckRun& run, const std::vector<int>& steps) {
  std::vector<bool> shaded;
  const nlohmann::json& list = run.dump_summary.is_object() && run.dump_summary.contains("steps")
                                   ? run.dump_summary.at("steps")
                                   : nlohmann::json();
  for (const int step : steps) {
    const bool prefill = list.is_array() && step >= 0 && step < static_cast<int>(list.size()) &&
                         list[step].is_object() && list[step].value("kind", "") == "prefill";
    shaded.push_back(prefill);
  }
  return shaded;
}

void step_chart_section(Html& html, const CheckRun& run,
                        const std::vector<StepSummary>& summaries) {
  LogChart chart;
  chart.title = "Worst rel_l2 over the layers, step by step";
  chart.id = "steps";
  chart.y_label = "rel_l2 (log)";
  chart.join = true;
  std::vector<int> steps;
  for (const StepSummary& s : summaries) {
    steps.push_back(s.step);
    chart.x_labels.push_back(std::to_string(s.step));
  }
  chart.shaded = prefill_steps(run, steps);
  chart.shaded_legend = "prefill step";
  std::set<Comparison> drawn;
  for (const SeriesStyle& style : kSeriesStyles) {
    Series series{comparison_name(style.comparison), style.colour, style.shape, {}, {}};
    bool nonzero = false;
    for (const StepSummary& s : summaries) {
      const auto it = s.worst.find(style.comparison);
      series.values.push_back(it == s.worst.end() ? std::nullopt
                                                  : std::optional<double>(it->second.rel_l2));
      nonzero = nonzero || (it != s.worst.end() && it->second.rel_l2 != 0.0);
      series.tooltips.push_back(
          it == s.worst.end() ? ""
                              : fmt::format("step {} {}: worst rel_l2 {} in layer {}", s.step,
                                            comparison_name(style.comparison),
                                            short_number(it->second.rel_l2), it->second.layer_id));
    }
    // A cache error of 0 at every step (an intact cache) has no place on a log axis.
    if (!nonzero && style.comparison == Comparison::kCache) continue;
    if (std::any_of(series.values.begin(), series.values.end(), [](auto v) { return v; })) {
      drawn.insert(style.comparison);
      chart.series.push_back(std::move(series));
    }
  }
  chart.limits = limit_lines(run, drawn);
  put(html,
      "<section id=\"across-steps\"><h2>Error across steps</h2><p class=\"small muted\">Does "
      "error grow after a prefill (shaded) or as the cache fills? A hollow marker at the bottom "
      "is an error of exactly 0.</p>{}</section>\n",
      log_chart_svg(chart));
}

// ---- integrity timeline ------------------------------------------------------------------------

struct PoolCell {
  bool checked = false;
  bool damaged = false;
  bool carried = false;
  std::int64_t slots = 0;
  std::vector<std::string> failing;
};

TimelineCell timeline_cell(const PoolCell& p, int step, const std::string& row) {
  TimelineCell cell;
  if (!p.checked) {
    cell.tooltip = fmt::format("{} step {}: not checked", row, step);
    return cell;
  }
  if (!p.damaged) {
    cell.state = TimelineState::kIntact;
    cell.tooltip = fmt::format("{} step {}: intact", row, step);
    return cell;
  }
  cell.state = p.carried ? TimelineState::kDamagedCarried : TimelineState::kDamagedNew;
  cell.label = p.slots > 0 ? grouped(p.slots) : "!";
  cell.tooltip = fmt::format("{} step {}: {}", row, step, fmt::join(p.failing, "; "));
  return cell;
}

Timeline integrity_timeline(const CheckRun& run) {
  std::map<std::pair<int, int>, PoolCell> backend;   // (layer, step)
  std::map<std::pair<int, int>, PoolCell> captured;  // (layer, step)
  std::set<int> captured_layers;
  for (const IntegrityFinding& f : run.integrity) {
    if (f.check == IntegrityCheck::kNanCodesInPool || is_indexer_check(f.check)) continue;
    const bool is_captured = f.check == IntegrityCheck::kCapturedPool;
    if (is_captured) captured_layers.insert(f.layer_id);
    PoolCell& cell = (is_captured ? captured : backend)[{f.layer_id, f.step}];
    cell.checked = true;
    if (f.pass) continue;
    cell.damaged = true;
    cell.carried = cell.carried || (is_captured && f.carried_from_step >= 0);
    cell.slots += f.slot_count;
    cell.failing.push_back(f.detail);
  }
  Timeline timeline;
  timeline.title = "Cache integrity after each step (slots damaged in the cell)";
  const std::vector<int> steps = run_steps(run);
  for (const int step : steps) timeline.column_labels.push_back(std::to_string(step));
  auto add_row = [&](const std::string& label, int layer,
                     const std::map<std::pair<int, int>, PoolCell>& cells) {
    timeline.row_labels.push_back(label);
    std::vector<TimelineCell> row;
    for (const int step : steps) {
      const auto it = cells.find({layer, step});
      row.push_back(timeline_cell(it == cells.end() ? PoolCell{} : it->second, step, label));
    }
    timeline.cells.push_back(std::move(row));
  };
  for (const int layer : run_layers(run)) {
    if (!backend.empty()) add_row(fmt::format("L{} backend pool", layer), layer, backend);
    if (captured_layers.count(layer)) {
      add_row(fmt::format("L{} captured pool", layer), layer, captured);
    }
  }
  return timeline;
}

void integrity_section(Html& html, const CheckRun& run, const RunCounts& counts) {
  put(html, "<section id=\"integrity\"><h2>Cache integrity</h2>");
  if (counts.integrity_checks == 0) {
    put(html, "<p>No integrity checks ran (no backend pool and no captured pool).</p></section>\n");
    return;
  }
  put(html, "<p>{} checks, {} failed (passing checks are counted, not listed).</p>",
      counts.integrity_checks, counts.integrity_failed);
  put(html, "{}", timeline_svg(integrity_timeline(run)));
  if (counts.integrity_failed > 0) {
    put(html,
        "<table><tr><th>step</th><th>layer</th><th>check</th><th>class</th><th>slots</th>"
        "<th>carried from</th><th>detail</th></tr>");
    for (const IntegrityFinding& f : run.integrity) {
      if (f.pass) continue;
      put(html,
          "<tr><td class=\"num\">{}</td><td class=\"num\">{}</td><td>{}</td><td>{}</td>"
          "<td class=\"num\">{}</td><td>{}</td><td>{}</td></tr>",
          f.step, f.layer_id, integrity_check_name(f.check), slot_class_name(f.classification),
          grouped(f.slot_count),
          f.carried_from_step >= 0 ? std::to_string(f.carried_from_step) : "-", esc(f.detail));
    }
    put(html, "</table>");
  }
  put(html, "</section>\n");
}

// ---- tables ------------------------------------------------------------------------------------

// rel_l2 against its limit (failing first): what to look at first.
double severity(const CheckRun& run, const ComparisonResult& r) {
  const double failing = fails_run(r) ? 2e9 : (!r.judgement.pass ? 1e9 : 0.0);
  const std::optional<double> limit = rel_l2_limit(run, r.comparison);
  const double ratio = limit && *limit > 0 ? r.metrics.rel_l2 / *limit : r.metrics.rel_l2;
  return failing + (std::isnan(ratio) ? 1e8 : std::min(ratio, 1e8));
}

void worst_section(Html& html, const CheckRun& run) {
  constexpr std::size_t kShown = 12;
  std::vector<const ComparisonResult*> ranked;
  for (const ComparisonResult& r : run.comparisons) ranked.push_back(&r);
  std::stable_sort(ranked.begin(), ranked.end(), [&run](const auto* a, const auto* b) {
    return severity(run, *a) > severity(run, *b);
  });
  put(html,
      "<section id=\"worst\"><h2>Worst elements</h2><p class=\"small muted\">The (step, layer, "
      "comparison) results nearest to or over their limit, each with its worst element: the "
      "first NaN/Inf mismatch, else the element of max_abs.</p><table><tr><th>step</th>"
      "<th>layer</th><th>comparison</th><th>rel_l2</th><th>limit</th><th>max_abs</th>"
      "<th>(row,head,dim)</th><th>request</th><th>reference</th><th>candidate</th>"
      "<th>result</th></tr>");
  for (std::size_t i = 0; i < ranked.size() && i < kShown; ++i) {
    const ComparisonResult& r = *ranked[i];
    const ElementLocation& at = worst_location(r);
    const std::optional<double> limit = rel_l2_limit(run, r.comparison);
    put(html,
        "<tr><td class=\"num\">{}</td><td class=\"num\">{}</td><td>{}</td><td class=\"num\">{}"
        "</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td>{}</td><td class=\"num\">{}"
        "</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td>{}</td></tr>",
        r.step, r.layer_id, comparison_name(r.comparison), short_number(r.metrics.rel_l2),
        limit ? short_number(*limit) : "-", short_number(r.metrics.max_abs), location_text(at),
        r.worst_request, short_number(at.reference), short_number(at.candidate), result_text(r));
  }
  put(html, "</table></section>\n");
}

void dump_section(Html& html, const CheckRun& run) {
  put(html, "<section id=\"dump\"><h2>The dump</h2><table>");
  put(html, "<tr><th>path</th><td><code>{}</code></td></tr>", esc(run.dump_path));
  put(html, "<tr><th>SHA-256</th><td><code>{}</code></td></tr>",
      esc(run.dump_sha256.empty() ? "not computed" : run.dump_sha256));
  const JsonObjectLayout layout = json_object_layout(run.dump_summary, JsonListings::kAsTables);
  for (const auto& [key, text] : layout.fields) {
    put(html, "<tr><th>{}</th><td>{}</td></tr>", esc(key), esc(text));
  }
  put(html, "</table>");
  for (const JsonTable& table : layout.tables) {
    put(html, "<h3>{}</h3>", esc(table.name));
    json_table(html, table, "dump-listing");
  }
  put(html, "</section>\n");
}

void policy_table(Html& html, const Policy& policy) {
  put(html,
      "<h3>Policy <code>{}</code></h3><table><tr><th>comparison</th><th>metric</th><th>limit</th>"
      "<th>sets exit</th><th>derivation</th></tr>",
      esc(policy.name));
  for (const Comparison comparison : all_comparisons()) {
    const ComparisonLimits& limits = limits_for(policy, comparison);
    for (const Limit limit : all_limits()) {
      const std::optional<double> value = limit_value(limits, limit);
      if (!value) continue;  // not judged: nothing to state
      const auto derivation = limits.derivations.find(limit);
      put(html, "<tr><td>{}</td><td>{}</td><td class=\"num\">{}</td><td>{}</td><td>{}</td></tr>",
          comparison_name(comparison), limit_name(limit), short_number(*value),
          comparison_sets_exit(policy, comparison) ? "yes" : "no",
          esc(derivation == limits.derivations.end() ? "" : derivation->second));
    }
  }
  put(html, "</table><p class=\"small muted\">rel_floor {} - {}</p>",
      short_number(policy.rel_floor), esc(policy.rel_floor_derivation));
}

void provenance_section(Html& html, const ReportModel& model) {
  const CheckRun& run = model.run;
  const Provenance& p = run.provenance;  // completed by make_report_model
  put(html, "<section id=\"provenance\"><h2>Provenance</h2><table>");
  const std::pair<const char*, std::string> rows[] = {
      {"dump", run.dump_path},
      {"dump SHA-256", run.dump_sha256.empty() ? "not computed" : run.dump_sha256},
      {"kvaudit version", p.kvaudit_version},
      {"git revision", p.git_revision},
      {"backend", backend_machine_text(run)},
      {"CPU", p.cpu},
      {"host", p.host},
      {"date (UTC)", p.date_utc},
      {"command line", p.command_line},
  };
  for (const auto& [key, value] : rows) {
    put(html, "<tr><th>{}</th><td class=\"mono\">{}</td></tr>", key, esc(value));
  }
  put(html, "</table>");
  if (!run.certification.empty()) {
    const CertificationMaxima& maxima = model.certification_maxima;
    put(html,
        "<p>Reference certified on this run: at {} sample sites R8 of one (row, head) recomputed "
        "in 50 digits; largest deviation {} (out, relative) and {} (lse, absolute), bound "
        "{}.</p>",
        run.certification.size(), esc(short_number(maxima.out_relative)),
        esc(short_number(maxima.lse_absolute)), esc(short_number(kReferenceBound)));
  }
  if (!p.merged_from.empty()) {
    put(html,
        "<h3>Merged from</h3><p>This run is <code>kvaudit merge</code> of {} parts; timing is "
        "summed over them.</p><table><tr><th>shard</th><th>part file</th><th>host</th>"
        "<th>date</th><th>command line</th></tr>",
        p.merged_from.size());
    for (const MergedPart& part : p.merged_from) {
      put(html,
          "<tr><td>{}</td><td class=\"mono\">{}</td><td>{}</td><td>{}</td>"
          "<td class=\"mono\">{}</td></tr>",
          esc(part.shard), esc(part.file), esc(part.host), esc(part.date_utc),
          esc(part.command_line));
    }
    put(html, "</table>");
  }
  const JsonObjectLayout backend =
      json_object_layout(run.backend_description, JsonListings::kAsFields);
  if (!backend.fields.empty()) {
    put(html, "<h3>Backend description</h3><table>");
    for (const auto& [key, text] : backend.fields) {
      put(html, "<tr><th>{}</th><td class=\"mono\">{}</td></tr>", esc(key), esc(text));
    }
    put(html, "</table>");
  }
  policy_table(html, run.policy);
  put(html,
      "<p class=\"small muted\">Timing: reference ({}) {} s, backend {} s, total {} s. "
      "report.json beside this page holds every number (docs/report-schema.md).</p></section>\n",
      esc(run.reference_device), short_number(run.reference_seconds),
      short_number(run.backend_seconds), short_number(run.total_seconds));
}

void notes_section(Html& html, const CheckRun& run) {
  if (run.notes.empty()) return;
  put(html, "<section id=\"notes\"><h2>Notes</h2><ul>");
  for (const std::string& note : run.notes) put(html, "<li>{}</li>", esc(note));
  put(html, "</ul></section>\n");
}

}  // namespace

const std::vector<Comparison>& heatmap_comparisons() {
  static const std::vector<Comparison> kShown = {Comparison::kKernel, Comparison::kCache,
                                                 Comparison::kQuantization, Comparison::kTotal};
  return kShown;
}

std::string render_html(const CheckRun& run) { return render_html(make_report_model(run)); }

std::string render_html(const ReportModel& model) {
  const CheckRun& run = model.run;
  Html html;
  put(html,
      "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><meta name=\"viewport\" "
      "content=\"width=device-width, initial-scale=1\"><title>kvaudit {}: {} on {}</title>"
      "<style>{}</style></head><body><main>\n",
      model.pass ? "PASS" : "FAIL", esc(backend_text(run)), esc(run.dump_path), kStyle);
  verdict_header(html, model);
  signoff_block(html, model.signoff);
  summary_section(html, run);
  failures_section(html, run);
  diagnosis_section(html, run);
  heatmap_section(html, run);
  layer_chart_section(html, run);
  scales_section(html, run);
  step_chart_section(html, run, model.steps);
  integrity_section(html, run, model.counts);
  worst_section(html, run);
  notes_section(html, run);
  dump_section(html, run);
  provenance_section(html, model);
  checksum_section(html, model.checksum);
  put(html, "</main></body></html>\n");
  return fmt::to_string(html);
}

}  // namespace kvaudit
