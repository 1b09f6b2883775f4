// replay_tiny: a TinyDump (tests/replay/check_dumps.hpp) written to the test folder and replayed
// in process, for tests that judge what the replay found. A dump that cannot be written, opened
// or replayed fails the calling test case.
#pragma once

#include <catch2/catch.hpp>
#include <string>
#include <utility>

#include "src/replay/replay.hpp"
#include "tests/replay/check_dumps.hpp"

namespace kvaudit::testing {

// `options` as given, with the default policy where it names none and two threads.
inline CheckRun replay_tiny(const TinyDump& dump, const std::string& name,
                            Backend* backend = nullptr, ReplayOptions options = {}) {
  if (options.policy.name.empty()) options.policy = default_policy();
  options.threads = 2;
  const auto path = test_tmp_path(name + ".h5");
  std::string error;
  REQUIRE(dump.write(path, &error));
  auto reader = DumpReader::open(path);
  if (!reader.ok()) FAIL(reader.error().message());
  auto outcome = replay_dump(*reader, backend, options);
  if (!outcome.ok()) FAIL(outcome.error().message());
  return std::move(outcome.value());
}

}  // namespace kvaudit::testing
