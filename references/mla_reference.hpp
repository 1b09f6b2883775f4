// The high-precision CPU reference for MLA attention (docs/kvdump-v1.md "Semantics"). No CUDA here.
//
// For one (step, layer), query row i (token position pos(i), kvdump-v1 causal rule), head h, and
// the visible tokens t = 0 .. pos(i) of the row's request, with (c_t, r_t) the KV row of token t:
//   s_t      = sm_scale * (q_nope[i,h,:] . c_t + q_pe[i,h,:] . r_t)
//   lse[i,h] = ln sum_t exp(s_t)
//   out[i,h] = sum_t exp(s_t - lse) c_t
// Shapes:
//   q_nope : [num_rows, num_heads, kv_lora_rank]     q_pe : [num_rows, num_heads, qk_rope_head_dim]
//   kv rows: [num_slots, kv_lora_rank + qk_rope_head_dim]  (row of slot s; element = value * scale)
//   out    : [num_rows, num_heads, kv_lora_rank]     lse  : [num_rows, num_heads]   (double)
// Tokens a row does not see are never read. A NaN in a visible row is the truth and gives NaN.
//
// Exactness. Every input is a float: q (bf16 or fp32 values), KV values (decoded e4m3 codes,
// bf16 values, or fp32 source values), and the per-tensor multiplier `scale` (kv_scale, a float)
// is kept apart and applied in double-double. Products of two floats are exact in binary64
// (24 + 24 <= 53 bits), so the score dot products need only a compensated sum. A kvdump v1.1
// per_token_group pool's values code * scale (up to 28 bits) are held as two floats hi + lo
// (KvRows::row_lo), each visited like a row of its own: the same exactness, twice the work.
// Where the KV values lie on one fixed grid (KvRows::has_value_grid: every e4m3 pool, integers
// times 2^-9 of at most 18 bits), both sums are made exact by slicing instead of compensation
// (mla_reference.cpp, "Exact slicing": q and the weights cut into fixed-grid slices whose sums
// are integers below 2^53 grid units, so plain binary64 sums are exact by construction; the
// weights' slices, on grids set by each weight's band of exponents, leave at most 2^-88 of each
// weight, inside the bound below; values of more than 20 bits, which would need more than 4
// weight slices, and weights below about 2^-780: the compensated sums).
//
// Accumulation type Acc (CUTLASS-style reference: templated on the compute type, separately from
// the storage types):
//   dd::DoubleDouble (the default) — exact float products, TwoSum-compensated dot products
//       (error <= D u^2 sum_j |q_j k_j|, u = 2^-53), exp/log/div in double-double (~2^-100,
//       references/double_double.hpp), P.V with each weight split so that its products with
//       the values are exact and TwoSum-accumulated (error <= n^2 u^2 sum_t w_t |c_t| in the
//       worst case, n tokens: 2e-25 at n = 4096). So before the final rounding to double the
//       error is ~1e-25 or less relative to sum_t w_t |c_t| on out and absolute on lse, and the
//       result is the double nearest the truth up to that: target relative <= 1e-15 on out,
//       absolute <= 1e-15 on lse (beyond the final rounding to double), checked against Boost
//       cpp_bin_float at 50 and 100 digits (tests/references/test_mla_reference_sliced.cpp checks
//       the nearest-double statement itself against a 100-digit oracle). Throughput at D = 576,
//       16 heads, e4m3 values (`kvaudit bench --cpu-only --cpu-seconds 3`, 2 threads, on a
//       2-core Intel Xeon with AVX-512 and without a GPU, 2026-12-06, three runs alternating with
//       e446bf7): 7.1e6-8.1e6 rows*heads*tokens per second, 0.67-0.74x a plain binary64 loop
//       over the same step in the same run (e446bf7: 5.7e6-6.6e6, 0.79-0.85x; 2026-12-05 before
//       the AVX-512 loops: 1.14-1.74x; the compensated sums before the slicing: 1.50-2.20x under
//       load, 3.26x on a quiet machine). The heads of a query row run together, their tokens in
//       chunks of 64, so that the rows of a chunk are read from memory once for every head.
//       The hot loops have x86-64-v3 clones (AVX2 + FMA) and, where the CPU has x86-64-v4, forms
//       of 8 doubles per vector that give the same bits (a test runs both on such a CPU). The
//       bench's values (|v| < 3.75, 11 bits) take 3 weight slices per band; a calibrated pool
//       (values to 448, 18 bits) takes 4, which beats the register-tiled compensated sum that
//       rows without a value grid (fp32 or bf16 source values) keep.
//   Float50 / Float100 (tags for boost::multiprecision::cpp_bin_float_50/_100, which
//       references/mla_reference.cpp maps them to, so that Boost stays out of this header) — the
//       same formulas evaluated naively in the multiprecision type; slow; they check the default.
//   double — the same naive formulas in binary64; its error (~|s| * 2^-53 in the scores) is
//       what the tests show the default avoids.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "references/double_double.hpp"
#include "references/reference_device.hpp"
#include "references/reference_problem.hpp"
#include "src/core/buffer_cache.hpp"
#include "src/core/result.hpp"
#include "src/format/kvdump.hpp"
#include "src/format/step_indices.hpp"

namespace kvaudit {

// Accumulation in Boost.Multiprecision's cpp_bin_float_50 / cpp_bin_float_100 (50 and 100 decimal
// digits): tags, defined with the Boost types in references/mla_reference.cpp.
struct Float50;
struct Float100;

// The KV rows the reference reads: element (slot, j) = double(row(slot)[j]) * scale(), exactly.
// Rows are stored as floats, which holds every kvdump KV value without loss (e4m3 values, bf16
// values, fp32 source values); the per-tensor kv_scale is kept as the separate multiplier so that
// code * kv_scale is never rounded.
class KvRows {
 public:
  // A view of `values` ([num_slots, row_width], e.g. kv_source), multiplier `scale`, and where
  // given the residuals of each value (row_lo). The values must outlive the KvRows. Their value
  // grid is found on up to `threads` threads (0: every core; the same whatever the count).
  static KvRows from_values(std::span<const float> values, int row_width, double scale = 1.0,
                            std::span<const float> residuals = {}, int threads = 1);
  // The pool decoded exactly: e4m3 codes (NaN codes stay NaN) or bf16 values, multiplier
  // kv_scale. Holds num_slots * row_width floats.
  static KvRows from_pool(const KvPool& pool, float kv_scale);
  // As from_pool, but only the listed slots (e.g. visible_slots(step)), so memory follows the
  // step, not the pool. Reading another slot is an error of the caller (row() returns nullptr).
  // The slots are decoded and scanned on up to `threads` threads (0: every core); each value is
  // its own, so the rows are the same whatever the count.
  static KvRows from_pool_slots(const KvPool& pool, float kv_scale,
                                std::span<const std::int64_t> slots, int threads = 1);

  int row_width() const { return row_width_; }
  std::int64_t num_slots() const { return num_slots_; }
  double scale() const { return scale_; }
  // nullptr for a slot out of range or not held.
  const float* row(std::int64_t slot) const;
  // A per_token_group pool (kvdump v1.1): its values code * group scale carry up to 28 significant
  // bits, so each is held as row[j] + row_lo[j] (two floats, exactly) and scale() is 1.
  // has_residual() is false where every value was a float already (row_lo then returns nullptr).
  bool has_residual() const { return values_lo_ != nullptr; }
  const float* row_lo(std::int64_t slot) const;

  // The fixed grid the held values lie on, the bound the reference's exact sliced sums are built
  // on (mla_reference.cpp, "Exact slicing"): where has_value_grid(), every finite value v is an
  // integer multiple of 2^grid_exponent() and |v| < 2^(grid_exponent() + magnitude_bits()). e4m3
  // values: 2^-9 and at most 18 bits (448 < 2^9). False where a value is infinite, where the rows
  // have residuals, or where the values span more than kMaxGridBits bits (fp32 source values
  // usually do): the reference then takes its compensated path.
  static constexpr int kMaxGridBits = 30;
  bool has_value_grid() const { return has_value_grid_; }
  int grid_exponent() const { return grid_exponent_; }
  int magnitude_bits() const { return magnitude_bits_; }

  // Where the values have no grid as a whole and no residuals (bf16 or fp32 source values, a bf16
  // pool): per row, whether it spans at most kRowGridBits bits, i.e. every finite nonzero value
  // is a multiple of 2^(top - kRowGridBits) where 2^top bounds the row's magnitudes (no infinity;
  // NaNs skipped). Such a row's score dot products are sliced exactly as with a value grid of
  // kRowGridBits bits (mla_reference.cpp, "Exact slicing"); the other rows' stay compensated.
  // (bf16 source rows of 576 Gaussian values span 21 bits at the median, 27 at the 99th
  // percentile.) has_row_grids() is false where the values have a grid as a whole, or residuals.
  static constexpr int kRowGridBits = 27;
  bool has_row_grids() const { return !row_on_grid_.empty(); }
  bool row_on_grid(std::int64_t slot) const;

 private:
  std::uint8_t decode_row(const KvPool& pool, float kv_scale, std::int64_t slot, std::int64_t row);
  void finish_grouped(const KvPool& pool);
  void find_pool_grid(const KvPool& pool, std::uint8_t largest_code, int threads);
  void set_e4m3_value_grid(float largest);
  void find_value_grid(std::span<const float> values, int threads);

  // Every element is decoded into before it is read: no zeroing first, and large ones reuse the
  // last layer's pages (CachedFloats, src/core/buffer_cache.hpp).
  CachedFloats owned_;
  CachedFloats owned_lo_;
  const float* values_lo_ = nullptr;
  const float* values_ = nullptr;
  std::vector<std::int64_t> compact_row_;  // slot -> row of owned_ (-1: absent); empty: identity
  std::int64_t num_slots_ = 0;
  int row_width_ = 0;
  double scale_ = 1.0;
  bool has_value_grid_ = false;
  int grid_exponent_ = 0;
  int magnitude_bits_ = 0;
  std::vector<std::uint8_t> row_on_grid_;  // per row of values_ (not per slot); empty: none found
};

// Runs the reference for one (step, layer). Writes out [Nq, H, Dc] and lse [Nq, H]; returns the
// work done in row*head*token units (sum over rows of visible tokens, times H) for throughput.
// threads = 0 uses std::thread::hardware_concurrency(). Sizes that disagree with attrs/step, a
// visible slot that kv does not hold, or a row whose position is negative give an error.
template <class Acc = dd::DoubleDouble>
Result<std::int64_t> mla_reference_attention(const DumpAttributes& attrs, const StepMeta& step,
                                             std::span<const float> q_nope,
                                             std::span<const float> q_pe, const KvRows& kv,
                                             std::span<double> out, std::span<double> lse,
                                             int threads = 0);

extern template Result<std::int64_t> mla_reference_attention<dd::DoubleDouble>(
    const DumpAttributes&, const StepMeta&, std::span<const float>, std::span<const float>,
    const KvRows&, std::span<double>, std::span<double>, int);
extern template Result<std::int64_t> mla_reference_attention<double>(
    const DumpAttributes&, const StepMeta&, std::span<const float>, std::span<const float>,
    const KvRows&, std::span<double>, std::span<double>, int);
extern template Result<std::int64_t> mla_reference_attention<Float50>(
    const DumpAttributes&, const StepMeta&, std::span<const float>, std::span<const float>,
    const KvRows&, std::span<double>, std::span<double>, int);
extern template Result<std::int64_t> mla_reference_attention<Float100>(
    const DumpAttributes&, const StepMeta&, std::span<const float>, std::span<const float>,
    const KvRows&, std::span<double>, std::span<double>, int);

// How the sliced P.V cuts the softmax weights of rows whose values are integers of
// `magnitude_bits` bits on one grid (mla_reference.cpp, "Exact slicing", which proves the bounds;
// exposed so that tests check them on the code the reference runs). A weight 0 < w < 2 is in band
// j = band_of(w.hi) and is cut into `slices` slices on the grids 2^-(band_bits j + weight_bits k),
// k = 1..slices, leaving at most 2^-88 w; bands after last_band (and every weight where slices is
// 0) take the compensated sum instead.
struct WeightBanding {
  int weight_bits = 0;  // bits per slice (each slice is at most 2^(weight_bits + 1) grid units)
  int slices = 0;       // 0: the compensated P.V for every weight
  int band_bits = 0;
  int last_band = 0;

  int band_of(double weight_hi) const;
};
WeightBanding weight_banding(int magnitude_bits);
// Writes w's `banding.slices` slices for its band `band` (<= last_band) to `out`.
void slice_banded_weight(const WeightBanding& banding, dd::DoubleDouble w, int band, double* out);

// mla_reference_attention<dd::DoubleDouble> on `device` (threads: the CPU's; on the GPU, the host
// threads that gather its inputs and copy out its results).
// On the GPU: an unsupported-input error where this build has no CUDA, an internal error where
// the device fails.
Result<std::int64_t> exact_reference_attention(ReferenceDevice device, const DumpAttributes& attrs,
                                               const StepMeta& step, std::span<const float> q_nope,
                                               std::span<const float> q_pe, const KvRows& kv,
                                               std::span<double> out, std::span<double> lse,
                                               int threads = 0);

}  // namespace kvaudit
