// The DSA indexer under FP8 (docs/indexer-fp8.md): the Python suite
// python/tests/test_indexer_fp8.py run under the venv's interpreter with KVAUDIT_REQUIRE_HF=1 (so a
// missing transformers fails instead of skipping) against this build's kvaudit and this checkout's
// kvdump package: the deployed quantizer against hand-worked values, planted defects (rotation
// skipped, scale not a power of two, a tie counted as a miss, damaged cache writes) caught, the
// command's refusals, and a tiny GLM-5 capture with its indexer cache (kvdump v1.2) that `kvaudit
// info` lists and whose stored cache and top-k are the deployed rule's. (Debian's python3 runs the
// same suite, without the capture, in "python kvdump writer: its unittest suite passes".)
//
// The interpreter: $KVAUDIT_PYTHON, else build/python-venv/bin/python. [torch]: skipped, by name,
// where that interpreter has no torch (tests/prerequisites.hpp).
#include <fmt/core.h>
#include <sys/wait.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "tests/test_paths.hpp"

namespace {

std::string quoted(const std::filesystem::path& path) { return fmt::format("'{}'", path.string()); }

std::filesystem::path interpreter() {
  if (const char* python = std::getenv("KVAUDIT_PYTHON"); python != nullptr && *python != '\0') {
    return python;
  }
  return kvaudit_test::source_dir() / "build" / "python-venv" / "bin" / "python";
}

std::string read_text(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

TEST_CASE("indexer fp8: the deployed quantization, recall with ties, cache integrity, capture",
          "[python][torch][hf]") {
  const std::filesystem::path dir = kvaudit_test::test_tmpdir() / "indexer_fp8";
  std::filesystem::create_directories(dir);
  const std::filesystem::path python_dir = kvaudit_test::source_dir() / "python";
  const std::string command = fmt::format(
      "cd {} && KVAUDIT_BINARY={} KVAUDIT_REQUIRE_HF=1 PYTHONPATH={} {} -B -m unittest -v "
      "tests.test_indexer_fp8 > {} 2>&1",
      quoted(python_dir), quoted(kvaudit_test::kvaudit_binary()), quoted(python_dir),
      quoted(interpreter()), quoted(dir / "unittest.log"));
  const int status = std::system(command.c_str());
  const std::string log = read_text(dir / "unittest.log");
  INFO(command << "\n" << log);
  REQUIRE(status != -1);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(log.find("Ran 23 tests") != std::string::npos);
  CHECK(log.find("skipped") == std::string::npos);
}
