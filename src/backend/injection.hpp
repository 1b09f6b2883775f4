// Fault injection (`kvaudit check --inject NAME`): a mutation test of the harness itself. Each
// injection reproduces one failure mode of docs/design.md inside a backend (cpu-fp8 and cuda-fp8),
// and names the check that is meant to catch it. The write rules themselves (kvdump's, the
// reciprocal option and the write faults) are kernel arithmetic, host/device functions in
// kernels/kv_write_rules.hpp, so the CPU model and the CUDA kernels write with the same code; this
// header maps an injection onto its rule.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "kernels/kv_write_rules.hpp"
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

// The scale a kScaleMismatch decode reads with: kv_scale rounded to the nearest power of two
// (twice kv_scale when it already is one).
float power_of_two_scale(float kv_scale);

}  // namespace kvaudit
