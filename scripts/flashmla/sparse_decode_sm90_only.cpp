// Minimal Python binding for FlashMLA's sparse FP8 decode kernel, sm90a only.
// Not part of FlashMLA: written for this project so that only the sm90 sparse
// decode kernels (+ the scheduler-metadata and combine kernels) need compiling.
//
// It reuses FlashMLA's own host-side dispatcher, csrc/api/sparse_decode.h,
// unchanged.  That header also references the sm100 kernels (and, through the
// sm90 dispatcher, the MODEL1 instantiations); they are not compiled here, so
// they are given explicit specializations below that raise a clear error.
// Explicit specializations must be declared before the header uses them, hence
// the include order.

#include <torch/extension.h>

#include "params.h"
#include "sm100/decode/head64/kernel.h"
#include "sm100/prefill/sparse/fwd_for_small_topk/head128/phase1.h"
#include "sm90/decode/sparse_fp8/splitkv_mla.h"

namespace sm100::decode::head64 {
template <>
void run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::V32>(const SparseAttnDecodeParams&) {
  TORCH_CHECK(false, "[flashmla-sm90-only] sm100 kernels were not built");
}
template <>
void run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::MODEL1>(const SparseAttnDecodeParams&) {
  TORCH_CHECK(false, "[flashmla-sm90-only] sm100 kernels were not built");
}
}  // namespace sm100::decode::head64

namespace sm100::fwd_for_small_topk::head128 {
template <>
void run_fwd_for_small_topk_phase1_kernel<SparseAttnFwdMode::DecodeWithSplitKV, 512>(
    const SparseAttnDecodeParams&) {
  TORCH_CHECK(false, "[flashmla-sm90-only] sm100 kernels were not built");
}
}  // namespace sm100::fwd_for_small_topk::head128

#ifndef FLASHMLA_WITH_MODEL1
// MODEL1 (d_qk = 512, 584-byte layout) instantiations are only compiled when
// build.sh is run with FLASHMLA_WITH_MODEL1=1 (which also defines this macro).
namespace sm90::decode::sparse_fp8 {
template <>
void run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::MODEL1, 64>(const SparseAttnDecodeParams&) {
  TORCH_CHECK(false,
              "[flashmla-sm90-only] MODEL1 (d_qk=512) kernels were not built; rebuild with "
              "FLASHMLA_WITH_MODEL1=1");
}
template <>
void run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::MODEL1, 128>(
    const SparseAttnDecodeParams&) {
  TORCH_CHECK(false,
              "[flashmla-sm90-only] MODEL1 (d_qk=512) kernels were not built; rebuild with "
              "FLASHMLA_WITH_MODEL1=1");
}
}  // namespace sm90::decode::sparse_fp8
#endif

#include "api/sparse_decode.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "FlashMLA sparse FP8 decode (sm90a only subset)";
  // Same signature and return as FlashMLA's flash_mla.cuda.sparse_decode_fwd:
  // (q, k_cache, indices, topk_length, attn_sink, tile_scheduler_metadata,
  //  num_splits, extra_k_cache, extra_indices, extra_topk_length, d_v, sm_scale)
  //  -> (out, lse, tile_scheduler_metadata, num_splits)
  m.def("sparse_decode_fwd", &sparse_attn_decode_interface);
}
