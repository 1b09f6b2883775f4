// The kernels of a bf16 pool: the write of bf16 bits (pool [S, D] bf16 bits, new_kv [num_rows, D])
// and the whole-pool cast of an FP8 pool (pool_bf16[e] = bf16(decode(pool[e])), the seed's bug
// kept for cuda-cast-bf16). Not templates: included by kernels/mla_attention.cu alone.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/fp8_e4m3_device.cuh"
#include "kernels/mla_attention/params.cuh"

namespace kvaudit::cuda::detail {

// pool[slots[i], c] = new_kv[i, c]: a bf16 pool stores the bf16 bits unchanged.
__global__ void kv_write_bf16_kernel(const __grid_constant__ KvWriteParams<std::uint16_t> p) {
  const std::int64_t total = static_cast<std::int64_t>(p.num_rows) * p.row_width;
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t row = e / p.row_width;
    const int col = static_cast<int>(e - row * p.row_width);
    p.pool[static_cast<std::int64_t>(__ldg(p.slots + row)) * p.row_width + col] =
        __ldg(p.new_kv + e);
  }
}

// pool_bf16[e] = bf16(decode(pool[e])), every element of the pool (the whole-pool cast).
__global__ void cast_pool_kernel(const __grid_constant__ CastPoolParams p) {
  const std::int64_t vectors = p.num_elements / 4;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t v = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       v < vectors; v += stride) {
    const std::uint32_t codes = __ldg(reinterpret_cast<const std::uint32_t*>(p.pool) + v);
    const uint2 r = e4m3x4_to_bf16x4(codes);
    reinterpret_cast<uint2*>(p.pool_bf16)[v] = make_uint2(r.x, r.y);
  }
  for (std::int64_t e =
           vectors * 4 + blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       e < p.num_elements; e += stride) {
    p.pool_bf16[e] = static_cast<std::uint16_t>(e4m3x2_to_bf16x2(__ldg(p.pool + e)) & 0xFFFF);
  }
}

}  // namespace kvaudit::cuda::detail
