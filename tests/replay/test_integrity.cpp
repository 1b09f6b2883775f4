// Integrity checks on hand-made pools: every expected pool here is built with the kvdump write
// rule from fp8_e4m3.hpp (kvdump_quantize), never by the code under test.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "src/core/fp8_e4m3.hpp"
#include "src/replay/integrity.hpp"

namespace kvaudit {
namespace {

constexpr int kWidth = 6;
constexpr std::int64_t kSlots = 8;
constexpr float kScale = 0.125f;

struct Scenario {
  std::vector<std::int32_t> slots = {2, 5};
  std::vector<float> new_kv;  // [2, kWidth]
  KvPool before;
  KvPool expected;
  StepLayerWrites writes() const { return {3, 7, slots, new_kv, kScale}; }
};

Scenario make_scenario() {
  Scenario s;
  s.new_kv = {0.5f, -1.25f, 3.0f,  70.0f, -0.0625f, 1.0f,  // row 0: 70 / 0.125 = 560 > 464: 448
              2.0f, 0.75f,  -3.5f, 0.25f, 1.5f,     -0.5f};
  s.before = KvPool::zeros(KvDtype::kFloat8E4m3fn, kSlots, kWidth);
  for (std::int64_t slot = 0; slot < kSlots; ++slot) {
    for (int c = 0; c < kWidth; ++c)
      s.before.row(slot)[c] = static_cast<std::uint8_t>(slot * 8 + c);
  }
  s.expected = s.before;
  for (std::size_t i = 0; i < s.slots.size(); ++i) {
    for (int c = 0; c < kWidth; ++c) {
      s.expected.row(s.slots[i])[c] = kvdump_quantize(s.new_kv[i * kWidth + c], kScale);
    }
  }
  return s;
}

const IntegrityFinding& finding(const std::vector<IntegrityFinding>& findings,
                                IntegrityCheck check) {
  const auto it = std::find_if(findings.begin(), findings.end(),
                               [&](const IntegrityFinding& f) { return f.check == check; });
  REQUIRE(it != findings.end());
  return *it;
}

}  // namespace

TEST_CASE("backend pool that wrote exactly the step's slots passes every check", "[integrity]") {
  const Scenario s = make_scenario();
  REQUIRE(s.expected.row(2)[3] == 0x7E);  // saturated, not NaN
  const auto findings = check_backend_pool(s.writes(), s.before, s.expected, s.expected);
  REQUIRE(findings.size() == 5);
  for (const IntegrityFinding& f : findings) {
    INFO(integrity_check_name(f.check) << ": " << f.detail);
    CHECK(f.pass);
    CHECK(f.step == 3);
    CHECK(f.layer_id == 7);
  }
}

TEST_CASE("write to the neighbouring slot fails written and unwritten checks naming slots",
          "[integrity]") {
  const Scenario s = make_scenario();
  KvPool after = s.before;
  // Slot 5's row lands in slot 6; slot 2 is written correctly.
  std::copy_n(s.expected.row(2), kWidth, after.row(2));
  std::copy_n(s.expected.row(5), kWidth, after.row(6));
  const auto findings = check_backend_pool(s.writes(), s.before, after, s.expected);
  const IntegrityFinding& written = finding(findings, IntegrityCheck::kWrittenSlots);
  CHECK_FALSE(written.pass);
  CHECK(written.slots == std::vector<std::int64_t>{5});
  CHECK_THAT(written.detail, Catch::Contains("S003 L007") && Catch::Contains("slot 5"));
  const IntegrityFinding& unwritten = finding(findings, IntegrityCheck::kUnwrittenSlots);
  CHECK_FALSE(unwritten.pass);
  CHECK(unwritten.slots == std::vector<std::int64_t>{6});
  CHECK(unwritten.classification == SlotClass::kWrongSlot);
  const IntegrityFinding& consistency = finding(findings, IntegrityCheck::kReadConsistency);
  CHECK_FALSE(consistency.pass);
  CHECK(consistency.slots == std::vector<std::int64_t>{5, 6});
  CHECK(finding(findings, IntegrityCheck::kStorage).pass);
  CHECK(finding(findings, IntegrityCheck::kNanWritten).pass);
}

TEST_CASE("NaN code written for a finite value is named", "[integrity]") {
  const Scenario s = make_scenario();
  KvPool after = s.expected;
  after.row(2)[3] = 0x7F;  // a no-saturation encoder: 560 -> NaN
  const auto findings = check_backend_pool(s.writes(), s.before, after, s.expected);
  CHECK(finding(findings, IntegrityCheck::kNanWritten).slots == std::vector<std::int64_t>{2});
  CHECK_FALSE(finding(findings, IntegrityCheck::kNanWritten).pass);
  CHECK_FALSE(finding(findings, IntegrityCheck::kWrittenSlots).pass);
  CHECK(finding(findings, IntegrityCheck::kUnwrittenSlots).pass);
}

TEST_CASE("a pool whose storage became bf16 fails storage", "[integrity]") {
  const Scenario s = make_scenario();
  const KvPool after = KvPool::zeros(KvDtype::kBfloat16, kSlots, kWidth);
  const auto findings = check_backend_pool(s.writes(), s.before, after, s.expected);
  const IntegrityFinding& storage = finding(findings, IntegrityCheck::kStorage);
  CHECK_FALSE(storage.pass);
  CHECK_THAT(storage.detail, Catch::Contains("bfloat16"));
  CHECK(std::none_of(findings.begin(), findings.end(), [](const auto& f) { return f.pass; }));
}

TEST_CASE("captured pool: equal passes, corruptions are classified per slot", "[integrity]") {
  const Scenario s = make_scenario();
  SECTION("equal") {
    const auto findings = check_captured_pool(s.writes(), s.expected, s.expected);
    REQUIRE(findings.size() == 1);
    CHECK(findings[0].pass);
  }
  SECTION("bf16 high bytes in a written slot (the bytes a bf16 -> u8 truncation leaves)") {
    KvPool captured = s.expected;
    for (int c = 0; c < kWidth; ++c) {
      captured.row(5)[c] = static_cast<std::uint8_t>(bf16_from_float(s.new_kv[kWidth + c]) >> 8);
    }
    const auto findings = check_captured_pool(s.writes(), captured, s.expected);
    REQUIRE(findings.size() == 1);
    CHECK_FALSE(findings[0].pass);
    CHECK(findings[0].classification == SlotClass::kBf16Bytes);
    CHECK(findings[0].slots == std::vector<std::int64_t>{5});
  }
  SECTION("NaN where satfinite stores 448") {
    KvPool captured = s.expected;
    captured.row(2)[3] = 0x7F;
    const auto findings = check_captured_pool(s.writes(), captured, s.expected);
    REQUIRE(findings.size() == 1);
    CHECK(findings[0].classification == SlotClass::kNanCode);
    CHECK(findings[0].slots == std::vector<std::int64_t>{2});
  }
  SECTION("rounded toward zero") {
    KvPool captured = s.expected;
    // 1.5 / 0.125 = 12 is exact; make one element one code smaller in magnitude.
    captured.row(5)[4] = static_cast<std::uint8_t>(captured.row(5)[4] - 1);
    const auto findings = check_captured_pool(s.writes(), captured, s.expected);
    REQUIRE(findings.size() == 1);
    CHECK(findings[0].classification == SlotClass::kOffByOneCode);
  }
  SECTION("row written to the neighbouring slot") {
    KvPool captured = s.expected;
    std::copy_n(s.before.row(5), kWidth, captured.row(5));
    std::copy_n(s.expected.row(5), kWidth, captured.row(6));
    const auto findings = check_captured_pool(s.writes(), captured, s.expected);
    REQUIRE(findings.size() == 1);
    CHECK(findings[0].classification == SlotClass::kWrongSlot);
    CHECK(findings[0].slots == std::vector<std::int64_t>{5, 6});
    CHECK_THAT(findings[0].detail, Catch::Contains("S003 L007"));
  }
  SECTION("an unwritten slot that changed") {
    KvPool captured = s.expected;
    captured.row(0)[0] = 0x55;
    const auto findings = check_captured_pool(s.writes(), captured, s.expected);
    REQUIRE(findings.size() == 1);
    CHECK(findings[0].classification == SlotClass::kOther);
    CHECK(findings[0].slots == std::vector<std::int64_t>{0});
  }
  SECTION("a real bf16 store: 2 bytes per element over the slot, spilling into the next") {
    // The little-endian bf16 row of slot 5's values is 2 * kWidth bytes: the first kWidth land
    // in slot 5, the rest in slot 6. Built here byte by byte from bf16_from_float.
    KvPool captured = s.expected;
    std::vector<std::uint8_t> row_bytes;
    for (int c = 0; c < kWidth; ++c) {
      const std::uint16_t bits = bf16_from_float(s.new_kv[kWidth + c]);
      row_bytes.push_back(static_cast<std::uint8_t>(bits & 0xFF));
      row_bytes.push_back(static_cast<std::uint8_t>(bits >> 8));
    }
    std::copy_n(row_bytes.begin(), kWidth, captured.row(5));
    std::copy_n(row_bytes.begin() + kWidth, kWidth, captured.row(6));
    const auto findings = check_captured_pool(s.writes(), captured, s.expected);
    REQUIRE(findings.size() == 1);
    CHECK_FALSE(findings[0].pass);
    CHECK(findings[0].classification == SlotClass::kBf16Bytes);
    CHECK(findings[0].slots == std::vector<std::int64_t>{5, 6});
    CHECK(findings[0].slot_count == 2);
  }
}

TEST_CASE("one code off by one is a rounding difference even where it looks like a bf16 byte",
          "[integrity]") {
  // 0.24375 / 0.125 = 1.95: RNE stores 2.0 (0x40); the code below it, 1.875, is 0x3F, which is
  // also the high byte of bf16(1.95). One such byte is a rounding difference, not a bf16 store.
  const std::vector<std::int32_t> slots = {0};
  const std::vector<float> row = {0.24375f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f};
  const StepLayerWrites writes{0, 0, slots, row, kScale};
  KvPool expected = KvPool::zeros(KvDtype::kFloat8E4m3fn, 2, kWidth);
  for (int c = 0; c < kWidth; ++c) expected.row(0)[c] = kvdump_quantize(row[c], kScale);
  REQUIRE(expected.row(0)[0] == 0x40);
  REQUIRE(static_cast<std::uint8_t>(bf16_from_float(row[0] / kScale) >> 8) == 0x3F);
  KvPool captured = expected;
  captured.row(0)[0] = 0x3F;
  CHECK(classify_slot(writes, captured, expected, 0) == SlotClass::kOffByOneCode);
}

TEST_CASE("backend pool: failing written slots carry the class of what is in them", "[integrity]") {
  const Scenario s = make_scenario();
  KvPool after = s.expected;
  for (int c = 0; c < kWidth; ++c) {
    after.row(2)[c] = static_cast<std::uint8_t>(bf16_from_float(s.new_kv[c]) >> 8);
  }
  after.row(5)[0] = static_cast<std::uint8_t>(after.row(5)[0] + 1);  // 2.0 / 0.125 = 16, one up
  const auto findings = check_backend_pool(s.writes(), s.before, after, s.expected);
  std::vector<SlotClass> classes;
  for (const IntegrityFinding& f : findings) {
    if (f.check == IntegrityCheck::kWrittenSlots) {
      CHECK_FALSE(f.pass);
      classes.push_back(f.classification);
      CHECK(f.slots ==
            std::vector<std::int64_t>{f.classification == SlotClass::kBf16Bytes ? 2 : 5});
    }
  }
  CHECK(classes == std::vector<SlotClass>{SlotClass::kBf16Bytes, SlotClass::kOffByOneCode});
}

TEST_CASE("captured pool: damage that persists is reported as carried from its first step",
          "[integrity]") {
  const Scenario s = make_scenario();
  PoolDamageHistory history;
  KvPool captured = s.expected;
  captured.row(2)[3] = 0x7F;  // NaN where satfinite stores 448
  const auto first = check_captured_pool(s.writes(), captured, s.expected, &history);
  REQUIRE(first.size() == 1);
  CHECK(first[0].classification == SlotClass::kNanCode);
  CHECK(first[0].carried_from_step == -1);

  // The next step writes slot 4 only; the captured pool still holds the NaN in slot 2.
  const std::vector<std::int32_t> next_slots = {4};
  const std::vector<float> next_kv = {1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f};
  const StepLayerWrites next{4, 7, next_slots, next_kv, kScale};
  KvPool next_expected = s.expected;
  for (int c = 0; c < kWidth; ++c) next_expected.row(4)[c] = kvdump_quantize(1.0f, kScale);
  KvPool next_captured = next_expected;
  next_captured.row(2)[3] = 0x7F;
  const auto second = check_captured_pool(next, next_captured, next_expected, &history);
  REQUIRE(second.size() == 1);
  CHECK_FALSE(second[0].pass);
  CHECK(second[0].classification == SlotClass::kNanCode);
  CHECK(second[0].carried_from_step == 3);
  CHECK(second[0].slots == std::vector<std::int64_t>{2});
  CHECK_THAT(second[0].detail, Catch::Contains("unchanged since step 3"));

  // The same slot damaged differently at the next step (not written there): new damage, with its
  // own class, not hidden behind the old one.
  {
    PoolDamageHistory changed = history;
    KvPool other_damage = next_expected;
    other_damage.row(2)[0] = 0x7F;  // NaN codes now, in place of 0.5's code
    other_damage.row(2)[3] = 0x7F;
    const auto again = check_captured_pool(next, other_damage, next_expected, &changed);
    REQUIRE(again.size() == 1);
    CHECK(again[0].carried_from_step == -1);
    CHECK(again[0].classification == SlotClass::kNanCode);
  }

  // Repaired at the step after: passes, and the history forgets the slot.
  const auto third = check_captured_pool(next, next_expected, next_expected, &history);
  REQUIRE(third.size() == 1);
  CHECK(third[0].pass);
  CHECK(history.size() == 0);
}

TEST_CASE("NaN codes already in the pool are reported as data, split by whether they are read",
          "[integrity]") {
  const Scenario s = make_scenario();
  CHECK_FALSE(report_nan_codes(s.writes(), s.expected, std::vector<std::int64_t>{2, 5}));
  KvPool pool = s.expected;
  pool.row(7)[1] = 0xFF;  // an unused slot
  pool.row(6)[0] = 0x7F;  // and one a request reads
  pool.row(6)[4] = 0x7F;
  const auto finding = report_nan_codes(s.writes(), pool, std::vector<std::int64_t>{2, 5, 6});
  REQUIRE(finding);
  CHECK(finding->pass);
  CHECK(finding->check == IntegrityCheck::kNanCodesInPool);
  CHECK(finding->slots == std::vector<std::int64_t>{6, 7});
  CHECK(finding->slot_count == 2);
  CHECK_THAT(finding->detail,
             Catch::Contains("3 NaN code(s)") &&
                 Catch::Contains("1 slot(s) no request of this step reads, 1 read"));
}

}  // namespace kvaudit

namespace kvaudit {

TEST_CASE("PoolNanCodes follows the writes: a NaN overwritten goes, a NaN written comes",
          "[integrity]") {
  KvPool pool = KvPool::zeros(KvDtype::kFloat8E4m3fn, 4, 3);
  pool.row(1)[0] = 0x7F;
  pool.row(3)[2] = 0xFF;
  PoolNanCodes nan_codes;
  nan_codes.scan(pool);
  const std::vector<std::int32_t> written = {1, 2};
  const std::vector<float> rows = {1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f};
  const StepLayerWrites writes{0, 0, written, rows, 1.0f};
  auto before = nan_codes.report(writes, pool.num_slots, std::vector<std::int64_t>{});
  REQUIRE(before);
  CHECK(before->slots == std::vector<std::int64_t>{1, 3});

  pool.row(1)[0] = 0x38;  // slot 1 rewritten finite
  pool.row(2)[1] = 0x7F;  // slot 2 written with a NaN
  nan_codes.update(pool, written);
  const auto after = nan_codes.report(writes, pool.num_slots, std::vector<std::int64_t>{2});
  REQUIRE(after);
  CHECK(after->slots == std::vector<std::int64_t>{2, 3});
  CHECK_THAT(after->detail, Catch::Contains("2 NaN code(s)") &&
                                Catch::Contains("1 slot(s) no request of this step reads, 1 read"));
  // The same as a full scan of the pool.
  const auto full = report_nan_codes(writes, pool, std::vector<std::int64_t>{2});
  REQUIRE(full);
  CHECK(full->detail == after->detail);
}

}  // namespace kvaudit

namespace kvaudit {
namespace {

// The attributes of the pool below, as a split-layout dump with 2 slots per page would say them.
DumpAttributes grouped_attrs() {
  DumpAttributes attrs;
  attrs.page_size = 2;
  attrs.kv_lora_rank = 8;
  attrs.qk_rope_head_dim = 2;
  attrs.kv_scale_kind = "per_token_group";
  attrs.kv_scale_group_size = 4;
  attrs.kv_scale_format = GroupScaleFormat::kFloat32;
  attrs.kv_rope_dtype = KvDtype::kFloat8E4m3fn;
  return attrs;
}

// A per_token_group pool (kvdump v1.1) of 2 slots: Dc = 8 in 2 groups of 4 with float32 scales,
// an e4m3 RoPE part of Dr = 2. Slot 0 holds hand-written codes and scales 0.5 and 2.
KvPool grouped_expected() {
  DumpAttributes attrs;
  attrs.kv_lora_rank = 8;
  attrs.qk_rope_head_dim = 2;
  attrs.kv_scale_kind = "per_token_group";
  attrs.kv_scale_group_size = 4;
  attrs.kv_scale_format = GroupScaleFormat::kFloat32;
  attrs.kv_rope_dtype = KvDtype::kFloat8E4m3fn;
  KvPool pool = KvPool::zeros_for(attrs, 2);
  for (int c = 0; c < 8; ++c) pool.row(0)[c] = static_cast<std::uint8_t>(0x30 + c);
  pool.set_group_scale(0, 0, 0.5f);
  pool.set_group_scale(0, 1, 2.0f);
  pool.row(0)[pool.rope_offset()] = 0x40;      // 2.0
  pool.row(0)[pool.rope_offset() + 1] = 0xC8;  // -4.0
  return pool;
}

}  // namespace

TEST_CASE("per_token_group slots are classified by the part of the slot that differs",
          "[integrity][v1.1]") {
  const std::vector<std::int32_t> slots = {0};
  const std::vector<float> row(10, 0.0f);
  const StepLayerWrites writes{0, 0, slots, row, 1.0f};
  const KvPool expected = grouped_expected();
  REQUIRE(expected.row_bytes() == 8 + 2 * 4 + 2);

  KvPool scale_byte = expected;  // one byte of group 1's fp32 scale
  scale_byte.row(0)[expected.scales_offset() + 4] ^= 0x01;
  CHECK(classify_slot(writes, scale_byte, expected, 0) == SlotClass::kScaleBytes);

  KvPool swapped = expected;  // group 0 written with group 1's scale
  swapped.set_group_scale(0, 0, 2.0f);
  CHECK(classify_slot(writes, swapped, expected, 0) == SlotClass::kSwappedGroupScale);

  KvPool rescaled = expected;  // latent codes 4 steps off, scales as stored
  rescaled.row(0)[1] = 0x35;
  rescaled.row(0)[6] = 0x3A;
  CHECK(classify_slot(writes, rescaled, expected, 0) == SlotClass::kCodesOtherScale);

  KvPool rounded = expected;  // one code one step off: a rounding difference
  rounded.row(0)[2] = 0x33;
  CHECK(classify_slot(writes, rounded, expected, 0) == SlotClass::kOffByOneCode);

  KvPool saturated = expected;  // the RoPE part at +448 where 2.0 was due
  saturated.row(0)[expected.rope_offset()] = 0x7E;
  CHECK(classify_slot(writes, saturated, expected, 0) == SlotClass::kRopeSaturated);

  KvPool nan_scale = expected;  // a NaN scale makes its group's values NaN
  nan_scale.set_group_scale(0, 1, std::numeric_limits<float>::quiet_NaN());
  CHECK(classify_slot(writes, nan_scale, expected, 0) == SlotClass::kNanCode);
}

TEST_CASE("a NaN group scale is one NaN scale in nan_codes_in_pool, not a NaN code per element",
          "[integrity][v1.1]") {
  const std::vector<std::int32_t> slots = {};
  const std::vector<float> row;
  const StepLayerWrites writes{0, 0, slots, row, 1.0f};
  KvPool pool = grouped_expected();  // slot 0: finite codes, scales 0.5 and 2
  pool.set_group_scale(0, 1, std::numeric_limits<float>::quiet_NaN());
  const std::vector<std::int64_t> visible = {0};
  const auto finding = report_nan_codes(writes, pool, visible);
  REQUIRE(finding.has_value());
  INFO(finding->detail);
  CHECK_THAT(finding->detail,
             Catch::Matchers::Contains("holds 0 NaN code(s) and 1 NaN group scale(s) in slot 0"));
  pool.row(1)[3] = 0x7F;  // and one NaN code in slot 1
  const auto both = report_nan_codes(writes, pool, visible);
  REQUIRE(both.has_value());
  CHECK_THAT(both->detail, Catch::Matchers::Contains(
                               "holds 1 NaN code(s) and 1 NaN group scale(s) in slots 0, 1"));
}

TEST_CASE("integrity messages locate a differing byte in the split layout's own datasets",
          "[integrity][v1.1]") {
  const std::vector<std::int32_t> slots = {};
  const std::vector<float> row;
  const DumpAttributes attrs = grouped_attrs();
  StepLayerWrites writes{5, 0, slots, row, 1.0f};
  writes.attrs = &attrs;
  const KvPool expected = grouped_expected();
  // Byte 2 of group 1's float32 scale of slot 0: in the file, kv_scales_after[0, 0, 1] (page 0,
  // offset 0, group 1), byte 2; in the slot form it is byte 8 + 4 + 2 = 14.
  KvPool captured = expected;
  captured.row(0)[expected.scales_offset() + 6] ^= 0x01;
  const auto scale = check_captured_pool(writes, captured, expected);
  REQUIRE(scale.size() == 1);
  INFO(scale[0].detail);
  CHECK_THAT(scale[0].detail,
             Catch::Matchers::Contains("first at kv_scales_after[0, 0, 1], byte 2 of its float32"));
  CHECK_THAT(scale[0].detail, !Catch::Matchers::Contains("byte 14"));
  // The RoPE part's element 1 of slot 1: kv_rope_after[0, 1, 1].
  KvPool rope = expected;
  rope.row(1)[expected.rope_offset() + 1] = 0x38;
  const auto rope_findings = check_captured_pool(writes, rope, expected);
  REQUIRE(rope_findings.size() == 1);
  CHECK_THAT(rope_findings[0].detail,
             Catch::Matchers::Contains("first at kv_rope_after[0, 1, 1]: 0x38, expected 0x00"));
  // A latent code: kv_cache_after[0, 0, 3].
  KvPool code = expected;
  code.row(0)[3] = 0x20;
  CHECK_THAT(check_captured_pool(writes, code, expected)[0].detail,
             Catch::Matchers::Contains("first at kv_cache_after[0, 0, 3]: 0x20, expected 0x33"));
}

TEST_CASE("a changed slot no request holds is classed unused_slot, not by rounding or scale",
          "[integrity][v1.1]") {
  const std::vector<std::int32_t> slots = {0};
  const std::vector<float> row(10, 0.0f);
  StepLayerWrites writes{0, 0, slots, row, 1.0f};
  const KvPool expected = grouped_expected();
  KvPool garbage = expected;  // latent codes of slot 1 (no token) changed, scales untouched
  garbage.row(1)[0] = 0x55;
  garbage.row(1)[5] = 0x66;
  // Without knowing which slots hold tokens, the bytes look like another scale's codes.
  CHECK(classify_slot(writes, garbage, expected, 1) == SlotClass::kCodesOtherScale);
  writes.held_slots = std::vector<std::int64_t>{0};
  CHECK(classify_slot(writes, garbage, expected, 1) == SlotClass::kUnusedSlot);
  CHECK(std::string(slot_class_name(SlotClass::kUnusedSlot)) == "unused_slot");
  // A slot that holds a token keeps its class.
  KvPool rescaled = expected;
  rescaled.row(0)[1] = 0x35;
  rescaled.row(0)[6] = 0x3A;
  CHECK(classify_slot(writes, rescaled, expected, 0) == SlotClass::kCodesOtherScale);
}

}  // namespace kvaudit
