// Inline-PTX wrappers of the sm_80+ instructions the CUDA kernels use (sm_90 is the target): one
// function per instruction, named after it, so that the kernels read as the algorithm and every
// asm statement sits in one place (CUTLASS arch/, FlashInfer mma.cuh / cp_async.cuh). Device code
// only; includable from any .cu file without defining kernels.
//
// Fragment layouts are PTX's ("Matrix Fragments for mma.m16n8k16"): for m16n8k16 with bf16
// operands, a thread (lane = 4 * group + quad) holds
//   A (16 x 16, row-major) : 4 registers of bf16x2, rows group / group + 8, columns 2 quad + {0, 1}
//                            of k 0-7 and k 8-15
//   B (16 x 8, column-major): 2 registers of bf16x2, k 2 quad + {0, 1} of k 0-7 and k 8-15,
//                            column group
//   C/D (16 x 8, fp32)      : 4 floats, rows group (d[0], d[1]) and group + 8 (d[2], d[3]),
//                            columns 2 quad + {0, 1}
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace kvaudit::cuda::ptx {

// cvta.to.shared: the 32-bit shared-window address of a generic pointer into shared memory (the
// operand form cp.async and ldmatrix take).
__device__ __forceinline__ std::uint32_t smem_address(const void* pointer) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(pointer));
}

// ---- asynchronous copies (global -> shared, bypassing registers) ------------------------------

// cp.async.cg.shared.global: copy 16 bytes from global `src` to shared `dst` without going
// through registers; .cg caches the line in L2 only (each KV row is read once per block).
__device__ __forceinline__ void cp_async_cg_16(std::uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}

// cp.async.commit_group: close the group of this thread's cp.async issued since the last commit.
__device__ __forceinline__ void cp_async_commit_group() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// cp.async.wait_group N: wait until at most kPending of this thread's committed groups are still
// in flight (0: all of them landed). Other threads' copies need a barrier after it.
template <int kPending>
__device__ __forceinline__ void cp_async_wait_group() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// ---- shared memory -> mma fragments -----------------------------------------------------------

// ldmatrix.sync.aligned.m8n8.x4.shared.b16: four 8x8 b16 matrices from shared memory into
// fragments; lanes 8i .. 8i + 7 give the row addresses of matrix i, and register r[i] of lane
// 4 * row + c receives elements (row, 2c) and (row, 2c + 1) of matrix i.
__device__ __forceinline__ void ldmatrix_m8n8_x4(std::uint32_t (&r)[4], std::uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// ldmatrix...x4.trans: the same with each 8x8 matrix transposed on the way (a row-major [k, n]
// tile in shared memory becomes the column-major B operand of mma).
__device__ __forceinline__ void ldmatrix_m8n8_x4_trans(std::uint32_t (&r)[4],
                                                       std::uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// ---- tensor cores ------------------------------------------------------------------------------

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32: d += a * b on a 16x8x16 tile, bf16
// operands (products exact in fp32), fp32 accumulation in the tensor core's own order.
__device__ __forceinline__ void mma_m16n8k16_bf16_f32(float (&d)[4], const std::uint32_t (&a)[4],
                                                      std::uint32_t b0, std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- conversions -------------------------------------------------------------------------------

// cvt.rn.bf16x2.f32: two fp32 -> two bf16, round to nearest even (NaN stays NaN); `lo` goes to
// the low half (the first element in memory). PTX names the high source first.
__device__ __forceinline__ std::uint32_t cvt_rn_bf16x2_f32(float lo, float hi) {
  std::uint32_t out;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(out) : "f"(hi), "f"(lo));
  return out;
}

// cvt.rn.f16x2.e4m3x2: two e4m3 codes (low byte first) -> two f16 (low half first); exact, every
// e4m3 value is an f16 value, NaN codes give NaN (sm_89+).
__device__ __forceinline__ std::uint32_t cvt_rn_f16x2_e4m3x2(std::uint16_t codes) {
  std::uint32_t halves;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(halves) : "h"(codes));
  return halves;
}

// mov.b32 {l, h} + cvt.f32.f16: unpack an f16x2 register into two fp32 (exact widening).
__device__ __forceinline__ void cvt_f32_f16x2(std::uint32_t halves, float& lo, float& hi) {
  asm("{ .reg .f16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;\n}\n"
      : "=f"(lo), "=f"(hi)
      : "r"(halves));
}

// ---- programmatic dependent launch (sm_90) ----------------------------------------------------

// griddepcontrol.wait: in a grid launched as a programmatic dependent, wait until the primary
// grid has completed and its memory operations are visible. No-op below sm_90 (and in a grid
// launched without the dependency).
__device__ __forceinline__ void griddepcontrol_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// griddepcontrol.launch_dependents: this block no longer holds back the launch of the dependent
// grid (it launches once every block of this grid has signalled or exited).
__device__ __forceinline__ void griddepcontrol_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

}  // namespace kvaudit::cuda::ptx
