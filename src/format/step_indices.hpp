// The index rules of kvdump v1 for one step (docs/kvdump-v1.md "Semantics" and "Errors"), written
// once: the validator (kvdump_validator.cpp) applies them to every step of a file the reader
// opens, the writer before it writes one, and the code that indexes a pool with a step it did not
// read itself (the reference, the cpu-fp8 model, the CUDA launcher) before it indexes, so a bad
// index is an Error value, never an out-of-bounds read or write.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "src/core/result.hpp"
#include "src/format/kvdump.hpp"

namespace kvaudit {

// indptr shapes ([B+1]), starts at 0 and monotonicity; kv_indptr ending at the size of kv_indices
// and qo_indptr at the size of new_kv_slots; page ids below num_pages; kv_last_page_len in
// 1..page_size (0 for a request without pages); no row that would see zero tokens; at most one row
// per request in a decode step; new_kv_slots equal to the slot of each row's token position, and no
// slot written by two rows of the step.
// `where` is "file:/steps/S###" (or "step S###" for a step in memory); errors name the dataset
// below it.
Status validate_step_indices(const StepMeta& step, std::int64_t num_pages, int page_size,
                             const std::string& where);

// The same rules for a step in memory over a pool of num_slots slots (where = "step <group>").
// A step with attention_only set (attention_view) skips the new_kv_slots rules.
Status check_step_indices(const StepMeta& step, int page_size, std::int64_t num_slots);

// Slots seen by at least one query row of the step (requests with no rows contribute none),
// sorted, without duplicates. The step must pass check_step_indices.
std::vector<std::int64_t> visible_slots(const StepMeta& step, int page_size);

// Slots that hold a token of some request of the step (positions 0..kv_len(b)-1 of every request,
// rows or not; the slots the step writes among them), sorted, without duplicates: the slots the
// step uses. The others hold no token at this step (kvdump-v1 "Semantics": they may hold
// anything). The step must pass check_step_indices.
std::vector<std::int64_t> held_slots(const StepMeta& step, int page_size);

// kvdump v1.1 topk_indices of one (step, layer), [Nq, k]: every entry -1 or a token position of
// the row's request in 0..pos(row) (causal), no position twice in a row, at least one per row.
// `where` names the dataset ("file:/steps/S###/L###/topk_indices").
Status check_topk_indices(const StepMeta& step, int page_size, std::span<const std::int32_t> topk,
                          int k, const std::string& where);

// What a (step, layer)'s attention runs on. Dense (no topk_indices): the step itself. Sparse: one
// request per query row, attending to the slots of its listed positions in increasing position
// order, with page_size 1 (kv_indices are slots) and attention_only set; kv_len = the number
// listed and the row sits at the last of them, so the causal rule makes it see all of them. The
// topk indices must have passed check_topk_indices.
struct AttentionView {
  DumpAttributes attrs;
  StepMeta step;
};
AttentionView attention_view(const DumpAttributes& attrs, const StepMeta& step,
                             const StepLayerTensors& tensors);

}  // namespace kvaudit
