// vLLM 0.34.0's Triton MLA decode (the peer file, unmodified) run on the CPU under Triton's
// interpreter (`python -m kvdump.backends vllm-triton-mla --triton-interpreter`), judged by
// `kvaudit check` on a small synth dump whose kv_scale (0.0733) is not a power of two: the kernel
// fails on the lse alone, and the diagnosis must explain every diagnosed (step, layer) (issue 29:
// K dequantized as bf16(fp32(code) * s) and the lse stored in bf16 each hide the other on the lse;
// docs/peer-kernels.md "Without a GPU"). About 20 s on 2 cores.
//
// [triton-interpreter]: needs the venv's interpreter ($KVAUDIT_PYTHON, else
// build/python-venv/bin/python) with torch and triton (PyPI's CUDA build of torch brings triton;
// no GPU is used), and the peer file (scripts/fetch-peer-kernels.sh, into build/peer-kernels, or
// $KVAUDIT_PEER_KERNELS); skipped, by name and reason, where one is missing.
#include <fmt/core.h>
#include <sys/wait.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "kvaudit_test_config.hpp"  // KVAUDIT_BINARY, KVAUDIT_TEST_TMPDIR
#include "tests/prerequisites.hpp"
#include "tests/test_paths.hpp"

namespace {

std::string quoted(const std::filesystem::path& path) { return fmt::format("'{}'", path.string()); }

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

std::filesystem::path venv_python() {
  if (const char* python = std::getenv("KVAUDIT_PYTHON"); python != nullptr && *python != '\0') {
    return python;
  }
  return kvaudit_test::source_dir() / "build" / "python-venv" / "bin" / "python";
}

std::filesystem::path vllm_kernel_file() {
  const char* root = std::getenv("KVAUDIT_PEER_KERNELS");
  const std::filesystem::path folder = root != nullptr && *root != '\0'
                                           ? std::filesystem::path(root)
                                           : kvaudit_test::source_dir() / "build" / "peer-kernels";
  return folder / "vllm-0.34.0" / "triton_decode_attention.py";
}

// Empty when the interpreted kernel can run here, else why not.
std::string missing_prerequisite() {
  const std::filesystem::path python = venv_python();
  if (!std::filesystem::exists(python)) {
    return fmt::format("{} does not exist (scripts/setup-python.sh, or set KVAUDIT_PYTHON)",
                       python.string());
  }
  if (exit_status(fmt::format("{} -c 'import torch, triton' >/dev/null 2>&1", quoted(python))) !=
      0) {
    return fmt::format(
        "{} cannot import torch and triton (KVAUDIT_WITH_TORCH=1 "
        "scripts/setup-python.sh installs both)",
        python.string());
  }
  if (!std::filesystem::exists(vllm_kernel_file())) {
    return fmt::format("no {} (scripts/fetch-peer-kernels.sh)", vllm_kernel_file().string());
  }
  return {};
}

const kvaudit_test::PrerequisiteRegistration interpreter_needed("triton-interpreter", [] {
  const std::string missing = missing_prerequisite();
  return kvaudit_test::PrerequisiteState{missing.empty(), missing};
});

std::string explained_names(const nlohmann::json& finding) {
  std::string names;
  for (const auto& outcome : finding.value("explained_by", nlohmann::json::array())) {
    names += (names.empty() ? "" : ", ") + outcome.value("hypothesis", std::string());
  }
  return names;
}

}  // namespace

TEST_CASE(
    "vLLM's Triton MLA decode under Triton's interpreter: its lse failure on a kv_scale of "
    "0.0733 is explained, by k-dequant-fp32-bf16 + lse-bf16 where neither alone does",
    "[triton-interpreter]") {
  const std::filesystem::path dir =
      std::filesystem::path(KVAUDIT_TEST_TMPDIR) / "exec" / "vllm_triton_interpreted";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::filesystem::path dump = dir / "scale0.0733.h5";
  const std::string binary = kvaudit_test::kvaudit_binary().string();
  REQUIRE(exit_status(fmt::format("{} synth --out {} --seed 3 --heads 8 --layers 1 --page-size 16 "
                                  "--prefix-lens 300,100 --prefill-tokens 1,1 --decode-steps 1 "
                                  "--kv-scale 0.0733 > {} 2>&1",
                                  binary, quoted(dump), quoted(dir / "synth.log"))) == 0);
  const std::string adapter = fmt::format(
      "PYTHONPATH={} {} -B -m kvdump.backends vllm-triton-mla --triton-interpreter --write kvdump "
      "--kernel-file {}",
      quoted(kvaudit_test::source_dir() / "python"), quoted(venv_python()),
      quoted(vllm_kernel_file()));
  const std::string command = fmt::format(
      "{} check {} --backend exec:vllm-triton-mla --backend-command \"{}\" --json {} > {} 2>&1",
      binary, quoted(dump), adapter, quoted(dir / "report.json"), quoted(dir / "check.log"));
  INFO(command << "\n" << read_text(dir / "check.log"));
  REQUIRE(exit_status(command) == 1);  // the kernel comparisons fail: the lse in bf16
  const nlohmann::json report = nlohmann::json::parse(read_text(dir / "report.json"));
  // The run says it was interpreted on the CPU.
  const std::string described = report["backend_description"].dump();
  CHECK(described.find("\"triton_interpreter\":{") != std::string::npos);
  CHECK(described.find("not a GPU run") != std::string::npos);
  const nlohmann::json& diagnosis = report["diagnosis"];
  REQUIRE(diagnosis.size() == 2);  // one layer, the prefill step and one decode step
  bool pair_named = false;
  for (const auto& finding : diagnosis) {
    INFO("step " << finding.value("step", -1) << ": explained by " << explained_names(finding));
    CHECK(finding.value("explained", false));
    for (const auto& outcome : finding.value("explained_by", nlohmann::json::array())) {
      pair_named |= outcome.value("hypothesis", std::string()) == "k-dequant-fp32-bf16 + lse-bf16";
    }
  }
  CHECK(pair_named);
}
