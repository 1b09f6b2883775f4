// Mutation test of the harness: every fault of src/injection.hpp, injected into the cpu-fp8
// backend on the shipped dumps, must be caught by the check meant for it (exit 1 and a message
// naming the check, step and layer), and the clean run must pass. The whole-pool cast is
// numerically exact, so `check` passes it; the bench's pool sweep is what catches it (GPU).
#include <sys/wait.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "src/injection.hpp"

namespace {

struct CommandOutcome {
  int exit_status = -1;
  std::string output;
};

CommandOutcome run_check(const std::string& dump, const std::string& injection) {
  const std::string log = std::string(KVAUDIT_TEST_TMPDIR) + "/injection_" + injection + ".log";
  std::system((std::string("mkdir -p ") + KVAUDIT_TEST_TMPDIR).c_str());
  const std::string command = std::string(KVAUDIT_BINARY) + " check " + KVAUDIT_SOURCE_DIR +
                              "/datasets/" + dump + " --backend cpu-fp8 --threads 2 --inject " +
                              injection + " > " + log + " 2>&1";
  const int status = std::system(command.c_str());
  CommandOutcome outcome;
  outcome.exit_status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream in(log);
  std::stringstream text;
  text << in.rdbuf();
  outcome.output = text.str();
  return outcome;
}

struct InjectionCase {
  const char* injection;
  const char* dump;      // the shipped dump that holds what the fault needs
  const char* evidence;  // text the check that catches it prints
};

// no-saturation needs values past 448 * kv_scale (saturated_page16.h5); masked-nan-leak needs NaN
// codes in unused slots of a last page (page64_nan.h5).
constexpr InjectionCase kCaught[] = {
    {"bf16-writeback", "glm5_page1.h5", "written_slots: S000 L000"},
    {"round-toward-zero", "glm5_page1.h5", "written_slots: S000 L000"},
    {"no-saturation", "saturated_page16.h5", "nan_written"},
    {"scale-mismatch", "glm5_page1.h5", "first divergence (kernel): step 0 layer 0"},
    {"neighbour-slot-write", "glm5_page1.h5", "unwritten_slots: S000 L000"},
    {"fp8-read-as-bf16", "glm5_page1.h5", "first divergence (kernel): step 0 layer 0"},
    {"masked-nan-leak", "page64_nan.h5", "NaN/Inf mismatches"},
};

}  // namespace

TEST_CASE("every injected fault is caught by its check; clean runs pass", "[injection][cli]") {
  for (const char* dump : {"glm5_page1.h5", "page64_nan.h5", "saturated_page16.h5"}) {
    const CommandOutcome clean = run_check(dump, "none");
    INFO(dump << " clean:\n" << clean.output);
    CHECK(clean.exit_status == 0);
    CHECK(clean.output.find("verdict: PASS") != std::string::npos);
  }
  int covered = 0;
  for (const InjectionCase& c : kCaught) {
    const CommandOutcome outcome = run_check(c.dump, c.injection);
    INFO(c.injection << " on " << c.dump << ":\n" << outcome.output);
    CHECK(outcome.exit_status == 1);
    CHECK(outcome.output.find("verdict: FAIL") != std::string::npos);
    CHECK(outcome.output.find(c.evidence) != std::string::npos);
    ++covered;
  }
  // Every catalogued numerical fault has a case above; the cast is the one that is not numerical.
  CHECK(covered + 1 == static_cast<int>(kvaudit::injection_table().size()));
}

TEST_CASE("the whole-pool cast is numerically exact, so check passes it (bench catches it)",
          "[injection][cli]") {
  const CommandOutcome outcome = run_check("glm5_page1.h5", "whole-pool-cast");
  INFO(outcome.output);
  CHECK(outcome.exit_status == 0);
  const auto& info = kvaudit::injection_info(kvaudit::parse_injection("whole-pool-cast").value());
  CHECK(std::string(info.caught_by).find("bench") != std::string::npos);
}

TEST_CASE("an unknown injection is refused as bad input", "[injection][cli]") {
  const CommandOutcome outcome = run_check("glm5_page1.h5", "flip-all-bits");
  CHECK(outcome.exit_status == 2);
  CHECK(outcome.output.find("flip-all-bits") != std::string::npos);
}

TEST_CASE("round-toward-zero differs from nearest-even only where it must", "[injection]") {
  using kvaudit::e4m3_decode;
  using kvaudit::e4m3_encode_toward_zero;
  // 1.06 lies between 1.0 and 1.125, nearer 1.0: both rules give 1.0. 1.1 is nearer 1.125:
  // toward zero gives 1.0. Negative values mirror. Saturation is kept.
  CHECK(e4m3_decode(e4m3_encode_toward_zero(1.06f)) == 1.0f);
  CHECK(e4m3_decode(e4m3_encode_toward_zero(1.1f)) == 1.0f);
  CHECK(e4m3_decode(e4m3_encode_toward_zero(-1.1f)) == -1.0f);
  CHECK(e4m3_decode(e4m3_encode_toward_zero(1.125f)) == 1.125f);
  CHECK(e4m3_decode(e4m3_encode_toward_zero(1000.0f)) == 448.0f);
  CHECK(kvaudit::power_of_two_scale(0.37f) == 0.5f);
  CHECK(kvaudit::power_of_two_scale(0.5f) == 1.0f);
}

TEST_CASE("check --list-injections prints every injection with its check", "[injection][cli]") {
  const std::string log = std::string(KVAUDIT_TEST_TMPDIR) + "/list_injections.log";
  std::system((std::string("mkdir -p ") + KVAUDIT_TEST_TMPDIR).c_str());
  const int status =
      std::system((std::string(KVAUDIT_BINARY) + " check --list-injections > " + log).c_str());
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  std::ifstream in(log);
  std::stringstream text;
  text << in.rdbuf();
  for (const auto& info : kvaudit::injection_table()) {
    CHECK(text.str().find(info.name) != std::string::npos);
    CHECK(text.str().find(info.caught_by) != std::string::npos);
  }
}
