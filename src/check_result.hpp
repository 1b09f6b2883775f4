// What one `kvaudit check` run found: comparisons per (step, layer), integrity findings per
// (step, layer), and the verdict. Produced by the replay (src/replay.cpp), rendered by the
// reports (src/report.cpp).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "src/metrics.hpp"
#include "src/policy.hpp"

namespace kvaudit {

struct ComparisonResult {
  int step = 0;      // step index (S### number)
  int layer_id = 0;  // model layer id (L### number)
  Comparison comparison = Comparison::kKernel;
  ComparisonMetrics metrics;
  Judgement judgement;
  bool sets_exit = true;  // whether a failure here fails the run under the policy
  // The first failing request/row/head for bug reproduction (row is step-global).
  int worst_request = -1;
};

struct IntegrityFinding {
  int step = 0;
  int layer_id = 0;
  std::string check;  // "storage", "written_slots", "unwritten_slots", "nan_written",
                      // "captured_pool", "read_consistency"
  bool pass = true;
  std::string message;              // one line naming step, layer and slots
  std::vector<std::int64_t> slots;  // first offending slots (at most a few dozen)
  std::string classification;       // "nan_code", "bf16_high_byte", "off_by_one_code",
                                    // "wrong_slot", "other" (captured pools)
};

struct CheckRun {
  std::string dump_path;
  std::string dump_sha256;
  std::string backend;  // "cpu-fp8", "none", ...
  nlohmann::json backend_description;
  Policy policy;
  nlohmann::json dump_summary;  // model, producer, shapes, layers, steps
  std::vector<ComparisonResult> comparisons;
  std::vector<IntegrityFinding> integrity;
  double reference_seconds = 0.0;
  double reference_rows_heads_tokens = 0.0;  // work done, for throughput
  double backend_seconds = 0.0;
  double total_seconds = 0.0;
  bool pass() const;  // no failing comparison that sets exit, no failing integrity finding
};

nlohmann::json to_json(const CheckRun& run);  // the report.json schema (docs/report-schema.md)

}  // namespace kvaudit
