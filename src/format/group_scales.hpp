// kvdump v1.1 per_token_group scales (docs/kvdump-v1.md "The write rule with per_token_group"):
// how a group's scale is chosen and encoded, how a row is written, and how a stored slot is
// dequantized, exactly (for the reference) and as the kernels do (to bf16).
//
// For a new row x [D] (fp32 values) and each group g of G = Dc / group_size latent groups:
//   a_g     = max |x_j| over the group's finite elements
//   scale_g = float32:      max(fp32(a_g / 448), 2^-149)          (one binary32 division; the
//                           quotient is 0 for a_g below about 2^-141.2, and a scale of 0 would
//                           give NaN codes: the least float instead, never 0)
//             power_of_two: 2^ceil(log2(a_g / 448)), exactly       (no finite element saturates)
//             e8m0:         the power of two clamped to 2^-127 .. 2^127, stored as exponent + 127
//             a_g = 0 (an all-zero group): 1 in every format (0 would make 0 * (1/0) = NaN)
//   code_j  = e4m3_rne_satfinite(x_j / scale_g)   (or x_j * fp32(1 / scale_g), reciprocal option)
// RoPE part: bf16 bits of x_j (rope_dtype bfloat16: a float32 x_j rounded to nearest, ties to even,
// past bf16's range to +-inf, NaN kept as a quiet NaN), or kvdump_quantize(x_j, kv_scale) (e4m3).
//
// Dequantization: exact value = code * scale_g (4 x 24 significant bits: exact in binary64) or
// the bf16 RoPE value, or code * kv_scale. The kernels' form (kernels/mla_attention_model.hpp,
// "grouped pools"): bf16(fp32(code * scale_g)), bf16 RoPE as stored, bf16(fp32(code * kv_scale)).
#pragma once

#include <cstdint>
#include <span>

#include "src/format/kvdump.hpp"

namespace kvaudit {

// The scale the write rule chooses for a group whose finite elements have max magnitude `amax`.
float group_scale_for(float amax, GroupScaleFormat format);
// max |x_j| over the finite elements of x (0 when none is finite).
float finite_amax(std::span<const float> x);

// e8m0: value 2^(code - 127); code 0xFF is NaN.
float e8m0_decode(std::uint8_t code);
// The code of a power of two in 2^-127 .. 2^127 (other values: the code of the power of two at or
// above them, clamped to that range; NaN -> 0xFF).
std::uint8_t e8m0_encode(float power_of_two);

// Faults of the grouped write (src/backend/injection.hpp names them); kNone is the v1.1 rule.
enum class GroupWriteFault : std::uint8_t {
  kNone,
  kScaleOne,        // codes quantized with scale 1, the rule's scale stored (SGLang PR #34765)
  kZeroGroupScale,  // an all-zero group gets scale 0 and codes x * (1 / 0) = NaN
  // The two below use one scale per token calibrated on the whole latent part:
  // the rule's choice for amax over the row's Dc latent values.
  kRopeLatentScale,  // e4m3 RoPE quantized with that latent scale, not kv_scale (vLLM #42956)
  kKvScaleSplit,     // latent codes quantized with that per-token V scale while the per-group
                     // K scales are stored (vLLM PR #37054)
};

// Writes row x ([row_width] fp32) into `slot` of a grouped pool with the v1.1 rule.
void write_grouped_row(KvPool& pool, std::int64_t slot, const float* x, float kv_scale,
                       bool reciprocal_scale, GroupWriteFault fault = GroupWriteFault::kNone);

// How a kernel reads a grouped slot's scales (src/backend/injection.hpp names the faults).
enum class GroupReadFault : std::uint8_t {
  kNone,
  kScaleAsPowerOfTwo,  // an fp32 scale read as a power of two: its exponent bits only
  kScaleAsE8m0,        // the scale bytes read as e8m0 codes: group g's scale = byte g
};

// The kernels' dequantized row of a grouped slot ([row_width] bf16 bits; the latent part serves
// as K and V alike).
void dequantize_grouped_row_bf16(const KvPool& pool, std::int64_t slot, float kv_scale,
                                 GroupReadFault fault, std::uint16_t* row);

// The bf16 pool of those rows for the listed slots (others zero): what a kernel attends over.
KvPool dequantize_grouped_pool_bf16(const KvPool& pool, float kv_scale, GroupReadFault fault,
                                    std::span<const std::int64_t> slots);

}  // namespace kvaudit
