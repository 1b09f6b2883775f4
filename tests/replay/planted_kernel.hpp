// A small fp32 model of an FP8 MLA attention kernel that can commit each convention mismatch of
// the diagnosis catalogue (src/replay/diagnosis.hpp), written here from the mismatches' own
// definitions (not from the code under test), to plant failures: as a test Backend (kernel
// comparison) or as a dump's captured out/lse (captured comparison).
//
// The clean model, per query row i, head h, over the visible tokens t (single pass, one tile):
//   k_t = decode(pool row), s_t = fp32(q . (a c_t, b r_t)) * sm * log2 e   (base 2, as cpu-fp8)
//   m = max_t s_t, w_t = exp2(s_t - m), l = sum_t w_t, p_t = bf16(w_t)
//   out = bf16(a * sum_t p_t c_t / l),  lse = (m + log2 l) * ln 2
// with a = b = kv_scale, sm = sm_scale, e4m3 decoding. Each mismatch changes one ingredient.
// Shapes: q_nope [Nq, H, Dc], q_pe [Nq, H, Dr], pool [S, Dc + Dr], out [Nq, H, Dc], lse [Nq, H].
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
    case Hypothesis::kScaleReciprocal:
      return 1.0f / s;
    case Hypothesis::kScaleSquared:
      return s * s;
    case Hypothesis::kScaleNotApplied:
    case Hypothesis::kDequantBf16:  // the scale is applied per element (planted_element)
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

// Attention of step `step` on `pool` (after the step's writes) as a kernel that commits `planted`
// (nullopt: the clean model).
inline PlantedOutput planted_attention(const DumpAttributes& attrs, const StepMeta& step,
                                       const StepLayerTensors& t, float kv_scale,
                                       const KvPool& pool, std::optional<Hypothesis> planted) {
  constexpr double kLog2e = 1.4426950408889634;
  constexpr double kLn2 = 0.6931471805599453;
  const int heads = attrs.num_heads;
  const int dc = attrs.kv_lora_rank;
  const int dr = attrs.qk_rope_head_dim;
  const float a = planted_scale(planted, kv_scale);
  const float b = planted == Hypothesis::kScaleLatentOnly ? 1.0f : a;
  double sm = attrs.sm_scale;
  if (planted == Hypothesis::kSmScaleMissing) sm = 1.0;
  if (planted == Hypothesis::kSmScaleLog2e) sm *= kLog2e;
  const float score_scale = static_cast<float>(sm * kLog2e);
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
          dot += qn[c] * (a * latent[p][c]);
        }
        for (int c = 0; c < dr; ++c)
          dot += qp[c] * (b * planted_element(planted, pool, slot, dc + c, kv_scale));
        scores[p] = dot * score_scale;
        m = std::max(m, scores[p]);
      }
      float sum = 0.0f;
      std::vector<float> acc(dc, 0.0f);
      for (std::int64_t p = 0; p < visible; ++p) {
        const float weight = std::exp2(scores[p] - m);
        sum += weight;
        const float rounded = planted == Hypothesis::kProbabilitiesE4m3
                                  ? e4m3_decode(e4m3_encode(weight))
                                  : bf16_round(weight);
        for (int c = 0; c < dc; ++c) acc[c] += rounded * latent[p][c];
      }
      for (int c = 0; c < dc; ++c) result.out[pair * dc + c] = bf16_round(acc[c] * (a / sum));
      const double log2_sum = m + std::log2(sum);
      result.lse[pair] =
          static_cast<float>(planted == Hypothesis::kLseBase2 ? log2_sum : log2_sum * kLn2);
    }
  }
  return result;
}

// A backend that writes with the kvdump rule (write_new_kv) and attends with the planted model.
class PlantedBackend : public Backend {
 public:
  explicit PlantedBackend(std::optional<Hypothesis> planted) : planted_(planted) {}
  std::string name() const override { return "planted"; }
  nlohmann::json describe() const override {
    return {{"name", "planted"},
            {"planted", planted_ ? hypothesis_name(*planted_) : "none (the clean model)"}};
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
  std::optional<Hypothesis> planted_;
};

// The dump's captured out/lse at (step s, layer l), as a server committing `planted` computed them
// on `pool` (what it read).
inline void plant_captured(TinyDump& dump, std::size_t s, std::size_t l, const KvPool& pool,
                           std::optional<Hypothesis> planted) {
  PlantedOutput output = planted_attention(dump.attrs, dump.steps[s], dump.tensors[s][l],
                                           dump.layers[l].kv_scale, pool, planted);
  dump.tensors[s][l].out = std::move(output.out);
  dump.tensors[s][l].lse = std::move(output.lse);
}

}  // namespace kvaudit::testing
