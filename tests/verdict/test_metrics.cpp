// Metrics on tensors small enough that every expected value is worked out by hand in the comments.
#include <boost/multiprecision/cpp_bin_float.hpp>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <vector>

#include "src/verdict/metrics.hpp"

using kvaudit::bf16_ulp_distance;
using kvaudit::compare_outputs;
using kvaudit::ComparisonMetrics;
using kvaudit::round_to_bf16;
using kvaudit::TensorShape3;

namespace {

constexpr double kNan = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

ComparisonMetrics compare(TensorShape3 shape, const std::vector<double>& a,
                          const std::vector<double>& b, double rel_floor = 0.0) {
  return compare_outputs(shape, a, b, {}, {}, rel_floor);
}

}  // namespace

TEST_CASE("metrics of a=[1,2,3,4] against b=[1,2,3,5]", "[metrics]") {
  const ComparisonMetrics m = compare({1, 1, 4}, {1, 2, 3, 4}, {1, 2, 3, 5});
  // Differences [0,0,0,1]: max 1 at dim 3; rms = sqrt(1/4) = 0.5.
  CHECK(m.elements == 4);
  CHECK(m.finite_elements == 4);
  CHECK(m.max_abs == 1.0);
  CHECK(m.max_abs_at.row == 0);
  CHECK(m.max_abs_at.head == 0);
  CHECK(m.max_abs_at.dim == 3);
  CHECK(m.max_abs_at.reference == 4.0);
  CHECK(m.max_abs_at.candidate == 5.0);
  CHECK(m.rms == 0.5);
  // ||a||^2 = 1 + 4 + 9 + 16 = 30, so rel_l2 = 1 / sqrt(30).
  CHECK(m.rel_l2 == Approx(1.0 / std::sqrt(30.0)).epsilon(1e-15));
  // sum ab = 1 + 4 + 9 + 20 = 34, sum a^2 + b^2 = 30 + 39 = 69: 1 - 68/69 = 1/69.
  CHECK(m.cos_diff == Approx(1.0 / 69.0).epsilon(1e-15));
  // Relative errors with no floor: 1/4 at dim 3, the only non-zero one.
  CHECK(m.max_rel == 0.25);
  CHECK(m.max_rel_at.dim == 3);
  CHECK(m.reference_max_abs == 4.0);
  // 4 and 5 are bf16 values in the binade [4, 8) whose quantum is 2^-5: (5 - 4) / 2^-5 = 32.
  CHECK(m.max_ulp_bf16 == 32.0);
  CHECK(m.max_ulp_at.dim == 3);
  CHECK_FALSE(m.has_lse);
  CHECK(m.nonfinite_mismatches == 0);
  CHECK(m.first_nonfinite_mismatch.row == -1);
}

TEST_CASE("metrics locate the worst element by (row, head, dim)", "[metrics]") {
  // shape [2 rows, 2 heads, 2 dims]; only element (row 1, head 0, dim 1) = index 5 differs, by 3.
  const std::vector<double> a = {1, 1, 1, 1, 1, 1, 1, 1};
  const std::vector<double> b = {1, 1, 1, 1, 1, 4, 1, 1};
  const ComparisonMetrics m = compare({2, 2, 2}, a, b);
  CHECK(m.max_abs == 3.0);
  CHECK(m.max_abs_at.row == 1);
  CHECK(m.max_abs_at.head == 0);
  CHECK(m.max_abs_at.dim == 1);
  // rms = sqrt(9 / 8); rel_l2 = 3 / sqrt(8); cos_diff = 9 / (8 + 7 + 16) = 9 / 31.
  CHECK(m.rms == Approx(std::sqrt(9.0 / 8.0)).epsilon(1e-15));
  CHECK(m.rel_l2 == Approx(3.0 / std::sqrt(8.0)).epsilon(1e-15));
  CHECK(m.cos_diff == Approx(9.0 / 31.0).epsilon(1e-15));
}

TEST_CASE("NaN in the candidate only is a mismatch with its location - norms skip it",
          "[metrics]") {
  // [1 row, 2 heads, 2 dims]: candidate NaN at (0, 1, 0) where the reference is 2.
  const std::vector<double> a = {1, 1, 2, 1};
  const std::vector<double> b = {1, 1.5, kNan, 1};
  const ComparisonMetrics m = compare({1, 2, 2}, a, b);
  CHECK(m.reference_nonfinite == 0);
  CHECK(m.candidate_nonfinite == 1);
  CHECK(m.nonfinite_mismatches == 1);
  CHECK(m.first_nonfinite_mismatch.row == 0);
  CHECK(m.first_nonfinite_mismatch.head == 1);
  CHECK(m.first_nonfinite_mismatch.dim == 0);
  CHECK(m.first_nonfinite_mismatch.reference == 2.0);
  CHECK(std::isnan(m.first_nonfinite_mismatch.candidate));
  // Norms over the 3 finite positions: differences [0, 0.5, 0]; ||a||^2 over them = 3.
  CHECK(m.finite_elements == 3);
  CHECK(m.max_abs == 0.5);
  CHECK(m.rel_l2 == Approx(0.5 / std::sqrt(3.0)).epsilon(1e-15));
  CHECK(std::isfinite(m.cos_diff));
}

TEST_CASE("NaN in both, Inf against Inf, and NaN against Inf", "[metrics]") {
  const std::vector<double> a = {kNan, kInf, kInf, -kInf, 1};
  const std::vector<double> b = {kNan, kInf, kNan, kInf, 1};
  const ComparisonMetrics m = compare({1, 1, 5}, a, b);
  CHECK(m.reference_nonfinite == 4);
  CHECK(m.candidate_nonfinite == 4);
  // Same class at dims 0 and 1; Inf vs NaN at 2 and -Inf vs +Inf at 3 disagree.
  CHECK(m.nonfinite_mismatches == 2);
  CHECK(m.first_nonfinite_mismatch.dim == 2);
  CHECK(m.finite_elements == 1);
  CHECK(m.max_abs == 0.0);
}

TEST_CASE("lse error and a non-finite lse ordered before later out positions", "[metrics]") {
  // [2 rows, 2 heads, 1 dim]. lse index = row * heads + head.
  const std::vector<double> a = {1, 2, 3, 4};
  const std::vector<double> b = {1, 2, 3, kNan};  // out mismatch at (1, 1, 0)
  const std::vector<double> lse_a = {0.5, 1.0, 2.0, 3.0};
  const std::vector<double> lse_b = {0.5, kInf, 2.25, 3.0};  // lse mismatch at (0, 1)
  const ComparisonMetrics m = compare_outputs({2, 2, 1}, a, b, lse_a, lse_b, 0.0);
  REQUIRE(m.has_lse);
  CHECK(m.nonfinite_mismatches == 2);
  CHECK(m.first_nonfinite_mismatch.row == 0);
  CHECK(m.first_nonfinite_mismatch.head == 1);
  CHECK(m.first_nonfinite_mismatch.dim == -1);
  // Finite lse differences: 0, 0.25 (at row 1, head 0), 0.
  CHECK(m.lse_max_abs == 0.25);
  CHECK(m.lse_max_abs_at.row == 1);
  CHECK(m.lse_max_abs_at.head == 0);
  CHECK(m.lse_max_abs_at.dim == -1);
}

TEST_CASE("a relative error floor that is infinite, NaN or negative is refused", "[metrics]") {
  const std::vector<double> a = {1e308, 1.0};
  const std::vector<double> b = {-1e308, 2.0};
  for (const double floor : {kInf, kNan, -1.0}) {
    CHECK_THROWS_AS(compare({1, 1, 2}, a, b, floor), std::invalid_argument);
  }
  CHECK_NOTHROW(compare({1, 1, 2}, a, b, 0.0));
}

TEST_CASE("relative error floor", "[metrics]") {
  // a = [0, 0.5, 2], b = [2^-7, 0.5, 2.25]: |a - b| = [2^-7, 0, 0.25].
  const std::vector<double> a = {0, 0.5, 2};
  const std::vector<double> b = {0.0078125, 0.5, 2.25};
  SECTION("no floor: an error at a zero reference is infinitely relative") {
    const ComparisonMetrics m = compare({1, 1, 3}, a, b, 0.0);
    CHECK(std::isinf(m.max_rel));
    CHECK(m.max_rel_at.dim == 0);
  }
  SECTION("floor 2^-5: 2^-7 / 2^-5 = 0.25 beats 0.25 / 2 = 0.125") {
    const ComparisonMetrics m = compare({1, 1, 3}, a, b, 0.03125);
    CHECK(m.max_rel == 0.25);
    CHECK(m.max_rel_at.dim == 0);
    CHECK(m.rel_floor == 0.03125);
  }
  SECTION("floor 1: 2^-7 / 1 loses to 0.25 / max(2, 1) = 0.125") {
    const ComparisonMetrics m = compare({1, 1, 3}, a, b, 1.0);
    CHECK(m.max_rel == 0.125);
    CHECK(m.max_rel_at.dim == 2);
  }
  SECTION("equal zeros are no error even with no floor") {
    const ComparisonMetrics m = compare({1, 1, 2}, {0, 1}, {0, 1}, 0.0);
    CHECK(m.max_rel == 0.0);
  }
}

TEST_CASE("ULPs count only where |a| is within 2^-4 of its (row, head)'s largest |a|",
          "[metrics][bf16]") {
  // Row scale S = max |a| = 1, so the ULP domain is |a| >= max(rel_floor, S / 16) = 0.0625.
  // dim 1: a = 2^-7 (above rel_floor 2^-8, below S / 16) changes sign, an absolute error of
  // 2^-6 (1.6% of S) that reads as bf16 0x3C00 -> 0xBC00, 2 x 15360 = 30720 ULPs: left out.
  // dim 0: 1 -> 1.0078125 is 1 ULP (bf16 spacing at 1 is 2^-7): the count that is reported.
  const std::vector<double> a = {1.0, 0.0078125, 0.5, 0.25};
  const std::vector<double> b = {1.0078125, -0.0078125, 0.5, 0.25};
  const ComparisonMetrics m = compare({1, 1, 4}, a, b, 0.00390625);
  CHECK(m.max_ulp_bf16 == 1.0);
  CHECK(m.max_ulp_at.dim == 0);
  // The other metrics still see dim 1: it is the largest relative error, 2^-6 / 2^-7 = 2.
  CHECK(m.max_rel == 2.0);
  CHECK(m.max_rel_at.dim == 1);
  // Each (row, head) has its own scale: a second head whose largest |a| is 2^-7 counts its own
  // 1-ULP move at 2^-7 (bf16 spacing there is 2^-14).
  const std::vector<double> a2 = {1.0, 0.5, 0.0078125, 0.00390625};
  const std::vector<double> b2 = {1.0, 0.5, 0.0078125 + 0x1p-14, 0.00390625};
  const ComparisonMetrics two = compare({1, 2, 2}, a2, b2, 0.00390625);
  CHECK(two.max_ulp_bf16 == 1.0);
  CHECK(two.max_ulp_at.head == 1);
  CHECK(two.max_ulp_at.dim == 0);
}

TEST_CASE("all-zero reference: rel_l2 is 0 against zeros and infinite otherwise", "[metrics]") {
  const ComparisonMetrics same = compare({1, 1, 2}, {0, 0}, {0, 0});
  CHECK(same.rel_l2 == 0.0);
  CHECK(same.cos_diff == 0.0);
  CHECK(same.rms == 0.0);
  const ComparisonMetrics off = compare({1, 1, 2}, {0, 0}, {0, 1});
  CHECK(std::isinf(off.rel_l2));
  // sum (a - b)^2 / sum (a^2 + b^2) = 1 / 1.
  CHECK(off.cos_diff == 1.0);
}

TEST_CASE("bf16 ULP distance", "[metrics][bf16]") {
  // 1.0 = 0x3F80; the next bf16 up is 1 + 2^-7 = 1.0078125 (0x3F81).
  CHECK(bf16_ulp_distance(1.0, 1.0078125) == 1.0);
  // Below 1.0 the binade [0.5, 1) has quantum 2^-8: 1 - 2^-8 = 0.99609375 = 0x3F7F.
  CHECK(bf16_ulp_distance(1.0, 0.99609375) == 1.0);
  CHECK(bf16_ulp_distance(0.99609375, 1.0078125) == 2.0);
  CHECK(bf16_ulp_distance(-0.0, 0.0) == 0.0);
  CHECK(bf16_ulp_distance(2.0, 2.0) == 0.0);
  // Symmetric around zero: +-1.0 are 0x3F80 = 16256 steps from zero each.
  CHECK(bf16_ulp_distance(1.0, -1.0) == 32512.0);
  // Smallest subnormal 2^-133 and its negative straddle the two zeros: 2 steps.
  CHECK(bf16_ulp_distance(std::ldexp(1.0, -133), -std::ldexp(1.0, -133)) == 2.0);
  CHECK(std::isinf(bf16_ulp_distance(kNan, 1.0)));
}

TEST_CASE("values are rounded to bf16 once, nearest even, before the distance", "[metrics][bf16]") {
  // 1 + 2^-8 is the midpoint of 0x3F80 and 0x3F81: ties to the even 0x3F80.
  CHECK(round_to_bf16(1.00390625) == 1.0);
  CHECK(bf16_ulp_distance(1.00390625, 1.0) == 0.0);
  // 1 + 3 * 2^-8 is the midpoint of 0x3F81 and 0x3F82: ties to the even 0x3F82 = 1 + 2^-6.
  CHECK(round_to_bf16(1.01171875) == 1.015625);
  // Just above the first midpoint rounds up. Through float it would first round to the midpoint
  // (2^-40 is below float's 2^-23 quantum at 1) and then tie down to 1.0: double rounding.
  const double above_midpoint = 1.00390625 + std::ldexp(1.0, -40);
  CHECK(round_to_bf16(above_midpoint) == 1.0078125);
  CHECK(bf16_ulp_distance(above_midpoint, 1.0) == 1.0);
  // Largest finite bf16 is (2 - 2^-7) * 2^127; at or past the midpoint to 2^128 it overflows.
  const double max_finite = std::ldexp(2.0 - 0.0078125, 127);
  CHECK(round_to_bf16(max_finite) == max_finite);
  CHECK(std::isinf(round_to_bf16(std::ldexp(2.0 - 0.00390625, 127))));
  CHECK(round_to_bf16(-3.0) == -3.0);
}

TEST_CASE("metrics JSON writes non-finite values as strings", "[metrics]") {
  const ComparisonMetrics m = compare({1, 1, 2}, {0, 0}, {0, 1});
  const nlohmann::json j = kvaudit::to_json(m);
  CHECK(j.at("rel_l2") == "inf");
  CHECK(j.at("max_abs") == 1.0);
  CHECK(j.at("max_abs_at").at("dim") == 1);
  CHECK(j.at("lse_max_abs").is_null());
  CHECK(j.at("first_nonfinite_mismatch").is_null());
  CHECK(j.at("elements") == 2);
}

TEST_CASE("bf16 ULPs are counted only where |reference| reaches the floor", "[metrics]") {
  // a = [2^-20, 1], b = [-2^-20, 1.015625]: the first pair crosses zero (thousands of bf16 steps
  // apart, 2 * 0x3580 = 27392), the second is 2 ULPs apart (quantum 2^-7 in [1, 2)).
  const std::vector<double> a = {std::ldexp(1.0, -20), 1.0};
  const std::vector<double> b = {-std::ldexp(1.0, -20), 1.015625};
  CHECK(bf16_ulp_distance(a[0], b[0]) == 27392.0);
  // Without a floor the row's scale still leaves 2^-20 out (below 2^-4 x max |a| = 2^-4).
  const ComparisonMetrics no_floor = compare({1, 1, 2}, a, b, 0.0);
  CHECK(no_floor.max_ulp_bf16 == 2.0);
  CHECK(no_floor.max_ulp_at.dim == 1);
  const ComparisonMetrics floored = compare({1, 1, 2}, a, b, 0.00390625);
  CHECK(floored.max_ulp_bf16 == 2.0);
  CHECK(floored.max_ulp_at.dim == 1);
}

namespace {

// A [rows, heads, dims] pair of tensors: the reference drawn from N(0, 1) with outliers, the
// candidate the reference plus relative noise of about 2^-9 (a bf16-sized error), so that the
// sums of squares span many binades.
struct RandomPair {
  TensorShape3 shape;
  std::vector<double> a;
  std::vector<double> b;
  std::vector<double> lse_a;
  std::vector<double> lse_b;
};

RandomPair random_pair(TensorShape3 shape, unsigned seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  RandomPair pair{shape, {}, {}, {}, {}};
  for (std::size_t i = 0; i < shape.size(); ++i) {
    const double scale = i % 97 == 0 ? 1e3 : 1.0;
    const double a = scale * normal(rng);
    pair.a.push_back(a);
    pair.b.push_back(a * (1.0 + std::ldexp(normal(rng), -9)));
  }
  for (int i = 0; i < shape.rows * shape.heads; ++i) {
    pair.lse_a.push_back(normal(rng));
    pair.lse_b.push_back(pair.lse_a.back() + std::ldexp(normal(rng), -12));
  }
  return pair;
}

std::uint64_t bits_of(double x) {
  std::uint64_t bits = 0;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
}

ComparisonMetrics compare_on_threads(const RandomPair& pair, int threads) {
  return compare_outputs(pair.shape, pair.a, pair.b, pair.lse_a, pair.lse_b, 0.00390625, threads);
}

// Every metric of `m` bit for bit against `expected` (the JSON form holds every field; the sums'
// results are also compared as bits, where JSON's decimal text could round).
void require_same_bits(const ComparisonMetrics& m, const ComparisonMetrics& expected) {
  CHECK(bits_of(m.rms) == bits_of(expected.rms));
  CHECK(bits_of(m.rel_l2) == bits_of(expected.rel_l2));
  CHECK(bits_of(m.cos_diff) == bits_of(expected.cos_diff));
  CHECK(kvaudit::to_json(m).dump() == kvaudit::to_json(expected).dump());
}

}  // namespace

TEST_CASE("metrics are bit for bit the same on 1, 2 and 7 threads", "[metrics]") {
  // 150 x 16 pairs: 10 blocks of 256 pairs (the last one short), more blocks than threads.
  RandomPair pair = random_pair({150, 16, 64}, 20261205);
  SECTION("random tensors") {}
  SECTION("with NaN and Inf at scattered positions") {
    for (std::size_t i = 5; i < pair.a.size(); i += 7919) pair.a[i] = kNan;
    for (std::size_t i = 11; i < pair.b.size(); i += 6151) pair.b[i] = kInf;
    for (std::size_t i = 3; i < pair.b.size(); i += 10007) pair.b[i] = -kInf;
    pair.lse_b[17] = kNan;
  }
  const ComparisonMetrics one = compare_on_threads(pair, 1);
  REQUIRE(one.finite_elements > 0);
  REQUIRE(one.rms > 0.0);
  for (const int threads : {2, 7}) {
    INFO("threads " << threads);
    require_same_bits(compare_on_threads(pair, threads), one);
  }
}

TEST_CASE("the sums of squares are accurate to dims units in the last place", "[metrics]") {
  // cos_diff = sum (a - b)^2 / sum (a^2 + b^2): each sum within (dims - 1) u of the exact sum of
  // its binary64 terms (metrics.cpp), so the ratio within (2 dims - 1) u; the exact sums are
  // taken here in 100 decimal digits, independently of the code under test.
  using Exact = boost::multiprecision::cpp_bin_float_100;
  RandomPair pair = random_pair({150, 16, 64}, 7);
  SECTION("random tensors") {}
  SECTION("one large difference, then many small ones") {
    // (a - b)^2 is 1 at the first element, then 169 2^-62 (about u / 3) at every other: one
    // running binary64 sum stays at 1 (each small term rounds away), off by about 51,000 u.
    for (std::size_t i = 0; i < pair.a.size(); ++i) {
      pair.a[i] = 1.0;
      pair.b[i] = i == 0 ? 0.0 : 1.0 - 13.0 * std::ldexp(1.0, -31);
    }
  }
  Exact diff_sq = 0;
  Exact both_sq = 0;
  for (std::size_t i = 0; i < pair.a.size(); ++i) {
    const double a = pair.a[i];
    const double b = pair.b[i];
    diff_sq += Exact((a - b) * (a - b));
    both_sq += Exact(a * a + b * b);
  }
  const double exact_cos_diff = static_cast<double>(Exact(diff_sq / both_sq));
  const ComparisonMetrics m = compare_on_threads(pair, 2);
  const double bound = (2.0 * pair.shape.dims - 1.0) * std::ldexp(1.0, -53);
  const double relative_error = std::fabs(m.cos_diff - exact_cos_diff) / exact_cos_diff;
  INFO("cos_diff relative error " << relative_error << " (" << relative_error / 0x1p-53
                                  << " u), bound " << bound);
  CHECK(relative_error <= bound);
}

namespace {

// bf16 ordered position of x by an independent route: frexp's significand in [0.5, 1) scaled by
// 2^8 and rounded to an integer, nearest even (the default rounding mode), gives bf16's 8
// significant bits; below 2^-126 the quantum stays 2^-133; past the largest finite, infinity
// (0x7F80). Then sign-magnitude to a signed position, as metrics.hpp defines the distance.
long long bf16_position_oracle(double x) {
  const double magnitude = std::fabs(x);
  double rounded = 0.0;
  if (magnitude < std::ldexp(1.0, -126)) {
    rounded = std::nearbyint(std::ldexp(magnitude, 133)) * std::ldexp(1.0, -133);
  } else {
    int exponent = 0;
    const double significand = std::frexp(magnitude, &exponent);
    rounded = std::ldexp(std::nearbyint(std::ldexp(significand, 8)), exponent - 8);
  }
  long long bits = 0x7F80;  // infinity
  if (rounded <= std::ldexp(2.0 - 0.0078125, 127)) {
    const float as_float = static_cast<float>(rounded);  // exact: rounded has 8 bits
    std::uint32_t float_bits = 0;
    std::memcpy(&float_bits, &as_float, sizeof float_bits);
    bits = float_bits >> 16;
  }
  return std::signbit(x) ? -bits : bits;
}

double bf16_distance_oracle(double a, double b) {
  return static_cast<double>(std::llabs(bf16_position_oracle(a) - bf16_position_oracle(b)));
}

// Values around every edge of bf16_ulp_distance's fast range (2^-126 .. 2^127) and of rounding
// (midpoints, the carry into the exponent), with random ones between.
std::vector<double> edge_values(std::mt19937_64& rng) {
  std::vector<double> values = {
      0.0, -0.0, 1.0, -1.0, 1.00390625, 1.01171875, std::ldexp(2.0 - 0.00390625, 0)};
  for (const int e : {-140, -133, -127, -126, -125, -1, 0, 1, 126, 127, 128}) {
    const double p = std::ldexp(1.0, e);
    for (const double x : {p, std::nextafter(p, 0.0), std::nextafter(p, 2 * p), p * 1.00390625,
                           p * (2.0 - 0.00390625), p * (2.0 - 0.0078125)}) {
      values.push_back(x);
      values.push_back(-x);
    }
  }
  std::uniform_int_distribution<int> exponent(-150, 130);
  std::uniform_real_distribution<double> significand(1.0, 2.0);
  for (int i = 0; i < 2000; ++i) {
    const double x = std::ldexp(significand(rng), exponent(rng));
    values.push_back(i % 2 == 0 ? x : -x);
  }
  return values;
}

// compare_outputs' out metrics by a plain loop over (row, head, dim) in order, written from
// metrics.hpp's definitions: maxima keep their first position, ULPs only where |a| reaches
// max(rel_floor, 2^-4 S), non-finite positions counted and skipped.
struct PlainOutMetrics {
  std::size_t finite = 0;
  double max_abs = 0, max_rel = 0, max_ulp = 0, reference_max = 0;
  std::size_t max_abs_at = 0, max_rel_at = 0, max_ulp_at = 0;
  std::size_t reference_nonfinite = 0, candidate_nonfinite = 0;
};

PlainOutMetrics plain_out_metrics(const RandomPair& pair, double rel_floor) {
  PlainOutMetrics m;
  const int dims = pair.shape.dims;
  bool first = true;
  for (std::size_t pair_index = 0; pair_index * dims < pair.a.size(); ++pair_index) {
    double scale = 0.0;
    for (int d = 0; d < dims; ++d) {
      const double a = pair.a[pair_index * dims + d];
      if (std::isfinite(a)) scale = std::max(scale, std::fabs(a));
    }
    const double ulp_floor = std::max(rel_floor, scale / 16.0);
    for (int d = 0; d < dims; ++d) {
      const std::size_t i = pair_index * dims + d;
      const double a = pair.a[i];
      const double b = pair.b[i];
      m.reference_nonfinite += !std::isfinite(a);
      m.candidate_nonfinite += !std::isfinite(b);
      if (!std::isfinite(a) || !std::isfinite(b)) continue;
      ++m.finite;
      const double diff = std::fabs(a - b);
      const double denominator = std::max(std::fabs(a), rel_floor);
      const double rel = diff == 0.0 ? 0.0 : denominator > 0.0 ? diff / denominator : kInf;
      const double ulp = std::fabs(a) >= ulp_floor ? bf16_distance_oracle(a, b) : 0.0;
      if (first || diff > m.max_abs) m.max_abs = diff, m.max_abs_at = i;
      if (first || rel > m.max_rel) m.max_rel = rel, m.max_rel_at = i;
      if (first || ulp > m.max_ulp) m.max_ulp = ulp, m.max_ulp_at = i;
      m.reference_max = std::max(m.reference_max, std::fabs(a));
      first = false;
    }
  }
  return m;
}

std::size_t flat_index(const kvaudit::ElementLocation& at, TensorShape3 shape) {
  return (static_cast<std::size_t>(at.row) * shape.heads + at.head) * shape.dims + at.dim;
}

}  // namespace

TEST_CASE("bf16 ULP distance agrees with rounding by frexp around every edge", "[metrics][bf16]") {
  std::mt19937_64 rng(20261205);
  const std::vector<double> values = edge_values(rng);
  std::size_t checked = 0;
  for (std::size_t i = 0; i < values.size(); ++i) {
    for (const std::size_t j : {i, (i * 7919 + 13) % values.size(), (i + 1) % values.size()}) {
      INFO("a = " << values[i] << ", b = " << values[j]);
      REQUIRE(bf16_ulp_distance(values[i], values[j]) ==
              bf16_distance_oracle(values[i], values[j]));
      ++checked;
    }
  }
  CHECK(checked > 6000);
}

TEST_CASE("compare_outputs' maxima and their positions match a plain loop over the elements",
          "[metrics]") {
  // 40 x 8 pairs of 64 dims: most pairs all finite, some with NaN or Inf (the element-by-element
  // path), ties of the largest error at several positions (the first must be kept), exact
  // agreement, zeros in the reference.
  RandomPair pair = random_pair({40, 8, 64}, 99);
  const double rel_floor = GENERATE(0.0, 0.00390625);
  SECTION("random") {}
  SECTION("ties, zeros and non-finite values") {
    for (std::size_t i = 0; i < pair.a.size(); i += 5) pair.b[i] = pair.a[i];  // exact
    for (std::size_t i = 1; i < pair.a.size(); i += 11) pair.a[i] = 0.0;
    for (std::size_t i = 2; i < pair.a.size(); i += 13) pair.a[i] = std::ldexp(1.0, -130);
    // The same largest error at three positions in different pairs, and twice within one pair.
    for (const std::size_t i : {700u, 703u, 4000u, 9000u}) {
      pair.a[i] = 3.0;
      pair.b[i] = -61.0;
    }
    pair.a[1500] = kNan;
    pair.b[2600] = kInf;
    pair.b[2601] = -kInf;
    pair.a[7000] = kInf;
    pair.b[7000] = kInf;
    pair.b[300] = 0.0;  // in the ULP domain, outside the distance's fast range
    pair.b[301] = std::ldexp(1.0, -140);
  }
  const PlainOutMetrics plain = plain_out_metrics(pair, rel_floor);
  for (const int threads : {1, 3}) {
    const ComparisonMetrics m =
        compare_outputs(pair.shape, pair.a, pair.b, pair.lse_a, pair.lse_b, rel_floor, threads);
    INFO("threads " << threads << ", rel_floor " << rel_floor);
    CHECK(m.finite_elements == plain.finite);
    CHECK(m.reference_nonfinite == plain.reference_nonfinite);
    CHECK(m.candidate_nonfinite == plain.candidate_nonfinite);
    CHECK(bits_of(m.max_abs) == bits_of(plain.max_abs));
    CHECK(flat_index(m.max_abs_at, pair.shape) == plain.max_abs_at);
    CHECK(bits_of(m.max_rel) == bits_of(plain.max_rel));
    CHECK(flat_index(m.max_rel_at, pair.shape) == plain.max_rel_at);
    CHECK(bits_of(m.max_ulp_bf16) == bits_of(plain.max_ulp));
    CHECK(flat_index(m.max_ulp_at, pair.shape) == plain.max_ulp_at);
    CHECK(bits_of(m.reference_max_abs) == bits_of(plain.reference_max));
  }
}
