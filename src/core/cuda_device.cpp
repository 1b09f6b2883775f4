// The CUDA device probe (src/core/cuda_device.hpp): device 0's name and capabilities through the
// CUDA runtime, or why there is none, in words that point at the cause.
#include "src/core/cuda_device.hpp"

#include <dlfcn.h>
#include <fmt/format.h>

#include <cctype>
#include <fstream>
#include <sstream>

#ifdef KVAUDIT_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace kvaudit {

std::optional<std::string> nvidia_driver_release() {
  std::ifstream in("/proc/driver/nvidia/version");
  std::string line;
  if (in && std::getline(in, line)) {
    std::istringstream words(line);
    std::string word;
    while (words >> word) {
      if (std::isdigit(static_cast<unsigned char>(word[0])) &&
          word.find('.') != std::string::npos) {
        return word;
      }
    }
    return std::string("unknown release");
  }
  // No kernel module visible (e.g. a container without /proc/driver): the user-space driver.
  if (void* library = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL)) {
    dlclose(library);
    return std::string("unknown release");
  }
  return std::nullopt;
}

std::string describe_missing_cuda_device(CudaProbeFailure failure,
                                         const std::string& runtime_message,
                                         const std::optional<std::string>& driver_release,
                                         const std::string& runtime_version) {
  switch (failure) {
    case CudaProbeFailure::kNoDevice:
      return driver_release ? fmt::format("no CUDA device: the NVIDIA driver ({}) sees no GPU",
                                          *driver_release)
                            : std::string("no CUDA device: this machine has no NVIDIA GPU");
    case CudaProbeFailure::kInsufficientDriver:
      if (!driver_release) {
        return "no CUDA device: this machine has no NVIDIA driver (no GPU, or its driver is not "
               "installed); the cpu-fp8 backend runs without one";
      }
      return fmt::format(
          "no usable CUDA device: the NVIDIA driver ({}) is older than this build's CUDA runtime "
          "{} ({}); update the driver, or build kvaudit with an older CUDA toolkit",
          *driver_release, runtime_version, runtime_message);
    case CudaProbeFailure::kOther:
      break;
  }
  return fmt::format("no CUDA device: {}", runtime_message);
}

CudaDeviceInfo cuda_device_info() {
  CudaDeviceInfo info;
#ifdef KVAUDIT_HAVE_CUDA
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess || count == 0) {
    const CudaProbeFailure failure =
        status == cudaErrorInsufficientDriver ? CudaProbeFailure::kInsufficientDriver
        : status == cudaSuccess || status == cudaErrorNoDevice ? CudaProbeFailure::kNoDevice
                                                               : CudaProbeFailure::kOther;
    const std::string runtime_version =
        fmt::format("{}.{}", CUDART_VERSION / 1000, (CUDART_VERSION % 1000) / 10);
    info.reason = describe_missing_cuda_device(failure, cudaGetErrorString(status),
                                               nvidia_driver_release(), runtime_version);
    return info;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) {
    info.reason = "cudaGetDeviceProperties failed";
    return info;
  }
  info.present = true;
  info.name = prop.name;
  info.compute_capability = prop.major * 10 + prop.minor;
  cudaDriverGetVersion(&info.driver_version);
  cudaRuntimeGetVersion(&info.runtime_version);
  info.global_memory_bytes = static_cast<long long>(prop.totalGlobalMem);
  info.multiprocessors = prop.multiProcessorCount;
#else
  info.reason = "kvaudit was built without CUDA (KVAUDIT_CUDA=OFF)";
#endif
  return info;
}

}  // namespace kvaudit
