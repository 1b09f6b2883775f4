// Counting NaN and saturated codes in a KV pool (see pool_codes.hpp).
#include "src/format/pool_codes.hpp"

#include <cmath>

namespace kvaudit {
namespace {

// Adds the counts of `count` stored elements starting at `bytes`. (Counted in locals: a store to
// `counts` inside the loop could alias the bytes, as any store may alias a byte array, which kept
// the loops from vectorising.)
void add_codes(KvDtype dtype, const std::uint8_t* bytes, std::size_t count,
               PoolCodeCounts& counts) {
  std::int64_t nan = 0;
  std::int64_t saturated = 0;
  if (dtype == KvDtype::kFloat8E4m3fn) {
    for (std::size_t i = 0; i < count; ++i) {
      const std::uint8_t magnitude = bytes[i] & 0x7F;
      nan += magnitude == kE4m3NanCode;
      saturated += magnitude == kE4m3MaxFiniteCode;
    }
  } else {
    for (std::size_t i = 0; i < count; ++i) {
      const auto bits = static_cast<std::uint16_t>(bytes[2 * i] | (bytes[2 * i + 1] << 8));
      nan += (bits & 0x7FFF) > 0x7F80;  // exponent all ones, mantissa non-zero
    }
  }
  counts.nan += nan;
  counts.saturated += saturated;
}

// One slot: the whole row of a v1 pool; a per_token_group slot's latent codes and its RoPE part
// (its scale bytes are not elements), and its NaN scales apart.
void add_slot(const KvPool& pool, std::int64_t slot, PoolCodeCounts& counts) {
  const std::uint8_t* row = pool.row(slot);
  if (!pool.grouped()) {
    add_codes(pool.dtype, row, static_cast<std::size_t>(pool.row_width), counts);
    return;
  }
  add_codes(KvDtype::kFloat8E4m3fn, row, static_cast<std::size_t>(pool.latent_width), counts);
  for (int g = 0; g < pool.num_groups(); ++g)
    counts.nan_scales += std::isnan(pool.group_scale(slot, g));
  add_codes(pool.rope_dtype, row + pool.rope_offset(), static_cast<std::size_t>(pool.rope_width()),
            counts);
}

}  // namespace

PoolCodeCounts count_pool_codes(const KvPool& pool) {
  PoolCodeCounts counts;
  for (std::int64_t slot = 0; slot < pool.num_slots; ++slot) add_slot(pool, slot, counts);
  return counts;
}

PoolCodeCounts count_pool_codes(const KvPool& pool, std::span<const std::int64_t> slots) {
  PoolCodeCounts counts;
  for (const std::int64_t slot : slots) add_slot(pool, slot, counts);
  return counts;
}

}  // namespace kvaudit
