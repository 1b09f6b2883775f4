#include "src/injection.hpp"

#include <array>
#include <cmath>

namespace kvaudit {

namespace {

constexpr std::array<InjectionInfo, 8> kInjections{{
    {Injection::kBf16Writeback, "bf16-writeback",
     "prefill/decode write the bf16 bytes of the new KV row into the fp8 slot",
     "integrity: written_slots (classified bf16_high_byte / other)"},
    {Injection::kRoundTowardZero, "round-toward-zero",
     "the fp8 write rounds toward zero instead of to nearest-even",
     "integrity: written_slots (off_by_one_code)"},
    {Injection::kNoSaturation, "no-saturation",
     "the fp8 write does not saturate: values past 464*kv_scale become NaN codes",
     "integrity: nan_written"},
    {Injection::kScaleMismatch, "scale-mismatch",
     "attention dequantizes with kv_scale rounded to a power of two, not the scale the write used",
     "kernel comparison (rel_l2 / max_abs vs the reference)"},
    {Injection::kNeighbourSlotWrite, "neighbour-slot-write",
     "the write lands in slot + 1 instead of new_kv_slots[i]",
     "integrity: written_slots and unwritten_slots"},
    {Injection::kFp8ReadAsBf16, "fp8-read-as-bf16",
     "attention reinterprets the fp8 pool bytes as bf16 (the kv_data_type mix-up)",
     "kernel comparison (NaN/Inf mismatch or norms)"},
    {Injection::kMaskedNanLeak, "masked-nan-leak",
     "attention reads the whole last page and multiplies masked slots by a zero weight (0 x NaN)",
     "kernel comparison (NaN/Inf mismatch), on dumps with NaN codes in unused slots"},
    {Injection::kWholePoolCast, "whole-pool-cast",
     "the seed's bug: cast the whole pool to bf16 on every call, then attend (numerically exact)",
     "not a numerical fault: caught by `kvaudit bench` (time grows with pool size)"},
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
