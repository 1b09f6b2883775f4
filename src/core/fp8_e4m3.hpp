// FP8 e4m3fn and bfloat16 codecs, usable from host and device code.
//
// e4m3fn (OCP FP8, "fn" = finite + NaN): bit pattern S.EEEE.MMM, exponent bias 7.
//   E = 0      : subnormal, value = (-1)^S * M/8 * 2^-6   (smallest 2^-9)
//   E = 1..15  : normal,    value = (-1)^S * (1 + M/8) * 2^(E-7)
//   E=15, M=7  : NaN (0x7F, 0xFF). There is no infinity. Largest finite: 0x7E = 1.75 * 2^8 = 448.
// Unit roundoff of e4m3 (3 mantissa bits, round to nearest) is 2^-4; bf16 (7 bits) is 2^-8.
//
// Encoding rounds to nearest, ties to even, computed exactly with integer arithmetic on the
// source's bits (no intermediate rounding), so float, double and bf16 inputs each round once.
// Overflow: the first value that rounds past 448 is the midpoint 464 = (448 + 480) / 2, where 480
// would be the next step of the format; 464 itself ties to 448 (mantissa 110 is even).
//   satfinite: |x| > 448 (and +-inf) -> +-448, as PTX cvt.rn.satfinite.e4m3x2.f32 does.
//   nosat:     values that round past 448 (|x| > 464) and +-inf -> NaN, as PyTorch <= 2.11 and
//              ml_dtypes do.
// NaN input gives the canonical NaN code 0x7F in both modes (the PTX conversion's result).
#pragma once

#include <array>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define KVAUDIT_HOST_DEVICE __host__ __device__
#else
#define KVAUDIT_HOST_DEVICE
#endif

namespace kvaudit {

inline constexpr std::uint8_t kE4m3NanCode = 0x7F;
inline constexpr std::uint8_t kE4m3MaxFiniteCode = 0x7E;  // 448
inline constexpr float kE4m3MaxFinite = 448.0f;
inline constexpr double kE4m3UnitRoundoff = 0.0625;                  // 2^-4
inline constexpr double kBf16UnitRoundoff = 0.00390625;              // 2^-8
inline constexpr double kFp32UnitRoundoff = 5.9604644775390625e-08;  // 2^-24

enum class E4m3Overflow : std::uint8_t { kSatFinite, kNoSat };

KVAUDIT_HOST_DEVICE inline std::uint32_t float_bits(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}
KVAUDIT_HOST_DEVICE inline float float_from_bits(std::uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}
KVAUDIT_HOST_DEVICE inline std::uint64_t double_bits(double x) {
  std::uint64_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

// ---- e4m3fn decode -----------------------------------------------------------------------------

KVAUDIT_HOST_DEVICE constexpr bool e4m3_is_nan(std::uint8_t code) { return (code & 0x7F) == 0x7F; }

// Exact value of a code as float bits (every e4m3 value is a normal or zero float).
KVAUDIT_HOST_DEVICE constexpr std::uint32_t e4m3_decode_float_bits(std::uint8_t code) {
  const std::uint32_t sign = static_cast<std::uint32_t>(code & 0x80) << 24;
  const std::uint32_t exponent = (code >> 3) & 0xF;
  const std::uint32_t mantissa = code & 0x7;
  if (exponent == 0xF && mantissa == 0x7) return sign | 0x7FC00000u;  // quiet NaN
  if (exponent != 0) return sign | ((exponent - 7 + 127) << 23) | (mantissa << 20);
  if (mantissa == 0) return sign;
  // Subnormal M/8 * 2^-6 = M * 2^-9: normalise the 3-bit mantissa into a float.
  std::uint32_t shift = 0;  // leading position of M
  std::uint32_t m = mantissa;
  while ((m & 0x4) == 0) {
    m <<= 1;
    ++shift;
  }
  // M = 1.xx * 2^(2-shift); value exponent = 2 - shift - 9.
  const std::uint32_t frac = (m & 0x3) << 21;
  return sign | (static_cast<std::uint32_t>(2 - static_cast<int>(shift) - 9 + 127) << 23) | frac;
}

KVAUDIT_HOST_DEVICE inline float e4m3_decode(std::uint8_t code) {
  return float_from_bits(e4m3_decode_float_bits(code));
}

// The values of all 256 codes (e4m3_decode of each; NaN codes as its quiet NaNs, whose bits the
// copies keep), built once, so that a row decodes by one load per element: e4m3_decode branches
// on subnormals and NaN codes. Host only (the exact reference and the kernels' CPU model).
inline const std::array<float, 256>& e4m3_value_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> values{};
    for (int code = 0; code < 256; ++code)
      values[code] = e4m3_decode(static_cast<std::uint8_t>(code));
    return values;
  }();
  return table;
}

// ---- e4m3fn encode -----------------------------------------------------------------------------

namespace detail {

// Round (sign, biased exponent, mantissa field) of a binary format with `kMantBits` stored
// mantissa bits and bias `kBias` to e4m3fn, nearest-even, in exact integer arithmetic.
template <int kMantBits, int kBias, int kMaxBiasedExponent, typename UInt>
KVAUDIT_HOST_DEVICE constexpr std::uint8_t e4m3_round_fields(bool negative, int biased_exponent,
                                                             UInt mantissa, E4m3Overflow mode) {
  const std::uint8_t sign = negative ? 0x80 : 0x00;
  if (biased_exponent == kMaxBiasedExponent) {  // inf or NaN
    if (mantissa != 0) return kE4m3NanCode;
    return mode == E4m3Overflow::kSatFinite ? static_cast<std::uint8_t>(sign | kE4m3MaxFiniteCode)
                                            : static_cast<std::uint8_t>(sign | kE4m3NanCode);
  }
  if (biased_exponent == 0) return sign;  // source zero or subnormal: far below 2^-10
  const int exponent = biased_exponent - kBias;
  const UInt significand = (UInt{1} << kMantBits) | mantissa;  // value = sig * 2^(e - kMantBits)
  // Quantum of the e4m3 binade holding |x|: 2^(e-3) for normals, 2^-9 below 2^-6.
  const int quantum_exponent = (exponent < -6 ? -6 : exponent) - 3;
  const int shift = kMantBits + quantum_exponent - exponent;  // >= kMantBits - 3 > 0
  if (shift > kMantBits + 1) return sign;                     // |x| < quantum / 2
  UInt multiple = significand >> shift;
  const UInt remainder = significand & ((UInt{1} << shift) - 1);
  const UInt half = UInt{1} << (shift - 1);
  if (remainder > half || (remainder == half && (multiple & 1))) ++multiple;
  int code;
  if (exponent < -6) {
    code = static_cast<int>(multiple);  // 0..8; 8 is the smallest normal, code 0x08
  } else {
    int e = exponent;
    if (multiple == 16) {  // rounded up into the next binade
      multiple = 8;
      ++e;
    }
    const int field = e + 7;
    if (field > 15) {
      code = 0x80;  // overflow marker, handled below
    } else {
      code = (field << 3) | static_cast<int>(multiple - 8);
    }
  }
  if (code > kE4m3MaxFiniteCode) {  // 0x7F (would-be 480) or beyond: overflow
    return mode == E4m3Overflow::kSatFinite ? static_cast<std::uint8_t>(sign | kE4m3MaxFiniteCode)
                                            : static_cast<std::uint8_t>(sign | kE4m3NanCode);
  }
  return static_cast<std::uint8_t>(sign | code);
}

}  // namespace detail

KVAUDIT_HOST_DEVICE inline std::uint8_t e4m3_encode(float x,
                                                    E4m3Overflow mode = E4m3Overflow::kSatFinite) {
  const std::uint32_t u = float_bits(x);
  return detail::e4m3_round_fields<23, 127, 255, std::uint32_t>(
      (u >> 31) != 0, static_cast<int>((u >> 23) & 0xFF), u & 0x7FFFFFu, mode);
}

KVAUDIT_HOST_DEVICE inline std::uint8_t e4m3_encode(double x,
                                                    E4m3Overflow mode = E4m3Overflow::kSatFinite) {
  const std::uint64_t u = double_bits(x);
  return detail::e4m3_round_fields<52, 1023, 2047, std::uint64_t>(
      (u >> 63) != 0, static_cast<int>((u >> 52) & 0x7FF), u & 0xFFFFFFFFFFFFFull, mode);
}

// ---- bfloat16 ----------------------------------------------------------------------------------

KVAUDIT_HOST_DEVICE inline float bf16_to_float(std::uint16_t bits) {
  return float_from_bits(static_cast<std::uint32_t>(bits) << 16);
}

// Round to nearest even; NaN stays NaN (quiet, sign kept); overflow goes to +-inf as IEEE does.
KVAUDIT_HOST_DEVICE inline std::uint16_t bf16_from_float(float x) {
  const std::uint32_t u = float_bits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);
  const std::uint32_t rounding_bias = 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>((u + rounding_bias) >> 16);
}

KVAUDIT_HOST_DEVICE inline float bf16_round(float x) { return bf16_to_float(bf16_from_float(x)); }

// bf16 -> e4m3 is the float rule on the exactly widened value.
KVAUDIT_HOST_DEVICE inline std::uint8_t e4m3_encode_bf16(
    std::uint16_t bits, E4m3Overflow mode = E4m3Overflow::kSatFinite) {
  return e4m3_encode(bf16_to_float(bits), mode);
}

// ---- the kvdump write rule ---------------------------------------------------------------------

// kvdump-v1 "Semantics": slot <- e4m3_rne_satfinite(fp32(value) / fp32(kv_scale)), one IEEE
// binary32 division, then one rounding to e4m3fn.
KVAUDIT_HOST_DEVICE inline std::uint8_t kvdump_quantize(float value, float kv_scale) {
  return e4m3_encode(value / kv_scale, E4m3Overflow::kSatFinite);
}

// The convention some servers use instead (multiply by a reciprocal computed in fp32). Offered as
// an option, named as such; it can differ from kvdump_quantize in the last bit of rare codes.
KVAUDIT_HOST_DEVICE inline std::uint8_t kvdump_quantize_reciprocal(float value, float kv_scale) {
  const float inverse = 1.0f / kv_scale;
  return e4m3_encode(value * inverse, E4m3Overflow::kSatFinite);
}

}  // namespace kvaudit
