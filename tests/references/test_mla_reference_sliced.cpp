// Adversarial inputs for the exact reference's sliced path (references/mla_reference.cpp, "Exact
// slicing") and for the compensated path it falls back to, against an oracle written here in
// Boost cpp_bin_float_100 (independent of the code under test).
//
// The check is the guarantee of references/mla_reference.hpp itself, not a loose tolerance: each
// out[i,h,d] is a double nearest the truth up to delta = 2^-80 * scale * sum_t p_t |c_t[d]| (p_t
// the softmax weights), i.e. |out - truth| <= ulp(out) / 2 + delta, and each lse is within half an
// ulp + 2^-80. An error of 2^-62 relative (one weight slice too few) flips roundings and fails.
#include <boost/multiprecision/cpp_bin_float.hpp>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <iomanip>
#include <limits>
#include <random>
#include <vector>

#include "references/mla_reference.hpp"
#include "src/core/cpu_clones.hpp"
#include "src/core/fp8_e4m3.hpp"

namespace kvaudit {
namespace {

using Big = boost::multiprecision::cpp_bin_float_100;

constexpr int kDc = 512;
constexpr int kDr = 64;
constexpr int kWidth = kDc + kDr;

// B requests of n tokens each, one decode row per request (position n - 1), page size 1, request
// b's tokens at slots b * n .. b * n + n - 1; KV rows given as floats (row-major [B * n, width]).
struct SlicedCase {
  DumpAttributes attrs;
  StepMeta step;
  std::vector<float> q_nope;   // [B, H, Dc]
  std::vector<float> q_pe;     // [B, H, Dr]
  std::vector<float> rows;     // [B * n, width]
  std::vector<float> rows_lo;  // empty, or the residuals of `rows` (grouped pools)
  double scale = 1.0;
  int tokens = 0;
};

// (dc, dr: other widths than GLM-5's 512 + 64 reach the loops' tails; the oracle below takes
// 512 + 64 only.)
SlicedCase make_case(int batch, int heads, int tokens, double sm_scale, int dc = kDc,
                     int dr = kDr) {
  SlicedCase c;
  c.attrs.num_heads = heads;
  c.attrs.kv_lora_rank = dc;
  c.attrs.qk_rope_head_dim = dr;
  c.attrs.sm_scale = sm_scale;
  c.attrs.page_size = 1;
  c.tokens = tokens;
  c.step.group = "S000";
  c.step.kind = StepKind::kDecode;
  for (int b = 0; b <= batch; ++b) {
    c.step.qo_indptr.push_back(b);
    c.step.kv_indptr.push_back(b * tokens);
  }
  for (int s = 0; s < batch * tokens; ++s) c.step.kv_indices.push_back(s);
  for (int b = 0; b < batch; ++b) {
    c.step.kv_last_page_len.push_back(1);
    c.step.new_kv_slots.push_back(b * tokens + tokens - 1);
  }
  c.q_nope.assign(static_cast<std::size_t>(batch) * heads * dc, 0.0f);
  c.q_pe.assign(static_cast<std::size_t>(batch) * heads * dr, 0.0f);
  c.rows.assign(static_cast<std::size_t>(batch) * tokens * (dc + dr), 0.0f);
  return c;
}

KvRows rows_of(const SlicedCase& c) {
  return KvRows::from_values(c.rows, c.attrs.row_width(), c.scale, c.rows_lo);
}

struct Outputs {
  std::vector<double> out;
  std::vector<double> lse;
};

Outputs run_default(const SlicedCase& c, int threads = 2) {
  Outputs r;
  r.out.assign(c.q_nope.size(), -12345.0);
  r.lse.assign(c.q_nope.size() / c.attrs.kv_lora_rank, -12345.0);
  const KvRows kv = rows_of(c);
  auto work = mla_reference_attention<dd::DoubleDouble>(c.attrs, c.step, c.q_nope, c.q_pe, kv,
                                                        r.out, r.lse, threads);
  REQUIRE(work.ok());
  return r;
}

// Half the gap from |v| to the next double up, in 100 digits (0's is half the smallest subnormal).
Big half_ulp(double v) {
  const double above = std::nextafter(std::abs(v), std::numeric_limits<double>::infinity());
  return (Big(above) - Big(std::abs(v))) / 2;
}

// The oracle: one (request, head) in 100 digits; checks the default's out and lse against it.
// Returns the number of outputs outside the guarantee (printed per failure, first few only).
int check_against_oracle(const SlicedCase& c, const Outputs& got, int b, int h, int* printed) {
  const int heads = c.attrs.num_heads;
  const float* qn = c.q_nope.data() + (static_cast<std::size_t>(b) * heads + h) * kDc;
  const float* qp = c.q_pe.data() + (static_cast<std::size_t>(b) * heads + h) * kDr;
  auto value = [&](int t, int j) {
    const std::size_t k = (static_cast<std::size_t>(b) * c.tokens + t) * kWidth + j;
    return c.rows_lo.empty() ? Big(c.rows[k]) : Big(c.rows[k]) + Big(c.rows_lo[k]);
  };
  std::vector<Big> s(c.tokens);
  for (int t = 0; t < c.tokens; ++t) {
    Big dot = 0;
    for (int j = 0; j < kDc; ++j) dot += Big(qn[j]) * value(t, j);
    for (int j = 0; j < kDr; ++j) dot += Big(qp[j]) * value(t, kDc + j);
    s[t] = Big(c.attrs.sm_scale) * Big(c.scale) * dot;
  }
  Big m = s[0];
  for (const Big& v : s) m = v > m ? v : m;
  Big l = 0;
  std::vector<Big> w(c.tokens);
  for (int t = 0; t < c.tokens; ++t) l += (w[t] = exp(s[t] - m));
  int bad = 0;
  const std::size_t pair = static_cast<std::size_t>(b) * heads + h;
  auto report = [&](const char* what, int d, double value, const Big& truth, const Big& delta) {
    ++bad;
    if ((*printed)++ < 5) {
      UNSCOPED_INFO(what << " at request " << b << " head " << h << " dim " << d << ": got "
                         << std::setprecision(17) << value << ", truth " << truth.str(25)
                         << ", allowed " << delta.str(5));
    }
  };
  for (int d = 0; d < kDc; ++d) {
    Big acc = 0, weighted_abs = 0;
    for (int t = 0; t < c.tokens; ++t) {
      acc += w[t] * value(t, d);
      weighted_abs += w[t] * abs(value(t, d));
    }
    const Big truth = Big(c.scale) * acc / l;
    const double o = got.out[pair * kDc + d];
    const Big allowed = half_ulp(o) + ldexp(Big(c.scale) * weighted_abs / l, -80);
    if (abs(Big(o) - truth) > allowed) report("out", d, o, truth, allowed);
  }
  const Big lse = m + log(l);
  const double got_lse = got.lse[pair];
  const Big lse_allowed = half_ulp(got_lse) + ldexp(Big(1), -80);
  if (abs(Big(got_lse) - lse) > lse_allowed) report("lse", -1, got_lse, lse, lse_allowed);
  return bad;
}

int outputs_outside_guarantee(const SlicedCase& c) {
  const Outputs got = run_default(c);
  int bad = 0, printed = 0;
  const int batch = static_cast<int>(c.step.qo_indptr.size()) - 1;
  for (int b = 0; b < batch; ++b) {
    for (int h = 0; h < c.attrs.num_heads; ++h) bad += check_against_oracle(c, got, b, h, &printed);
  }
  return bad;
}

// The value of a random e4m3 code (NaN codes skipped): every exponent, subnormals included.
float random_e4m3(std::mt19937_64& rng) {
  for (;;) {
    const auto code = static_cast<std::uint8_t>(rng() & 0xffu);
    if (!e4m3_is_nan(code)) return e4m3_decode(code);
  }
}

void fill_e4m3(std::vector<float>& v, std::mt19937_64& rng) {
  for (float& x : v) x = random_e4m3(rng);
}

// Rows of a per_token_group pool: code * group scale (a float of 24 bits) as hi + lo, as
// KvRows::from_pool holds them.
void fill_grouped_rows(SlicedCase& c, std::mt19937_64& rng) {
  c.rows_lo.resize(c.rows.size());
  for (std::size_t k = 0; k < c.rows.size(); ++k) {
    const double value = static_cast<double>(random_e4m3(rng)) * 1.2345678f;
    c.rows[k] = static_cast<float>(value);
    c.rows_lo[k] = static_cast<float>(value - c.rows[k]);
  }
}

// bf16 q, each part scaled (the scores' spread follows).
void fill_q(SlicedCase& c, std::mt19937_64& rng, float pe_scale, float nope_scale = 1.0f) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (float& x : c.q_nope) x = bf16_round(nope_scale * u(rng));
  for (float& x : c.q_pe) x = bf16_round(pe_scale * u(rng));
}

TEST_CASE("KvRows finds the value grid the sliced path is built on", "[reference][sliced]") {
  const std::vector<float> e4m3 = {448.0f, -448.0f, 0.001953125f, 0.0f, 1.5f, -0.375f};
  const KvRows a = KvRows::from_values(e4m3, 3);
  REQUIRE(a.has_value_grid());
  CHECK(a.grid_exponent() == -9);   // 2^-9, the smallest subnormal
  CHECK(a.magnitude_bits() == 18);  // 448 < 2^9 = 2^(-9 + 18)
  const std::vector<float> spread = {1.0f, std::ldexp(1.0f, -40)};
  CHECK(!KvRows::from_values(spread, 2).has_value_grid());  // 41 bits apart: compensated
  const std::vector<float> with_inf = {1.0f, std::numeric_limits<float>::infinity()};
  CHECK(!KvRows::from_values(with_inf, 2).has_value_grid());
  const std::vector<float> with_nan = {0.5f, std::numeric_limits<float>::quiet_NaN()};
  const KvRows n = KvRows::from_values(with_nan, 2);
  REQUIRE(n.has_value_grid());  // NaN reaches the result through the products instead
  CHECK(n.grid_exponent() == -1);
  CHECK(n.magnitude_bits() == 1);                                    // 0.5 < 2^(-1 + 1)
  CHECK(!KvRows::from_values(e4m3, 3, 1.0, e4m3).has_value_grid());  // residuals: compensated

  // Float values 30 bits apart have a grid and 31 do not, also where the value that decides is
  // one of 600,000 (the scans work in chunks of 2^18, in parallel) and NaNs are about.
  std::vector<float> many(600000, 1.5f);  // 1.5 = 1.1b: its last bit is 2^-1, it is below 2^1
  many[123] = std::numeric_limits<float>::quiet_NaN();
  many[550000] = std::ldexp(1.0f, -29);
  const KvRows thirty = KvRows::from_values(many, 6, 1.0, {}, 3);
  REQUIRE(thirty.has_value_grid());
  CHECK(thirty.grid_exponent() == -29);
  CHECK(thirty.magnitude_bits() == 30);
  many[550000] = std::ldexp(1.0f, -30);
  CHECK(!KvRows::from_values(many, 6, 1.0, {}, 3).has_value_grid());
  many[550000] = std::ldexp(3.0f, -31);  // 1.1b * 2^-30: its last bit is 2^-31
  CHECK(!KvRows::from_values(many, 6, 1.0, {}, 3).has_value_grid());
  many[550000] = std::numeric_limits<float>::infinity();
  CHECK(!KvRows::from_values(many, 6, 1.0, {}, 3).has_value_grid());
}

TEST_CASE("sliced path: every e4m3 value, +-448 and subnormals, long context past one block",
          "[reference][sliced]") {
  // 700 tokens: two blocks of 256 and a partial one. Scores spread over ~40 nats by a large
  // rope part, then over hundreds: values up to 448 (18 bits) take 4 weight slices per band, and
  // the weights fill many bands (P.V of each band in blocks of its own).
  std::mt19937_64 rng(11);
  SlicedCase c = make_case(2, 2, 700, 0.0625);
  c.scale = 0.375;
  fill_e4m3(c.rows, rng);
  for (int t = 0; t < 40; ++t) {  // saturated rows: every product at its largest
    for (int j = 0; j < kWidth; ++j) c.rows[t * kWidth + j] = (j % 2 == 0) ? 448.0f : -448.0f;
  }
  fill_q(c, rng, 0.1f, 0.1f);
  CHECK(outputs_outside_guarantee(c) == 0);
  fill_q(c, rng, 1.0f, 1.0f);  // scores hundreds of nats apart: weights down to underflow
  CHECK(outputs_outside_guarantee(c) == 0);
}

TEST_CASE("sliced path: near-equal scores, weights that all need the finest slice",
          "[reference][sliced]") {
  // Small e4m3 values and small q: every weight is close to 1, the case the bench measures; the
  // last slice's bits decide the result's last bit often enough to show a slice too few.
  std::mt19937_64 rng(5);
  SlicedCase c = make_case(4, 4, 300, 0.0625);
  for (float& x : c.rows) {
    x = e4m3_decode(
        static_cast<std::uint8_t>((rng() & 0x80u) | ((rng() % 9u) << 3) | (rng() & 7u)));
  }
  fill_q(c, rng, 1.0f);
  CHECK(outputs_outside_guarantee(c) == 0);
}

TEST_CASE("sliced path: fp32 q with a wide exponent spread (several q slices, or compensated)",
          "[reference][sliced]") {
  std::mt19937_64 rng(3);
  for (const int spread : {20, 60, 120}) {
    CAPTURE(spread);
    SlicedCase c = make_case(2, 2, 100, 0.0625);
    fill_e4m3(c.rows, rng);
    std::uniform_real_distribution<float> u(1.0f, 2.0f);
    auto wide = [&] {
      const int e = static_cast<int>(rng() % static_cast<unsigned>(spread)) - spread / 2;
      return ((rng() & 1u) ? -1.0f : 1.0f) * std::ldexp(u(rng), e) * 1e-3f;
    };
    for (float& x : c.q_nope) x = wide();
    for (float& x : c.q_pe) x = wide();
    CHECK(outputs_outside_guarantee(c) == 0);
  }
}

TEST_CASE("sliced path: a NaN in a visible row gives NaN for that row only",
          "[reference][sliced]") {
  std::mt19937_64 rng(9);
  SlicedCase c = make_case(2, 2, 300, 0.0625);
  fill_e4m3(c.rows, rng);
  fill_q(c, rng, 1.0f);
  c.rows[257 * kWidth + 600 % kWidth] = std::numeric_limits<float>::quiet_NaN();  // request 0
  REQUIRE(rows_of(c).has_value_grid());
  const Outputs got = run_default(c);
  for (int h = 0; h < 2; ++h) {
    CHECK(std::isnan(got.lse[h]));
    CHECK(std::isnan(got.out[h * kDc]));
    CHECK(std::isfinite(got.lse[2 + h]));
    CHECK(std::isfinite(got.out[(2 + h) * kDc]));
  }
}

TEST_CASE("weight banding: slices on the band's grids, exact block sums, 2^-88 of each weight left",
          "[reference][sliced]") {
  // The bounds of mla_reference.cpp's "P.V" paragraph, checked on the functions the kernel calls,
  // for weights from 1 down past the last band, in 100 digits.
  std::mt19937_64 rng(29);
  for (const int magnitude_bits : {4, 11, 14, 18, 20}) {
    CAPTURE(magnitude_bits);
    const WeightBanding banding = weight_banding(magnitude_bits);
    REQUIRE(banding.slices > 0);
    const int bw = banding.weight_bits;
    // a block of 2^8 tokens: sum |slice * value| <= 2^8 * 2^(bw + 1) * 2^magnitude_bits <= 2^53
    CHECK(8 + bw + 1 + magnitude_bits <= 53);
    // the finest product (slice grid times a float value's grid, >= 2^-149) stays normal
    CHECK(banding.band_bits * banding.last_band + bw * banding.slices + 149 <= 1022);
    CHECK(banding.band_bits >= 8);
    // w >= 2 (a score's low word past ln 2, |m| >= 2^53), infinite or subnormal weights: the
    // compensated sum, never band 0's slices (whose bound needs w < 2)
    CHECK(banding.band_of(2.0) > banding.last_band);
    CHECK(banding.band_of(2.46) > banding.last_band);
    CHECK(banding.band_of(std::numeric_limits<double>::infinity()) > banding.last_band);
    CHECK(banding.band_of(std::ldexp(1.0, -1030)) > banding.last_band);
    CHECK(banding.band_of(1.9999) == 0);
    int sliced = 0, lightest = 0;
    for (int i = 0; i < 4000; ++i) {
      // w = exp(-x) as double-double: a random hi in [1, 2) * 2^-e and a random low word
      const int e = static_cast<int>(rng() % 1000);
      const double hi = std::ldexp(1.0 + std::ldexp(static_cast<double>(rng() >> 12), -52), -e);
      const double lo =
          std::ldexp(hi, -54) * (std::ldexp(static_cast<double>(rng() >> 11), -53) - 0.5);
      const dd::DoubleDouble w{hi, lo};
      const int band = banding.band_of(w.hi);
      if (band > banding.last_band) {
        CHECK(e > 700);  // only weights far below 2^-700 are left to the compensated sum
        ++lightest;
        continue;
      }
      ++sliced;
      double slices[8];
      slice_banded_weight(banding, w, band, slices);
      Big sum = 0;
      for (int k = 1; k <= banding.slices; ++k) {
        const double units = std::ldexp(slices[k - 1], banding.band_bits * band + bw * k);
        INFO("band " << band << " slice " << k << " = " << slices[k - 1]);
        CHECK(units == std::nearbyint(units));               // on its grid
        CHECK(std::fabs(units) <= std::ldexp(1.0, bw + 1));  // and within the block bound
        sum += Big(slices[k - 1]);
      }
      const Big exact = Big(w.hi) + Big(w.lo);
      INFO("w = " << w.hi << " + " << w.lo << ", band " << band);
      CHECK(abs(exact - sum) <= ldexp(exact, -88));
    }
    CHECK(sliced > 1000);
    CHECK(lightest > 100);
  }
}

// A random e4m3 value in [low, high).
float random_e4m3_in(std::mt19937_64& rng, float low, float high) {
  for (;;) {
    const float v = random_e4m3(rng);
    if (v >= low && v < high) return v;
  }
}

TEST_CASE("sliced path: dims that only light weights reach, in many bands and below the last",
          "[reference][sliced]") {
  // The guarantee is per dim, relative to sum_t p_t |c_t[d]|: where the heavier tokens' values are
  // 0, a light token alone decides out[d]. Scores s_t = q_pe[0] r_t (the rest of q 0, sm_scale 1,
  // r_t a token's first rope value, e4m3): token 0 has r = 448, the heaviest; tokens 1..99 have
  // r in [-200, -100), weights e^(r - 448) of 2^-790 .. 2^-935 where q_pe[0] = 1, below the last
  // band (2^-781 for these 18-bit values), and mid bands where q_pe[0] = 1/2; the rest r in
  // [-90, 448), weights in many bands above (e4m3's spacing leaves some empty; the banding test
  // covers each band's bounds). Each of dims 0..255 is nonzero in one token only:
  // dims 0..127 in one of tokens 1..99, dims 128..255 in one of the rest.
  std::mt19937_64 rng(31);
  SlicedCase c = make_case(2, 2, 1024, 1.0);
  fill_e4m3(c.rows, rng);
  constexpr int kLightest = 99;
  for (int b = 0; b < 2; ++b) {
    float* request = c.rows.data() + static_cast<std::size_t>(b) * c.tokens * kWidth;
    for (int t = 0; t < c.tokens; ++t) {
      float* row = request + static_cast<std::size_t>(t) * kWidth;
      row[kDc] = t == 0           ? 448.0f
                 : t <= kLightest ? random_e4m3_in(rng, -200.0f, -100.0f)
                                  : random_e4m3_in(rng, -90.0f, 448.0f);
      std::fill(row, row + 256, 0.0f);
    }
    for (int d = 0; d < 256; ++d) {
      const int t =
          d < 128 ? 1 + d % kLightest : kLightest + 1 + (d * 7) % (c.tokens - kLightest - 1);
      float v = 0.0f;
      while (v == 0.0f) v = random_e4m3(rng);
      request[static_cast<std::size_t>(t) * kWidth + d] = v;
    }
  }
  for (int bh = 0; bh < 4; ++bh) {
    c.q_pe[static_cast<std::size_t>(bh) * kDr] = bh % 2 == 0 ? 1.0f : 0.5f;
  }
  REQUIRE(rows_of(c).has_value_grid());
  const WeightBanding banding = weight_banding(rows_of(c).magnitude_bits());
  REQUIRE(banding.band_bits * (banding.last_band + 1) <= 790);  // the last band ends above 2^-790
  const Outputs got = run_default(c);
  for (int bh = 0; bh < 4; bh += 2) {  // q_pe[0] = 1: dims 0..127 hold weights below 2^-790
    for (int d = 0; d < 128; ++d) {
      INFO("pair " << bh << " dim " << d);
      CHECK(got.out[static_cast<std::size_t>(bh) * kDc + d] != 0.0);
    }
  }
  CHECK(outputs_outside_guarantee(c) == 0);
}

TEST_CASE("compensated path: fp32 source rows and grouped hi + lo rows", "[reference][sliced]") {
  std::mt19937_64 rng(21);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  SlicedCase source = make_case(2, 2, 300, 0.0625);  // past one block of 256 entries
  for (float& x : source.rows) x = normal(rng) * 0.3f;
  fill_q(source, rng, 1.0f);
  REQUIRE(!rows_of(source).has_value_grid());
  CHECK(outputs_outside_guarantee(source) == 0);

  SlicedCase grouped = make_case(2, 2, 150, 0.0625);  // 300 entries: hi and lo rows
  fill_grouped_rows(grouped, rng);
  fill_q(grouped, rng, 1.0f);
  REQUIRE(!rows_of(grouped).has_value_grid());
  CHECK(outputs_outside_guarantee(grouped) == 0);
}

TEST_CASE("KvRows marks the rows whose values span at most kRowGridBits bits",
          "[reference][sliced]") {
  constexpr int kWidth8 = 8;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const float bits27 = std::ldexp(1.0f, -26);  // with 1.5 (< 2^1): 1 - (-26) = 27 bits
  const float bits28 = std::ldexp(1.0f, -27);
  // One row each, padded with zeros to kWidth8 values.
  const std::vector<std::vector<float>> row_values = {
      {1.5f, bits27, -1.0f, nan, 0.5f, 1.0f, -1.5f},  // 27 bits: on its grid
      {1.5f, bits28, -1.0f, 0.5f, 1.0f, -1.5f},       // 28 bits
      {1.5f, inf, 1.0f},                              // an infinity
      {},                                             // zeros
      {std::ldexp(1.0f, -149), std::ldexp(3.0f, -141)},
      {1.0f + std::ldexp(1.0f, -23), -0.75f},  // 24 bits
  };
  std::vector<float> values;
  for (const std::vector<float>& row : row_values) {
    values.insert(values.end(), row.begin(), row.end());
    values.resize(values.size() + kWidth8 - row.size(), 0.0f);
  }
  const KvRows rows = KvRows::from_values(values, kWidth8);
  REQUIRE(!rows.has_value_grid());  // 2^-149 and 1.5 in one tensor: far more than 30 bits
  REQUIRE(rows.has_row_grids());
  CHECK(rows.row_on_grid(0));
  CHECK(!rows.row_on_grid(1));
  CHECK(!rows.row_on_grid(2));
  CHECK(rows.row_on_grid(3));
  CHECK(rows.row_on_grid(4));  // subnormals: 2^-149 .. 3 * 2^-141 (< 2^-139), 10 bits
  CHECK(rows.row_on_grid(5));
  CHECK(!rows.row_on_grid(6));  // no such slot

  // e4m3 values have a grid as a whole: no per-row grids.
  std::vector<float> e4m3(16, 0.0f);
  e4m3[0] = 448.0f;
  e4m3[9] = std::ldexp(1.0f, -9);
  const KvRows graded = KvRows::from_values(e4m3, kWidth8);
  CHECK(graded.has_value_grid());
  CHECK(!graded.has_row_grids());
}

// Source rows (bf16 values, no grid as a whole): rows within 27 bits take the sliced scores,
// wider ones the compensated; both against the 100-digit oracle. The first rows of each request
// span exactly 27 bits (every value of full magnitude, one value 27 bits down) and q has one sign.
TEST_CASE("per-row grids: bf16 source rows at the 27-bit bound and wider ones against the oracle",
          "[reference][sliced]") {
  std::mt19937_64 rng(27);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  SlicedCase c = make_case(2, 2, 300, 0.0625);
  for (float& x : c.rows) x = bf16_round(normal(rng));
  for (int b = 0; b < 2; ++b) {
    for (int t = 0; t < 300; ++t) {
      float* row = c.rows.data() + (static_cast<std::size_t>(b) * 300 + t) * kWidth;
      if (t < 40) {  // at the bound: |v| < 2^1, one value at 2^-26
        std::fill_n(row, kWidth, 1.9921875f);
        row[t % kWidth] = std::ldexp(1.0f, -26);
      } else if (t % 7 == 0) {  // wider than 27 bits: compensated
        row[t % kWidth] = std::ldexp(row[t % kWidth], -30);
      }
    }
  }
  // 1 - 2^-17: two slices of the bound's 16 bits, the first of full magnitude. (A slice one bit
  // wider would round these sums by about 2^-54 of the score, below what the outputs show: this
  // case checks the path against the oracle, the test above the rows' bound.)
  for (float& x : c.q_nope) x = 1.0f - std::ldexp(1.0f, -17);
  for (float& x : c.q_pe) x = std::ldexp(normal(rng), static_cast<int>(rng() % 12) - 6);
  const KvRows kv = rows_of(c);
  REQUIRE(!kv.has_value_grid());
  REQUIRE(kv.has_row_grids());
  int on = 0;
  for (int s = 0; s < 600; ++s) on += kv.row_on_grid(s);
  CHECK(on > 300);
  CHECK(on < 600);
  CHECK(outputs_outside_guarantee(c) == 0);
}

// Bitwise equality of two runs' outputs (NaNs included): the number of values that differ.
int values_differing(const Outputs& a, const Outputs& b) {
  int differ = 0;
  for (std::size_t i = 0; i < a.out.size(); ++i) {
    differ += std::memcmp(&a.out[i], &b.out[i], sizeof(double)) != 0;
  }
  for (std::size_t i = 0; i < a.lse.size(); ++i) {
    differ += std::memcmp(&a.lse[i], &b.lse[i], sizeof(double)) != 0;
  }
  return differ;
}

// The heads of a row run together in groups, their tokens in chunks (HeadGroupKernel); the group
// size follows the thread count (2 rows: 1 thread takes all 6 heads at once, 3 threads groups of
// 2, 64 threads one head each). Every form must give the bits of one head at a time: each head's
// state is its own, and each row's kernel starts clean (row 0's head 2 has a NaN q, so its out
// is NaN, and the next row's head 2, in the same kernel, must not be). 700 tokens: 11 chunks and
// blocks of several bands, opened and closed out of band order.
TEST_CASE("the reference gives the same bits whatever the heads per group", "[reference][sliced]") {
  std::mt19937_64 rng(35);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  SlicedCase e4m3 = make_case(2, 6, 700, 0.0625);  // sliced scores and P.V, many bands
  fill_e4m3(e4m3.rows, rng);
  fill_q(e4m3, rng, 1.0f);
  e4m3.q_nope[2 * kDc + 5] = std::numeric_limits<float>::quiet_NaN();  // row 0, head 2

  SlicedCase source = make_case(2, 6, 700, 0.0625);  // per-row grids and compensated P.V
  for (float& x : source.rows) x = bf16_round(normal(rng));
  for (int t = 0; t < 2 * 700; t += 9) source.rows[static_cast<std::size_t>(t) * kWidth] *= 1e-12f;
  fill_q(source, rng, 1.0f);

  SlicedCase grouped = make_case(2, 6, 700, 0.0625);  // compensated scores and P.V, hi + lo
  fill_grouped_rows(grouped, rng);
  fill_q(grouped, rng, 1.0f);

  for (const SlicedCase* c : {&e4m3, &source, &grouped}) {
    const Outputs all_heads = run_default(*c, 1);
    const Outputs pairs = run_default(*c, 3);
    const Outputs one_head = run_default(*c, 64);
    CHECK(values_differing(all_heads, one_head) == 0);
    CHECK(values_differing(pairs, one_head) == 0);
  }
  const Outputs got = run_default(e4m3, 1);
  CHECK(std::isnan(got.lse[2]));
  CHECK(std::isfinite(got.lse[6 + 2]));
  CHECK(std::isfinite(got.lse[3]));
}

#if defined(KVAUDIT_HAVE_CPU_V4_TARGET)
// Every output of the default run twice, with the CPU's x86-64-v4 forms (8 doubles per vector)
// and with the 4-wide forms they replace; the number of values whose bits differ.
int values_differing_between_widths(const SlicedCase& c) {
  const Outputs wide = run_default(c);
  kvaudit_cpu_v4_off = true;
  const Outputs narrow = run_default(c);
  kvaudit_cpu_v4_off = false;
  return values_differing(wide, narrow);
}

// The 8-wide loops change the order of the sliced sums (exact: any order gives the same bits) and
// hold each compensated sum's lanes and each dim's order of entries as the 4-wide ones do; the
// cases reach every tail: dims 102 (not a multiple of 16, 8 or 4), width 109 (not of 8), 261
// tokens (past one block, not a multiple of a tile).
TEST_CASE("the reference's AVX-512 and 4-wide loops give the same bits", "[reference][sliced]") {
  if (!kvaudit_cpu_has_v4()) {
    WARN("this CPU has no x86-64-v4 (AVX-512): only the 4-wide loops run, nothing to compare");
    return;
  }
  std::mt19937_64 rng(34);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const int dc : {102, kDc}) {
    const int dr = dc == kDc ? kDr : 7;
    const int tokens = dc == kDc ? 300 : 261;
    SlicedCase e4m3 = make_case(2, 3, tokens, 0.0625, dc, dr);  // 4 weight slices
    fill_e4m3(e4m3.rows, rng);
    fill_q(e4m3, rng, 1.0f);
    REQUIRE(rows_of(e4m3).has_value_grid());
    CHECK(values_differing_between_widths(e4m3) == 0);

    SlicedCase small = make_case(2, 3, tokens, 0.0625, dc, dr);  // |v| < 4: 3 weight slices
    for (float& x : small.rows) x = std::ldexp(std::round(std::ldexp(normal(rng), 6)), -6);
    for (float& x : small.q_nope) x = std::ldexp(normal(rng), static_cast<int>(rng() % 40) - 20);
    for (float& x : small.q_pe) x = normal(rng);  // fp32 q, wide spread: several q slices
    REQUIRE(rows_of(small).has_value_grid());
    CHECK(values_differing_between_widths(small) == 0);

    SlicedCase source = make_case(2, 3, tokens, 0.0625, dc, dr);  // compensated
    for (float& x : source.rows) x = std::ldexp(normal(rng), static_cast<int>(rng() % 40) - 30);
    fill_q(source, rng, 1.0f);
    REQUIRE(!rows_of(source).has_value_grid());
    CHECK(values_differing_between_widths(source) == 0);

    SlicedCase grouped = make_case(2, 3, tokens, 0.0625, dc, dr);  // compensated, hi + lo rows
    fill_grouped_rows(grouped, rng);
    fill_q(grouped, rng, 1.0f);
    CHECK(values_differing_between_widths(grouped) == 0);
  }
}
#endif

}  // namespace
}  // namespace kvaudit
