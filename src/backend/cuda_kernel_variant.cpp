// Names and JSON of the CUDA kernel variant (src/backend/cuda_kernel_variant.hpp).
#include "src/backend/cuda_kernel_variant.hpp"

#include <string>

namespace kvaudit {

std::string_view mma_choice_name(MmaChoice choice) {
  switch (choice) {
    case MmaChoice::kAuto:
      return "auto";
    case MmaChoice::kMmaSync:
      return "mma-sync";
  }
  return "?";
}

std::string_view decode16_choice_name(Decode16Choice choice) {
  switch (choice) {
    case Decode16Choice::kAuto:
      return "auto";
    case Decode16Choice::kSharedTile:
      return "shared-tile";
    case Decode16Choice::kRegisters:
      return "registers";
  }
  return "?";
}

std::string_view tensor_core_path_name(TensorCorePath path) {
  return path == TensorCorePath::kWgmma ? "wgmma" : "mma-sync";
}

std::string_view on_off_name(bool on) { return on ? "on" : "off"; }

std::optional<MmaChoice> parse_mma_choice(std::string_view text) {
  for (const MmaChoice choice : {MmaChoice::kAuto, MmaChoice::kMmaSync}) {
    if (text == mma_choice_name(choice)) return choice;
  }
  return std::nullopt;
}

std::optional<Decode16Choice> parse_decode16_choice(std::string_view text) {
  for (const Decode16Choice choice :
       {Decode16Choice::kAuto, Decode16Choice::kSharedTile, Decode16Choice::kRegisters}) {
    if (text == decode16_choice_name(choice)) return choice;
  }
  return std::nullopt;
}

std::optional<bool> parse_on_off(std::string_view text) {
  if (text == "on") return true;
  if (text == "off") return false;
  return std::nullopt;
}

nlohmann::json kernel_variant_json(const CudaKernelVariant& variant, TensorCorePath mma_ran) {
  return {{"mma", std::string(tensor_core_path_name(mma_ran))},
          {"mma_requested", std::string(mma_choice_name(variant.mma))},
          {"decode16", std::string(decode16_choice_name(variant.decode16))},
          {"host_plan", variant.host_plan},
          {"longest_first", variant.longest_first}};
}

}  // namespace kvaudit
