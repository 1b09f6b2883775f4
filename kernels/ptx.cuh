// Inline-PTX wrappers of the sm_80+ instructions the CUDA kernels use (sm_90a is the target, whose
// wgmma the 64-row attention blocks use; everything else runs on sm_89+): one
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

// mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32: the k8 shape (a: 2 registers, rows group
// and group + 8, columns 2 quad + {0, 1}; b: 1 register, k 2 quad + {0, 1} of column group).
__device__ __forceinline__ void mma_m16n8k8_bf16_f32(float (&d)[4], std::uint32_t a0,
                                                     std::uint32_t a1, std::uint32_t b0) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(b0));
}

// movmatrix.sync.aligned.m8n8.trans.b16: transposes an 8x8 b16 matrix held by the warp in the
// fragment layout (lane 4 row + c holds elements (row, 2c) and (row, 2c + 1)) without shared
// memory: lane 4 r + c receives elements (2c, r) and (2c + 1, r) of the source (sm_75+).
__device__ __forceinline__ std::uint32_t movmatrix_m8n8_trans(std::uint32_t fragment) {
  std::uint32_t transposed;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n"
               : "=r"(transposed)
               : "r"(fragment));
  return transposed;
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

// The same for four codes: the low and the high code pair of `codes` into two f16x2, each half
// taken as a 16-bit operand of the 32-bit register (so no shift extracts the high pair).
__device__ __forceinline__ void cvt_rn_f16x2_e4m3x4(std::uint32_t codes, std::uint32_t& lo,
                                                    std::uint32_t& hi) {
  asm("{ .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n"
      " cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(codes));
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

// ---- warpgroup tensor cores (sm_90a) -----------------------------------------------------------
// wgmma.mma_async exists on sm_90a only (compiled where __CUDA_ARCH_FEAT_SM90_ALL is defined; the
// other targets get a trap, and the launcher runs wgmma_probe_kernel (kernels/mla_attention.cuh)
// once before it picks a kernel that uses them). A warpgroup (4 consecutive warps, 128 threads)
// issues each one together. Accumulator layout of m64nNk16 with fp32 D: warp w of the group holds
// rows 16 w .. 16 w + 15, and its registers d[j][0..3] are the mma.m16n8 C fragment of columns 8 j
// .. 8 j + 7 (rows group / group + 8, columns 2 quad + {0, 1}), as above.
//
// Shared-memory operands are described by a 64-bit matrix descriptor (PTX "Matrix Descriptor
// Format"): start address, leading and stride byte offsets (all >> 4), and the swizzle mode. The
// kernels use the 128-byte swizzle only: rows of 128 bytes (64 bf16) in 1024-byte atoms of 8 rows
// whose 16-byte chunk c of row r sits at chunk c ^ (r % 8); atoms must start 1024-byte aligned.
//   K-major operand (rows M or N, 64 k per 128-byte row): stride byte offset = the distance of
//     8-row groups (1024 for dense atoms); the leading offset is unused. A k16 step inside the
//     row is the start address plus 32 bytes.
//   MN-major operand (rows k, 64 MN elements per 128-byte row): leading byte offset = the distance
//     of 64-element MN blocks, stride byte offset = the distance of 8-row k groups.
__device__ __forceinline__ std::uint64_t wgmma_sw128_descriptor(std::uint32_t smem_address,
                                                                std::uint32_t leading_bytes,
                                                                std::uint32_t stride_bytes) {
  constexpr std::uint64_t kSwizzle128B = 1;
  return static_cast<std::uint64_t>((smem_address >> 4) & 0x3FFF) |
         (static_cast<std::uint64_t>((leading_bytes >> 4) & 0x3FFF) << 16) |
         (static_cast<std::uint64_t>((stride_bytes >> 4) & 0x3FFF) << 32) | (kSwizzle128B << 62);
}

// fence.proxy.async.shared::cta: this thread's shared-memory writes (generic proxy) become visible
// to the async proxy, which wgmma reads its shared operands through; a barrier then publishes them
// to the warpgroups.
__device__ __forceinline__ void fence_proxy_async_shared() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// wgmma.fence: orders this thread's register accesses to accumulators before the wgmma that
// follow (needed before the first wgmma and whenever the registers were touched in between).
__device__ __forceinline__ void wgmma_fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

// wgmma.commit_group: close the group of wgmma issued since the last commit.
__device__ __forceinline__ void wgmma_commit_group() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

// wgmma.wait_group N: wait until at most kPending committed groups are in flight; the accumulators
// of the finished ones may then be read.
template <int kPending>
__device__ __forceinline__ void wgmma_wait_group() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
#endif
}

// wgmma.mma_async.m64n64k16.f32.bf16.bf16, both operands K-major in shared memory: d = a * b + d
// (accumulate) or a * b (!accumulate), a 64 x 16, b 16 x 64.
__device__ __forceinline__ void wgmma_m64n64k16_bf16_f32(float (&d)[8][4], std::uint64_t a_desc,
                                                         std::uint64_t b_desc, bool accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred keep;\nsetp.ne.b32 keep, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
      "}, %32, %33, keep, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),
        "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]),
        "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]),
        "+f"(d[7][2]), "+f"(d[7][3])
      : "l"(a_desc), "l"(b_desc), "r"(static_cast<int>(accumulate)));
#else
  __trap();
#endif
}

// wgmma.mma_async.m64n256k16.f32.bf16.bf16, a K-major, b MN-major (imm-trans-b = 1) in shared
// memory: d += a * b, a 64 x 16, b 16 x 256.
__device__ __forceinline__ void wgmma_m64n256k16_bf16_f32_b_mn(float (&d)[32][4],
                                                               std::uint64_t a_desc,
                                                               std::uint64_t b_desc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred keep;\nsetp.ne.b32 keep, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, "
      "%127"
      "}, %128, %129, keep, 1, 1, 0, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),
        "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
        "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]),
        "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]),
        "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]),
        "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]),
        "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]),
        "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]),
        "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]),
        "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]),
        "+f"(d[15][2]), "+f"(d[15][3]), "+f"(d[16][0]), "+f"(d[16][1]), "+f"(d[16][2]),
        "+f"(d[16][3]), "+f"(d[17][0]), "+f"(d[17][1]), "+f"(d[17][2]), "+f"(d[17][3]),
        "+f"(d[18][0]), "+f"(d[18][1]), "+f"(d[18][2]), "+f"(d[18][3]), "+f"(d[19][0]),
        "+f"(d[19][1]), "+f"(d[19][2]), "+f"(d[19][3]), "+f"(d[20][0]), "+f"(d[20][1]),
        "+f"(d[20][2]), "+f"(d[20][3]), "+f"(d[21][0]), "+f"(d[21][1]), "+f"(d[21][2]),
        "+f"(d[21][3]), "+f"(d[22][0]), "+f"(d[22][1]), "+f"(d[22][2]), "+f"(d[22][3]),
        "+f"(d[23][0]), "+f"(d[23][1]), "+f"(d[23][2]), "+f"(d[23][3]), "+f"(d[24][0]),
        "+f"(d[24][1]), "+f"(d[24][2]), "+f"(d[24][3]), "+f"(d[25][0]), "+f"(d[25][1]),
        "+f"(d[25][2]), "+f"(d[25][3]), "+f"(d[26][0]), "+f"(d[26][1]), "+f"(d[26][2]),
        "+f"(d[26][3]), "+f"(d[27][0]), "+f"(d[27][1]), "+f"(d[27][2]), "+f"(d[27][3]),
        "+f"(d[28][0]), "+f"(d[28][1]), "+f"(d[28][2]), "+f"(d[28][3]), "+f"(d[29][0]),
        "+f"(d[29][1]), "+f"(d[29][2]), "+f"(d[29][3]), "+f"(d[30][0]), "+f"(d[30][1]),
        "+f"(d[30][2]), "+f"(d[30][3]), "+f"(d[31][0]), "+f"(d[31][1]), "+f"(d[31][2]),
        "+f"(d[31][3])
      : "l"(a_desc), "l"(b_desc), "r"(1));
#else
  __trap();
#endif
}

}  // namespace kvaudit::cuda::ptx
