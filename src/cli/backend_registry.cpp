// The backend registry (src/cli/backend_registry.hpp). The CPU model and exec backends build
// everywhere; the CUDA backends exist only in a build with KVAUDIT_HAVE_CUDA, and a build without
// them says so instead of pretending.
#include "src/cli/backend_registry.hpp"

#include <fmt/format.h>

#include <string>

#include "src/backend/exec_backend.hpp"
#include "src/backend/exec_session.hpp"
#include "src/backend/mla_attention_cpu.hpp"

#if defined(KVAUDIT_HAVE_CUDA) && __has_include("src/backend/mla_attention_cuda_backend.hpp")
#include "src/backend/mla_attention_cuda_backend.hpp"
#define KVAUDIT_HAVE_CUDA_BACKENDS 1
#endif

namespace kvaudit {

std::vector<std::string> backend_names() { return {"cpu-fp8", "cuda-fp8", "cuda-cast-bf16"}; }

std::optional<std::string_view> exec_backend_name(std::string_view backend) {
  if (backend.substr(0, kExecPrefix.size()) != kExecPrefix) return std::nullopt;
  return backend.substr(kExecPrefix.size());
}

Result<std::unique_ptr<Backend>> make_backend(std::string_view name,
                                              const BackendOptions& options) {
  if (const std::optional<std::string_view> exec_name = exec_backend_name(name)) {
    KVAUDIT_TRY(exec::check_exec_name(*exec_name, "--backend"));
    return make_exec_backend(*exec_name, options);
  }
  if (name == "cpu-fp8") return make_cpu_fp8_backend(options);
  if (name == "cuda-fp8" || name == "cuda-cast-bf16") {
#if defined(KVAUDIT_HAVE_CUDA_BACKENDS)
    return name == "cuda-fp8" ? cuda::make_cuda_fp8_backend(options)
                              : cuda::make_cuda_cast_bf16_backend(options);
#else
    return bad_input(fmt::format("--backend {}", name),
                     "kvaudit was built without CUDA (configure with -DKVAUDIT_CUDA=ON where nvcc "
                     "exists); use --backend cpu-fp8");
#endif
  }
  // "none" is valid too (check runs no backend for it, before asking here): list every name.
  return bad_input(
      fmt::format("--backend {}", name),
      fmt::format("unknown backend '{}' (valid: {}, none; exec:NAME runs a program speaking "
                  "the external backend protocol)",
                  name, fmt::join(backend_names(), ", ")));
}

}  // namespace kvaudit
