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
// Work decomposition. One thread block handles M = 16 * kMTiles (query row, head) pairs: a group
// of rows_per_block consecutive query rows of one request (1 for decode; 4 or 2 for prefill and
// extend) times block_heads heads of each (heads past H are zero rows), and one split (a
// contiguous range of 64-token tiles) of the tokens the group's last row sees. Each KV tile is
// loaded and decoded once per block and serves all M rows; a row masks the tokens past its own
// causal length with -inf. Tokens no row of the block may see are never loaded: their shared-memory
// rows are zeroed. Prefill and extend grids take their row groups longest first (locate_work).
// With several rows per block, a NaN code is found when its tile is decoded (a per-tile mask of
// tokens): its bf16 row is zeroed, and a row that sees the token gets a NaN score for it, so out
// and lse become NaN as in the reference, while an earlier row of the same block (which does not
// see it) never multiplies a NaN by its zero weight (0 * NaN would leak it). With one row per
// block every loaded token is visible and a NaN code propagates by itself. The merge keeps a
// split's NaN even when its weight underflows to 0.
// Per tile: the 64 FP8 rows (576 bytes each) are fetched while the previous tile is computed
// (Fp8Staging), decoded exactly once into one bf16 tile in shared memory, and that one tile serves
// both Q.K^T (576 columns) and P.V (its first 512 columns) on the tensor cores, bf16 -> fp32:
// mma.sync.m16n8k16 (one and two m16 tiles; four where sm_90a code is missing or
// KVAUDIT_CUDA_MMA=mma-sync), or, for four m16 tiles on sm_90a, wgmma (MmaPath): warpgroup g
// computes S over columns 288 g .. + 287 for all 64 tokens (m64n64k16, 18 k steps), keeps tokens
// 32 g .. + 31 with the other group's half added through shared memory, and P.V for dims
// 256 g .. + 255 (m64n256k16), Q, the tile and P in wgmma's 128-byte swizzled layout
// (Swizzled128Tiles). mma.sync's Q.K^T sums its 576 columns in two halves (fp32, added at the end;
// with two or more m16 tiles, even / odd 16-column chains), wgmma's each 288-column half in the
// tensor core's own order, then the two halves in fp32: other fp32 summation orders, same bound;
// every rounding point (P to bf16, the epilogue) is the same.
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
//
// The attention kernel body reads as the algorithm; each step is a __device__ __forceinline__
// phase below (inlined: the phases are names, not calls):
//   locate_work / locate_pass  which rows, heads and tiles this block owns (a pass per request)
//   start_fp8_fetch       slot tables of the first two tiles, the first tile fetched
//   OneRowQ / stage_q     Q [M, 576] bf16 into shared memory (one-row blocks: loaded first)
//   load_q_fragments      (one m16 tile) Q's A fragments into registers, once per pass
//   per 64-token tile:
//     stage_fp8_tile      decode the fetched tile into the bf16 tile (NaN mask), fetch the next
//     stage_bf16_tile     (bf16 pool) the bf16 rows into the tile (NaN mask)
//     finish_tile         next slot table, zero rows of NaN codes
//     qk_scores_*         S = Q K^T (mma.sync: two variants of the warp tiling; wgmma)
//     online_softmax_update  scale, mask, block row max, P = exp2(s - m) in bf16, l, rescale acc
//     pv_mma / issue_pv_wgmma  acc += P V (V = the tile's first 512 columns); on wgmma the next
//                         tile's rope pieces are decoded meanwhile
//   write_attention_output  out and lse, or the split's partial (out, lse)
// and the merge: mla_merge_kernel (few splits: load_split_weights, sum_split_group) or
// mla_merge_window_kernel (many: load_split_window, reduce_split_totals, sum_split_window), then
// write_merged_row.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kernels/fp8_e4m3_device.cuh"
#include "kernels/kv_write_rules.hpp"
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
// batch 1 (reports/bench-h200.md, reports/h200-kernels-limit/experiments/7-scaled-f16.patch).
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
// on the H200, reports/h200-kernels-limit/experiments/12-host-plan.txt).
inline constexpr int kMaxPlannedRows = 16;

struct PlannedRow {
  RowRange range;
  int request_row_end;  // qo_indptr[range.request + 1]: where the request's rows end
};

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
  int read_masked_tail;  // fault masked-nan-leak: load the last page's unused slots too
  int mark_nan;          // rows_per_block > 1, not masked-nan-leak: NaN masks (finish_tile)
  int longest_first;     // prefill / extend: row groups in reverse order (locate_work)
  float score_scale;     // fp32(sm_scale * kv_scale * log2 e)
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

// Warp tiling of mla_attention_kernel for kMTiles m16 tiles (M = 16 * kMTiles rows).
//   kWn       warps sharing one m16 tile (8, 4, 2); warp wn owns tokens 8 kQkTiles wn .. of a tile
//             in the softmax and dims 8 kPvTiles wn .. in P.V
//   kKSplit   (one m16 tile) Q.K^T splits the 576 columns in two halves of kQkSteps k16 steps,
//             each warp on 16 tokens of one half
template <int kMTiles>
struct AttentionWarpTiling {
  static constexpr int kWn = kWarps / kMTiles;
  static constexpr int kQkTiles = kTile / 8 / kWn;
  static constexpr int kPvTiles = kDc / 8 / kWn;
  static constexpr int kKSplit = 2;
  static constexpr int kQkSteps = kD / 16 / kKSplit;
  static_assert(kQkTiles >= 1 && kPvTiles % 2 == 0, "warp tiling");
};

// How FP8 tiles reach a block. Each thread owns kFp8PiecesPerThread 16-byte pieces of every tile
// (piece v = tid + k * kThreads: token v / 36, bytes 16 (v % 36) .. + 15, coalesced per 576-byte
// row, so page size 1 costs no more than 64) and fetches the next tile's pieces while the current
// tile is computed:
//   kRegisters  into 36 registers (ld.global.nc): no shared-memory round trip. One and two m16
//               tiles of heads.
//   kBuffer     by cp.async into a 36,864-byte shared-memory buffer: the four-m16-tile kernel has
//               no registers to spare (its P.V accumulators take 128).
// One tile in flight is enough: a ring of three buffers measured no faster on the H200 (the kernel
// is bound by its shared-memory traffic and instruction latency, not by bytes in flight;
// docs/kernels.md).
enum class Fp8Staging { kRegisters, kBuffer };
template <int kMTiles>
inline constexpr Fp8Staging kFp8StagingOf =
    kMTiles == 4 ? Fp8Staging::kBuffer : Fp8Staging::kRegisters;
inline constexpr int kFp8TileBytes = kTile * kD;

// Which tensor-core instructions a four-m16-tile block runs: mma.sync with ldmatrix operands
// (every target), or wgmma reading both operands from shared memory (sm_90a; the launcher runs
// wgmma_probe_kernel once to learn whether the device got that code, four_tile_mma_path in
// kernels/mla_attention.cu). The math, its roundings and the tile order are the same; the order of
// the fp32 additions inside a 576-term dot product or a 64-term P.V sum is the tensor core's either
// way.
enum class MmaPath { kMmaSync, kWgmma };

// Extra dynamic shared memory a block asks for so that it can start its tiles 1024-byte aligned
// (wgmma's swizzle atoms); the mma.sync layouts need 128.
template <MmaPath kPath>
inline constexpr int kSmemAlignSlack = kPath == MmaPath::kWgmma ? 1024 : 0;

// Shared-memory carve-up of one attention block; the launcher sizes the dynamic allocation with
// it (kBytes + kSmemAlignSlack<kPath>). Q, the KV tile and P take padded rows for mma.sync
// (PaddedTiles below) and dense 128-byte-swizzled rows at 1024-byte aligned offsets for wgmma
// (Swizzled128Tiles: the swizzle is a function of the address).
template <int kMTiles, bool kBf16Pool, MmaPath kPath = MmaPath::kMmaSync>
struct MlaSmemLayout {
  static constexpr bool kWgmma = kPath == MmaPath::kWgmma;
  static constexpr int kRows = 16 * kMTiles;
  static constexpr int kWn = AttentionWarpTiling<kMTiles>::kWn;
  static constexpr int kKSplit = AttentionWarpTiling<kMTiles>::kKSplit;
  static constexpr bool kFp8Buffer = !kBf16Pool && kFp8StagingOf<kMTiles> == Fp8Staging::kBuffer;
  static constexpr int kRowBytes = (kWgmma ? kD : kSmemRow) * 2;  // Q and KV rows
  static constexpr int kPRowBytes = (kWgmma ? kTile : kPRow) * 2;
  static constexpr int kQOffset = 0;
  static constexpr int kKvOffset = kQOffset + kRows * kRowBytes;
  static constexpr int kPOffset = kKvOffset + kTile * kRowBytes;
  static constexpr int kMaxOffset = kPOffset + kRows * kPRowBytes;
  static constexpr int kSumOffset = kMaxOffset + kRows * kWn * 4;
  // Partial scores of the k parts (one m16 tile): [kKSplit][16][kSRow] fp32.
  static constexpr int kSPartOffset = kSumOffset + kRows * kWn * 4;
  static constexpr int kSlotOffset = kSPartOffset + (kMTiles == 1 ? kKSplit * 16 * kSRow * 4 : 0);
  // Slot tables of two tiles, NaN-code masks of two tiles (64 bits each), the FP8 buffer.
  static constexpr int kNanOffset = kSlotOffset + 2 * kTile * 4;
  static constexpr int kBufferOffset = kNanOffset + 2 * 8;
  // wgmma: the two warpgroups' partial scores of each other's tokens (qk_scores_wgmma).
  static constexpr int kSExchangeOffset = kBufferOffset + (kFp8Buffer ? kFp8TileBytes : 0);
  static constexpr int kBytes = kSExchangeOffset + (kWgmma ? 2 * 4 * 128 * 16 : 0);
  static_assert(!kWgmma || (kMTiles == 4 && kKvOffset % 1024 == 0 && kPOffset % 1024 == 0),
                "wgmma blocks: 64 rows, swizzle atoms 1024-aligned");
  static_assert(kBufferOffset % 16 == 0, "cp.async destinations are 16-byte aligned");
  static_assert(kBytes + kSmemAlignSlack<kPath> <= 227 * 1024,
                "shared memory of one block exceeds the sm_90 limit");
};

// Where the bf16 tiles live in shared memory, as byte offsets of 16-byte chunks (8 bf16):
//   PaddedTiles      rows of kSmemRow (Q, KV) or kPRow (P) elements: the 16-byte pad puts the 8
//                    rows one ldmatrix phase reads in 8 different bank groups.
//   Swizzled128Tiles wgmma's canonical 128-byte swizzle (kernels/ptx.cuh): a [rows, 576] tile is
//                    9 column blocks of [rows, 64] (128-byte rows, 8-row atoms of 1024 bytes),
//                    chunk c of row r at chunk c ^ (r % 8) of its block's row; P [64, 64] is one
//                    such block. Written by generic stores, read by wgmma through the async proxy,
//                    so each writer fences (kAsyncProxy) before the barrier that publishes them.
//
// Each also says which 16-byte FP8 piece of a tile (token, piece column 0..35) is thread tid's k-th
// (k < kFp8PiecesPerThread = 9), and stores its decoded chunks:
//   PaddedTiles      piece v = tid + 256 k in row order (v / 36, v % 36).
//   Swizzled128Tiles warp w, lane l: k < 8 piece l of token 8 w + k (a warp loads 512 contiguous
//                    bytes of a row), k = 8 piece 32 + l % 4 of token 8 w + l / 4. Lane l then
//                    always decodes the same columns, so the chunk offsets are per-lane constants
//                    and the unrolled k (the row-order map made ptxas keep 18 of them and spill),
//                    and lanes of odd 64-column blocks store a piece's high chunk first, so that
//                    one store instruction covers all eight 16-byte bank groups of a row.
struct PaddedTiles {
  static constexpr bool kAsyncProxy = false;
  template <int kRows>
  __device__ static constexpr int chunk(int row, int chunk) {
    return row * kSmemRow * 2 + chunk * 16;
  }
  __device__ static constexpr int p_element(int row, int col) { return (row * kPRow + col) * 2; }
  __device__ static int piece_token(int tid, int k) { return (tid + k * kThreads) / kFp8RowPieces; }
  __device__ static int piece_column(int tid, int k) {
    return (tid + k * kThreads) % kFp8RowPieces;
  }
  __device__ static void store_piece(unsigned char* kv_bytes, int tid, int k, uint4 lo, uint4 hi) {
    const int token = piece_token(tid, k), chunk = 2 * piece_column(tid, k);
    *reinterpret_cast<uint4*>(kv_bytes + PaddedTiles::chunk<kTile>(token, chunk)) = lo;
    *reinterpret_cast<uint4*>(kv_bytes + PaddedTiles::chunk<kTile>(token, chunk + 1)) = hi;
  }
};

struct Swizzled128Tiles {
  static constexpr bool kAsyncProxy = true;
  static constexpr int kRowBytes = 128;
  template <int kRows>
  __device__ static constexpr int chunk(int row, int chunk) {
    return (chunk / 8) * kRows * kRowBytes + row * kRowBytes + ((chunk % 8) ^ (row % 8)) * 16;
  }
  __device__ static constexpr int p_element(int row, int col) {
    return row * kRowBytes + (((col / 8) ^ (row % 8)) * 16) + (col % 8) * 2;
  }
  static constexpr int kRowTokens = kTile / kWarps;  // 8 tokens per warp
  static_assert(kFp8PiecesPerThread == kRowTokens + 1, "8 full-row pieces + 1 tail piece");
  __device__ static int piece_token(int tid, int k) {
    const unsigned warp = static_cast<unsigned>(tid) / 32, lane = static_cast<unsigned>(tid) % 32;
    return static_cast<int>(kRowTokens * warp + (k < kRowTokens ? k : lane / 4));
  }
  __device__ static int piece_column(int tid, int k) {
    const unsigned lane = static_cast<unsigned>(tid) % 32;
    return static_cast<int>(k < kRowTokens ? lane : 32 + lane % 4);
  }
  __device__ static void store_piece(unsigned char* kv_bytes, int tid, int k, uint4 lo, uint4 hi) {
    const unsigned warp = static_cast<unsigned>(tid) / 32, lane = static_cast<unsigned>(tid) % 32;
    const bool tail = k >= kRowTokens;
    const unsigned token = kRowTokens * warp + (tail ? lane / 4 : static_cast<unsigned>(k));
    const unsigned chunk = tail ? 64 + 2 * (lane % 4) : 2 * lane;
    const unsigned phase = tail ? lane / 4 : static_cast<unsigned>(k) % 8;  // token % 8
    unsigned char* row = kv_bytes + (chunk / 8) * kTile * kRowBytes + token * kRowBytes;
    unsigned lo_at = ((chunk % 8) ^ phase) * 16, hi_at = (((chunk + 1) % 8) ^ phase) * 16;
    if (!tail && (chunk / 8) % 2 == 1) {  // high chunk first: swap the values and their places
      const uint4 value = lo;
      lo = hi;
      hi = value;
      const unsigned at = lo_at;
      lo_at = hi_at;
      hi_at = at;
    }
    *reinterpret_cast<uint4*>(row + lo_at) = lo;
    *reinterpret_cast<uint4*>(row + hi_at) = hi;
  }
};

template <MmaPath kPath>
using TileAddressing = std::conditional_t<kPath == MmaPath::kWgmma, Swizzled128Tiles, PaddedTiles>;

// A thread's last FP8 piece of a tile: in Swizzled128Tiles, 16 of a token's 64 rope codes, which
// land in the bf16 tile's last 64-column block (columns 512..575). Q.K^T reads that block, P.V does
// not, so the wgmma blocks decode the next tile's rope pieces into it while P.V runs.
inline constexpr int kTailPiece = kFp8PiecesPerThread - 1;

// Makes this thread's shared-memory tile writes visible to wgmma (before the publishing barrier).
template <typename Addr>
__device__ __forceinline__ void publish_tile_writes() {
  if constexpr (Addr::kAsyncProxy) ptx::fence_proxy_async_shared();
}

// ---- KV write and pool cast -------------------------------------------------------------------

// The elementwise kernels read their inputs through __ldg (ld.global.nc): the inputs are read-only
// for the kernel's lifetime, which a params struct cannot state with __restrict__.

// One new_kv row as the shared write rules read it (kv_write_code, kernels/kv_write_rules.hpp):
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
// kernels/kv_write_rules.hpp for this kernel and the CPU model.
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

// ---- attention: where a block works ------------------------------------------------------------

// The row's request and tokens: from the host plan's launch parameters where the launcher made
// one (p.planned_rows), else from the request arrays in memory (one dependent round trip).
__device__ __forceinline__ RowRange locate_row(const MlaAttentionParams& p, int row) {
  if (row < p.planned_rows) return p.planned[row].range;
  return row_range(p.qo_indptr, p.kv_indptr, p.kv_last_page_len, p.batch, p.page_size,
                   p.read_masked_tail != 0, row);
}

__device__ __forceinline__ std::int32_t slot_of(const MlaAttentionParams& p, const RowRange& r,
                                                int position) {
  const std::int32_t page = p.kv_indices[r.kv_begin + position / p.page_size];
  return page * p.page_size + position % p.page_size;
}

// The rows and heads of one block: the group of rows_per_block consecutive query rows
// [row_begin, row_end), heads head0 .. head0 + block_heads - 1 of each, and one split.
struct BlockWork {
  int split;
  int head0;
  int row_begin;
  int row_end;
};

// grid: row_groups * head_blocks * num_splits blocks, split fastest. With longest_first (prefill
// and extend) the row groups go in reverse: a request's causal rows see more tokens the later
// they are, and the GPU starts blocks in index order, so the longest blocks start first and the
// shortest fill the last wave (longest-processing-time-first scheduling) instead of the longest
// running alone at the end (across the requests of a batch the order is simply reversed, which
// sorts no lengths). Which block computes what changes, not what it computes.
__device__ __forceinline__ BlockWork locate_work(const MlaAttentionParams& p) {
  BlockWork w;
  w.split = blockIdx.x % p.num_splits;
  const int head_block = (blockIdx.x / p.num_splits) % p.head_blocks;
  const int group_index = blockIdx.x / (p.num_splits * p.head_blocks);
  const int row_groups = (p.num_rows + p.rows_per_block - 1) / p.rows_per_block;
  const int group = p.longest_first ? row_groups - 1 - group_index : group_index;
  w.head0 = head_block * p.block_heads;
  w.row_begin = group * p.rows_per_block;
  w.row_end = min(p.num_rows, w.row_begin + p.rows_per_block);
  return w;
}

// One pass of a block: the rows of its group that belong to one request (a group that spans
// requests takes one pass per request). Row first_row + r sees first_visible + r tokens (causal
// rows of one request are consecutive positions); the tiles loaded are those of the last row,
// [tile_begin, tile_end) of its split. M row m of the block is row first_row + m / block_heads,
// head head0 + m % block_heads.
struct AttentionPass {
  int first_row;
  int row_count;
  int first_visible;
  RowRange range;  // of the pass's last row: the tokens loaded
  int tile_begin;
  int tile_end;
};

__device__ __forceinline__ AttentionPass locate_pass(const MlaAttentionParams& p,
                                                     const BlockWork& w, int first_row) {
  AttentionPass pass;
  pass.first_row = first_row;
  const RowRange first = locate_row(p, first_row);
  const int request_row_end = first_row < p.planned_rows ? p.planned[first_row].request_row_end
                                                         : p.qo_indptr[first.request + 1];
  pass.row_count = min(w.row_end, request_row_end) - first_row;
  pass.first_visible = first.visible;
  pass.range = first;
  pass.range.visible = first.visible + pass.row_count - 1;
  if (!p.read_masked_tail) pass.range.readable = pass.range.visible;
  const int num_tiles = (pass.range.visible + kTile - 1) / kTile;
  const int tiles_per_split = (num_tiles + p.num_splits - 1) / p.num_splits;
  pass.tile_begin = w.split * tiles_per_split;
  pass.tile_end = min(num_tiles, pass.tile_begin + tiles_per_split);
  return pass;
}

// The (query row, head) of M row m, and whether it is one of the pass's rows and heads.
struct MRow {
  int row;
  int head;
  bool active;
};

__device__ __forceinline__ MRow m_row(const MlaAttentionParams& p, const BlockWork& w,
                                      const AttentionPass& pass, int m) {
  const int r = m / p.block_heads;
  MRow out;
  out.row = pass.first_row + r;
  out.head = w.head0 + m % p.block_heads;
  out.active = r < pass.row_count && out.head < p.num_heads;
  return out;
}

// Tokens of the pass that M rows of m16 tile mt see (block_heads is a multiple of 16, so one m16
// tile holds heads of one row); 0 for a tile past the pass's rows.
__device__ __forceinline__ int m_tile_visible(const MlaAttentionParams& p,
                                              const AttentionPass& pass, int mt) {
  const int r = (mt * 16) / p.block_heads;
  return r < pass.row_count ? pass.first_visible + r : 0;
}

// This thread's place in the tiling: warp (mt, wn) works on m16 tile mt and on slice wn of the
// tokens (Q.K^T) and of the dims (P.V); in an mma fragment it holds rows group and group + 8,
// columns 2 quad and 2 quad + 1 (kernels/ptx.cuh).
struct ThreadRole {
  int tid;
  int lane;
  int mt;  // this warp's m16 tile
  int wn;  // its part of the tokens (Q.K^T) and of the dims (P.V)
  int group;
  int quad;
};

// mma.sync: the kWn warps of an m16 tile are consecutive. wgmma: warp w of warpgroup g holds rows
// 16 w .. 16 w + 15 of the group's m64 result (kernels/ptx.cuh), so mt = w and wn = g.
template <int kWn, MmaPath kPath = MmaPath::kMmaSync>
__device__ __forceinline__ ThreadRole thread_role() {
  ThreadRole t;
  t.tid = threadIdx.x;
  const int warp = t.tid / 32;
  t.lane = t.tid % 32;
  constexpr bool kWarpgroups = kPath == MmaPath::kWgmma;
  t.mt = kWarpgroups ? warp % 4 : warp / kWn;
  t.wn = kWarpgroups ? warp / 4 : warp % kWn;
  t.group = t.lane / 4;
  t.quad = t.lane % 4;
  return t;
}

// The block's shared memory (MlaSmemLayout), with the 32-bit addresses ldmatrix takes:
//   q      : [kRows, kSmemRow] bf16   Q rows [q_nope (512) | q_pe (64)], zero past H
//   kv     : [kTile, kSmemRow] bf16   the decoded KV tile: K for Q.K^T, its first 512 columns V
//   p      : [kRows, kPRow] bf16      P of the tile
//   max    : [kRows, kWn] fp32        each warp's row max of the tile's scores
//   sum    : [kRows, kWn] fp32        each warp's row sum of the tile's p
//   s_part : [2, 16, kSRow] fp32      (one m16 tile) partial scores of the two k halves
//   slot   : [2, kTile] int32         (FP8 pool) slot tables of the next two tiles
//   nan    : [2, 2] u32               tokens of a tile holding a NaN code (two tiles)
//   buffer : [kTile, kD] u8           (FP8 pool, kBuffer staging) the next tile's codes
struct AttentionSmem {
  std::uint16_t* q;
  std::uint16_t* kv;
  std::uint16_t* p;
  float* max;
  float* sum;
  std::int32_t* slot;
  float* s_part;
  std::uint32_t* nan;
  unsigned char* buffer;
  float4* s_exchange;
  // 32-bit shared addresses of q, kv and p (ldmatrix operands), set by set_tile_addresses.
  std::uint32_t q_address;
  std::uint32_t kv_address;
  std::uint32_t p_address;

  __device__ __forceinline__ void set_tile_addresses() {
    q_address = ptx::smem_address(q);
    kv_address = ptx::smem_address(kv);
    p_address = ptx::smem_address(p);
  }
};

template <typename Layout>
__device__ __forceinline__ AttentionSmem carve_attention_smem(unsigned char* smem) {
  AttentionSmem s;
  s.q = reinterpret_cast<std::uint16_t*>(smem + Layout::kQOffset);
  s.kv = reinterpret_cast<std::uint16_t*>(smem + Layout::kKvOffset);
  s.p = reinterpret_cast<std::uint16_t*>(smem + Layout::kPOffset);
  s.max = reinterpret_cast<float*>(smem + Layout::kMaxOffset);
  s.sum = reinterpret_cast<float*>(smem + Layout::kSumOffset);
  s.slot = reinterpret_cast<std::int32_t*>(smem + Layout::kSlotOffset);
  s.s_part = reinterpret_cast<float*>(smem + Layout::kSPartOffset);
  s.nan = reinterpret_cast<std::uint32_t*>(smem + Layout::kNanOffset);
  s.buffer = smem + Layout::kBufferOffset;
  s.s_exchange = reinterpret_cast<float4*>(smem + Layout::kSExchangeOffset);
  return s;
}

// An empty split (a pass's last row shorter than the split's first tile) contributes nothing:
// its partial lse is -inf, which the merge skips.
template <int kRows>
__device__ __forceinline__ void write_empty_split(const MlaAttentionParams& p, const BlockWork& w,
                                                  const AttentionPass& pass, int tid) {
  if (p.num_splits > 1) {
    for (int m = tid; m < kRows; m += kThreads) {
      const MRow r = m_row(p, w, pass, m);
      if (r.active) {
        p.partial_lse[partial_row(r.row, p.num_splits, w.split, p.num_heads, r.head)] = -INFINITY;
      }
    }
  }
}

// ---- attention: staging Q and KV tiles ---------------------------------------------------------

// Q (bf16) for the pass's M rows: [q_nope (512) | q_pe (64)], zero for rows and heads outside it,
// as 16-byte vectors (vector v: M row v / 72, columns 8 (v % 72) .. + 7).
//
// A one-row block (decode; the launcher gives it block_heads = kRows heads of one query row, so M
// row m is head head0 + m) holds its Q in registers: this thread's vectors v = tid + k * kThreads
// are all loaded before any is stored, and before the block locates its request, so that Q costs
// one memory latency, hidden behind the indptr -> page table -> KV chain. Staged one vector after
// another after that chain, as before, Q took 2.7 us of a one-tile block's 8 on the H200 (clock64
// stamps: five dependent latencies at 16 heads).
template <int kRows>
struct OneRowQ {
  static constexpr int kVectors = kRows * kBf16RowVectors;
  static constexpr int kPerThread = (kVectors + kThreads - 1) / kThreads;  // 5, 9 (16, 32 rows)
  uint4 v[kPerThread];

  __device__ __forceinline__ void load(const MlaAttentionParams& p, const BlockWork& w, int tid) {
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      const int vector = tid + k * kThreads;
      const int head = w.head0 + vector / kBf16RowVectors;
      const int c = (vector % kBf16RowVectors) * 8;  // element column
      v[k] = make_uint4(0, 0, 0, 0);
      if (vector < kVectors && head < p.num_heads) {
        const std::int64_t qrow = static_cast<std::int64_t>(w.row_begin) * p.num_heads + head;
        v[k] = c < kDc ? __ldg(reinterpret_cast<const uint4*>(p.q_nope + qrow * kDc + c))
                       : __ldg(reinterpret_cast<const uint4*>(p.q_pe + qrow * kDr + (c - kDc)));
      }
    }
  }

  __device__ __forceinline__ void store(std::uint16_t* q_s, int tid) const {
#pragma unroll
    for (int k = 0; k < kPerThread; ++k) {
      const int vector = tid + k * kThreads;
      if (vector < kVectors) {
        *reinterpret_cast<uint4*>(q_s + (vector / kBf16RowVectors) * kSmemRow +
                                  (vector % kBf16RowVectors) * 8) = v[k];
      }
    }
  }
};

// Q staged within a pass (blocks of several rows), one vector after another. Loading all of a
// thread's 18 vectors first made the four-m16-tile kernels slower on the H200 (403.6 -> 417.6 us
// at 128 heads, 1,878.9 -> 1,926.8 us on the 4,096-row prefill: their registers are spent), and a
// pass of many tiles hides Q's latency anyway.
template <int kRows, typename Addr>
__device__ __forceinline__ void stage_q(const MlaAttentionParams& p, const BlockWork& w,
                                        const AttentionPass& pass, int tid, std::uint16_t* q_s) {
  unsigned char* q_bytes = reinterpret_cast<unsigned char*>(q_s);
  for (int v = tid; v < kRows * kBf16RowVectors; v += kThreads) {
    const int m = v / kBf16RowVectors;
    const int c = (v % kBf16RowVectors) * 8;  // element column
    const MRow r = m_row(p, w, pass, m);
    uint4 value = make_uint4(0, 0, 0, 0);
    if (r.active) {
      const std::int64_t qrow = static_cast<std::int64_t>(r.row) * p.num_heads + r.head;
      value = c < kDc ? *reinterpret_cast<const uint4*>(p.q_nope + qrow * kDc + c)
                      : *reinterpret_cast<const uint4*>(p.q_pe + qrow * kDr + (c - kDc));
    }
    *reinterpret_cast<uint4*>(q_bytes + Addr::template chunk<kRows>(m, c / 8)) = value;
  }
  publish_tile_writes<Addr>();
}

// Slot of token `token` of tile `tile`, or -1 past the pass's tiles or its readable range.
__device__ __forceinline__ std::int32_t tile_slot(const MlaAttentionParams& p,
                                                  const AttentionPass& pass, int tile, int token) {
  const int position = tile * kTile + token;
  return (tile < pass.tile_end && position < pass.range.readable) ? slot_of(p, pass.range, position)
                                                                  : -1;
}

// This thread's pieces of the next FP8 tile, in registers or in the block's buffer (Fp8Staging).
template <Fp8Staging kStaging>
struct Fp8Pieces;

template <>
struct Fp8Pieces<Fp8Staging::kRegisters> {
  uint4 fetched[kFp8PiecesPerThread];

  __device__ __forceinline__ void fetch(int k, const std::uint8_t* src, const AttentionSmem&, int) {
    fetched[k] = __ldg(reinterpret_cast<const uint4*>(src));
  }
  __device__ __forceinline__ void commit() {}
  __device__ __forceinline__ void wait() {}
  __device__ __forceinline__ uint4 piece(int k, const AttentionSmem&, int) const {
    return fetched[k];
  }
};

template <>
struct Fp8Pieces<Fp8Staging::kBuffer> {
  __device__ __forceinline__ void fetch(int k, const std::uint8_t* src, const AttentionSmem& smem,
                                        int tid) {
    ptx::cp_async_cg_16(ptx::smem_address(smem.buffer + (tid + k * kThreads) * 16), src);
  }
  __device__ __forceinline__ void commit() { ptx::cp_async_commit_group(); }
  // The thread reads back only its own pieces: waiting for its own copies is enough.
  __device__ __forceinline__ void wait() { ptx::cp_async_wait_group<0>(); }
  __device__ __forceinline__ uint4 piece(int k, const AttentionSmem& smem, int tid) const {
    return *reinterpret_cast<const uint4*>(smem.buffer + (tid + k * kThreads) * 16);
  }
};

// Fetches this thread's pieces of `tile` (slot table slot[tile % 2]); nothing past the split.
template <typename Addr, Fp8Staging kStaging>
__device__ __forceinline__ void fetch_fp8_tile(const MlaAttentionParams& p,
                                               const AttentionPass& pass, const AttentionSmem& smem,
                                               int tid, int tile, Fp8Pieces<kStaging>& pieces) {
  if (tile < pass.tile_end) {
    const std::int32_t* slots = smem.slot + (tile % 2) * kTile;
#pragma unroll
    for (int k = 0; k < kFp8PiecesPerThread; ++k) {
      const std::int32_t slot = slots[Addr::piece_token(tid, k)];
      if (slot >= 0) {
        pieces.fetch(
            k, p.pool + static_cast<std::int64_t>(slot) * kD + Addr::piece_column(tid, k) * 16,
            smem, tid);
      }
    }
  }
  pieces.commit();
}

// Slot tables ([2, kTile] int32, tile t in table t % 2) of the pass's first two tiles, by threads
// 0 .. kTile - 1; read after the caller's next barrier. Both FP8 kernels start this way.
__device__ __forceinline__ void store_first_slot_tables(const MlaAttentionParams& p,
                                                        const AttentionPass& pass,
                                                        std::int32_t* slot, int tid) {
  if (tid < kTile) {
    slot[(pass.tile_begin % 2) * kTile + tid] = tile_slot(p, pass, pass.tile_begin, tid);
    slot[((pass.tile_begin + 1) % 2) * kTile + tid] = tile_slot(p, pass, pass.tile_begin + 1, tid);
  }
}

// Slot tables of the pass's first two tiles, NaN masks cleared, the first tile fetched.
template <typename Addr, Fp8Staging kStaging>
__device__ __forceinline__ void start_fp8_fetch(const MlaAttentionParams& p,
                                                const AttentionPass& pass,
                                                const AttentionSmem& smem, int tid,
                                                Fp8Pieces<kStaging>& pieces) {
  store_first_slot_tables(p, pass, smem.slot, tid);
  if (tid < 4) smem.nan[tid] = 0;
  __syncthreads();
  fetch_fp8_tile<Addr>(p, pass, smem, tid, pass.tile_begin, pieces);
}

// Marks `token` in the NaN mask when one of the 16 codes is a NaN code (0x7F or 0xFF): the OR of
// the four words has a NaN byte wherever one of them has (and sometimes where none has), a cheap
// first test before the exact one.
__device__ __forceinline__ void mark_nan_codes(const uint4 codes, int token,
                                               std::uint32_t* nan_mask) {
  if (e4m3x4_nan_bytes(codes.x | codes.y | codes.z | codes.w) != 0 &&
      (e4m3x4_nan_bytes(codes.x) | e4m3x4_nan_bytes(codes.y) | e4m3x4_nan_bytes(codes.z) |
       e4m3x4_nan_bytes(codes.w)) != 0) {
    atomicOr(nan_mask + token / 32, 1u << (token % 32));
  }
}

// Decodes this thread's pieces kFirst .. kEnd - 1 of `tile` into the bf16 tile (exactly; NaN codes
// stay NaN). Rows past `loaded` become zeros, so no code of a token the pass may not see enters an
// MMA. With several causal rows per block (p.mark_nan), tokens holding a NaN code are marked in the
// tile's NaN mask (finish_tile).
template <bool kRowGroups, typename Addr, Fp8Staging kStaging, int kFirst = 0,
          int kEnd = kFp8PiecesPerThread>
__device__ __forceinline__ void decode_fp8_tile(const MlaAttentionParams& p, int tid, int tile,
                                                int loaded, const AttentionSmem& smem,
                                                const Fp8Pieces<kStaging>& pieces) {
  std::uint32_t* nan_mask = smem.nan + (tile % 2) * 2;
  unsigned char* kv_bytes = reinterpret_cast<unsigned char*>(smem.kv);
#pragma unroll
  for (int k = kFirst; k < kEnd; ++k) {
    const int token = Addr::piece_token(tid, k);
    uint4 lo = make_uint4(0, 0, 0, 0), hi = make_uint4(0, 0, 0, 0);
    if (token < loaded) {
      const uint4 codes = pieces.piece(k, smem, tid);
      const uint2 a = e4m3x4_to_bf16x4(codes.x), b = e4m3x4_to_bf16x4(codes.y);
      const uint2 c = e4m3x4_to_bf16x4(codes.z), d = e4m3x4_to_bf16x4(codes.w);
      lo = make_uint4(a.x, a.y, b.x, b.y);
      hi = make_uint4(c.x, c.y, d.x, d.y);
      if (kRowGroups && p.mark_nan) mark_nan_codes(codes, token, nan_mask);
    }
    Addr::store_piece(kv_bytes, tid, k, lo, hi);  // 16 codes -> two 16-byte bf16 chunks
  }
  publish_tile_writes<Addr>();
}

// One tile's FP8 staging: wait for this thread's pieces, decode them after the barrier that frees
// the bf16 tile, and fetch the next tile at once. Returns the slot of token tid of tile
// + 2 (threads 0..63; loaded before the wait), which finish_tile stores. kRopeAhead: the rope piece
// (the last, kTailPiece) of every tile after the pass's first was decoded during the previous
// tile's P.V (decode_rope_ahead).
template <bool kRowGroups, typename Addr, Fp8Staging kStaging, bool kRopeAhead>
__device__ __forceinline__ std::int32_t stage_fp8_tile(const MlaAttentionParams& p,
                                                       const AttentionPass& pass, int tid, int tile,
                                                       int loaded, const AttentionSmem& smem,
                                                       Fp8Pieces<kStaging>& pieces) {
  const std::int32_t next_slot = tid < kTile ? tile_slot(p, pass, tile + 2, tid) : -1;
  pieces.wait();
  __syncthreads();  // everyone done with the previous tile's kv_s, p_s, sums and NaN mask
  if constexpr (kRopeAhead) {
    decode_fp8_tile<kRowGroups, Addr, kStaging, 0, kTailPiece>(p, tid, tile, loaded, smem, pieces);
    if (tile == pass.tile_begin) {
      decode_fp8_tile<kRowGroups, Addr, kStaging, kTailPiece>(p, tid, tile, loaded, smem, pieces);
    }
  } else {
    decode_fp8_tile<kRowGroups, Addr>(p, tid, tile, loaded, smem, pieces);
  }
  // The next tile goes out at once, into this thread's registers or its own slots of the buffer,
  // which it has just read (so no barrier is waited for first).
  fetch_fp8_tile<Addr>(p, pass, smem, tid, tile + 1, pieces);
  return next_slot;
}

// After the barrier that publishes tile `tile`: its NaN mask, the next tile's mask cleared, and the
// slot table of tile + 2 stored (in tile's place: every thread has read it). Tokens in the mask
// have their bf16 rows zeroed: a row that sees such a token gets a NaN score for it
// (online_softmax_update), which makes its out and lse NaN as in the reference, and an earlier
// causal row of the pass, which does not see it, multiplies zeros by its zero weight instead of
// NaN. Blocks of one row (!kRowGroups) mark nothing: their mask is 0 at compile time and none of
// this runs.
template <bool kRowGroups, typename Addr>
__device__ __forceinline__ std::uint64_t finish_tile(const MlaAttentionParams& p,
                                                     const AttentionPass& pass, int tid, int tile,
                                                     std::int32_t next_slot,
                                                     const AttentionSmem& smem) {
  if (tid < kTile) smem.slot[(tile % 2) * kTile + tid] = next_slot;
  if constexpr (!kRowGroups) return 0;
  const std::uint32_t* mask = smem.nan + (tile % 2) * 2;
  const std::uint64_t nan_tokens = mask[0] | (static_cast<std::uint64_t>(mask[1]) << 32);
  if (tid < 2) smem.nan[((tile + 1) % 2) * 2 + tid] = 0;
  if (nan_tokens != 0) {  // uniform over the block
    for (int v = tid; v < kTile * kBf16RowVectors; v += kThreads) {
      const int token = v / kBf16RowVectors;
      if ((nan_tokens >> token) & 1u) {
        *reinterpret_cast<uint4*>(reinterpret_cast<unsigned char*>(smem.kv) +
                                  Addr::template chunk<kTile>(token, v % kBf16RowVectors)) =
            make_uint4(0, 0, 0, 0);
      }
    }
    publish_tile_writes<Addr>();
    __syncthreads();
  }
  return nan_tokens;
}

// Whether one of eight bf16 values is NaN or infinite (exponent bits all ones).
__device__ __forceinline__ bool bf16x8_non_finite(const uint4 v) {
  constexpr std::uint32_t kExponents = 0x7F807F80u;
  return (__vcmpeq2(v.x & kExponents, kExponents) | __vcmpeq2(v.y & kExponents, kExponents) |
          __vcmpeq2(v.z & kExponents, kExponents) | __vcmpeq2(v.w & kExponents, kExponents)) != 0;
}

// bf16 pool (cuda-cast-bf16, fault fp8-read-as-bf16): the tile's rows into the bf16 tile, rows
// past `loaded` zeroed. One row per block: by cp.async, as this baseline always did. Several rows
// (p.mark_nan): through registers, so that tokens holding a non-finite value can be marked in the
// tile's NaN mask (as the FP8 path marks NaN codes).
template <bool kRowGroups, typename Addr>
__device__ __forceinline__ void stage_bf16_tile(const MlaAttentionParams& p,
                                                const AttentionPass& pass, int tid, int tile,
                                                int loaded, const AttentionSmem& smem) {
  __syncthreads();  // everyone done with the previous tile
  std::uint32_t* nan_mask = smem.nan + (tile % 2) * 2;
  const bool marks_nan = kRowGroups && p.mark_nan;  // uniform over the block
  for (int v = tid; v < kTile * kBf16RowVectors; v += kThreads) {
    const int token = v / kBf16RowVectors;
    const int chunk = v % kBf16RowVectors;
    uint4* dst = reinterpret_cast<uint4*>(reinterpret_cast<unsigned char*>(smem.kv) +
                                          Addr::template chunk<kTile>(token, chunk));
    if (token >= loaded) {
      *dst = make_uint4(0, 0, 0, 0);
      continue;
    }
    const std::int32_t slot = slot_of(p, pass.range, tile * kTile + token);
    const std::uint8_t* src = p.pool + (static_cast<std::int64_t>(slot) * kD) * 2 + chunk * 16;
    if (marks_nan) {
      const uint4 value = __ldg(reinterpret_cast<const uint4*>(src));
      if (bf16x8_non_finite(value)) atomicOr(nan_mask + token / 32, 1u << (token % 32));
      *dst = value;
    } else {
      ptx::cp_async_cg_16(ptx::smem_address(dst), src);
    }
  }
  if (!marks_nan) {
    ptx::cp_async_commit_group();
    ptx::cp_async_wait_group<0>();
  }
  publish_tile_writes<Addr>();  // cp.async writes count as this thread's generic-proxy writes
}

// ---- attention: S = Q K^T ----------------------------------------------------------------------

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

// ---- attention: online softmax (base 2) --------------------------------------------------------

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

// ---- attention: acc += P V ---------------------------------------------------------------------

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

// ---- attention: the same two products on wgmma (sm_90a) ---------------------------------------
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

// ---- attention: epilogue -----------------------------------------------------------------------

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

// ---- attention: the kernel ---------------------------------------------------------------------

// One pass: the pass's rows and heads over the tiles of its split, from staging Q to the output.
// q_loaded: the pass's Q in registers (one-row blocks load it before locating the pass), or
// nullptr: staged here.
template <int kMTiles, bool kBf16Pool, MmaPath kPath>
__device__ __forceinline__ void attend_pass(
    const MlaAttentionParams& p, const BlockWork& w, const AttentionPass& pass,
    AttentionSmem& tiles, const ThreadRole& t,
    const OneRowQ<MlaSmemLayout<kMTiles, kBf16Pool, kPath>::kRows>* q_loaded) {
  using Layout = MlaSmemLayout<kMTiles, kBf16Pool, kPath>;
  using Tiling = AttentionWarpTiling<kMTiles>;
  using Addr = TileAddressing<kPath>;
  constexpr bool kWgmma = kPath == MmaPath::kWgmma;  // 64 rows (MlaSmemLayout asserts it)
  if (pass.tile_begin >= pass.tile_end) {  // an empty split (short rows): it contributes nothing
    write_empty_split<Layout::kRows>(p, w, pass, t.tid);
    return;
  }
  __syncthreads();  // a previous pass of this block is done with Q and the slot tables
  constexpr Fp8Staging kStaging = kBf16Pool ? Fp8Staging::kRegisters : kFp8StagingOf<kMTiles>;
  constexpr bool kRowGroups = kMTiles == 4;  // only these blocks take several rows (launcher)
  constexpr bool kRopeAhead = kWgmma && !kBf16Pool;  // (the rope pieces during P.V)
  Fp8Pieces<kStaging> pieces;
  // The first tile's fetch goes out before Q is staged, so that Q's loads overlap it instead of
  // delaying the page-table lookup it waits for (a short row's latency is that chain).
  if constexpr (!kBf16Pool) {
    start_fp8_fetch<Addr>(p, pass, tiles, t.tid, pieces);
  } else if (t.tid < 4) {
    tiles.nan[t.tid] = 0;  // ordered before the first tile's writes by stage_bf16_tile's barrier
  }
  // Q is read after the next barrier.
  if (q_loaded != nullptr) {
    q_loaded->store(tiles.q, t.tid);
  } else {
    stage_q<Layout::kRows, Addr>(p, w, pass, t.tid, tiles.q);
  }

  SoftmaxState<Tiling::kPvTiles> state;
  state.init();
  tiles.set_tile_addresses();
  std::uint32_t q_frag[kMTiles == 1 ? Tiling::kQkSteps : 1][4];
  if constexpr (kMTiles == 1) load_q_fragments(q_frag, tiles, t);
  const int visible = m_tile_visible(p, pass, t.mt);  // this warp's rows see tokens 0 .. visible-1

  for (int tile = pass.tile_begin; tile < pass.tile_end; ++tile) {
    // Tokens whose rows are loaded: the last row's (the fault masked-nan-leak loads more).
    const int loaded = min(kTile, pass.range.readable - tile * kTile);
    std::int32_t next_slot = -1;
    if constexpr (!kBf16Pool) {
      next_slot = stage_fp8_tile<kRowGroups, Addr, kStaging, kRopeAhead>(p, pass, t.tid, tile,
                                                                         loaded, tiles, pieces);
    } else {
      stage_bf16_tile<kRowGroups, Addr>(p, pass, t.tid, tile, loaded, tiles);
    }
    __syncthreads();  // bf16 tile, its NaN mask and the next slot table ready
    const std::uint64_t nan_tokens =
        finish_tile<kRowGroups, Addr>(p, pass, t.tid, tile, next_slot, tiles);

    float s[Tiling::kQkTiles][4];
    const int token0 = t.wn * 8 * Tiling::kQkTiles;
    if constexpr (kWgmma) {
      qk_scores_wgmma(s, tiles, t);
    } else if constexpr (kMTiles == 1) {
      qk_scores_split_k(s, q_frag, tiles, t, token0);
    } else {
      qk_scores_two_chains(s, tiles, t, token0);
    }
    online_softmax_update<Tiling::kWn, Addr>(s, visible - tile * kTile, nan_tokens, p.score_scale,
                                             token0, tiles, t, state);
    if constexpr (kWgmma) {
      issue_pv_wgmma(state.acc, tiles, t);
      // While the tensor cores run P.V (wgmma is asynchronous), the ALUs decode the next tile's
      // rope pieces into the block of the bf16 tile that P.V does not read (Q.K^T is done with it:
      // qk_scores_wgmma's barrier).
      if (kRopeAhead && tile + 1 < pass.tile_end) {
        pieces.wait();
        decode_fp8_tile<kRowGroups, Addr, kStaging, kTailPiece>(
            p, t.tid, tile + 1, min(kTile, pass.range.readable - (tile + 1) * kTile), tiles,
            pieces);
      }
      ptx::wgmma_wait_group<0>();
    } else {
      pv_mma(state.acc, tiles, t);
    }
  }
  write_attention_output(p, w, pass, t, state);
}

template <MmaPath kPath>
__device__ __forceinline__ unsigned char* aligned_tiles(unsigned char* smem) {
  if constexpr (kPath == MmaPath::kWgmma) {
    const std::uint32_t misalign = ptx::smem_address(smem) % 1024;
    return smem + (misalign == 0 ? 0 : 1024 - misalign);
  }
  return smem;
}

// grid: row_groups * head_blocks * num_splits blocks (split fastest), kThreads threads, dynamic
// shared memory MlaSmemLayout<kMTiles, kBf16Pool, kPath>::kBytes + kSmemAlignSlack<kPath>.
// A group's rows normally belong to one request (one pass); a group that spans requests takes one
// pass per request.
template <int kMTiles, bool kBf16Pool, MmaPath kPath = MmaPath::kMmaSync>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm)
    mla_attention_kernel(const __grid_constant__ MlaAttentionParams p) {
  using Layout = MlaSmemLayout<kMTiles, kBf16Pool, kPath>;
  using Tiling = AttentionWarpTiling<kMTiles>;
  // The merge (split-KV) may launch once every block of this grid has got here, i.e. has started:
  // its blocks then take only what this grid leaves free of the SMs, and wait for this grid's
  // writes (griddepcontrol.wait) before reading them.
  ptx::griddepcontrol_launch_dependents();
  extern __shared__ __align__(128) unsigned char smem[];
  AttentionSmem tiles = carve_attention_smem<Layout>(aligned_tiles<kPath>(smem));
  const ThreadRole t = thread_role<Tiling::kWn, kPath>();
  const BlockWork work = locate_work(p);
  if constexpr (kMTiles != 4) {
    // One row per block (launcher), one pass. Its Q depends on the block index alone, so its loads
    // go out first and overlap the request's indptr -> page table -> KV chain, the whole latency
    // of a short row.
    OneRowQ<Layout::kRows> q;
    q.load(p, work, t.tid);
    attend_pass<kMTiles, kBf16Pool, kPath>(p, work, locate_pass(p, work, work.row_begin), tiles, t,
                                           &q);
  } else {
    for (int first = work.row_begin; first < work.row_end;) {
      const AttentionPass pass = locate_pass(p, work, first);
      attend_pass<kMTiles, kBf16Pool, kPath>(p, work, pass, tiles, t, nullptr);
      first += pass.row_count;
    }
  }
}

// One thread writes 1 where this binary's code for the running GPU has wgmma (sm_90a code on an
// sm_90 device), else 0: the launcher asks once before it picks MmaPath::kWgmma.
__global__ void wgmma_probe_kernel(int* has_wgmma) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  *has_wgmma = 1;
#else
  *has_wgmma = 0;
#endif
}

// ---- split-KV merge ----------------------------------------------------------------------------

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
//     (reports/h200-kernels-limit/experiments/16-merge-window.txt).
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
