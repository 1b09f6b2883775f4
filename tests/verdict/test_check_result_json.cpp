// check_run_from_json, the inverse of to_json: to_json(from_json(j)) == j on a hand-built run
// (every kind of value: NaN and infinity as strings, null locations, carried damage, a first
// divergence, a merged run's provenance) and on the report of every shipped dump checked clean,
// without a backend and under a write and a read fault, through the binary; so a key added to
// to_json without its reader fails here. Then the errors: file and JSON pointer of the key.
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "src/verdict/check_result.hpp"
#include "tests/cli/shard_commands.hpp"
#include "tests/verdict/check_run_fixture.hpp"

namespace kvaudit {
namespace {

// Everything to_json writes, and to_json again of what check_run_from_json read from it.
void require_round_trip(const nlohmann::json& report, const std::string& name) {
  const Result<CheckRun> run = check_run_from_json(report, name);
  INFO(name << ": " << (run.ok() ? "" : run.error().message()));
  REQUIRE(run.ok());
  const nlohmann::json again = to_json(*run);
  for (const auto& item : report.items()) {
    INFO("key " << item.key());
    CHECK(again.at(item.key()) == item.value());
  }
  CHECK(again == report);
}

CheckRun every_kind_of_value() {
  CheckRun run = testing::make_failing_run();
  ComparisonResult& kernel = run.comparisons[2];
  kernel.metrics.nonfinite_mismatches = 2;
  kernel.metrics.candidate_nonfinite = 2;
  kernel.metrics.first_nonfinite_mismatch = {1, 0, 4, 0.5,
                                             std::numeric_limits<double>::quiet_NaN()};
  kernel.metrics.max_rel = std::numeric_limits<double>::infinity();
  kernel.metrics.rel_l2 = std::numeric_limits<double>::quiet_NaN();
  kernel.sets_exit = false;  // written as true: it has NaN/Inf mismatches
  run.comparisons[1].metrics.has_lse = false;
  run.integrity[1].carried_from_step = 0;
  run.integrity[1].misplaced_rows = {{7, 6, 0, 0, 6}, {12, 11, 3, 1, 0}};
  run.first_divergence = Divergence{1, 3, 1, 5, 2, Comparison::kKernel, "rel_l2 0.025 > 0.00391"};
  run.notes = {"S000 L000: a note"};
  run.provenance.merged_from = {
      {"p0.json", "0/2", "node1", "2026-11-29T09:30:00Z", "kvaudit check --shard 0/2"},
      {"p1.json", "1/2", "node2", "2026-11-29T09:31:00Z", "kvaudit check --shard 1/2"}};
  // The keys of the sign-off report, the diagnosis and the exec protocol.
  run.provenance.git_revision = "0123abc";
  run.provenance.cpu = "2 x Example CPU";
  run.diagnosis = testing::make_diagnosis();
  run.diagnosis_seconds = 0.25;
  run.coverage = {{0, 3, 40, 0, 40 * 576, 2}, {1, 3, 41, 41, 41 * 576, -1}};
  run.signoff = SignOff{"A. Reviewer", "", "sglang, H200"};
  run.backend_protocol = {{"protocol_version", 1}, {"steps", 2}, {"overhead_seconds", 0.01}};
  return run;
}

}  // namespace

TEST_CASE("report.json read back: a hand-built run of every kind of value", "[check_result]") {
  require_round_trip(to_json(testing::make_failing_run()), "fixture");
  require_round_trip(to_json(every_kind_of_value()), "every kind of value");
  const CheckRun run = *check_run_from_json(to_json(every_kind_of_value()), "fixture");
  CHECK(std::isnan(run.comparisons[2].metrics.rel_l2));
  CHECK(std::isinf(run.comparisons[2].metrics.max_rel));
  CHECK(run.comparisons[2].metrics.first_nonfinite_mismatch.row == 1);
  CHECK(run.integrity[1].carried_from_step == 0);
  REQUIRE(run.integrity[1].misplaced_rows.size() == 2);
  CHECK(run.integrity[1].misplaced_rows[1] == MisplacedRow{12, 11, 3, 1, 0});
  CHECK(run.diagnosis.size() == testing::make_diagnosis().size());
  CHECK(run.coverage.size() == 2);
  CHECK(run.coverage[1].saturated_codes == -1);
  REQUIRE(run.signoff.has_value());
  CHECK(run.signoff->model.empty());
  CHECK(run.provenance.cpu == "2 x Example CPU");
  CHECK(run.integrity[1].classification == SlotClass::kBf16Bytes);
  CHECK(run.provenance.merged_from.size() == 2);
  CHECK(run.policy.name == "default");
  CHECK_FALSE(run.pass());
}

TEST_CASE("report.json read back: every shipped dump's report, clean and failing",
          "[check_result][datasets]") {
  using kvaudit_test::read_json;
  using kvaudit_test::run_kvaudit;
  const std::filesystem::path dir = kvaudit_test::test_tmpdir() / "report_round_trip";
  std::filesystem::create_directories(dir);
  for (const char* dump : {"glm5_page1", "page64_nan", "saturated_page16"}) {
    const std::string signoff = "--inject scale-mismatch --signoff --signed-by A --model M" +
                                kvaudit_test::signing_key_option() + " --report '" +
                                (dir / "signed").string() + "'";
    for (const std::string& options :
         std::vector<std::string>{"--backend cpu-fp8", "--backend none", "--inject bf16-writeback",
                                  "--inject masked-nan-leak", signoff}) {
      const auto path = dir / "report.json";
      std::filesystem::remove(path);
      const auto outcome =
          run_kvaudit("round_trip", "check " + kvaudit_test::shipped_dump(dump) + " --threads 2 " +
                                        options + " --json '" + path.string() + "'");
      INFO(dump << " " << options << ": " << outcome.out << outcome.err);
      REQUIRE((outcome.status == 0 || outcome.status == 1));
      require_round_trip(read_json(path), std::string(dump) + " " + options);
    }
  }
}

TEST_CASE("report.json read back: errors name the file and the key", "[check_result]") {
  const nlohmann::json report = to_json(testing::make_failing_run());
  auto error_of = [](const nlohmann::json& json) {
    const Result<CheckRun> run = check_run_from_json(json, "r.json");
    REQUIRE_FALSE(run.ok());
    CHECK(run.error().kind == ErrorKind::kBadInput);
    return run.error().message();
  };
  nlohmann::json bad = report;
  bad["results"][1]["metrics"]["rms"] = "small";
  CHECK_THAT(error_of(bad), Catch::StartsWith("r.json:/results/1/metrics/rms: expected a number"));
  bad = report;
  bad["integrity"][0].erase("detail");
  CHECK_THAT(error_of(bad), Catch::StartsWith("r.json:/integrity/0: missing key detail"));
  bad = report;
  bad["results"][0]["certified"] = true;  // a key this kvaudit does not write
  CHECK_THAT(error_of(bad), Catch::StartsWith("r.json:/results/0/certified: unknown key"));
  bad = report;
  bad["new_section"] = nlohmann::json::object();
  CHECK_THAT(error_of(bad), Catch::StartsWith("r.json:/new_section: unknown key"));
  bad = report;
  bad["integrity"][1]["check"] = "checksum";
  CHECK_THAT(error_of(bad), Catch::StartsWith("r.json:/integrity/1/check: unknown name"));
  bad = report;
  bad["policy"]["kernel"]["rel_l2"]["limit"] = -1;
  CHECK_THAT(error_of(bad), Catch::StartsWith("r.json:/policy/kernel/rel_l2/limit"));
  bad = report;
  bad["tool"] = "other";
  CHECK_THAT(error_of(bad), Catch::StartsWith("r.json:/tool"));
  CHECK_THAT(error_of(nlohmann::json::array()), Catch::StartsWith("r.json:/: expected an object"));
}

}  // namespace kvaudit
