// The cpu-fp8 backend: a dump's (step, layer) written with the write rules of
// kernels/kv_write_rules.hpp (the ones the CUDA write kernel applies) and attended by the CPU model
// of the kernels (kernels/mla_attention_cpu_model.hpp), after the operands of
// src/backend/mla_attention_operands.hpp (sparse rows, grouped pools) and the injections' choices
// (src/backend/injection.hpp).
#include "src/backend/mla_attention_cpu.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "kernels/mla_attention_cpu_model.hpp"
#include "kernels/mla_attention_model.hpp"
#include "src/backend/mla_attention_operands.hpp"
#include "src/core/fp8_e4m3.hpp"
#include "src/core/parallel_for.hpp"
#include "src/format/step_indices.hpp"

namespace kvaudit {

Result<Injection> parse_cpu_injection(std::string_view name) { return parse_injection(name); }

namespace {

// ---- the KV write -------------------------------------------------------------------------------

// One new_kv row as the shared write rules read it (kv_write_code, src/backend/injection.hpp):
// fp32 values (kvdump's new_kv may be float32), their bf16 bits where a rule needs them.
struct FloatRowView {
  const float* values;

  float value(int col) const { return values[col]; }
  std::uint16_t bf16_bits(int col) const { return bf16_from_float(values[col]); }
};

// new_kv holds one row of pool.row_width values per new_kv_slots entry, each slot in the pool.
Status check_new_kv(const StepMeta& step, std::span<const float> new_kv, const KvPool& pool) {
  const std::string where = fmt::format("write step {}", step.group);
  const std::size_t rows = step.new_kv_slots.size();
  if (new_kv.size() != rows * static_cast<std::size_t>(pool.row_width)) {
    return bad_input(where, fmt::format("new_kv has {} values, expected {} rows of {}",
                                        new_kv.size(), rows, pool.row_width));
  }
  for (std::size_t i = 0; i < rows; ++i) {
    const std::int64_t slot = step.new_kv_slots[i];
    if (slot < 0 || slot >= pool.num_slots) {
      return bad_input(where, fmt::format("new_kv_slots[{}] = {} is outside the pool", i, slot));
    }
  }
  return ok_status();
}

// dst[c] = kv_write_code<rule>(values, c) for the row's `width` elements (an fp8 slot).
void write_fp8_row(KvWriteRule rule, const float* values, int width, float kv_scale,
                   std::uint8_t* dst) {
  dispatch_kv_write_rule(rule, [&](auto kind) {
    const FloatRowView row{values};
    for (int c = 0; c < width; ++c) {
      dst[c] = kv_write_code<decltype(kind)::value, HostE4m3Rounding>(row, c, kv_scale);
    }
  });
}

}  // namespace

Status write_new_kv(const StepMeta& step, std::span<const float> new_kv, float kv_scale,
                    bool reciprocal_scale, KvPool& pool, Injection injection) {
  KVAUDIT_TRY(check_new_kv(step, new_kv, pool));
  // The same rule and slot the CUDA write kernel applies (src/backend/injection.hpp).
  const KvWriteRule rule = kv_write_rule_of(injection, reciprocal_scale);
  const int slot_offset = kv_write_slot_offset(injection);
  const int width = pool.row_width;
  for (std::size_t i = 0; i < step.new_kv_slots.size(); ++i) {
    std::int64_t slot = step.new_kv_slots[i];
    if (slot_offset != 0) slot = (slot + slot_offset) % pool.num_slots;
    const float* values = new_kv.data() + i * width;
    if (pool.dtype == KvDtype::kFloat8E4m3fn) {
      write_fp8_row(rule, values, width, kv_scale, pool.row(slot));
    } else {
      pool.write_row(slot, values, kv_scale);  // a bf16 pool stores the bf16 bits of v
    }
  }
  return ok_status();
}

namespace {

Status check_attention_inputs(const DumpAttributes& attrs, const StepMeta& step,
                              std::span<const float> q_nope, std::span<const float> q_pe,
                              const KvPool& pool) {
  const std::string where = fmt::format("cpu-fp8 step {}", step.group);
  if (pool.row_width != attrs.row_width()) {
    return bad_input(where, fmt::format("pool rows have {} elements, expected Dc + Dr = {}",
                                        pool.row_width, attrs.row_width()));
  }
  if (pool.dtype != attrs.kv_dtype) {
    return bad_input(where, fmt::format("pool holds {} but the dump's kv_dtype is {}",
                                        kv_dtype_name(pool.dtype), kv_dtype_name(attrs.kv_dtype)));
  }
  KVAUDIT_TRY(check_step_indices(step, attrs.page_size, pool.num_slots));
  const std::size_t rows = static_cast<std::size_t>(step.num_rows());
  const std::size_t heads = static_cast<std::size_t>(attrs.num_heads);
  if (q_nope.size() != rows * heads * attrs.kv_lora_rank ||
      q_pe.size() != rows * heads * attrs.qk_rope_head_dim) {
    return bad_input(where, "q_nope/q_pe sizes disagree with [Nq, H, Dc/Dr]");
  }
  return ok_status();
}

}  // namespace

Result<AttentionOutput> mla_attention_cpu(const DumpAttributes& attrs, const StepMeta& step,
                                          float kv_scale, std::span<const float> q_nope,
                                          std::span<const float> q_pe, const KvPool& pool,
                                          const MlaAttentionCpuOptions& options) {
  KVAUDIT_TRY(check_attention_inputs(attrs, step, q_nope, q_pe, pool));
  const std::size_t rows = static_cast<std::size_t>(step.num_rows());
  const std::size_t heads = static_cast<std::size_t>(attrs.num_heads);
  AttentionOutput output;
  output.out_bf16.assign(rows * heads * attrs.kv_lora_rank, 0);
  output.lse.assign(rows * heads, 0.0f);
  if (rows == 0 || heads == 0) return output;

  MlaCpuAttention a;
  a.qo_indptr = step.qo_indptr;
  a.kv_indptr = step.kv_indptr;
  a.kv_indices = step.kv_indices;
  a.kv_last_page_len = step.kv_last_page_len;
  a.page_size = attrs.page_size;
  a.num_heads = attrs.num_heads;
  a.kv_lora_rank = attrs.kv_lora_rank;
  a.qk_rope_head_dim = attrs.qk_rope_head_dim;
  // Injection scale-mismatch: dequantize with a scale other than the one the write used.
  const float read_scale =
      options.injection == Injection::kScaleMismatch ? power_of_two_scale(kv_scale) : kv_scale;
  a.score_scale = mla_score_scale(attrs.sm_scale, read_scale);
  a.kv_scale = read_scale;
  a.pool = pool.bytes;
  a.bf16_pool = pool.dtype == KvDtype::kBfloat16;
  a.q_nope = q_nope;
  a.q_pe = q_pe;
  a.read_masked_tail = options.injection == Injection::kMaskedNanLeak;
  a.fp8_read_as_bf16 = options.injection == Injection::kFp8ReadAsBf16;
  a.threads = options.threads;
  mla_attention_cpu_model(a, output.out_bf16, output.lse);
  return output;
}

namespace {

class CpuFp8Backend final : public Backend {
 public:
  CpuFp8Backend(const BackendOptions& options, Injection injection)
      : options_(options), injection_(injection) {}

  std::string name() const override { return "cpu-fp8"; }
  // run_step reads only its arguments and the options fixed at construction.
  BackendConcurrency concurrency() const override { return BackendConcurrency::kConcurrent; }

  nlohmann::json describe() const override {
    return {
        {"name", "cpu-fp8"},
        {"device", "cpu"},
        {"threads", resolve_thread_count(options_.threads)},
        {"kv_tile_tokens", mla::kKvTileTokens},
        {"injection", injection_ == Injection::kNone ? "none" : injection_info(injection_).name},
        {"write_rule", options_.reciprocal_scale
                           ? "e4m3_rne_satfinite(x * fp32(1 / kv_scale)) (reciprocal_scale)"
                           : "e4m3_rne_satfinite(fp32(x) / fp32(kv_scale)) (kvdump)"},
        {"rounding",
         {{"q", "bf16"},
          {"kv", "codes decoded exactly, kv_scale folded into the score and the output"},
          {"dot", "fp32, sequential in index order"},
          {"score_scale", "fp32(sm_scale * kv_scale * log2 e)"},
          {"softmax", "online, base 2, 64-token tiles in token order, exp2f, fp32 l"},
          {"p", "bf16 before P.V"},
          {"acc", "fp32"},
          {"out", "bf16(acc * (kv_scale / l))"},
          {"lse", "fp32 (m + log2 l) * ln 2"}}},
    };
  }

  Result<AttentionOutput> run_step(const StepLayerInput& input, KvPool& pool) override {
    if (!injection_translates(injection_)) return run_handed(input, pool);
    // A translation fault: the attention is handed a faulty sm_scale or q_pe.
    KVAUDIT_ASSIGN_OR_RETURN(const TranslatedInput translated,
                             translate_input(injection_, input.attrs, input.tensors));
    return run_handed({translated.attrs, input.step, input.layer, translated.tensors,
                       input.step_index, input.layer_index},
                      pool);
  }

 private:
  // The write, then the attention, on what the backend was handed.
  Result<AttentionOutput> run_handed(const StepLayerInput& input, KvPool& pool) {
    const std::string where = fmt::format("cpu-fp8 {}/{}", input.step.group, input.layer.group);
    if (pool.dtype != input.attrs.kv_dtype || pool.row_width != input.attrs.row_width()) {
      return bad_input(where, "pool type or row width disagrees with the dump attributes");
    }
    KVAUDIT_TRY(check_injection_applies(injection_, input.attrs));
    KVAUDIT_TRY(check_step_indices(input.step, input.attrs.page_size, pool.num_slots));
    if (pool.grouped()) {
      KVAUDIT_TRY(write_grouped_step(input.step, input.tensors.new_kv, input.layer.kv_scale,
                                     options_.reciprocal_scale, pool, injection_));
    } else {
      KVAUDIT_TRY(write_new_kv(input.step, input.tensors.new_kv, input.layer.kv_scale,
                               options_.reciprocal_scale, pool, injection_));
    }
    const AttentionOperands operands = attention_operands(input, pool, injection_);
    MlaAttentionCpuOptions options;
    options.threads = options_.threads;
    options.injection = injection_;
    if (injection_ == Injection::kWholePoolCast && !pool.grouped() &&
        pool.dtype == KvDtype::kFloat8E4m3fn) {
      // The seed's path: a bf16 copy of the whole pool on every call (exact: e4m3 values are
      // bf16 values), then attention on the copy with the same kv_scale. Same numbers, more
      // time and memory: only the bench's pool sweep can see it.
      KvPool cast = KvPool::zeros(KvDtype::kBfloat16, pool.num_slots, pool.row_width);
      for (std::size_t e = 0; e < pool.bytes.size(); ++e) {
        const std::uint16_t bits = bf16_from_float(e4m3_decode(pool.bytes[e]));
        cast.bytes[2 * e] = static_cast<std::uint8_t>(bits & 0xFF);
        cast.bytes[2 * e + 1] = static_cast<std::uint8_t>(bits >> 8);
      }
      DumpAttributes cast_attrs = operands.view.attrs;
      cast_attrs.kv_dtype = KvDtype::kBfloat16;
      return mla_attention_cpu(cast_attrs, operands.view.step, input.layer.kv_scale,
                               input.tensors.q_nope, input.tensors.q_pe, cast, options);
    }
    return mla_attention_cpu(operands.view.attrs, operands.view.step, operands.kv_scale,
                             input.tensors.q_nope, input.tensors.q_pe, operands.pool_to_read(pool),
                             options);
  }

  BackendOptions options_;
  Injection injection_;
};

}  // namespace

Result<std::unique_ptr<Backend>> make_cpu_fp8_backend(const BackendOptions& options) {
  KVAUDIT_ASSIGN_OR_RETURN(const Injection injection, parse_cpu_injection(options.injection));
  return std::unique_ptr<Backend>(std::make_unique<CpuFp8Backend>(options, injection));
}

}  // namespace kvaudit
