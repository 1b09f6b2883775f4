// The high-precision MLA reference (math, shapes and error targets: mla_reference.hpp).
//
// Work is split over (row, head) pairs, claimed from an atomic counter by every thread. Each pair
// makes two passes over its visible tokens: scores s_t, then, with m = max_t s_t,
//   l = sum_t exp(s_t - m),  acc = sum_t exp(s_t - m) c_t,  out = scale * acc / l,  lse = m + ln l.
// Subtracting m changes nothing mathematically; it keeps exp in range.
#include "references/mla_reference.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <boost/multiprecision/cpp_bin_float.hpp>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "references/mla_reference_cuda.hpp"
#include "src/core/cpu_clones.hpp"
#include "src/core/parallel_for.hpp"

namespace kvaudit {

// ---- KvRows ------------------------------------------------------------------------------------

KvRows KvRows::from_values(std::span<const float> values, int row_width, double scale,
                           std::span<const float> residuals) {
  KvRows rows;
  rows.values_ = values.data();
  if (!residuals.empty()) rows.values_lo_ = residuals.data();
  rows.row_width_ = row_width;
  rows.num_slots_ = row_width > 0 ? static_cast<std::int64_t>(values.size()) / row_width : 0;
  rows.scale_ = scale;
  return rows;
}

namespace {

// A grouped pool's values code * scale have up to 28 significant bits: each is held as hi + lo,
// hi = fp32(value) and lo = value - hi (at most 4 significant bits, exact as a float unless it
// falls below float's subnormal range, 2^-149).
void decode_grouped_row(const KvPool& pool, std::int64_t slot, float kv_scale, float* hi,
                        float* lo) {
  for (int c = 0; c < pool.row_width; ++c) {
    const double value = pool.dequantized(slot, c, kv_scale);
    hi[c] = static_cast<float>(value);
    lo[c] = static_cast<float>(value - static_cast<double>(hi[c]));
  }
}

void decode_pool_row(const KvPool& pool, std::int64_t slot, float* dst) {
  if (pool.dtype == KvDtype::kBfloat16) {
    for (int c = 0; c < pool.row_width; ++c) dst[c] = bf16_to_float(pool.bf16_bits(slot, c));
  } else {
    const std::uint8_t* codes = pool.row(slot);
    for (int c = 0; c < pool.row_width; ++c) dst[c] = e4m3_decode(codes[c]);
  }
}

}  // namespace

void KvRows::decode_row(const KvPool& pool, float kv_scale, std::int64_t slot, std::int64_t row) {
  float* hi = owned_.data() + row * row_width_;
  if (!pool.grouped()) return decode_pool_row(pool, slot, hi);
  decode_grouped_row(pool, slot, kv_scale, hi, owned_lo_.data() + row * row_width_);
}

// A grouped pool's rows carry their scales (scale 1); the residual array is dropped when every
// value was a float already (power-of-two scales, in range).
void KvRows::finish_grouped(const KvPool& pool) {
  if (!pool.grouped()) return;
  scale_ = 1.0;
  const bool any = std::any_of(owned_lo_.begin(), owned_lo_.end(), [](float v) { return v != 0; });
  if (!any) {
    owned_lo_.clear();
    owned_lo_.shrink_to_fit();
  }
  values_lo_ = owned_lo_.empty() ? nullptr : owned_lo_.data();
}

const float* KvRows::row_lo(std::int64_t slot) const {
  if (values_lo_ == nullptr) return nullptr;
  const float* hi = row(slot);
  return hi == nullptr ? nullptr : values_lo_ + (hi - values_);
}

KvRows KvRows::from_pool(const KvPool& pool, float kv_scale) {
  KvRows rows;
  rows.row_width_ = pool.row_width;
  rows.num_slots_ = pool.num_slots;
  rows.scale_ = kv_scale;
  rows.owned_.resize(static_cast<std::size_t>(pool.num_slots) * pool.row_width);
  if (pool.grouped()) rows.owned_lo_.resize(rows.owned_.size());
  for (std::int64_t s = 0; s < pool.num_slots; ++s) rows.decode_row(pool, kv_scale, s, s);
  rows.values_ = rows.owned_.data();
  rows.finish_grouped(pool);
  return rows;
}

KvRows KvRows::from_pool_slots(const KvPool& pool, float kv_scale,
                               std::span<const std::int64_t> slots) {
  KvRows rows;
  rows.row_width_ = pool.row_width;
  rows.num_slots_ = pool.num_slots;
  rows.scale_ = kv_scale;
  rows.compact_row_.assign(static_cast<std::size_t>(pool.num_slots), -1);
  std::int64_t held = 0;
  for (const std::int64_t s : slots) {
    if (s >= 0 && s < pool.num_slots && rows.compact_row_[s] < 0) rows.compact_row_[s] = held++;
  }
  rows.owned_.resize(static_cast<std::size_t>(held) * pool.row_width);
  if (pool.grouped()) rows.owned_lo_.resize(rows.owned_.size());
  for (std::int64_t s = 0; s < pool.num_slots; ++s) {
    if (rows.compact_row_[s] >= 0) rows.decode_row(pool, kv_scale, s, rows.compact_row_[s]);
  }
  rows.values_ = rows.owned_.data();
  rows.finish_grouped(pool);
  return rows;
}

const float* KvRows::row(std::int64_t slot) const {
  if (slot < 0 || slot >= num_slots_) return nullptr;
  if (compact_row_.empty()) return values_ + slot * row_width_;
  const std::int64_t r = compact_row_[slot];
  return r < 0 ? nullptr : values_ + r * row_width_;
}

namespace {

using Problem = ReferenceProblem;

// The formulas evaluated as written, in Acc (a multiprecision type, or double).
template <class Acc>
class NaiveKernel {
 public:
  explicit NaiveKernel(const Problem& problem)
      : p_(problem), q_(problem.width()), s_(problem.max_visible), acc_(problem.dc) {}

  void run(int row, int head) {
    using std::exp;
    using std::isnan;
    using std::log;
    const int dc = p_.dc;
    const int width = p_.width();
    const float* qn = p_.q_nope_of(row, head);
    const float* qp = p_.q_pe_of(row, head);
    for (int j = 0; j < dc; ++j) q_[j] = Acc(qn[j]);
    for (int j = 0; j < p_.dr; ++j) q_[dc + j] = Acc(qp[j]);
    const auto& rows = p_.token_rows[p_.request_of_row[row]];
    const std::int64_t n = p_.visible_of_row[row];
    const Acc factor = Acc(p_.sm_scale) * Acc(p_.scale);
    const auto* rows_lo =
        p_.token_rows_lo.empty() ? nullptr : &p_.token_rows_lo[p_.request_of_row[row]];
    auto value = [&](std::int64_t t, int j) {
      return rows_lo == nullptr ? Acc(rows[t][j]) : Acc(rows[t][j]) + Acc((*rows_lo)[t][j]);
    };
    for (std::int64_t t = 0; t < n; ++t) {
      Acc dot = 0;
      for (int j = 0; j < width; ++j) dot += q_[j] * value(t, j);
      s_[t] = factor * dot;
      if (isnan(s_[t])) {
        p_.write_nan(row, head);
        return;
      }
    }
    Acc m = s_[0];
    for (std::int64_t t = 1; t < n; ++t) {
      if (s_[t] > m) m = s_[t];
    }
    Acc l = 0;
    for (int d = 0; d < dc; ++d) acc_[d] = 0;
    for (std::int64_t t = 0; t < n; ++t) {
      const Acc e = exp(Acc(s_[t] - m));
      l += e;
      for (int d = 0; d < dc; ++d) acc_[d] += e * value(t, d);
    }
    double* out = p_.out_of(row, head);
    const Acc out_scale = Acc(p_.scale) / l;
    for (int d = 0; d < dc; ++d) out[d] = static_cast<double>(Acc(acc_[d] * out_scale));
    p_.lse[static_cast<std::size_t>(row) * p_.num_heads + head] =
        static_cast<double>(Acc(m + log(l)));
  }

 private:
  const Problem& p_;
  std::vector<Acc> q_;
  std::vector<Acc> s_;
  std::vector<Acc> acc_;
};

// The hot functions are compiled twice on x86-64 Linux (KVAUDIT_CPU_CLONES,
// src/core/cpu_clones.hpp: the x86-64-v3 clone, AVX2 + FMA, where the CPU has it). Contraction into
// FMAs there is harmless: the products in the loops are exact, double_double.hpp's algorithms stay
// error-free under it, and the inexact products (e.lo * c and the like, 2^-106 relative) may only
// round differently between clones, far below the final rounding to double.

// sum_j q_j v_j with each product exact in binary64 (float * float) and the sum compensated:
// kLanes independent TwoSum accumulators (their error terms summed in plain double: error
// <= n u^2 sum_j |q_j v_j|, u = 2^-53), combined in double-double.
KVAUDIT_CPU_CLONES
dd::DoubleDouble compensated_dot(const double* q, const float* v, int n) {
  // Two 4-lane vectors of accumulators (GCC/Clang vector extensions: AVX registers in the x86-64-v3
  // clone, SSE pairs otherwise). Lane k holds the elements j = k mod 8.
  using Double4 = double __attribute__((vector_size(32)));
  using Float4 = float __attribute__((vector_size(16)));
  constexpr int kLanes = 8;
  Double4 hi[2] = {};
  Double4 lo[2] = {};
  int j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int h = 0; h < 2; ++h) {
      Double4 qv;
      Float4 vv;
      std::memcpy(&qv, q + j + 4 * h, sizeof qv);
      std::memcpy(&vv, v + j + 4 * h, sizeof vv);
      const Double4 prod = qv * __builtin_convertvector(vv, Double4);
      const Double4 s = hi[h] + prod;
      const Double4 bb = s - hi[h];
      lo[h] += (hi[h] - (s - bb)) + (prod - bb);
      hi[h] = s;
    }
  }
  double tail_hi = 0.0;
  double tail_lo = 0.0;
  for (; j < n; ++j) {
    const double prod = q[j] * static_cast<double>(v[j]);
    const double s = tail_hi + prod;
    const double bb = s - tail_hi;
    tail_lo += (tail_hi - (s - bb)) + (prod - bb);
    tail_hi = s;
  }
  dd::DoubleDouble sum = dd::two_sum(tail_hi, tail_lo);
  for (int h = 0; h < 2; ++h) {
    for (int k = 0; k < 4; ++k) sum = dd::add(sum, dd::two_sum(hi[h][k], lo[h][k]));
  }
  return sum;
}

// acc += e * v over v's first n elements (e double-double, v floats), acc as (hi, lo) arrays.
// e.hi = h1 + h2 with <= 26 and <= 27 significant bits: h1 * c and h2 * c are exact (c is a
// float), and are added with TwoSum; e.lo * c is 2^-53 smaller, so its rounding is below 2^-106.
// The form for CPUs without fused multiply-add (17 operations per element); where the x86-64-v3
// clone would apply, accumulate_weighted_row takes the fma form instead, so it has no clones.
void accumulate_weighted_row_split(dd::DoubleDouble e, const float* v, int n, double* acc_hi,
                                   double* acc_lo) {
  double h1, h2;
  dd::split_truncate(e.hi, h1, h2);
  const double el = e.lo;
  for (int d = 0; d < n; ++d) {
    const double c = v[d];
    const double p1 = h1 * c;
    const double p2 = h2 * c;
    const double s1 = acc_hi[d] + p1;
    double bb = s1 - acc_hi[d];
    const double e1 = (acc_hi[d] - (s1 - bb)) + (p1 - bb);
    const double s2 = s1 + p2;
    bb = s2 - s1;
    const double e2 = (s1 - (s2 - bb)) + (p2 - bb);
    acc_hi[d] = s2;
    acc_lo[d] += (e1 + e2) + el * c;
  }
}

#if defined(KVAUDIT_HAVE_CPU_V3_TARGET)
// The same sum where fused multiply-add is an instruction (10 operations per element): the
// product e.hi * c is p + p_error exactly (TwoProd: p = fma(e.hi, c, 0), the product rounded
// once, p_error = fma(e.hi, c, -p)), p is added with TwoSum and p_error + e.lo * c go to the low
// word, as in the GPU reference. p is made by an fma call rather than `e.hi * c` so that the
// compiler cannot contract it into the TwoSum's additions (that would change what the TwoSum's
// error term means); every other product here is exact or lands in the low word.
KVAUDIT_CPU_V3_TARGET
void accumulate_weighted_row_fma(dd::DoubleDouble e, const float* v, int n, double* acc_hi,
                                 double* acc_lo) {
  const double h = e.hi;
  const double el = e.lo;
  for (int d = 0; d < n; ++d) {
    const double c = v[d];
    const double p = __builtin_fma(h, c, 0.0);
    const double p_error = __builtin_fma(h, c, -p);
    const double s = acc_hi[d] + p;
    const double bb = s - acc_hi[d];
    const double err = (acc_hi[d] - (s - bb)) + (p - bb);
    acc_hi[d] = s;
    acc_lo[d] += err + __builtin_fma(el, c, p_error);
  }
}
#endif

void accumulate_weighted_row(dd::DoubleDouble e, const float* v, int n, double* acc_hi,
                             double* acc_lo) {
#if defined(KVAUDIT_HAVE_CPU_V3_TARGET)
  if (kvaudit_cpu_has_v3()) return accumulate_weighted_row_fma(e, v, n, acc_hi, acc_lo);
#endif
  accumulate_weighted_row_split(e, v, n, acc_hi, acc_lo);
}

// exp in double-double (references/double_double.hpp), cloned so that its two_prod calls become
// fused multiply-add instructions where the CPU has them.
KVAUDIT_CPU_CLONES
dd::DoubleDouble weight_exp(dd::DoubleDouble x) { return dd::exp(x); }

// The default: double-double with exact products (see mla_reference.hpp).
class DoubleDoubleKernel {
 public:
  explicit DoubleDoubleKernel(const Problem& problem)
      : p_(problem),
        q_(problem.width()),
        s_(problem.max_visible),
        acc_hi_(problem.dc),
        acc_lo_(problem.dc) {}

  void run(int row, int head) {
    const int dc = p_.dc;
    const int width = p_.width();
    const float* qn = p_.q_nope_of(row, head);
    const float* qp = p_.q_pe_of(row, head);
    for (int j = 0; j < dc; ++j) q_[j] = qn[j];
    for (int j = 0; j < p_.dr; ++j) q_[dc + j] = qp[j];
    const auto& rows = p_.token_rows[p_.request_of_row[row]];
    const std::int64_t n = p_.visible_of_row[row];
    const dd::DoubleDouble factor = dd::two_prod(p_.sm_scale, p_.scale);
    double m = -std::numeric_limits<double>::infinity();
    const auto* rows_lo =
        p_.token_rows_lo.empty() ? nullptr : &p_.token_rows_lo[p_.request_of_row[row]];
    for (std::int64_t t = 0; t < n; ++t) {
      dd::DoubleDouble dot = compensated_dot(q_.data(), rows[t], width);
      if (rows_lo != nullptr) dot = dd::add(dot, compensated_dot(q_.data(), (*rows_lo)[t], width));
      s_[t] = dd::mul(dot, factor);
      if (std::isnan(s_[t].hi)) {
        p_.write_nan(row, head);
        return;
      }
      m = std::max(m, s_[t].hi);
    }
    std::fill(acc_hi_.begin(), acc_hi_.end(), 0.0);
    std::fill(acc_lo_.begin(), acc_lo_.end(), 0.0);
    double* acc_hi = acc_hi_.data();
    double* acc_lo = acc_lo_.data();
    dd::DoubleDouble l{0.0, 0.0};
    for (std::int64_t t = 0; t < n; ++t) {
      const dd::DoubleDouble e = weight_exp(dd::add(s_[t], -m));
      l = dd::add(l, e);
      accumulate_weighted_row(e, rows[t], dc, acc_hi, acc_lo);
      if (rows_lo != nullptr) accumulate_weighted_row(e, (*rows_lo)[t], dc, acc_hi, acc_lo);
    }
    double* out = p_.out_of(row, head);
    for (int d = 0; d < dc; ++d) {
      const dd::DoubleDouble acc = dd::two_sum(acc_hi[d], acc_lo[d]);
      out[d] = dd::to_double(dd::mul(dd::div(acc, l), p_.scale));
    }
    p_.lse[static_cast<std::size_t>(row) * p_.num_heads + head] =
        dd::to_double(dd::add(dd::log(l), m));
  }

 private:
  const Problem& p_;
  std::vector<double> q_;
  std::vector<dd::DoubleDouble> s_;
  std::vector<double> acc_hi_;
  std::vector<double> acc_lo_;
};

// The number type of an accumulation tag: Boost's for the multiprecision tags (kept out of the
// header), the type itself otherwise.
template <class Acc>
struct NumberOf {
  using type = Acc;
};
template <>
struct NumberOf<Float50> {
  using type = boost::multiprecision::cpp_bin_float_50;
};
template <>
struct NumberOf<Float100> {
  using type = boost::multiprecision::cpp_bin_float_100;
};

template <class Acc>
struct KernelFor {
  using type = NaiveKernel<typename NumberOf<Acc>::type>;
};
template <>
struct KernelFor<dd::DoubleDouble> {
  using type = DoubleDoubleKernel;
};

// Sizes the step and attrs imply: KV rows of width Dc + Dr, q_nope and out [Nq, H, Dc], q_pe
// [Nq, H, Dr], lse [Nq, H].
Status check_reference_sizes(const DumpAttributes& attrs, const StepMeta& step,
                             const Problem& problem, const KvRows& kv, const std::string& where) {
  const std::size_t rows = static_cast<std::size_t>(step.num_rows());
  const std::size_t heads = static_cast<std::size_t>(attrs.num_heads);
  const std::size_t dc = static_cast<std::size_t>(attrs.kv_lora_rank);
  const std::size_t dr = static_cast<std::size_t>(attrs.qk_rope_head_dim);
  if (kv.row_width() != attrs.row_width()) {
    return bad_input(where, fmt::format("KV rows have width {}, expected Dc + Dr = {}",
                                        kv.row_width(), attrs.row_width()));
  }
  if (problem.q_nope.size() != rows * heads * dc || problem.q_pe.size() != rows * heads * dr ||
      problem.out.size() != rows * heads * dc || problem.lse.size() != rows * heads) {
    return bad_input(where, "q_nope/q_pe/out/lse sizes disagree with [Nq, H, Dc/Dr]");
  }
  return ok_status();
}

// The KV row of every token position of every request that has rows (kvdump-v1: a request with
// no rows is skipped); every one must be held by `kv`.
Status resolve_token_rows(const StepMeta& step, int page_size, const KvRows& kv,
                          const std::string& where, Problem* problem) {
  problem->token_rows.resize(step.batch_size());
  if (kv.has_residual()) problem->token_rows_lo.resize(step.batch_size());
  for (int b = 0; b < step.batch_size(); ++b) {
    if (step.rows_of(b) == 0) continue;
    const std::int64_t len = step.kv_len(b, page_size);
    auto& token_rows = problem->token_rows[b];
    token_rows.resize(static_cast<std::size_t>(len));
    if (kv.has_residual()) problem->token_rows_lo[b].resize(static_cast<std::size_t>(len));
    for (std::int64_t p = 0; p < len; ++p) {
      const std::int64_t slot = step.slot_of(b, p, page_size);
      token_rows[p] = kv.row(slot);
      if (kv.has_residual()) problem->token_rows_lo[b][p] = kv.row_lo(slot);
      if (token_rows[p] == nullptr) {
        return internal_error(
            where,
            fmt::format("KV rows do not hold slot {} (position {} of request {})", slot, p, b));
      }
    }
  }
  return ok_status();
}

// Each query row's request and visible tokens (pos + 1). Returns the work in row*head*token units.
std::int64_t resolve_query_rows(const StepMeta& step, int page_size, Problem* problem) {
  const std::size_t rows = static_cast<std::size_t>(step.num_rows());
  std::int64_t work = 0;
  problem->request_of_row.resize(rows);
  problem->visible_of_row.resize(rows);
  for (std::size_t i = 0; i < rows; ++i) {
    const int row = static_cast<int>(i);
    problem->request_of_row[i] = step.request_of_row(row);
    problem->visible_of_row[i] = step.position_of_row(row, page_size) + 1;
    problem->max_visible = std::max<std::int64_t>(problem->max_visible, problem->visible_of_row[i]);
    work += problem->visible_of_row[i] * static_cast<std::int64_t>(problem->num_heads);
  }
  return work;
}

}  // namespace

namespace {

// The problem of one call, checked and resolved; returns the work in row*head*token units.
Result<std::int64_t> resolve_problem(const DumpAttributes& attrs, const StepMeta& step,
                                     std::span<const float> q_nope, std::span<const float> q_pe,
                                     const KvRows& kv, std::span<double> out, std::span<double> lse,
                                     const std::string& where, Problem* problem) {
  KVAUDIT_TRY(check_step_indices(step, attrs.page_size, kv.num_slots()));
  problem->num_heads = attrs.num_heads;
  problem->dc = attrs.kv_lora_rank;
  problem->dr = attrs.qk_rope_head_dim;
  problem->sm_scale = attrs.sm_scale;
  problem->scale = kv.scale();
  problem->q_nope = q_nope;
  problem->q_pe = q_pe;
  problem->out = out;
  problem->lse = lse;
  KVAUDIT_TRY(check_reference_sizes(attrs, step, *problem, kv, where));
  KVAUDIT_TRY(resolve_token_rows(step, attrs.page_size, kv, where, problem));
  return resolve_query_rows(step, attrs.page_size, problem);
}

}  // namespace

template <class Acc>
Result<std::int64_t> mla_reference_attention(const DumpAttributes& attrs, const StepMeta& step,
                                             std::span<const float> q_nope,
                                             std::span<const float> q_pe, const KvRows& kv,
                                             std::span<double> out, std::span<double> lse,
                                             int threads) {
  const std::string where = "reference step " + step.group;
  Problem problem;
  KVAUDIT_ASSIGN_OR_RETURN(const std::int64_t work, resolve_problem(attrs, step, q_nope, q_pe, kv,
                                                                    out, lse, where, &problem));
  // One kernel (with its scratch) per thread; pair = row * H + head.
  const std::size_t heads = static_cast<std::size_t>(attrs.num_heads);
  parallel_for(static_cast<std::size_t>(step.num_rows()) * heads, threads, [&] {
    return [&problem, heads,
            kernel = typename KernelFor<Acc>::type(problem)](std::size_t pair) mutable {
      kernel.run(static_cast<int>(pair / heads), static_cast<int>(pair % heads));
    };
  });
  return work;
}

std::string_view reference_device_name(ReferenceDevice device) {
  return device == ReferenceDevice::kCuda ? "cuda" : "cpu";
}

bool reference_device_built(ReferenceDevice device) {
#if defined(KVAUDIT_HAVE_CUDA)
  (void)device;
  return true;
#else
  return device == ReferenceDevice::kCpu;
#endif
}

Result<std::int64_t> exact_reference_attention(ReferenceDevice device, const DumpAttributes& attrs,
                                               const StepMeta& step, std::span<const float> q_nope,
                                               std::span<const float> q_pe, const KvRows& kv,
                                               std::span<double> out, std::span<double> lse,
                                               int threads) {
  if (device == ReferenceDevice::kCpu) {
    return mla_reference_attention(attrs, step, q_nope, q_pe, kv, out, lse, threads);
  }
  const std::string where = "GPU reference step " + step.group;
#if defined(KVAUDIT_HAVE_CUDA)
  if (kv.has_residual()) {
    return unsupported(where,
                       "per-token-group float32 scales make KV values of up to 28 "
                       "significant bits, held as two floats; the GPU reference reads one "
                       "float per value: use --reference cpu for this dump");
  }
  Problem problem;
  KVAUDIT_ASSIGN_OR_RETURN(const std::int64_t work, resolve_problem(attrs, step, q_nope, q_pe, kv,
                                                                    out, lse, where, &problem));
  KVAUDIT_TRY(mla_reference_attention_cuda(problem, where));
  return work;
#else
  return unsupported(where, "this kvaudit was built without CUDA (KVAUDIT_CUDA=OFF)");
#endif
}

#define KVAUDIT_INSTANTIATE_REFERENCE(Acc)                                                    \
  template Result<std::int64_t> mla_reference_attention<Acc>(                                 \
      const DumpAttributes&, const StepMeta&, std::span<const float>, std::span<const float>, \
      const KvRows&, std::span<double>, std::span<double>, int);

KVAUDIT_INSTANTIATE_REFERENCE(dd::DoubleDouble)
KVAUDIT_INSTANTIATE_REFERENCE(double)
KVAUDIT_INSTANTIATE_REFERENCE(Float50)
KVAUDIT_INSTANTIATE_REFERENCE(Float100)

#undef KVAUDIT_INSTANTIATE_REFERENCE

}  // namespace kvaudit
