#include "src/tools/bench_grid.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <map>

namespace kvaudit::bench {
namespace {

GpuCase make_case(std::string group, int batch, int context, int heads, int page,
                  std::int64_t pool = 0, int q_len = 1, std::string target = {}) {
  GpuCase c;
  c.group = std::move(group);
  c.batch = batch;
  c.context = context;
  c.num_heads = heads;
  c.page_size = page;
  c.pool_slots = pool;
  c.q_len = q_len;
  c.target = std::move(target);
  return c;
}

const GpuCaseResult* find_target(const std::vector<GpuCaseResult>& results,
                                 const std::string& target) {
  for (const GpuCaseResult& r : results) {
    if (r.config.target == target && r.skipped.empty()) return &r;
  }
  return nullptr;
}

}  // namespace

std::vector<GpuCase> bench_grid(bool quick) {
  std::vector<GpuCase> grid;
  if (quick) {
    // Sizes chosen to be tiny but not aligned to the tile (300 = 4 * 64 + 44).
    for (int page : {1, 64}) grid.push_back(make_case("decode", 2, 300, 16, page));
    // Exercises the sweep path; no target tag: a 4x sweep of tiny pools says nothing about
    // whether time grows with the pool.
    for (std::int64_t pool : {1024, 4096}) {
      grid.push_back(make_case("pool-sweep", 2, 300, 16, 64, pool));
    }
    grid.push_back(make_case("prefill", 2, 300, 16, 64, 0, 17));
    return grid;
  }
  // Decode over batch x context, 16 heads (one tensor-parallel rank of GLM-5 / DeepSeek-V3).
  for (int batch : {1, 8, 64, 128}) {
    for (int context : {1024, 4096, 8192, 32768}) {
      const bool target = batch == 64 && context == 8192;
      grid.push_back(make_case("decode", batch, context, 16, 64, 0, 1, target ? "copy-ratio" : ""));
    }
  }
  // The seed's pool, page 1 (SGLang) and page 64.
  for (int page : {1, 64}) {
    grid.push_back(make_case("seed-pool", 1, 4096, 16, page, kSeedPoolSlots, 1, "seed-speedup-b1"));
    grid.push_back(
        make_case("seed-pool", 64, 4096, 16, page, kSeedPoolSlots, 1, "seed-speedup-b64"));
  }
  // Pool size at fixed work: FP8 time must not move, the cast path grows with the pool.
  for (int page : {1, 64}) {
    for (std::int64_t pool : {65536, 131072, 262144, 524288, 1048576}) {
      grid.push_back(make_case("pool-sweep", 8, 4096, 16, page, pool, 1, "pool-sweep"));
    }
  }
  // Heads at a representative size: memory-bound at 16, compute-bound towards 128.
  for (int heads : {16, 32, 64, 128}) {
    grid.push_back(
        make_case("heads", 64, 4096, heads, 64, 0, 1, heads == 128 ? "heads128-tflops" : ""));
  }
  // Page size: 1 is a gather of single 576-byte rows.
  for (int page : {1, 16, 64}) grid.push_back(make_case("page", 64, 8192, 16, page));
  // Prefill / extend (causal): a whole prompt, chunked extends, and 4-token speculative decode.
  grid.push_back(make_case("prefill", 1, 4096, 16, 64, 0, 4096, "prefill-tflops"));
  grid.push_back(make_case("prefill", 8, 4096, 16, 64, 0, 512));
  grid.push_back(make_case("prefill", 64, 4096, 16, 64, 0, 4));
  return grid;
}

namespace {

// The case tagged `target`: its `figure` (copy ratio, TFLOP/s) >= threshold; judged when the
// case ran (the figure is positive).
TargetVerdict single_case_verdict(const std::vector<GpuCaseResult>& results,
                                  const std::string& target, std::string statement,
                                  double threshold, double GpuCaseResult::*figure) {
  TargetVerdict v{target, std::move(statement), "", 0, threshold};
  if (const GpuCaseResult* r = find_target(results, target)) {
    v.cases = r->config.name();
    v.measured = r->*figure;
    v.evaluated = v.measured > 0;
    v.met = v.evaluated && v.measured >= v.threshold;
  }
  return v;
}

// One verdict per case tagged `target` (one per page size): FP8 median time <= threshold_us.
void add_latency_verdicts(const std::vector<GpuCaseResult>& results, const std::string& target,
                          const std::string& name, double threshold_us,
                          std::vector<TargetVerdict>& verdicts) {
  for (const GpuCaseResult& r : results) {
    if (r.config.target != target) continue;
    TargetVerdict v;
    v.name = fmt::format("{}-page{}", name, r.config.page_size);
    v.statement = fmt::format("seed pool {} slots, batch {} x ctx {}, page {}: FP8 time <= {} us",
                              r.config.effective_pool_slots(), r.config.batch, r.config.context,
                              r.config.page_size, threshold_us);
    v.cases = r.config.name();
    v.threshold = threshold_us;
    v.evaluated = r.skipped.empty() && r.fp8.launches > 0;
    v.measured = r.fp8.median_us;
    v.met = v.evaluated && v.measured <= threshold_us;
    verdicts.push_back(v);
  }
}

// Over every case the peer measured: the smallest peer time / FP8 time, met above 1.
TargetVerdict peer_faster_verdict(const std::vector<GpuCaseResult>& results) {
  TargetVerdict v{"peer-faster", "every case the --peer measured: peer time / FP8 time > 1", "", 0,
                  1.0};
  int compared = 0;
  for (const GpuCaseResult& r : results) {
    if (r.peer_median_us <= 0 || r.fp8.median_us <= 0 || !r.skipped.empty()) continue;
    const double ratio = r.peer_median_us / r.fp8.median_us;
    if (compared == 0 || ratio < v.measured) {
      v.measured = ratio;
      v.cases = r.config.name();
    }
    ++compared;
  }
  v.evaluated = compared > 0;
  v.met = v.evaluated && v.measured > v.threshold;
  if (v.evaluated) v.cases = fmt::format("{} cases, slowest ratio at {}", compared, v.cases);
  return v;
}

// One verdict per case tagged `target` (one per page size): cast path / FP8 >= threshold.
void add_seed_speedup_verdicts(const std::vector<GpuCaseResult>& results, const std::string& target,
                               double threshold, std::vector<TargetVerdict>& verdicts) {
  for (const GpuCaseResult& r : results) {
    if (r.config.target != target) continue;
    TargetVerdict v;
    v.name = fmt::format("{}-page{}", target, r.config.page_size);
    v.statement =
        fmt::format("seed pool {} slots, batch {} x ctx {}, page {}: cast path / FP8 >= {}x",
                    r.config.effective_pool_slots(), r.config.batch, r.config.context,
                    r.config.page_size, static_cast<int>(threshold));
    v.cases = r.config.name();
    v.threshold = threshold;
    v.evaluated = r.skipped.empty() && r.cast.has_value();
    v.measured = r.cast_speedup;
    v.met = v.evaluated && v.measured >= threshold;
    verdicts.push_back(v);
  }
}

// The sweep of one page size (rows sorted by pool size): FP8 time flat, cast time growing.
void add_pool_sweep_verdicts(int page, const std::vector<const GpuCaseResult*>& rows,
                             std::vector<TargetVerdict>& verdicts) {
  const bool all_ran = rows.size() >= 2 && std::all_of(rows.begin(), rows.end(), [](auto* r) {
                         return r->skipped.empty() && r->fp8.launches > 0;
                       });
  const std::string span = fmt::format(
      "{} -> {} slots, batch {} x ctx {}, page {}", rows.front()->config.effective_pool_slots(),
      rows.back()->config.effective_pool_slots(), rows.front()->config.batch,
      rows.front()->config.context, page);
  TargetVerdict flat{fmt::format("pool-flat-page{}", page),
                     fmt::format("pool {}: FP8 time varies < 10% ((max - min) / min)", span), span,
                     0, 0.10};
  TargetVerdict grows{fmt::format("pool-cast-grows-page{}", page),
                      fmt::format("pool {}: cast path time at largest pool >= 2x smallest", span),
                      span, 0, 2.0};
  if (all_ran) {
    double lo = rows.front()->fp8.median_us, hi = lo;
    for (auto* r : rows) {
      lo = std::min(lo, r->fp8.median_us);
      hi = std::max(hi, r->fp8.median_us);
    }
    flat.measured = (hi - lo) / lo;
    flat.evaluated = true;
    flat.met = flat.measured < flat.threshold;
    if (rows.front()->cast && rows.back()->cast) {
      grows.measured = rows.back()->cast->median_us / rows.front()->cast->median_us;
      grows.evaluated = true;
      grows.met = grows.measured >= grows.threshold;
    }
  }
  verdicts.push_back(flat);
  verdicts.push_back(grows);
}

}  // namespace

std::vector<TargetVerdict> evaluate_targets(const std::vector<GpuCaseResult>& results) {
  std::vector<TargetVerdict> verdicts;
  verdicts.push_back(single_case_verdict(
      results, "copy-ratio",
      "decode 16 heads, batch 64, ctx 8192, page 64: FP8 bandwidth >= 80% of copy", 0.80,
      &GpuCaseResult::fp8_copy_ratio));
  verdicts.push_back(single_case_verdict(
      results, "heads128-tflops", "decode 128 heads, batch 64, ctx 4096, page 64: >= 400 TFLOP/s",
      400.0, &GpuCaseResult::fp8_tflops));
  verdicts.push_back(single_case_verdict(
      results, "prefill-tflops",
      "prefill batch 1, 4096 queries over 4096 tokens, 16 heads: >= 350 TFLOP/s", 350.0,
      &GpuCaseResult::fp8_tflops));
  add_latency_verdicts(results, "seed-speedup-b1", "seed-latency-b1", 12.0, verdicts);
  add_seed_speedup_verdicts(results, "seed-speedup-b1", 20.0, verdicts);
  add_seed_speedup_verdicts(results, "seed-speedup-b64", 3.0, verdicts);
  // Pool sweep, per page size.
  std::map<int, std::vector<const GpuCaseResult*>> sweeps;
  for (const GpuCaseResult& r : results) {
    if (r.config.target == "pool-sweep") sweeps[r.config.page_size].push_back(&r);
  }
  for (auto& [page, rows] : sweeps) {
    std::sort(rows.begin(), rows.end(), [](const GpuCaseResult* a, const GpuCaseResult* b) {
      return a->config.effective_pool_slots() < b->config.effective_pool_slots();
    });
    add_pool_sweep_verdicts(page, rows, verdicts);
  }
  verdicts.push_back(peer_faster_verdict(results));
  return verdicts;
}

}  // namespace kvaudit::bench
