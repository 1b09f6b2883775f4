// Whether a CUDA device is usable, and what it is (for reports and test skips). Builds without
// CUDA answer "no device" with the reason.
#pragma once

#include <string>

namespace kvaudit {

struct CudaDeviceInfo {
  bool present = false;
  std::string reason;          // why not present
  std::string name;            // "NVIDIA H200"
  int compute_capability = 0;  // 90
  int driver_version = 0;      // cudaDriverGetVersion, e.g. 13000
  int runtime_version = 0;     // cudaRuntimeGetVersion
  long long global_memory_bytes = 0;
  int multiprocessors = 0;
};

CudaDeviceInfo cuda_device_info();

}  // namespace kvaudit
