// `kvaudit backend-serve` and the round trip through the external backend protocol: `check
// --backend exec:cpu-fp8 --backend-command "kvaudit backend-serve cpu-fp8"` must give the report
// of `--backend cpu-fp8` (all but the fields naming and timing the backend) and bit-identical
// saved outputs on every shipped dump, and the same with every injection of the served backend:
// the protocol loses nothing, findings included. The exec run's report holds the protocol's
// overhead (timing.backend_protocol).
#include <catch2/catch.hpp>
#include <string>

#include "tests/backend/exec_test_support.hpp"

namespace kvaudit {
namespace {

using exec_test::case_dir;
using exec_test::CommandRun;
using exec_test::kvaudit;
using exec_test::quoted;
using exec_test::run_shell;
using exec_test::serve_command;
using exec_test::shipped_dump;

struct CheckPair {
  CommandRun in_process;
  CommandRun exec;
  nlohmann::json in_process_report;
  nlohmann::json exec_report;
};

// The same check in process and through backend-serve, with --json and --save-outputs into dir.
CheckPair check_both_ways(const std::filesystem::path& dir, const std::string& dump,
                          const std::string& injection = "") {
  const std::string common = " check " + quoted(shipped_dump(dump)) + " --threads 2";
  const std::string inject = injection.empty() ? "" : " --inject " + injection;
  CheckPair pair;
  pair.in_process = run_shell(kvaudit() + common + " --backend cpu-fp8" + inject + " --json " +
                                  quoted(dir / "in_process.json") + " --save-outputs " +
                                  quoted(dir / "in_process.h5"),
                              dir, "in_process.log");
  pair.exec =
      run_shell(kvaudit() + common + " --backend exec:cpu-fp8 --backend-command " +
                    exec_test::shell_word(serve_command(inject)) + " --json " +
                    quoted(dir / "exec.json") + " --save-outputs " + quoted(dir / "exec.h5"),
                dir, "exec.log");
  pair.in_process_report = exec_test::load_json(dir / "in_process.json");
  pair.exec_report = exec_test::load_json(dir / "exec.json");
  return pair;
}

void check_same(const CheckPair& pair) {
  INFO(pair.in_process.command << "\n" << pair.in_process.output);
  INFO(pair.exec.command << "\n" << pair.exec.output);
  CHECK(pair.exec.status == pair.in_process.status);
  REQUIRE(pair.in_process_report.is_object());
  REQUIRE(pair.exec_report.is_object());
  CHECK(pair.exec_report.value("backend", "") == "exec:cpu-fp8");
  CHECK(exec_test::without_backend(pair.exec_report) ==
        exec_test::without_backend(pair.in_process_report));
}

}  // namespace

TEST_CASE("backend-serve: exec:cpu-fp8 through the protocol equals cpu-fp8 on every shipped dump",
          "[exec][serve]") {
  for (const std::string dump : {"glm5_page1", "page64_nan", "saturated_page16"}) {
    SECTION(dump) {
      const auto dir = case_dir("serve_" + dump);
      const CheckPair pair = check_both_ways(dir, dump);
      check_same(pair);
      const auto exec_outputs = exec_test::dataset_bytes(dir / "exec.h5");
      CHECK_FALSE(exec_outputs.empty());
      CHECK(exec_outputs == exec_test::dataset_bytes(dir / "in_process.h5"));
      // The hello's describe (the served backend's own) and the exec facts.
      const nlohmann::json& description = pair.exec_report["backend_description"];
      CHECK(description.value("name", "") == "cpu-fp8");
      CHECK(description.value("served_by", "") == "kvaudit backend-serve");
      CHECK(description["exec"].value("protocol_version", 0) == 1);
      CHECK_THAT(description["exec"].value("command", ""), Catch::Contains("backend-serve"));
      // The protocol's cost: every (step, layer) timed, compute reported by the server.
      const nlohmann::json& protocol = pair.exec_report["timing"]["backend_protocol"];
      const nlohmann::json& summary = pair.exec_report["dump"]["summary"];
      const int step_layers = static_cast<int>(summary["steps"].size() * summary["layers"].size());
      CHECK(protocol.value("steps", 0) == step_layers);
      CHECK(protocol.value("steps_with_compute_seconds", 0) == step_layers);
      CHECK(protocol.value("layer_requests", 0) == static_cast<int>(summary["layers"].size()));
      CHECK(protocol.value("overhead_seconds", -1.0) >= 0.0);
      CHECK(protocol.value("compute_seconds", -1.0) > 0.0);
      CHECK(pair.in_process_report["timing"]["backend_protocol"].is_null());
    }
  }
}

TEST_CASE("backend-serve: every injection gives the same findings behind the protocol",
          "[exec][serve]") {
  const char* injections[] = {"bf16-writeback",       "fp8-read-as-bf16", "masked-nan-leak",
                              "neighbour-slot-write", "no-saturation",    "round-toward-zero",
                              "scale-mismatch",       "whole-pool-cast"};
  for (const std::string dump : {"glm5_page1", "page64_nan"}) {
    for (const std::string injection : injections) {
      SECTION(dump + " " + injection) {
        check_same(check_both_ways(case_dir("serve_" + dump + "_" + injection), dump, injection));
      }
    }
  }
}

TEST_CASE("backend-serve: serves built-in backends only, and is listed for testing the protocol",
          "[exec][serve]") {
  const auto dir = case_dir("serve_cli");
  const CommandRun exec = run_shell(kvaudit() + " backend-serve exec:torch < /dev/null", dir);
  CHECK(exec.status == 2);
  CHECK_THAT(exec.output, Catch::Contains("serves a built-in backend, not exec:NAME"));
  const CommandRun help = run_shell(kvaudit() + " --help", dir);
  CHECK_THAT(help.output, Catch::Contains("backend-serve"));
  CHECK_THAT(help.output, Catch::Contains("For testing the external backend protocol"));
  // No hello at all: exit 2, a line on stderr, nothing on stdout.
  const CommandRun silent = run_shell(kvaudit() + " backend-serve cpu-fp8 < /dev/null", dir);
  CHECK(silent.status == 2);
  CHECK_THAT(silent.output, Catch::Contains("no hello"));
}

}  // namespace kvaudit
