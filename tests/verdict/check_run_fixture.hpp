// A small hand-built CheckRun shared by the check_result and report tests: two layers, two steps,
// one failing kernel comparison, one report-only quantization failure, one failing integrity
// finding. Every number is written out here, not computed by the code under test.
#pragma once

#include <limits>

#include "src/verdict/check_result.hpp"

namespace kvaudit::testing {

inline ComparisonResult make_comparison(int step, int layer, Comparison comparison, double rel_l2,
                                        bool pass, bool sets_exit) {
  ComparisonResult r;
  r.step = step;
  r.layer_id = layer;
  r.comparison = comparison;
  r.metrics.elements = 64;
  r.metrics.finite_elements = 64;
  r.metrics.max_abs = 0.5 * rel_l2;
  r.metrics.max_abs_at = {3, 1, 7, 0.25, 0.25 + 0.5 * rel_l2};
  r.metrics.reference_max_abs = 2.0;
  r.metrics.rel_l2 = rel_l2;
  r.metrics.cos_diff = rel_l2 * rel_l2 / 2;
  r.metrics.max_ulp_bf16 = 3;
  r.metrics.has_lse = true;
  r.metrics.lse_max_abs = 1e-5;
  r.judgement.pass = pass;
  r.sets_exit = sets_exit;
  r.worst_request = 0;
  return r;
}

inline CheckRun make_failing_run() {
  CheckRun run;
  run.dump_path = "/data/glm5_two_layers.h5";
  run.dump_sha256 = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
  run.backend = "cpu-fp8";
  run.backend_description = {{"threads", 2}, {"injection", ""}};
  run.policy = default_policy();
  run.dump_summary = {
      {"model", "GLM-5"}, {"num_heads", 16}, {"steps", 2}, {"layers", nlohmann::json::array()}};
  run.dump_summary["layers"].push_back({{"group", "L000"}, {"layer_id", 0}, {"kv_scale", 0.5}});
  run.dump_summary["layers"].push_back({{"group", "L003"}, {"layer_id", 3}, {"kv_scale", 0.25}});

  run.comparisons.push_back(make_comparison(0, 0, Comparison::kKernel, 0.002, true, true));
  run.comparisons.push_back(make_comparison(0, 0, Comparison::kQuantization, 0.03, true, false));
  ComparisonResult failing = make_comparison(1, 3, Comparison::kKernel, 0.025, false, true);
  failing.metrics.max_abs_at = {5, 2, 17, 1.5, 1.53125};
  failing.judgement.reasons = {"rel_l2 0.025 > 0.00391 (kernel limit)"};
  failing.worst_request = 1;
  run.comparisons.push_back(failing);
  ComparisonResult report_only =
      make_comparison(1, 3, Comparison::kQuantization, 0.07, false, false);
  report_only.judgement.reasons = {"rel_l2 0.07 > 0.0625 (quantization limit)"};
  run.comparisons.push_back(report_only);

  IntegrityFinding ok;
  ok.step = 0;
  ok.layer_id = 0;
  ok.check = IntegrityCheck::kWrittenSlots;
  ok.pass = true;
  ok.detail = "step 0 layer 0: 4 written slots hold e4m3_rne_satfinite(x / kv_scale)";
  run.integrity.push_back(ok);
  IntegrityFinding bad;
  bad.step = 1;
  bad.layer_id = 3;
  bad.check = IntegrityCheck::kWrittenSlots;
  bad.pass = false;
  bad.detail = "step 1 layer 3: slots 12, 13 hold bf16 bytes";
  bad.slots = {12, 13};
  bad.classification = SlotClass::kBf16Bytes;
  run.integrity.push_back(bad);

  run.reference_seconds = 2.0;
  run.reference_rows_heads_tokens = 1.0e6;
  run.backend_seconds = 0.5;
  run.total_seconds = 3.0;
  run.provenance = {"testhost", "2026-11-29T09:30:00Z", "kvaudit check /data/glm5_two_layers.h5",
                    "0.1.0"};
  return run;
}

// Three diagnosis findings for the failing kernel comparison above (step 1 layer 3): one
// hypothesis explains; two explain as the same computation; none explains (the closest named).
inline std::vector<DiagnosisFinding> make_diagnosis() {
  auto error = [](double rel_l2, double over_max, double lse) {
    ErrorSummary e;
    e.rel_l2 = rel_l2;
    e.max_abs_over_ref_max = over_max;
    e.has_lse = true;
    e.lse_max_abs = lse;
    return e;
  };
  DiagnosisFinding one;
  one.step = 1;
  one.layer_id = 3;
  one.before = error(0.025, 0.031, 1.5);
  one.explained_by.push_back({"lse-base-2",
                              "candidate lse read as log2 of the sum",
                              error(0.0018, 0.0022, 2e-6),
                              true,
                              {},
                              0.46,
                              7.2e-5});
  one.tried = 14;
  DiagnosisFinding twins = one;
  twins.layer_id = 0;
  twins.explained_by = {{"scale-pow2-floor",
                         "kv_scale 0.75 read as 0.5 (2^-1)",
                         error(0.0017, 0.002, 1e-6),
                         true,
                         {},
                         0.44,
                         0.068},
                        {"scale-pow2-nearest",
                         "kv_scale 0.75 read as 0.5 (2^-1)",
                         error(0.0017, 0.002, 1e-6),
                         true,
                         {},
                         0.44,
                         0.068}};
  twins.same_computation = true;
  DiagnosisFinding none = one;
  none.step = 2;
  none.explained_by.clear();
  none.closest = HypothesisOutcome{"scale-bf16",
                                   "kv_scale 0.75 read as 0.75",
                                   error(0.02, 0.03, 0.4),
                                   false,
                                   {"rel_l2 0.02 > 0.00391 (kernel limit)"},
                                   5.12,
                                   0.8};
  none.hypotheses = {*none.closest};
  none.not_applicable = {"scale-not-applied"};
  return {one, twins, none};
}

}  // namespace kvaudit::testing
