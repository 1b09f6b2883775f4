// Where the exact reference runs (`kvaudit check --reference`): the CPU loops of mla_reference.cpp,
// or the same algorithms as GPU kernels (mla_reference_cuda.hpp), with the same bound. A light
// header, so that the replay's options name the device without pulling in Boost.
#pragma once

#include <cstdint>
#include <string_view>

namespace kvaudit {

enum class ReferenceDevice : std::uint8_t { kCpu, kCuda };

std::string_view reference_device_name(ReferenceDevice device);  // "cpu", "cuda"
// Whether this build has the device's reference (cuda: built with KVAUDIT_CUDA).
bool reference_device_built(ReferenceDevice device);

}  // namespace kvaudit
