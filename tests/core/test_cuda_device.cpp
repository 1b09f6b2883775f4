// Why no CUDA device can be used, in words that point at the cause (src/core/cuda_device.hpp). The
// CUDA runtime calls a machine without any NVIDIA driver "CUDA driver version is insufficient for
// CUDA runtime version"; kvaudit must not pass that on as advice to upgrade a driver that is not
// there. In a CUDA build on a machine without a GPU (CI), the backend's own message is checked too.
#include <sys/wait.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>

#include "src/core/cuda_device.hpp"
#include "tests/test_paths.hpp"

namespace kvaudit {
namespace {

constexpr const char* kInsufficient =
    "CUDA driver version is insufficient for CUDA runtime version";

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST_CASE("no NVIDIA driver: says so instead of the runtime's 'insufficient driver'", "[cuda]") {
  const std::string reason = describe_missing_cuda_device(CudaProbeFailure::kInsufficientDriver,
                                                          kInsufficient, std::nullopt, "13.0");
  CHECK(reason ==
        "no CUDA device: this machine has no NVIDIA driver (no GPU, or its driver is not "
        "installed); the cpu-fp8 backend runs without one");
  CHECK_FALSE(contains(reason, "insufficient"));
  CHECK_FALSE(contains(reason, "update"));
}

TEST_CASE("an old NVIDIA driver: named with the runtime it is older than", "[cuda]") {
  const std::string reason = describe_missing_cuda_device(
      CudaProbeFailure::kInsufficientDriver, kInsufficient, std::string("535.104.05"), "13.0");
  CHECK(contains(reason,
                 "the NVIDIA driver (535.104.05) is older than this build's CUDA "
                 "runtime 13.0"));
  CHECK(contains(reason, "update the driver"));
}

TEST_CASE("a driver without a GPU, and other runtime errors", "[cuda]") {
  CHECK(describe_missing_cuda_device(CudaProbeFailure::kNoDevice, "no CUDA-capable device",
                                     std::string("580.95.05"), "13.0") ==
        "no CUDA device: the NVIDIA driver (580.95.05) sees no GPU");
  CHECK(describe_missing_cuda_device(CudaProbeFailure::kNoDevice, "no CUDA-capable device",
                                     std::nullopt,
                                     "13.0") == "no CUDA device: this machine has no NVIDIA GPU");
  CHECK(describe_missing_cuda_device(CudaProbeFailure::kOther, "initialization error", std::nullopt,
                                     "13.0") == "no CUDA device: initialization error");
}

TEST_CASE("kvaudit check --backend cuda-fp8 without a GPU gives the probe's reason", "[cuda]") {
  const CudaDeviceInfo device = cuda_device_info();
  if (device.present) {
    WARN("SKIPPED " << Catch::getResultCapture().getCurrentTestName() << ": a CUDA device is here");
    return;
  }
  const std::filesystem::path log = kvaudit_test::test_tmpdir() / "cuda_device_check.log";
  std::filesystem::create_directories(log.parent_path());
  const std::string command = kvaudit_test::kvaudit_binary().string() + " check '" +
                              (kvaudit_test::source_dir() / "datasets" / "glm5_page1.h5").string() +
                              "' --backend cuda-fp8 > '" + log.string() + "' 2>&1";
  const int raw = std::system(command.c_str());
  REQUIRE(WIFEXITED(raw));
  CHECK(WEXITSTATUS(raw) == 2);
  std::ifstream in(log);
  const std::string output{std::istreambuf_iterator<char>(in), {}};
  CHECK_FALSE(contains(output, "insufficient"));
#ifdef KVAUDIT_HAVE_CUDA
  CHECK(contains(output, device.reason));
#else
  CHECK(contains(output, "built without CUDA"));
#endif
}

}  // namespace
}  // namespace kvaudit
