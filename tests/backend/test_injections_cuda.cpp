// The fault-injection matrix of injection_matrix.hpp on the cuda-fp8 backend: the CUDA write and
// attention kernels inject the same faults as the CPU model (src/backend/injection.hpp), and the
// same checks must catch them. Runs the kvaudit binary; skipped by name where no device exists.
#include <catch2/catch.hpp>

#include "src/backend/injection.hpp"
#include "tests/backend/injection_matrix.hpp"
#include "tests/gpu_skip.hpp"

TEST_CASE("cuda-fp8: every injected fault on every shipped dump is caught by its check",
          "[gpu][injection][cli]") {
  KVAUDIT_REQUIRE_GPU();
  REQUIRE(std::size(kvaudit_test::kInjectionMatrix) == kvaudit::injection_table().size() + 1);
  for (const auto& expectation : kvaudit_test::kInjectionMatrix) {
    for (const char* dump : kvaudit_test::kShippedDumps) {
      kvaudit_test::require_injection_outcome("cuda-fp8", dump, expectation);
    }
  }
}

TEST_CASE(
    "cuda-fp8: every injected fault on the kvdump v1.1 dumps is caught by its check, or "
    "refused",
    "[gpu][injection][cli]") {
  KVAUDIT_REQUIRE_GPU();
  REQUIRE(std::size(kvaudit_test::kGroupInjectionMatrix) == kvaudit::injection_table().size() + 1);
  for (const auto& expectation : kvaudit_test::kGroupInjectionMatrix) {
    for (const char* dump : kvaudit_test::kShippedGroupDumps) {
      kvaudit_test::require_group_injection_outcome("cuda-fp8", dump, expectation);
    }
  }
}
