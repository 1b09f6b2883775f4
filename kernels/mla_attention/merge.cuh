// Split-KV merge: the partials partial_out [num_rows, num_splits, H, 512] fp32 (acc / l) and
// partial_lse [num_rows, num_splits, H] (base 2) of the attention kernel's splits combined exactly
// into out [num_rows, H, 512] bf16 and lse [num_rows, H] (natural log).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/mla_attention/epilogue.cuh"
#include "kernels/mla_attention/params.cuh"
#include "kernels/ptx.cuh"

namespace kvaudit::cuda::detail {

// Exact merge of split-KV partials: with L = max_i lse_i (base 2), w_i = exp2(lse_i - L),
//   out = bf16(kv_scale * sum_i w_i out_i / sum_i w_i),  lse = (L + log2 sum_i w_i) * ln 2.
// Splits that saw no tokens carry lse = -inf and are skipped (their out_i, never written, is never
// used; the window kernel may load it).
// grid: num_rows * num_heads * kDimChunks blocks of 512 threads (MergeShape); a block merges
// 512 / kDimChunks dims of one (row, head) as kDimGroups groups of 4 dims times kGroups split
// groups (group g takes splits g, g + kGroups, ... in that order; the groups' sums are added in
// group order): no result depends on timing. Two kernels, each a programmatic dependent of the
// attention kernel (sm_90), launched once every attention block has started; they wait for its
// results (griddepcontrol.wait) before reading them.
//   few splits, mla_merge_kernel<NarrowMerge> (one block per (row, head)): the split weights in
//     shared memory, L and sum_i w_i by one thread in split order;
//   many splits, mla_merge_window_kernel<WideMerge> (four blocks per (row, head), a one-row
//     decode's merge on 64 SMs rather than 16): after the wait every load goes out at once (the
//     lse values, and this thread's first kWindow partial outs into registers), one barrier, then
//     each warp reduces L and sum_i w_i itself (lane j: splits j, j + 32, ... in order, then a
//     fixed butterfly: the same bits in every warp). The few-splits layout spent 2.3 us after its
//     wait on a one-row decode's 64 splits on the H200 (clock64 stamps), in its serial steps;
//   more splits than WideMerge holds before its barrier (64), mla_merge_window_kernel<LongMerge>:
//     the same with a window of 8 (128 splits in registers; a one-row decode of 65-132 tiles). On
//     the H200 it took a one-row decode of ctx 8192 (128 splits) from 17.5 to 15.6-16.2 us and of
//     ctx 32768 from 24.8 to 23.2 us; with 16 splits the larger window cost 1 us (its registers
//     leave fewer merge blocks per SM), hence the three shapes
//     (docs/kernel-experiments.md, round 16).
// The merge's shape: kDimChunks blocks per (row, head), each kDimGroups float4 lanes of dims times
// kGroups split groups (kDimChunks * kDimGroups * 4 = 512 dims); kWindow partial outs a thread of
// the window kernel loads before its barrier (splits group, group + kGroups, ...; the rest after
// it).
template <int kDimChunksT, int kGroupsT, int kWindowT = 4>
struct MergeShape {
  static constexpr int kDimChunks = kDimChunksT;
  static constexpr int kDimGroups = kDc / 4 / kDimChunks;
  static constexpr int kGroups = kGroupsT;
  static constexpr int kThreads = kDimGroups * kGroups;
  static constexpr int kWindow = kWindowT;
  static_assert(kThreads == 512, "merge blocks of 512 threads");
};
using WideMerge = MergeShape<4, 16>;     // many splits (a one-row decode: 64 of them)
using LongMerge = MergeShape<4, 16, 8>;  // more than WideMerge's window holds (65 .. 128 in it)
using NarrowMerge = MergeShape<1, 4>;    // few splits: one block per (row, head)
inline constexpr int kWideMergeMinSplits = 16;
inline constexpr int kLongMergeMinSplits = WideMerge::kWindow * WideMerge::kGroups + 1;  // 65

__device__ __forceinline__ std::int64_t merge_part_row(const MlaMergeParams& p, std::int64_t row,
                                                       int head, int split) {
  return partial_row(row, p.num_splits, split, p.num_heads, head);
}

// The weight of a split, or -1 for an empty one (lse = -inf). A NaN lse (a split that saw a NaN
// score) gives a NaN weight, which every sum below keeps, as the CPU model does.
__device__ __forceinline__ float split_weight(float part_lse, float lse_max) {
  return part_lse == -INFINITY ? -1.f : exp2f(part_lse - lse_max);
}

__device__ __forceinline__ void add_weighted(float4& sum, float w, const float4 v) {
  sum.x += w * v.x;
  sum.y += w * v.y;
  sum.z += w * v.z;
  sum.w += w * v.w;
}

__device__ __forceinline__ float4 load_partial_out(const MlaMergeParams& p, std::int64_t row,
                                                   int head, int split, int dim) {
  return *reinterpret_cast<const float4*>(p.partial_out +
                                          merge_part_row(p, row, head, split) * kDc + dim);
}

// ---- few splits --------------------------------------------------------------------------------

// weight_s[i] = split_weight(lse_i, L); returns L.
__device__ __forceinline__ float load_split_weights(const MlaMergeParams& p, std::int64_t row,
                                                    int head, float* weight_s, float& lse_max_s) {
  for (int i = threadIdx.x; i < p.num_splits; i += blockDim.x) {
    weight_s[i] = p.partial_lse[merge_part_row(p, row, head, i)];
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float m = -INFINITY;
    for (int i = 0; i < p.num_splits; ++i) m = fmaxf(m, weight_s[i]);
    lse_max_s = m;
  }
  __syncthreads();
  const float lse_max = lse_max_s;
  for (int i = threadIdx.x; i < p.num_splits; i += blockDim.x) {
    weight_s[i] = split_weight(weight_s[i], lse_max);
  }
  __syncthreads();
  return lse_max;
}

// sum_i w_i out_i over the splits of `group`, dims dim .. dim + 3.
template <int kGroups>
__device__ __forceinline__ float4 sum_split_group(const MlaMergeParams& p, std::int64_t row,
                                                  int head, const float* weight_s, int group,
                                                  int dim) {
  float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
  for (int i = group; i < p.num_splits; i += kGroups) {
    const float w = weight_s[i];
    // An empty split is skipped (its out_i was never written). A split whose weight underflowed to
    // 0 is still multiplied in, as the single-pass softmax multiplies by alpha = 0: a NaN it saw
    // (a visible NaN code) stays NaN, as in the CPU model and the reference.
    if (w < 0.f) continue;
    add_weighted(sum, w, load_partial_out(p, row, head, i, dim));
  }
  return sum;
}

// sum_i w_i in split order.
__device__ __forceinline__ float sum_weights_in_order(const float* weight_s, int num_splits) {
  float weight_sum = 0.f;
  for (int i = 0; i < num_splits; ++i) {
    const float w = weight_s[i];
    if (!(w < 0.f)) weight_sum += w;  // a NaN weight (a split that saw a NaN score) stays NaN
  }
  return weight_sum;
}

// ---- many splits -------------------------------------------------------------------------------

struct SplitTotals {
  float lse_max;
  float weight_sum;
};

// L and sum_i w_i over all splits, by the calling warp alone.
__device__ __forceinline__ SplitTotals reduce_split_totals(const float* lse_s, int num_splits) {
  const int lane = threadIdx.x % 32;
  float lse_max = -INFINITY;
  for (int i = lane; i < num_splits; i += 32) lse_max = fmaxf(lse_max, lse_s[i]);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    lse_max = fmaxf(lse_max, __shfl_xor_sync(0xffffffffu, lse_max, offset));
  }
  float weight_sum = 0.f;
  for (int i = lane; i < num_splits; i += 32) {
    const float w = split_weight(lse_s[i], lse_max);
    if (!(w < 0.f)) weight_sum += w;
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    weight_sum += __shfl_xor_sync(0xffffffffu, weight_sum, offset);
  }
  return SplitTotals{lse_max, weight_sum};
}

// This thread's first kWindow partial outs (splits group, group + kGroups, ...), dims dim .. + 3.
template <typename Shape>
__device__ __forceinline__ void load_split_window(const MlaMergeParams& p, std::int64_t row,
                                                  int head, int group, int dim,
                                                  float4 (&window)[Shape::kWindow]) {
#pragma unroll
  for (int j = 0; j < Shape::kWindow; ++j) {
    const int i = group + j * Shape::kGroups;
    window[j] =
        i < p.num_splits ? load_partial_out(p, row, head, i, dim) : make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

// sum_i w_i out_i over the splits of `group` in increasing order (as sum_split_group), the
// window from registers, the rest from memory.
template <typename Shape>
__device__ __forceinline__ float4 sum_split_window(const MlaMergeParams& p, std::int64_t row,
                                                   int head, const float* lse_s, float lse_max,
                                                   int group, int dim,
                                                   const float4 (&window)[Shape::kWindow]) {
  float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int j = 0; j < Shape::kWindow; ++j) {
    const int i = group + j * Shape::kGroups;
    if (i >= p.num_splits) break;
    const float w = split_weight(lse_s[i], lse_max);
    if (!(w < 0.f)) add_weighted(sum, w, window[j]);
  }
#pragma unroll 4
  for (int i = group + Shape::kWindow * Shape::kGroups; i < p.num_splits; i += Shape::kGroups) {
    const float w = split_weight(lse_s[i], lse_max);
    if (!(w < 0.f)) add_weighted(sum, w, load_partial_out(p, row, head, i, dim));
  }
  return sum;
}

// ---- both --------------------------------------------------------------------------------------

// Group 0: adds the other groups' sums in group order, divides by sum_i w_i, writes out (and, in
// the first dim chunk, lse).
template <typename Shape>
__device__ __forceinline__ void write_merged_row(const MlaMergeParams& p, std::int64_t row_head,
                                                 const float4 (*sum_s)[Shape::kDimGroups],
                                                 float4 sum, float lse_max, float weight_sum,
                                                 int lane, int dim, bool writes_lse) {
  for (int g = 1; g < Shape::kGroups; ++g) {
    const float4 v = sum_s[g][lane];
    sum.x += v.x;
    sum.y += v.y;
    sum.z += v.z;
    sum.w += v.w;
  }
  const float factor = p.kv_scale / weight_sum;
  std::uint16_t* out = p.out + row_head * kDc + dim;
  *reinterpret_cast<uint2*>(out) =
      make_uint2(ptx::cvt_rn_bf16x2_f32(sum.x * factor, sum.y * factor),
                 ptx::cvt_rn_bf16x2_f32(sum.z * factor, sum.w * factor));
  if (writes_lse && lane == 0) {
    p.lse[row_head] = natural_lse(lse_max, weight_sum);
  }
}

// This block's (row, head), dim chunk, and this thread's split group, lane and dims.
template <typename Shape>
struct MergeRole {
  std::int64_t row_head;
  std::int64_t row;
  int head;
  int chunk;
  int group;
  int lane;
  int dim;

  __device__ __forceinline__ explicit MergeRole(const MlaMergeParams& p)
      : row_head(blockIdx.x / Shape::kDimChunks),
        row(row_head / p.num_heads),
        head(static_cast<int>(row_head % p.num_heads)),
        chunk(static_cast<int>(blockIdx.x % Shape::kDimChunks)),
        group(static_cast<int>(threadIdx.x) / Shape::kDimGroups),
        lane(static_cast<int>(threadIdx.x) % Shape::kDimGroups),
        dim((chunk * Shape::kDimGroups + lane) * 4) {}
};

template <typename Shape>
__global__ void __launch_bounds__(Shape::kThreads)
    mla_merge_kernel(const __grid_constant__ MlaMergeParams p) {
  extern __shared__ float weight_s[];  // [num_splits]
  __shared__ float lse_max_s;
  __shared__ float4 sum_s[Shape::kGroups][Shape::kDimGroups];
  const MergeRole<Shape> r(p);
  ptx::griddepcontrol_wait();
  const float lse_max = load_split_weights(p, r.row, r.head, weight_s, lse_max_s);
  const float4 sum = sum_split_group<Shape::kGroups>(p, r.row, r.head, weight_s, r.group, r.dim);
  sum_s[r.group][r.lane] = sum;
  __syncthreads();
  if (r.group != 0) return;
  write_merged_row<Shape>(p, r.row_head, sum_s, sum, lse_max,
                          sum_weights_in_order(weight_s, p.num_splits), r.lane, r.dim,
                          r.chunk == 0);
}

template <typename Shape>
__global__ void __launch_bounds__(Shape::kThreads)
    mla_merge_window_kernel(const __grid_constant__ MlaMergeParams p) {
  extern __shared__ float lse_s[];  // [num_splits] partial lse (base 2)
  __shared__ float4 sum_s[Shape::kGroups][Shape::kDimGroups];
  const MergeRole<Shape> r(p);
  ptx::griddepcontrol_wait();
  for (int i = threadIdx.x; i < p.num_splits; i += blockDim.x) {
    lse_s[i] = p.partial_lse[merge_part_row(p, r.row, r.head, i)];
  }
  float4 window[Shape::kWindow];
  load_split_window<Shape>(p, r.row, r.head, r.group, r.dim, window);
  __syncthreads();
  const SplitTotals totals = reduce_split_totals(lse_s, p.num_splits);
  const float4 sum =
      sum_split_window<Shape>(p, r.row, r.head, lse_s, totals.lse_max, r.group, r.dim, window);
  sum_s[r.group][r.lane] = sum;
  __syncthreads();
  if (r.group != 0) return;
  write_merged_row<Shape>(p, r.row_head, sum_s, sum, totals.lse_max, totals.weight_sum, r.lane,
                          r.dim, r.chunk == 0);
}

}  // namespace kvaudit::cuda::detail
