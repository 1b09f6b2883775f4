// The Python dump writer (python/kvdump) seen from the C++ side: its own unittest suite passes, and
// a dump it writes is accepted by `kvaudit info`, so the two ends of the kvdump v1 contract agree.
// Uses Debian's /usr/bin/python3 with numpy and h5py (installed in CI); where h5py is missing each
// case says so by name and checks nothing.
#include <sys/wait.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <filesystem>
#include <string>

namespace {

const std::string kPython = "/usr/bin/python3";

// tests/python/test_python_writer.cpp -> the repository root (CMake compiles with full paths).
std::filesystem::path source_root() {
  return std::filesystem::path(__FILE__).parent_path().parent_path().parent_path();
}

std::string quoted(const std::filesystem::path& path) { return "'" + path.string() + "'"; }

// Exit status of a shell command; -1 when it did not exit normally.
int exit_status(const std::string& command) {
  const int status = std::system(command.c_str());
  if (status == -1 || !WIFEXITED(status)) return -1;
  return WEXITSTATUS(status);
}

bool python_has_h5py() {
  return exit_status(kPython + " -c 'import h5py, numpy' >/dev/null 2>&1") == 0;
}

}  // namespace

#define KVAUDIT_REQUIRE_PYTHON_H5PY()                                                      \
  do {                                                                                     \
    if (!python_has_h5py()) {                                                              \
      WARN("SKIPPED " << Catch::getResultCapture().getCurrentTestName() << ": " << kPython \
                      << " lacks h5py or numpy (apt-get install python3-h5py)");           \
      return;                                                                              \
    }                                                                                      \
  } while (0)

TEST_CASE("python kvdump writer: its unittest suite passes", "[python]") {
  KVAUDIT_REQUIRE_PYTHON_H5PY();
  const std::filesystem::path tests = source_root() / "python" / "tests";
  REQUIRE(std::filesystem::exists(tests / "test_writer.py"));
  // -B: no __pycache__ in the source tree.
  const std::string command = kPython + " -B -m unittest discover -s " + quoted(tests);
  INFO(command);
  CHECK(exit_status(command) == 0);
}

TEST_CASE("python kvdump writer: kvaudit info accepts the dump it writes", "[python]") {
  KVAUDIT_REQUIRE_PYTHON_H5PY();
  const std::filesystem::path dir = KVAUDIT_TEST_TMPDIR;
  std::filesystem::create_directories(dir);
  const std::filesystem::path dump = dir / "python_writer_synthetic.h5";
  std::filesystem::remove(dump);

  const std::filesystem::path script =
      source_root() / "python" / "examples" / "write_synthetic_dump.py";
  const std::string write = kPython + " -B " + quoted(script) + " " + quoted(dump);
  INFO(write);
  REQUIRE(exit_status(write) == 0);
  REQUIRE(std::filesystem::exists(dump));

  // Its summary on stdout is not needed here; a refusal still prints its one line on stderr.
  const std::string info = std::string(KVAUDIT_BINARY) + " info " + quoted(dump) + " >/dev/null";
  INFO(info);
  CHECK(exit_status(info) == 0);
}
