// Large buffers on transparent huge pages. A fresh buffer of tens or hundreds of MB (a prefill
// step's q_nope as floats: 134 MB for GLM-5's 16-head bench shape) is mapped and zeroed on first
// touch; with 4 KiB pages that is one fault per page, and the faults cost more than the data's
// own read (measured on the 2-core build machine, 2026-12-05: a fresh 134 MB vector<float>
// filled in 101 ms with 4 KiB pages, 50 ms with madvise(MADV_HUGEPAGE)). Linux only; elsewhere,
// or where the kernel's transparent huge pages are "never", the advice does nothing. Only the
// 2 MiB-aligned part of a buffer is advised; the memory stays ordinary, freed as before.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace kvaudit {

// Buffers below this are left alone (a huge page would be most of them).
inline constexpr std::size_t kHugePageMinBytes = std::size_t{8} << 20;

inline void advise_huge_pages(void* data, std::size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr std::uintptr_t kHuge = std::uintptr_t{2} << 20;
  const auto start = reinterpret_cast<std::uintptr_t>(data);
  const std::uintptr_t begin = (start + kHuge - 1) & ~(kHuge - 1);
  const std::uintptr_t end = (start + bytes) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

// vector.reserve(count), with a large new allocation advised onto huge pages before anything
// touches it; the caller then fills it (assign, resize).
template <class T, class A>
void reserve_on_huge_pages(std::vector<T, A>& vector, std::size_t count) {
  if (count <= vector.capacity()) return;
  vector.reserve(count);
  if (count * sizeof(T) >= kHugePageMinBytes) advise_huge_pages(vector.data(), count * sizeof(T));
}

}  // namespace kvaudit
