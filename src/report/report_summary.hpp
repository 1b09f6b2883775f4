// What a person reads first in a report, computed once from the run for report.md and
// report.html (src/report/report.cpp, src/report/report_html.cpp): the sentences a sign-off rests
// on ("FP8 storage costs at most rel_l2 X of the output in layer L; the kernel adds at most Y;
// the cache stayed intact across N steps"), the failures with their likely cause (saturated codes
// beside the quantization error they explain, the class of damaged slots), and the per-layer and
// per-step extents the tables and charts draw. Renderers add markup; the words are here, once.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "src/verdict/check_result.hpp"
#include "src/verdict/signoff.hpp"

namespace kvaudit {

// The worst of one comparison over a set of results (rel_l2 first; NaN counts as worst).
struct Extent {
  bool present = false;
  double rel_l2 = 0.0;
  int step = -1;  // where rel_l2 is worst
  int layer_id = -1;
  double over_ref_max = 0.0;  // worst max_abs / max|ref|, anywhere
  bool has_lse = false;
  double lse = 0.0;  // worst lse max abs error, anywhere
  std::size_t count = 0;
  std::size_t failed = 0;  // results that failed their limits (report-only or not)
  std::size_t nonfinite_mismatches = 0;
  void add(const ComparisonResult& result);
};

// Over the whole run, per comparison.
std::map<Comparison, Extent> run_extents(const CheckRun& run);
// Per layer, per comparison (over the layer's steps).
std::map<int, std::map<Comparison, Extent>> layer_extents(const CheckRun& run);

// Saturated codes a layer's steps read (CheckRun::coverage), at the step with the most.
struct Saturation {
  bool known = false;  // an e4m3 pool with coverage
  std::int64_t codes = 0;
  std::int64_t codes_read = 0;
  int step = -1;
  double fraction() const { return codes_read > 0 ? double(codes) / double(codes_read) : 0.0; }
};
std::map<int, Saturation> layer_saturation(const CheckRun& run);
// "1,234 of 560,448 codes read (0.22%) at step 1" / "none of 148,032 codes read" / "n/a (bf16)".
std::string saturation_text(const Saturation& saturation);

// The sorted distinct steps and layers the run reports on.
std::vector<int> run_steps(const CheckRun& run);
std::vector<int> run_layers(const CheckRun& run);

enum class LineState { kPass, kFail, kReportOnly, kUnmeasured, kInfo };
// "PASS", "FAIL", "over the sign-off limit (report-only)", "NOT MEASURED", "".
const char* line_state_text(LineState state);

// One sentence of the summary.
struct SummaryLine {
  LineState state = LineState::kInfo;
  std::string text;
};

// The sentences a sign-off rests on, in order: quantization (FP8 storage), kernel, total,
// captured outputs where the dump has them, cache integrity, and what the policy judged.
std::vector<SummaryLine> summary_lines(const CheckRun& run);

// One failure, grouped per (comparison or check, layer): what failed, where and by how much, and
// its likely cause.
struct FailureItem {
  std::string title;                 // "quantization error over the sign-off limit in layer 5"
  std::vector<std::string> details;  // "step 1: rel_l2 0.577 > 0.0625", saturation, slots
  std::string likely_cause;          // may be empty
  bool sets_exit = true;             // false: report-only under this policy
};
std::vector<FailureItem> failure_items(const CheckRun& run);

// ---- cell texts shared by the stdout table, report.md and report.html --------------------------

// "1.234e-02" (fixed width for the stdout table); "nan", "inf", "-inf".
std::string sci(double value);
// A ULP count without exponent ("32221").
std::string ulp_text(double ulps);
// "(row,head,dim)", dim "lse" for an lse element; "-" for none.
std::string location_text(const ElementLocation& at);
// "PASS" / "FAIL", with " report-only" where a failure would not set the exit status.
std::string result_text(const ComparisonResult& result);
// The run's backend, "none" when empty.
const char* backend_text(const CheckRun& run);
// Where the backend ran, from its description: "cuda-fp8 on NVIDIA H200 (compute capability 9.0,
// driver 12080, CUDA runtime 12060)", "exec:flashinfer-fp8 on NVIDIA H200 (compute capability
// 9.0, driver 580.159.04, torch 2.11.0+cu130, flashinfer 0.6.18)" (only what it names) or
// "cpu-fp8 on the CPU (2 threads)".
std::string backend_machine_text(const CheckRun& run);
// "-" / "intact" / "damaged" / "damaged (12 slots)".
std::string pool_text(PoolState state, std::int64_t slots, const char* unit);
// The captured pool of a step: "damaged (3 new, 5 carried)".
std::string captured_text(const StepSummary& summary);

// "1,234,567": thousands separated, for counts people read.
std::string grouped(std::int64_t value);
// 4 significant digits, "nan"/"inf" for non-finite values.
std::string short_number(double value);

}  // namespace kvaudit
