// Counts of special codes in a KV pool's stored elements: NaN codes and saturated codes. `kvaudit
// info` counts a layer's whole initial pool; the replay counts the slots a step reads, so a report
// can put the saturated codes a step read beside the quantization error they cause.
//
// e4m3fn: NaN codes are 0x7F/0xFF (S.1111.111); saturated codes are 0x7E/0xFE (+-448, where the
// write rule's satfinite clamps every value past 464 * kv_scale). bf16: NaN bit patterns; a bf16
// pool has no saturation, so `saturated` is 0 and not meaningful there.
#pragma once

#include <cstdint>
#include <span>

#include "src/format/kvdump.hpp"

namespace kvaudit {

struct PoolCodeCounts {
  std::int64_t nan = 0;
  std::int64_t saturated = 0;
  // v1.1 per_token_group pools: NaN group scales (fp32 NaN, e8m0 0xFF), one per scale; a scale
  // is not an element, so its group's codes are not counted as NaN codes for it.
  std::int64_t nan_scales = 0;
};

// Over every element of the pool.
PoolCodeCounts count_pool_codes(const KvPool& pool);
// Over the elements of `slots` only (each slot a row of row_width elements; in range).
PoolCodeCounts count_pool_codes(const KvPool& pool, std::span<const std::int64_t> slots);

}  // namespace kvaudit
