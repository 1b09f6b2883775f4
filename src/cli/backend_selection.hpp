// The backend a command runs, chosen on its command line: --backend NAME, --backend-command CMD
// (exec:NAME), --inject FAULT (built-in backends), --reciprocal-scale and the --cuda-* kernel
// variant. `check`, `golden record` and `golden check` take the same options through this one
// place, so a backend `check` can judge can also be pinned in a golden file (an exec backend
// included: its program is started with the dump's model, as `check` starts it).
#pragma once

#include <CLI/CLI.hpp>
#include <memory>
#include <string>

#include "src/backend/backend.hpp"
#include "src/cli/cli.hpp"
#include "src/core/result.hpp"
#include "src/format/kvdump.hpp"

namespace kvaudit {

struct BackendSelection {
  std::string backend = "cpu-fp8";
  std::string backend_command;  // exec:NAME: the command that starts the program
  std::string inject;           // a built-in backend's fault injection
  bool reciprocal_scale = false;
  CudaVariantOptions cuda;  // --cuda-* (cuda-fp8 and cuda-cast-bf16 only)
};

// Whether --backend none (compare the captured outputs only) is offered: `check` has it, a golden
// file holds a backend's outputs and needs one.
enum class NoBackend : std::uint8_t { kAllowed, kRefused };

// --backend, --backend-command, --inject, --reciprocal-scale and the --cuda-* options.
void add_backend_selection_options(CLI::App& cmd, BackendSelection& selection, NoBackend none);

// The options agree with each other: --backend-command only with exec:NAME, --inject only with a
// built-in backend, the --cuda-* options only with a CUDA backend, no backend where one is needed.
// Bad input naming the option otherwise.
Status check_backend_selection(const BackendSelection& selection, NoBackend none);

// The backend, for replaying the dump of `layout` with `threads` threads; none for --backend
// none. An exec backend's program is started here and greeted with the dump's model.
Result<std::unique_ptr<Backend>> make_selected_backend(const BackendSelection& selection,
                                                       const DumpLayout& layout, int threads);

// The options that repeat the selection beyond --backend, each preceded by `separator`:
// " --backend-command CMD --inject NAME --reciprocal-scale --cuda-mma mma-sync", as given.
std::string backend_selection_arguments(const BackendSelection& selection, const char* separator);

}  // namespace kvaudit
