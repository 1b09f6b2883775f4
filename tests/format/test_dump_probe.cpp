// Damaged files written by h5py: h5py stores string attributes as variable-length strings in
// HDF5's global heap, which HDF5 1.10 reads unchecked, so some byte flips crash or hang the
// library itself (seen here: 3 segfaults, 1 abort and 1 hang in 300 mutations before the CLI
// opened dumps in a child process first). Every run of `kvaudit info` on such a file must still
// end with exit 0, 1 or 2.
#include <sys/wait.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "kvaudit_test_config.hpp"  // KVAUDIT_BINARY, KVAUDIT_SOURCE_DIR, KVAUDIT_TEST_TMPDIR

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
  int refused = 0;
  int failures = 0;
  for (int i = 0; i < 300; ++i) {
    std::vector<char> damaged = bytes;
    const int flips = 1 << (rng() % 4);
    for (int f = 0; f < flips; ++f) damaged[rng() % damaged.size()] ^= char(1 << (rng() % 8));
    std::ofstream(mutated, std::ios::binary).write(damaged.data(), damaged.size());
    const int status =
        exit_status_of("KVAUDIT_OPEN_TIMEOUT=5 timeout 60 " + std::string(KVAUDIT_BINARY) +
                       " info " + mutated.string() + " >/dev/null 2>&1");
    refused += status == 2;
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
