// Fault injection (`kvaudit check --inject NAME`): a mutation test of the harness itself. Each
// injection reproduces one failure mode of docs/design.md inside a backend (cpu-fp8 and cuda-fp8),
// and names the check that is meant to catch it. The write rules (kvdump's, the reciprocal option
// and the write faults) are host/device functions, so the CPU model and the CUDA kernels write
// with the same code.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>

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
  // kvdump v1.1 per_token_group pools only (src/format/group_scales.hpp):
  kScaleOneWrite,           // codes quantized with scale 1, the rule's scales stored
  kZeroGroupScale,          // an all-zero group gets scale 0: codes 0 * (1/0) = NaN
  kRopeOutsideCalibration,  // the e4m3 RoPE part quantized with the latent's scale: saturates
  kKvScaleSplit,            // latent codes quantized with a V scale, K scales stored
  kScaleReadAsPowerOfTwo,   // attention reads an fp32 scale as a power of two
  kScaleReadAsE8m0,         // attention reads the scale bytes as e8m0 codes
};

struct InjectionInfo {
  Injection id;
  const char* name;         // --inject NAME
  const char* description;  // one line
  const char* caught_by;    // the check meant to catch it
};

std::span<const InjectionInfo> injection_table();
// Whether the injection acts on pools of the dump's scale kind: the v1 ones on per_tensor pools,
// the v1.1 ones on per_token_group pools; otherwise it would silently do nothing, so a backend
// refuses it (unsupported input naming both).
bool injection_for_grouped_pools(Injection injection);
Status check_injection_applies(Injection injection, const std::string& kv_scale_kind);
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

// ---- the KV write rules -------------------------------------------------------------------------
// How a backend writes a new_kv row into an fp8 pool: kvdump's rule, the harness's named
// --reciprocal-scale option, or one of the write faults above. The CPU model (write_new_kv) and the
// CUDA write kernel (kv_write_fp8_kernel) both apply kv_write_code, so each rule is written once.
enum class KvWriteRule : std::uint8_t {
  kDivide,           // kvdump: e4m3_rne_satfinite(x / scale)
  kReciprocal,       // --reciprocal-scale: e4m3_rne_satfinite(x * fp32(1 / scale))
  kRoundTowardZero,  // fault round-toward-zero
  kNoSaturation,     // fault no-saturation (past 464 * scale -> NaN)
  kBf16Bytes,        // fault bf16-writeback: byte c of the little-endian bf16 row into element c
};

const char* kv_write_rule_name(KvWriteRule rule);  // "divide", "reciprocal", ...

// The rule a backend writes an fp8 pool with: the write fault `injection` names, else the
// reciprocal option or kvdump's rule (a bf16 pool stores the bf16 bits under every rule).
constexpr KvWriteRule kv_write_rule_of(Injection injection, bool reciprocal_scale) {
  switch (injection) {
    case Injection::kRoundTowardZero:
      return KvWriteRule::kRoundTowardZero;
    case Injection::kNoSaturation:
      return KvWriteRule::kNoSaturation;
    case Injection::kBf16Writeback:
      return KvWriteRule::kBf16Bytes;
    default:
      return reciprocal_scale ? KvWriteRule::kReciprocal : KvWriteRule::kDivide;
  }
}

// Where a write lands: slot s, or (fault neighbour-slot-write) slot (s + 1) mod num_slots.
constexpr int kv_write_slot_offset(Injection injection) {
  return injection == Injection::kNeighbourSlotWrite ? 1 : 0;
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

// The scale a kScaleMismatch decode reads with: kv_scale rounded to the nearest power of two
// (twice kv_scale when it already is one).
float power_of_two_scale(float kv_scale);

}  // namespace kvaudit
