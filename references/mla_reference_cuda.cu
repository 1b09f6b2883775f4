// The exact MLA reference on the GPU (mla_reference_cuda.hpp). Same formulas and error analysis as
// the CPU reference (mla_reference.hpp); only the order of the exact-to-2^-100 partial sums and the
// way products are made error-free differ, so both give the double nearest the truth up to ~1e-25
// relative and agree to within an ulp or two of the final rounding.
//
// Per call, the query rows are cut into segments (rows of one request, at most a score buffer's
// worth), batched, and each batch runs three kernels. With a query vector qv = (row, head) of a
// segment, T its request's tokens and V(qv) = visible_of_row[row] (causal: V <= T):
//   1. scores   S[qv, t] = dd(q[qv] . k_t) * (sm_scale * scale)   for t < V(qv)  (64 x 64 tiles)
//      Every product is a float times a float, exact in binary64 (24 + 24 bits); the sum over
//      the Dc + Dr channels is TwoSum-compensated (hi, lo), as compensated_dot on the CPU:
//      error <= n u^2 sum_j |q_j k_j|, u = 2^-53.
//   1'. scores, sliced (KV rows with a value grid: every value an integer V times 2^G with
//      |V| < 2^bV, ReferenceProblem::value_grid_bits = bV; e4m3 pools): the CPU reference's exact
//      slicing (mla_reference.cpp, "Exact slicing"). q[qv] (|q_j| < 2^Eq) is cut into Kq <= 4
//      slices on the grids 2^(Eq - bq k), bq = 53 - bV - ceil(log2(Dc + Dr)); each slice's dot
//      with k_t is a sum of integers below 2^53 in units of 2^(Eq - bq k + G), so plain binary64
//      fused multiply-adds compute it exactly in any order. The Kq exact dots are then added in
//      double-double in slice order, as on the CPU, so these scores are the CPU's to the bit.
//      A batch with a query vector that is not finite or needs more than 4 slices takes kernel 1.
//      1' and 3' are the default; KVAUDIT_GPU_REFERENCE_SLICING=off keeps kernels 1 and 3.
//   2. weights  m = max_t S.hi,  E[qv, t] = exp_dd(S - m),  l = sum_t E (double-double),
//               lse = log_dd(l) + m;  a NaN score makes the pair NaN (out and lse), as on the CPU.
//   3. values   acc[qv, d] = sum_t E[qv, t] v_t[d]     (d < Dc)               (64 x 64 tiles)
//      Each product E.hi * v is made error-free with a fused multiply-add (TwoProd), added with
//      TwoSum; E.lo * v (2^-53 smaller) goes to the low word. out = scale * acc / l.
//   3'. values, sliced (rows with a value grid, as 1'): the CPU's sliced P.V with blocks of 16
//      tokens (one stage) instead of 256. The weights E (< 2) are cut into Kw slices on the
//      fixed grids 2^(-bw k), bw = 48 - bV, so a slice's sum over one stage is below
//      2^4 * 2^(bw + 1) * 2^bV = 2^53 units: exact in binary64 fused multiply-adds, then added
//      into (hi, lo) with TwoSum, largest slice first. Kw is the fewest slices that leave each
//      weight's remainder <= 2^-88 of the weight, chosen from the batch's smallest positive
//      weight (the weights kernel finds it), so the truncation costs at most 2^-88 sum_t E_t |v_t|,
//      the CPU's guarantee. A batch needing more than 5 slices takes kernel 3.
// Tiles: 256 threads, 16 x 16, each holding a 4 x 4 register block (query vectors ty + 16 i,
// columns tx + 16 k), the reduction axis staged through shared memory 16 deep. Tiles a causal
// mask hides entirely are never launched; inside a tile, masked tokens are skipped, never read
// (a NaN in a token a row does not see must not reach it).
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "references/double_double.hpp"
#include "references/mla_reference_cuda.hpp"
#include "src/core/parallel_for.hpp"

namespace kvaudit {
namespace {

constexpr int kTile = 64;      // query vectors x (tokens or latent dims) per tile
constexpr int kDepth = 16;     // reduction elements staged in shared memory per pass
constexpr int kThreads = 256;  // 16 x 16 threads, 4 x 4 outputs each
constexpr int kPerThread = 4;

// A run of query rows of one request; its scores are [num_qv, num_tokens] from score_offset.
struct Segment {
  long long score_offset = 0;
  long long kv_offset = 0;  // the request's token 0 in the gathered KV rows
  int first_row = 0;        // global query row
  int num_qv = 0;           // rows x heads
  int num_tokens = 0;       // the request's tokens
};

// One tile of kernels 1 and 3: query vectors qv0 .. qv0 + 63 of a segment; columns x0 .. x0 + 63
// (tokens in 1, latent dims in 3); `limit` = the largest V(qv) among the tile's query vectors.
struct Tile {
  int segment = 0;
  int qv0 = 0;
  int x0 = 0;
  int limit = 0;
};

struct DeviceArgs {
  const float* q_nope = nullptr;  // [Nq, H, Dc]
  const float* q_pe = nullptr;    // [Nq, H, Dr]
  const float* kv = nullptr;      // gathered rows [sum T, Dc + Dr]
  const int* visible_of_row = nullptr;
  const int* segment_of_row = nullptr;  // within the batch; -1: not in it
  const Segment* segments = nullptr;
  double* s_hi = nullptr;  // scores, then weights
  double* s_lo = nullptr;
  double* l_hi = nullptr;  // [Nq * H]
  double* l_lo = nullptr;
  unsigned char* is_nan = nullptr;  // [Nq * H]
  double* out = nullptr;            // [Nq, H, Dc]
  double* lse = nullptr;            // [Nq, H]
  int heads = 0;
  int dc = 0;
  int dr = 0;
  // The sliced scores (1'): per query vector of the batch (pair = row * H + head), the exponent
  // Eq (|q_j| < 2^Eq) and the number of slices (0: not sliceable); bq; see slicing_kernel.
  int* query_top = nullptr;
  int* query_slices = nullptr;
  int slice_bits = 0;
  // The sliced values (3'): bw, and per batch [0] the most weight slices a query vector needs,
  // [1] set where one needs more than kMaxWeightSlices (nullptr: the weights kernel skips it).
  int weight_bits = 0;
  int* weight_flags = nullptr;
  double factor_hi = 0.0;  // sm_scale * scale as a double-double (exact: a TwoProd)
  double factor_lo = 0.0;
  double scale = 1.0;
};

// TwoSum of acc and an exact addend p, the rounding error added to lo.
__device__ __forceinline__ void accumulate_exact(double& hi, double& lo, double p) {
  const double s = __dadd_rn(hi, p);
  const double bb = __dsub_rn(s, hi);
  lo = __dadd_rn(lo, __dadd_rn(__dsub_rn(hi, __dsub_rn(s, bb)), __dsub_rn(p, bb)));
  hi = s;
}

__device__ __forceinline__ int visible_of_qv(const DeviceArgs& a, const Segment& seg, int qv) {
  return a.visible_of_row[seg.first_row + qv / a.heads];
}

// Element j of query vector qv of the segment ([q_nope | q_pe]); 0 past the width.
__device__ __forceinline__ double query_element(const DeviceArgs& a, const Segment& seg, int qv,
                                                int j) {
  const long long pair = static_cast<long long>(seg.first_row) * a.heads + qv;
  if (j < a.dc) return a.q_nope[pair * a.dc + j];
  if (j < a.dc + a.dr) return a.q_pe[pair * a.dr + (j - a.dc)];
  return 0.0;
}

// ---- 1. scores -------------------------------------------------------------------------------

__global__ void __launch_bounds__(kThreads) scores_kernel(DeviceArgs a, const Tile* tiles) {
  __shared__ double q_tile[kDepth][kTile + 1];  // + 1: the channel-fastest stores hit
  __shared__ float k_tile[kDepth][kTile + 1];   // distinct banks
  const Tile tile = tiles[blockIdx.x];
  const Segment seg = a.segments[tile.segment];
  const int width = a.dc + a.dr;
  const int tx = threadIdx.x % 16;
  const int ty = threadIdx.x / 16;
  double hi[kPerThread][kPerThread] = {};
  double lo[kPerThread][kPerThread] = {};
  for (int j0 = 0; j0 < width; j0 += kDepth) {
    // Stage q[qv0 .. +63][j0 .. +15] and k[x0 .. +63][j0 .. +15], channel-fastest (coalesced).
    for (int e = threadIdx.x; e < kDepth * kTile; e += kThreads) {
      const int j = e % kDepth;
      const int r = e / kDepth;
      const int qv = tile.qv0 + r;
      q_tile[j][r] = qv < seg.num_qv ? query_element(a, seg, qv, j0 + j) : 0.0;
      const int t = tile.x0 + r;
      k_tile[j][r] = (t < seg.num_tokens && j0 + j < width)
                         ? a.kv[(seg.kv_offset + t) * width + j0 + j]
                         : 0.0f;
    }
    __syncthreads();
#pragma unroll 4
    for (int j = 0; j < kDepth; ++j) {
      double q[kPerThread];
      double k[kPerThread];
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) q[i] = q_tile[j][ty + 16 * i];
#pragma unroll
      for (int c = 0; c < kPerThread; ++c) k[c] = k_tile[j][tx + 16 * c];
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
#pragma unroll
        for (int c = 0; c < kPerThread; ++c) {
          accumulate_exact(hi[i][c], lo[i][c], __dmul_rn(q[i], k[c]));  // exact product
        }
      }
    }
    __syncthreads();
  }
  const dd::DoubleDouble factor{a.factor_hi, a.factor_lo};
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int qv = tile.qv0 + ty + 16 * i;
    if (qv >= seg.num_qv) continue;
    const int visible = visible_of_qv(a, seg, qv);
#pragma unroll
    for (int c = 0; c < kPerThread; ++c) {
      const int t = tile.x0 + tx + 16 * c;
      if (t >= visible) continue;
      const dd::DoubleDouble s = dd::mul(dd::two_sum(hi[i][c], lo[i][c]), factor);
      const long long at = seg.score_offset + static_cast<long long>(qv) * seg.num_tokens + t;
      a.s_hi[at] = s.hi;
      a.s_lo[at] = s.lo;
    }
  }
}

// ---- 1'. sliced scores -------------------------------------------------------------------------

constexpr int kMaxScoreSlices = 4;  // as the CPU reference: more slices take kernel 1

// Slice k (1-based) of q_j: the remainder after slices 1 .. k-1, rounded to the grid
// 2^(top - bits k) (a power-of-two scaling and a round-to-nearest-even: exact; the remainder's
// subtraction is exact too, as the CPU's slice_q argues). Returns the slice; `rest` becomes the
// remainder after it.
__device__ __forceinline__ double cut_slice(double& rest, int top, int bits, int k) {
  const int grid = top - bits * k;
  const double slice =
      __dmul_rn(rint(__dmul_rn(rest, dd::power_of_two(-grid))), dd::power_of_two(grid));
  rest = __dsub_rn(rest, slice);
  return slice;
}

// One warp per query vector (pairs first_pair .. first_pair + num_pairs - 1): its exponent
// Eq = the top of max_j |q_j| (|q_j| < 2^Eq; 0 for a zero vector, as the CPU), and the number of
// slices after which nothing of q is left: 1 .. kMaxScoreSlices, or 0 where q is not finite or
// needs more. flags[0] gathers the largest count, flags[1] is set where a count is 0.
__global__ void slicing_kernel(DeviceArgs a, int first_pair, int num_pairs, int* top_of_pair,
                               int* slices_of_pair, int* flags) {
  const int lane = threadIdx.x % 32;
  const long long pair =
      first_pair + static_cast<long long>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (pair >= first_pair + static_cast<long long>(num_pairs)) return;
  const int width = a.dc + a.dr;
  auto element = [&](int j) {
    return j < a.dc ? static_cast<double>(a.q_nope[pair * a.dc + j])
                    : static_cast<double>(a.q_pe[pair * a.dr + (j - a.dc)]);
  };
  double largest = 0.0;
  bool finite = true;
  for (int j = lane; j < width; j += 32) {
    const double v = element(j);
    finite = finite && isfinite(v);
    largest = fmax(largest, fabs(v));
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    largest = fmax(largest, __shfl_xor_sync(0xffffffffu, largest, offset));
  }
  finite = __all_sync(0xffffffffu, finite);
  const int top = largest == 0.0 ? 0 : ilogb(largest) + 1;  // |q_j| < 2^top
  int slices = 0;
  if (finite) {
    for (int k = 1; k <= kMaxScoreSlices && slices == 0; ++k) {
      bool rest_left = false;
      for (int j = lane; j < width; j += 32) {
        double rest = element(j);
        for (int i = 1; i <= k; ++i) cut_slice(rest, top, a.slice_bits, i);
        rest_left = rest_left || rest != 0.0;
      }
      if (!__any_sync(0xffffffffu, rest_left)) slices = k;
    }
  }
  if (lane == 0) {
    top_of_pair[pair] = top;
    slices_of_pair[pair] = slices;
    atomicMax(&flags[0], slices);
    if (slices == 0) atomicExch(&flags[1], 1);
  }
}

// Kernel 1 with q sliced: the same tiles and staging, Kq accumulators per output, each an exact
// binary64 sum (the bound at the top of the file), added in double-double at the end.
template <int Kq>
__global__ void __launch_bounds__(kThreads) sliced_scores_kernel(DeviceArgs a, const Tile* tiles) {
  __shared__ double q_tile[Kq][kDepth][kTile + 1];
  __shared__ float k_tile[kDepth][kTile + 1];
  const Tile tile = tiles[blockIdx.x];
  const Segment seg = a.segments[tile.segment];
  const int width = a.dc + a.dr;
  const int tx = threadIdx.x % 16;
  const int ty = threadIdx.x / 16;
  const long long first_pair = static_cast<long long>(seg.first_row) * a.heads;
  double acc[Kq][kPerThread][kPerThread] = {};
  for (int j0 = 0; j0 < width; j0 += kDepth) {
    for (int e = threadIdx.x; e < kDepth * kTile; e += kThreads) {
      const int j = e % kDepth;
      const int r = e / kDepth;
      const int qv = tile.qv0 + r;
      double rest = qv < seg.num_qv ? query_element(a, seg, qv, j0 + j) : 0.0;
      const int top = qv < seg.num_qv ? a.query_top[first_pair + qv] : 0;
#pragma unroll
      for (int k = 0; k < Kq; ++k) q_tile[k][j][r] = cut_slice(rest, top, a.slice_bits, k + 1);
      const int t = tile.x0 + r;
      k_tile[j][r] = (t < seg.num_tokens && j0 + j < width)
                         ? a.kv[(seg.kv_offset + t) * width + j0 + j]
                         : 0.0f;
    }
    __syncthreads();
#pragma unroll 2
    for (int j = 0; j < kDepth; ++j) {
      double k[kPerThread];
#pragma unroll
      for (int c = 0; c < kPerThread; ++c) k[c] = k_tile[j][tx + 16 * c];
#pragma unroll
      for (int s = 0; s < Kq; ++s) {
#pragma unroll
        for (int i = 0; i < kPerThread; ++i) {
          const double q = q_tile[s][j][ty + 16 * i];
#pragma unroll
          for (int c = 0; c < kPerThread; ++c) acc[s][i][c] = __fma_rn(q, k[c], acc[s][i][c]);
        }
      }
    }
    __syncthreads();
  }
  const dd::DoubleDouble factor{a.factor_hi, a.factor_lo};
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int qv = tile.qv0 + ty + 16 * i;
    if (qv >= seg.num_qv) continue;
    const int visible = visible_of_qv(a, seg, qv);
    const int slices = a.query_slices[first_pair + qv];
#pragma unroll
    for (int c = 0; c < kPerThread; ++c) {
      const int t = tile.x0 + tx + 16 * c;
      if (t >= visible) continue;
      dd::DoubleDouble dot{acc[0][i][c], 0.0};
#pragma unroll
      for (int s = 1; s < Kq; ++s) {
        if (s < slices) dot = dd::add(dot, acc[s][i][c]);
      }
      const dd::DoubleDouble score = dd::mul(dot, factor);
      const long long at = seg.score_offset + static_cast<long long>(qv) * seg.num_tokens + t;
      a.s_hi[at] = score.hi;
      a.s_lo[at] = score.lo;
    }
  }
}

// ---- 2. weights ------------------------------------------------------------------------------

__device__ dd::DoubleDouble block_sum(dd::DoubleDouble x, dd::DoubleDouble* shared) {
  shared[threadIdx.x] = x;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      shared[threadIdx.x] = dd::add(shared[threadIdx.x], shared[threadIdx.x + stride]);
    }
    __syncthreads();
  }
  return shared[0];
}

constexpr int kMaxWeightSlices = 5;      // more: kernel 3 (a slice costs one FMA per product)
constexpr int kWeightRelativeBits = 88;  // a sliced weight's remainder <= 2^-88 of the weight

// The weight slices this query vector needs (3'): from the smallest positive weight w, the fewest
// Kw with 2^(-bw Kw) <= 2^-88 w (grids from 2^0 for every weight; the CPU's accumulate_sliced
// instead starts each weight's grids at its band of exponents); gathered into a.weight_flags.
// Called by every thread of the block.
__device__ void count_weight_slices(const DeviceArgs& a, const double* weights, int visible) {
  __shared__ double scratch[kThreads];
  double smallest = 1.0;
  for (int t = threadIdx.x; t < visible; t += kThreads) {
    if (weights[t] > 0.0) smallest = fmin(smallest, weights[t]);
  }
  scratch[threadIdx.x] = smallest;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      scratch[threadIdx.x] = fmin(scratch[threadIdx.x], scratch[threadIdx.x + stride]);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const int needed = kWeightRelativeBits - ilogb(scratch[0]);
    const int slices = max(1, (needed + a.weight_bits - 1) / a.weight_bits);
    atomicMax(&a.weight_flags[0], slices);
    if (slices > kMaxWeightSlices) atomicExch(&a.weight_flags[1], 1);
  }
}

// One block per query vector (pair = row * H + head) of the batch.
__global__ void __launch_bounds__(kThreads) weights_kernel(DeviceArgs a, int first_pair) {
  __shared__ dd::DoubleDouble partial[kThreads];
  __shared__ double row_max;
  __shared__ int any_nan;
  const long long pair = first_pair + static_cast<long long>(blockIdx.x);
  const int row = static_cast<int>(pair / a.heads);
  const int segment = a.segment_of_row[row];
  if (segment < 0) return;
  const Segment seg = a.segments[segment];
  const int qv = static_cast<int>(pair - static_cast<long long>(seg.first_row) * a.heads);
  const int visible = a.visible_of_row[row];
  double* s_hi = a.s_hi + seg.score_offset + static_cast<long long>(qv) * seg.num_tokens;
  double* s_lo = a.s_lo + seg.score_offset + static_cast<long long>(qv) * seg.num_tokens;

  if (threadIdx.x == 0) {
    row_max = -INFINITY;
    any_nan = 0;
  }
  __syncthreads();
  double m = -INFINITY;
  bool nan = false;
  for (int t = threadIdx.x; t < visible; t += kThreads) {
    nan = nan || isnan(s_hi[t]);
    m = fmax(m, s_hi[t]);
  }
  if (nan) atomicExch(&any_nan, 1);
  // Every thread's maximum into one (fmax ignores NaN, which is handled by any_nan).
  partial[threadIdx.x] = {m, 0.0};
  __syncthreads();
  if (threadIdx.x == 0) {
    double best = -INFINITY;
    for (int i = 0; i < kThreads; ++i) best = fmax(best, partial[i].hi);
    row_max = best;
  }
  __syncthreads();
  if (any_nan) {
    if (threadIdx.x == 0) {
      a.is_nan[pair] = 1;
      a.lse[pair] = NAN;
    }
    return;
  }
  m = row_max;
  dd::DoubleDouble l{0.0, 0.0};
  for (int t = threadIdx.x; t < visible; t += kThreads) {
    const dd::DoubleDouble e = dd::exp(dd::add(dd::DoubleDouble{s_hi[t], s_lo[t]}, -m));
    s_hi[t] = e.hi;
    s_lo[t] = e.lo;
    l = dd::add(l, e);
  }
  __syncthreads();  // partial[] was read above
  l = block_sum(l, partial);
  if (threadIdx.x == 0) {
    a.is_nan[pair] = 0;
    a.l_hi[pair] = l.hi;
    a.l_lo[pair] = l.lo;
    a.lse[pair] = dd::to_double(dd::add(dd::log(l), m));
  }
  if (a.weight_flags != nullptr) count_weight_slices(a, s_hi, visible);
}

// ---- 3. values -------------------------------------------------------------------------------

// Phases shared by kernels 3 and 3': each thread's rows (tile.qv0 + ty + 16 i) and their visible
// token counts; the stage of kDepth KV rows' c columns [t0 .. +15][x0 .. +63] (dim-fastest, zero
// beyond the segment or c); and the epilogue out = (hi + lo) / l * scale (NaN for a NaN pair).
__device__ __forceinline__ void visible_of_rows(const DeviceArgs& a, const Segment& seg,
                                                const Tile& tile, int ty,
                                                int (&visible)[kPerThread]) {
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int qv = tile.qv0 + ty + 16 * i;
    visible[i] = qv < seg.num_qv ? visible_of_qv(a, seg, qv) : 0;
  }
}

__device__ __forceinline__ void stage_value_element(const DeviceArgs& a, const Segment& seg,
                                                    const Tile& tile, int t0, int e,
                                                    float (&v_tile)[kDepth][kTile]) {
  const int width = a.dc + a.dr;
  const int d = e % kTile;
  const int tt = e / kTile;
  v_tile[tt][d] = (t0 + tt < seg.num_tokens && tile.x0 + d < a.dc)
                      ? a.kv[(seg.kv_offset + t0 + tt) * width + tile.x0 + d]
                      : 0.0f;
}

__device__ __forceinline__ void store_outputs(const DeviceArgs& a, const Segment& seg,
                                              const Tile& tile, int tx, int ty,
                                              const double (&hi)[kPerThread][kPerThread],
                                              const double (&lo)[kPerThread][kPerThread]) {
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int qv = tile.qv0 + ty + 16 * i;
    if (qv >= seg.num_qv) continue;
    const long long pair = static_cast<long long>(seg.first_row) * a.heads + qv;
    const bool nan = a.is_nan[pair] != 0;
    const dd::DoubleDouble l{a.l_hi[pair], a.l_lo[pair]};
#pragma unroll
    for (int c = 0; c < kPerThread; ++c) {
      const int d = tile.x0 + tx + 16 * c;
      if (d >= a.dc) continue;
      a.out[pair * a.dc + d] =
          nan ? NAN : dd::to_double(dd::mul(dd::div(dd::two_sum(hi[i][c], lo[i][c]), l), a.scale));
    }
  }
}

__global__ void __launch_bounds__(kThreads) values_kernel(DeviceArgs a, const Tile* tiles) {
  __shared__ double w_hi[kDepth][kTile + 1];
  __shared__ double w_lo[kDepth][kTile + 1];
  __shared__ float v_tile[kDepth][kTile];
  const Tile tile = tiles[blockIdx.x];
  const Segment seg = a.segments[tile.segment];
  const int tx = threadIdx.x % 16;
  const int ty = threadIdx.x / 16;
  int visible[kPerThread];
  visible_of_rows(a, seg, tile, ty, visible);
  double hi[kPerThread][kPerThread] = {};
  double lo[kPerThread][kPerThread] = {};
  for (int t0 = 0; t0 < tile.limit; t0 += kDepth) {
    // Stage E[qv0 .. +63][t0 .. +15] (token-fastest) and v[t0 .. +15][x0 .. +63] (dim-fastest).
    for (int e = threadIdx.x; e < kDepth * kTile; e += kThreads) {
      const int t = e % kDepth;
      const int r = e / kDepth;
      const int qv = tile.qv0 + r;
      double whi = 0.0;
      double wlo = 0.0;
      if (qv < seg.num_qv && t0 + t < visible_of_qv(a, seg, qv)) {
        const long long at =
            seg.score_offset + static_cast<long long>(qv) * seg.num_tokens + t0 + t;
        whi = a.s_hi[at];
        wlo = a.s_lo[at];
      }
      w_hi[t][r] = whi;
      w_lo[t][r] = wlo;
      stage_value_element(a, seg, tile, t0, e, v_tile);
    }
    __syncthreads();
    for (int t = 0; t < kDepth; ++t) {
      double v[kPerThread];
#pragma unroll
      for (int c = 0; c < kPerThread; ++c) v[c] = v_tile[t][tx + 16 * c];
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
        if (t0 + t >= visible[i]) continue;  // masked: never read (it may hold a NaN)
        const double whi = w_hi[t][ty + 16 * i];
        const double wlo = w_lo[t][ty + 16 * i];
#pragma unroll
        for (int c = 0; c < kPerThread; ++c) {
          const double p = __dmul_rn(whi, v[c]);
          const double p_error = __fma_rn(whi, v[c], -p);  // TwoProd: p + p_error == whi * v
          accumulate_exact(hi[i][c], lo[i][c], p);
          lo[i][c] = __dadd_rn(lo[i][c], __fma_rn(wlo, v[c], p_error));
        }
      }
    }
    __syncthreads();
  }
  store_outputs(a, seg, tile, tx, ty, hi, lo);
}

// ---- 3'. sliced values -------------------------------------------------------------------------

// Slice k (1-based) of the weight whose unsliced rest is w, on the grid 2^(-bits k): as the
// CPU's slice_weight (renormalise the rest with TwoSum, round its high word to the grid; the
// subtraction is exact).
__device__ __forceinline__ double cut_weight_slice(dd::DoubleDouble& w, int bits, int k) {
  w = dd::two_sum(w.hi, w.lo);
  const double slice =
      __dmul_rn(rint(__dmul_rn(w.hi, dd::power_of_two(bits * k))), dd::power_of_two(-bits * k));
  w.hi = __dsub_rn(w.hi, slice);
  return slice;
}

// Kernel 3 with the weights sliced: per stage of kDepth tokens, each slice's products summed in
// registers (exact: the bound at the top of the file), then added into (hi, lo) with TwoSum,
// largest slice first. Same tiles, masking and epilogue as kernel 3.
template <int Kw>
__global__ void __launch_bounds__(kThreads) sliced_values_kernel(DeviceArgs a, const Tile* tiles) {
  __shared__ double w_tile[Kw][kDepth][kTile + 1];
  __shared__ float v_tile[kDepth][kTile];
  const Tile tile = tiles[blockIdx.x];
  const Segment seg = a.segments[tile.segment];
  const int tx = threadIdx.x % 16;
  const int ty = threadIdx.x / 16;
  int visible[kPerThread];
  visible_of_rows(a, seg, tile, ty, visible);
  double hi[kPerThread][kPerThread] = {};
  double lo[kPerThread][kPerThread] = {};
  for (int t0 = 0; t0 < tile.limit; t0 += kDepth) {
    for (int e = threadIdx.x; e < kDepth * kTile; e += kThreads) {
      const int t = e % kDepth;
      const int r = e / kDepth;
      const int qv = tile.qv0 + r;
      dd::DoubleDouble w{0.0, 0.0};
      if (qv < seg.num_qv && t0 + t < visible_of_qv(a, seg, qv)) {
        const long long at =
            seg.score_offset + static_cast<long long>(qv) * seg.num_tokens + t0 + t;
        w = {a.s_hi[at], a.s_lo[at]};
      }
#pragma unroll
      for (int k = 0; k < Kw; ++k) w_tile[k][t][r] = cut_weight_slice(w, a.weight_bits, k + 1);
      stage_value_element(a, seg, tile, t0, e, v_tile);
    }
    __syncthreads();
#pragma unroll 1
    for (int k = 0; k < Kw; ++k) {
      double acc[kPerThread][kPerThread] = {};
      for (int t = 0; t < kDepth; ++t) {
        double v[kPerThread];
#pragma unroll
        for (int c = 0; c < kPerThread; ++c) v[c] = v_tile[t][tx + 16 * c];
#pragma unroll
        for (int i = 0; i < kPerThread; ++i) {
          if (t0 + t >= visible[i]) continue;  // masked: never read (it may hold a NaN)
          const double w = w_tile[k][t][ty + 16 * i];
#pragma unroll
          for (int c = 0; c < kPerThread; ++c) acc[i][c] = __fma_rn(w, v[c], acc[i][c]);
        }
      }
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
#pragma unroll
        for (int c = 0; c < kPerThread; ++c) accumulate_exact(hi[i][c], lo[i][c], acc[i][c]);
      }
    }
    __syncthreads();
  }
  store_outputs(a, seg, tile, tx, ty, hi, lo);
}

// ---- host ------------------------------------------------------------------------------------

using Clock = std::chrono::steady_clock;

Status cuda_check(cudaError_t status, const std::string& where, const char* what) {
  if (status == cudaSuccess) return ok_status();
  return internal_error(where,
                        std::string("GPU reference: ") + what + ": " + cudaGetErrorString(status));
}

enum class Memory : std::uint8_t { kDevice, kPinnedHost };

// Allocations that only grow, kept between calls (a check calls once per step and layer): device
// memory, or page-locked host memory, which the copies to and from the device read and write at the
// link's speed (pageable memory goes through the driver's own staging copy first). A buffer grows
// by at least a quarter: cudaFree and cudaFreeHost wait for the whole device (the backend's stream
// too), and a decode dump's context grows a little at every step.
class Arena {
 public:
  explicit Arena(Memory memory) : memory_(memory) {}

  // Bytes held over every buffer.
  std::size_t bytes() const {
    std::size_t total = 0;
    for (const Buffer& b : buffers_) total += b.bytes;
    return total;
  }

  template <typename T>
  Result<T*> get(int slot, std::size_t count, const std::string& where) {
    if (buffers_.size() <= static_cast<std::size_t>(slot)) buffers_.resize(slot + 1);
    Buffer& b = buffers_[slot];
    const std::size_t bytes = std::max<std::size_t>(count * sizeof(T), 16);
    if (bytes > b.bytes) {
      const std::size_t grown = std::max(bytes, b.bytes + b.bytes / 4);
      release(b);
      KVAUDIT_TRY(allocate(b, grown, where));
    }
    return static_cast<T*>(b.data);
  }

 private:
  struct Buffer {
    void* data = nullptr;
    std::size_t bytes = 0;
  };
  Status allocate(Buffer& b, std::size_t bytes, const std::string& where) {
    const Status status = memory_ == Memory::kDevice
                              ? cuda_check(cudaMalloc(&b.data, bytes), where, "cudaMalloc")
                              : cuda_check(cudaHostAlloc(&b.data, bytes, cudaHostAllocDefault),
                                           where, "cudaHostAlloc (page-locked host memory)");
    if (!status.ok()) return status;
    b.bytes = bytes;
    return ok_status();
  }
  void release(Buffer& b) {
    if (memory_ == Memory::kDevice) cudaFree(b.data);
    if (memory_ == Memory::kPinnedHost) cudaFreeHost(b.data);
    b = {};
  }

  Memory memory_;
  std::vector<Buffer> buffers_;
};

enum ArenaSlot : int {
  kQNope,
  kQPe,
  kKv,
  kVisible,
  kSegmentOfRow,
  kSegments,
  kScoreTiles,
  kValueTiles,
  kScoreHi,
  kScoreLo,
  kSumHi,
  kSumLo,
  kIsNan,
  kOut,
  kLse,
  kQueryTop,
  kQuerySlices,
  kSliceFlags,
  kWeightFlags,
};

// The page-locked host buffers: the inputs staged for upload, the results downloaded.
enum PinnedSlot : int { kPinnedQNope, kPinnedQPe, kPinnedKv, kPinnedOut, kPinnedLse };

// The score buffers hold at most this many elements per batch (2 x 8 bytes each: 4 GiB).
constexpr long long kMaxScoreElements = 1ll << 28;

struct Batch {
  std::vector<Segment> segments;
  long long score_elements = 0;
  int first_row = 0;
  int end_row = 0;
};

// Segments: each request's rows, cut so that one segment's scores fit the buffer; consecutive
// segments grouped into batches under the same bound.
std::vector<Batch> plan_batches(const ReferenceProblem& p,
                                const std::vector<long long>& kv_offset) {
  std::vector<Batch> batches;
  Batch batch;
  const auto flush = [&] {
    if (!batch.segments.empty()) batches.push_back(std::move(batch));
    batch = Batch{};
  };
  int row = 0;
  while (row < p.num_rows()) {
    const int request = p.request_of_row[row];
    const long long tokens = static_cast<long long>(p.token_rows[request].size());
    const long long per_row = std::max<long long>(tokens * p.num_heads, 1);
    int end = row;
    while (end < p.num_rows() && p.request_of_row[end] == request &&
           (end - row + 1) * per_row <= kMaxScoreElements) {
      ++end;
    }
    end = std::max(end, row + 1);
    const long long elements = (end - row) * per_row;
    if (batch.score_elements + elements > kMaxScoreElements) flush();
    if (batch.segments.empty()) batch.first_row = row;
    batch.segments.push_back(Segment{batch.score_elements, kv_offset[request], row,
                                     (end - row) * p.num_heads, static_cast<int>(tokens)});
    batch.score_elements += elements;
    batch.end_row = end;
    row = end;
  }
  flush();
  return batches;
}

// The largest V(qv) over query vectors qv0 .. qv0 + 63 of a segment.
int tile_limit(const ReferenceProblem& p, const Segment& seg, int qv0) {
  const int last_qv = std::min(qv0 + kTile, seg.num_qv) - 1;
  std::int64_t limit = 0;
  for (int row = seg.first_row + qv0 / p.num_heads; row <= seg.first_row + last_qv / p.num_heads;
       ++row) {
    limit = std::max(limit, p.visible_of_row[row]);
  }
  return static_cast<int>(limit);
}

void plan_tiles(const ReferenceProblem& p, const Batch& batch, std::vector<Tile>& score_tiles,
                std::vector<Tile>& value_tiles) {
  score_tiles.clear();
  value_tiles.clear();
  for (int s = 0; s < static_cast<int>(batch.segments.size()); ++s) {
    const Segment& seg = batch.segments[s];
    for (int qv0 = 0; qv0 < seg.num_qv; qv0 += kTile) {
      const int limit = tile_limit(p, seg, qv0);
      for (int t0 = 0; t0 < limit; t0 += kTile) score_tiles.push_back({s, qv0, t0, limit});
      for (int d0 = 0; d0 < p.dc; d0 += kTile) value_tiles.push_back({s, qv0, d0, limit});
    }
  }
}

// Copies are queued on the reference's own stream (the caller synchronizes it before the host
// reuses a page-locked source or reads a result); a pageable source may be freed at return (the
// runtime has staged it by then).
template <typename T>
Status upload(T* device, const T* host, std::size_t count, cudaStream_t stream,
              const std::string& where) {
  if (count == 0) return ok_status();
  return cuda_check(
      cudaMemcpyAsync(device, host, count * sizeof(T), cudaMemcpyHostToDevice, stream), where,
      "cudaMemcpy to the device");
}

// A device array into host memory, complete at return.
template <typename T>
Status download_array(T* host, const T* device, std::size_t count, cudaStream_t stream,
                      const std::string& where, const char* what) {
  if (count == 0) return ok_status();
  KVAUDIT_TRY(
      cuda_check(cudaMemcpyAsync(host, device, count * sizeof(T), cudaMemcpyDeviceToHost, stream),
                 where, what));
  return cuda_check(cudaStreamSynchronize(stream), where, what);
}

// bw of the sliced values (3'): 48 - bV (blocks of kDepth = 2^4 tokens, weights < 2); 0 where the
// rows have no value grid or fewer than 8 bits are left (kernel 3 then).
int weight_slice_bits(const ReferenceProblem& p) {
  static_assert(kDepth == 16);
  if (p.value_grid_bits < 0) return 0;
  const int bits = 53 - p.value_grid_bits - 4 - 1;
  return bits >= 8 ? bits : 0;
}

// bq of the sliced scores (1'), as the CPU's score_slice_bits: 0 where the rows have no value grid
// or the bound leaves fewer than 8 bits per slice (kernel 1 then).
int score_slice_bits(const ReferenceProblem& p) {
  if (p.value_grid_bits < 0) return 0;
  const int width = p.width();
  const int log2_width = width <= 1 ? 0 : 32 - __builtin_clz(static_cast<unsigned>(width - 1));
  const int bits = 53 - p.value_grid_bits - log2_width;
  return bits >= 8 ? bits : 0;
}

class GpuReference {
 public:
  Status run(const ReferenceProblem& p, const std::string& where);
  // The kernels run since the last call of this, counted from zero again.
  GpuReferenceKernels take_kernels_run() { return std::exchange(kernels_run_, {}); }
  std::size_t device_bytes() const { return arena_.bytes(); }

 private:
  Status upload_inputs(const ReferenceProblem& p, const std::string& where);
  Status run_batch(const ReferenceProblem& p, const Batch& batch, const std::string& where);
  Result<int> slice_queries(const ReferenceProblem& p, const Batch& batch,
                            const std::string& where);
  void launch_scores(int slices, const Tile* score_tiles);
  Result<int> weight_slices(const std::string& where);
  void launch_values(int slices, const Tile* value_tiles);
  Status download(const ReferenceProblem& p, const std::string& where);
  Status synchronize(const std::string& where, const char* what);

  // A caller's array copied (on p.threads threads) into a page-locked buffer, then to the device.
  template <typename T>
  Status upload_staged(T* device, std::span<const T> host, PinnedSlot slot, int threads,
                       const std::string& where);

  // The reference's own stream (non-blocking): its copies and kernels overlap a cuda-* backend's,
  // which has its own, when two layers are in flight; made at the first call, never destroyed
  // (see gpu_reference()).
  cudaStream_t stream_ = nullptr;
  DeviceSeconds seconds_;  // this call's split (add_gpu_reference_seconds at its end)
  Arena arena_{Memory::kDevice};
  Arena pinned_{Memory::kPinnedHost};
  DeviceArgs args_;
  GpuReferenceKernels kernels_run_;
  int* segment_of_row_ = nullptr;     // args_.segment_of_row, writable
  std::vector<long long> kv_offset_;  // gathered_row_offsets
  std::vector<Tile> score_tiles_;
  std::vector<Tile> value_tiles_;
};

template <typename T>
Status GpuReference::upload_staged(T* device, std::span<const T> host, PinnedSlot slot, int threads,
                                   const std::string& where) {
  KVAUDIT_ASSIGN_OR_RETURN(T * staged, pinned_.get<T>(slot, host.size(), where));
  parallel_copy(host.data(), host.size(), staged, threads);
  return upload(device, staged, host.size(), stream_, where);
}

Status GpuReference::synchronize(const std::string& where, const char* what) {
  return cuda_check(cudaStreamSynchronize(stream_), where, what);
}

// The visible KV rows gathered (on p.threads threads) straight into a page-locked buffer, q staged
// through one, everything uploaded.
Status GpuReference::upload_inputs(const ReferenceProblem& p, const std::string& where) {
  const std::size_t pairs = static_cast<std::size_t>(p.num_rows()) * p.num_heads;
  auto start = Clock::now();
  kv_offset_ = gathered_row_offsets(p);
  const std::size_t kv_count = static_cast<std::size_t>(kv_offset_.back()) * p.width();
  KVAUDIT_ASSIGN_OR_RETURN(float* kv, pinned_.get<float>(kPinnedKv, kv_count, where));
  gather_token_rows(p, kv_offset_, kv);
  std::vector<int> visible(p.visible_of_row.begin(), p.visible_of_row.end());
  seconds_.prepare += elapsed_seconds_since(start);
  start = Clock::now();
  KVAUDIT_ASSIGN_OR_RETURN(float* q_nope, arena_.get<float>(kQNope, p.q_nope.size(), where));
  KVAUDIT_ASSIGN_OR_RETURN(float* q_pe, arena_.get<float>(kQPe, p.q_pe.size(), where));
  KVAUDIT_ASSIGN_OR_RETURN(float* kv_device, arena_.get<float>(kKv, kv_count, where));
  KVAUDIT_ASSIGN_OR_RETURN(int* visible_device, arena_.get<int>(kVisible, visible.size(), where));
  KVAUDIT_TRY(upload_staged(q_nope, p.q_nope, kPinnedQNope, p.threads, where));
  KVAUDIT_TRY(upload_staged(q_pe, p.q_pe, kPinnedQPe, p.threads, where));
  KVAUDIT_TRY(upload(kv_device, kv, kv_count, stream_, where));
  KVAUDIT_TRY(upload(visible_device, visible.data(), visible.size(), stream_, where));
  KVAUDIT_TRY(synchronize(where, "uploads"));
  seconds_.upload += elapsed_seconds_since(start);
  args_ = DeviceArgs{};
  args_.q_nope = q_nope;
  args_.q_pe = q_pe;
  args_.kv = kv_device;
  args_.visible_of_row = visible_device;
  KVAUDIT_ASSIGN_OR_RETURN(segment_of_row_,
                           arena_.get<int>(kSegmentOfRow, p.visible_of_row.size(), where));
  args_.segment_of_row = segment_of_row_;
  KVAUDIT_ASSIGN_OR_RETURN(args_.l_hi, arena_.get<double>(kSumHi, pairs, where));
  KVAUDIT_ASSIGN_OR_RETURN(args_.l_lo, arena_.get<double>(kSumLo, pairs, where));
  KVAUDIT_ASSIGN_OR_RETURN(args_.is_nan, arena_.get<unsigned char>(kIsNan, pairs, where));
  KVAUDIT_ASSIGN_OR_RETURN(args_.out, arena_.get<double>(kOut, p.out.size(), where));
  KVAUDIT_ASSIGN_OR_RETURN(args_.lse, arena_.get<double>(kLse, p.lse.size(), where));
  args_.heads = p.num_heads;
  args_.dc = p.dc;
  args_.dr = p.dr;
  args_.slice_bits = score_slice_bits(p);
  args_.weight_bits = weight_slice_bits(p);
  KVAUDIT_ASSIGN_OR_RETURN(args_.query_top, arena_.get<int>(kQueryTop, pairs, where));
  KVAUDIT_ASSIGN_OR_RETURN(args_.query_slices, arena_.get<int>(kQuerySlices, pairs, where));
  const dd::DoubleDouble factor = dd::two_prod(p.sm_scale, p.scale);
  args_.factor_hi = factor.hi;
  args_.factor_lo = factor.lo;
  args_.scale = p.scale;
  return ok_status();
}

// The sliced scores' plan for a batch (1'): each query vector's exponent and slice count on the
// device; returns the slices every query vector of the batch fits in (the kernel's Kq), or 0
// where the rows have no value grid or some query vector cannot be sliced (kernel 1 then).
// The sliced kernels (1', 3') run unless KVAUDIT_GPU_REFERENCE_SLICING=off (then the compensated
// kernels 1 and 3 alone, for a comparison of the two: their outputs agree within the bound, and a
// whole-model report is the same either way; docs/gpu.md). Read at every batch, so a test can
// switch it.
bool slicing_allowed() {
  const char* choice = std::getenv("KVAUDIT_GPU_REFERENCE_SLICING");
  return choice == nullptr || std::string_view(choice) != "off";
}

Result<int> GpuReference::slice_queries(const ReferenceProblem& p, const Batch& batch,
                                        const std::string& where) {
  const int num_pairs = (batch.end_row - batch.first_row) * p.num_heads;
  if (args_.slice_bits == 0 || num_pairs == 0 || !slicing_allowed()) return 0;
  KVAUDIT_ASSIGN_OR_RETURN(int* flags, arena_.get<int>(kSliceFlags, 2, where));
  KVAUDIT_TRY(cuda_check(cudaMemsetAsync(flags, 0, 2 * sizeof(int), stream_), where, "cudaMemset"));
  constexpr int kWarps = 8;
  slicing_kernel<<<static_cast<unsigned>((num_pairs + kWarps - 1) / kWarps), 32 * kWarps, 0,
                   stream_>>>(args_, batch.first_row * p.num_heads, num_pairs, args_.query_top,
                              args_.query_slices, flags);
  KVAUDIT_TRY(cuda_check(cudaGetLastError(), where, "slicing kernel launch"));
  int host_flags[2] = {0, 0};
  KVAUDIT_TRY(
      download_array(host_flags, flags, 2, stream_, where, "cudaMemcpy of the slice counts"));
  return host_flags[1] != 0 ? 0 : host_flags[0];
}

void GpuReference::launch_scores(int slices, const Tile* score_tiles) {
  const auto blocks = static_cast<unsigned>(score_tiles_.size());
  switch (slices) {
    case 1:
      return sliced_scores_kernel<1><<<blocks, kThreads, 0, stream_>>>(args_, score_tiles);
    case 2:
      return sliced_scores_kernel<2><<<blocks, kThreads, 0, stream_>>>(args_, score_tiles);
    case 3:
      return sliced_scores_kernel<3><<<blocks, kThreads, 0, stream_>>>(args_, score_tiles);
    case 4:
      return sliced_scores_kernel<4><<<blocks, kThreads, 0, stream_>>>(args_, score_tiles);
    default:
      return scores_kernel<<<blocks, kThreads, 0, stream_>>>(args_, score_tiles);
  }
}

// The weight slices of the batch's sliced values (3'), after the weights kernel counted them into
// args_.weight_flags: Kw, or 0 for kernel 3 (no value grid, or a query vector needing more than
// kMaxWeightSlices).
Result<int> GpuReference::weight_slices(const std::string& where) {
  if (args_.weight_flags == nullptr) return 0;
  int host_flags[2] = {0, 0};
  KVAUDIT_TRY(download_array(host_flags, args_.weight_flags, 2, stream_, where,
                             "cudaMemcpy of the weight slice counts"));
  return host_flags[1] != 0 ? 0 : std::max(host_flags[0], 1);
}

void GpuReference::launch_values(int slices, const Tile* value_tiles) {
  const auto blocks = static_cast<unsigned>(value_tiles_.size());
  switch (slices) {
    case 1:
      return sliced_values_kernel<1><<<blocks, kThreads, 0, stream_>>>(args_, value_tiles);
    case 2:
      return sliced_values_kernel<2><<<blocks, kThreads, 0, stream_>>>(args_, value_tiles);
    case 3:
      return sliced_values_kernel<3><<<blocks, kThreads, 0, stream_>>>(args_, value_tiles);
    case 4:
      return sliced_values_kernel<4><<<blocks, kThreads, 0, stream_>>>(args_, value_tiles);
    case 5:
      return sliced_values_kernel<5><<<blocks, kThreads, 0, stream_>>>(args_, value_tiles);
    default:
      return values_kernel<<<blocks, kThreads, 0, stream_>>>(args_, value_tiles);
  }
}

Status GpuReference::run_batch(const ReferenceProblem& p, const Batch& batch,
                               const std::string& where) {
  auto start = Clock::now();
  std::vector<int> segment_of_row(p.visible_of_row.size(), -1);
  for (int s = 0; s < static_cast<int>(batch.segments.size()); ++s) {
    const Segment& seg = batch.segments[s];
    for (int r = 0; r < seg.num_qv / p.num_heads; ++r) segment_of_row[seg.first_row + r] = s;
  }
  plan_tiles(p, batch, score_tiles_, value_tiles_);
  seconds_.prepare += elapsed_seconds_since(start);
  start = Clock::now();
  KVAUDIT_ASSIGN_OR_RETURN(Segment * segments,
                           arena_.get<Segment>(kSegments, batch.segments.size(), where));
  KVAUDIT_ASSIGN_OR_RETURN(Tile * score_tiles,
                           arena_.get<Tile>(kScoreTiles, score_tiles_.size(), where));
  KVAUDIT_ASSIGN_OR_RETURN(Tile * value_tiles,
                           arena_.get<Tile>(kValueTiles, value_tiles_.size(), where));
  KVAUDIT_ASSIGN_OR_RETURN(args_.s_hi, arena_.get<double>(kScoreHi, batch.score_elements, where));
  KVAUDIT_ASSIGN_OR_RETURN(args_.s_lo, arena_.get<double>(kScoreLo, batch.score_elements, where));
  KVAUDIT_TRY(
      upload(segment_of_row_, segment_of_row.data(), segment_of_row.size(), stream_, where));
  KVAUDIT_TRY(upload(segments, batch.segments.data(), batch.segments.size(), stream_, where));
  KVAUDIT_TRY(upload(score_tiles, score_tiles_.data(), score_tiles_.size(), stream_, where));
  KVAUDIT_TRY(upload(value_tiles, value_tiles_.data(), value_tiles_.size(), stream_, where));
  KVAUDIT_TRY(synchronize(where, "uploads"));
  args_.segments = segments;
  seconds_.upload += elapsed_seconds_since(start);

  start = Clock::now();
  const int pairs = (batch.end_row - batch.first_row) * p.num_heads;
  KVAUDIT_ASSIGN_OR_RETURN(const int slices, slice_queries(p, batch, where));
  if (!score_tiles_.empty()) launch_scores(slices, score_tiles);
  ++kernels_run_.score_batches[slices];
  args_.weight_flags = nullptr;
  if (args_.weight_bits > 0 && slicing_allowed()) {
    KVAUDIT_ASSIGN_OR_RETURN(args_.weight_flags, arena_.get<int>(kWeightFlags, 2, where));
    KVAUDIT_TRY(cuda_check(cudaMemsetAsync(args_.weight_flags, 0, 2 * sizeof(int), stream_), where,
                           "cudaMemset"));
  }
  if (pairs > 0) {
    weights_kernel<<<static_cast<unsigned>(pairs), kThreads, 0, stream_>>>(
        args_, batch.first_row * p.num_heads);
  }
  KVAUDIT_ASSIGN_OR_RETURN(const int weight_slice_count, weight_slices(where));
  if (!value_tiles_.empty()) launch_values(weight_slice_count, value_tiles);
  ++kernels_run_.value_batches[weight_slice_count];
  KVAUDIT_TRY(cuda_check(cudaGetLastError(), where, "kernel launch"));
  KVAUDIT_TRY(synchronize(where, "kernels"));
  seconds_.kernels += elapsed_seconds_since(start);
  return ok_status();
}

// out and lse into page-locked buffers, then copied out to the caller's arrays on p.threads
// threads.
Status GpuReference::download(const ReferenceProblem& p, const std::string& where) {
  const auto start = Clock::now();
  KVAUDIT_ASSIGN_OR_RETURN(double* out, pinned_.get<double>(kPinnedOut, p.out.size(), where));
  KVAUDIT_ASSIGN_OR_RETURN(double* lse, pinned_.get<double>(kPinnedLse, p.lse.size(), where));
  KVAUDIT_TRY(download_array(out, args_.out, p.out.size(), stream_, where, "cudaMemcpy of out"));
  KVAUDIT_TRY(download_array(lse, args_.lse, p.lse.size(), stream_, where, "cudaMemcpy of lse"));
  parallel_copy(out, p.out.size(), p.out.data(), p.threads);
  parallel_copy(lse, p.lse.size(), p.lse.data(), p.threads);
  seconds_.download += elapsed_seconds_since(start);
  return ok_status();
}

// One call: inputs up, the batches' kernels, results down; its split is added to the process's
// totals whether it succeeds or not.
Status GpuReference::run(const ReferenceProblem& p, const std::string& where) {
  if (p.num_rows() == 0 || p.num_heads == 0) return ok_status();
  seconds_ = DeviceSeconds{};
  seconds_.calls = 1;
  const Status status = [&]() -> Status {
    if (stream_ == nullptr) {
      KVAUDIT_TRY(cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), where,
                             "cudaStreamCreate"));
    }
    KVAUDIT_TRY(upload_inputs(p, where));
    auto start = Clock::now();
    const std::vector<Batch> batches = plan_batches(p, kv_offset_);
    seconds_.prepare += elapsed_seconds_since(start);
    for (const Batch& batch : batches) KVAUDIT_TRY(run_batch(p, batch, where));
    return download(p, where);
  }();
  // A failure may leave copies queued from page-locked buffers the next call reuses or frees.
  if (!status.ok() && stream_ != nullptr) cudaStreamSynchronize(stream_);
  add_gpu_reference_seconds(seconds_);
  return status;
}

}  // namespace

namespace {

// The process's GPU references: up to kMaxReferences, each with its own stream and buffers, kept
// between calls. A call takes an idle one; with two layers in flight, one call's host work
// (gathering and staging inputs, copying results out) and copies then overlap the other's
// kernels. A second reference is made only when a call finds the first busy, the first has
// finished a call, and the device has room for another of the largest size a finished call left
// (buffers only grow, so that is a fair guess); else the call waits for the first: a process that
// calls one at a time, or a small GPU, holds one reference, as before. The size is read when a
// call gives its reference back, never while another thread runs it. Never destroyed: freeing
// device memory from a static destructor races the CUDA runtime's own teardown at exit, and the
// process's end releases it anyway.
class GpuReferencePool {
 public:
  static constexpr std::size_t kMaxReferences = 2;

  GpuReference& acquire() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      if (!idle_.empty()) {
        GpuReference* reference = idle_.back();
        idle_.pop_back();
        return *reference;
      }
      if (all_.empty() || (all_.size() < kMaxReferences && room_for_another())) {
        all_.push_back(new GpuReference);
        return *all_.back();
      }
      released_.wait(lock);
    }
  }

  void release(GpuReference& reference) {
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      add(kernels_run_, reference.take_kernels_run());
      largest_device_bytes_ = std::max(largest_device_bytes_, reference.device_bytes());
      idle_.push_back(&reference);
    }
    released_.notify_one();
  }

  GpuReferenceKernels kernels_run() {
    const std::lock_guard<std::mutex> lock(mutex_);
    return kernels_run_;
  }

 private:
  // Twice the largest device buffers a finished call left free: room for another reference and
  // for what the backend under test may still allocate. None before a call has finished (the
  // first calls of a run arrive together, before any size is known).
  bool room_for_another() const {
    if (largest_device_bytes_ == 0) return false;
    std::size_t free_bytes = 0;
    std::size_t total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) return false;
    return free_bytes > 2 * largest_device_bytes_;
  }
  static void add(GpuReferenceKernels& into, const GpuReferenceKernels& part) {
    for (std::size_t i = 0; i < into.score_batches.size(); ++i)
      into.score_batches[i] += part.score_batches[i];
    for (std::size_t i = 0; i < into.value_batches.size(); ++i)
      into.value_batches[i] += part.value_batches[i];
  }

  std::mutex mutex_;
  std::condition_variable released_;
  std::vector<GpuReference*> all_;
  std::vector<GpuReference*> idle_;
  GpuReferenceKernels kernels_run_;
  std::size_t largest_device_bytes_ = 0;  // of any reference, read as a call gives it back
};

GpuReferencePool& gpu_references() {
  static GpuReferencePool* const pool = new GpuReferencePool;
  return *pool;
}

}  // namespace

Status mla_reference_attention_cuda(const ReferenceProblem& problem, const std::string& where) {
  // Given back however the call ends (an exception too), so that no later call waits forever.
  struct Lease {
    GpuReferencePool& pool;
    GpuReference& reference;
    ~Lease() { pool.release(reference); }
  };
  GpuReferencePool& pool = gpu_references();
  const Lease lease{pool, pool.acquire()};
  return lease.reference.run(problem, where);
}

GpuReferenceKernels gpu_reference_kernels() { return gpu_references().kernels_run(); }

}  // namespace kvaudit
