// The exact MLA reference on a CUDA GPU (`kvaudit check --reference cuda`): the math, shapes and
// bound of mla_reference.hpp (<= 1e-15 relative on out, <= 1e-15 absolute on lse), evaluated by
// the kernels of mla_reference_cuda.cu with the double-double algorithms of double_double.hpp.
// Compiled only where KVAUDIT_HAVE_CUDA is defined; callers go through exact_reference_attention
// (mla_reference.hpp), which says why where it is not.
#pragma once

#include <array>
#include <string>

#include "references/reference_problem.hpp"
#include "src/core/device_seconds.hpp"
#include "src/core/result.hpp"

namespace kvaudit {

// Writes problem.out and problem.lse. An error when the device fails (no device, out of memory, a
// launch that fails): internal, named by `where`.
// Copies on problem.threads host threads (0: every core).
Status mla_reference_attention_cuda(const ReferenceProblem& problem, const std::string& where);

// The batches the GPU reference has run in this process, by how it computed their two sums
// (mla_reference_cuda.cu): score_batches[0] the compensated scores, [k] the exact sliced scores
// with k slices of q (k = 1 .. 4); value_batches[0] the compensated P.V, [k] the sliced P.V with
// k weight slices (k = 1 .. 5). Tests and benchmarks read it to know which kernels ran.
struct GpuReferenceKernels {
  std::array<long long, 5> score_batches{};
  std::array<long long, 6> value_batches{};
};
GpuReferenceKernels gpu_reference_kernels();

// Where the GPU reference's time went in this process so far, summed over every call (prepare:
// resolving the problem, gathering the visible KV rows, planning the tiles; upload; kernels;
// download: out and lse, copied out). All zero in a build without CUDA and before the first call;
// a run reads it before and after (DeviceSeconds' difference). Thread-safe.
DeviceSeconds gpu_reference_seconds();
void add_gpu_reference_seconds(const DeviceSeconds& part);

}  // namespace kvaudit
