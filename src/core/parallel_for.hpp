// The one work-sharing loop of kvaudit (the CPU reference and the cpu-fp8 model both use it), and a
// copy built on it.
//
// parallel_for(units, threads, make_worker) runs unit indices 0..units-1 on up to `threads` threads
// (0: every core). Units are claimed one at a time from a shared counter, so uneven units (rows
// that see many tokens next to rows that see few) balance themselves. Each thread first calls
// make_worker() once to build its own state (scratch buffers, accumulators), then calls that
// worker with every unit it claims: worker(unit). Which thread runs a unit is not fixed, so a
// worker's result must not depend on it; every caller writes each unit's result to its own slot.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <thread>
#include <vector>

namespace kvaudit {

// `requested` threads, or every core for 0 (at least 1).
inline int resolve_thread_count(int requested) {
  if (requested > 0) return requested;
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

template <class MakeWorker>
void parallel_for(std::size_t units, int threads, MakeWorker&& make_worker) {
  if (units == 0) return;
  const std::size_t workers = std::min<std::size_t>(resolve_thread_count(threads), units);
  std::atomic<std::size_t> next{0};
  auto drain = [&] {
    auto worker = make_worker();
    for (std::size_t unit = next++; unit < units; unit = next++) worker(unit);
  };
  if (workers == 1) {
    drain();
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(workers);
  for (std::size_t w = 0; w < workers; ++w) pool.emplace_back(drain);
  for (std::thread& thread : pool) thread.join();
}

// Copies count elements from `from` to `to` (not overlapping) in fixed chunks on up to `threads`
// threads: pure data movement, the same bytes whatever the thread count. For arrays of hundreds of
// MB (a prefill step's out), where one thread's copy, and its first touch of fresh pages, is slow.
template <class T>
void parallel_copy(const T* from, std::size_t count, T* to, int threads) {
  constexpr std::size_t kChunk = std::size_t{1} << 16;  // elements per unit
  parallel_for((count + kChunk - 1) / kChunk, threads, [&] {
    return [&](std::size_t chunk) {
      const std::size_t begin = chunk * kChunk;
      const std::size_t end = std::min(count, begin + kChunk);
      std::copy(from + begin, from + end, to + begin);
    };
  });
}

}  // namespace kvaudit
