// The fault variants of the attention kernels (AttentionFault, kernels/mla_attention/params.cuh):
// their instantiations live in this translation unit alone, so that the production launcher's
// object (kernels/mla_attention.cu) holds no fault code. kernels/mla_attention.cu calls
// launch_masked_nan_leak_attention for a problem with read_masked_tail (fault masked-nan-leak,
// src/backend/injection.hpp) with the grid and the kernel choice it made; the kernels here are the
// production ones with the fault's branches compiled in. scripts/check_fault_free_kernels.py reads
// the device code of both objects.
#include "kernels/mla_attention_launch.cuh"

namespace kvaudit::cuda::launch {

Status launch_masked_nan_leak_attention(PoolElement pool_element, int m_tiles,
                                        const detail::MlaAttentionParams& params, long long blocks,
                                        Decode16Kernel decode16, FourTilePath four_tile_path,
                                        cudaStream_t stream) {
  return launch_attention_blocks<detail::AttentionFault::kMaskedNanLeak>(
      pool_element, m_tiles, params, blocks, decode16, four_tile_path, stream);
}

}  // namespace kvaudit::cuda::launch
