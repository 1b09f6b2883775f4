// Shard assignment (src/verdict/shard.hpp) as a pure function, with the expected groups written
// out; and the part file: a run with its shard and divergence points, written and read back.
#include <algorithm>
#include <catch2/catch.hpp>
#include <numeric>
#include <vector>

#include "src/verdict/shard.hpp"
#include "tests/verdict/check_run_fixture.hpp"

namespace kvaudit {
namespace {

std::vector<std::vector<int>> groups(const std::vector<int>& layers, int count) {
  std::vector<std::vector<int>> all;
  for (int index = 0; index < count; ++index) all.push_back(shard_layers(layers, {index, count}));
  return all;
}

using Groups = std::vector<std::vector<int>>;

}  // namespace

TEST_CASE("shard assignment: contiguous, near-equal, the larger groups first", "[shard]") {
  const std::vector<int> glm5 = {0, 1, 77};  // datasets/glm5_page1.h5
  CHECK(groups(glm5, 1) == Groups{{0, 1, 77}});
  CHECK(groups(glm5, 2) == Groups{{0, 1}, {77}});
  CHECK(groups(glm5, 3) == Groups{{0}, {1}, {77}});
  CHECK(groups(glm5, 4) == Groups{{0}, {1}, {77}, {}});
  CHECK(groups(glm5, 5) == Groups{{0}, {1}, {77}, {}, {}});
  const std::vector<int> seven = {10, 11, 12, 13, 14, 15, 16};
  CHECK(groups(seven, 3) == Groups{{10, 11, 12}, {13, 14}, {15, 16}});
  CHECK(groups(seven, 4) == Groups{{10, 11}, {12, 13}, {14, 15}, {16}});
  CHECK(groups({}, 2) == Groups{{}, {}});
}

TEST_CASE("shard assignment: every layer in exactly one shard, in dump order", "[shard]") {
  // 78 layers (GLM-5), ids not in numeric order, over many shard counts.
  std::vector<int> layers(78);
  std::iota(layers.begin(), layers.end(), 0);
  std::reverse(layers.begin(), layers.begin() + 10);
  for (int count = 1; count <= 100; ++count) {
    std::vector<int> concatenated;
    std::size_t smallest = layers.size();
    std::size_t largest = 0;
    std::size_t previous = layers.size();
    for (const std::vector<int>& group : groups(layers, count)) {
      concatenated.insert(concatenated.end(), group.begin(), group.end());
      smallest = std::min(smallest, group.size());
      largest = std::max(largest, group.size());
      CHECK(group.size() <= previous);  // the larger groups first
      previous = group.size();
    }
    INFO(count << " shards");
    CHECK(concatenated == layers);
    CHECK(largest - smallest <= 1);
  }
}

TEST_CASE("shard names", "[shard]") { CHECK(shard_name({2, 7}) == "2/7"); }

TEST_CASE("a part file: the run, its shard and its divergence points, read back", "[shard]") {
  CheckRun run = testing::make_failing_run();
  run.comparisons[2].divergence = DivergencePoint{1, 5, 2};
  run.notes = {"about the run", "about layer 3"};
  ShardInfo shard;
  shard.spec = {1, 2};
  shard.layers = {3};
  shard.selected_layers = {0, 3};
  shard.steps = {0, 1};
  shard.injection = "scale-mismatch";
  shard.run_notes = 1;
  const nlohmann::json json = part_to_json(run, shard);
  CHECK(json.at("shard").at("assignment") == "contiguous");
  CHECK(json.at("shard").at("divergences") ==
        nlohmann::json::parse(R"([{"result": 2, "request": 1, "row": 5, "head": 2}])"));

  const Result<ShardPart> part = part_from_json(json, "part.json");
  REQUIRE(part.ok());
  CHECK(part->shard.spec.index == 1);
  CHECK(part->shard.spec.count == 2);
  CHECK(part->shard.layers == std::vector<int>{3});
  CHECK(part->shard.selected_layers == std::vector<int>({0, 3}));
  CHECK(part->shard.steps == std::vector<int>({0, 1}));
  CHECK(part->shard.injection == "scale-mismatch");
  CHECK_FALSE(part->shard.reciprocal_scale);
  CHECK(part->shard.run_notes == 1);
  REQUIRE(part->run.comparisons[2].divergence);
  CHECK(part->run.comparisons[2].divergence->request == 1);
  CHECK(part->run.comparisons[2].divergence->row == 5);
  CHECK(part->run.comparisons[2].divergence->head == 2);
  CHECK_FALSE(part->run.comparisons[0].divergence);
  CHECK(part_to_json(part->run, part->shard) == json);

  // A report of an unsharded run is no part; a part with a bad shard is refused by key.
  nlohmann::json report = json;
  report.erase("shard");
  CHECK_THAT(part_from_json(report, "report.json").error().message(),
             Catch::Contains("report.json") && Catch::Contains("not a shard part"));
  nlohmann::json bad = json;
  bad["shard"]["index"] = 2;
  CHECK_THAT(part_from_json(bad, "bad.json").error().message(),
             Catch::StartsWith("bad.json:/shard/index"));
  bad = json;
  bad["shard"]["divergences"][0]["result"] = 9;
  CHECK_THAT(part_from_json(bad, "bad.json").error().message(),
             Catch::StartsWith("bad.json:/shard/divergences/0/result"));
  bad = json;
  bad["shard"]["layer"] = 3;
  CHECK_THAT(part_from_json(bad, "bad.json").error().message(),
             Catch::StartsWith("bad.json:/shard/layer") && Catch::Contains("unknown key"));
}

}  // namespace kvaudit
