// The cpu-fp8 backend: CPU model of the FP8 MLA attention kernels (math and rounding points in
// src/backend/mla_attention_cpu.hpp and kernels/mla_attention_model.hpp).
//
// Work is split over (query row, block of heads) units, claimed from an atomic counter. A unit
// walks its row's visible tokens one 64-token tile at a time (the GPU's tile, mla::kKvTileTokens),
// decodes the tile once into fp32 in two layouts, and updates every head of its block:
//   tile_rows : [tile, D]  for P.V (acc[d] += p_t * v_t[d], vectorised over d)
//   tile_cols : [D, tile]  for the scores (s[t] += q_j * k_t[j], vectorised over t, so that each
//                          token's dot product is still summed in index order j = 0, 1, ...)
// Both products are exact in fp32 (see the header), so fused or separate multiply-add give the
// same bits there. TileWorker's steps are named after the kernel's phases (stage_q, load_tile for
// the tile decode, qk_scores, online_softmax_update, rescale_and_accumulate_pv, the epilogue), and
// write_new_kv applies the write rules of src/backend/injection.hpp that the CUDA write kernel
// applies.
#include "src/backend/mla_attention_cpu.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "kernels/mla_attention_model.hpp"
#include "src/backend/mla_attention_operands.hpp"
#include "src/core/fp8_e4m3.hpp"
#include "src/core/parallel_for.hpp"
#include "src/format/step_indices.hpp"

namespace kvaudit {

Result<Injection> parse_cpu_injection(std::string_view name) { return parse_injection(name); }

float mla_score_scale(double sm_scale, float kv_scale) {
  return static_cast<float>(sm_scale * static_cast<double>(kv_scale) * mla::kLog2e);
}

namespace {

// ---- the KV write -------------------------------------------------------------------------------

// One new_kv row as the shared write rules read it (kv_write_code, src/backend/injection.hpp):
// fp32 values (kvdump's new_kv may be float32), their bf16 bits where a rule needs them.
struct FloatRowView {
  const float* values;

  float value(int col) const { return values[col]; }
  std::uint16_t bf16_bits(int col) const { return bf16_from_float(values[col]); }
};

// new_kv holds one row of pool.row_width values per new_kv_slots entry, each slot in the pool.
Status check_new_kv(const StepMeta& step, std::span<const float> new_kv, const KvPool& pool) {
  const std::string where = fmt::format("write step {}", step.group);
  const std::size_t rows = step.new_kv_slots.size();
  if (new_kv.size() != rows * static_cast<std::size_t>(pool.row_width)) {
    return bad_input(where, fmt::format("new_kv has {} values, expected {} rows of {}",
                                        new_kv.size(), rows, pool.row_width));
  }
  for (std::size_t i = 0; i < rows; ++i) {
    const std::int64_t slot = step.new_kv_slots[i];
    if (slot < 0 || slot >= pool.num_slots) {
      return bad_input(where, fmt::format("new_kv_slots[{}] = {} is outside the pool", i, slot));
    }
  }
  return ok_status();
}

// dst[c] = kv_write_code<rule>(values, c) for the row's `width` elements (an fp8 slot).
void write_fp8_row(KvWriteRule rule, const float* values, int width, float kv_scale,
                   std::uint8_t* dst) {
  dispatch_kv_write_rule(rule, [&](auto kind) {
    const FloatRowView row{values};
    for (int c = 0; c < width; ++c) {
      dst[c] = kv_write_code<decltype(kind)::value, HostE4m3Rounding>(row, c, kv_scale);
    }
  });
}

}  // namespace

Status write_new_kv(const StepMeta& step, std::span<const float> new_kv, float kv_scale,
                    bool reciprocal_scale, KvPool& pool, Injection injection) {
  KVAUDIT_TRY(check_new_kv(step, new_kv, pool));
  // The same rule and slot the CUDA write kernel applies (src/backend/injection.hpp).
  const KvWriteRule rule = kv_write_rule_of(injection, reciprocal_scale);
  const int slot_offset = kv_write_slot_offset(injection);
  const int width = pool.row_width;
  for (std::size_t i = 0; i < step.new_kv_slots.size(); ++i) {
    std::int64_t slot = step.new_kv_slots[i];
    if (slot_offset != 0) slot = (slot + slot_offset) % pool.num_slots;
    const float* values = new_kv.data() + i * width;
    if (pool.dtype == KvDtype::kFloat8E4m3fn) {
      write_fp8_row(rule, values, width, kv_scale, pool.row(slot));
    } else {
      pool.write_row(slot, values, kv_scale);  // a bf16 pool stores the bf16 bits of v
    }
  }
  return ok_status();
}

namespace {

constexpr int kTile = mla::kKvTileTokens;

std::array<float, 256> make_e4m3_table() {
  std::array<float, 256> table{};
  for (int code = 0; code < 256; ++code) table[code] = e4m3_decode(static_cast<std::uint8_t>(code));
  return table;
}

const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> table = make_e4m3_table();
  return table;
}

struct CpuProblem {
  const StepMeta* step = nullptr;
  const KvPool* pool = nullptr;
  int page_size = 1;
  int num_heads = 0;
  int dc = 0;
  int dr = 0;
  int heads_per_unit = 1;
  int units_per_row = 1;
  float score_scale = 0.0f;
  float kv_scale = 1.0f;
  Injection injection = Injection::kNone;
  std::span<const float> q_nope;
  std::span<const float> q_pe;
  AttentionOutput* output = nullptr;

  int width() const { return dc + dr; }
};

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
    const StepMeta& step = *p_.step;
    const int dc = p_.dc;
    const int heads = head_end - head_begin;
    const int request = step.request_of_row(row);
    const std::int64_t visible = step.position_of_row(row, p_.page_size) + 1;
    stage_q(row, head_begin, heads);

    // Injection masked-nan-leak: the last tile also reads the rest of the request's last page
    // (unused slots) with a zero weight, as a kernel that masks by multiplying would.
    std::int64_t readable = visible;
    if (p_.injection == Injection::kMaskedNanLeak) {
      const std::int64_t pages = step.kv_indptr[request + 1] - step.kv_indptr[request];
      readable = pages * p_.page_size;
    }
    for (std::int64_t t0 = 0; t0 < visible; t0 += kTile) {
      const int n = static_cast<int>(std::min<std::int64_t>(kTile, visible - t0));
      const int n_read = static_cast<int>(std::min<std::int64_t>(kTile, readable - t0));
      load_tile(request, t0, n_read);
      for (int h = 0; h < heads; ++h) update_head(h, n, n_read);
    }

    // Epilogue: out = bf16(acc * (kv_scale / l)), lse = (m + log2 l) * ln 2. Kept inline here: as
    // a function of its own, GCC orders the operands of the NaN-producing products and sums
    // differently, and the sign of a NaN output (an injected fault's) changes.
    AttentionOutput& out = *p_.output;
    const float ln2 = static_cast<float>(mla::kLn2);
    for (int h = 0; h < heads; ++h) {
      const std::size_t oi = static_cast<std::size_t>(row) * p_.num_heads + head_begin + h;
      const float factor = p_.kv_scale / l_[h];
      const float* acc = acc_.data() + static_cast<std::size_t>(h) * dc;
      std::uint16_t* o = out.out_bf16.data() + oi * dc;
      for (int d = 0; d < dc; ++d) o[d] = bf16_from_float(acc[d] * factor);
      out.lse[oi] = (m_[h] + std::log2(l_[h])) * ln2;
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
    const KvPool& pool = *p_.pool;
    const int width = p_.width();
    const auto& table = e4m3_table();
    for (int t = 0; t < n; ++t) {
      const std::int64_t slot = p_.step->slot_of(request, t0 + t, p_.page_size);
      float* dst = tile_rows_.data() + static_cast<std::size_t>(t) * width;
      if (p_.injection == Injection::kFp8ReadAsBf16 && pool.dtype == KvDtype::kFloat8E4m3fn) {
        // The kv_data_type mix-up: the fp8 byte buffer addressed as a [S, D] bf16 array (reads
        // past the buffer's end, which a GPU would make out of bounds, give 0 here).
        for (int j = 0; j < width; ++j) {
          const std::size_t byte = 2 * (static_cast<std::size_t>(slot) * width + j);
          dst[j] = byte + 1 < pool.bytes.size()
                       ? bf16_to_float(static_cast<std::uint16_t>(pool.bytes[byte] |
                                                                  (pool.bytes[byte + 1] << 8)))
                       : 0.0f;
        }
      } else if (pool.dtype == KvDtype::kBfloat16) {
        for (int j = 0; j < width; ++j) dst[j] = bf16_to_float(pool.bf16_bits(slot, j));
      } else {
        const std::uint8_t* codes = pool.row(slot);
        for (int j = 0; j < width; ++j) dst[j] = table[codes[j]];
      }
    }
    for (int t = 0; t < n; ++t) {
      const float* src = tile_rows_.data() + static_cast<std::size_t>(t) * width;
      for (int j = 0; j < width; ++j) tile_cols_[static_cast<std::size_t>(j) * kTile + t] = src[j];
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

  // s[t] = q . k_t for the tile's n visible tokens, each summed in index order j = 0, 1, ...
  void qk_scores(int h, int n, float (&s)[kTile]) const {
    const int width = p_.width();
    const float* q = q_.data() + static_cast<std::size_t>(h) * width;
    for (int t = 0; t < n; ++t) s[t] = 0.0f;
    for (int j = 0; j < width; ++j) {
      const float qj = q[j];
      const float* col = tile_cols_.data() + static_cast<std::size_t>(j) * kTile;
      for (int t = 0; t < n; ++t) s[t] += qj * col[t];
    }
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
    for (int d = 0; d < dc; ++d) acc[d] *= alpha;
    for (int t = 0; t < n_read; ++t) {
      const float pb = bf16_round(p[t]);  // mla::kRoundProbabilitiesToBf16
      const float* v = tile_rows_.data() + static_cast<std::size_t>(t) * width;
      for (int d = 0; d < dc; ++d) acc[d] += pb * v[d];
    }
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

Status check_attention_inputs(const DumpAttributes& attrs, const StepMeta& step,
                              std::span<const float> q_nope, std::span<const float> q_pe,
                              const KvPool& pool) {
  const std::string where = fmt::format("cpu-fp8 step {}", step.group);
  if (pool.row_width != attrs.row_width()) {
    return bad_input(where, fmt::format("pool rows have {} elements, expected Dc + Dr = {}",
                                        pool.row_width, attrs.row_width()));
  }
  if (pool.dtype != attrs.kv_dtype) {
    return bad_input(where, fmt::format("pool holds {} but the dump's kv_dtype is {}",
                                        kv_dtype_name(pool.dtype), kv_dtype_name(attrs.kv_dtype)));
  }
  KVAUDIT_TRY(check_step_indices(step, attrs.page_size, pool.num_slots));
  const std::size_t rows = static_cast<std::size_t>(step.num_rows());
  const std::size_t heads = static_cast<std::size_t>(attrs.num_heads);
  if (q_nope.size() != rows * heads * attrs.kv_lora_rank ||
      q_pe.size() != rows * heads * attrs.qk_rope_head_dim) {
    return bad_input(where, "q_nope/q_pe sizes disagree with [Nq, H, Dc/Dr]");
  }
  return ok_status();
}

// The work of one step: its shapes, the scales the attention reads with (the scale-mismatch fault
// changes them) and the split of the rows' heads into units of work.
CpuProblem cpu_problem(const DumpAttributes& attrs, const StepMeta& step, float kv_scale,
                       std::span<const float> q_nope, std::span<const float> q_pe,
                       const KvPool& pool, Injection injection, int threads,
                       AttentionOutput& output) {
  CpuProblem problem;
  problem.step = &step;
  problem.pool = &pool;
  problem.page_size = attrs.page_size;
  problem.num_heads = attrs.num_heads;
  problem.dc = attrs.kv_lora_rank;
  problem.dr = attrs.qk_rope_head_dim;
  // Injection scale-mismatch: dequantize with a scale other than the one the write used.
  const float read_scale =
      injection == Injection::kScaleMismatch ? power_of_two_scale(kv_scale) : kv_scale;
  problem.score_scale = mla_score_scale(attrs.sm_scale, read_scale);
  problem.kv_scale = read_scale;
  problem.injection = injection;
  problem.q_nope = q_nope;
  problem.q_pe = q_pe;
  problem.output = &output;
  // Split heads only when rows alone cannot keep every thread busy (a decode of few requests);
  // each unit decodes its tiles once for all heads of its block.
  const std::size_t rows = static_cast<std::size_t>(step.num_rows());
  const int want_units_per_row =
      static_cast<int>((2 * static_cast<std::size_t>(threads) + rows - 1) / rows);
  problem.units_per_row = std::clamp(want_units_per_row, 1, attrs.num_heads);
  problem.heads_per_unit = (attrs.num_heads + problem.units_per_row - 1) / problem.units_per_row;
  problem.units_per_row = (attrs.num_heads + problem.heads_per_unit - 1) / problem.heads_per_unit;
  return problem;
}

}  // namespace

Result<AttentionOutput> mla_attention_cpu(const DumpAttributes& attrs, const StepMeta& step,
                                          float kv_scale, std::span<const float> q_nope,
                                          std::span<const float> q_pe, const KvPool& pool,
                                          const MlaAttentionCpuOptions& options) {
  KVAUDIT_TRY(check_attention_inputs(attrs, step, q_nope, q_pe, pool));
  const std::size_t rows = static_cast<std::size_t>(step.num_rows());
  const std::size_t heads = static_cast<std::size_t>(attrs.num_heads);
  AttentionOutput output;
  output.out_bf16.assign(rows * heads * attrs.kv_lora_rank, 0);
  output.lse.assign(rows * heads, 0.0f);
  if (rows == 0 || heads == 0) return output;

  const int threads = resolve_thread_count(options.threads);
  const CpuProblem problem =
      cpu_problem(attrs, step, kv_scale, q_nope, q_pe, pool, options.injection, threads, output);
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
  return output;
}

namespace {

class CpuFp8Backend final : public Backend {
 public:
  CpuFp8Backend(const BackendOptions& options, Injection injection)
      : options_(options), injection_(injection) {}

  std::string name() const override { return "cpu-fp8"; }

  nlohmann::json describe() const override {
    return {
        {"name", "cpu-fp8"},
        {"device", "cpu"},
        {"threads", resolve_thread_count(options_.threads)},
        {"kv_tile_tokens", mla::kKvTileTokens},
        {"injection", injection_ == Injection::kNone ? "none" : injection_info(injection_).name},
        {"write_rule", options_.reciprocal_scale
                           ? "e4m3_rne_satfinite(x * fp32(1 / kv_scale)) (reciprocal_scale)"
                           : "e4m3_rne_satfinite(fp32(x) / fp32(kv_scale)) (kvdump)"},
        {"rounding",
         {{"q", "bf16"},
          {"kv", "codes decoded exactly, kv_scale folded into the score and the output"},
          {"dot", "fp32, sequential in index order"},
          {"score_scale", "fp32(sm_scale * kv_scale * log2 e)"},
          {"softmax", "online, base 2, 64-token tiles in token order, exp2f, fp32 l"},
          {"p", "bf16 before P.V"},
          {"acc", "fp32"},
          {"out", "bf16(acc * (kv_scale / l))"},
          {"lse", "fp32 (m + log2 l) * ln 2"}}},
    };
  }

  Result<AttentionOutput> run_step(const StepLayerInput& input, KvPool& pool) override {
    const std::string where = fmt::format("cpu-fp8 {}/{}", input.step.group, input.layer.group);
    if (pool.dtype != input.attrs.kv_dtype || pool.row_width != input.attrs.row_width()) {
      return bad_input(where, "pool type or row width disagrees with the dump attributes");
    }
    KVAUDIT_TRY(check_injection_applies(injection_, input.attrs.kv_scale_kind));
    KVAUDIT_TRY(check_step_indices(input.step, input.attrs.page_size, pool.num_slots));
    if (pool.grouped()) {
      KVAUDIT_TRY(write_grouped_step(input.step, input.tensors.new_kv, input.layer.kv_scale,
                                     options_.reciprocal_scale, pool, injection_));
    } else {
      KVAUDIT_TRY(write_new_kv(input.step, input.tensors.new_kv, input.layer.kv_scale,
                               options_.reciprocal_scale, pool, injection_));
    }
    const AttentionOperands operands = attention_operands(input, pool, injection_);
    MlaAttentionCpuOptions options;
    options.threads = options_.threads;
    options.injection = injection_;
    if (injection_ == Injection::kWholePoolCast && !pool.grouped() &&
        pool.dtype == KvDtype::kFloat8E4m3fn) {
      // The seed's path: a bf16 copy of the whole pool on every call (exact: e4m3 values are
      // bf16 values), then attention on the copy with the same kv_scale. Same numbers, more
      // time and memory: only the bench's pool sweep can see it.
      KvPool cast = KvPool::zeros(KvDtype::kBfloat16, pool.num_slots, pool.row_width);
      for (std::size_t e = 0; e < pool.bytes.size(); ++e) {
        const std::uint16_t bits = bf16_from_float(e4m3_decode(pool.bytes[e]));
        cast.bytes[2 * e] = static_cast<std::uint8_t>(bits & 0xFF);
        cast.bytes[2 * e + 1] = static_cast<std::uint8_t>(bits >> 8);
      }
      DumpAttributes cast_attrs = operands.view.attrs;
      cast_attrs.kv_dtype = KvDtype::kBfloat16;
      return mla_attention_cpu(cast_attrs, operands.view.step, input.layer.kv_scale,
                               input.tensors.q_nope, input.tensors.q_pe, cast, options);
    }
    return mla_attention_cpu(operands.view.attrs, operands.view.step, operands.kv_scale,
                             input.tensors.q_nope, input.tensors.q_pe, operands.pool_to_read(pool),
                             options);
  }

 private:
  BackendOptions options_;
  Injection injection_;
};

}  // namespace

Result<std::unique_ptr<Backend>> make_cpu_fp8_backend(const BackendOptions& options) {
  KVAUDIT_ASSIGN_OR_RETURN(const Injection injection, parse_cpu_injection(options.injection));
  return std::unique_ptr<Backend>(std::make_unique<CpuFp8Backend>(options, injection));
}

}  // namespace kvaudit
