// Device code of the CUDA MLA attention family: the KV write rule, the whole-pool cast (the seed's
// bug, kept for cuda-cast-bf16), and paged MLA attention (decode and prefill/extend) reading the
// FP8 e4m3 pool directly. Only kernels/mla_attention.cu launches these (and
// kernels/mla_attention_faults.cu the fault variants). This header gathers the headers of
// kernels/mla_attention/, one per phase, as FlashInfer's include/flashinfer/attention/ is split.
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
// --cuda-mma mma-sync), or, for four m16 tiles on sm_90a, wgmma (MmaPath): warpgroup g
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
// The attention kernel body (mla_attention/kernel.cuh) reads as the algorithm; each step is a
// __device__ __forceinline__ phase (inlined: the phases are names, not calls), in the header named
// on the right (kernels/mla_attention/):
//   locate_work / locate_pass  which rows, heads and tiles this block owns     work.cuh
//                         (a pass per request)
//   start_fp8_fetch       slot tables of the first two tiles, the first tile   staging.cuh
//                         fetched
//   OneRowQ / stage_q     Q [M, 576] bf16 into shared memory (one-row blocks:  staging.cuh
//                         loaded first)
//   load_q_fragments      (one m16 tile) Q's A fragments into registers, once  scores_mma.cuh
//                         per pass
//   per 64-token tile:
//     stage_fp8_tile      decode the fetched tile into the bf16 tile (NaN      staging.cuh
//                         mask), fetch the next
//     stage_bf16_tile     (bf16 pool) the bf16 rows into the tile (NaN mask)   staging.cuh
//     finish_tile         next slot table, zero rows of NaN codes              staging.cuh
//     qk_scores_*         S = Q K^T (mma.sync: two variants of the warp        scores_mma.cuh,
//                         tiling; wgmma)                                       wgmma.cuh
//     online_softmax_update  scale, mask, block row max, P = exp2(s - m) in    softmax.cuh
//                         bf16, l, rescale acc
//     pv_mma / issue_pv_wgmma  acc += P V (V = the tile's first 512 columns);  pv_mma.cuh,
//                         on wgmma the next tile's rope pieces are decoded     wgmma.cuh
//                         meanwhile
//   write_attention_output  out and lse, or the split's partial (out, lse)     epilogue.cuh
// and the merge (merge.cuh): mla_merge_kernel (few splits: load_split_weights, sum_split_group) or
// mla_merge_window_kernel (many: load_split_window, reduce_split_totals, sum_split_window), then
// write_merged_row. Besides: params.cuh (parameters, constants, row_range, the fault variants),
// smem_layout.cuh (warp tiling, shared-memory carve-up, tile addressing), kv_write.cuh (KV write
// and pool cast kernels), wgmma_probe.cuh.
// Fault injection: the attention kernels take an AttentionFault template argument (params.cuh);
// the production instantiations (kNone) hold no fault code, scripts/check_fault_free_kernels.py
// checks it on the compiled objects.
#pragma once

#include "kernels/mla_attention/bf16_pool.cuh"
#include "kernels/mla_attention/epilogue.cuh"
#include "kernels/mla_attention/kernel.cuh"
#include "kernels/mla_attention/kv_write.cuh"
#include "kernels/mla_attention/merge.cuh"
#include "kernels/mla_attention/params.cuh"
#include "kernels/mla_attention/pv_mma.cuh"
#include "kernels/mla_attention/scores_mma.cuh"
#include "kernels/mla_attention/smem_layout.cuh"
#include "kernels/mla_attention/softmax.cuh"
#include "kernels/mla_attention/staging.cuh"
#include "kernels/mla_attention/wgmma.cuh"
#include "kernels/mla_attention/wgmma_probe.cuh"
#include "kernels/mla_attention/work.cuh"
