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
//   exp(r) = (1 + expm1(r / 32))^32 with the Taylor series of expm1 to the 13th power
//   (|r/32| <= 0.011, so the first omitted term is < 0.011^14 / 14! < 1e-37) and five squarings
//   in the form e <- 2e + e^2, which multiply the relative error by at most 32;
//   log(a) = y + (a exp(-y) - 1), y = std::log(a.hi): one Newton step from a double-precision
//   start squares its 1e-16 error.
// Non-finite inputs propagate as NaN or infinity in hi; nothing here loops on them.
#pragma once

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

namespace kvaudit::dd {

struct DoubleDouble {
  double hi = 0.0;
  double lo = 0.0;
};

// s + e == a + b exactly (any magnitudes).
inline DoubleDouble two_sum(double a, double b) {
  const double s = a + b;
  const double bb = s - a;
  const double e = (a - (s - bb)) + (b - bb);
  return {s, e};
}

// s + e == a + b exactly, provided |a| >= |b| (or a == 0).
inline DoubleDouble fast_two_sum(double a, double b) {
  const double s = a + b;
  const double e = b - (s - a);
  return {s, e};
}

// a == hi + lo with hi = a truncated to 26 significant bits (the low 27 stored bits cleared) and
// lo = a - hi (exact, <= 27 significant bits): products of either with a float are exact in a
// double (<= 51 bits). It has no multiplication, so it stays exact when a compiler contracts
// expressions into fused multiply-adds.
inline void split_truncate(double a, double& hi, double& lo) {
  std::uint64_t bits;
  std::memcpy(&bits, &a, sizeof bits);
  bits &= ~((std::uint64_t{1} << 27) - 1);
  std::memcpy(&hi, &bits, sizeof hi);
  lo = a - hi;
}

// p + e == a * b exactly (barring overflow/underflow): the fused multiply-add's single rounding
// makes a * b - p exact. std::fma is correctly rounded everywhere (an instruction on FMA targets,
// glibc's hardware or software routine otherwise); unlike Dekker's splitting, it stays exact when
// the compiler contracts other expressions into FMAs.
inline DoubleDouble two_prod(double a, double b) {
  const double p = a * b;
  return {p, std::fma(a, b, -p)};
}

inline DoubleDouble neg(DoubleDouble a) { return {-a.hi, -a.lo}; }

inline DoubleDouble add(DoubleDouble a, DoubleDouble b) {
  const DoubleDouble s = two_sum(a.hi, b.hi);
  const DoubleDouble t = two_sum(a.lo, b.lo);
  const DoubleDouble u = fast_two_sum(s.hi, s.lo + t.hi);
  return fast_two_sum(u.hi, t.lo + u.lo);
}

inline DoubleDouble add(DoubleDouble a, double b) {
  const DoubleDouble s = two_sum(a.hi, b);
  return fast_two_sum(s.hi, s.lo + a.lo);
}

inline DoubleDouble mul(DoubleDouble a, double b) {
  const DoubleDouble p = two_prod(a.hi, b);
  return fast_two_sum(p.hi, p.lo + a.lo * b);
}

inline DoubleDouble mul(DoubleDouble a, DoubleDouble b) {
  const DoubleDouble p = two_prod(a.hi, b.hi);
  return fast_two_sum(p.hi, p.lo + (a.hi * b.lo + a.lo * b.hi));
}

inline DoubleDouble div(DoubleDouble a, double b) {
  const double q1 = a.hi / b;
  const DoubleDouble p = two_prod(q1, b);
  const DoubleDouble r = two_sum(a.hi, -p.hi);
  const double q2 = ((r.hi + (r.lo - p.lo)) + a.lo) / b;
  return fast_two_sum(q1, q2);
}

inline DoubleDouble div(DoubleDouble a, DoubleDouble b) {
  const double q1 = a.hi / b.hi;
  DoubleDouble r = add(a, neg(mul(b, q1)));
  const double q2 = r.hi / b.hi;
  r = add(r, neg(mul(b, q2)));
  const double q3 = r.hi / b.hi;
  return add(fast_two_sum(q1, q2), q3);
}

// Rounds to the nearest double (exactly when the pair is normalised, as every result above is).
inline double to_double(DoubleDouble a) { return a.hi + a.lo; }

// ln 2 = 0.693147180559945309417232121458176568..., as hi + lo (checked against Boost at 50 digits
// in tests/references/test_mla_reference.cpp).
inline constexpr DoubleDouble kLn2{0.6931471805599453094, 2.319046813846299558e-17};

KVAUDIT_DD_INLINE DoubleDouble exp(DoubleDouble x) {
  if (std::isnan(x.hi)) return {x.hi, 0.0};
  if (x.hi > 709.78) return {std::numeric_limits<double>::infinity(), 0.0};
  if (x.hi < -745.2) return {0.0, 0.0};  // below half the smallest subnormal
  const double k = std::nearbyint(x.hi / kLn2.hi);
  DoubleDouble r = add(x, mul(kLn2, -k));
  r = {std::ldexp(r.hi, -5), std::ldexp(r.lo, -5)};  // exact scaling by 1/32
  // expm1(r) = r (1 + r/2 (1 + r/3 (... (1 + r/13)))).
  DoubleDouble t{1.0, 0.0};
  for (int n = 13; n >= 2; --n) t = add(mul(div(r, static_cast<double>(n)), t), 1.0);
  DoubleDouble e = mul(r, t);
  for (int i = 0; i < 5; ++i) e = add(DoubleDouble{2.0 * e.hi, 2.0 * e.lo}, mul(e, e));
  const DoubleDouble y = add(e, 1.0);
  const int k_int = static_cast<int>(k);
  return {std::ldexp(y.hi, k_int), std::ldexp(y.lo, k_int)};
}

inline DoubleDouble log(DoubleDouble a) {
  if (!(a.hi > 0.0) || std::isinf(a.hi)) return {std::log(a.hi), 0.0};
  const double y = std::log(a.hi);
  const DoubleDouble correction = add(mul(a, exp(DoubleDouble{-y, 0.0})), -1.0);
  return add(correction, y);
}

}  // namespace kvaudit::dd
