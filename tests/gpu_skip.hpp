// GPU test cases carry the [gpu] tag and start with KVAUDIT_REQUIRE_GPU(): on a machine without a
// device they say so by name and return (the runner's gpu_tests entry reports them skipped).
#pragma once

#include <catch2/catch.hpp>

#include "src/core/cuda_device.hpp"

#define KVAUDIT_REQUIRE_GPU()                                                   \
  do {                                                                          \
    const auto kvaudit_device_ = kvaudit::cuda_device_info();                   \
    if (!kvaudit_device_.present) {                                             \
      WARN("SKIPPED " << Catch::getResultCapture().getCurrentTestName() << ": " \
                      << kvaudit_device_.reason);                               \
      return;                                                                   \
    }                                                                           \
  } while (0)
