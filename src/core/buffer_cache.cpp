#include "src/core/buffer_cache.hpp"

#include <array>

#include "src/core/huge_pages.hpp"

namespace kvaudit {

namespace {

constexpr std::align_val_t kAlignment{64};

}  // namespace

LargeBufferCache& LargeBufferCache::instance() {
  // Never destroyed: a vector in some other static object may give its block back at exit.
  static LargeBufferCache* const cache = new LargeBufferCache;
  return *cache;
}

LargeBufferCache::LargeBufferCache() { kept_.reserve(kMaxKept); }

void LargeBufferCache::free_block(void* data) { ::operator delete(data, kAlignment); }

void* LargeBufferCache::take(std::size_t bytes) {
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    // The smallest kept block that fits closely (a small request must not pin a large block); of
    // equal ones the last kept, whose pages were touched last.
    auto best = kept_.end();
    for (auto it = kept_.begin(); it != kept_.end(); ++it) {
      const bool fits = it->bytes >= bytes && it->bytes - bytes <= bytes / 4;
      if (fits && (best == kept_.end() || it->bytes <= best->bytes)) best = it;
    }
    if (best != kept_.end()) {
      const Block block = *best;
      kept_.erase(best);
      kept_bytes_ -= block.bytes;
      lent_.emplace(block.data, block.bytes);
      ++reused_;
      return block.data;
    }
  }
  void* data = ::operator new(bytes, kAlignment);  // outside the lock: may take long, may throw
  advise_huge_pages(data, bytes);
  try {
    const std::lock_guard<std::mutex> lock(mutex_);
    lent_.emplace(data, bytes);
    ++taken_new_;
  } catch (...) {
    free_block(data);
    throw;
  }
  return data;
}

// Allocates nothing (deallocate is noexcept): kept_ has room for kMaxKept from the start.
void LargeBufferCache::give_back(void* block) {
  std::array<void*, kMaxKept + 1> to_free{};
  std::size_t freeing = 0;
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    const auto lent = lent_.find(block);
    if (lent == lent_.end()) return;  // not ours: nothing to do (allocate never hands such out)
    const Block returned{block, lent->second};
    lent_.erase(lent);
    if (returned.bytes > kMaxKeptBytes) {
      to_free[freeing++] = returned.data;
    } else {
      // Room for the returned block: the oldest kept ones go first (sizes change with the steps).
      while (!kept_.empty() &&
             (kept_.size() >= kMaxKept || kept_bytes_ + returned.bytes > kMaxKeptBytes)) {
        to_free[freeing++] = kept_.front().data;
        kept_bytes_ -= kept_.front().bytes;
        kept_.erase(kept_.begin());
      }
      kept_.push_back(returned);
      kept_bytes_ += returned.bytes;
    }
  }
  for (std::size_t i = 0; i < freeing; ++i) free_block(to_free[i]);  // outside the lock
}

void LargeBufferCache::release_all() {
  std::vector<Block> kept;
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    kept.swap(kept_);
    kept_bytes_ = 0;
  }
  for (const Block& block : kept) free_block(block.data);
}

LargeBufferCache::Counts LargeBufferCache::counts() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  return {taken_new_, reused_, kept_.size(), kept_bytes_};
}

}  // namespace kvaudit
