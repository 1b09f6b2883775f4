// Tests of the high-precision MLA reference (references/mla_reference.hpp).
//
// Targets (docs/design.md "Numerics"): relative error <= 1e-15 on out, absolute <= 1e-15 on lse,
// the result being a double. Both are checked by comparing evaluations at different precisions
// (Boost cpp_bin_float at 50 and 100 digits, and the double-double default), plus hand-checkable
// cases whose expected values are written down independently of the code under test.
#include <boost/multiprecision/cpp_bin_float.hpp>
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <iostream>
#include <limits>
#include <vector>

#include "references/mla_reference.hpp"
#include "tests/mla_case.hpp"

namespace kvaudit {
namespace {

using testing::make_mla_case;
using testing::MlaCase;
using testing::MlaCaseSpec;

struct RefResult {
  std::vector<double> out;
  std::vector<double> lse;
  std::int64_t work = 0;
};

template <class Acc>
RefResult run_reference(const DumpAttributes& attrs, const StepMeta& step,
                        const StepLayerTensors& tensors, const KvRows& kv, int threads = 2) {
  RefResult r;
  const std::size_t pairs = static_cast<std::size_t>(step.num_rows()) * attrs.num_heads;
  r.out.assign(pairs * attrs.kv_lora_rank, -12345.0);
  r.lse.assign(pairs, -12345.0);
  auto work = mla_reference_attention<Acc>(attrs, step, tensors.q_nope, tensors.q_pe, kv, r.out,
                                           r.lse, threads);
  REQUIRE(work.ok());
  r.work = *work;
  return r;
}

template <class Acc>
RefResult run_reference(const MlaCase& c, int threads = 2) {
  const KvRows kv = KvRows::from_pool(c.pool_after, c.layer.kv_scale);
  return run_reference<Acc>(c.attrs, c.step, c.tensors, kv, threads);
}

// Largest elementwise |a - b| / |b| over out (b = 0 requires a = 0) and largest |a - b| on lse.
struct Distance {
  double out_rel = 0.0;
  double lse_abs = 0.0;
};

Distance distance(const RefResult& a, const RefResult& b) {
  Distance d;
  REQUIRE(a.out.size() == b.out.size());
  for (std::size_t k = 0; k < a.out.size(); ++k) {
    REQUIRE(std::isfinite(a.out[k]));
    REQUIRE(std::isfinite(b.out[k]));
    const double diff = std::abs(a.out[k] - b.out[k]);
    d.out_rel = std::max(d.out_rel,
                         b.out[k] == 0.0 ? (diff == 0.0 ? 0.0 : 1.0) : diff / std::abs(b.out[k]));
  }
  for (std::size_t k = 0; k < a.lse.size(); ++k) {
    REQUIRE(std::isfinite(a.lse[k]));
    d.lse_abs = std::max(d.lse_abs, std::abs(a.lse[k] - b.lse[k]));
  }
  return d;
}

// lse values in these cases stay below 4, where a double's spacing is 2^-51 < 1e-15, so the
// target 1e-15 is meaningful after the final rounding.
void require_lse_below_4(const RefResult& r) {
  for (const double v : r.lse) REQUIRE(std::abs(v) < 4.0);
}

// A step where every score is ~ sm_scale * q_pe . r = 1000 plus an O(1) part from q_nope . c:
// weights of comparable size, scores whose rounding in double (~1000 * 2^-53) is visible.
MlaCase large_score_case() {
  MlaCaseSpec spec;
  spec.heads = 2;
  spec.dc = 16;
  spec.dr = 8;
  spec.page_size = 4;
  spec.sm_scale = 0.07;  // not a short binary fraction, so products with it round in double
  spec.kv_scale = 0.37f;
  spec.requests = {{40, 2}, {7, 1}};
  spec.seed = 7;
  MlaCase c = make_mla_case(spec);
  // Every token's r is 16 (5.92 after kv_scale) and q_pe ~ 300, so every score is
  // 0.07 * 8 * 300 * 5.92 ~ 1000 plus an O(1) part from q_nope . c.
  KvPool& pool = c.pool;
  for (std::int64_t s = 0; s < pool.num_slots; ++s) {
    if (e4m3_is_nan(pool.row(s)[0])) continue;
    for (int j = spec.dc; j < spec.dc + spec.dr; ++j) pool.row(s)[j] = e4m3_encode(16.0f);
  }
  for (std::size_t i = 0; i < c.tensors.new_kv.size(); ++i) {
    if (static_cast<int>(i % (spec.dc + spec.dr)) >= spec.dc) c.tensors.new_kv[i] = 5.90625f;
  }
  for (auto& v : c.tensors.q_pe) v = bf16_round(300.0f + 4.0f * v);
  c.pool_after = c.written_pool();  // the edited pool and new_kv, written
  return c;
}

TEST_CASE("double-double constants and exp/log agree with Boost at 50 digits", "[reference]") {
  using Boost50 = boost::multiprecision::cpp_bin_float_50;
  const Boost50 ln2 = boost::multiprecision::log(Boost50(2));
  const Boost50 err = abs(Boost50(dd::kLn2.hi) + Boost50(dd::kLn2.lo) - ln2);
  CHECK(static_cast<double>(err) < 1e-32);
  for (const double x : {-600.5, -37.25, -1.0, -0.3466, -1e-9, 0.0, 2e-17, 0.5, 3.75, 80.0}) {
    const dd::DoubleDouble arg{x, x * 1e-17};
    const dd::DoubleDouble e = dd::exp(arg);
    const Boost50 exact = boost::multiprecision::exp(Boost50(arg.hi) + Boost50(arg.lo));
    const Boost50 rel = abs((Boost50(e.hi) + Boost50(e.lo)) / exact - 1);
    INFO("exp(" << x << ")");
    CHECK(static_cast<double>(rel) < 1e-29);
  }
  for (const double x : {1.0, 1.0 + 1e-16, 1.5, 2.75, 64.0, 4096.5, 1e-3}) {
    const dd::DoubleDouble arg{x, x * 3e-17};
    const dd::DoubleDouble l = dd::log(arg);
    const Boost50 exact = boost::multiprecision::log(Boost50(arg.hi) + Boost50(arg.lo));
    INFO("log(" << x << ")");
    CHECK(static_cast<double>(abs(Boost50(l.hi) + Boost50(l.lo) - exact)) < 1e-30);
  }
}

TEST_CASE("reference at 50 and 100 digits agree to 1e-15 - the default agrees with both",
          "[reference]") {
  for (const int page_size : {1, 4}) {
    MlaCaseSpec spec;
    spec.page_size = page_size;
    spec.kv_scale = 0.37f;
    spec.sm_scale = 0.15;
    spec.requests = {{9, 3}, {0, 0}, {5, 1}};
    const MlaCase c = make_mla_case(spec);
    INFO(c.name());
    const RefResult r50 = run_reference<Float50>(c);
    const RefResult r100 = run_reference<Float100>(c);
    const RefResult rdd = run_reference<dd::DoubleDouble>(c);
    require_lse_below_4(r100);
    const Distance d50 = distance(r50, r100);
    CHECK(d50.out_rel <= 1e-15);
    CHECK(d50.lse_abs <= 1e-15);
    const Distance ddd = distance(rdd, r100);
    CHECK(ddd.out_rel <= 1e-15);
    CHECK(ddd.lse_abs <= 1e-15);
  }
}

TEST_CASE("reference at full MLA width (512 + 64) agrees with 100 digits", "[reference]") {
  MlaCaseSpec spec;
  spec.heads = 2;
  spec.dc = 512;
  spec.dr = 64;
  spec.page_size = 64;
  spec.sm_scale = 1.0 / std::sqrt(192.0);
  spec.kv_scale = 0.0213f;
  spec.kv_range = 2.0f;
  spec.requests = {{3, 2}};
  spec.seed = 3;
  const MlaCase c = make_mla_case(spec);
  INFO(c.name());
  const RefResult r100 = run_reference<Float100>(c);
  const RefResult rdd = run_reference<dd::DoubleDouble>(c);
  require_lse_below_4(r100);
  const Distance d = distance(rdd, r100);
  CHECK(d.out_rel <= 1e-15);
  CHECK(d.lse_abs <= 1e-15);
}

TEST_CASE("large scores: the default meets 1e-15 where plain double does not", "[reference]") {
  const MlaCase c = large_score_case();
  INFO(c.name());
  const RefResult r100 = run_reference<Float100>(c);
  const RefResult rdd = run_reference<dd::DoubleDouble>(c);
  const RefResult r64 = run_reference<double>(c);
  // lse ~ 1000 here: compare it relative to its size (ulp(1000) = 1.1e-13).
  double lse_max = 0.0;
  for (const double v : r100.lse) lse_max = std::max(lse_max, std::abs(v));
  REQUIRE(lse_max > 500.0);
  const Distance dd_dist = distance(rdd, r100);
  const Distance double_dist = distance(r64, r100);
  CHECK(dd_dist.out_rel <= 1e-15);
  CHECK(dd_dist.lse_abs <= 2.0 * std::numeric_limits<double>::epsilon() * lse_max);
  // The naive double evaluation loses ~1000 * 2^-53 ~ 1e-13 in the scores: the test can tell.
  CHECK(double_dist.out_rel > 1e-14);
}

// One request, one decode row over `codes` (token-major [n, Dc + Dr]), page_size 1 at slots
// 0..n-1; q given.
struct HandCase {
  DumpAttributes attrs;
  StepMeta step;
  StepLayerTensors tensors;
  KvPool pool;
};

HandCase hand_case(int dc, int dr, double sm_scale, const std::vector<std::vector<float>>& rows,
                   std::vector<float> q_nope, std::vector<float> q_pe) {
  HandCase h;
  h.attrs.num_heads = 1;
  h.attrs.kv_lora_rank = dc;
  h.attrs.qk_rope_head_dim = dr;
  h.attrs.sm_scale = sm_scale;
  h.attrs.page_size = 1;
  const int n = static_cast<int>(rows.size());
  h.step.group = "S000";
  h.step.kind = StepKind::kDecode;
  h.step.qo_indptr = {0, 1};
  h.step.kv_indptr = {0, n};
  for (int t = 0; t < n; ++t) h.step.kv_indices.push_back(t);
  h.step.kv_last_page_len = {1};
  h.step.new_kv_slots = {n - 1};
  h.pool = KvPool::zeros(KvDtype::kFloat8E4m3fn, n, dc + dr);
  for (int t = 0; t < n; ++t) {
    for (int j = 0; j < dc + dr; ++j) {
      h.pool.row(t)[j] = e4m3_encode(rows[t][j]);
      REQUIRE(e4m3_decode(h.pool.row(t)[j]) == rows[t][j]);  // hand values are e4m3 values
    }
  }
  h.tensors.q_nope = std::move(q_nope);
  h.tensors.q_pe = std::move(q_pe);
  return h;
}

TEST_CASE("one visible token: out = its value, lse = its score", "[reference]") {
  // s = 0.125 * 0.375 * (1*1 + 0.5*1 + 0.25*1) = 0.08203125 exactly.
  const HandCase h =
      hand_case(4, 2, 0.125, {{1.0f, -2.0f, 0.5f, 3.0f, 1.0f, 1.0f}}, {1, 0, 0, 0}, {0.5f, 0.25f});
  const KvRows kv = KvRows::from_pool(h.pool, 0.375f);
  const RefResult r = run_reference<dd::DoubleDouble>(h.attrs, h.step, h.tensors, kv, 1);
  CHECK(r.out == std::vector<double>{0.375, -0.75, 0.1875, 1.125});
  CHECK(r.lse == std::vector<double>{0.08203125});
  CHECK(r.work == 1);
  const RefResult r50 = run_reference<Float50>(h.attrs, h.step, h.tensors, kv, 1);
  CHECK(r50.out == r.out);
  CHECK(r50.lse == r.lse);
}

TEST_CASE("identical keys: uniform weights, out = mean, lse = s + ln n", "[reference]") {
  // q_nope = 0, so every score is sm_scale * q_pe . r = 0.5 * (2 * 1.5) = 1.5.
  const HandCase h =
      hand_case(2, 1, 0.5, {{1.0f, -8.0f, 1.5f}, {2.0f, 0.5f, 1.5f}, {4.0f, 3.0f, 1.5f}},
                {0.0f, 0.0f}, {2.0f});
  const KvRows kv = KvRows::from_pool(h.pool, 1.0f);
  for (const bool precise : {true, false}) {
    const RefResult r = precise ? run_reference<dd::DoubleDouble>(h.attrs, h.step, h.tensors, kv)
                                : run_reference<Float100>(h.attrs, h.step, h.tensors, kv);
    CHECK(r.out[0] == 7.0 / 3.0);   // correctly rounded mean
    CHECK(r.out[1] == -4.5 / 3.0);  // -1.5 exactly
    CHECK(std::abs(r.lse[0] - (1.5 + std::log(3.0))) <= 1e-15);
    CHECK(r.work == 3);
  }
}

TEST_CASE("one dominant score: out and lse match the closed form", "[reference]") {
  // Scores 0 (token 0) and 30 (token 1): w0 = 1 / (1 + e^30).
  const HandCase h =
      hand_case(2, 1, 1.0, {{3.0f, -1.0f, 0.0f}, {-2.0f, 0.25f, 15.0f}}, {0.0f, 0.0f}, {2.0f});
  const KvRows kv = KvRows::from_pool(h.pool, 1.0f);
  const RefResult r = run_reference<dd::DoubleDouble>(h.attrs, h.step, h.tensors, kv);
  const double w0 = 1.0 / (1.0 + std::exp(30.0));
  const double expected0 = -2.0 + (3.0 - -2.0) * w0;
  const double expected1 = 0.25 + (-1.0 - 0.25) * w0;
  CHECK(std::abs(r.out[0] - expected0) <= 1e-15 * std::abs(expected0));
  CHECK(std::abs(r.out[1] - expected1) <= 1e-15 * std::abs(expected1));
  CHECK(r.out[0] != -2.0);  // the small weight is not lost
  CHECK(std::abs(r.lse[0] - (30.0 + std::log1p(std::exp(-30.0)))) <= 1e-14);
}

TEST_CASE("causal prefill: each row sees exactly the positions up to its own", "[reference]") {
  MlaCaseSpec spec;
  spec.page_size = 2;
  spec.requests = {{6, 4}};
  spec.seed = 11;
  const MlaCase c = make_mla_case(spec);
  const KvPool pool = c.pool_after;
  const KvRows kv = KvRows::from_pool(pool, c.layer.kv_scale);
  const RefResult all = run_reference<dd::DoubleDouble>(c.attrs, c.step, c.tensors, kv);
  CHECK(all.work == (3 + 4 + 5 + 6) * spec.heads);
  const int dc = spec.dc;
  const int heads = spec.heads;
  // Row j as a decode of a request cut at its position: the same pages, kv_len = position + 1.
  for (int row = 0; row < 4; ++row) {
    const int len = 3 + row;
    StepMeta cut;
    cut.group = "S000";
    cut.kind = StepKind::kDecode;
    cut.qo_indptr = {0, 1};
    const int pages = (len + 1) / 2;
    cut.kv_indices.assign(c.step.kv_indices.begin(), c.step.kv_indices.begin() + pages);
    cut.kv_indptr = {0, pages};
    cut.kv_last_page_len = {len - (pages - 1) * 2};
    cut.new_kv_slots = {c.step.new_kv_slots[row]};
    StepLayerTensors t;
    t.q_nope.assign(c.tensors.q_nope.begin() + row * heads * dc,
                    c.tensors.q_nope.begin() + (row + 1) * heads * dc);
    t.q_pe.assign(c.tensors.q_pe.begin() + row * heads * spec.dr,
                  c.tensors.q_pe.begin() + (row + 1) * heads * spec.dr);
    const RefResult one = run_reference<dd::DoubleDouble>(c.attrs, cut, t, kv);
    INFO("row " << row);
    CHECK(std::equal(one.out.begin(), one.out.end(), all.out.begin() + row * heads * dc));
    CHECK(std::equal(one.lse.begin(), one.lse.end(), all.lse.begin() + row * heads));
  }
  // And it matters: the last row differs from the first.
  CHECK(!std::equal(all.out.begin(), all.out.begin() + dc, all.out.begin() + 3 * heads * dc));
}

TEST_CASE("paged layout: page 64 with scattered pages equals page 1 with shuffled slots",
          "[reference]") {
  MlaCaseSpec spec;
  spec.kind = StepKind::kDecode;
  spec.heads = 2;
  spec.dc = 512;
  spec.dr = 64;
  spec.page_size = 64;
  spec.sm_scale = 0.07;
  spec.kv_scale = 0.5f;
  spec.requests = {{130, 1}, {64, 1}, {1, 1}};
  spec.spare_pages = 4;
  const MlaCase c = make_mla_case(spec);
  INFO(c.name());
  const KvPool pool64 = c.pool_after;
  // Unused slots and the last pages' tails hold NaN codes; they must not be read.
  const RefResult paged =
      run_reference<dd::DoubleDouble>(c.attrs, c.step, c.tensors, KvRows::from_pool(pool64, 0.5f));
  // The same token rows at a random permutation of slots, page_size 1.
  DumpAttributes attrs1 = c.attrs;
  attrs1.page_size = 1;
  StepMeta step1 = c.step;
  step1.kv_indices.clear();
  step1.kv_indptr = {0};
  step1.kv_last_page_len.clear();
  const int total = 130 + 64 + 1;
  std::vector<int> perm(total + 5);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937(5));
  KvPool pool1 = KvPool::zeros(KvDtype::kFloat8E4m3fn, total + 5, 576);
  int next = 0;
  for (int b = 0; b < 3; ++b) {
    for (std::int64_t p = 0; p < c.step.kv_len(b, 64); ++p) {
      const int slot = perm[next++];
      std::copy_n(pool64.row(c.step.slot_of(b, p, 64)), 576, pool1.row(slot));
      step1.kv_indices.push_back(slot);
    }
    step1.kv_indptr.push_back(static_cast<std::int32_t>(step1.kv_indices.size()));
    step1.kv_last_page_len.push_back(1);
    step1.new_kv_slots[b] = step1.kv_indices.back();
  }
  const RefResult flat =
      run_reference<dd::DoubleDouble>(attrs1, step1, c.tensors, KvRows::from_pool(pool1, 0.5f));
  CHECK(paged.out == flat.out);
  CHECK(paged.lse == flat.lse);
  CHECK(paged.work == (130 + 64 + 1) * 2);
  for (const double v : paged.out) REQUIRE(std::isfinite(v));
}

TEST_CASE("a request with no rows is skipped, pages or not", "[reference]") {
  MlaCaseSpec with;
  with.requests = {{5, 2}, {7, 0}, {4, 1}, {0, 0}};
  with.seed = 21;
  MlaCase c = make_mla_case(with);
  KvPool pool = c.pool_after;
  // The skipped request's pages hold NaN codes: reading them would show.
  for (int p = c.step.kv_indptr[1]; p < c.step.kv_indptr[2]; ++p) {
    for (int o = 0; o < with.page_size; ++o) {
      std::fill_n(pool.row(c.step.kv_indices[p] * with.page_size + o), pool.row_width,
                  kE4m3NanCode);
    }
  }
  const KvRows kv = KvRows::from_pool(pool, c.layer.kv_scale);
  const RefResult r = run_reference<dd::DoubleDouble>(c.attrs, c.step, c.tensors, kv);
  // The same step without the empty requests.
  StepMeta without = c.step;
  without.qo_indptr = {0, 2, 3};
  without.kv_indptr = {0, c.step.kv_indptr[1], c.step.kv_indptr[1] + 4};
  without.kv_indices.clear();
  for (int p = 0; p < c.step.kv_indptr[1]; ++p) without.kv_indices.push_back(c.step.kv_indices[p]);
  for (int p = c.step.kv_indptr[2]; p < c.step.kv_indptr[3]; ++p) {
    without.kv_indices.push_back(c.step.kv_indices[p]);
  }
  without.kv_last_page_len = {1, 1};
  const RefResult r2 = run_reference<dd::DoubleDouble>(c.attrs, without, c.tensors, kv);
  CHECK(r.out == r2.out);
  CHECK(r.lse == r2.lse);
  CHECK(r.work == (4 + 5 + 4) * with.heads);
  for (const double v : r.out) REQUIRE(std::isfinite(v));
}

TEST_CASE("NaN codes in visible slots give NaN - elsewhere they do not leak", "[reference]") {
  MlaCaseSpec spec;
  spec.requests = {{6, 1}, {3, 1}};
  spec.kind = StepKind::kDecode;
  spec.seed = 4;
  const MlaCase c = make_mla_case(spec);  // unused slots hold NaN codes
  KvPool pool = c.pool_after;
  pool.row(c.step.slot_of(0, 2, 1))[5] = 0xFF;  // request 0, position 2, a ckv column
  const KvRows kv = KvRows::from_pool(pool, 1.0f);
  const RefResult r = run_reference<dd::DoubleDouble>(c.attrs, c.step, c.tensors, kv);
  const std::size_t per_row = static_cast<std::size_t>(spec.heads) * spec.dc;
  for (std::size_t k = 0; k < per_row; ++k) CHECK(std::isnan(r.out[k]));
  for (std::size_t k = per_row; k < 2 * per_row; ++k) CHECK(std::isfinite(r.out[k]));
  CHECK(std::isnan(r.lse[0]));
  CHECK(std::isfinite(r.lse[spec.heads]));
}

TEST_CASE("KvRows decode codes exactly and keep kv_scale apart", "[reference]") {
  KvPool pool = KvPool::zeros(KvDtype::kFloat8E4m3fn, 3, 4);
  const std::uint8_t codes[3][4] = {{0x38, 0xB8, 0x7E, 0x01}, {0x7F, 0x00, 0x80, 0x40}, {}};
  for (int s = 0; s < 3; ++s) std::copy_n(codes[s], 4, pool.row(s));
  const KvRows all = KvRows::from_pool(pool, 0.3f);
  CHECK(all.scale() == static_cast<double>(0.3f));
  CHECK(all.row(0)[0] == 1.0f);
  CHECK(all.row(0)[1] == -1.0f);
  CHECK(all.row(0)[2] == 448.0f);
  CHECK(all.row(0)[3] == 0.001953125f);  // 2^-9, smallest subnormal
  CHECK(std::isnan(all.row(1)[0]));
  CHECK(all.row(1)[3] == 2.0f);
  CHECK(all.row(3) == nullptr);
  const std::vector<std::int64_t> some = {2, 0};
  const KvRows part = KvRows::from_pool_slots(pool, 0.3f, some);
  CHECK(part.row(1) == nullptr);
  REQUIRE(part.row(0) != nullptr);
  CHECK(part.row(0)[2] == 448.0f);
  KvPool bf = KvPool::zeros(KvDtype::kBfloat16, 1, 2);
  bf.set_bf16_bits(0, 0, 0x3FC0);  // 1.5
  bf.set_bf16_bits(0, 1, 0xC120);  // -10
  const KvRows bfr = KvRows::from_pool(bf, 1.0f);
  CHECK(bfr.row(0)[0] == 1.5f);
  CHECK(bfr.row(0)[1] == -10.0f);
}

TEST_CASE("KvRows from source values, and the slots a step sees", "[reference]") {
  const std::vector<float> values = {1.0f, 2.0f, 3.0f, -4.0f, 5.5f, 6.0f};  // [3, 2]
  const KvRows rows = KvRows::from_values(values, 2, 0.5);
  CHECK(rows.num_slots() == 3);
  CHECK(rows.scale() == 0.5);
  REQUIRE(rows.row(1) != nullptr);
  CHECK(rows.row(1)[1] == -4.0f);
  CHECK(rows.row(3) == nullptr);
  CHECK(rows.row(-1) == nullptr);

  // Page 2: request 0 has pages {3, 0} and 3 tokens (slots 6, 7, 0), one row; request 1 has page
  // 1 but no rows (skipped); request 2 has page 2, 1 token (slot 4), one row.
  StepMeta step;
  step.group = "S000";
  step.qo_indptr = {0, 1, 1, 2};
  step.kv_indptr = {0, 2, 3, 4};
  step.kv_indices = {3, 0, 1, 2};
  step.kv_last_page_len = {1, 2, 1};
  step.new_kv_slots = {0, 4};
  CHECK(check_step_indices(step, 2, 8).ok());
  CHECK(visible_slots(step, 2) == std::vector<std::int64_t>{0, 4, 6, 7});
  CHECK(!check_step_indices(step, 2, 6).ok());  // page 3 is outside a 6-slot pool
  StepMeta too_many_rows = step;
  too_many_rows.qo_indptr = {0, 4, 4, 5};
  too_many_rows.new_kv_slots = {0, 0, 0, 0, 4};
  CHECK(!check_step_indices(too_many_rows, 2, 8).ok());  // 4 rows, 3 tokens
}

TEST_CASE("reference refuses inconsistent sizes and indices", "[reference]") {
  const MlaCase c = make_mla_case(MlaCaseSpec{});
  const KvPool pool = c.pool_after;
  const KvRows kv = KvRows::from_pool(pool, 1.0f);
  std::vector<double> out(c.tensors.q_nope.size()),
      lse(c.tensors.q_nope.size() / c.attrs.kv_lora_rank);
  CHECK(mla_reference_attention(c.attrs, c.step, c.tensors.q_nope, c.tensors.q_pe, kv, out, lse)
            .ok());
  std::vector<double> short_out(out.size() - 1);
  CHECK(!mla_reference_attention(c.attrs, c.step, c.tensors.q_nope, c.tensors.q_pe, kv, short_out,
                                 lse)
             .ok());
  StepMeta bad = c.step;
  bad.kv_indices[0] = 1000;
  const auto r =
      mla_reference_attention(c.attrs, bad, c.tensors.q_nope, c.tensors.q_pe, kv, out, lse);
  REQUIRE(!r.ok());
  CHECK(r.error().what.find("1000") != std::string::npos);
  const std::vector<std::int64_t> none;
  const KvRows empty = KvRows::from_pool_slots(pool, 1.0f, none);
  CHECK(!mla_reference_attention(c.attrs, c.step, c.tensors.q_nope, c.tensors.q_pe, empty, out, lse)
             .ok());
}

// Not run by default: prints the default reference's throughput at full MLA width.
TEST_CASE("reference throughput (rows*heads*tokens per second)", "[.][benchmark][reference]") {
  MlaCaseSpec spec;
  spec.kind = StepKind::kDecode;
  spec.heads = 16;
  spec.dc = 512;
  spec.dr = 64;
  spec.page_size = 64;
  spec.sm_scale = 1.0 / std::sqrt(192.0);
  spec.requests = {{2048, 1}, {1024, 1}};
  const MlaCase c = make_mla_case(spec);
  const KvPool pool = c.pool_after;
  const KvRows kv = KvRows::from_pool(pool, c.layer.kv_scale);
  const auto start = std::chrono::steady_clock::now();
  const RefResult r = run_reference<dd::DoubleDouble>(c.attrs, c.step, c.tensors, kv, 0);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << c.name() << ": " << r.work << " rows*heads*tokens in " << seconds
            << " s = " << r.work / seconds << " per second\n";
  CHECK(r.work == (2048 + 1024) * 16);
}

}  // namespace
}  // namespace kvaudit
