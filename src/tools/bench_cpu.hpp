// Throughput of the high-precision CPU reference (references/mla_reference.hpp), which is what
// limits `kvaudit check` on a full dump without a GPU (docs/design.md "Performance").
//
// One synthetic decode step: `batch` requests of `context` tokens each (page size 1, slots a
// random permutation of the pool), `num_heads` heads, KV values decoded e4m3 codes times a
// per-tensor scale, queries bf16 values in [-1, 1).
//   q_nope : [batch, num_heads, 512]   q_pe : [batch, num_heads, 64]   kv : [batch * context, 576]
// Work unit: one (query row, head, visible token), i.e. 1,088 multiply-adds in double-double.
// The reference is run repeatedly until `min_seconds` of wall time have passed (at least once);
// rate = units / wall seconds. Then, in the same run and on the same inputs, the baseline: a plain,
// uncompensated binary64 loop (scores, max, exp, sum and P.V in double, one pass per (row, head),
// the same threads), timed the same way; exactness's cost is the ratio of the two rates. The
// projection scales that rate to one decode step of a dump with `project_layers` layers of
// `project_batch` requests x `project_context` tokens x `project_heads` heads: layers * batch *
// context * heads units.
#pragma once

#include <cstdint>
#include <string>

#include "src/core/result.hpp"

namespace kvaudit::bench {

struct CpuBenchOptions {
  int batch = 4;
  int context = 2048;
  int num_heads = 16;
  int threads = 0;  // 0: every core
  double min_seconds = 1.0;
  std::uint64_t seed = 1;
  // The step a full GLM-5 dump replays: 78 layers, one tensor-parallel rank's 16 heads.
  int project_layers = 78;
  int project_batch = 64;
  int project_context = 4096;
  int project_heads = 16;
};

struct CpuBenchResult {
  CpuBenchOptions options;
  int threads = 0;           // threads used (hardware_concurrency when options.threads == 0)
  std::string accumulation;  // "double-double"
  int runs = 0;
  double seconds = 0;              // wall time over all runs
  std::int64_t units_per_run = 0;  // as the reference reports it
  double units_per_second = 0;
  double project_units = 0;
  double project_seconds = 0;
  // The plain binary64 baseline on the same step and threads.
  int plain_runs = 0;
  double plain_seconds = 0;
  double plain_units_per_second = 0;
  double plain_max_out_difference = 0;  // |plain - reference| / max |reference| over out
  double cost_of_exactness = 0;         // plain rate / reference rate
};

// Errors: sizes < 1 (bad input), or whatever the reference reports.
Result<CpuBenchResult> run_cpu_reference_bench(const CpuBenchOptions& options);

}  // namespace kvaudit::bench
