// Double-double arithmetic for the CPU reference: a value is the unevaluated sum hi + lo of two
// doubles (|lo| <= ulp(hi) / 2 once normalised), about 106 significant bits.
//
// Error-free transformations (Knuth TwoSum; TwoProd by fused multiply-add) give the exact
// rounding error of one double operation as another double. On top of them, each operation below
// has a relative error of a few units of 2^-104 (Joldes, Muller, Popescu, "Tight and rigorous error
// bounds for basic building blocks of double-word arithmetic", 2017: add <= 3u^2, mul by double <=
// 2u^2, mul <= 5u^2, div <= 15u^2 for these algorithms, u = 2^-53), i.e. relative ~1e-31: far below
// the reference's 1e-15 target, which is what lets it be both exact to double precision and fast.
//
// exp and log are computed to ~1e-30 relative (exp) and ~1e-31 absolute (log near 1):
//   exp(x) = 2^k * exp(r),  k = round(x / ln2),  r = x - k ln2  (|r| <= ln2 / 2),
//   exp(r) = (1 + expm1(r / 32))^32 with the Taylor series of expm1 to the 13th power (r/n formed
//   as r times a double-double 1/n, ~2^-104 relative like a division)
//   (|r/32| <= 0.011, so the first omitted term is < 0.011^14 / 14! < 1e-37) and five squarings
//   in the form e <- 2e + e^2, which multiply the relative error by at most 32;
//   log(a) = y + (a exp(-y) - 1), y = std::log(a.hi): one Newton step from a double-precision
//   start squares its 1e-16 error.
// Non-finite inputs propagate as NaN or infinity in hi; nothing here loops on them.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

// Forced inlining puts exp's body into its callers, including function-multiversioned clones
// compiled for other targets (references/mla_reference.cpp), where two_prod's std::fma then
// becomes one instruction.
#if defined(__GNUC__)
#define KVAUDIT_DD_INLINE inline __attribute__((always_inline))
#else
#define KVAUDIT_DD_INLINE inline
#endif

// Every function here also compiles as device code for the GPU reference
// (references/mla_reference_cuda.cu), so that both references run the same algorithms. Device code
// must be compiled with nvcc --fmad=false: nvcc contracts a product into a later addition even when
// the product has other uses, so `p = a * b; s = p + c` would no longer round p where written and
// two_prod/mul's error terms would be wrong. GCC contracts a product only when every use of it is
// an addition or subtraction: two_prod's product also feeds its fma, so it is never contracted,
// and the other inexact products land in low-order words, where a fused rounding only helps; host
// code is safe with GCC's default -ffp-contract=fast (and the tests and each run's certification
// check it against 50 digits).
#if defined(__CUDACC__)
#define KVAUDIT_DD_HD __host__ __device__
#else
#define KVAUDIT_DD_HD
#endif

namespace kvaudit::dd {

struct DoubleDouble {
  double hi = 0.0;
  double lo = 0.0;
};

// s + e == a + b exactly (any magnitudes).
KVAUDIT_DD_HD inline DoubleDouble two_sum(double a, double b) {
  const double s = a + b;
  const double bb = s - a;
  const double e = (a - (s - bb)) + (b - bb);
  return {s, e};
}

// s + e == a + b exactly, provided |a| >= |b| (or a == 0).
KVAUDIT_DD_HD inline DoubleDouble fast_two_sum(double a, double b) {
  const double s = a + b;
  const double e = b - (s - a);
  return {s, e};
}

// a == hi + lo with hi = a truncated to 26 significant bits (the low 27 stored bits cleared) and
// lo = a - hi (exact, <= 27 significant bits): products of either with a float are exact in a
// double (<= 51 bits). It has no multiplication, so it stays exact when a compiler contracts
// expressions into fused multiply-adds.
KVAUDIT_DD_HD inline void split_truncate(double a, double& hi, double& lo) {
#if defined(__CUDA_ARCH__)
  hi = __longlong_as_double(__double_as_longlong(a) & ~((1LL << 27) - 1));
#else
  std::uint64_t bits;
  std::memcpy(&bits, &a, sizeof bits);
  bits &= ~((std::uint64_t{1} << 27) - 1);
  std::memcpy(&hi, &bits, sizeof hi);
#endif
  lo = a - hi;
}

// p + e == a * b exactly (barring overflow/underflow): the fused multiply-add's single rounding
// makes a * b - p exact. std::fma is correctly rounded everywhere (an instruction on FMA targets,
// glibc's hardware or software routine otherwise); unlike Dekker's splitting, it stays exact when
// the compiler contracts other expressions into FMAs.
KVAUDIT_DD_HD inline DoubleDouble two_prod(double a, double b) {
  const double p = a * b;
  return {p, std::fma(a, b, -p)};
}

KVAUDIT_DD_HD inline DoubleDouble neg(DoubleDouble a) { return {-a.hi, -a.lo}; }

KVAUDIT_DD_HD inline DoubleDouble add(DoubleDouble a, DoubleDouble b) {
  const DoubleDouble s = two_sum(a.hi, b.hi);
  const DoubleDouble t = two_sum(a.lo, b.lo);
  const DoubleDouble u = fast_two_sum(s.hi, s.lo + t.hi);
  return fast_two_sum(u.hi, t.lo + u.lo);
}

KVAUDIT_DD_HD inline DoubleDouble add(DoubleDouble a, double b) {
  const DoubleDouble s = two_sum(a.hi, b);
  return fast_two_sum(s.hi, s.lo + a.lo);
}

KVAUDIT_DD_HD inline DoubleDouble mul(DoubleDouble a, double b) {
  const DoubleDouble p = two_prod(a.hi, b);
  return fast_two_sum(p.hi, p.lo + a.lo * b);
}

KVAUDIT_DD_HD inline DoubleDouble mul(DoubleDouble a, DoubleDouble b) {
  const DoubleDouble p = two_prod(a.hi, b.hi);
  return fast_two_sum(p.hi, p.lo + (a.hi * b.lo + a.lo * b.hi));
}

KVAUDIT_DD_HD inline DoubleDouble div(DoubleDouble a, DoubleDouble b) {
  const double q1 = a.hi / b.hi;
  DoubleDouble r = add(a, neg(mul(b, q1)));
  const double q2 = r.hi / b.hi;
  r = add(r, neg(mul(b, q2)));
  const double q3 = r.hi / b.hi;
  return add(fast_two_sum(q1, q2), q3);
}

// Rounds to the nearest double (exactly when the pair is normalised, as every result above is).
KVAUDIT_DD_HD inline double to_double(DoubleDouble a) { return a.hi + a.lo; }

// ln 2 = 0.693147180559945309417232121458176568..., as hi + lo (checked against Boost at 50 digits
// in tests/references/test_mla_reference.cpp).
inline constexpr double kLn2Hi = 0.6931471805599453094;
inline constexpr double kLn2Lo = 2.319046813846299558e-17;
inline constexpr DoubleDouble kLn2{kLn2Hi, kLn2Lo};

// 2^k, exactly, for -1022 <= k <= 1023 (a normal double built from its exponent bits).
KVAUDIT_DD_HD inline double power_of_two(int k) {
  const auto bits = static_cast<std::uint64_t>(k + 1023) << 52;
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(static_cast<long long>(bits));
#else
  return std::bit_cast<double>(bits);
#endif
}

// y * 2^k rounded once, as std::ldexp(y, k), for |y| < 2 and -1075 <= k <= 1024: a product with
// an exact power of two is correctly rounded like ldexp, without its library call (measured: a
// tenth of the CPU reference's time went to ldexp). Outside the normal exponents the scaling is
// split so that the first product is exact and only the second rounds.
KVAUDIT_DD_HD inline double times_power_of_two(double y, int k) {
  if (k > 1023) return y * power_of_two(1023) * power_of_two(k - 1023);
  if (k < -1022) return y * power_of_two(k + 600) * power_of_two(-600);
  return y * power_of_two(k);
}

KVAUDIT_DD_HD KVAUDIT_DD_INLINE DoubleDouble exp(DoubleDouble x) {
  if (std::isnan(x.hi)) return {x.hi, 0.0};
  if (x.hi > 709.78) return {std::numeric_limits<double>::infinity(), 0.0};
  if (x.hi < -745.2) return {0.0, 0.0};  // below half the smallest subnormal
  const double k = std::nearbyint(x.hi / kLn2Hi);
  DoubleDouble r = add(x, mul(DoubleDouble{kLn2Hi, kLn2Lo}, -k));
  r = {r.hi * 0.03125, r.lo * 0.03125};  // scaling by 1/32: exact, as ldexp(r, -5)
  // expm1(r) = r (1 + r/2 (1 + r/3 (... (1 + r/13)))).
  // r/n as r * (1/n), with 1/n = hi + lo to 2^-107 (below, n = 2..13): a product is a few
  // operations where a division is two hardware divides (measured: a third of exp's time).
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
  DoubleDouble t{1.0, 0.0};
#if defined(__CUDACC__)
#pragma unroll
#elif defined(__GNUC__)
#pragma GCC unroll 12
#endif
  for (int n = 13; n >= 2; --n) {
    t = add(mul(mul(r, DoubleDouble{kInverseHi[n - 2], kInverseLo[n - 2]}), t), 1.0);
  }
  DoubleDouble e = mul(r, t);
  for (int i = 0; i < 5; ++i) e = add(DoubleDouble{2.0 * e.hi, 2.0 * e.lo}, mul(e, e));
  const DoubleDouble y = add(e, 1.0);
  const int k_int = static_cast<int>(k);
  return {times_power_of_two(y.hi, k_int), times_power_of_two(y.lo, k_int)};
}

KVAUDIT_DD_HD inline DoubleDouble log(DoubleDouble a) {
  if (!(a.hi > 0.0) || std::isinf(a.hi)) return {std::log(a.hi), 0.0};
  const double y = std::log(a.hi);
  const DoubleDouble correction = add(mul(a, exp(DoubleDouble{-y, 0.0})), -1.0);
  return add(correction, y);
}

}  // namespace kvaudit::dd
