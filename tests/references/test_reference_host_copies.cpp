// The host side of the GPU reference that runs without a GPU: the threaded copies
// (parallel_copy, gather_token_rows), the threaded decode of a pool's visible slots and the value
// grid found over chunks (KvRows). Pure data movement or exact reductions: each expected value
// below is written from the test's own input pattern, never from the code under test.
#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <iostream>
#include <limits>
#include <vector>

#include "references/mla_reference.hpp"
#include "references/reference_problem.hpp"
#include "src/core/fp8_e4m3.hpp"
#include "src/core/parallel_for.hpp"

using kvaudit::KvRows;
using kvaudit::ReferenceProblem;

TEST_CASE("parallel_copy: every element lands in its own place whatever the thread count",
          "[reference][host-copies]") {
  constexpr std::size_t kChunk = std::size_t{1} << 16;  // parallel_copy's unit
  for (const std::size_t count :
       {std::size_t{0}, std::size_t{1}, kChunk - 1, kChunk, 3 * kChunk + 17}) {
    for (const int threads : {1, 3, 0}) {
      std::vector<double> from(count);
      for (std::size_t i = 0; i < count; ++i) from[i] = 3.0 * static_cast<double>(i) + 1.0;
      std::vector<double> to(count + 1, -1.0);  // one past the end: must stay untouched
      kvaudit::parallel_copy(from.data(), count, to.data(), threads);
      INFO("count " << count << ", threads " << threads);
      std::size_t wrong = 0;
      for (std::size_t i = 0; i < count; ++i) wrong += to[i] != 3.0 * static_cast<double>(i) + 1.0;
      CHECK(wrong == 0);
      CHECK(to[count] == -1.0);
    }
  }
}

TEST_CASE("gather_token_rows: each request's rows in token order, from its offset",
          "[reference][host-copies]") {
  // 1000 slots of width 5 (dc 3 + dr 2), slot s holding s * 10 + j; request b's token t reads
  // slot (b * 389 + t * 7) % 1000. Requests of 600 (several 256-row units), 0 and 300 tokens.
  constexpr int kWidth = 5;
  std::vector<float> slots(1000 * kWidth);
  for (int s = 0; s < 1000; ++s) {
    for (int j = 0; j < kWidth; ++j) slots[s * kWidth + j] = static_cast<float>(s * 10 + j);
  }
  const auto slot_of = [](int b, int t) { return (b * 389 + t * 7) % 1000; };
  ReferenceProblem p;
  p.dc = 3;
  p.dr = 2;
  p.threads = 4;
  const std::vector<int> tokens = {600, 0, 300};
  p.token_rows.resize(tokens.size());
  for (std::size_t b = 0; b < tokens.size(); ++b) {
    for (int t = 0; t < tokens[b]; ++t) {
      p.token_rows[b].push_back(slots.data() + slot_of(static_cast<int>(b), t) * kWidth);
    }
  }
  const std::vector<long long> offsets = kvaudit::gathered_row_offsets(p);
  CHECK(offsets == std::vector<long long>{0, 600, 600, 900});
  std::vector<float> gathered(900 * kWidth + 1, -1.0f);
  kvaudit::gather_token_rows(p, offsets, gathered.data());
  int wrong = 0;
  for (int b : {0, 2}) {
    for (int t = 0; t < tokens[b]; ++t) {
      for (int j = 0; j < kWidth; ++j) {
        const float expected = static_cast<float>(slot_of(b, t) * 10 + j);
        wrong += gathered[(offsets[b] + t) * kWidth + j] != expected;
      }
    }
  }
  CHECK(wrong == 0);
  CHECK(gathered[900 * kWidth] == -1.0f);  // nothing written past the rows
}

TEST_CASE("KvRows from a pool's slots on several threads: each visible row decoded in place",
          "[reference][host-copies]") {
  // 3000 slots (three 1024-slot units), width 4, code (s * 7 + c) % 0x7E (no NaN code); the slots
  // s % 3 != 1 visible (listed last first), 1023, the first unit's last slot, among them. The
  // largest code present, 0x7D, is 416 < 2^9: an 18-bit grid from 2^-9.
  kvaudit::KvPool pool = kvaudit::KvPool::zeros(kvaudit::KvDtype::kFloat8E4m3fn, 3000, 4);
  for (int s = 0; s < 3000; ++s) {
    for (int c = 0; c < 4; ++c) pool.row(s)[c] = static_cast<std::uint8_t>((s * 7 + c) % 0x7E);
  }
  std::vector<std::int64_t> visible;
  for (std::int64_t s = 2999; s >= 0; --s) {
    if (s % 3 != 1) visible.push_back(s);
  }
  const KvRows rows = KvRows::from_pool_slots(pool, 0.5f, visible, 3);
  int wrong = 0;
  int missing = 0;
  for (int s = 0; s < 3000; ++s) {
    const float* row = rows.row(s);
    if (s % 3 == 1) {
      missing += row != nullptr;
      continue;
    }
    if (row == nullptr) {
      ++missing;
      continue;
    }
    for (int c = 0; c < 4; ++c) {
      wrong += row[c] != kvaudit::e4m3_decode(static_cast<std::uint8_t>((s * 7 + c) % 0x7E));
    }
  }
  CHECK(missing == 0);
  CHECK(wrong == 0);
  CHECK(rows.scale() == 0.5);
  CHECK(rows.has_value_grid());
  CHECK(rows.grid_exponent() == -9);
  CHECK(rows.magnitude_bits() == 18);
}

TEST_CASE("KvRows of an e4m3 pool: the grid's top from the largest finite magnitude of any sign",
          "[reference][host-copies]") {
  // The grid's top is read off the codes: NaN codes (0x7f, 0xff) are no magnitude, a negative
  // code counts by its magnitude, and only slots held count. 0x38 is 1.0 (top 2^1: 10 bits from
  // 2^-9), 0xc8 is -4.0 (top 2^3: 12 bits), 0x58 is 16.0 (top 2^5: 14 bits).
  kvaudit::KvPool pool = kvaudit::KvPool::zeros(kvaudit::KvDtype::kFloat8E4m3fn, 2100, 4);
  pool.row(5)[1] = 0x38;
  pool.row(7)[0] = 0x7f;
  pool.row(1500)[3] = 0xff;
  const std::vector<std::int64_t> first = {5, 7, 1500};
  const KvRows one = KvRows::from_pool_slots(pool, 1.0f, first, 2);
  REQUIRE(one.has_value_grid());
  CHECK(one.grid_exponent() == -9);
  CHECK(one.magnitude_bits() == 10);
  CHECK(KvRows::from_pool(pool, 1.0f).magnitude_bits() == 10);

  pool.row(2050)[2] = 0xc8;
  const std::vector<std::int64_t> second = {5, 2050};
  CHECK(KvRows::from_pool_slots(pool, 1.0f, second, 2).magnitude_bits() == 12);
  CHECK(KvRows::from_pool(pool, 1.0f).magnitude_bits() == 12);
  pool.row(900)[0] = 0x58;  // not among `second`'s slots
  CHECK(KvRows::from_pool_slots(pool, 1.0f, second, 2).magnitude_bits() == 12);
  CHECK(KvRows::from_pool(pool, 1.0f).magnitude_bits() == 14);

  const kvaudit::KvPool zeros = kvaudit::KvPool::zeros(kvaudit::KvDtype::kFloat8E4m3fn, 10, 4);
  const KvRows none = KvRows::from_pool(zeros, 1.0f);
  REQUIRE(none.has_value_grid());
  CHECK(none.magnitude_bits() == 0);  // no nonzero value: top 2^-9
}

TEST_CASE("KvRows value grid: chunks that each fit can together span too much",
          "[reference][host-copies]") {
  // Two 2^18-value chunks of the grid scan: one of 2^-20 and one of 2^k. Each chunk alone spans
  // 1 bit; together they span k + 21 bits, a grid only while that is at most kMaxGridBits (30).
  constexpr std::size_t kChunk = std::size_t{1} << 18;
  std::vector<float> values(2 * kChunk, 0x1p-20f);
  SECTION("2^-20 and 2^9: 30 bits, a grid") {
    std::fill(values.begin() + kChunk, values.end(), 0x1p9f);
    const KvRows rows = KvRows::from_values(values, 4);
    CHECK(rows.has_value_grid());
    CHECK(rows.grid_exponent() == -20);
    CHECK(rows.magnitude_bits() == 30);
  }
  SECTION("2^-20 and 2^10: 31 bits, no grid") {
    std::fill(values.begin() + kChunk, values.end(), 0x1p10f);
    CHECK_FALSE(KvRows::from_values(values, 4).has_value_grid());
  }
  SECTION("an infinity in the second chunk: no grid") {
    values[kChunk + 5] = std::numeric_limits<float>::infinity();
    CHECK_FALSE(KvRows::from_values(values, 4).has_value_grid());
  }
}

// Not run by default: the host copies at a GLM-5 prefill step-layer's size (8 requests x 4608
// visible tokens of 576 e4m3 values; out [4096, 16, 512] doubles), one thread against every core.
TEST_CASE("host copies at GLM-5 prefill size (seconds)", "[.][benchmark][host-copies]") {
  using Clock = std::chrono::steady_clock;
  const auto time = [](auto&& work) {
    const auto start = Clock::now();
    work();
    return std::chrono::duration<double>(Clock::now() - start).count();
  };
  constexpr int kRequests = 8;
  constexpr int kTokens = 4608;
  constexpr int kWidth = 576;
  kvaudit::KvPool pool =
      kvaudit::KvPool::zeros(kvaudit::KvDtype::kFloat8E4m3fn, kRequests * kTokens, kWidth);
  for (std::int64_t s = 0; s < pool.num_slots; ++s) {
    for (int c = 0; c < kWidth; ++c)
      pool.row(s)[c] = static_cast<std::uint8_t>((s * 31 + c) % 0x7E);
  }
  std::vector<std::int64_t> visible(static_cast<std::size_t>(pool.num_slots));
  for (std::int64_t s = 0; s < pool.num_slots; ++s) visible[s] = s;
  for (const int threads : {1, 0}) {
    KvRows rows;
    const double decode =
        time([&] { rows = KvRows::from_pool_slots(pool, 1.0f, visible, threads); });
    ReferenceProblem p;
    p.dc = 512;
    p.dr = 64;
    p.threads = threads;
    p.token_rows.resize(kRequests);
    for (int b = 0; b < kRequests; ++b) {
      for (int t = 0; t < kTokens; ++t) p.token_rows[b].push_back(rows.row(b * kTokens + t));
    }
    const std::vector<long long> offsets = kvaudit::gathered_row_offsets(p);
    std::vector<float> gathered(static_cast<std::size_t>(offsets.back()) * kWidth);
    const double gather = time([&] { kvaudit::gather_token_rows(p, offsets, gathered.data()); });
    const std::size_t out_size = std::size_t{4096} * 16 * 512;
    std::vector<double> from(out_size, 1.5);
    std::vector<double> fresh;
    const double zero_fresh = time([&] { fresh.assign(out_size, 0.0); });
    const double copy =
        time([&] { kvaudit::parallel_copy(from.data(), out_size, fresh.data(), threads); });
    std::cout << "threads " << kvaudit::resolve_thread_count(threads) << ": from_pool_slots "
              << decode << " s, gather_token_rows " << gather << " s, out zeroed fresh "
              << zero_fresh << " s, out parallel_copy into mapped pages " << copy << " s\n";
    CHECK(gathered[kWidth] == rows.row(1)[0]);
  }
}
