// Decode blocks of at most 16 heads with the KV tile in registers: the same math as
// mla_attention_kernel<1, kBf16Pool> (kernels/mla_attention.cuh states it; the CPU model,
// kernels/mla_attention_model.hpp, mirrors it), on another split of the work, so that no decoded
// bf16 tile passes through shared memory. The launcher runs it when a split holds >= 8 tiles
// (kRegisterTileMinTiles in kernels/mla_attention.cu): per tile it is faster, its first tile
// slower.
//
// Shapes: one block = one query row x 16 heads (heads past H are zero rows) x one split of the
// row's 64-token tiles; 8 warps. Warp w owns the columns
//   nope  c = 64 w .. 64 w + 63   (of Dc = 512; also the columns of out it writes)
//   rope  r = 8 w .. 8 w + 7      (of Dr = 64)
// of every token of a tile. Per 64-token tile:
//   1. load   each lane fetches, a tile ahead, into registers its 16 FP8 codes of its nope columns
//             (and 2 rope codes) for 8 tokens, and decodes them exactly into bf16 mma B fragments
//             of K^T (e4m3x4_to_bf16x4, as the shared-tile kernel)
//   2. S_w    = Q[:, cols of w] . K[tokens, cols of w]^T: 8 n8 tiles x (4 k16 steps + 1 k8 step)
//             -> [16, 64] fp32 partial scores, stored to shared memory
//   3. softmax warp w sums S = sum_w' S_w' (a fixed tree over w' = 0..7) for heads 2w, 2w+1 over
//             the 64 tokens (16 lanes per head, 4 tokens per lane), then as the shared-tile
//             kernel: scale, mask past `visible`, tile max (a butterfly within the 16 lanes),
//             m_new, P = exp2(s - m) rounded to bf16 (shared memory), alpha per head (shared
//             memory); each lane keeps l_lane = l_lane * alpha + (its 4 p), l = the sum of the 16
//             lanes' l_lane after the last tile
//   4. O_w    acc *= alpha (skipped when every alpha of the warp's heads is 1); acc += P .
//             V[tokens, cols of w]: V's B fragments are the decoded K fragments transposed in
//             registers (movmatrix), 4 k16 steps x 8 n8 tiles
// Two block barriers per tile (after 2, after 3). Column permutation: lane (g, q) (g = lane / 4,
// q = lane % 4) holds, for token 8 i + g, columns 64 w + 16 q + 4 s + {0, 1} as k slots 2q, 2q + 1
// of k16 step s and 64 w + 16 q + 4 s + {2, 3} as slots 2q + 8, 2q + 9: a dot product does not
// depend on the order of its columns as long as Q's A fragments take the same order, which they
// do (Q[h, 64 w + 16 q .. + 15] are the lane's 8 words). After movmatrix the lane holds V rows of
// tokens 16 u + 2q + {0, 1} (+8) for n index g, column 64 w + 16 (g / 2) + 4 s + 2 r + g % 2, so
// output n8 tile 2 s + r of the lane lands on columns 64 w + 16 q + 2 (2 s + r) + {0, 1}: the 16
// contiguous columns 64 w + 16 q .. + 15 of heads g and g + 8.
//
// Where it differs from the shared-tile kernel (both inside the tolerances stated there): the
// 576-term dot product is summed as 8 partial sums of 72 columns (tensor-core order) added in a
// fixed tree, and l per lane then over 16 lanes (other fp32 orders: ~n x 2^-24 relative, n = 576 or
// the tokens). Every rounding point (P to bf16, the epilogue) is the same, and the rescale it skips
// multiplies by exactly 1. The bf16 pool (cuda-cast-bf16) runs the same kernel with the decode
// left out, so the two stay bit-identical.
#pragma once

#include "kernels/mla_attention/kernel.cuh"

namespace kvaudit::cuda::detail {

inline constexpr int kRegNopeCols = kDc / kWarps;  // 64 nope columns per warp
inline constexpr int kRegRopeCols = kDr / kWarps;  // 8 rope columns per warp
inline constexpr int kRegTokenTiles = kTile / 8;   // 8 n8 tiles of tokens

// Shared memory of a register-tile block:
//   s_part : [kWarps, 16, kSRow] fp32   each warp's partial scores of the tile
//   p      : [16, kPRow] bf16          P of the tile (ldmatrix A fragments)
//   alpha  : [16] fp32                 exp2(m_old - m_new) of the tile, per head
//   m, l   : [16] fp32 each            the final running max and sum (epilogue)
//   slot   : [2, kTile] int32          slot tables of the next two tiles
struct RegisterTileLayout {
  static constexpr int kSPartOffset = 0;
  static constexpr int kPOffset = kSPartOffset + kWarps * 16 * kSRow * 4;
  static constexpr int kAlphaOffset = kPOffset + 16 * kPRow * 2;
  static constexpr int kMOffset = kAlphaOffset + 16 * 4;
  static constexpr int kLOffset = kMOffset + 16 * 4;
  static constexpr int kSlotOffset = kLOffset + 16 * 4;
  static constexpr int kBytes = kSlotOffset + 2 * kTile * 4;
};

struct RegisterTileSmem {
  float* s_part;
  std::uint16_t* p;
  float* alpha;
  float* m;
  float* l;
  std::int32_t* slot;
  std::uint32_t p_address;

  __device__ __forceinline__ explicit RegisterTileSmem(unsigned char* smem)
      : s_part(reinterpret_cast<float*>(smem + RegisterTileLayout::kSPartOffset)),
        p(reinterpret_cast<std::uint16_t*>(smem + RegisterTileLayout::kPOffset)),
        alpha(reinterpret_cast<float*>(smem + RegisterTileLayout::kAlphaOffset)),
        m(reinterpret_cast<float*>(smem + RegisterTileLayout::kMOffset)),
        l(reinterpret_cast<float*>(smem + RegisterTileLayout::kLOffset)),
        slot(reinterpret_cast<std::int32_t*>(smem + RegisterTileLayout::kSlotOffset)),
        p_address(ptx::smem_address(smem + RegisterTileLayout::kPOffset)) {}
};

// This lane's place: warp w (its columns), fragment row `group` (token 8 i + group of n8 tile i;
// heads group, group + 8) and `quad` (its 16 columns 64 w + 16 quad ..).
struct RegisterLane {
  int tid;
  int warp;
  int lane;
  int group;
  int quad;

  __device__ __forceinline__ RegisterLane()
      : tid(threadIdx.x),
        warp(threadIdx.x / 32),
        lane(threadIdx.x % 32),
        group((threadIdx.x % 32) / 4),
        quad(threadIdx.x % 4) {}
  __device__ __forceinline__ int nope_col() const { return warp * kRegNopeCols + 16 * quad; }
  __device__ __forceinline__ int rope_col() const { return warp * kRegRopeCols + 2 * quad; }
};

// Q's A fragments of this lane: q[h][j] = Q[head group + 8 h, nope_col + 2 j .. + 1] (bf16x2),
// qr[h] = Q[head group + 8 h, rope_col .. + 1]; zero past H. Loaded at kernel entry (they depend on
// the block index only), so that they overlap the request's indptr -> page table -> KV chain.
struct RegisterQ {
  std::uint32_t q[2][8];
  std::uint32_t qr[2];

  __device__ __forceinline__ void load(const MlaAttentionParams& p, const BlockWork& w,
                                       const RegisterLane& l) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int head = w.head0 + l.group + 8 * h;
      uint4 lo = make_uint4(0, 0, 0, 0), hi = make_uint4(0, 0, 0, 0);
      std::uint32_t rope = 0;
      if (head < p.num_heads) {
        const std::int64_t qrow = static_cast<std::int64_t>(w.row_begin) * p.num_heads + head;
        const uint4* nope = reinterpret_cast<const uint4*>(p.q_nope + qrow * kDc + l.nope_col());
        lo = __ldg(nope);
        hi = __ldg(nope + 1);
        rope = __ldg(reinterpret_cast<const unsigned int*>(p.q_pe + qrow * kDr + l.rope_col()));
      }
      q[h][0] = lo.x, q[h][1] = lo.y, q[h][2] = lo.z, q[h][3] = lo.w;
      q[h][4] = hi.x, q[h][5] = hi.y, q[h][6] = hi.z, q[h][7] = hi.w;
      qr[h] = rope;
    }
  }
};

// The codes of this lane's part of one tile, fetched a tile ahead: for token 8 i + group, its 16
// nope columns (16 FP8 codes, or 16 bf16 values of a bf16 pool) and its 2 rope columns. A token
// without a slot (past the split or the readable range) reads slot 0 and counts as zeros when
// decoded (present[i]): no branch guards a load, and nothing uses a loaded register before the
// decode (zeroing right after the load made the compiler wait for it, so the fetch a tile ahead
// became a wait on every tile: docs/kernel-experiments.md, round 11).
template <bool kBf16Pool>
struct RegisterCodes {
  static constexpr int kNopeVectors = kBf16Pool ? 2 : 1;  // 16-byte vectors per token
  static constexpr int kElementBytes = kBf16Pool ? 2 : 1;
  uint4 nope[kRegTokenTiles][kNopeVectors];
  std::uint32_t rope[kRegTokenTiles];
  bool present[kRegTokenTiles];  // the token has a slot

  __device__ __forceinline__ void fetch(const MlaAttentionParams& p, const std::int32_t* slots,
                                        const RegisterLane& l) {
#pragma unroll
    for (int i = 0; i < kRegTokenTiles; ++i) {
      const std::int32_t slot = slots[8 * i + l.group];
      const std::uint8_t* row =
          p.pool + static_cast<std::int64_t>(max(slot, 0)) * kD * kElementBytes;
      const uint4* src = reinterpret_cast<const uint4*>(row + l.nope_col() * kElementBytes);
#pragma unroll
      for (int v = 0; v < kNopeVectors; ++v) nope[i][v] = __ldg(src + v);
      const std::uint8_t* rope_src = row + (kDc + l.rope_col()) * kElementBytes;
      if constexpr (kBf16Pool) {
        rope[i] = __ldg(reinterpret_cast<const unsigned int*>(rope_src));
      } else {
        rope[i] = __ldg(reinterpret_cast<const unsigned short*>(rope_src));
      }
      present[i] = slot >= 0;
    }
  }
};

// The tile as bf16 B fragments of K^T: k[i][s][0] = columns 16 quad + 4 s + {0, 1} and
// k[i][s][1] = + {2, 3} (of the warp's 64) of token 8 i + group; kr[i] its rope columns.
struct RegisterTile {
  std::uint32_t k[kRegTokenTiles][4][2];
  std::uint32_t kr[kRegTokenTiles];
};

template <bool kBf16Pool>
__device__ __forceinline__ void decode_register_tile(const RegisterCodes<kBf16Pool>& codes,
                                                     RegisterTile& tile) {
#pragma unroll
  for (int i = 0; i < kRegTokenTiles; ++i) {
    const std::uint32_t keep = codes.present[i] ? 0xFFFFFFFFu : 0u;
    if constexpr (kBf16Pool) {
      const std::uint32_t words[8] = {codes.nope[i][0].x, codes.nope[i][0].y, codes.nope[i][0].z,
                                      codes.nope[i][0].w, codes.nope[i][1].x, codes.nope[i][1].y,
                                      codes.nope[i][1].z, codes.nope[i][1].w};
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        tile.k[i][s][0] = words[2 * s] & keep;
        tile.k[i][s][1] = words[2 * s + 1] & keep;
      }
      tile.kr[i] = codes.rope[i] & keep;
    } else {
      const std::uint32_t words[4] = {codes.nope[i][0].x, codes.nope[i][0].y, codes.nope[i][0].z,
                                      codes.nope[i][0].w};
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        const uint2 d = e4m3x4_to_bf16x4(words[s] & keep);
        tile.k[i][s][0] = d.x;
        tile.k[i][s][1] = d.y;
      }
      tile.kr[i] = e4m3x2_to_bf16x2(static_cast<std::uint16_t>(codes.rope[i] & keep & 0xFFFF));
    }
  }
}

// S_w = Q[:, warp's columns] . K^T for the 64 tokens, into the warp's s_part rows.
__device__ __forceinline__ void register_partial_scores(const RegisterQ& q,
                                                        const RegisterTile& tile,
                                                        const RegisterLane& l, float* s_part) {
  float* mine = s_part + l.warp * 16 * kSRow;
#pragma unroll
  for (int i = 0; i < kRegTokenTiles; ++i) {
    float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      const std::uint32_t a[4] = {q.q[0][2 * ks], q.q[1][2 * ks], q.q[0][2 * ks + 1],
                                  q.q[1][2 * ks + 1]};
      ptx::mma_m16n8k16_bf16_f32(s, a, tile.k[i][ks][0], tile.k[i][ks][1]);
    }
    ptx::mma_m16n8k8_bf16_f32(s, q.qr[0], q.qr[1], tile.kr[i]);
    const int col = 8 * i + 2 * l.quad;
    *reinterpret_cast<float2*>(mine + l.group * kSRow + col) = make_float2(s[0], s[1]);
    *reinterpret_cast<float2*>(mine + (l.group + 8) * kSRow + col) = make_float2(s[2], s[3]);
  }
}

// Running softmax state of head 2 warp + lane / 16 (the same in the 16 lanes of that head).
struct RegisterSoftmax {
  float m;       // running max of the head's scores (base 2), the same in its 16 lanes
  float l_lane;  // running sum of this lane's p (its 4 tokens of every tile), relative to m

  // l = the sum of the 16 lanes' l_lane (a butterfly), once after the last tile instead of a
  // butterfly per tile on the way to the barrier.
  __device__ __forceinline__ float l() const {
    float sum = l_lane;
#pragma unroll
    for (int x = 1; x < 16; x *= 2) sum += __shfl_xor_sync(0xffffffffu, sum, x);
    return sum;
  }
};

// Softmax of warp w's heads 2 w, 2 w + 1 over the tile: lane holds tokens 4 (lane % 16) .. + 3 of
// head 2 w + lane / 16. Writes P (bf16) and alpha, updates m and l.
__device__ __forceinline__ void register_softmax(const RegisterTileSmem& smem,
                                                 const RegisterLane& l, int valid,
                                                 float score_scale, RegisterSoftmax& state) {
  const int head = 2 * l.warp + l.lane / 16;
  const int token0 = 4 * (l.lane % 16);
  float4 part[kWarps];
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    part[w] = *reinterpret_cast<const float4*>(smem.s_part + (w * 16 + head) * kSRow + token0);
  }
  // A fixed tree ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)): the sums start as the loads land.
#pragma unroll
  for (int width = 1; width < kWarps; width *= 2) {
#pragma unroll
    for (int w = 0; w < kWarps; w += 2 * width) {
      part[w].x += part[w + width].x, part[w].y += part[w + width].y;
      part[w].z += part[w + width].z, part[w].w += part[w + width].w;
    }
  }
  float s[4] = {part[0].x, part[0].y, part[0].z, part[0].w};
  float tile_max = -INFINITY;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    s[e] = token0 + e < valid ? s[e] * score_scale : -INFINITY;
    tile_max = fmaxf(tile_max, s[e]);
  }
#pragma unroll
  for (int x = 1; x < 16; x *= 2) {
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, x));
  }
  const float m_new = fmaxf(state.m, tile_max);
  const RowShift shift = shift_row(state.m, m_new);
  const float m_use = shift.m_use, alpha = shift.alpha;
  float p[4];
  float part_sum = 0.f;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    p[e] = exp2f(s[e] - m_use);
    part_sum += p[e];
  }
  *reinterpret_cast<uint2*>(smem.p + head * kPRow + token0) =
      make_uint2(ptx::cvt_rn_bf16x2_f32(p[0], p[1]), ptx::cvt_rn_bf16x2_f32(p[2], p[3]));
  state.l_lane = state.l_lane * alpha + part_sum;
  state.m = m_new;
  if (l.lane % 16 == 0) smem.alpha[head] = alpha;
}

// acc = acc * alpha + P . V over the warp's 64 columns: V's B fragments are the K fragments
// transposed (movmatrix), acc[2 s + r] holds columns 16 quad + 2 (2 s + r) + {0, 1} of heads
// group (elements 0, 1) and group + 8 (2, 3).
__device__ __forceinline__ void register_pv(float (&acc)[8][4], const RegisterTile& tile,
                                            const RegisterTileSmem& smem, const RegisterLane& l) {
  const float alpha[2] = {smem.alpha[l.group], smem.alpha[l.group + 8]};
  rescale_accumulators(acc, alpha);  // (skipped by a warp whose 16 heads all kept their max)
  const int a_row = (l.lane % 8) + 8 * ((l.lane / 8) % 2);
  const std::uint32_t a_addr = smem.p_address + (a_row * kPRow + 8 * (l.lane / 16)) * 2;
#pragma unroll
  for (int u = 0; u < kTile / 16; ++u) {
    std::uint32_t a[4];
    ptx::ldmatrix_m8n8_x4(a, a_addr + u * 32);
#pragma unroll
    for (int s = 0; s < 4; ++s) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const std::uint32_t b0 = ptx::movmatrix_m8n8_trans(tile.k[2 * u][s][r]);
        const std::uint32_t b1 = ptx::movmatrix_m8n8_trans(tile.k[2 * u + 1][s][r]);
        ptx::mma_m16n8k16_bf16_f32(acc[2 * s + r], a, b0, b1);
      }
    }
  }
}

// out = bf16(acc * (kv_scale / l)), lse = (m + log2 l) ln 2; or the split's partial (acc / l,
// m + log2 l), as write_attention_output.
__device__ __forceinline__ void register_write_output(const MlaAttentionParams& p,
                                                      const BlockWork& w,
                                                      const RegisterTileSmem& smem,
                                                      const RegisterLane& l,
                                                      const float (&acc)[8][4]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int local = l.group + 8 * h;
    const int head = w.head0 + local;
    if (head >= p.num_heads) continue;
    const float m = smem.m[local], sum = smem.l[local];
    const std::int64_t out_row = static_cast<std::int64_t>(w.row_begin) * p.num_heads + head;
    if (p.num_splits == 1) {
      const float factor = p.kv_scale / sum;
      std::uint32_t v[8];
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        v[n] = ptx::cvt_rn_bf16x2_f32(acc[n][2 * h] * factor, acc[n][2 * h + 1] * factor);
      }
      uint4* out = reinterpret_cast<uint4*>(p.out + out_row * kDc + l.nope_col());
      out[0] = make_uint4(v[0], v[1], v[2], v[3]);
      out[1] = make_uint4(v[4], v[5], v[6], v[7]);
      if (l.warp == 0 && l.quad == 0) p.lse[out_row] = natural_lse(m, sum);
    } else {
      const std::int64_t part_row =
          partial_row(w.row_begin, p.num_splits, w.split, p.num_heads, head);
      const float inverse = 1.f / sum;
      float4* out = reinterpret_cast<float4*>(p.partial_out + part_row * kDc + l.nope_col());
#pragma unroll
      for (int n = 0; n < 8; n += 2) {
        out[n / 2] = make_float4(acc[n][2 * h] * inverse, acc[n][2 * h + 1] * inverse,
                                 acc[n + 1][2 * h] * inverse, acc[n + 1][2 * h + 1] * inverse);
      }
      if (l.warp == 0 && l.quad == 0) p.partial_lse[part_row] = base2_lse(m, sum);
    }
  }
}

// grid: row_groups * head_blocks * num_splits blocks (split fastest; rows_per_block = 1,
// block_heads = 16), kThreads threads, RegisterTileLayout::kBytes of dynamic shared memory.
// kFault as for mla_attention_kernel (kernels/mla_attention/kernel.cuh).
template <bool kBf16Pool, AttentionFault kFault = AttentionFault::kNone>
__global__ void __launch_bounds__(kThreads, 1)
    mla_decode_registers_kernel(const __grid_constant__ MlaAttentionParams p) {
  ptx::griddepcontrol_launch_dependents();  // as mla_attention_kernel: the merge may launch
  extern __shared__ __align__(128) unsigned char smem_bytes[];
  const RegisterTileSmem smem(smem_bytes);
  const RegisterLane l;
  const BlockWork work = locate_work(p);
  RegisterQ q;
  q.load(p, work, l);
  const AttentionPass pass = locate_pass<kFault>(p, work, work.row_begin);
  if (pass.tile_begin >= pass.tile_end) {  // an empty split: it contributes nothing
    write_empty_split<16>(p, work, pass, l.tid);
    return;
  }
  store_first_slot_tables(p, pass, smem.slot, l.tid);
  __syncthreads();
  RegisterCodes<kBf16Pool> codes;
  codes.fetch(p, smem.slot + (pass.tile_begin % 2) * kTile, l);

  float acc[8][4];
#pragma unroll
  for (int n = 0; n < 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  RegisterSoftmax state{-INFINITY, 0.f};  // m, l_lane
  for (int tile = pass.tile_begin; tile < pass.tile_end; ++tile) {
    const std::int32_t next_slot = l.tid < kTile ? tile_slot(p, pass, tile + 2, l.tid) : -1;
    RegisterTile kv;
    decode_register_tile(codes, kv);
    if (tile + 1 < pass.tile_end) codes.fetch(p, smem.slot + ((tile + 1) % 2) * kTile, l);
    register_partial_scores(q, kv, l, smem.s_part);
    __syncthreads();  // partial scores of every warp; every fetch of tile's slot table done
    if (l.tid < kTile) smem.slot[(tile % 2) * kTile + l.tid] = next_slot;
    register_softmax(smem, l, pass.range.visible - tile * kTile, p.score_scale, state);
    __syncthreads();  // P and alpha of the tile; the slot table of tile + 2
    register_pv(acc, kv, smem, l);
  }
  const float row_sum = state.l();
  if (l.lane % 16 == 0) {
    const int head = 2 * l.warp + l.lane / 16;
    smem.m[head] = state.m;
    smem.l[head] = row_sum;
  }
  __syncthreads();
  register_write_output(p, work, smem, l, acc);
}

}  // namespace kvaudit::cuda::detail
