// Integrity of the KV cache across steps (docs/design.md "Integrity of the cache").
//
// Pools are [num_slots, row_width] as stored: one e4m3 code per element (or two bytes of bf16
// bits). After a step's writes the expected pool is the reference replay's own pool, in which
// every slot the step wrote (new_kv_slots) holds kvdump_quantize(new_kv, kv_scale), i.e.
// e4m3_rne_satfinite(fp32(x) / fp32(kv_scale)), and every other slot is what it was before.
// These checks are exact (bytewise); there is no tolerance.
//
// Backend pool, after run_step:
//   storage          dtype and byte size unchanged (one byte per element of e4m3 codes, not a
//                    BF16 buffer in its place)
//   written_slots    every slot of new_kv_slots equals the expected row
//   unwritten_slots  every other slot is bitwise equal to the copy taken before the step
//   nan_written      no written slot holds a NaN code where its input value was not NaN
//   read_consistency the whole pool equals the reference pool (what later steps will read)
// Captured pool (kv_cache_after in the dump), against the expected pool:
//   captured_pool    equal, or one failing finding per classification of the differing slots
// As data (always passes): nan_codes_in_pool, the NaN codes the reference replay's pool holds
// after the step (the dump's kv_cache plus the writes; legal in unused slots, kvdump-v1
// "Errors"), split into slots the step's attention reads and slots it does not.
//
// A slot that differs from the expected pool is classified (written_slots, unwritten_slots and
// captured_pool findings carry the class):
//   wrong_slot      its row equals the expected row of another slot the step wrote, or its own
//                   expected row landed in a neighbour (a write to slot +-1); the finding names
//                   each such row (misplaced_rows: request, token, the slot meant and the slot
//                   it landed in)
//   bf16_bytes      BF16 bits in an FP8 slot: every differing byte is the high byte of bf16(x)
//                   (or of bf16(x / kv_scale)); or the slot holds the little-endian bf16 row
//                   (2 bytes per element, elements 0 .. D/2-1); or it is the next slot and holds
//                   the spill of that row (elements D/2 .. D-1)
//   nan_code        it holds a NaN code (0x7F / 0xFF) where a finite code was expected
//   off_by_one_code every differing code is one step from the expected code (wrong rounding)
//   unused_slot     a slot no request of any step of the dump holds (StepLayerWrites::held_slots):
//                   garbage
//                   there is judged (every slot must be bitwise as expected) but gets no rounding
//                   or scale class; wrong_slot and bf16_bytes still apply
//   other           anything else
// Damage of a captured pool that persists unchanged into later steps keeps the class and step it
// was first seen with (PoolDamageHistory), so a later step reports it as carried, not as new
// damage; a damaged slot whose bytes change again is classified afresh.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "src/format/kvdump.hpp"
#include "src/verdict/check_result.hpp"

namespace kvaudit {

// How many offending slots a finding lists (the message names the first few of them).
inline constexpr std::size_t kMaxListedSlots = 32;

struct StepLayerWrites {
  int step = 0;                         // S### number
  int layer_id = 0;                     // L### number
  std::span<const std::int32_t> slots;  // new_kv_slots: [Nq]
  std::span<const float> new_kv;        // [Nq, D], values before quantization
  float kv_scale = 1.0f;
  // The dump's group names, "S001 L000", for messages; empty: built from step and layer_id.
  std::string where;
  // The write rule the expected pool was written with, for messages.
  std::string rule = "kvdump_quantize(new_kv, kv_scale)";
  // The dump's attributes (may be null): messages then locate a differing byte in the file's own
  // datasets (kv_cache / kv_rope / kv_scales, or their _after forms) rather than in the slot form.
  const DumpAttributes* attrs = nullptr;
  // The slots that hold a token of some request of any step of the dump (sorted): a slot a request
  // not scheduled in this step holds is still used. Absent: not known, every slot is taken as used.
  // A differing slot outside them is classed unused_slot.
  std::optional<std::vector<std::int64_t>> held_slots = std::nullopt;
  // The step, to name the request and token of a misplaced row (MisplacedRow); null: rows are
  // named by their index in new_kv only.
  const StepMeta* meta = nullptr;
  int page_size = 0;
};

// Slot-level damage of a captured pool seen so far: slot -> (step first seen, class).
class PoolDamageHistory {
 public:
  struct Entry {
    int first_step = 0;
    SlotClass classification = SlotClass::kOther;
    std::uint64_t row_hash = 0;  // of the damaged bytes: damage is carried only while unchanged
  };
  const Entry* find(std::int64_t slot) const;
  void record(std::int64_t slot, int step, SlotClass classification, std::uint64_t row_hash);
  void forget(std::int64_t slot);  // the slot is back to its expected bytes
  std::size_t size() const { return entries_.size(); }

 private:
  std::map<std::int64_t, Entry> entries_;
};

// The checks on the pool a backend left after run_step. `before` is the backend's pool before the
// step, `expected` the reference pool after the step's writes, `expected_dtype` / `expected_bytes`
// what the storage was before the step. Returns one finding per check (pass or fail).
std::vector<IntegrityFinding> check_backend_pool(const StepLayerWrites& writes,
                                                 const KvPool& before, const KvPool& after,
                                                 const KvPool& expected);

// The captured pool after the step (kv_cache_after) against the expected pool. Returns one passing
// finding when they are equal, else one failing finding per classification present (new damage
// and damage carried from an earlier step apart). `history` (may be null) carries the damage
// from step to step of one layer; it is updated.
std::vector<IntegrityFinding> check_captured_pool(const StepLayerWrites& writes,
                                                  const KvPool& captured, const KvPool& expected,
                                                  PoolDamageHistory* history = nullptr);

// Classification of one slot of `actual` that differs from `expected` (classes above).
SlotClass classify_slot(const StepLayerWrites& writes, const KvPool& actual, const KvPool& expected,
                        std::int64_t slot);

// The NaN codes a pool holds, by slot, kept current from step to step: the pool is scanned once,
// then only the slots each step writes are counted again. A grouped (v1.1) slot's NaN group
// scales are counted apart, one per scale, not as NaN codes of the group's elements.
class PoolNanCodes {
 public:
  void scan(const KvPool& pool);
  void update(const KvPool& pool, std::span<const std::int32_t> written_slots);
  // Reported as data: a passing nan_codes_in_pool finding naming the slots, split by whether
  // `visible` (the slots the step's attention reads, any order) holds them; none when there are
  // no NaN codes.
  std::optional<IntegrityFinding> report(const StepLayerWrites& writes, std::int64_t num_slots,
                                         std::span<const std::int64_t> visible) const;

 private:
  struct SlotNans {
    std::int64_t codes = 0;   // NaN codes of the slot's elements
    std::int64_t scales = 0;  // NaN group scales (grouped pools)
  };
  void count_slot(const KvPool& pool, std::int64_t slot);
  std::map<std::int64_t, SlotNans> by_slot_;
};

// PoolNanCodes of `pool` (the reference pool after the step's writes), reported at once.
std::optional<IntegrityFinding> report_nan_codes(const StepLayerWrites& writes, const KvPool& pool,
                                                 std::span<const std::int64_t> visible);

// "S001 L003" style prefix used in messages.
std::string step_layer_name(int step, int layer_id);

}  // namespace kvaudit
