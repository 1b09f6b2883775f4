// count_pool_codes (src/format/pool_codes.hpp): NaN and saturated e4m3 codes, over a whole pool
// and over chosen slots. The codes are written here by hand.
#include <catch2/catch.hpp>
#include <limits>
#include <vector>

#include "src/format/pool_codes.hpp"

using kvaudit::count_pool_codes;
using kvaudit::KvDtype;
using kvaudit::KvPool;

namespace {

// 3 slots of 4 elements: slot 0 plain codes, slot 1 two saturated (+448, -448) and a NaN, slot 2
// one NaN (-NaN) and one saturated code.
KvPool hand_pool() {
  KvPool pool = KvPool::zeros(KvDtype::kFloat8E4m3fn, 3, 4);
  pool.bytes = {0x38, 0x40, 0x7D, 0xFD,   // 1.0, 2.0, 416, -416: large but not saturated
                0x7E, 0xFE, 0x7F, 0x00,   // +448, -448, NaN, 0
                0xFF, 0x01, 0x7E, 0x80};  // -NaN, a subnormal, +448, -0
  return pool;
}

}  // namespace

TEST_CASE("count_pool_codes counts e4m3 NaN and saturated codes over the whole pool",
          "[pool_codes]") {
  const auto counts = count_pool_codes(hand_pool());
  CHECK(counts.nan == 2);
  CHECK(counts.saturated == 3);
}

TEST_CASE("count_pool_codes over slots counts only those slots' elements", "[pool_codes]") {
  const KvPool pool = hand_pool();
  const std::vector<std::int64_t> first{0};
  CHECK(count_pool_codes(pool, first).saturated == 0);
  CHECK(count_pool_codes(pool, first).nan == 0);
  const std::vector<std::int64_t> last_two{1, 2};
  CHECK(count_pool_codes(pool, last_two).saturated == 3);
  CHECK(count_pool_codes(pool, last_two).nan == 2);
  const std::vector<std::int64_t> only_two{2};
  CHECK(count_pool_codes(pool, only_two).saturated == 1);
  CHECK(count_pool_codes(pool, only_two).nan == 1);
}

TEST_CASE("count_pool_codes counts a NaN group scale once, apart from the NaN codes",
          "[pool_codes][v1.1]") {
  kvaudit::DumpAttributes attrs;  // Dc = 8 in 2 groups of 4, float32 scales, bf16 RoPE of 2
  attrs.kv_lora_rank = 8;
  attrs.qk_rope_head_dim = 2;
  attrs.kv_scale_kind = "per_token_group";
  attrs.kv_scale_group_size = 4;
  attrs.kv_scale_format = kvaudit::GroupScaleFormat::kFloat32;
  attrs.kv_rope_dtype = KvDtype::kBfloat16;
  KvPool pool = KvPool::zeros_for(attrs, 2);
  pool.set_group_scale(0, 0, 1.0f);
  pool.set_group_scale(0, 1, std::numeric_limits<float>::quiet_NaN());
  pool.row(1)[2] = 0x7F;  // one NaN code in slot 1
  const auto counts = count_pool_codes(pool);
  CHECK(counts.nan_scales == 1);
  CHECK(counts.nan == 1);
}
