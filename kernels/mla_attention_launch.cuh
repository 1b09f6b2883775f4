// Host-side launch pieces shared by the production launcher (kernels/mla_attention.cu) and the
// fault variants of the attention kernels (kernels/mla_attention_faults.cu): the runtime ->
// compile-time dispatch and the launch of one kernel instantiation, each a template on the
// AttentionFault variant (kernels/mla_attention/params.cuh), so that each translation unit
// instantiates only its own kernels. Grid shapes and the choice of kernel stay in
// kernels/mla_attention.cu.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "kernels/mla_attention/kernel.cuh"
#include "kernels/mla_attention_cuda.hpp"
#include "kernels/mla_decode_registers.cuh"
#include "src/core/result.hpp"

namespace kvaudit::cuda::launch {

inline constexpr const char* kWhere = "cuda mla_attention";

inline Status cuda_status(cudaError_t status, const char* what) {
  if (status == cudaSuccess) return ok_status();
  return internal_error(kWhere, std::string(what) + ": " + cudaGetErrorString(status));
}

// ---- runtime -> compile-time dispatch, one axis at a time (FlashInfer DISPATCH_*) -------------
// Each calls `launch` with the axis' value as a compile-time constant; a value without a kernel
// is `unsupported`, never a launch of the wrong instantiation.

// Pool element: the FP8 pool read directly, or a bf16 pool (cuda-cast-bf16, fp8-read-as-bf16).
template <typename Launch>
Status dispatch_pool_element(PoolElement element, Launch&& launch) {
  switch (element) {
    case PoolElement::kFp8E4m3:
      return launch(std::bool_constant<false>{});
    case PoolElement::kBf16:
      return launch(std::bool_constant<true>{});
  }
  return unsupported(kWhere,
                     "no kernel for pool element " + std::to_string(static_cast<int>(element)));
}

// m16 tiles of (row, head) pairs per block: 1, 2 or 4.
template <typename Launch>
Status dispatch_m_tiles(int m_tiles, Launch&& launch) {
  switch (m_tiles) {
    case 1:
      return launch(std::integral_constant<int, 1>{});
    case 2:
      return launch(std::integral_constant<int, 2>{});
    case 4:
      return launch(std::integral_constant<int, 4>{});
    default:
      return unsupported(kWhere,
                         "no kernel for " + std::to_string(m_tiles) + " m16 tiles per block");
  }
}

// ---- launches ----------------------------------------------------------------------------------

// The shared-memory opt-in of one instantiation, with the device's limit checked first: sm_89 and
// sm_120 allow 99 KiB per block, less than a tile needs, which is unsupported rather than an
// internal error (the H100/H200/B200 class allows 227 KiB).
template <int kMTiles, bool kBf16Pool, detail::MmaPath kPath, detail::AttentionFault kFault>
Status configure_attention_kernel() {
  using Layout = detail::MlaSmemLayout<kMTiles, kBf16Pool, kPath>;
  constexpr int kBytes = Layout::kBytes + detail::kSmemAlignSlack<kPath>;
  int device = 0;
  int max_shared = 0;
  KVAUDIT_TRY(cuda_status(cudaGetDevice(&device), "cudaGetDevice"));
  KVAUDIT_TRY(cuda_status(
      cudaDeviceGetAttribute(&max_shared, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
      "cudaDeviceGetAttribute"));
  if (static_cast<long long>(max_shared) < static_cast<long long>(kBytes)) {
    return unsupported("launch_mla_attention",
                       "the kernel needs " + std::to_string(kBytes) +
                           " bytes of shared memory per block; this GPU allows " +
                           std::to_string(max_shared));
  }
  return cuda_status(
      cudaFuncSetAttribute(detail::mla_attention_kernel<kMTiles, kBf16Pool, kPath, kFault>,
                           cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes),
      "cudaFuncSetAttribute");
}

template <int kMTiles, bool kBf16Pool, detail::MmaPath kPath, detail::AttentionFault kFault>
Status launch_attention_kernel(const detail::MlaAttentionParams& params, long long blocks,
                               cudaStream_t stream) {
  using Layout = detail::MlaSmemLayout<kMTiles, kBf16Pool, kPath>;
  // Once per process (kvaudit uses device 0 only), not on every launch: the bench times launches.
  static const Status configured = configure_attention_kernel<kMTiles, kBf16Pool, kPath, kFault>();
  if (!configured.ok()) return configured.error();
  detail::mla_attention_kernel<kMTiles, kBf16Pool, kPath, kFault>
      <<<static_cast<unsigned>(blocks), detail::kThreads,
         Layout::kBytes + detail::kSmemAlignSlack<kPath>, stream>>>(params);
  return cuda_status(cudaGetLastError(), "mla_attention_kernel launch");
}

template <bool kBf16Pool, detail::AttentionFault kFault>
Status launch_decode_registers_kernel(const detail::MlaAttentionParams& params, long long blocks,
                                      cudaStream_t stream) {
  detail::mla_decode_registers_kernel<kBf16Pool, kFault>
      <<<static_cast<unsigned>(blocks), detail::kThreads, detail::RegisterTileLayout::kBytes,
         stream>>>(params);
  return cuda_status(cudaGetLastError(), "mla_decode_registers_kernel launch");
}

// One m16 tile takes the register-tile kernel where decode16 says so, four m16 tiles wgmma where
// four_tile_path (the launcher's four_tile_mma_path, asked only for them) says so; both pool
// elements alike, so that cuda-cast-bf16 keeps running cuda-fp8's tiling and arithmetic.
using FourTilePath = detail::MmaPath (*)();

template <int kMTiles, bool kBf16Pool, detail::AttentionFault kFault>
Status launch_attention_kernel_on_path(const detail::MlaAttentionParams& params, long long blocks,
                                       Decode16Kernel decode16, FourTilePath four_tile_path,
                                       cudaStream_t stream) {
  if constexpr (kMTiles == 1) {
    if (decode16 == Decode16Kernel::kRegisterTile) {
      return launch_decode_registers_kernel<kBf16Pool, kFault>(params, blocks, stream);
    }
  }
  if constexpr (kMTiles == 4) {
    if (four_tile_path() == detail::MmaPath::kWgmma) {
      return launch_attention_kernel<kMTiles, kBf16Pool, detail::MmaPath::kWgmma, kFault>(
          params, blocks, stream);
    }
  }
  return launch_attention_kernel<kMTiles, kBf16Pool, detail::MmaPath::kMmaSync, kFault>(
      params, blocks, stream);
}

// The attention grid of one fault variant: the runtime axes (pool element, m16 tiles) dispatched
// to the instantiation that serves them.
template <detail::AttentionFault kFault>
Status launch_attention_blocks(PoolElement pool_element, int m_tiles,
                               const detail::MlaAttentionParams& params, long long blocks,
                               Decode16Kernel decode16, FourTilePath four_tile_path,
                               cudaStream_t stream) {
  return dispatch_pool_element(pool_element, [&](auto bf16_pool) {
    return dispatch_m_tiles(m_tiles, [&](auto m_tiles_constant) {
      return launch_attention_kernel_on_path<decltype(m_tiles_constant)::value,
                                             decltype(bf16_pool)::value, kFault>(
          params, blocks, decode16, four_tile_path, stream);
    });
  });
}

// launch_attention_blocks<AttentionFault::kMaskedNanLeak>, instantiated in
// kernels/mla_attention_faults.cu alone: the production launcher's object holds no fault kernel.
Status launch_masked_nan_leak_attention(PoolElement pool_element, int m_tiles,
                                        const detail::MlaAttentionParams& params, long long blocks,
                                        Decode16Kernel decode16, FourTilePath four_tile_path,
                                        cudaStream_t stream);

// The grid-stride kernels (KV write, pool cast): 256 threads per block, grids capped at 65,535
// blocks (write) and 16 blocks per SM of an H100/H200 (cast).
inline constexpr int kElementwiseThreads = 256;
inline constexpr long long kMaxWriteBlocks = 65535;
inline constexpr long long kMaxCastBlocks = 132LL * 16;

inline long long elementwise_blocks(long long elements, long long max_blocks) {
  return std::min<long long>((elements + kElementwiseThreads - 1) / kElementwiseThreads,
                             max_blocks);
}

}  // namespace kvaudit::cuda::launch
