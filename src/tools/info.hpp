// `kvaudit info`: a summary of a validated kvdump (root attributes, layers with the NaN and
// saturated codes of their initial pool, steps with request/row/token/page counts, optional
// captures), as JSON; the CLI prints it as text or as the JSON itself.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "src/core/result.hpp"
#include "src/format/kvdump.hpp"

namespace kvaudit {

// Counts over a pool's stored elements. e4m3fn: NaN codes are 0x7F/0xFF (S.1111.111), saturated
// codes are 0x7E/0xFE (+-448, where satfinite clamps overflow). bf16: NaN bit patterns; there is
// no saturation in a bf16 pool, so `saturated` is 0 and not meaningful.
struct PoolCodeCounts {
  std::int64_t nan = 0;
  std::int64_t saturated = 0;
};
PoolCodeCounts count_pool_codes(const KvPool& pool);

// Reads every layer's initial pool (one at a time) to count codes. Schema:
// { "file", "format_version", "model", "producer",
//   "shapes": { num_heads, kv_lora_rank, qk_rope_head_dim, page_size, num_pages, num_slots,
//               kv_dtype, kv_scale_kind, sm_scale },
//   "layers": [ { group, layer_id, kv_scale, has_kv_source, nan_codes,
//                 saturated_codes (null for a bf16 pool) } ],
//   "steps":  [ { group, kind, requests, rows, tokens, page_refs, pages_used,
//                 captures: { out: [layer groups], lse: [...], kv_cache_after: [...] } } ] }
// tokens = sum of kv_len over requests; page_refs = entries of kv_indices; pages_used = distinct.
Result<nlohmann::json> dump_info(const DumpReader& reader);

// The same, for people: one line per layer and per step.
std::string format_dump_info(const nlohmann::json& info);

}  // namespace kvaudit
