// The prerequisite registry (tests/prerequisites.hpp) and the [gpu] prerequisite: a CUDA device.
#include "tests/prerequisites.hpp"

#include <fmt/format.h>

#include <utility>

#include "src/core/cuda_device.hpp"

namespace kvaudit_test {

std::vector<Prerequisite>& prerequisites() {
  static std::vector<Prerequisite> registered;
  return registered;
}

PrerequisiteRegistration::PrerequisiteRegistration(std::string tag,
                                                   std::function<PrerequisiteState()> probe) {
  prerequisites().push_back({std::move(tag), std::move(probe)});
}

namespace {

// The reason says that no device is there, then why ("no CUDA device: this machine has no NVIDIA
// GPU", "no CUDA device: kvaudit was built without CUDA (KVAUDIT_CUDA=OFF)").
PrerequisiteState probe_cuda_device() {
  const kvaudit::CudaDeviceInfo device = kvaudit::cuda_device_info();
  if (!device.present) {
    const bool says_so = device.reason.rfind("no ", 0) == 0;
    return {false, says_so ? device.reason : "no CUDA device: " + device.reason};
  }
  return {true,
          fmt::format("CUDA device: {} (sm_{}, driver {}, runtime {})", device.name,
                      device.compute_capability, device.driver_version, device.runtime_version)};
}

const PrerequisiteRegistration gpu_needed("gpu", probe_cuda_device);

}  // namespace
}  // namespace kvaudit_test
