// The sign-off rule: a verdict rests only on what was measured. Quantization error (R8 vs Rs) and
// total error (backend vs Rs) need the source value of every token a step reads; a step-layer
// whose tokens lack one (no kv_source, and written before the dump's first step), or a run
// without a backend (no total), leaves them unmeasured there. Under a policy that judges them
// (--signoff, or a policy file with quantization_sets_exit) such a gap fails the run: a sign-off
// cannot pass on what it never measured. Under the default policy gaps are reported, not judged.
//
// The replay records what each reported (step, layer) read (CheckRun::coverage); the gaps are the
// coverage sites without a quantization or total result, grouped per layer, comparison and reason.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "src/verdict/check_result.hpp"

namespace kvaudit {

enum class GapReason {
  kNoSource,   // some token the step reads has no source value
  kNoBackend,  // --backend none: no backend output to compare with Rs (total only)
};
const char* gap_reason_name(GapReason reason);  // "no_source" | "no_backend"
// "the tokens the steps read have no source value: no kv_source" | "no backend ran".
const char* gap_reason_text(GapReason reason);

// One layer's unmeasured comparison, and the steps where it is missing.
struct MeasurementGap {
  int layer_id = 0;
  Comparison comparison = Comparison::kQuantization;  // kQuantization or kTotal
  GapReason reason = GapReason::kNoSource;
  std::vector<int> steps;  // ascending
  // At the first of those steps (kNoSource): tokens read, and how many have no source value.
  std::int64_t tokens_read = 0;
  std::int64_t tokens_without_source = 0;
};

// Every gap of the run, by layer (in coverage order), then quantization before total.
std::vector<MeasurementGap> measurement_gaps(const CheckRun& run);

// (step, layer, comparison) sites the gaps cover (RunCounts::unmeasured).
std::size_t unmeasured_sites(const std::vector<MeasurementGap>& gaps);

// Whether the gaps fail the run: the policy judges quantization and total, and some are missing.
bool gaps_fail_run(const CheckRun& run);

// The headline: "quantization and total error not measured in layers 0, 1 (the tokens the steps
// read have no source value: no kv_source)"; one clause per distinct (comparisons, reason); empty
// when nothing is missing.
std::string gaps_headline(const std::vector<MeasurementGap>& gaps);

// ---- The served scale (CheckRun::scales, from `kvaudit calibrate`) ------------------------------
// One rule: a layer's served scale fails the sign-off when its FP8-storage error (out rel_l2)
// exceeds the policy's quantization rel_l2 limit, or exceeds scale_error_factor times the
// recommended scale's. The cause named: saturation (values past 464 * s under the served scale),
// underflow (more values subnormal or flushed to 0 than under the recommended scale), both, or
// neither (the error of that scale's rounding alone).
enum class ScaleCause { kSaturation, kUnderflow, kBoth, kNeither };
const char* scale_cause_name(ScaleCause cause);  // "saturation" | "underflow" | "both" | "neither"

struct ScaleFailure {
  int layer_id = 0;
  ScaleCause cause = ScaleCause::kNeither;
  // "layer 1: the served kv_scale 1 costs out rel_l2 0.232 (over the quantization limit 0.0625
  // and 2x the recommended scale's 0.0399): saturation (0.3% of the values past 464*s); use
  // k_scale = v_scale = 2.69642854 (amax/448)"
  std::string sentence;
};

// Whether one layer's served scale fails, and why (nullopt: it passes).
std::optional<ScaleFailure> judge_served_scale(const Policy& policy, const LayerScaleCheck& layer);
// Every failing layer of the run, in CheckRun::scales order.
std::vector<ScaleFailure> scale_failures(const CheckRun& run);
// Whether they fail the run: the policy judges quantization (sign-off) and some layer fails.
bool scales_fail_run(const CheckRun& run);

}  // namespace kvaudit
