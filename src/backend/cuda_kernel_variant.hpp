// The kernel variant of the CUDA backends (cuda-fp8, cuda-cast-bf16) and of `kvaudit bench`: which
// of several kernels that compute the same attention runs. Chosen once on the command line
// (--cuda-mma, --cuda-decode16, --cuda-host-plan, --cuda-longest-first; src/cli/cli.hpp
// add_cuda_variant_options), carried in BackendOptions to the backend and in every
// MlaAttentionProblem to the launcher, whose choice is a pure function of (problem, device,
// variant) made in one place (kernels/mla_attention.cu, "Kernel variant"). Every report and golden
// file records it (describe()'s "kernel_variant", kernel_variant_json below).
//
// What each choice changes in the results:
//   host_plan, longest_first  nothing: the same kernels run the same sums (bit-identical);
//   mma, decode16             the summation order of the same products (another kernel): results
//                             agree within the kernel error bound, not bit for bit.
// The defaults are what runs in production; the other values exist for A/B measurements and for
// bisecting a doubt about one path.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string_view>

namespace kvaudit {

// The tensor-core instructions of the 64-row blocks (decode above 32 heads, prefill and extend).
enum class MmaChoice : std::uint8_t {
  kAuto,     // wgmma where the binary has sm_90a code and the device runs it, else mma.sync
  kMmaSync,  // mma.sync everywhere
};

// The kernel of the 16-head decode blocks (at most 16 heads, one row per request).
enum class Decode16Choice : std::uint8_t {
  kAuto,        // the KV tile in registers when a split streams >= 8 tiles, else shared memory
  kSharedTile,  // always the shared-memory tile (mla_attention_kernel<1>)
  kRegisters,   // always the register tile (mla_decode_registers_kernel)
};

struct CudaKernelVariant {
  MmaChoice mma = MmaChoice::kAuto;
  Decode16Choice decode16 = Decode16Choice::kAuto;
  bool host_plan = true;      // locate the rows of a problem of at most 16 rows on the host
  bool longest_first = true;  // prefill and extend: start the longest row groups first

  bool operator==(const CudaKernelVariant&) const = default;
};

// The instructions the 64-row blocks actually run (MmaChoice resolved on a device).
enum class TensorCorePath : std::uint8_t { kMmaSync, kWgmma };

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
// as asked (auto picks per problem, by the rule above).
nlohmann::json kernel_variant_json(const CudaKernelVariant& variant, TensorCorePath mma_ran);

}  // namespace kvaudit
