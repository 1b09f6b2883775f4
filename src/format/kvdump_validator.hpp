// The rules of docs/kvdump-v1.md "Errors" for a whole file, applied by DumpReader::open before any
// bulk tensor is read:
//   root       the attributes format, format_version, model, producer, num_heads, kv_lora_rank,
//              qk_rope_head_dim, sm_scale, page_size, kv_dtype, kv_scale_kind (type and range);
//   /layers    at least one L### group; per layer layer_id (unique) and kv_scale, kv_cache
//              [num_pages, page_size, D] in the pool type (num_pages equal in every layer),
//              kv_source (optional) bfloat16 of the same shape;
//   /steps     S### groups with distinct numbers; per step its kind, the index datasets (read
//              whole; their rules are src/format/step_indices.hpp) and one group per layer and no
//              other; per (step, layer) q_nope [Nq, H, Dc], q_pe [Nq, H, Dr], new_kv [Nq, D]
//              bfloat16, and the optional captures out [Nq, H, Dc] bfloat16, lse [Nq, H] float32,
//              kv_cache_after in the pool type and shape.
// v1.1 adds format_minor_version, the per_token_group attributes and pool datasets (split or
// packed), and topk_indices [Nq, K] (shape here; values when read, check_topk_indices).
// v1.2 adds the DSA indexer's FP8 key cache: /layers/L###/indexer (attributes, k_cache
// [num_pages, page_size, Di] u8 e4m3, k_scales [.., Di / block] float32, k_source [.., Di]
// float32) and, in every step of such a layer, /steps/S###/L###/indexer (q [Nq, Hi, Di],
// weights [Nq, Hi], new_k [Nq, Di] float32, topk_indices [Nq, index_topk] integer, and
// k_cache_after with k_scales_after, both or neither). Hi = index_n_heads, Di = index_head_dim.
// (H = num_heads, Dc = kv_lora_rank, Dr = qk_rope_head_dim, D = Dc + Dr, Nq = rows of the step.)
// Only attributes, dataspaces and the small index datasets are read. Every error is one Error
// naming "file:/hdf5/path" and what is wrong there.
#pragma once

#include <hdf5.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "src/core/result.hpp"
#include "src/format/kvdump.hpp"

namespace kvaudit {

// One dataset of a stored pool: its name, what its elements are and its last dimension.
enum class PoolPartType { kE4m3, kBf16, kScalesF32, kScalesE8m0, kFlashMlaPacked };
struct PoolPart {
  std::string name;
  PoolPartType type;
  int width;
  const char* meaning;  // of the last dimension, for messages
  // Where the part's bytes of a slot sit in the in-memory slot (KvPool::row), and how many.
  std::size_t slot_offset = 0;
  std::size_t slot_bytes = 0;
};

// The datasets a pool is stored in. v1: kv_cache [.., D] of kv_dtype. v1.1 split: kv_cache
// [.., Dc] e4m3, kv_rope [.., Dr] of kv_rope_dtype, kv_scales [.., G]. flashmla_fp8: kv_cache
// [.., Dc + 4 G + 2 Dr] bytes. `pool_name` is "kv_cache" or "kv_cache_after"; the companions of
// kv_cache_after are kv_rope_after and kv_scales_after.
std::vector<PoolPart> pool_parts(const DumpAttributes& attrs, const std::string& pool_name);

// Where byte `byte` of `slot` of the in-memory pool (KvPool::row, the slot form of kvdump.hpp)
// is stored in the file's datasets of `pool_name`, as the file indexes them:
// "kv_scales_after[2, 1, 1], byte 2 of its float32" (split layout),
// "kv_cache[2, 1, 17] (the float32 scale of group 0, byte 1)" (flashmla_fp8), "kv_cache[2, 1, 5]"
// (v1 e4m3), "kv_cache[2, 1, 5], byte 1 of its bf16" (v1 bfloat16). Index [page, offset, j].
std::string locate_pool_byte(const DumpAttributes& attrs, const std::string& pool_name,
                             std::int64_t slot, std::size_t byte);

// Validates the open HDF5 file `file`, named `file_text` in errors, and returns its layout.
Result<DumpLayout> validate_dump_layout(hid_t file, const std::string& file_text);

}  // namespace kvaudit
