// acc += P V on mma.sync.m16n8k16: P [M, 64] bf16 from shared memory, V the bf16 tile's first
// 512 columns [64, 512], acc [M, 512] fp32 in registers (each warp its slice of the dims).
#pragma once

#include "kernels/mla_attention/work.cuh"
#include "kernels/ptx.cuh"

namespace kvaudit::cuda::detail {

// acc += P V for dims [wn * 8 * kPvTiles, +8 * kPvTiles) of this warp, V the tile's first 512
// columns.
template <int kPvTiles>
__device__ __forceinline__ void pv_mma(float (&acc)[kPvTiles][4], const AttentionSmem& smem,
                                       const ThreadRole& t) {
  const int dim0 = t.wn * 8 * kPvTiles;
  const int a_row = t.mt * 16 + (t.lane % 8) + 8 * ((t.lane / 8) % 2);
  const std::uint32_t a_addr = smem.p_address + (a_row * kPRow + 8 * (t.lane / 16)) * 2;
  // V^T fragments via ldmatrix.trans: matrices (tokens 0-7, dims 0-7), (tokens 8-15, dims
  // 0-7), (tokens 0-7, dims 8-15), (tokens 8-15, dims 8-15) -> b0, b1 of two n8 tiles.
  const int v_token = (t.lane % 8) + 8 * ((t.lane / 8) % 2);
  const std::uint32_t v_addr =
      smem.kv_address + (v_token * kSmemRow + dim0 + 8 * (t.lane / 16)) * 2;
#pragma unroll
  for (int kt = 0; kt < kTile / 16; ++kt) {
    std::uint32_t a[4];
    ptx::ldmatrix_m8n8_x4(a, a_addr + kt * 32);
#pragma unroll
    for (int j = 0; j < kPvTiles; j += 2) {
      std::uint32_t b[4];
      ptx::ldmatrix_m8n8_x4_trans(b, v_addr + (kt * 16 * kSmemRow + j * 8) * 2);
      ptx::mma_m16n8k16_bf16_f32(acc[j], a, b[0], b[1]);
      ptx::mma_m16n8k16_bf16_f32(acc[j + 1], a, b[2], b[3]);
    }
  }
}

}  // namespace kvaudit::cuda::detail
