// The summary and failures of a report (see report_summary.hpp).
#include "src/report/report_summary.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

namespace kvaudit {

// ---- numbers -----------------------------------------------------------------------------------

std::string grouped(std::int64_t value) {
  const std::string digits = std::to_string(value < 0 ? -value : value);
  std::string text = value < 0 ? "-" : "";
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) text.push_back(',');
    text.push_back(digits[i]);
  }
  return text;
}

namespace {

std::string non_finite_text(double value) {
  if (std::isnan(value)) return "nan";
  return value > 0 ? "inf" : "-inf";
}

}  // namespace

std::string short_number(double value) {
  return std::isfinite(value) ? fmt::format("{:.4g}", value) : non_finite_text(value);
}

std::string sci(double value) {
  return std::isfinite(value) ? fmt::format("{:.3e}", value) : non_finite_text(value);
}

std::string ulp_text(double ulps) {
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

std::string backend_machine_text(const CheckRun& run) {
  const nlohmann::json& d = run.backend_description;
  auto text = [&d](const char* key) -> std::string {
    if (!d.is_object() || !d.contains(key)) return "";
    return d.at(key).is_string() ? d.at(key).get<std::string>() : d.at(key).dump();
  };
  const std::string device = text("device");
  if (device.empty()) return backend_text(run);
  if (device == "cpu") {
    const std::string threads = text("threads");
    return threads.empty() ? fmt::format("{} on the CPU", backend_text(run))
                           : fmt::format("{} on the CPU ({} threads)", backend_text(run), threads);
  }
  // What the description names, in this order; built-in CUDA backends say driver_version and
  // runtime_version, exec adapters driver and their libraries' versions.
  std::vector<std::string> parts;
  auto add = [&](const char* label, std::string value) {
    if (!value.empty()) parts.push_back(fmt::format("{} {}", label, value));
  };
  add("compute capability", text("compute_capability"));
  add("driver", text("driver_version").empty() ? text("driver") : text("driver_version"));
  add("CUDA runtime", text("runtime_version"));
  add("torch", text("torch"));
  add("flashinfer", text("flashinfer"));
  if (parts.empty()) return fmt::format("{} on {}", backend_text(run), device);
  return fmt::format("{} on {} ({})", backend_text(run), device, fmt::join(parts, ", "));
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

// ---- extents -----------------------------------------------------------------------------------

namespace {

// NaN is worse than any number; otherwise larger is worse.
bool worse(double value, double current) {
  return (std::isnan(value) && !std::isnan(current)) || value > current;
}

}  // namespace

void Extent::add(const ComparisonResult& result) {
  const ComparisonMetrics& m = result.metrics;
  if (!present || worse(m.rel_l2, rel_l2)) {
    rel_l2 = m.rel_l2;
    step = result.step;
    layer_id = result.layer_id;
  }
  const double ratio = max_abs_over_ref_max(m);
  if (!present || worse(ratio, over_ref_max)) over_ref_max = ratio;
  if (m.has_lse && (!has_lse || worse(m.lse_max_abs, lse))) lse = m.lse_max_abs;
  has_lse = has_lse || m.has_lse;
  present = true;
  ++count;
  failed += result.judgement.pass ? 0 : 1;
  nonfinite_mismatches += m.nonfinite_mismatches;
}

std::map<Comparison, Extent> run_extents(const CheckRun& run) {
  std::map<Comparison, Extent> extents;
  for (const ComparisonResult& result : run.comparisons) extents[result.comparison].add(result);
  return extents;
}

std::map<int, std::map<Comparison, Extent>> layer_extents(const CheckRun& run) {
  std::map<int, std::map<Comparison, Extent>> extents;
  for (const ComparisonResult& result : run.comparisons) {
    extents[result.layer_id][result.comparison].add(result);
  }
  return extents;
}

std::map<int, Saturation> layer_saturation(const CheckRun& run) {
  std::map<int, Saturation> layers;
  for (const StepLayerCoverage& site : run.coverage) {
    if (site.saturated_codes < 0) continue;
    Saturation& s = layers[site.layer_id];
    if (!s.known || site.saturated_codes > s.codes) {
      s.codes = site.saturated_codes;
      s.codes_read = site.codes_read;
      s.step = site.step;
    }
    s.known = true;
  }
  return layers;
}

std::string saturation_text(const Saturation& s) {
  if (!s.known) return "n/a";
  if (s.codes == 0) return fmt::format("none of {} codes read", grouped(s.codes_read));
  return fmt::format("{} of {} codes read ({:.2g}%) at step {}", grouped(s.codes),
                     grouped(s.codes_read), 100.0 * s.fraction(), s.step);
}

std::vector<int> run_steps(const CheckRun& run) {
  std::set<int> steps;
  for (const ComparisonResult& r : run.comparisons) steps.insert(r.step);
  for (const IntegrityFinding& f : run.integrity) steps.insert(f.step);
  for (const StepLayerCoverage& c : run.coverage) steps.insert(c.step);
  return {steps.begin(), steps.end()};
}

std::vector<int> run_layers(const CheckRun& run) {
  std::set<int> layers;
  for (const ComparisonResult& r : run.comparisons) layers.insert(r.layer_id);
  for (const IntegrityFinding& f : run.integrity) layers.insert(f.layer_id);
  for (const StepLayerCoverage& c : run.coverage) layers.insert(c.layer_id);
  return {layers.begin(), layers.end()};
}

const char* line_state_text(LineState state) {
  switch (state) {
    case LineState::kPass:
      return "PASS";
    case LineState::kFail:
      return "FAIL";
    case LineState::kReportOnly:
      return "over the sign-off limit (report-only)";
    case LineState::kUnmeasured:
      return "NOT MEASURED";
    case LineState::kInfo:
      return "";
  }
  return "";
}

// ---- summary sentences -------------------------------------------------------------------------

namespace {

std::string limit_text(const Policy& policy, Comparison comparison) {
  const std::optional<double> limit = limit_value(limits_for(policy, comparison), Limit::kRelL2);
  return limit ? fmt::format("limit rel_l2 <= {}", short_number(*limit)) : "rel_l2 not limited";
}

// The state of a measured comparison: pass, or fail / report-only by the policy.
LineState extent_state(const CheckRun& run, Comparison comparison, const Extent& extent) {
  if (extent.failed == 0) return LineState::kPass;
  return comparison_sets_exit(run.policy, comparison) || extent.nonfinite_mismatches > 0
             ? LineState::kFail
             : LineState::kReportOnly;
}

// "in layer 5 at step 1": where the worst rel_l2 is.
std::string where_text(const Extent& extent) {
  return fmt::format("in layer {} at step {}", extent.layer_id, extent.step);
}

std::string lse_text(const Extent& extent) {
  return extent.has_lse ? fmt::format(", lse error <= {}", short_number(extent.lse)) : "";
}

// Layers where this comparison was not measured, for the sentence of a partly measured one.
std::string missing_text(const std::vector<MeasurementGap>& gaps, Comparison comparison) {
  std::set<int> layers;
  for (const MeasurementGap& gap : gaps) {
    if (gap.comparison == comparison) layers.insert(gap.layer_id);
  }
  if (layers.empty()) return "";
  return fmt::format(" Not measured in layer{} {}.", layers.size() == 1 ? "" : "s",
                     fmt::join(layers, ", "));
}

SummaryLine unmeasured_line(const std::vector<MeasurementGap>& gaps, Comparison comparison,
                            const char* what) {
  std::set<int> layers;
  std::set<std::string> reasons;
  for (const MeasurementGap& gap : gaps) {
    if (gap.comparison != comparison) continue;
    layers.insert(gap.layer_id);
    reasons.insert(gap_reason_text(gap.reason));
  }
  return {LineState::kUnmeasured,
          fmt::format("{} not measured in layer{} {} ({}).", what, layers.size() == 1 ? "" : "s",
                      fmt::join(layers, ", "), fmt::join(reasons, "; "))};
}

SummaryLine quantization_line(const CheckRun& run, const std::map<Comparison, Extent>& extents,
                              const std::vector<MeasurementGap>& gaps) {
  const auto it = extents.find(Comparison::kQuantization);
  if (it == extents.end()) {
    return unmeasured_line(gaps, Comparison::kQuantization,
                           "FP8 storage cost (quantization error, R8 vs Rs)");
  }
  const Extent& e = it->second;
  return {extent_state(run, Comparison::kQuantization, e),
          fmt::format("FP8 storage costs at most rel_l2 {} of the output {} (quantization error, "
                      "R8 vs Rs: exact attention on the dequantized pool vs on the source KV); "
                      "max_abs/max|ref| <= {}{}; sign-off {}.{}",
                      short_number(e.rel_l2), where_text(e), short_number(e.over_ref_max),
                      lse_text(e), limit_text(run.policy, Comparison::kQuantization),
                      missing_text(gaps, Comparison::kQuantization))};
}

SummaryLine kernel_line(const CheckRun& run, const std::map<Comparison, Extent>& extents) {
  const auto it = extents.find(Comparison::kKernel);
  if (it == extents.end()) {
    return {LineState::kInfo, "No backend ran (--backend none): no kernel error to measure."};
  }
  const Extent& e = it->second;
  return {extent_state(run, Comparison::kKernel, e),
          fmt::format("The kernel adds at most rel_l2 {} {} (kernel error, backend vs R8': exact "
                      "attention on the FP8 pool the backend read); max_abs/max|ref| <= {}{}; "
                      "{}.",
                      short_number(e.rel_l2), where_text(e), short_number(e.over_ref_max),
                      lse_text(e), limit_text(run.policy, Comparison::kKernel))};
}

SummaryLine total_line(const CheckRun& run, const std::map<Comparison, Extent>& extents,
                       const std::vector<MeasurementGap>& gaps) {
  const auto it = extents.find(Comparison::kTotal);
  if (it == extents.end()) {
    return unmeasured_line(gaps, Comparison::kTotal, "Total error (backend vs Rs)");
  }
  const Extent& e = it->second;
  return {
      extent_state(run, Comparison::kTotal, e),
      fmt::format("Storage and kernel together cost at most rel_l2 {} {} (total error, "
                  "backend vs Rs); sign-off {}.{}",
                  short_number(e.rel_l2), where_text(e), limit_text(run.policy, Comparison::kTotal),
                  missing_text(gaps, Comparison::kTotal))};
}

std::optional<SummaryLine> captured_line(const CheckRun& run,
                                         const std::map<Comparison, Extent>& extents) {
  const auto it = extents.find(Comparison::kCaptured);
  if (it == extents.end()) return std::nullopt;
  const Extent& e = it->second;
  return SummaryLine{extent_state(run, Comparison::kCaptured, e),
                     fmt::format("The dump's captured outputs are within rel_l2 {} of exact "
                                 "attention on the replayed pool {} (captured, out/lse vs R8){}; "
                                 "{}.",
                                 short_number(e.rel_l2), where_text(e), lse_text(e),
                                 limit_text(run.policy, Comparison::kCaptured))};
}

// The first failing integrity finding, "step 1 layer 3 written_slots [bf16_bytes]".
std::string first_damage(const CheckRun& run) {
  for (const IntegrityFinding& f : run.integrity) {
    if (f.pass) continue;
    const std::string slot_class = f.classification == SlotClass::kNone
                                       ? ""
                                       : fmt::format(" [{}]", slot_class_name(f.classification));
    return fmt::format("step {} layer {} {}{}", f.step, f.layer_id, integrity_check_name(f.check),
                       slot_class);
  }
  return "";
}

SummaryLine cache_line(const CheckRun& run, const std::map<Comparison, Extent>& extents) {
  const RunCounts counts = count_results(run);
  if (counts.integrity_checks == 0) {
    return {LineState::kInfo,
            "Cache integrity not checked (no backend pool and no captured kv_cache_after)."};
  }
  std::set<int> steps;
  std::set<int> layers;
  for (const IntegrityFinding& f : run.integrity) {
    steps.insert(f.step);
    layers.insert(f.layer_id);
  }
  const auto cache = extents.find(Comparison::kCache);
  if (counts.integrity_failed == 0) {
    const std::string cost = cache == extents.end()
                                 ? ""
                                 : fmt::format("; cache error (R8 vs R8') at most rel_l2 {}",
                                               short_number(cache->second.rel_l2));
    const bool has_indexer =
        std::any_of(run.integrity.begin(), run.integrity.end(),
                    [](const IntegrityFinding& f) { return is_indexer_check(f.check); });
    const std::string indexer = has_indexer
                                    ? "; the DSA indexer cache: written slots hold the declared "
                                      "rule's bytes, other slots unchanged, the stored top-k a "
                                      "top-k of its FP8 scores"
                                    : "";
    return {LineState::kPass,
            fmt::format("The cache stayed intact across {} step{} in {} layer{}: all {} "
                        "integrity checks passed (storage one byte per element, written slots "
                        "hold e4m3_rne_satfinite(x / kv_scale), other slots unchanged, no NaN "
                        "code written{}){}.",
                        steps.size(), steps.size() == 1 ? "" : "s", layers.size(),
                        layers.size() == 1 ? "" : "s", counts.integrity_checks, indexer, cost)};
  }
  const std::string cost = cache == extents.end()
                               ? ""
                               : fmt::format(
                                     "; it costs the outputs up to rel_l2 {} (cache, R8 "
                                     "vs R8')",
                                     short_number(cache->second.rel_l2));
  return {LineState::kFail,
          fmt::format("The cache was damaged: {} of {} integrity checks failed, first at {}{}.",
                      counts.integrity_failed, counts.integrity_checks, first_damage(run), cost)};
}

SummaryLine policy_line(const CheckRun& run) {
  return {LineState::kInfo,
          run.policy.quantization_sets_exit
              ? fmt::format("Judged with policy {}: kernel, cache and captured limits and the "
                            "sign-off limits of quantization and total error set the verdict; "
                            "quantization and total must be measured at every step of every "
                            "layer.",
                            run.policy.name)
              : fmt::format("Judged with policy {}: kernel, cache and captured limits set the "
                            "verdict; quantization and total error are judged against the "
                            "sign-off limits but report-only (run with --signoff to make them "
                            "count).",
                            run.policy.name)};
}

}  // namespace

std::vector<SummaryLine> summary_lines(const CheckRun& run) {
  const std::map<Comparison, Extent> extents = run_extents(run);
  const std::vector<MeasurementGap> gaps = measurement_gaps(run);
  std::vector<SummaryLine> lines;
  const bool quantization_known = extents.count(Comparison::kQuantization) != 0 || !gaps.empty();
  if (quantization_known) lines.push_back(quantization_line(run, extents, gaps));
  lines.push_back(kernel_line(run, extents));
  if (extents.count(Comparison::kTotal) != 0 || !gaps.empty()) {
    lines.push_back(total_line(run, extents, gaps));
  }
  if (auto captured = captured_line(run, extents)) lines.push_back(*captured);
  lines.push_back(cache_line(run, extents));
  lines.push_back(policy_line(run));
  return lines;
}

// ---- failures ----------------------------------------------------------------------------------

namespace {

const char* gap_cause(GapReason reason) {
  switch (reason) {
    case GapReason::kNoSource:
      return "Rs needs the unquantized value of every token a step reads; the dump has no "
             "kv_source for the tokens cached before its first step. Capture kv_source "
             "(docs/kvdump-v1.md) to measure quantization and total error.";
    case GapReason::kNoBackend:
      return "no backend ran (--backend none), so there is no output to compare with Rs.";
  }
  return "";
}

std::vector<FailureItem> gap_items(const CheckRun& run) {
  const std::vector<MeasurementGap> gaps = measurement_gaps(run);
  std::map<GapReason, std::vector<MeasurementGap>> by_reason;
  for (const MeasurementGap& gap : gaps) by_reason[gap.reason].push_back(gap);
  std::vector<FailureItem> items;
  for (const auto& [reason, these] : by_reason) {
    FailureItem item;
    item.title = fmt::format("Not measured: {}", gaps_headline(these));
    for (const MeasurementGap& gap : these) {
      const std::string tokens =
          gap.tokens_without_source > 0
              ? fmt::format(" (at step {}, {} of the {} tokens read have no source value)",
                            gap.steps.front(), grouped(gap.tokens_without_source),
                            grouped(gap.tokens_read))
              : "";
      item.details.push_back(fmt::format("layer {} {}: steps {}{}", gap.layer_id,
                                         comparison_name(gap.comparison),
                                         fmt::join(gap.steps, ", "), tokens));
    }
    item.likely_cause = gap_cause(reason);
    item.sets_exit = run.policy.quantization_sets_exit;
    items.push_back(std::move(item));
  }
  return items;
}

std::string saturation_at(const CheckRun& run, int step, int layer_id) {
  for (const StepLayerCoverage& site : run.coverage) {
    if (site.step != step || site.layer_id != layer_id || site.saturated_codes < 0) continue;
    Saturation s{true, site.saturated_codes, site.codes_read, step};
    return fmt::format("; saturated codes read: {}",
                       s.codes == 0 ? std::string("none") : saturation_text(s));
  }
  return "";
}

// ---- the likely cause of a failing comparison, from what failed ---------------------------------
//
// A pool is written, then read. What failed says which of the two is wrong:
//   the write path  an integrity check of the pool failed at or before the step (the backend's
//                   checks, or captured_pool for the server's kv_cache_after);
//   the read path   the output differs from exact attention on the very pool it read: kernel
//                   (backend vs R8'), captured_read (server vs R8s), or captured (server vs R8)
//                   where the server's pool matches the replay.
// Both can be wrong at once; a comparison that fails only because the pool was damaged (cache,
// captured on a damaged pool while captured_read passes) is the write path's.

bool is_backend_pool_check(IntegrityCheck check) {
  return check != IntegrityCheck::kCapturedPool && check != IntegrityCheck::kNanCodesInPool &&
         !is_indexer_check(check);
}

// The failing integrity findings of a layer on one side (backend pool or the server's captured
// pool) at or before `step`, in report order.
std::vector<const IntegrityFinding*> pool_damage(const CheckRun& run, int layer_id, int step,
                                                 bool server) {
  std::vector<const IntegrityFinding*> found;
  for (const IntegrityFinding& f : run.integrity) {
    if (f.pass || f.layer_id != layer_id || f.step > step) continue;
    const bool server_check = f.check == IntegrityCheck::kCapturedPool;
    if (server_check == server && (server || is_backend_pool_check(f.check))) found.push_back(&f);
  }
  return found;
}

// "request 0 token 6's row, meant for slot 6, landed in slot 7; ... (5 rows in all)" over the
// findings' misplaced rows, each once; "" for none.
std::string misplaced_text(const std::vector<const IntegrityFinding*>& findings) {
  constexpr std::size_t kNamed = 3;
  std::vector<MisplacedRow> rows;
  std::vector<int> steps;
  for (const IntegrityFinding* f : findings) {
    for (const MisplacedRow& row : f->misplaced_rows) {
      if (std::find(rows.begin(), rows.end(), row) != rows.end()) continue;
      rows.push_back(row);
      steps.push_back(f->step);
    }
  }
  std::vector<std::string> named;
  for (std::size_t i = 0; i < rows.size() && i < kNamed; ++i) {
    named.push_back(fmt::format("at step {}, {}", steps[i], misplaced_row_text(rows[i])));
  }
  if (named.empty()) return "";
  const std::string more =
      rows.size() > kNamed ? fmt::format(" ({} rows in all)", rows.size()) : std::string();
  return fmt::format("{}{}", fmt::join(named, "; "), more);
}

// "step 0 written_slots [wrong_slot]; at step 0, request 0 token 6's row, ...": the first damage
// and the misplaced rows among it.
std::string damage_text(const std::vector<const IntegrityFinding*>& damage) {
  if (damage.empty()) return "";
  const IntegrityFinding& first = *damage.front();
  std::string text =
      fmt::format("first at step {} {}", first.step, integrity_check_name(first.check));
  if (first.classification != SlotClass::kNone) {
    text += fmt::format(" [{}]", slot_class_name(first.classification));
  }
  const std::string misplaced = misplaced_text(damage);
  return misplaced.empty() ? text : fmt::format("{}; {}", text, misplaced);
}

const ComparisonResult* result_at(const CheckRun& run, Comparison comparison, int step,
                                  int layer_id) {
  for (const ComparisonResult& r : run.comparisons) {
    if (r.comparison == comparison && r.step == step && r.layer_id == layer_id) return &r;
  }
  return nullptr;
}

// Which side of the pool the failing results of one (comparison, layer) point at, with the
// damage found on the write side.
struct FailedSides {
  bool write = false;
  bool read = false;
  std::vector<const IntegrityFinding*> damage;  // of the write side, at or before the steps
};

void add_damage(FailedSides& sides, std::vector<const IntegrityFinding*> damage) {
  for (const IntegrityFinding* f : damage) {
    if (std::find(sides.damage.begin(), sides.damage.end(), f) == sides.damage.end()) {
      sides.damage.push_back(f);
    }
  }
}

FailedSides failed_sides(const CheckRun& run, Comparison comparison, int layer_id,
                         const std::vector<const ComparisonResult*>& failing) {
  FailedSides sides;
  for (const ComparisonResult* r : failing) {
    const bool server = comparison == Comparison::kCaptured;
    std::vector<const IntegrityFinding*> damage = pool_damage(run, layer_id, r->step, server);
    const bool damaged = !damage.empty();
    add_damage(sides, std::move(damage));
    switch (comparison) {
      case Comparison::kKernel: {
        sides.read = true;
        sides.write = sides.write || damaged;
        break;
      }
      case Comparison::kCache: {
        sides.write = true;
        const ComparisonResult* kernel = result_at(run, Comparison::kKernel, r->step, layer_id);
        sides.read = sides.read || (kernel != nullptr && !kernel->judgement.pass);
        break;
      }
      case Comparison::kCaptured: {
        // On an intact server pool the server read what the replay reads: its kernel. On a
        // damaged one captured_read (vs R8s, the pool it read) says whether its reads were right
        // (none made: R8s = R8, so the captured failure is its kernel's).
        const ComparisonResult* read = result_at(run, Comparison::kCapturedRead, r->step, layer_id);
        sides.write = sides.write || damaged;
        sides.read = sides.read || !damaged || read == nullptr || !read->judgement.pass;
        break;
      }
      default:
        break;
    }
  }
  return sides;
}

std::string kernel_cause(const FailedSides& sides) {
  if (!sides.write) {
    return "The backend's kernel (or a convention mismatch: lse base, scales): it computes "
           "differently from exact attention on the very pool it read (R8' uses it), and that "
           "pool is intact (every integrity check passed), so the writes are ruled out: the "
           "kernel's arithmetic or how it reads the pool. Start at the first divergence and the "
           "diagnosis where there is one.";
  }
  return fmt::format(
      "Both the write path and the kernel: the backend computes differently from exact "
      "attention on the very pool it read (R8'), and its writes also damaged that pool ({}). "
      "Fix the writes (the integrity failures), then see whether the kernel error remains.",
      damage_text(sides.damage));
}

std::string cache_cause(const FailedSides& sides) {
  const std::string damage =
      sides.damage.empty() ? std::string() : fmt::format(" ({})", damage_text(sides.damage));
  if (!sides.read) {
    return fmt::format(
        "The backend's write path, not its kernel: its pool differs from the reference replay's "
        "in slots this step reads{}; the kernel comparison passes (it read the damaged bytes "
        "correctly). See the integrity failures for the slots and their class.",
        damage);
  }
  return fmt::format(
      "Both the write path and the kernel: the backend's pool differs from the reference "
      "replay's in slots this step reads{}, and the kernel comparison fails too (see its "
      "failure).",
      damage);
}

std::string captured_cause(const FailedSides& sides) {
  if (!sides.write) {
    return "The server's kernel or a convention mismatch (lse base, scales): its output differs "
           "from exact attention on the replayed pool, and its pool is not known to differ (no "
           "captured kv_cache_after does); see the diagnosis where there is one.";
  }
  if (!sides.read) {
    return fmt::format(
        "The server's write path, not its kernel: its captured pool differs from the replay "
        "({}), and captured_read passes: its output is right for the pool it read. What its "
        "corrupted cache costs is captured_cache.",
        damage_text(sides.damage));
  }
  return fmt::format(
      "Both the server's write path and its kernel: its captured pool differs from the replay "
      "({}), and captured_read fails too, so its output is also wrong for the pool it read (its "
      "kernel or a convention mismatch; see the diagnosis where there is one).",
      damage_text(sides.damage));
}

// The mismatch a reader looks at first: the first NaN/Inf mismatch of the failing results.
const ComparisonResult* first_nonfinite(const std::vector<const ComparisonResult*>& failing) {
  for (const ComparisonResult* r : failing) {
    if (r->metrics.nonfinite_mismatches > 0) return r;
  }
  return nullptr;
}

// Rs (the reference of quantization and total) is NaN where the candidate is a number: the
// source values hold a NaN that the pool's codes do not.
bool source_nan(Comparison comparison, const ComparisonResult& result) {
  const ElementLocation& at = result.metrics.first_nonfinite_mismatch;
  const bool against_source =
      comparison == Comparison::kQuantization || comparison == Comparison::kTotal;
  return against_source && std::isnan(at.reference) && std::isfinite(at.candidate);
}

std::string nonfinite_cause(Comparison comparison, const ComparisonResult& result) {
  if (source_nan(comparison, result)) {
    return "The dump's source values hold NaN: Rs (exact attention on the unquantized KV) is NaN "
           "where the rows read a token whose kv_source (or, for a token a step writes, new_kv) "
           "value is NaN, while the FP8 pool's codes there are finite. The source is at fault, "
           "not a kernel; `kvaudit info` counts kv_source's NaN values by slot.";
  }
  const ElementLocation& at = result.metrics.first_nonfinite_mismatch;
  if (std::isfinite(at.reference)) {
    return "NaN/Inf in the output where the reference is finite: e.g. a NaN code in a slot the "
           "attention masks reaching the output (a masked-NaN leak), or an overflow.";
  }
  return "The reference is NaN/Inf where the output is finite: the pool holds a NaN code in a "
         "token the row reads (data: the reference is NaN there), and the output dropped it.";
}

std::string comparison_cause(const CheckRun& run, Comparison comparison, int layer_id,
                             const std::vector<const ComparisonResult*>& failing) {
  if (const ComparisonResult* nonfinite = first_nonfinite(failing)) {
    return nonfinite_cause(comparison, *nonfinite);
  }
  const Saturation s = layer_saturation(run)[layer_id];
  switch (comparison) {
    case Comparison::kQuantization:
    case Comparison::kTotal:
      if (s.known && s.codes > 0) {
        return fmt::format(
            "Saturation: {} hold +-448, values past 464 * kv_scale clamped by the write rule's "
            "satfinite. Clipped values, not e4m3 rounding, make an error this large; a kv_scale "
            "that fits the values removes them.",
            saturation_text(s));
      }
      return comparison == Comparison::kQuantization
                 ? "No saturated codes: e4m3's own rounding (3 mantissa bits) costs more than the "
                   "limit on this data; a finer scale (per channel or per token) would be needed."
                 : "The kernel's error adds to the storage error (total = quantization + kernel).";
    case Comparison::kKernel:
      return kernel_cause(failed_sides(run, comparison, layer_id, failing));
    case Comparison::kCache:
      return cache_cause(failed_sides(run, comparison, layer_id, failing));
    case Comparison::kCaptured:
      return captured_cause(failed_sides(run, comparison, layer_id, failing));
    case Comparison::kCapturedRead:
      return "The server's output differs from exact attention on the pool it captured (what it "
             "read): its kernel, not its cache; see the diagnosis where there is one.";
    case Comparison::kCapturedCache:
      return "The server's captured pool differs from the replay in slots this step reads: what "
             "its corrupted cache costs the output (the captured_pool integrity finding names "
             "the slots).";
  }
  return "";
}

std::vector<FailureItem> comparison_items(const CheckRun& run) {
  std::map<std::pair<Comparison, int>, std::vector<const ComparisonResult*>> failing;
  for (const ComparisonResult& r : run.comparisons) {
    if (!r.judgement.pass) failing[{r.comparison, r.layer_id}].push_back(&r);
  }
  std::vector<FailureItem> items;
  for (const auto& [key, results] : failing) {
    const auto& [comparison, layer_id] = key;
    const bool signoff_kind =
        comparison == Comparison::kQuantization || comparison == Comparison::kTotal;
    FailureItem item;
    item.title = fmt::format("{} error over the {}limit in layer {}", comparison_name(comparison),
                             signoff_kind ? "sign-off " : "", layer_id);
    item.sets_exit = std::any_of(results.begin(), results.end(),
                                 [](const ComparisonResult* r) { return fails_run(*r); });
    for (const ComparisonResult* r : results) {
      const ElementLocation& at = worst_location(*r);
      item.details.push_back(
          fmt::format("step {}: {} (worst element row {} head {} dim {}, request {}){}", r->step,
                      fmt::join(r->judgement.reasons, "; "), at.row, at.head, at.dim,
                      r->worst_request, signoff_kind ? saturation_at(run, r->step, layer_id) : ""));
    }
    item.likely_cause = comparison_cause(run, comparison, layer_id, results);
    items.push_back(std::move(item));
  }
  return items;
}

const char* slot_class_cause(SlotClass slot_class) {
  switch (slot_class) {
    case SlotClass::kWrongSlot:
      return "rows written to the wrong slot: the slot index arithmetic (page table, offset).";
    case SlotClass::kBf16Bytes:
      return "BF16 bytes stored in the FP8 pool: a bf16 write-back or a cast of the pool.";
    case SlotClass::kNanCode:
      return "a NaN code written for a finite value: overflow not saturated (satfinite missing).";
    case SlotClass::kOffByOneCode:
      return "codes one step from the write rule's: another rounding (toward zero, a reciprocal "
             "scale) than e4m3_rne_satfinite(x / kv_scale).";
    case SlotClass::kScaleBytes:
      return "group scales stored wrong (per_token_group): the scale computation or its "
             "encoding (fp32, power of two, e8m0).";
    case SlotClass::kSwappedGroupScale:
      return "a group stored with another group's scale: the scale index arithmetic.";
    case SlotClass::kCodesOtherScale:
      return "latent codes quantized with another scale than the one stored (scale 1, a V scale "
             "for the K row, a per-token instead of per-group scale).";
    case SlotClass::kRopeSaturated:
      return "the RoPE part saturated at +-448: its scale was calibrated without it.";
    case SlotClass::kUnusedSlot:
      return "bytes changed in a slot that no request of any step holds: a stray write, or a "
             "capture of another pool region.";
    case SlotClass::kOther:
      return "damage of no known class: compare the slots' bytes with the write rule.";
    case SlotClass::kNone:
      return "";
  }
  return "";
}

std::vector<FailureItem> integrity_items(const CheckRun& run) {
  constexpr std::size_t kListed = 5;
  std::map<std::tuple<IntegrityCheck, SlotClass, int>, std::vector<const IntegrityFinding*>> bad;
  for (const IntegrityFinding& f : run.integrity) {
    if (!f.pass) bad[{f.check, f.classification, f.layer_id}].push_back(&f);
  }
  std::vector<FailureItem> items;
  for (const auto& [key, findings] : bad) {
    const auto& [check, slot_class, layer_id] = key;
    FailureItem item;
    item.title = fmt::format("cache integrity: {}{} in layer {}", integrity_check_name(check),
                             slot_class == SlotClass::kNone
                                 ? std::string()
                                 : fmt::format(" [{}]", slot_class_name(slot_class)),
                             layer_id);
    for (std::size_t i = 0; i < findings.size() && i < kListed; ++i) {
      const IntegrityFinding& f = *findings[i];
      item.details.push_back(f.carried_from_step >= 0 ? fmt::format("{} (carried from step {})",
                                                                    f.detail, f.carried_from_step)
                                                      : f.detail);
    }
    if (findings.size() > kListed) {
      item.details.push_back(fmt::format("and {} more steps", findings.size() - kListed));
    }
    item.likely_cause = is_indexer_check(check)
                            ? "the DSA indexer's FP8 key cache (kvdump v1.2) is not what the "
                              "deployed rule gives (docs/indexer-fp8.md): the indexer's cache "
                              "write or its top-k, not the attention."
                            : slot_class_cause(slot_class);
    const std::string misplaced = misplaced_text(findings);
    if (!misplaced.empty()) item.likely_cause += fmt::format(" Misplaced: {}.", misplaced);
    items.push_back(std::move(item));
  }
  return items;
}

}  // namespace

std::vector<FailureItem> failure_items(const CheckRun& run) {
  std::vector<FailureItem> items = gap_items(run);
  for (FailureItem& item : integrity_items(run)) items.push_back(std::move(item));
  for (FailureItem& item : comparison_items(run)) items.push_back(std::move(item));
  return items;
}

}  // namespace kvaudit
