// The `cuda-fp8` and `cuda-cast-bf16` backends (src/backend/backend.hpp) on the CUDA MLA attention
// family (kernels/mla_attention_cuda.hpp): the adaptation of a dump's (step, layer) to the
// launcher, in src/backend/mla_attention_cuda_backend.cu.
#pragma once

#include <cstddef>
#include <memory>
#include <optional>

#include "src/backend/backend.hpp"
#include "src/core/result.hpp"

namespace kvaudit::cuda {

// Backends for `kvaudit check` (src/cli/backend_registry.cpp dispatches to these).
Result<std::unique_ptr<Backend>> make_cuda_fp8_backend(const BackendOptions& options);
Result<std::unique_ptr<Backend>> make_cuda_cast_bf16_backend(const BackendOptions& options);

// Device bytes a cuda-* backend holds, by role: the FP8 (or bf16) pool it attends on, a bf16 copy
// of the whole pool (cuda-cast-bf16 only), and everything else (indices, q, new_kv, out/lse,
// split-KV workspace: sized by the step, never by the pool). nullopt for other backends.
struct CudaBackendAllocations {
  std::size_t pool_bytes = 0;
  std::size_t pool_bf16_bytes = 0;
  std::size_t other_bytes = 0;
};
std::optional<CudaBackendAllocations> cuda_backend_allocations(const Backend& backend);

}  // namespace kvaudit::cuda
