// Mutation test of the harness on the CPU backend (runs in CI): every fault of
// src/backend/injection.hpp, injected into cpu-fp8 on every shipped dump, must be caught by the
// check meant for it, with exit 1 and findings naming step, layer and slots (write faults) or step,
// layer, request, row and head (read faults); clean runs pass. The matrix and its assertions are in
// injection_matrix.hpp, shared with the cuda-fp8 run (test_injections_cuda.cpp, [gpu]).
#include <sys/wait.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "kvaudit_test_config.hpp"  // KVAUDIT_BINARY, KVAUDIT_SOURCE_DIR, KVAUDIT_TEST_TMPDIR
#include "src/backend/injection.hpp"
#include "tests/backend/injection_matrix.hpp"

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

}  // namespace

TEST_CASE("cpu-fp8: every injected fault on every shipped dump is caught by its check",
          "[injection][cli]") {
  // Every catalogued injection has a row in the matrix (plus "none").
  REQUIRE(std::size(kvaudit_test::kInjectionMatrix) == kvaudit::injection_table().size() + 1);
  for (const auto& expectation : kvaudit_test::kInjectionMatrix) {
    REQUIRE(kvaudit::parse_injection(expectation.injection).ok());
    for (const char* dump : kvaudit_test::kShippedDumps) {
      kvaudit_test::require_injection_outcome("cpu-fp8", dump, expectation);
    }
  }
}

TEST_CASE(
    "cpu-fp8: every injected fault on the kvdump v1.1 dumps is caught by its check, or refused",
    "[injection][cli]") {
  REQUIRE(std::size(kvaudit_test::kGroupInjectionMatrix) == kvaudit::injection_table().size() + 1);
  for (const auto& expectation : kvaudit_test::kGroupInjectionMatrix) {
    REQUIRE(kvaudit::parse_injection(expectation.injection).ok());
    for (const char* dump : kvaudit_test::kShippedGroupDumps) {
      kvaudit_test::require_group_injection_outcome("cpu-fp8", dump, expectation);
    }
  }
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

// One row of fp32 values as kv_write_code reads it (the CPU model's FloatRowView is private).
struct TestRow {
  const float* values;
  float value(int col) const { return values[col]; }
  std::uint16_t bf16_bits(int col) const { return kvaudit::bf16_from_float(values[col]); }
};

template <kvaudit::KvWriteRule kRule>
std::uint8_t write_code(const float* values, int col, float kv_scale) {
  return kvaudit::kv_write_code<kRule, kvaudit::HostE4m3Rounding>(TestRow{values}, col, kv_scale);
}

TEST_CASE("the write rules shared by cpu-fp8 and cuda-fp8 are chosen and applied as named",
          "[injection]") {
  using kvaudit::Injection;
  using kvaudit::kv_write_rule_of;
  using kvaudit::KvWriteRule;
  CHECK(kv_write_rule_of(Injection::kNone, false) == KvWriteRule::kDivide);
  CHECK(kv_write_rule_of(Injection::kNone, true) == KvWriteRule::kReciprocal);
  CHECK(kv_write_rule_of(Injection::kScaleMismatch, false) == KvWriteRule::kDivide);
  CHECK(kv_write_rule_of(Injection::kRoundTowardZero, true) == KvWriteRule::kRoundTowardZero);
  CHECK(kv_write_rule_of(Injection::kNoSaturation, false) == KvWriteRule::kNoSaturation);
  CHECK(kv_write_rule_of(Injection::kBf16Writeback, false) == KvWriteRule::kBf16Bytes);
  CHECK(kvaudit::kv_write_slot_offset(Injection::kNeighbourSlotWrite) == 1);
  CHECK(kvaudit::kv_write_slot_offset(Injection::kNoSaturation) == 0);
  CHECK(std::string(kvaudit::kv_write_rule_name(KvWriteRule::kBf16Bytes)) == "bf16-bytes");

  // e4m3 codes by hand: 1.0 = 0x38, 1.125 = 0x39, 448 = 0x7E, NaN = 0x7F; bf16 of 1.0 is 0x3F80,
  // of -2.0 0xC000 (little-endian bytes 80 3F 00 C0).
  const float row[4] = {1.1f, 1000.0f, 1.0f, -2.0f};
  CHECK(write_code<KvWriteRule::kDivide>(row, 0, 1.0f) == 0x39);  // 1.1 rounds to 1.125
  CHECK(write_code<KvWriteRule::kRoundTowardZero>(row, 0, 1.0f) == 0x38);
  CHECK(write_code<KvWriteRule::kDivide>(row, 1, 1.0f) == 0x7E);  // saturates
  CHECK(write_code<KvWriteRule::kNoSaturation>(row, 1, 1.0f) == 0x7F);
  CHECK(write_code<KvWriteRule::kNoSaturation>(row, 0, 1.0f) == 0x39);
  CHECK(write_code<KvWriteRule::kBf16Bytes>(row + 2, 0, 1.0f) == 0x80);
  CHECK(write_code<KvWriteRule::kBf16Bytes>(row + 2, 1, 1.0f) == 0x3F);
  CHECK(write_code<KvWriteRule::kBf16Bytes>(row + 2, 2, 1.0f) == 0x00);
  CHECK(write_code<KvWriteRule::kBf16Bytes>(row + 2, 3, 1.0f) == 0xC0);
  // kDivide and kReciprocal are the host codec's two kvdump roundings (the device passes its
  // cvt-based pair instead, compared code for code in tests/core/test_fp8_e4m3_cuda.cu).
  for (const float scale : {0.37f, 0.0625f, 3.0f}) {
    CHECK(write_code<KvWriteRule::kDivide>(row, 0, scale) ==
          kvaudit::kvdump_quantize(row[0], scale));
    CHECK(write_code<KvWriteRule::kReciprocal>(row, 0, scale) ==
          kvaudit::kvdump_quantize_reciprocal(row[0], scale));
  }
  // The runtime dispatch reaches the instantiation of each rule.
  for (const KvWriteRule rule :
       {KvWriteRule::kDivide, KvWriteRule::kReciprocal, KvWriteRule::kRoundTowardZero,
        KvWriteRule::kNoSaturation, KvWriteRule::kBf16Bytes}) {
    CHECK(kvaudit::dispatch_kv_write_rule(rule, [](auto kind) { return decltype(kind)::value; }) ==
          rule);
  }
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
