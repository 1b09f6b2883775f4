// The e4m3fn / bf16 codec against a slow oracle written differently: values by std::ldexp from
// the (E, M) fields, encoding as "the nearest of the 254 finite values by exact comparison, ties to
// the even code", overflow by the stated thresholds (satfinite: |x| > 448 -> 448; nosat: |x| > 464
// -> NaN). Exhaustive over all 65,536 bf16 bit patterns in both modes, and dense over floats and
// doubles at and around every rounding midpoint and the overflow boundary.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "src/core/fp8_e4m3.hpp"
#include "src/core/fp8_e4m3_rows.hpp"

namespace {

using kvaudit::E4m3Overflow;

long double oracle_decode(int code) {
  const int sign = (code >> 7) & 1;
  const int exponent = (code >> 3) & 0xF;
  const int mantissa = code & 7;
  long double magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(static_cast<long double>(mantissa), -9);
  } else {
    magnitude = std::ldexp(static_cast<long double>(8 + mantissa), exponent - 10);
  }
  return sign ? -magnitude : magnitude;
}

bool oracle_is_nan(int code) { return (code & 0x7F) == 0x7F; }

// x is exactly representable in long double (float or double input).
std::uint8_t oracle_encode(long double x, E4m3Overflow mode) {
  if (std::isnan(x)) return 0x7F;
  const std::uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const long double magnitude = std::fabs(x);
  if (mode == E4m3Overflow::kSatFinite && magnitude > 448.0L) return sign | 0x7E;
  if (mode == E4m3Overflow::kNoSat && magnitude > 464.0L) return sign | 0x7F;
  int best = 0;
  long double best_distance = std::numeric_limits<long double>::infinity();
  for (int code = 0; code <= 0x7E; ++code) {
    const long double distance = std::fabs(magnitude - oracle_decode(code));
    if (distance < best_distance || (distance == best_distance && (code & 1) == 0)) {
      best = code;
      best_distance = distance;
    }
  }
  return static_cast<std::uint8_t>(sign | best);
}

std::vector<long double> positive_e4m3_values() {
  std::vector<long double> values;
  for (int code = 0; code <= 0x7E; ++code) values.push_back(oracle_decode(code));
  return values;
}

// Floats at and next to every midpoint of adjacent e4m3 values, at the values themselves, and
// around the overflow boundaries, both signs.
std::vector<float> float_probe_points() {
  std::vector<float> points;
  const auto values = positive_e4m3_values();
  auto add_around = [&points](float center) {
    float below = center;
    float above = center;
    for (int step = 0; step < 4; ++step) {
      points.push_back(below);
      points.push_back(above);
      below = std::nextafter(below, -std::numeric_limits<float>::infinity());
      above = std::nextafter(above, std::numeric_limits<float>::infinity());
    }
  };
  for (std::size_t i = 0; i < values.size(); ++i) {
    add_around(static_cast<float>(values[i]));
    if (i + 1 < values.size()) add_around(static_cast<float>((values[i] + values[i + 1]) / 2));
  }
  for (float boundary : {448.0f, 464.0f, 480.0f, 496.0f, 512.0f, 1e6f, 0x1p-10f, 0x1p-9f}) {
    add_around(boundary);
  }
  points.push_back(std::numeric_limits<float>::infinity());
  points.push_back(std::numeric_limits<float>::max());
  points.push_back(std::numeric_limits<float>::denorm_min());
  points.push_back(std::numeric_limits<float>::min());
  points.push_back(0.0f);
  const std::size_t positive = points.size();
  for (std::size_t i = 0; i < positive; ++i) points.push_back(-points[i]);
  return points;
}

}  // namespace

TEST_CASE("e4m3 decode matches the (E, M) definition for all 256 codes", "[fp8]") {
  int nan_codes = 0;
  for (int code = 0; code < 256; ++code) {
    const float value = kvaudit::e4m3_decode(static_cast<std::uint8_t>(code));
    if (oracle_is_nan(code)) {
      ++nan_codes;
      CHECK(std::isnan(value));
      CHECK(kvaudit::e4m3_is_nan(static_cast<std::uint8_t>(code)));
      continue;
    }
    INFO("code 0x" << std::hex << code);
    CHECK(static_cast<long double>(value) == oracle_decode(code));
    CHECK(std::signbit(value) == ((code & 0x80) != 0));
  }
  CHECK(nan_codes == 2);
  CHECK(kvaudit::e4m3_decode(0x7E) == 448.0f);
  CHECK(kvaudit::e4m3_decode(0x01) == 0x1p-9f);
  CHECK(kvaudit::e4m3_decode(0x08) == 0x1p-6f);
}

TEST_CASE("e4m3 rows decode to the bits of e4m3_decode with their largest finite code", "[fp8]") {
  // All 256 codes in a row (the vector loop's body and its remainder both), shifted by every
  // offset in 0..40 so that each code lands in every lane; then the largest finite magnitude's
  // code against the oracle's largest |value|.
  std::vector<std::uint8_t> codes;
  for (int round = 0; round < 3; ++round) {
    for (int code = 0; code < 256; ++code) codes.push_back(static_cast<std::uint8_t>(code));
  }
  for (int offset = 0; offset <= 40; ++offset) {
    const int n = 256 + offset;
    std::vector<float> out(static_cast<std::size_t>(n) + 1, -1.0f);
    const std::uint8_t largest = kvaudit::e4m3_decode_row(codes.data() + offset, n, out.data());
    int differing = 0;
    for (int i = 0; i < n; ++i) {
      const std::uint32_t want =
          kvaudit::e4m3_decode_float_bits(codes[static_cast<std::size_t>(offset + i)]);
      std::uint32_t got;
      std::memcpy(&got, &out[static_cast<std::size_t>(i)], sizeof got);
      differing += got != want;
    }
    CAPTURE(offset);
    CHECK(differing == 0);
    CHECK(out[static_cast<std::size_t>(n)] == -1.0f);  // nothing written past n
    CHECK(largest == 0x7E);                            // 448: every code is present
  }
  // The largest finite magnitude, of either sign, NaN codes left out.
  auto largest_of = [](std::vector<std::uint8_t> row) {
    std::vector<float> out(row.size());
    return kvaudit::e4m3_decode_row(row.data(), static_cast<int>(row.size()), out.data());
  };
  CHECK(largest_of({0x7f, 0xff, 0x01, 0x80}) == 0x01);
  CHECK(largest_of({0x38, 0xc8, 0x7f, 0x30}) == 0x48);  // -4.0 beats 1.0
  CHECK(largest_of({0x7f, 0xff}) == 0);
  CHECK(largest_of({}) == 0);
  long double biggest = 0;
  std::uint8_t biggest_code = 0;
  for (int code = 0; code < 256; ++code) {
    if (oracle_is_nan(code)) continue;
    if (std::fabs(oracle_decode(code)) > biggest) {
      biggest = std::fabs(oracle_decode(code));
      biggest_code = static_cast<std::uint8_t>(code & 0x7f);
    }
  }
  CHECK(biggest_code == 0x7E);
}

TEST_CASE("e4m3 encode is exhaustive-correct over all bf16 bit patterns", "[fp8]") {
  for (const E4m3Overflow mode : {E4m3Overflow::kSatFinite, E4m3Overflow::kNoSat}) {
    int mismatches = 0;
    for (std::uint32_t bits = 0; bits < 65536; ++bits) {
      const float x = kvaudit::bf16_to_float(static_cast<std::uint16_t>(bits));
      const std::uint8_t got = kvaudit::e4m3_encode_bf16(static_cast<std::uint16_t>(bits), mode);
      const std::uint8_t want = oracle_encode(x, mode);
      if (got != want) {
        ++mismatches;
        if (mismatches < 5) {
          FAIL_CHECK("bf16 0x" << std::hex << bits << " mode " << static_cast<int>(mode)
                               << ": got 0x" << int(got) << " want 0x" << int(want));
        }
      }
    }
    CHECK(mismatches == 0);
  }
}

TEST_CASE("e4m3 encode of floats at and around every midpoint and overflow boundary", "[fp8]") {
  const auto points = float_probe_points();
  REQUIRE(points.size() > 2000);
  for (const E4m3Overflow mode : {E4m3Overflow::kSatFinite, E4m3Overflow::kNoSat}) {
    int mismatches = 0;
    for (const float x : points) {
      const std::uint8_t got = kvaudit::e4m3_encode(x, mode);
      const std::uint8_t want = oracle_encode(x, mode);
      if (got != want && ++mismatches < 5) {
        FAIL_CHECK("float " << std::hexfloat << x << " got 0x" << std::hex << int(got) << " want 0x"
                            << int(want));
      }
    }
    CHECK(mismatches == 0);
  }
}

TEST_CASE("e4m3 encode of doubles rounds once (no double rounding through float)", "[fp8]") {
  const auto values = positive_e4m3_values();
  int mismatches = 0;
  for (std::size_t i = 0; i + 1 < values.size(); ++i) {
    const double midpoint = static_cast<double>((values[i] + values[i + 1]) / 2);
    // Just above / below a midpoint by far less than a float ulp: via float these would tie.
    for (const double x : {midpoint, midpoint * (1 + 0x1p-40), midpoint * (1 - 0x1p-40)}) {
      for (const E4m3Overflow mode : {E4m3Overflow::kSatFinite, E4m3Overflow::kNoSat}) {
        for (const double signed_x : {x, -x}) {
          if (kvaudit::e4m3_encode(signed_x, mode) != oracle_encode(signed_x, mode)) ++mismatches;
        }
      }
    }
  }
  CHECK(mismatches == 0);
  // A concrete case: 1.0625 is the midpoint of 1.0 and 1.125 and ties to even (1.0, code 0x38);
  // a hair above it must round up to 1.125 (0x39).
  CHECK(kvaudit::e4m3_encode(1.0625) == 0x38);
  CHECK(kvaudit::e4m3_encode(1.0625 + 0x1p-40) == 0x39);
}

TEST_CASE("e4m3 overflow, NaN and infinity in both modes", "[fp8]") {
  using kvaudit::e4m3_encode;
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // satfinite, as cvt.rn.satfinite.e4m3x2.f32 (values observed on the H200: 500 -> 0x7E).
  CHECK(e4m3_encode(500.0f) == 0x7E);
  CHECK(e4m3_encode(-500.0f) == 0xFE);
  CHECK(e4m3_encode(inf) == 0x7E);
  CHECK(e4m3_encode(-inf) == 0xFE);
  CHECK(e4m3_encode(nan) == 0x7F);
  CHECK(e4m3_encode(3.3f) == 0x45);
  CHECK(e4m3_encode(0x1p-7f) == 0x04);
  // nosat: 464 ties to 448 (even mantissa), anything above becomes NaN.
  CHECK(e4m3_encode(464.0f, E4m3Overflow::kNoSat) == 0x7E);
  CHECK(e4m3_encode(std::nextafter(464.0f, inf), E4m3Overflow::kNoSat) == 0x7F);
  CHECK(e4m3_encode(-480.0f, E4m3Overflow::kNoSat) == 0xFF);
  CHECK(e4m3_encode(inf, E4m3Overflow::kNoSat) == 0x7F);
  CHECK(e4m3_encode(nan, E4m3Overflow::kNoSat) == 0x7F);
  // Underflow: half the smallest subnormal ties to zero; a hair above rounds up; sign is kept.
  CHECK(e4m3_encode(0x1p-10f) == 0x00);
  CHECK(e4m3_encode(std::nextafter(0x1p-10f, 1.0f)) == 0x01);
  CHECK(e4m3_encode(-0x1p-11f) == 0x80);
  CHECK(e4m3_encode(-0.0f) == 0x80);
}

TEST_CASE("bf16 round-to-nearest-even and exact widening", "[fp8][bf16]") {
  // Oracle: the two bf16 candidates around x by truncation, nearest by exact double distance,
  // ties to the even pattern.
  std::uint64_t state = 0x9E3779B97F4A7C15ull;
  int mismatches = 0;
  for (int i = 0; i < 1'000'000; ++i) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    std::uint32_t bits = static_cast<std::uint32_t>(state);
    if (i % 4 == 0) bits = (bits & 0xFFFF0000u) | 0x8000u;  // exact ties
    const float x = kvaudit::float_from_bits(bits);
    if (!std::isfinite(x) || std::fabs(x) > 3.0e38f) continue;
    const std::uint16_t low = static_cast<std::uint16_t>(bits >> 16);
    const std::uint16_t high = static_cast<std::uint16_t>(low + 1);
    const double d_low = std::fabs(static_cast<double>(x) - kvaudit::bf16_to_float(low));
    const double d_high = std::fabs(static_cast<double>(x) - kvaudit::bf16_to_float(high));
    const std::uint16_t want = d_low < d_high   ? low
                               : d_high < d_low ? high
                                                : (low & 1 ? high : low);
    if (kvaudit::bf16_from_float(x) != want) ++mismatches;
  }
  CHECK(mismatches == 0);
  CHECK(kvaudit::bf16_from_float(1.0f) == 0x3F80);
  CHECK(kvaudit::bf16_to_float(0x3F80) == 1.0f);
  CHECK(std::isnan(kvaudit::bf16_to_float(kvaudit::bf16_from_float(std::nanf("")))));
  CHECK(kvaudit::bf16_from_float(std::numeric_limits<float>::infinity()) == 0x7F80);
  // Every e4m3 value is a bf16 value: widening e4m3 -> bf16 is exact.
  for (int code = 0; code < 256; ++code) {
    if (oracle_is_nan(code)) continue;
    const float v = kvaudit::e4m3_decode(static_cast<std::uint8_t>(code));
    CHECK(kvaudit::bf16_round(v) == v);
  }
}

TEST_CASE("the kvdump write rule divides in fp32 then rounds once", "[fp8]") {
  // 1 / 0.37 = 2.7027... lies between 2.5 and 2.75 (quantum 0.25 in [2, 4)): nearest is 2.75.
  CHECK(kvaudit::kvdump_quantize(1.0f, 0.37f) == 0x43);
  CHECK(kvaudit::e4m3_decode(0x43) == 2.75f);
  // Saturation: 448 * scale and beyond clamp to +-448, never NaN for finite input.
  CHECK(kvaudit::kvdump_quantize(1000.0f, 0.5f) == 0x7E);
  CHECK(kvaudit::kvdump_quantize(-1000.0f, 0.5f) == 0xFE);
  // The rule is exactly encode(fp32 quotient): check against the oracle on a sweep.
  int mismatches = 0;
  for (int i = -3000; i <= 3000; ++i) {
    const float value = static_cast<float>(i) * 0.0173f;
    for (const float scale : {0.37f, 0.0123f, 1.0f, 0.9731f}) {
      const float quotient = value / scale;
      if (kvaudit::kvdump_quantize(value, scale) !=
          oracle_encode(quotient, E4m3Overflow::kSatFinite)) {
        ++mismatches;
      }
    }
  }
  CHECK(mismatches == 0);
}
