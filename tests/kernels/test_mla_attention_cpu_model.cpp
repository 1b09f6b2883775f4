// Tests of the CPU model of the attention kernels on plain arrays
// (kernels/mla_attention_cpu_model.hpp), without a dump: the cases where the model's result is
// known in closed form, and its fault variant masked-nan-leak. The model against the exact
// reference, through the cpu-fp8 backend, is tests/backend/test_mla_attention_cpu.cpp.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/mla_attention_cpu_model.hpp"
#include "kernels/mla_attention_model.hpp"
#include "src/core/fp8_e4m3.hpp"

namespace kvaudit {
namespace {

constexpr int kDc = 4;
constexpr int kDr = 2;
constexpr int kWidth = kDc + kDr;

// One request of one query row over a page of `page_size` slots of an e4m3 pool whose first
// `tokens` slots are its tokens; q = 1 everywhere.
struct OneRow {
  std::vector<std::int32_t> qo_indptr{0, 1};
  std::vector<std::int32_t> kv_indptr{0, 1};
  std::vector<std::int32_t> kv_indices{0};
  std::vector<std::int32_t> kv_last_page_len;
  std::vector<std::uint8_t> pool;
  std::vector<float> q_nope = std::vector<float>(kDc, 1.0f);
  std::vector<float> q_pe = std::vector<float>(kDr, 1.0f);

  OneRow(int tokens, int page_size)
      : kv_last_page_len{tokens}, pool(static_cast<std::size_t>(page_size) * kWidth, 0) {}

  MlaCpuAttention attention(int page_size, float kv_scale) const {
    MlaCpuAttention a;
    a.qo_indptr = qo_indptr;
    a.kv_indptr = kv_indptr;
    a.kv_indices = kv_indices;
    a.kv_last_page_len = kv_last_page_len;
    a.page_size = page_size;
    a.num_heads = 1;
    a.kv_lora_rank = kDc;
    a.qk_rope_head_dim = kDr;
    a.score_scale = mla_score_scale(1.0, kv_scale);
    a.kv_scale = kv_scale;
    a.pool = pool;
    a.q_nope = q_nope;
    a.q_pe = q_pe;
    a.threads = 1;
    return a;
  }
};

TEST_CASE("cpu model: one visible token gives its row times kv_scale and its score", "[kernels]") {
  OneRow c(1, 4);
  const float codes[kWidth] = {1.0f, -2.0f, 0.5f, 3.0f, 0.25f, -1.0f};
  for (int j = 0; j < kWidth; ++j) c.pool[j] = e4m3_encode(codes[j], E4m3Overflow::kSatFinite);
  const float kv_scale = 0.5f;
  const MlaCpuAttention a = c.attention(4, kv_scale);
  std::vector<std::uint16_t> out(kDc);
  std::vector<float> lse(1);
  mla_attention_cpu_model(a, out, lse);
  // p = exp2(s - s) = 1, l = 1, acc = c: out = bf16(c * kv_scale), lse = s ln 2.
  for (int d = 0; d < kDc; ++d) CHECK(bf16_to_float(out[d]) == codes[d] * kv_scale);
  float dot = 0.0f;
  for (int j = 0; j < kWidth; ++j) dot += codes[j];
  const float s = dot * a.score_scale;
  CHECK(lse[0] == (s + std::log2(1.0f)) * static_cast<float>(mla::kLn2));
}

TEST_CASE("cpu model: masked-nan-leak reads the last page's unused slots", "[kernels]") {
  // Two tokens visible on a page of 4; slot 3 (unused) holds NaN codes.
  OneRow c(2, 4);
  for (int j = 0; j < 2 * kWidth; ++j) c.pool[j] = e4m3_encode(0.5f, E4m3Overflow::kSatFinite);
  for (int j = 3 * kWidth; j < 4 * kWidth; ++j) c.pool[j] = 0x7F;  // e4m3 NaN
  MlaCpuAttention a = c.attention(4, 1.0f);
  std::vector<std::uint16_t> out(kDc);
  std::vector<float> lse(1);
  mla_attention_cpu_model(a, out, lse);
  for (int d = 0; d < kDc; ++d) CHECK(bf16_to_float(out[d]) == 0.5f);  // never read
  CHECK(std::isfinite(lse[0]));
  a.read_masked_tail = true;
  mla_attention_cpu_model(a, out, lse);
  for (int d = 0; d < kDc; ++d) CHECK(std::isnan(bf16_to_float(out[d])));  // 0 * NaN
  CHECK(std::isfinite(lse[0]));  // the masked tokens' zero weights do not enter l
}

}  // namespace
}  // namespace kvaudit
