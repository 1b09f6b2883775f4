// report.html: one self-contained page (styles inline, charts as inline SVG from
// src/report/svg_chart.hpp, no script, no font or image to fetch: it makes no network request)
// that shows a check run at a glance:
//   - the verdict and what it rests on (comparisons measured, integrity checks, policy, what was
//     not measured), the sign-off block (who signed, the public key, the report checksum);
//   - the summary a person signs and the failures with their likely cause
//     (src/report/report_summary.hpp, the same words as report.md), the diagnosis findings;
//   - a layers x steps heatmap of kernel, cache, quantization and total error (colour = rel_l2
//     against its limit), per-layer error with the policy's limits (log scale), error across steps
//     (prefill steps shaded: does it grow after one?), the integrity timeline (which pools went
//     bad at which step, damage carried), the worst elements;
//   - the dump's summary and the provenance (dump SHA-256, kvaudit version and git revision,
//     backend and its device, CPU, policy with derivations, date, command line).
#pragma once

#include <string>

#include "src/verdict/check_result.hpp"
#include "src/verdict/report_model.hpp"

namespace kvaudit {

// The page, from the report model alone (like render_markdown); the run's overload makes the model.
std::string render_html(const ReportModel& model);
std::string render_html(const CheckRun& run);

// The heatmaps' comparisons, in page order: kernel, cache, quantization, total. Each heatmap has
// one cell per (layer, step) of the run, measured or not: layers x steps x 4 cells in all.
const std::vector<Comparison>& heatmap_comparisons();

}  // namespace kvaudit
