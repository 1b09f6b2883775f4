// Tests of the cpu-fp8 backend (src/backend/mla_attention_cpu.hpp) and the backend registry.
//
// Against the exact attention on the pool the backend wrote (R8, references/mla_reference.hpp),
// with a tolerance derived from where the model rounds (u = 2^-24 fp32, 2^-8 bf16; base-2 scores
// s2 = log2(e) * s):
//   score error   E_t = u sigma sum_k |S_tk| (1 + D u) + 2u |S2_t|: the fp32 dot of D exact
//                 products summed in order rounds each partial sum S_tk once (error <= u |S_tk|;
//                 the a-posteriori form of gamma_D sum_j |q_j k_tj|, tighter by ~sqrt(D)), then
//                 score_scale's and the product's roundings; sigma = sm_scale * kv_scale * log2 e.
//                 E = max_t E_t.
//   weight error  eta = 2 ln2 E + ln2 u dM + 2u + T (ln2 u dM + 3u): two scores' errors in a
//                 ratio, s - m rounding (dM = spread of the scores that matter, <= 64), exp2f
//                 (<= 1 ulp), and each of the T = ceil(n / 64) tile rescalings.
//   out:  |K - R8| <= 2^-8 |R8| + (1 + 2^-8) M [2^-8 + (2 eta + 2 (n + T + 3) u)(1 + 2^-8)]
//         with M = sum_t w_t |v_t| (exact weights): bf16(P) (2^-8 relative per weight, the
//         numerator only), weight errors (numerator and denominator), the fp32 sums of l and acc
//         (n + T terms each) and the two final products; then the output's bf16 rounding.
//   lse:  |K - R8| <= ln2 (E + log2e eta' + 2u |log2 l| + u (|m| + |log2 l|))(1 + 2u)
//                     + 2u |lse|,  eta' = eta - 2 ln2 E + (n + T) u
//         (log-sum-exp moves by at most the largest score error; l's relative error; log2f,
//         the sum and the product by fp32(ln 2) each round once).
// Tokens whose exact weight is below 2^-64 of the largest contribute < n 2^-64 M and are covered
// by the factor 1.01 applied to the bound.
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <cstring>
#include <iostream>
#include <limits>
#include <vector>

#include "kernels/mla_attention_model.hpp"
#include "references/mla_reference.hpp"
#include "src/backend/backend.hpp"
#include "src/backend/mla_attention_cpu.hpp"
#include "src/cli/backend_registry.hpp"
#include "tests/mla_case.hpp"

namespace kvaudit {
namespace {

using testing::make_mla_case;
using testing::MlaCase;
using testing::MlaCaseSpec;

constexpr double kU = 5.9604644775390625e-08;  // 2^-24, fp32 unit roundoff
constexpr double kUb = 0.00390625;             // 2^-8, bf16 unit roundoff

std::unique_ptr<Backend> cpu_backend(int threads = 2) {
  BackendOptions options;
  options.threads = threads;
  auto made = make_backend("cpu-fp8", options);
  REQUIRE(made.ok());
  return std::move(*made);
}

AttentionOutput run_backend(const MlaCase& c, KvPool& pool, Backend& backend) {
  const StepLayerInput input{c.attrs, c.step, c.layer, c.tensors, 0, 0};
  auto out = backend.run_step(input, pool);
  if (!out.ok()) FAIL(out.error().message());
  return std::move(*out);
}

struct Exact {
  std::vector<double> out;
  std::vector<double> lse;
};

Exact exact_r8(const MlaCase& c, const KvPool& written) {
  Exact r;
  const std::size_t pairs = static_cast<std::size_t>(c.step.num_rows()) * c.attrs.num_heads;
  r.out.resize(pairs * c.attrs.kv_lora_rank);
  r.lse.resize(pairs);
  const KvRows kv = KvRows::from_pool(written, c.layer.kv_scale);
  auto work = mla_reference_attention(c.attrs, c.step, c.tensors.q_nope, c.tensors.q_pe, kv, r.out,
                                      r.lse, 2);
  REQUIRE(work.ok());
  return r;
}

// The bound derived in the header comment, per output element and per lse.
struct Bound {
  std::vector<double> out;
  std::vector<double> lse;
  double max_v = 0.0;  // largest |v| any row sees
};

Bound derive_bound(const MlaCase& c, const KvPool& pool, const Exact& r8) {
  const int heads = c.attrs.num_heads;
  const int dc = c.attrs.kv_lora_rank;
  const int dr = c.attrs.qk_rope_head_dim;
  const int width = dc + dr;
  const double ks = c.layer.kv_scale;
  const double sigma = c.attrs.sm_scale * ks * mla::kLog2e;
  const double ln2 = mla::kLn2;
  const double log2e = mla::kLog2e;
  Bound bound;
  bound.out.resize(r8.out.size());
  bound.lse.resize(r8.lse.size());
  for (int row = 0; row < c.step.num_rows(); ++row) {
    const int b = c.step.request_of_row(row);
    const std::int64_t n = c.step.position_of_row(row, c.attrs.page_size) + 1;
    std::vector<std::vector<double>> k(n, std::vector<double>(width));
    for (std::int64_t t = 0; t < n; ++t) {
      const std::int64_t slot = c.step.slot_of(b, t, c.attrs.page_size);
      for (int j = 0; j < width; ++j) k[t][j] = pool.element(slot, j);
    }
    for (int h = 0; h < heads; ++h) {
      const std::size_t pair = static_cast<std::size_t>(row) * heads + h;
      std::vector<double> s2(n);
      double e_max = 0.0;
      for (std::int64_t t = 0; t < n; ++t) {
        double dot = 0.0;
        double partial_abs_sum = 0.0;  // sum_k |S_k| over the partial sums of the dot
        for (int j = 0; j < width; ++j) {
          const double q =
              j < dc ? c.tensors.q_nope[pair * dc + j] : c.tensors.q_pe[pair * dr + (j - dc)];
          dot += q * k[t][j];
          partial_abs_sum += std::abs(dot);
        }
        s2[t] = sigma * dot;
        e_max = std::max(
            e_max, (1 + width * kU) * kU * sigma * partial_abs_sum + 2 * kU * std::abs(s2[t]));
      }
      const double m2 = *std::max_element(s2.begin(), s2.end());
      double spread = 0.0;
      std::vector<double> w(n);
      double wsum = 0.0;
      for (std::int64_t t = 0; t < n; ++t) {
        if (m2 - s2[t] <= 64.0) spread = std::max(spread, m2 - s2[t]);
        w[t] = std::exp2(s2[t] - m2);
        wsum += w[t];
      }
      const double tiles = static_cast<double>((n + mla::kKvTileTokens - 1) / mla::kKvTileTokens);
      const double spread_all = spread + 2 * e_max;
      const double eta_common =
          ln2 * kU * spread_all + 2 * kU + tiles * (ln2 * kU * spread_all + 3 * kU);
      const double eta = 2 * ln2 * e_max + eta_common;
      const double sums = 2 * (n + tiles + 3) * kU;
      for (int d = 0; d < dc; ++d) {
        double m_abs = 0.0;
        for (std::int64_t t = 0; t < n; ++t) {
          m_abs += w[t] / wsum * std::abs(k[t][d] * ks);
          bound.max_v = std::max(bound.max_v, std::abs(k[t][d] * ks));
        }
        const double pre = m_abs * (kUb + (2 * eta + sums) * (1 + kUb));
        bound.out[pair * dc + d] = 1.01 * (kUb * std::abs(r8.out[pair * dc + d]) + (1 + kUb) * pre);
      }
      const double log2_l = std::log2(wsum);
      const double eta_l = eta_common + (n + tiles) * kU;
      bound.lse[pair] = 1.01 * (ln2 *
                                    (e_max + log2e * eta_l + 2 * kU * std::abs(log2_l) +
                                     kU * (std::abs(m2) + std::abs(log2_l))) *
                                    (1 + 2 * kU) +
                                2 * kU * std::abs(r8.lse[pair]));
    }
  }
  return bound;
}

// Checks K against R8 within the bound; returns the largest error / bound seen.
double check_against_reference(const MlaCase& c, const AttentionOutput& k, const Exact& r8,
                               const Bound& bound) {
  double worst = 0.0;
  double max_err = 0.0;
  REQUIRE(k.out_bf16.size() == r8.out.size());
  REQUIRE(k.lse.size() == r8.lse.size());
  for (std::size_t e = 0; e < r8.out.size(); ++e) {
    const double got = bf16_to_float(k.out_bf16[e]);
    REQUIRE(std::isfinite(got));
    const double err = std::abs(got - r8.out[e]);
    max_err = std::max(max_err, err);
    worst = std::max(worst, err / bound.out[e]);
    if (err > bound.out[e]) {
      FAIL_CHECK(c.name() << " out[" << e << "] = " << got << ", R8 " << r8.out[e] << ", error "
                          << err << " > bound " << bound.out[e]);
      break;
    }
  }
  for (std::size_t e = 0; e < r8.lse.size(); ++e) {
    REQUIRE(std::isfinite(k.lse[e]));
    const double err = std::abs(k.lse[e] - r8.lse[e]);
    worst = std::max(worst, err / bound.lse[e]);
    if (err > bound.lse[e]) {
      FAIL_CHECK(c.name() << " lse[" << e << "] = " << k.lse[e] << ", R8 " << r8.lse[e]
                          << ", error " << err << " > bound " << bound.lse[e]);
      break;
    }
  }
  // The bound is not vacuous: it stays within a few bf16 units of the values' scale, and the
  // backend does round somewhere (bf16 output), so some error is seen.
  for (const double b : bound.out) REQUIRE(b <= 4 * kUb * bound.max_v);
  CHECK(max_err > 0.0);
  return worst;
}

TEST_CASE("cpu-fp8 agrees with the exact reference within the derived bound", "[cpu-fp8]") {
  std::vector<MlaCaseSpec> specs;
  {
    MlaCaseSpec s;  // small widths, page 1, prefill with an empty request
    s.requests = {{9, 3}, {0, 0}, {5, 1}};
    s.kv_scale = 0.37f;
    s.sm_scale = 0.3;
    specs.push_back(s);
  }
  {
    MlaCaseSpec s;  // full width, page 64, decode, scattered pages, partial last pages
    s.kind = StepKind::kDecode;
    s.heads = 4;
    s.dc = 512;
    s.dr = 64;
    s.page_size = 64;
    s.sm_scale = 1.0 / std::sqrt(192.0);
    s.kv_scale = 0.0213f;
    s.kv_range = 8.0f;
    s.requests = {{130, 1}, {64, 1}, {1, 1}};
    s.seed = 2;
    specs.push_back(s);
  }
  {
    MlaCaseSpec s;  // full width, page 64, causal prefill across tile boundaries
    s.heads = 2;
    s.dc = 512;
    s.dr = 64;
    s.page_size = 64;
    s.sm_scale = 1.0 / std::sqrt(192.0);
    s.kv_scale = 1.0f;
    s.requests = {{140, 80}};
    s.seed = 3;
    specs.push_back(s);
  }
  {
    MlaCaseSpec s;  // page 1, decode, wide score range (sharp softmax)
    s.kind = StepKind::kDecode;
    s.heads = 3;
    s.dc = 64;
    s.dr = 16;
    s.sm_scale = 2.0;
    s.kv_scale = 0.75f;
    s.requests = {{200, 1}, {3, 1}, {66, 1}};
    s.seed = 4;
    specs.push_back(s);
  }
  {
    MlaCaseSpec s;  // bf16 pool (the unquantized baseline), page 4
    s.kv_dtype = KvDtype::kBfloat16;
    s.page_size = 4;
    s.dc = 32;
    s.dr = 8;
    s.requests = {{70, 5}, {4, 2}};
    s.seed = 5;
    specs.push_back(s);
  }
  auto backend = cpu_backend();
  for (const auto& spec : specs) {
    const MlaCase c = make_mla_case(spec);
    INFO(c.name());
    KvPool pool = c.pool;
    const AttentionOutput k = run_backend(c, pool, *backend);
    const KvPool written = c.pool_after;
    REQUIRE(pool.bytes == written.bytes);
    const Exact r8 = exact_r8(c, written);
    const Bound bound = derive_bound(c, written, r8);
    const double worst = check_against_reference(c, k, r8, bound);
    CHECK(worst <= 1.0);
  }
}

TEST_CASE("cpu-fp8 writes exactly the step's slots by the kvdump rule", "[cpu-fp8]") {
  MlaCaseSpec spec;
  spec.page_size = 64;
  spec.requests = {{70, 3}, {5, 1}};
  spec.kv_scale = 0.37f;
  MlaCase c = make_mla_case(spec);  // unused slots and new rows' slots hold NaN codes
  const int width = c.attrs.row_width();
  // Hand-known codes in row 0 (kv_scale 0.37): 0.37 -> 1.0 (0x38); 448 * 0.37 -> 448 (0x7E);
  // 1e4 and -1e4 saturate to +-448 (0x7E, 0xFE); 0 -> 0x00.
  c.tensors.new_kv[0] = 0.37f;
  c.tensors.new_kv[1] = 448.0f * 0.37f;
  c.tensors.new_kv[2] = 1e4f;
  c.tensors.new_kv[3] = -1e4f;
  c.tensors.new_kv[4] = 0.0f;
  KvPool pool = c.pool;
  auto backend = cpu_backend();
  const AttentionOutput k = run_backend(c, pool, *backend);
  const std::uint8_t* row0 = pool.row(c.step.new_kv_slots[0]);
  CHECK(row0[0] == 0x38);
  CHECK(row0[1] == 0x7E);
  CHECK(row0[2] == 0x7E);
  CHECK(row0[3] == 0xFE);
  CHECK(row0[4] == 0x00);
  std::vector<bool> written(pool.num_slots, false);
  for (int i = 0; i < c.step.num_rows(); ++i) {
    const std::int64_t slot = c.step.new_kv_slots[i];
    written[slot] = true;
    for (int j = 0; j < width; ++j) {
      INFO("row " << i << " col " << j);
      CHECK(pool.row(slot)[j] == kvdump_quantize(c.tensors.new_kv[i * width + j], 0.37f));
      CHECK(!e4m3_is_nan(pool.row(slot)[j]));
    }
  }
  std::size_t unchanged = 0;
  for (std::int64_t s = 0; s < pool.num_slots; ++s) {
    if (written[s]) continue;
    REQUIRE(std::memcmp(pool.row(s), c.pool.row(s), width) == 0);
    ++unchanged;
  }
  CHECK(unchanged == static_cast<std::size_t>(pool.num_slots - 4));
  // Saturated values are read as +-448 * kv_scale and NaN codes elsewhere never leak.
  for (const std::uint16_t bits : k.out_bf16) REQUIRE(std::isfinite(bf16_to_float(bits)));
  for (const float v : k.lse) REQUIRE(std::isfinite(v));
}

TEST_CASE("cpu-fp8 reciprocal_scale writes with x * (1 / kv_scale)", "[cpu-fp8]") {
  // Find a value whose two quantizations differ (rare: a quotient within an ulp of an e4m3
  // rounding midpoint).
  float value = 0.0f;
  float scale = 0.0f;
  for (float s = 0.3f; s < 0.9f && value == 0.0f; s = std::nextafter(s + 0.001f, 1.0f)) {
    for (int code = 1; code < 0x7E && value == 0.0f; ++code) {
      const double mid = 0.5 * (e4m3_decode(code) + e4m3_decode(code + 1));
      float v = std::nextafter(static_cast<float>(mid * s), 0.0f);
      for (int i = 0; i < 3; ++i, v = std::nextafter(v, 1e9f)) {
        if (kvdump_quantize(v, s) != kvdump_quantize_reciprocal(v, s)) {
          value = v;
          scale = s;
          break;
        }
      }
    }
  }
  REQUIRE(value != 0.0f);
  MlaCaseSpec spec;
  spec.requests = {{2, 1}};
  spec.kv_scale = scale;
  MlaCase c = make_mla_case(spec);
  c.tensors.new_kv[0] = value;
  for (const bool reciprocal : {false, true}) {
    BackendOptions options;
    options.reciprocal_scale = reciprocal;
    auto backend = make_backend("cpu-fp8", options);
    REQUIRE(backend.ok());
    KvPool pool = c.pool;
    run_backend(c, pool, **backend);
    const std::uint8_t code = pool.row(c.step.new_kv_slots[0])[0];
    CHECK(code ==
          (reciprocal ? kvdump_quantize_reciprocal(value, scale) : kvdump_quantize(value, scale)));
  }
}

TEST_CASE("cpu-fp8 never reads masked or unused slots", "[cpu-fp8]") {
  MlaCaseSpec spec;
  spec.page_size = 64;
  spec.requests = {{70, 4}, {3, 1}};  // last page of request 0 holds 6 of 64 tokens
  MlaCase c = make_mla_case(spec);    // everything unused holds NaN codes
  // The last row's own token is NaN (written as a NaN code): rows before it must not see it.
  const int width = c.attrs.row_width();
  c.tensors.new_kv[3 * width + 1] = std::numeric_limits<float>::quiet_NaN();
  KvPool pool = c.pool;
  auto backend = cpu_backend();
  const AttentionOutput k = run_backend(c, pool, *backend);
  CHECK(pool.row(c.step.new_kv_slots[3])[1] == kE4m3NanCode);
  const std::size_t per_row = static_cast<std::size_t>(spec.heads) * spec.dc;
  for (int row = 0; row < c.step.num_rows(); ++row) {
    const bool sees_nan = row == 3;
    for (std::size_t e = row * per_row; e < (row + 1) * per_row; ++e) {
      INFO("row " << row);
      CHECK(std::isnan(bf16_to_float(k.out_bf16[e])) == sees_nan);
    }
  }
}

TEST_CASE("cpu-fp8 on an all-zero pool gives exactly zero", "[cpu-fp8]") {
  MlaCaseSpec spec;
  spec.requests = {{100, 2}, {1, 1}};
  spec.nan_unused = false;
  spec.kv_range = 0.0f;  // every value 0
  const MlaCase c = make_mla_case(spec);
  KvPool pool = c.pool;
  auto backend = cpu_backend();
  const AttentionOutput k = run_backend(c, pool, *backend);
  for (const std::uint16_t bits : k.out_bf16) REQUIRE(bits == 0);
  // Scores all 0: lse = ln(visible tokens).
  const int visible[] = {99, 100, 1};
  for (int row = 0; row < 3; ++row) {
    for (int h = 0; h < spec.heads; ++h) {
      CHECK(std::abs(k.lse[row * spec.heads + h] - std::log(visible[row])) <= 1e-6);
    }
  }
}

TEST_CASE("cpu-fp8 with one visible token returns bf16 of its value", "[cpu-fp8]") {
  for (const float scale : {0.5f, 1.0f, 0.37f}) {
    MlaCaseSpec spec;
    spec.kind = StepKind::kDecode;
    spec.requests = {{1, 1}, {1, 1}};
    spec.kv_scale = scale;
    spec.dc = 64;
    spec.kv_range = 300.0f;
    const MlaCase c = make_mla_case(spec);
    INFO(c.name());
    KvPool pool = c.pool;
    auto backend = cpu_backend();
    const AttentionOutput k = run_backend(c, pool, *backend);
    for (int row = 0; row < 2; ++row) {
      const std::uint8_t* codes = pool.row(c.step.new_kv_slots[row]);
      for (int h = 0; h < spec.heads; ++h) {
        for (int d = 0; d < spec.dc; ++d) {
          const double value = static_cast<double>(e4m3_decode(codes[d])) * scale;
          const double got = bf16_to_float(k.out_bf16[(row * spec.heads + h) * spec.dc + d]);
          if (scale != 0.37f) {
            // code * 2^k is exact in bf16 (4 significant bits): no rounding at all.
            REQUIRE(got == value);
          } else {
            // One rounding of the fp32 product, one to bf16.
            REQUIRE(std::abs(got - value) <= kUb * std::abs(value) * (1 + 2 * kU));
          }
        }
      }
    }
  }
}

TEST_CASE("cpu-fp8 is deterministic across thread counts", "[cpu-fp8]") {
  MlaCaseSpec spec;
  spec.heads = 5;
  spec.requests = {{90, 7}, {20, 1}, {3, 2}};
  const MlaCase c = make_mla_case(spec);
  KvPool pool1 = c.pool;
  KvPool pool3 = c.pool;
  auto one = cpu_backend(1);
  auto three = cpu_backend(3);
  const AttentionOutput a = run_backend(c, pool1, *one);
  const AttentionOutput b = run_backend(c, pool3, *three);
  CHECK(a.out_bf16 == b.out_bf16);
  CHECK(a.lse == b.lse);
  CHECK(pool1.bytes == pool3.bytes);
}

TEST_CASE("cpu-fp8 refuses inconsistent inputs", "[cpu-fp8]") {
  MlaCase c = make_mla_case(MlaCaseSpec{});
  auto backend = cpu_backend();
  {
    KvPool pool = KvPool::zeros(KvDtype::kBfloat16, c.pool.num_slots, c.pool.row_width);
    const StepLayerInput input{c.attrs, c.step, c.layer, c.tensors, 0, 0};
    CHECK(!backend->run_step(input, pool).ok());
  }
  {
    StepLayerTensors t = c.tensors;
    t.new_kv.pop_back();
    KvPool pool = c.pool;
    const StepLayerInput input{c.attrs, c.step, c.layer, t, 0, 0};
    const auto r = backend->run_step(input, pool);
    REQUIRE(!r.ok());
    CHECK(r.error().kind == ErrorKind::kBadInput);
  }
  {
    StepMeta step = c.step;
    step.new_kv_slots[0] = static_cast<std::int32_t>(c.pool.num_slots);
    KvPool pool = c.pool;
    const StepLayerInput input{c.attrs, step, c.layer, c.tensors, 0, 0};
    CHECK(!backend->run_step(input, pool).ok());
    CHECK(pool.bytes == c.pool.bytes);  // refused before writing anything
  }
}

TEST_CASE("backend registry: names, cpu-fp8, CUDA availability, unknown names", "[backend]") {
  CHECK(backend_names() == std::vector<std::string>{"cpu-fp8", "cuda-fp8", "cuda-cast-bf16"});
  auto cpu = make_backend("cpu-fp8", BackendOptions{});
  REQUIRE(cpu.ok());
  CHECK((*cpu)->name() == "cpu-fp8");
  const nlohmann::json d = (*cpu)->describe();
  CHECK(d.at("name") == "cpu-fp8");
  CHECK(d.at("kv_tile_tokens") == mla::kKvTileTokens);
  CHECK(d.at("threads").get<int>() >= 1);
  CHECK(d.at("rounding").at("p") == "bf16 before P.V");

  auto unknown = make_backend("cuda-fp9", BackendOptions{});
  REQUIRE(!unknown.ok());
  CHECK(unknown.error().kind == ErrorKind::kBadInput);
  CHECK(unknown.error().what.find("cpu-fp8, cuda-fp8, cuda-cast-bf16") != std::string::npos);
#if !defined(KVAUDIT_HAVE_CUDA)
  for (const char* name : {"cuda-fp8", "cuda-cast-bf16"}) {
    auto cuda = make_backend(name, BackendOptions{});
    REQUIRE(!cuda.ok());
    CHECK(cuda.error().kind == ErrorKind::kBadInput);
    CHECK(cuda.error().what.find("without CUDA") != std::string::npos);
  }
#endif
  BackendOptions inject;
  inject.injection = "bf16-writeback";
  auto injected = make_backend("cpu-fp8", inject);
  REQUIRE(injected.ok());
  CHECK(injected.value()->describe()["injection"] == "bf16-writeback");
  inject.injection = "no-such-fault";
  auto unknown_injection = make_backend("cpu-fp8", inject);
  REQUIRE(!unknown_injection.ok());
  CHECK(unknown_injection.error().kind == ErrorKind::kBadInput);
  CHECK(unknown_injection.error().message().find("no-such-fault") != std::string::npos);
}

// Not run by default: prints the CPU model's throughput at full MLA width.
TEST_CASE("cpu-fp8 throughput (rows*heads*tokens per second)", "[.][benchmark][cpu-fp8]") {
  MlaCaseSpec spec;
  spec.kind = StepKind::kDecode;
  spec.heads = 16;
  spec.dc = 512;
  spec.dr = 64;
  spec.page_size = 64;
  spec.sm_scale = 1.0 / std::sqrt(192.0);
  spec.requests = {{4096, 1}, {4096, 1}};
  const MlaCase c = make_mla_case(spec);
  KvPool pool = c.pool;
  auto backend = cpu_backend(0);
  const auto start = std::chrono::steady_clock::now();
  const AttentionOutput k = run_backend(c, pool, *backend);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double work = 2.0 * 4096 * 16;
  std::cout << c.name() << ": " << work / seconds << " rows*heads*tokens per second\n";
  CHECK(k.lse.size() == 32);
}

}  // namespace
}  // namespace kvaudit
