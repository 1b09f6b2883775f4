// What the FP8 MLA attention kernels compute, and where they round: shared by the CUDA kernels
// (kernels/mla_attention.cuh) and their CPU model (src/backend/mla_attention_cpu.cpp), so that the
// two cannot drift.
//
// Per query row i, head h, over its visible tokens t (codes c_t, r_t of the FP8 pool, decoded
// exactly, *without* kv_scale), with q in bf16:
//   dot_t  = fp32( q_nope[i,h,:] . c_t + q_pe[i,h,:] . r_t )        (fp32 accumulation)
//   s_t    = dot_t * score_scale,  score_scale = fp32(sm_scale * kv_scale * log2(e))
//                                   (kv_scale folded into the score; base-2 softmax)
// Online softmax over KV tiles of kKvTileTokens tokens, in token order:
//   m'     = max(m, max_t s_t);  p_t = exp2(s_t - m')  (fp32)
//   l      = l * exp2(m - m') + sum_t p_t               (fp32, unrounded p)
//   acc    = acc * exp2(m - m') + sum_t bf16(p_t) * c_t (P rounded to bf16 before P.V, fp32 acc)
// Finally out = bf16( acc * (kv_scale / l) )  and  lse = (m + log2(l)) * ln(2)  (natural log).
//
// A bf16 pool is the same with the bf16 values in place of decoded codes and kv_scale = 1.
//
// Grouped pools (kvdump v1.1 per_token_group; src/backend/mla_attention_operands.hpp): the slots
// the rows read are dequantized to bf16 first, latent element j of token t as bf16(fp32(code_tj *
// scale_t,j/group)), the RoPE part as its bf16 value or bf16(fp32(code * kv_scale)) (FlashInfer's
// ckv_scale_arr rule), and attended as a bf16 pool with kv_scale = 1. Sparse rows (topk_indices)
// attend over their listed tokens in increasing position.
#pragma once

#include <cstdint>

namespace kvaudit::mla {

// Tokens per KV tile of the online softmax (and per split-KV chunk granularity on the GPU).
inline constexpr int kKvTileTokens = 64;

// MLA widths the kernels are specialised for (DeepSeek-V2/V3, GLM-5).
inline constexpr int kKvLoraRank = 512;                         // Dc
inline constexpr int kQkRopeHeadDim = 64;                       // Dr
inline constexpr int kRowWidth = kKvLoraRank + kQkRopeHeadDim;  // 576

inline constexpr double kLog2e = 1.4426950408889634074;
inline constexpr double kLn2 = 0.69314718055994530942;

// Rounding points (documented above; named so tests and tolerances can refer to them).
inline constexpr bool kRoundProbabilitiesToBf16 = true;
inline constexpr bool kRoundOutputToBf16 = true;

}  // namespace kvaudit::mla
