// Whether a CUDA device is usable, and what it is (for reports and test skips). Builds without
// CUDA answer "no device" with the reason.
//
// The reason names the real cause. The CUDA runtime reports a machine without an NVIDIA driver as
// "CUDA driver version is insufficient for CUDA runtime version" (cudaErrorInsufficientDriver: it
// finds no libcuda), which would send a user without a GPU to upgrade a driver they do not have;
// so that error is told apart by whether an NVIDIA driver is installed at all.
#pragma once

#include <optional>
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

// How the device query failed.
enum class CudaProbeFailure {
  kNoDevice,            // the driver runs but sees no GPU (cudaErrorNoDevice, or a count of 0)
  kInsufficientDriver,  // cudaErrorInsufficientDriver: no driver at all, or one too old
  kOther,               // any other runtime error
};

// The NVIDIA kernel driver installed here: its release ("580.95.05", from
// /proc/driver/nvidia/version), "unknown release" when only its library (libcuda.so.1) is found,
// or nothing when there is none.
std::optional<std::string> nvidia_driver_release();

// The reason of a failed device query, from what failed, the runtime's own message, the driver
// found (nvidia_driver_release) and this build's runtime version ("13.0").
std::string describe_missing_cuda_device(CudaProbeFailure failure,
                                         const std::string& runtime_message,
                                         const std::optional<std::string>& driver_release,
                                         const std::string& runtime_version);

}  // namespace kvaudit
