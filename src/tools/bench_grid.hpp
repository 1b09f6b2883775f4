// The cases `kvaudit bench` times on the GPU and the targets it judges them against. Plain C++
// (no CUDA): the grid and the target arithmetic are tested everywhere.
//
// Targets (the acceptance figures):
//   copy-ratio : decode, 16 heads, batch 64, context 8192, page 64: FP8 GB/s >= 0.60 x the
//                device-to-device copy bandwidth of the same run.
//   seed-speedup-b1 / -b64 : the seed's 495,552-slot pool, context 4096, batch 1 / 64, page 1
//                (SGLang) and page 64: cast path time / FP8 time >= 10 (batch 1), >= 3 (batch 64).
//   pool-flat  : batch 8 x context 4096, pool 65,536 -> 1,048,576 slots: FP8 median time varies
//                by less than 10% over the sweep ((max - min) / min), per page size.
//   pool-cast-grows : same sweep, cast path: time at the largest pool >= 2x the smallest (the
//                cast moves 3 bytes per pool element, 16x more pool over the sweep).
#pragma once

#include <string>
#include <vector>

#include "kernels/mla_attention_bench.hpp"

namespace kvaudit::bench {

// The seed's pool (SGLang GLM-5 server, one layer) in slots.
inline constexpr std::int64_t kSeedPoolSlots = 495552;

// quick: a few tiny cases for tests and smoke runs; otherwise the full grid (docs/design.md
// "Performance"; about 50 cases, well under a minute of GPU time on an H200).
std::vector<GpuCase> bench_grid(bool quick);

struct TargetVerdict {
  std::string name;       // "copy-ratio"
  std::string statement;  // what is asked, in words
  std::string cases;      // the case(s) it was judged on
  double measured = 0;
  double threshold = 0;
  bool evaluated = false;  // false: a case it needs is missing or was skipped
  bool met = false;
};

// Judges every target whose cases are present in `results` (others come back not evaluated).
std::vector<TargetVerdict> evaluate_targets(const std::vector<GpuCaseResult>& results);

}  // namespace kvaudit::bench
