// Device-side FP8 e4m3 conversions shared by the CUDA kernels (kernels/mla_attention.cuh) and the
// [gpu] codec test (tests/core/test_fp8_e4m3_cuda.cu), which compares them with the host codec in
// src/core/fp8_e4m3.hpp code for code. Declarations only of inline device functions: includable
// from any .cu file without defining kernels.
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/ptx.cuh"

namespace kvaudit::cuda::detail {

// The kvdump write rule on the device: e4m3_rne_satfinite(value / kv_scale), one IEEE fp32
// division (__fdiv_rn, whatever -prec-div says), then cvt.rn.satfinite.e4m3x2.f32 (NaN -> 0x7F),
// as the host's kvdump_quantize (tests/core/test_fp8_e4m3_cuda.cu compares the two).
__device__ __forceinline__ std::uint8_t kvdump_quantize_device(float value, float kv_scale) {
  return __nv_cvt_float_to_fp8(__fdiv_rn(value, kv_scale), __NV_SATFINITE, __NV_E4M3);
}

// The harness's named --reciprocal-scale option on the device: value * fp32(1 / kv_scale) (IEEE
// division for the reciprocal, then one fp32 product), then the same satfinite conversion, as the
// host's kvdump_quantize_reciprocal.
__device__ __forceinline__ std::uint8_t kvdump_quantize_reciprocal_device(float value,
                                                                          float kv_scale) {
  return __nv_cvt_float_to_fp8(value * __fdiv_rn(1.0f, kv_scale), __NV_SATFINITE, __NV_E4M3);
}

// The two kvdump roundings for the write rules shared with the host (kv_write_code in
// kernels/kv_write_rules.hpp): the device's cvt.rn.satfinite.e4m3x2.f32 where the host uses the
// software codec (HostE4m3Rounding); tests/core/test_fp8_e4m3_cuda.cu shows they agree.
struct DeviceE4m3Rounding {
  __device__ __forceinline__ static std::uint8_t divide(float value, float kv_scale) {
    return kvdump_quantize_device(value, kv_scale);
  }
  __device__ __forceinline__ static std::uint8_t reciprocal(float value, float kv_scale) {
    return kvdump_quantize_reciprocal_device(value, kv_scale);
  }
};

// Two f16 (an f16x2 register, low half first) holding e4m3 values -> the same two values as bf16:
// f16 -> f32 is exact and every e4m3 value is a bf16 value, so the rounding to bf16 is exact.
__device__ __forceinline__ std::uint32_t f16x2_to_bf16x2(std::uint32_t halves) {
  float lo, hi;
  ptx::cvt_f32_f16x2(halves, lo, hi);
  return ptx::cvt_rn_bf16x2_f32(lo, hi);
}

// Two e4m3 codes (low byte first) -> two bf16 (low half first), exactly: e4m3 -> f16 is exact
// (cvt.rn.f16x2.e4m3x2), then f16x2_to_bf16x2. NaN codes stay NaN.
__device__ __forceinline__ std::uint32_t e4m3x2_to_bf16x2(std::uint16_t codes) {
  return f16x2_to_bf16x2(ptx::cvt_rn_f16x2_e4m3x2(codes));
}

// Four codes (byte n = code n) -> two bf16x2 (codes 0, 1 and 2, 3), exactly as e4m3x2_to_bf16x2.
__device__ __forceinline__ uint2 e4m3x4_to_bf16x4(std::uint32_t codes) {
  std::uint32_t lo, hi;
  ptx::cvt_rn_f16x2_e4m3x4(codes, lo, hi);
  return make_uint2(f16x2_to_bf16x2(lo), f16x2_to_bf16x2(hi));
}

// Bit 7 of byte n is set where code n of `codes` is a NaN code (its low 7 bits all ones): adding 1
// to a byte of at most 0x7F carries into bit 7 only from 0x7F, and never into the next byte.
__device__ __forceinline__ std::uint32_t e4m3x4_nan_bytes(std::uint32_t codes) {
  return ((codes & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u;
}

}  // namespace kvaudit::cuda::detail
