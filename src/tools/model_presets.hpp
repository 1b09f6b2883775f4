// Model presets: the attention dimensions and RoPE configuration of the models kvaudit's
// synthetic dumps are shaped like, and the softmax scale each model's attention code derives
// from them (not a constant: GLM-5 and DeepSeek-V3 differ in qk_nope_head_dim and in YaRN).
//
// The math (Hugging Face transformers, GlmMoeDsaAttention / DeepseekV3Attention / DeepseekV32
// Attention __init__; checked against transformers 5.25.0):
//   qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
//   sm_scale    = qk_head_dim^-0.5             no YaRN, or YaRN without mscale_all_dim
//   sm_scale    = qk_head_dim^-0.5 * mscale^2  YaRN with mscale_all_dim != 0
//   mscale      = 1                            when factor <= 1
//               = 0.1 * mscale_all_dim * ln(factor) + 1   otherwise (yarn_get_mscale)
// The scale multiplies q . k over the whole qk_head_dim in the expanded form, and the same
// q_nope . W_UK . c + q_pe . k_pe over Dc + Dr in the absorbed form kvaudit replays: the
// absorption changes the dimension of the dot product, never its scale.
//
//   GLM-5 (zai-org/GLM-5, glm_moe_dsa):  192 + 64 = 256, no mscale_all_dim  -> 1/16
//   DeepSeek-V3 / V3.2:                  128 + 64 = 192, YaRN factor 40, mscale_all_dim 1
//                                        -> 192^-0.5 * (0.1 ln 40 + 1)^2 = 0.135234...
#pragma once

#include <optional>
#include <span>
#include <string_view>

namespace kvaudit {

// YaRN rope scaling as the model's config.json states it (rope_scaling / rope_parameters).
struct YarnRope {
  double factor = 1.0;
  double mscale_all_dim = 0.0;  // 0: the attention scale is not changed
};

struct ModelPreset {
  std::string_view name;
  int num_heads = 0;
  int kv_lora_rank = 0;
  int qk_nope_head_dim = 0;
  int qk_rope_head_dim = 0;
  int v_head_dim = 0;
  std::optional<YarnRope> yarn;
};

// The presets kvaudit knows (GLM-5, DeepSeek-V3, DeepSeek-V3.2).
std::span<const ModelPreset> model_presets();

// The preset of that exact name, or none.
const ModelPreset* find_model_preset(std::string_view name);

// yarn_get_mscale(factor, mscale_all_dim): 1 for factor <= 1.
double yarn_mscale(double factor, double mscale_all_dim);

// The softmax scale the model's attention applies (see the header comment).
double preset_softmax_scale(const ModelPreset& preset);

}  // namespace kvaudit
