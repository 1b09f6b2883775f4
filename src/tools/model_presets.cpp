// Model presets and the softmax scale their attention derives (see model_presets.hpp).
#include "src/tools/model_presets.hpp"

#include <array>
#include <cmath>

namespace kvaudit {
namespace {

// Dimensions from each model's config.json (num_attention_heads, kv_lora_rank,
// qk_nope_head_dim, qk_rope_head_dim, v_head_dim, rope_scaling).
constexpr std::array<ModelPreset, 3> kPresets = {{
    {"GLM-5", 64, 512, 192, 64, 256, std::nullopt},
    {"DeepSeek-V3", 128, 512, 128, 64, 128, YarnRope{40.0, 1.0}},
    {"DeepSeek-V3.2", 128, 512, 128, 64, 128, YarnRope{40.0, 1.0}},
}};

}  // namespace

std::span<const ModelPreset> model_presets() { return kPresets; }

const ModelPreset* find_model_preset(std::string_view name) {
  for (const ModelPreset& preset : kPresets) {
    if (preset.name == name) return &preset;
  }
  return nullptr;
}

double yarn_mscale(double factor, double mscale_all_dim) {
  if (factor <= 1.0) return 1.0;
  return 0.1 * mscale_all_dim * std::log(factor) + 1.0;
}

double preset_softmax_scale(const ModelPreset& preset) {
  const double qk_head_dim = preset.qk_nope_head_dim + preset.qk_rope_head_dim;
  const double base = 1.0 / std::sqrt(qk_head_dim);
  if (!preset.yarn || preset.yarn->mscale_all_dim == 0.0) return base;
  const double mscale = yarn_mscale(preset.yarn->factor, preset.yarn->mscale_all_dim);
  return base * mscale * mscale;
}

}  // namespace kvaudit
