// What the FP8 MLA kernels (cuda-fp8 and its CPU model cpu-fp8) are given for one (step, layer),
// for every kvdump form: written once here so that both backends write and attend alike.
//
// Writes: a per_tensor pool with the write rules of src/backend/injection.hpp (each backend its
// own way: the CPU model on the host, cuda-fp8 on the device); a per_token_group pool (v1.1) on
// the host, with write_grouped_row (src/format/group_scales.hpp) and the grouped write faults.
//
// Attention operands:
//   step   the step itself, or for sparse rows (topk_indices) attention_view's one request per
//          row over its listed tokens, page size 1 (src/format/step_indices.hpp);
//   pool   per_tensor: the backend's pool as stored, with kv_scale;
//          per_token_group: the kernels' dequantized form of the slots the rows read (bf16 pool,
//          [S, D]: bf16(fp32(code * group scale)), bf16 RoPE as stored or bf16(fp32(code *
//          kv_scale))), attended as a bf16 pool with kv_scale 1 (kernels/mla_attention_model.hpp
//          "Grouped pools"); the grouped read faults act in that dequantization.
#pragma once

#include <optional>

#include "src/backend/backend.hpp"
#include "src/backend/injection.hpp"
#include "src/core/result.hpp"
#include "src/format/kvdump.hpp"
#include "src/format/step_indices.hpp"

namespace kvaudit {

struct AttentionOperands {
  AttentionView view;                 // attrs (kv_dtype bf16 for a grouped pool) and the step
  float kv_scale = 1.0f;              // the multiplier the kernel applies
  std::optional<KvPool> dequantized;  // grouped pools: the bf16 pool attended over

  // What the kernel reads: `dequantized` for a grouped pool, else the backend's own pool.
  const KvPool& pool_to_read(const KvPool& stored) const {
    return dequantized ? *dequantized : stored;
  }
};

// Writes the step's rows into a per_token_group pool (v1.1 rule, or the grouped write fault
// `injection` names). The pool must be grouped.
Status write_grouped_step(const StepMeta& step, std::span<const float> new_kv, float kv_scale,
                          bool reciprocal_scale, KvPool& pool, Injection injection);

// The attention operands of `input` over `pool` (after the step's writes).
AttentionOperands attention_operands(const StepLayerInput& input, const KvPool& pool,
                                     Injection injection);

}  // namespace kvaudit
