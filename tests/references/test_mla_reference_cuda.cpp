// The GPU reference (`--reference cuda`, references/mla_reference_cuda.hpp) against the CPU
// reference, which stays the truth, and against Boost at 50 digits.
//
// Both references promise the double nearest the exact value up to ~1e-25 relative, so they may
// differ by the final rounding only, and only where the truth lies within ~1e-25 of a midpoint
// between doubles: the checks are the promised bound (out: 1e-15 relative to the largest |out| of
// its (row, head); lse: 1e-15 absolute, or one unit in the last place where |lse| >= 8 and a
// double's spacing is coarser than that), NaN exactly where the CPU has NaN, and at least 99.9% of
// the elements bit-identical (an ulp-level loss anywhere, e.g. a product fused into an addition by
// the compiler, changes about a third of them). The
// shapes cover what the GPU kernels tile: widths that are not multiples of the 64-wide tiles or the
// 16-deep stages, many heads, causal prefill rows straddling a tile, paged requests, NaN codes in
// visible tokens and in tokens only later rows see.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <thread>
#include <vector>

#include "references/mla_reference.hpp"
#if defined(KVAUDIT_HAVE_CUDA)
#include "references/mla_reference_cuda.hpp"
#endif
#include "tests/gpu_skip.hpp"
#include "tests/mla_case.hpp"

namespace kvaudit {
namespace {

using testing::make_mla_case;
using testing::MlaCase;
using testing::MlaCaseSpec;
using testing::RequestShape;

struct Outputs {
  std::vector<double> out;
  std::vector<double> lse;
};

Outputs run_on(ReferenceDevice device, const MlaCase& c, const KvRows& kv) {
  const std::size_t pairs = static_cast<std::size_t>(c.step.num_rows()) * c.attrs.num_heads;
  Outputs r{std::vector<double>(pairs * c.attrs.kv_lora_rank, -12345.0),
            std::vector<double>(pairs, -12345.0)};
  const auto work = exact_reference_attention(device, c.attrs, c.step, c.tensors.q_nope,
                                              c.tensors.q_pe, kv, r.out, r.lse, 2);
  INFO((work.ok() ? std::string() : work.error().message()));
  REQUIRE(work.ok());
  return r;
}

// Per (row, head): max_d |gpu - cpu| / max_d |cpu|, and |gpu lse - cpu lse|; NaN must match.
struct Agreement {
  double out_relative = 0.0;
  double lse_excess = 0.0;  // max |gpu lse - cpu lse| / max(1e-15, spacing at the lse)
  int nan_pairs = 0;
  std::size_t elements = 0;
  std::size_t identical = 0;
  double identical_fraction() const {
    return elements == 0 ? 1.0 : static_cast<double>(identical) / static_cast<double>(elements);
  }
};

Agreement compare(const Outputs& gpu, const Outputs& cpu, int dc) {
  Agreement a;
  for (std::size_t pair = 0; pair < cpu.lse.size(); ++pair) {
    const bool nan = std::isnan(cpu.lse[pair]);
    REQUIRE(std::isnan(gpu.lse[pair]) == nan);
    double largest = 0.0;
    double deviation = 0.0;
    for (int d = 0; d < dc; ++d) {
      const double x = cpu.out[pair * dc + d];
      const double y = gpu.out[pair * dc + d];
      REQUIRE(std::isnan(x) == std::isnan(y));
      ++a.elements;
      if (x == y || (std::isnan(x) && std::isnan(y))) ++a.identical;
      if (std::isnan(x)) continue;
      largest = std::max(largest, std::abs(x));
      deviation = std::max(deviation, std::abs(x - y));
    }
    if (nan) {
      ++a.nan_pairs;
      continue;
    }
    if (deviation > 0.0) a.out_relative = std::max(a.out_relative, deviation / largest);
    const double lse = cpu.lse[pair];
    const double spacing = std::nextafter(std::abs(lse), INFINITY) - std::abs(lse);
    a.lse_excess = std::max(a.lse_excess, std::abs(gpu.lse[pair] - lse) / std::max(1e-15, spacing));
  }
  return a;
}

MlaCaseSpec spec_of(StepKind kind, int heads, int dc, int dr, int page,
                    std::vector<RequestShape> requests, std::uint32_t seed) {
  MlaCaseSpec spec;
  spec.kind = kind;
  spec.heads = heads;
  spec.dc = dc;
  spec.dr = dr;
  spec.page_size = page;
  spec.requests = std::move(requests);
  spec.kv_scale = 0.37f;
  spec.sm_scale = 0.0721687836487032;
  spec.seed = seed;
  return spec;
}

}  // namespace

TEST_CASE("GPU reference equals the CPU reference within 1e-15 on every shape it tiles",
          "[gpu][reference]") {
  KVAUDIT_REQUIRE_GPU();
  const std::vector<MlaCaseSpec> specs = {
      // decode, MLA width, 16 heads, page 64, contexts not multiples of the tiles
      spec_of(StepKind::kDecode, 16, 512, 64, 64, {{300, 1}, {1, 1}, {129, 1}, {64, 1}}, 1),
      // prefill: causal rows straddling 64-wide tiles, three heads, odd widths
      spec_of(StepKind::kPrefill, 3, 40, 9, 1, {{150, 70}, {33, 33}, {5, 2}}, 2),
      // many heads, one long request, widths below one stage
      spec_of(StepKind::kPrefill, 128, 12, 3, 16, {{200, 5}}, 3),
      // a request with no rows, one with a single row
      spec_of(StepKind::kPrefill, 2, 64, 64, 4, {{30, 0}, {17, 1}, {90, 20}}, 4),
  };
  for (const MlaCaseSpec& spec : specs) {
    const MlaCase c = make_mla_case(spec);
    INFO(c.name());
    const KvPool pool = c.pool_after;
    const KvRows kv = KvRows::from_pool(pool, c.layer.kv_scale);
    const Agreement a = compare(run_on(ReferenceDevice::kCuda, c, kv),
                                run_on(ReferenceDevice::kCpu, c, kv), spec.dc);
    CHECK(a.nan_pairs == 0);
    CHECK(a.out_relative <= 1e-15);
    CHECK(a.lse_excess <= 1.0);
    CHECK(a.identical_fraction() >= 0.999);
  }
}

TEST_CASE("GPU reference calls from two threads at once give the bits of calls one at a time",
          "[gpu][reference]") {
  // Two layers in flight call the reference at once (mla_reference_cuda.cu: up to two references,
  // each with its own stream and buffers); a call's result must not depend on what runs beside it.
  KVAUDIT_REQUIRE_GPU();
  const MlaCase a = make_mla_case(
      spec_of(StepKind::kPrefill, 16, 512, 64, 64, {{340, 40}, {190, 90}, {7, 3}}, 21));
  const MlaCase b =
      make_mla_case(spec_of(StepKind::kDecode, 16, 512, 64, 64, {{500, 1}, {129, 1}}, 22));
  const KvRows kv_a = KvRows::from_pool(a.pool_after, a.layer.kv_scale);
  const KvRows kv_b = KvRows::from_pool(b.pool_after, b.layer.kv_scale);
  const Outputs alone_a = run_on(ReferenceDevice::kCuda, a, kv_a);
  const Outputs alone_b = run_on(ReferenceDevice::kCuda, b, kv_b);
  for (int round = 0; round < 4; ++round) {
    INFO("round " << round);
    // Catch2's assertions are not thread-safe: the threads only compute, the checks run here.
    std::vector<double> out_a(alone_a.out.size()), lse_a(alone_a.lse.size());
    std::vector<double> out_b(alone_b.out.size()), lse_b(alone_b.lse.size());
    bool ok_a = false, ok_b = false;
    std::thread other([&] {
      ok_a = exact_reference_attention(ReferenceDevice::kCuda, a.attrs, a.step, a.tensors.q_nope,
                                       a.tensors.q_pe, kv_a, out_a, lse_a, 2)
                 .ok();
    });
    ok_b = exact_reference_attention(ReferenceDevice::kCuda, b.attrs, b.step, b.tensors.q_nope,
                                     b.tensors.q_pe, kv_b, out_b, lse_b, 2)
               .ok();
    other.join();
    REQUIRE(ok_a);
    REQUIRE(ok_b);
    CHECK(std::memcmp(out_a.data(), alone_a.out.data(), out_a.size() * sizeof(double)) == 0);
    CHECK(std::memcmp(lse_a.data(), alone_a.lse.data(), lse_a.size() * sizeof(double)) == 0);
    CHECK(std::memcmp(out_b.data(), alone_b.out.data(), out_b.size() * sizeof(double)) == 0);
    CHECK(std::memcmp(lse_b.data(), alone_b.lse.data(), lse_b.size() * sizeof(double)) == 0);
  }
}

TEST_CASE("GPU reference agrees with 50 digits at full MLA width", "[gpu][reference]") {
  KVAUDIT_REQUIRE_GPU();
  const MlaCase c =
      make_mla_case(spec_of(StepKind::kPrefill, 4, 512, 64, 8, {{260, 67}, {40, 3}}, 11));
  const KvPool pool = c.pool_after;
  const KvRows kv = KvRows::from_pool(pool, c.layer.kv_scale);
  const Outputs gpu = run_on(ReferenceDevice::kCuda, c, kv);
  Outputs exact{std::vector<double>(gpu.out.size()), std::vector<double>(gpu.lse.size())};
  REQUIRE(mla_reference_attention<Float50>(c.attrs, c.step, c.tensors.q_nope, c.tensors.q_pe, kv,
                                           exact.out, exact.lse, 2)
              .ok());
  const Agreement a = compare(gpu, exact, c.attrs.kv_lora_rank);
  CHECK(a.out_relative <= 1e-15);
  CHECK(a.lse_excess <= 1.0);
  CHECK(a.identical_fraction() >= 0.999);
}

TEST_CASE("GPU reference: NaN where a row sees a NaN code, nowhere else", "[gpu][reference]") {
  KVAUDIT_REQUIRE_GPU();
  // One prefill request of 100 tokens, 80 new rows: put a NaN code into the latent part of token
  // 50. Rows at positions >= 50 see it (NaN); rows before it must not (it is in their future).
  MlaCase c = make_mla_case(spec_of(StepKind::kPrefill, 2, 96, 16, 1, {{100, 80}}, 5));
  KvPool pool = c.pool_after;
  const std::int64_t slot = c.step.slot_of(0, 50, 1);
  pool.row(slot)[7] = kE4m3NanCode;
  const KvRows kv = KvRows::from_pool(pool, c.layer.kv_scale);
  const Outputs gpu = run_on(ReferenceDevice::kCuda, c, kv);
  const Outputs cpu = run_on(ReferenceDevice::kCpu, c, kv);
  const Agreement a = compare(gpu, cpu, c.attrs.kv_lora_rank);
  // Rows are positions 20..99; those at 50..99 (50 rows x 2 heads) are NaN.
  CHECK(a.nan_pairs == 50 * 2);
  for (int row = 0; row < 30; ++row) CHECK_FALSE(std::isnan(gpu.lse[row * 2]));
  CHECK(a.out_relative <= 1e-15);
  CHECK(a.lse_excess <= 1.0);
  CHECK(a.identical_fraction() >= 0.999);
}

#if defined(KVAUDIT_HAVE_CUDA)
namespace {

// q as float32 with a 24-bit significand and exponents spread over [low, high): a query the
// sliced scores cut into several slices (bf16 q fits one).
void spread_queries(MlaCase& c, int low, int high, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> significand(1.0f, 2.0f);
  std::uniform_int_distribution<int> exponent(low, high - 1);
  auto spread = [&](std::vector<float>& q) {
    for (float& v : q) v = (rng() % 2 ? -1.0f : 1.0f) * std::ldexp(significand(rng), exponent(rng));
  };
  spread(c.tensors.q_nope);
  spread(c.tensors.q_pe);
}

// Runs the case on both references and returns which kernels the GPU ran (the change in
// gpu_reference_kernels()); the outputs must meet the file's bounds.
GpuReferenceKernels run_and_compare(const MlaCase& c, int expected_nan_pairs) {
  const KvRows kv = KvRows::from_pool(c.pool_after, c.layer.kv_scale);
  const GpuReferenceKernels before = gpu_reference_kernels();
  const Outputs gpu = run_on(ReferenceDevice::kCuda, c, kv);
  GpuReferenceKernels ran = gpu_reference_kernels();
  for (std::size_t k = 0; k < ran.score_batches.size(); ++k) {
    ran.score_batches[k] -= before.score_batches[k];
  }
  for (std::size_t k = 0; k < ran.value_batches.size(); ++k) {
    ran.value_batches[k] -= before.value_batches[k];
  }
  const Agreement a = compare(gpu, run_on(ReferenceDevice::kCpu, c, kv), c.attrs.kv_lora_rank);
  CHECK(a.nan_pairs == expected_nan_pairs);
  CHECK(a.out_relative <= 1e-15);
  CHECK(a.lse_excess <= 1.0);
  CHECK(a.identical_fraction() >= 0.999);
  return ran;
}

long long sliced(const auto& batches) {
  long long total = 0;
  for (std::size_t k = 1; k < batches.size(); ++k) total += batches[k];
  return total;
}

}  // namespace

TEST_CASE(
    "GPU reference slices q and the weights exactly as the CPU does and sends other "
    "batches to the compensated kernels",
    "[gpu][reference]") {
  KVAUDIT_REQUIRE_GPU();
  // The sliced kernels are the default (mla_reference_cuda.cu, slicing_allowed): a setting left in
  // the environment must not turn them off here.
  struct SlicingDefault {
    SlicingDefault() { unsetenv("KVAUDIT_GPU_REFERENCE_SLICING"); }
    ~SlicingDefault() { unsetenv("KVAUDIT_GPU_REFERENCE_SLICING"); }
  } slicing_default;
  const MlaCaseSpec spec =
      spec_of(StepKind::kPrefill, 4, 512, 64, 16, {{200, 40}, {90, 1}, {64, 64}}, 21);
  SECTION("bf16 q: one or two slices of q, sliced weights, no compensated batch") {
    const GpuReferenceKernels ran = run_and_compare(make_mla_case(spec), 0);
    CHECK(ran.score_batches[0] == 0);
    CHECK(ran.score_batches[1] + ran.score_batches[2] >= 1);
    CHECK(ran.value_batches[0] == 0);
    CHECK(sliced(ran.value_batches) >= 1);
  }
  SECTION("float32 q over 40 binades: three or four slices of q") {
    MlaCase c = make_mla_case(spec);
    spread_queries(c, -36, 4, 5);
    const GpuReferenceKernels ran = run_and_compare(c, 0);
    CHECK(ran.score_batches[0] == 0);
    CHECK(ran.score_batches[3] + ran.score_batches[4] >= 1);
  }
  SECTION("float32 q over 110 binades: more than four slices, the compensated scores") {
    MlaCase c = make_mla_case(spec);
    spread_queries(c, -106, 4, 6);
    const GpuReferenceKernels ran = run_and_compare(c, 0);
    CHECK(ran.score_batches[0] >= 1);
    CHECK(sliced(ran.score_batches) == 0);
  }
  SECTION("weights spanning more than 5 slices: the compensated P.V") {
    MlaCase c = make_mla_case(spec);
    for (float& v : c.tensors.q_nope) v *= 64.0f;  // scores spread over hundreds: tiny weights
    const GpuReferenceKernels ran = run_and_compare(c, 0);
    CHECK(ran.value_batches[0] >= 1);
  }
  SECTION("KVAUDIT_GPU_REFERENCE_SLICING=off: the compensated kernels alone") {
    setenv("KVAUDIT_GPU_REFERENCE_SLICING", "off", 1);
    const GpuReferenceKernels ran = run_and_compare(make_mla_case(spec), 0);
    CHECK(ran.score_batches[0] >= 1);
    CHECK(sliced(ran.score_batches) == 0);
    CHECK(ran.value_batches[0] >= 1);
    CHECK(sliced(ran.value_batches) == 0);
  }
  SECTION("a NaN in one query: that (row, head) is NaN, the batch takes the compensated scores") {
    MlaCase c = make_mla_case(spec);
    c.tensors.q_pe[5] = std::numeric_limits<float>::quiet_NaN();  // row 0, head 0
    const GpuReferenceKernels ran = run_and_compare(c, 1);
    CHECK(ran.score_batches[0] >= 1);
  }
}
#endif

TEST_CASE("GPU reference is unavailable in a build without CUDA, with the reason", "[reference]") {
  if (reference_device_built(ReferenceDevice::kCuda)) {
    CHECK(reference_device_name(ReferenceDevice::kCuda) == "cuda");
    return;  // the [gpu] cases above cover a CUDA build
  }
  const MlaCase c = make_mla_case(MlaCaseSpec{});
  const KvPool pool = c.pool_after;
  const KvRows kv = KvRows::from_pool(pool, c.layer.kv_scale);
  std::vector<double> out(static_cast<std::size_t>(c.step.num_rows()) * c.attrs.num_heads *
                          c.attrs.kv_lora_rank);
  std::vector<double> lse(static_cast<std::size_t>(c.step.num_rows()) * c.attrs.num_heads);
  const auto work = exact_reference_attention(ReferenceDevice::kCuda, c.attrs, c.step,
                                              c.tensors.q_nope, c.tensors.q_pe, kv, out, lse);
  REQUIRE_FALSE(work.ok());
  CHECK(work.error().kind == ErrorKind::kUnsupported);
  CHECK_THAT(work.error().what, Catch::Contains("without CUDA"));
}

}  // namespace kvaudit
