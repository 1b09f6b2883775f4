// Warp tiling, FP8 staging kind, tensor-core path and the shared-memory carve-up of one
// attention block: M = 16 * kMTiles (row, head) pairs, a bf16 KV tile [kTile = 64, 576], P
// [M, 64] bf16, and the two ways its bf16 tiles are addressed (PaddedTiles for mma.sync,
// Swizzled128Tiles for wgmma).
#pragma once

#include <cuda_runtime.h>

#include <type_traits>

#include "kernels/mla_attention/params.cuh"
#include "kernels/ptx.cuh"

namespace kvaudit::cuda::detail {

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

}  // namespace kvaudit::cuda::detail
