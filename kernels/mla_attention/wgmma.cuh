// The same two products on wgmma (sm_90a, 64-row blocks): S = Q K^T by m64n64k16 over each
// warpgroup's 288-column half, the halves exchanged through shared memory, and acc += P V by
// m64n256k16 for each warpgroup's 256 dims; Q, the tile and P in the 128-byte swizzled layout.
#pragma once

#include <cuda_runtime.h>

#include "kernels/mla_attention/work.cuh"
#include "kernels/ptx.cuh"

namespace kvaudit::cuda::detail {

// Warpgroup g (warps 4 g .. 4 g + 3) of the 64-row block ends with S for tokens 32 g .. 32 g + 31
// and P.V for dims 256 g .. 256 g + 255, all 64 rows: the same split of the work as the mma.sync
// kernel's (mt, wn) warps, so the softmax and the epilogue phases serve both unchanged.

// S = Q K^T for the group's 32 tokens. Warpgroup g multiplies all 64 tokens over its half of the
// 576 columns (18 k16 steps of m64n64k16 from step 18 g: Q's half and the tile each read once per
// tile), then the halves meet in shared memory: g keeps tokens 32 g .. 32 g + 31 (the softmax's
// split) and adds the other group's partial sums of them (one fp32 addition, the same in both
// groups: commutative). Q (A) and K (B) are K-major in their swizzled tiles (a k16 step is 32
// bytes along a 128-byte row, a 64-column block 64 rows on).
__device__ __forceinline__ void qk_scores_wgmma(float (&s)[4][4], const AttentionSmem& smem,
                                                const ThreadRole& t) {
  constexpr std::uint32_t kAtomGroup = 8 * Swizzled128Tiles::kRowBytes;  // 8 rows: 1024 bytes
  constexpr std::uint32_t kQBlock = 64 * Swizzled128Tiles::kRowBytes;    // 64 M rows x 64 columns
  constexpr std::uint32_t kKvBlock = kTile * Swizzled128Tiles::kRowBytes;
  constexpr int kGroupSteps = kD / 16 / 2;  // 18 k16 steps per warpgroup
  float d[kTile / 8][4];
  ptx::wgmma_fence();
#pragma unroll
  for (int step = 0; step < kGroupSteps; ++step) {
    const int ks = t.wn * kGroupSteps + step;
    const std::uint32_t along = (ks % 4) * 32;  // k16 step inside the 64-column block
    const std::uint64_t a =
        ptx::wgmma_sw128_descriptor(smem.q_address + (ks / 4) * kQBlock + along, 0, kAtomGroup);
    const std::uint64_t b =
        ptx::wgmma_sw128_descriptor(smem.kv_address + (ks / 4) * kKvBlock + along, 0, kAtomGroup);
    ptx::wgmma_m64n64k16_bf16_f32(d, a, b, step > 0);
  }
  ptx::wgmma_commit_group();
  ptx::wgmma_wait_group<0>();
  // s_exchange [2 groups][4 n8 tiles][128 threads] float4: a thread and its twin in the other
  // group (same warp of the group, same lane) hold the same rows and columns.
  const int slot = t.tid % 128;
  const bool first = t.wn == 0;
  float4* sent = smem.s_exchange + t.wn * 4 * 128;
  const float4* received = smem.s_exchange + (1 - t.wn) * 4 * 128;
  // (selected element by element: a reference to one of two register arrays would put d in
  // local memory)
#pragma unroll
  for (int j = 0; j < 4; ++j) {  // the other group's tokens
    float o[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) o[e] = first ? d[4 + j][e] : d[j][e];
    sent[j * 128 + slot] = make_float4(o[0], o[1], o[2], o[3]);
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float4 v = received[j * 128 + slot];
    const float other[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) s[j][e] = (first ? d[j][e] : d[4 + j][e]) + other[e];
  }
}

// acc += P V for the group's 256 dims: 4 k16 steps (16 tokens each) of m64n256k16, P (A) K-major,
// V (B) the KV tile read MN-major: 64 dims per 128-byte row, the group's 4 column blocks 64 rows
// apart (leading offset), 8-token groups 1024 bytes apart (stride offset). Issued and committed
// only: acc may be read after the caller's wgmma_wait_group<0>.
__device__ __forceinline__ void issue_pv_wgmma(float (&acc)[32][4], const AttentionSmem& smem,
                                               const ThreadRole& t) {
  constexpr std::uint32_t kAtomGroup = 8 * Swizzled128Tiles::kRowBytes;
  constexpr std::uint32_t kKvBlock = kTile * Swizzled128Tiles::kRowBytes;
  const std::uint32_t v_dims = smem.kv_address + t.wn * 4 * kKvBlock;
  ptx::wgmma_fence();
#pragma unroll
  for (int kt = 0; kt < kTile / 16; ++kt) {
    const std::uint64_t a = ptx::wgmma_sw128_descriptor(smem.p_address + kt * 32, 0, kAtomGroup);
    const std::uint64_t b = ptx::wgmma_sw128_descriptor(
        v_dims + kt * 16 * Swizzled128Tiles::kRowBytes, kKvBlock, kAtomGroup);
    ptx::wgmma_m64n256k16_bf16_f32_b_mn(acc, a, b);
  }
  ptx::wgmma_commit_group();
}

}  // namespace kvaudit::cuda::detail
