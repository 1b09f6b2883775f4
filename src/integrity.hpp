// Integrity of the KV cache across steps (DESIGN.md "Integrity of the cache").
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
// Captured pool (kv_cache_after in the dump), against the expected pool: differing slots are
// listed and classified per slot as
//   wrong_slot      its row equals the expected row of another written slot or of a neighbour
//   bf16_high_byte  every differing byte is the high byte of the bf16 bits of the value (BF16
//                   written back into FP8 slots)
//   nan_code        it holds a NaN code (0x7F / 0xFF) where a finite code was expected
//   off_by_one_code every differing code is one step from the expected code (wrong rounding)
//   other           anything else
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "src/check_result.hpp"
#include "src/kvdump.hpp"

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
};

// The checks on the pool a backend left after run_step. `before` is the backend's pool before the
// step, `expected` the reference pool after the step's writes, `expected_dtype` / `expected_bytes`
// what the storage was before the step. Returns one finding per check (pass or fail).
std::vector<IntegrityFinding> check_backend_pool(const StepLayerWrites& writes,
                                                 const KvPool& before, const KvPool& after,
                                                 const KvPool& expected);

// The captured pool after the step (kv_cache_after) against the expected pool. Returns one passing
// finding when they are equal, else one failing finding per classification present.
std::vector<IntegrityFinding> check_captured_pool(const StepLayerWrites& writes,
                                                  const KvPool& captured, const KvPool& expected);

// Classification of one slot of a captured pool that differs from the expected pool.
std::string classify_captured_slot(const StepLayerWrites& writes, const KvPool& captured,
                                   const KvPool& expected, std::int64_t slot);

// "S001 L003" style prefix used in messages.
std::string step_layer_name(int step, int layer_id);

}  // namespace kvaudit
