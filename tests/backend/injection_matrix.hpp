// The fault-injection matrix shared by the cpu-fp8 test (CI) and the cuda-fp8 test ([gpu]): every
// injection of src/backend/injection.hpp on every shipped dump, through the `kvaudit check` binary,
// and what must come of it. The expectations follow from what each fault does (docs/design.md
// "Integrity of the cache"), not from a run of the code under test:
//   write faults  change the bytes a write stores: exit 1, the integrity check meant for the
//                 fault fails with its class, naming step, layer and slots, and the error shows
//                 in the cache comparison while every kernel comparison passes;
//   read faults   leave the pool alone: exit 1, every integrity check passes, the kernel
//                 comparison fails and the first divergence names step, layer, request, row, head;
//   a fault with nothing to act on (no value past 464 * kv_scale for no-saturation, no NaN code in
//                 an unused slot for masked-nan-leak) changes nothing: exit 0, as the clean run;
//   the whole-pool cast is exact: exit 0 (the bench's pool sweep catches it, not check);
//   a fault for another scale kind (the kvdump v1.1 per_token_group faults on these per_tensor
//                 dumps) would do nothing: refused, exit 2, the message naming both kinds;
//   the translation faults act on what the attention is handed, on any pool: the RoPE ones are
//                 read faults everywhere; the mscale ones need rope attributes no shipped dump
//                 has (GLM-5 has no YaRN mscale): refused, exit 2, naming rope_mscale_all_dim.
// The per_token_group faults' own matrix, on the shipped v1.1 dumps, is kGroupInjectionMatrix.
#pragma once

#include <sys/wait.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "tests/test_paths.hpp"

namespace kvaudit_test {

// kRefusedWithoutRope: a fault that needs the dump's rope attributes (mscale-dropped,
// mscale-twice) on a dump without them: exit 2, the message naming rope_mscale_all_dim.
enum class Expect { kPass, kWriteFault, kReadFault, kRefused, kRefusedWithoutRope };

struct InjectionExpectation {
  const char* injection;
  const char* check;           // the integrity check meant to catch a write fault
  const char* classification;  // the class its failing finding carries
  Expect on_glm5_page1;        // fp8 pool, page size 1, no value past 464 * kv_scale
  Expect on_page64_nan;        // NaN codes in unused slots of last pages
  Expect on_saturated_page16;  // values up to 2 x 448 * kv_scale in layer 5 (past 464 too)
};

inline constexpr InjectionExpectation kInjectionMatrix[] = {
    {"none", "", "", Expect::kPass, Expect::kPass, Expect::kPass},
    {"bf16-writeback", "written_slots", "bf16_bytes", Expect::kWriteFault, Expect::kWriteFault,
     Expect::kWriteFault},
    {"round-toward-zero", "written_slots", "off_by_one_code", Expect::kWriteFault,
     Expect::kWriteFault, Expect::kWriteFault},
    {"no-saturation", "nan_written", "nan_code", Expect::kPass, Expect::kPass, Expect::kWriteFault},
    {"scale-mismatch", "", "", Expect::kReadFault, Expect::kReadFault, Expect::kReadFault},
    {"neighbour-slot-write", "unwritten_slots", "wrong_slot", Expect::kWriteFault,
     Expect::kWriteFault, Expect::kWriteFault},
    {"fp8-read-as-bf16", "", "", Expect::kReadFault, Expect::kReadFault, Expect::kReadFault},
    {"masked-nan-leak", "", "", Expect::kPass, Expect::kReadFault, Expect::kPass},
    {"whole-pool-cast", "", "", Expect::kPass, Expect::kPass, Expect::kPass},
    {"scale-one-write", "", "", Expect::kRefused, Expect::kRefused, Expect::kRefused},
    {"zero-group-scale", "", "", Expect::kRefused, Expect::kRefused, Expect::kRefused},
    {"rope-outside-calibration", "", "", Expect::kRefused, Expect::kRefused, Expect::kRefused},
    {"kv-scale-split", "", "", Expect::kRefused, Expect::kRefused, Expect::kRefused},
    {"scale-read-as-pow2", "", "", Expect::kRefused, Expect::kRefused, Expect::kRefused},
    {"scale-read-as-e8m0", "", "", Expect::kRefused, Expect::kRefused, Expect::kRefused},
    {"mscale-dropped", "", "", Expect::kRefusedWithoutRope, Expect::kRefusedWithoutRope,
     Expect::kRefusedWithoutRope},
    {"mscale-twice", "", "", Expect::kRefusedWithoutRope, Expect::kRefusedWithoutRope,
     Expect::kRefusedWithoutRope},
    {"kpe-deinterleaved", "", "", Expect::kReadFault, Expect::kReadFault, Expect::kReadFault},
    {"qpe-deinterleaved", "", "", Expect::kReadFault, Expect::kReadFault, Expect::kReadFault},
    {"rope-dot-missing", "", "", Expect::kReadFault, Expect::kReadFault, Expect::kReadFault},
};

inline constexpr const char* kShippedDumps[] = {"glm5_page1", "page64_nan", "saturated_page16"};

// The shipped kvdump v1.1 dumps (datasets/recipes.sh): every injection again, with what follows
// from each dump's form. glm5_dsa_flashmla: power-of-two scales, a bf16 RoPE part, sparse rows;
// glm5_pertoken_fp8rope: float32 scales, an e4m3 RoPE part 8x wider than the latent. Both hold
// all-zero latent groups among the rows their steps write.
//   scale-read-as-pow2 reads a power-of-two scale unchanged, and rope-outside-calibration has no
//   e4m3 RoPE part to act on in glm5_dsa_flashmla: nothing changes there, exit 0;
//   the per_tensor faults are refused on both (exit 2).
struct GroupInjectionExpectation {
  const char* injection;
  const char* check;
  const char* classification;
  Expect on_dsa_flashmla;
  Expect on_pertoken_fp8rope;
};

inline constexpr GroupInjectionExpectation kGroupInjectionMatrix[] = {
    {"none", "", "", Expect::kPass, Expect::kPass},
    {"bf16-writeback", "", "", Expect::kRefused, Expect::kRefused},
    {"round-toward-zero", "", "", Expect::kRefused, Expect::kRefused},
    {"no-saturation", "", "", Expect::kRefused, Expect::kRefused},
    {"scale-mismatch", "", "", Expect::kRefused, Expect::kRefused},
    {"neighbour-slot-write", "", "", Expect::kRefused, Expect::kRefused},
    {"fp8-read-as-bf16", "", "", Expect::kRefused, Expect::kRefused},
    {"masked-nan-leak", "", "", Expect::kRefused, Expect::kRefused},
    {"whole-pool-cast", "", "", Expect::kRefused, Expect::kRefused},
    {"scale-one-write", "written_slots", "codes_other_scale", Expect::kWriteFault,
     Expect::kWriteFault},
    {"zero-group-scale", "nan_written", "nan_code", Expect::kWriteFault, Expect::kWriteFault},
    {"rope-outside-calibration", "written_slots", "rope_saturated", Expect::kPass,
     Expect::kWriteFault},
    {"kv-scale-split", "written_slots", "codes_other_scale", Expect::kWriteFault,
     Expect::kWriteFault},
    {"scale-read-as-pow2", "", "", Expect::kPass, Expect::kReadFault},
    {"scale-read-as-e8m0", "", "", Expect::kReadFault, Expect::kReadFault},
    {"mscale-dropped", "", "", Expect::kRefusedWithoutRope, Expect::kRefusedWithoutRope},
    {"mscale-twice", "", "", Expect::kRefusedWithoutRope, Expect::kRefusedWithoutRope},
    {"kpe-deinterleaved", "", "", Expect::kReadFault, Expect::kReadFault},
    {"qpe-deinterleaved", "", "", Expect::kReadFault, Expect::kReadFault},
    {"rope-dot-missing", "", "", Expect::kReadFault, Expect::kReadFault},
};

inline constexpr const char* kShippedGroupDumps[] = {"glm5_dsa_flashmla", "glm5_pertoken_fp8rope"};

inline Expect expectation_on(const InjectionExpectation& e, const std::string& dump) {
  if (dump == "glm5_page1") return e.on_glm5_page1;
  if (dump == "page64_nan") return e.on_page64_nan;
  return e.on_saturated_page16;
}

struct CheckOutcome {
  int exit_status = -1;
  std::string output;     // stdout and stderr
  nlohmann::json report;  // report.json, null when none was written
};

inline std::string read_text(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// `kvaudit check datasets/DUMP.h5 --backend BACKEND --inject INJECTION --report DIR`.
inline CheckOutcome run_injected_check(const std::string& backend, const std::string& dump,
                                       const std::string& injection) {
  const std::filesystem::path dir =
      test_tmpdir() / "injections" / (backend + "-" + dump + "-" + injection);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string command = kvaudit_binary().string() + " check " +
                              (source_dir() / "datasets" / (dump + ".h5")).string() +
                              " --backend " + backend + " --threads 2 --inject " + injection +
                              " --report " + (dir / "report").string() + " > " +
                              (dir / "log").string() + " 2>&1";
  const int status = std::system(command.c_str());
  CheckOutcome outcome;
  outcome.exit_status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  outcome.output = read_text(dir / "log");
  if (std::filesystem::exists(dir / "report" / "report.json")) {
    outcome.report = nlohmann::json::parse(read_text(dir / "report" / "report.json"));
  }
  return outcome;
}

// The assertions of the matrix for one (backend, dump, injection).
template <typename Expectation>
inline void require_injection_outcome(const std::string& backend, const std::string& dump,
                                      const Expectation& e, Expect expect) {
  const CheckOutcome outcome = run_injected_check(backend, dump, e.injection);
  INFO(backend << " --inject " << e.injection << " on " << dump << ":\n" << outcome.output);
  if (expect == Expect::kRefused) {
    CHECK(outcome.exit_status == 2);
    CHECK(outcome.report.is_null());
    CHECK(outcome.output.find(std::string("--inject ") + e.injection) != std::string::npos);
    CHECK(outcome.output.find("per_token_group") != std::string::npos);
    return;
  }
  if (expect == Expect::kRefusedWithoutRope) {
    CHECK(outcome.exit_status == 2);
    CHECK(outcome.report.is_null());
    CHECK(outcome.output.find(std::string("--inject ") + e.injection) != std::string::npos);
    CHECK(outcome.output.find("rope_mscale_all_dim") != std::string::npos);
    return;
  }
  REQUIRE(outcome.report.is_object());
  const nlohmann::json& integrity = outcome.report.at("integrity");
  REQUIRE(integrity.is_array());
  bool integrity_clean = true;
  for (const nlohmann::json& finding : integrity) integrity_clean &= finding.at("pass").get<bool>();

  if (expect == Expect::kPass) {
    CHECK(outcome.exit_status == 0);
    CHECK(outcome.report.at("verdict") == "pass");
    CHECK(integrity_clean);
    CHECK(outcome.output.find("verdict: PASS") != std::string::npos);
    return;
  }
  CHECK(outcome.exit_status == 1);
  CHECK(outcome.report.at("verdict") == "fail");
  CHECK(outcome.output.find("verdict: FAIL") != std::string::npos);

  if (expect == Expect::kReadFault) {
    // The pool is untouched: every integrity check passes; the kernel comparison fails and the
    // first divergence says where, down to the row and head.
    CHECK(integrity_clean);
    const nlohmann::json& divergence = outcome.report.at("first_divergence");
    REQUIRE(divergence.is_object());
    CHECK(divergence.at("comparison") == "kernel");
    CHECK(divergence.at("request").get<int>() >= 0);
    CHECK(divergence.at("row").get<int>() >= 0);
    CHECK(divergence.at("head").get<int>() >= 0);
    const std::string line = "first divergence (kernel): step " +
                             std::to_string(divergence.at("step").get<int>()) + " layer " +
                             std::to_string(divergence.at("layer_id").get<int>()) + " request " +
                             std::to_string(divergence.at("request").get<int>()) + " row " +
                             std::to_string(divergence.at("row").get<int>()) + " head " +
                             std::to_string(divergence.at("head").get<int>());
    CHECK(outcome.output.find(line) != std::string::npos);
    return;
  }

  // A write fault: what it costs shows in the cache comparison (R8 on the pool the backend read
  // vs R8 on the reference pool), not in the kernel comparison: the kernel computed correctly on
  // what it read.
  bool cache_failed = false;
  for (const nlohmann::json& result : outcome.report.at("results")) {
    INFO("step " << result.at("step") << " layer " << result.at("layer") << " "
                 << result.at("comparison"));
    if (result.at("comparison") == "kernel") CHECK(result.at("pass").get<bool>());
    if (result.at("comparison") == "cache") cache_failed |= !result.at("pass").get<bool>();
  }
  CHECK(cache_failed);
  // The intended check fails with the intended class, naming step, layer and slots, in
  // report.json and on stdout.
  const nlohmann::json* caught = nullptr;
  for (const nlohmann::json& finding : integrity) {
    if (!finding.at("pass").get<bool>() && finding.at("check") == e.check &&
        finding.at("classification") == e.classification) {
      caught = &finding;
      break;
    }
  }
  REQUIRE(caught != nullptr);
  const nlohmann::json& slots = caught->at("slots");
  REQUIRE(!slots.empty());
  CHECK(caught->at("slot_count").get<std::int64_t>() >= static_cast<std::int64_t>(slots.size()));
  const std::string where = caught->at("where");
  const std::string first_slot = std::to_string(slots[0].get<std::int64_t>());
  const std::string detail = caught->at("detail");
  CHECK(detail.find(where) == 0);
  CHECK(detail.find(first_slot) != std::string::npos);
  const std::string printed = "step " + std::to_string(caught->at("step").get<int>()) + " layer " +
                              std::to_string(caught->at("layer").get<int>()) + " " + e.check +
                              " [" + e.classification + "]: " + detail;
  CHECK(outcome.output.find(printed) != std::string::npos);
}

inline void require_injection_outcome(const std::string& backend, const std::string& dump,
                                      const InjectionExpectation& e) {
  require_injection_outcome(backend, dump, e, expectation_on(e, dump));
}

inline void require_group_injection_outcome(const std::string& backend, const std::string& dump,
                                            const GroupInjectionExpectation& e) {
  require_injection_outcome(
      backend, dump, e, dump == "glm5_dsa_flashmla" ? e.on_dsa_flashmla : e.on_pertoken_fp8rope);
}

}  // namespace kvaudit_test
