// The one place that turns metrics into pass/fail (docs/design.md "one place that turns results
// into a verdict"; src/verdict/run_judge.hpp applies it to a run). Limits are per comparison; the
// defaults are one table in policy.cpp, each row with where its number comes from (derived in
// policy.cpp's header comment and the README).
#pragma once

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "src/core/result.hpp"
#include "src/format/kvdump.hpp"
#include "src/verdict/metrics.hpp"

namespace kvaudit {

// kernel         backend vs R8 on the pool the backend read (its own pool after its writes)
// cache          R8 on that pool vs R8 on the reference replay's pool: what a corrupted cache costs
// quantization   R8 vs Rs;  total  backend vs Rs;  captured  the dump's out/lse vs R8
// captured_read  the dump's out/lse vs R8 on the server's pool (its captured kv_cache_after,
// carried
//                with the reference's writes to steps without one): the server's kernel on what
//                it read; made only once a captured pool differs from the replay
// captured_cache R8 vs R8 on the server's pool: what the server's corrupted cache costs
// captured_read and captured_cache are judged with the captured and the cache limits (they have no
// policy keys of their own) and are report-only (policy.cpp's header says why).
enum class Comparison {
  kKernel,
  kQuantization,
  kTotal,
  kCaptured,
  kCache,
  kCapturedRead,
  kCapturedCache
};
const char* comparison_name(Comparison comparison);  // "kernel" | "quantization" | ...
// The comparisons with limits of their own (the policy's keys), in report order: kernel, cache,
// captured, quantization, total.
const std::vector<Comparison>& all_comparisons();

// The limits a comparison may have, each bounding one metric (src/verdict/metrics.hpp).
enum class Limit { kMaxAbsOverRefMax, kRelL2, kCosDiff, kMaxUlpBf16, kLseMaxAbs };
// "max_abs_over_ref_max" | "rel_l2" | "cos_diff" | "max_ulp_bf16" | "lse_max_abs": the keys of
// report.json's policy object and of policy files.
const char* limit_name(Limit limit);
// Every limit, in report order: max_abs_over_ref_max, rel_l2, cos_diff, max_ulp_bf16,
// lse_max_abs.
const std::vector<Limit>& all_limits();

// A limit that is absent (std::nullopt) is not checked. NaN/Inf mismatches always fail.
struct ComparisonLimits {
  std::optional<double> max_abs_over_ref_max;  // max_abs / max|reference out|
  std::optional<double> rel_l2;
  std::optional<double> cos_diff;
  std::optional<double> max_ulp_bf16;
  std::optional<double> lse_max_abs;
  // Where each number comes from, by limit: written into reports.
  std::map<Limit, std::string> derivations;
};

std::optional<double> limit_value(const ComparisonLimits& limits, Limit limit);

// 2: a served scale may cost up to twice the error of the best scale measured before the sign-off
// calls it wrong. The error-versus-scale curve repeats with every factor of two, but it is not
// flat: on saturated_page16 two candidates that saturate nothing differ by 55% in held-out rel_l2
// (4.92e-2 vs 7.61e-2). 2x leaves room for that spread; it is a judgement, not a derived bound.
inline constexpr double kDefaultScaleErrorFactor = 2.0;

struct Policy {
  std::string name;        // "default", "signoff", or the policy file's name
  double rel_floor = 0.0;  // floor for max_rel denominators (reported, not judged)
  ComparisonLimits kernel;
  ComparisonLimits cache;
  ComparisonLimits captured;
  ComparisonLimits quantization;  // sign-off limits
  ComparisonLimits total;
  bool quantization_sets_exit = false;  // true under --signoff or when a policy file asks
  std::string rel_floor_derivation;
  // Diagnosis (judge_hypothesis): a hypothesis's replay must land within this fraction of the
  // candidate's distance from the reference, in (0, 1].
  double explain_fraction = 0.25;
  std::string explain_fraction_derivation;
  // Sign-off of the served scale (src/verdict/signoff.hpp): it fails when its FP8-storage out
  // rel_l2 exceeds the quantization rel_l2 limit, or this factor times the recommended scale's.
  double scale_error_factor = kDefaultScaleErrorFactor;
};

const ComparisonLimits& limits_for(const Policy& policy, Comparison comparison);
ComparisonLimits& limits_for(Policy& policy, Comparison comparison);

struct Judgement {
  bool pass = true;
  std::vector<std::string> reasons;  // "rel_l2 0.031 > 0.0156 (kernel limit)"
};

// The defaults of policy.cpp's table, each limit with its derivation.
Policy default_policy();
// Whether the FP8 kernels' model rounds dequantized K and V to bf16
// (kernels/mla_attention_model.hpp "Grouped pools"): a per_token_group pool (kvdump v1.1) unless
// every dequantized value is a bf16 value already (power-of-two or e8m0 scales with a bf16 RoPE
// part).
bool kernel_rounds_kv_to_bf16(const DumpAttributes& attrs);
// The kernel limits for such a kernel: the captured limits, derived for one bf16 rounding of K and
// V. Only kernel limits still at their default values change (a policy file's stay).
Policy with_bf16_dequantized_kernel(Policy policy);
Policy signoff_policy();
Result<Policy> load_policy(const std::filesystem::path& path);  // JSON, same keys as to_json
nlohmann::json to_json(const Policy& policy);
// A policy object as to_json writes it (report.json's "policy"), read over the default policy with
// load_policy's rules; errors name `file` and the key's JSON pointer below `pointer`
// ("part.json:/policy/kernel/rel_l2").
Result<Policy> policy_from_json(const nlohmann::json& object, const std::string& file,
                                const std::string& pointer);

Judgement judge(const Policy& policy, Comparison comparison, const ComparisonMetrics& metrics);

// Whether a hypothesis of the diagnosis (src/replay/diagnosis.hpp) can explain a failing
// comparison: `before` (the candidate against the comparison's reference) fails `comparison`'s
// limits, and `after` (the candidate against the reference recomputed under the hypothesis, on
// the same pool)
//  (1) has no NaN/Inf mismatch and passes those limits, the lse limit widened in proportion to the
//      hypothesis's lse magnitude past 2^7 (max |lse| of its reference; policy.cpp's header), and
//  (2) lands within policy.explain_fraction of the candidate's distance from the reference:
//      fraction = max over the compared metrics of after / before <= explain_fraction, the
//      compared metrics being out rel_l2 and lse_max_abs where `before` fails them (where it
//      fails neither: max_abs_over_ref_max).
// Whether it explains is then the diagnosis's call: it must also be the closest of the
// hypotheses tried (smallest fraction; those within kHypothesisTieRatio of it are
// indistinguishable). `reasons` say why it cannot explain; `excess` how far `after` is past the
// limits: the largest metric / limit ratio (<= 1 passes; +inf with a NaN/Inf mismatch, a NaN
// metric or a limit of 0 exceeded).
struct HypothesisJudgement {
  bool explains = false;  // passes_limits && within_fraction
  bool passes_limits = false;
  bool within_fraction = false;
  double fraction = 0.0;  // after / before, the largest over the compared metrics; +inf: NaN/Inf
  // The smallest after / before over the compared metrics and the out metrics the candidate
  // passes (rel_l2, max_abs_over_ref_max): how much closer the hypothesis brings the one metric
  // it helps most (a partial explanation: the search's combinations are anchored on it).
  double closest_metric_ratio = 0.0;
  std::vector<std::string> reasons;
  double excess = 0.0;
};
// Two hypotheses whose fractions are within this factor of each other cannot be told apart: the
// distance from a bf16-rounded candidate carries that kernel's own rounding (rel_l2 ~2^-9,
// policy.cpp's header), whose spread over a step's rows is of that order. A combination counts
// only when it is closer than each of its parts by this factor.
inline constexpr double kHypothesisTieRatio = 1.25;
// Where the candidate stores out in bf16 while the replays are computed in double, the fraction
// rule (2) compares each replay as the candidate stores it (docs/design.md "The rule"): `after`
// is the candidate against bf16(the hypothesis's out), `baseline` the candidate against bf16(the
// comparison's reference out), both with the lse as `after` and `before` read it. Requirement (1)
// and which metrics are compared stay on `after` and `before`.
struct StoredDistances {
  const ComparisonMetrics& baseline;
  const ComparisonMetrics& after;
};
HypothesisJudgement judge_hypothesis(const Policy& policy, Comparison comparison,
                                     const ComparisonMetrics& before,
                                     const ComparisonMetrics& after, double lse_magnitude,
                                     const StoredDistances* stored = nullptr);
// Whether a failing comparison of this kind sets the exit status under this policy. A NaN/Inf
// mismatch sets it whatever the kind (CheckRun::pass, fails_run in src/verdict/check_result.hpp).
bool comparison_sets_exit(const Policy& policy, Comparison comparison);

}  // namespace kvaudit
