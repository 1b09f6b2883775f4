// The KV write rules: how a new_kv row becomes the codes of an fp8 pool slot, under kvdump's rule,
// the harness's --reciprocal-scale option, or one of the write faults of src/backend/injection.hpp
// (which maps an injection onto its rule). Host/device functions: the cpu-fp8 write (write_new_kv,
// src/backend/mla_attention_cpu.cpp) and the CUDA write kernel (kv_write_fp8_kernel,
// kernels/mla_attention/kv_write.cuh) both apply kv_write_code, so each rule is written once.
// Math, element c of a row x ([D] values, their bf16 bits) with scale s:
//   kDivide          e4m3_rne_satfinite(fp32(x_c) / s)
//   kReciprocal      e4m3_rne_satfinite(x_c * fp32(1 / s))
//   kRoundTowardZero the largest-magnitude code not exceeding |x_c / s|, saturating at 448
//   kNoSaturation    e4m3_rn(x_c / s), past 464 a NaN code
//   kBf16Bytes       byte c of the little-endian bf16 row
#pragma once

#include <cstdint>
#include <type_traits>

#include "src/core/fp8_e4m3.hpp"

namespace kvaudit {

// e4m3 write rounding toward zero (the fault kRoundTowardZero): the largest-magnitude code not
// exceeding |x|, saturating at 448.
KVAUDIT_HOST_DEVICE inline std::uint8_t e4m3_encode_toward_zero(float x) {
  const std::uint8_t nearest = e4m3_encode(x, E4m3Overflow::kSatFinite);
  if (e4m3_is_nan(nearest) || (nearest & 0x7F) == 0) return nearest;
  const float decoded = e4m3_decode(nearest);
  const bool rounded_away = x < 0 ? decoded < x : decoded > x;
  return rounded_away ? static_cast<std::uint8_t>(nearest - 1) : nearest;
}

// How a backend writes a new_kv row into an fp8 pool: kvdump's rule, the harness's named
// --reciprocal-scale option, or one of the write faults (src/backend/injection.hpp).
enum class KvWriteRule : std::uint8_t {
  kDivide,           // kvdump: e4m3_rne_satfinite(x / scale)
  kReciprocal,       // --reciprocal-scale: e4m3_rne_satfinite(x * fp32(1 / scale))
  kRoundTowardZero,  // fault round-toward-zero
  kNoSaturation,     // fault no-saturation (past 464 * scale -> NaN)
  kBf16Bytes,        // fault bf16-writeback: byte c of the little-endian bf16 row into element c
};

// "divide", "reciprocal", ...
constexpr const char* kv_write_rule_name(KvWriteRule rule) {
  switch (rule) {
    case KvWriteRule::kDivide:
      return "divide";
    case KvWriteRule::kReciprocal:
      return "reciprocal";
    case KvWriteRule::kRoundTowardZero:
      return "round-toward-zero";
    case KvWriteRule::kNoSaturation:
      return "no-saturation";
    case KvWriteRule::kBf16Bytes:
      return "bf16-bytes";
  }
  return "unknown";
}

// The two correct roundings on the host: the software codec of src/core/fp8_e4m3.hpp. The device
// passes DeviceE4m3Rounding (kernels/fp8_e4m3_device.cuh, cvt.rn.satfinite.e4m3x2.f32) instead;
// tests/core/test_fp8_e4m3_cuda.cu shows the two agree code for code.
struct HostE4m3Rounding {
  static std::uint8_t divide(float value, float kv_scale) {
    return kvdump_quantize(value, kv_scale);
  }
  static std::uint8_t reciprocal(float value, float kv_scale) {
    return kvdump_quantize_reciprocal(value, kv_scale);
  }
};

// The code element `col` of a new_kv row receives under kRule. `row.value(c)` is element c in
// fp32 and `row.bf16_bits(c)` its bf16 bits (the device holds bf16 bits, the host fp32 values);
// `Rounding` supplies kvdump's division and the reciprocal option (HostE4m3Rounding on the host).
template <KvWriteRule kRule, typename Rounding, typename Row>
KVAUDIT_HOST_DEVICE inline std::uint8_t kv_write_code(const Row& row, int col, float kv_scale) {
  if constexpr (kRule == KvWriteRule::kReciprocal) {
    return Rounding::reciprocal(row.value(col), kv_scale);
  } else if constexpr (kRule == KvWriteRule::kRoundTowardZero) {
    return e4m3_encode_toward_zero(row.value(col) / kv_scale);
  } else if constexpr (kRule == KvWriteRule::kNoSaturation) {
    return e4m3_encode(row.value(col) / kv_scale, E4m3Overflow::kNoSat);
  } else if constexpr (kRule == KvWriteRule::kBf16Bytes) {
    // A bf16 row copied byte for byte into the fp8 slot: element c receives byte c of the
    // little-endian bf16 row (low byte of value c / 2 for even c, high byte for odd c).
    const std::uint16_t bits = row.bf16_bits(col / 2);
    return static_cast<std::uint8_t>(col % 2 == 0 ? bits & 0xFF : bits >> 8);
  } else {
    return Rounding::divide(row.value(col), kv_scale);
  }
}

// Runtime -> compile-time: calls f(std::integral_constant<KvWriteRule, rule>{}) (every rule has
// an instantiation, so there is no unsupported value).
template <typename F>
decltype(auto) dispatch_kv_write_rule(KvWriteRule rule, F&& f) {
  using R = KvWriteRule;
  switch (rule) {
    case R::kReciprocal:
      return f(std::integral_constant<R, R::kReciprocal>{});
    case R::kRoundTowardZero:
      return f(std::integral_constant<R, R::kRoundTowardZero>{});
    case R::kNoSaturation:
      return f(std::integral_constant<R, R::kNoSaturation>{});
    case R::kBf16Bytes:
      return f(std::integral_constant<R, R::kBf16Bytes>{});
    case R::kDivide:
      break;
  }
  return f(std::integral_constant<R, R::kDivide>{});
}

}  // namespace kvaudit
