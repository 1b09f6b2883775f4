// Where an attention block works (locate_work, locate_pass): which query rows, heads and 64-token
// tiles it owns, each thread's role in the warp tiling, and its shared memory. A block: one group
// of rows_per_block consecutive rows x block_heads heads (M = 16 * kMTiles), one split of the
// group's tiles; a pass: the group's rows of one request.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/mla_attention/params.cuh"
#include "kernels/mla_attention/smem_layout.cuh"

namespace kvaudit::cuda::detail {

// The row's request and tokens: from the host plan's launch parameters where the launcher made
// one (p.planned_rows), else from the request arrays in memory (one dependent round trip).
template <AttentionFault kFault>
__device__ __forceinline__ RowRange locate_row(const MlaAttentionParams& p, int row) {
  if (row < p.planned_rows) return p.planned[row].range;
  return row_range(p.qo_indptr, p.kv_indptr, p.kv_last_page_len, p.batch, p.page_size,
                   kReadsMaskedTail<kFault>, row);
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

template <AttentionFault kFault>
__device__ __forceinline__ AttentionPass locate_pass(const MlaAttentionParams& p,
                                                     const BlockWork& w, int first_row) {
  AttentionPass pass;
  pass.first_row = first_row;
  const RowRange first = locate_row<kFault>(p, first_row);
  const int request_row_end = first_row < p.planned_rows ? p.planned[first_row].request_row_end
                                                         : p.qo_indptr[first.request + 1];
  pass.row_count = min(w.row_end, request_row_end) - first_row;
  pass.first_visible = first.visible;
  pass.range = first;
  pass.range.visible = first.visible + pass.row_count - 1;
  if constexpr (!kReadsMaskedTail<kFault>) pass.range.readable = pass.range.visible;
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

}  // namespace kvaudit::cuda::detail
