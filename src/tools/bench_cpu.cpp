#include "src/tools/bench_cpu.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <span>
#include <vector>

#include "references/mla_reference.hpp"
#include "src/core/cpu_clones.hpp"
#include "src/core/fp8_e4m3.hpp"
#include "src/core/parallel_for.hpp"
#include "src/format/kvdump.hpp"
#include "src/tools/model_presets.hpp"

namespace kvaudit::bench {
namespace {

constexpr int kDc = 512;
constexpr int kDr = 64;
constexpr int kD = kDc + kDr;

// A value of bf16 (8 significant bits) uniform in [-1, 1): a multiple of 2^-7 is one.
float random_bf16_value(std::mt19937_64& rng) {
  return static_cast<float>(static_cast<int>(rng() % 256) - 128) / 128.0f;
}

// The value of a random e4m3 code with exponent field 0..8 (|value| < 3.75, never NaN): the same
// codes the GPU bench fills its pools with.
float random_e4m3_value(std::mt19937_64& rng) {
  const std::uint64_t r = rng();
  const auto code =
      static_cast<std::uint8_t>((r & 0x80u) | (((r >> 8) % 9u) << 3) | (r >> 16 & 7u));
  return e4m3_decode(code);
}

// The baseline the reference is measured against: attention of one decode step in plain binary64,
// no compensation, at the reference's level of optimisation (the same x86-64-v3 clones, the same
// two passes per (row, head): scores, then weights and P.V, 4-lane vector accumulators). Page size
// 1 (the bench's step): token p of request b is slot kv_indices[kv_indptr[b] + p]. Written here
// rather than as mla_reference_attention<double>, whose loops keep the reference's structure for
// a generic Acc: the baseline is the fastest plain loop, so the ratio does not flatter the
// reference.

KVAUDIT_CPU_CLONES
double plain_dot(const double* q, const float* k, int n) {
  using Double4 = double __attribute__((vector_size(32)));
  using Float4 = float __attribute__((vector_size(16)));
  Double4 sum[2] = {};
  int j = 0;
  for (; j + 8 <= n; j += 8) {
    for (int h = 0; h < 2; ++h) {
      Double4 qv;
      Float4 kv;
      std::memcpy(&qv, q + j + 4 * h, sizeof qv);
      std::memcpy(&kv, k + j + 4 * h, sizeof kv);
      sum[h] += qv * __builtin_convertvector(kv, Double4);
    }
  }
  double total = 0.0;
  for (; j < n; ++j) total += q[j] * k[j];
  const Double4 both = sum[0] + sum[1];
  return total + (both[0] + both[1]) + (both[2] + both[3]);
}

KVAUDIT_CPU_CLONES
void plain_axpy(double w, const float* v, int n, double* acc) {
  for (int d = 0; d < n; ++d) acc[d] += w * v[d];
}

void plain_binary64_attention(const StepMeta& step, int heads, double sm_scale,
                              std::span<const float> q_nope, std::span<const float> q_pe,
                              const std::vector<float>& kv, double kv_scale, int threads,
                              std::span<double> out, std::span<double> lse) {
  const std::size_t pairs = static_cast<std::size_t>(step.batch_size()) * heads;
  parallel_for(pairs, threads, [&] {
    return [&, q = std::vector<double>(kD), acc = std::vector<double>(kDc),
            scores = std::vector<double>()](std::size_t pair) mutable {
      const int b = static_cast<int>(pair / heads);
      std::copy_n(q_nope.data() + pair * kDc, kDc, q.begin());
      std::copy_n(q_pe.data() + pair * kDr, kDr, q.begin() + kDc);
      const std::int32_t first = step.kv_indptr[b];
      const std::int32_t tokens = step.kv_indptr[b + 1] - first;
      auto row = [&](std::int32_t t) {
        return kv.data() + static_cast<std::size_t>(step.kv_indices[first + t]) * kD;
      };
      scores.resize(static_cast<std::size_t>(tokens));
      double m = -INFINITY;
      for (std::int32_t t = 0; t < tokens; ++t) {
        scores[t] = plain_dot(q.data(), row(t), kD) * (sm_scale * kv_scale);
        m = std::max(m, scores[t]);
      }
      std::fill(acc.begin(), acc.end(), 0.0);
      double l = 0.0;
      for (std::int32_t t = 0; t < tokens; ++t) {
        const double w = std::exp(scores[t] - m);
        l += w;
        plain_axpy(w, row(t), kDc, acc.data());
      }
      for (int j = 0; j < kDc; ++j) out[pair * kDc + j] = acc[j] * kv_scale / l;
      lse[pair] = m + std::log(l);
    };
  });
}

}  // namespace

Result<CpuBenchResult> run_cpu_reference_bench(const CpuBenchOptions& options) {
  if (options.batch < 1 || options.context < 1 || options.num_heads < 1 || options.threads < 0 ||
      !(options.min_seconds >= 0)) {
    return bad_input("bench --cpu", "batch, context and heads must be >= 1, threads >= 0");
  }
  CpuBenchResult result;
  result.options = options;
  result.threads = resolve_thread_count(options.threads);
  result.accumulation = "double-double";

  DumpAttributes attrs;
  attrs.model = "GLM-5 (synthetic bench step)";
  attrs.num_heads = options.num_heads;
  attrs.kv_lora_rank = kDc;
  attrs.qk_rope_head_dim = kDr;
  attrs.sm_scale = preset_softmax_scale(*find_model_preset("GLM-5"));  // 1/16
  attrs.page_size = 1;
  attrs.kv_dtype = KvDtype::kFloat8E4m3fn;

  // Decode step, page size 1: request b's tokens are slots perm[b * context ...].
  const std::int64_t num_slots = static_cast<std::int64_t>(options.batch) * options.context;
  std::mt19937_64 rng(options.seed);
  std::vector<std::int32_t> perm(static_cast<std::size_t>(num_slots));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  StepMeta step;
  step.group = "S000";
  step.kind = StepKind::kDecode;
  step.kv_indices = perm;
  for (int b = 0; b <= options.batch; ++b) {
    step.qo_indptr.push_back(b);
    step.kv_indptr.push_back(b * options.context);
  }
  for (int b = 0; b < options.batch; ++b) {
    step.kv_last_page_len.push_back(1);
    step.new_kv_slots.push_back(
        perm[static_cast<std::size_t>(b) * options.context + options.context - 1]);
  }

  std::vector<float> kv_values(static_cast<std::size_t>(num_slots) * kD);
  for (float& v : kv_values) v = random_e4m3_value(rng);
  const std::size_t q_rows = static_cast<std::size_t>(options.batch) * options.num_heads;
  std::vector<float> q_nope(q_rows * kDc), q_pe(q_rows * kDr);
  for (float& v : q_nope) v = random_bf16_value(rng);
  for (float& v : q_pe) v = random_bf16_value(rng);
  const KvRows kv = KvRows::from_values(kv_values, kD, 0.0625);  // the baseline's kKvScale
  std::vector<double> out(q_rows * kDc), lse(q_rows);

  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  double elapsed = 0;
  do {
    auto units = mla_reference_attention<dd::DoubleDouble>(attrs, step, q_nope, q_pe, kv, out, lse,
                                                           result.threads);
    if (!units) return units.error();
    result.units_per_run = *units;
    ++result.runs;
    elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  } while (elapsed < options.min_seconds);
  for (double v : lse) {
    if (!std::isfinite(v)) {
      return internal_error("bench --cpu", "the reference returned a non-finite lse");
    }
  }

  result.seconds = elapsed;
  result.units_per_second =
      static_cast<double>(result.units_per_run) * result.runs / std::max(elapsed, 1e-9);

  // The baseline, timed the same way on the same step.
  constexpr double kKvScale = 0.0625;
  std::vector<double> plain_out(out.size()), plain_lse(lse.size());
  const Clock::time_point plain_start = Clock::now();
  do {
    plain_binary64_attention(step, options.num_heads, attrs.sm_scale, q_nope, q_pe, kv_values,
                             kKvScale, result.threads, plain_out, plain_lse);
    ++result.plain_runs;
    result.plain_seconds = std::chrono::duration<double>(Clock::now() - plain_start).count();
  } while (result.plain_seconds < options.min_seconds);
  result.plain_units_per_second = static_cast<double>(result.units_per_run) * result.plain_runs /
                                  std::max(result.plain_seconds, 1e-9);
  result.cost_of_exactness = result.plain_units_per_second / result.units_per_second;
  double reference_max = 0.0, difference = 0.0;
  for (std::size_t i = 0; i < out.size(); ++i) {
    reference_max = std::max(reference_max, std::abs(out[i]));
    difference = std::max(difference, std::abs(plain_out[i] - out[i]));
  }
  result.plain_max_out_difference = difference / std::max(reference_max, 1e-300);
  result.project_units = static_cast<double>(options.project_layers) * options.project_batch *
                         options.project_context * options.project_heads;
  result.project_seconds = result.project_units / result.units_per_second;
  return result;
}

}  // namespace kvaudit::bench
