#include "src/backend/injection.hpp"

#include <algorithm>
#include <array>
#include <cmath>

namespace kvaudit {

namespace {

constexpr std::array<InjectionInfo, 19> kInjections{{
    {Injection::kBf16Writeback, "bf16-writeback",
     "the write stores the bf16 bytes of the new row in the fp8 slot",
     "integrity written_slots [bf16_bytes]"},
    {Injection::kRoundTowardZero, "round-toward-zero",
     "the write rounds toward zero instead of to nearest-even",
     "integrity written_slots [off_by_one_code]"},
    {Injection::kNoSaturation, "no-saturation",
     "the write does not saturate: |x / kv_scale| > 464 becomes a NaN code",
     "integrity nan_written (needs values past 464 * kv_scale)"},
    {Injection::kScaleMismatch, "scale-mismatch",
     "attention dequantizes with kv_scale rounded to a power of two", "kernel comparison"},
    {Injection::kNeighbourSlotWrite, "neighbour-slot-write", "the write lands in slot + 1",
     "integrity written_slots, unwritten_slots [wrong_slot]"},
    {Injection::kFp8ReadAsBf16, "fp8-read-as-bf16",
     "attention reads the fp8 bytes as bf16 (the kv_data_type mix-up)", "kernel comparison"},
    {Injection::kMaskedNanLeak, "masked-nan-leak",
     "attention reads whole last pages: 0 x NaN from unused slots",
     "kernel comparison, NaN/Inf mismatch (needs NaN codes in unused slots)"},
    {Injection::kWholePoolCast, "whole-pool-cast",
     "cast the whole pool to bf16 on every call (the seed's bug; exact)",
     "kvaudit bench pool sweep (time grows with pool size), not check"},
    {Injection::kScaleOneWrite, "scale-one-write",
     "per_token_group: codes written with scale 1 while the group scales are stored and read",
     "integrity written_slots [codes_other_scale]"},
    {Injection::kZeroGroupScale, "zero-group-scale",
     "per_token_group: an all-zero group gets scale 0 and codes 0 * (1/0) = NaN",
     "integrity nan_written [nan_code] (needs an all-zero group)"},
    {Injection::kRopeOutsideCalibration, "rope-outside-calibration",
     "per_token_group, e4m3 RoPE: RoPE quantized with the latent's largest scale, so it saturates",
     "integrity written_slots [rope_saturated] (needs an e4m3 RoPE part larger than the latent)"},
    {Injection::kKvScaleSplit, "kv-scale-split",
     "per_token_group: the shared latent row's codes quantized with a V scale (the row's largest) "
     "while the per-group K scales are stored",
     "integrity written_slots [codes_other_scale]"},
    {Injection::kScaleReadAsPowerOfTwo, "scale-read-as-pow2",
     "per_token_group: attention reads each fp32 group scale as a power of two (its exponent)",
     "kernel comparison (needs float32 scales)"},
    {Injection::kScaleReadAsE8m0, "scale-read-as-e8m0",
     "per_token_group: attention reads the scale bytes as e8m0 codes (group g <- byte g)",
     "kernel comparison (needs float32 or power_of_two scales)"},
    {Injection::kMscaleDropped, "mscale-dropped",
     "the softmax scale without YaRN's mscale^2, qk_head_dim^-0.5 = sm_scale / mscale^2 (a "
     "server deriving it from the head widths alone)",
     "kernel comparison, diagnosis sm-scale-mscale-dropped (needs the dump's rope_factor and "
     "rope_mscale_all_dim)"},
    {Injection::kMscaleTwice, "mscale-twice",
     "YaRN's mscale^2 applied again to a softmax scale that already holds it: sm_scale * "
     "mscale^2",
     "kernel comparison, diagnosis sm-scale-mscale-twice (needs the dump's rope_factor and "
     "rope_mscale_all_dim)"},
    {Injection::kKpeDeinterleaved, "kpe-deinterleaved",
     "the cached RoPE part read in the Hugging Face module's de-interleaved order (even elements, "
     "then odd) against an interleaved q_pe",
     "kernel comparison, diagnosis kpe-deinterleaved"},
    {Injection::kQpeDeinterleaved, "qpe-deinterleaved",
     "q_pe in the Hugging Face module's de-interleaved order against an interleaved cached RoPE "
     "part",
     "kernel comparison, diagnosis qpe-deinterleaved"},
    {Injection::kRopeDotMissing, "rope-dot-missing",
     "the absorbed query formed without its RoPE part: scores sm_scale * q_nope . c (q_pe "
     "zeroed)",
     "kernel comparison, diagnosis rope-dot-missing"},
}};

constexpr InjectionInfo kNoInjection{Injection::kNone, "", "no injection", ""};

}  // namespace

std::span<const InjectionInfo> injection_table() { return kInjections; }

Result<Injection> parse_injection(std::string_view name) {
  if (name.empty() || name == "none") return Injection::kNone;
  for (const auto& info : kInjections) {
    if (name == info.name) return info.id;
  }
  std::string names;
  for (const auto& info : kInjections) names += std::string(names.empty() ? "" : ", ") + info.name;
  return bad_input("--inject", "unknown injection '" + std::string(name) + "' (known: " + names +
                                   "; see --list-injections)");
}

bool injection_for_grouped_pools(Injection injection) {
  switch (injection) {
    case Injection::kScaleOneWrite:
    case Injection::kZeroGroupScale:
    case Injection::kRopeOutsideCalibration:
    case Injection::kKvScaleSplit:
    case Injection::kScaleReadAsPowerOfTwo:
    case Injection::kScaleReadAsE8m0:
      return true;
    default:
      return false;
  }
}

bool injection_for_any_pool(Injection injection) { return injection_translates(injection); }

bool injection_translates(Injection injection) {
  switch (injection) {
    case Injection::kMscaleDropped:
    case Injection::kMscaleTwice:
    case Injection::kKpeDeinterleaved:
    case Injection::kQpeDeinterleaved:
    case Injection::kRopeDotMissing:
      return true;
    default:
      return false;
  }
}

Status check_injection_applies(Injection injection, const DumpAttributes& attrs) {
  if (injection == Injection::kNone) return ok_status();
  const std::string option = "--inject " + std::string(injection_info(injection).name);
  if (injection == Injection::kMscaleDropped || injection == Injection::kMscaleTwice) {
    const std::optional<double> mscale_squared = yarn_mscale_squared(attrs);
    if (!mscale_squared) {
      return unsupported(option,
                         "needs the dump's rope attributes rope_factor and rope_mscale_all_dim "
                         "(docs/kvdump-v1.md \"Optional model attributes\"); this dump has none");
    }
    if (*mscale_squared == 1.0) {
      return unsupported(option,
                         "YaRN's mscale^2 is 1 for this dump's rope attributes "
                         "(rope_mscale_all_dim 0 or rope_factor <= 1): nothing to drop");
    }
  }
  if (injection_for_any_pool(injection)) {
    if (attrs.qk_rope_head_dim % 2 != 0 && injection != Injection::kMscaleDropped &&
        injection != Injection::kMscaleTwice) {
      return unsupported(option, "needs an even qk_rope_head_dim (RoPE rotates pairs)");
    }
    return ok_status();
  }
  const bool grouped = attrs.kv_scale_kind == "per_token_group";
  if (grouped == injection_for_grouped_pools(injection)) return ok_status();
  return unsupported(option, grouped ? "acts on per_tensor pools; this dump's kv_scale_kind is "
                                       "per_token_group (see --list-injections)"
                                     : "acts on per_token_group pools (kvdump v1.1); this dump's "
                                       "kv_scale_kind is per_tensor");
}

const InjectionInfo& injection_info(Injection injection) {
  for (const auto& info : kInjections) {
    if (info.id == injection) return info;
  }
  return kNoInjection;
}

std::optional<double> yarn_mscale_squared(const DumpAttributes& attrs) {
  if (!attrs.rope_factor || !attrs.rope_mscale_all_dim) return std::nullopt;
  if (*attrs.rope_mscale_all_dim == 0.0 || *attrs.rope_factor <= 1.0) return 1.0;
  const double mscale = 0.1 * *attrs.rope_mscale_all_dim * std::log(*attrs.rope_factor) + 1.0;
  return mscale * mscale;
}

void deinterleave_rope(std::span<const float> x, std::span<float> y) {
  const std::size_t half = x.size() / 2;
  for (std::size_t j = 0; j < half; ++j) {
    y[j] = x[2 * j];
    y[half + j] = x[2 * j + 1];
  }
}

void interleave_rope(std::span<const float> x, std::span<float> y) {
  const std::size_t half = x.size() / 2;
  for (std::size_t j = 0; j < half; ++j) {
    y[2 * j] = x[j];
    y[2 * j + 1] = x[half + j];
  }
}

Result<TranslatedInput> translate_input(Injection injection, const DumpAttributes& attrs,
                                        const StepLayerTensors& tensors) {
  KVAUDIT_TRY(check_injection_applies(injection, attrs));
  TranslatedInput translated{attrs, {}};
  translated.tensors.q_nope = tensors.q_nope;
  translated.tensors.q_pe = tensors.q_pe;
  translated.tensors.new_kv = tensors.new_kv;
  translated.tensors.topk_indices = tensors.topk_indices;
  translated.tensors.topk = tensors.topk;
  const std::size_t width = static_cast<std::size_t>(attrs.qk_rope_head_dim);
  const std::span<const float> q_pe(tensors.q_pe);
  const std::span<float> out(translated.tensors.q_pe);
  switch (injection) {
    case Injection::kMscaleDropped:
      translated.attrs.sm_scale = attrs.sm_scale / *yarn_mscale_squared(attrs);
      break;
    case Injection::kMscaleTwice:
      translated.attrs.sm_scale = attrs.sm_scale * *yarn_mscale_squared(attrs);
      break;
    case Injection::kKpeDeinterleaved:  // q_pe . D(r) = I(q_pe) . r
      for (std::size_t at = 0; at + width <= q_pe.size() && width > 0; at += width) {
        interleave_rope(q_pe.subspan(at, width), out.subspan(at, width));
      }
      break;
    case Injection::kQpeDeinterleaved:
      for (std::size_t at = 0; at + width <= q_pe.size() && width > 0; at += width) {
        deinterleave_rope(q_pe.subspan(at, width), out.subspan(at, width));
      }
      break;
    case Injection::kRopeDotMissing:
      std::fill(out.begin(), out.end(), 0.0f);
      break;
    default:
      break;
  }
  return translated;
}

float power_of_two_scale(float kv_scale) {
  const float rounded = std::exp2(std::round(std::log2(kv_scale)));
  // A scale that already is a power of two would make the fault a no-op: read with twice it.
  return rounded == kv_scale ? 2.0f * kv_scale : rounded;
}

}  // namespace kvaudit
