// Where a GPU pipeline's wall time went, summed over its calls (`kvaudit check --verbose` prints
// it for the GPU reference and the cuda-* backends, src/report/report.cpp print_timing):
//   prepare  — work on the host before the first copy (resolving indices, gathering or converting
//              inputs, planning launches),
//   upload   — host-to-device copies (and filling the page-locked staging buffers they read),
//   kernels  — from the first launch to the synchronize after the last,
//   download — device-to-host copies and copying them out to the caller's arrays.
// Plain steady-clock spans on the calling thread; a part no call has reached stays 0.
#pragma once

#include <chrono>
#include <cstdint>

namespace kvaudit {

struct DeviceSeconds {
  double prepare = 0.0;
  double upload = 0.0;
  double kernels = 0.0;
  double download = 0.0;
  std::int64_t calls = 0;

  double total() const { return prepare + upload + kernels + download; }
  DeviceSeconds& operator+=(const DeviceSeconds& other) {
    prepare += other.prepare;
    upload += other.upload;
    kernels += other.kernels;
    download += other.download;
    calls += other.calls;
    return *this;
  }
  // What was spent between two readings of a running total (`later` taken after `earlier`).
  friend DeviceSeconds operator-(DeviceSeconds later, const DeviceSeconds& earlier) {
    later.prepare -= earlier.prepare;
    later.upload -= earlier.upload;
    later.kernels -= earlier.kernels;
    later.download -= earlier.download;
    later.calls -= earlier.calls;
    return later;
  }
};

// Seconds since `start` on the steady clock, for adding a span to one DeviceSeconds part.
inline double elapsed_seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace kvaudit
