// The cases `kvaudit bench` times on the GPU and the targets it judges them against. Plain C++
// (no CUDA): the grid and the target arithmetic are tested everywhere.
//
// Targets (the acceptance figures of the FP8 MLA kernels at the hardware's limit):
//   copy-ratio : decode, 16 heads, batch 64, context 8192, page 64: FP8 GB/s >= 0.80 x the
//                device-to-device copy bandwidth of the same run.
//   heads128-tflops : decode, 128 heads, batch 64, context 4096, page 64: >= 400 TFLOP/s.
//   prefill-tflops : prefill, batch 1, 4,096 queries over 4,096 tokens, 16 heads: >= 350 TFLOP/s.
//   seed-latency-b1 / seed-speedup-b1 / -b64 : the seed's 495,552-slot pool, context 4096, page 1
//                (SGLang) and page 64: batch 1 FP8 time <= 12 us; cast path time / FP8 time >= 20
//                (batch 1), >= 3 (batch 64).
//   pool-flat  : batch 8 x context 4096, pool 65,536 -> 1,048,576 slots: FP8 median time varies
//                by less than 10% over the sweep ((max - min) / min), per page size.
//   pool-cast-grows : same sweep, cast path: time at the largest pool >= 2x the smallest (the
//                cast moves 3 bytes per pool element, 16x more pool over the sweep).
//   peer-faster : with --peer, on every case the peer measured: peer time / FP8 time > 1 (the
//                smallest ratio is reported).
#pragma once

#include <string>
#include <vector>

#include "src/tools/mla_attention_bench.hpp"

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
