// The CUDA kernel variant as plain data (src/backend/cuda_kernel_variant.hpp): the names the
// command line spells, and the JSON every cuda-* backend's describe() records as "kernel_variant"
// (report.json's backend_description, golden files' provenance). Runs without a GPU: describe()
// itself is covered by the [gpu] tests in tests/kernels/test_mla_attention_cuda.cu.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "src/backend/backend.hpp"
#include "src/backend/cuda_kernel_variant.hpp"

namespace kvaudit {

TEST_CASE("cuda kernel variant: the defaults are what runs in production", "[cuda-variant]") {
  const CudaKernelVariant variant;
  CHECK(variant.mma == MmaChoice::kAuto);
  CHECK(variant.decode16 == Decode16Choice::kAuto);
  CHECK(variant.host_plan);
  CHECK(variant.longest_first);
  CHECK(BackendOptions{}.cuda_variant == variant);
}

TEST_CASE("cuda kernel variant: names parse back, anything else is refused", "[cuda-variant]") {
  CHECK(parse_mma_choice("auto") == MmaChoice::kAuto);
  CHECK(parse_mma_choice("mma-sync") == MmaChoice::kMmaSync);
  CHECK(mma_choice_name(MmaChoice::kMmaSync) == "mma-sync");
  CHECK(parse_decode16_choice("auto") == Decode16Choice::kAuto);
  CHECK(parse_decode16_choice("shared-tile") == Decode16Choice::kSharedTile);
  CHECK(parse_decode16_choice("registers") == Decode16Choice::kRegisters);
  CHECK(decode16_choice_name(Decode16Choice::kSharedTile) == "shared-tile");
  CHECK(decode16_choice_name(Decode16Choice::kRegisters) == "registers");
  CHECK(parse_on_off("on") == true);
  CHECK(parse_on_off("off") == false);
  CHECK(tensor_core_path_name(TensorCorePath::kWgmma) == "wgmma");
  CHECK(tensor_core_path_name(TensorCorePath::kMmaSync) == "mma-sync");
  // The old environment variables' spellings and near misses are not values.
  for (const char* bad : {"", "Auto", "wgmma", "mma.sync", "mma_sync", " auto"}) {
    INFO("'" << bad << "'");
    CHECK_FALSE(parse_mma_choice(bad).has_value());
  }
  for (const char* bad : {"", "shared", "register", "shared_tile", "off"}) {
    INFO("'" << bad << "'");
    CHECK_FALSE(parse_decode16_choice(bad).has_value());
  }
  for (const char* bad : {"", "ON", "true", "1", "yes", "no"}) {
    INFO("'" << bad << "'");
    CHECK_FALSE(parse_on_off(bad).has_value());
  }
}

TEST_CASE("cuda kernel variant: the JSON states what was asked and the instructions that ran",
          "[cuda-variant]") {
  const nlohmann::json defaults = kernel_variant_json(CudaKernelVariant{}, TensorCorePath::kWgmma);
  CHECK(defaults == nlohmann::json::parse(R"({"mma": "wgmma", "mma_requested": "auto",
      "decode16": "auto", "host_plan": true, "longest_first": true})"));

  CudaKernelVariant forced;
  forced.mma = MmaChoice::kMmaSync;
  forced.decode16 = Decode16Choice::kRegisters;
  forced.host_plan = false;
  forced.longest_first = false;
  CHECK(kernel_variant_json(forced, TensorCorePath::kMmaSync) ==
        nlohmann::json::parse(R"({"mma": "mma-sync", "mma_requested": "mma-sync",
      "decode16": "registers", "host_plan": false, "longest_first": false})"));

  // auto on a device (or build) without wgmma: mma.sync ran, auto was asked.
  CHECK(kernel_variant_json(CudaKernelVariant{}, TensorCorePath::kMmaSync)["mma"] == "mma-sync");
  CHECK(kernel_variant_json(CudaKernelVariant{}, TensorCorePath::kMmaSync)["mma_requested"] ==
        "auto");
}

}  // namespace kvaudit
