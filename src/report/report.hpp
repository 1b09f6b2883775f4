// Renderings of a check run (src/verdict/check_result.hpp): the stdout table, and a report
// directory with report.json (the schema of docs/report-schema.md) and report.md (self-contained
// Markdown).
#pragma once

#include <filesystem>
#include <iosfwd>
#include <nlohmann/json.hpp>
#include <string>

#include "src/core/result.hpp"
#include "src/verdict/check_result.hpp"

namespace kvaudit {

// The comparison table, the failing integrity findings, the per-step summary, the verdict line.
void print_check_table(std::ostream& out, const CheckRun& run);

// The parts of print_check_table, for callers that interleave their own lines.
// One row per (step, layer, comparison): step, layer, comparison, max_abs, rel_l2, cos_diff,
// max_ulp, lse_err, NaN/Inf mismatches, PASS/FAIL (with "report-only" where a failure would not
// set the exit status), worst (row,head,dim); then the reasons of the failing rows.
void print_comparison_table(std::ostream& out, const CheckRun& run);
void print_integrity_failures(std::ostream& out, const CheckRun& run);
// The NaN codes the pools hold (nan_codes_in_pool: data, not failures), the first step of each
// layer.
void print_pool_data(std::ostream& out, const CheckRun& run);
// One line per step (summarize_steps): the backend's pool and the captured pool intact or damaged
// (how many slots), and the worst kernel / cache / total rel_l2 over the step's layers.
void print_step_summary(std::ostream& out, const CheckRun& run);
// "verdict: PASS (policy default, backend cpu-fp8, 24 comparisons, 0 failed, ...)"
std::string verdict_summary(const CheckRun& run);

// report.md's text. `report` is the run's report.json object (to_json(run), possibly with the
// caller's extra keys: "first_divergence" and "notes" are rendered when present).
std::string render_markdown(const CheckRun& run, const nlohmann::json& report);

// Creates `dir` (and parents) and writes report.json (pretty-printed) and report.md.
Status write_report_dir(const std::filesystem::path& dir, const CheckRun& run);
Status write_report_dir(const std::filesystem::path& dir, const CheckRun& run,
                        const nlohmann::json& report);

}  // namespace kvaudit
