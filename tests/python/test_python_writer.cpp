// The Python dump writer (python/kvdump) seen from the C++ side: its own unittest suite passes, a
// dump it writes is accepted by `kvaudit info` and passes `kvaudit check`, so the two ends of the
// kvdump v1 contract agree. Dumps written by tests/python/write_saturation_dumps.py hold the
// captured pools to the write rule: a correctly saturated pool passes; one with bf16 bytes in a
// slot after the prefill, or NaN codes where the satfinite write gives +-448, fails naming the
// step, layer group and slot.
// Uses Debian's /usr/bin/python3 with numpy and h5py (installed in CI); where h5py is missing each
// case says so by name and checks nothing.
#include <sys/wait.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "kvaudit_test_config.hpp"  // KVAUDIT_BINARY, KVAUDIT_SOURCE_DIR, KVAUDIT_TEST_TMPDIR

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

std::string read_text(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::filesystem::path tmp_dir() {
  const std::filesystem::path dir = KVAUDIT_TEST_TMPDIR;
  std::filesystem::create_directories(dir);
  return dir;
}

struct Run {
  std::string command;
  int status = -1;
  std::string output;  // stdout and stderr together
};

// Runs `command` with its stdout and stderr sent to the file `log`.
Run run_logged(const std::string& command, const std::filesystem::path& log) {
  Run run;
  run.command = command;
  run.status = exit_status(command + " > " + quoted(log) + " 2>&1");
  run.output = read_text(log);
  return run;
}

// `kvaudit check DUMP --backend BACKEND --threads 2`, logged next to the dump.
Run kvaudit_check(const std::filesystem::path& dump, const std::string& backend) {
  return run_logged(std::string(KVAUDIT_BINARY) + " check " + quoted(dump) + " --backend " +
                        backend + " --threads 2",
                    dump.parent_path() / (dump.stem().string() + "_" + backend + ".log"));
}

// Whether one line of `output` names the step group (S000), the layer group (L005) and the slot,
// the slot as "slot N" or in a list "slots 4, N, ...".
bool names_slot(const std::string& output, const std::string& step, const std::string& layer,
                int slot) {
  const std::regex step_word("\\b" + step + "\\b");
  const std::regex layer_word("\\b" + layer + "\\b");
  const std::regex slot_word("\\bslots?[ :=\\[]*(\\d+, ?)*" + std::to_string(slot) + "\\b");
  std::istringstream lines(output);
  for (std::string line; std::getline(lines, line);) {
    if (std::regex_search(line, step_word) && std::regex_search(line, layer_word) &&
        std::regex_search(line, slot_word)) {
      return true;
    }
  }
  return false;
}

// The four dumps of tests/python/write_saturation_dumps.py (see its docstring: the corruption is
// in S000 / L005; bf16 bytes start at slot 2), written into a directory of the test's own, since
// CTest may run the cases in parallel.
struct SaturationDumps {
  Run write;
  std::filesystem::path dir;
  std::vector<int> nan_slots;  // slots of nan_at_448.h5 holding NaN codes, from the script
};

SaturationDumps write_saturation_dumps(const std::string& test) {
  SaturationDumps dumps;
  dumps.dir = tmp_dir() / ("python_saturation_" + test);
  std::filesystem::remove_all(dumps.dir);
  std::filesystem::create_directories(dumps.dir);
  const std::filesystem::path script =
      source_root() / "tests" / "python" / "write_saturation_dumps.py";
  dumps.write = run_logged(kPython + " -B " + quoted(script) + " " + quoted(dumps.dir),
                           dumps.dir / "write.log");
  std::istringstream lines(dumps.write.output);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("nan_slots:", 0) != 0) continue;
    std::istringstream slots(line.substr(10));
    for (int slot = 0; slots >> slot;) dumps.nan_slots.push_back(slot);
  }
  return dumps;
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
  // -B: no __pycache__ in the source tree. KVAUDIT_BINARY: the suite's kvaudit runs (where torch
  // is installed) use the binary this build made.
  const std::string command = "KVAUDIT_BINARY=" + quoted(KVAUDIT_BINARY) + " " + kPython +
                              " -B -m unittest discover -s " + quoted(tests);
  INFO(command);
  CHECK(exit_status(command) == 0);
}

TEST_CASE("python kvdump writer: kvaudit info and check accept the example dump it writes",
          "[python]") {
  KVAUDIT_REQUIRE_PYTHON_H5PY();
  const std::filesystem::path dump = tmp_dir() / "python_writer_synthetic.h5";
  std::filesystem::create_directories(dump.parent_path());
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

  const Run check = kvaudit_check(dump, "cpu-fp8");
  INFO(check.command << "\n" << check.output);
  CHECK(check.status == 0);
  CHECK_THAT(check.output, Catch::Contains("verdict: PASS"));
}

TEST_CASE("python kvdump writer: a correctly saturated pool passes kvaudit check", "[python]") {
  KVAUDIT_REQUIRE_PYTHON_H5PY();
  const SaturationDumps dumps = write_saturation_dumps("saturated");
  INFO(dumps.write.command << "\n" << dumps.write.output);
  REQUIRE(dumps.write.status == 0);
  REQUIRE_FALSE(dumps.nan_slots.empty());

  // The captured kv_cache_after of every step was computed by kvdump.quantize_e4m3; kvaudit's own
  // replay of the write rule must agree with it everywhere, saturated codes and the 464 tie too.
  for (const std::string backend : {"none", "cpu-fp8"}) {
    const Run check = kvaudit_check(dumps.dir / "saturated.h5", backend);
    INFO(check.command << "\n" << check.output);
    CHECK(check.status == 0);
    CHECK_THAT(check.output, Catch::Contains("verdict: PASS"));
    // The slot-naming test used below finds nothing in a passing run.
    CHECK_FALSE(names_slot(check.output, "S000", "L005", 2));
    for (const int slot : dumps.nan_slots)
      CHECK_FALSE(names_slot(check.output, "S000", "L005", slot));
  }
}

TEST_CASE("python kvdump writer: bf16 bytes in a slot after the prefill fail kvaudit check",
          "[python]") {
  KVAUDIT_REQUIRE_PYTHON_H5PY();
  const SaturationDumps dumps = write_saturation_dumps("bf16");
  INFO(dumps.write.command << "\n" << dumps.write.output);
  REQUIRE(dumps.write.status == 0);

  // bf16_spill.h5: slot 2 holds the first half of its row's bf16 bytes, slot 3 the rest;
  // bf16_high.h5: slot 2 holds the high byte of each bf16 element. The failure names S000, L005
  // and slot 2 on one line, classified as BF16 bytes (the spill into slot 3 too).
  for (const std::string name : {"bf16_spill.h5", "bf16_high.h5"}) {
    const Run check = kvaudit_check(dumps.dir / name, "none");
    INFO(check.command << "\n" << check.output);
    CHECK(check.status == 1);
    CHECK_THAT(check.output, Catch::Contains("verdict: FAIL"));
    CHECK(names_slot(check.output, "S000", "L005", 2));
    CHECK_THAT(check.output, Catch::Contains("captured_pool [bf16_bytes]: S000 L005"));
  }
  const Run spill = kvaudit_check(dumps.dir / "bf16_spill.h5", "none");
  CHECK_THAT(spill.output, Catch::Contains("[bf16_bytes]: slots 2, 3 "));
}

TEST_CASE("python kvdump writer: NaN codes where satfinite gives 448 fail kvaudit check",
          "[python]") {
  KVAUDIT_REQUIRE_PYTHON_H5PY();
  const SaturationDumps dumps = write_saturation_dumps("nan");
  INFO(dumps.write.command << "\n" << dumps.write.output);
  REQUIRE(dumps.write.status == 0);
  REQUIRE_FALSE(dumps.nan_slots.empty());

  const Run check = kvaudit_check(dumps.dir / "nan_at_448.h5", "none");
  INFO(check.command << "\n" << check.output);
  CHECK(check.status == 1);
  CHECK_THAT(check.output, Catch::Contains("verdict: FAIL"));
  bool named = false;
  for (const int slot : dumps.nan_slots)
    named = named || names_slot(check.output, "S000", "L005", slot);
  CHECK(named);
  CHECK_THAT(check.output, Catch::Contains("captured_pool [nan_code]: S000 L005"));
}
