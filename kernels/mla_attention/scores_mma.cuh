// S = Q K^T on mma.sync.m16n8k16 (bf16 x bf16 -> fp32): per tile, S [M, 64] fp32 over the 576
// columns of Q [M, 576] and the bf16 tile [64, 576]; one m16 tile splits the 576 columns in two
// halves (qk_scores_split_k), two and four m16 tiles sum even / odd 16-column chains
// (qk_scores_two_chains).
#pragma once

#include <cstdint>

#include "kernels/mla_attention/work.cuh"
#include "kernels/ptx.cuh"

namespace kvaudit::cuda::detail {

// One m16 tile over eight warps: warp (kh = wn / 4, tp = wn % 4) computes the scores of tokens
// 16 tp .. 16 tp + 15 (two n8 tiles) over the k16 steps kQkSteps kh .. kQkSteps (kh + 1) - 1 (half
// of the 576 columns). Its Q fragments for those steps (72 registers) are loaded once per pass, so
// Q costs no shared-memory traffic per tile; the k halves meet in shared memory (s_part).
template <int kQkSteps>
__device__ __forceinline__ void load_q_fragments(std::uint32_t (&q_frag)[kQkSteps][4],
                                                 const AttentionSmem& smem, const ThreadRole& t) {
  __syncthreads();  // Q staged by every thread
  const int kh = t.wn / 4;
  const int a_row = t.mt * 16 + (t.lane % 8) + 8 * ((t.lane / 8) % 2);
  const std::uint32_t a_addr =
      smem.q_address + (a_row * kSmemRow + 8 * (t.lane / 16)) * 2 + kh * kQkSteps * 32;
#pragma unroll
  for (int ks = 0; ks < kQkSteps; ++ks) ptx::ldmatrix_m8n8_x4(q_frag[ks], a_addr + ks * 32);
}

// S for the rows of the m16 tile and this warp's tokens 8 wn .. 8 wn + 7: each warp sums its k
// half for 16 tokens, the halves are exchanged through s_part, S = half 0 + half 1.
template <int kQkSteps>
__device__ __forceinline__ void qk_scores_split_k(float (&s)[1][4],
                                                  const std::uint32_t (&q_frag)[kQkSteps][4],
                                                  const AttentionSmem& smem, const ThreadRole& t,
                                                  int token0) {
  const int kh = t.wn / 4, tp = t.wn % 4;
  float part[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
  // B x4: matrices (n tile 0, k 0-7), (n tile 0, k 8-15), (n tile 1, k 0-7), (n tile 1, k 8-15).
  const std::uint32_t b_addr =
      smem.kv_address +
      ((16 * tp + t.lane % 8 + 8 * (t.lane / 16)) * kSmemRow + 8 * ((t.lane / 8) % 2)) * 2 +
      kh * kQkSteps * 32;
#pragma unroll
  for (int ks = 0; ks < kQkSteps; ++ks) {
    std::uint32_t b[4];
    ptx::ldmatrix_m8n8_x4(b, b_addr + ks * 32);
    ptx::mma_m16n8k16_bf16_f32(part[0], q_frag[ks], b[0], b[1]);
    ptx::mma_m16n8k16_bf16_f32(part[1], q_frag[ks], b[2], b[3]);
  }
  float* mine = smem.s_part + kh * 16 * kSRow;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int col = 16 * tp + 8 * j + 2 * t.quad;
    *reinterpret_cast<float2*>(mine + t.group * kSRow + col) = make_float2(part[j][0], part[j][1]);
    *reinterpret_cast<float2*>(mine + (t.group + 8) * kSRow + col) =
        make_float2(part[j][2], part[j][3]);
  }
  __syncthreads();
  const int col = token0 + 2 * t.quad;
  const float* s_part = smem.s_part;
  const float2 r0 = *reinterpret_cast<const float2*>(s_part + t.group * kSRow + col);
  const float2 r1 = *reinterpret_cast<const float2*>(s_part + (t.group + 8) * kSRow + col);
  const float2 t0 = *reinterpret_cast<const float2*>(s_part + (16 + t.group) * kSRow + col);
  const float2 t1 = *reinterpret_cast<const float2*>(s_part + (16 + t.group + 8) * kSRow + col);
  s[0][0] = r0.x + t0.x;
  s[0][1] = r0.y + t0.y;
  s[0][2] = r1.x + t1.x;
  s[0][3] = r1.y + t1.y;
}

// S for rows of m16 tile mt, tokens [token0, token0 + 8 * kQkTiles): every warp runs the whole
// k range, Q and K by ldmatrix per k32 step, in two accumulator chains (even / odd 16-column
// steps) that halve the MMA dependency chain and are added at the end.
template <int kQkTiles>
__device__ __forceinline__ void qk_scores_two_chains(float (&s)[kQkTiles][4],
                                                     const AttentionSmem& smem, const ThreadRole& t,
                                                     int token0) {
  float s2[kQkTiles][4];
#pragma unroll
  for (int j = 0; j < kQkTiles; ++j) {
    s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
    s2[j][0] = s2[j][1] = s2[j][2] = s2[j][3] = 0.f;
  }
  // ldmatrix addresses: A (Q) x4 = rows 0-7/8-15 x k 0-7/8-15; B (K) x4 = two k16 steps of
  // one n8 tile: matrices (k 0-7), (k 8-15), (k 16-23), (k 24-31).
  const int a_row = t.mt * 16 + (t.lane % 8) + 8 * ((t.lane / 8) % 2);
  const std::uint32_t a_addr = smem.q_address + (a_row * kSmemRow + 8 * (t.lane / 16)) * 2;
  const std::uint32_t b_addr =
      smem.kv_address + ((token0 + t.lane % 8) * kSmemRow + 8 * (t.lane / 8)) * 2;
#pragma unroll 1
  for (int kk = 0; kk < kD / 32; ++kk) {
    std::uint32_t a0[4], a1[4];
    ptx::ldmatrix_m8n8_x4(a0, a_addr + kk * 64);
    ptx::ldmatrix_m8n8_x4(a1, a_addr + kk * 64 + 32);
#pragma unroll
    for (int j = 0; j < kQkTiles; ++j) {
      std::uint32_t b[4];
      ptx::ldmatrix_m8n8_x4(b, b_addr + j * 8 * kSmemRow * 2 + kk * 64);
      ptx::mma_m16n8k16_bf16_f32(s[j], a0, b[0], b[1]);
      ptx::mma_m16n8k16_bf16_f32(s2[j], a1, b[2], b[3]);
    }
  }
#pragma unroll
  for (int j = 0; j < kQkTiles; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) s[j][e] += s2[j][e];
  }
}

}  // namespace kvaudit::cuda::detail
