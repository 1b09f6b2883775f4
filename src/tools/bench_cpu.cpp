#include "src/tools/bench_cpu.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>
#include <random>
#include <span>
#include <vector>

#include "references/mla_reference.hpp"
#include "src/core/fp8_e4m3.hpp"
#include "src/core/parallel_for.hpp"
#include "src/format/kvdump.hpp"

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
  attrs.sm_scale = 1.0 / std::sqrt(192.0);
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
  const KvRows kv = KvRows::from_values(kv_values, kD, 0.0625);
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
  result.project_units = static_cast<double>(options.project_layers) * options.project_batch *
                         options.project_context * options.project_heads;
  result.project_seconds = result.project_units / result.units_per_second;
  return result;
}

}  // namespace kvaudit::bench
