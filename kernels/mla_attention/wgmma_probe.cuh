// The probe the launcher runs once to learn whether this binary has sm_90a (wgmma) code for the
// running GPU (four_tile_mma_path, kernels/mla_attention.cu).
#pragma once

#include <cuda_runtime.h>

namespace kvaudit::cuda::detail {

// One thread writes 1 where this binary's code for the running GPU has wgmma (sm_90a code on an
// sm_90 device), else 0: the launcher asks once before it picks MmaPath::kWgmma.
__global__ void wgmma_probe_kernel(int* has_wgmma) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  *has_wgmma = 1;
#else
  *has_wgmma = 0;
#endif
}

}  // namespace kvaudit::cuda::detail
