// `kvaudit check --emit-repro FILE` end to end: on the shipped dumps with an injected fault the
// repro (one layer, one step, a few pages) fails alone the same way (step 0, the same layer, the
// same check), passes without the fault, and `kvaudit info` accepts it; a passing run writes no
// file. A tiny dump whose first failure is at step 2 shows that the repro's pool is the reference
// pool after the earlier steps' writes (exactly one planted slot differs, nothing else).
#include <sys/wait.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "kvaudit_test_config.hpp"  // KVAUDIT_BINARY, KVAUDIT_SOURCE_DIR, KVAUDIT_TEST_TMPDIR
#include "src/format/kvdump.hpp"
#include "tests/replay/check_dumps.hpp"

namespace kvaudit {
namespace {

using testing::test_tmp_path;

struct CommandResult {
  int status = -1;
  std::string out;
};

std::string read_text(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Runs `kvaudit ARGUMENTS`, stdout and stderr together.
CommandResult run_kvaudit(const std::string& name, const std::string& arguments) {
  const auto log = test_tmp_path("emit_repro_" + name + ".log");
  const std::string command =
      std::string(KVAUDIT_BINARY) + " " + arguments + " > '" + log.string() + "' 2>&1";
  const int raw = std::system(command.c_str());
  CommandResult result;
  result.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  result.out = read_text(log);
  return result;
}

nlohmann::json read_json(const std::filesystem::path& path) {
  std::ifstream in(path);
  nlohmann::json j;
  in >> j;
  return j;
}

// (step, layer_id, what) of the first failure a report.json names: the first divergence, or
// else the first failing integrity finding.
struct FirstFailure {
  int step = -1;
  int layer_id = -1;
  std::string what;  // "divergence:<comparison>" or "integrity:<check>"
};

FirstFailure first_failure(const nlohmann::json& report) {
  FirstFailure failure;
  if (!report["first_divergence"].is_null()) {
    failure.step = report["first_divergence"]["step"].get<int>();
    failure.layer_id = report["first_divergence"]["layer_id"].get<int>();
    failure.what = "divergence:" + report["first_divergence"]["comparison"].get<std::string>();
    return failure;
  }
  for (const auto& finding : report["integrity"]) {
    if (finding["pass"].get<bool>()) continue;
    failure.step = finding["step"].get<int>();
    failure.layer_id = finding["layer"].get<int>();
    failure.what = "integrity:" + finding["check"].get<std::string>();
    return failure;
  }
  return failure;
}

std::string quoted(const std::filesystem::path& path) { return "'" + path.string() + "'"; }

struct InjectionCase {
  const char* injection;
  const char* dump;
};

}  // namespace

TEST_CASE("check --emit-repro: the repro of an injected fault fails alone the same way",
          "[cli][check][repro]") {
  const InjectionCase kCases[] = {{"scale-mismatch", "glm5_page1.h5"},
                                  {"round-toward-zero", "glm5_page1.h5"},
                                  {"masked-nan-leak", "page64_nan.h5"}};
  for (const InjectionCase& c : kCases) {
    const std::string name = c.injection;
    const std::filesystem::path original =
        std::filesystem::path(KVAUDIT_SOURCE_DIR) / "datasets" / c.dump;
    const auto repro = test_tmp_path("repro_" + name + ".h5");
    const auto original_json = test_tmp_path("repro_" + name + "_original.json");
    const auto repro_json = test_tmp_path("repro_" + name + "_alone.json");
    std::filesystem::remove(repro);
    const std::string inject = " --backend cpu-fp8 --threads 2 --inject " + name;

    const CommandResult emitted =
        run_kvaudit(name + "_emit", "check " + quoted(original) + inject + " --json " +
                                        quoted(original_json) + " --emit-repro " + quoted(repro));
    INFO(name << " on " << c.dump << ":\n" << emitted.out);
    REQUIRE(emitted.status == 1);
    REQUIRE(std::filesystem::exists(repro));
    CHECK_THAT(emitted.out, Catch::Contains("repro: wrote"));
    const FirstFailure expected = first_failure(read_json(original_json));
    REQUIRE(expected.step >= 0);

    // Alone, with the same fault: exit 1, the same kind of first failure at step 0, same layer.
    const CommandResult alone = run_kvaudit(
        name + "_alone", "check " + quoted(repro) + inject + " --json " + quoted(repro_json));
    INFO("repro alone:\n" << alone.out);
    CHECK(alone.status == 1);
    const FirstFailure got = first_failure(read_json(repro_json));
    CHECK(got.step == 0);
    CHECK(got.layer_id == expected.layer_id);
    CHECK(got.what == expected.what);

    // Without the fault the repro passes: what failed was the injection, not the repro.
    const CommandResult clean =
        run_kvaudit(name + "_clean", "check " + quoted(repro) + " --backend cpu-fp8 --threads 2");
    INFO("repro clean:\n" << clean.out);
    CHECK(clean.status == 0);
    CHECK_THAT(clean.out, Catch::Contains("verdict: PASS"));

    const CommandResult info = run_kvaudit(name + "_info", "info " + quoted(repro));
    INFO("info:\n" << info.out);
    CHECK(info.status == 0);

    // Much smaller: one layer, one step, fewer pages and rows, a smaller file.
    auto small = DumpReader::open(repro);
    auto large = DumpReader::open(original);
    REQUIRE(small.ok());
    REQUIRE(large.ok());
    const DumpLayout& s = small->layout();
    const DumpLayout& l = large->layout();
    CHECK(s.layers.size() == 1);
    CHECK(s.layers[0].layer_id == expected.layer_id);
    CHECK(s.steps.size() == 1);
    CHECK(s.steps[0].kind == l.steps[expected.step].kind);
    CHECK(s.steps[0].batch_size() < l.steps[expected.step].batch_size());
    CHECK(s.num_pages < l.num_pages);
    CHECK(s.attrs.page_size == l.attrs.page_size);
    CHECK_THAT(s.attrs.producer, Catch::Contains("--emit-repro"));
    CHECK(std::filesystem::file_size(repro) * 3 < std::filesystem::file_size(original));

    // The producer maps every repro page back to its original page ("a,b-c,..."): at step 0 the
    // repro's pool page k holds exactly the original pool's page pages[k].
    const std::string key = "are original pages ";
    const auto at = s.attrs.producer.find(key);
    REQUIRE(at != std::string::npos);
    std::vector<std::int64_t> pages;
    std::istringstream list(s.attrs.producer.substr(at + key.size()));
    for (std::int64_t first = 0; list >> first;) {
      std::int64_t last = first;
      if (list.peek() == '-') list.ignore() >> last;
      for (std::int64_t page = first; page <= last; ++page) pages.push_back(page);
      if (list.peek() != ',') break;
      list.ignore();
    }
    REQUIRE(static_cast<std::int64_t>(pages.size()) == s.num_pages);
    if (expected.step == 0) {
      std::size_t original_layer = 0;
      while (l.layers[original_layer].layer_id != expected.layer_id) ++original_layer;
      const auto small_pool = small->read_pool(0);
      const auto large_pool = large->read_pool(original_layer);
      REQUIRE(small_pool.ok());
      REQUIRE(large_pool.ok());
      const std::size_t page_bytes = small_pool->row_bytes() * s.attrs.page_size;
      for (std::size_t k = 0; k < pages.size(); ++k) {
        INFO("repro page " << k << " <- original page " << pages[k]);
        CHECK(std::equal(small_pool->bytes.begin() + k * page_bytes,
                         small_pool->bytes.begin() + (k + 1) * page_bytes,
                         large_pool->bytes.begin() + pages[k] * page_bytes));
      }
    }
  }
}

TEST_CASE("check --emit-repro: a passing run writes no file", "[cli][check][repro]") {
  const std::filesystem::path original =
      std::filesystem::path(KVAUDIT_SOURCE_DIR) / "datasets" / "glm5_page1.h5";
  const auto repro = test_tmp_path("repro_of_pass.h5");
  std::filesystem::remove(repro);
  const CommandResult result = run_kvaudit(
      "pass", "check " + quoted(original) + " --backend cpu-fp8 --threads 2 --layers 1 " +
                  "--emit-repro " + quoted(repro));
  INFO(result.out);
  CHECK(result.status == 0);
  CHECK_FALSE(std::filesystem::exists(repro));
  CHECK_THAT(result.out, Catch::Contains("wrote nothing"));
}

TEST_CASE("check --emit-repro: a failure at a later step starts from the reference pool",
          "[cli][check][repro]") {
  // Captured pools after every step, correct except one element of a slot request 1 writes at
  // step 2: with --backend none the first failure is that captured pool. The repro's pool must be
  // kv_cache plus steps 0 and 1's writes, or more slots than the planted one would differ.
  testing::TinySpec spec;
  spec.layer_ids = {0, 3};
  testing::TinyDump dump = testing::make_tiny_dump(spec);
  REQUIRE(dump.steps.size() == 3);
  for (std::size_t s = 0; s < dump.steps.size(); ++s) {
    for (std::size_t l = 0; l < dump.layers.size(); ++l) {
      dump.tensors[s][l].kv_cache_after = dump.pool_after(s, l);
    }
  }
  const StepMeta& step2 = dump.steps[2];
  const int planted_row = step2.qo_indptr[1];  // request 1's row
  const std::int64_t planted_slot = step2.new_kv_slots[planted_row];
  dump.tensors[2][1].kv_cache_after->row(planted_slot)[0] ^= 0x01;
  const auto original = test_tmp_path("repro_late_original.h5");
  std::string error;
  REQUIRE(dump.write(original, &error));

  const auto repro = test_tmp_path("repro_late.h5");
  const auto repro_json = test_tmp_path("repro_late_alone.json");
  std::filesystem::remove(repro);
  const CommandResult emitted = run_kvaudit(
      "late_emit", "check " + quoted(original) + " --backend none --emit-repro " + quoted(repro));
  INFO(emitted.out);
  REQUIRE(emitted.status == 1);
  REQUIRE(std::filesystem::exists(repro));

  auto small = DumpReader::open(repro);
  REQUIRE(small.ok());
  const DumpLayout& s = small->layout();
  REQUIRE(s.layers.size() == 1);
  CHECK(s.layers[0].layer_id == 3);
  CHECK(s.layers[0].kv_scale == dump.layers[1].kv_scale);
  CHECK(s.layers[0].has_source);
  REQUIRE(s.steps.size() == 1);
  CHECK(s.steps[0].kind == StepKind::kDecode);
  CHECK(s.steps[0].batch_size() == 1);
  CHECK(s.steps[0].num_rows() == 1);
  // Request 1's pages (page size 1: one per token, 4 + 2 = 6 of them), renumbered 0..5.
  CHECK(s.num_pages == step2.kv_indptr[2] - step2.kv_indptr[1]);

  const CommandResult alone = run_kvaudit(
      "late_alone", "check " + quoted(repro) + " --backend none --json " + quoted(repro_json));
  INFO(alone.out);
  CHECK(alone.status == 1);
  const nlohmann::json report = read_json(repro_json);
  int failing = 0;
  for (const auto& finding : report["integrity"]) {
    if (finding["pass"].get<bool>()) continue;
    ++failing;
    CHECK(finding["step"] == 0);
    CHECK(finding["layer"] == 3);
    CHECK(finding["check"] == "captured_pool");
    CHECK(finding["slots"] == nlohmann::json::array({s.steps[0].new_kv_slots[0]}));
  }
  CHECK(failing == 1);
}

}  // namespace kvaudit
