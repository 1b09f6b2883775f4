// kvaudit with an external backend (docs/backend-protocol.md): the `torch` adapter of the Python
// package (python -m kvdump.backends torch --device cpu) judged end to end by `kvaudit check
// --backend exec:torch` on a shipped dump. A clean adapter passes; one planted with a wrong
// convention fails with the check meant to catch it:
//   --write kvdump                     (kvdump's write rule)        exit 0, verdict pass
//   default write                      PyTorch's (new_kv / kv_scale).to(float8_e4m3fn) on a bf16
//                                      new_kv: the bf16 quotient double-rounds, exit 1, integrity
//                                      written_slots [off_by_one_code]
//   --fault round-toward-zero          exit 1, integrity written_slots [off_by_one_code]
//   --fault lse-base2                  exit 1, a failing kernel comparison whose reasons name lse,
//                                      and the diagnosis explains it by lse-base-2
// Golden files through the same adapter (`kvaudit golden record/check --backend exec:torch
// --backend-command ...`): a recording matches a second run, and a planted lse-base2 fault or
// PyTorch's own write moves it (exit 1, the first moved element named).
// Also the package's unittest suite under the same interpreter, so that its torch tests run.
//
// The interpreter: $KVAUDIT_PYTHON, else build/python-venv/bin/python (scripts/setup-python.sh;
// KVAUDIT_WITH_TORCH=1 installs torch). The adapter runs from this checkout's python/ (PYTHONPATH),
// not from the copy installed in the venv; $KVAUDIT_TORCH_ADAPTER replaces the whole adapter
// command (`python -m kvdump.backends torch`), for the tests of these tests.
//
// Skips and failures (tests/prerequisites.hpp): a case tagged [torch] needs that interpreter with
// torch, one tagged [python-venv] the interpreter alone; where it is missing the runner reports the
// case skipped, by name and reason, and never runs it. A help text that lacks an option these cases
// pass (kvaudit check's --backend-command, the adapter's --device, --write kvdump, --fault
// round-toward-zero / lse-base2) is not a reason to skip: kvaudit, the adapter and these tests have
// drifted apart, and the case fails, naming the option.
#include <fmt/core.h>
#include <sys/wait.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "kvaudit_test_config.hpp"  // KVAUDIT_BINARY, KVAUDIT_SOURCE_DIR, KVAUDIT_TEST_TMPDIR
#include "tests/prerequisites.hpp"
#include "tests/test_paths.hpp"

namespace {

// kvaudit's diagnosis of convention mismatches exists (src/replay/diagnosis.hpp): report.json
// must hold a "diagnosis" array for a failing run.
constexpr bool kRequireDiagnosis = true;

// The repository root (tests/test_paths.hpp: the build's, or $KVAUDIT_TEST_SOURCE_DIR). Not
// __FILE__: a compiler cache with a base_dir makes it relative to the build folder.
std::filesystem::path source_root() { return kvaudit_test::source_dir(); }

std::string quoted(const std::filesystem::path& path) { return fmt::format("'{}'", path.string()); }

// Exit status of a shell command; -1 when it did not exit normally.
int exit_status(const std::string& command) {
  const int status = std::system(command.c_str());
  if (status == -1 || !WIFEXITED(status)) return -1;
  return WEXITSTATUS(status);
}

std::string read_text(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::filesystem::path case_dir(const std::string& name) {
  const std::filesystem::path dir = std::filesystem::path(KVAUDIT_TEST_TMPDIR) / "exec" / name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

std::filesystem::path venv_python() {
  if (const char* python = std::getenv("KVAUDIT_PYTHON"); python != nullptr && *python != '\0') {
    return python;
  }
  return source_root() / "build" / "python-venv" / "bin" / "python";
}

// Empty when the venv's interpreter exists, else why not.
std::string missing_python() {
  const std::filesystem::path python = venv_python();
  if (!std::filesystem::exists(python)) {
    return fmt::format("{} does not exist (run scripts/setup-python.sh, or set KVAUDIT_PYTHON)",
                       python.string());
  }
  return {};
}

// Empty when the adapter can run here, else why not.
std::string missing_prerequisite() {
  if (std::string missing = missing_python(); !missing.empty()) return missing;
  const std::filesystem::path python = venv_python();
  if (exit_status(fmt::format("{} -c 'import torch, numpy' >/dev/null 2>&1", quoted(python))) !=
      0) {
    return fmt::format("{} cannot import torch (KVAUDIT_WITH_TORCH=1 scripts/setup-python.sh)",
                       python.string());
  }
  return {};
}

const char* adapter_override() {
  const char* command = std::getenv("KVAUDIT_TORCH_ADAPTER");
  return command != nullptr && *command != '\0' ? command : nullptr;
}

const kvaudit_test::PrerequisiteRegistration torch_needed("torch", [] {
  const std::string missing = missing_prerequisite();
  return kvaudit_test::PrerequisiteState{missing.empty(), missing};
});
// The adapter's help text needs the interpreter only (the adapter imports torch when it serves),
// or nothing when $KVAUDIT_TORCH_ADAPTER names the adapter.
const kvaudit_test::PrerequisiteRegistration python_needed("python-venv", [] {
  const std::string missing = adapter_override() != nullptr ? std::string() : missing_python();
  return kvaudit_test::PrerequisiteState{missing.empty(), missing};
});

// The command that starts the torch adapter, before its options.
std::string torch_adapter_command() {
  if (const char* command = adapter_override()) return command;
  return fmt::format("PYTHONPATH=\"{}\" \"{}\" -B -m kvdump.backends torch",
                     (source_root() / "python").string(), venv_python().string());
}

// Standard output and error of a shell command (empty when it cannot be started).
std::string output_of(const std::string& command) {
  std::string output;
  if (FILE* pipe = popen((command + " 2>&1").c_str(), "r")) {
    char buffer[4096];
    for (std::size_t n; (n = std::fread(buffer, 1, sizeof buffer, pipe)) > 0;)
      output.append(buffer, n);
    pclose(pipe);
  }
  return output;
}

// The words of `expected` that `help` does not contain.
std::vector<std::string> missing_words(const std::string& help,
                                       const std::vector<std::string>& expected) {
  std::vector<std::string> missing;
  for (const std::string& word : expected) {
    if (help.find(word) == std::string::npos) missing.push_back(word);
  }
  return missing;
}

// What these cases pass to kvaudit and to the adapter.
const std::vector<std::string> kKvauditOptions = {"--backend-command"};
const std::vector<std::string> kAdapterOptions = {"--device", "--write",           "kvdump",
                                                  "--fault",  "round-toward-zero", "lse-base2"};

std::string joined(const std::vector<std::string>& words) {
  std::string text;
  for (const std::string& word : words) text += (text.empty() ? "" : ", ") + word;
  return text;
}

// Fails the case, naming each option, when kvaudit's or the adapter's help text lacks one these
// cases pass: the three have drifted apart.
void require_options_in_help() {
  {
    const std::string help = output_of(fmt::format("{} check --help", KVAUDIT_BINARY));
    INFO("kvaudit check --help:\n" << help);
    if (const auto missing = missing_words(help, kKvauditOptions); !missing.empty()) {
      FAIL("kvaudit check --help does not mention " << joined(missing)
                                                    << ", which these cases pass it");
    }
    SUCCEED("kvaudit check --help mentions " << joined(kKvauditOptions));
  }
  const std::string help = output_of(torch_adapter_command() + " --help");
  INFO(torch_adapter_command() << " --help:\n" << help);
  if (const auto missing = missing_words(help, kAdapterOptions); !missing.empty()) {
    FAIL("the torch adapter's --help does not mention " << joined(missing)
                                                        << ", which these cases pass it");
  }
  SUCCEED("the torch adapter's --help mentions " << joined(kAdapterOptions));
}

struct ExecRun {
  std::string command;
  int status = -1;
  std::string output;  // kvaudit's stdout and stderr
  nlohmann::json report;
};

// `kvaudit check DUMP --backend exec:torch --backend-command "<python> -m kvdump.backends torch
// --device cpu ADAPTER_OPTIONS" --json DIR/report.json`.
ExecRun check_with_torch_adapter(const std::string& name, const std::string& adapter_options) {
  const std::filesystem::path dir = case_dir(name);
  const std::string backend_command =
      fmt::format("{} --device cpu {}", torch_adapter_command(), adapter_options);
  ExecRun run;
  run.command =
      fmt::format("{} check {} --backend exec:torch --backend-command '{}' --json {} --threads 2",
                  KVAUDIT_BINARY, quoted(source_root() / "datasets" / "glm5_page1.h5"),
                  backend_command, quoted(dir / "report.json"));
  const std::filesystem::path log = dir / "kvaudit.log";
  run.status = exit_status(fmt::format("{} > {} 2>&1", run.command, quoted(log)));
  run.output = read_text(log);
  if (std::filesystem::exists(dir / "report.json")) {
    run.report = nlohmann::json::parse(read_text(dir / "report.json"), nullptr, false);
  }
  return run;
}

// The failing integrity findings of a check (name, classification) as "check [class]" lines.
std::string failing_integrity(const nlohmann::json& report) {
  std::string lines;
  for (const auto& finding : report.value("integrity", nlohmann::json::array())) {
    if (finding.value("pass", true)) continue;
    lines +=
        fmt::format("{} [{}]\n", finding.value("check", ""), finding.value("classification", ""));
  }
  return lines;
}

bool has_failing_integrity(const nlohmann::json& report, const std::string& check,
                           const std::string& classification) {
  for (const auto& finding : report.value("integrity", nlohmann::json::array())) {
    if (!finding.value("pass", true) && finding.value("check", "") == check &&
        finding.value("classification", "") == classification) {
      return true;
    }
  }
  return false;
}

// A failing comparison of this kind whose reasons mention `word`.
bool has_failing_comparison(const nlohmann::json& report, const std::string& comparison,
                            const std::string& word) {
  for (const auto& result : report.value("results", nlohmann::json::array())) {
    if (result.value("pass", true) || result.value("comparison", "") != comparison) continue;
    for (const auto& reason : result.value("reasons", nlohmann::json::array())) {
      if (reason.is_string() && reason.get<std::string>().find(word) != std::string::npos) {
        return true;
      }
    }
  }
  return false;
}

// Whether some kernel finding of report.json's "diagnosis" array is explained by lse-base-2, the
// catalogue's name for an lse returned as log2 of the softmax sum.
bool diagnosis_names_lse_base(const nlohmann::json& diagnosis) {
  for (const auto& finding : diagnosis) {
    if (finding.value("comparison", "") != "kernel") continue;
    for (const auto& outcome : finding.value("explained_by", nlohmann::json::array())) {
      if (outcome.value("hypothesis", "") == "lse-base-2") return true;
    }
  }
  return false;
}

}  // namespace

TEST_CASE("exec torch adapter: kvaudit's and the adapter's help name every option these cases pass",
          "[python][exec][python-venv]") {
  require_options_in_help();
}

TEST_CASE("python backends: the package's unittest suite passes under the venv python",
          "[python][exec][torch]") {
  const std::filesystem::path dir = case_dir("unittest");
  const std::string command =
      fmt::format("KVAUDIT_BINARY={} {} -B -m unittest discover -s {} > {} 2>&1",
                  quoted(KVAUDIT_BINARY), quoted(venv_python()),
                  quoted(source_root() / "python" / "tests"), quoted(dir / "unittest.log"));
  const int status = exit_status(command);
  INFO(command << "\n" << read_text(dir / "unittest.log"));
  CHECK(status == 0);
}

TEST_CASE("exec torch adapter: with kvdump's write rule a shipped dump passes",
          "[python][exec][torch]") {
  require_options_in_help();
  const ExecRun run = check_with_torch_adapter("clean", "--write kvdump");
  INFO(run.command << "\n" << run.output);
  CHECK(run.status == 0);
  REQUIRE(run.report.is_object());
  CHECK(run.report.value("verdict", "") == "pass");
  CHECK(run.report.value("backend", "") == "exec:torch");
  CHECK(failing_integrity(run.report).empty());
}

TEST_CASE("exec torch adapter: PyTorch's own write of a bf16 quotient is reported code by code",
          "[python][exec][torch]") {
  require_options_in_help();
  // glm5_page1's kv_scales are not 1, so new_kv / kv_scale is rounded to bf16 before the FP8
  // cast: about 2% of the written codes are one step from e4m3_rne_satfinite(x / kv_scale).
  const ExecRun run = check_with_torch_adapter("server_write", "");
  INFO(run.command << "\n" << run.output << "\n" << failing_integrity(run.report));
  CHECK(run.status == 1);
  REQUIRE(run.report.is_object());
  CHECK(has_failing_integrity(run.report, "written_slots", "off_by_one_code"));
}

TEST_CASE("exec torch adapter: a round-toward-zero write fails written_slots as off_by_one_code",
          "[python][exec][torch]") {
  require_options_in_help();
  const ExecRun run =
      check_with_torch_adapter("round_toward_zero", "--write kvdump --fault round-toward-zero");
  INFO(run.command << "\n" << run.output << "\n" << failing_integrity(run.report));
  CHECK(run.status == 1);
  REQUIRE(run.report.is_object());
  CHECK(run.report.value("verdict", "") == "fail");
  CHECK(has_failing_integrity(run.report, "written_slots", "off_by_one_code"));
}

TEST_CASE("exec torch adapter: a base-2 lse fails the kernel comparison on lse",
          "[python][exec][torch]") {
  require_options_in_help();
  const ExecRun run = check_with_torch_adapter("lse_base2", "--write kvdump --fault lse-base2");
  INFO(run.command << "\n" << run.output);
  CHECK(run.status == 1);
  REQUIRE(run.report.is_object());
  CHECK(run.report.value("verdict", "") == "fail");
  CHECK(has_failing_comparison(run.report, "kernel", "lse"));
  CHECK(failing_integrity(run.report).empty());  // the write is right; only the output is not
  if (kRequireDiagnosis) REQUIRE(run.report.contains("diagnosis"));
  if (run.report.contains("diagnosis")) {
    INFO(run.report["diagnosis"].dump(2));
    CHECK(diagnosis_names_lse_base(run.report["diagnosis"]));
  }
}

namespace {

// `kvaudit golden SUBCOMMAND ARGUMENTS --backend exec:torch --backend-command "<python> -m
// kvdump.backends torch --device cpu ADAPTER_OPTIONS"`, its exit status and output.
ExecRun golden_with_torch_adapter(const std::string& name, const std::string& arguments,
                                  const std::string& adapter_options) {
  const std::filesystem::path dir = std::filesystem::path(KVAUDIT_TEST_TMPDIR) / "exec" / "golden";
  std::filesystem::create_directories(dir);
  const std::string backend_command =
      fmt::format("PYTHONPATH=\"{}\" \"{}\" -B -m kvdump.backends torch --device cpu {}",
                  (source_root() / "python").string(), venv_python().string(), adapter_options);
  ExecRun run;
  run.command = fmt::format(
      "KVAUDIT_GOLDEN_ACCEPT=0 {} golden {} --backend exec:torch "
      "--backend-command '{}' --threads 2",
      KVAUDIT_BINARY, arguments, backend_command);
  const std::filesystem::path log = dir / (name + ".log");
  run.status = exit_status(fmt::format("{} > {} 2>&1", run.command, quoted(log)));
  run.output = read_text(log);
  return run;
}

}  // namespace

TEST_CASE("exec torch adapter: a golden file recorded through it matches - a fault moves it",
          "[python][exec][golden][torch]") {
  require_options_in_help();
  const std::string dump = quoted(source_root() / "datasets" / "glm5_page1.h5");
  const std::filesystem::path golden =
      std::filesystem::path(KVAUDIT_TEST_TMPDIR) / "exec" / "golden" / "glm5_page1.torch.golden.h5";
  std::filesystem::remove(golden);
  const ExecRun recorded = golden_with_torch_adapter(
      "record", fmt::format("record {} -o {}", dump, quoted(golden)), "--write kvdump");
  INFO(recorded.command << "\n" << recorded.output);
  REQUIRE(recorded.status == 0);
  REQUIRE(std::filesystem::exists(golden));
  const std::string check = fmt::format("check {} {}", dump, quoted(golden));

  const ExecRun same = golden_with_torch_adapter("match", check, "--write kvdump");
  INFO(same.command << "\n" << same.output);
  CHECK(same.status == 0);
  CHECK(same.output.find("verdict: match") != std::string::npos);

  // lse in base 2: every lse moves, out does not.
  const ExecRun lse =
      golden_with_torch_adapter("lse_base2", check, "--write kvdump --fault lse-base2");
  INFO(lse.command << "\n" << lse.output);
  CHECK(lse.status == 1);
  CHECK(lse.output.find("first moved: step 0 layer 0 lse[row ") != std::string::npos);
  CHECK(lse.output.find("verdict: MOVED") != std::string::npos);

  // PyTorch's own write (a bf16 quotient): written codes move, one step each.
  const ExecRun write = golden_with_torch_adapter("server_write", check, "");
  INFO(write.command << "\n" << write.output);
  CHECK(write.status == 1);
  CHECK(write.output.find("first moved: step 0 layer ") != std::string::npos);
  CHECK(write.output.find(" pool[slot ") != std::string::npos);
}
