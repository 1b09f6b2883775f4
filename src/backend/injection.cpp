#include "src/backend/injection.hpp"

#include <array>
#include <cmath>

namespace kvaudit {

namespace {

constexpr std::array<InjectionInfo, 8> kInjections{{
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

const char* kv_write_rule_name(KvWriteRule rule) {
  switch (rule) {
    case KvWriteRule::kDivide:
      return "divide";
    case KvWriteRule::kReciprocal:
      return "reciprocal";
    case KvWriteRule::kRoundTowardZero:
      return "round-toward-zero";
    case KvWriteRule::kNoSaturation:
      return "no-saturation";
    case KvWriteRule::kBf16Bytes:
      return "bf16-bytes";
  }
  return "unknown";
}

float power_of_two_scale(float kv_scale) {
  const float rounded = std::exp2(std::round(std::log2(kv_scale)));
  // A scale that already is a power of two would make the fault a no-op: read with twice it.
  return rounded == kv_scale ? 2.0f * kv_scale : rounded;
}

}  // namespace kvaudit
