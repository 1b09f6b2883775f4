// The attention kernel, mla_attention_kernel<kMTiles, kBf16Pool, kPath, kFault>: a short body
// built from the named phases of the headers beside this one (kernels/mla_attention.cuh lists
// them and states the math). One block: M = 16 * kMTiles (row, head) pairs over one split of
// 64-token tiles; out [num_rows, H, 512] bf16 and lse, or the split's partials.
#pragma once

#include <cuda_runtime.h>

#include "kernels/mla_attention/epilogue.cuh"
#include "kernels/mla_attention/pv_mma.cuh"
#include "kernels/mla_attention/scores_mma.cuh"
#include "kernels/mla_attention/smem_layout.cuh"
#include "kernels/mla_attention/softmax.cuh"
#include "kernels/mla_attention/staging.cuh"
#include "kernels/mla_attention/wgmma.cuh"
#include "kernels/mla_attention/work.cuh"
#include "kernels/ptx.cuh"

namespace kvaudit::cuda::detail {

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
// pass per request. kFault: AttentionFault::kNone in production (kernels/mla_attention.cu), a
// fault variant in kernels/mla_attention_faults.cu only.
template <int kMTiles, bool kBf16Pool, MmaPath kPath = MmaPath::kMmaSync,
          AttentionFault kFault = AttentionFault::kNone>
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
    attend_pass<kMTiles, kBf16Pool, kPath>(p, work, locate_pass<kFault>(p, work, work.row_begin),
                                           tiles, t, &q);
  } else {
    for (int first = work.row_begin; first < work.row_end;) {
      const AttentionPass pass = locate_pass<kFault>(p, work, first);
      attend_pass<kMTiles, kBf16Pool, kPath>(p, work, pass, tiles, t, nullptr);
      first += pass.row_count;
    }
  }
}

}  // namespace kvaudit::cuda::detail
