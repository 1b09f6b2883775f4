// Damaged files written by h5py: h5py stores string attributes as variable-length strings in
// HDF5's global heap, which HDF5 1.10 reads unchecked, so some byte flips crash or hang the
// library itself (seen here: 3 segfaults, 1 abort and 1 hang in 300 mutations before the CLI
// opened dumps in a child process first). Every run of `kvaudit info` on such a file must still
// end with exit 0, 1 or 2.
//
// The probe itself (probe_in_child): any end of the child other than returning from the probe is
// a damaged file: a signal, an exit status of its own (a sanitizer's, a library's exit()), an
// exit(0) that skips the verdict, a hang past the time limit.
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "kvaudit_test_config.hpp"  // KVAUDIT_BINARY, KVAUDIT_SOURCE_DIR, KVAUDIT_TEST_TMPDIR
#include "src/format/dump_probe.hpp"
#include "tests/format/sanitizer_reports.hpp"
#include "tests/test_paths.hpp"

namespace {

int exit_status_of(const std::string& command) {
  const int status = std::system(command.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

}  // namespace

TEST_CASE("kvaudit info survives byte flips of an h5py-written dump", "[kvdump][fuzz][python]") {
  if (exit_status_of("/usr/bin/python3 -c 'import h5py, numpy' >/dev/null 2>&1") != 0) {
    WARN("SKIPPED " << Catch::getResultCapture().getCurrentTestName()
                    << ": /usr/bin/python3 has no h5py/numpy (apt-get install python3-h5py)");
    return;
  }
  const std::filesystem::path dir = std::filesystem::path(KVAUDIT_TEST_TMPDIR) / "dump_probe";
  std::filesystem::create_directories(dir);
  const std::filesystem::path original = dir / "h5py_dump.h5";
  REQUIRE(exit_status_of("/usr/bin/python3 " + std::string(KVAUDIT_SOURCE_DIR) +
                         "/tests/python/write_dump_from_spec.py " + original.string()) == 0);
  std::ifstream in(original, std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), {});
  REQUIRE(bytes.size() > 1000);

  std::mt19937 rng(7);
  const std::filesystem::path mutated = dir / "mutated.h5";
  const std::filesystem::path reports = dir / "sanitizer";
  std::filesystem::create_directories(reports);
  kvaudit::testing::collect_sanitizer_reports(reports);  // from an earlier run
  int refused = 0;
  int failures = 0;
  const char* count_text = std::getenv("KVAUDIT_FUZZ_MUTATIONS");
  const int mutations =
      count_text != nullptr && std::atoi(count_text) > 0 ? std::atoi(count_text) : 300;
  for (int i = 0; i < mutations; ++i) {
    std::vector<char> damaged = bytes;
    const int flips = 1 << (rng() % 4);
    for (int f = 0; f < flips; ++f) damaged[rng() % damaged.size()] ^= char(1 << (rng() % 8));
    std::ofstream(mutated, std::ios::binary).write(damaged.data(), damaged.size());
    const int status = exit_status_of(kvaudit::testing::sanitizer_environment(reports) +
                                      "KVAUDIT_OPEN_TIMEOUT=5 timeout 60 '" +
                                      kvaudit_test::kvaudit_binary().string() + "' info " +
                                      mutated.string() + " >/dev/null 2>&1");
    refused += status == 2;
    const kvaudit::testing::SanitizerReports found =
        kvaudit::testing::collect_sanitizer_reports(reports);
    for (const std::string& report : found.kvaudit) {
      FAIL_CHECK("mutation " << i << ": a sanitizer report from kvaudit's own code:\n"
                             << report.substr(0, 4000));
    }
    if (status != 0 && status != 1 && status != 2) {
      ++failures;
      const auto kept = dir / ("probe-failure-" + std::to_string(i) + ".h5");
      std::filesystem::copy_file(mutated, kept, std::filesystem::copy_options::overwrite_existing);
      FAIL_CHECK("mutation " << i << " ended with status " << status << " (kept as " << kept
                             << ")");
    }
  }
  CHECK(failures == 0);
  CHECK(refused > 0);  // the mutations do damage the file
}

namespace {

std::string probe_message(const std::function<void()>& probe, int timeout_seconds = 20) {
  const kvaudit::Status status = kvaudit::probe_in_child("dump.h5", probe, timeout_seconds);
  return status.ok() ? std::string("ok") : status.error().message();
}

}  // namespace

TEST_CASE("the probe child: only a probe that returns is a healthy file", "[kvdump][probe]") {
  CHECK(probe_message([] {}) == "ok");
  // A sanitizer's report ends the process with its own status (ASan: 1).
  CHECK(probe_message([] { _exit(1); }) ==
        "dump.h5: reading the file ended the process with exit status 1 (a library or sanitizer "
        "stopped it): the file is damaged, e.g. its global heap");
  CHECK(probe_message([] { std::exit(42); }).find("exit status 42") != std::string::npos);
  // exit(0) inside a library: status 0, but the verdict never came.
  CHECK(probe_message([] { std::_Exit(0); }) ==
        "dump.h5: reading the file ended the process early: the file is damaged, e.g. its global "
        "heap");
  // Catch2 handles these signals itself: the child restores the default first.
  CHECK(probe_message([] {
          std::signal(SIGSEGV, SIG_DFL);
          std::raise(SIGSEGV);
        }).find("signal 11") != std::string::npos);
  CHECK(probe_message([] {
          std::signal(SIGABRT, SIG_DFL);
          std::abort();
        }).find("signal 6") != std::string::npos);
  CHECK(probe_message([] { pause(); }, 1) ==
        "dump.h5: reading the file's HDF5 metadata did not finish within 1 s: the file is damaged");
}
