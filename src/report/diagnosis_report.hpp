// The diagnosis of a check run (CheckRun::diagnosis, src/replay/diagnosis.hpp) for people: the
// "diagnosis:" block of `kvaudit check`'s stdout (after the comparison table), report.md's and
// report.html's "Diagnosis" sections, all built from diagnosis_rows(); and the sentence on what
// the server's captured pool cost (captured_pool_cost, check_result.hpp). Nothing is printed when
// nothing was diagnosed (a clean run) or no captured pool differs.
#pragma once

#include <iosfwd>
#include <optional>
#include <string>
#include <vector>

#include "src/verdict/check_result.hpp"

namespace kvaudit {

// One diagnosis finding in words.
struct DiagnosisRow {
  int step = 0;
  int layer_id = 0;
  std::string comparison;    // "kernel", "captured_read", ...
  std::string finding;       // diagnosis_summary(): what explains it, or the closest
  std::string error_change;  // "rel_l2 0.116 -> 0.0018, lse_max_abs 0.767 -> 2.1e-06, ..."
};
std::vector<DiagnosisRow> diagnosis_rows(const CheckRun& run);

// The introduction of the Diagnosis sections: what was tried and how to read before -> after.
extern const char* const kDiagnosisIntroduction;

// "captured pool cost first shows at step 2 layer 0 (damaged from step 1): ..."; none when the
// captured pool equals the replay's or the dump has none.
std::optional<std::string> captured_pool_cost_text(const CheckRun& run);

// Per finding: "step 0 layer 5 kernel: explained by ..." and the error before -> after.
void print_diagnosis(std::ostream& out, const CheckRun& run);

// "## Diagnosis" with one table row per finding; "" when there is none.
std::string render_diagnosis_markdown(const CheckRun& run);

}  // namespace kvaudit
