// Device code of the CUDA MLA attention family: the KV write rule, the whole-pool cast (the seed's
// bug, kept for cuda-cast-bf16), and paged MLA attention (decode and prefill/extend) reading the
// FP8 e4m3 pool directly. Only kernels/mla_attention.cu launches these.
//
// Math (kernels/mla_attention_model.hpp is the contract; the CPU model mirrors it):
//   per query row i, head h, over the visible tokens t of the row's request, (c_t, r_t) the pool
//   row decoded exactly to bf16 *without* kv_scale:
//     dot_t = q_nope[i,h,:] . c_t + q_pe[i,h,:] . r_t        (bf16 x bf16 -> fp32, tensor cores)
//     s_t   = dot_t * score_scale,  score_scale = fp32(sm_scale * kv_scale * log2 e)
//   online softmax in base 2 over tiles of kKvTileTokens = 64 token positions (tile k holds
//   positions 64k .. 64k + 63 of the request), P rounded to bf16 before P.V, fp32 accumulation,
//   out = bf16(acc * (kv_scale / l)),  lse = (m + log2 l) * ln 2.
//
// Shapes (H = num_heads, Dc = 512, Dr = 64, D = 576, S = slots):
//   q_nope : [num_rows, H, Dc] bf16     q_pe : [num_rows, H, Dr] bf16
//   pool   : [S, D] e4m3 codes (or bf16 bits)
//   out    : [num_rows, H, Dc] bf16     lse  : [num_rows, H] fp32
//   partial_out : [num_rows, num_splits, H, Dc] fp32 (acc / l), partial_lse : [.., H] fp32 (base 2)
//
// Work decomposition. One thread block handles one query row, a block of 16 * kMTiles heads (the
// MMA M dimension; heads past H are zero rows) and one split (a contiguous range of 64-token
// tiles) of that row's visible tokens. Every M row of a block sees the same tokens, so a token the
// row may not see is never loaded: its shared-memory row is zeroed, and its score is -inf. NaN
// codes in unused or masked slots therefore never enter an MMA (0 * NaN would leak them). A NaN
// code in a visible token is data: its score is NaN for every head, and out and lse become NaN,
// as in the reference (the merge keeps a split's NaN even when its weight underflows to 0).
// Per tile: the 64 FP8 rows (576 bytes each, 16-byte loads, coalesced per token, so page size 1
// costs no more than 64) are loaded into registers while the previous tile is computed, decoded
// once into a bf16 shared-memory tile, and that one tile serves both Q.K^T (576 columns) and P.V
// (its first 512 columns) through mma.sync.m16n8k16 bf16 -> fp32. Q.K^T sums its 576 columns in
// two halves (fp32, added at the end; with 32 heads per block, even / odd 16-column chains):
// another fp32 summation order, same bound.
//
// Where the GPU differs from the CPU model, and by how much (the tests' tolerances):
//   * tensor-core fp32 accumulation of the 576-term dot products and of P.V is not sequential fp32
//     addition: each differs by at most ~n * 2^-24 relative to the sum of |terms| (n = 576 or
//     64 per tile), far below the bf16 output rounding (2^-8 relative).
//   * exp2f is ex2.approx (<= 2 ulp): p_t differs by ~2^-22 relative before its bf16 rounding,
//     which can flip that rounding (a change of one bf16 ulp, 2^-8 relative, in rare p_t).
//   * split-KV: each split runs its own online softmax (its own running max), so P is rounded to
//     bf16 relative to a different max than the CPU's single pass; each p_t then carries its own
//     rounding of <= 2^-9 relative either way, and the exact merge of the partial (out, lse) adds
//     fp32 rounding only. The difference to the model is bounded by ~2^-8 * max|v| per output.
//   * the final bf16 rounding of out can then land on the neighbouring bf16 value (1 bf16 ulp).
//   * nvcc contracts l = l * alpha + tile_sum into one FMA (-fmad=true), where the model rounds
//     the product and the sum separately: ~2^-24 relative in l, inside the fp32 terms above.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/fp8_e4m3_device.cuh"
#include "kernels/mla_attention_model.hpp"
#include "kernels/ptx.cuh"
#include "src/backend/injection.hpp"
#include "src/core/fp8_e4m3.hpp"

namespace kvaudit::cuda::detail {

inline constexpr int kThreads = 256;  // 8 warps per block
inline constexpr int kWarps = kThreads / 32;
inline constexpr int kTile = mla::kKvTileTokens;  // 64
inline constexpr int kDc = mla::kKvLoraRank;      // 512
inline constexpr int kDr = mla::kQkRopeHeadDim;   // 64
inline constexpr int kD = mla::kRowWidth;         // 576
// bf16 rows in shared memory are padded by 16 bytes: 1168 bytes = 292 words, 292 mod 32 = 4, so
// the 8 rows one ldmatrix phase reads start in 8 different 4-bank groups (no bank conflicts).
inline constexpr int kSmemRow = kD + 8;  // bf16 elements per shared row
inline constexpr int kPRow = kTile + 8;  // bf16 elements per row of P (144 bytes)
// fp32 partial-score rows: 72 words, 72 mod 32 = 8, so the float2 stores of rows g..g+3 of a
// half-warp land in disjoint banks.
inline constexpr int kSRow = kTile + 8;
inline constexpr int kFp8RowVectors = kD / 16;       // 36 16-byte vectors per FP8 row
inline constexpr int kBf16RowVectors = kD * 2 / 16;  // 72 per bf16 row

struct MlaAttentionParams {
  using QElement = std::uint16_t;  // bf16 bits
  using OutElement = std::uint16_t;

  const std::int32_t* qo_indptr;
  const std::int32_t* kv_indptr;
  const std::int32_t* kv_indices;
  const std::int32_t* kv_last_page_len;
  int batch;
  int num_rows;
  int num_heads;
  int page_size;
  int num_splits;
  int head_blocks;
  int read_masked_tail;  // fault masked-nan-leak: load the last page's unused slots too
  float score_scale;     // fp32(sm_scale * kv_scale * log2 e)
  float kv_scale;
  const std::uint8_t* pool;
  const QElement* q_nope;
  const QElement* q_pe;
  OutElement* out;
  float* lse;
  float* partial_out;  // used when num_splits > 1
  float* partial_lse;
};

// kv_write_fp8_kernel / kv_write_bf16_kernel: a grid-stride loop over [num_rows, row_width].
template <typename PoolElementT>
struct KvWriteParams {
  using InElement = std::uint16_t;   // new_kv: bf16 bits
  using PoolElement = PoolElementT;  // e4m3 code (std::uint8_t) or bf16 bits (std::uint16_t)

  const InElement* new_kv;    // [num_rows, row_width]
  const std::int32_t* slots;  // [num_rows]
  int num_rows;
  int row_width;
  float kv_scale;
  PoolElement* pool;       // [num_slots, row_width]
  std::int64_t num_slots;  // kv_write_fp8_kernel<kRule, kWrapSlot = true> only
  int slot_offset;         // fault neighbour-slot-write: 1 writes slot (s + 1) mod num_slots
};

// cast_pool_kernel: every element of the pool.
struct CastPoolParams {
  using PoolElement = std::uint8_t;  // e4m3 code
  using OutElement = std::uint16_t;  // bf16 bits

  const PoolElement* pool;  // [num_elements]
  std::int64_t num_elements;
  OutElement* pool_bf16;  // [num_elements]
};

// Shared-memory carve-up of one block; the launcher sizes the dynamic allocation with it.
template <int kMTiles, bool kBf16Pool>
struct MlaSmemLayout {
  static constexpr int kRows = 16 * kMTiles;
  static constexpr int kWarpsPerMTile = kWarps / kMTiles;
  static constexpr int kQOffset = 0;
  static constexpr int kKvOffset = kQOffset + kRows * kSmemRow * 2;
  static constexpr int kPOffset = kKvOffset + kTile * kSmemRow * 2;
  static constexpr int kMaxOffset = kPOffset + kRows * kPRow * 2;
  static constexpr int kSumOffset = kMaxOffset + kRows * kWarpsPerMTile * 4;
  // Partial scores of the two k halves (one m16 tile, eight warps): [2][16][kSRow] fp32.
  static constexpr int kSPartOffset = kSumOffset + kRows * kWarpsPerMTile * 4;
  static constexpr int kSlotOffset = kSPartOffset + (kMTiles == 1 ? 2 * 16 * kSRow * 4 : 0);
  static constexpr int kBytes = kSlotOffset + 2 * kTile * 4;  // two tiles' slot tables
  // One block per SM: with one m16 tile the kernel holds Q fragments in registers (up to 255 per
  // thread); two blocks of ~106 KB fit the shared memory but measured no faster.
  static constexpr int kBlocksPerSm = 1;
  static_assert(kBytes <= 227 * 1024, "shared memory of one block exceeds the sm_90 limit");
};

// ---- KV write and pool cast -------------------------------------------------------------------

// The elementwise kernels read their inputs through __ldg (ld.global.nc): the inputs are read-only
// for the kernel's lifetime, which a params struct cannot state with __restrict__.

// One new_kv row as the shared write rules read it (kv_write_code, src/backend/injection.hpp):
// bf16 bits in device memory, widened exactly to fp32.
struct Bf16RowView {
  const std::uint16_t* bits;

  __device__ __forceinline__ float value(int col) const {
    return __uint_as_float(static_cast<std::uint32_t>(__ldg(bits + col)) << 16);
  }
  __device__ __forceinline__ std::uint16_t bf16_bits(int col) const { return __ldg(bits + col); }
};

// pool[slot_i, c] = kv_write_code<kRule>(new_kv[i, :], c), slot_i = slots[i], or with kWrapSlot
// (slots[i] + slot_offset) mod num_slots: the kvdump rule (kDivide, what launch_kv_write runs),
// the --reciprocal-scale option and the write faults, each case written once in
// src/backend/injection.hpp for this kernel and the CPU model.
template <KvWriteRule kRule, bool kWrapSlot>
__global__ void kv_write_fp8_kernel(const __grid_constant__ KvWriteParams<std::uint8_t> p) {
  const std::int64_t total = static_cast<std::int64_t>(p.num_rows) * p.row_width;
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t row = e / p.row_width;
    const int col = static_cast<int>(e - row * p.row_width);
    const Bf16RowView new_row{p.new_kv + row * p.row_width};
    const std::uint8_t code = kv_write_code<kRule, DeviceE4m3Rounding>(new_row, col, p.kv_scale);
    std::int64_t slot = __ldg(p.slots + row);
    if constexpr (kWrapSlot) slot = (slot + p.slot_offset) % p.num_slots;
    p.pool[slot * p.row_width + col] = code;
  }
}

// pool[slots[i], c] = new_kv[i, c]: a bf16 pool stores the bf16 bits unchanged.
__global__ void kv_write_bf16_kernel(const __grid_constant__ KvWriteParams<std::uint16_t> p) {
  const std::int64_t total = static_cast<std::int64_t>(p.num_rows) * p.row_width;
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t row = e / p.row_width;
    const int col = static_cast<int>(e - row * p.row_width);
    p.pool[static_cast<std::int64_t>(__ldg(p.slots + row)) * p.row_width + col] =
        __ldg(p.new_kv + e);
  }
}

// pool_bf16[e] = bf16(decode(pool[e])), every element of the pool (the whole-pool cast).
__global__ void cast_pool_kernel(const __grid_constant__ CastPoolParams p) {
  const std::int64_t vectors = p.num_elements / 4;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t v = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       v < vectors; v += stride) {
    const std::uint32_t codes = __ldg(reinterpret_cast<const std::uint32_t*>(p.pool) + v);
    const uint2 r = e4m3x4_to_bf16x4(codes);
    reinterpret_cast<uint2*>(p.pool_bf16)[v] = make_uint2(r.x, r.y);
  }
  for (std::int64_t e =
           vectors * 4 + blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       e < p.num_elements; e += stride) {
    p.pool_bf16[e] = static_cast<std::uint16_t>(e4m3x2_to_bf16x2(__ldg(p.pool + e)) & 0xFFFF);
  }
}

// ---- attention --------------------------------------------------------------------------------

struct RowRange {
  int request;
  std::int64_t kv_begin;  // first entry of the request in kv_indices
  int visible;            // tokens this row sees: positions 0 .. visible - 1
  int readable;           // tokens loaded: `visible`, or (fault) the request's whole pages
};

__device__ __forceinline__ RowRange locate_row(const MlaAttentionParams& p, int row) {
  // Request owning `row`: the last b with qo_indptr[b] <= row (requests without rows skipped).
  int lo = 0, hi = p.batch;  // answer in [lo, hi)
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (p.qo_indptr[mid] <= row) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  while (lo + 1 < p.batch && p.qo_indptr[lo + 1] <= row) ++lo;
  RowRange r;
  r.request = lo;
  r.kv_begin = p.kv_indptr[lo];
  const int pages = p.kv_indptr[lo + 1] - p.kv_indptr[lo];
  const int kv_len = pages == 0 ? 0 : (pages - 1) * p.page_size + p.kv_last_page_len[lo];
  const int rows_of_request = p.qo_indptr[lo + 1] - p.qo_indptr[lo];
  r.visible = kv_len - rows_of_request + (row - p.qo_indptr[lo]) + 1;
  r.readable = p.read_masked_tail ? pages * p.page_size : r.visible;
  return r;
}

__device__ __forceinline__ std::int32_t slot_of(const MlaAttentionParams& p, const RowRange& r,
                                                int position) {
  const std::int32_t page = p.kv_indices[r.kv_begin + position / p.page_size];
  return page * p.page_size + position % p.page_size;
}

// grid: num_rows * head_blocks * num_splits blocks (split fastest), kThreads threads.
template <int kMTiles, bool kBf16Pool>
__global__ void __launch_bounds__(kThreads, (MlaSmemLayout<kMTiles, kBf16Pool>::kBlocksPerSm))
    mla_attention_kernel(const __grid_constant__ MlaAttentionParams p) {
  using Layout = MlaSmemLayout<kMTiles, kBf16Pool>;
  constexpr int kRows = Layout::kRows;
  constexpr int kWn = Layout::kWarpsPerMTile;                  // warps sharing one m16 tile
  constexpr int kQkTiles = kTile / 8 / kWn;                    // n8 token tiles per warp in Q.K^T
  constexpr int kPvTiles = kDc / 8 / kWn;                      // n8 dim tiles per warp in P.V
  constexpr int kVectors = kTile * kFp8RowVectors / kThreads;  // 16-byte FP8 loads per thread
  static_assert(kTile * kFp8RowVectors % kThreads == 0, "FP8 tile split over the threads");
  static_assert(kQkTiles >= 1 && kPvTiles % 2 == 0, "warp tiling");

  extern __shared__ __align__(128) unsigned char smem[];
  std::uint16_t* q_s = reinterpret_cast<std::uint16_t*>(smem + Layout::kQOffset);
  std::uint16_t* kv_s = reinterpret_cast<std::uint16_t*>(smem + Layout::kKvOffset);
  std::uint16_t* p_s = reinterpret_cast<std::uint16_t*>(smem + Layout::kPOffset);
  float* max_s = reinterpret_cast<float*>(smem + Layout::kMaxOffset);
  float* sum_s = reinterpret_cast<float*>(smem + Layout::kSumOffset);
  std::int32_t* slot_s = reinterpret_cast<std::int32_t*>(smem + Layout::kSlotOffset);
  float* s_part_s = reinterpret_cast<float*>(smem + Layout::kSPartOffset);

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int mt = warp / kWn;  // this warp's m16 tile
  const int wn = warp % kWn;  // its part of the tokens (Q.K^T) and of the dims (P.V)
  const int group = lane / 4;
  const int quad = lane % 4;

  const int split = blockIdx.x % p.num_splits;
  const int head_block = (blockIdx.x / p.num_splits) % p.head_blocks;
  const int row = blockIdx.x / (p.num_splits * p.head_blocks);
  const int head0 = head_block * kRows;

  const RowRange range = locate_row(p, row);
  const int num_tiles = (range.visible + kTile - 1) / kTile;
  const int tiles_per_split = (num_tiles + p.num_splits - 1) / p.num_splits;
  const int tile_begin = split * tiles_per_split;
  const int tile_end = min(num_tiles, tile_begin + tiles_per_split);

  if (tile_begin >= tile_end) {  // an empty split (short row): it contributes nothing
    if (p.num_splits > 1) {
      for (int r = tid; r < kRows; r += kThreads) {
        const int head = head0 + r;
        if (head < p.num_heads) {
          p.partial_lse[(static_cast<std::int64_t>(row) * p.num_splits + split) * p.num_heads +
                        head] = -INFINITY;
        }
      }
    }
    return;
  }

  // Stage Q (bf16) for this block's heads: rows [q_nope (512) | q_pe (64)], zero past H.
  for (int v = tid; v < kRows * kBf16RowVectors; v += kThreads) {
    const int r = v / kBf16RowVectors;
    const int c = (v % kBf16RowVectors) * 8;  // element column
    const int head = head0 + r;
    uint4 value = make_uint4(0, 0, 0, 0);
    if (head < p.num_heads) {
      const std::int64_t qrow = static_cast<std::int64_t>(row) * p.num_heads + head;
      value = c < kDc ? *reinterpret_cast<const uint4*>(p.q_nope + qrow * kDc + c)
                      : *reinterpret_cast<const uint4*>(p.q_pe + qrow * kDr + (c - kDc));
    }
    *reinterpret_cast<uint4*>(q_s + r * kSmemRow + c) = value;
  }

  // Slot of token `token` of tile `tile`, or -1 past the row's visible range.
  auto tile_slot = [&](int tile, int token) -> std::int32_t {
    const int position = tile * kTile + token;
    return (tile < tile_end && position < range.readable) ? slot_of(p, range, position) : -1;
  };
  // FP8 path: each thread owns kVectors 16-byte pieces of a tile (vector v = tid + k * kThreads:
  // token v / 36, chunk v % 36, the same in every tile). Tile i + 1 is loaded into registers
  // (ld.global.nc, coalesced per 576-byte row) while tile i is computed; slot tables for the
  // next two tiles sit in shared memory (slot_s[tile % 2]), computed by threads 0..63.
  uint4 fetched[kVectors];
  auto load_tile = [&](int tile) {
    if (tile >= tile_end) return;
    const std::int32_t* slots = slot_s + (tile % 2) * kTile;
#pragma unroll
    for (int k = 0; k < kVectors; ++k) {
      const int v = tid + k * kThreads;
      const std::int32_t slot = slots[v / kFp8RowVectors];
      if (slot >= 0) {
        fetched[k] = __ldg(reinterpret_cast<const uint4*>(
            p.pool + static_cast<std::int64_t>(slot) * kD + (v % kFp8RowVectors) * 16));
      }
    }
  };
  if constexpr (!kBf16Pool) {
    if (tid < kTile) {
      slot_s[(tile_begin % 2) * kTile + tid] = tile_slot(tile_begin, tid);
      slot_s[((tile_begin + 1) % 2) * kTile + tid] = tile_slot(tile_begin + 1, tid);
    }
    __syncthreads();
    load_tile(tile_begin);
  }

  // Online-softmax state of this thread's two rows (group, group + 8 of tile mt); every warp of
  // the m16 tile holds the same values (same inputs, same order).
  float m_run[2] = {-INFINITY, -INFINITY};
  float l_run[2] = {0.f, 0.f};
  float acc[kPvTiles][4];
#pragma unroll
  for (int j = 0; j < kPvTiles; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

  const std::uint32_t q_base = ptx::smem_address(q_s);
  const std::uint32_t kv_base = ptx::smem_address(kv_s);
  const std::uint32_t p_base = ptx::smem_address(p_s);

  // One m16 tile over eight warps: warp (kh = wn / 4, tp = wn % 4) computes the scores of tokens
  // 16 tp .. 16 tp + 15 (two n8 tiles) over k steps 18 kh .. 18 kh + 17. Its Q fragments for those
  // k steps (72 registers) are loaded once per block, so Q costs no shared-memory traffic per
  // tile; the two k halves meet in shared memory (s_part_s).
  constexpr int kQkSteps = kD / 16 / 2;  // 18 k16 steps per half
  std::uint32_t q_frag[kWn == 8 ? kQkSteps : 1][4];
  if constexpr (kWn == 8) {
    __syncthreads();  // Q staged (the FP8 path synchronised already; the bf16 path has not)
    const int kh = wn / 4;
    const int a_row = mt * 16 + (lane % 8) + 8 * ((lane / 8) % 2);
    const std::uint32_t a_addr =
        q_base + (a_row * kSmemRow + 8 * (lane / 16)) * 2 + kh * kQkSteps * 32;
#pragma unroll
    for (int ks = 0; ks < kQkSteps; ++ks) ptx::ldmatrix_m8n8_x4(q_frag[ks], a_addr + ks * 32);
  }

  for (int tile = tile_begin; tile < tile_end; ++tile) {
    const int valid = min(kTile, range.visible - tile * kTile);  // tokens of this tile in range
    // Tokens whose rows are loaded: `valid` (the fault masked-nan-leak loads more, masked below).
    const int loaded = min(kTile, range.readable - tile * kTile);
    std::int32_t next_slot = -1;
    if constexpr (!kBf16Pool) {
      __syncthreads();  // everyone done with the previous tile's kv_s, p_s, sums; slots visible
      // Decode the fetched FP8 rows into the bf16 tile; rows past `valid` become zeros.
#pragma unroll
      for (int k = 0; k < kVectors; ++k) {
        const int v = tid + k * kThreads;
        const int token = v / kFp8RowVectors;
        const int chunk = v % kFp8RowVectors;
        uint4 lo = make_uint4(0, 0, 0, 0), hi = make_uint4(0, 0, 0, 0);
        if (token < loaded) {
          const uint4 codes = fetched[k];
          const uint2 a = e4m3x4_to_bf16x4(codes.x), b = e4m3x4_to_bf16x4(codes.y);
          const uint2 c = e4m3x4_to_bf16x4(codes.z), d = e4m3x4_to_bf16x4(codes.w);
          lo = make_uint4(a.x, a.y, b.x, b.y);
          hi = make_uint4(c.x, c.y, d.x, d.y);
        }
        uint4* dst = reinterpret_cast<uint4*>(kv_s + token * kSmemRow + chunk * 16);
        dst[0] = lo;
        dst[1] = hi;
      }
      load_tile(tile + 1);  // in flight while this tile is computed
      if (tid < kTile) next_slot = tile_slot(tile + 2, tid);
    } else {
      __syncthreads();  // everyone done with the previous tile
      for (int v = tid; v < kTile * kBf16RowVectors; v += kThreads) {
        const int token = v / kBf16RowVectors;
        const int chunk = v % kBf16RowVectors;
        uint4* dst = reinterpret_cast<uint4*>(kv_s + token * kSmemRow + chunk * 8);
        if (token < loaded) {
          const std::int32_t slot = slot_of(p, range, tile * kTile + token);
          ptx::cp_async_cg_16(ptx::smem_address(dst),
                              p.pool + (static_cast<std::int64_t>(slot) * kD) * 2 + chunk * 16);
        } else {
          *dst = make_uint4(0, 0, 0, 0);
        }
      }
      ptx::cp_async_commit_group();
      ptx::cp_async_wait_group<0>();
    }
    __syncthreads();  // bf16 tile ready

    // ---- S = Q K^T for rows of tile mt, tokens [wn * 8 * kQkTiles, +8 * kQkTiles) ----
    float s[kQkTiles][4], s2[kQkTiles][4];
#pragma unroll
    for (int j = 0; j < kQkTiles; ++j) {
      s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
      s2[j][0] = s2[j][1] = s2[j][2] = s2[j][3] = 0.f;
    }
    const int token0 = wn * 8 * kQkTiles;
    if constexpr (kWn == 8) {
      const int kh = wn / 4, tp = wn % 4;
      float part[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
      // B x4: matrices (n tile 0, k 0-7), (n tile 0, k 8-15), (n tile 1, k 0-7), (n tile 1, k
      // 8-15).
      const std::uint32_t b_addr =
          kv_base + ((16 * tp + lane % 8 + 8 * (lane / 16)) * kSmemRow + 8 * ((lane / 8) % 2)) * 2 +
          kh * kQkSteps * 32;
#pragma unroll
      for (int ks = 0; ks < kQkSteps; ++ks) {
        std::uint32_t b[4];
        ptx::ldmatrix_m8n8_x4(b, b_addr + ks * 32);
        ptx::mma_m16n8k16_bf16_f32(part[0], q_frag[ks], b[0], b[1]);
        ptx::mma_m16n8k16_bf16_f32(part[1], q_frag[ks], b[2], b[3]);
      }
      float* half = s_part_s + kh * 16 * kSRow;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int col = 16 * tp + 8 * j + 2 * quad;
        *reinterpret_cast<float2*>(half + group * kSRow + col) =
            make_float2(part[j][0], part[j][1]);
        *reinterpret_cast<float2*>(half + (group + 8) * kSRow + col) =
            make_float2(part[j][2], part[j][3]);
      }
      __syncthreads();
      // Warp wn holds tokens 8 wn .. 8 wn + 7: S = half 0 + half 1.
      const int col = token0 + 2 * quad;
      const float2 r0 = *reinterpret_cast<const float2*>(s_part_s + group * kSRow + col);
      const float2 r1 = *reinterpret_cast<const float2*>(s_part_s + (group + 8) * kSRow + col);
      const float2 t0 = *reinterpret_cast<const float2*>(s_part_s + (16 + group) * kSRow + col);
      const float2 t1 = *reinterpret_cast<const float2*>(s_part_s + (16 + group + 8) * kSRow + col);
      s[0][0] = r0.x + t0.x;
      s[0][1] = r0.y + t0.y;
      s[0][2] = r1.x + t1.x;
      s[0][3] = r1.y + t1.y;
    } else {
      // ldmatrix addresses: A (Q) x4 = rows 0-7/8-15 x k 0-7/8-15; B (K) x4 = two k16 steps of
      // one n8 tile: matrices (k 0-7), (k 8-15), (k 16-23), (k 24-31).
      const int a_row = mt * 16 + (lane % 8) + 8 * ((lane / 8) % 2);
      const std::uint32_t a_addr = q_base + (a_row * kSmemRow + 8 * (lane / 16)) * 2;
      const std::uint32_t b_addr = kv_base + ((token0 + lane % 8) * kSmemRow + 8 * (lane / 8)) * 2;
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
      // Two accumulator chains (even / odd 16-column steps) halve the MMA dependency chain.
#pragma unroll
      for (int j = 0; j < kQkTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] += s2[j][e];
      }
    }
    if constexpr (!kBf16Pool) {
      if (tid < kTile) slot_s[(tile % 2) * kTile + tid] = next_slot;  // tile + 2's table
    }
    // Scale, mask past `valid`, row max over this warp's tokens.
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < kQkTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int token = token0 + j * 8 + 2 * quad + (e % 2);
        s[j][e] = token < valid ? s[j][e] * p.score_scale : -INFINITY;
        tile_max[e / 2] = fmaxf(tile_max[e / 2], s[j][e]);
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 1));
      tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 2));
    }
    if (quad == 0) {
      max_s[(mt * 16 + group) * kWn + wn] = tile_max[0];
      max_s[(mt * 16 + group + 8) * kWn + wn] = tile_max[1];
    }
    __syncthreads();
    float m_new[2], m_use[2], alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float m = m_run[h];
      for (int w = 0; w < kWn; ++w) m = fmaxf(m, max_s[(mt * 16 + group + 8 * h) * kWn + w]);
      m_new[h] = m;
      m_use[h] = m == -INFINITY ? 0.f : m;  // a row whose scores are all -inf stays all zero
      alpha[h] = m_run[h] == -INFINITY ? 0.f : exp2f(m_run[h] - m_use[h]);
    }
    // P = exp2(s - m), rounded to bf16 for P.V; the row sums use the unrounded values.
    float part_sum[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < kQkTiles; ++j) {
      const float p0 = exp2f(s[j][0] - m_use[0]), p1 = exp2f(s[j][1] - m_use[0]);
      const float p2 = exp2f(s[j][2] - m_use[1]), p3 = exp2f(s[j][3] - m_use[1]);
      part_sum[0] += p0 + p1;
      part_sum[1] += p2 + p3;
      const int col = token0 + j * 8 + 2 * quad;
      *reinterpret_cast<std::uint32_t*>(p_s + (mt * 16 + group) * kPRow + col) =
          ptx::cvt_rn_bf16x2_f32(p0, p1);
      *reinterpret_cast<std::uint32_t*>(p_s + (mt * 16 + group + 8) * kPRow + col) =
          ptx::cvt_rn_bf16x2_f32(p2, p3);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      part_sum[h] += __shfl_xor_sync(0xffffffffu, part_sum[h], 1);
      part_sum[h] += __shfl_xor_sync(0xffffffffu, part_sum[h], 2);
    }
    if (quad == 0) {
      sum_s[(mt * 16 + group) * kWn + wn] = part_sum[0];
      sum_s[(mt * 16 + group + 8) * kWn + wn] = part_sum[1];
    }
    __syncthreads();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float tile_sum = 0.f;
      for (int w = 0; w < kWn; ++w) tile_sum += sum_s[(mt * 16 + group + 8 * h) * kWn + w];
      l_run[h] = l_run[h] * alpha[h] + tile_sum;
      m_run[h] = m_new[h];
    }
#pragma unroll
    for (int j = 0; j < kPvTiles; ++j) {
      acc[j][0] *= alpha[0];
      acc[j][1] *= alpha[0];
      acc[j][2] *= alpha[1];
      acc[j][3] *= alpha[1];
    }

    // ---- acc += P V for dims [wn * 8 * kPvTiles, +8 * kPvTiles) ----
    {
      const int dim0 = wn * 8 * kPvTiles;
      const int a_row = mt * 16 + (lane % 8) + 8 * ((lane / 8) % 2);
      const std::uint32_t a_addr = p_base + (a_row * kPRow + 8 * (lane / 16)) * 2;
      // V^T fragments via ldmatrix.trans: matrices (tokens 0-7, dims 0-7), (tokens 8-15, dims
      // 0-7), (tokens 0-7, dims 8-15), (tokens 8-15, dims 8-15) -> b0, b1 of two n8 tiles.
      const int v_token = (lane % 8) + 8 * ((lane / 8) % 2);
      const std::uint32_t v_addr = kv_base + (v_token * kSmemRow + dim0 + 8 * (lane / 16)) * 2;
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
  }

  // ---- epilogue ----
  const int dim0 = wn * 8 * kPvTiles;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int head = head0 + mt * 16 + group + 8 * h;
    if (head >= p.num_heads) continue;
    const std::int64_t out_row = static_cast<std::int64_t>(row) * p.num_heads + head;
    if (p.num_splits == 1) {
      const float factor = p.kv_scale / l_run[h];
      std::uint16_t* out = p.out + out_row * kDc + dim0 + 2 * quad;
#pragma unroll
      for (int j = 0; j < kPvTiles; ++j) {
        *reinterpret_cast<std::uint32_t*>(out + j * 8) =
            ptx::cvt_rn_bf16x2_f32(acc[j][2 * h] * factor, acc[j][2 * h + 1] * factor);
      }
      if (wn == 0 && quad == 0)
        p.lse[out_row] = (m_run[h] + log2f(l_run[h])) * 0.69314718055994531f;
    } else {
      const float inverse = 1.f / l_run[h];
      const std::int64_t part_row =
          (static_cast<std::int64_t>(row) * p.num_splits + split) * p.num_heads + head;
      float* out = p.partial_out + part_row * kDc + dim0 + 2 * quad;
#pragma unroll
      for (int j = 0; j < kPvTiles; ++j) {
        *reinterpret_cast<float2*>(out + j * 8) =
            make_float2(acc[j][2 * h] * inverse, acc[j][2 * h + 1] * inverse);
      }
      if (wn == 0 && quad == 0) p.partial_lse[part_row] = m_run[h] + log2f(l_run[h]);
    }
  }
}

// Exact merge of split-KV partials: with L = max_i lse_i (base 2), w_i = exp2(lse_i - L),
//   out = bf16(kv_scale * sum_i w_i out_i / sum_i w_i),  lse = (L + log2 sum_i w_i) * ln 2.
// Splits that saw no tokens carry lse = -inf and are skipped (their out_i is never read).
// grid: num_rows * num_heads blocks of kMergeThreads threads: 128 dim groups of 4 dims times
// kMergeGroups split groups (group g takes splits g, g + kMergeGroups, ...; the groups' sums are
// added in group order, so the result does not depend on timing). Dynamic shared memory holds
// the num_splits weights.
inline constexpr int kMergeGroups = 4;
inline constexpr int kMergeThreads = 128 * kMergeGroups;

__global__ void __launch_bounds__(kMergeThreads)
    mla_merge_kernel(const __grid_constant__ MlaAttentionParams p) {
  extern __shared__ float weight_s[];  // [num_splits]
  __shared__ float lse_max_s;
  __shared__ float4 sum_s[kMergeGroups][128];
  const std::int64_t row_head = blockIdx.x;
  const std::int64_t row = row_head / p.num_heads;
  const int head = static_cast<int>(row_head % p.num_heads);
  auto part_row = [&](int split) { return (row * p.num_splits + split) * p.num_heads + head; };
  for (int i = threadIdx.x; i < p.num_splits; i += blockDim.x) {
    weight_s[i] = p.partial_lse[part_row(i)];
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
    const float part_lse = weight_s[i];
    weight_s[i] = part_lse == -INFINITY ? -1.f : exp2f(part_lse - lse_max);  // -1: empty split
  }
  __syncthreads();
  const int group = threadIdx.x / 128;
  const int dim = (threadIdx.x % 128) * 4;
  float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
  for (int i = group; i < p.num_splits; i += kMergeGroups) {
    const float w = weight_s[i];
    // An empty split is skipped (its out_i was never written). A split whose weight underflowed to
    // 0 is still multiplied in, as the single-pass softmax multiplies by alpha = 0: a NaN it saw
    // (a visible NaN code) stays NaN, as in the CPU model and the reference.
    if (w < 0.f) continue;
    const float4 v = *reinterpret_cast<const float4*>(p.partial_out + part_row(i) * kDc + dim);
    sum.x += w * v.x;
    sum.y += w * v.y;
    sum.z += w * v.z;
    sum.w += w * v.w;
  }
  sum_s[group][threadIdx.x % 128] = sum;
  __syncthreads();
  if (group != 0) return;
  float weight_sum = 0.f;
  for (int i = 0; i < p.num_splits; ++i) {
    const float w = weight_s[i];
    if (!(w < 0.f)) weight_sum += w;  // a NaN weight (a split that saw a NaN score) stays NaN
  }
  for (int g = 1; g < kMergeGroups; ++g) {
    const float4 v = sum_s[g][threadIdx.x];
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
  if (threadIdx.x == 0) p.lse[row_head] = (lse_max + log2f(weight_sum)) * 0.69314718055994531f;
}

}  // namespace kvaudit::cuda::detail
