// The high-precision MLA reference (math, shapes and error targets: mla_reference.hpp).
//
// Work is split over (row, head group) units, claimed from an atomic counter by every thread (the
// multiprecision forms: (row, head) pairs). Each (row, head) makes two passes over its visible
// tokens, which the heads of a group take together, chunk by chunk (HeadGroupKernel): scores s_t,
// then, with m = max_t s_t,
//   l = sum_t exp(s_t - m),  acc = sum_t exp(s_t - m) c_t,  out = scale * acc / l,  lse = m + ln l.
// Subtracting m changes nothing mathematically; it keeps exp in range.
#include "references/mla_reference.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <boost/multiprecision/cpp_bin_float.hpp>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <type_traits>

#include "references/mla_reference_cuda.hpp"
#include "src/core/cpu_clones.hpp"
#include "src/core/fp8_e4m3_rows.hpp"
#include "src/core/parallel_for.hpp"

#if defined(KVAUDIT_HAVE_CPU_V3_TARGET)
#include <immintrin.h>
#endif

namespace kvaudit {

// ---- KvRows ------------------------------------------------------------------------------------

KvRows KvRows::from_values(std::span<const float> values, int row_width, double scale,
                           std::span<const float> residuals, int threads) {
  KvRows rows;
  rows.values_ = values.data();
  if (!residuals.empty()) rows.values_lo_ = residuals.data();
  rows.row_width_ = row_width;
  rows.num_slots_ = row_width > 0 ? static_cast<std::int64_t>(values.size()) / row_width : 0;
  rows.scale_ = scale;
  if (residuals.empty()) rows.find_value_grid(values, threads);
  return rows;
}

namespace {

// A grouped pool's values code * scale have up to 28 significant bits: each is held as hi + lo,
// hi = fp32(value) and lo = value - hi (at most 4 significant bits, exact as a float unless it
// falls below float's subnormal range, 2^-149).
void decode_grouped_row(const KvPool& pool, std::int64_t slot, float kv_scale, float* hi,
                        float* lo) {
  for (int c = 0; c < pool.row_width; ++c) {
    const double value = pool.dequantized(slot, c, kv_scale);
    hi[c] = static_cast<float>(value);
    lo[c] = static_cast<float>(value - static_cast<double>(hi[c]));
  }
}

// Returns, for an e4m3 row, the code of its largest finite magnitude with the sign cleared: e4m3
// codes order as their magnitudes do, so the largest value is read off the codes (0x7f, NaN, left
// out); 0 for a bf16 row.
std::uint8_t decode_pool_row(const KvPool& pool, std::int64_t slot, float* dst) {
  if (pool.dtype == KvDtype::kBfloat16) {
    for (int c = 0; c < pool.row_width; ++c) dst[c] = bf16_to_float(pool.bf16_bits(slot, c));
    return 0;
  }
  return e4m3_decode_row(pool.row(slot), pool.row_width, dst);
}

}  // namespace

std::uint8_t KvRows::decode_row(const KvPool& pool, float kv_scale, std::int64_t slot,
                                std::int64_t row) {
  float* hi = owned_.data() + row * row_width_;
  if (!pool.grouped()) return decode_pool_row(pool, slot, hi);
  decode_grouped_row(pool, slot, kv_scale, hi, owned_lo_.data() + row * row_width_);
  return 0;
}

// The value grid of the decoded rows, e4m3 (largest_code from decode_row) or not.
void KvRows::find_pool_grid(const KvPool& pool, std::uint8_t largest_code, int threads) {
  if (has_residual()) return;
  const bool e4m3_values = pool.dtype == KvDtype::kFloat8E4m3fn &&
                           pool.rope_dtype == KvDtype::kFloat8E4m3fn && !pool.grouped();
  if (e4m3_values) return set_e4m3_value_grid(e4m3_value_table()[largest_code]);
  find_value_grid(owned_, threads);
}

// A grouped pool's rows carry their scales (scale 1); the residual array is dropped when every
// value was a float already (power-of-two scales, in range).
void KvRows::finish_grouped(const KvPool& pool) {
  if (!pool.grouped()) return;
  scale_ = 1.0;
  const bool any = std::any_of(owned_lo_.begin(), owned_lo_.end(), [](float v) { return v != 0; });
  if (!any) {
    owned_lo_.clear();
    owned_lo_.shrink_to_fit();
  }
  values_lo_ = owned_lo_.empty() ? nullptr : owned_lo_.data();
}

const float* KvRows::row_lo(std::int64_t slot) const {
  if (values_lo_ == nullptr) return nullptr;
  const float* hi = row(slot);
  return hi == nullptr ? nullptr : values_lo_ + (hi - values_);
}

KvRows KvRows::from_pool(const KvPool& pool, float kv_scale) {
  KvRows rows;
  rows.row_width_ = pool.row_width;
  rows.num_slots_ = pool.num_slots;
  rows.scale_ = kv_scale;
  rows.owned_.resize(static_cast<std::size_t>(pool.num_slots) * pool.row_width);
  if (pool.grouped()) rows.owned_lo_.resize(rows.owned_.size());
  std::uint8_t largest_code = 0;
  for (std::int64_t s = 0; s < pool.num_slots; ++s) {
    largest_code = std::max(largest_code, rows.decode_row(pool, kv_scale, s, s));
  }
  rows.values_ = rows.owned_.data();
  rows.finish_grouped(pool);
  rows.find_pool_grid(pool, largest_code, 1);
  return rows;
}

KvRows KvRows::from_pool_slots(const KvPool& pool, float kv_scale,
                               std::span<const std::int64_t> slots, int threads) {
  KvRows rows;
  rows.row_width_ = pool.row_width;
  rows.num_slots_ = pool.num_slots;
  rows.scale_ = kv_scale;
  rows.compact_row_.assign(static_cast<std::size_t>(pool.num_slots), -1);
  std::int64_t held = 0;
  for (const std::int64_t s : slots) {
    if (s >= 0 && s < pool.num_slots && rows.compact_row_[s] < 0) rows.compact_row_[s] = held++;
  }
  rows.owned_.resize(static_cast<std::size_t>(held) * pool.row_width);
  if (pool.grouped()) rows.owned_lo_.resize(rows.owned_.size());
  // Each held slot decodes into its own row, so the threads share the slots freely.
  constexpr std::int64_t kSlotsPerUnit = 1024;
  const auto units = static_cast<std::size_t>((pool.num_slots + kSlotsPerUnit - 1) / kSlotsPerUnit);
  std::vector<std::uint8_t> unit_largest_code(units, 0);
  parallel_for(units, threads, [&] {
    return [&](std::size_t unit) {
      const std::int64_t first = static_cast<std::int64_t>(unit) * kSlotsPerUnit;
      const std::int64_t end = std::min(pool.num_slots, first + kSlotsPerUnit);
      std::uint8_t largest = 0;
      for (std::int64_t s = first; s < end; ++s) {
        const std::int64_t row = rows.compact_row_[s];
        if (row >= 0) largest = std::max(largest, rows.decode_row(pool, kv_scale, s, row));
      }
      unit_largest_code[unit] = largest;
    };
  });
  rows.values_ = rows.owned_.data();
  rows.finish_grouped(pool);
  const std::uint8_t largest_code =
      units == 0 ? 0 : *std::max_element(unit_largest_code.begin(), unit_largest_code.end());
  rows.find_pool_grid(pool, largest_code, threads);
  return rows;
}

namespace {

// The exponents of a finite nonzero float v: v is a multiple of 2^low and |v| < 2^top.
struct FloatExponents {
  int low = 0;
  int top = 0;
};
FloatExponents float_exponents(float v) {
  const auto bits = std::bit_cast<std::uint32_t>(v);
  const int field = static_cast<int>(bits >> 23 & 0xffu);
  const std::uint32_t mantissa = bits & 0x7fffffu;
  if (field == 0) {  // subnormal: mantissa * 2^-149
    return {-149 + std::countr_zero(mantissa), -149 + static_cast<int>(std::bit_width(mantissa))};
  }
  const std::uint32_t significand = mantissa | (1u << 23);  // significand * 2^(field - 150)
  return {field - 150 + std::countr_zero(significand), field - 126};
}

}  // namespace

namespace {

// What one row's finite nonzero values span: the bits of the largest magnitude, the lowest
// last-bit exponent (+ 150, as float_exponents' low + 150), and whether the row holds an infinity
// (NaNs are skipped). Maximum, minimum and "any" are exact and order-free, so rows' spans merge
// into the span of all values whatever the threads.
struct RowSpan {
  static constexpr std::int32_t kNone = 1 << 20;
  std::int32_t largest = 0;
  std::int32_t lowest = kNone;
  bool infinite = false;

  void merge(const RowSpan& other) {
    largest = std::max(largest, other.largest);
    lowest = std::min(lowest, other.lowest);
    infinite = infinite || other.infinite;
  }
  // Whether the values span at most `bits` bits (top - lowest last bit) with no infinity.
  bool at_most(int bits) const {
    if (infinite) return false;
    if (largest == 0) return true;
    return float_exponents(std::bit_cast<float>(largest)).top - (lowest - 150) <= bits;
  }
};

// One pass on the row's bits that the compiler vectorises: a value's last bit is its exponent (at
// least 1 for subnormals) - 150 plus the position of its significand's lowest set bit, found as the
// exponent of that bit converted to a float (exact: a power of two).
KVAUDIT_CPU_CLONES_V4
RowSpan row_span(const float* row, int width) {
  std::int32_t largest = 0;              // the largest |v|'s bits among finite values
  std::int32_t lowest = RowSpan::kNone;  // the lowest last-bit exponent, + 150
  std::int32_t infinite = 0;
  for (int j = 0; j < width; ++j) {
    std::int32_t bits_of_v;
    std::memcpy(&bits_of_v, row + j, sizeof bits_of_v);
    const std::int32_t a = bits_of_v & 0x7fffffff;
    const std::int32_t field = a >> 23;
    // Masks and arithmetic rather than branches or selects, which keep GCC from vectorising.
    const std::int32_t keep = -static_cast<std::int32_t>((a != 0) & (field != 0xff));
    const std::int32_t significand = (a & 0x7fffff) | (static_cast<std::int32_t>(field != 0) << 23);
    const std::int32_t lowest_bit = significand & -significand;  // <= 2^23: exact as a float
    const float lowest_bit_value = static_cast<float>(lowest_bit);
    std::int32_t lowest_bit_bits;
    std::memcpy(&lowest_bit_bits, &lowest_bit_value, sizeof lowest_bit_bits);
    const std::int32_t last =
        field + static_cast<std::int32_t>(field == 0) + (lowest_bit_bits >> 23) - 127;
    lowest = std::min(lowest, (last & keep) | (RowSpan::kNone & ~keep));
    largest = std::max(largest, a & keep);
    infinite |= static_cast<std::int32_t>(a == 0x7f800000);
  }
  return {largest, lowest, infinite != 0};
}

}  // namespace

// e4m3 values are multiples of 2^-9 by their format, so their grid follows from the largest
// magnitude alone (at most 18 bits: 448 < 2^9).
void KvRows::set_e4m3_value_grid(float largest) {
  has_value_grid_ = true;
  row_on_grid_.clear();
  const int top = largest == 0.0f ? -9 : float_exponents(largest).top;
  grid_exponent_ = -9;
  magnitude_bits_ = top + 9;
}

// One pass over the rows on up to `threads` threads: each row's span decides the row's grid, and
// their merge the grid of all values (taken where they span at most kMaxGridBits bits, with no
// infinity). Values that are not whole rows are never read (row() ends before them).
void KvRows::find_value_grid(std::span<const float> values, int threads) {
  has_value_grid_ = false;
  row_on_grid_.clear();
  const std::size_t width = static_cast<std::size_t>(row_width_);
  const std::size_t rows = width > 0 ? values.size() / width : 0;
  std::vector<RowSpan> spans(rows);
  constexpr std::size_t kRowsPerUnit = 1024;
  parallel_for((rows + kRowsPerUnit - 1) / kRowsPerUnit, threads, [&] {
    return [&](std::size_t unit) {
      const std::size_t end = std::min(rows, (unit + 1) * kRowsPerUnit);
      for (std::size_t r = unit * kRowsPerUnit; r < end; ++r) {
        spans[r] = row_span(values.data() + r * width, row_width_);
      }
    };
  });
  RowSpan all;
  for (const RowSpan& span : spans) all.merge(span);
  if (all.at_most(kMaxGridBits)) {
    has_value_grid_ = true;
    grid_exponent_ = all.largest == 0 ? 0 : all.lowest - 150;  // no nonzero finite value: 2^0
    magnitude_bits_ = all.largest == 0
                          ? 0
                          : float_exponents(std::bit_cast<float>(all.largest)).top - grid_exponent_;
    return;
  }
  row_on_grid_.resize(rows);
  for (std::size_t r = 0; r < rows; ++r) row_on_grid_[r] = spans[r].at_most(kRowGridBits);
}

bool KvRows::row_on_grid(std::int64_t slot) const {
  if (row_on_grid_.empty()) return false;
  const float* r = row(slot);
  return r != nullptr && row_on_grid_[static_cast<std::size_t>((r - values_) / row_width_)] != 0;
}

const float* KvRows::row(std::int64_t slot) const {
  if (slot < 0 || slot >= num_slots_) return nullptr;
  if (compact_row_.empty()) return values_ + slot * row_width_;
  const std::int64_t r = compact_row_[slot];
  return r < 0 ? nullptr : values_ + r * row_width_;
}

namespace {

using Problem = ReferenceProblem;

// The formulas evaluated as written, in Acc (a multiprecision type, or double).
template <class Acc>
class NaiveKernel {
 public:
  explicit NaiveKernel(const Problem& problem)
      : p_(problem), q_(problem.width()), s_(problem.max_visible), acc_(problem.dc) {}

  void run(int row, int head) {
    using std::exp;
    using std::isnan;
    using std::log;
    const int dc = p_.dc;
    const int width = p_.width();
    const float* qn = p_.q_nope_of(row, head);
    const float* qp = p_.q_pe_of(row, head);
    for (int j = 0; j < dc; ++j) q_[j] = Acc(qn[j]);
    for (int j = 0; j < p_.dr; ++j) q_[dc + j] = Acc(qp[j]);
    const auto& rows = p_.token_rows[p_.request_of_row[row]];
    const std::int64_t n = p_.visible_of_row[row];
    const Acc factor = Acc(p_.sm_scale) * Acc(p_.scale);
    const auto* rows_lo =
        p_.token_rows_lo.empty() ? nullptr : &p_.token_rows_lo[p_.request_of_row[row]];
    auto q_float = [&](int j) { return static_cast<double>(j < dc ? qn[j] : qp[j - dc]); };
    auto value = [&](std::int64_t t, int j) {
      return rows_lo == nullptr ? Acc(rows[t][j]) : Acc(rows[t][j]) + Acc((*rows_lo)[t][j]);
    };
    for (std::int64_t t = 0; t < n; ++t) {
      Acc dot = 0;
      if (rows_lo == nullptr) {
        // q_j k_j of two floats is exact in binary64 (48 significant bits), so it enters Acc
        // as one conversion rather than a multiplication in Acc: the same value, at a third of
        // the multiprecision work (the certification's 50-digit recomputation is this loop).
        for (int j = 0; j < width; ++j) dot += Acc(q_float(j) * static_cast<double>(rows[t][j]));
      } else {
        for (int j = 0; j < width; ++j) dot += q_[j] * value(t, j);
      }
      s_[t] = factor * dot;
      if (isnan(s_[t])) {
        p_.write_nan(row, head);
        return;
      }
    }
    Acc m = s_[0];
    for (std::int64_t t = 1; t < n; ++t) {
      if (s_[t] > m) m = s_[t];
    }
    Acc l = 0;
    for (int d = 0; d < dc; ++d) acc_[d] = 0;
    for (std::int64_t t = 0; t < n; ++t) {
      const Acc e = exp(Acc(s_[t] - m));
      l += e;
      for (int d = 0; d < dc; ++d) acc_[d] += e * value(t, d);
    }
    double* out = p_.out_of(row, head);
    const Acc out_scale = Acc(p_.scale) / l;
    for (int d = 0; d < dc; ++d) out[d] = static_cast<double>(Acc(acc_[d] * out_scale));
    p_.lse[static_cast<std::size_t>(row) * p_.num_heads + head] =
        static_cast<double>(Acc(m + log(l)));
  }

 private:
  const Problem& p_;
  std::vector<Acc> q_;
  std::vector<Acc> s_;
  std::vector<Acc> acc_;
};

// The hot functions are compiled twice on x86-64 Linux (KVAUDIT_CPU_CLONES,
// src/core/cpu_clones.hpp: the x86-64-v3 clone, AVX2 + FMA, where the CPU has it). Contraction into
// FMAs there is harmless: the products in the loops are exact, double_double.hpp's algorithms stay
// error-free under it, and the inexact products (e.lo * c and the like, 2^-106 relative) may only
// round differently between clones, far below the final rounding to double.

// W doubles (W floats) as one vector (GCC/Clang vector extensions): W = 4 is one AVX register in
// x86-64-v3 code (two SSE ones elsewhere), W = 8 one AVX-512 register in x86-64-v4 code. Loops
// written for W lanes are instantiated inside functions compiled for those targets.
template <int W>
struct Lanes;
template <>
struct Lanes<4> {
  using Doubles = double __attribute__((vector_size(32)));
  using Floats = float __attribute__((vector_size(16)));
  using Int64s = long long __attribute__((vector_size(32)));
};
template <>
struct Lanes<8> {
  using Doubles = double __attribute__((vector_size(64)));
  using Floats = float __attribute__((vector_size(32)));
  using Int64s = long long __attribute__((vector_size(64)));
};

// (By reference: a vector return value would differ in ABI between the targets.) Eight floats
// become eight doubles by one vcvtps2pd written out: GCC 12 converts them as two halves joined by
// two shuffles, which compete with the loops' multiply-adds for the same port, and these
// templates, compiled for the default target before they are inlined into x86-64-v4 code, cannot
// call the AVX-512 intrinsic. W = 8 is only instantiated inside such code.
template <int W>
KVAUDIT_DD_INLINE void load_as_doubles(const float* v, typename Lanes<W>::Doubles& out) {
  typename Lanes<W>::Floats f;
  std::memcpy(&f, v, sizeof f);
#if defined(KVAUDIT_HAVE_CPU_V4_TARGET)
  if constexpr (W == 8) {
    asm("vcvtps2pd %1, %0" : "=v"(out) : "v"(f));
    return;
  }
#endif
  out = __builtin_convertvector(f, typename Lanes<W>::Doubles);
}

// dots[t] = sum_j q_j v_t,j for kTokens rows v_t, each product exact in binary64 (float * float)
// and each sum compensated: kLanes = 8 independent TwoSum accumulators per row (their error terms
// summed in plain double: error <= n u^2 sum_j |q_j v_j|, u = 2^-53), combined in double-double.
// Lane k holds the elements j = k mod 8, as 8 / W vectors of W lanes: the same operations on
// every element whatever W and kTokens, so every form gives the same bits. The rows of a tile
// share q's loads, and their chains of additions run side by side.
template <int W, int kTokens>
KVAUDIT_DD_INLINE void compensated_dots_tile(const double* q, const float* const* rows, int width,
                                             dd::DoubleDouble* dots) {
  using Doubles = typename Lanes<W>::Doubles;
  constexpr int kLanes = 8;
  constexpr int kVectors = kLanes / W;
  Doubles hi[kTokens][kVectors] = {};
  Doubles lo[kTokens][kVectors] = {};
  int j = 0;
  for (; j + kLanes <= width; j += kLanes) {
    for (int h = 0; h < kVectors; ++h) {
      Doubles qv;
      std::memcpy(&qv, q + j + W * h, sizeof qv);
      for (int t = 0; t < kTokens; ++t) {
        Doubles vv;
        load_as_doubles<W>(rows[t] + j + W * h, vv);
        const Doubles prod = qv * vv;
        const Doubles s = hi[t][h] + prod;
        const Doubles bb = s - hi[t][h];
        lo[t][h] += (hi[t][h] - (s - bb)) + (prod - bb);
        hi[t][h] = s;
      }
    }
  }
  for (int t = 0; t < kTokens; ++t) {
    double tail_hi = 0.0;
    double tail_lo = 0.0;
    for (int jj = j; jj < width; ++jj) {
      const double prod = q[jj] * static_cast<double>(rows[t][jj]);
      const double s = tail_hi + prod;
      const double bb = s - tail_hi;
      tail_lo += (tail_hi - (s - bb)) + (prod - bb);
      tail_hi = s;
    }
    dd::DoubleDouble sum = dd::two_sum(tail_hi, tail_lo);
    for (int h = 0; h < kVectors; ++h) {
      for (int k = 0; k < W; ++k) sum = dd::add(sum, dd::two_sum(hi[t][h][k], lo[t][h][k]));
    }
    dots[t] = sum;
  }
}

// The dots of n rows, kTokens at a time (4 with 8 lanes, 2 with 4: what the registers hold); the
// last group repeats its last row where n is not a multiple of kTokens (computed and dropped).
template <int W>
KVAUDIT_DD_INLINE void compensated_dots_lanes(const double* q, const float* const* rows,
                                              std::int64_t n, int width, dd::DoubleDouble* dots) {
  constexpr int kTokens = W == 8 ? 4 : 2;
  for (std::int64_t t = 0; t < n; t += kTokens) {
    const float* tile[kTokens];
    for (int i = 0; i < kTokens; ++i) tile[i] = rows[std::min<std::int64_t>(t + i, n - 1)];
    dd::DoubleDouble tile_dots[kTokens];
    compensated_dots_tile<W, kTokens>(q, tile, width, tile_dots);
    const int valid = static_cast<int>(std::min<std::int64_t>(kTokens, n - t));
    std::copy_n(tile_dots, valid, dots + t);
  }
}

KVAUDIT_CPU_CLONES
void compensated_dots_4(const double* q, const float* const* rows, std::int64_t n, int width,
                        dd::DoubleDouble* dots) {
  compensated_dots_lanes<4>(q, rows, n, width, dots);
}
#if defined(KVAUDIT_HAVE_CPU_V4_TARGET)
KVAUDIT_CPU_V4_TARGET
void compensated_dots_8(const double* q, const float* const* rows, std::int64_t n, int width,
                        dd::DoubleDouble* dots) {
  compensated_dots_lanes<8>(q, rows, n, width, dots);
}
#endif

// dots[t] = q . rows[t] (width values each) for t < n, compensated.
void compensated_dots(const double* q, const float* const* rows, std::int64_t n, int width,
                      dd::DoubleDouble* dots) {
#if defined(KVAUDIT_HAVE_CPU_V4_TARGET)
  if (kvaudit_cpu_use_v4()) return compensated_dots_8(q, rows, n, width, dots);
#endif
  compensated_dots_4(q, rows, n, width, dots);
}

// acc += e * v over v's first n elements (e double-double, v floats), acc as (hi, lo) arrays.
// e.hi = h1 + h2 with <= 26 and <= 27 significant bits: h1 * c and h2 * c are exact (c is a
// float), and are added with TwoSum; e.lo * c is 2^-53 smaller, so its rounding is below 2^-106.
// The form for CPUs without fused multiply-add (17 operations per element); where the x86-64-v3
// clone would apply, accumulate_weighted_rows takes the fma form instead, so it has no clones.
void accumulate_weighted_row_split(dd::DoubleDouble e, const float* v, int n, double* acc_hi,
                                   double* acc_lo) {
  double h1, h2;
  dd::split_truncate(e.hi, h1, h2);
  const double el = e.lo;
  for (int d = 0; d < n; ++d) {
    const double c = v[d];
    const double p1 = h1 * c;
    const double p2 = h2 * c;
    const double s1 = acc_hi[d] + p1;
    double bb = s1 - acc_hi[d];
    const double e1 = (acc_hi[d] - (s1 - bb)) + (p1 - bb);
    const double s2 = s1 + p2;
    bb = s2 - s1;
    const double e2 = (s1 - (s2 - bb)) + (p2 - bb);
    acc_hi[d] = s2;
    acc_lo[d] += (e1 + e2) + el * c;
  }
}

#if defined(KVAUDIT_HAVE_CPU_V3_TARGET)
// The same sum where fused multiply-add is an instruction (10 operations per element): the
// product e.hi * c is p + p_error exactly (TwoProd: p = fma(e.hi, c, 0), the product rounded
// once, p_error = fma(e.hi, c, -p)), p is added with TwoSum and p_error + e.lo * c go to the low
// word, as in the GPU reference. p is made by an fma call rather than `e.hi * c` so that the
// compiler cannot contract it into the TwoSum's additions (that would change what the TwoSum's
// error term means); every other product here is exact or lands in the low word.
KVAUDIT_CPU_V3_TARGET
void accumulate_weighted_row_fma(dd::DoubleDouble e, const float* v, int n, double* acc_hi,
                                 double* acc_lo) {
  const double h = e.hi;
  const double el = e.lo;
  for (int d = 0; d < n; ++d) {
    const double c = v[d];
    const double p = __builtin_fma(h, c, 0.0);
    const double p_error = __builtin_fma(h, c, -p);
    const double s = acc_hi[d] + p;
    const double bb = s - acc_hi[d];
    const double err = (acc_hi[d] - (s - bb)) + (p - bb);
    acc_hi[d] = s;
    acc_lo[d] += err + __builtin_fma(el, c, p_error);
  }
}
#endif

// exp in double-double (references/double_double.hpp), cloned so that its two_prod calls become
// fused multiply-add instructions where the CPU has them.
KVAUDIT_CPU_CLONES
dd::DoubleDouble weight_exp(dd::DoubleDouble x) { return dd::exp(x); }

#if defined(KVAUDIT_HAVE_CPU_V3_TARGET)
// dd::exp of W arguments at once (W = 4 where the CPU has AVX2 + FMA, 8 where it has AVX-512): the
// same operations in the same order as references/double_double.hpp's exp, one lane per argument
// (two_prod's fused multiply-add as the vector instruction), so each lane's result is the scalar
// function's. Used where all W arguments lie in [-708, 709] (2^k then a normal double, the
// scalar's plain branch); the caller takes the scalar form for others. The weights are a quarter
// of the reference's time otherwise. The helpers are templates of the default target, inlined
// into the x86-64-v3 and -v4 functions below; their two target instructions (the fused
// multiply-subtract, the rounding to an integer) are written as asm, which, unlike the
// intrinsics, such templates may contain.
template <int W>
struct DdLanes {
  typename Lanes<W>::Doubles hi;
  typename Lanes<W>::Doubles lo;
};

// p becomes a * b - p rounded once (vfmsub231pd: ymm where W = 4, zmm where W = 8).
template <int W>
KVAUDIT_DD_INLINE void fused_product_error(typename Lanes<W>::Doubles a,
                                           typename Lanes<W>::Doubles b,
                                           typename Lanes<W>::Doubles& p) {
  if constexpr (W == 8) {
    asm("vfmsub231pd %2, %1, %0" : "+v"(p) : "v"(a), "v"(b));
  } else {
    asm("vfmsub231pd %2, %1, %0" : "+x"(p) : "x"(a), "x"(b));
  }
}

// Each lane of v rounded to the nearest integer, ties to even (as std::nearbyint in the default
// rounding mode).
template <int W>
KVAUDIT_DD_INLINE void round_to_integer(typename Lanes<W>::Doubles& v) {
  if constexpr (W == 8) {
    asm("vrndscalepd $0, %0, %0" : "+v"(v));
  } else {
    asm("vroundpd $0, %0, %0" : "+x"(v));
  }
}

template <int W>
KVAUDIT_DD_INLINE DdLanes<W> two_sum_lanes(typename Lanes<W>::Doubles a,
                                           typename Lanes<W>::Doubles b) {
  const auto s = a + b;
  const auto bb = s - a;
  return {s, (a - (s - bb)) + (b - bb)};
}
template <int W>
KVAUDIT_DD_INLINE DdLanes<W> fast_two_sum_lanes(typename Lanes<W>::Doubles a,
                                                typename Lanes<W>::Doubles b) {
  const auto s = a + b;
  return {s, b - (s - a)};
}
template <int W>
KVAUDIT_DD_INLINE DdLanes<W> two_prod_lanes(typename Lanes<W>::Doubles a,
                                            typename Lanes<W>::Doubles b) {
  const auto p = a * b;
  auto error = p;
  fused_product_error<W>(a, b, error);
  return {p, error};
}
template <int W>
KVAUDIT_DD_INLINE DdLanes<W> add_lanes(DdLanes<W> a, DdLanes<W> b) {
  const DdLanes<W> s = two_sum_lanes<W>(a.hi, b.hi);
  const DdLanes<W> t = two_sum_lanes<W>(a.lo, b.lo);
  const DdLanes<W> u = fast_two_sum_lanes<W>(s.hi, s.lo + t.hi);
  return fast_two_sum_lanes<W>(u.hi, t.lo + u.lo);
}
template <int W>
KVAUDIT_DD_INLINE DdLanes<W> add_lanes(DdLanes<W> a, typename Lanes<W>::Doubles b) {
  const DdLanes<W> s = two_sum_lanes<W>(a.hi, b);
  return fast_two_sum_lanes<W>(s.hi, s.lo + a.lo);
}
template <int W>
KVAUDIT_DD_INLINE DdLanes<W> mul_lanes(DdLanes<W> a, typename Lanes<W>::Doubles b) {
  const DdLanes<W> p = two_prod_lanes<W>(a.hi, b);
  return fast_two_sum_lanes<W>(p.hi, p.lo + a.lo * b);
}
template <int W>
KVAUDIT_DD_INLINE DdLanes<W> mul_lanes(DdLanes<W> a, DdLanes<W> b) {
  const DdLanes<W> p = two_prod_lanes<W>(a.hi, b.hi);
  return fast_two_sum_lanes<W>(p.hi, p.lo + (a.hi * b.lo + a.lo * b.hi));
}

// 2^k for integral k in -1022..1023 (as the scalar power_of_two): k + 1023 + 2^52 holds k + 1023
// in its low mantissa bits, which then move to the exponent field.
template <int W>
KVAUDIT_DD_INLINE void power_of_two_lanes(typename Lanes<W>::Doubles k,
                                          typename Lanes<W>::Doubles& out) {
  using Int = typename Lanes<W>::Int64s;
  constexpr double kTwo52 = 4503599627370496.0;
  const auto biased = k + (1023.0 + kTwo52);
  const Int field = __builtin_bit_cast(Int, biased) - std::bit_cast<long long>(kTwo52);
  const Int bits = field << 52;
  out = __builtin_bit_cast(typename Lanes<W>::Doubles, bits);
}

// V vectors of W arguments (x and out hold W * V), each step taken for all V before the next:
// the V chains of dependent operations are independent, so the core overlaps them (one chain
// alone waits on each step's latency).
template <int W, int V>
KVAUDIT_DD_INLINE void weight_exp_lanes(const dd::DoubleDouble* x, dd::DoubleDouble* out) {
  using Doubles = typename Lanes<W>::Doubles;
  constexpr double kInverseHi[12] = {
      0x1.0000000000000p-1, 0x1.5555555555555p-2, 0x1.0000000000000p-2, 0x1.999999999999ap-3,
      0x1.5555555555555p-3, 0x1.2492492492492p-3, 0x1.0000000000000p-3, 0x1.c71c71c71c71cp-4,
      0x1.999999999999ap-4, 0x1.745d1745d1746p-4, 0x1.5555555555555p-4, 0x1.3b13b13b13b14p-4};
  constexpr double kInverseLo[12] = {0.0,
                                     0x1.5555555555555p-56,
                                     0.0,
                                     -0x1.999999999999ap-57,
                                     0x1.5555555555555p-57,
                                     0x1.2492492492492p-57,
                                     0.0,
                                     0x1.c71c71c71c71cp-58,
                                     -0x1.999999999999ap-58,
                                     -0x1.745d1745d1746p-59,
                                     0x1.5555555555555p-58,
                                     -0x1.3b13b13b13b14p-58};
  const DdLanes<W> ln2{Doubles{} + dd::kLn2Hi, Doubles{} + dd::kLn2Lo};
  Doubles k[V];
  DdLanes<W> r[V];
  DdLanes<W> t[V];
  for (int v = 0; v < V; ++v) {
    DdLanes<W> a;
    for (int i = 0; i < W; ++i) {
      a.hi[i] = x[v * W + i].hi;
      a.lo[i] = x[v * W + i].lo;
    }
    k[v] = a.hi / dd::kLn2Hi;
    round_to_integer<W>(k[v]);
    r[v] = add_lanes<W>(a, mul_lanes<W>(ln2, -k[v]));
    r[v] = {r[v].hi * 0.03125, r[v].lo * 0.03125};
    t[v] = {Doubles{} + 1.0, Doubles{}};
  }
#pragma GCC unroll 12
  for (int n = 13; n >= 2; --n) {
    const DdLanes<W> inverse{Doubles{} + kInverseHi[n - 2], Doubles{} + kInverseLo[n - 2]};
    for (int v = 0; v < V; ++v) {
      t[v] = add_lanes<W>(mul_lanes<W>(mul_lanes<W>(r[v], inverse), t[v]), Doubles{} + 1.0);
    }
  }
  DdLanes<W> e[V];
  for (int v = 0; v < V; ++v) e[v] = mul_lanes<W>(r[v], t[v]);
  for (int i = 0; i < 5; ++i) {
    for (int v = 0; v < V; ++v) {
      e[v] = add_lanes<W>(DdLanes<W>{2.0 * e[v].hi, 2.0 * e[v].lo}, mul_lanes<W>(e[v], e[v]));
    }
  }
  for (int v = 0; v < V; ++v) {
    const DdLanes<W> y = add_lanes<W>(e[v], Doubles{} + 1.0);
    Doubles scale;
    power_of_two_lanes<W>(k[v], scale);
    const Doubles hi = y.hi * scale;
    const Doubles lo = y.lo * scale;
    for (int i = 0; i < W; ++i) out[v * W + i] = {hi[i], lo[i]};
  }
}

// 4 arguments (AVX2), 16 (AVX-512: two vectors of 8).
KVAUDIT_CPU_V3_TARGET
void weight_exp4(const dd::DoubleDouble* x, dd::DoubleDouble* out) {
  weight_exp_lanes<4, 1>(x, out);
}
#if defined(KVAUDIT_HAVE_CPU_V4_TARGET)
KVAUDIT_CPU_V4_TARGET
void weight_exp16(const dd::DoubleDouble* x, dd::DoubleDouble* out) {
  weight_exp_lanes<8, 2>(x, out);
}
#endif
#endif

// The arguments' exps, W at a time where all W lie in the vector form's range.
template <int W, class VectorExp>
std::int64_t weight_exps_by(const dd::DoubleDouble* x, std::int64_t n, dd::DoubleDouble* out,
                            VectorExp vector_exp) {
  std::int64_t t = 0;
  for (; t + W <= n; t += W) {
    const bool in_range = std::all_of(x + t, x + t + W, [](const dd::DoubleDouble& v) {
      return v.hi >= -708.0 && v.hi <= 709.0;  // false for NaN
    });
    if (in_range) {
      vector_exp(x + t, out + t);
    } else {
      for (int i = 0; i < W; ++i) out[t + i] = weight_exp(x[t + i]);
    }
  }
  return t;
}

// w_t = exp(x_t) for n arguments: 16 at a time where the CPU has AVX-512, then 4 at a time
// where it has AVX2 + FMA, where they lie in the vector forms' range; one at a time otherwise.
// The same values either way.
void weight_exps(const dd::DoubleDouble* x, std::int64_t n, dd::DoubleDouble* out) {
  std::int64_t t = 0;
#if defined(KVAUDIT_HAVE_CPU_V4_TARGET)
  if (kvaudit_cpu_use_v4()) t = weight_exps_by<16>(x, n, out, weight_exp16);
#endif
#if defined(KVAUDIT_HAVE_CPU_V3_TARGET)
  if (kvaudit_cpu_has_v3()) t += weight_exps_by<4>(x + t, n - t, out + t, weight_exp4);
#endif
  for (; t < n; ++t) out[t] = weight_exp(x[t]);
}

// ---- Exact slicing (the path for KV rows with a value grid, KvRows::has_value_grid) ------------
//
// Where every KV value is an integer V times 2^G with |V| < 2^bV (e4m3: G = -9, bV <= 18), a sum
// of products whose other factors all lie on one grid 2^g with magnitude <= 2^b grid units is a
// sum of integers times 2^(g + G); while n * 2^(b + bV) <= 2^53 every partial sum, in any order,
// is an integer below 2^53 in those units and so exact in binary64 (fused multiply-adds
// included: an exact result is not rounded). Both sums of the reference are cut into such slices:
//
// Scores. q (one (row, head), width D) with |q_j| < 2^Eq is cut once into slices on the grids
// g_k = 2^(Eq - bq k), k = 1..Kq (each slice q rounded to its grid, the remainder passed on,
// exactly), bq = 53 - bV - ceil(log2 D): |slice_1| <= 2^bq units, later ones <= 2^(bq - 1). The
// slices stop when the remainder is zero (bf16 q: usually 1, fp32 q: 2 or 3; more than
// kMaxScoreSlices or a non-finite q: the compensated dot below). Each slice's dot product with a
// KV row is exact by the bound above; the Kq exact dots are added in double-double (error
// <= Kq 2^-106 sum_j |q_j k_j|, below the compensated dot's bound). The bound needs only the one
// row's values on a grid 2^G with |V| < 2^bV: where the rows have no grid as a whole (source
// values), a row within KvRows::kRowGridBits bits of its own largest value (KvRows::row_on_grid)
// takes these dots with bV = kRowGridBits, the other rows the compensated dot.
//
// P.V. The weights w_t = exp(s_t - m) (double-double; the largest is 1 up to the score's low
// word, so w_t < 2 unless |m| >= 2^53, where that low word can pass ln 2: a weight of 2 or more
// takes the compensated sum) are cut into Kw slices each, on grids that depend on the weight's
// band: a weight with exponent e = ilogb(w_t) <= 0 is in band j = floor(-e / sb) (band 0 for
// e = 0), so 2^(1 - sb (j + 1)) <= w_t < 2^(1 - sb j), and its slices lie on the grids 2^(-sb j -
// bw k), k = 1..Kw, bw = 44 - bV (weight_slice_bits). Scaled by 2^(sb j) (exact: a power of two)
// the weight is below 2, as band 0's are, so each slice is at most 2^(bw + 1) units of its grid and
// a block of kPvBlockTokens = 2^8 tokens of one band has sum_t |w_t,k V_t,d| <= 2^8 * 2^(bw + 1) *
// 2^bV = 2^53 units: each slice's block sum is exact, accumulated over 16 or 8 dims held in
// registers and added into the (hi, lo) accumulators once per block with TwoSum (tokens are
// grouped by band, in token order within a band, so every block is one band's). The slices leave
// |r_t| <= 2^(-sb j - bw Kw) of each weight; with bw Kw >= 87 + sb that is at most
// 2^(-88 + 1 - sb (j + 1)) <= 2^-88 w_t whatever the band. WeightBanding picks Kw, the fewest
// slices with bands of at least 8 bits (18-bit e4m3 values: bw = 26, Kw = 4, sb = 17), and the
// last band whose finest products stay normal binary64 numbers (so that scaling a slice back by
// 2^(-sb j) and multiplying it by a value are exact); a weight below that band (under 2^-755 to
// 2^-782, by bV) takes the compensated sum, as every token does where Kw would exceed
// kMaxFastWeightSlices. So the truncation costs at most 2^-88 sum_t w_t |c_t| on out (relative to
// the quantity the guarantee of mla_reference.hpp is stated against), for any spread of the
// weights, and the guarantee holds by construction.
constexpr int kMaxScoreSlices = 4;
constexpr int kPvBlockLog2 = 8;
constexpr int kPvBlockTokens = 1 << kPvBlockLog2;
constexpr int kWeightRelativeBits = 88;  // truncation of a sliced weight <= 2^-88 of the weight
constexpr int kMinBandBits = 8;          // bands narrower than this would mean many small blocks
// More weight slices than this cost more than the register-tiled compensated sum; the sliced P.V
// kernels are instantiated for 1..4.
constexpr int kMaxFastWeightSlices = 4;
// The lowest exponent of a float's last bit (2^-149, the smallest subnormal): a bound on the grid
// of any KV value, which keeps WeightBanding independent of the values.
constexpr int kLowestFloatGrid = -149;

int ceil_log2(int n) {
  return n <= 1 ? 0 : static_cast<int>(std::bit_width(static_cast<unsigned>(n - 1)));
}

// Bits per q slice and per weight slice for rows of `magnitude_bits` and width `width`, 0 where
// the bound leaves too few for slicing to pay.
int score_slice_bits(int magnitude_bits, int width) {
  const int bits = 53 - magnitude_bits - ceil_log2(width);
  return bits >= 8 ? bits : 0;
}
int weight_slice_bits(int magnitude_bits) {
  const int bits = 53 - magnitude_bits - kPvBlockLog2 - 1;  // - 1: w_t < 2
  return bits >= 8 ? bits : 0;
}

// dots[t][k] = sum_j q_slices[k][j] * rows[t][j] for kTokens tokens, W lanes at a time (each sum
// exact: the bound above, so the same bits in any order and for any W).
template <int K, int kTokens, int W>
KVAUDIT_DD_INLINE void sliced_dots_tile(const double* q_slices, const float* const* rows, int width,
                                        double* dots) {
  using Doubles = typename Lanes<W>::Doubles;
  Doubles acc[kTokens][K] = {};
  int j = 0;
  for (; j + W <= width; j += W) {
    Doubles qv[K];
    for (int k = 0; k < K; ++k) std::memcpy(&qv[k], q_slices + k * width + j, sizeof qv[k]);
    for (int t = 0; t < kTokens; ++t) {
      Doubles v;
      load_as_doubles<W>(rows[t] + j, v);
      for (int k = 0; k < K; ++k) acc[t][k] += qv[k] * v;
    }
  }
  for (int t = 0; t < kTokens; ++t) {
    for (int k = 0; k < K; ++k) {
      double sum = 0.0;
      for (int lane = 0; lane < W; ++lane) sum += acc[t][k][lane];
      for (int jj = j; jj < width; ++jj) sum += q_slices[k * width + jj] * rows[t][jj];
      dots[t * K + k] = sum;
    }
  }
}

// The dots of n tokens, kTokens at a time (q slices loaded once per kTokens tokens: as many as
// the registers hold, 16 of W = 4 lanes, 32 of 8); the last group repeats its last row where n
// is not a multiple of kTokens (computed and dropped).
template <int K, int W>
KVAUDIT_DD_INLINE void sliced_dots_impl(const double* q_slices, const float* const* rows,
                                        std::int64_t n, int width, double* dots) {
  constexpr int kTokens = W == 8 || K <= 2 ? 4 : 2;
  for (std::int64_t t = 0; t < n; t += kTokens) {
    const float* tile[kTokens];
    for (int i = 0; i < kTokens; ++i) tile[i] = rows[std::min<std::int64_t>(t + i, n - 1)];
    double tile_dots[kTokens * K];
    sliced_dots_tile<K, kTokens, W>(q_slices, tile, width, tile_dots);
    const int valid = static_cast<int>(std::min<std::int64_t>(kTokens, n - t));
    std::copy_n(tile_dots, valid * K, dots + t * K);
  }
}

template <int W>
KVAUDIT_DD_INLINE void sliced_dots_lanes(int slices, const double* q_slices,
                                         const float* const* rows, std::int64_t n, int width,
                                         double* dots) {
  switch (slices) {
    case 1:
      return sliced_dots_impl<1, W>(q_slices, rows, n, width, dots);
    case 2:
      return sliced_dots_impl<2, W>(q_slices, rows, n, width, dots);
    case 3:
      return sliced_dots_impl<3, W>(q_slices, rows, n, width, dots);
    default:
      return sliced_dots_impl<4, W>(q_slices, rows, n, width, dots);
  }
}

KVAUDIT_CPU_CLONES
void sliced_dots_4(int slices, const double* q_slices, const float* const* rows, std::int64_t n,
                   int width, double* dots) {
  sliced_dots_lanes<4>(slices, q_slices, rows, n, width, dots);
}
#if defined(KVAUDIT_HAVE_CPU_V4_TARGET)
KVAUDIT_CPU_V4_TARGET
void sliced_dots_8(int slices, const double* q_slices, const float* const* rows, std::int64_t n,
                   int width, double* dots) {
  sliced_dots_lanes<8>(slices, q_slices, rows, n, width, dots);
}
#endif

void sliced_dots(int slices, const double* q_slices, const float* const* rows, std::int64_t n,
                 int width, double* dots) {
#if defined(KVAUDIT_HAVE_CPU_V4_TARGET)
  if (kvaudit_cpu_use_v4()) return sliced_dots_8(slices, q_slices, rows, n, width, dots);
#endif
  sliced_dots_4(slices, q_slices, rows, n, width, dots);
}

// P.V of one block of n <= 2^8 tokens, in tiles: block[k][d] += sum_t weights[t][k] * rows[t][d]
// for tokens [t0, t1) and kVectors * W dims from d0, the dims held in registers through the
// tokens. Every slice's block sum is exact (the bound above), so the tiles' order cannot change
// a bit. The next tile's rows are prefetched at the same dims: the rows are walked along their
// length, kPvTileTokens at a time, rather than down one column of 256 rows at a time, whose
// 2,304-byte stride the hardware does not prefetch.
constexpr int kPvTileTokens = 8;

template <int K, int kVectors, int W>
KVAUDIT_DD_INLINE void sliced_pv_tile(const double* weights, const float* const* rows, int t0,
                                      int t1, int n, int d0, int dc, double* block) {
  using Doubles = typename Lanes<W>::Doubles;
  Doubles acc[K][kVectors];
  for (int k = 0; k < K; ++k) {
    for (int i = 0; i < kVectors; ++i) {
      std::memcpy(&acc[k][i], block + k * dc + d0 + W * i, sizeof acc[k][i]);
    }
  }
  for (int t = t0; t < t1; ++t) {
    if (t + kPvTileTokens < n) {
      for (int i = 0; i < kVectors * W; i += 16) {
        __builtin_prefetch(rows[t + kPvTileTokens] + d0 + i);
      }
    }
    Doubles v[kVectors];
    for (int i = 0; i < kVectors; ++i) load_as_doubles<W>(rows[t] + d0 + W * i, v[i]);
    for (int k = 0; k < K; ++k) {
      const double w = weights[t * K + k];
      for (int i = 0; i < kVectors; ++i) acc[k][i] += w * v[i];
    }
  }
  for (int k = 0; k < K; ++k) {
    for (int i = 0; i < kVectors; ++i) {
      std::memcpy(block + k * dc + d0 + W * i, &acc[k][i], sizeof acc[k][i]);
    }
  }
}

// Tokens of one block added into its sums per slice, `block` ([K][dc], the block's running
// sums: zero for a new block), tile by tile (dims in groups of kVectors * W, then of W, of 4 after
// 8, then one at a time). A block may take its tokens over several calls: every partial sum is
// exact (the bound above), so how the tokens are split between calls cannot change a bit.
template <int K, int W>
KVAUDIT_DD_INLINE void sliced_pv_impl(const double* weights, const float* const* rows, int n,
                                      int dc, double* block) {
  constexpr int kVectors = W == 8 || K <= 3 ? 4 : 2;
  for (int t0 = 0; t0 < n; t0 += kPvTileTokens) {
    const int t1 = std::min(n, t0 + kPvTileTokens);
    int d = 0;
    for (; d + W * kVectors <= dc; d += W * kVectors) {
      sliced_pv_tile<K, kVectors, W>(weights, rows, t0, t1, n, d, dc, block);
    }
    for (; d + W <= dc; d += W) sliced_pv_tile<K, 1, W>(weights, rows, t0, t1, n, d, dc, block);
    if constexpr (W > 4) {
      for (; d + 4 <= dc; d += 4) sliced_pv_tile<K, 1, 4>(weights, rows, t0, t1, n, d, dc, block);
    }
    for (; d < dc; ++d) {
      for (int k = 0; k < K; ++k) {
        for (int t = t0; t < t1; ++t) block[k * dc + d] += weights[t * K + k] * rows[t][d];
      }
    }
  }
}

template <int W>
KVAUDIT_DD_INLINE void sliced_pv_lanes(int slices, const double* weights, const float* const* rows,
                                       int n, int dc, double* block) {
  switch (slices) {
    case 1:
      return sliced_pv_impl<1, W>(weights, rows, n, dc, block);
    case 2:
      return sliced_pv_impl<2, W>(weights, rows, n, dc, block);
    case 3:
      return sliced_pv_impl<3, W>(weights, rows, n, dc, block);
    default:  // weight_banding never picks more than kMaxFastWeightSlices
      return sliced_pv_impl<4, W>(weights, rows, n, dc, block);
  }
}

KVAUDIT_CPU_CLONES
void sliced_pv_accumulate_4(int slices, const double* weights, const float* const* rows, int n,
                            int dc, double* block) {
  sliced_pv_lanes<4>(slices, weights, rows, n, dc, block);
}
#if defined(KVAUDIT_HAVE_CPU_V4_TARGET)
KVAUDIT_CPU_V4_TARGET
void sliced_pv_accumulate_8(int slices, const double* weights, const float* const* rows, int n,
                            int dc, double* block) {
  sliced_pv_lanes<8>(slices, weights, rows, n, dc, block);
}
#endif

// block[k][d] += sum_t weights[t][k] * rows[t][d] for n <= kPvBlockTokens tokens of one band
// (block: `slices` x dc doubles).
void sliced_pv_accumulate(int slices, const double* weights, const float* const* rows, int n,
                          int dc, double* block) {
#if defined(KVAUDIT_HAVE_CPU_V4_TARGET)
  if (kvaudit_cpu_use_v4()) return sliced_pv_accumulate_8(slices, weights, rows, n, dc, block);
#endif
  sliced_pv_accumulate_4(slices, weights, rows, n, dc, block);
}

// A finished block's exact sums added into acc_hi/acc_lo with TwoSum, largest slice first.
void add_block_sums(int slices, const double* block, int dc, double* acc_hi, double* acc_lo) {
  for (int d = 0; d < dc; ++d) {
    for (int k = 0; k < slices; ++k) {
      const dd::DoubleDouble s = dd::two_sum(acc_hi[d], block[k * dc + d]);
      acc_hi[d] = s.hi;
      acc_lo[d] += s.lo;
    }
  }
}

// value rounded to the grid 2^grid_exponent (exact: a power-of-two scaling, an integer rounding).
inline double round_to_grid(double value, int grid_exponent) {
  return std::nearbyint(value * dd::power_of_two(-grid_exponent)) * dd::power_of_two(grid_exponent);
}

// Cuts w (double-double) into `slices` slices on the grids 2^(-bits k), exactly: w = sum of
// slices + remainder, |remainder| <= 2^(-bits * slices) (half of it, plus the low word's last
// bits). The remainder is renormalised with TwoSum before each cut, so nothing is lost.
inline void slice_weight(dd::DoubleDouble w, int bits, int slices, double* out) {
  for (int k = 1; k <= slices; ++k) {
    w = dd::two_sum(w.hi, w.lo);
    out[k - 1] = round_to_grid(w.hi, -bits * k);
    w.hi -= out[k - 1];  // exact: w.hi and its rounding to a coarser grid share w.hi's last bit
  }
}

}  // namespace

// From the exponent field (ilogb without the library call): a weight below 2^-1022 (subnormal)
// lies far below the last band (about 2^-780) in any banding, and one of 2 or more (or infinite)
// above band 0's bound; both take the compensated sum, as every weight does without slices.
int WeightBanding::band_of(double weight_hi) const {
  const auto field = static_cast<int>(std::bit_cast<std::uint64_t>(weight_hi) >> 52 & 0x7ffu);
  const int e = field - 1023;
  if (field == 0 || e >= 1 || slices == 0) return last_band + 1;
  return e == 0 ? 0 : std::min(-e / band_bits, last_band + 1);
}
WeightBanding weight_banding(int magnitude_bits) {
  WeightBanding banding;
  banding.weight_bits = weight_slice_bits(magnitude_bits);
  if (banding.weight_bits <= 0) return banding;
  const int needed = kWeightRelativeBits - 1 + kMinBandBits;
  const int slices = (needed + banding.weight_bits - 1) / banding.weight_bits;
  if (slices > kMaxFastWeightSlices) return banding;
  banding.slices = slices;
  banding.band_bits = banding.weight_bits * slices - (kWeightRelativeBits - 1);
  // A slice of band j is a multiple of 2^(-sb j - bw Kw); times a value's grid (>= 2^-149) it
  // must stay at or above 2^-1022, the smallest normal double.
  banding.last_band = (1022 + kLowestFloatGrid - banding.weight_bits * slices) / banding.band_bits;
  return banding;
}

// Scaled by 2^(sb j) the weight is below 2 (band 0's case); its slices are scaled back exactly.
void slice_banded_weight(const WeightBanding& banding, dd::DoubleDouble w, int band, double* out) {
  const double up = dd::power_of_two(banding.band_bits * band);
  const double down = dd::power_of_two(-banding.band_bits * band);
  slice_weight({w.hi * up, w.lo * up}, banding.weight_bits, banding.slices, out);
  for (int k = 0; k < banding.slices; ++k) out[k] *= down;
}

namespace {

// The compensated P.V over many (weight, row) entries, in their order: acc += e_i * v_i over the
// first dc values of each row. Where the CPU has AVX2 + FMA, 8 dims (16 with AVX-512) are held in
// registers through all entries (the accumulators loaded and stored once per 8 or 16 dims, not
// once per entry), with per (entry, dim) accumulate_weighted_row_fma's operations in the same
// order: the same bits.
#if defined(KVAUDIT_HAVE_CPU_V3_TARGET)
// Dims [d_begin, dc).
KVAUDIT_CPU_V3_TARGET
void accumulate_weighted_rows_fma(const dd::DoubleDouble* e, const float* const* rows, int n,
                                  int d_begin, int dc, double* acc_hi, double* acc_lo) {
  using Double4 = Lanes<4>::Doubles;
  int d0 = d_begin;
  for (; d0 + 8 <= dc; d0 += 8) {
    Double4 hi[2], lo[2];
    std::memcpy(hi, acc_hi + d0, sizeof hi);
    std::memcpy(lo, acc_lo + d0, sizeof lo);
    for (int t = 0; t < n; ++t) {
      const Double4 h = Double4{} + e[t].hi;
      const Double4 el = Double4{} + e[t].lo;
      for (int i = 0; i < 2; ++i) {
        Double4 c;
        load_as_doubles<4>(rows[t] + d0 + 4 * i, c);
        const Double4 p = _mm256_fmadd_pd(h, c, Double4{});
        const Double4 p_error = _mm256_fmadd_pd(h, c, -p);
        const Double4 sum = hi[i] + p;
        const Double4 bb = sum - hi[i];
        const Double4 err = (hi[i] - (sum - bb)) + (p - bb);
        hi[i] = sum;
        lo[i] += err + static_cast<Double4>(_mm256_fmadd_pd(el, c, p_error));
      }
    }
    std::memcpy(acc_hi + d0, hi, sizeof hi);
    std::memcpy(acc_lo + d0, lo, sizeof lo);
  }
  if (d0 == dc) return;
  for (int t = 0; t < n; ++t) {
    accumulate_weighted_row_fma(e[t], rows[t] + d0, dc - d0, acc_hi + d0, acc_lo + d0);
  }
}
#endif

#if defined(KVAUDIT_HAVE_CPU_V4_TARGET)
// The same with AVX-512, in tiles of kPvTileTokens entries by 16 dims (as sliced_pv_tile, the
// rows walked along their length with the next tile's prefetched): per dim the entries are still
// taken in their order, with the operations of the form above, so the bits are the same. The
// dims left over (dc not a multiple of 16) take the form above. (Written out a second time rather
// than shared as a template: the fused multiply-add intrinsics may only be called from code built
// for their target, which a template instantiated outside it is not.)
// kVectors * 8 dims from d0 over one tile of entries [t0, t1).
template <int kVectors>
KVAUDIT_CPU_V4_TARGET KVAUDIT_DD_INLINE void weighted_rows_tile_fma8(const dd::DoubleDouble* e,
                                                                     const float* const* rows,
                                                                     int t0, int t1, int n, int d0,
                                                                     double* acc_hi,
                                                                     double* acc_lo) {
  using Double8 = Lanes<8>::Doubles;
  Double8 hi[kVectors], lo[kVectors];
  std::memcpy(hi, acc_hi + d0, sizeof hi);
  std::memcpy(lo, acc_lo + d0, sizeof lo);
  for (int t = t0; t < t1; ++t) {
    if (t + kPvTileTokens < n) {
      for (int i = 0; i < kVectors * 8; i += 16)
        __builtin_prefetch(rows[t + kPvTileTokens] + d0 + i);
    }
    const Double8 h = Double8{} + e[t].hi;
    const Double8 el = Double8{} + e[t].lo;
    for (int i = 0; i < kVectors; ++i) {
      Double8 c;
      load_as_doubles<8>(rows[t] + d0 + 8 * i, c);
      const Double8 p = _mm512_fmadd_pd(h, c, Double8{});
      const Double8 p_error = _mm512_fmadd_pd(h, c, -p);
      const Double8 sum = hi[i] + p;
      const Double8 bb = sum - hi[i];
      const Double8 err = (hi[i] - (sum - bb)) + (p - bb);
      hi[i] = sum;
      lo[i] += err + static_cast<Double8>(_mm512_fmadd_pd(el, c, p_error));
    }
  }
  std::memcpy(acc_hi + d0, hi, sizeof hi);
  std::memcpy(acc_lo + d0, lo, sizeof lo);
}

// 32 dims per tile (then 16): one broadcast of each entry's weight serves four vectors.
KVAUDIT_CPU_V4_TARGET
void accumulate_weighted_rows_fma8(const dd::DoubleDouble* e, const float* const* rows, int n,
                                   int dc, double* acc_hi, double* acc_lo) {
  const int dims = dc - dc % 16;
  for (int t0 = 0; t0 < n; t0 += kPvTileTokens) {
    const int t1 = std::min(n, t0 + kPvTileTokens);
    int d0 = 0;
    for (; d0 + 32 <= dims; d0 += 32) {
      weighted_rows_tile_fma8<4>(e, rows, t0, t1, n, d0, acc_hi, acc_lo);
    }
    if (d0 < dims) weighted_rows_tile_fma8<2>(e, rows, t0, t1, n, d0, acc_hi, acc_lo);
  }
  if (dims < dc) accumulate_weighted_rows_fma(e, rows, n, dims, dc, acc_hi, acc_lo);
}
#endif

void accumulate_weighted_rows(const dd::DoubleDouble* e, const float* const* rows, int n, int dc,
                              double* acc_hi, double* acc_lo) {
#if defined(KVAUDIT_HAVE_CPU_V4_TARGET)
  if (kvaudit_cpu_use_v4()) return accumulate_weighted_rows_fma8(e, rows, n, dc, acc_hi, acc_lo);
#endif
#if defined(KVAUDIT_HAVE_CPU_V3_TARGET)
  if (kvaudit_cpu_has_v3()) return accumulate_weighted_rows_fma(e, rows, n, 0, dc, acc_hi, acc_lo);
#endif
  for (int t = 0; t < n; ++t) accumulate_weighted_row_split(e[t], rows[t], dc, acc_hi, acc_lo);
}

// Tokens per chunk where the heads of a row run together (HeadGroupKernel): 64 rows of 576
// floats are 147 KB, which stay in a core's L2 cache while every head of the group reads them.
constexpr std::int64_t kChunkTokens = 64;

// The default: double-double with exact products (see mla_reference.hpp), by exact slicing where
// the KV rows have a value grid and by compensated sums elsewhere. One object is one (row, head)
// at a time, in phases that take the tokens in ranges: begin; score over ranges covering the
// visible tokens in order; weigh; accumulate over ranges in order; end. Each token's score is its
// own, and the P.V sums are taken in the order of one pass over all tokens (accumulate_sliced
// says how), so the ranges change no bit of out or lse.
class DoubleDoubleKernel {
 public:
  explicit DoubleDoubleKernel(const Problem& problem)
      : p_(problem),
        q_(problem.width()),
        q_slices_(static_cast<std::size_t>(kMaxScoreSlices) * problem.width()),
        dots_(static_cast<std::size_t>(kMaxScoreSlices) * kChunkTokens),
        s_(problem.max_visible),
        residual_dots_(problem.token_rows_lo.empty() ? 0 : kChunkTokens),
        split_rows_(problem.token_on_grid.empty() ? 0 : kChunkTokens),
        split_tokens_(split_rows_.size()),
        other_dots_(split_rows_.size()),
        sliced_rows_(kPvBlockTokens),
        entry_weights_(kPvBlockTokens),
        sliced_weights_(static_cast<std::size_t>(kMaxFastWeightSlices) * kPvBlockTokens),
        acc_hi_(problem.dc),
        acc_lo_(problem.dc),
        score_bits_(score_bits_of(problem)),
        banding_(problem.value_grid_bits < 0 ? WeightBanding{}
                                             : weight_banding(problem.value_grid_bits)),
        band_tokens_(banding_.slices > 0 ? problem.max_visible : 0),
        token_band_(band_tokens_.size()),
        band_start_(banding_.slices > 0 ? banding_.last_band + 3 : 0),
        band_fill_(band_start_.size()),
        band_next_(band_start_.size()),
        open_block_(band_start_.size()) {}

  // Phase 0: head `head` of query row `row`: its q, cut into slices where it can be.
  void begin(int row, int head) {
    row_ = row;
    head_ = head;
    std::copy_n(p_.q_nope_of(row, head), p_.dc, q_.begin());
    std::copy_n(p_.q_pe_of(row, head), p_.dr, q_.begin() + p_.dc);
    const int request = p_.request_of_row[row];
    rows_ = p_.token_rows[request].data();
    rows_lo_ = p_.token_rows_lo.empty() ? nullptr : p_.token_rows_lo[request].data();
    on_grid_ = p_.token_on_grid.empty() ? nullptr : p_.token_on_grid[request].data();
    n_ = p_.visible_of_row[row];
    q_slice_count_ = score_bits_ > 0 ? slice_q() : 0;
    finite_ = true;
  }

  // Phase 1 for tokens [t0, t1): s_t = sm_scale * scale * (q . k_t). A NaN score ends the head's
  // work: its out and lse are NaN.
  void score(std::int64_t t0, std::int64_t t1) {
    for (std::int64_t c0 = t0; finite_ && c0 < t1; c0 += kChunkTokens) {
      const std::int64_t c1 = std::min(t1, c0 + kChunkTokens);
      if (q_slice_count_ == 0) {
        score_compensated(c0, c1);
      } else if (on_grid_ != nullptr) {
        score_by_row(c0, c1);
      } else {
        score_sliced(c0, c1);
      }
      finite_ = scale_scores(c0, c1);
    }
  }

  // Phase 2 (every token scored): m = max_t s_t, s_t becomes w_t = exp(s_t - m), l = sum_t w_t.
  void weigh() {
    if (!finite_) return;
    m_ = max_score(n_);
    l_ = weigh_tokens(n_, m_);
    std::fill(acc_hi_.begin(), acc_hi_.end(), 0.0);
    std::fill(acc_lo_.begin(), acc_lo_.end(), 0.0);
    held_ = 0;
    if (banding_.slices == 0) return;
    order_tokens_by_band(n_);
    std::copy(band_start_.begin(), band_start_.end(), band_next_.begin());
    std::fill(open_block_.begin(), open_block_.end(), -1);
    blocks_.clear();
    block_sums_used_ = 0;
  }

  // Phase 3 for tokens [t0, t1): their w_t c_t into acc.
  void accumulate(std::int64_t t0, std::int64_t t1) {
    if (!finite_) return;
    if (banding_.slices > 0) return accumulate_sliced(t1);
    accumulate_compensated(t0, t1);
  }

  // Phase 4: out = scale * acc / l, lse = m + ln l (NaN where a score was).
  void end() {
    if (!finite_) return p_.write_nan(row_, head_);
    if (banding_.slices > 0) {
      add_blocks();
      accumulate_lightest();
    }
    finish();
  }

 private:
  // Bits per q slice: from the rows' value grid, else from the per-row grids' bound; 0 (the
  // compensated dots) where neither exists.
  static int score_bits_of(const Problem& p) {
    if (p.value_grid_bits >= 0) return score_slice_bits(p.value_grid_bits, p.width());
    if (p.row_grid_bits >= 0) return score_slice_bits(p.row_grid_bits, p.width());
    return 0;
  }

  // Phase 1's three forms write q . k_t to s_t for t in [c0, c1), at most kChunkTokens tokens.
  void score_sliced(std::int64_t c0, std::int64_t c1) {
    const std::int64_t n = c1 - c0;
    sliced_dots(q_slice_count_, q_slices_.data(), rows_ + c0, n, p_.width(), dots_.data());
    for (std::int64_t i = 0; i < n; ++i) s_[c0 + i] = sliced_dot(i);
  }

  // Per-row grids: the tokens whose rows span at most row_grid_bits take the sliced dots, the
  // others the compensated ones; each dot is its token's alone, so the split changes no other's.
  void score_by_row(std::int64_t c0, std::int64_t c1) {
    const std::int64_t n = c1 - c0;
    std::int64_t sliced = 0;
    for (std::int64_t t = c0; t < c1; ++t) {
      if (on_grid_[t] == 0) continue;
      split_rows_[sliced] = rows_[t];
      split_tokens_[sliced++] = t;
    }
    std::int64_t other = sliced;
    for (std::int64_t t = c0; t < c1; ++t) {
      if (on_grid_[t] != 0) continue;
      split_rows_[other] = rows_[t];
      split_tokens_[other++] = t;
    }
    const int width = p_.width();
    sliced_dots(q_slice_count_, q_slices_.data(), split_rows_.data(), sliced, width, dots_.data());
    for (std::int64_t i = 0; i < sliced; ++i) s_[split_tokens_[i]] = sliced_dot(i);
    compensated_dots(q_.data(), split_rows_.data() + sliced, n - sliced, width, other_dots_.data());
    for (std::int64_t i = sliced; i < n; ++i) s_[split_tokens_[i]] = other_dots_[i - sliced];
  }

  void score_compensated(std::int64_t c0, std::int64_t c1) {
    const std::int64_t n = c1 - c0;
    const int width = p_.width();
    compensated_dots(q_.data(), rows_ + c0, n, width, s_.data() + c0);
    if (rows_lo_ == nullptr) return;
    compensated_dots(q_.data(), rows_lo_ + c0, n, width, residual_dots_.data());
    for (std::int64_t i = 0; i < n; ++i) s_[c0 + i] = dd::add(s_[c0 + i], residual_dots_[i]);
  }

  // s_t *= sm_scale * scale for t in [c0, c1); false at a NaN score.
  bool scale_scores(std::int64_t c0, std::int64_t c1) {
    const dd::DoubleDouble factor = dd::two_prod(p_.sm_scale, p_.scale);
    for (std::int64_t t = c0; t < c1; ++t) {
      s_[t] = dd::mul(s_[t], factor);
      if (std::isnan(s_[t].hi)) return false;
    }
    return true;
  }

  // The sum of the i-th dot's slices (dots_), largest first, in double-double.
  dd::DoubleDouble sliced_dot(std::int64_t i) const {
    const double* d = dots_.data() + i * q_slice_count_;
    dd::DoubleDouble dot{d[0], 0.0};
    for (int k = 1; k < q_slice_count_; ++k) dot = dd::add(dot, d[k]);
    return dot;
  }

  // Cuts q into slices on the grids 2^(Eq - score_bits_ k) (the bound at the top of this
  // section); returns their number, or 0 where q is not finite or needs more than
  // kMaxScoreSlices (the compensated dot then).
  int slice_q() {
    const int width = p_.width();
    double largest = 0.0;
    for (const double v : q_) {
      if (!std::isfinite(v)) return 0;
      largest = std::max(largest, std::fabs(v));
    }
    const int top = largest == 0.0 ? 0 : float_exponents(static_cast<float>(largest)).top;
    std::copy(q_.begin(), q_.end(), q_slices_.begin());  // the remainder, in slice 0's place
    for (int k = 1; k <= kMaxScoreSlices; ++k) {
      double* slice = q_slices_.data() + (k - 1) * width;
      double* next = slice + width;
      bool rest = false;
      for (int j = 0; j < width; ++j) {
        const double remainder = slice[j];
        slice[j] = round_to_grid(remainder, top - score_bits_ * k);
        const double left = remainder - slice[j];  // exact (see slice_weight)
        if (k < kMaxScoreSlices) next[j] = left;
        rest = rest || left != 0.0;
      }
      if (!rest) return k;
    }
    return 0;
  }

  double max_score(std::int64_t n) const {
    double m = -std::numeric_limits<double>::infinity();
    for (std::int64_t t = 0; t < n; ++t) m = std::max(m, s_[t].hi);
    return m;
  }

  // s_t becomes w_t = exp(s_t - m); returns l = sum_t w_t (in token order).
  dd::DoubleDouble weigh_tokens(std::int64_t n, double m) {
    for (std::int64_t t = 0; t < n; ++t) s_[t] = dd::add(s_[t], -m);
    weight_exps(s_.data(), n, s_.data());
    dd::DoubleDouble l{0.0, 0.0};
    for (std::int64_t t = 0; t < n; ++t) l = dd::add(l, s_[t]);
    return l;
  }

  // Phase 3 (rows without a value grid): acc = sum_t w_t c_t, compensated: each token's row, then
  // its residual row, as entries of blocks of at most kPvBlockTokens. The compensated sum takes
  // its entries one by one, so where a block ends (here: at a range's end too) changes no bit.
  void accumulate_compensated(std::int64_t t0, std::int64_t t1) {
    for (std::int64_t t = t0; t < t1; ++t) {
      add_compensated_entry(s_[t], rows_[t]);
      if (rows_lo_ != nullptr) add_compensated_entry(s_[t], rows_lo_[t]);
    }
    flush_compensated();
  }

  // One (weight, row) entry of a compensated block; a full block is summed into acc.
  void add_compensated_entry(dd::DoubleDouble weight, const float* row) {
    entry_weights_[held_] = weight;
    sliced_rows_[held_++] = row;
    if (held_ == kPvBlockTokens) flush_compensated();
  }
  void flush_compensated() {
    accumulate_weighted_rows(entry_weights_.data(), sliced_rows_.data(), held_, p_.dc,
                             acc_hi_.data(), acc_lo_.data());
    held_ = 0;
  }

  // Phase 3 (rows with a value grid): every token's weight cut into banding_.slices slices on its
  // band's grids, in exact blocks of one band each (tokens in order within a band); weights
  // lighter than the last band take the compensated sum (end). A range adds each band's tokens
  // below t1 not yet taken to that band's open block, which closes at kPvBlockTokens tokens: the
  // blocks of one pass over each band's tokens, with the same exact sums. end() adds them into
  // acc band by band, each band's in order, as one pass would: so the same bits.
  void accumulate_sliced(std::int64_t t1) {
    const int slices = banding_.slices;
    for (int band = 0; band <= banding_.last_band; ++band) {
      int& next = band_next_[band];
      const int band_end = band_start_[band + 1];
      while (next < band_end && band_tokens_[next] < t1) {
        if (open_block_[band] < 0) open_block_[band] = new_block(band);
        SlicedBlock& block = blocks_[static_cast<std::size_t>(open_block_[band])];
        int taken = 0;
        while (next < band_end && band_tokens_[next] < t1 &&
               block.tokens + taken < kPvBlockTokens) {
          const std::int64_t t = band_tokens_[next++];
          slice_banded_weight(banding_, s_[t], band, sliced_weights_.data() + taken * slices);
          sliced_rows_[taken++] = rows_[t];
        }
        sliced_pv_accumulate(slices, sliced_weights_.data(), sliced_rows_.data(), taken, p_.dc,
                             block_sums_.data() + block.offset);
        block.tokens += taken;
        if (block.tokens == kPvBlockTokens) open_block_[band] = -1;
      }
    }
  }

  // A new block of `band` (its sums zero); returns its index in blocks_.
  int new_block(int band) {
    const std::size_t size = static_cast<std::size_t>(banding_.slices) * p_.dc;
    blocks_.push_back({band, 0, block_sums_used_});
    block_sums_used_ += size;
    if (block_sums_.size() < block_sums_used_) block_sums_.resize(block_sums_used_);
    std::fill_n(block_sums_.data() + blocks_.back().offset, size, 0.0);
    return static_cast<int>(blocks_.size()) - 1;
  }

  // The blocks' sums into acc: bands in order, each band's blocks in the order they were opened.
  void add_blocks() {
    std::stable_sort(blocks_.begin(), blocks_.end(),
                     [](const SlicedBlock& a, const SlicedBlock& b) { return a.band < b.band; });
    for (const SlicedBlock& block : blocks_) {
      add_block_sums(banding_.slices, block_sums_.data() + block.offset, p_.dc, acc_hi_.data(),
                     acc_lo_.data());
    }
  }

  // Counting sort of the visible tokens with a nonzero weight by band (exp underflowed to 0:
  // w_t c_t = 0): band_tokens_[band_start_[j] .. band_start_[j + 1]) are band j's, in token order;
  // band last_band + 1 holds the weights too light to slice.
  void order_tokens_by_band(std::int64_t n) {
    const int bands = banding_.last_band + 2;
    std::fill(band_start_.begin(), band_start_.end(), 0);
    for (std::int64_t t = 0; t < n; ++t) {
      token_band_[t] = s_[t].hi != 0.0 ? banding_.band_of(s_[t].hi) : -1;
      ++band_start_[token_band_[t] + 1];
    }
    band_start_[0] = 0;  // the zero weights' count, dropped
    for (int j = 0; j < bands; ++j) band_start_[j + 1] += band_start_[j];
    std::copy_n(band_start_.begin(), bands, band_fill_.begin());
    for (std::int64_t t = 0; t < n; ++t) {
      if (token_band_[t] >= 0) band_tokens_[band_fill_[token_band_[t]]++] = t;
    }
  }

  // The weights below the last band (under about 2^-780 of the largest), compensated.
  void accumulate_lightest() {
    const int band = banding_.last_band + 1;
    for (int i = band_start_[band]; i < band_start_[band + 1]; ++i) {
      add_compensated_entry(s_[band_tokens_[i]], rows_[band_tokens_[i]]);
    }
    flush_compensated();
  }

  void finish() {
    double* out = p_.out_of(row_, head_);
    for (int d = 0; d < p_.dc; ++d) {
      const dd::DoubleDouble acc = dd::two_sum(acc_hi_[d], acc_lo_[d]);
      out[d] = dd::to_double(dd::mul(dd::div(acc, l_), p_.scale));
    }
    p_.lse[static_cast<std::size_t>(row_) * p_.num_heads + head_] =
        dd::to_double(dd::add(dd::log(l_), m_));
  }

  // A sliced P.V block: its band, its tokens so far, where its sums ([slice][dim]) start in
  // block_sums_.
  struct SlicedBlock {
    int band = 0;
    int tokens = 0;
    std::size_t offset = 0;
  };

  const Problem& p_;
  // The (row, head) in hand and what begin() and weigh() found for it.
  int row_ = 0;
  int head_ = 0;
  const float* const* rows_ = nullptr;
  const float* const* rows_lo_ = nullptr;
  const std::uint8_t* on_grid_ = nullptr;  // per-row grids, else nullptr
  std::int64_t n_ = 0;
  int q_slice_count_ = 0;  // 0: the compensated dots
  bool finite_ = true;     // false once a score is NaN
  double m_ = 0.0;
  dd::DoubleDouble l_{0.0, 0.0};
  std::vector<double> q_;
  std::vector<double> q_slices_;  // [kMaxScoreSlices][width]
  std::vector<double> dots_;      // a chunk's, [token][slice]
  std::vector<dd::DoubleDouble> s_;
  std::vector<dd::DoubleDouble> residual_dots_;  // a chunk's q . row_lo, where rows have residuals
  // Per-row grids, a chunk's: the rows of the sliced tokens, then of the compensated ones, with
  // their tokens; the compensated ones' dots.
  std::vector<const float*> split_rows_;
  std::vector<std::int64_t> split_tokens_;
  std::vector<dd::DoubleDouble> other_dots_;
  std::vector<const float*> sliced_rows_;        // a block's rows (sliced or compensated)
  std::vector<dd::DoubleDouble> entry_weights_;  // a compensated block's weights
  int held_ = 0;                                 // entries held in them
  std::vector<double> sliced_weights_;           // [token][slice]
  std::vector<double> acc_hi_;
  std::vector<double> acc_lo_;
  int score_bits_ = 0;                     // bits per q slice; 0: no value grid, compensated scores
  WeightBanding banding_;                  // slices 0: compensated P.V
  std::vector<std::int64_t> band_tokens_;  // visible tokens ordered by band
  std::vector<int> token_band_;            // each token's band (-1: zero weight)
  std::vector<int> band_start_;            // [band + 1]: where each band starts in band_tokens_
  std::vector<int> band_fill_;             // scratch of order_tokens_by_band
  std::vector<int> band_next_;             // per band: its next token not yet taken
  std::vector<int> open_block_;            // per band: its open block in blocks_, else -1
  std::vector<SlicedBlock> blocks_;        // in the order opened
  std::vector<double> block_sums_;         // their sums
  std::size_t block_sums_used_ = 0;
};

// Heads per group, for HeadGroupKernel: every head of a row, unless the rows are too few to keep
// each thread busy (the heads are then split until rows x groups >= 2 x threads) or the group's
// state per visible token would pass 16 MiB a thread: per head, s_, band_tokens_ and token_band_
// (28 bytes a token) and the sliced P.V's block sums (kMaxFastWeightSlices x dc doubles per
// kPvBlockTokens tokens: 64 bytes a token at dc = 512). 4,096 tokens: 44 heads; 128 K: one.
int heads_per_group(const Problem& p, int threads) {
  const int workers = resolve_thread_count(threads);
  int groups = 1;
  while (groups < p.num_heads && static_cast<std::int64_t>(p.num_rows()) * groups < 2 * workers) {
    ++groups;
  }
  const int size = (p.num_heads + groups - 1) / groups;
  constexpr std::int64_t kGroupStateBytes = std::int64_t{16} << 20;
  const std::int64_t per_token =
      28 + 8 * kMaxFastWeightSlices * std::int64_t{p.dc} / kPvBlockTokens;
  const std::int64_t per_head = per_token * std::max<std::int64_t>(p.max_visible, 1);
  return static_cast<int>(std::clamp<std::int64_t>(kGroupStateBytes / per_head, 1, size));
}

// The heads [first, last) of one query row together (MLA: every head reads the same KV rows),
// chunk by chunk of kChunkTokens tokens: a chunk's rows come from memory once for the group, and
// from the cache for each of its heads. The phases are DoubleDoubleKernel's, so the bits are
// those of one head at a time.
class HeadGroupKernel {
 public:
  HeadGroupKernel(const Problem& problem, int group_size) : p_(problem) {
    heads_.reserve(static_cast<std::size_t>(group_size));
    for (int i = 0; i < group_size; ++i) heads_.emplace_back(problem);
  }

  void run(int row, int first, int last) {
    const std::span<DoubleDoubleKernel> group(heads_.data(),
                                              static_cast<std::size_t>(last - first));
    for (std::size_t i = 0; i < group.size(); ++i) group[i].begin(row, first + static_cast<int>(i));
    const std::int64_t n = p_.visible_of_row[row];
    for (std::int64_t t0 = 0; t0 < n; t0 += kChunkTokens) {
      const std::int64_t t1 = std::min(n, t0 + kChunkTokens);
      for (DoubleDoubleKernel& head : group) head.score(t0, t1);
    }
    for (DoubleDoubleKernel& head : group) head.weigh();
    for (std::int64_t t0 = 0; t0 < n; t0 += kChunkTokens) {
      const std::int64_t t1 = std::min(n, t0 + kChunkTokens);
      for (DoubleDoubleKernel& head : group) head.accumulate(t0, t1);
    }
    for (DoubleDoubleKernel& head : group) head.end();
  }

 private:
  const Problem& p_;
  std::vector<DoubleDoubleKernel> heads_;
};

// The number type of an accumulation tag: Boost's for the multiprecision tags (kept out of the
// header), the type itself otherwise.
template <class Acc>
struct NumberOf {
  using type = Acc;
};
template <>
struct NumberOf<Float50> {
  using type = boost::multiprecision::cpp_bin_float_50;
};
template <>
struct NumberOf<Float100> {
  using type = boost::multiprecision::cpp_bin_float_100;
};

// Sizes the step and attrs imply: KV rows of width Dc + Dr, q_nope and out [Nq, H, Dc], q_pe
// [Nq, H, Dr], lse [Nq, H].
Status check_reference_sizes(const DumpAttributes& attrs, const StepMeta& step,
                             const Problem& problem, const KvRows& kv, const std::string& where) {
  const std::size_t rows = static_cast<std::size_t>(step.num_rows());
  const std::size_t heads = static_cast<std::size_t>(attrs.num_heads);
  const std::size_t dc = static_cast<std::size_t>(attrs.kv_lora_rank);
  const std::size_t dr = static_cast<std::size_t>(attrs.qk_rope_head_dim);
  if (kv.row_width() != attrs.row_width()) {
    return bad_input(where, fmt::format("KV rows have width {}, expected Dc + Dr = {}",
                                        kv.row_width(), attrs.row_width()));
  }
  if (problem.q_nope.size() != rows * heads * dc || problem.q_pe.size() != rows * heads * dr ||
      problem.out.size() != rows * heads * dc || problem.lse.size() != rows * heads) {
    return bad_input(where, "q_nope/q_pe/out/lse sizes disagree with [Nq, H, Dc/Dr]");
  }
  return ok_status();
}

// The KV row of every token position of every request that has rows (kvdump-v1: a request with
// no rows is skipped); every one must be held by `kv`.
Status resolve_token_rows(const StepMeta& step, int page_size, const KvRows& kv,
                          const std::string& where, Problem* problem) {
  problem->token_rows.resize(step.batch_size());
  if (kv.has_residual()) problem->token_rows_lo.resize(step.batch_size());
  const bool row_grids = !kv.has_value_grid() && kv.has_row_grids();
  problem->row_grid_bits = row_grids ? KvRows::kRowGridBits : -1;
  if (row_grids) problem->token_on_grid.resize(step.batch_size());
  for (int b = 0; b < step.batch_size(); ++b) {
    if (step.rows_of(b) == 0) continue;
    const std::int64_t len = step.kv_len(b, page_size);
    auto& token_rows = problem->token_rows[b];
    token_rows.resize(static_cast<std::size_t>(len));
    if (kv.has_residual()) problem->token_rows_lo[b].resize(static_cast<std::size_t>(len));
    if (row_grids) problem->token_on_grid[b].resize(static_cast<std::size_t>(len));
    for (std::int64_t p = 0; p < len; ++p) {
      const std::int64_t slot = step.slot_of(b, p, page_size);
      token_rows[p] = kv.row(slot);
      if (kv.has_residual()) problem->token_rows_lo[b][p] = kv.row_lo(slot);
      if (row_grids) problem->token_on_grid[b][p] = kv.row_on_grid(slot) ? 1 : 0;
      if (token_rows[p] == nullptr) {
        return internal_error(
            where,
            fmt::format("KV rows do not hold slot {} (position {} of request {})", slot, p, b));
      }
    }
  }
  return ok_status();
}

// Each query row's request and visible tokens (pos + 1). Returns the work in row*head*token units.
std::int64_t resolve_query_rows(const StepMeta& step, int page_size, Problem* problem) {
  const std::size_t rows = static_cast<std::size_t>(step.num_rows());
  std::int64_t work = 0;
  problem->request_of_row.resize(rows);
  problem->visible_of_row.resize(rows);
  for (std::size_t i = 0; i < rows; ++i) {
    const int row = static_cast<int>(i);
    problem->request_of_row[i] = step.request_of_row(row);
    problem->visible_of_row[i] = step.position_of_row(row, page_size) + 1;
    problem->max_visible = std::max<std::int64_t>(problem->max_visible, problem->visible_of_row[i]);
    work += problem->visible_of_row[i] * static_cast<std::int64_t>(problem->num_heads);
  }
  return work;
}

}  // namespace

namespace {

// The problem of one call, checked and resolved; returns the work in row*head*token units.
Result<std::int64_t> resolve_problem(const DumpAttributes& attrs, const StepMeta& step,
                                     std::span<const float> q_nope, std::span<const float> q_pe,
                                     const KvRows& kv, std::span<double> out, std::span<double> lse,
                                     const std::string& where, Problem* problem) {
  KVAUDIT_TRY(check_step_indices(step, attrs.page_size, kv.num_slots()));
  problem->num_heads = attrs.num_heads;
  problem->dc = attrs.kv_lora_rank;
  problem->dr = attrs.qk_rope_head_dim;
  problem->sm_scale = attrs.sm_scale;
  problem->scale = kv.scale();
  problem->value_grid_bits = kv.has_value_grid() ? kv.magnitude_bits() : -1;
  problem->q_nope = q_nope;
  problem->q_pe = q_pe;
  problem->out = out;
  problem->lse = lse;
  KVAUDIT_TRY(check_reference_sizes(attrs, step, *problem, kv, where));
  KVAUDIT_TRY(resolve_token_rows(step, attrs.page_size, kv, where, problem));
  return resolve_query_rows(step, attrs.page_size, problem);
}

}  // namespace

template <class Acc>
Result<std::int64_t> mla_reference_attention(const DumpAttributes& attrs, const StepMeta& step,
                                             std::span<const float> q_nope,
                                             std::span<const float> q_pe, const KvRows& kv,
                                             std::span<double> out, std::span<double> lse,
                                             int threads) {
  const std::string where = "reference step " + step.group;
  Problem problem;
  KVAUDIT_ASSIGN_OR_RETURN(const std::int64_t work, resolve_problem(attrs, step, q_nope, q_pe, kv,
                                                                    out, lse, where, &problem));
  const std::size_t rows = static_cast<std::size_t>(step.num_rows());
  const int heads = attrs.num_heads;
  if constexpr (std::is_same_v<Acc, dd::DoubleDouble>) {
    // One kernel (with its scratch) per thread; unit = row * groups + group.
    const int group = heads_per_group(problem, threads);
    const int groups = (heads + group - 1) / group;
    parallel_for(rows * groups, threads, [&] {
      return [&problem, heads, group, groups,
              kernel = HeadGroupKernel(problem, group)](std::size_t unit) mutable {
        const int first = static_cast<int>(unit % groups) * group;
        kernel.run(static_cast<int>(unit / groups), first, std::min(heads, first + group));
      };
    });
  } else {
    // One kernel per thread; pair = row * H + head.
    parallel_for(rows * heads, threads, [&] {
      return [&problem, heads, kernel = NaiveKernel<typename NumberOf<Acc>::type>(problem)](
                 std::size_t pair) mutable {
        kernel.run(static_cast<int>(pair / heads), static_cast<int>(pair % heads));
      };
    });
  }
  return work;
}

std::vector<long long> gathered_row_offsets(const ReferenceProblem& p) {
  std::vector<long long> offsets(p.token_rows.size() + 1, 0);
  for (std::size_t b = 0; b < p.token_rows.size(); ++b) {
    offsets[b + 1] = offsets[b] + static_cast<long long>(p.token_rows[b].size());
  }
  return offsets;
}

void gather_token_rows(const ReferenceProblem& p, const std::vector<long long>& offsets,
                       float* dst) {
  constexpr long long kRowsPerUnit = 256;
  struct Unit {
    std::size_t request;
    long long first_token;
  };
  std::vector<Unit> units;
  for (std::size_t b = 0; b < p.token_rows.size(); ++b) {
    const long long tokens = static_cast<long long>(p.token_rows[b].size());
    for (long long t = 0; t < tokens; t += kRowsPerUnit) units.push_back({b, t});
  }
  const std::size_t width = static_cast<std::size_t>(p.width());
  parallel_for(units.size(), p.threads, [&] {
    return [&](std::size_t u) {
      const std::vector<const float*>& rows = p.token_rows[units[u].request];
      const long long end =
          std::min(units[u].first_token + kRowsPerUnit, static_cast<long long>(rows.size()));
      for (long long t = units[u].first_token; t < end; ++t) {
        std::copy(rows[t], rows[t] + width,
                  dst + static_cast<std::size_t>(offsets[units[u].request] + t) * width);
      }
    };
  });
}

namespace {

std::mutex gpu_reference_seconds_mutex;
DeviceSeconds gpu_reference_seconds_total;

}  // namespace

DeviceSeconds gpu_reference_seconds() {
  const std::lock_guard<std::mutex> lock(gpu_reference_seconds_mutex);
  return gpu_reference_seconds_total;
}

void add_gpu_reference_seconds(const DeviceSeconds& part) {
  const std::lock_guard<std::mutex> lock(gpu_reference_seconds_mutex);
  gpu_reference_seconds_total += part;
}

std::string_view reference_device_name(ReferenceDevice device) {
  return device == ReferenceDevice::kCuda ? "cuda" : "cpu";
}

bool reference_device_built(ReferenceDevice device) {
#if defined(KVAUDIT_HAVE_CUDA)
  (void)device;
  return true;
#else
  return device == ReferenceDevice::kCpu;
#endif
}

Result<std::int64_t> exact_reference_attention(ReferenceDevice device, const DumpAttributes& attrs,
                                               const StepMeta& step, std::span<const float> q_nope,
                                               std::span<const float> q_pe, const KvRows& kv,
                                               std::span<double> out, std::span<double> lse,
                                               int threads) {
  if (device == ReferenceDevice::kCpu) {
    return mla_reference_attention(attrs, step, q_nope, q_pe, kv, out, lse, threads);
  }
  const std::string where = "GPU reference step " + step.group;
#if defined(KVAUDIT_HAVE_CUDA)
  if (kv.has_residual()) {
    return unsupported(where,
                       "per-token-group float32 scales make KV values of up to 28 "
                       "significant bits, held as two floats; the GPU reference reads one "
                       "float per value: use --reference cpu for this dump");
  }
  const auto start = std::chrono::steady_clock::now();
  Problem problem;
  KVAUDIT_ASSIGN_OR_RETURN(const std::int64_t work, resolve_problem(attrs, step, q_nope, q_pe, kv,
                                                                    out, lse, where, &problem));
  problem.threads = threads;
  DeviceSeconds resolving;
  resolving.prepare = elapsed_seconds_since(start);
  add_gpu_reference_seconds(resolving);
  KVAUDIT_TRY(mla_reference_attention_cuda(problem, where));
  return work;
#else
  return unsupported(where, "this kvaudit was built without CUDA (KVAUDIT_CUDA=OFF)");
#endif
}

#define KVAUDIT_INSTANTIATE_REFERENCE(Acc)                                                    \
  template Result<std::int64_t> mla_reference_attention<Acc>(                                 \
      const DumpAttributes&, const StepMeta&, std::span<const float>, std::span<const float>, \
      const KvRows&, std::span<double>, std::span<double>, int);

KVAUDIT_INSTANTIATE_REFERENCE(dd::DoubleDouble)
KVAUDIT_INSTANTIATE_REFERENCE(double)
KVAUDIT_INSTANTIATE_REFERENCE(Float50)
KVAUDIT_INSTANTIATE_REFERENCE(Float100)

#undef KVAUDIT_INSTANTIATE_REFERENCE

}  // namespace kvaudit
