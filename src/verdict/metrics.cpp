// Error metrics between a reference and a candidate attention output (definitions in
// src/verdict/metrics.hpp; docs/design.md "Numerics").
//
// out : [rows, heads, dims]   lse : [rows, heads]   (row-major, the kvdump layout)
//
// Order of checks, as ggml's eval() does it: first the non-finite positions (NaN, +Inf, -Inf in
// either tensor; a position whose classes differ is a mismatch, and the first one in (row, head)
// order, out before lse, is kept), then the norms over the positions where both are finite.
//
// Numerics of the metrics themselves: the terms are binary64 ((a - b)^2, a^2, a^2 + b^2 as
// written below), summed in a fixed order that does not depend on the thread count: each
// (row, head) pair's `dims` terms in order in binary64 (error <= (dims - 1) u of their sum, u =
// 2^-53), then the pair sums in (row, head) order in double-double (TwoSum; error O(n u^2)), cut
// into fixed blocks of kPairsPerBlock pairs whose double-double sums are added in block order,
// and rounded to binary64 once. The terms being >= 0, the relative error of each sum is at most
// (dims - 1) u + O(n u^2) (dims = 512: 2^-44), against (n - 1) u for one running binary64 sum
// over all n = rows x heads x dims terms (2^-26 for a 4,096-row prefill of 64 heads), the order
// used before 2026-12-05, whose last bits these sums may differ from. cos_diff is evaluated as
//   sum (a - b)^2 / sum (a^2 + b^2),
// which equals 1 - 2 sum(ab) / sum(a^2 + b^2) exactly in real arithmetic (sum(a^2 + b^2) -
// 2 sum(ab) = sum (a - b)^2) but does not cancel catastrophically when a and b agree: the
// kernel limits sit near 2^-13, and clean kernels near 2^-18, where 1 - ratio would keep only
// ~35 of binary64's 53 bits. bf16 ULP distances round both values to bf16 in one step (a double
// -> float -> bf16 path would round twice).
//
// The ULP domain (max_ulp_bf16). An attention output a = sum_t p_t v_t / l carries errors that
// are absolute at the scale of its terms, M = sum_t p_t |v_t| / l: P rounded to bf16 moves it by
// up to 2^-8 M, e4m3 storage of v by up to 2^-4 M. A bf16 ULP at a is 2^-8..2^-7 |a|, so such an
// error reads as about 2^8 (err / M) (M / |a|) ULPs: the count says how many roundings of a only
// while M / |a| is small, and grows without bound where a is small against its terms (up to a
// sign change across zero, ~30,000 ULPs near 2^-8, which is what a passing quantization row used
// to show). M is not known here; S = max_d |a[row, head, d]|, the (row, head)'s largest output,
// stands in for it (as in golden tolerance, src/report/golden_compare.cpp). ULPs are counted where
// |a| >= 2^-4 S (kUlpRowFraction): there an error at the row's scale is overstated at most 16-fold
// (4 bits), and a sign change needs an error of 2 x 2^-4 S, an eighth of the row's largest value,
// far past the kernel limit (max_abs / max|ref| 2^-7). The elements below it are judged by the
// absolute metrics (max_abs, rel_l2), which do not blow up there.
//
// Work: counts, maxima with their first locations, and the sums run in parallel over fixed blocks
// of (row, head) pairs, merged in block order. So the result is bit-for-bit the same on any
// number of threads (a prefill step of 4,096 rows x 64 heads x 512 is 134M elements per
// comparison; one running sum in order, as before, took most of a comparison's time on 16
// cores). Within a block, a (row, head) pair whose outputs are all finite in both (nearly every
// one) skips the per-element NaN/Inf bookkeeping: its maxima are found over the pair with the
// first dim reaching each, then folded in as that element alone would be, which keeps the same
// values and positions; bf16 ULPs of values in [2^-126, 2^127) come straight from the double's
// bits. Pinned to one core, a 4,096 x 16 x 512 comparison took 0.89 s before that (2026-12-05).
#include "src/verdict/metrics.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "src/core/fp8_e4m3.hpp"
#include "src/core/parallel_for.hpp"

namespace kvaudit {
namespace {

enum class ValueClass { kFinite, kNan, kPositiveInf, kNegativeInf };

ValueClass classify(double x) {
  if (std::isnan(x)) return ValueClass::kNan;
  if (std::isinf(x)) return x > 0 ? ValueClass::kPositiveInf : ValueClass::kNegativeInf;
  return ValueClass::kFinite;
}

// Position on a line where adjacent bf16 values are 1 apart: sign-magnitude bits to a signed
// integer, so +0 (0x0000) and -0 (0x8000) both map to 0 and -min_subnormal to -1.
int bf16_ordered(std::uint16_t bits) {
  const int magnitude = bits & 0x7FFF;
  return (bits & 0x8000) != 0 ? -magnitude : magnitude;
}

std::uint16_t bf16_bits_of_value(double bf16_value) {
  // bf16_value is a bf16 value (or +-inf), hence exactly a float with 16 zero low bits.
  return static_cast<std::uint16_t>(float_bits(static_cast<float>(bf16_value)) >> 16);
}

ElementLocation location(int row, int head, int dim, double reference, double candidate) {
  return ElementLocation{row, head, dim, reference, candidate};
}

}  // namespace

double round_to_bf16(double x) {
  if (!std::isfinite(x) || x == 0.0) return x;
  // bf16 keeps 8 significand bits: the binade [2^e, 2^(e+1)) has quantum 2^(e-7). Below the
  // smallest normal 2^-126 the quantum stays that of the subnormals, 2^-133. Bit operations, not
  // frexp/ldexp: this runs for every compared element (measured: most of a comparison's time).
  double rounded;
  if (std::fabs(x) < 0x1p-126) {
    rounded = std::nearbyint(x * 0x1p133) * 0x1p-133;  // both scalings exact; ties to even
  } else {
    // Round away the low 45 of the double's 52 stored significand bits, to nearest, ties to even;
    // a carry moves into the exponent, as it should.
    constexpr int kDropped = 52 - 7;
    auto bits = std::bit_cast<std::uint64_t>(x);
    const std::uint64_t kept_lsb = (bits >> kDropped) & 1;
    bits += (std::uint64_t{1} << (kDropped - 1)) - 1 + kept_lsb;
    bits &= ~((std::uint64_t{1} << kDropped) - 1);
    rounded = std::bit_cast<double>(bits);
  }
  // Largest finite bf16 is 0x7F7F = (2 - 2^-7) * 2^127; anything rounding beyond it is inf.
  constexpr double kBf16MaxFinite = 0x1.fep+127;
  if (std::fabs(rounded) > kBf16MaxFinite) {
    return std::copysign(std::numeric_limits<double>::infinity(), x);
  }
  return rounded;
}

namespace {

// bf16_ordered(bits of round_to_bf16(x)) for a non-NaN x. Where 2^-126 <= |x| < 2^127 (every
// output of a sane kernel), straight from the double's bits: round_to_bf16's normal branch keeps
// the top 7 stored significand bits, rounded (its result is at most 2^127, finite in bf16), and
// bf16's 8 exponent bits are binary64's 11 less the bias difference 1023 - 127 = 896, so the
// bf16 magnitude is (rounded bits >> 45) - 896 * 2^7. Elsewhere (zero, subnormal in bf16,
// rounding to infinity, infinity) through round_to_bf16 itself.
int bf16_ordered_of(double x) {
  constexpr int kDropped = 52 - 7;
  constexpr std::uint64_t kSign = std::uint64_t{1} << 63;
  constexpr std::uint64_t kSmallestNormal = 0x3810000000000000;  // bits of 2^-126
  constexpr std::uint64_t kTop = 0x47E0000000000000;             // bits of 2^127
  const auto bits = std::bit_cast<std::uint64_t>(x);
  const std::uint64_t magnitude = bits & ~kSign;
  if (magnitude >= kSmallestNormal && magnitude < kTop) {
    const std::uint64_t kept_lsb = (magnitude >> kDropped) & 1;
    const std::uint64_t rounded = magnitude + (std::uint64_t{1} << (kDropped - 1)) - 1 + kept_lsb;
    const int bf16_magnitude = static_cast<int>(rounded >> kDropped) - (896 << 7);
    return (bits & kSign) != 0 ? -bf16_magnitude : bf16_magnitude;
  }
  return bf16_ordered(bf16_bits_of_value(round_to_bf16(x)));
}

}  // namespace

double bf16_ulp_distance(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<double>::infinity();
  return static_cast<double>(std::abs(bf16_ordered_of(a) - bf16_ordered_of(b)));
}

namespace {

// A sum of binary64 values carried as an unevaluated pair hi + lo (double-double): each add is
// Knuth's TwoSum, whose error term is exact, then renormalised. Its result after many adds is
// within O(n u^2) of the exact sum, so the order of the adds barely matters, and it is fixed
// anyway (see "Numerics of the metrics" above).
struct CompensatedSum {
  double hi = 0.0;
  double lo = 0.0;

  void add(double x) {
    const double sum = hi + x;
    if (!std::isfinite(sum)) {  // overflow (terms of 1e155 and more): the sum is +inf, as before
      hi = sum;
      lo = 0.0;
      return;
    }
    const double x_part = sum - hi;
    const double error = (hi - (sum - x_part)) + (x - x_part);  // TwoSum: hi + x = sum + error
    const double low = lo + error;
    hi = sum + low;  // Fast2Sum renormalisation: |sum| >= |low|
    lo = low - (hi - sum);
  }
  void add(const CompensatedSum& other) {
    add(other.hi);
    add(other.lo);
  }
  double value() const { return hi + lo; }
};

// The three sums the norms come from, over the elements where both are finite.
struct NormSums {
  CompensatedSum diff_sq;  // sum (a - b)^2
  CompensatedSum ref_sq;   // sum a^2
  CompensatedSum both_sq;  // sum a^2 + b^2

  // One (row, head) pair's `dims` terms, summed in order in binary64, then added as one value
  // each. kAllFinite: the caller knows every a and b of the pair is finite (the same sums without
  // the test).
  template <bool kAllFinite>
  void add_pair(const double* a_row, const double* b_row, int dims) {
    double pair_diff_sq = 0.0;
    double pair_ref_sq = 0.0;
    double pair_both_sq = 0.0;
    for (int d = 0; d < dims; ++d) {
      const double a = a_row[d];
      const double b = b_row[d];
      if (!kAllFinite && (!std::isfinite(a) || !std::isfinite(b))) continue;
      pair_diff_sq += (a - b) * (a - b);
      pair_ref_sq += a * a;
      pair_both_sq += a * a + b * b;
    }
    diff_sq.add(pair_diff_sq);
    ref_sq.add(pair_ref_sq);
    both_sq.add(pair_both_sq);
  }
  void add(const NormSums& later) {
    diff_sq.add(later.diff_sq);
    ref_sq.add(later.ref_sq);
    both_sq.add(later.both_sq);
  }
};

// One finite element's errors: |a - b|, its relative form and its bf16 ULPs (0 outside the ULP
// domain).
struct ElementErrors {
  double diff;
  double rel;
  double ulp;
};

ElementErrors element_errors(double a, double b, double ulp_floor, double rel_floor) {
  const double diff = std::fabs(a - b);
  const double magnitude = std::fabs(a);
  // A zero difference is zero relative error even where the denominator is 0.
  const double denominator = std::max(magnitude, rel_floor);
  const double rel = diff == 0.0         ? 0.0
                     : denominator > 0.0 ? diff / denominator
                                         : std::numeric_limits<double>::infinity();
  // ULPs only in the domain: below it bf16's quantum shrinks toward 2^-133 and an absolute
  // error at the row's scale (or a sign change) reads as tens of thousands of ULPs.
  const double ulp = magnitude >= ulp_floor ? bf16_ulp_distance(a, b) : 0.0;
  return {diff, rel, ulp};
}

// The running state of compare_outputs over (row, head, dim) in order: non-finite bookkeeping,
// maxima with their locations, and the binary64 sums the norms come from.
class MetricsAccumulator {
 public:
  MetricsAccumulator(ComparisonMetrics& metrics, double rel_floor)
      : m_(metrics), rel_floor_(rel_floor) {}

  // Counts NaN/Inf in each, and keeps the first position whose classes differ; returns whether
  // both are finite.
  bool both_finite(double a, double b, int row, int head, int dim) {
    const ValueClass class_a = classify(a);
    const ValueClass class_b = classify(b);
    if (class_a != ValueClass::kFinite) ++m_.reference_nonfinite;
    if (class_b != ValueClass::kFinite) ++m_.candidate_nonfinite;
    if (class_a != class_b) {
      ++m_.nonfinite_mismatches;
      if (!have_mismatch_) {
        m_.first_nonfinite_mismatch = location(row, head, dim, a, b);
        have_mismatch_ = true;
      }
    }
    return class_a == ValueClass::kFinite && class_b == ValueClass::kFinite;
  }

  // `ulp_floor`: ULPs are counted only where |a| reaches it (the ULP domain, above).
  void add_out(double a, double b, int row, int head, int dim, double ulp_floor) {
    ++m_.finite_elements;
    const ElementErrors e = element_errors(a, b, ulp_floor, rel_floor_);
    const ElementLocation at = location(row, head, dim, a, b);
    fold_finite({e.diff, at, e.rel, at, e.ulp, at, std::fabs(a)});
  }

  // A (row, head) pair whose `dims` (> 0) outputs are all finite in both, with the largest |a|
  // among them: the same state as add_out on each element in order. Each maximum is found over
  // the pair first, with the first dim that reaches it, then folded in as that one element
  // would be: a maximum is replaced only by a strictly larger value, so the first position of
  // the largest is the one kept either way.
  void add_finite_pair(const double* a_row, const double* b_row, int dims, int row, int head,
                       double ulp_floor, double largest_magnitude) {
    struct Largest {
      double value = -1.0;  // below every error, so dim 0 is taken first
      int dim = 0;
      void consider(double x, int d) {
        if (x > value) {
          value = x;
          dim = d;
        }
      }
    };
    Largest diff, rel, ulp;
    for (int d = 0; d < dims; ++d) {
      const ElementErrors e = element_errors(a_row[d], b_row[d], ulp_floor, rel_floor_);
      diff.consider(e.diff, d);
      rel.consider(e.rel, d);
      ulp.consider(e.ulp, d);
    }
    m_.finite_elements += static_cast<std::size_t>(dims);
    const auto at = [&](int d) { return location(row, head, d, a_row[d], b_row[d]); };
    fold_finite({diff.value, at(diff.dim), rel.value, at(rel.dim), ulp.value, at(ulp.dim),
                 largest_magnitude});
  }

  void add_lse(double a, double b, int row, int head) {
    const double diff = std::fabs(a - b);
    if (!have_finite_lse_ || diff > m_.lse_max_abs) {
      m_.lse_max_abs = diff;
      m_.lse_max_abs_at = location(row, head, -1, a, b);
    }
    have_finite_lse_ = true;
  }

  // Folds in the state of the elements that come after this accumulator's, so that the result is
  // that of one pass over both in order: counts add, the first mismatch and the first position of
  // each maximum are kept (a later block's maximum replaces only a strictly smaller one).
  void merge(const MetricsAccumulator& later) {
    const ComparisonMetrics& b = later.m_;
    m_.reference_nonfinite += b.reference_nonfinite;
    m_.candidate_nonfinite += b.candidate_nonfinite;
    m_.nonfinite_mismatches += b.nonfinite_mismatches;
    if (!have_mismatch_ && later.have_mismatch_) {
      m_.first_nonfinite_mismatch = b.first_nonfinite_mismatch;
      have_mismatch_ = true;
    }
    m_.finite_elements += b.finite_elements;
    if (later.have_finite_) {
      fold_finite({b.max_abs, b.max_abs_at, b.max_rel, b.max_rel_at, b.max_ulp_bf16, b.max_ulp_at,
                   b.reference_max_abs});
    }
    if (later.have_finite_lse_ && (!have_finite_lse_ || b.lse_max_abs > m_.lse_max_abs)) {
      m_.lse_max_abs = b.lse_max_abs;
      m_.lse_max_abs_at = b.lse_max_abs_at;
      have_finite_lse_ = true;
    }
  }

 private:
  // The largest of each error among some finite elements that come after this accumulator's, with
  // where it is, and their largest |a|.
  struct FiniteMaxima {
    double diff;
    ElementLocation diff_at;
    double rel;
    ElementLocation rel_at;
    double ulp;
    ElementLocation ulp_at;
    double magnitude;
  };

  // One element, a pair or a later block folded in: a maximum is replaced only by a strictly
  // larger value, so the first position of the largest is kept; the first finite elements set
  // all three.
  void fold_finite(const FiniteMaxima& later) {
    if (!have_finite_ || later.diff > m_.max_abs) {
      m_.max_abs = later.diff;
      m_.max_abs_at = later.diff_at;
    }
    if (!have_finite_ || later.rel > m_.max_rel) {
      m_.max_rel = later.rel;
      m_.max_rel_at = later.rel_at;
    }
    if (!have_finite_ || later.ulp > m_.max_ulp_bf16) {
      m_.max_ulp_bf16 = later.ulp;
      m_.max_ulp_at = later.ulp_at;
    }
    m_.reference_max_abs = std::max(m_.reference_max_abs, later.magnitude);
    have_finite_ = true;
  }

  ComparisonMetrics& m_;
  double rel_floor_;
  bool have_mismatch_ = false;
  bool have_finite_ = false;
  bool have_finite_lse_ = false;
};

// One (row, head) pair at a glance: S of the ULP domain, the largest finite |a| of its `dims`
// outputs (0 for none), and whether every a and b is finite (the common case, which takes
// MetricsAccumulator::add_finite_pair).
struct PairScan {
  double scale = 0.0;
  bool all_finite = true;
};

PairScan scan_pair(const double* reference, const double* candidate, int dims) {
  PairScan scan;
  for (int d = 0; d < dims; ++d) {
    const bool finite_a = std::isfinite(reference[d]);
    if (finite_a) scan.scale = std::max(scan.scale, std::fabs(reference[d]));
    scan.all_finite = scan.all_finite && finite_a && std::isfinite(candidate[d]);
  }
  return scan;
}

// rms, rel_l2 and cos_diff from the sums, each rounded to binary64 once.
void add_norms(const NormSums& sums, ComparisonMetrics& m) {
  const double sum_diff_sq = sums.diff_sq.value();
  const double sum_ref_sq = sums.ref_sq.value();
  const double sum_both_sq = sums.both_sq.value();
  if (m.finite_elements > 0)
    m.rms = std::sqrt(sum_diff_sq / static_cast<double>(m.finite_elements));
  // ||a - b|| / ||a|| with ||a|| = 0: 0 if b is also 0, else infinitely wrong.
  if (sum_ref_sq > 0.0) {
    m.rel_l2 = std::sqrt(sum_diff_sq) / std::sqrt(sum_ref_sq);
  } else if (sum_diff_sq > 0.0) {
    m.rel_l2 = std::numeric_limits<double>::infinity();
  }
  if (sum_both_sq > 0.0) m.cos_diff = sum_diff_sq / sum_both_sq;
}

}  // namespace

ComparisonMetrics compare_outputs(TensorShape3 shape, std::span<const double> reference_out,
                                  std::span<const double> candidate_out,
                                  std::span<const double> reference_lse,
                                  std::span<const double> candidate_lse, double rel_floor,
                                  int threads) {
  // Sizes come from a validated dump; a disagreement here is a bug in the caller.
  if (shape.rows < 0 || shape.heads < 0 || shape.dims < 0 || reference_out.size() != shape.size() ||
      candidate_out.size() != shape.size()) {
    throw std::invalid_argument("compare_outputs: out sizes disagree with the shape");
  }
  // A finite floor keeps every relative error a number (an infinite one would make inf / inf);
  // policies accept only finite, non-negative floors.
  if (!std::isfinite(rel_floor) || rel_floor < 0.0) {
    throw std::invalid_argument("compare_outputs: rel_floor must be finite and non-negative");
  }
  const std::size_t lse_size = static_cast<std::size_t>(shape.rows) * shape.heads;
  const bool has_lse = !reference_lse.empty() && !candidate_lse.empty();
  if (has_lse && (reference_lse.size() != lse_size || candidate_lse.size() != lse_size)) {
    throw std::invalid_argument("compare_outputs: lse sizes disagree with the shape");
  }

  ComparisonMetrics m;
  m.elements = shape.size();
  m.rel_floor = rel_floor;
  m.has_lse = has_lse;
  // Maxima, counts and sums per block of (row, head) pairs, in parallel, then merged in block
  // order. The block size is fixed, never derived from the thread count (the sums' order).
  constexpr std::size_t kPairsPerBlock = 256;
  const std::size_t pairs = static_cast<std::size_t>(shape.rows) * shape.heads;
  const std::size_t blocks = (pairs + kPairsPerBlock - 1) / kPairsPerBlock;
  std::vector<ComparisonMetrics> block_metrics(blocks, m);
  std::vector<MetricsAccumulator> block_state;
  block_state.reserve(blocks);
  for (ComparisonMetrics& block : block_metrics) block_state.emplace_back(block, rel_floor);
  std::vector<NormSums> block_sums(blocks);
  parallel_for(blocks, threads, [&] {
    return [&](std::size_t block) {
      MetricsAccumulator& accumulator = block_state[block];
      NormSums& sums = block_sums[block];
      const std::size_t end = std::min(pairs, (block + 1) * kPairsPerBlock);
      for (std::size_t index = block * kPairsPerBlock; index < end; ++index) {
        const int row = static_cast<int>(index / shape.heads);
        const int head = static_cast<int>(index % shape.heads);
        const double* a_row = reference_out.data() + index * shape.dims;
        const double* b_row = candidate_out.data() + index * shape.dims;
        const PairScan scan = scan_pair(a_row, b_row, shape.dims);
        const double ulp_floor = std::max(rel_floor, kUlpRowFraction * scan.scale);
        if (scan.all_finite && shape.dims > 0) {
          accumulator.add_finite_pair(a_row, b_row, shape.dims, row, head, ulp_floor, scan.scale);
          sums.add_pair<true>(a_row, b_row, shape.dims);
        } else {
          for (int dim = 0; dim < shape.dims; ++dim) {
            const double a = a_row[dim];
            const double b = b_row[dim];
            if (accumulator.both_finite(a, b, row, head, dim))
              accumulator.add_out(a, b, row, head, dim, ulp_floor);
          }
          sums.add_pair<false>(a_row, b_row, shape.dims);
        }
        if (!has_lse) continue;
        const double a = reference_lse[index];
        const double b = candidate_lse[index];
        if (accumulator.both_finite(a, b, row, head, -1)) accumulator.add_lse(a, b, row, head);
      }
    };
  });
  MetricsAccumulator total(m, rel_floor);
  for (const MetricsAccumulator& block : block_state) total.merge(block);
  NormSums sums;
  for (const NormSums& block : block_sums) sums.add(block);
  add_norms(sums, m);
  return m;
}

double over_reference_max(double abs_error, double reference_max_abs) {
  if (reference_max_abs > 0.0) return abs_error / reference_max_abs;
  return abs_error > 0.0 ? std::numeric_limits<double>::infinity() : 0.0;
}

double max_abs_over_ref_max(const ComparisonMetrics& metrics) {
  return over_reference_max(metrics.max_abs, metrics.reference_max_abs);
}

nlohmann::json json_number(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  return value;
}

nlohmann::json to_json(const ElementLocation& at) {
  return nlohmann::json{{"row", at.row},
                        {"head", at.head},
                        {"dim", at.dim},
                        {"reference", json_number(at.reference)},
                        {"candidate", json_number(at.candidate)}};
}

nlohmann::json to_json(const ComparisonMetrics& m) {
  nlohmann::json j;
  j["elements"] = m.elements;
  j["finite_elements"] = m.finite_elements;
  j["max_abs"] = json_number(m.max_abs);
  j["max_abs_at"] = to_json(m.max_abs_at);
  j["max_rel"] = json_number(m.max_rel);
  j["rel_floor"] = json_number(m.rel_floor);
  j["max_rel_at"] = to_json(m.max_rel_at);
  j["rms"] = json_number(m.rms);
  j["rel_l2"] = json_number(m.rel_l2);
  j["cos_diff"] = json_number(m.cos_diff);
  j["max_ulp_bf16"] = json_number(m.max_ulp_bf16);
  j["max_ulp_at"] = to_json(m.max_ulp_at);
  j["reference_max_abs"] = json_number(m.reference_max_abs);
  j["has_lse"] = m.has_lse;
  if (m.has_lse) {
    j["lse_max_abs"] = json_number(m.lse_max_abs);
    j["lse_max_abs_at"] = to_json(m.lse_max_abs_at);
  } else {
    j["lse_max_abs"] = nullptr;
    j["lse_max_abs_at"] = nullptr;
  }
  j["reference_nonfinite"] = m.reference_nonfinite;
  j["candidate_nonfinite"] = m.candidate_nonfinite;
  j["nonfinite_mismatches"] = m.nonfinite_mismatches;
  j["first_nonfinite_mismatch"] =
      m.nonfinite_mismatches > 0 ? to_json(m.first_nonfinite_mismatch) : nlohmann::json(nullptr);
  return j;
}

}  // namespace kvaudit
