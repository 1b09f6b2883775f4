// The diagnosis of a check run (CheckRun::diagnosis, src/replay/diagnosis.hpp) for people: the
// "diagnosis:" block of `kvaudit check`'s stdout (after the comparison table) and report.md's
// "Diagnosis" section. Both print nothing when nothing was diagnosed (a clean run).
#pragma once

#include <iosfwd>
#include <string>

#include "src/verdict/check_result.hpp"

namespace kvaudit {

// Per finding: "step 0 layer 5 kernel: explained by ..." and the error before -> after.
void print_diagnosis(std::ostream& out, const CheckRun& run);

// "## Diagnosis" with one table row per finding; "" when there is none.
std::string render_diagnosis_markdown(const CheckRun& run);

}  // namespace kvaudit
