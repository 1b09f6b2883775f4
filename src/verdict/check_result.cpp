// The verdict of a check run and its report.json form (docs/report-schema.md).
#include "src/verdict/check_result.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <fstream>
#include <iterator>
#include <limits>
#include <set>

#include "src/core/build_info.hpp"
#include "src/verdict/report_digest.hpp"
#include "src/verdict/signoff.hpp"

namespace kvaudit {

std::string shell_quote(const std::string& arg) {
  const bool plain = !arg.empty() && arg.find_first_not_of(
                                         "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                         "0123456789_-./=:,+@%") == std::string::npos;
  if (plain) return arg;
  std::string quoted = "'";
  for (const char c : arg) {
    if (c == '\'') {
      quoted += "'\\''";
    } else {
      quoted += c;
    }
  }
  return quoted + "'";
}

namespace {

std::string process_command_line() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  if (!in) return "";
  const std::string raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::string line;
  std::size_t start = 0;
  while (start < raw.size()) {
    std::size_t end = raw.find('\0', start);
    if (end == std::string::npos) end = raw.size();
    if (!line.empty()) line += ' ';
    line += shell_quote(raw.substr(start, end - start));
    start = end + 1;
  }
  return line;
}

}  // namespace

Provenance current_provenance() {
  Provenance provenance;
  char host[256] = {};
  if (gethostname(host, sizeof host - 1) == 0) provenance.host = host;
  const std::time_t now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm utc{};
  gmtime_r(&now, &utc);
  char date[32];
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", &utc);
  provenance.date_utc = date;
  provenance.command_line = process_command_line();
#ifdef KVAUDIT_VERSION
  provenance.kvaudit_version = KVAUDIT_VERSION;
#endif
  provenance.git_revision = kvaudit_git_revision();
  provenance.cpu = cpu_description();
  return provenance;
}

bool is_complete(const Provenance& provenance) {
  return !provenance.host.empty() && !provenance.date_utc.empty() &&
         !provenance.command_line.empty() && !provenance.kvaudit_version.empty() &&
         !provenance.git_revision.empty() && !provenance.cpu.empty();
}

Provenance completed_provenance(const Provenance& given) {
  if (is_complete(given)) return given;
  Provenance provenance = given;
  const Provenance here = current_provenance();
  if (provenance.host.empty()) provenance.host = here.host;
  if (provenance.date_utc.empty()) provenance.date_utc = here.date_utc;
  if (provenance.command_line.empty()) provenance.command_line = here.command_line;
  if (provenance.kvaudit_version.empty()) provenance.kvaudit_version = here.kvaudit_version;
  if (provenance.git_revision.empty()) provenance.git_revision = here.git_revision;
  if (provenance.cpu.empty()) provenance.cpu = here.cpu;
  return provenance;
}

const char* kvaudit_version() {
#ifdef KVAUDIT_VERSION
  return KVAUDIT_VERSION;
#else
  return "unknown";
#endif
}

bool fails_run(const ComparisonResult& result) {
  return !result.judgement.pass && (result.sets_exit || result.metrics.nonfinite_mismatches > 0);
}

const ElementLocation& worst_location(const ComparisonResult& result) {
  return result.metrics.nonfinite_mismatches > 0 ? result.metrics.first_nonfinite_mismatch
                                                 : result.metrics.max_abs_at;
}

bool CheckRun::pass() const {
  for (const ComparisonResult& result : comparisons) {
    if (fails_run(result)) return false;
  }
  for (const IntegrityFinding& finding : integrity) {
    if (!finding.pass) return false;
  }
  return !gaps_fail_run(*this);
}

RunCounts count_results(const CheckRun& run) {
  RunCounts counts;
  counts.comparisons = run.comparisons.size();
  for (const ComparisonResult& result : run.comparisons) {
    if (result.judgement.pass) continue;
    if (fails_run(result)) {
      ++counts.failed;
    } else {
      ++counts.failed_report_only;
    }
  }
  counts.integrity_checks = run.integrity.size();
  for (const IntegrityFinding& finding : run.integrity) counts.integrity_failed += !finding.pass;
  counts.unmeasured = unmeasured_sites(measurement_gaps(run));
  return counts;
}

const char* pool_state_name(PoolState state) {
  switch (state) {
    case PoolState::kNotChecked:
      return "not checked";
    case PoolState::kIntact:
      return "intact";
    case PoolState::kDamaged:
      return "damaged";
  }
  return "unknown";
}

const char* integrity_check_name(IntegrityCheck check) {
  switch (check) {
    case IntegrityCheck::kStorage:
      return "storage";
    case IntegrityCheck::kWrittenSlots:
      return "written_slots";
    case IntegrityCheck::kUnwrittenSlots:
      return "unwritten_slots";
    case IntegrityCheck::kNanWritten:
      return "nan_written";
    case IntegrityCheck::kReadConsistency:
      return "read_consistency";
    case IntegrityCheck::kCapturedPool:
      return "captured_pool";
    case IntegrityCheck::kNanCodesInPool:
      return "nan_codes_in_pool";
  }
  return "unknown";
}

const char* slot_class_name(SlotClass slot_class) {
  switch (slot_class) {
    case SlotClass::kNone:
      return "";
    case SlotClass::kWrongSlot:
      return "wrong_slot";
    case SlotClass::kBf16Bytes:
      return "bf16_bytes";
    case SlotClass::kNanCode:
      return "nan_code";
    case SlotClass::kOffByOneCode:
      return "off_by_one_code";
    case SlotClass::kScaleBytes:
      return "scale_bytes";
    case SlotClass::kSwappedGroupScale:
      return "swapped_group_scale";
    case SlotClass::kCodesOtherScale:
      return "codes_other_scale";
    case SlotClass::kRopeSaturated:
      return "rope_saturated";
    case SlotClass::kOther:
      return "other";
  }
  return "unknown";
}

namespace {

// A pool is intact until a check of it fails, and not checked until one runs.
void mark_pool(PoolState& state, bool pass) {
  if (!pass) {
    state = PoolState::kDamaged;
  } else if (state == PoolState::kNotChecked) {
    state = PoolState::kIntact;
  }
}

void add_finding(StepSummary& summary, const IntegrityFinding& finding) {
  summary.pass = summary.pass && finding.pass;
  switch (finding.check) {
    case IntegrityCheck::kNanCodesInPool:  // data, not the state of a pool
      return;
    case IntegrityCheck::kCapturedPool:
      mark_pool(summary.captured_pool, finding.pass);
      if (!finding.pass) {
        (finding.carried_from_step >= 0 ? summary.carried_captured_slots
                                        : summary.new_captured_slots) += finding.slot_count;
      }
      return;
    case IntegrityCheck::kReadConsistency:
      mark_pool(summary.backend_pool, finding.pass);
      if (!finding.pass) {
        summary.damaged_slots += finding.slot_count;
        ++summary.damaged_layers;
      }
      return;
    case IntegrityCheck::kStorage:
    case IntegrityCheck::kWrittenSlots:
    case IntegrityCheck::kUnwrittenSlots:
    case IntegrityCheck::kNanWritten:
      mark_pool(summary.backend_pool, finding.pass);
      return;
  }
}

void add_result(StepSummary& summary, const ComparisonResult& result) {
  summary.pass = summary.pass && !fails_run(result);
  ComparisonWorst& worst = summary.worst[result.comparison];
  const double rel_l2 = result.metrics.rel_l2;
  const bool worse =
      !worst.present || (std::isnan(rel_l2) && !std::isnan(worst.rel_l2)) || rel_l2 > worst.rel_l2;
  if (worse) {
    worst.rel_l2 = rel_l2;
    worst.layer_id = result.layer_id;
  }
  worst.present = true;
  worst.nonfinite_mismatches += result.metrics.nonfinite_mismatches;
  worst.failed += result.judgement.pass ? 0 : 1;
}

}  // namespace

std::vector<StepSummary> summarize_steps(const CheckRun& run) {
  std::map<int, StepSummary> steps;
  std::map<int, std::set<int>> layers_of_step;
  auto summary_of = [&](int step, int layer_id) -> StepSummary& {
    layers_of_step[step].insert(layer_id);
    StepSummary& summary = steps[step];
    summary.step = step;
    return summary;
  };
  for (const IntegrityFinding& finding : run.integrity) {
    add_finding(summary_of(finding.step, finding.layer_id), finding);
  }
  for (const ComparisonResult& result : run.comparisons) {
    add_result(summary_of(result.step, result.layer_id), result);
  }
  std::vector<StepSummary> ordered;
  for (auto& [step, summary] : steps) {
    summary.layers = static_cast<int>(layers_of_step[step].size());
    ordered.push_back(std::move(summary));
  }
  return ordered;
}

ErrorSummary summarize_error(const ComparisonMetrics& metrics) {
  ErrorSummary summary;
  summary.rel_l2 = metrics.rel_l2;
  summary.max_abs_over_ref_max = max_abs_over_ref_max(metrics);
  summary.has_lse = metrics.has_lse;
  summary.lse_max_abs = metrics.lse_max_abs;
  summary.nonfinite_mismatches = metrics.nonfinite_mismatches;
  return summary;
}

namespace {

std::string outcome_text(const HypothesisOutcome& outcome) {
  return fmt::format("{} ({})", outcome.hypothesis, outcome.transform);
}

std::string closest_text(const HypothesisOutcome& closest) {
  return fmt::format("closest: {}, {:.3g}x its limits", outcome_text(closest), closest.excess);
}

}  // namespace

std::string diagnosis_summary(const DiagnosisFinding& finding) {
  const std::vector<HypothesisOutcome>& explaining = finding.explained_by;
  if (explaining.empty()) {
    if (finding.tried == 0) {
      return "no hypothesis in the catalogue explains this failure (none applies here)";
    }
    return fmt::format("no hypothesis in the catalogue explains this failure ({} tried{})",
                       finding.tried,
                       finding.closest ? "; " + closest_text(*finding.closest) : std::string());
  }
  if (explaining.size() == 1) return "explained by " + outcome_text(explaining.front());
  std::vector<std::string> names;
  for (const HypothesisOutcome& outcome : explaining) names.push_back(outcome.hypothesis);
  if (finding.same_computation) {
    return fmt::format(
        "explained by {} (indistinguishable on this data: the same computation here, {})",
        fmt::join(names, ", "), explaining.front().transform);
  }
  std::vector<std::string> each;
  for (const HypothesisOutcome& outcome : explaining) each.push_back(outcome_text(outcome));
  return fmt::format(
      "explained by {} (indistinguishable on this data: each brings the error to a clean "
      "kernel's level)",
      fmt::join(each, ", "));
}

CertificationMaxima certification_maxima(const std::vector<CertificationSample>& samples) {
  CertificationMaxima maxima;
  for (const CertificationSample& s : samples) {
    maxima.out_relative = std::max(maxima.out_relative, s.out_relative);
    maxima.lse_absolute = std::max(maxima.lse_absolute, s.lse_absolute);
  }
  return maxima;
}

std::optional<std::string> diagnosis_budget_note(std::size_t diagnosed_sites,
                                                 std::size_t failing_sites, int limit) {
  if (limit <= 0 || diagnosed_sites >= failing_sites) return std::nullopt;
  return fmt::format(
      "diagnosis: {} of {} (step, layer)s with a failing kernel or captured comparison "
      "diagnosed (--diagnose {}), the earliest first",
      diagnosed_sites, failing_sites, limit);
}

std::optional<CapturedPoolCost> captured_pool_cost(const CheckRun& run) {
  bool diverged = false;
  const ComparisonResult* first = nullptr;
  for (const ComparisonResult& result : run.comparisons) {
    if (result.comparison != Comparison::kCapturedCache) continue;
    diverged = true;
    // The run lists layers in dump order within a step: the first at the smallest step wins.
    if (!result.judgement.pass && (first == nullptr || result.step < first->step)) first = &result;
  }
  if (!diverged) return std::nullopt;
  CapturedPoolCost cost;
  cost.shows = first != nullptr;
  if (first != nullptr) {
    cost.step = first->step;
    cost.layer_id = first->layer_id;
    cost.cost = summarize_error(first->metrics);
  }
  for (const IntegrityFinding& finding : run.integrity) {
    const bool in_layer = first == nullptr || finding.layer_id == first->layer_id;
    if (finding.check != IntegrityCheck::kCapturedPool || finding.pass || !in_layer) continue;
    const int since = finding.carried_from_step >= 0 ? finding.carried_from_step : finding.step;
    if (cost.damaged_since_step < 0 || since < cost.damaged_since_step) {
      cost.damaged_since_step = since;
    }
  }
  return cost;
}

namespace {

nlohmann::json pool_state_json(PoolState state) {
  return state == PoolState::kNotChecked ? nlohmann::json(nullptr)
                                         : nlohmann::json(pool_state_name(state));
}

nlohmann::json object_or_empty(const nlohmann::json& value) {
  return value.is_null() ? nlohmann::json::object() : value;
}

nlohmann::json counts_json(const RunCounts& counts) {
  return {{"comparisons", counts.comparisons},
          {"failed", counts.failed},
          {"failed_report_only", counts.failed_report_only},
          {"integrity_checks", counts.integrity_checks},
          {"integrity_failed", counts.integrity_failed},
          {"unmeasured", counts.unmeasured}};
}

nlohmann::json result_json(const ComparisonResult& result) {
  nlohmann::json metrics = to_json(result.metrics);
  metrics["max_abs_over_ref_max"] = json_number(max_abs_over_ref_max(result.metrics));
  return {{"step", result.step},
          {"layer", result.layer_id},
          {"comparison", comparison_name(result.comparison)},
          {"metrics", std::move(metrics)},
          {"worst", to_json(worst_location(result))},
          {"worst_request", result.worst_request},
          {"pass", result.judgement.pass},
          {"sets_exit", result.sets_exit || result.metrics.nonfinite_mismatches > 0},
          {"reasons", result.judgement.reasons}};
}

nlohmann::json finding_json(const IntegrityFinding& finding) {
  return {{"step", finding.step},
          {"layer", finding.layer_id},
          {"check", integrity_check_name(finding.check)},
          {"pass", finding.pass},
          {"where", finding.where},
          {"detail", finding.detail},
          {"slots", finding.slots},
          {"slot_count", finding.slot_count},
          {"classification", slot_class_name(finding.classification)},
          {"carried_from_step", finding.carried_from_step >= 0
                                    ? nlohmann::json(finding.carried_from_step)
                                    : nlohmann::json(nullptr)}};
}

nlohmann::json step_json(const StepSummary& summary) {
  nlohmann::json comparisons = nlohmann::json::object();
  for (const auto& [comparison, worst] : summary.worst) {
    comparisons[comparison_name(comparison)] = {
        {"worst_rel_l2", json_number(worst.rel_l2)},
        {"worst_layer", worst.layer_id},
        {"nonfinite_mismatches", worst.nonfinite_mismatches},
        {"failed_layers", worst.failed}};
  }
  return {{"step", summary.step},
          {"layers", summary.layers},
          {"backend_pool", pool_state_json(summary.backend_pool)},
          {"damaged_slots", summary.damaged_slots},
          {"damaged_layers", summary.damaged_layers},
          {"captured_pool", pool_state_json(summary.captured_pool)},
          {"new_captured_slots", summary.new_captured_slots},
          {"carried_captured_slots", summary.carried_captured_slots},
          {"comparisons", std::move(comparisons)},
          {"pass", summary.pass}};
}

nlohmann::json error_json(const ErrorSummary& error) {
  return {{"rel_l2", json_number(error.rel_l2)},
          {"max_abs_over_ref_max", json_number(error.max_abs_over_ref_max)},
          {"lse_max_abs", error.has_lse ? json_number(error.lse_max_abs) : nlohmann::json(nullptr)},
          {"nonfinite_mismatches", error.nonfinite_mismatches}};
}

nlohmann::json outcome_json(const HypothesisOutcome& outcome) {
  return {{"hypothesis", outcome.hypothesis},      {"transform", outcome.transform},
          {"after", error_json(outcome.after)},    {"explains", outcome.explains},
          {"excess", json_number(outcome.excess)}, {"reasons", outcome.reasons}};
}

nlohmann::json diagnosis_json(const DiagnosisFinding& finding) {
  nlohmann::json explained_by = nlohmann::json::array();
  for (const HypothesisOutcome& outcome : finding.explained_by) {
    explained_by.push_back(outcome_json(outcome));
  }
  return {{"step", finding.step},
          {"layer", finding.layer_id},
          {"comparison", comparison_name(finding.comparison)},
          {"before", error_json(finding.before)},
          {"explained", !finding.explained_by.empty()},
          {"explained_by", std::move(explained_by)},
          {"indistinguishable", finding.explained_by.size() > 1},
          {"same_computation", finding.same_computation},
          {"closest", finding.closest ? outcome_json(*finding.closest) : nlohmann::json(nullptr)},
          {"hypotheses_tried", finding.tried},
          {"not_applicable", finding.not_applicable},
          {"summary", diagnosis_summary(finding)}};
}

nlohmann::json captured_pool_cost_json(const std::optional<CapturedPoolCost>& cost) {
  if (!cost) return nullptr;
  auto optional_int = [](int value) {
    return value >= 0 ? nlohmann::json(value) : nlohmann::json(nullptr);
  };
  return {{"damaged_since_step", optional_int(cost->damaged_since_step)},
          {"shows", cost->shows},
          {"step", optional_int(cost->step)},
          {"layer", cost->shows ? nlohmann::json(cost->layer_id) : nlohmann::json(nullptr)},
          {"cost", cost->shows ? error_json(cost->cost) : nlohmann::json(nullptr)}};
}

nlohmann::json divergence_json(const std::optional<Divergence>& divergence) {
  if (!divergence) return nullptr;
  return {{"step", divergence->step},       {"layer_id", divergence->layer_id},
          {"request", divergence->request}, {"row", divergence->row},
          {"head", divergence->head},       {"comparison", comparison_name(divergence->comparison)},
          {"reason", divergence->reason}};
}

nlohmann::json timing_json(const CheckRun& run) {
  const nlohmann::json throughput =
      run.reference_seconds > 0.0
          ? json_number(run.reference_rows_heads_tokens / run.reference_seconds)
          : nlohmann::json(nullptr);
  return {{"reference_device", run.reference_device},
          {"reference_seconds", json_number(run.reference_seconds)},
          {"reference_rows_heads_tokens", json_number(run.reference_rows_heads_tokens)},
          {"reference_throughput_rows_heads_tokens_per_s", throughput},
          {"backend_seconds", json_number(run.backend_seconds)},
          {"read_seconds", json_number(run.read_seconds)},
          {"judge_seconds", json_number(run.judge_seconds)},
          {"diagnosis_seconds", json_number(run.diagnosis_seconds)},
          {"certification_seconds", json_number(run.certification_seconds)},
          {"total_seconds", json_number(run.total_seconds)},
          {"backend_protocol", run.backend_protocol}};
}

// The reference's certification: the bound, each sample, and the largest deviations (derived).
nlohmann::json certification_json(const std::vector<CertificationSample>& samples) {
  nlohmann::json items = nlohmann::json::array();
  for (const CertificationSample& s : samples) {
    items.push_back({{"step", s.step},
                     {"layer", s.layer_id},
                     {"row", s.row},
                     {"head", s.head},
                     {"out_relative", json_number(s.out_relative)},
                     {"lse_absolute", json_number(s.lse_absolute)}});
  }
  const CertificationMaxima maxima = certification_maxima(samples);
  return {{"method",
           "R8 of one (row, head) per sample site recomputed in 50 decimal digits (Boost "
           "cpp_bin_float_50) and compared with the run's reference"},
          {"bound", json_number(kReferenceBound)},
          {"samples", std::move(items)},
          {"max_out_relative", json_number(maxima.out_relative)},
          {"max_lse_absolute", json_number(maxima.lse_absolute)}};
}

nlohmann::json merged_part_json(const MergedPart& part) {
  return {{"file", part.file},
          {"shard", part.shard},
          {"host", part.host},
          {"date", part.date_utc},
          {"command_line", part.command_line}};
}

// merged_from only in a merged run's report, so that other reports keep their keys.
nlohmann::json provenance_json(const Provenance& given) {
  const Provenance provenance = completed_provenance(given);
  nlohmann::json j = {{"host", provenance.host},
                      {"date", provenance.date_utc},
                      {"command_line", provenance.command_line},
                      {"kvaudit_version", provenance.kvaudit_version},
                      {"git_revision", provenance.git_revision},
                      {"cpu", provenance.cpu}};
  if (!provenance.merged_from.empty()) {
    j["merged_from"] = nlohmann::json::array();
    for (const MergedPart& part : provenance.merged_from) {
      j["merged_from"].push_back(merged_part_json(part));
    }
  }
  return j;
}

nlohmann::json coverage_json(const StepLayerCoverage& site) {
  return {{"step", site.step},
          {"layer", site.layer_id},
          {"tokens_read", site.tokens_read},
          {"tokens_without_source", site.tokens_without_source},
          {"codes_read", site.codes_read},
          {"saturated_codes", site.saturated_codes >= 0 ? nlohmann::json(site.saturated_codes)
                                                        : nlohmann::json(nullptr)}};
}

nlohmann::json gap_json(const MeasurementGap& gap) {
  return {{"layer", gap.layer_id},
          {"comparison", comparison_name(gap.comparison)},
          {"reason", gap_reason_name(gap.reason)},
          {"steps", gap.steps},
          {"tokens_read", gap.tokens_read},
          {"tokens_without_source", gap.tokens_without_source}};
}

// Who signed, and the digest of everything else but timing (src/verdict/report_digest.hpp);
// null for a run that is not a sign-off.
void add_signoff(nlohmann::json& j, const std::optional<SignOff>& signoff) {
  if (!signoff) {
    j["signoff"] = nullptr;
    return;
  }
  auto text_or_null = [](const std::string& text) {
    return text.empty() ? nlohmann::json(nullptr) : nlohmann::json(text);
  };
  j["signoff"] = {{"signed_by", text_or_null(signoff->signed_by)},
                  {"model", text_or_null(signoff->model)},
                  {"deployment", text_or_null(signoff->deployment)}};
  j["signoff"]["digest"] = {{"algorithm", kReportDigestAlgorithm},
                            {"covers", kReportDigestCovers},
                            {"value", report_digest(j)}};
}

template <typename T, typename ToJson>
nlohmann::json array_json(const std::vector<T>& items, ToJson to_json_item) {
  nlohmann::json array = nlohmann::json::array();
  for (const T& item : items) array.push_back(to_json_item(item));
  return array;
}

}  // namespace

// Read back by check_run_from_json (check_result_json.cpp): a key added here needs its reader
// there, or the round-trip test over the shipped dumps' reports fails.
nlohmann::json to_json(const CheckRun& run) {
  nlohmann::json j;
  j["tool"] = "kvaudit";
  j["version"] = kvaudit_version();
  j["verdict"] = run.pass() ? "pass" : "fail";
  j["counts"] = counts_json(count_results(run));
  j["backend"] = run.backend;
  j["backend_description"] = object_or_empty(run.backend_description);
  j["policy"] = to_json(run.policy);
  j["dump"] = {{"path", run.dump_path},
               {"sha256", run.dump_sha256},
               {"summary", object_or_empty(run.dump_summary)}};
  j["results"] = array_json(run.comparisons, result_json);
  j["integrity"] = array_json(run.integrity, finding_json);
  j["steps"] = array_json(summarize_steps(run), step_json);
  j["first_divergence"] = divergence_json(run.first_divergence);
  j["diagnosis"] = array_json(run.diagnosis, diagnosis_json);
  j["captured_pool_cost"] = captured_pool_cost_json(captured_pool_cost(run));
  j["certification"] = certification_json(run.certification);
  j["notes"] = run.notes;
  j["coverage"] = array_json(run.coverage, coverage_json);
  j["unmeasured"] = array_json(measurement_gaps(run), gap_json);
  j["timing"] = timing_json(run);
  j["provenance"] = provenance_json(run.provenance);
  add_signoff(j, run.signoff);  // last: its digest covers everything above
  return j;
}

}  // namespace kvaudit
