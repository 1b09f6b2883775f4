// Integrity checks of the KV pools (see integrity.hpp for what each check means). All comparisons
// are bytewise on the stored codes; there is no tolerance anywhere in this file.
#include "src/integrity.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>

namespace kvaudit {
namespace {

bool rows_equal(const KvPool& a, std::int64_t slot_a, const KvPool& b, std::int64_t slot_b) {
  return std::memcmp(a.row(slot_a), b.row(slot_b), a.row_bytes()) == 0;
}

std::string slot_list(const std::vector<std::int64_t>& slots, std::size_t total) {
  std::ostringstream text;
  const std::size_t shown = std::min<std::size_t>(slots.size(), 8);
  text << (total == 1 ? "slot " : "slots ");
  for (std::size_t i = 0; i < shown; ++i) text << (i ? ", " : "") << slots[i];
  if (total > shown) text << ", ... (" << total << " in all)";
  return text.str();
}

std::string hex_byte(unsigned value) {
  char text[8];
  std::snprintf(text, sizeof text, "0x%02x", value & 0xFF);
  return text;
}

// What differs in one slot: "3 of 576 bytes differ, first at byte 5: 0x3f, expected 0x38".
std::string describe_row_difference(const KvPool& actual, const KvPool& expected,
                                    std::int64_t slot) {
  const std::uint8_t* a = actual.row(slot);
  const std::uint8_t* e = expected.row(slot);
  std::size_t differing = 0;
  std::size_t first = 0;
  for (std::size_t j = 0; j < actual.row_bytes(); ++j) {
    if (a[j] != e[j]) {
      if (differing == 0) first = j;
      ++differing;
    }
  }
  std::ostringstream text;
  text << differing << " of " << actual.row_bytes() << " bytes differ, first at byte " << first
       << ": " << hex_byte(a[first]) << ", expected " << hex_byte(e[first]);
  return text.str();
}

IntegrityFinding make_finding(const StepLayerWrites& writes, std::string check) {
  IntegrityFinding finding;
  finding.step = writes.step;
  finding.layer_id = writes.layer_id;
  finding.where =
      writes.where.empty() ? step_layer_name(writes.step, writes.layer_id) : writes.where;
  finding.check = std::move(check);
  return finding;
}

// Fills a failing finding from the offending slots; `what` says what is wrong with them.
void fail_with_slots(IntegrityFinding& finding, const std::vector<std::int64_t>& slots,
                     const std::string& what, const std::string& detail) {
  finding.pass = false;
  finding.slots.assign(slots.begin(),
                       slots.begin() + std::min<std::size_t>(slots.size(), kMaxListedSlots));
  finding.message = finding.where + ": " + std::to_string(slots.size()) + " " + what + ": " +
                    slot_list(slots, slots.size()) + (detail.empty() ? "" : " (" + detail + ")");
}

void pass_with(IntegrityFinding& finding, const std::string& what) {
  finding.pass = true;
  finding.message = finding.where + ": " + what;
}

bool element_is_nan(const KvPool& pool, std::int64_t slot, int col) {
  if (pool.dtype == KvDtype::kBfloat16) return std::isnan(bf16_to_float(pool.bf16_bits(slot, col)));
  return e4m3_is_nan(pool.row(slot)[col]);
}

}  // namespace

std::string step_layer_name(int step, int layer_id) {
  return step_group_name(step) + " " + layer_group_name(layer_id);
}

std::vector<IntegrityFinding> check_backend_pool(const StepLayerWrites& writes,
                                                 const KvPool& before, const KvPool& after,
                                                 const KvPool& expected) {
  std::vector<IntegrityFinding> findings;

  IntegrityFinding storage = make_finding(writes, "storage");
  const bool same_storage = after.dtype == before.dtype && after.num_slots == before.num_slots &&
                            after.row_width == before.row_width &&
                            after.bytes.size() == before.bytes.size() &&
                            expected.bytes.size() == before.bytes.size();
  if (same_storage) {
    pass_with(storage, std::string("pool still holds ") + kv_dtype_name(before.dtype) + ", " +
                           std::to_string(before.bytes_per_element()) + " byte(s) per element");
    findings.push_back(storage);
  } else {
    storage.pass = false;
    storage.message = storage.where + ": pool storage changed: " + kv_dtype_name(before.dtype) +
                      " " + std::to_string(before.bytes.size()) + " bytes before the step, " +
                      kv_dtype_name(after.dtype) + " " + std::to_string(after.bytes.size()) +
                      " bytes after";
    findings.push_back(storage);
    // Nothing below can be compared byte for byte; say so rather than guess.
    for (const char* check :
         {"written_slots", "unwritten_slots", "nan_written", "read_consistency"}) {
      IntegrityFinding skipped = make_finding(writes, check);
      skipped.pass = false;
      skipped.message = skipped.where + ": not checked, the pool storage changed";
      findings.push_back(skipped);
    }
    return findings;
  }

  const int width = before.row_width;
  std::vector<char> written(static_cast<std::size_t>(before.num_slots), 0);
  for (const std::int32_t slot : writes.slots) written[slot] = 1;

  // written_slots and nan_written
  std::vector<std::int64_t> wrong_written;
  std::vector<std::int64_t> nan_slots;
  for (std::size_t i = 0; i < writes.slots.size(); ++i) {
    const std::int64_t slot = writes.slots[i];
    if (!rows_equal(after, slot, expected, slot)) wrong_written.push_back(slot);
    for (int c = 0; c < width; ++c) {
      const float value = writes.new_kv[i * width + c];
      if (element_is_nan(after, slot, c) && !std::isnan(value)) {
        nan_slots.push_back(slot);
        break;
      }
    }
  }
  IntegrityFinding written_finding = make_finding(writes, "written_slots");
  if (wrong_written.empty()) {
    pass_with(written_finding, std::to_string(writes.slots.size()) +
                                   " written slot(s) hold kvdump_quantize(new_kv, kv_scale)");
  } else {
    fail_with_slots(written_finding, wrong_written,
                    "written slot(s) do not hold kvdump_quantize(new_kv, kv_scale)",
                    "slot " + std::to_string(wrong_written.front()) + ": " +
                        describe_row_difference(after, expected, wrong_written.front()));
  }
  findings.push_back(written_finding);

  std::vector<std::int64_t> changed;
  for (std::int64_t slot = 0; slot < before.num_slots; ++slot) {
    if (!written[slot] && !rows_equal(after, slot, before, slot)) changed.push_back(slot);
  }
  IntegrityFinding unwritten_finding = make_finding(writes, "unwritten_slots");
  if (changed.empty()) {
    pass_with(unwritten_finding, "every slot the step did not write is unchanged");
  } else {
    fail_with_slots(unwritten_finding, changed, "slot(s) the step did not write changed",
                    "slot " + std::to_string(changed.front()) + ": " +
                        describe_row_difference(after, before, changed.front()));
  }
  findings.push_back(unwritten_finding);

  IntegrityFinding nan_finding = make_finding(writes, "nan_written");
  if (nan_slots.empty()) {
    pass_with(nan_finding, "no written slot holds a NaN code");
  } else {
    fail_with_slots(nan_finding, nan_slots, "written slot(s) hold a NaN code for a finite value",
                    "");
  }
  findings.push_back(nan_finding);

  std::vector<std::int64_t> inconsistent;
  if (after.bytes != expected.bytes) {
    for (std::int64_t slot = 0; slot < before.num_slots; ++slot) {
      if (!rows_equal(after, slot, expected, slot)) inconsistent.push_back(slot);
    }
  }
  IntegrityFinding consistency = make_finding(writes, "read_consistency");
  if (inconsistent.empty()) {
    pass_with(consistency, "backend pool equals the reference replay's pool");
  } else {
    fail_with_slots(consistency, inconsistent,
                    "slot(s) of the backend pool differ from the reference replay's pool",
                    "later steps read these");
  }
  findings.push_back(consistency);
  return findings;
}

std::string classify_captured_slot(const StepLayerWrites& writes, const KvPool& captured,
                                   const KvPool& expected, std::int64_t slot) {
  const int width = expected.row_width;
  // wrong_slot: a row this step wrote for another slot landed here, or this slot's own row landed
  // in a neighbour (a write to slot +-1).
  for (const std::int32_t other : writes.slots) {
    if (other != slot && !rows_equal(expected, other, expected, slot) &&
        rows_equal(captured, slot, expected, other)) {
      return "wrong_slot";
    }
  }
  const bool slot_written =
      std::find(writes.slots.begin(), writes.slots.end(), slot) != writes.slots.end();
  for (const std::int64_t neighbour : {slot - 1, slot + 1}) {
    if (slot_written && neighbour >= 0 && neighbour < expected.num_slots &&
        !rows_equal(captured, neighbour, expected, neighbour) &&
        rows_equal(captured, neighbour, expected, slot)) {
      return "wrong_slot";
    }
  }

  if (expected.dtype == KvDtype::kBfloat16) {
    for (int c = 0; c < width; ++c) {
      if (element_is_nan(captured, slot, c) && !element_is_nan(expected, slot, c))
        return "nan_code";
    }
    return "other";
  }

  // The value this slot was written from, when the step wrote it.
  int row = -1;
  for (std::size_t i = 0; i < writes.slots.size(); ++i) {
    if (writes.slots[i] == slot) row = static_cast<int>(i);
  }
  const std::uint8_t* got = captured.row(slot);
  const std::uint8_t* want = expected.row(slot);
  bool all_bf16_high = row >= 0;
  bool any_nan = false;
  bool all_off_by_one = true;
  for (int c = 0; c < width; ++c) {
    if (got[c] == want[c]) continue;
    if (row >= 0) {
      const float value = writes.new_kv[static_cast<std::size_t>(row) * width + c];
      const auto high = static_cast<std::uint8_t>(bf16_from_float(value) >> 8);
      const auto high_scaled =
          static_cast<std::uint8_t>(bf16_from_float(value / writes.kv_scale) >> 8);
      all_bf16_high &= got[c] == high || got[c] == high_scaled;
    }
    any_nan |= e4m3_is_nan(got[c]) && !e4m3_is_nan(want[c]);
    const bool same_sign = (got[c] & 0x80) == (want[c] & 0x80);
    const int distance =
        std::abs(static_cast<int>(got[c] & 0x7F) - static_cast<int>(want[c] & 0x7F));
    all_off_by_one &= same_sign && distance == 1 && !e4m3_is_nan(got[c]);
  }
  if (all_bf16_high) return "bf16_high_byte";
  if (any_nan) return "nan_code";
  if (all_off_by_one) return "off_by_one_code";
  return "other";
}

std::vector<IntegrityFinding> check_captured_pool(const StepLayerWrites& writes,
                                                  const KvPool& captured, const KvPool& expected) {
  std::vector<IntegrityFinding> findings;
  if (captured.dtype != expected.dtype || captured.bytes.size() != expected.bytes.size() ||
      captured.row_width != expected.row_width) {
    IntegrityFinding finding = make_finding(writes, "captured_pool");
    finding.pass = false;
    finding.classification = "other";
    finding.message =
        finding.where + ": captured pool has another dtype or size than the replayed pool";
    findings.push_back(finding);
    return findings;
  }
  static constexpr std::array<const char*, 5> kClasses = {"nan_code", "bf16_high_byte",
                                                          "off_by_one_code", "wrong_slot", "other"};
  std::array<std::vector<std::int64_t>, kClasses.size()> by_class;
  if (captured.bytes != expected.bytes) {
    for (std::int64_t slot = 0; slot < expected.num_slots; ++slot) {
      if (rows_equal(captured, slot, expected, slot)) continue;
      const std::string kind = classify_captured_slot(writes, captured, expected, slot);
      for (std::size_t k = 0; k < kClasses.size(); ++k) {
        if (kind == kClasses[k]) by_class[k].push_back(slot);
      }
    }
  }
  for (std::size_t k = 0; k < kClasses.size(); ++k) {
    if (by_class[k].empty()) continue;
    IntegrityFinding finding = make_finding(writes, "captured_pool");
    finding.classification = kClasses[k];
    const std::int64_t first = by_class[k].front();
    fail_with_slots(
        finding, by_class[k],
        std::string("slot(s) of the captured pool differ from the replay [") + kClasses[k] + "]",
        "slot " + std::to_string(first) + ": " +
            describe_row_difference(captured, expected, first));
    findings.push_back(finding);
  }
  if (findings.empty()) {
    IntegrityFinding finding = make_finding(writes, "captured_pool");
    pass_with(finding, "captured pool equals the replayed pool");
    findings.push_back(finding);
  }
  return findings;
}

}  // namespace kvaudit
