// Fault injection (`kvaudit check --inject NAME`): a mutation test of the harness itself. Each
// injection reproduces one failure mode of docs/design.md inside a backend (cpu-fp8 and cuda-fp8),
// and names the check that is meant to catch it. The write rules themselves (kvdump's, the
// reciprocal option and the write faults) are kernel arithmetic, host/device functions in
// kernels/kv_write_rules.hpp, so the CPU model and the CUDA kernels write with the same code; this
// header maps an injection onto its rule.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/kv_write_rules.hpp"
#include "src/core/result.hpp"
#include "src/format/kvdump.hpp"

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
  // Faults of the translation from the expanded (Hugging Face) MLA to the absorbed form a server
  // runs: what the attention is handed (sm_scale, q_pe) is wrong; any pool kind.
  kMscaleDropped,     // the softmax scale without YaRN's mscale^2: sm_scale / mscale^2
  kMscaleTwice,       // YaRN's mscale^2 applied again: sm_scale * mscale^2
  kKpeDeinterleaved,  // the cached RoPE part read de-interleaved against an interleaved q_pe
  kQpeDeinterleaved,  // q_pe de-interleaved against an interleaved cached RoPE part
  kRopeDotMissing,    // the RoPE dot dropped: scores q_nope . c only (q_pe zeroed)
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
// A translation fault (kMscaleDropped ... kRopeDotMissing) acts on any pool; the mscale ones need
// the dump's rope attributes (yarn_mscale_squared), and are refused without them.
bool injection_for_any_pool(Injection injection);
Status check_injection_applies(Injection injection, const DumpAttributes& attrs);
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

// YaRN's factor on the softmax scale, mscale^2 with mscale = 0.1 * rope_mscale_all_dim *
// ln(rope_factor) + 1 (1 for rope_factor <= 1; transformers' yarn_get_mscale, applied to
// DeepseekV3Attention.scaling once when mscale_all_dim is non-zero), from the dump's optional
// rope attributes (docs/kvdump-v1.md "Optional model attributes"); nullopt when the dump lacks
// rope_factor or rope_mscale_all_dim (nothing is guessed), 1 when rope_mscale_all_dim is 0.
std::optional<double> yarn_mscale_squared(const DumpAttributes& attrs);

// The RoPE layouts. De-interleaved (the Hugging Face module's order): even elements, then odd,
// y[j] = x[2j], y[Dr/2 + j] = x[2j + 1]; interleaved is its inverse. Dr is even.
void deinterleave_rope(std::span<const float> x, std::span<float> y);
void interleave_rope(std::span<const float> x, std::span<float> y);

// What a translation fault hands the attention, per (step, layer): the dump's attributes with the
// faulty sm_scale, and the step's q_nope, new_kv and topk_indices with q_pe [Nq, H, Dr] permuted
// or zeroed (no captured outputs: a backend reads none). For kKpeDeinterleaved the scores
// q_pe . D(r) are formed as I(q_pe) . r (a permutation is orthogonal: q . P r = P^T q . r), so the
// pool is read as stored. Any other injection: the input unchanged.
struct TranslatedInput {
  DumpAttributes attrs;
  StepLayerTensors tensors;
};
Result<TranslatedInput> translate_input(Injection injection, const DumpAttributes& attrs,
                                        const StepLayerTensors& tensors);
bool injection_translates(Injection injection);

}  // namespace kvaudit
