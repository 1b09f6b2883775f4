// The cache of large buffers (src/core/buffer_cache.hpp): a freed block serves the next request it
// fits closely, a much smaller request gets a block of its own, what is kept stays within
// kMaxKept blocks and kMaxKeptBytes, and small vectors never touch the cache.
#include <catch2/catch.hpp>
#include <cstddef>
#include <vector>

#include "src/core/buffer_cache.hpp"

namespace kvaudit {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

TEST_CASE("a freed large buffer's block serves the next vector of about its size",
          "[buffer-cache]") {
  LargeBufferCache& cache = LargeBufferCache::instance();
  cache.release_all();
  const LargeBufferCache::Counts before = cache.counts();
  const float* first = nullptr;
  {
    CachedFloats rows(20 * kMiB);  // 80 MiB
    rows.back() = 1.0f;
    first = rows.data();
  }
  CHECK(cache.counts().kept == 1);
  CachedFloats again(19 * kMiB);  // within a quarter below the kept block: it fits
  CHECK(again.data() == first);
  const LargeBufferCache::Counts after = cache.counts();
  CHECK(after.reused == before.reused + 1);
  CHECK(after.taken_new == before.taken_new + 1);
  CHECK(after.kept == 0);
}

TEST_CASE("a much smaller request does not take a large kept block", "[buffer-cache]") {
  LargeBufferCache& cache = LargeBufferCache::instance();
  cache.release_all();
  void* large = cache.take(80 * kMiB);
  cache.give_back(large);
  const LargeBufferCache::Counts before = cache.counts();
  void* smaller = cache.take(40 * kMiB);
  CHECK(smaller != large);
  CHECK(cache.counts().reused == before.reused);
  CHECK(cache.counts().kept == 1);       // the large block is still kept
  void* larger = cache.take(81 * kMiB);  // more than the kept block holds
  CHECK(larger != large);
  cache.give_back(smaller);
  cache.give_back(larger);
  cache.release_all();
  CHECK(cache.counts().kept == 0);
  CHECK(cache.counts().kept_bytes == 0);
}

TEST_CASE("the cache keeps at most kMaxKept blocks and kMaxKeptBytes, the newest",
          "[buffer-cache]") {
  LargeBufferCache& cache = LargeBufferCache::instance();
  cache.release_all();
  std::vector<void*> blocks;
  for (std::size_t i = 0; i < LargeBufferCache::kMaxKept + 2; ++i) {
    blocks.push_back(cache.take(LargeBufferCache::kMinBytes));
  }
  for (void* block : blocks) cache.give_back(block);
  CHECK(cache.counts().kept == LargeBufferCache::kMaxKept);
  // The last block given back is kept (the oldest went): the next request of its size gets it.
  void* reused = cache.take(LargeBufferCache::kMinBytes);
  CHECK(reused == blocks.back());
  cache.give_back(reused);

  // Blocks whose bytes would pass kMaxKeptBytes push the older ones out.
  const std::size_t big = LargeBufferCache::kMaxKeptBytes / 2 + kMiB;
  void* big_a = cache.take(big);
  void* big_b = cache.take(big);
  cache.give_back(big_a);
  cache.give_back(big_b);
  CHECK(cache.counts().kept_bytes <= LargeBufferCache::kMaxKeptBytes);
  CHECK(cache.counts().kept == 1);
  // A block larger than kMaxKeptBytes is freed at once.
  void* huge = cache.take(LargeBufferCache::kMaxKeptBytes + kMiB);
  cache.give_back(huge);
  CHECK(cache.counts().kept_bytes <= LargeBufferCache::kMaxKeptBytes);
  cache.release_all();
}

TEST_CASE("vectors below kMinBytes do not use the cache", "[buffer-cache]") {
  LargeBufferCache& cache = LargeBufferCache::instance();
  cache.release_all();
  const LargeBufferCache::Counts before = cache.counts();
  {
    CachedFloats small(1000, 2.0f);
    CHECK(small[999] == 2.0f);
  }
  const LargeBufferCache::Counts after = cache.counts();
  CHECK(after.taken_new == before.taken_new);
  CHECK(after.kept == 0);
}

}  // namespace
}  // namespace kvaudit
