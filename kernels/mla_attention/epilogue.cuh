// Epilogue: out = bf16(acc * (kv_scale / l)) [M rows, 512] and lse = (m + log2 l) ln 2, or a
// split's partial (acc / l in fp32, lse in base 2) for the merge.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/mla_attention/softmax.cuh"
#include "kernels/mla_attention/work.cuh"

namespace kvaudit::cuda::detail {

// lse of a row from its running max m (base 2) and sum l: base2_lse for a split's partial (the
// merge's input), natural_lse for out (the model's lse: (m + log2 l) ln 2).
__device__ __forceinline__ float base2_lse(float m, float l) { return m + log2f(l); }
__device__ __forceinline__ float natural_lse(float m, float l) {
  return base2_lse(m, l) * 0.69314718055994531f;
}

// out = bf16(acc * (kv_scale / l)), lse = (m + log2 l) * ln 2, for row h (0: group, 1: group + 8).
template <int kPvTiles>
__device__ __forceinline__ void store_output_row(const MlaAttentionParams& p, std::int64_t out_row,
                                                 int h, int dim0, const ThreadRole& t,
                                                 const SoftmaxState<kPvTiles>& state) {
  const float factor = p.kv_scale / state.l[h];
  std::uint16_t* out = p.out + out_row * kDc + dim0 + 2 * t.quad;
#pragma unroll
  for (int j = 0; j < kPvTiles; ++j) {
    *reinterpret_cast<std::uint32_t*>(out + j * 8) =
        ptx::cvt_rn_bf16x2_f32(state.acc[j][2 * h] * factor, state.acc[j][2 * h + 1] * factor);
  }
  if (t.wn == 0 && t.quad == 0) {
    p.lse[out_row] = natural_lse(state.m[h], state.l[h]);
  }
}

// Split-KV: partial out = acc / l (fp32), partial lse = m + log2 l (base 2), for the merge.
template <int kPvTiles>
__device__ __forceinline__ void store_partial_row(const MlaAttentionParams& p,
                                                  std::int64_t part_row, int h, int dim0,
                                                  const ThreadRole& t,
                                                  const SoftmaxState<kPvTiles>& state) {
  const float inverse = 1.f / state.l[h];
  float* out = p.partial_out + part_row * kDc + dim0 + 2 * t.quad;
#pragma unroll
  for (int j = 0; j < kPvTiles; ++j) {
    *reinterpret_cast<float2*>(out + j * 8) =
        make_float2(state.acc[j][2 * h] * inverse, state.acc[j][2 * h + 1] * inverse);
  }
  if (t.wn == 0 && t.quad == 0) p.partial_lse[part_row] = base2_lse(state.m[h], state.l[h]);
}

template <int kPvTiles>
__device__ __forceinline__ void write_attention_output(const MlaAttentionParams& p,
                                                       const BlockWork& w,
                                                       const AttentionPass& pass,
                                                       const ThreadRole& t,
                                                       const SoftmaxState<kPvTiles>& state) {
  const int dim0 = t.wn * 8 * kPvTiles;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const MRow r = m_row(p, w, pass, t.mt * 16 + t.group + 8 * h);
    if (!r.active) continue;
    const std::int64_t out_row = static_cast<std::int64_t>(r.row) * p.num_heads + r.head;
    if (p.num_splits == 1) {
      store_output_row(p, out_row, h, dim0, t, state);
    } else {
      const std::int64_t part_row = partial_row(r.row, p.num_splits, w.split, p.num_heads, r.head);
      store_partial_row(p, part_row, h, dim0, t, state);
    }
  }
}

}  // namespace kvaudit::cuda::detail
