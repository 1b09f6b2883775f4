// The CUDA kernel variant options end to end through the kvaudit binary (src/cli/cli.hpp
// add_cuda_variant_options): every command that builds a cuda-* backend or times the kernels takes
// --cuda-mma, --cuda-decode16, --cuda-host-plan, --cuda-longest-first and teaches them in its help;
// a value outside the set is one line naming the option and the valid values (exit 2); with a
// backend that is not a CUDA one they are refused, not ignored (exit 2).
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "src/cli/cli.hpp"
#include "tests/test_paths.hpp"

namespace kvaudit {
namespace {

namespace fs = std::filesystem;

struct Outcome {
  int status = -1;
  std::string out;
  std::string err;
};

std::string file_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

// `kvaudit args` with stdin from /dev/null (backend-serve reads it), COLUMNS=200 for help. The
// files are per process: ctest runs this file's cases in parallel, each as its own process.
Outcome run_kvaudit(const std::string& args) {
  const fs::path dir =
      kvaudit_test::test_tmpdir() / ("cli_cuda_variant." + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path out = dir / "run.out";
  const fs::path err = dir / "run.err";
  const std::string command = "COLUMNS=200 '" + kvaudit_test::kvaudit_binary().string() + "' " +
                              args + " < /dev/null > '" + out.string() + "' 2> '" + err.string() +
                              "'";
  const int raw = std::system(command.c_str());
  return {WIFEXITED(raw) ? WEXITSTATUS(raw) : -1, file_text(out), file_text(err)};
}

// `text` with every run of whitespace made one space (help is wrapped to the terminal).
std::string one_line(const std::string& text) {
  std::string joined;
  for (const char c : text) {
    const bool space = c == ' ' || c == '\n' || c == '\t';
    if (space && (joined.empty() || joined.back() == ' ')) continue;
    joined += space ? ' ' : c;
  }
  return joined;
}

std::string shipped_dump() {
  return "'" + (kvaudit_test::source_dir() / "datasets" / "glm5_page1.h5").string() + "'";
}

// Exit 2, exactly `line` on stderr, nothing on stdout.
void check_refused(const Outcome& outcome, const std::string& line) {
  INFO("stderr: " << outcome.err << "stdout: " << outcome.out.substr(0, 300));
  CHECK(outcome.status == 2);
  CHECK(outcome.err == line + "\n");
  CHECK(outcome.out.empty());
}

}  // namespace

TEST_CASE("cuda variant options: a bad value is one line naming the option and the valid values",
          "[cli][cuda-variant]") {
  const std::string dump = shipped_dump();
  check_refused(run_kvaudit("check " + dump + " --backend cuda-fp8 --cuda-mma wgmma"),
                "kvaudit: check --cuda-mma: 'wgmma' is not one of auto, mma-sync");
  check_refused(run_kvaudit("check " + dump + " --backend cuda-fp8 --cuda-decode16 shared"),
                "kvaudit: check --cuda-decode16: 'shared' is not one of auto, shared-tile, "
                "registers");
  check_refused(run_kvaudit("check " + dump + " --backend cuda-fp8 --cuda-host-plan yes"),
                "kvaudit: check --cuda-host-plan: 'yes' is not one of on, off");
  check_refused(run_kvaudit("check " + dump + " --backend cuda-fp8 --cuda-longest-first OFF"),
                "kvaudit: check --cuda-longest-first: 'OFF' is not one of on, off");
  check_refused(run_kvaudit("check " + dump + " --backend cuda-fp8 --cuda-mma ''"),
                "kvaudit: check --cuda-mma: the value is empty");
  check_refused(run_kvaudit("golden record " + dump +
                            " -o x.golden.h5 --backend cuda-fp8 "
                            "--cuda-decode16 register"),
                "kvaudit: golden record --cuda-decode16: 'register' is not one of auto, "
                "shared-tile, registers");
  check_refused(run_kvaudit("golden check " + dump +
                            " x.golden.h5 --backend cuda-fp8 "
                            "--cuda-mma mma.sync"),
                "kvaudit: golden check --cuda-mma: 'mma.sync' is not one of auto, mma-sync");
  check_refused(run_kvaudit("bench --gpu-only --cuda-host-plan 0"),
                "kvaudit: bench --cuda-host-plan: '0' is not one of on, off");
  check_refused(run_kvaudit("backend-serve cuda-fp8 --cuda-longest-first true"),
                "kvaudit: backend-serve --cuda-longest-first: 'true' is not one of on, off");
}

TEST_CASE("cuda variant options with a backend that is not a CUDA one are refused",
          "[cli][cuda-variant]") {
  const std::string dump = shipped_dump();
  check_refused(run_kvaudit("check " + dump + " --backend cpu-fp8 --cuda-mma mma-sync"),
                "kvaudit: --cuda-mma: chooses a kernel of the CUDA backends (cuda-fp8, "
                "cuda-cast-bf16); --backend is cpu-fp8");
  check_refused(run_kvaudit("check " + dump + " --cuda-host-plan off"),
                "kvaudit: --cuda-host-plan: chooses a kernel of the CUDA backends (cuda-fp8, "
                "cuda-cast-bf16); --backend is cpu-fp8");
  check_refused(run_kvaudit("check " + dump + " --backend none --cuda-longest-first on"),
                "kvaudit: --cuda-longest-first: chooses a kernel of the CUDA backends "
                "(cuda-fp8, cuda-cast-bf16); --backend is none");
  check_refused(run_kvaudit("check " + dump +
                            " --backend exec:torch --backend-command false --cuda-decode16 "
                            "registers"),
                "kvaudit: --cuda-decode16: chooses a kernel of the CUDA backends (cuda-fp8, "
                "cuda-cast-bf16); --backend is exec:torch");
  check_refused(
      run_kvaudit("golden record " + dump + " -o '" +
                  (kvaudit_test::test_tmpdir() / "cli_cuda_variant" / "g.golden.h5").string() +
                  "' --backend cpu-fp8 --cuda-mma auto"),
      "kvaudit: --cuda-mma: chooses a kernel of the CUDA backends (cuda-fp8, "
      "cuda-cast-bf16); --backend is cpu-fp8");
  check_refused(run_kvaudit("golden check " + dump + " nosuch.golden.h5 --cuda-host-plan on"),
                "kvaudit: --cuda-host-plan: chooses a kernel of the CUDA backends (cuda-fp8, "
                "cuda-cast-bf16); --backend is cpu-fp8");
  check_refused(run_kvaudit("backend-serve cpu-fp8 --cuda-mma mma-sync"),
                "kvaudit: --cuda-mma: chooses a kernel of the CUDA backends (cuda-fp8, "
                "cuda-cast-bf16); --backend is cpu-fp8");
}

TEST_CASE("cuda variant options: the help of every command that runs the CUDA kernels teaches them",
          "[cli][cuda-variant]") {
  for (const char* command : {"check", "golden record", "golden check", "bench", "backend-serve"}) {
    INFO(command);
    const Outcome help = run_kvaudit(std::string("help ") + command);
    REQUIRE(help.status == 0);
    const std::string text_of_help = one_line(help.out);
    for (const char* text :
         {"--cuda-mma auto|mma-sync", "--cuda-decode16 auto|shared-tile|registers",
          "--cuda-host-plan on|off", "--cuda-longest-first on|off", "Bit-identical results",
          "within the kernel error bound",
          "recorded in report.json and golden files (backend_description.kernel_variant)"}) {
      CHECK_THAT(text_of_help, Catch::Matchers::Contains(text));
    }
  }
  const Outcome info = run_kvaudit("help info");
  REQUIRE(info.status == 0);
  CHECK_THAT(info.out, !Catch::Matchers::Contains("--cuda-mma"));
}

TEST_CASE("cuda_variant_arguments repeats the variant's non-default choices", "[cuda-variant]") {
  CHECK(cuda_variant_arguments(CudaKernelVariant{}, " ").empty());
  CudaKernelVariant variant;
  variant.mma = MmaChoice::kMmaSync;
  variant.host_plan = false;
  CHECK(cuda_variant_arguments(variant, " ") == " --cuda-mma mma-sync --cuda-host-plan off");
  variant = CudaKernelVariant{};
  variant.decode16 = Decode16Choice::kSharedTile;
  variant.longest_first = false;
  CHECK(cuda_variant_arguments(variant, ", ") ==
        ", --cuda-decode16 shared-tile, --cuda-longest-first off");
}

}  // namespace kvaudit
