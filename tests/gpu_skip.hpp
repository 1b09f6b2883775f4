// GPU test cases carry the [gpu] tag and start with KVAUDIT_REQUIRE_GPU(). On a machine without a
// device the runner (tests/test_main.cpp, tests/prerequisites.hpp) takes every selected [gpu] case
// out of the run and reports it skipped, so a case reaches this guard without a device only when
// its [gpu] tag is missing: the guard then fails it, by name, rather than let it pass having
// checked nothing.
#pragma once

#include <catch2/catch.hpp>

#include "src/core/cuda_device.hpp"

#define KVAUDIT_REQUIRE_GPU()                                                                     \
  do {                                                                                            \
    const auto kvaudit_device_ = kvaudit::cuda_device_info();                                     \
    if (!kvaudit_device_.present) {                                                               \
      FAIL(Catch::getResultCapture().getCurrentTestName()                                         \
           << ": runs without a CUDA device (" << kvaudit_device_.reason                          \
           << "); tag it [gpu] so that the runner reports it skipped (tests/prerequisites.hpp)"); \
    }                                                                                             \
  } while (0)
