// scripts/run-main-job.sh builds only what it runs (README "The two commands"): the `kvaudit`
// target without the tests, CUDA only where `nvidia-smi -L` lists a GPU (then for that GPU's
// architecture alone) or where KVAUDIT_CUDA asks, and it says what it does, one line per phase
// with the time elapsed. Checked through its dry run (KVAUDIT_DRY_RUN=1 prints the phases and
// commands and runs nothing), with a stand-in nvidia-smi first on PATH.
#include <sys/stat.h>
#include <sys/wait.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <regex>
#include <sstream>
#include <string>

#include "tests/test_paths.hpp"

namespace {

namespace fs = std::filesystem;

// A folder holding an `nvidia-smi` that lists an H200 (compute capability 9.0) or fails.
fs::path fake_nvidia_smi(bool gpu) {
  const fs::path dir = kvaudit_test::test_tmpdir() / "main_job" / (gpu ? "gpu" : "no-gpu");
  fs::create_directories(dir);
  const fs::path script = dir / "nvidia-smi";
  std::ofstream(script) << (gpu ? "#!/bin/sh\n"
                                  "case \"$*\" in *compute_cap*) echo 9.0 ;; "
                                  "*) echo 'GPU 0: NVIDIA H200 (UUID: GPU-0)' ;; esac\n"
                                : "#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n");
  chmod(script.c_str(), 0755);
  return dir;
}

// The dry run's output, with `gpu` deciding what nvidia-smi answers and `env` added.
std::string dry_run(bool gpu, const std::string& env = "") {
  const fs::path out = kvaudit_test::test_tmpdir() / "main_job" / "dry-run.out";
  const std::string command =
      "env -u KVAUDIT_CUDA -u KVAUDIT_BUILD_DIR KVAUDIT_DRY_RUN=1 KVAUDIT_JOBS=2 PATH='" +
      fake_nvidia_smi(gpu).string() + "':\"$PATH\" " + env + " bash '" +
      (kvaudit_test::source_dir() / "scripts" / "run-main-job.sh").string() + "' > '" +
      out.string() + "' 2>&1";
  const int raw = std::system(command.c_str());
  REQUIRE(WIFEXITED(raw));
  std::ifstream in(out);
  std::string text{std::istreambuf_iterator<char>(in), {}};
  INFO(text);
  REQUIRE(WEXITSTATUS(raw) == 0);
  return text;
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST_CASE("main job without a GPU: the kvaudit target only, no CUDA, phases timed", "[scripts]") {
  const std::string plan = dry_run(false);
  INFO(plan);
  CHECK(contains(plan, "-DKVAUDIT_TESTS=OFF -DKVAUDIT_CUDA=OFF"));
  CHECK(contains(plan, "CUDA OFF (no GPU found (nvidia-smi -L fails)"));
  CHECK(contains(plan, "+ cmake --build build --target kvaudit -j2"));
  CHECK_FALSE(contains(plan, "CMAKE_CUDA_ARCHITECTURES"));
  CHECK(contains(plan,
                 "+ build/kvaudit check datasets/glm5_page1.h5 --backend cpu-fp8 --report "
                 "build/main-job/report"));
  // Every line is a phase with its elapsed time, or a command of it.
  std::istringstream lines(plan);
  std::string line;
  int phases = 0;
  while (std::getline(lines, line)) {
    INFO(line);
    const bool phase = std::regex_match(line, std::regex(R"(main-job \[\d+:\d\d\] .+)"));
    CHECK((phase || line.rfind("  + ", 0) == 0));
    phases += phase;
  }
  CHECK(phases == 6);
}

TEST_CASE("main job with a GPU: CUDA for that GPU's architecture only", "[scripts]") {
  const std::string plan = dry_run(true);
  INFO(plan);
  // sm_90's "a" target: the wgmma kernels need it.
  CHECK(contains(plan, "-DKVAUDIT_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a"));
  CHECK(contains(plan, "CUDA ON (a GPU is present (nvidia-smi -L), sm_90)"));
  CHECK(contains(plan, "--target kvaudit"));
}

// The packages scripts/setup.sh would install for a set, one per line (its --list mode).
std::string setup_packages(const std::string& set) {
  const fs::path out = kvaudit_test::test_tmpdir() / "main_job" / "setup-list.out";
  fs::create_directories(out.parent_path());
  const std::string command = "bash '" +
                              (kvaudit_test::source_dir() / "scripts" / "setup.sh").string() +
                              "' --list " + set + " > '" + out.string() + "' 2>&1";
  const int raw = std::system(command.c_str());
  std::ifstream in(out);
  std::string text{std::istreambuf_iterator<char>(in), {}};
  INFO(text);
  REQUIRE(WIFEXITED(raw));
  REQUIRE(WEXITSTATUS(raw) == 0);
  return "\n" + text;
}

TEST_CASE("main job: its set-up installs no browser - the tests' set-up does", "[scripts]") {
  CHECK(contains(dry_run(false), "+ bash scripts/setup.sh\n"));  // the build set, no argument
  const std::string build = setup_packages("");
  const std::string tests = setup_packages("tests");
  for (const char* package : {"\ncmake\n", "\nlibhdf5-dev\n", "\nnettle-dev\n"}) {
    CHECK(contains(build, package));
    CHECK(contains(tests, package));
  }
  for (const char* package : {"\nchromium\n", "\ntidy\n", "\npython3-pil\n", "\ncatch2\n"}) {
    INFO(package);
    CHECK_FALSE(contains(build, package));
    CHECK(contains(tests, package));
  }
}

TEST_CASE("main job: KVAUDIT_CUDA decides over nvidia-smi", "[scripts]") {
  CHECK(contains(dry_run(false, "KVAUDIT_CUDA=ON"), "-DKVAUDIT_CUDA=ON"));
  CHECK(contains(dry_run(true, "KVAUDIT_CUDA=off"), "-DKVAUDIT_CUDA=OFF"));
}

}  // namespace
