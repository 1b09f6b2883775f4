// The shipped dumps in datasets/ are reproducible: every `"$KVAUDIT" synth` command of
// datasets/recipes.sh is rerun in-process (the same CLI definition the kvaudit binary uses) into
// a temporary directory, and the result must equal the shipped file in layout and in every tensor
// bit for bit (HDF5 metadata and timestamps are not compared). Every shipped .h5 must have a
// recipe, and each stays small enough to live in the repository.
#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "kvaudit_test_config.hpp"  // KVAUDIT_BINARY, KVAUDIT_SOURCE_DIR, KVAUDIT_TEST_TMPDIR
#include "src/format/kvdump.hpp"
#include "tests/datasets/dump_equality.hpp"

namespace kvaudit {
namespace {

const std::filesystem::path kDatasets = std::filesystem::path(KVAUDIT_SOURCE_DIR) / "datasets";

struct Recipe {
  std::string output;             // file name in datasets/
  std::vector<std::string> args;  // after "synth", with --out removed
};

// Commands of recipes.sh: lines joined across backslash-newlines; those whose first two words
// are "$KVAUDIT" synth.
std::vector<Recipe> read_recipes() {
  std::ifstream file(kDatasets / "recipes.sh");
  REQUIRE(file.good());
  std::vector<std::string> commands;
  std::string line;
  std::string joined;
  while (std::getline(file, line)) {
    if (!line.empty() && line.back() == '\\') {
      joined += line.substr(0, line.size() - 1) + " ";
      continue;
    }
    commands.push_back(joined + line);
    joined.clear();
  }
  std::vector<Recipe> recipes;
  for (const std::string& command : commands) {
    std::istringstream words(command);
    std::string program;
    std::string subcommand;
    words >> program >> subcommand;
    if (program != "\"$KVAUDIT\"" || subcommand != "synth") continue;
    Recipe recipe;
    std::string word;
    while (words >> word) {
      INFO(command);
      REQUIRE(word.find_first_of("'\"$`;&|<>()") == std::string::npos);  // shell == test
      if (word == "--out") {
        REQUIRE(words >> recipe.output);
        REQUIRE(recipe.output.find('/') == std::string::npos);
      } else {
        recipe.args.push_back(word);
      }
    }
    REQUIRE_FALSE(recipe.output.empty());
    recipes.push_back(recipe);
  }
  return recipes;
}

TEST_CASE("every shipped dump has a recipe and stays small", "[datasets]") {
  std::set<std::string> with_recipe;
  for (const Recipe& recipe : read_recipes()) with_recipe.insert(recipe.output);
  REQUIRE(with_recipe.size() >= 2);
  int shipped = 0;
  for (const auto& entry : std::filesystem::directory_iterator(kDatasets)) {
    if (entry.path().extension() != ".h5") continue;
    ++shipped;
    INFO(entry.path().filename().string());
    CHECK(with_recipe.count(entry.path().filename().string()) == 1);
    CHECK(entry.file_size() < 3u * 1024 * 1024);
  }
  CHECK(shipped == static_cast<int>(with_recipe.size()));
}

TEST_CASE("shipped dumps are exactly what their recipes generate", "[datasets]") {
  const auto tmp = testing::test_tmp_dir("datasets");
  for (const Recipe& recipe : read_recipes()) {
    DYNAMIC_SECTION(recipe.output) {
      const auto regenerated = tmp / recipe.output;
      std::vector<std::string> args = recipe.args;
      args.push_back("--out");
      args.push_back(regenerated.string());
      REQUIRE(testing::run_synth_cli(args) == kExitPass);
      auto shipped = DumpReader::open(kDatasets / recipe.output);
      if (!shipped) FAIL(shipped.error().message());
      auto fresh = DumpReader::open(regenerated);
      if (!fresh) FAIL(fresh.error().message());
      testing::require_same_dump(*shipped, *fresh);
    }
  }
}

TEST_CASE("shipped dumps hold what datasets/README.md says", "[datasets]") {
  auto glm5 = DumpReader::open(kDatasets / "glm5_page1.h5");
  REQUIRE(glm5.ok());
  const DumpLayout& a = glm5->layout();
  CHECK(a.attrs.page_size == 1);
  CHECK(a.attrs.num_heads == 16);
  CHECK(a.attrs.row_width() == 576);
  REQUIRE(a.layers.size() == 3);
  CHECK(a.layers[2].layer_id == 77);
  CHECK(a.layers[0].has_source);
  REQUIRE(a.steps.size() == 4);
  CHECK(a.steps[0].kind == StepKind::kPrefill);
  CHECK(a.steps[3].kind == StepKind::kDecode);
  CHECK(a.steps[0].rows_of(0) == 0);  // the empty request
  CHECK(a.steps[3].kv_indptr[1] == 0);

  auto nan = DumpReader::open(kDatasets / "page64_nan.h5");
  REQUIRE(nan.ok());
  const DumpLayout& b = nan->layout();
  CHECK(b.attrs.page_size == 64);
  REQUIRE(b.layers.size() == 2);
  for (std::size_t l = 0; l < b.layers.size(); ++l) {
    const float scale = b.layers[l].kv_scale;
    CHECK(scale != std::exp2(std::round(std::log2(scale))));  // not a power of two
    auto pool = nan->read_pool(l);
    REQUIRE(pool.ok());
    std::size_t nan_codes = 0;
    for (const std::uint8_t code : pool->bytes) nan_codes += e4m3_is_nan(code);
    CHECK(nan_codes > 0);
  }
}

}  // namespace
}  // namespace kvaudit
