// The CPU model of the FP8 MLA attention kernels (kernels/mla_attention_cpu_model.hpp states the
// math and the rounding points, kernels/mla_attention_model.hpp the contract).
//
// Work is split over (query row, block of heads) units, claimed from an atomic counter. A unit
// walks its row's visible tokens one 64-token tile at a time (the GPU's tile, mla::kKvTileTokens),
// decodes the tile once into fp32 in two layouts, and updates every head of its block:
//   tile_rows : [tile, D]  for P.V (acc[d] += p_t * v_t[d], vectorised over d)
//   tile_cols : [D, tile]  for the scores (s[t] += q_j * k_t[j], vectorised over t, so that each
//                          token's dot product is still summed in index order j = 0, 1, ...)
// Both products are exact in fp32 (see the header), so fused or separate multiply-add give the
// same bits there. TileWorker's steps are named after the kernel's phases (stage_q, load_tile for
// the tile decode, qk_scores, online_softmax_update, rescale_and_accumulate_pv, the epilogue).
#include "kernels/mla_attention_cpu_model.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/mla_attention_model.hpp"
#include "src/core/cpu_clones.hpp"
#include "src/core/fp8_e4m3.hpp"
#include "src/core/fp8_e4m3_rows.hpp"
#include "src/core/parallel_for.hpp"

namespace kvaudit {

float mla_score_scale(double sm_scale, float kv_scale) {
  return static_cast<float>(sm_scale * static_cast<double>(kv_scale) * mla::kLog2e);
}

namespace {

constexpr int kTile = mla::kKvTileTokens;

// s[t] = sum_j q[j] * cols[j][t] for t < n (cols: [width, kTile]), each summed in index order
// j = 0, 1, ..., vectorised over t. A full tile (n = kTile) keeps its sums in registers through
// all j. Cloned for x86-64-v3 and -v4; with -ffp-contract=off (kernels/CMakeLists.txt) every
// clone rounds each product and each sum, in the same order: the same bits.
template <int kN>
void tile_scores_fixed(const float* q, const float* cols, int width, float* s) {
  float sums[kN] = {};
  for (int j = 0; j < width; ++j) {
    const float qj = q[j];
    const float* col = cols + static_cast<std::size_t>(j) * kTile;
    for (int t = 0; t < kN; ++t) sums[t] += qj * col[t];
  }
  std::copy_n(sums, kN, s);
}

// Two heads' scores of a full tile at once (q_a and q_b against the same columns): each column
// row is loaded once for both. Each head's sums are tile_scores_fixed's, in the same order.
template <int kN>
__attribute__((always_inline)) inline void tile_scores_pair_fixed(const float* q_a,
                                                                  const float* q_b,
                                                                  const float* cols, int width,
                                                                  float* s_a, float* s_b) {
  float sums_a[kN] = {};
  float sums_b[kN] = {};
  for (int j = 0; j < width; ++j) {
    const float qa = q_a[j];
    const float qb = q_b[j];
    const float* col = cols + static_cast<std::size_t>(j) * kTile;
    for (int t = 0; t < kN; ++t) {
      sums_a[t] += qa * col[t];
      sums_b[t] += qb * col[t];
    }
  }
  std::copy_n(sums_a, kN, s_a);
  std::copy_n(sums_b, kN, s_b);
}

KVAUDIT_CPU_CLONES_V4
void tile_scores_pair(const float* q_a, const float* q_b, const float* cols, int width, float* s_a,
                      float* s_b) {
  tile_scores_pair_fixed<kTile>(q_a, q_b, cols, width, s_a, s_b);
}

KVAUDIT_CPU_CLONES_V4
void tile_scores(const float* q, const float* cols, int width, int n, float* s) {
  if (n == kTile) return tile_scores_fixed<kTile>(q, cols, width, s);
  for (int t = 0; t < n; ++t) s[t] = 0.0f;
  for (int j = 0; j < width; ++j) {
    const float qj = q[j];
    const float* col = cols + static_cast<std::size_t>(j) * kTile;
    for (int t = 0; t < n; ++t) s[t] += qj * col[t];
  }
}

// kDims dims of tile_pv, their sums held in registers through all n tokens (not loaded and stored
// once per token). Always inlined: each clone of tile_pv then compiles it for its own target.
template <int kDims>
__attribute__((always_inline)) inline void tile_pv_fixed(const float* p, const float* rows,
                                                         int width, int n, float alpha,
                                                         float* acc) {
  float sums[kDims];
  for (int d = 0; d < kDims; ++d) sums[d] = acc[d] * alpha;
  for (int t = 0; t < n; ++t) {
    const float pt = p[t];
    const float* v = rows + static_cast<std::size_t>(t) * width;
    for (int d = 0; d < kDims; ++d) sums[d] += pt * v[d];
  }
  std::copy_n(sums, kDims, acc);
}

// acc[d] = acc[d] * alpha, then acc[d] += p[t] * rows[t][d] for t < n in order (rows: [n,
// width]), vectorised over d, 128 dims at a time; cloned as tile_scores, the same bits in every
// clone and for any split of the dims (each dim's operations are its own).
KVAUDIT_CPU_CLONES_V4
void tile_pv(const float* p, const float* rows, int width, int dc, int n, float alpha, float* acc) {
  constexpr int kBlock = 128;
  int d0 = 0;
  for (; d0 + kBlock <= dc; d0 += kBlock)
    tile_pv_fixed<kBlock>(p, rows + d0, width, n, alpha, acc + d0);
  for (int d = d0; d < dc; ++d) acc[d] *= alpha;
  for (int t = 0; t < n; ++t) {
    const float pt = p[t];
    const float* v = rows + static_cast<std::size_t>(t) * width;
    for (int d = d0; d < dc; ++d) acc[d] += pt * v[d];
  }
}

// The problem as the tile worker reads it: the caller's arrays and the split of each row's heads
// into units of work.
struct CpuProblem {
  const MlaCpuAttention* attention = nullptr;
  int page_size = 1;
  int num_heads = 0;
  int dc = 0;
  int dr = 0;
  int heads_per_unit = 1;
  int units_per_row = 1;
  float score_scale = 0.0f;
  float kv_scale = 1.0f;
  std::span<const float> q_nope;
  std::span<const float> q_pe;
  std::span<std::uint16_t> out;
  std::span<float> lse;

  int width() const { return dc + dr; }
};

// The request owning query row `row`: the first b with qo_indptr[b + 1] > row (requests without
// rows are skipped over).
int request_of_row(std::span<const std::int32_t> qo_indptr, int row) {
  const auto it = std::upper_bound(qo_indptr.begin(), qo_indptr.end(), row);
  return static_cast<int>(it - qo_indptr.begin()) - 1;
}

// Pages of request b, its tokens ((P - 1) page_size + the last page's length; 0 without pages)
// and the slot of its token position `pos` (kvdump-v1).
std::int64_t pages_of(const MlaCpuAttention& a, int request) {
  return a.kv_indptr[request + 1] - a.kv_indptr[request];
}

std::int64_t kv_len(const MlaCpuAttention& a, int request) {
  const std::int64_t pages = pages_of(a, request);
  if (pages == 0) return 0;
  return (pages - 1) * a.page_size + a.kv_last_page_len[request];
}

std::int64_t slot_of(const MlaCpuAttention& a, int request, std::int64_t pos) {
  const std::int64_t page = a.kv_indices[a.kv_indptr[request] + pos / a.page_size];
  return page * a.page_size + pos % a.page_size;
}

// Token position of query row `row` of request b (causal: it sees positions 0 .. that position).
std::int64_t position_of_row(const MlaCpuAttention& a, int request, int row) {
  const int rows_of_request = a.qo_indptr[request + 1] - a.qo_indptr[request];
  return kv_len(a, request) - rows_of_request + (row - a.qo_indptr[request]);
}

class TileWorker {
 public:
  explicit TileWorker(const CpuProblem& p)
      : p_(p),
        tile_rows_(static_cast<std::size_t>(kTile) * p.width()),
        tile_cols_(static_cast<std::size_t>(kTile) * p.width()),
        q_(static_cast<std::size_t>(p.heads_per_unit) * p.width()),
        acc_(static_cast<std::size_t>(p.heads_per_unit) * p.dc),
        m_(p.heads_per_unit),
        l_(p.heads_per_unit) {}

  // The phases of mla_attention_kernel for one (row, block of heads): stage q, then per tile load
  // (decode) the tile and update every head (scores, online softmax, P.V), then the epilogue.
  void run(int row, int head_begin, int head_end) {
    const MlaCpuAttention& a = *p_.attention;
    const int dc = p_.dc;
    const int heads = head_end - head_begin;
    const int request = request_of_row(a.qo_indptr, row);
    const std::int64_t visible = position_of_row(a, request, row) + 1;
    stage_q(row, head_begin, heads);

    // Injection masked-nan-leak: the last tile also reads the rest of the request's last page
    // (unused slots) with a zero weight, as a kernel that masks by multiplying would.
    std::int64_t readable = visible;
    if (a.read_masked_tail) {
      const std::int64_t pages = pages_of(a, request);
      readable = pages * p_.page_size;
    }
    for (std::int64_t t0 = 0; t0 < visible; t0 += kTile) {
      const int n = static_cast<int>(std::min<std::int64_t>(kTile, visible - t0));
      const int n_read = static_cast<int>(std::min<std::int64_t>(kTile, readable - t0));
      load_tile(request, t0, n_read);
      int h = 0;
      if (n == kTile) {  // full tiles: the scores of two heads at a time
        for (; h + 2 <= heads; h += 2) update_head_pair(h, n_read);
      }
      for (; h < heads; ++h) update_head(h, n, n_read);
    }

    // Epilogue: out = bf16(acc * (kv_scale / l)), lse = (m + log2 l) * ln 2. Kept inline here: as
    // a function of its own, GCC orders the operands of the NaN-producing products and sums
    // differently, and the sign of a NaN output (an injected fault's) changes.
    const float ln2 = static_cast<float>(mla::kLn2);
    for (int h = 0; h < heads; ++h) {
      const std::size_t oi = static_cast<std::size_t>(row) * p_.num_heads + head_begin + h;
      const float factor = p_.kv_scale / l_[h];
      const float* acc = acc_.data() + static_cast<std::size_t>(h) * dc;
      std::uint16_t* o = p_.out.data() + oi * dc;
      for (int d = 0; d < dc; ++d) o[d] = bf16_from_float(acc[d] * factor);
      p_.lse[oi] = (m_[h] + std::log2(l_[h])) * ln2;
    }
  }

 private:
  // q rounded to bf16 ([heads, Dc + Dr], q_nope then q_pe) and the softmax state reset.
  void stage_q(int row, int head_begin, int heads) {
    const int width = p_.width();
    const int dc = p_.dc;
    for (int h = 0; h < heads; ++h) {
      const std::size_t qi = static_cast<std::size_t>(row) * p_.num_heads + head_begin + h;
      float* q = q_.data() + static_cast<std::size_t>(h) * width;
      for (int j = 0; j < dc; ++j) q[j] = bf16_round(p_.q_nope[qi * dc + j]);
      for (int j = 0; j < p_.dr; ++j) q[dc + j] = bf16_round(p_.q_pe[qi * p_.dr + j]);
      m_[h] = -std::numeric_limits<float>::infinity();
      l_[h] = 0.0f;
    }
    std::fill(acc_.begin(), acc_.end(), 0.0f);
  }

  // Decodes visible positions t0 .. t0 + n - 1 of the request (never more: a slot past the row's
  // position, or past the last page's used length, is not read).
  void load_tile(int request, std::int64_t t0, int n) {
    const MlaCpuAttention& a = *p_.attention;
    const std::span<const std::uint8_t> pool = a.pool;
    const int width = p_.width();
    for (int t = 0; t < n; ++t) {
      const std::int64_t slot = slot_of(a, request, t0 + t);
      float* dst = tile_rows_.data() + static_cast<std::size_t>(t) * width;
      if (a.fp8_read_as_bf16 && !a.bf16_pool) {
        // The kv_data_type mix-up: the fp8 byte buffer addressed as a [S, D] bf16 array (reads
        // past the buffer's end, which a GPU would make out of bounds, give 0 here).
        for (int j = 0; j < width; ++j) {
          const std::size_t byte = 2 * (static_cast<std::size_t>(slot) * width + j);
          dst[j] =
              byte + 1 < pool.size()
                  ? bf16_to_float(static_cast<std::uint16_t>(pool[byte] | (pool[byte + 1] << 8)))
                  : 0.0f;
        }
      } else if (a.bf16_pool) {
        // Little-endian bf16 bits, [S, D].
        const std::uint8_t* bits = pool.data() + 2 * static_cast<std::size_t>(slot) * width;
        for (int j = 0; j < width; ++j) {
          dst[j] = bf16_to_float(static_cast<std::uint16_t>(bits[2 * j] | (bits[2 * j + 1] << 8)));
        }
      } else {
        e4m3_decode_row(pool.data() + static_cast<std::size_t>(slot) * width, width, dst);
      }
    }
    transpose_tile(n, width);
  }

  // tile_cols_[j][t] = tile_rows_[t][j], in blocks of 16 columns (16 destination rows of the
  // tile written at once rather than all 576: they stay in L1 while the 64 tokens fill them).
  void transpose_tile(int n, int width) {
    constexpr int kColumns = 16;
    for (int j0 = 0; j0 < width; j0 += kColumns) {
      const int j1 = std::min(width, j0 + kColumns);
      for (int t = 0; t < n; ++t) {
        const float* src = tile_rows_.data() + static_cast<std::size_t>(t) * width;
        for (int j = j0; j < j1; ++j) tile_cols_[static_cast<std::size_t>(j) * kTile + t] = src[j];
      }
    }
  }

  // One tile's step for head h: the kernel's Q.K^T, online softmax update and P.V.
  void update_head(int h, int n, int n_read) {
    float s[kTile];
    float p[kTile];
    qk_scores(h, n, s);
    const float alpha = online_softmax_update(h, n, n_read, s, p);
    rescale_and_accumulate_pv(h, n_read, alpha, p);
  }

  // update_head for heads h and h + 1 of a full tile, their scores taken together.
  void update_head_pair(int h, int n_read) {
    const int width = p_.width();
    float s[2][kTile];
    float p[kTile];
    tile_scores_pair(q_.data() + static_cast<std::size_t>(h) * width,
                     q_.data() + static_cast<std::size_t>(h + 1) * width, tile_cols_.data(), width,
                     s[0], s[1]);
    for (int k = 0; k < 2; ++k) {
      const float alpha = online_softmax_update(h + k, kTile, n_read, s[k], p);
      rescale_and_accumulate_pv(h + k, n_read, alpha, p);
    }
  }

  // s[t] = q . k_t for the tile's n visible tokens, each summed in index order j = 0, 1, ...
  void qk_scores(int h, int n, float (&s)[kTile]) const {
    const int width = p_.width();
    const float* q = q_.data() + static_cast<std::size_t>(h) * width;
    tile_scores(q, tile_cols_.data(), width, n, s);
  }

  // Scales the scores, moves m and l onto the tile's max and fills p (p[n .. n_read) = 0, the
  // masked-nan-leak tokens); returns alpha = exp2(m_old - m_new), the factor for acc.
  float online_softmax_update(int h, int n, int n_read, float (&s)[kTile], float (&p)[kTile]) {
    for (int t = n; t < n_read; ++t) p[t] = 0.0f;
    // fmaxf ignores NaN, as the GPU's max does; a NaN score still poisons p, l and out.
    float tile_max = -std::numeric_limits<float>::infinity();
    for (int t = 0; t < n; ++t) {
      s[t] *= p_.score_scale;
      tile_max = std::fmax(tile_max, s[t]);
    }
    const float m_old = m_[h];
    const float m_new = std::fmax(m_old, tile_max);
    const float alpha =
        m_old == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp2(m_old - m_new);
    float tile_sum = 0.0f;
    for (int t = 0; t < n; ++t) {
      p[t] = std::exp2(s[t] - m_new);
      tile_sum += p[t];
    }
    // Two roundings (product, then sum) as the model states. The project builds for baseline
    // x86-64, which has no FMA, so the compiler cannot fuse them; every other product here is
    // exact, where fusing would not change a bit anyway.
    const float l_scaled = l_[h] * alpha;
    l_[h] = l_scaled + tile_sum;
    m_[h] = m_new;
    return alpha;
  }

  // acc = acc * alpha + sum_t bf16(p_t) v_t, tokens in order (fp32; each product is exact).
  // Tokens n .. n_read - 1 were read but are masked (only under masked-nan-leak): their weight
  // is exactly zero and is multiplied in, which a correct kernel never does.
  void rescale_and_accumulate_pv(int h, int n_read, float alpha, const float (&p)[kTile]) {
    const int width = p_.width();
    const int dc = p_.dc;
    float* acc = acc_.data() + static_cast<std::size_t>(h) * dc;
    float pb[kTile];
    for (int t = 0; t < n_read; ++t) pb[t] = bf16_round(p[t]);  // mla::kRoundProbabilitiesToBf16
    tile_pv(pb, tile_rows_.data(), width, dc, n_read, alpha, acc);
  }

  const CpuProblem& p_;
  std::vector<float> tile_rows_;
  std::vector<float> tile_cols_;
  std::vector<float> q_;
  std::vector<float> acc_;
  std::vector<float> m_;
  std::vector<float> l_;
};

}  // namespace

namespace {

// The work of one problem: its shapes and the split of the rows' heads into units of work.
CpuProblem cpu_problem(const MlaCpuAttention& a, int threads, std::span<std::uint16_t> out,
                       std::span<float> lse) {
  CpuProblem problem;
  problem.attention = &a;
  problem.page_size = a.page_size;
  problem.num_heads = a.num_heads;
  problem.dc = a.kv_lora_rank;
  problem.dr = a.qk_rope_head_dim;
  problem.score_scale = a.score_scale;
  problem.kv_scale = a.kv_scale;
  problem.q_nope = a.q_nope;
  problem.q_pe = a.q_pe;
  problem.out = out;
  problem.lse = lse;
  // Split heads only when rows alone cannot keep every thread busy (a decode of few requests);
  // each unit decodes its tiles once for all heads of its block.
  const std::size_t rows = static_cast<std::size_t>(a.qo_indptr.back());
  const int want_units_per_row =
      static_cast<int>((2 * static_cast<std::size_t>(threads) + rows - 1) / rows);
  problem.units_per_row = std::clamp(want_units_per_row, 1, a.num_heads);
  problem.heads_per_unit = (a.num_heads + problem.units_per_row - 1) / problem.units_per_row;
  problem.units_per_row = (a.num_heads + problem.heads_per_unit - 1) / problem.heads_per_unit;
  return problem;
}

}  // namespace

void mla_attention_cpu_model(const MlaCpuAttention& a, std::span<std::uint16_t> out,
                             std::span<float> lse) {
  const std::size_t rows = a.qo_indptr.empty() ? 0 : static_cast<std::size_t>(a.qo_indptr.back());
  if (rows == 0 || a.num_heads == 0) return;
  const int threads = resolve_thread_count(a.threads);
  const CpuProblem problem = cpu_problem(a, threads, out, lse);
  const std::size_t units = rows * problem.units_per_row;
  parallel_for(units, threads, [&] {
    return [&problem, worker = TileWorker(problem)](std::size_t unit) mutable {
      const int row = static_cast<int>(unit / problem.units_per_row);
      const int head_begin =
          static_cast<int>(unit % problem.units_per_row) * problem.heads_per_unit;
      const int head_end = std::min(problem.num_heads, head_begin + problem.heads_per_unit);
      worker.run(row, head_begin, head_end);
    };
  });
}

}  // namespace kvaudit
