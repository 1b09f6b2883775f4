// The kernel variant of the CUDA MLA attention launcher: which of several kernels that compute
// the same attention runs. The launcher's choice is a pure function of (problem, device, variant),
// made in one place (kernels/mla_attention.cu, "Kernel variant"); the command line chooses the
// variant once (src/backend/cuda_kernel_variant.hpp: names, parsing, the JSON every report and
// golden file records).
//
// What each choice changes in the results:
//   host_plan, longest_first  nothing: the same kernels run the same sums (bit-identical);
//   mma, decode16             the summation order of the same products (another kernel): results
//                             agree within the kernel error bound, not bit for bit.
// The defaults are what runs in production; the other values exist for A/B measurements and for
// bisecting a doubt about one path.
#pragma once

#include <cstdint>

namespace kvaudit {

// The tensor-core instructions of the 64-row blocks (decode above 32 heads, prefill and extend).
enum class MmaChoice : std::uint8_t {
  kAuto,     // wgmma where the binary has sm_90a code and the device runs it, else mma.sync
  kMmaSync,  // mma.sync everywhere
};

// The kernel of the 16-head decode blocks (at most 16 heads, one row per request).
enum class Decode16Choice : std::uint8_t {
  kAuto,        // the KV tile in registers when a split streams >= 8 tiles, else shared memory
  kSharedTile,  // always the shared-memory tile (mla_attention_kernel<1>)
  kRegisters,   // always the register tile (mla_decode_registers_kernel)
};

struct CudaKernelVariant {
  MmaChoice mma = MmaChoice::kAuto;
  Decode16Choice decode16 = Decode16Choice::kAuto;
  bool host_plan = true;      // locate the rows of a problem of at most 16 rows on the host
  bool longest_first = true;  // prefill and extend: start the longest row groups first

  bool operator==(const CudaKernelVariant&) const = default;
};

// The instructions the 64-row blocks actually run (MmaChoice resolved on a device).
enum class TensorCorePath : std::uint8_t { kMmaSync, kWgmma };

}  // namespace kvaudit
