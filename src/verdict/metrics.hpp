// Error metrics between a reference tensor and a candidate (docs/design.md "Numerics").
//
// Inputs, for one (step, layer, comparison):
//   reference_out : [num_rows, num_heads, kv_lora_rank] (double; R8 or Rs)
//   candidate_out : same shape (double; a bf16 backend output, a captured output, or R8)
//   reference_lse, candidate_lse : [num_rows, num_heads], natural log
// Metrics, each with the (row, head, dim) of its worst element:
//   max_abs      = max |a - b|;  max_abs_over_ref_max = max_abs / max |a| (its scale-free form)
//   max_rel      = max |a - b| / max(|a|, rel_floor)       (rel_floor stated in the result)
//   rms          = sqrt(mean (a - b)^2)
//   rel_l2       = ||a - b||_2 / ||a||_2
//   cos_diff     = 1 - 2 sum(a b) / sum(a^2 + b^2)          (FlashMLA's)
//   max_ulp_bf16 = max distance in bf16 ULPs between bf16(a) and bf16(b) (ordered bit distance),
//                  over elements with |a| >= max(rel_floor, 2^-4 S), S = max_d |a[row, head, d]|
//                  the scale of the element's (row, head) (kUlpRowFraction, metrics.cpp derives
//                  it): below that an absolute error at the row's scale reads as thousands of
//                  ULPs (a sign change near zero); the absolute metrics judge those elements
//   lse_max_abs  = max |lse_a - lse_b|
//   NaN/Inf counts in each and the number of positions where they disagree (a NaN in one but not
//   the other); these fail a comparison before any norm is looked at. Norms are taken over the
//   elements where both are finite.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <span>
#include <string>

namespace kvaudit {

struct TensorShape3 {
  int rows = 0;
  int heads = 0;
  int dims = 0;
  std::size_t size() const { return static_cast<std::size_t>(rows) * heads * dims; }
};

struct ElementLocation {
  int row = -1;  // step-global query row
  int head = -1;
  int dim = -1;  // -1 for lse
  double reference = 0.0;
  double candidate = 0.0;
};

// The ULP domain's fraction of the (row, head)'s largest |reference| (see max_ulp_bf16 above).
inline constexpr double kUlpRowFraction = 0x1p-4;

struct ComparisonMetrics {
  std::size_t elements = 0;         // out elements compared (rows * heads * dims)
  std::size_t finite_elements = 0;  // out elements where both are finite: the norms' domain
  double max_abs = 0.0;
  ElementLocation max_abs_at;
  double max_rel = 0.0;
  double rel_floor = 0.0;
  ElementLocation max_rel_at;
  double rms = 0.0;
  double rel_l2 = 0.0;
  double cos_diff = 0.0;
  double max_ulp_bf16 = 0.0;
  ElementLocation max_ulp_at;
  double reference_max_abs = 0.0;  // max |a|, the scale the errors are read against
  bool has_lse = false;
  double lse_max_abs = 0.0;
  ElementLocation lse_max_abs_at;
  std::size_t reference_nonfinite = 0;  // NaN or Inf in out and lse
  std::size_t candidate_nonfinite = 0;
  std::size_t nonfinite_mismatches = 0;  // positions finite in one, not the other (or NaN vs Inf)
  ElementLocation first_nonfinite_mismatch;
};

// rel_floor: denominators below it are replaced by it (so near-zero outputs do not dominate);
// finite and >= 0, else std::invalid_argument. threads: how many threads share the work (0: every
// core); the result is bit-for-bit the same for any count (metrics.cpp: the sums run in a fixed
// order).
ComparisonMetrics compare_outputs(TensorShape3 shape, std::span<const double> reference_out,
                                  std::span<const double> candidate_out,
                                  std::span<const double> reference_lse,
                                  std::span<const double> candidate_lse, double rel_floor,
                                  int threads = 0);

// |error| / max|reference|, the scale-free form of an absolute error: 0 for 0/0, +inf for x/0 (an
// error against an all-zero reference). The one place this ratio is computed: the policy judges
// max_abs_over_ref_max with it, the first-divergence search each element's error.
double over_reference_max(double abs_error, double reference_max_abs);
// max_abs / reference_max_abs (report.json's metrics.max_abs_over_ref_max).
double max_abs_over_ref_max(const ComparisonMetrics& metrics);

// JSON has no NaN or infinity: a finite double is written as a number, others as the strings
// "nan", "inf", "-inf" (docs/report-schema.md).
nlohmann::json json_number(double value);

nlohmann::json to_json(const ComparisonMetrics& metrics);
nlohmann::json to_json(const ElementLocation& location);

// Ordered distance in bf16 units in the last place between two finite values after rounding each
// to bf16 (adjacent bf16 values are 1 apart, +0 and -0 are 0 apart).
// NaN in either gives +inf; an infinity sits one step past the largest finite bf16.
double bf16_ulp_distance(double a, double b);

// x rounded to the nearest bf16 value, ties to even, in one rounding (no float intermediate);
// overflow gives +-inf as IEEE does. Used by bf16_ulp_distance.
double round_to_bf16(double x);

}  // namespace kvaudit
