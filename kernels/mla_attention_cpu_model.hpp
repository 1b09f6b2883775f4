// The CPU model of the FP8 MLA attention kernels (kernels/mla_attention.cuh): the same algorithm
// and the same rounding points as kernels/mla_attention_model.hpp describes for the CUDA kernels,
// in plain C++ over plain arrays (src/core only), so CI without a GPU exercises everything and the
// GPU tests have a twin to compare with. The cpu-fp8 backend (src/backend/mla_attention_cpu.hpp)
// adapts a dump's (step, layer) to it. Math, per query row i, head h, over the row's visible tokens
// t (kvdump-v1 causal rule):
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
#include <span>

namespace kvaudit {

// score_scale = fp32(sm_scale * kv_scale * log2 e): the double product, rounded once to float.
float mla_score_scale(double sm_scale, float kv_scale);

// One attention problem, kvdump-v1 requests (query row i of request b sees positions
// 0 .. kv_len(b) - rows(b) + (i - qo_indptr[b]); token position t of b is in slot
// kv_indices[kv_indptr[b] + t / page_size] * page_size + t % page_size).
struct MlaCpuAttention {
  std::span<const std::int32_t> qo_indptr;         // [batch + 1]
  std::span<const std::int32_t> kv_indptr;         // [batch + 1]
  std::span<const std::int32_t> kv_indices;        // [nnz_pages]
  std::span<const std::int32_t> kv_last_page_len;  // [batch]
  int page_size = 1;
  int num_heads = 0;
  int kv_lora_rank = 0;      // Dc
  int qk_rope_head_dim = 0;  // Dr
  float score_scale = 0.0f;  // mla_score_scale(sm_scale, the kv_scale read with)
  float kv_scale = 1.0f;     // the multiplier of the decoded values
  // [num_slots, Dc + Dr]: e4m3 codes, or with bf16_pool the little-endian bf16 bits.
  std::span<const std::uint8_t> pool;
  bool bf16_pool = false;
  std::span<const float> q_nope;  // [num_rows, H, Dc]
  std::span<const float> q_pe;    // [num_rows, H, Dr]
  // Fault variants (src/backend/injection.hpp names them): masked-nan-leak reads the rest of each
  // request's last page with a zero weight; fp8-read-as-bf16 reads an e4m3 pool's bytes as a
  // [S, D] bf16 array (past the end: 0).
  bool read_masked_tail = false;
  bool fp8_read_as_bf16 = false;
  int threads = 0;  // 0: every core
};

// out [num_rows, H, Dc] (bf16 bits) and lse [num_rows, H] of `a`; the caller checks the indices
// and sizes (out and lse hold num_rows * H * Dc and num_rows * H elements).
void mla_attention_cpu_model(const MlaCpuAttention& a, std::span<std::uint16_t> out,
                             std::span<float> lse);

}  // namespace kvaudit
