// The KV write into an FP8 pool: pool[slot_i, c] = kv_write_code<kRule>(new_kv[i, :], c), new_kv
// [num_rows, D] bf16 bits, pool [S, D] e4m3 codes. Templates only, so that a translation unit
// instantiates just the rules it launches (kernels/mla_attention.cu kvdump's rule,
// kernels/kv_write_rules.cu the others); the bf16 pool's kernels are in bf16_pool.cuh.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/fp8_e4m3_device.cuh"
#include "kernels/kv_write_rules.hpp"
#include "kernels/mla_attention/params.cuh"

namespace kvaudit::cuda::detail {

// The elementwise kernels read their inputs through __ldg (ld.global.nc): the inputs are read-only
// for the kernel's lifetime, which a params struct cannot state with __restrict__.

// One new_kv row as the shared write rules read it (kv_write_code, kernels/kv_write_rules.hpp):
// bf16 bits in device memory, widened exactly to fp32.
struct Bf16RowView {
  const std::uint16_t* bits;

  __device__ __forceinline__ float value(int col) const {
    return __uint_as_float(static_cast<std::uint32_t>(__ldg(bits + col)) << 16);
  }
  __device__ __forceinline__ std::uint16_t bf16_bits(int col) const { return __ldg(bits + col); }
};

// pool[slot_i, c] = kv_write_code<kRule>(new_kv[i, :], c), slot_i = slots[i], or with kWrapSlot
// (slots[i] + slot_offset) mod num_slots: the kvdump rule (kDivide, what launch_kv_write runs),
// the --reciprocal-scale option and the write faults, each case written once in
// kernels/kv_write_rules.hpp for this kernel and the CPU model.
template <KvWriteRule kRule, bool kWrapSlot>
__global__ void kv_write_fp8_kernel(const __grid_constant__ KvWriteParams<std::uint8_t> p) {
  const std::int64_t total = static_cast<std::int64_t>(p.num_rows) * p.row_width;
  for (std::int64_t e = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t row = e / p.row_width;
    const int col = static_cast<int>(e - row * p.row_width);
    const Bf16RowView new_row{p.new_kv + row * p.row_width};
    const std::uint8_t code = kv_write_code<kRule, DeviceE4m3Rounding>(new_row, col, p.kv_scale);
    std::int64_t slot = __ldg(p.slots + row);
    if constexpr (kWrapSlot) slot = (slot + p.slot_offset) % p.num_slots;
    p.pool[slot * p.row_width + col] = code;
  }
}

}  // namespace kvaudit::cuda::detail
