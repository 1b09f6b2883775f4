// Integrity checks of the KV pools (see integrity.hpp for what each check means). All comparisons
// are bytewise on the stored codes; there is no tolerance anywhere in this file.
#include "src/replay/integrity.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <unordered_map>

namespace kvaudit {
namespace {

bool rows_equal(const KvPool& a, std::int64_t slot_a, const KvPool& b, std::int64_t slot_b) {
  return std::memcmp(a.row(slot_a), b.row(slot_b), a.row_bytes()) == 0;
}

bool element_is_nan(const KvPool& pool, std::int64_t slot, int col) {
  if (pool.dtype == KvDtype::kBfloat16) return std::isnan(bf16_to_float(pool.bf16_bits(slot, col)));
  return e4m3_is_nan(pool.row(slot)[col]);
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

IntegrityFinding make_finding(const StepLayerWrites& writes, IntegrityCheck check) {
  IntegrityFinding finding;
  finding.step = writes.step;
  finding.layer_id = writes.layer_id;
  finding.where =
      writes.where.empty() ? step_layer_name(writes.step, writes.layer_id) : writes.where;
  finding.check = check;
  return finding;
}

// Fills a failing finding from the offending slots; `what` says what is wrong with them.
void fail_with_slots(IntegrityFinding& finding, const std::vector<std::int64_t>& slots,
                     const std::string& what, const std::string& detail) {
  finding.pass = false;
  finding.slots.assign(slots.begin(),
                       slots.begin() + std::min<std::size_t>(slots.size(), kMaxListedSlots));
  finding.slot_count = static_cast<std::int64_t>(slots.size());
  finding.detail = finding.where + ": " + std::to_string(slots.size()) + " " + what + ": " +
                   slot_list(slots, slots.size()) + (detail.empty() ? "" : " (" + detail + ")");
}

void pass_with(IntegrityFinding& finding, const std::string& what) {
  finding.pass = true;
  finding.detail = finding.where + ": " + what;
}

// Byte `index` of the little-endian bf16 row bf16(values[0 .. D)) (two bytes per element).
std::uint8_t bf16_row_byte(const float* values, int index, float divisor) {
  const std::uint16_t bits = bf16_from_float(values[index / 2] / divisor);
  return static_cast<std::uint8_t>(index % 2 == 0 ? bits & 0xFF : bits >> 8);
}

// Whether every byte of `got` that differs from `want` is byte (offset + c) of the little-endian
// bf16 row of `values` (raw or divided by kv_scale): a bf16 store of that row over this slot.
bool holds_bf16_row_bytes(const std::uint8_t* got, const std::uint8_t* want, const float* values,
                          int width, int offset, float kv_scale) {
  for (const float divisor : {1.0f, kv_scale}) {
    bool all = true;
    for (int c = 0; c < width && all; ++c) {
      all = got[c] == want[c] || got[c] == bf16_row_byte(values, offset + c, divisor);
    }
    if (all) return true;
  }
  return false;
}

// Whether every differing byte is the high byte of bf16(x) or bf16(x / kv_scale), element-wise.
bool holds_bf16_high_bytes(const std::uint8_t* got, const std::uint8_t* want, const float* values,
                           int width, float kv_scale) {
  for (int c = 0; c < width; ++c) {
    if (got[c] == want[c]) continue;
    const auto high = static_cast<std::uint8_t>(bf16_from_float(values[c]) >> 8);
    const auto high_scaled = static_cast<std::uint8_t>(bf16_from_float(values[c] / kv_scale) >> 8);
    if (got[c] != high && got[c] != high_scaled) return false;
  }
  return true;
}

std::uint64_t row_hash(const std::uint8_t* bytes, std::size_t count) {  // FNV-1a
  std::uint64_t hash = 1469598103934665603ull;
  for (std::size_t i = 0; i < count; ++i) hash = (hash ^ bytes[i]) * 1099511628211ull;
  return hash;
}

// The step's writes indexed once per check, so that classifying many slots stays linear: the row
// each written slot received (the last one when written twice), and the written slots by the
// hash of their expected row.
class WriteIndex {
 public:
  WriteIndex(const StepLayerWrites& writes, const KvPool& expected) : expected_(expected) {
    for (std::size_t i = 0; i < writes.slots.size(); ++i) {
      row_of_slot_[writes.slots[i]] = static_cast<int>(i);
    }
    for (const auto& [slot, row] : row_of_slot_) {
      slots_by_hash_.emplace(row_hash(expected.row(slot), expected.row_bytes()), slot);
    }
  }
  int row_of(std::int64_t slot) const {  // -1: the step did not write it
    const auto it = row_of_slot_.find(slot);
    return it == row_of_slot_.end() ? -1 : it->second;
  }
  // Whether `actual`'s row at `slot` is the expected row of another written slot (one whose
  // expected row differs from this slot's own).
  bool holds_other_written_row(const KvPool& actual, std::int64_t slot) const {
    const auto [first, last] =
        slots_by_hash_.equal_range(row_hash(actual.row(slot), actual.row_bytes()));
    for (auto it = first; it != last; ++it) {
      const std::int64_t other = it->second;
      if (other != slot && !rows_equal(expected_, other, expected_, slot) &&
          rows_equal(actual, slot, expected_, other)) {
        return true;
      }
    }
    return false;
  }

 private:
  const KvPool& expected_;
  std::unordered_map<std::int64_t, int> row_of_slot_;
  std::unordered_multimap<std::uint64_t, std::int64_t> slots_by_hash_;
};

SlotClass classify_indexed(const StepLayerWrites& writes, const WriteIndex& index,
                           const KvPool& actual, const KvPool& expected, std::int64_t slot) {
  const int width = expected.row_width;
  // Nothing to classify where the bytes agree (an unwritten slot that changed back to them).
  if (rows_equal(actual, slot, expected, slot)) return SlotClass::kOther;
  // wrong_slot: a row this step wrote for another slot landed here, or this slot's own row landed
  // in a neighbour (a write to slot +-1, wrapping at the pool's ends as a modular index does).
  if (index.holds_other_written_row(actual, slot)) return SlotClass::kWrongSlot;
  const int row = index.row_of(slot);
  const std::int64_t slots = expected.num_slots;
  for (const std::int64_t neighbour : {(slot + slots - 1) % slots, (slot + 1) % slots}) {
    if (row >= 0 && neighbour != slot && !rows_equal(actual, neighbour, expected, neighbour) &&
        rows_equal(actual, neighbour, expected, slot)) {
      return SlotClass::kWrongSlot;
    }
  }

  if (expected.dtype == KvDtype::kBfloat16) {
    for (int c = 0; c < width; ++c) {
      if (element_is_nan(actual, slot, c) && !element_is_nan(expected, slot, c)) {
        return SlotClass::kNanCode;
      }
    }
    return SlotClass::kOther;
  }

  const std::uint8_t* got = actual.row(slot);
  const std::uint8_t* want = expected.row(slot);
  int differing = 0;
  bool any_nan = false;
  bool all_off_by_one = true;
  for (int c = 0; c < width; ++c) {
    if (got[c] == want[c]) continue;
    ++differing;
    any_nan |= e4m3_is_nan(got[c]) && !e4m3_is_nan(want[c]);
    const bool same_sign = (got[c] & 0x80) == (want[c] & 0x80);
    const int distance =
        std::abs(static_cast<int>(got[c] & 0x7F) - static_cast<int>(want[c] & 0x7F));
    all_off_by_one &= same_sign && distance == 1 && !e4m3_is_nan(got[c]);
  }
  // Every differing code one step away is a rounding difference, whatever else it resembles: for
  // quotients in [1.875, 4) the bf16 high byte (0x3F, 0x40) is itself a neighbouring e4m3 code.
  if (all_off_by_one) return SlotClass::kOffByOneCode;
  // bf16_bytes: this slot's row as bf16 (high bytes, or the first half of the 2-byte row), or the
  // spill of the previous slot's bf16 row (its second half). A single differing byte is too weak
  // a match to call it that.
  if (differing >= 2) {
    if (row >= 0) {
      const float* values = writes.new_kv.data() + static_cast<std::size_t>(row) * width;
      if (holds_bf16_high_bytes(got, want, values, width, writes.kv_scale) ||
          holds_bf16_row_bytes(got, want, values, width, 0, writes.kv_scale)) {
        return SlotClass::kBf16Bytes;
      }
    }
    const int previous_row = slot > 0 ? index.row_of(slot - 1) : -1;
    if (previous_row >= 0) {
      const float* values = writes.new_kv.data() + static_cast<std::size_t>(previous_row) * width;
      if (holds_bf16_row_bytes(got, want, values, width, width, writes.kv_scale)) {
        return SlotClass::kBf16Bytes;
      }
    }
  }
  if (any_nan) return SlotClass::kNanCode;
  return SlotClass::kOther;
}

// The classes of src/replay/integrity.hpp, in the order findings are reported.
constexpr std::array<SlotClass, 5> kClasses = {SlotClass::kWrongSlot, SlotClass::kBf16Bytes,
                                               SlotClass::kNanCode, SlotClass::kOffByOneCode,
                                               SlotClass::kOther};

// Failing slots split by class: one finding per class present, `what` naming the check's failure.
void add_classified_findings(std::vector<IntegrityFinding>& findings, const StepLayerWrites& writes,
                             IntegrityCheck check, const std::vector<std::int64_t>& slots,
                             const KvPool& actual, const KvPool& compared_with,
                             const KvPool& expected, const std::string& what) {
  std::array<std::vector<std::int64_t>, kClasses.size()> by_class;
  const WriteIndex index(writes, expected);
  for (const std::int64_t slot : slots) {
    const SlotClass kind = classify_indexed(writes, index, actual, expected, slot);
    for (std::size_t k = 0; k < kClasses.size(); ++k) {
      if (kind == kClasses[k]) by_class[k].push_back(slot);
    }
  }
  for (std::size_t k = 0; k < kClasses.size(); ++k) {
    if (by_class[k].empty()) continue;
    IntegrityFinding finding = make_finding(writes, check);
    finding.classification = kClasses[k];
    const std::int64_t first = by_class[k].front();
    fail_with_slots(finding, by_class[k], what + " [" + slot_class_name(kClasses[k]) + "]",
                    "slot " + std::to_string(first) + ": " +
                        describe_row_difference(actual, compared_with, first));
    findings.push_back(std::move(finding));
  }
}

}  // namespace

SlotClass classify_slot(const StepLayerWrites& writes, const KvPool& actual, const KvPool& expected,
                        std::int64_t slot) {
  return classify_indexed(writes, WriteIndex(writes, expected), actual, expected, slot);
}

std::string step_layer_name(int step, int layer_id) {
  return step_group_name(step) + " " + layer_group_name(layer_id);
}

std::vector<IntegrityFinding> check_backend_pool(const StepLayerWrites& writes,
                                                 const KvPool& before, const KvPool& after,
                                                 const KvPool& expected) {
  std::vector<IntegrityFinding> findings;

  IntegrityFinding storage = make_finding(writes, IntegrityCheck::kStorage);
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
    storage.detail = storage.where + ": pool storage changed: " + kv_dtype_name(before.dtype) +
                     " " + std::to_string(before.bytes.size()) + " bytes before the step, " +
                     kv_dtype_name(after.dtype) + " " + std::to_string(after.bytes.size()) +
                     " bytes after";
    findings.push_back(storage);
    // Nothing below can be compared byte for byte; say so rather than guess.
    for (const IntegrityCheck check :
         {IntegrityCheck::kWrittenSlots, IntegrityCheck::kUnwrittenSlots,
          IntegrityCheck::kNanWritten, IntegrityCheck::kReadConsistency}) {
      IntegrityFinding skipped = make_finding(writes, check);
      skipped.pass = false;
      skipped.detail = skipped.where + ": not checked, the pool storage changed";
      findings.push_back(skipped);
    }
    return findings;
  }

  const int width = before.row_width;
  std::vector<char> written(static_cast<std::size_t>(before.num_slots), 0);
  for (const std::int32_t slot : writes.slots) written[slot] = 1;

  // written_slots and nan_written. A slot written twice in one step is listed once and judged by
  // its last row (the expected pool holds the last write).
  std::vector<std::int64_t> wrong_written;
  std::vector<std::int64_t> nan_slots;
  std::vector<int> last_row(static_cast<std::size_t>(before.num_slots), -1);
  for (std::size_t i = 0; i < writes.slots.size(); ++i) {
    last_row[writes.slots[i]] = static_cast<int>(i);
  }
  for (std::size_t i = 0; i < writes.slots.size(); ++i) {
    const std::int64_t slot = writes.slots[i];
    if (last_row[slot] != static_cast<int>(i)) continue;
    if (!rows_equal(after, slot, expected, slot)) wrong_written.push_back(slot);
    for (int c = 0; c < width; ++c) {
      const float value = writes.new_kv[i * width + c];
      if (element_is_nan(after, slot, c) && !std::isnan(value)) {
        nan_slots.push_back(slot);
        break;
      }
    }
  }
  if (wrong_written.empty()) {
    IntegrityFinding written_finding = make_finding(writes, IntegrityCheck::kWrittenSlots);
    pass_with(written_finding,
              std::to_string(writes.slots.size()) + " written slot(s) hold " + writes.rule);
    findings.push_back(written_finding);
  } else {
    add_classified_findings(findings, writes, IntegrityCheck::kWrittenSlots, wrong_written, after,
                            expected, expected, "written slot(s) do not hold " + writes.rule);
  }

  std::vector<std::int64_t> changed;
  for (std::int64_t slot = 0; slot < before.num_slots; ++slot) {
    if (!written[slot] && !rows_equal(after, slot, before, slot)) changed.push_back(slot);
  }
  if (changed.empty()) {
    IntegrityFinding unwritten_finding = make_finding(writes, IntegrityCheck::kUnwrittenSlots);
    pass_with(unwritten_finding, "every slot the step did not write is unchanged");
    findings.push_back(unwritten_finding);
  } else {
    add_classified_findings(findings, writes, IntegrityCheck::kUnwrittenSlots, changed, after,
                            before, expected, "slot(s) the step did not write changed");
  }

  IntegrityFinding nan_finding = make_finding(writes, IntegrityCheck::kNanWritten);
  if (nan_slots.empty()) {
    pass_with(nan_finding, "no written slot holds a NaN code");
  } else {
    fail_with_slots(nan_finding, nan_slots, "written slot(s) hold a NaN code for a finite value",
                    "");
    nan_finding.classification = SlotClass::kNanCode;
  }
  findings.push_back(nan_finding);

  std::vector<std::int64_t> inconsistent;
  if (after.bytes != expected.bytes) {
    for (std::int64_t slot = 0; slot < before.num_slots; ++slot) {
      if (!rows_equal(after, slot, expected, slot)) inconsistent.push_back(slot);
    }
  }
  IntegrityFinding consistency = make_finding(writes, IntegrityCheck::kReadConsistency);
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

const PoolDamageHistory::Entry* PoolDamageHistory::find(std::int64_t slot) const {
  const auto it = entries_.find(slot);
  return it == entries_.end() ? nullptr : &it->second;
}

void PoolDamageHistory::record(std::int64_t slot, int step, SlotClass classification,
                               std::uint64_t row_hash) {
  entries_[slot] = Entry{step, classification, row_hash};
}

void PoolDamageHistory::forget(std::int64_t slot) { entries_.erase(slot); }

std::vector<IntegrityFinding> check_captured_pool(const StepLayerWrites& writes,
                                                  const KvPool& captured, const KvPool& expected,
                                                  PoolDamageHistory* history) {
  std::vector<IntegrityFinding> findings;
  if (captured.dtype != expected.dtype || captured.bytes.size() != expected.bytes.size() ||
      captured.row_width != expected.row_width) {
    IntegrityFinding finding = make_finding(writes, IntegrityCheck::kCapturedPool);
    finding.pass = false;
    finding.classification = SlotClass::kOther;
    finding.detail =
        finding.where + ": captured pool has another dtype or size than the replayed pool";
    findings.push_back(finding);
    return findings;
  }
  std::vector<char> written(static_cast<std::size_t>(expected.num_slots), 0);
  for (const std::int32_t slot : writes.slots) written[slot] = 1;

  // New damage by class; carried damage by (class, first step).
  std::array<std::vector<std::int64_t>, kClasses.size()> by_class;
  std::map<std::pair<std::size_t, int>, std::vector<std::int64_t>> carried;
  const bool identical = captured.bytes == expected.bytes;
  std::optional<WriteIndex> index;  // built at the first slot that needs classifying
  if (identical && history != nullptr) *history = PoolDamageHistory{};
  for (std::int64_t slot = 0; slot < expected.num_slots && !identical; ++slot) {
    if (rows_equal(captured, slot, expected, slot)) {
      if (history != nullptr) history->forget(slot);
      continue;
    }
    // Carried: the same bytes as when the damage was first seen, in a slot this step did not
    // write. Anything else is classified afresh, as new damage.
    const std::uint64_t hash = row_hash(captured.row(slot), captured.row_bytes());
    const PoolDamageHistory::Entry* seen = history != nullptr ? history->find(slot) : nullptr;
    SlotClass kind = SlotClass::kOther;
    int first_step = writes.step;
    if (seen != nullptr && !written[slot] && seen->row_hash == hash) {
      kind = seen->classification;
      first_step = seen->first_step;
    } else {
      if (!index) index.emplace(writes, expected);
      kind = classify_indexed(writes, *index, captured, expected, slot);
      if (history != nullptr) history->record(slot, writes.step, kind, hash);
    }
    for (std::size_t k = 0; k < kClasses.size(); ++k) {
      if (kind != kClasses[k]) continue;
      if (first_step == writes.step) {
        by_class[k].push_back(slot);
      } else {
        carried[{k, first_step}].push_back(slot);
      }
    }
  }
  for (std::size_t k = 0; k < kClasses.size(); ++k) {
    if (by_class[k].empty()) continue;
    IntegrityFinding finding = make_finding(writes, IntegrityCheck::kCapturedPool);
    finding.classification = kClasses[k];
    const std::int64_t first = by_class[k].front();
    fail_with_slots(finding, by_class[k],
                    std::string("slot(s) of the captured pool differ from the replay [") +
                        slot_class_name(kClasses[k]) + "]",
                    "slot " + std::to_string(first) + ": " +
                        describe_row_difference(captured, expected, first));
    findings.push_back(finding);
  }
  for (const auto& [key, slots] : carried) {
    IntegrityFinding finding = make_finding(writes, IntegrityCheck::kCapturedPool);
    finding.classification = kClasses[key.first];
    finding.carried_from_step = key.second;
    fail_with_slots(finding, slots,
                    std::string("slot(s) of the captured pool still differ from the replay [") +
                        slot_class_name(kClasses[key.first]) + ", unchanged since step " +
                        std::to_string(key.second) + "]",
                    "slot " + std::to_string(slots.front()) + ": " +
                        describe_row_difference(captured, expected, slots.front()));
    findings.push_back(finding);
  }
  if (findings.empty()) {
    IntegrityFinding finding = make_finding(writes, IntegrityCheck::kCapturedPool);
    pass_with(finding, "captured pool equals the replayed pool");
    findings.push_back(finding);
  }
  return findings;
}

namespace {

std::int64_t nan_codes_in_row(const KvPool& pool, std::int64_t slot) {
  std::int64_t count = 0;
  const std::uint8_t* row = pool.row(slot);
  if (pool.dtype == KvDtype::kBfloat16) {
    for (int c = 0; c < pool.row_width; ++c) {
      const unsigned bits = row[2 * c] | (static_cast<unsigned>(row[2 * c + 1]) << 8);
      count += (bits & 0x7FFFu) > 0x7F80u;
    }
  } else {
    for (int c = 0; c < pool.row_width; ++c) count += (row[c] & 0x7F) == 0x7F;
  }
  return count;
}

}  // namespace

void PoolNanCodes::scan(const KvPool& pool) {
  codes_by_slot_.clear();
  for (std::int64_t slot = 0; slot < pool.num_slots; ++slot) {
    if (const std::int64_t codes = nan_codes_in_row(pool, slot); codes > 0) {
      codes_by_slot_[slot] = codes;
    }
  }
}

void PoolNanCodes::update(const KvPool& pool, std::span<const std::int32_t> written_slots) {
  for (const std::int32_t slot : written_slots) {
    if (const std::int64_t codes = nan_codes_in_row(pool, slot); codes > 0) {
      codes_by_slot_[slot] = codes;
    } else {
      codes_by_slot_.erase(slot);
    }
  }
}

std::optional<IntegrityFinding> PoolNanCodes::report(const StepLayerWrites& writes,
                                                     std::int64_t num_slots,
                                                     std::span<const std::int64_t> visible) const {
  if (codes_by_slot_.empty()) return std::nullopt;
  std::vector<char> read(static_cast<std::size_t>(num_slots), 0);
  for (const std::int64_t slot : visible) read[slot] = 1;
  std::vector<std::int64_t> slots;
  std::int64_t codes = 0;
  std::int64_t read_slots = 0;
  for (const auto& [slot, count] : codes_by_slot_) {
    codes += count;
    slots.push_back(slot);
    read_slots += read[slot];
  }
  IntegrityFinding finding = make_finding(writes, IntegrityCheck::kNanCodesInPool);
  finding.pass = true;  // data, not a failure (kvdump-v1 "Errors")
  finding.slots.assign(slots.begin(),
                       slots.begin() + std::min<std::size_t>(slots.size(), kMaxListedSlots));
  finding.slot_count = static_cast<std::int64_t>(slots.size());
  finding.classification = SlotClass::kNanCode;
  std::ostringstream text;
  text << finding.where << ": the pool holds " << codes << " NaN code(s) in "
       << slot_list(slots, slots.size())
       << " (data, not a failure): " << static_cast<std::int64_t>(slots.size()) - read_slots
       << " slot(s) no request of this step reads, " << read_slots
       << " read (the reference is NaN where a row reads one; a backend output must match)";
  finding.detail = text.str();
  return finding;
}

std::optional<IntegrityFinding> report_nan_codes(const StepLayerWrites& writes, const KvPool& pool,
                                                 std::span<const std::int64_t> visible) {
  PoolNanCodes nan_codes;
  nan_codes.scan(pool);
  return nan_codes.report(writes, pool.num_slots, visible);
}

}  // namespace kvaudit
