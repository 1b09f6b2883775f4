// `kvaudit info`: a summary of a validated kvdump (root attributes, layers with the NaN and
// saturated codes of their initial pool and the NaN values of their kv_source, steps with
// request/row/token/page counts, optional captures), as JSON; the CLI prints it as text or as the
// JSON itself.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "src/core/result.hpp"
#include "src/format/kvdump.hpp"
#include "src/format/pool_codes.hpp"  // count_pool_codes, used here and by the tests

namespace kvaudit {

// Reads every layer's initial pool (one at a time) to count codes, and every v1.1 topk_indices
// dataset, whose values are checked as `check` checks them (an Error names the first bad one).
// Schema:
// { "file", "format_version", "format_minor_version" (1: v1.1, 2: v1.2), "model", "producer",
//   "shapes": { num_heads, kv_lora_rank, qk_rope_head_dim, page_size, num_pages, num_slots,
//               kv_dtype, kv_scale_kind, sm_scale },
//   "group_scales": null, or (v1.1 per_token_group) { group_size, groups, scale_format,
//               rope_dtype, layout },
//   "layers": [ { group, layer_id, kv_scale, has_kv_source, nan_codes,
//                 saturated_codes (null for a bf16 pool), nan_scales (v1.1 per_token_group
//                 only: NaN group scales, one per scale),
//                 kv_source_nan: null without kv_source, else { values: NaN values in it,
//                   slot_count: slots holding one, slots: the first 8 of them },
//                 indexer: null, or (v1.2) { n_heads, head_dim, block_size, topk, scale_format,
//                   rotation, softmax_scale } } ],
//   "steps":  [ { group, kind, topk: { layer group: K } (v1.1 sparse layers), requests, rows,
//                 tokens, page_refs, pages_used,
//                 captures: { out: [layer groups], lse: [...], kv_cache_after: [...],
//                             indexer_cache_after: [...] (v1.2) } } ] }
// tokens = sum of kv_len over requests; page_refs = entries of kv_indices; pages_used = distinct.
Result<nlohmann::json> dump_info(const DumpReader& reader);

// The same, for people: one line per layer and per step.
std::string format_dump_info(const nlohmann::json& info);

}  // namespace kvaudit
