// Where a test finds the kvaudit binary, the source tree (datasets/) and its scratch folder. The
// build bakes in absolute paths (KVAUDIT_BINARY, KVAUDIT_SOURCE_DIR, KVAUDIT_TEST_TMPDIR); a test
// binary carried to another machine (the GPU machine, README "Running on a GPU") finds them
// instead from the environment (KVAUDIT_TEST_BINARY, KVAUDIT_TEST_SOURCE_DIR,
// KVAUDIT_TEST_TMPDIR), else next to itself (BUILD/tests/kvaudit_tests -> BUILD/kvaudit), the
// working directory (a checkout's root) and the system's temporary folder.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <string>

#include "kvaudit_test_config.hpp"  // KVAUDIT_BINARY, KVAUDIT_SOURCE_DIR, KVAUDIT_TEST_TMPDIR

namespace kvaudit_test {

inline std::filesystem::path path_from(const char* variable, const char* built_in,
                                       const std::filesystem::path& fallback) {
  if (const char* value = std::getenv(variable); value != nullptr && *value != '\0') return value;
  std::error_code error;
  if (std::filesystem::exists(built_in, error)) return built_in;
  return fallback;
}

inline std::filesystem::path kvaudit_binary() {
  std::error_code error;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", error);
  return path_from("KVAUDIT_TEST_BINARY", KVAUDIT_BINARY,
                   self.parent_path().parent_path() / "kvaudit");
}

inline std::filesystem::path source_dir() {
  return path_from("KVAUDIT_TEST_SOURCE_DIR", KVAUDIT_SOURCE_DIR, std::filesystem::current_path());
}

inline std::filesystem::path test_tmpdir() {
  const std::filesystem::path built_in(KVAUDIT_TEST_TMPDIR);
  std::error_code error;
  const bool build_tree_here = std::filesystem::exists(built_in.parent_path(), error);
  if (const char* value = std::getenv("KVAUDIT_TEST_TMPDIR"); value != nullptr && *value != '\0') {
    return value;
  }
  return build_tree_here ? built_in : std::filesystem::temp_directory_path() / "kvaudit_tests";
}

}  // namespace kvaudit_test
