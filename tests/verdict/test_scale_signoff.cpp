// Tests of the served-scale sign-off (src/verdict/signoff.hpp "The served scale"): the one rule
// (quantization rel_l2 limit, or scale_error_factor x the recommended scale's error), the cause
// it names, the run's verdict under sign-off and under the default policy, the report.json
// round trip of CheckRun::scales, and the two shipped traces: scale 1.0 fails naming saturation
// and the recommended scale, the recalibrated one passes.
#include <catch2/catch.hpp>
#include <string>

#include "src/cli/cli.hpp"
#include "src/format/kvdump.hpp"
#include "src/verdict/check_result.hpp"
#include "src/verdict/policy.hpp"
#include "src/verdict/signoff.hpp"
#include "tests/test_paths.hpp"

namespace kvaudit {
namespace {

// The numbers are chosen by hand against the sign-off policy's quantization rel_l2 limit 2^-4 =
// 0.0625 and the default factor 2.
LayerScaleCheck layer_with(double served_rel_l2, double recommended_rel_l2, double saturated,
                           double served_underflow, double recommended_underflow) {
  LayerScaleCheck layer;
  layer.layer_id = 7;
  layer.served_scale = 1.0;
  layer.recommended_scale = 2.69642854;
  layer.recommended_rule = "amax/448";
  layer.served_rel_l2 = served_rel_l2;
  layer.recommended_rel_l2 = recommended_rel_l2;
  layer.served_saturated_fraction = saturated;
  layer.served_underflow_fraction = served_underflow;
  layer.recommended_underflow_fraction = recommended_underflow;
  layer.curve = {{1.0, served_rel_l2, saturated}, {2.69642854, recommended_rel_l2, 0.0}};
  return layer;
}

TEST_CASE("scale sign-off: over the quantization limit with saturation fails, naming both",
          "[signoff][scales]") {
  const auto failure =
      judge_served_scale(signoff_policy(), layer_with(0.2, 0.04, 0.003, 0.01, 0.02));
  REQUIRE(failure);
  CHECK(failure->cause == ScaleCause::kSaturation);
  CHECK(failure->sentence.find("layer 7") != std::string::npos);
  CHECK(failure->sentence.find("saturation") != std::string::npos);
  CHECK(failure->sentence.find("k_scale = v_scale = 2.69642854") != std::string::npos);
  CHECK(failure->sentence.find("over the quantization limit 0.0625") != std::string::npos);
}

TEST_CASE("scale sign-off: within the limit and the factor passes", "[signoff][scales]") {
  CHECK_FALSE(judge_served_scale(signoff_policy(), layer_with(0.05, 0.04, 0.0, 0.1, 0.02)));
}

TEST_CASE("scale sign-off: under the limit but past the factor fails, naming underflow",
          "[signoff][scales]") {
  const auto failure =
      judge_served_scale(signoff_policy(), layer_with(0.05, 0.02, 0.0, 0.30, 0.02));
  REQUIRE(failure);
  CHECK(failure->cause == ScaleCause::kUnderflow);
  CHECK(failure->sentence.find("over 2x the recommended scale's 0.02") != std::string::npos);
  Policy lenient = signoff_policy();
  lenient.scale_error_factor = 3.0;  // 0.05 <= 3 x 0.02 and <= 0.0625
  CHECK_FALSE(judge_served_scale(lenient, layer_with(0.05, 0.02, 0.0, 0.30, 0.02)));
}

TEST_CASE("scale sign-off: a failing scale fails the run under sign-off only",
          "[signoff][scales]") {
  CheckRun run;
  run.policy = signoff_policy();
  run.scales = {layer_with(0.2, 0.04, 0.003, 0.01, 0.02)};
  CHECK(scales_fail_run(run));
  CHECK_FALSE(run.pass());
  run.policy = default_policy();  // report-only there, like quantization itself
  CHECK_FALSE(scales_fail_run(run));
  CHECK(run.pass());
}

TEST_CASE("scale sign-off: report.json carries the scales and reads them back",
          "[signoff][scales]") {
  CheckRun run;
  run.policy = signoff_policy();
  run.scales = {layer_with(0.2, 0.04, 0.003, 0.01, 0.02)};
  const nlohmann::json json = to_json(run);
  REQUIRE(json.contains("scales"));
  CHECK(json["scales"][0]["pass"] == false);
  CHECK(json["scales"][0]["cause"] == "saturation");
  CHECK(json["policy"]["scale_error_factor"] == 2.0);
  auto back = check_run_from_json(json, "report.json");
  REQUIRE(back);
  REQUIRE(back->scales.size() == 1);
  CHECK(back->scales[0].served_rel_l2 == 0.2);
  CHECK(back->scales[0].curve.size() == 2);
  CHECK(back->policy.scale_error_factor == 2.0);
}

// A shipped dump, opened (the case fails naming the error otherwise).
DumpReader dataset(const char* name) {
  auto reader = DumpReader::open(kvaudit_test::source_dir() / "datasets" / name);
  if (!reader) FAIL(reader.error().message());
  return std::move(*reader);
}

TEST_CASE("scale sign-off: the scale-1.0 trace fails naming saturation, the recalibrated passes",
          "[signoff][scales]") {
  const DumpReader unit = dataset("glm5_outliers_scale1.h5");
  auto unit_served = served_scale_checks(unit, {}, 0);
  REQUIRE(unit_served);
  CHECK(unit_served->notes.empty());
  const std::vector<LayerScaleCheck>* unit_checks = &unit_served->checks;
  REQUIRE(unit_checks->size() == 2);
  for (const LayerScaleCheck& layer : *unit_checks) {
    INFO("layer " << layer.layer_id);
    CHECK(layer.served_scale == 1.0);
    const auto failure = judge_served_scale(signoff_policy(), layer);
    REQUIRE(failure);
    CHECK((failure->cause == ScaleCause::kSaturation || failure->cause == ScaleCause::kBoth));
    CHECK(failure->sentence.find("use k_scale = v_scale = ") != std::string::npos);
  }
  const DumpReader calibrated = dataset("glm5_outliers_calibrated.h5");
  auto calibrated_served = served_scale_checks(calibrated, {}, 0);
  REQUIRE(calibrated_served);
  const std::vector<LayerScaleCheck>* calibrated_checks = &calibrated_served->checks;
  REQUIRE(calibrated_checks->size() == 2);
  for (std::size_t i = 0; i < calibrated_checks->size(); ++i) {
    const LayerScaleCheck& layer = (*calibrated_checks)[i];
    INFO("layer " << layer.layer_id);
    // The recalibrated trace was written with what calibrate recommends for the scale-1.0 one.
    CHECK(static_cast<float>(layer.served_scale) ==
          static_cast<float>((*unit_checks)[i].recommended_scale));
    CHECK_FALSE(judge_served_scale(signoff_policy(), layer));
  }
}

TEST_CASE("scale sign-off: what cannot be judged is a note naming why, not a silent gap",
          "[signoff][scales]") {
  const DumpReader no_source = dataset("page64_nan.h5");  // written without kv_source
  auto served = served_scale_checks(no_source, {}, 0);
  REQUIRE(served);
  CHECK(served->checks.empty());
  REQUIRE(served->notes.size() == 1);
  CHECK_THAT(served->notes[0], Catch::Contains("Scales: not judged: layer(s) 0, 1 have no "
                                               "kv_source"));

  const DumpReader grouped = dataset("glm5_pertoken_fp8rope.h5");  // per_token_group scales
  auto grouped_served = served_scale_checks(grouped, {}, 0);
  REQUIRE(grouped_served);
  CHECK(grouped_served->checks.empty());
  REQUIRE(grouped_served->notes.size() == 1);
  CHECK_THAT(grouped_served->notes[0], Catch::Contains("per_token_group scales"));
}

}  // namespace
}  // namespace kvaudit
