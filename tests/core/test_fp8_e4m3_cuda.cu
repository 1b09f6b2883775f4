// [gpu] The device's kvdump write rule (kvdump_quantize_device: fp32 division, then
// cvt.rn.satfinite.e4m3x2.f32) against the host codec (kvdump_quantize / e4m3_encode), code for
// code, over a dense sweep of floats: every binade e4m3 can reach and beyond, every mantissa
// pattern near the rounding ties, the overflow boundaries 448 / 464 / 480 and their float
// neighbours, zeros, subnormals, infinities and NaNs, and a million random bit patterns (and the
// --reciprocal-scale rounding the same way); the full launchers (launch_kv_write with several
// scales, launch_kv_write_rule under every write rule) on every bf16 bit pattern.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "kernels/fp8_e4m3_device.cuh"
#include "kernels/mla_attention_cuda.hpp"
#include "src/backend/injection.hpp"
#include "src/core/fp8_e4m3.hpp"
#include "tests/gpu_skip.hpp"

namespace {

// reciprocal 0: kvdump's division (kvdump_quantize_device); 1: the --reciprocal-scale option.
__global__ void quantize_sweep_kernel(const float* values, int n, float kv_scale,
                                      std::uint8_t* codes, int reciprocal = 0) {
  using kvaudit::cuda::detail::DeviceE4m3Rounding;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    codes[i] = reciprocal ? DeviceE4m3Rounding::reciprocal(values[i], kv_scale)
                          : kvaudit::cuda::detail::kvdump_quantize_device(values[i], kv_scale);
  }
}

std::vector<float> float_sweep() {
  std::vector<float> v;
  // Every binade from 2^-14 (below e4m3's smallest subnormal 2^-9) to 2^10 (past 480): the top 10
  // mantissa bits exhaustively (e4m3 keeps 3; the next bits decide the rounding), each with low
  // bits 0, 1 and all-ones (exact ties, just above, just below a tie).
  for (int e = -14; e <= 10; ++e) {
    for (std::uint32_t top = 0; top < 1024; ++top) {
      for (const std::uint32_t low : {0u, 1u, 0x1FFFu}) {
        const std::uint32_t bits = (static_cast<std::uint32_t>(e + 127) << 23) | (top << 13) | low;
        v.push_back(kvaudit::float_from_bits(bits));
        v.push_back(-kvaudit::float_from_bits(bits));
      }
    }
  }
  // Overflow boundaries and their neighbours: 448 (max), 464 (tie to 448), 480 (would-be next).
  for (const float b : {448.f, 464.f, 480.f, 416.f, 432.f, 0.001953125f, 0.0009765625f}) {
    float lo = b, hi = b;
    for (int k = 0; k < 4; ++k) {
      v.push_back(lo);
      v.push_back(hi);
      v.push_back(-lo);
      v.push_back(-hi);
      lo = std::nextafter(lo, 0.f);
      hi = std::nextafter(hi, 1e9f);
    }
  }
  const float inf = std::numeric_limits<float>::infinity();
  for (const float x :
       {0.f, -0.f, inf, -inf, std::numeric_limits<float>::quiet_NaN(),
        -std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::denorm_min(),
        -std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::max(),
        -std::numeric_limits<float>::max(), 1e-30f, 1e30f}) {
    v.push_back(x);
  }
  std::mt19937 rng(20261129);
  for (int i = 0; i < 1 << 20; ++i) v.push_back(kvaudit::float_from_bits(rng()));
  return v;
}

}  // namespace

TEST_CASE("device kvdump write rule matches the host codec on a dense float sweep", "[gpu][fp8]") {
  KVAUDIT_REQUIRE_GPU();
  const std::vector<float> values = float_sweep();
  const int n = static_cast<int>(values.size());
  float* d_values = nullptr;
  std::uint8_t* d_codes = nullptr;
  REQUIRE(cudaMalloc(&d_values, values.size() * sizeof(float)) == cudaSuccess);
  REQUIRE(cudaMalloc(&d_codes, values.size()) == cudaSuccess);
  REQUIRE(cudaMemcpy(d_values, values.data(), values.size() * sizeof(float),
                     cudaMemcpyHostToDevice) == cudaSuccess);
  // 1 (no division effect), powers of two and non-powers of two (the division rounds); kvdump's
  // rule and the reciprocal option (DeviceE4m3Rounding, which the write rules of
  // src/backend/injection.hpp use on the device).
  for (const int reciprocal : {0, 1}) {
    for (const float scale : {1.0f, 0.25f, 4.0f, 0.37f, 1.7f, 0.0123f, 3.0f}) {
      quantize_sweep_kernel<<<(n + 255) / 256, 256>>>(d_values, n, scale, d_codes, reciprocal);
      REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
      std::vector<std::uint8_t> codes(values.size());
      REQUIRE(cudaMemcpy(codes.data(), d_codes, codes.size(), cudaMemcpyDeviceToHost) ==
              cudaSuccess);
      int mismatches = 0;
      for (int i = 0; i < n; ++i) {
        const std::uint8_t expected = reciprocal
                                          ? kvaudit::kvdump_quantize_reciprocal(values[i], scale)
                                          : kvaudit::kvdump_quantize(values[i], scale);
        if (codes[i] != expected) {
          if (++mismatches <= 5) {
            UNSCOPED_INFO("scale " << scale << " x=" << values[i] << " (bits 0x" << std::hex
                                   << kvaudit::float_bits(values[i]) << ") device 0x"
                                   << int(codes[i]) << " host 0x" << int(expected) << std::dec);
          }
        }
      }
      INFO("reciprocal " << reciprocal << ", scale " << scale << ": " << n << " values");
      CHECK(mismatches == 0);
    }
  }
  // Spot values stated in the format: saturation and NaN.
  const float spot[] = {500.f, -500.f, 464.f, 464.0001f, 3.3f, 0.0078125f};
  const std::uint8_t expected_spot[] = {0x7E, 0xFE, 0x7E, 0x7E, 0x45, 0x04};
  REQUIRE(cudaMemcpy(d_values, spot, sizeof spot, cudaMemcpyHostToDevice) == cudaSuccess);
  quantize_sweep_kernel<<<1, 32>>>(d_values, 6, 1.0f, d_codes);
  std::uint8_t got[6];
  REQUIRE(cudaMemcpy(got, d_codes, 6, cudaMemcpyDeviceToHost) == cudaSuccess);
  for (int i = 0; i < 6; ++i) CHECK(int(got[i]) == int(expected_spot[i]));
  cudaFree(d_values);
  cudaFree(d_codes);
}

TEST_CASE("launch_kv_write writes every bf16 pattern as kvdump_quantize does", "[gpu][fp8]") {
  KVAUDIT_REQUIRE_GPU();
  // 65536 bf16 patterns as 128 rows of 512 elements; slots reversed and offset so that an indexing
  // slip shows as a wrong row.
  constexpr int kRows = 128, kWidth = 512, kSlots = 300;
  std::vector<std::uint16_t> bits(kRows * kWidth);
  for (int i = 0; i < kRows * kWidth; ++i) bits[i] = static_cast<std::uint16_t>(i);
  std::vector<std::int32_t> slots(kRows);
  for (int r = 0; r < kRows; ++r) slots[r] = 2 * (kRows - 1 - r) + 7;
  std::uint16_t* d_bits = nullptr;
  std::int32_t* d_slots = nullptr;
  std::uint8_t* d_pool = nullptr;
  REQUIRE(cudaMalloc(&d_bits, bits.size() * 2) == cudaSuccess);
  REQUIRE(cudaMalloc(&d_slots, slots.size() * 4) == cudaSuccess);
  REQUIRE(cudaMalloc(&d_pool, kSlots * kWidth) == cudaSuccess);
  REQUIRE(cudaMemcpy(d_bits, bits.data(), bits.size() * 2, cudaMemcpyHostToDevice) == cudaSuccess);
  REQUIRE(cudaMemcpy(d_slots, slots.data(), slots.size() * 4, cudaMemcpyHostToDevice) ==
          cudaSuccess);
  for (const float scale : {1.0f, 0.37f, 2.5f}) {
    REQUIRE(cudaMemset(d_pool, 0xA5, kSlots * kWidth) == cudaSuccess);
    REQUIRE(kvaudit::cuda::launch_kv_write(d_bits, d_slots, kRows, kWidth, scale,
                                           kvaudit::cuda::PoolElement::kFp8E4m3, d_pool, nullptr)
                .ok());
    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    std::vector<std::uint8_t> pool(kSlots * kWidth);
    REQUIRE(cudaMemcpy(pool.data(), d_pool, pool.size(), cudaMemcpyDeviceToHost) == cudaSuccess);
    std::vector<std::uint8_t> expected(kSlots * kWidth, 0xA5);
    for (int r = 0; r < kRows; ++r) {
      for (int c = 0; c < kWidth; ++c) {
        expected[slots[r] * kWidth + c] =
            kvaudit::kvdump_quantize(kvaudit::bf16_to_float(bits[r * kWidth + c]), scale);
      }
    }
    int mismatches = 0;
    for (std::size_t i = 0; i < pool.size(); ++i) mismatches += pool[i] != expected[i];
    INFO("scale " << scale);
    CHECK(mismatches == 0);
  }
  cudaFree(d_bits);
  cudaFree(d_slots);
  cudaFree(d_pool);
}

// The code of element c of a bf16 row under each write rule, from the host codec directly (not
// through kv_write_code, which the device kernel shares).
std::uint8_t host_rule_code(kvaudit::KvWriteRule rule, const std::uint16_t* row, int c,
                            float scale) {
  using kvaudit::KvWriteRule;
  const float x = kvaudit::bf16_to_float(row[c]);
  switch (rule) {
    case KvWriteRule::kReciprocal:
      return kvaudit::kvdump_quantize_reciprocal(x, scale);
    case KvWriteRule::kRoundTowardZero:
      return kvaudit::e4m3_encode_toward_zero(x / scale);
    case KvWriteRule::kNoSaturation:
      return kvaudit::e4m3_encode(x / scale, kvaudit::E4m3Overflow::kNoSat);
    case KvWriteRule::kBf16Bytes:
      return static_cast<std::uint8_t>(c % 2 == 0 ? row[c / 2] & 0xFF : row[c / 2] >> 8);
    case KvWriteRule::kDivide:
      break;
  }
  return kvaudit::kvdump_quantize(x, scale);
}

TEST_CASE("launch_kv_write_rule writes every bf16 pattern under every rule as the host does",
          "[gpu][fp8][inject]") {
  KVAUDIT_REQUIRE_GPU();
  using kvaudit::KvWriteRule;
  // 65536 bf16 patterns as 128 rows of 512 elements into a pool of 300 slots; slot_offset 1 with
  // the last row in the last slot checks the wrap to slot 0 (fault neighbour-slot-write).
  constexpr int kRows = 128, kWidth = 512, kSlots = 300;
  std::vector<std::uint16_t> bits(kRows * kWidth);
  for (int i = 0; i < kRows * kWidth; ++i) bits[i] = static_cast<std::uint16_t>(i);
  std::vector<std::int32_t> slots(kRows);
  for (int r = 0; r < kRows; ++r) slots[r] = 2 * (kRows - 1 - r) + 7;
  slots[0] = kSlots - 1;
  std::uint16_t* d_bits = nullptr;
  std::int32_t* d_slots = nullptr;
  std::uint8_t* d_pool = nullptr;
  REQUIRE(cudaMalloc(&d_bits, bits.size() * 2) == cudaSuccess);
  REQUIRE(cudaMalloc(&d_slots, slots.size() * 4) == cudaSuccess);
  REQUIRE(cudaMalloc(&d_pool, kSlots * kWidth) == cudaSuccess);
  REQUIRE(cudaMemcpy(d_bits, bits.data(), bits.size() * 2, cudaMemcpyHostToDevice) == cudaSuccess);
  REQUIRE(cudaMemcpy(d_slots, slots.data(), slots.size() * 4, cudaMemcpyHostToDevice) ==
          cudaSuccess);
  for (const KvWriteRule rule :
       {KvWriteRule::kDivide, KvWriteRule::kReciprocal, KvWriteRule::kRoundTowardZero,
        KvWriteRule::kNoSaturation, KvWriteRule::kBf16Bytes}) {
    for (const int slot_offset : {0, 1}) {
      const float scale = 0.37f;
      REQUIRE(cudaMemset(d_pool, 0xA5, kSlots * kWidth) == cudaSuccess);
      REQUIRE(kvaudit::cuda::launch_kv_write_rule(d_bits, d_slots, kRows, kWidth, scale, d_pool,
                                                  kSlots, rule, slot_offset, nullptr)
                  .ok());
      REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
      std::vector<std::uint8_t> pool(kSlots * kWidth);
      REQUIRE(cudaMemcpy(pool.data(), d_pool, pool.size(), cudaMemcpyDeviceToHost) == cudaSuccess);
      std::vector<std::uint8_t> expected(kSlots * kWidth, 0xA5);
      for (int r = 0; r < kRows; ++r) {
        const int slot = (slots[r] + slot_offset) % kSlots;
        for (int c = 0; c < kWidth; ++c) {
          expected[slot * kWidth + c] = host_rule_code(rule, bits.data() + r * kWidth, c, scale);
        }
      }
      int mismatches = 0;
      for (std::size_t i = 0; i < pool.size(); ++i) mismatches += pool[i] != expected[i];
      INFO("rule " << kvaudit::kv_write_rule_name(rule) << ", slot_offset " << slot_offset);
      CHECK(mismatches == 0);
    }
  }
  cudaFree(d_bits);
  cudaFree(d_slots);
  cudaFree(d_pool);
}

namespace {

__global__ void decode_all_codes_kernel(std::uint32_t* out) {
  const int i = threadIdx.x;  // 128 threads, codes 2i and 2i + 1
  out[i] = kvaudit::cuda::detail::e4m3x2_to_bf16x2(
      static_cast<std::uint16_t>((2 * i) | ((2 * i + 1) << 8)));
}

// Thread i (256 threads) decodes the word of codes i, i + 1, i + 2, i + 3 (mod 256, byte n = code
// i + n) with e4m3x4_to_bf16x4, so every code passes through every byte position once.
__global__ void decode_all_codes_x4_kernel(uint2* out) {
  const unsigned i = threadIdx.x;
  const std::uint32_t word = (i & 0xFFu) | (((i + 1) & 0xFFu) << 8) | (((i + 2) & 0xFFu) << 16) |
                             (((i + 3) & 0xFFu) << 24);
  out[i] = kvaudit::cuda::detail::e4m3x4_to_bf16x4(word);
}

// The bf16 bits of a decoded code agree with the host codec (NaN codes: any NaN).
void check_decoded_code(int code, std::uint16_t bits) {
  const float value = kvaudit::bf16_to_float(bits);
  const float expected = kvaudit::e4m3_decode(static_cast<std::uint8_t>(code));
  INFO("code 0x" << std::hex << code);
  if (kvaudit::e4m3_is_nan(static_cast<std::uint8_t>(code))) {
    CHECK(std::isnan(value));
  } else {
    CHECK(kvaudit::float_bits(value) == kvaudit::float_bits(expected));  // sign of zero too
  }
}

}  // namespace

TEST_CASE("device e4m3 -> bf16 decode is exact for all 256 codes", "[gpu][fp8]") {
  KVAUDIT_REQUIRE_GPU();
  std::uint32_t* d_out = nullptr;
  REQUIRE(cudaMalloc(&d_out, 128 * 4) == cudaSuccess);
  decode_all_codes_kernel<<<1, 128>>>(d_out);
  std::uint32_t got[128];
  REQUIRE(cudaMemcpy(got, d_out, sizeof got, cudaMemcpyDeviceToHost) == cudaSuccess);
  cudaFree(d_out);
  for (int code = 0; code < 256; ++code) {
    check_decoded_code(
        code, static_cast<std::uint16_t>(code % 2 ? got[code / 2] >> 16 : got[code / 2] & 0xFFFF));
  }
}

TEST_CASE("device e4m3x4 -> bf16x4 decode is exact for every code in every byte position",
          "[gpu][fp8]") {
  KVAUDIT_REQUIRE_GPU();
  uint2* d_out = nullptr;
  REQUIRE(cudaMalloc(&d_out, 256 * sizeof(uint2)) == cudaSuccess);
  decode_all_codes_x4_kernel<<<1, 256>>>(d_out);
  uint2 got[256];
  REQUIRE(cudaMemcpy(got, d_out, sizeof got, cudaMemcpyDeviceToHost) == cudaSuccess);
  cudaFree(d_out);
  for (int i = 0; i < 256; ++i) {
    const std::uint32_t halves[4] = {got[i].x & 0xFFFFu, got[i].x >> 16, got[i].y & 0xFFFFu,
                                     got[i].y >> 16};
    for (int n = 0; n < 4; ++n) {
      INFO("thread " << i << ", byte " << n);
      check_decoded_code((i + n) % 256, static_cast<std::uint16_t>(halves[n]));
    }
  }
}

namespace {

// Thread i reports the NaN bytes of codes 4i .. 4i + 3 (64 threads).
__global__ void nan_bytes_of_all_codes_kernel(std::uint32_t* nan_bytes) {
  const std::uint32_t first = 4 * threadIdx.x;
  const std::uint32_t codes =
      first | ((first + 1) << 8) | ((first + 2) << 16) | ((first + 3) << 24);
  nan_bytes[threadIdx.x] = kvaudit::cuda::detail::e4m3x4_nan_bytes(codes);
}

}  // namespace

TEST_CASE("device e4m3x4_nan_bytes flags exactly the two NaN codes", "[gpu][fp8]") {
  KVAUDIT_REQUIRE_GPU();
  std::uint32_t* d_nan = nullptr;
  REQUIRE(cudaMalloc(&d_nan, 64 * 4) == cudaSuccess);
  nan_bytes_of_all_codes_kernel<<<1, 64>>>(d_nan);
  std::uint32_t nan_bytes[64];
  REQUIRE(cudaMemcpy(nan_bytes, d_nan, sizeof nan_bytes, cudaMemcpyDeviceToHost) == cudaSuccess);
  cudaFree(d_nan);
  int flagged = 0;
  for (int code = 0; code < 256; ++code) {
    const bool nan_flag = (nan_bytes[code / 4] >> (8 * (code % 4) + 7)) & 1u;
    INFO("code 0x" << std::hex << code);
    CHECK(nan_flag == kvaudit::e4m3_is_nan(static_cast<std::uint8_t>(code)));
    flagged += nan_flag;
  }
  CHECK(flagged == 2);
}
