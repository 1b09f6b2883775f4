// CheckRun's verdict and its report.json form on a hand-built run
// (tests/verdict/check_run_fixture.hpp).
#include <catch2/catch.hpp>
#include <limits>

#include "src/verdict/check_result.hpp"
#include "tests/verdict/check_run_fixture.hpp"

using kvaudit::CheckRun;
using kvaudit::Comparison;
using kvaudit::ComparisonResult;
using kvaudit::default_policy;
using kvaudit::diagnosis_summary;
using kvaudit::DiagnosisFinding;
using kvaudit::HypothesisOutcome;
using kvaudit::IntegrityCheck;
using kvaudit::IntegrityFinding;
using kvaudit::PoolState;
using kvaudit::StepSummary;
using kvaudit::summarize_steps;
using kvaudit::to_json;
using kvaudit::testing::make_comparison;
using kvaudit::testing::make_failing_run;
namespace testing = kvaudit::testing;

TEST_CASE("a run fails on a failing kernel comparison or integrity finding", "[check_result]") {
  CheckRun run = make_failing_run();
  CHECK_FALSE(run.pass());
  run.comparisons.erase(run.comparisons.begin() + 2);  // the failing kernel comparison
  CHECK_FALSE(run.pass());                             // the storage finding still fails it
  run.integrity.pop_back();
  // Left: a report-only quantization failure, which does not fail the run.
  CHECK(run.pass());
  const kvaudit::RunCounts counts = kvaudit::count_results(run);
  CHECK(counts.failed == 0);
  CHECK(counts.failed_report_only == 1);
}

TEST_CASE("a NaN/Inf mismatch fails the run even in a report-only comparison", "[check_result]") {
  CheckRun run;
  run.policy = kvaudit::default_policy();
  auto quantization = make_comparison(0, 0, Comparison::kQuantization, 0.01, false, false);
  quantization.metrics.nonfinite_mismatches = 1;
  quantization.judgement.reasons = {"1 NaN/Inf mismatches"};
  run.comparisons.push_back(quantization);
  CHECK(kvaudit::fails_run(run.comparisons[0]));
  CHECK_FALSE(run.pass());
  run.comparisons[0].metrics.nonfinite_mismatches = 0;
  CHECK(run.pass());
}

TEST_CASE("max_abs over the reference's max", "[check_result]") {
  kvaudit::ComparisonMetrics m;
  m.max_abs = 0.5;
  m.reference_max_abs = 4.0;
  CHECK(kvaudit::max_abs_over_ref_max(m) == 0.125);
  m.reference_max_abs = 0.0;
  CHECK(std::isinf(kvaudit::max_abs_over_ref_max(m)));
  m.max_abs = 0.0;
  CHECK(kvaudit::max_abs_over_ref_max(m) == 0.0);
}

TEST_CASE("report.json schema of a failing run", "[check_result]") {
  const nlohmann::json j = kvaudit::to_json(make_failing_run());
  CHECK(j.at("tool") == "kvaudit");
  CHECK(j.at("version").is_string());
  CHECK(j.at("verdict") == "fail");
  CHECK(j.at("backend") == "cpu-fp8");
  CHECK(j.at("backend_description").at("threads") == 2);
  CHECK(j.at("policy").at("name") == "default");
  CHECK(j.at("policy").at("kernel").at("rel_l2").at("limit") == 0.00390625);
  CHECK(j.at("dump").at("path") == "/data/glm5_two_layers.h5");
  CHECK(j.at("dump").at("sha256") ==
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  CHECK(j.at("dump").at("summary").at("model") == "GLM-5");
  CHECK(j.at("counts").at("comparisons") == 4);
  CHECK(j.at("counts").at("failed") == 1);
  CHECK(j.at("counts").at("failed_report_only") == 1);
  CHECK(j.at("counts").at("integrity_failed") == 1);

  const nlohmann::json& results = j.at("results");
  REQUIRE(results.size() == 4);
  const nlohmann::json& failing = results[2];
  CHECK(failing.at("step") == 1);
  CHECK(failing.at("layer") == 3);
  CHECK(failing.at("comparison") == "kernel");
  CHECK(failing.at("pass") == false);
  CHECK(failing.at("sets_exit") == true);
  CHECK(failing.at("reasons")[0] == "rel_l2 0.025 > 0.00391 (kernel limit)");
  CHECK(failing.at("worst") ==
        nlohmann::json(
            {{"row", 5}, {"head", 2}, {"dim", 17}, {"reference", 1.5}, {"candidate", 1.53125}}));
  CHECK(failing.at("worst_request") == 1);
  CHECK(failing.at("metrics").at("rel_l2") == 0.025);
  // max_abs = 0.5 * 0.025 over reference_max_abs 2.
  CHECK(failing.at("metrics").at("max_abs_over_ref_max") == Approx(0.00625));
  CHECK(results[3].at("comparison") == "quantization");
  CHECK(results[3].at("sets_exit") == false);

  const nlohmann::json& integrity = j.at("integrity");
  REQUIRE(integrity.size() == 2);
  CHECK(integrity[1].at("check") == "written_slots");
  CHECK(integrity[1].at("pass") == false);
  CHECK(integrity[1].at("slots") == nlohmann::json({12, 13}));
  CHECK(integrity[1].at("classification") == "bf16_bytes");
  CHECK(integrity[1].at("detail") == "step 1 layer 3: slots 12, 13 hold bf16 bytes");
  for (const char* key : {"step", "layer", "check", "pass", "slots", "detail"}) {
    INFO(key);
    CHECK(integrity[0].contains(key));
  }
  CHECK(integrity[1].at("layer") == 3);

  // 1e6 rows*heads*tokens in 2 s.
  CHECK(j.at("timing").at("reference_throughput_rows_heads_tokens_per_s") == 500000.0);
  CHECK(j.at("timing").at("backend_seconds") == 0.5);
  CHECK(j.at("provenance").at("host") == "testhost");
  CHECK(j.at("provenance").at("date") == "2026-11-29T09:30:00Z");
  CHECK(j.at("provenance").at("command_line") == "kvaudit check /data/glm5_two_layers.h5");
}

TEST_CASE("report.json writes infinities as strings and fills missing provenance",
          "[check_result]") {
  CheckRun run;
  run.policy = kvaudit::default_policy();
  auto zero_reference = make_comparison(0, 0, Comparison::kKernel, 0.0, false, true);
  zero_reference.metrics.rel_l2 = std::numeric_limits<double>::infinity();
  zero_reference.metrics.reference_max_abs = 0.0;
  run.comparisons.push_back(zero_reference);
  const nlohmann::json j = kvaudit::to_json(run);
  CHECK(j.at("results")[0].at("metrics").at("rel_l2") == "inf");
  CHECK(j.at("verdict") == "fail");
  CHECK(j.at("timing").at("reference_throughput_rows_heads_tokens_per_s").is_null());
  // Filled from this process: a date in ISO-8601 UTC form.
  const std::string date = j.at("provenance").at("date");
  REQUIRE(date.size() == 20);
  CHECK(date[10] == 'T');
  CHECK(date.back() == 'Z');
  CHECK_FALSE(j.at("provenance").at("command_line").get<std::string>().empty());
  // The whole document must serialise (no NaN/inf numbers, which JSON cannot hold).
  CHECK(nlohmann::json::parse(j.dump()) == j);
}

TEST_CASE("per-step summary: pools intact or damaged, and the worst error with its layer",
          "[check_result]") {
  CheckRun run;
  run.policy = default_policy();
  // Step 0: two layers, clean. Step 1: layer 3's backend pool lost 5 slots (read_consistency),
  // its cache comparison is NaN in 2 positions; the captured pool of layer 0 carries 2 slots
  // damaged at step 0 and 1 new one.
  run.comparisons.push_back(testing::make_comparison(0, 0, Comparison::kKernel, 0.002, true, true));
  run.comparisons.push_back(testing::make_comparison(0, 3, Comparison::kKernel, 0.003, true, true));
  run.comparisons.push_back(testing::make_comparison(1, 0, Comparison::kKernel, 0.001, true, true));
  ComparisonResult cache = testing::make_comparison(1, 3, Comparison::kCache, 0.2, false, true);
  cache.metrics.nonfinite_mismatches = 2;
  run.comparisons.push_back(cache);
  auto finding = [](int step, int layer, IntegrityCheck check, bool pass, std::int64_t slots,
                    int carried) {
    IntegrityFinding f;
    f.step = step;
    f.layer_id = layer;
    f.check = check;
    f.pass = pass;
    f.slot_count = slots;
    f.carried_from_step = carried;
    return f;
  };
  run.integrity.push_back(finding(0, 0, IntegrityCheck::kReadConsistency, true, 0, -1));
  run.integrity.push_back(finding(0, 3, IntegrityCheck::kReadConsistency, true, 0, -1));
  run.integrity.push_back(finding(0, 0, IntegrityCheck::kNanCodesInPool, true, 7, -1));
  run.integrity.push_back(finding(1, 3, IntegrityCheck::kWrittenSlots, false, 5, -1));
  run.integrity.push_back(finding(1, 3, IntegrityCheck::kReadConsistency, false, 5, -1));
  run.integrity.push_back(finding(1, 0, IntegrityCheck::kReadConsistency, true, 0, -1));
  run.integrity.push_back(finding(1, 0, IntegrityCheck::kCapturedPool, false, 2, 0));
  run.integrity.push_back(finding(1, 0, IntegrityCheck::kCapturedPool, false, 1, -1));

  const std::vector<StepSummary> steps = summarize_steps(run);
  REQUIRE(steps.size() == 2);
  CHECK(steps[0].step == 0);
  CHECK(steps[0].layers == 2);
  CHECK(steps[0].backend_pool == PoolState::kIntact);
  CHECK(steps[0].captured_pool == PoolState::kNotChecked);
  CHECK(steps[0].pass);
  CHECK(steps[0].worst.at(Comparison::kKernel).rel_l2 == 0.003);
  CHECK(steps[0].worst.at(Comparison::kKernel).layer_id == 3);

  CHECK(steps[1].backend_pool == PoolState::kDamaged);
  CHECK(steps[1].damaged_slots == 5);
  CHECK(steps[1].damaged_layers == 1);
  CHECK(steps[1].captured_pool == PoolState::kDamaged);
  CHECK(steps[1].new_captured_slots == 1);
  CHECK(steps[1].carried_captured_slots == 2);
  CHECK(steps[1].worst.at(Comparison::kCache).layer_id == 3);
  CHECK(steps[1].worst.at(Comparison::kCache).nonfinite_mismatches == 2);
  CHECK(steps[1].worst.at(Comparison::kCache).failed == 1);
  CHECK_FALSE(steps[1].pass);

  const nlohmann::json j = to_json(run);
  REQUIRE(j.at("steps").size() == 2);
  CHECK(j.at("steps")[0].at("backend_pool") == "intact");
  CHECK(j.at("steps")[0].at("captured_pool").is_null());
  CHECK(j.at("steps")[1].at("backend_pool") == "damaged");
  CHECK(j.at("steps")[1].at("damaged_slots") == 5);
  CHECK(j.at("steps")[1].at("comparisons").at("cache").at("worst_rel_l2") == 0.2);
  CHECK(j.at("steps")[1].at("comparisons").at("cache").at("worst_layer") == 3);
  CHECK(j.at("steps")[1].at("pass") == false);
}

TEST_CASE("integrity checks and slot classes carry the names report.json uses", "[check_result]") {
  using kvaudit::integrity_check_name;
  using kvaudit::slot_class_name;
  using kvaudit::SlotClass;
  CHECK(std::string(integrity_check_name(IntegrityCheck::kStorage)) == "storage");
  CHECK(std::string(integrity_check_name(IntegrityCheck::kWrittenSlots)) == "written_slots");
  CHECK(std::string(integrity_check_name(IntegrityCheck::kUnwrittenSlots)) == "unwritten_slots");
  CHECK(std::string(integrity_check_name(IntegrityCheck::kNanWritten)) == "nan_written");
  CHECK(std::string(integrity_check_name(IntegrityCheck::kReadConsistency)) == "read_consistency");
  CHECK(std::string(integrity_check_name(IntegrityCheck::kCapturedPool)) == "captured_pool");
  CHECK(std::string(integrity_check_name(IntegrityCheck::kNanCodesInPool)) == "nan_codes_in_pool");
  CHECK(std::string(slot_class_name(SlotClass::kNone)).empty());
  CHECK(std::string(slot_class_name(SlotClass::kWrongSlot)) == "wrong_slot");
  CHECK(std::string(slot_class_name(SlotClass::kBf16Bytes)) == "bf16_bytes");
  CHECK(std::string(slot_class_name(SlotClass::kNanCode)) == "nan_code");
  CHECK(std::string(slot_class_name(SlotClass::kOffByOneCode)) == "off_by_one_code");
  CHECK(std::string(slot_class_name(SlotClass::kOther)) == "other");

  // A finding that is not about slots writes an empty classification.
  CheckRun run;
  run.policy = default_policy();
  IntegrityFinding storage;
  storage.check = IntegrityCheck::kStorage;
  run.integrity.push_back(storage);
  const nlohmann::json j = to_json(run);
  CHECK(j.at("integrity")[0].at("check") == "storage");
  CHECK(j.at("integrity")[0].at("classification") == "");
}

TEST_CASE("report.json carries the run's first divergence and notes", "[check_result]") {
  CheckRun run = make_failing_run();
  nlohmann::json j = to_json(run);
  CHECK(j.at("first_divergence").is_null());
  CHECK(j.at("notes") == nlohmann::json::array());

  kvaudit::Divergence divergence;
  divergence.step = 1;
  divergence.layer_id = 3;
  divergence.request = 1;
  divergence.row = 5;
  divergence.head = 2;
  divergence.comparison = Comparison::kCache;
  divergence.reason = "rel_l2 0.025 > 0 (cache limit)";
  run.first_divergence = divergence;
  run.notes = {"S000 L003: no kv_source", "second note"};
  j = to_json(run);
  CHECK(j.at("first_divergence") == nlohmann::json({{"step", 1},
                                                    {"layer_id", 3},
                                                    {"request", 1},
                                                    {"row", 5},
                                                    {"head", 2},
                                                    {"comparison", "cache"},
                                                    {"reason", "rel_l2 0.025 > 0 (cache limit)"}}));
  CHECK(j.at("notes") == nlohmann::json({"S000 L003: no kv_source", "second note"}));
}

TEST_CASE("diagnosis findings: one line each, and report.json's diagnosis array",
          "[check_result][diagnosis]") {
  CheckRun run = kvaudit::testing::make_failing_run();
  run.diagnosis = kvaudit::testing::make_diagnosis();
  CHECK(kvaudit::diagnosis_summary(run.diagnosis[0]) ==
        "explained by lse-base-2 (candidate lse read as log2 of the sum)");
  CHECK(kvaudit::diagnosis_summary(run.diagnosis[1]) ==
        "explained by scale-pow2-floor, scale-pow2-nearest (indistinguishable on this data: the "
        "same computation here, kv_scale 0.75 read as 0.5 (2^-1))");
  CHECK(kvaudit::diagnosis_summary(run.diagnosis[2]) ==
        "no hypothesis in the catalogue explains this failure (14 tried; closest: scale-bf16 "
        "(kv_scale 0.75 read as 0.75), its replay 0.8 of the candidate's distance, 5.12x its "
        "limits)");
  kvaudit::DiagnosisFinding nothing_applies = run.diagnosis[2];
  nothing_applies.tried = 0;
  nothing_applies.closest.reset();
  CHECK(kvaudit::diagnosis_summary(nothing_applies) ==
        "no hypothesis in the catalogue explains this failure (none applies here)");

  const nlohmann::json j = kvaudit::to_json(run);
  const nlohmann::json& diagnosis = j.at("diagnosis");
  REQUIRE(diagnosis.size() == 3);
  const nlohmann::json& first = diagnosis[0];
  CHECK(first.at("step") == 1);
  CHECK(first.at("layer") == 3);
  CHECK(first.at("comparison") == "kernel");
  CHECK(first.at("explained") == true);
  CHECK(first.at("indistinguishable") == false);
  CHECK(first.at("before") == nlohmann::json({{"rel_l2", 0.025},
                                              {"max_abs_over_ref_max", 0.031},
                                              {"lse_max_abs", 1.5},
                                              {"nonfinite_mismatches", 0}}));
  CHECK(first.at("explained_by")[0].at("hypothesis") == "lse-base-2");
  CHECK(first.at("explained_by")[0].at("after").at("rel_l2") == 0.0018);
  CHECK(first.at("explained_by")[0].at("excess") == 0.46);
  CHECK(first.at("closest").is_null());
  CHECK(first.at("hypotheses_tried") == 14);
  CHECK(diagnosis[1].at("indistinguishable") == true);
  CHECK(diagnosis[1].at("same_computation") == true);
  const nlohmann::json& none = diagnosis[2];
  CHECK(none.at("explained") == false);
  CHECK(none.at("explained_by") == nlohmann::json::array());
  CHECK(none.at("closest").at("hypothesis") == "scale-bf16");
  CHECK(none.at("closest").at("reasons")[0] == "rel_l2 0.02 > 0.00391 (kernel limit)");
  CHECK(none.at("not_applicable") == nlohmann::json({"scale-not-applied"}));
  CHECK_THAT(none.at("summary").get<std::string>(),
             Catch::StartsWith("no hypothesis in the catalogue explains this failure"));
  // Without a captured pool that differs, there is no captured pool cost.
  CHECK(j.at("captured_pool_cost").is_null());
}

TEST_CASE("captured pool cost: the first failing captured_cache, by step then layer",
          "[check_result]") {
  using kvaudit::testing::make_comparison;
  CheckRun run;
  run.policy = kvaudit::default_policy();
  CHECK_FALSE(kvaudit::captured_pool_cost(run).has_value());
  // Layer 5 (dump order first) fails from step 3; layer 1 from step 2.
  run.comparisons.push_back(make_comparison(1, 5, Comparison::kCapturedCache, 0.0, true, false));
  run.comparisons.push_back(make_comparison(3, 5, Comparison::kCapturedCache, 0.2, false, false));
  auto cost = kvaudit::captured_pool_cost(run);
  REQUIRE(cost.has_value());
  CHECK(cost->shows);
  CHECK(cost->step == 3);
  run.comparisons.push_back(make_comparison(2, 1, Comparison::kCapturedCache, 0.1, false, false));
  run.comparisons.push_back(make_comparison(2, 4, Comparison::kCapturedCache, 0.3, false, false));
  kvaudit::IntegrityFinding damage;
  damage.step = 1;
  damage.layer_id = 1;
  damage.check = IntegrityCheck::kCapturedPool;
  damage.pass = false;
  run.integrity.push_back(damage);
  cost = kvaudit::captured_pool_cost(run);
  REQUIRE(cost.has_value());
  CHECK(cost->step == 2);
  CHECK(cost->layer_id == 1);
  CHECK(cost->cost.rel_l2 == 0.1);
  CHECK(cost->damaged_since_step == 1);
  const nlohmann::json j = kvaudit::to_json(run).at("captured_pool_cost");
  CHECK(j.at("step") == 2);
  CHECK(j.at("layer") == 1);
  CHECK(j.at("shows") == true);
  CHECK(j.at("damaged_since_step") == 1);
  CHECK(j.at("cost").at("rel_l2") == 0.1);
}

TEST_CASE("a closest hypothesis within explain_fraction but not the limits is said to carry most",
          "[check_result][diagnosis]") {
  DiagnosisFinding finding;
  finding.tried = 90;
  HypothesisOutcome closest;
  closest.hypothesis = "q-e4m3 + p-e4m3-tile";
  closest.transform = "q cast to e4m3";
  closest.fraction = 0.137;
  closest.excess = 6.48;
  finding.closest = closest;
  const std::string within = diagnosis_summary(finding, 0.25);
  CHECK_THAT(within, Catch::StartsWith("no hypothesis in the catalogue explains this failure"));
  CHECK_THAT(within,
             Catch::Contains("its replay 0.137 of the candidate's distance (within "
                             "explain_fraction 0.25: it carries most of the error), "
                             "6.48x its limits: the rest is not modelled by the catalogue"));

  finding.closest->fraction = 0.5;  // outside the fraction rule: only "closest"
  const std::string outside = diagnosis_summary(finding, 0.25);
  CHECK_THAT(outside,
             Catch::Contains("its replay 0.5 of the candidate's distance, 6.48x its limits"));
  CHECK_THAT(outside, !Catch::Contains("carries most"));
  CHECK_THAT(diagnosis_summary(finding), !Catch::Contains("carries most"));  // no policy given
}
