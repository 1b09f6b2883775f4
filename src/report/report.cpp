// Check-run reports: the stdout table, report.json and report.md (docs/report-schema.md,
// reports/README.md), all from the typed run. Numbers are printed with 3-4 significant digits:
// every limit is a power of two stated with its derivation, so more digits would only suggest a
// precision the policy does not have.
#include "src/report/report.hpp"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <fstream>
#include <iterator>
#include <map>
#include <ostream>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "src/report/diagnosis_report.hpp"

namespace kvaudit {
namespace {

// ---- numbers and cells, shared by stdout and Markdown ------------------------------------------

std::string non_finite_text(double value) {
  if (std::isnan(value)) return "nan";
  return value > 0 ? "inf" : "-inf";
}

std::string sci(double value) {  // fixed width for the stdout table
  return std::isfinite(value) ? fmt::format("{:.3e}", value) : non_finite_text(value);
}

std::string short_number(double value) {  // for Markdown
  return std::isfinite(value) ? fmt::format("{:.4g}", value) : non_finite_text(value);
}

std::string ulp_text(double ulps) {  // a count: no exponent
  return std::isfinite(ulps) ? fmt::format("{:.0f}", ulps) : sci(ulps);
}

std::string location_text(const ElementLocation& at) {
  if (at.row < 0) return "-";
  const std::string dim = at.dim >= 0 ? std::to_string(at.dim) : "lse";
  return fmt::format("({},{},{})", at.row, at.head, dim);
}

std::string result_text(const ComparisonResult& result) {
  const bool counts = fails_run(result) || result.sets_exit;
  const char* verdict = result.judgement.pass ? "PASS" : "FAIL";
  return counts ? verdict : fmt::format("{} report-only", verdict);
}

const char* backend_text(const CheckRun& run) {
  return run.backend.empty() ? "none" : run.backend.c_str();
}

std::string pool_text(PoolState state, std::int64_t slots, const char* unit) {
  if (state == PoolState::kNotChecked) return "-";
  if (state == PoolState::kIntact) return "intact";
  if (slots == 0) return "damaged";  // e.g. storage changed: no slot-level count
  return fmt::format("damaged ({} {})", slots, unit);
}

std::string captured_text(const StepSummary& summary) {
  if (summary.captured_pool != PoolState::kDamaged) {
    return pool_text(summary.captured_pool, 0, "");
  }
  if (summary.carried_captured_slots == 0) {
    return fmt::format("damaged ({} new)", summary.new_captured_slots);
  }
  return fmt::format("damaged ({} new, {} carried)", summary.new_captured_slots,
                     summary.carried_captured_slots);
}

// ---- stdout ------------------------------------------------------------------------------------

// Text columns left-aligned, numbers right-aligned.
void print_table_row(std::ostream& out, const std::array<std::string, 11>& f) {
  fmt::print(out, "{:>5} {:>6} {:<13} {:>10} {:>10} {:>10} {:>8} {:>10} {:>8} {:<17} {}\n", f[0],
             f[1], f[2], f[3], f[4], f[5], f[6], f[7], f[8], f[9], f[10]);
}

std::string worst_text(const StepSummary& summary, Comparison comparison) {
  const auto it = summary.worst.find(comparison);
  if (it == summary.worst.end()) return "-";
  return fmt::format("{} L{}{}", sci(it->second.rel_l2), it->second.layer_id,
                     it->second.nonfinite_mismatches > 0 ? " nan/inf" : "");
}

// ---- Markdown ----------------------------------------------------------------------------------

using Markdown = fmt::memory_buffer;

template <typename... Args>
void append(Markdown& md, fmt::format_string<Args...> format, Args&&... args) {
  fmt::format_to(std::back_inserter(md), format, std::forward<Args>(args)...);
}

// A table cell: pipes escaped, line breaks folded into spaces.
std::string cell(const std::string& text) {
  std::string escaped;
  for (const char c : text) {
    if (c == '|') {
      escaped += "\\|";
    } else if (c == '\n' || c == '\r') {
      escaped += ' ';
    } else {
      escaped += c;
    }
  }
  return escaped;
}

std::string code(const std::string& text) { return fmt::format("`{}`", cell(text)); }

std::string json_value_text(const nlohmann::json& value) {
  if (value.is_string()) return value.get<std::string>();
  return value.dump();
}

void key_value_table(Markdown& md, const nlohmann::json& object) {
  if (!object.is_object() || object.empty()) {
    append(md, "(none recorded)\n\n");
    return;
  }
  append(md, "| key | value |\n| --- | --- |\n");
  for (const auto& [key, value] : object.items()) {
    append(md, "| {} | {} |\n", cell(key), cell(json_value_text(value)));
  }
  append(md, "\n");
}

bool is_array_of_objects(const nlohmann::json& value) {
  return value.is_array() && !value.empty() &&
         std::all_of(value.begin(), value.end(),
                     [](const nlohmann::json& item) { return item.is_object(); });
}

// One row per object, one column per key (in first-seen order).
void array_table(Markdown& md, const nlohmann::json& array) {
  std::vector<std::string> columns;
  for (const nlohmann::json& item : array) {
    for (const auto& [key, value] : item.items()) {
      if (std::find(columns.begin(), columns.end(), key) == columns.end()) columns.push_back(key);
    }
  }
  append(md, "|");
  for (const std::string& column : columns) append(md, " {} |", cell(column));
  append(md, "\n|");
  for (std::size_t i = 0; i < columns.size(); ++i) append(md, " --- |");
  append(md, "\n");
  for (const nlohmann::json& item : array) {
    append(md, "|");
    for (const std::string& column : columns) {
      append(md, " {} |", item.contains(column) ? cell(json_value_text(item[column])) : "");
    }
    append(md, "\n");
  }
  append(md, "\n");
}

void verdict_section(Markdown& md, const CheckRun& run) {
  const RunCounts counts = count_results(run);
  append(md, "# kvaudit check report\n\n");
  append(md, "**Verdict: {}** — policy {}, backend {}: {} comparisons, {} failed",
         run.pass() ? "PASS" : "FAIL", code(run.policy.name), code(backend_text(run)),
         counts.comparisons, counts.failed);
  if (counts.failed_report_only > 0) {
    append(md, " (and {} failed report-only)", counts.failed_report_only);
  }
  append(md, "; {} integrity checks, {} failed.\n\n", counts.integrity_checks,
         counts.integrity_failed);
  if (!run.first_divergence) return;
  // Its fields in report.json's (alphabetical) key order.
  const Divergence& d = *run.first_divergence;
  append(md,
         "First divergence: comparison {} head {} layer_id {} reason {} request {} row {} step {} "
         "\n\n",
         code(comparison_name(d.comparison)), code(std::to_string(d.head)),
         code(std::to_string(d.layer_id)), code(d.reason), code(std::to_string(d.request)),
         code(std::to_string(d.row)), code(std::to_string(d.step)));
}

void dump_section(Markdown& md, const CheckRun& run) {
  append(md, "## Dump\n\n| key | value |\n| --- | --- |\n");
  append(md, "| path | {} |\n", code(run.dump_path));
  append(md, "| SHA-256 | {} |\n",
         code(run.dump_sha256.empty() ? "not computed" : run.dump_sha256));
  // Scalars go in the table; arrays of objects (layers, steps) get a table of their own.
  std::vector<std::pair<std::string, const nlohmann::json*>> listings;
  if (run.dump_summary.is_object()) {
    for (const auto& [key, value] : run.dump_summary.items()) {
      if (is_array_of_objects(value)) {
        listings.emplace_back(key, &value);
      } else {
        append(md, "| {} | {} |\n", cell(key), cell(json_value_text(value)));
      }
    }
  }
  append(md, "\n");
  for (const auto& [key, value] : listings) {
    append(md, "### {}\n\n", cell(key));
    array_table(md, *value);
  }
}

void backend_section(Markdown& md, const CheckRun& run) {
  append(md, "## Backend\n\nBackend {}.\n\n", code(backend_text(run)));
  key_value_table(md, run.backend_description);
}

void policy_section(Markdown& md, const Policy& policy) {
  append(md, "## Policy\n\n");
  append(md,
         "Policy {}. NaN/Inf mismatches fail every comparison and always set the exit status; "
         "then each limit below is checked. Quantization and total {}\n\n",
         code(policy.name),
         policy.quantization_sets_exit
             ? "**set** the exit status (sign-off)."
             : "are judged against the sign-off limits but are **report-only** (run with "
               "`--signoff` to make them count).");
  append(md, "max_rel denominator floor (reported, not judged): {} — {}\n\n",
         short_number(policy.rel_floor), cell(policy.rel_floor_derivation));
  append(md,
         "| comparison | metric | limit | sets exit | derivation |\n"
         "| --- | --- | --- | --- | --- |\n");
  for (const Comparison comparison : all_comparisons()) {
    const ComparisonLimits& limits = limits_for(policy, comparison);
    for (const Limit limit : all_limits()) {
      const std::optional<double> value = limit_value(limits, limit);
      const auto derivation = limits.derivations.find(limit);
      append(md, "| {} | {} | {} | {} | {} |\n", comparison_name(comparison), limit_name(limit),
             value ? short_number(*value) : "not judged",
             comparison_sets_exit(policy, comparison) ? "yes" : "no",
             cell(derivation == limits.derivations.end() ? "" : derivation->second));
    }
  }
  append(md, "\n");
}

void result_row(Markdown& md, const ComparisonResult& r) {
  const ComparisonMetrics& m = r.metrics;
  const char* emphasis = r.judgement.pass ? "" : "**";
  append(md, "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {}{}{} | {} | {} |\n", r.step,
         r.layer_id, comparison_name(r.comparison), short_number(m.max_abs),
         short_number(max_abs_over_ref_max(m)), short_number(m.rel_l2), short_number(m.cos_diff),
         ulp_text(m.max_ulp_bf16), m.has_lse ? short_number(m.lse_max_abs) : "-",
         m.nonfinite_mismatches, emphasis, result_text(r), emphasis,
         location_text(worst_location(r)),
         cell(fmt::format("{}", fmt::join(r.judgement.reasons, "; "))));
}

void results_section(Markdown& md, const CheckRun& run) {
  append(md, "## Results per step, layer and comparison\n\n");
  if (run.comparisons.empty()) {
    append(md, "No comparisons ran.\n\n");
    return;
  }
  append(md,
         "Kernel = backend vs R8 (exact attention on the dequantized FP8 pool the backend read); "
         "cache = R8 on the backend's pool vs R8 on the reference replay's pool (zero while the "
         "cache is intact); quantization = R8 vs Rs (exact attention on the source KV); total = "
         "backend vs Rs; captured = the dump's own out/lse vs R8. Worst = (row, head, dim) of the "
         "first NaN/Inf mismatch, else of max_abs.\n\n");
  append(md,
         "| step | layer | comparison | max_abs | max_abs/ref_max | rel_l2 | cos_diff | max_ulp | "
         "lse_err | NaN/Inf mismatches | result | worst (row,head,dim) | reasons |\n"
         "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | --- "
         "|\n");
  for (const ComparisonResult& r : run.comparisons) result_row(md, r);
  append(md, "\n");
}

// Per layer, the worst quantization / total / kernel figures over all steps: what FP8 storage
// costs in that layer, and what the kernel adds on top.
struct LayerWorst {
  double quant_rel_l2 = 0, quant_cos = 0, quant_over_max = 0, quant_lse = 0;
  double total_rel_l2 = 0, kernel_rel_l2 = 0;
  bool has_quant = false, has_total = false, has_kernel = false, pass = true;

  void add(const ComparisonResult& r) {
    const ComparisonMetrics& m = r.metrics;
    switch (r.comparison) {
      case Comparison::kQuantization:
        has_quant = true;
        quant_rel_l2 = worse(quant_rel_l2, m.rel_l2);
        quant_cos = worse(quant_cos, m.cos_diff);
        quant_over_max = worse(quant_over_max, max_abs_over_ref_max(m));
        if (m.has_lse) quant_lse = worse(quant_lse, m.lse_max_abs);
        pass = pass && r.judgement.pass;
        break;
      case Comparison::kTotal:
        has_total = true;
        total_rel_l2 = worse(total_rel_l2, m.rel_l2);
        pass = pass && r.judgement.pass;
        break;
      case Comparison::kKernel:
        has_kernel = true;
        kernel_rel_l2 = worse(kernel_rel_l2, m.rel_l2);
        break;
      case Comparison::kCaptured:
      case Comparison::kCache:
      case Comparison::kCapturedRead:
      case Comparison::kCapturedCache:
        break;
    }
  }

  // std::max(NaN, x) keeps the first argument; the comparison as written lets NaN win.
  static double worse(double current, double value) {
    return !(value <= current) ? value : current;
  }
};

void signoff_row(Markdown& md, int layer, const LayerWorst& w) {
  auto quant = [&w](double value) { return w.has_quant ? short_number(value) : "-"; };
  const std::string ratio = w.has_kernel && w.has_quant && w.quant_rel_l2 > 0
                                ? short_number(w.kernel_rel_l2 / w.quant_rel_l2)
                                : "-";
  append(md, "| {} | {} | {} | {} | {} | {} | {} | {} | {} |\n", layer, quant(w.quant_rel_l2),
         quant(w.quant_cos), quant(w.quant_over_max), quant(w.quant_lse),
         w.has_kernel ? short_number(w.kernel_rel_l2) : "-", ratio,
         w.has_total ? short_number(w.total_rel_l2) : "-", w.pass ? "PASS" : "**FAIL**");
}

void signoff_section(Markdown& md, const CheckRun& run) {
  append(md, "## Quantization sign-off per layer\n\n");
  std::map<int, LayerWorst> layers;
  for (const ComparisonResult& r : run.comparisons) layers[r.layer_id].add(r);
  const bool any_quant = std::any_of(layers.begin(), layers.end(),
                                     [](const auto& entry) { return entry.second.has_quant; });
  if (!any_quant) {
    append(md,
           "No quantization comparisons: the dump holds no `kv_source` covering the tokens the "
           "steps read, so R8 - Rs could not be measured.\n\n");
    return;
  }
  append(md,
         "Worst value over the steps of each layer. kernel/quant = kernel rel_l2 / quantization "
         "rel_l2: how much the kernel adds relative to what FP8 storage costs. Sign-off limits: "
         "see the policy ({}).\n\n",
         run.policy.quantization_sets_exit ? "they set the exit status" : "report-only here");
  append(md,
         "| layer | quant rel_l2 | quant cos_diff | quant max_abs/ref_max | quant lse_err | "
         "kernel rel_l2 | kernel/quant | total rel_l2 | sign-off |\n"
         "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n");
  for (const auto& [layer, w] : layers) {
    if (w.has_quant || w.has_total) signoff_row(md, layer, w);
  }
  append(md, "\n");
}

void step_row(Markdown& md, const StepSummary& s) {
  auto worst = [&s](Comparison comparison) {
    const auto it = s.worst.find(comparison);
    if (it == s.worst.end()) return std::string("-");
    return fmt::format("{} (L{})", short_number(it->second.rel_l2), it->second.layer_id);
  };
  auto nonfinite = [&s](Comparison comparison) {
    const auto it = s.worst.find(comparison);
    return it == s.worst.end() ? std::string("-") : std::to_string(it->second.nonfinite_mismatches);
  };
  append(md, "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} / {} | {} |\n", s.step, s.layers,
         pool_state_name(s.backend_pool), s.damaged_slots, captured_text(s),
         worst(Comparison::kKernel), worst(Comparison::kCache), worst(Comparison::kTotal),
         worst(Comparison::kQuantization), nonfinite(Comparison::kKernel),
         nonfinite(Comparison::kCache), s.pass ? "PASS" : "**FAIL**");
}

void steps_section(Markdown& md, const CheckRun& run) {
  const std::vector<StepSummary> steps = summarize_steps(run);
  if (steps.empty()) return;
  append(md, "## Across steps\n\n");
  append(md,
         "Per step, over the layers checked: whether the backend's pool and the captured pool "
         "are intact (damaged: how many slots differ from the reference replay's pool; captured "
         "damage new at this step or carried from an earlier one), and the worst rel_l2 of each "
         "comparison with its layer, so corruption shows as the step it starts at and the error "
         "that follows it.\n\n");
  append(md,
         "| step | layers | backend pool | damaged slots | captured pool | kernel rel_l2 | cache "
         "rel_l2 | total rel_l2 | quantization rel_l2 | NaN/Inf mismatches kernel / cache | "
         "result |\n"
         "| ---: | ---: | --- | ---: | --- | --- | --- | --- | --- | ---: | --- |\n");
  for (const StepSummary& s : steps) step_row(md, s);
  append(md, "\n");
}

void integrity_section(Markdown& md, const CheckRun& run) {
  append(md, "## Cache integrity\n\n");
  if (run.integrity.empty()) {
    append(md, "No integrity checks ran (no backend pool to check, or no step).\n\n");
    return;
  }
  const RunCounts counts = count_results(run);
  append(md, "{} checks, {} failed.\n\n", counts.integrity_checks, counts.integrity_failed);
  append(md,
         "| step | layer | check | result | classification | slots | message |\n"
         "| ---: | ---: | --- | --- | --- | --- | --- |\n");
  for (const IntegrityFinding& f : run.integrity) {
    append(md, "| {} | {} | {} | {} | {} | {} | {} |\n", f.step, f.layer_id,
           cell(integrity_check_name(f.check)), f.pass ? "PASS" : "**FAIL**",
           cell(slot_class_name(f.classification)),
           cell(fmt::format("{}", fmt::join(f.slots, ", "))), cell(f.detail));
  }
  append(md, "\n");
}

void notes_section(Markdown& md, const CheckRun& run) {
  if (run.notes.empty()) return;
  append(md, "## Notes\n\n");
  for (const std::string& note : run.notes) append(md, "- {}\n", note);
  append(md, "\n");
}

void timing_section(Markdown& md, const CheckRun& run) {
  append(md, "## Timing\n\n| quantity | value |\n| --- | --- |\n");
  append(md, "| reference (CPU, high precision) | {} s |\n", short_number(run.reference_seconds));
  if (run.reference_seconds > 0) {
    append(md, "| reference throughput | {} rows x heads x tokens / s |\n",
           short_number(run.reference_rows_heads_tokens / run.reference_seconds));
  }
  append(md, "| backend | {} s |\n", short_number(run.backend_seconds));
  if (run.diagnosis_seconds > 0) {
    append(md, "| diagnosis | {} s |\n", short_number(run.diagnosis_seconds));
  }
  append(md, "| total | {} s |\n\n", short_number(run.total_seconds));
}

void provenance_section(Markdown& md, const CheckRun& run) {
  // report.json's provenance keys, in its (alphabetical) order.
  const Provenance provenance = completed_provenance(run.provenance);
  append(md, "## Provenance\n\n| key | value |\n| --- | --- |\n");
  append(md, "| command_line | {} |\n", cell(provenance.command_line));
  append(md, "| date | {} |\n", cell(provenance.date_utc));
  append(md, "| host | {} |\n", cell(provenance.host));
  append(md, "| kvaudit_version | {} |\n\n", cell(provenance.kvaudit_version));
  append(md,
         "Produced by {}; report.json beside this file holds every number above "
         "(docs/report-schema.md).\n",
         code(fmt::format("kvaudit {}", kvaudit_version())));
}

}  // namespace

std::string verdict_summary(const CheckRun& run) {
  const RunCounts counts = count_results(run);
  const std::string report_only =
      counts.failed_report_only > 0
          ? fmt::format(", {} failed report-only", counts.failed_report_only)
          : "";
  return fmt::format(
      "verdict: {} (policy {}, backend {}, {} comparisons, {} failed{}, {} integrity checks, {} "
      "failed)",
      run.pass() ? "PASS" : "FAIL", run.policy.name, backend_text(run), counts.comparisons,
      counts.failed, report_only, counts.integrity_checks, counts.integrity_failed);
}

void print_comparison_table(std::ostream& out, const CheckRun& run) {
  print_table_row(out, {"step", "layer", "comparison", "max_abs", "rel_l2", "cos_diff", "max_ulp",
                        "lse_err", "nan/inf", "result", "worst (row,head,dim)"});
  for (const ComparisonResult& r : run.comparisons) {
    const ComparisonMetrics& m = r.metrics;
    print_table_row(
        out, {std::to_string(r.step), std::to_string(r.layer_id), comparison_name(r.comparison),
              sci(m.max_abs), sci(m.rel_l2), sci(m.cos_diff), ulp_text(m.max_ulp_bf16),
              m.has_lse ? sci(m.lse_max_abs) : "-", std::to_string(m.nonfinite_mismatches),
              result_text(r), location_text(worst_location(r))});
  }
  bool header_printed = false;
  for (const ComparisonResult& r : run.comparisons) {
    if (r.judgement.pass) continue;
    if (!header_printed) out << "failures:\n";
    header_printed = true;
    const std::string reasons =
        r.judgement.reasons.empty() ? "" : fmt::format(" {}", fmt::join(r.judgement.reasons, "; "));
    const std::string request =
        r.worst_request >= 0 ? fmt::format(" [request {}]", r.worst_request) : "";
    fmt::print(out, "  step {} layer {} {}{}:{}{}\n", r.step, r.layer_id,
               comparison_name(r.comparison), fails_run(r) ? "" : " (report-only)", reasons,
               request);
  }
}

void print_integrity_failures(std::ostream& out, const CheckRun& run) {
  bool header_printed = false;
  for (const IntegrityFinding& f : run.integrity) {
    if (f.pass) continue;
    if (!header_printed) out << "integrity failures:\n";
    header_printed = true;
    const std::string slot_class = f.classification == SlotClass::kNone
                                       ? ""
                                       : fmt::format(" [{}]", slot_class_name(f.classification));
    fmt::print(out, "  step {} layer {} {}{}: {}\n", f.step, f.layer_id,
               integrity_check_name(f.check), slot_class, f.detail);
  }
}

void print_pool_data(std::ostream& out, const CheckRun& run) {
  // Per layer, the first step and every step where the set of slots holding NaN codes changed.
  std::map<int, std::pair<std::int64_t, std::vector<std::int64_t>>> last_seen;
  bool header = false;
  for (const IntegrityFinding& f : run.integrity) {
    if (f.check != IntegrityCheck::kNanCodesInPool) continue;
    auto [it, first] = last_seen.try_emplace(f.layer_id, f.slot_count, f.slots);
    if (!first && it->second.first == f.slot_count && it->second.second == f.slots) continue;
    it->second = {f.slot_count, f.slots};
    if (!header) out << "pool data (NaN codes, where they change; every step in the report):\n";
    header = true;
    fmt::print(out, "  {}\n", f.detail);
  }
}

void print_step_summary(std::ostream& out, const CheckRun& run) {
  const std::vector<StepSummary> steps = summarize_steps(run);
  if (steps.empty()) return;
  out << "per step (worst rel_l2 over the layers, and where):\n";
  fmt::print(out, "{:>5} {:<28} {:<28} {:<28} {:<28} {:<28} result\n", "step", "backend pool",
             "captured pool", "kernel", "cache", "total");
  for (const StepSummary& s : steps) {
    fmt::print(out, "{:>5} {:<28} {:<28} {:<28} {:<28} {:<28} {}\n", s.step,
               pool_text(s.backend_pool, s.damaged_slots, "slots"), captured_text(s),
               worst_text(s, Comparison::kKernel), worst_text(s, Comparison::kCache),
               worst_text(s, Comparison::kTotal), s.pass ? "PASS" : "FAIL");
  }
}

void print_captured_pool_cost(std::ostream& out, const CheckRun& run) {
  const std::optional<CapturedPoolCost> cost = captured_pool_cost(run);
  if (!cost) return;
  const std::string since = cost->damaged_since_step >= 0
                                ? fmt::format(" (damaged from step {})", cost->damaged_since_step)
                                : "";
  if (!cost->shows) {
    fmt::print(out,
               "captured pool cost: zero: the captured pool differs from the replay{} but no "
               "reported step reads a damaged slot\n",
               since);
    return;
  }
  const ErrorSummary& e = cost->cost;
  fmt::print(out,
             "captured pool cost first shows at step {} layer {}{}: R8 on the captured pool vs R8 "
             "rel_l2 {}, lse_max_abs {}, max_abs/ref_max {}\n",
             cost->step, cost->layer_id, since, sci(e.rel_l2), e.has_lse ? sci(e.lse_max_abs) : "-",
             sci(e.max_abs_over_ref_max));
}

void print_notes(std::ostream& out, const CheckRun& run) {
  for (const std::string& note : run.notes) fmt::print(out, "note: {}\n", note);
  if (!run.first_divergence) return;
  const Divergence& d = *run.first_divergence;
  fmt::print(out, "first divergence ({}): step {} layer {} request {} row {} head {}{}\n",
             comparison_name(d.comparison), d.step, d.layer_id, d.request, d.row, d.head,
             d.reason.empty() ? "" : ": " + d.reason);
}

void print_timing(std::ostream& out, const CheckRun& run) {
  const double throughput =
      run.reference_seconds > 0.0 ? run.reference_rows_heads_tokens / run.reference_seconds : 0.0;
  const std::string diagnosis =
      run.diagnosis_seconds > 0.0 ? fmt::format(", diagnosis {:.4g} s", run.diagnosis_seconds) : "";
  fmt::print(out,
             "timing: reference {:.4g} s, backend {:.4g} s{}, total {:.4g} s\n"
             "reference throughput: {:.4g} rows*heads*tokens/s ({:.4g} in all)\n",
             run.reference_seconds, run.backend_seconds, diagnosis, run.total_seconds, throughput,
             run.reference_rows_heads_tokens);
}

void print_check_table(std::ostream& out, const CheckRun& run, bool with_timing) {
  print_comparison_table(out, run);
  print_diagnosis(out, run);
  print_integrity_failures(out, run);
  print_pool_data(out, run);
  print_step_summary(out, run);
  print_captured_pool_cost(out, run);
  print_notes(out, run);
  if (with_timing) print_timing(out, run);
  out << verdict_summary(run) << "\n";
}

std::string render_markdown(const CheckRun& run) {
  Markdown md;
  verdict_section(md, run);
  dump_section(md, run);
  backend_section(md, run);
  policy_section(md, run.policy);
  results_section(md, run);
  append(md, "{}", render_diagnosis_markdown(run));
  signoff_section(md, run);
  steps_section(md, run);
  integrity_section(md, run);
  notes_section(md, run);
  timing_section(md, run);
  provenance_section(md, run);
  return fmt::to_string(md);
}

Status write_report_dir(const std::filesystem::path& dir, const CheckRun& run) {
  if (!is_complete(run.provenance)) {
    // report.json and report.md name the same moment: fill the provenance once, for both.
    CheckRun completed = run;
    completed.provenance = completed_provenance(run.provenance);
    return write_report_dir(dir, completed);
  }
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error) {
    return bad_input(dir.string(), "cannot create the report directory: " + error.message());
  }
  const std::filesystem::path json_path = dir / "report.json";
  {
    std::ofstream out(json_path);
    // Strings from the dump (model, producer) may not be UTF-8: replace bad bytes, don't throw.
    out << to_json(run).dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    if (!out) return bad_input(json_path.string(), "cannot write the report");
  }
  const std::filesystem::path md_path = dir / "report.md";
  {
    std::ofstream out(md_path);
    out << render_markdown(run);
    if (!out) return bad_input(md_path.string(), "cannot write the report");
  }
  return ok_status();
}

}  // namespace kvaudit
