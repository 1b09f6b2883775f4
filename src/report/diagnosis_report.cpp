// The diagnosis block of stdout and the Diagnosis section of report.md (see diagnosis_report.hpp).
// Errors are quoted as before -> after: before against the comparison's own reference, after
// against the reference recomputed under the hypothesis that explains (or, when none does, the
// closest).
#include "src/report/diagnosis_report.hpp"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <cmath>
#include <iterator>
#include <ostream>

namespace kvaudit {
namespace {

std::string number(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  return fmt::format("{:.3g}", value);
}

// The hypothesis whose errors a finding quotes: the first that explains, else the closest.
const HypothesisOutcome* quoted(const DiagnosisFinding& finding) {
  if (!finding.explained_by.empty()) return &finding.explained_by.front();
  return finding.closest ? &*finding.closest : nullptr;
}

std::string change(double before, const HypothesisOutcome* outcome, double after) {
  return outcome != nullptr ? fmt::format("{} -> {}", number(before), number(after))
                            : number(before);
}

// "rel_l2 0.116 -> 0.0018, lse_max_abs 0.767 -> 2.1e-06, max_abs/ref_max 0.31 -> 0.0029"
std::string error_change(const DiagnosisFinding& finding) {
  const HypothesisOutcome* outcome = quoted(finding);
  const ErrorSummary& before = finding.before;
  const ErrorSummary after = outcome != nullptr ? outcome->after : ErrorSummary{};
  std::string text = fmt::format("rel_l2 {}", change(before.rel_l2, outcome, after.rel_l2));
  if (before.has_lse) {
    text += fmt::format(", lse_max_abs {}", change(before.lse_max_abs, outcome, after.lse_max_abs));
  }
  text += fmt::format(", max_abs/ref_max {}",
                      change(before.max_abs_over_ref_max, outcome, after.max_abs_over_ref_max));
  if (before.nonfinite_mismatches > 0 || after.nonfinite_mismatches > 0) {
    text += fmt::format(", NaN/Inf mismatches {}",
                        outcome != nullptr ? fmt::format("{} -> {}", before.nonfinite_mismatches,
                                                         after.nonfinite_mismatches)
                                           : std::to_string(before.nonfinite_mismatches));
  }
  return text;
}

std::string cell(const std::string& text) {
  std::string escaped;
  for (const char c : text) escaped += c == '|' ? std::string("\\|") : std::string(1, c);
  return escaped;
}

}  // namespace

const char* const kDiagnosisIntroduction =
    "Each failing kernel or captured comparison (at most --diagnose N steps and layers, the "
    "earliest) was recomputed under every hypothesis of the catalogue of convention mismatches "
    "(kvaudit check --list-diagnoses), alone and in combinations, on the pool its candidate read. "
    "A hypothesis explains the failure when the candidate passes the comparison's limits against "
    "it, its replay lands within the policy's explain_fraction of the candidate's distance from "
    "the reference, and it is the closest tried; errors are quoted before -> after (after: the "
    "first hypothesis that explains, else the closest); report.json lists every hypothesis tried "
    "with its distances.";

std::vector<DiagnosisRow> diagnosis_rows(const CheckRun& run) {
  std::vector<DiagnosisRow> rows;
  for (const DiagnosisFinding& finding : run.diagnosis) {
    rows.push_back({finding.step, finding.layer_id, comparison_name(finding.comparison),
                    diagnosis_summary(finding, run.policy.explain_fraction),
                    error_change(finding)});
  }
  return rows;
}

std::optional<std::string> captured_pool_cost_text(const CheckRun& run) {
  const std::optional<CapturedPoolCost> cost = captured_pool_cost(run);
  if (!cost) return std::nullopt;
  const std::string since = cost->damaged_since_step >= 0
                                ? fmt::format(" (damaged from step {})", cost->damaged_since_step)
                                : "";
  if (!cost->shows) {
    return fmt::format(
        "captured pool cost: zero: the captured pool differs from the replay{} but no reported "
        "step reads a damaged slot",
        since);
  }
  const ErrorSummary& e = cost->cost;
  return fmt::format(
      "captured pool cost first shows at step {} layer {}{}: R8 on the captured pool vs R8 "
      "rel_l2 {}, lse_max_abs {}, max_abs/ref_max {}",
      cost->step, cost->layer_id, since, number(e.rel_l2), e.has_lse ? number(e.lse_max_abs) : "-",
      number(e.max_abs_over_ref_max));
}

void print_diagnosis(std::ostream& out, const CheckRun& run) {
  if (run.diagnosis.empty()) return;
  out << "diagnosis (convention mismatches tried on failing comparisons; the catalogue: "
         "--list-diagnoses):\n";
  for (const DiagnosisRow& row : diagnosis_rows(run)) {
    fmt::print(out, "  step {} layer {} {}: {}\n    {}\n", row.step, row.layer_id, row.comparison,
               row.finding, row.error_change);
  }
}

std::string render_diagnosis_markdown(const CheckRun& run) {
  const std::optional<std::string> pool_cost = captured_pool_cost_text(run);
  if (run.diagnosis.empty() && !pool_cost) return "";
  fmt::memory_buffer md;
  auto out = std::back_inserter(md);
  fmt::format_to(out, "## Diagnosis\n\n");
  if (!run.diagnosis.empty()) {
    fmt::format_to(out,
                   "{}\n\n| step | layer | comparison | finding | error before -> after |\n"
                   "| ---: | ---: | --- | --- | --- |\n",
                   kDiagnosisIntroduction);
    for (const DiagnosisRow& row : diagnosis_rows(run)) {
      fmt::format_to(out, "| {} | {} | {} | {} | {} |\n", row.step, row.layer_id, row.comparison,
                     cell(row.finding), cell(row.error_change));
    }
    fmt::format_to(out, "\n");
  }
  if (pool_cost) fmt::format_to(out, "The server's pool: {}.\n\n", *pool_cost);
  return fmt::to_string(md);
}

}  // namespace kvaudit
