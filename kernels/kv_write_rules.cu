// The KV write into an FP8 pool under a rule other than kvdump's: the --reciprocal-scale option
// (x * fp32(1 / kv_scale)) and the write faults (round-toward-zero, no-saturation, bf16-writeback,
// and neighbour-slot-write's slot offset; src/backend/injection.hpp). Their kernel instantiations
// (kv_write_fp8_kernel<rule, kWrapSlot = true>) live in this translation unit alone, so that the
// production launcher's object (kernels/mla_attention.cu, which writes with kvdump's rule only:
// kv_write_fp8_kernel<kDivide, false>) holds no write-fault code;
// scripts/check_fault_free_kernels.py reads the device code of the objects.
#include "kernels/mla_attention/kv_write.cuh"
#include "kernels/mla_attention_launch.cuh"

namespace kvaudit::cuda {

using namespace launch;  // kWhere, cuda_status, the grid-stride grid

Status launch_kv_write_rule(const std::uint16_t* new_kv, const std::int32_t* new_kv_slots,
                            int num_rows, int row_width, float kv_scale, std::uint8_t* pool,
                            std::int64_t num_slots, KvWriteRule rule, int slot_offset,
                            cudaStream_t stream) {
  if (num_rows <= 0 || row_width <= 0) return ok_status();
  if (num_slots <= 0) return internal_error(kWhere, "kv write into an empty pool");
  const long long blocks =
      elementwise_blocks(static_cast<long long>(num_rows) * row_width, kMaxWriteBlocks);
  const detail::KvWriteParams<std::uint8_t> params{new_kv,   new_kv_slots, num_rows,  row_width,
                                                   kv_scale, pool,         num_slots, slot_offset};
  dispatch_kv_write_rule(rule, [&](auto kind) {
    detail::kv_write_fp8_kernel<decltype(kind)::value, true>
        <<<static_cast<unsigned>(blocks), kElementwiseThreads, 0, stream>>>(params);
  });
  return cuda_status(cudaGetLastError(), "kv_write_rule kernel launch");
}

}  // namespace kvaudit::cuda
