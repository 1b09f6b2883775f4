// Check-run reports: the stdout table and the report directory (report.json, report.md from
// report_markdown.cpp, report.html from report_html.cpp; docs/report-schema.md,
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
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "src/report/diagnosis_report.hpp"
#include "src/report/report_html.hpp"
#include "src/report/report_signature.hpp"
#include "src/report/report_summary.hpp"
#include "src/verdict/signoff.hpp"

namespace kvaudit {
namespace {

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

}  // namespace

std::string verdict_summary(const CheckRun& run) {
  const RunCounts counts = count_results(run);
  const std::string report_only =
      counts.failed_report_only > 0
          ? fmt::format(", {} failed report-only", counts.failed_report_only)
          : "";
  // Under sign-off, what could not be measured fails the run: the headline says what and where.
  const std::string incomplete =
      gaps_fail_run(run)
          ? fmt::format(" - sign-off incomplete: {}", gaps_headline(measurement_gaps(run)))
          : "";
  // Under sign-off, a served scale the rule rejects: one sentence per layer, cause and remedy.
  std::string scales;
  if (scales_fail_run(run)) {
    for (const ScaleFailure& failure : scale_failures(run)) {
      scales += fmt::format(" - scale: {}", failure.sentence);
    }
  }
  return fmt::format(
      "verdict: {} (policy {}, backend {}, {} comparisons, {} failed{}, {} integrity checks, {} "
      "failed){}{}",
      run.pass() ? "PASS" : "FAIL", run.policy.name, backend_text(run), counts.comparisons,
      counts.failed, report_only, counts.integrity_checks, counts.integrity_failed, incomplete,
      scales);
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
  if (const std::optional<std::string> text = captured_pool_cost_text(run)) {
    fmt::print(out, "{}\n", *text);
  }
}

void print_notes(std::ostream& out, const CheckRun& run) {
  for (const std::string& note : run.notes) fmt::print(out, "note: {}\n", note);
  if (!run.first_divergence) return;
  const Divergence& d = *run.first_divergence;
  fmt::print(out, "first divergence ({}): step {} layer {} request {} row {} head {}{}\n",
             comparison_name(d.comparison), d.step, d.layer_id, d.request, d.row, d.head,
             d.reason.empty() ? "" : ": " + d.reason);
}

namespace {

// "timing on the GPU: reference 12.5 s over 156 calls = prepare 1.2 s, upload 0.8 s, kernels
// 10.1 s, download 0.4 s": the parts of what the timing line counts as reference (or backend)
// time; nothing where that part of the run did not run on a GPU.
void print_device_seconds(std::ostream& out, std::string_view part,
                          const std::optional<DeviceSeconds>& seconds) {
  if (!seconds) return;
  fmt::print(out,
             "timing on the GPU: {} {:.4g} s over {} calls = prepare {:.4g} s, upload {:.4g} s, "
             "kernels {:.4g} s, download {:.4g} s\n",
             part, seconds->total(), seconds->calls, seconds->prepare, seconds->upload,
             seconds->kernels, seconds->download);
}

}  // namespace

void print_timing(std::ostream& out, const CheckRun& run) {
  const double throughput =
      run.reference_seconds > 0.0 ? run.reference_rows_heads_tokens / run.reference_seconds : 0.0;
  const std::string diagnosis =
      run.diagnosis_seconds > 0.0 ? fmt::format(", diagnosis {:.4g} s", run.diagnosis_seconds) : "";
  fmt::print(out,
             "timing: reference ({}) {:.4g} s, backend {:.4g} s, reading the dump {:.4g} s, "
             "comparisons {:.4g} s{}, total {:.4g} s\n"
             "reference throughput: {:.4g} rows*heads*tokens/s ({:.4g} in all)\n",
             run.reference_device, run.reference_seconds, run.backend_seconds, run.read_seconds,
             run.judge_seconds, diagnosis, run.total_seconds, throughput,
             run.reference_rows_heads_tokens);
  if (run.layers_in_flight > 1) {
    fmt::print(out,
               "layers in flight: {} (reference, backend and comparisons are each the sum of the "
               "layers' own times, which overlap: the total is less than their sum)\n",
               run.layers_in_flight);
  }
  if (!run.layers_in_flight_note.empty()) {
    fmt::print(out, "layers in flight: {}\n", run.layers_in_flight_note);
  }
  print_device_seconds(out, "reference", run.reference_device_seconds);
  print_device_seconds(out, "backend", run.backend_device_seconds);
  if (const nlohmann::json& protocol = run.backend_protocol; protocol.is_object()) {
    fmt::print(out,
               "exec backend: started in {:.4g} s; protocol overhead {:.4g} s over {} steps "
               "(backend time minus the compute_seconds it reported)\n",
               protocol.value("startup_seconds", 0.0), protocol.value("overhead_seconds", 0.0),
               protocol.value("steps", 0));
  }
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

namespace {

Status write_text(const std::filesystem::path& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
  if (!out) return bad_input(path.string(), "cannot write the report");
  return ok_status();
}

}  // namespace

Status write_report_dir(const std::filesystem::path& dir, const CheckRun& run,
                        const Ed25519KeyPair* signing_key) {
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error) {
    return bad_input(dir.string(), "cannot create the report directory: " + error.message());
  }
  // report.json, report.md and report.html render one model: the same provenance and checksum.
  const ReportModel model = make_report_model(run);
  if (model.signoff && signing_key == nullptr) {
    return internal_error(dir.string(), "a sign-off report needs its signing key");
  }
  KVAUDIT_TRY(write_text(dir / kReportFiles[0], report_json_text(to_json(model))));
  KVAUDIT_TRY(write_text(dir / kReportFiles[1], render_markdown(model)));
  KVAUDIT_TRY(write_text(dir / kReportFiles[2], render_html(model)));
  if (!model.signoff) return ok_status();
  return sign_report_dir(dir, model, {kReportFiles.begin(), kReportFiles.end()}, *signing_key);
}

}  // namespace kvaudit
