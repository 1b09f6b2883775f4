// One of python/tests' unittest modules run as a Catch2 case: under the venv's interpreter
// ($KVAUDIT_PYTHON, else build/python-venv/bin/python), with KVAUDIT_REQUIRE_HF=1 (a missing
// transformers fails instead of skipping), against this build's kvaudit and this checkout's kvdump
// package, its output in test_tmpdir()/NAME/unittest.log.
#pragma once

#include <fmt/core.h>
#include <sys/wait.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "tests/test_paths.hpp"

namespace kvaudit_test {

inline std::filesystem::path python_interpreter() {
  if (const char* python = std::getenv("KVAUDIT_PYTHON"); python != nullptr && *python != '\0') {
    return python;
  }
  return source_dir() / "build" / "python-venv" / "bin" / "python";
}

// Runs `python -m unittest -v tests.MODULE` and checks it exits 0 having run `tests` tests, none
// skipped.
inline void check_python_suite(const std::string& module, const std::string& name, int tests) {
  const auto quoted = [](const std::filesystem::path& path) {
    return fmt::format("'{}'", path.string());
  };
  const std::filesystem::path dir = test_tmpdir() / name;
  std::filesystem::create_directories(dir);
  const std::filesystem::path python_dir = source_dir() / "python";
  const std::string command = fmt::format(
      "cd {} && KVAUDIT_BINARY={} KVAUDIT_REQUIRE_HF=1 PYTHONPATH={} {} -B -m unittest -v "
      "tests.{} > {} 2>&1",
      quoted(python_dir), quoted(kvaudit_binary()), quoted(python_dir),
      quoted(python_interpreter()), module, quoted(dir / "unittest.log"));
  const int status = std::system(command.c_str());
  std::ifstream in(dir / "unittest.log");
  std::stringstream log;
  log << in.rdbuf();
  INFO(command << "\n" << log.str());
  REQUIRE(status != -1);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(log.str().find(fmt::format("Ran {} tests", tests)) != std::string::npos);
  CHECK(log.str().find("skipped") == std::string::npos);
}

}  // namespace kvaudit_test
