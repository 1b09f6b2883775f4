// The backend selection options shared by `check`, `golden record` and `golden check`
// (src/cli/backend_selection.hpp).
#include "src/cli/backend_selection.hpp"

#include <fmt/format.h>

#include <string>

#include "src/backend/injection.hpp"
#include "src/cli/backend_registry.hpp"
#include "src/verdict/check_result.hpp"  // shell_quote

namespace kvaudit {

void add_backend_selection_options(CLI::App& cmd, BackendSelection& selection, NoBackend none) {
  std::string backends;
  for (const std::string& name : backend_names()) backends += name + ", ";
  cmd.add_option("--backend", selection.backend,
                 "Backend under test: " + backends +
                     "exec:NAME (a program outside kvaudit speaking the external backend "
                     "protocol, docs/backend-protocol.md; NAME: letters, digits, -, _, .)" +
                     (none == NoBackend::kAllowed
                          ? ", or none (compare only the captured outputs and pools)"
                          : ""))
      ->capture_default_str();
  cmd.add_option("--backend-command", selection.backend_command,
                 "With --backend exec:NAME: the command that starts the program, run once per "
                 "dump by /bin/sh -c (default: python3 -m kvdump.backends NAME, the Python "
                 "package's adapters torch, flashinfer-fp8, flashinfer-cast-bf16; `kvaudit "
                 "backend-serve cpu-fp8` serves a built-in backend). Environment: "
                 "KVAUDIT_BACKEND_TIMEOUT (seconds per reply, default 900), "
                 "KVAUDIT_EXCHANGE_DIR (where the session directory goes, default /dev/shm)");
  std::string injections;
  for (const InjectionInfo& info : injection_table()) {
    injections += std::string(injections.empty() ? "" : ", ") + info.name;
  }
  cmd.add_option("--inject", selection.inject,
                 "Fault injection into a built-in backend, a mutation test of the harness: " +
                     injections + " (each names the check meant to catch it)");
  cmd.add_flag("--reciprocal-scale", selection.reciprocal_scale,
               "Write with e4m3_rne_satfinite(x * fp32(1 / kv_scale)), the convention of servers "
               "that multiply by a reciprocal scale, instead of kvdump-v1's x / kv_scale: in the "
               "reference replay (so captured pools are judged by it) and in the backend. It "
               "differs in the last bit of rare codes; the report notes it");
  add_cuda_variant_options(cmd, selection.cuda);
}

Status check_backend_selection(const BackendSelection& selection, NoBackend none) {
  const bool exec = exec_backend_name(selection.backend).has_value();
  if (selection.backend == "none" && none == NoBackend::kRefused) {
    return bad_input("--backend none", "a golden file holds a backend's outputs: name a backend");
  }
  if (!selection.backend_command.empty() && !exec) {
    return bad_input(
        "--backend-command",
        fmt::format("starts an exec:NAME backend; --backend is {}", selection.backend));
  }
  if (!selection.inject.empty() && exec) {
    return bad_input("--inject",
                     fmt::format("injections are for the built-in backends; {} is a program of "
                                 "its own: plant faults with its own options (the Python "
                                 "adapters: --fault, see python -m kvdump.backends NAME --help)",
                                 selection.backend));
  }
  if (selection.backend == "none" && !selection.inject.empty()) {
    return bad_input("--inject", "needs a backend (--backend none runs none)");
  }
  return check_cuda_variant_applies(selection.cuda, selection.backend);
}

Result<std::unique_ptr<Backend>> make_selected_backend(const BackendSelection& selection,
                                                       const DumpLayout& layout, int threads) {
  if (selection.backend == "none") return std::unique_ptr<Backend>();
  BackendOptions options;
  options.threads = threads;
  options.injection = selection.inject;
  options.reciprocal_scale = selection.reciprocal_scale;
  options.exec_command = selection.backend_command;
  options.dump = &layout;
  options.cuda_variant = selection.cuda.variant;
  return make_backend(selection.backend, options);
}

std::string backend_selection_arguments(const BackendSelection& selection, const char* separator) {
  std::string text;
  if (!selection.backend_command.empty()) {
    text +=
        fmt::format("{}--backend-command {}", separator, shell_quote(selection.backend_command));
  }
  if (!selection.inject.empty()) text += fmt::format("{}--inject {}", separator, selection.inject);
  if (selection.reciprocal_scale) text += fmt::format("{}--reciprocal-scale", separator);
  text += cuda_variant_arguments(selection.cuda.variant, separator);
  return text;
}

}  // namespace kvaudit
