// The diagnosis of convention mismatches (math, shapes and the catalogue's meaning:
// diagnosis.hpp). Work is split over (row, head) pairs as in the reference; each pair makes two
// passes over its visible tokens (scores, then weights and P.V), in double.
#include "src/replay/diagnosis.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>
#include <optional>
#include <set>
#include <string>

#include "src/backend/injection.hpp"
#include "src/core/fp8_e4m3.hpp"
#include "src/core/parallel_for.hpp"
#include "src/format/step_indices.hpp"

namespace kvaudit {
namespace {

constexpr double kLog2e = 1.4426950408889634074;
constexpr double kLn2 = 0.69314718055994530942;
constexpr float kE4m3Max = 448.0f;  // the largest finite e4m3 value (src/core/fp8_e4m3.hpp)

// Shorthands for the table.
constexpr Transform scaled(ScaleRule rule) { return {rule, rule}; }
constexpr Transform with_sm(SmScaleRule rule) {
  Transform t;
  t.sm_scale = rule;
  return t;
}
constexpr Transform with_read(PoolRead read) {
  Transform t;
  t.read = read;
  return t;
}
constexpr Transform with_query(QueryRounding query) {
  Transform t;
  t.query = query;
  return t;
}
constexpr Transform with_weights(WeightRounding weights) {
  Transform t;
  t.weights = weights;
  return t;
}
constexpr Transform with_lse(LseBase lse) {
  Transform t;
  t.candidate_lse = lse;
  return t;
}
constexpr Transform with_value(ValueScale value) {
  Transform t;
  t.value_scale = value;
  return t;
}
constexpr Transform with_rope(RopePairing rope) {
  Transform t;
  t.rope = rope;
  return t;
}

constexpr HypothesisInfo kCatalogue[] = {
    {Hypothesis::kLseBase2, "lse-base-2",
     "the candidate's lse is log2 of the softmax sum (FlashInfer's convention): compared as "
     "lse * ln 2",
     Transform{ScaleRule::kAsIs, ScaleRule::kAsIs, SmScaleRule::kAsIs, PoolRead::kAsStored,
               WeightRounding::kNone, LseBase::kTwo}},
    {Hypothesis::kScalePow2Floor, "scale-pow2-floor",
     "kv_scale rounded down to a power of two, 2^floor(log2 s)", scaled(ScaleRule::kPow2Floor)},
    {Hypothesis::kScalePow2Nearest, "scale-pow2-nearest",
     "kv_scale rounded to the nearest power of two in log2, 2^round(log2 s) (2s when s already "
     "is one: the scale-mismatch injection)",
     scaled(ScaleRule::kPow2Nearest)},
    {Hypothesis::kScaleE8m0, "scale-e8m0",
     "kv_scale converted to e8m0 rounding up (__nv_cvt_float_to_e8m0, cudaRoundPosInf): "
     "2^ceil(log2 s)",
     scaled(ScaleRule::kE8m0)},
    {Hypothesis::kScaleBf16, "scale-bf16", "kv_scale rounded to bf16 (nearest even)",
     scaled(ScaleRule::kBf16)},
    {Hypothesis::kScaleReciprocal, "scale-reciprocal",
     "kv_scale applied as its reciprocal, fp32(1 / s)", scaled(ScaleRule::kReciprocal)},
    {Hypothesis::kScaleSquared, "scale-squared", "kv_scale applied twice, fp32(s * s)",
     scaled(ScaleRule::kSquared)},
    {Hypothesis::kScaleNotApplied, "scale-not-applied",
     "kv_scale not applied: the FP8 codes read as the values", scaled(ScaleRule::kOne)},
    {Hypothesis::kScaleLatentOnly, "scale-latent-only",
     "kv_scale applied to the latent part (the first Dc columns: K and V) only; the rope part "
     "read unscaled",
     Transform{ScaleRule::kAsIs, ScaleRule::kOne}},
    {Hypothesis::kSmScaleMissing, "sm-scale-missing",
     "the softmax scale not applied (sm_scale = 1)", with_sm(SmScaleRule::kOne)},
    {Hypothesis::kSmScaleLog2e, "sm-scale-log2e",
     "the softmax scale with log2(e) folded in, used with exp: scores multiplied by log2 e",
     with_sm(SmScaleRule::kTimesLog2e)},
    {Hypothesis::kReadAsE5m2, "fp8-read-as-e5m2",
     "the FP8 bytes decoded as e5m2 instead of e4m3fn (times kv_scale)",
     with_read(PoolRead::kE5m2)},
    {Hypothesis::kReadAsBf16, "fp8-read-as-bf16",
     "the FP8 pool addressed as a [S, D] bf16 array (the kv_data_type mix-up, as the injection "
     "reads it: element j of slot t from bytes 2 (t D + j), 0 past the buffer; times kv_scale)",
     with_read(PoolRead::kBf16Bytes)},
    {Hypothesis::kProbabilitiesE4m3, "p-e4m3",
     "the softmax weights exp(s - m) (m: the row's max) rounded to e4m3 (satfinite) before P.V; "
     "the normaliser l summed unrounded",
     Transform{ScaleRule::kAsIs, ScaleRule::kAsIs, SmScaleRule::kAsIs, PoolRead::kAsStored,
               WeightRounding::kE4m3}},
    {Hypothesis::kDequantBf16, "dequant-bf16",
     "each K/V element dequantized in bf16 arithmetic, bf16(code * bf16(kv_scale)), before the "
     "bf16 MMAs (FlashInfer 0.6's FP8 MLA repack of FP8 tiles to bf16)",
     Transform{ScaleRule::kOne, ScaleRule::kOne, SmScaleRule::kAsIs, PoolRead::kDequantBf16}},
    {Hypothesis::kQueryE4m3, "q-e4m3",
     "q (q_nope and q_pe) cast to e4m3 without a scale, satfinite (|q| > 448 -> +-448), as "
     "Triton's fp32 -> fp8e4nv cast on sm90 (cvt.rn.satfinite) before an FP8 QK MMA",
     with_query(QueryRounding::kE4m3)},
    {Hypothesis::kQueryE4m3Scaled, "q-e4m3-scaled",
     "q cast to e4m3 with a dynamic per-step q scale q_scale = fp32(amax|q| / 448) over the "
     "step's whole q (every row and head, q_nope and q_pe together), applied as a reciprocal "
     "multiply e4m3(q * fp32(1 / q_scale)) (the code path of vLLM's QuantFP8, whose q_scale is "
     "static, 1.0 by default), scores times q_scale (FlashMLA dense FP8's descale_q)",
     with_query(QueryRounding::kE4m3Scaled)},
    {Hypothesis::kQueryNopeE4m3, "q-nope-e4m3",
     "the latent part of q (q_nope) cast to e4m3 without a scale, satfinite, for an FP8 latent "
     "dot, the RoPE part kept for a bf16 dot (SGLang 0.5.23's Triton decode on an FP8 MLA cache)",
     with_query(QueryRounding::kE4m3Nope)},
    {Hypothesis::kDequantFp32Bf16, "k-dequant-fp32-bf16",
     "each K/V element dequantized in fp32, fp32(code * s), then rounded to bf16 before bf16 "
     "MMAs (dequant-bf16 multiplies in bf16 by bf16(s) instead)",
     Transform{ScaleRule::kOne, ScaleRule::kOne, SmScaleRule::kAsIs, PoolRead::kDequantFp32Bf16}},
    {Hypothesis::kProbabilitiesE4m3Tile, "p-e4m3-tile",
     "P rounded to e4m3 (satfinite) against the running max of each KV tile within each split "
     "(a split-KV flash kernel: SGLang's Triton decode, FlashMLA dense FP8), partials "
     "rescaled exactly, l summed unrounded, splits merged by their lse; tile and split sizes from "
     "--diagnose-tile, else tiles of 16, 32, 64, 128 with one split each",
     with_weights(WeightRounding::kE4m3Tile)},
    {Hypothesis::kLseBf16, "lse-bf16",
     "the candidate's lse stored in bf16: compared against bf16(lse) (nearest even)",
     with_lse(LseBase::kBf16)},
    {Hypothesis::kKeyScaleInSmScale, "k-scale-in-sm-scale",
     "kv_scale folded into the softmax scale: scores = fp32(sm_scale * s) * (q . codes), out = s * "
     "(P.V on the codes); differs from R8 by one fp32 rounding of sm_scale * s, usually "
     "indistinguishable",
     Transform{ScaleRule::kOne, ScaleRule::kOne, SmScaleRule::kTimesKvScaleFp32,
               PoolRead::kAsStored, WeightRounding::kNone, LseBase::kNatural,
               ValueScale::kKvScale}},
    {Hypothesis::kValueScaleOnOutput, "v-scale-on-output",
     "kv_scale applied to the output, s * (P.V on the codes), instead of to V: in double the same "
     "computation as R8, so never applicable alone (listed as considered; an fp32 kernel differs "
     "by one rounding)",
     with_value(ValueScale::kKvScale)},
    {Hypothesis::kTf32, "tf32",
     "fp32 operands multiplied as TF32 (Triton's default for tl.dot on fp32): q, the dequantized "
     "K/V fp32(code * s) and the fp32 P rounded to TF32 (10 mantissa bits, cvt.rna: ties away "
     "from zero)",
     Transform{ScaleRule::kOne, ScaleRule::kOne, SmScaleRule::kAsIs, PoolRead::kDequantTf32,
               WeightRounding::kTf32, LseBase::kNatural, ValueScale::kAsLatent,
               QueryRounding::kTf32}},
    {Hypothesis::kScaleFp16, "scale-fp16", "kv_scale read in fp16 (nearest even)",
     scaled(ScaleRule::kFp16)},
    {Hypothesis::kValueDescaleMissing, "v-descale-missing",
     "K scaled, V not: the scores read c * s, P.V the unscaled codes (out missing the factor s)",
     with_value(ValueScale::kOne)},
    {Hypothesis::kWriteUnitScale, "write-unit-scale",
     "the cache written with scale 1 (e4m3_satfinite(x) of the unquantized rows, kv_source and "
     "new_kv) while the read applies s; needs kv_source (not applicable without). The reverse, "
     "written with s and read with 1, is scale-not-applied",
     with_read(PoolRead::kRequantizedUnitScale)},
    {Hypothesis::kSmScaleMscaleDropped, "sm-scale-mscale-dropped",
     "the softmax scale without YaRN's mscale^2: qk_head_dim^-0.5 = sm_scale / mscale^2, mscale = "
     "0.1 * rope_mscale_all_dim * ln(rope_factor) + 1 from the dump's rope attributes (not "
     "applicable without them): a server deriving the scale from the head widths alone "
     "(TensorRT-LLM issue 3675)",
     with_sm(SmScaleRule::kWithoutMscale)},
    {Hypothesis::kSmScaleMscaleTwice, "sm-scale-mscale-twice",
     "YaRN's mscale^2 applied twice: sm_scale * mscale^2 (qk_head_dim^-0.5 * mscale^4), a server "
     "multiplying a model scale that already holds mscale^2 by it again; needs the dump's rope "
     "attributes",
     with_sm(SmScaleRule::kMscaleTwice)},
    {Hypothesis::kKpeDeinterleaved, "kpe-deinterleaved",
     "the cached RoPE part in the Hugging Face module's de-interleaved order (even elements, then "
     "odd) while q_pe is interleaved: scores q_pe . D(r)",
     with_rope(RopePairing::kKeyDeinterleaved)},
    {Hypothesis::kQpeDeinterleaved, "qpe-deinterleaved",
     "q_pe in the Hugging Face module's de-interleaved order while the cached RoPE part is "
     "interleaved: scores D(q_pe) . r",
     with_rope(RopePairing::kQueryDeinterleaved)},
    {Hypothesis::kRopeDotMissing, "rope-dot-missing",
     "the absorbed query formed without the RoPE split: the q_pe . r term missing from the "
     "scores (a 512-wide latent attention, q_pe zeroed)",
     with_rope(RopePairing::kDropped)},
};

// s = f * 2^e with f in [0.5, 1): floor(log2 s) = e - 1, and s is a power of two iff f = 0.5.
float pow2_floor(float s) {
  int exponent = 0;
  std::frexp(s, &exponent);
  return std::ldexp(1.0f, exponent - 1);
}

float pow2_ceil(float s) {
  int exponent = 0;
  const float fraction = std::frexp(s, &exponent);
  return fraction == 0.5f ? s : std::ldexp(1.0f, exponent);
}

double sm_scale_of(SmScaleRule rule, double sm_scale, float kv_scale,
                   std::optional<double> mscale_squared) {
  const double unknown = std::numeric_limits<double>::quiet_NaN();
  switch (rule) {
    case SmScaleRule::kWithoutMscale:
      return mscale_squared ? sm_scale / *mscale_squared : unknown;
    case SmScaleRule::kMscaleTwice:
      return mscale_squared ? sm_scale * *mscale_squared : unknown;
    case SmScaleRule::kAsIs:
      return sm_scale;
    case SmScaleRule::kOne:
      return 1.0;
    case SmScaleRule::kTimesLog2e:
      return sm_scale * kLog2e;
    case SmScaleRule::kTimesKvScaleFp32:  // SGLang's rule: the product in double, rounded to fp32
      return static_cast<float>(sm_scale * static_cast<double>(kv_scale));
  }
  return sm_scale;
}

bool folds_scale_into_rows(PoolRead read) {
  return read == PoolRead::kDequantBf16 || read == PoolRead::kDequantFp32Bf16 ||
         read == PoolRead::kDequantTf32;
}

// "0.00195312 (2^-9)": six digits, and the power of two when the number is one.
std::string number_text(double value) {
  int exponent = 0;
  const double fraction = std::frexp(value, &exponent);
  if (fraction == 0.5) return fmt::format("{:.6g} (2^{})", value, exponent - 1);
  return fmt::format("{:.6g}", value);
}

// e5m2: S.EEEEE.MM, bias 15; E = 31 is Inf (M = 0) or NaN.
float e5m2_decode(std::uint8_t code) {
  const bool negative = (code & 0x80) != 0;
  const int exponent = (code >> 2) & 0x1F;
  const int mantissa = code & 0x3;
  float magnitude = 0.0f;
  if (exponent == 31) {
    magnitude = mantissa == 0 ? std::numeric_limits<float>::infinity()
                              : std::numeric_limits<float>::quiet_NaN();
  } else if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -16);  // M/4 * 2^-14
  } else {
    magnitude = std::ldexp(1.0f + static_cast<float>(mantissa) / 4.0f, exponent - 15);
  }
  return negative ? -magnitude : magnitude;
}

// One decoded element (column j of slot t) under a PoolRead (kRequantizedUnitScale: decode()).
float decode_element(const KvPool& pool, PoolRead read, std::int64_t slot, int j, float kv_scale) {
  if (pool.dtype == KvDtype::kBfloat16) return bf16_to_float(pool.bf16_bits(slot, j));
  switch (read) {
    case PoolRead::kAsStored:
    case PoolRead::kRequantizedUnitScale:
      return e4m3_decode(pool.row(slot)[j]);
    case PoolRead::kDequantFp32Bf16:
      return bf16_round(e4m3_decode(pool.row(slot)[j]) * kv_scale);
    case PoolRead::kDequantTf32:
      return tf32_round(e4m3_decode(pool.row(slot)[j]) * kv_scale);
    case PoolRead::kDequantBf16:
      // e4m3 values and bf16(s) have 4 and 8 significant bits: their fp32 product is exact, and
      // its bf16 rounding is __hmul2's.
      return bf16_round(e4m3_decode(pool.row(slot)[j]) * bf16_round(kv_scale));
    case PoolRead::kE5m2:
      return e5m2_decode(pool.row(slot)[j]);
    case PoolRead::kBf16Bytes: {
      const std::size_t byte = 2 * (static_cast<std::size_t>(slot) * pool.row_width + j);
      if (byte + 1 >= pool.bytes.size()) return 0.0f;
      return bf16_to_float(
          static_cast<std::uint16_t>(pool.bytes[byte] | pool.bytes[byte + 1] << 8));
    }
  }
  return 0.0f;
}

}  // namespace

std::span<const HypothesisInfo> hypothesis_catalogue() { return kCatalogue; }

const HypothesisInfo& hypothesis_info(Hypothesis hypothesis) {
  for (const HypothesisInfo& info : kCatalogue) {
    if (info.id == hypothesis) return info;
  }
  return kCatalogue[0];  // every enumerator has a row (tests/replay/test_diagnosis.cpp)
}

const char* hypothesis_name(Hypothesis hypothesis) { return hypothesis_info(hypothesis).name; }

unsigned transform_parts(const Transform& t) {
  const Transform none;
  unsigned parts = 0;
  if (t.latent_scale != none.latent_scale || t.rope_scale != none.rope_scale ||
      t.value_scale != none.value_scale || t.sm_scale == SmScaleRule::kTimesKvScaleFp32 ||
      folds_scale_into_rows(t.read)) {
    parts |= kPartScale;
  }
  if (t.sm_scale != none.sm_scale) parts |= kPartSmScale;
  if (t.read != none.read) parts |= kPartRead;
  if (t.query != none.query) parts |= kPartQuery;
  if (t.weights != none.weights || t.normaliser != none.normaliser) parts |= kPartWeights;
  if (t.candidate_lse != none.candidate_lse) parts |= kPartLse;
  if (t.rope != none.rope) parts |= kPartRope;
  return parts;
}

bool combinable(const Transform& a, const Transform& b) {
  return (transform_parts(a) & transform_parts(b)) == 0;
}

Transform combine(const Transform& a, const Transform& b) {
  const Transform none;
  const auto pick = [](auto x, auto y, auto unchanged) { return x != unchanged ? x : y; };
  Transform t;
  t.latent_scale = pick(a.latent_scale, b.latent_scale, none.latent_scale);
  t.rope_scale = pick(a.rope_scale, b.rope_scale, none.rope_scale);
  t.sm_scale = pick(a.sm_scale, b.sm_scale, none.sm_scale);
  t.read = pick(a.read, b.read, none.read);
  t.weights = pick(a.weights, b.weights, none.weights);
  t.candidate_lse = pick(a.candidate_lse, b.candidate_lse, none.candidate_lse);
  t.value_scale = pick(a.value_scale, b.value_scale, none.value_scale);
  t.query = pick(a.query, b.query, none.query);
  t.query_scale_domain = pick(a.query_scale_domain, b.query_scale_domain, none.query_scale_domain);
  t.normaliser = pick(a.normaliser, b.normaliser, none.normaliser);
  t.rope = pick(a.rope, b.rope, none.rope);
  return t;
}

bool ResolvedVariant::same_computation(const ResolvedVariant& other) const {
  return latent_scale == other.latent_scale && rope_scale == other.rope_scale &&
         value_scale == other.value_scale && sm_scale == other.sm_scale && read == other.read &&
         query == other.query && query_scale == other.query_scale && weights == other.weights &&
         tiles == other.tiles && normaliser == other.normaliser && rope == other.rope;
}

float tf32_round(float x) {
  if (!std::isfinite(x)) return x;
  std::uint32_t bits = 0;
  std::memcpy(&bits, &x, sizeof bits);
  bits = (bits + 0x1000u) & 0xFFFFE000u;  // add half of the 13 dropped bits' range: ties away
  float rounded = 0.0f;
  std::memcpy(&rounded, &bits, sizeof rounded);
  return rounded;
}

float fp16_round(float x) {
  if (!std::isfinite(x) || x == 0.0f) return x;
  int exponent = 0;
  std::frexp(x, &exponent);  // |x| in [2^(exponent-1), 2^exponent)
  // 11 significant bits in the normal range (|x| >= 2^-14), a fixed quantum 2^-24 below it.
  const int quantum_exponent = std::max(exponent - 1 - 10, -24);
  const double rounded =
      std::nearbyint(std::ldexp(static_cast<double>(x), -quantum_exponent));  // nearest even
  const double value = std::ldexp(rounded, quantum_exponent);
  if (std::abs(value) > 65504.0) return std::copysign(std::numeric_limits<float>::infinity(), x);
  return static_cast<float>(value);
}

std::vector<TokenRange> tile_ranges(std::int64_t n, TileShape tiles) {
  std::vector<TokenRange> ranges;
  if (n <= 0) return ranges;
  const std::int64_t tile = tiles.tile > 0 ? tiles.tile : n;
  const std::int64_t splits = std::max(tiles.splits, 1);
  const std::int64_t per_split = (n + splits - 1) / splits;
  const std::int64_t split_len = (per_split + tile - 1) / tile * tile;  // a multiple of the tile
  for (std::int64_t start = 0; start < n; start += split_len) {
    const std::int64_t end = std::min(start + split_len, n);
    for (std::int64_t t = start; t < end; t += tile) {
      ranges.push_back({t, std::min(t + tile, end), t == start});
    }
  }
  return ranges;
}

double apply_scale_rule(ScaleRule rule, float kv_scale) {
  switch (rule) {
    case ScaleRule::kAsIs:
      return kv_scale;
    case ScaleRule::kPow2Floor:
      return pow2_floor(kv_scale);
    case ScaleRule::kPow2Nearest:
      return power_of_two_scale(kv_scale);
    case ScaleRule::kE8m0:
      return pow2_ceil(kv_scale);
    case ScaleRule::kBf16:
      return bf16_round(kv_scale);
    case ScaleRule::kFp16:
      return fp16_round(kv_scale);
    case ScaleRule::kReciprocal:
      return 1.0f / kv_scale;
    case ScaleRule::kSquared:
      return kv_scale * kv_scale;
    case ScaleRule::kOne:
      return 1.0;
  }
  return kv_scale;
}

ResolvedVariant resolve(const Transform& transform, float kv_scale, double sm_scale,
                        float query_amax, TileShape tiles, std::optional<double> mscale_squared) {
  ResolvedVariant variant;
  variant.latent_scale = apply_scale_rule(transform.latent_scale, kv_scale);
  variant.rope_scale = apply_scale_rule(transform.rope_scale, kv_scale);
  switch (transform.value_scale) {
    case ValueScale::kAsLatent:
      variant.value_scale = variant.latent_scale;
      break;
    case ValueScale::kOne:
      variant.value_scale = 1.0;
      break;
    case ValueScale::kKvScale:
      variant.value_scale = kv_scale;
      break;
  }
  variant.sm_scale = sm_scale_of(transform.sm_scale, sm_scale, kv_scale, mscale_squared);
  variant.rope = transform.rope;
  variant.read = transform.read;
  variant.query = transform.query;
  if (transform.query == QueryRounding::kE4m3Scaled && query_amax > 0.0f) {
    variant.query_scale = static_cast<float>(query_amax / kE4m3Max);
  }
  variant.weights = transform.weights;
  if (transform.weights == WeightRounding::kE4m3Tile) variant.tiles = tiles;
  variant.normaliser = transform.normaliser;
  variant.candidate_lse = transform.candidate_lse;
  return variant;
}

std::string describe_variant(const ResolvedVariant& v, const ResolvedVariant& identity) {
  std::vector<std::string> parts;
  const double s = identity.latent_scale;
  const bool folded_into_sm = v.sm_scale != identity.sm_scale && v.latent_scale == 1.0 &&
                              v.rope_scale == 1.0 && v.value_scale == s && s != 1.0;
  if (v.read == PoolRead::kDequantBf16) {  // the scale is inside the rows (a = b = 1)
    parts.push_back(fmt::format("K/V elements bf16(code * {}): kv_scale {} in bf16",
                                number_text(bf16_round(static_cast<float>(s))), number_text(s)));
  } else if (v.read == PoolRead::kDequantFp32Bf16) {
    parts.push_back(fmt::format("K/V elements bf16(fp32(code * {}))", number_text(s)));
  } else if (v.read == PoolRead::kDequantTf32) {
    parts.push_back(fmt::format("K/V elements tf32(fp32(code * {}))", number_text(s)));
  } else if (folded_into_sm) {
    parts.push_back(
        fmt::format("kv_scale {} folded into sm_scale: scores fp32(sm_scale * s) = {} "
                    "times q . codes, out s * P.V on the codes",
                    number_text(s), number_text(v.sm_scale)));
  } else if (v.latent_scale != v.rope_scale) {
    parts.push_back(fmt::format("kv_scale {}: latent part scaled by {}, rope part by {}",
                                number_text(identity.latent_scale), number_text(v.latent_scale),
                                number_text(v.rope_scale)));
  } else if (v.latent_scale != identity.latent_scale) {
    parts.push_back(fmt::format("kv_scale {} read as {}", number_text(identity.latent_scale),
                                number_text(v.latent_scale)));
  }
  if (v.value_scale != v.latent_scale && !folds_scale_into_rows(v.read)) {
    parts.push_back(fmt::format("P.V scaled by {} (scores by {})", number_text(v.value_scale),
                                number_text(v.latent_scale)));
  }
  if (v.sm_scale != identity.sm_scale && !folded_into_sm) {
    parts.push_back(fmt::format("sm_scale {} read as {}", number_text(identity.sm_scale),
                                number_text(v.sm_scale)));
  }
  if (v.rope == RopePairing::kKeyDeinterleaved) {
    parts.emplace_back("rope part read de-interleaved against q_pe: q_pe . D(r)");
  }
  if (v.rope == RopePairing::kQueryDeinterleaved) {
    parts.emplace_back("q_pe de-interleaved against the rope part: D(q_pe) . r");
  }
  if (v.rope == RopePairing::kDropped) parts.emplace_back("q_pe . r dropped from the scores");
  if (v.read == PoolRead::kE5m2) parts.emplace_back("FP8 bytes decoded as e5m2");
  if (v.read == PoolRead::kBf16Bytes) parts.emplace_back("FP8 pool read as bf16, 2 bytes/element");
  if (v.read == PoolRead::kRequantizedUnitScale) {
    parts.emplace_back("the unquantized rows written as e4m3(x) (scale 1), read times kv_scale");
  }
  if (v.query == QueryRounding::kE4m3) parts.emplace_back("q cast to e4m3 (satfinite), no scale");
  if (v.query == QueryRounding::kE4m3Scaled) {
    parts.push_back(fmt::format("q cast to e4m3 with q_scale {} (amax of the step's q / 448)",
                                number_text(v.query_scale)));
  }
  if (v.query == QueryRounding::kTf32) parts.emplace_back("q rounded to tf32");
  if (v.query == QueryRounding::kE4m3Nope) {
    parts.emplace_back("q_nope cast to e4m3 (satfinite), no scale; q_pe unrounded");
  }
  const char* l_sum = v.normaliser == Normaliser::kRounded ? "l rounded" : "l unrounded";
  if (v.weights == WeightRounding::kE4m3) {
    parts.push_back(fmt::format("P = exp(s - m) rounded to e4m3 before P.V, {}", l_sum));
  }
  if (v.weights == WeightRounding::kE4m3Tile) {
    parts.push_back(
        fmt::format("P rounded to e4m3 against the running max of tile {}, {} split{}, {}",
                    v.tiles.tile, v.tiles.splits, v.tiles.splits == 1 ? "" : "s", l_sum));
  }
  if (v.weights == WeightRounding::kTf32) parts.emplace_back("P rounded to tf32 before P.V");
  if (v.candidate_lse == LseBase::kTwo) {
    parts.emplace_back("candidate lse read as log2 of the sum: compared as lse * ln 2");
  }
  if (v.candidate_lse == LseBase::kBf16) {
    parts.emplace_back("candidate lse stored in bf16: compared against bf16(lse)");
  }
  return parts.empty() ? "no change" : fmt::format("{}", fmt::join(parts, "; "));
}

// ---- DecodedRows -------------------------------------------------------------------------------

DecodedRows DecodedRows::decode(const KvPool& pool, PoolRead read,
                                std::span<const std::int64_t> visible, float kv_scale,
                                const SourceRowFn& source_row) {
  DecodedRows rows;
  rows.row_width_ = pool.row_width;
  rows.index_.assign(static_cast<std::size_t>(pool.num_slots), -1);
  std::int64_t held = 0;
  for (const std::int64_t slot : visible) {
    if (slot >= 0 && slot < pool.num_slots && rows.index_[slot] < 0) rows.index_[slot] = held++;
  }
  rows.values_.resize(static_cast<std::size_t>(held) * pool.row_width);
  for (std::int64_t slot = 0; slot < pool.num_slots; ++slot) {
    if (rows.index_[slot] < 0) continue;
    float* dst = rows.values_.data() + rows.index_[slot] * pool.row_width;
    if (read == PoolRead::kRequantizedUnitScale && pool.dtype == KvDtype::kFloat8E4m3fn) {
      // The kvdump write rule with scale 1: e4m3_rne_satfinite(fp32(x) / 1).
      const float* x = source_row ? source_row(slot) : nullptr;
      for (int j = 0; j < pool.row_width; ++j) {
        dst[j] = x != nullptr ? e4m3_decode(e4m3_encode(x[j], E4m3Overflow::kSatFinite))
                              : std::numeric_limits<float>::quiet_NaN();
      }
      continue;
    }
    for (int j = 0; j < pool.row_width; ++j) {
      dst[j] = decode_element(pool, read, slot, j, kv_scale);
    }
  }
  return rows;
}

const float* DecodedRows::row(std::int64_t slot) const {
  if (slot < 0 || slot >= static_cast<std::int64_t>(index_.size()) || index_[slot] < 0) {
    return nullptr;
  }
  return values_.data() + index_[slot] * row_width_;
}

// ---- variant_attention -------------------------------------------------------------------------

namespace {

// What every (row, head) pair of one call reads.
struct VariantProblem {
  int heads = 0;
  int dc = 0;
  int dr = 0;
  ResolvedVariant variant;
  std::span<const float> q_nope;
  std::span<const float> q_pe;
  std::span<double> out;
  std::span<double> lse;
  std::vector<int> request_of_row;
  std::vector<std::int64_t> visible_of_row;           // position + 1
  std::vector<std::vector<const float*>> token_rows;  // per request: the row of each position
  std::int64_t max_visible = 0;
};

Status resolve_variant_problem(const DumpAttributes& attrs, const StepMeta& step,
                               const DecodedRows& rows, VariantProblem& problem) {
  const int page = attrs.page_size;
  problem.token_rows.resize(step.batch_size());
  for (int b = 0; b < step.batch_size(); ++b) {
    if (step.rows_of(b) == 0) continue;
    const std::int64_t len = step.kv_len(b, page);
    for (std::int64_t p = 0; p < len; ++p) {
      const float* row = rows.row(step.slot_of(b, p, page));
      if (row == nullptr) {
        return internal_error("diagnosis step " + step.group,
                              fmt::format("slot of position {} of request {} not decoded", p, b));
      }
      problem.token_rows[b].push_back(row);
    }
  }
  for (int i = 0; i < step.num_rows(); ++i) {
    problem.request_of_row.push_back(step.request_of_row(i));
    problem.visible_of_row.push_back(step.position_of_row(i, page) + 1);
    problem.max_visible = std::max(problem.max_visible, problem.visible_of_row.back());
  }
  return ok_status();
}

// sum_j q_j k_j in double, four partial sums (the order is free at double's precision; four
// independent sums let the compiler use vector registers).
double dot(const double* q, const float* k, int n) {
  double partial[4] = {0.0, 0.0, 0.0, 0.0};
  int j = 0;
  for (; j + 4 <= n; j += 4) {
    for (int lane = 0; lane < 4; ++lane) partial[lane] += q[j + lane] * k[j + lane];
  }
  for (; j < n; ++j) partial[0] += q[j] * k[j];
  return (partial[0] + partial[1]) + (partial[2] + partial[3]);
}

// q as the variant's QK MMA reads it.
double rounded_query(QueryRounding rounding, float q, float query_scale) {
  switch (rounding) {
    case QueryRounding::kNone:
      return q;
    case QueryRounding::kE4m3:
    case QueryRounding::kE4m3Nope:  // run() keeps q_pe for this one
      return e4m3_decode(e4m3_encode(q, E4m3Overflow::kSatFinite));
    case QueryRounding::kE4m3Scaled: {  // a reciprocal multiply, as vLLM's QuantFP8 applies it
      const float reciprocal = 1.0f / query_scale;
      return e4m3_decode(e4m3_encode(q * reciprocal, E4m3Overflow::kSatFinite));
    }
    case QueryRounding::kTf32:
      return tf32_round(q);
  }
  return q;
}

// The weight P.V uses for the unrounded weight w (kE4m3Tile rounds like kE4m3, per tile).
double rounded_weight(WeightRounding rounding, double w) {
  switch (rounding) {
    case WeightRounding::kNone:
      return w;
    case WeightRounding::kE4m3:
    case WeightRounding::kE4m3Tile:
      return e4m3_decode(e4m3_encode(w, E4m3Overflow::kSatFinite));
    case WeightRounding::kTf32:
      return tf32_round(static_cast<float>(w));
  }
  return w;
}

// One (row, head) pair: the header's formulas in double.
class VariantKernel {
 public:
  explicit VariantKernel(const VariantProblem& problem)
      : p_(problem),
        q_(static_cast<std::size_t>(problem.dc + problem.dr)),
        s_(static_cast<std::size_t>(problem.max_visible)),
        acc_(problem.dc),
        split_acc_(problem.dc) {}

  void run(int row, int head) {
    const std::size_t pair = static_cast<std::size_t>(row) * p_.heads + head;
    const ResolvedVariant& v = p_.variant;
    const float query_scale = static_cast<float>(v.query_scale);
    for (int j = 0; j < p_.dc; ++j) {
      q_[j] = rounded_query(v.query, p_.q_nope[pair * p_.dc + j], query_scale);
    }
    for (int j = 0; j < p_.dr; ++j) {
      q_[p_.dc + j] = v.query == QueryRounding::kE4m3Nope
                          ? p_.q_pe[pair * p_.dr + j]
                          : rounded_query(v.query, p_.q_pe[pair * p_.dr + j], query_scale);
    }
    pair_rope(v.rope);
    const auto& rows = p_.token_rows[p_.request_of_row[row]];
    const std::int64_t n = p_.visible_of_row[row];
    double* out = p_.out.data() + pair * p_.dc;
    const double score_scale = v.sm_scale * v.query_scale;
    double m = -std::numeric_limits<double>::infinity();
    for (std::int64_t t = 0; t < n; ++t) {
      const float* k = rows[t];
      const double latent = dot(q_.data(), k, p_.dc);
      const double rope = dot(q_.data() + p_.dc, k + p_.dc, p_.dr);
      s_[t] = score_scale * (v.latent_scale * latent + v.rope_scale * rope);
      if (std::isnan(s_[t])) {
        std::fill_n(out, p_.dc, std::numeric_limits<double>::quiet_NaN());
        p_.lse[pair] = std::numeric_limits<double>::quiet_NaN();
        return;
      }
      m = std::max(m, s_[t]);
    }
    std::fill(acc_.begin(), acc_.end(), 0.0);
    double l = 0.0;
    if (v.weights == WeightRounding::kE4m3Tile) {
      m = tiled_weights(rows, n, l);
    } else {
      l = accumulate(rows, 0, n, m, acc_);
    }
    for (int d = 0; d < p_.dc; ++d) out[d] = v.value_scale * acc_[d] / l;
    p_.lse[pair] = m + std::log(l);
  }

 private:
  // q_pe (q_[Dc:]) as it meets r_t under the pairing: q . D(r) = I(q) . r, the scores' RoPE dot
  // then reads r_t as stored.
  void pair_rope(RopePairing rope) {
    if (rope == RopePairing::kAsStored) return;
    double* q_pe = q_.data() + p_.dc;
    if (rope == RopePairing::kDropped) {
      std::fill_n(q_pe, p_.dr, 0.0);
      return;
    }
    const int half = p_.dr / 2;
    rope_.assign(q_pe, q_pe + p_.dr);
    for (int j = 0; j < half; ++j) {
      if (rope == RopePairing::kKeyDeinterleaved) {  // I(q): y[2j] = q[j], y[2j + 1] = q[half + j]
        q_pe[2 * j] = rope_[j];
        q_pe[2 * j + 1] = rope_[half + j];
      } else {  // D(q): y[j] = q[2j], y[half + j] = q[2j + 1]
        q_pe[j] = rope_[2 * j];
        q_pe[half + j] = rope_[2 * j + 1];
      }
    }
  }

  // acc += sum_{t in [begin, end)} p_t c_t with w_t = exp(s_t - m); returns the tokens' share of
  // l (sum of w_t, or of p_t with Normaliser::kRounded).
  double accumulate(const std::vector<const float*>& rows, std::int64_t begin, std::int64_t end,
                    double m, std::vector<double>& acc) const {
    const ResolvedVariant& v = p_.variant;
    // e4m3 codes are finite (a NaN code made its score NaN above), so a zero weight adds
    // nothing; other reads may hold Inf, where 0 x Inf must stay NaN, as in a kernel.
    const bool skip_zero_weights = v.read == PoolRead::kAsStored;
    double l = 0.0;
    for (std::int64_t t = begin; t < end; ++t) {
      const double w = std::exp(s_[t] - m);
      const double p = rounded_weight(v.weights, w);
      l += v.normaliser == Normaliser::kRounded ? p : w;
      if (p == 0.0 && skip_zero_weights) continue;
      const float* c = rows[t];
      for (int d = 0; d < p_.dc; ++d) acc[d] += p * c[d];
    }
    return l;
  }

  // p-e4m3-tile: within each split, the running max m_j after tile j; the split's accumulator and
  // normaliser are rescaled by exp(m_{j-1} - m_j) as the max grows; the splits merge exactly,
  // acc = sum_k exp(m_k - M) acc_k, l = sum_k exp(m_k - M) l_k (the lse merge). Leaves acc_ and l;
  // returns M, the row's max.
  double tiled_weights(const std::vector<const float*>& rows, std::int64_t n, double& l) {
    const std::vector<TokenRange> ranges = tile_ranges(n, p_.variant.tiles);
    double merged_m = -std::numeric_limits<double>::infinity();
    double split_m = merged_m;
    double split_l = 0.0;
    const auto merge_split = [&] {
      if (split_m == -std::numeric_limits<double>::infinity()) return;
      const double new_m = std::max(merged_m, split_m);
      const double old_factor = std::exp(merged_m - new_m);
      const double split_factor = std::exp(split_m - new_m);
      for (int d = 0; d < p_.dc; ++d) {
        acc_[d] = acc_[d] * old_factor + split_acc_[d] * split_factor;
      }
      l = l * old_factor + split_l * split_factor;
      merged_m = new_m;
    };
    for (const TokenRange& range : ranges) {
      if (range.split_start) {
        merge_split();
        split_m = -std::numeric_limits<double>::infinity();
        split_l = 0.0;
        std::fill(split_acc_.begin(), split_acc_.end(), 0.0);
      }
      double tile_m = split_m;
      for (std::int64_t t = range.begin; t < range.end; ++t) tile_m = std::max(tile_m, s_[t]);
      if (split_m != -std::numeric_limits<double>::infinity() && tile_m != split_m) {
        const double factor = std::exp(split_m - tile_m);
        for (double& a : split_acc_) a *= factor;
        split_l *= factor;
      }
      split_m = tile_m;
      split_l += accumulate(rows, range.begin, range.end, split_m, split_acc_);
    }
    merge_split();
    return merged_m;
  }

  const VariantProblem& p_;
  std::vector<double> q_;     // q_nope then q_pe, widened (and rounded) once per pair
  std::vector<double> rope_;  // q_pe before pair_rope's permutation
  std::vector<double> s_;
  std::vector<double> acc_;
  std::vector<double> split_acc_;
};

}  // namespace

Status variant_attention(const DumpAttributes& attrs, const StepMeta& step,
                         std::span<const float> q_nope, std::span<const float> q_pe,
                         const DecodedRows& rows, const ResolvedVariant& variant,
                         std::span<double> out, std::span<double> lse, int threads) {
  const std::size_t pairs = static_cast<std::size_t>(step.num_rows()) * attrs.num_heads;
  if (rows.row_width() != attrs.row_width() || q_nope.size() != pairs * attrs.kv_lora_rank ||
      q_pe.size() != pairs * attrs.qk_rope_head_dim || out.size() != pairs * attrs.kv_lora_rank ||
      lse.size() != pairs) {
    return internal_error("diagnosis step " + step.group,
                          "q_nope/q_pe/out/lse or KV row sizes disagree with [Nq, H, Dc/Dr]");
  }
  VariantProblem problem;
  problem.heads = attrs.num_heads;
  problem.dc = attrs.kv_lora_rank;
  problem.dr = attrs.qk_rope_head_dim;
  problem.variant = variant;
  problem.q_nope = q_nope;
  problem.q_pe = q_pe;
  problem.out = out;
  problem.lse = lse;
  KVAUDIT_TRY(resolve_variant_problem(attrs, step, rows, problem));
  const std::size_t heads = static_cast<std::size_t>(attrs.num_heads);
  parallel_for(pairs, threads, [&] {
    return [&problem, heads, kernel = VariantKernel(problem)](std::size_t pair) mutable {
      kernel.run(static_cast<int>(pair / heads), static_cast<int>(pair % heads));
    };
  });
  return ok_status();
}

// ---- diagnose ----------------------------------------------------------------------------------

namespace {

// What one resolved variant gave on the failing comparison (shared by hypotheses that resolve to
// the same variant).
struct Evaluation {
  ErrorSummary after;
  std::optional<ErrorSummary> after_stored;  // against bf16(replay out): a bf16-out candidate
  HypothesisJudgement judgement;
};

// out as a candidate that stores it in bf16 holds it: bf16(fp32(x)), the fp32 accumulator
// rounded to nearest even on store.
std::vector<double> stored_as_bf16(std::span<const double> out) {
  std::vector<double> stored(out.size());
  for (std::size_t i = 0; i < out.size(); ++i) {
    stored[i] = bf16_round(static_cast<float>(out[i]));
  }
  return stored;
}

double max_abs_finite(std::span<const double> values) {
  double largest = 0.0;
  for (const double x : values) {
    if (std::isfinite(x)) largest = std::max(largest, std::abs(x));
  }
  return largest;
}

float query_amax(const StepLayerTensors& tensors) {
  float amax = 0.0f;
  for (const std::span<const float> q :
       {std::span<const float>(tensors.q_nope), std::span<const float>(tensors.q_pe)}) {
    for (const float x : q) {
      if (std::isfinite(x)) amax = std::max(amax, std::abs(x));
    }
  }
  return amax;
}

std::int64_t max_visible_of(const DiagnosisInput& input) {
  std::int64_t largest = 0;
  for (int i = 0; i < input.step.num_rows(); ++i) {
    largest = std::max(largest, input.step.position_of_row(i, input.attrs.page_size) + 1);
  }
  return largest;
}

// One entry of the search: a catalogue hypothesis (p-e4m3-tile once per tile shape) or a
// combination of them.
struct Candidate {
  std::string name;  // "q-e4m3", "q-e4m3 + p-e4m3-tile"
  Transform transform;
  TileShape tiles;
  std::vector<std::size_t> members;  // indices of the singles it combines (itself for a single)
};

struct Tried {
  Candidate candidate;
  ResolvedVariant variant;
  HypothesisOutcome outcome;
  double closest_metric_ratio = 0.0;  // HypothesisJudgement's: how much it helps one metric
};

class Diagnoser {
 public:
  explicit Diagnoser(const DiagnosisInput& input)
      : input_(input),
        identity_(resolve(Transform{}, input.kv_scale, input.attrs.sm_scale)),
        mscale_squared_(yarn_mscale_squared(input.attrs)),
        query_amax_(query_amax(input.tensors)),
        max_visible_(max_visible_of(input)),
        compares_out_(!input.reference.out.empty()),
        compares_lse_(!input.reference.lse.empty()),
        baseline_(stored_baseline(input)) {}

  const ResolvedVariant& identity() const { return identity_; }
  // The candidate against bf16(reference out), where it stores out in bf16: the no-hypothesis
  // distance the fraction rule divides by (nullopt: the rule uses the comparison's own metrics).
  const std::optional<ComparisonMetrics>& baseline() const { return baseline_; }

  // Why a candidate that changes the softmax scale by YaRN's mscale^2 was not tried here ("" for
  // any other): the report's not_applicable entry says it, so nothing reads as guessed.
  std::string mscale_unknown_note(const Transform& transform) const {
    const bool mscale_rule = transform.sm_scale == SmScaleRule::kWithoutMscale ||
                             transform.sm_scale == SmScaleRule::kMscaleTwice;
    if (!mscale_rule) return "";
    if (!mscale_squared_) return " (the dump has no rope_factor and rope_mscale_all_dim)";
    if (*mscale_squared_ == 1.0) return " (mscale^2 is 1 for the dump's rope attributes)";
    return "";
  }

  // The candidate resolved for this (step, layer); a tiled rounding whose one split's tile holds
  // every row is p-e4m3 (the same computation), and is resolved as such.
  ResolvedVariant resolve_candidate(const Candidate& candidate) const {
    ResolvedVariant v = resolve(candidate.transform, input_.kv_scale, input_.attrs.sm_scale,
                                query_amax_, candidate.tiles, mscale_squared_);
    if (v.weights == WeightRounding::kE4m3Tile && v.tiles.splits <= 1 &&
        v.tiles.tile >= max_visible_) {
      v.weights = WeightRounding::kE4m3;
      v.tiles = {};
    }
    return v;
  }

  // Whether the variant could change anything here.
  bool applicable(const ResolvedVariant& v) const {
    const bool fp8 = input_.pool.dtype == KvDtype::kFloat8E4m3fn;
    if (v.read != PoolRead::kAsStored && !fp8) return false;
    if (v.candidate_lse != LseBase::kNatural && input_.candidate.lse.empty()) return false;
    if (v.read == PoolRead::kRequantizedUnitScale && !covers_sources()) return false;
    if (!std::isfinite(v.sm_scale)) return false;  // an mscale rule without rope attributes
    if (v.rope != RopePairing::kAsStored && input_.attrs.qk_rope_head_dim == 0) return false;
    return !(v.same_computation(identity_) && v.candidate_lse == identity_.candidate_lse);
  }

  // The variant's evaluation, computed once per distinct variant.
  Result<Evaluation> evaluate(const ResolvedVariant& variant) {
    for (const auto& [seen, evaluation] : evaluated_) {
      if (seen == variant) return evaluation;
    }
    KVAUDIT_ASSIGN_OR_RETURN(const Evaluation evaluation, compute(variant));
    evaluated_.emplace_back(variant, evaluation);
    return evaluation;
  }

 private:
  bool covers_sources() const {
    if (!input_.source_row) return false;
    return std::all_of(input_.visible.begin(), input_.visible.end(),
                       [&](std::int64_t slot) { return input_.source_row(slot) != nullptr; });
  }

  Result<Evaluation> compute(const ResolvedVariant& variant) {
    // The hypothesis's reference: the comparison's own where the computation is R8's.
    OutputView reference = input_.reference;
    if (!variant.same_computation(identity_)) {
      KVAUDIT_TRY(compute_reference(variant));
      reference = {compares_out_ ? std::span<const double>(out_) : std::span<const double>(),
                   compares_lse_ ? std::span<const double>(lse_) : std::span<const double>()};
    }
    std::vector<double> lse_stored;
    if (variant.candidate_lse == LseBase::kBf16) {
      for (const double x : reference.lse) lse_stored.push_back(bf16_round(static_cast<float>(x)));
      reference.lse = lse_stored;
    }
    OutputView candidate = input_.candidate;
    std::vector<double> lse_natural;
    if (variant.candidate_lse == LseBase::kTwo) {
      for (const double x : candidate.lse) lse_natural.push_back(x * kLn2);
      candidate.lse = lse_natural;
    }
    const ComparisonMetrics after =
        compare_outputs(input_.shape, reference.out, candidate.out, reference.lse, candidate.lse,
                        input_.policy.rel_floor);
    Evaluation evaluation;
    evaluation.after = summarize_error(after);
    std::optional<ComparisonMetrics> after_stored;
    if (baseline_) {
      const std::vector<double> stored = stored_as_bf16(reference.out);
      after_stored = compare_outputs(input_.shape, stored, candidate.out, reference.lse,
                                     candidate.lse, input_.policy.rel_floor);
      evaluation.after_stored = summarize_error(*after_stored);
    }
    const StoredDistances distances{baseline_ ? *baseline_ : input_.failed.metrics,
                                    after_stored ? *after_stored : after};
    evaluation.judgement =
        judge_hypothesis(input_.policy, input_.failed.comparison, input_.failed.metrics, after,
                         max_abs_finite(reference.lse), baseline_ ? &distances : nullptr);
    return evaluation;
  }

  // The no-hypothesis distance with the candidate's bf16 store modelled: bf16(reference out)
  // against the candidate, the lse as the comparison read it.
  static std::optional<ComparisonMetrics> stored_baseline(const DiagnosisInput& input) {
    if (input.candidate_out != OutputStorage::kBfloat16 || input.reference.out.empty()) {
      return std::nullopt;
    }
    const std::vector<double> stored = stored_as_bf16(input.reference.out);
    return compare_outputs(input.shape, stored, input.candidate.out, input.reference.lse,
                           input.candidate.lse, input.policy.rel_floor);
  }

  Status compute_reference(const ResolvedVariant& variant) {
    auto decoded = decoded_.find(variant.read);
    if (decoded == decoded_.end()) {
      decoded =
          decoded_
              .emplace(variant.read, DecodedRows::decode(input_.pool, variant.read, input_.visible,
                                                         input_.kv_scale, input_.source_row))
              .first;
    }
    const TensorShape3 full{input_.shape.rows, input_.shape.heads, input_.attrs.kv_lora_rank};
    out_.assign(full.size(), 0.0);
    lse_.assign(static_cast<std::size_t>(full.rows) * full.heads, 0.0);
    return variant_attention(input_.attrs, input_.step, input_.tensors.q_nope, input_.tensors.q_pe,
                             decoded->second, variant, out_, lse_, input_.threads);
  }

  const DiagnosisInput& input_;
  ResolvedVariant identity_;
  std::optional<double> mscale_squared_;
  float query_amax_;
  std::int64_t max_visible_;
  bool compares_out_;
  bool compares_lse_;
  std::optional<ComparisonMetrics> baseline_;
  std::map<PoolRead, DecodedRows> decoded_;
  std::vector<double> out_;
  std::vector<double> lse_;
  std::vector<std::pair<ResolvedVariant, Evaluation>> evaluated_;
};

std::vector<TileShape> tile_shapes(const DiagnosisInput& input) {
  if (!input.tiles.empty()) return input.tiles;
  std::vector<TileShape> shapes;
  for (const int tile : kDefaultDiagnoseTiles) shapes.push_back({tile, 1});
  return shapes;
}

// The singles: the catalogue in order, p-e4m3-tile once per tile shape.
std::vector<Candidate> single_candidates(const DiagnosisInput& input) {
  std::vector<Candidate> singles;
  for (const HypothesisInfo& info : kCatalogue) {
    if (info.transform.weights != WeightRounding::kE4m3Tile) {
      singles.push_back({info.name, info.transform, {}, {singles.size()}});
      continue;
    }
    for (const TileShape& shape : tile_shapes(input)) {
      singles.push_back({info.name, info.transform, shape, {singles.size()}});
    }
  }
  return singles;
}

// Merges singles into one candidate; nullopt when two change the same part of the computation.
std::optional<Candidate> merged(const std::vector<Tried>& singles,
                                const std::vector<std::size_t>& parts) {
  Candidate c;
  for (const std::size_t i : parts) {
    const Candidate& single = singles[i].candidate;
    if (!c.members.empty() && !combinable(c.transform, single.transform)) return std::nullopt;
    c.transform = c.members.empty() ? single.transform : combine(c.transform, single.transform);
    if (single.transform.weights == WeightRounding::kE4m3Tile) c.tiles = single.tiles;
    c.name += (c.members.empty() ? "" : " + ") + single.name;
    c.members.push_back(i);
  }
  return c;
}

// The pairs: each of the kPairAnchors singles that help most (that bring the candidate closer
// than R8 does, by more than kHypothesisTieRatio, in at least one compared metric or passing out
// metric: HypothesisJudgement::closest_metric_ratio) with every other single it combines with. The
// partner need not help alone: a rounding applied to inputs another mismatch moved (P rounded on
// scores from a rounded q) does not help on its own.
std::vector<Candidate> pairs(const std::vector<Tried>& singles) {
  std::vector<std::size_t> helping;
  for (std::size_t i = 0; i < singles.size(); ++i) {
    if (singles[i].closest_metric_ratio * kHypothesisTieRatio < 1.0) helping.push_back(i);
  }
  std::stable_sort(helping.begin(), helping.end(), [&](std::size_t a, std::size_t b) {
    return singles[a].outcome.fraction < singles[b].outcome.fraction;
  });
  helping.resize(std::min<std::size_t>(helping.size(), kPairAnchors));
  std::vector<Candidate> found;
  std::set<std::vector<std::size_t>> seen;
  for (const std::size_t anchor : helping) {
    for (std::size_t other = 0; other < singles.size(); ++other) {
      std::vector<std::size_t> members = {std::min(anchor, other), std::max(anchor, other)};
      if (other == anchor || !seen.insert(members).second) continue;
      if (auto c = merged(singles, members)) found.push_back(std::move(*c));
    }
  }
  return found;
}

// The triples: the closest competing pair with every other single it combines with.
std::vector<Candidate> triples(const std::vector<Tried>& singles, const Tried* best_pair) {
  std::vector<Candidate> found;
  if (best_pair == nullptr) return found;
  for (std::size_t other = 0; other < singles.size(); ++other) {
    std::vector<std::size_t> members = best_pair->candidate.members;
    if (std::find(members.begin(), members.end(), other) != members.end()) continue;
    members.push_back(other);
    std::sort(members.begin(), members.end());
    if (auto c = merged(singles, members)) found.push_back(std::move(*c));
  }
  return found;
}

std::string display_name(const Candidate& c) {
  if (c.transform.weights != WeightRounding::kE4m3Tile || c.members.size() > 1) return c.name;
  return fmt::format("{} (tile {}, {} split{})", c.name, c.tiles.tile, c.tiles.splits,
                     c.tiles.splits == 1 ? "" : "s");
}

// Evaluates `candidates`, appending those that apply to `tried` (the others' names to
// not_applicable, once each).
Status try_candidates(Diagnoser& diagnoser, const std::vector<Candidate>& candidates,
                      std::vector<Tried>& tried, DiagnosisFinding& finding) {
  for (const Candidate& candidate : candidates) {
    const ResolvedVariant variant = diagnoser.resolve_candidate(candidate);
    const bool duplicate = std::any_of(tried.begin(), tried.end(), [&](const Tried& t) {
      return t.candidate.name == candidate.name && t.variant == variant;
    });
    // A tiled rounding whose tile holds every row is p-e4m3 here (resolve_candidate).
    const bool untiled = candidate.transform.weights == WeightRounding::kE4m3Tile &&
                         variant.weights != WeightRounding::kE4m3Tile;
    if (duplicate || untiled || !diagnoser.applicable(variant)) {
      const std::string name =
          display_name(candidate) + diagnoser.mscale_unknown_note(candidate.transform);
      if (std::find(finding.not_applicable.begin(), finding.not_applicable.end(), name) ==
          finding.not_applicable.end()) {
        finding.not_applicable.push_back(name);
      }
      continue;
    }
    KVAUDIT_ASSIGN_OR_RETURN(const Evaluation evaluation, diagnoser.evaluate(variant));
    const HypothesisJudgement& j = evaluation.judgement;
    tried.push_back(
        {candidate, variant,
         HypothesisOutcome{candidate.name, describe_variant(variant, diagnoser.identity()),
                           evaluation.after, j.explains, j.reasons, j.excess, j.fraction,
                           evaluation.after_stored},
         j.closest_metric_ratio});
  }
  return ok_status();
}

// A combination competes only when none of its parts (its singles, and the smaller combinations
// of them tried) explains on its own and it is closer than each of them by kHypothesisTieRatio:
// otherwise the simpler explanation stands.
bool competes(const Tried& t, const std::vector<Tried>& singles, const std::vector<Tried>& combos) {
  const auto& members = t.candidate.members;
  if (members.size() < 2) return true;
  const auto dominated_by = [&](const Tried& part) {
    return part.outcome.explains ||
           !(t.outcome.fraction * kHypothesisTieRatio < part.outcome.fraction);
  };
  for (const std::size_t i : members) {
    if (dominated_by(singles[i])) return false;
  }
  for (const Tried& other : combos) {
    const auto& sub = other.candidate.members;
    const bool strict_subset =
        sub.size() < members.size() &&
        std::includes(members.begin(), members.end(), sub.begin(), sub.end());
    if (strict_subset && dominated_by(other)) return false;
  }
  return true;
}

// The closest that does not explain: the smallest finite fraction, then the smallest excess.
bool closer(const HypothesisOutcome& candidate, const std::optional<HypothesisOutcome>& current) {
  if (!std::isfinite(candidate.fraction)) return false;
  if (!current) return true;
  if (candidate.fraction != current->fraction) return candidate.fraction < current->fraction;
  return candidate.excess < current->excess;
}

}  // namespace

Result<DiagnosisFinding> diagnose(const DiagnosisInput& input) {
  DiagnosisFinding finding;
  finding.step = input.failed.step;
  finding.layer_id = input.failed.layer_id;
  finding.comparison = input.failed.comparison;
  finding.before = summarize_error(input.failed.metrics);
  Diagnoser diagnoser(input);
  if (diagnoser.baseline()) finding.baseline_stored = summarize_error(*diagnoser.baseline());
  // 1. Singles, then combinations of those that help.
  std::vector<Tried> singles;
  KVAUDIT_TRY(try_candidates(diagnoser, single_candidates(input), singles, finding));
  std::vector<Tried> combos;
  KVAUDIT_TRY(try_candidates(diagnoser, pairs(singles), combos, finding));
  const Tried* best_pair = nullptr;
  for (const Tried& t : combos) {
    if (competes(t, singles, combos) &&
        (best_pair == nullptr || t.outcome.fraction < best_pair->outcome.fraction)) {
      best_pair = &t;
    }
  }
  const std::vector<Candidate> triple_candidates = triples(singles, best_pair);
  KVAUDIT_TRY(try_candidates(diagnoser, triple_candidates, combos, finding));
  // 2. The contenders and the closest of them.
  std::vector<const Tried*> contenders;
  for (const Tried& t : singles) contenders.push_back(&t);
  for (const Tried& t : combos) {
    if (competes(t, singles, combos)) contenders.push_back(&t);
  }
  double best = std::numeric_limits<double>::infinity();
  for (const Tried* t : contenders) best = std::min(best, t->outcome.fraction);
  // 3. Those that explain: pass the limits and the fraction rule, and are the closest (or within
  // kHypothesisTieRatio of it: indistinguishable).
  std::vector<ResolvedVariant> explaining;
  for (const Tried* t : contenders) {
    HypothesisOutcome outcome = t->outcome;
    const bool closest = outcome.fraction <= best * kHypothesisTieRatio;
    if (outcome.explains && !closest) {
      outcome.explains = false;
      outcome.reasons.push_back(fmt::format(
          "another hypothesis is closer: its replay is {:.3g} of the candidate's distance, this "
          "one {:.3g} (more than {:g}x)",
          best, outcome.fraction, kHypothesisTieRatio));
    }
    if (outcome.explains) {
      finding.explained_by.push_back(outcome);
      explaining.push_back(t->variant);
    } else if (closer(outcome, finding.closest)) {
      finding.closest = outcome;
    }
  }
  if (!finding.explained_by.empty()) finding.closest.reset();
  finding.same_computation =
      explaining.size() > 1 &&
      std::all_of(explaining.begin(), explaining.end(),
                  [&](const ResolvedVariant& v) { return v == explaining.front(); });
  for (const std::vector<Tried>* group : {&singles, &combos}) {
    for (const Tried& t : *group) {
      HypothesisOutcome outcome = t.outcome;
      outcome.explains = std::any_of(finding.explained_by.begin(), finding.explained_by.end(),
                                     [&](const HypothesisOutcome& e) {
                                       return e.hypothesis == outcome.hypothesis &&
                                              e.transform == outcome.transform;
                                     });
      finding.hypotheses.push_back(std::move(outcome));
    }
  }
  finding.tried = static_cast<int>(finding.hypotheses.size());
  return finding;
}

// ---- DiagnosisBudget ---------------------------------------------------------------------------

bool DiagnosisBudget::admit(int step, std::size_t layer_order) {
  const Site site{step, layer_order};
  failing_.insert(site);
  if (limit_ <= 0) return false;
  if (kept_.count(site) != 0) return true;
  if (kept_.size() >= static_cast<std::size_t>(limit_)) {
    if (!(site < kept_.rbegin()->first)) return false;
    kept_.erase(std::prev(kept_.end()));  // a later site gives way to this earlier one
  }
  kept_[site];
  return true;
}

void DiagnosisBudget::add(int step, std::size_t layer_order, DiagnosisFinding finding) {
  kept_[{step, layer_order}].push_back(std::move(finding));
}

bool DiagnosisBudget::could_admit(int step, std::size_t layer_order) const {
  if (limit_ <= 0) return false;
  if (kept_.size() < static_cast<std::size_t>(limit_)) return true;
  return Site{step, layer_order} <= kept_.rbegin()->first;
}

// The kept sites are the `limit_` earliest failing ones whatever the order of admission, and a site
// this budget keeps after admitting `other`'s was among `other`'s earliest too (kept there with
// its diagnoses, as `other` has the same limit).
void DiagnosisBudget::absorb(DiagnosisBudget other) {
  for (const Site& site : other.failing_) admit(site.first, site.second);
  for (auto& [site, findings] : other.kept_) {
    const auto kept = kept_.find(site);
    if (kept == kept_.end()) continue;
    kept->second.insert(kept->second.end(), std::make_move_iterator(findings.begin()),
                        std::make_move_iterator(findings.end()));
  }
}

std::vector<DiagnosisFinding> DiagnosisBudget::findings() const {
  std::vector<DiagnosisFinding> all;
  for (const auto& [site, findings] : kept_)
    all.insert(all.end(), findings.begin(), findings.end());
  return all;
}

}  // namespace kvaudit
