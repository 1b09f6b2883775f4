// Parameters and constants of the MLA attention family (one params struct per kernel), the
// compile-time fault variants, and where a query row's tokens are (row_range, shared with the
// launcher's host plan). Shapes (H = num_heads, Dc = kDc = 512, Dr = kDr = 64, D = kD = 576):
//   q_nope [num_rows, H, Dc], q_pe [num_rows, H, Dr] bf16; pool [S, D] e4m3 codes or bf16 bits;
//   out [num_rows, H, Dc] bf16, lse [num_rows, H] fp32; partial_out [num_rows, num_splits, H, Dc]
//   fp32 (acc / l), partial_lse [num_rows, num_splits, H] fp32 (base 2).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kernels/fp8_e4m3_device.cuh"
#include "kernels/mla_attention_model.hpp"
#include "kernels/ptx.cuh"
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
inline constexpr int kFp8RowPieces = kD / 16;        // 36 16-byte pieces per FP8 row
inline constexpr int kBf16RowVectors = kD * 2 / 16;  // 72 16-byte vectors per bf16 row
// 16-byte FP8 pieces per thread and tile (9): piece v = tid + k * kThreads of a tile.
inline constexpr int kFp8PiecesPerThread = kTile * kFp8RowPieces / kThreads;
static_assert(kTile * kFp8RowPieces % kThreads == 0, "FP8 tile split over the threads");
// One block of 8 warps per SM (up to 255 registers per thread: with one m16 tile the Q fragments
// stay in registers). Measured on the H200 and kept out: two blocks of ~106 KB per SM, 16 warps
// per block (128 registers, spills), a three-tile cp.async ring, decoding by bit placement instead
// of cvt and swizzled decode stores were each no faster or slower, and f16 operands scaled by
// powers of two (exact, a third fewer instructions) 1.3% faster at 16 heads but 7.5% slower at
// batch 1 (docs/kernel-experiments.md, rounds 1-3 and 7).
inline constexpr int kBlocksPerSm = 1;

// ---- where a query row's tokens are (kvdump-v1), on the device and in the launcher's host plan --

struct RowRange {
  int request;
  std::int64_t kv_begin;  // first entry of the request in kv_indices
  int visible;            // tokens this row sees: positions 0 .. visible - 1
  int readable;           // tokens loaded: `visible`, or (fault) the request's whole pages
};

// The request owning `row` is the last b with qo_indptr[b] <= row (requests without rows skipped).
// A request of P pages whose last page holds L tokens has kv_len = (P - 1) page_size + L tokens
// (0 without pages); its i-th of R rows sees positions 0 .. kv_len - R + i. One rule for the
// kernels (device arrays) and the launcher's host plan (host copies of the same arrays).
__host__ __device__ __forceinline__ RowRange row_range(const std::int32_t* qo_indptr,
                                                       const std::int32_t* kv_indptr,
                                                       const std::int32_t* kv_last_page_len,
                                                       int batch, int page_size,
                                                       bool read_masked_tail, int row) {
  int lo = 0, hi = batch;  // answer in [lo, hi)
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (qo_indptr[mid] <= row) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  while (lo + 1 < batch && qo_indptr[lo + 1] <= row) ++lo;
  RowRange r;
  r.request = lo;
  r.kv_begin = kv_indptr[lo];
  const int pages = kv_indptr[lo + 1] - kv_indptr[lo];
  const int kv_len = pages == 0 ? 0 : (pages - 1) * page_size + kv_last_page_len[lo];
  const int rows_of_request = qo_indptr[lo + 1] - qo_indptr[lo];
  r.visible = kv_len - rows_of_request + (row - qo_indptr[lo]) + 1;
  r.readable = read_masked_tail ? pages * page_size : r.visible;
  return r;
}

// Query rows the launcher may locate on the host and pass in the launch parameters (16 x 32
// bytes): a decode of up to 16 requests then starts its page-table lookup without first reading
// the request arrays, one cold memory round trip off a short row's latency (0.5-0.9 us at batch 1
// on the H200, docs/kernel-experiments.md, round 12).
inline constexpr int kMaxPlannedRows = 16;

struct PlannedRow {
  RowRange range;
  int request_row_end;  // qo_indptr[range.request + 1]: where the request's rows end
};

// ---- compile-time fault variants ---------------------------------------------------------------

// The attention kernels' fault injections (src/backend/injection.hpp) are template arguments: the
// production instantiations (kNone, kernels/mla_attention.cu) contain no fault code at all, the
// fault ones are instantiated in kernels/mla_attention_faults.cu only, and
// scripts/check_fault_free_kernels.py checks both objects' device code.
//   kMaskedNanLeak  load the rest of each request's last page too (slots no row may see) and mask
//                   those tokens by a zero weight, as a kernel that masks by multiplying would: NaN
//                   codes there reach the output (0 * NaN).
enum class AttentionFault { kNone, kMaskedNanLeak };
template <AttentionFault kFault>
inline constexpr bool kReadsMaskedTail = kFault == AttentionFault::kMaskedNanLeak;

// ---- parameters, one struct per kernel ---------------------------------------------------------

// mla_attention_kernel: one block per (query row, block of 16 * kMTiles heads, split).
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
  int rows_per_block;  // query rows sharing a block's KV tiles (consecutive rows of one request)
  int block_heads;     // heads per row in a block: M = rows_per_block * block_heads = 16 * kMTiles
  int mark_nan;        // rows_per_block > 1, not masked-nan-leak: NaN masks (finish_tile)
  int longest_first;   // prefill / extend: row groups in reverse order (locate_work)
  float score_scale;   // fp32(sm_scale * kv_scale * log2 e)
  float kv_scale;
  const std::uint8_t* pool;
  const QElement* q_nope;
  const QElement* q_pe;
  OutElement* out;
  float* lse;
  float* partial_out;  // used when num_splits > 1
  float* partial_lse;
  int planned_rows;  // rows 0 .. planned_rows - 1 are located by `planned`, the others in memory
  PlannedRow planned[kMaxPlannedRows];
};

// mla_merge_kernel: MergeShape::kDimChunks blocks per (query row, head), combining the num_splits
// partials.
struct MlaMergeParams {
  using OutElement = std::uint16_t;  // bf16 bits

  const float* partial_out;  // [num_rows, num_splits, H, Dc] fp32 (acc / l)
  const float* partial_lse;  // [num_rows, num_splits, H] fp32 (base 2; -inf: empty split)
  OutElement* out;           // [num_rows, H, Dc]
  float* lse;                // [num_rows, H] (natural log)
  int num_heads;
  int num_splits;
  float kv_scale;
};

// Row of the split-KV partials ([num_rows, num_splits, H], times Dc in partial_out) that holds
// query row `row`, split `split`, head `head`: the layout the attention kernels write and the merge
// reads, in one place.
__device__ __forceinline__ std::int64_t partial_row(std::int64_t row, int num_splits, int split,
                                                    int num_heads, int head) {
  return (row * num_splits + split) * num_heads + head;
}

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

}  // namespace kvaudit::cuda::detail
