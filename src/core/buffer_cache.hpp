// Large buffers kept for reuse, and an allocator that draws on them.
//
// A whole-model check allocates the same few large buffers for every layer: the layer's kv_source
// as floats and the exact reference's decoded pool (each [S, 576] floats, 76 MB for a GLM-5 layer
// of 8 x 4,097 tokens). Freed, such a buffer goes back to the kernel (glibc maps every block above
// 32 MiB on its own); the next layer's is mapped again, and every page is zeroed by the kernel
// before the buffer's own writes: 1.6 million page faults and about 3 CPU-seconds in the kernel for
// 78 layers on the 2-core build machine (perf, 2026-12-06). LargeBufferCache keeps freed blocks of
// at least kMinBytes, up to kMaxKept of them and kMaxKeptBytes in all, and lends one back for a
// request it fits closely (at most 1/4 more bytes than asked), so that a layer's buffers reuse the
// last layer's pages. Like CUDA caching allocators, but for host memory: what is kept stays
// resident until reused or until the process ends (release_all() frees it sooner).
//
// CachedAllocator<T> is that cache behind std::allocator's interface, and CachedUninitAllocator<T>
// the same with default-initialising construction: resize(n) leaves trivially constructible
// elements unwritten (a reused block holds the last layer's values; a new one's pages are first
// touched by the threads that fill it, not zeroed beforehand), so it is only for buffers every
// element of which is written before it is read. Blocks below kMinBytes come from std::allocator as
// usual. (Boost.Container's default_init does the default-initialising part, but public headers of
// the references layer must not include Boost: references/CMakeLists.txt.)
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <new>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace kvaudit {

class LargeBufferCache {
 public:
  static constexpr std::size_t kMinBytes = std::size_t{8} << 20;
  static constexpr std::size_t kMaxKept = 8;
  static constexpr std::size_t kMaxKeptBytes = std::size_t{1} << 30;

  // The process's one cache (thread-safe).
  static LargeBufferCache& instance();

  // At least `bytes` (>= kMinBytes), aligned to 64 bytes: a kept block that fits closely, or a new
  // one (advised onto huge pages). Throws std::bad_alloc as operator new does.
  void* take(std::size_t bytes);
  // A block from take(): kept for reuse where there is room, else freed.
  void give_back(void* block);
  // Frees every kept block.
  void release_all();

  // What the cache has done since the process started (for its tests).
  struct Counts {
    std::size_t taken_new = 0;  // blocks allocated
    std::size_t reused = 0;     // requests met by a kept block
    std::size_t kept = 0;       // blocks kept now
    std::size_t kept_bytes = 0;
  };
  Counts counts() const;

 private:
  LargeBufferCache();
  struct Block {
    void* data = nullptr;
    std::size_t bytes = 0;
  };
  static void free_block(void* data);

  mutable std::mutex mutex_;
  std::vector<Block> kept_;
  std::unordered_map<void*, std::size_t> lent_;  // block -> its bytes
  std::size_t kept_bytes_ = 0;
  std::size_t taken_new_ = 0;
  std::size_t reused_ = 0;
};

// Value-initialising, as std::allocator: a vector's resize(n) zeroes the new elements.
template <class T>
struct CachedAllocator {
  using value_type = T;
  template <class U>
  struct rebind {
    using other = CachedAllocator<U>;
  };
  CachedAllocator() = default;
  template <class U>
  CachedAllocator(const CachedAllocator<U>&) noexcept {}

  T* allocate(std::size_t n) {
    if (n > static_cast<std::size_t>(-1) / sizeof(T)) throw std::bad_array_new_length();
    const std::size_t bytes = n * sizeof(T);
    if (bytes < LargeBufferCache::kMinBytes) return std::allocator<T>().allocate(n);
    return static_cast<T*>(LargeBufferCache::instance().take(bytes));
  }
  void deallocate(T* p, std::size_t n) noexcept {
    if (n * sizeof(T) < LargeBufferCache::kMinBytes) return std::allocator<T>().deallocate(p, n);
    LargeBufferCache::instance().give_back(p);
  }

  template <class U>
  bool operator==(const CachedAllocator<U>&) const noexcept {
    return true;
  }
};

// Default-initialising: resize(n) leaves trivially constructible elements unwritten (see above).
template <class T>
struct CachedUninitAllocator : CachedAllocator<T> {
  template <class U>
  struct rebind {
    using other = CachedUninitAllocator<U>;
  };
  CachedUninitAllocator() = default;
  template <class U>
  CachedUninitAllocator(const CachedUninitAllocator<U>&) noexcept {}

  template <class U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

// A vector of the cache compares equal to any vector of the same elements (as std::vector's own
// == does for one allocator): element by element.
template <class T, class A, class B>
requires(!std::is_same_v<A, B>) bool operator==(const std::vector<T, A>& a,
                                                const std::vector<T, B>& b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end());
}

// A float buffer of that kind, every element written before it is read: kv_source rows, decoded
// pool rows.
using CachedFloats = std::vector<float, CachedUninitAllocator<float>>;
// A KV pool's bytes (KvPool::bytes, tens of MB a layer, copied per step for the integrity checks),
// zeroed as a std::vector's are.
using CachedBytes = std::vector<std::uint8_t, CachedAllocator<std::uint8_t>>;

}  // namespace kvaudit
