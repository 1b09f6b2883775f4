// --shard's value and the environment of a job array (src/cli/check_shard.hpp), on a stand-in
// environment; then `kvaudit check --shard` through the binary: the layers a shard checks, the
// index taken from SLURM_ARRAY_TASK_ID / JOB_COMPLETION_INDEX, the empty part, and exit 2 with one
// line on stderr for every bad value.
#include <algorithm>
#include <catch2/catch.hpp>
#include <map>
#include <string>

#include "src/cli/check_shard.hpp"
#include "tests/cli/shard_commands.hpp"

namespace kvaudit {
namespace {

using Variables = std::map<std::string, std::string>;

EnvironmentLookup environment_of(const Variables& variables) {
  return [variables](const char* name) -> std::optional<std::string> {
    const auto it = variables.find(name);
    if (it == variables.end() || it->second.empty()) return std::nullopt;
    return it->second;
  };
}

ShardSpec resolved(const std::string& text, const Variables& variables = {}) {
  const Result<ResolvedShard> shard = resolve_shard(text, environment_of(variables));
  INFO(text << ": " << (shard.ok() ? "" : shard.error().message()));
  REQUIRE(shard.ok());
  return shard->spec;
}

std::string refusal(const std::string& text, const Variables& variables = {}) {
  const Result<ResolvedShard> shard = resolve_shard(text, environment_of(variables));
  INFO(text);
  REQUIRE_FALSE(shard.ok());
  CHECK(shard.error().kind == ErrorKind::kBadInput);
  return shard.error().message();
}

}  // namespace

TEST_CASE("shard option I/N: 0-based, I below N, plain decimal integers", "[shard][cli]") {
  CHECK(resolved("0/1").index == 0);
  CHECK(resolved("0/1").count == 1);
  CHECK(resolved("3/4").index == 3);
  CHECK(resolved("3/4").count == 4);
  // An explicit index ignores the environment.
  CHECK(resolved("1/4", {{"SLURM_ARRAY_TASK_ID", "3"}, {"JOB_COMPLETION_INDEX", "2"}}).index == 1);

  CHECK_THAT(refusal("4/4"),
             Catch::Contains("index 4 is not below 4") && Catch::Contains("0-based"));
  CHECK_THAT(refusal("0/0"), Catch::Contains("--shard"));
  for (const char* bad :
       {"", "1", "1/", "/4", "-1/4", "+1/4", "1/-4", " 1/4", "1/4 ", "1.0/4", "a/4", "1/four",
        "1/4/2", "Auto/4", "99999999999999999999/4", "1/99999999999999999999", "0/1048577"}) {
    CHECK_THAT(refusal(bad), Catch::StartsWith("--shard"));
  }
}

TEST_CASE("shard option auto/N: Slurm array task, Kubernetes completion index", "[shard][cli]") {
  // Slurm: the task id less the array's first index.
  CHECK(resolved("auto/4", {{"SLURM_ARRAY_TASK_ID", "2"}}).index == 2);
  const Variables one_based = {{"SLURM_ARRAY_TASK_ID", "4"},
                               {"SLURM_ARRAY_TASK_MIN", "1"},
                               {"SLURM_ARRAY_TASK_MAX", "4"},
                               {"SLURM_ARRAY_TASK_COUNT", "4"}};
  CHECK(resolved("auto/4", one_based).index == 3);
  CHECK(resolved("auto/4", one_based).count == 4);
  CHECK(resolved("auto/4", {{"SLURM_ARRAY_TASK_ID", "11"}, {"SLURM_ARRAY_TASK_MIN", "10"}}).index ==
        1);
  // Kubernetes Indexed Job.
  CHECK(resolved("auto/3", {{"JOB_COMPLETION_INDEX", "0"}}).index == 0);
  CHECK(resolved("auto/3", {{"JOB_COMPLETION_INDEX", "2"}}).index == 2);
  // Both set: Slurm's, set for the task itself (sbatch passes the submitter's environment on).
  CHECK(resolved("auto/4", {{"SLURM_ARRAY_TASK_ID", "1"}, {"JOB_COMPLETION_INDEX", "3"}}).index ==
        1);
  // An empty variable is unset.
  CHECK(resolved("auto/4", {{"SLURM_ARRAY_TASK_ID", ""}, {"JOB_COMPLETION_INDEX", "3"}}).index ==
        3);

  CHECK_THAT(refusal("auto/4"),
             Catch::Contains("SLURM_ARRAY_TASK_ID") && Catch::Contains("JOB_COMPLETION_INDEX"));
  CHECK_THAT(refusal("auto/4", {{"SLURM_ARRAY_TASK_ID", "4"}}),
             Catch::StartsWith("SLURM_ARRAY_TASK_ID"));
  CHECK_THAT(refusal("auto/4", {{"SLURM_ARRAY_TASK_ID", "x1"}}),
             Catch::StartsWith("SLURM_ARRAY_TASK_ID") && Catch::Contains("x1"));
  CHECK_THAT(refusal("auto/4", {{"SLURM_ARRAY_TASK_ID", "0"}, {"SLURM_ARRAY_TASK_MIN", "1"}}),
             Catch::StartsWith("SLURM_ARRAY_TASK_ID"));
  // An array of another size, or with a step (--array=0-6:2: 4 tasks over 0..6).
  CHECK_THAT(refusal("auto/4", {{"SLURM_ARRAY_TASK_ID", "1"}, {"SLURM_ARRAY_TASK_COUNT", "5"}}),
             Catch::StartsWith("SLURM_ARRAY_TASK_COUNT") && Catch::Contains("--array=0-3"));
  CHECK_THAT(refusal("auto/4", {{"SLURM_ARRAY_TASK_ID", "2"},
                                {"SLURM_ARRAY_TASK_MIN", "0"},
                                {"SLURM_ARRAY_TASK_MAX", "6"},
                                {"SLURM_ARRAY_TASK_COUNT", "4"}}),
             Catch::Contains("consecutive"));
  CHECK_THAT(refusal("auto/3", {{"JOB_COMPLETION_INDEX", "3"}}),
             Catch::StartsWith("JOB_COMPLETION_INDEX") && Catch::Contains("completions"));
  CHECK_THAT(refusal("auto/3", {{"JOB_COMPLETION_INDEX", "-1"}}),
             Catch::StartsWith("JOB_COMPLETION_INDEX"));
}

TEST_CASE("kvaudit check --shard through the binary", "[shard][cli]") {
  using kvaudit_test::read_json;
  using kvaudit_test::run_kvaudit;
  using kvaudit_test::shipped_dump;
  const std::filesystem::path dir = kvaudit_test::test_tmpdir() / "check_shard";
  std::filesystem::create_directories(dir);
  const std::string dump = shipped_dump("glm5_page1");  // layers 0, 1, 77
  auto part_of = [&](const std::string& name, const std::string& shard,
                     const std::string& environment) {
    const auto path = dir / (name + ".json");
    std::filesystem::remove(path);
    const auto outcome = run_kvaudit(
        "check_shard_" + name,
        "check " + dump + " --threads 2 --shard " + shard + " --json '" + path.string() + "'",
        environment);
    INFO(outcome.out << outcome.err);
    REQUIRE(outcome.status == 0);
    return read_json(path);
  };
  auto layers_of = [](const nlohmann::json& part) {
    std::vector<int> layers;
    for (const auto& result : part.at("results")) layers.push_back(result.at("layer").get<int>());
    layers.erase(std::unique(layers.begin(), layers.end()), layers.end());
    return layers;
  };

  const nlohmann::json explicit_part = part_of("explicit", "1/2", "");
  CHECK(explicit_part.at("shard").at("layers") == nlohmann::json({77}));
  CHECK(layers_of(explicit_part) == std::vector<int>{77});
  const nlohmann::json slurm =
      part_of("slurm", "auto/2", "SLURM_ARRAY_TASK_ID=1 SLURM_ARRAY_TASK_MIN=1");
  CHECK(slurm.at("shard").at("index") == 0);
  CHECK(layers_of(slurm) == std::vector<int>({0, 1}));
  const nlohmann::json kubernetes = part_of("kubernetes", "auto/3", "JOB_COMPLETION_INDEX=2");
  CHECK(layers_of(kubernetes) == std::vector<int>{77});
  // More shards than layers: an empty part, a valid report that passes.
  const nlohmann::json empty = part_of("empty", "4/5", "");
  CHECK(empty.at("results").empty());
  CHECK(empty.at("integrity").empty());
  CHECK(empty.at("verdict") == "pass");
  CHECK(empty.at("shard").at("layers").empty());
  // --layers first, then the shard of what it selects.
  const nlohmann::json selected = part_of("selected", "0/2 --layers 77,1", "");
  CHECK(selected.at("shard").at("selected_layers") == nlohmann::json({1, 77}));
  CHECK(layers_of(selected) == std::vector<int>{1});

  for (const std::string& bad : {"4/4", "auto/4", "x/4", "1/0"}) {
    const auto outcome = run_kvaudit("check_shard_bad", "check " + dump + " --shard " + bad);
    INFO(bad << ": " << outcome.out << outcome.err);
    CHECK(outcome.status == 2);
    CHECK(std::count(outcome.err.begin(), outcome.err.end(), '\n') == 1);
  }
  const auto out_of_array = run_kvaudit("check_shard_array", "check " + dump + " --shard auto/4",
                                        "SLURM_ARRAY_TASK_ID=4");
  CHECK(out_of_array.status == 2);
  CHECK_THAT(out_of_array.err, Catch::Contains("SLURM_ARRAY_TASK_ID"));
}

}  // namespace kvaudit
