// The CUDA device probe (src/core/cuda_device.hpp): device 0's name and capabilities through the
// CUDA runtime, or why there is none.
#include "src/core/cuda_device.hpp"

#ifdef KVAUDIT_HAVE_CUDA
#include <cuda_runtime.h>
#include <fmt/format.h>
#endif

namespace kvaudit {

CudaDeviceInfo cuda_device_info() {
  CudaDeviceInfo info;
#ifdef KVAUDIT_HAVE_CUDA
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess || count == 0) {
    info.reason = status != cudaSuccess
                      ? fmt::format("no CUDA device: {}", cudaGetErrorString(status))
                      : std::string("no CUDA device found");
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
