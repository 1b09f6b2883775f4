// Online softmax in base 2 over a tile's scores S [M, 64] fp32: s = dot * score_scale, masked
// positions -inf, m' = max(m, max_t s_t) (block row max), p_t = exp2(s_t - m') stored to P in bf16,
// l = l * exp2(m - m') + sum_t p_t (unrounded p), acc *= exp2(m - m') (online rescale).
#pragma once

#include <cuda_runtime.h>

#include "kernels/mla_attention/work.cuh"
#include "kernels/ptx.cuh"

namespace kvaudit::cuda::detail {

// Online-softmax state of this thread's two rows (group, group + 8 of m16 tile mt); every warp of
// the m16 tile holds the same m and l (same inputs, same order), and its own slice of acc.
template <int kPvTiles>
struct SoftmaxState {
  float acc[kPvTiles][4];  // P.V over this warp's dims, relative to m
  float l[2];              // running sum of exp2(s - m), unrounded p
  float m[2];              // running max of the scores (base 2)

  __device__ __forceinline__ void init() {
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.f;
#pragma unroll
    for (int j = 0; j < kPvTiles; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  }
};

// How one row's running state moves onto its new max m_new (m_run: the max before the tile):
// m_use = m_new, or 0 for a row whose scores are all -inf (it stays all zero), and alpha =
// exp2(m_run - m_use), 0 before the first tile. Both decode kernels' softmax steps use it.
struct RowShift {
  float m_use;
  float alpha;
};

__device__ __forceinline__ RowShift shift_row(float m_run, float m_new) {
  RowShift r;
  r.m_use = m_new == -INFINITY ? 0.f : m_new;
  r.alpha = m_run == -INFINITY ? 0.f : exp2f(m_run - r.m_use);
  return r;
}

// The tile's new row max and the factor that moves the running state onto it.
struct RowRescale {
  float m_new[2];
  float m_use[2];  // m_new, or 0 for a row whose scores are all -inf (it stays all zero)
  float alpha[2];  // exp2(m - m_new), 0 before the first tile
};

// s = dot * score_scale for tokens below `valid` (NaN for a token in nan_tokens, whose KV row
// holds a NaN code), -inf past it; returns this warp's row max over its tokens (reduced over the
// quad of threads holding a row).
template <int kQkTiles>
__device__ __forceinline__ void scale_mask_and_max(float (&s)[kQkTiles][4], int valid,
                                                   std::uint64_t nan_tokens, float score_scale,
                                                   int token0, int quad, float (&tile_max)[2]) {
  tile_max[0] = tile_max[1] = -INFINITY;
#pragma unroll
  for (int j = 0; j < kQkTiles; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int token = token0 + j * 8 + 2 * quad + (e % 2);
      const float scaled =
          ((nan_tokens >> token) & 1u) ? __int_as_float(0x7FFFFFFF) : s[j][e] * score_scale;
      s[j][e] = token < valid ? scaled : -INFINITY;
      tile_max[e / 2] = fmaxf(tile_max[e / 2], s[j][e]);
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 1));
    tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 2));
  }
}

// The block's row max over the kWn warps of the m16 tile (through shared memory), and the
// rescale of the running state onto it.
template <int kWn>
__device__ __forceinline__ RowRescale block_row_max(const float (&tile_max)[2],
                                                    const float (&m_run)[2], float* max_s,
                                                    const ThreadRole& t) {
  if (t.quad == 0) {
    max_s[(t.mt * 16 + t.group) * kWn + t.wn] = tile_max[0];
    max_s[(t.mt * 16 + t.group + 8) * kWn + t.wn] = tile_max[1];
  }
  __syncthreads();
  RowRescale r;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float m = m_run[h];
    for (int w = 0; w < kWn; ++w) m = fmaxf(m, max_s[(t.mt * 16 + t.group + 8 * h) * kWn + w]);
    const RowShift shift = shift_row(m_run[h], m);
    r.m_new[h] = m;
    r.m_use[h] = shift.m_use;
    r.alpha[h] = shift.alpha;
  }
  return r;
}

// P = exp2(s - m), rounded to bf16 into p_s for P.V; returns this warp's row sums of the
// unrounded values (reduced over the quad).
template <typename Addr, int kQkTiles>
__device__ __forceinline__ void store_probabilities(const float (&s)[kQkTiles][4],
                                                    const float (&m_use)[2], int token0,
                                                    const ThreadRole& t, std::uint16_t* p_s,
                                                    float (&part_sum)[2]) {
  part_sum[0] = part_sum[1] = 0.f;
  unsigned char* p_bytes = reinterpret_cast<unsigned char*>(p_s);
  const int row0 = t.mt * 16 + t.group;
#pragma unroll
  for (int j = 0; j < kQkTiles; ++j) {
    const float p0 = exp2f(s[j][0] - m_use[0]), p1 = exp2f(s[j][1] - m_use[0]);
    const float p2 = exp2f(s[j][2] - m_use[1]), p3 = exp2f(s[j][3] - m_use[1]);
    part_sum[0] += p0 + p1;
    part_sum[1] += p2 + p3;
    const int col = token0 + j * 8 + 2 * t.quad;
    *reinterpret_cast<std::uint32_t*>(p_bytes + Addr::p_element(row0, col)) =
        ptx::cvt_rn_bf16x2_f32(p0, p1);
    *reinterpret_cast<std::uint32_t*>(p_bytes + Addr::p_element(row0 + 8, col)) =
        ptx::cvt_rn_bf16x2_f32(p2, p3);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    part_sum[h] += __shfl_xor_sync(0xffffffffu, part_sum[h], 1);
    part_sum[h] += __shfl_xor_sync(0xffffffffu, part_sum[h], 2);
  }
}

// l = l * alpha + (the block's row sum of the tile, warps in order), m = m_new.
template <int kWn, int kPvTiles>
__device__ __forceinline__ void update_running_sum(const float (&part_sum)[2], const RowRescale& r,
                                                   float* sum_s, const ThreadRole& t,
                                                   SoftmaxState<kPvTiles>& state) {
  if (t.quad == 0) {
    sum_s[(t.mt * 16 + t.group) * kWn + t.wn] = part_sum[0];
    sum_s[(t.mt * 16 + t.group + 8) * kWn + t.wn] = part_sum[1];
  }
  __syncthreads();
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float tile_sum = 0.f;
    for (int w = 0; w < kWn; ++w) tile_sum += sum_s[(t.mt * 16 + t.group + 8 * h) * kWn + w];
    state.l[h] = state.l[h] * r.alpha[h] + tile_sum;
    state.m[h] = r.m_new[h];
  }
}

template <int kPvTiles>
__device__ __forceinline__ void rescale_accumulators(float (&acc)[kPvTiles][4],
                                                     const float (&alpha)[2]) {
  // alpha = exp2(0) = 1 exactly where the tile did not raise the row's max (most tiles after the
  // first few): the products would change no bit, so a warp whose alphas are all 1 skips them.
  if (__all_sync(0xffffffffu, alpha[0] == 1.f && alpha[1] == 1.f)) return;
#pragma unroll
  for (int j = 0; j < kPvTiles; ++j) {
    acc[j][0] *= alpha[0];
    acc[j][1] *= alpha[0];
    acc[j][2] *= alpha[1];
    acc[j][3] *= alpha[1];
  }
}

// One tile's step of the online softmax: from the raw dot products s of this warp's tokens to P
// (bf16, in smem.p) and the running m, l and acc moved onto the new max.
template <int kWn, typename Addr, int kQkTiles, int kPvTiles>
__device__ __forceinline__ void online_softmax_update(float (&s)[kQkTiles][4], int valid,
                                                      std::uint64_t nan_tokens, float score_scale,
                                                      int token0, const AttentionSmem& smem,
                                                      const ThreadRole& t,
                                                      SoftmaxState<kPvTiles>& state) {
  float tile_max[2];
  scale_mask_and_max(s, valid, nan_tokens, score_scale, token0, t.quad, tile_max);
  const RowRescale r = block_row_max<kWn>(tile_max, state.m, smem.max, t);
  float part_sum[2];
  store_probabilities<Addr>(s, r.m_use, token0, t, smem.p, part_sum);
  publish_tile_writes<Addr>();  // P, read by wgmma after update_running_sum's barrier
  update_running_sum<kWn>(part_sum, r, smem.sum, t, state);
  rescale_accumulators(state.acc, r.alpha);
}

}  // namespace kvaudit::cuda::detail
