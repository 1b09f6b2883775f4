// Integrity checks of the KV pools (see integrity.hpp for what each check means). All comparisons
// are bytewise on the stored codes; there is no tolerance anywhere in this file.
#include "src/replay/integrity.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <unordered_map>
#include <utility>

#include "src/format/kvdump_validator.hpp"

namespace kvaudit {
namespace {

bool rows_equal(const KvPool& a, std::int64_t slot_a, const KvPool& b, std::int64_t slot_b) {
  return std::memcmp(a.row(slot_a), b.row(slot_b), a.row_bytes()) == 0;
}

bool element_is_nan(const KvPool& pool, std::int64_t slot, int col) {
  if (pool.grouped()) {
    return std::isnan(pool.element(slot, col)) ||
           (col < pool.latent_width && std::isnan(pool.group_scale(slot, col / pool.group_size)));
  }
  if (pool.dtype == KvDtype::kBfloat16) return std::isnan(bf16_to_float(pool.bf16_bits(slot, col)));
  return e4m3_is_nan(pool.row(slot)[col]);
}

// "slot 5" or "slots 2, 3, ... (40 in all)": the first eight.
std::string slot_list(const std::vector<std::int64_t>& slots) {
  const std::size_t shown = std::min<std::size_t>(slots.size(), 8);
  const std::string listed =
      fmt::format("{}", fmt::join(slots.begin(), slots.begin() + shown, ", "));
  const char* noun = slots.size() == 1 ? "slot" : "slots";
  if (slots.size() > shown)
    return fmt::format("{} {}, ... ({} in all)", noun, listed, slots.size());
  return fmt::format("{} {}", noun, listed);
}

// What differs in one slot: "3 of 576 bytes differ, first at byte 5: 0x3f, expected 0x38", or,
// where the dump's attributes are known, with the first byte located in the file's own datasets
// of `pool_name` ("first at kv_scales_after[2, 1, 1], byte 2 of its float32: ...").
std::string describe_row_difference(const StepLayerWrites& writes, const std::string& pool_name,
                                    const KvPool& actual, const KvPool& expected,
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
  const std::string at = writes.attrs != nullptr
                             ? locate_pool_byte(*writes.attrs, pool_name, slot, first)
                             : fmt::format("byte {}", first);
  return fmt::format("{} of {} bytes differ, first at {}: 0x{:02x}, expected 0x{:02x}", differing,
                     actual.row_bytes(), at, a[first], e[first]);
}

// "slot 5: 3 of 576 bytes differ, ...", for the first of a finding's slots.
std::string first_slot_difference(const StepLayerWrites& writes, const std::string& pool_name,
                                  const std::vector<std::int64_t>& slots, const KvPool& actual,
                                  const KvPool& expected) {
  return fmt::format("slot {}: {}", slots.front(),
                     describe_row_difference(writes, pool_name, actual, expected, slots.front()));
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
  finding.detail = fmt::format("{}: {} {}: {}{}", finding.where, slots.size(), what,
                               slot_list(slots), detail.empty() ? "" : " (" + detail + ")");
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
  // The other written slot whose expected row `actual` holds at `slot` (one whose expected row
  // differs from this slot's own), if any.
  std::optional<std::int64_t> written_row_held(const KvPool& actual, std::int64_t slot) const {
    const auto [first, last] =
        slots_by_hash_.equal_range(row_hash(actual.row(slot), actual.row_bytes()));
    for (auto it = first; it != last; ++it) {
      const std::int64_t other = it->second;
      if (other != slot && !rows_equal(expected_, other, expected_, slot) &&
          rows_equal(actual, slot, expected_, other)) {
        return other;
      }
    }
    return std::nullopt;
  }

 private:
  const KvPool& expected_;
  std::unordered_map<std::int64_t, int> row_of_slot_;
  std::unordered_multimap<std::uint64_t, std::int64_t> slots_by_hash_;
};

// A written row found in another slot: the slot it was meant for and the slot it landed in.
struct Misplacement {
  std::int64_t intended_slot;
  std::int64_t landed_slot;
};

// wrong_slot: a row this step wrote for another slot landed here, or this slot's own row landed in
// a neighbour (a write to slot +-1, wrapping at the pool's ends as a modular index does).
std::optional<Misplacement> find_misplacement(const WriteIndex& index, const KvPool& actual,
                                              const KvPool& expected, std::int64_t slot) {
  if (const auto other = index.written_row_held(actual, slot)) return Misplacement{*other, slot};
  if (index.row_of(slot) < 0) return std::nullopt;
  const std::int64_t slots = expected.num_slots;
  for (const std::int64_t neighbour : {(slot + slots - 1) % slots, (slot + 1) % slots}) {
    if (neighbour != slot && !rows_equal(actual, neighbour, expected, neighbour) &&
        rows_equal(actual, neighbour, expected, slot)) {
      return Misplacement{slot, neighbour};
    }
  }
  return std::nullopt;
}

bool is_wrong_slot(const WriteIndex& index, const KvPool& actual, const KvPool& expected,
                   std::int64_t slot) {
  return find_misplacement(index, actual, expected, slot).has_value();
}

// The rows of wrong_slot `slots` found in another slot, each once, by request and token where the
// step is known (at most kMaxListedSlots), in slot order.
std::vector<MisplacedRow> misplaced_rows(const StepLayerWrites& writes, const WriteIndex& index,
                                         const KvPool& actual, const KvPool& expected,
                                         const std::vector<std::int64_t>& slots) {
  std::vector<MisplacedRow> rows;
  for (const std::int64_t slot : slots) {
    const std::optional<Misplacement> found = find_misplacement(index, actual, expected, slot);
    if (!found) continue;
    MisplacedRow row;
    row.slot = found->landed_slot;
    row.intended_slot = found->intended_slot;
    row.new_kv_row = index.row_of(found->intended_slot);
    if (writes.meta != nullptr && row.new_kv_row >= 0) {
      row.request = writes.meta->request_of_row(row.new_kv_row);
      row.token = writes.meta->position_of_row(row.new_kv_row, writes.page_size);
    }
    if (std::find(rows.begin(), rows.end(), row) != rows.end()) continue;
    rows.push_back(row);
    if (rows.size() == kMaxListedSlots) break;
  }
  std::sort(rows.begin(), rows.end(),
            [](const MisplacedRow& a, const MisplacedRow& b) { return a.slot < b.slot; });
  return rows;
}

// Names the misplaced rows of a wrong_slot finding in its detail: "...; request 0 token 6's row,
// meant for slot 6, landed in slot 7; ..." (the first three).
void add_misplaced_rows(IntegrityFinding& finding, std::vector<MisplacedRow> rows) {
  constexpr std::size_t kNamed = 3;
  for (std::size_t i = 0; i < rows.size() && i < kNamed; ++i) {
    finding.detail += "; " + misplaced_row_text(rows[i]);
  }
  if (rows.size() > kNamed) finding.detail += fmt::format("; {} rows in all", rows.size());
  finding.misplaced_rows = std::move(rows);
}

// A bf16 pool's slot: NaN where a finite value was expected, else other.
SlotClass classify_bf16_slot(const KvPool& actual, const KvPool& expected, std::int64_t slot) {
  for (int c = 0; c < expected.row_width; ++c) {
    if (element_is_nan(actual, slot, c) && !element_is_nan(expected, slot, c)) {
      return SlotClass::kNanCode;
    }
  }
  return SlotClass::kOther;
}

// How the e4m3 codes of a slot differ from the expected ones.
struct CodeDifference {
  int differing = 0;           // codes that differ
  bool any_nan = false;        // a NaN code where a finite one was expected
  bool all_off_by_one = true;  // every differing code one step from the expected, same sign
};

CodeDifference compare_codes(const std::uint8_t* got, const std::uint8_t* want, int width) {
  CodeDifference difference;
  for (int c = 0; c < width; ++c) {
    if (got[c] == want[c]) continue;
    ++difference.differing;
    difference.any_nan |= e4m3_is_nan(got[c]) && !e4m3_is_nan(want[c]);
    const bool same_sign = (got[c] & 0x80) == (want[c] & 0x80);
    const int distance =
        std::abs(static_cast<int>(got[c] & 0x7F) - static_cast<int>(want[c] & 0x7F));
    difference.all_off_by_one &= same_sign && distance == 1 && !e4m3_is_nan(got[c]);
  }
  return difference;
}

// bf16_bytes: this slot's row as bf16 (high bytes, or the first half of the 2-byte row), or the
// spill of the previous slot's bf16 row (its second half).
bool holds_bf16_bytes(const StepLayerWrites& writes, const WriteIndex& index,
                      const std::uint8_t* got, const std::uint8_t* want, int width,
                      std::int64_t slot) {
  const int row = index.row_of(slot);
  if (row >= 0) {
    const float* values = writes.new_kv.data() + static_cast<std::size_t>(row) * width;
    if (holds_bf16_high_bytes(got, want, values, width, writes.kv_scale) ||
        holds_bf16_row_bytes(got, want, values, width, 0, writes.kv_scale)) {
      return true;
    }
  }
  const int previous_row = slot > 0 ? index.row_of(slot - 1) : -1;
  if (previous_row < 0) return false;
  const float* values = writes.new_kv.data() + static_cast<std::size_t>(previous_row) * width;
  return holds_bf16_row_bytes(got, want, values, width, width, writes.kv_scale);
}

// A per_token_group slot (kvdump v1.1) that differs from the expected one, by which of its parts
// differ: [latent codes][scales][RoPE].
SlotClass classify_grouped_slot(const KvPool& actual, const KvPool& expected, std::int64_t slot) {
  for (int c = 0; c < expected.row_width; ++c) {
    if (element_is_nan(actual, slot, c) && !element_is_nan(expected, slot, c)) {
      return SlotClass::kNanCode;
    }
  }
  const std::uint8_t* got = actual.row(slot);
  const std::uint8_t* want = expected.row(slot);
  const std::size_t scales = expected.scales_offset();
  const std::size_t rope = expected.rope_offset();
  const bool latent_same = std::memcmp(got, want, scales) == 0;
  const bool scales_same = std::memcmp(got + scales, want + scales, rope - scales) == 0;
  const bool rope_same = std::memcmp(got + rope, want + rope, expected.row_bytes() - rope) == 0;
  if (latent_same && rope_same) {
    for (int g = 0; g < expected.num_groups(); ++g) {
      for (int h = 0; h < expected.num_groups(); ++h) {
        if (h != g && actual.group_scale(slot, g) == expected.group_scale(slot, h) &&
            actual.group_scale(slot, g) != expected.group_scale(slot, g)) {
          return SlotClass::kSwappedGroupScale;
        }
      }
    }
    return SlotClass::kScaleBytes;
  }
  if (latent_same && scales_same && expected.rope_dtype == KvDtype::kFloat8E4m3fn) {
    for (int c = expected.latent_width; c < expected.row_width; ++c) {
      const float a = std::fabs(actual.element(slot, c));
      if (a == kE4m3MaxFinite && std::fabs(expected.element(slot, c)) != kE4m3MaxFinite) {
        return SlotClass::kRopeSaturated;
      }
    }
  }
  if (scales_same && rope_same) {
    const CodeDifference difference = compare_codes(got, want, expected.latent_width);
    return difference.all_off_by_one ? SlotClass::kOffByOneCode : SlotClass::kCodesOtherScale;
  }
  return SlotClass::kOther;
}

// Whether no request of the step holds `slot` (known only where the replay said which do).
bool slot_unused(const StepLayerWrites& writes, std::int64_t slot) {
  return writes.held_slots &&
         !std::binary_search(writes.held_slots->begin(), writes.held_slots->end(), slot);
}

SlotClass classify_indexed(const StepLayerWrites& writes, const WriteIndex& index,
                           const KvPool& actual, const KvPool& expected, std::int64_t slot) {
  // Nothing to classify where the bytes agree (an unwritten slot that changed back to them).
  if (rows_equal(actual, slot, expected, slot)) return SlotClass::kOther;
  if (is_wrong_slot(index, actual, expected, slot)) return SlotClass::kWrongSlot;
  const bool unused = slot_unused(writes, slot);
  if (unused && (expected.dtype == KvDtype::kBfloat16 || expected.grouped())) {
    return SlotClass::kUnusedSlot;
  }
  if (expected.dtype == KvDtype::kBfloat16) return classify_bf16_slot(actual, expected, slot);
  if (expected.grouped()) return classify_grouped_slot(actual, expected, slot);
  const int width = expected.row_width;
  const std::uint8_t* got = actual.row(slot);
  const std::uint8_t* want = expected.row(slot);
  const CodeDifference difference = compare_codes(got, want, width);
  if (unused) {  // garbage, unless it is the bf16 spill of a written row
    const bool bf16 =
        difference.differing >= 2 && holds_bf16_bytes(writes, index, got, want, width, slot);
    return bf16 ? SlotClass::kBf16Bytes : SlotClass::kUnusedSlot;
  }
  // Every differing code one step away is a rounding difference, whatever else it resembles: for
  // quotients in [1.875, 4) the bf16 high byte (0x3F, 0x40) is itself a neighbouring e4m3 code.
  if (difference.all_off_by_one) return SlotClass::kOffByOneCode;
  // A single differing byte is too weak a match to call it bf16 bytes.
  if (difference.differing >= 2 && holds_bf16_bytes(writes, index, got, want, width, slot)) {
    return SlotClass::kBf16Bytes;
  }
  return difference.any_nan ? SlotClass::kNanCode : SlotClass::kOther;
}

// Slots by class, in the order findings are reported (the order of SlotClass).
using SlotsByClass = std::map<SlotClass, std::vector<std::int64_t>>;

// Failing slots split by class: one finding per class present, `what` naming the check's failure
// and the first slot's bytes shown against `compared_with`.
void add_classified_findings(std::vector<IntegrityFinding>& findings, const StepLayerWrites& writes,
                             IntegrityCheck check, const std::vector<std::int64_t>& slots,
                             const KvPool& actual, const KvPool& compared_with,
                             const KvPool& expected, const std::string& what) {
  SlotsByClass by_class;
  const WriteIndex index(writes, expected);
  for (const std::int64_t slot : slots) {
    by_class[classify_indexed(writes, index, actual, expected, slot)].push_back(slot);
  }
  for (const auto& [slot_class, class_slots] : by_class) {
    IntegrityFinding finding = make_finding(writes, check);
    finding.classification = slot_class;
    fail_with_slots(finding, class_slots, fmt::format("{} [{}]", what, slot_class_name(slot_class)),
                    first_slot_difference(writes, "kv_cache", class_slots, actual, compared_with));
    if (slot_class == SlotClass::kWrongSlot) {
      add_misplaced_rows(finding, misplaced_rows(writes, index, actual, expected, class_slots));
    }
    findings.push_back(std::move(finding));
  }
}

// ---- backend pool ------------------------------------------------------------------------------

// storage: whether the pool is still the same dtype and size. When it is not, nothing else can be
// compared byte for byte: the other four checks fail as not checked rather than guess.
bool add_storage_findings(std::vector<IntegrityFinding>& findings, const StepLayerWrites& writes,
                          const KvPool& before, const KvPool& after, const KvPool& expected) {
  IntegrityFinding storage = make_finding(writes, IntegrityCheck::kStorage);
  const bool same_storage = after.dtype == before.dtype && after.num_slots == before.num_slots &&
                            after.row_width == before.row_width &&
                            after.bytes.size() == before.bytes.size() &&
                            expected.bytes.size() == before.bytes.size();
  if (same_storage) {
    pass_with(storage, fmt::format("pool still holds {}, {} byte(s) per element",
                                   kv_dtype_name(before.dtype), before.bytes_per_element()));
    findings.push_back(storage);
    return true;
  }
  storage.pass = false;
  storage.detail =
      fmt::format("{}: pool storage changed: {} {} bytes before the step, {} {} bytes after",
                  storage.where, kv_dtype_name(before.dtype), before.bytes.size(),
                  kv_dtype_name(after.dtype), after.bytes.size());
  findings.push_back(storage);
  for (const IntegrityCheck check :
       {IntegrityCheck::kWrittenSlots, IntegrityCheck::kUnwrittenSlots, IntegrityCheck::kNanWritten,
        IntegrityCheck::kReadConsistency}) {
    IntegrityFinding skipped = make_finding(writes, check);
    skipped.pass = false;
    skipped.detail = skipped.where + ": not checked, the pool storage changed";
    findings.push_back(skipped);
  }
  return false;
}

// The slots the step wrote, each once, with the row of new_kv it holds: the last one written to
// it (the expected pool holds the last write), in the order of those last writes.
struct SlotWrite {
  std::int64_t slot;
  std::size_t row;
};
std::vector<SlotWrite> last_writes(const StepLayerWrites& writes, std::int64_t num_slots) {
  std::vector<std::size_t> last_row(static_cast<std::size_t>(num_slots), 0);
  for (std::size_t i = 0; i < writes.slots.size(); ++i) last_row[writes.slots[i]] = i;
  std::vector<SlotWrite> last;
  for (std::size_t i = 0; i < writes.slots.size(); ++i) {
    if (last_row[writes.slots[i]] == i) last.push_back({writes.slots[i], i});
  }
  return last;
}

// written_slots: every written slot equals the expected row.
void add_written_slots(std::vector<IntegrityFinding>& findings, const StepLayerWrites& writes,
                       const std::vector<SlotWrite>& last, const KvPool& after,
                       const KvPool& expected) {
  std::vector<std::int64_t> wrong;
  for (const SlotWrite& write : last) {
    if (!rows_equal(after, write.slot, expected, write.slot)) wrong.push_back(write.slot);
  }
  if (!wrong.empty()) {
    add_classified_findings(findings, writes, IntegrityCheck::kWrittenSlots, wrong, after, expected,
                            expected, "written slot(s) do not hold " + writes.rule);
    return;
  }
  IntegrityFinding finding = make_finding(writes, IntegrityCheck::kWrittenSlots);
  pass_with(finding, fmt::format("{} written slot(s) hold {}", writes.slots.size(), writes.rule));
  findings.push_back(finding);
}

// unwritten_slots: every other slot bitwise as before the step.
void add_unwritten_slots(std::vector<IntegrityFinding>& findings, const StepLayerWrites& writes,
                         const KvPool& before, const KvPool& after, const KvPool& expected) {
  std::vector<char> written(static_cast<std::size_t>(before.num_slots), 0);
  for (const std::int32_t slot : writes.slots) written[slot] = 1;
  std::vector<std::int64_t> changed;
  for (std::int64_t slot = 0; slot < before.num_slots; ++slot) {
    if (!written[slot] && !rows_equal(after, slot, before, slot)) changed.push_back(slot);
  }
  if (!changed.empty()) {
    add_classified_findings(findings, writes, IntegrityCheck::kUnwrittenSlots, changed, after,
                            before, expected, "slot(s) the step did not write changed");
    return;
  }
  IntegrityFinding finding = make_finding(writes, IntegrityCheck::kUnwrittenSlots);
  pass_with(finding, "every slot the step did not write is unchanged");
  findings.push_back(finding);
}

// nan_written: no written slot holds a NaN code where its input value was not NaN.
void add_nan_written(std::vector<IntegrityFinding>& findings, const StepLayerWrites& writes,
                     const std::vector<SlotWrite>& last, const KvPool& after) {
  const int width = after.row_width;
  std::vector<std::int64_t> nan_slots;
  for (const SlotWrite& write : last) {
    for (int c = 0; c < width; ++c) {
      const float value = writes.new_kv[write.row * width + c];
      if (element_is_nan(after, write.slot, c) && !std::isnan(value)) {
        nan_slots.push_back(write.slot);
        break;
      }
    }
  }
  IntegrityFinding finding = make_finding(writes, IntegrityCheck::kNanWritten);
  if (nan_slots.empty()) {
    pass_with(finding, "no written slot holds a NaN code");
  } else {
    fail_with_slots(finding, nan_slots, "written slot(s) hold a NaN code for a finite value", "");
    finding.classification = SlotClass::kNanCode;
  }
  findings.push_back(finding);
}

// read_consistency: the whole pool equals the reference pool (what later steps will read).
void add_read_consistency(std::vector<IntegrityFinding>& findings, const StepLayerWrites& writes,
                          const KvPool& after, const KvPool& expected) {
  std::vector<std::int64_t> inconsistent;
  if (after.bytes != expected.bytes) {
    for (std::int64_t slot = 0; slot < after.num_slots; ++slot) {
      if (!rows_equal(after, slot, expected, slot)) inconsistent.push_back(slot);
    }
  }
  IntegrityFinding finding = make_finding(writes, IntegrityCheck::kReadConsistency);
  if (inconsistent.empty()) {
    pass_with(finding, "backend pool equals the reference replay's pool");
  } else {
    fail_with_slots(finding, inconsistent,
                    "slot(s) of the backend pool differ from the reference replay's pool",
                    "later steps read these");
  }
  findings.push_back(finding);
}

// ---- captured pool -----------------------------------------------------------------------------

// The slots of a captured pool that differ from the expected pool: new damage by class, and
// damage carried unchanged from an earlier step by (class, step first seen).
struct CapturedDamage {
  SlotsByClass fresh;
  std::map<std::pair<SlotClass, int>, std::vector<std::int64_t>> carried;
};

CapturedDamage find_captured_damage(const StepLayerWrites& writes, const KvPool& captured,
                                    const KvPool& expected, PoolDamageHistory* history) {
  CapturedDamage damage;
  const bool identical = captured.bytes == expected.bytes;
  if (identical && history != nullptr) *history = PoolDamageHistory{};
  if (identical) return damage;
  std::vector<char> written(static_cast<std::size_t>(expected.num_slots), 0);
  for (const std::int32_t slot : writes.slots) written[slot] = 1;
  std::optional<WriteIndex> index;  // built at the first slot that needs classifying
  for (std::int64_t slot = 0; slot < expected.num_slots; ++slot) {
    if (rows_equal(captured, slot, expected, slot)) {
      if (history != nullptr) history->forget(slot);
      continue;
    }
    // Carried: the same bytes as when the damage was first seen, in a slot this step did not
    // write. Anything else is classified afresh, as new damage.
    const std::uint64_t hash = row_hash(captured.row(slot), captured.row_bytes());
    const PoolDamageHistory::Entry* seen = history != nullptr ? history->find(slot) : nullptr;
    if (seen != nullptr && !written[slot] && seen->row_hash == hash) {
      if (seen->first_step == writes.step) {
        damage.fresh[seen->classification].push_back(slot);
      } else {
        damage.carried[{seen->classification, seen->first_step}].push_back(slot);
      }
      continue;
    }
    if (!index) index.emplace(writes, expected);
    const SlotClass slot_class = classify_indexed(writes, *index, captured, expected, slot);
    if (history != nullptr) history->record(slot, writes.step, slot_class, hash);
    damage.fresh[slot_class].push_back(slot);
  }
  return damage;
}

void add_captured_findings(std::vector<IntegrityFinding>& findings, const StepLayerWrites& writes,
                           const CapturedDamage& damage, const KvPool& captured,
                           const KvPool& expected) {
  for (const auto& [slot_class, slots] : damage.fresh) {
    IntegrityFinding finding = make_finding(writes, IntegrityCheck::kCapturedPool);
    finding.classification = slot_class;
    fail_with_slots(finding, slots,
                    fmt::format("slot(s) of the captured pool differ from the replay [{}]",
                                slot_class_name(slot_class)),
                    first_slot_difference(writes, "kv_cache_after", slots, captured, expected));
    if (slot_class == SlotClass::kWrongSlot) {
      const WriteIndex index(writes, expected);
      add_misplaced_rows(finding, misplaced_rows(writes, index, captured, expected, slots));
    }
    findings.push_back(finding);
  }
  for (const auto& [key, slots] : damage.carried) {
    const auto [slot_class, first_step] = key;
    IntegrityFinding finding = make_finding(writes, IntegrityCheck::kCapturedPool);
    finding.classification = slot_class;
    finding.carried_from_step = first_step;
    fail_with_slots(finding, slots,
                    fmt::format("slot(s) of the captured pool still differ from the replay [{}, "
                                "unchanged since step {}]",
                                slot_class_name(slot_class), first_step),
                    first_slot_difference(writes, "kv_cache_after", slots, captured, expected));
    findings.push_back(finding);
  }
}

}  // namespace

SlotClass classify_slot(const StepLayerWrites& writes, const KvPool& actual, const KvPool& expected,
                        std::int64_t slot) {
  return classify_indexed(writes, WriteIndex(writes, expected), actual, expected, slot);
}

std::string step_layer_name(int step, int layer_id) {
  return fmt::format("{} {}", step_group_name(step), layer_group_name(layer_id));
}

std::vector<IntegrityFinding> check_backend_pool(const StepLayerWrites& writes,
                                                 const KvPool& before, const KvPool& after,
                                                 const KvPool& expected) {
  std::vector<IntegrityFinding> findings;
  if (!add_storage_findings(findings, writes, before, after, expected)) return findings;
  const std::vector<SlotWrite> last = last_writes(writes, before.num_slots);
  add_written_slots(findings, writes, last, after, expected);
  add_unwritten_slots(findings, writes, before, after, expected);
  add_nan_written(findings, writes, last, after);
  add_read_consistency(findings, writes, after, expected);
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
  add_captured_findings(findings, writes, find_captured_damage(writes, captured, expected, history),
                        captured, expected);
  if (findings.empty()) {
    IntegrityFinding finding = make_finding(writes, IntegrityCheck::kCapturedPool);
    pass_with(finding, "captured pool equals the replayed pool");
    findings.push_back(finding);
  }
  return findings;
}

namespace {

// NaN codes of a slot's elements (a grouped slot's latent codes and RoPE part, not its scales).
std::int64_t nan_codes_in_row(const KvPool& pool, std::int64_t slot) {
  std::int64_t count = 0;
  const std::uint8_t* row = pool.row(slot);
  if (pool.grouped()) {
    for (int c = 0; c < pool.row_width; ++c) count += std::isnan(pool.element(slot, c));
  } else if (pool.dtype == KvDtype::kBfloat16) {
    for (int c = 0; c < pool.row_width; ++c) {
      const unsigned bits = row[2 * c] | (static_cast<unsigned>(row[2 * c + 1]) << 8);
      count += (bits & 0x7FFFu) > 0x7F80u;
    }
  } else {
    for (int c = 0; c < pool.row_width; ++c) count += (row[c] & 0x7F) == 0x7F;
  }
  return count;
}

// NaN group scales of a grouped slot (one each, however many codes they multiply); 0 otherwise.
std::int64_t nan_scales_in_row(const KvPool& pool, std::int64_t slot) {
  std::int64_t count = 0;
  for (int g = 0; g < pool.num_groups(); ++g) count += std::isnan(pool.group_scale(slot, g));
  return count;
}

}  // namespace

void PoolNanCodes::count_slot(const KvPool& pool, std::int64_t slot) {
  const SlotNans nans{nan_codes_in_row(pool, slot), nan_scales_in_row(pool, slot)};
  if (nans.codes > 0 || nans.scales > 0) {
    by_slot_[slot] = nans;
  } else {
    by_slot_.erase(slot);
  }
}

void PoolNanCodes::scan(const KvPool& pool) {
  by_slot_.clear();
  for (std::int64_t slot = 0; slot < pool.num_slots; ++slot) count_slot(pool, slot);
}

void PoolNanCodes::update(const KvPool& pool, std::span<const std::int32_t> written_slots) {
  for (const std::int32_t slot : written_slots) count_slot(pool, slot);
}

std::optional<IntegrityFinding> PoolNanCodes::report(const StepLayerWrites& writes,
                                                     std::int64_t num_slots,
                                                     std::span<const std::int64_t> visible) const {
  if (by_slot_.empty()) return std::nullopt;
  std::vector<char> read(static_cast<std::size_t>(num_slots), 0);
  for (const std::int64_t slot : visible) read[slot] = 1;
  std::vector<std::int64_t> slots;
  std::int64_t codes = 0;
  std::int64_t scales = 0;
  std::int64_t read_slots = 0;
  for (const auto& [slot, nans] : by_slot_) {
    codes += nans.codes;
    scales += nans.scales;
    slots.push_back(slot);
    read_slots += read[slot];
  }
  // A NaN group scale is one NaN scale (it makes its group's values NaN), not a NaN per code.
  const std::string what =
      scales == 0 ? fmt::format("{} NaN code(s)", codes)
                  : fmt::format("{} NaN code(s) and {} NaN group scale(s)", codes, scales);
  IntegrityFinding finding = make_finding(writes, IntegrityCheck::kNanCodesInPool);
  finding.pass = true;  // data, not a failure (kvdump-v1 "Errors")
  finding.slots.assign(slots.begin(),
                       slots.begin() + std::min<std::size_t>(slots.size(), kMaxListedSlots));
  finding.slot_count = static_cast<std::int64_t>(slots.size());
  finding.classification = SlotClass::kNanCode;
  finding.detail = fmt::format(
      "{}: the pool holds {} in {} (data, not a failure): {} slot(s) no request of "
      "this step reads, {} read (the reference is NaN where a row reads one; a backend output "
      "must match)",
      finding.where, what, slot_list(slots), static_cast<std::int64_t>(slots.size()) - read_slots,
      read_slots);
  return finding;
}

std::optional<IntegrityFinding> report_nan_codes(const StepLayerWrites& writes, const KvPool& pool,
                                                 std::span<const std::int64_t> visible) {
  PoolNanCodes nan_codes;
  nan_codes.scan(pool);
  return nan_codes.report(writes, pool.num_slots, visible);
}

}  // namespace kvaudit
