// Fault injection (`kvaudit check --inject NAME`): a mutation test of the harness itself. Each
// injection reproduces one failure mode of docs/design.md inside a backend (cpu-fp8 and cuda-fp8),
// and names the check that is meant to catch it. The mutated write rules are host/device functions
// so the CPU model and the CUDA kernels inject the same fault.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "src/core/fp8_e4m3.hpp"
#include "src/core/result.hpp"

namespace kvaudit {

enum class Injection : std::uint8_t {
  kNone,
  kBf16Writeback,       // the write stores bf16 bits into the fp8 slots (bytes of the bf16 row)
  kRoundTowardZero,     // the write rounds toward zero instead of to nearest-even
  kNoSaturation,        // the write does not saturate: |x / scale| past 464 becomes NaN
  kScaleMismatch,       // attention dequantizes with the scale rounded to a power of two
  kNeighbourSlotWrite,  // the write goes to slot + 1
  kFp8ReadAsBf16,       // attention reads the fp8 bytes as bf16 (the kv_data_type mix-up)
  kMaskedNanLeak,       // attention reads whole pages/tiles and multiplies masked slots by 0
  kWholePoolCast,       // the seed's whole-pool cast to bf16 each call (numerically benign)
};

struct InjectionInfo {
  Injection id;
  const char* name;         // --inject NAME
  const char* description;  // one line
  const char* caught_by;    // the check meant to catch it
};

std::span<const InjectionInfo> injection_table();
Result<Injection> parse_injection(std::string_view name);  // "" -> kNone
const InjectionInfo& injection_info(Injection injection);

// e4m3 write rounding toward zero (the fault kRoundTowardZero): the largest-magnitude code not
// exceeding |x|, saturating at 448.
KVAUDIT_HOST_DEVICE inline std::uint8_t e4m3_encode_toward_zero(float x) {
  const std::uint8_t nearest = e4m3_encode(x, E4m3Overflow::kSatFinite);
  if (e4m3_is_nan(nearest) || (nearest & 0x7F) == 0) return nearest;
  const float decoded = e4m3_decode(nearest);
  const bool rounded_away = x < 0 ? decoded < x : decoded > x;
  return rounded_away ? static_cast<std::uint8_t>(nearest - 1) : nearest;
}

// The kvdump write of one element under an injection that changes the rounding (others use the
// correct rule here and act elsewhere).
KVAUDIT_HOST_DEVICE inline std::uint8_t kvdump_quantize_injected(float value, float kv_scale,
                                                                 Injection injection) {
  const float quotient = value / kv_scale;
  switch (injection) {
    case Injection::kRoundTowardZero:
      return e4m3_encode_toward_zero(quotient);
    case Injection::kNoSaturation:
      return e4m3_encode(quotient, E4m3Overflow::kNoSat);
    default:
      return e4m3_encode(quotient, E4m3Overflow::kSatFinite);
  }
}

// The scale a kScaleMismatch decode reads with: kv_scale rounded to the nearest power of two
// (twice kv_scale when it already is one).
float power_of_two_scale(float kv_scale);

}  // namespace kvaudit
