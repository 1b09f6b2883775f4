#include "src/core/fp8_e4m3_rows.hpp"

#include <algorithm>
#include <cstring>

#include "src/core/cpu_clones.hpp"

namespace kvaudit {

// A code's seven magnitude bits m = (exponent field e, mantissa field f): for e > 0 the float's
// bits are (e - 7 + 127) << 23 | f << 20 = (m << 20) + (120 << 23); for e = 0 the value is
// f * 2^-9 (f < 8: exact as a float, 0 for f = 0); m = 0x7f is NaN. The selects are masks, which
// GCC vectorises where it would not a branch.
KVAUDIT_CPU_CLONES_V4
std::uint8_t e4m3_decode_row(const std::uint8_t* codes, int n, float* out) {
  std::uint32_t largest = 0;
  for (int i = 0; i < n; ++i) {
    const std::uint32_t code = codes[i];
    const std::uint32_t m = code & 0x7f;
    const std::uint32_t sign = (code & 0x80) << 24;
    const std::uint32_t normal_bits = (m << 20) + (120u << 23);
    const float subnormal = static_cast<float>(static_cast<std::int32_t>(m)) * 0x1p-9f;
    std::uint32_t subnormal_bits;
    std::memcpy(&subnormal_bits, &subnormal, sizeof subnormal_bits);
    const std::uint32_t normal = 0u - static_cast<std::uint32_t>(m >= 8);
    const std::uint32_t nan = 0u - static_cast<std::uint32_t>(m == 0x7f);
    std::uint32_t bits = (normal_bits & normal) | (subnormal_bits & ~normal);
    bits = (bits & ~nan) | (0x7fc00000u & nan);
    bits |= sign;
    std::memcpy(out + i, &bits, sizeof bits);
    largest = std::max(largest, m & ~nan);
  }
  return static_cast<std::uint8_t>(largest);
}

}  // namespace kvaudit
