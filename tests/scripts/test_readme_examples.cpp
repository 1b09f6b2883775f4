// README.md says what the program does; these keep it true (issue: it showed 36 comparisons where
// the run prints 48, called gpu_tests a CTest entry the test script excludes, and its examples
// wrote repro.h5 and trace.h5 into the checkout root, which .gitignore did not cover):
//   - the main job's example table: every line shown is a line of the real run, verdict included;
//   - every file or directory a README example writes is ignored by git;
//   - where the [gpu] tests run agrees with scripts/run-tests.sh.
#include <sys/wait.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "tests/test_paths.hpp"

namespace {

namespace fs = std::filesystem;

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream stream(text);
  std::string line;
  while (std::getline(stream, line)) lines.push_back(line);
  return lines;
}

int run(const std::string& command) {
  const int raw = std::system(command.c_str());
  return WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
}

const fs::path& readme() {
  static const fs::path path = kvaudit_test::source_dir() / "README.md";
  return path;
}

// The indented block after the line starting "Example (the main job", without its indent.
std::vector<std::string> main_job_example() {
  const std::vector<std::string> lines = lines_of(read_text(readme()));
  std::vector<std::string> block;
  bool after_title = false;
  for (const std::string& line : lines) {
    if (line.rfind("Example (the main job", 0) == 0) after_title = true;
    if (!after_title) continue;
    if (line.rfind("    ", 0) == 0) {
      block.push_back(line.substr(4));
    } else if (!block.empty()) {
      break;
    }
  }
  return block;
}

TEST_CASE("README: the main job's example is what the main job prints", "[readme]") {
  const std::vector<std::string> example = main_job_example();
  REQUIRE(example.size() >= 3);
  REQUIRE(example.back().rfind("verdict: ", 0) == 0);
  const fs::path out = kvaudit_test::test_tmpdir() / "readme-main-job.out";
  fs::create_directories(out.parent_path());
  REQUIRE(run("'" + kvaudit_test::kvaudit_binary().string() + "' check '" +
              (kvaudit_test::source_dir() / "datasets" / "glm5_page1.h5").string() +
              "' --backend cpu-fp8 > '" + out.string() + "' 2>/dev/null") == 0);
  const std::vector<std::string> printed = lines_of(read_text(out));
  for (const std::string& line : example) {
    INFO("README line: " << line);
    CHECK(std::find(printed.begin(), printed.end(), line) != printed.end());
  }
}

TEST_CASE("README: what its examples write is ignored by git", "[readme]") {
  const fs::path source = kvaudit_test::source_dir();
  if (run("git -C '" + source.string() + "' rev-parse --is-inside-work-tree > /dev/null 2>&1") !=
      0) {
    WARN("SKIPPED " << Catch::getResultCapture().getCurrentTestName() << ": not a git checkout");
    return;
  }
  const std::regex output(R"(--(?:out|emit-repro|json|report|save-outputs) ([^ \\]+))");
  const std::string text = read_text(readme());
  int checked = 0;
  for (const std::string& line : lines_of(text)) {
    if (line.rfind("    ", 0) != 0) continue;  // examples are indented blocks
    for (auto it = std::sregex_iterator(line.begin(), line.end(), output);
         it != std::sregex_iterator(); ++it) {
      const std::string path = (*it)[1];
      if (std::regex_match(path, std::regex(R"([A-Z_.\]\[]+)"))) continue;  // FILE, DIR]
      INFO("README example writes " << path);
      CHECK(run("git -C '" + source.string() + "' check-ignore -q --no-index '" + path + "'") == 0);
      ++checked;
    }
  }
  CHECK(checked >= 3);  // --emit-repro, synth --out, bench --json
}

TEST_CASE("README: the [gpu] tests run where scripts/run-tests.sh runs them", "[readme]") {
  const std::string script = read_text(kvaudit_test::source_dir() / "scripts" / "run-tests.sh");
  const std::string text = read_text(readme());
  const bool excluded_from_ctest = script.find("-E '^gpu_tests$'") != std::string::npos;
  CHECK(excluded_from_ctest == (text.find("run outside CTest") != std::string::npos));
  CHECK(text.find("reported skipped (CTest entry `gpu_tests`)") == std::string::npos);
}

}  // namespace
