// `kvaudit calibrate`: which kv_scale should this cache use? Per layer, from the dump's kv_source
// (the unquantized rows) and its steps' queries, what FP8 storage costs under candidate scales.
//
// Shapes (H heads, Dc latent, Dr RoPE, D = Dc + Dr, Nq rows of a step, S slots):
//   source rows x [S, D] (kv_source, then each step's new_kv [Nq, D] written to its slots),
//   q_nope [Nq, H, Dc], q_pe [Nq, H, Dr], out [Nq, H, Dc], lse [Nq, H].
// The values: every source row some step's attention reads (a cached token's kv_source row, each
// new_kv row), counted once per value it holds. MLA caches one tensor: the latent is both K and V
// (k_scale = v_scale), so one per-tensor scale s serves the whole row (latent and RoPE).
//
// Statistics per part (latent [0, Dc), RoPE [Dc, D)): amax = max |x|, percentiles of |x|
// (nearest rank), and under a scale s, with q = fp32(x / s) and the dump's write rule
// code = e4m3_rne_satfinite(q) (docs/kvdump-v1.md; a per_token_group pool: its group scales):
//   saturated   |q| > 464 (the midpoint past 448): satfinite stores +-448; PyTorch's
//               .to(torch.float8_e4m3fn), as servers call it, stores NaN for the same values;
//   subnormal   0 < |code value| < 2^-6 (3 bits or fewer of precision left);
//   flushed     x != 0 stored as code 0.
//
// The error FP8 storage alone causes under s, per layer over a set of steps T:
//   Rs = attention on x, R8(s) = attention on s * e4m3(x / s)   (the reference's formulas,
//   references/mla_reference.hpp), over every (step in T, row i, head h):
//   out_rel_l2 = sqrt(sum ||R8 - Rs||^2 / sum ||Rs||^2),  lse_err = max |lse8 - lses|,
//   worst row  = the (step, row) of the largest sqrt(sum_h ||R8 - Rs||^2 / sum_h ||Rs||^2).
// Rs is the exact reference (double-double); the candidates' R8 are plain binary64
// (mla_reference_attention<double>, ~1e-16 relative, far below the 2^-4 quantization level); the
// recommended scale's R8 is recomputed with the exact reference and reported as confirmed.
//
// Candidates: r = fp32(amax / 448) (amax over the whole row of every step), 2^ceil(log2 r) (a power
// of two rounded up: rounding down would overflow amax), the dump's kv_scale, 1.0, then a sweep
// b * 2^(+-1/2) around the best b of those on the selection steps (where nothing saturates
// the curve repeats with every factor of two, so wider points would add little).
// Held out: steps are split by index, even = selection, odd = held out (one step: none held out,
// said so). The recommendation is r unless another candidate's selection out_rel_l2 is below
// `margin` times r's (CalibrationOptions::margin); its held-out error is what it is judged by.
// Flat: every candidate at or above r within 2r (none saturating) has a selection out_rel_l2
// within a factor 1 + flat_tolerance of r's: the choice hardly matters there.
// per_token_group dumps (v1.1) compute scales at write time: the candidates are the write rule
// (amax / 448 per group) with float32 and with power-of-two group scales, against the per-tensor
// rule r over the whole row; headroom = 448 / max |code value| over the latent.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "src/core/result.hpp"
#include "src/format/kvdump.hpp"

namespace kvaudit {

enum class CandidateKind : std::uint8_t {
  kAmaxRule,      // fp32(amax / 448)
  kAmaxRulePow2,  // 2^ceil(log2(amax / 448))
  kDumpScale,     // the dump's kv_scale
  kUnit,          // 1.0 (a server's default where the checkpoint has no scale)
  kSweep,         // b * 2^(+-1/2) around the best
  kGroupFloat32,  // per_token_group: amax / 448 per group (fp32 scales)
  kGroupPow2,     // per_token_group: power-of-two group scales, rounded up
};
const char* candidate_kind_name(CandidateKind kind);  // "amax/448", "pow2-up(amax/448)", ...

struct PartStats {
  std::int64_t count = 0;      // finite values: the statistics are over these
  std::int64_t nonfinite = 0;  // NaN or +-Inf in kv_source (the format allows NaN), left out
  double amax = 0.0;
  double p50 = 0.0, p90 = 0.0, p99 = 0.0, p999 = 0.0;
  std::int64_t saturated = 0;  // under the scale the statistics were taken with
  std::int64_t subnormal = 0;
  std::int64_t flushed = 0;
  double max_code = 0.0;  // largest |code value| (headroom = 448 / max_code)
};

struct StorageError {
  double out_rel_l2 = 0.0;
  double lse_max_abs = 0.0;
  double worst_row_rel_l2 = 0.0;
  int worst_step = -1;
  int worst_row = -1;
  bool measured = false;  // false: the step set is empty
};

struct CandidateResult {
  CandidateKind kind = CandidateKind::kAmaxRule;
  float scale = 1.0f;  // per-tensor candidates; the RoPE multiplier for group candidates
  PartStats latent;    // saturation / underflow under this candidate
  PartStats rope;
  StorageError selection;
  StorageError held_out;
  StorageError all;
};

struct LayerCalibration {
  int layer_id = 0;
  float dump_scale = 1.0f;
  bool grouped = false;
  PartStats latent;  // |x| statistics, and saturation / underflow under the dump's own scale
  PartStats rope;
  std::vector<CandidateResult> candidates;
  int recommended = 0;  // index into candidates; -1: none (no finite nonzero amax, `reason`)
  bool flat = false;
  StorageError confirmed;  // the recommended scale, exact reference, held-out steps (else all)
  bool confirmed_on_held_out = false;
  std::string reason;  // one sentence: why this one
};

struct CalibrationOptions {
  // Another candidate replaces the rule r when its selection out_rel_l2 < margin * r's.
  double margin = 0.75;
  double flat_tolerance = 0.25;
  int threads = 0;             // 0: every core
  std::vector<int> layer_ids;  // empty: every layer
};

struct Calibration {
  std::string dump;
  std::string model;       // the dump's model attribute
  std::string write_rule;  // "satfinite (kvdump write rule)"
  std::vector<int> selection_steps;
  std::vector<int> held_out_steps;
  std::vector<LayerCalibration> layers;
  double seconds = 0.0;
};

// Bad input (one line naming the file and what is missing) when a layer has no kv_source.
Result<Calibration> calibrate_dump(const DumpReader& reader, const CalibrationOptions& options);

// The plain-text report (stdout of `kvaudit calibrate`).
std::string format_calibration(const Calibration& calibration);

// Everything measured, as JSON (`kvaudit calibrate --json FILE`): per layer the statistics, every
// candidate's figures, and the recommendation as k_scale = v_scale (MLA's one cache tensor).
nlohmann::json calibration_json(const Calibration& calibration);

// The recommended scales in the forms servers load (docs/calibrate.md "Putting the scales into a
// checkpoint"); per_token_group layers have none (their scales are computed at write time).
//   quantization_param_json: {"model_type", "kv_cache": {"dtype": "float8_e4m3fn",
//     "scaling_factor": {"<tp rank>": {"<layer id>": s}}}}, the same s for every rank 0..tp_size-1
//     (--quantization-param-path of SGLang; vLLM's kv_cache_scales_loader reads the same schema);
//   scales_safetensors: one float32 scalar per layer and name,
//     "model.layers.<id>.self_attn.k_scale" and ".v_scale" (equal: MLA's one cache tensor), the
//     per-layer names compressed-tensors / llm-compressor checkpoints carry.
//     model_type: `model_type`, or null where it is empty. QuantParamSchema (vLLM, SGLang) has
//     `model_type: Optional[str]` with no default (the key is required, null accepted) and
//     compares it with the checkpoint config's model_type ("deepseek_v3", "glm_moe_dsa"), not a
//     display name such as the dump's model attribute.
//   Layers without a recommendation (no finite nonzero amax) have no entry either.
nlohmann::json quantization_param_json(const Calibration& calibration,
                                       const std::string& model_type, int tp_size);
// One warning line where the exported layer ids are not 0..N-1 (a --layers subset, a dump with
// some layers, a layer without a recommendation): servers expect a scale for every layer
// (QuantParamSchema refuses a rank map of another length). Empty where they are complete.
std::string incomplete_layers_warning(const Calibration& calibration);
std::string scales_safetensors(const Calibration& calibration);

}  // namespace kvaudit
