// --cuda-mma, --cuda-decode16, --cuda-host-plan, --cuda-longest-first (src/cli/cli.hpp): parsed
// and validated here, once, into a CudaKernelVariant.
#include <fmt/format.h>

#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "src/cli/cli.hpp"

namespace kvaudit {
namespace {

// Group headings are not wrapped: short.
constexpr const char* kGroup = "CUDA kernel variant";

// An option whose value is one of `names`, stored by `set` (which parses it: the validator has
// already refused anything else; an empty value is left to refuse_empty_values' message).
CLI::Option* add_choice(CLI::App& cmd, const std::string& name, std::vector<std::string> names,
                        std::function<void(const std::string&)> set,
                        const std::string& description) {
  const std::string valid = fmt::format("{}", fmt::join(names, ", "));
  const CLI::Validator one_of(
      [names, valid](std::string& text) -> std::string {
        if (text.empty()) return {};  // refuse_empty_values says so, as for every option
        for (const std::string& allowed : names) {
          if (text == allowed) return {};
        }
        return fmt::format("'{}' is not one of {}", text, valid);
      },
      "", "");
  return cmd.add_option_function<std::string>(name, std::move(set), description)
      ->check(one_of)
      ->type_name(fmt::format("{}", fmt::join(names, "|")))
      ->group(kGroup);
}

}  // namespace

void add_cuda_variant_options(CLI::App& cmd, CudaVariantOptions& options) {
  CudaKernelVariant& v = options.variant;
  options.options = {
      add_choice(
          cmd, "--cuda-mma", {"auto", "mma-sync"},
          [&v](const std::string& text) {
            if (const auto choice = parse_mma_choice(text)) v.mma = *choice;
          },
          "For cuda-fp8, cuda-cast-bf16 and bench; the choice is recorded in report.json and "
          "golden files (backend_description.kernel_variant). Tensor-core instructions of the "
          "64-row blocks (decode above 32 heads, prefill and extend): auto runs wgmma where this "
          "kvaudit has sm_90a code and the device runs it, "
          "else mma.sync; mma-sync forces mma.sync everywhere. Another summation order: results "
          "agree within the kernel error bound, not bit for bit (default: auto)"),
      add_choice(
          cmd, "--cuda-decode16", {"auto", "shared-tile", "registers"},
          [&v](const std::string& text) {
            if (const auto choice = parse_decode16_choice(text)) v.decode16 = *choice;
          },
          "Kernel of the decode blocks of at most 16 heads: auto keeps the KV tile in registers "
          "when a split streams at least 8 tiles of 64 tokens, else passes it through shared "
          "memory; shared-tile or registers forces one. Within the kernel error bound, not bit "
          "for bit (default: auto)"),
      add_choice(
          cmd, "--cuda-host-plan", {"on", "off"},
          [&v](const std::string& text) {
            if (const auto on = parse_on_off(text)) v.host_plan = *on;
          },
          "on: a step of at most 16 query rows has its rows located on the host and passed in "
          "the launch; off: the kernels locate them. Bit-identical results (default: on)"),
      add_choice(
          cmd, "--cuda-longest-first", {"on", "off"},
          [&v](const std::string& text) {
            if (const auto on = parse_on_off(text)) v.longest_first = *on;
          },
          "on: prefill and extend start their longest row groups first; off: in row order. "
          "Bit-identical results (default: on)"),
  };
}

Status check_cuda_variant_applies(const CudaVariantOptions& options, const std::string& backend) {
  if (backend == "cuda-fp8" || backend == "cuda-cast-bf16") return ok_status();
  for (const CLI::Option* option : options.options) {
    if (option->count() == 0) continue;
    return bad_input(
        option->get_name(),
        fmt::format("chooses a kernel of the CUDA backends (cuda-fp8, cuda-cast-bf16); "
                    "--backend is {}",
                    backend));
  }
  return ok_status();
}

std::string cuda_variant_arguments(const CudaKernelVariant& variant, const char* separator) {
  const CudaKernelVariant defaults;
  std::string text;
  if (variant.mma != defaults.mma) {
    text += fmt::format("{}--cuda-mma {}", separator, mma_choice_name(variant.mma));
  }
  if (variant.decode16 != defaults.decode16) {
    text += fmt::format("{}--cuda-decode16 {}", separator, decode16_choice_name(variant.decode16));
  }
  if (variant.host_plan != defaults.host_plan) {
    text += fmt::format("{}--cuda-host-plan {}", separator, on_off_name(variant.host_plan));
  }
  if (variant.longest_first != defaults.longest_first) {
    text += fmt::format("{}--cuda-longest-first {}", separator, on_off_name(variant.longest_first));
  }
  return text;
}

}  // namespace kvaudit
