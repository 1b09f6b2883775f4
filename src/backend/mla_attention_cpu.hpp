// The CPU model of the FP8 MLA attention kernels (the `cpu-fp8` backend): the same algorithm and
// the same rounding points as kernels/mla_attention_model.hpp describes for the CUDA kernels, in
// plain C++, so CI without a GPU exercises everything and the GPU tests have a twin to compare
// with. Math, per query row i, head h, over the row's visible tokens t (kvdump-v1 causal rule):
//   q      = bf16(q)                     (exact for bf16 inputs)
//   c_t,r_t= the pool row decoded exactly, without kv_scale (e4m3 value, or bf16 value)
//   dot_t  = fp32 sum over j = 0..D-1 in index order of q_j * k_tj  (each product is exact in
//            fp32: bf16 x e4m3 has 8 + 4 significant bits, bf16 x bf16 8 + 8)
//   s_t    = fp32(dot_t * score_scale),  score_scale = fp32(double(sm_scale) * kv_scale * log2 e)
//   online softmax over tiles of mla::kKvTileTokens (64) token positions, in token order, base 2:
//     m' = max(m, max_t s_t), alpha = exp2f(m - m') (0 for the first tile), p_t = exp2f(s_t - m')
//     l  = l * alpha + (sum_t p_t, sequential)          (fp32, unrounded p)
//     acc = acc * alpha, then acc += bf16(p_t) * c_t for t in order   (fp32; the product is exact)
//   out = bf16(acc * (kv_scale / l)),  lse = (m + log2f(l)) * fp32(ln 2)  (natural log).
// Shapes:
//   q_nope : [num_rows, num_heads, kv_lora_rank]   q_pe : [num_rows, num_heads, qk_rope_head_dim]
//   pool   : [num_slots, kv_lora_rank + qk_rope_head_dim] (codes or bf16 bits)
//   out    : [num_rows, num_heads, kv_lora_rank] bf16 bits   lse : [num_rows, num_heads] fp32
// Tokens a row does not see are never read: NaN codes in masked, unused or past-the-end slots
// cannot reach an output (they are skipped, never multiplied by zero).
//
// Any Dc/Dr is accepted (the CUDA kernels are specialised for 512 + 64; small widths keep tests
// fast). Error against the exact attention on the same pool (R8) is dominated by the two bf16
// roundings (P and out, 2^-8 relative each); tests/backend/test_mla_attention_cpu.cpp derives the
// full bound.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>

#include "src/backend/backend.hpp"
#include "src/backend/injection.hpp"
#include "src/core/result.hpp"
#include "src/format/kvdump.hpp"

namespace kvaudit {

// Fault injections (src/backend/injection.hpp, `--inject NAME`): every entry of that catalogue is
// implemented here, as a branch in write_new_kv (bf16-writeback, round-toward-zero,
// no-saturation, neighbour-slot-write), in the attention (scale-mismatch, fp8-read-as-bf16,
// masked-nan-leak) or in the backend (whole-pool-cast). An unknown name is bad input.
Result<Injection> parse_cpu_injection(std::string_view name);

struct MlaAttentionCpuOptions {
  int threads = 0;  // 0: std::thread::hardware_concurrency()
  Injection injection = Injection::kNone;
};

// score_scale = fp32(sm_scale * kv_scale * log2 e): the double product, rounded once to float.
float mla_score_scale(double sm_scale, float kv_scale);

// The kvdump write rule for a step: row i of new_kv ([Nq, D]) goes to slot new_kv_slots[i] as
// e4m3_rne_satfinite(fp32(v) / kv_scale) (or v * fp32(1 / kv_scale) with reciprocal_scale); a
// bf16 pool stores the bf16 bits of v. No other slot changes.
// `injection` selects a faulty write (the harness's mutation test); kNone is the kvdump rule.
Status write_new_kv(const StepMeta& step, std::span<const float> new_kv, float kv_scale,
                    bool reciprocal_scale, KvPool& pool, Injection injection = Injection::kNone);

// Attention on a pool that already holds the step's writes; the pure function the GPU tests
// compare the CUDA kernels with.
Result<AttentionOutput> mla_attention_cpu(const DumpAttributes& attrs, const StepMeta& step,
                                          float kv_scale, std::span<const float> q_nope,
                                          std::span<const float> q_pe, const KvPool& pool,
                                          const MlaAttentionCpuOptions& options = {});

// The `cpu-fp8` backend: write_new_kv, then mla_attention_cpu.
Result<std::unique_ptr<Backend>> make_cpu_fp8_backend(const BackendOptions& options);

}  // namespace kvaudit
