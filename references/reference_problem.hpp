// One call of the exact MLA reference, resolved for whichever device evaluates it (the CPU loops
// in mla_reference.cpp, the GPU kernels in mla_reference_cuda.cu). Math and shapes:
// mla_reference.hpp. This header has no Boost and no CUDA, so both compilers read it.
//
// For query row i (request b = request_of_row[i], visible tokens t = 0 .. visible_of_row[i] - 1)
// and head h:   q = [q_nope[i,h,:], q_pe[i,h,:]]   (width Dc + Dr)
//               k_t = token_rows[b][t]            (width Dc + Dr; v_t = its first Dc values)
//               s_t = sm_scale * scale * (q . k_t),  out[i,h,:] = scale * sum_t softmax(s)_t v_t.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

namespace kvaudit {

struct ReferenceProblem {
  int num_heads = 0;
  int dc = 0;  // kv_lora_rank
  int dr = 0;  // qk_rope_head_dim
  double sm_scale = 0.0;
  double scale = 1.0;             // the KV multiplier (kv_scale), kept apart from the float values
  std::span<const float> q_nope;  // [Nq, H, Dc]
  std::span<const float> q_pe;    // [Nq, H, Dr]
  std::span<double> out;          // [Nq, H, Dc]
  std::span<double> lse;          // [Nq, H]
  std::vector<int> request_of_row;                    // [Nq]
  std::vector<std::int64_t> visible_of_row;           // [Nq]: position + 1
  std::vector<std::vector<const float*>> token_rows;  // per request: KV row of each position
  // Per request, the residual row of each position (KvRows::row_lo: value = row + row_lo), or
  // empty where the values are floats (every v1 pool).
  std::vector<std::vector<const float*>> token_rows_lo;
  std::int64_t max_visible = 0;
  // KvRows::magnitude_bits() where the rows have a value grid (KvRows::has_value_grid), else -1:
  // the CPU reference's exact sliced path reads it; the GPU reference ignores it.
  int value_grid_bits = -1;
  // Where value_grid_bits < 0 and KvRows found per-row grids (KvRows::has_row_grids):
  // KvRows::kRowGridBits, and per request whether each position's row spans at most that many
  // bits (1) or not (0); else -1 and empty. The CPU reference slices those rows' scores; the GPU
  // reference ignores it.
  int row_grid_bits = -1;
  std::vector<std::vector<std::uint8_t>> token_on_grid;
  int threads = 0;  // host threads for the GPU reference's copies (0: every core)

  int width() const { return dc + dr; }
  int num_rows() const { return static_cast<int>(request_of_row.size()); }
  const float* q_nope_of(int row, int head) const {
    return q_nope.data() + (static_cast<std::size_t>(row) * num_heads + head) * dc;
  }
  const float* q_pe_of(int row, int head) const {
    return q_pe.data() + (static_cast<std::size_t>(row) * num_heads + head) * dr;
  }
  double* out_of(int row, int head) const {
    return out.data() + (static_cast<std::size_t>(row) * num_heads + head) * dc;
  }
  void write_nan(int row, int head) const {
    const double nan = std::numeric_limits<double>::quiet_NaN();
    std::fill_n(out_of(row, head), dc, nan);
    lse[static_cast<std::size_t>(row) * num_heads + head] = nan;
  }
};

// Where each request's token 0 lies in the gathered KV rows (row units): [num requests + 1], the
// last entry the total sum_b T_b.
std::vector<long long> gathered_row_offsets(const ReferenceProblem& p);
// Copies the KV row of every token of every request, in token order, to dst [sum_b T_b, Dc + Dr]
// (request b from row offsets[b]), rows shared over p.threads threads. Pure data movement: each row
// lands in its own place whatever the thread count.
void gather_token_rows(const ReferenceProblem& p, const std::vector<long long>& offsets,
                       float* dst);

}  // namespace kvaudit
