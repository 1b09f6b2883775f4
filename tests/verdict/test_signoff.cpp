// The sign-off rule (src/verdict/signoff.hpp): a verdict rests only on what was measured. Runs are
// built by hand (tests/verdict/check_run_fixture.hpp) with coverage sites written out here.
#include <catch2/catch.hpp>

#include "src/verdict/check_result.hpp"
#include "src/verdict/signoff.hpp"
#include "tests/verdict/check_run_fixture.hpp"

using kvaudit::CheckRun;
using kvaudit::Comparison;
using kvaudit::GapReason;
using kvaudit::StepLayerCoverage;
using kvaudit::testing::make_comparison;

namespace {

// Two layers (0, 1), two steps, kernel and cache everywhere, everything passing; quantization and
// total only where `measured` says, the others' tokens without a source value.
CheckRun clean_run(bool signoff, bool layer1_measured) {
  CheckRun run;
  run.backend = "cpu-fp8";
  run.policy = signoff ? kvaudit::signoff_policy() : kvaudit::default_policy();
  for (int step = 0; step < 2; ++step) {
    for (int layer = 0; layer < 2; ++layer) {
      const bool measured = layer == 0 || layer1_measured;
      run.comparisons.push_back(
          make_comparison(step, layer, Comparison::kKernel, 0.002, true, true));
      run.comparisons.push_back(make_comparison(step, layer, Comparison::kCache, 0.0, true, true));
      if (measured) {
        run.comparisons.push_back(
            make_comparison(step, layer, Comparison::kQuantization, 0.03, true, signoff));
        run.comparisons.push_back(
            make_comparison(step, layer, Comparison::kTotal, 0.03, true, signoff));
      }
      run.coverage.push_back({step, layer, 40, measured ? 0 : 37, 40 * 576, 0});
    }
  }
  return run;
}

}  // namespace

TEST_CASE("sign-off fails where quantization and total error were not measured", "[signoff]") {
  const CheckRun run = clean_run(true, false);
  const auto gaps = kvaudit::measurement_gaps(run);
  REQUIRE(gaps.size() == 2);  // layer 1: quantization, total
  CHECK(gaps[0].layer_id == 1);
  CHECK(gaps[0].comparison == Comparison::kQuantization);
  CHECK(gaps[0].reason == GapReason::kNoSource);
  CHECK(gaps[0].steps == std::vector<int>{0, 1});
  CHECK(gaps[0].tokens_read == 40);
  CHECK(gaps[0].tokens_without_source == 37);
  CHECK(gaps[1].comparison == Comparison::kTotal);
  CHECK(kvaudit::unmeasured_sites(gaps) == 4);
  CHECK(kvaudit::gaps_fail_run(run));
  CHECK_FALSE(run.pass());
  CHECK(kvaudit::count_results(run).unmeasured == 4);
  CHECK(kvaudit::gaps_headline(gaps) ==
        "quantization and total error not measured in layer 1 (the tokens the steps read have no "
        "source value: no kv_source)");
}

TEST_CASE("the default policy reports gaps but passes", "[signoff]") {
  const CheckRun run = clean_run(false, false);
  CHECK(kvaudit::measurement_gaps(run).size() == 2);
  CHECK_FALSE(kvaudit::gaps_fail_run(run));
  CHECK(run.pass());
  const nlohmann::json j = kvaudit::to_json(run);
  CHECK(j.at("verdict") == "pass");
  CHECK(j.at("counts").at("unmeasured") == 4);
  REQUIRE(j.at("unmeasured").size() == 2);
  CHECK(j.at("unmeasured")[0].at("layer") == 1);
  CHECK(j.at("unmeasured")[0].at("reason") == "no_source");
  CHECK(j.at("unmeasured")[0].at("steps") == nlohmann::json::array({0, 1}));
  CHECK(j.at("coverage").size() == 4);
  CHECK(j.at("coverage")[1].at("tokens_without_source") == 37);
}

TEST_CASE("sign-off passes when everything was measured", "[signoff]") {
  const CheckRun run = clean_run(true, true);
  CHECK(kvaudit::measurement_gaps(run).empty());
  CHECK(run.pass());
  CHECK(kvaudit::gaps_headline({}).empty());
}

TEST_CASE("without a backend, total error is unmeasured for want of a backend", "[signoff]") {
  CheckRun run;
  run.backend = "none";
  run.policy = kvaudit::signoff_policy();
  run.comparisons.push_back(make_comparison(0, 3, Comparison::kQuantization, 0.03, true, true));
  run.coverage.push_back({0, 3, 10, 0, 5760, 0});
  const auto gaps = kvaudit::measurement_gaps(run);
  REQUIRE(gaps.size() == 1);
  CHECK(gaps[0].comparison == Comparison::kTotal);
  CHECK(gaps[0].reason == GapReason::kNoBackend);
  CHECK_FALSE(run.pass());
  CHECK(kvaudit::gaps_headline(gaps) == "total error not measured in layer 3 (no backend ran)");
}

TEST_CASE("a run without coverage (built by hand, or no step reported) has no gaps", "[signoff]") {
  CheckRun run = kvaudit::testing::make_failing_run();
  run.policy = kvaudit::signoff_policy();
  CHECK(kvaudit::measurement_gaps(run).empty());
}
