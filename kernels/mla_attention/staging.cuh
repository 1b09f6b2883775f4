// Staging (loads): Q [M, 576] bf16 into shared memory or registers (OneRowQ, stage_q), and per
// 64-token tile the KV rows, FP8 [64, 576] e4m3 codes fetched ahead (Fp8Staging) and decoded
// exactly into the bf16 tile [64, 576] (stage_fp8_tile), or a bf16 pool's rows copied
// (stage_bf16_tile), with the NaN-code masks of row groups (finish_tile).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/fp8_e4m3_device.cuh"
#include "kernels/mla_attention/work.cuh"
#include "kernels/ptx.cuh"

namespace kvaudit::cuda::detail {

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

}  // namespace kvaudit::cuda::detail
