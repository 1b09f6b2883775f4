// Catch2 runner. A run that selects [gpu] cases on a machine without a CUDA device lists them,
// says why they are skipped, and exits 77 (CTest's SKIP_RETURN_CODE for gpu_tests).
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#include <cstring>
#include <iostream>

#include "src/core/cuda_device.hpp"

int main(int argc, char** argv) {
  Catch::Session session;
  if (const int rc = session.applyCommandLine(argc, argv); rc != 0) return rc;
  bool gpu_only = false;
  for (int i = 1; i < argc; ++i) gpu_only |= std::strcmp(argv[i], "[gpu]") == 0;
  if (gpu_only) {
    const kvaudit::CudaDeviceInfo device = kvaudit::cuda_device_info();
    if (!device.present) {
      std::cout << "SKIPPED [gpu] tests (" << device.reason << "):\n";
      const auto spec =
          Catch::TestSpecParser(Catch::ITagAliasRegistry::get()).parse("[gpu]").testSpec();
      for (const auto& test : Catch::filterTests(Catch::getAllTestCasesSorted(session.config()),
                                                 spec, session.config())) {
        std::cout << "  skipped: " << test.name << "\n";
      }
      return 77;
    }
    std::cout << "CUDA device: " << device.name << " (sm_" << device.compute_capability
              << ", driver " << device.driver_version << ", runtime " << device.runtime_version
              << ")\n";
  }
  return session.run();
}
