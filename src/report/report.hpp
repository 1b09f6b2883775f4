// Renderings of a check run (src/verdict/check_result.hpp): the stdout table, and a report
// directory with report.json (the schema of docs/report-schema.md), report.md (self-contained
// Markdown) and report.html (one self-contained page with charts, src/report/report_html.hpp).
#pragma once

#include <array>
#include <filesystem>
#include <iosfwd>
#include <string>

#include "src/core/ed25519.hpp"
#include "src/core/result.hpp"
#include "src/verdict/check_result.hpp"
#include "src/verdict/report_model.hpp"

namespace kvaudit {

// Everything `kvaudit check` prints after the run: the comparison table, the diagnosis
// (src/report/diagnosis_report.hpp), the failing integrity findings, the pool data, the per-step
// summary, the captured pool's cost, the notes and the first divergence, the timings
// (with_timing: --verbose) and the verdict line.
void print_check_table(std::ostream& out, const CheckRun& run, bool with_timing = false);

// The parts of print_check_table.
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
// Where the server's corrupted pool first costs the outputs something (captured_pool_cost): one
// line once a captured pool differs from the replay, "cost zero" when no reported step reads it.
void print_captured_pool_cost(std::ostream& out, const CheckRun& run);
// "note: ..." per note, then "first divergence (kernel): step 1 layer 3 request 0 row 5 head 2:
// REASON" when there is one.
void print_notes(std::ostream& out, const CheckRun& run);
// The reference's and the backend's wall time, the reference's throughput, and where either ran on
// a GPU, that part's split into host preparation, uploads, kernels and downloads.
void print_timing(std::ostream& out, const CheckRun& run);
// "verdict: PASS (policy default, backend cpu-fp8, 24 comparisons, 0 failed, ...)"; under sign-off
// with quantization or total error unmeasured, " - sign-off incomplete: <what, which layers>".
std::string verdict_summary(const CheckRun& run);

// report.md's text, from the report model alone (report.json is to_json(model),
// src/verdict/report_model.hpp): the verdict, the sign-off block, the summary a person signs, the
// failures with their likely cause, the diagnosis, the details, then the appendices (policy, dump,
// backend, timing, provenance). The run's overload makes the model.
std::string render_markdown(const ReportModel& model);
std::string render_markdown(const CheckRun& run);

// Creates `dir` (and parents) and writes report.json (report_json_text), report.md and report.html,
// all from one report model (make_report_model: the same provenance, filled once). A sign-off run
// (run.signoff) is signed with `signing_key`, which it needs: report.manifest.json and report.sig
// (src/report/report_signature.hpp) over those three files.
Status write_report_dir(const std::filesystem::path& dir, const CheckRun& run,
                        const Ed25519KeyPair* signing_key = nullptr);
// The files write_report_dir writes (for a staging directory's signal-time cleanup): these three,
// and kSignedReportFiles too under sign-off.
inline constexpr std::array<const char*, 3> kReportFiles = {"report.json", "report.md",
                                                            "report.html"};
inline constexpr std::array<const char*, 2> kSignedReportFiles = {"report.manifest.json",
                                                                  "report.sig"};

}  // namespace kvaudit
