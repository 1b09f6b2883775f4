// Names, parsing and the recorded JSON of the CUDA kernel variant (the type:
// kernels/mla_attention_variant.hpp), for the command line (--cuda-mma, --cuda-decode16,
// --cuda-host-plan, --cuda-longest-first; src/cli/cli.hpp add_cuda_variant_options), the backends'
// describe() and golden files. It travels in BackendOptions to the backend and in every
// MlaAttentionProblem to the launcher.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string_view>

#include "kernels/mla_attention_variant.hpp"

namespace kvaudit {

// Names as the command line spells them: "auto" | "mma-sync"; "auto" | "shared-tile" |
// "registers"; "mma-sync" | "wgmma"; "on" | "off".
std::string_view mma_choice_name(MmaChoice choice);
std::string_view decode16_choice_name(Decode16Choice choice);
std::string_view tensor_core_path_name(TensorCorePath path);
std::string_view on_off_name(bool on);
std::optional<MmaChoice> parse_mma_choice(std::string_view text);
std::optional<Decode16Choice> parse_decode16_choice(std::string_view text);
std::optional<bool> parse_on_off(std::string_view text);

// describe()'s "kernel_variant": what was asked and, where it depends on the device, what runs:
//   {"mma": "wgmma", "mma_requested": "auto", "decode16": "auto", "host_plan": true,
//    "longest_first": true}
// "mma" is `mma_ran`, the instructions of the 64-row blocks on this device; "decode16" the choice
// as asked (auto picks per problem: kernels/mla_attention_variant.hpp).
nlohmann::json kernel_variant_json(const CudaKernelVariant& variant, TensorCorePath mma_ran);

}  // namespace kvaudit
