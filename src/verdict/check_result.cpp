// The verdict of a check run and what it derives from its results; report.json is written and read
// in src/verdict/report_json.cpp (src/verdict/report_model.hpp).
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
  return !gaps_fail_run(*this) && !scales_fail_run(*this);
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
    case IntegrityCheck::kIndexerWrittenSlots:
      return "indexer_written_slots";
    case IntegrityCheck::kIndexerUnwrittenSlots:
      return "indexer_unwritten_slots";
    case IntegrityCheck::kIndexerTopk:
      return "indexer_topk";
    case IntegrityCheck::kIndexerNonFinite:
      return "indexer_nonfinite";
  }
  return "unknown";
}

bool is_indexer_check(IntegrityCheck check) {
  return check == IntegrityCheck::kIndexerWrittenSlots ||
         check == IntegrityCheck::kIndexerUnwrittenSlots || check == IntegrityCheck::kIndexerTopk ||
         check == IntegrityCheck::kIndexerNonFinite;
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
    case SlotClass::kUnusedSlot:
      return "unused_slot";
    case SlotClass::kRopeSaturated:
      return "rope_saturated";
    case SlotClass::kOther:
      return "other";
  }
  return "unknown";
}

std::string misplaced_row_text(const MisplacedRow& row) {
  const std::string whose = row.request >= 0
                                ? fmt::format("request {} token {}", row.request, row.token)
                                : fmt::format("new_kv row {}", row.new_kv_row);
  return fmt::format("{}'s row, meant for slot {}, landed in slot {}", whose, row.intended_slot,
                     row.slot);
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
    case IntegrityCheck::kIndexerWrittenSlots:  // the indexer's cache: neither attention pool
    case IntegrityCheck::kIndexerUnwrittenSlots:
    case IntegrityCheck::kIndexerTopk:
    case IntegrityCheck::kIndexerNonFinite:
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

std::string closest_text(const HypothesisOutcome& closest, double explain_fraction) {
  // Within the fraction rule but not the limits: the hypothesis carries most of the error and
  // something the catalogue does not model carries the rest.
  const bool carries_most = closest.fraction <= explain_fraction;
  return fmt::format(
      "closest: {}, its replay {:.3g} of the candidate's distance{}, {:.3g}x its limits{}",
      outcome_text(closest), closest.fraction,
      carries_most ? fmt::format(" (within explain_fraction {:g}: it carries most of the error)",
                                 explain_fraction)
                   : "",
      closest.excess, carries_most ? ": the rest is not modelled by the catalogue" : "");
}

}  // namespace

std::string diagnosis_summary(const DiagnosisFinding& finding, double explain_fraction) {
  const std::vector<HypothesisOutcome>& explaining = finding.explained_by;
  if (explaining.empty()) {
    if (finding.tried == 0) {
      return "no hypothesis in the catalogue explains this failure (none applies here)";
    }
    return fmt::format(
        "no hypothesis in the catalogue explains this failure ({} tried{})", finding.tried,
        finding.closest ? "; " + closest_text(*finding.closest, explain_fraction) : std::string());
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

}  // namespace kvaudit
