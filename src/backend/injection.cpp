#include "src/backend/injection.hpp"

#include <array>
#include <cmath>

namespace kvaudit {

namespace {

constexpr std::array<InjectionInfo, 14> kInjections{{
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

Status check_injection_applies(Injection injection, const std::string& kv_scale_kind) {
  if (injection == Injection::kNone) return ok_status();
  const bool grouped = kv_scale_kind == "per_token_group";
  if (grouped == injection_for_grouped_pools(injection)) return ok_status();
  return unsupported("--inject " + std::string(injection_info(injection).name),
                     grouped ? "acts on per_tensor pools; this dump's kv_scale_kind is "
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

float power_of_two_scale(float kv_scale) {
  const float rounded = std::exp2(std::round(std::log2(kv_scale)));
  // A scale that already is a power of two would make the fault a no-op: read with twice it.
  return rounded == kv_scale ? 2.0f * kv_scale : rounded;
}

}  // namespace kvaudit
