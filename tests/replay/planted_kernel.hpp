// A small fp32 model of an FP8 MLA attention kernel that can commit each convention mismatch of
// the diagnosis catalogue (src/replay/diagnosis.hpp), written here from the mismatches' own
// definitions (not from the code under test), to plant failures: as a test Backend (kernel
// comparison) or as a dump's captured out/lse (captured comparison).
//
// The clean model, per query row i, head h, over the visible tokens t (single pass, one tile):
//   k_t = decode(pool row), s_t = fp32(q . (a c_t, b r_t)) * sm * log2 e   (base 2, as cpu-fp8)
//   m = max_t s_t, w_t = exp2(s_t - m), l = sum_t w_t, p_t = bf16(w_t)
//   out = bf16(a * sum_t p_t c_t / l),  lse = (m + log2 l) * ln 2
// with a = b = kv_scale, sm = sm_scale, e4m3 decoding. The translation faults: sm divided or
// multiplied by YaRN's mscale^2 from the dump's rope attributes, q_pe or r_t read de-interleaved
// (position c holds element 2c, then 2(c - Dr/2) + 1), or the RoPE dot left out. Each mismatch
// changes one ingredient; a PlantedChoices may commit several at once (those that change
// different ingredients). The tiled one (p-e4m3-tile) runs the flash loop: per split of
// ceil(ceil(n / S) / T) * T tokens, per tile of T tokens, m_j = max(m_{j-1}, max of tile j),
// p = e4m3(exp2(s - m_j)), acc and l rescaled by exp2(m_{j-1} - m_j), l summing the unrounded
// weights; the splits merged by their lse. PlantedChoices::p_bf16 false leaves P in fp32. Shapes:
// q_nope [Nq, H, Dc], q_pe [Nq, H, Dr], pool [S, Dc + Dr], out [Nq, H, Dc], lse [Nq, H].
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "src/backend/backend.hpp"
#include "src/backend/mla_attention_cpu.hpp"
#include "src/core/fp8_e4m3.hpp"
#include "src/replay/diagnosis.hpp"  // Hypothesis: the labels only
#include "tests/replay/check_dumps.hpp"

namespace kvaudit::testing {

// What a planted kernel commits: none (the clean model), one mismatch, or several; the tile and
// split of p-e4m3-tile.
struct PlantedChoices {
  std::vector<Hypothesis> mismatches;
  int tile = 64;
  int splits = 1;
  // P rounded to bf16 before P.V (the clean model); false: fp32 P, so that what separates the
  // kernel from a replay of its choices is its fp32 arithmetic and its bf16 out store alone.
  bool p_bf16 = true;
  PlantedChoices() = default;
  PlantedChoices(std::nullopt_t) {}              // NOLINT: the clean model, as std::nullopt
  PlantedChoices(std::optional<Hypothesis> h) {  // NOLINT: one mismatch, as before
    if (h) mismatches.push_back(*h);
  }
  PlantedChoices(Hypothesis h) : mismatches{h} {}  // NOLINT
  PlantedChoices(std::vector<Hypothesis> all, int tile_tokens, int split_count)
      : mismatches(std::move(all)), tile(tile_tokens), splits(split_count) {}
  bool has(Hypothesis h) const {
    return std::find(mismatches.begin(), mismatches.end(), h) != mismatches.end();
  }
  std::string label() const {
    std::string text;
    for (const Hypothesis h : mismatches)
      text += (text.empty() ? "" : " + ") + std::string(hypothesis_name(h));
    return text.empty() ? "none (the clean model)" : text;
  }
};

// fp32 -> TF32 from its definition: 11 significant bits, round half away from zero (std::round).
inline float planted_tf32(float x) {
  if (!std::isfinite(x) || x == 0.0f) return x;
  int exponent = 0;
  const double mantissa = std::frexp(static_cast<double>(x), &exponent);  // [0.5, 1)
  return static_cast<float>(std::ldexp(std::round(std::ldexp(mantissa, 11)), exponent - 11));
}

// The multiplier a planted kernel reads a pool with, from each mismatch's definition.
inline float planted_scale(std::optional<Hypothesis> planted, float s) {
  if (!planted) return s;
  switch (*planted) {
    case Hypothesis::kScalePow2Floor:
      return std::exp2(std::floor(std::log2(s)));
    case Hypothesis::kScalePow2Nearest: {
      const float nearest = std::exp2(std::round(std::log2(s)));
      return nearest == s ? 2.0f * s : nearest;  // the scale-mismatch injection's rule
    }
    case Hypothesis::kScaleE8m0:
      return std::exp2(std::ceil(std::log2(s)));
    case Hypothesis::kScaleBf16:
      return bf16_round(s);
    case Hypothesis::kScaleFp16:
      return static_cast<float>(static_cast<_Float16>(s));  // GCC's binary16: nearest even
    case Hypothesis::kScaleReciprocal:
      return 1.0f / s;
    case Hypothesis::kScaleSquared:
      return s * s;
    case Hypothesis::kScaleNotApplied:
    case Hypothesis::kDequantBf16:  // the scale is applied per element (planted_element)
    case Hypothesis::kDequantFp32Bf16:
    case Hypothesis::kTf32:
      return 1.0f;
    default:
      return s;
  }
}

// An fp8 byte read as e5m2: the high byte of an IEEE half (S, 5 exponent bits, 10 mantissa bits).
inline float half_high_byte_value(std::uint8_t code) {
  const unsigned half = static_cast<unsigned>(code) << 8;
  const int exponent = static_cast<int>((half >> 10) & 0x1F);
  const double mantissa = static_cast<double>(half & 0x3FF) / 1024.0;
  double magnitude;
  if (exponent == 0x1F) {
    magnitude = mantissa == 0.0 ? INFINITY : NAN;
  } else if (exponent == 0) {
    magnitude = std::ldexp(mantissa, -14);
  } else {
    magnitude = std::ldexp(1.0 + mantissa, exponent - 15);
  }
  return static_cast<float>((half & 0x8000) ? -magnitude : magnitude);
}

// Element j of slot `slot` as the planted kernel decodes it, without any scale (but dequant-bf16's:
// FlashInfer 0.6's repack, bf16 code times the bf16 scale, rounded to bf16 like __hmul2).
inline float planted_element(std::optional<Hypothesis> planted, const KvPool& pool,
                             std::int64_t slot, int j, float kv_scale) {
  if (planted == Hypothesis::kDequantBf16) {
    const float scale = bf16_round(kv_scale);
    return bf16_round(e4m3_decode(pool.row(slot)[j]) * scale);
  }
  if (planted == Hypothesis::kDequantFp32Bf16) {
    return bf16_round(e4m3_decode(pool.row(slot)[j]) * kv_scale);
  }
  if (planted == Hypothesis::kTf32) return planted_tf32(e4m3_decode(pool.row(slot)[j]) * kv_scale);
  if (planted == Hypothesis::kReadAsE5m2) return half_high_byte_value(pool.row(slot)[j]);
  if (planted == Hypothesis::kReadAsBf16) {
    // The fp8 buffer addressed as a bf16 [S, D] array (2 bytes per element, little endian).
    const std::size_t at = 2 * (static_cast<std::size_t>(slot) * pool.row_width + j);
    if (at + 1 >= pool.bytes.size()) return 0.0f;
    return bf16_to_float(static_cast<std::uint16_t>(pool.bytes[at] | (pool.bytes[at + 1] << 8)));
  }
  return e4m3_decode(pool.row(slot)[j]);
}

struct PlantedOutput {
  std::vector<float> out;  // [Nq, H, Dc], bf16 values
  std::vector<float> lse;  // [Nq, H]
};

// The ingredient-changing mismatch of `choices` that planted_scale / planted_element know, if any.
inline std::optional<Hypothesis> scale_or_read_mismatch(const PlantedChoices& choices) {
  for (const Hypothesis h : choices.mismatches) {
    switch (h) {
      case Hypothesis::kQueryE4m3:
      case Hypothesis::kQueryE4m3Scaled:
      case Hypothesis::kQueryNopeE4m3:
      case Hypothesis::kProbabilitiesE4m3:
      case Hypothesis::kProbabilitiesE4m3Tile:
      case Hypothesis::kLseBf16:
      case Hypothesis::kLseBase2:
      case Hypothesis::kKeyScaleInSmScale:
      case Hypothesis::kValueScaleOnOutput:
      case Hypothesis::kValueDescaleMissing:
      case Hypothesis::kSmScaleMissing:
      case Hypothesis::kSmScaleLog2e:
      case Hypothesis::kSmScaleMscaleDropped:
      case Hypothesis::kSmScaleMscaleTwice:
      case Hypothesis::kKpeDeinterleaved:
      case Hypothesis::kQpeDeinterleaved:
      case Hypothesis::kRopeDotMissing:
        continue;
      default:
        return h;
    }
  }
  return std::nullopt;
}

// q as the planted QK MMA reads it.
inline float planted_query(const PlantedChoices& c, float q, float q_scale) {
  if (c.has(Hypothesis::kQueryE4m3) || c.has(Hypothesis::kQueryNopeE4m3)) {
    return e4m3_decode(e4m3_encode(q));
  }
  if (c.has(Hypothesis::kQueryE4m3Scaled)) {  // QuantFP8's path: times the fp32 reciprocal
    const float inverse_scale = 1.0f / q_scale;
    return e4m3_decode(e4m3_encode(q * inverse_scale));
  }
  if (c.has(Hypothesis::kTf32)) return planted_tf32(q);
  return q;
}

// YaRN's factor on the softmax scale from its definition (transformers' yarn_get_mscale, squared
// once into DeepseekV3Attention.scaling): (0.1 * mscale_all_dim * ln factor + 1)^2.
inline double planted_mscale_squared(const DumpAttributes& attrs) {
  const double mscale =
      0.1 * attrs.rope_mscale_all_dim.value() * std::log(attrs.rope_factor.value()) + 1.0;
  return mscale * mscale;
}

// Which element of a rope part of width dr sits at position c when the part is read in the
// Hugging Face module's de-interleaved order (even elements, then odd): 2c, then 2(c - dr/2) + 1.
inline int deinterleaved_source(int c, int dr) { return c < dr / 2 ? 2 * c : 2 * (c - dr / 2) + 1; }

// The flash loop of p-e4m3-tile (header) over scores [0, n): acc (zeroed by the caller) and l
// after the split merge; returns the row's max m.
inline float planted_tiled(const PlantedChoices& c, const std::vector<float>& scores,
                           const std::vector<std::vector<float>>& latent, std::int64_t n,
                           std::vector<float>& acc, float& l) {
  const std::int64_t tile = c.tile;
  const std::int64_t per_split = (n + c.splits - 1) / c.splits;
  const std::int64_t split_len = (per_split + tile - 1) / tile * tile;
  const std::size_t dc = acc.size();
  float total_m = -std::numeric_limits<float>::infinity();
  l = 0.0f;
  for (std::int64_t start = 0; start < n; start += split_len) {
    const std::int64_t end = std::min(start + split_len, n);
    float m = -std::numeric_limits<float>::infinity();
    float split_l = 0.0f;
    std::vector<float> split_acc(dc, 0.0f);
    for (std::int64_t t0 = start; t0 < end; t0 += tile) {
      const std::int64_t t1 = std::min(t0 + tile, end);
      float m_new = m;
      for (std::int64_t p = t0; p < t1; ++p) m_new = std::max(m_new, scores[p]);
      const float r = std::exp2(m - m_new);  // 0 for the first tile (m = -inf)
      split_l *= r;
      for (float& x : split_acc) x *= r;
      for (std::int64_t p = t0; p < t1; ++p) {
        const float w = std::exp2(scores[p] - m_new);
        split_l += w;
        const float rounded = e4m3_decode(e4m3_encode(w));
        for (std::size_t d = 0; d < dc; ++d) split_acc[d] += rounded * latent[p][d];
      }
      m = m_new;
    }
    const float merged = std::max(total_m, m);
    const float old_factor = std::exp2(total_m - merged);
    const float factor = std::exp2(m - merged);
    for (std::size_t d = 0; d < dc; ++d) acc[d] = acc[d] * old_factor + split_acc[d] * factor;
    l = l * old_factor + split_l * factor;
    total_m = merged;
  }
  return total_m;
}

// Attention of step `step` on `pool` (after the step's writes) as a kernel that commits `choices`
// (none: the clean model).
inline PlantedOutput planted_attention(const DumpAttributes& attrs, const StepMeta& step,
                                       const StepLayerTensors& t, float kv_scale,
                                       const KvPool& pool, const PlantedChoices& choices) {
  constexpr double kLog2e = 1.4426950408889634;
  constexpr double kLn2 = 0.6931471805599453;
  const int heads = attrs.num_heads;
  const int dc = attrs.kv_lora_rank;
  const int dr = attrs.qk_rope_head_dim;
  const std::optional<Hypothesis> planted = scale_or_read_mismatch(choices);
  const bool scale_in_sm = choices.has(Hypothesis::kKeyScaleInSmScale);
  const float a = scale_in_sm ? 1.0f : planted_scale(planted, kv_scale);
  const float b = planted == Hypothesis::kScaleLatentOnly ? 1.0f : a;
  // What multiplies P.V: a, or kv_scale on the codes (k-scale-in-sm-scale), or 1 (V unscaled).
  float out_scale = scale_in_sm ? kv_scale : a;
  if (choices.has(Hypothesis::kValueDescaleMissing)) out_scale = 1.0f;
  double sm = attrs.sm_scale;
  if (choices.has(Hypothesis::kSmScaleMissing)) sm = 1.0;
  if (choices.has(Hypothesis::kSmScaleLog2e)) sm *= kLog2e;
  if (choices.has(Hypothesis::kSmScaleMscaleDropped)) sm /= planted_mscale_squared(attrs);
  if (choices.has(Hypothesis::kSmScaleMscaleTwice)) sm *= planted_mscale_squared(attrs);
  float score_scale = static_cast<float>(sm * kLog2e);
  if (scale_in_sm) {
    // SGLang forms sm_scale * k_scale in double (Python floats) and hands the kernel one fp32.
    const double sm_times_scale = sm * static_cast<double>(kv_scale);
    score_scale = static_cast<float>(sm_times_scale) * static_cast<float>(kLog2e);
  }
  float q_scale = 1.0f;
  if (choices.has(Hypothesis::kQueryE4m3Scaled)) {
    float amax = 0.0f;
    for (const float q : t.q_nope) amax = std::max(amax, std::abs(q));
    for (const float q : t.q_pe) amax = std::max(amax, std::abs(q));
    q_scale = amax / 448.0f;
    score_scale *= q_scale;
  }
  const int nq = step.num_rows();
  PlantedOutput result;
  result.out.assign(static_cast<std::size_t>(nq) * heads * dc, 0.0f);
  result.lse.assign(static_cast<std::size_t>(nq) * heads, 0.0f);
  for (int i = 0; i < nq; ++i) {
    const int request = step.request_of_row(i);
    const std::int64_t visible = step.position_of_row(i, attrs.page_size) + 1;
    for (int h = 0; h < heads; ++h) {
      const std::size_t pair = static_cast<std::size_t>(i) * heads + h;
      const float* qn = t.q_nope.data() + pair * dc;
      const float* qp = t.q_pe.data() + pair * dr;
      std::vector<float> scores(static_cast<std::size_t>(visible));
      std::vector<std::vector<float>> latent(static_cast<std::size_t>(visible));
      float m = -std::numeric_limits<float>::infinity();
      for (std::int64_t p = 0; p < visible; ++p) {
        const std::int64_t slot = step.slot_of(request, p, attrs.page_size);
        float dot = 0.0f;
        latent[p].resize(dc);
        for (int c = 0; c < dc; ++c) {
          latent[p][c] = planted_element(planted, pool, slot, c, kv_scale);
          dot += planted_query(choices, qn[c], q_scale) * (a * latent[p][c]);
        }
        for (int c = 0; dr > 0 && c < dr && !choices.has(Hypothesis::kRopeDotMissing); ++c) {
          const bool pe_kept = choices.has(Hypothesis::kQueryNopeE4m3);  // a bf16 RoPE dot
          // The layouts q_pe and the cached RoPE part meet in: one of them de-interleaved.
          const int k_c =
              choices.has(Hypothesis::kKpeDeinterleaved) ? deinterleaved_source(c, dr) : c;
          const int q_c =
              choices.has(Hypothesis::kQpeDeinterleaved) ? deinterleaved_source(c, dr) : c;
          dot += (pe_kept ? qp[q_c] : planted_query(choices, qp[q_c], q_scale)) *
                 (b * planted_element(planted, pool, slot, dc + k_c, kv_scale));
        }
        scores[p] = dot * score_scale;
        m = std::max(m, scores[p]);
      }
      float sum = 0.0f;
      std::vector<float> acc(dc, 0.0f);
      if (choices.has(Hypothesis::kProbabilitiesE4m3Tile)) {
        m = planted_tiled(choices, scores, latent, visible, acc, sum);
      } else {
        for (std::int64_t p = 0; p < visible; ++p) {
          const float weight = std::exp2(scores[p] - m);
          sum += weight;
          float rounded = choices.p_bf16 ? bf16_round(weight) : weight;
          if (choices.has(Hypothesis::kProbabilitiesE4m3))
            rounded = e4m3_decode(e4m3_encode(weight));
          if (choices.has(Hypothesis::kTf32)) rounded = planted_tf32(weight);
          for (int c = 0; c < dc; ++c) acc[c] += rounded * latent[p][c];
        }
      }
      for (int c = 0; c < dc; ++c)
        result.out[pair * dc + c] = bf16_round(acc[c] * (out_scale / sum));
      const double log2_sum = m + std::log2(sum);
      float lse =
          static_cast<float>(choices.has(Hypothesis::kLseBase2) ? log2_sum : log2_sum * kLn2);
      if (choices.has(Hypothesis::kLseBf16)) lse = bf16_round(lse);
      result.lse[pair] = lse;
    }
  }
  return result;
}

// A backend that writes with the kvdump rule (write_new_kv) and attends with the planted model.
class PlantedBackend : public Backend {
 public:
  explicit PlantedBackend(PlantedChoices planted) : planted_(std::move(planted)) {}
  std::string name() const override { return "planted"; }
  nlohmann::json describe() const override {
    return {{"name", "planted"}, {"planted", planted_.label()}};
  }
  Result<AttentionOutput> run_step(const StepLayerInput& input, KvPool& pool) override {
    KVAUDIT_TRY(write_new_kv(input.step, input.tensors.new_kv, input.layer.kv_scale,
                             /*reciprocal_scale=*/false, pool));
    const PlantedOutput planted = planted_attention(input.attrs, input.step, input.tensors,
                                                    input.layer.kv_scale, pool, planted_);
    AttentionOutput output;
    for (const float v : planted.out) output.out_bf16.push_back(bf16_from_float(v));
    output.lse = planted.lse;
    return output;
  }

 private:
  PlantedChoices planted_;
};

// The dump's captured out/lse at (step s, layer l), as a server committing `planted` computed them
// on `pool` (what it read).
inline void plant_captured(TinyDump& dump, std::size_t s, std::size_t l, const KvPool& pool,
                           const PlantedChoices& planted) {
  PlantedOutput output = planted_attention(dump.attrs, dump.steps[s], dump.tensors[s][l],
                                           dump.layers[l].kv_scale, pool, planted);
  dump.tensors[s][l].out = std::move(output.out);
  dump.tensors[s][l].lse = std::move(output.lse);
}

}  // namespace kvaudit::testing
