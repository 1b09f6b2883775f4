// Diagnosis of convention mismatches (docs/design.md "Diagnosis"): when a kernel or captured
// comparison fails for a (step, layer), try a catalogue of known mismatches and say which, if any,
// explains the data, i.e. brings the error down to a clean kernel's level.
//
// Each hypothesis is a variation of the R8 computation (or, for an output convention, of how the
// candidate's outputs are read), recomputed for the failing (step, layer) on the same pool the
// candidate read. Per query row i, head h, over its visible tokens t, with (c_t, r_t) the pool row
// decoded under the hypothesis (latent part [Dc], rope part [Dr], unscaled):
//   s_t = sm' * (a * q_nope[i,h,:] . c_t + b * q_pe[i,h,:] . r_t)
//   m = max_t s_t,  w_t = exp(s_t - m),  l = sum_t w_t,  p_t = w_t (or e4m3(w_t): p-e4m3)
//   out[i,h] = a * sum_t p_t c_t / l  [Dc],   lse[i,h] = m + ln l
// where a (latent multiplier), b (rope multiplier) and sm' come from kv_scale and sm_scale by the
// hypothesis's rules; R8 itself is a = b = kv_scale, sm' = sm_scale, e4m3 decoding, p = w.
// Shapes: q_nope [Nq, H, Dc], q_pe [Nq, H, Dr], pool [S, Dc + Dr], out [Nq, H, Dc], lse [Nq, H].
// The variants are evaluated in plain double (~1e-16 relative, far below the clean-kernel level
// they are judged at, 2^-8); the exact reference (references/mla_reference.hpp) stays the one
// every verdict is made against. A hypothesis that changes nothing here (kv_scale already a power
// of two for a rounding, 1 for "not applied", a bf16 pool for an FP8 variant) is not applicable.
//
// Whether a hypothesis explains the failure is the verdict's call (judge_hypothesis,
// src/verdict/policy.hpp): the candidate against the hypothesis's reference passes the failing
// comparison's limits. Every hypothesis that explains is reported; two or more are
// indistinguishable on this data (and the same computation when they resolve to the same
// numbers, e.g. kv_scale rounded down and to the nearest power of two); none: the closest is named.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <span>
#include <utility>
#include <vector>

#include "src/core/result.hpp"
#include "src/format/kvdump.hpp"
#include "src/verdict/check_result.hpp"
#include "src/verdict/divergence.hpp"
#include "src/verdict/policy.hpp"

namespace kvaudit {

enum class Hypothesis : std::uint8_t {
  kLseBase2,
  kScalePow2Floor,
  kScalePow2Nearest,
  kScaleE8m0,
  kScaleBf16,
  kScaleReciprocal,
  kScaleSquared,
  kScaleNotApplied,
  kScaleLatentOnly,
  kSmScaleMissing,
  kSmScaleLog2e,
  kReadAsE5m2,
  kReadAsBf16,
  kProbabilitiesE4m3,
  kDequantBf16,
};

// How a hypothesis derives a KV multiplier from kv_scale s (all in fp32, as a kernel would).
enum class ScaleRule : std::uint8_t {
  kAsIs,         // s
  kPow2Floor,    // 2^floor(log2 s)
  kPow2Nearest,  // power_of_two_scale(s) (src/backend/injection.hpp): 2^round(log2 s), 2s when
                 // s already is a power of two (the scale-mismatch injection)
  kE8m0,         // 2^ceil(log2 s): __nv_cvt_float_to_e8m0(s, ..., cudaRoundPosInf)
  kBf16,         // bf16(s), nearest even
  kReciprocal,   // fp32(1 / s)
  kSquared,      // fp32(s * s)
  kOne,          // 1: not applied
};
enum class SmScaleRule : std::uint8_t { kAsIs, kOne, kTimesLog2e };
// How the pool's bytes are decoded (an FP8 pool; a bf16 pool is always read as stored).
enum class PoolRead : std::uint8_t {
  kAsStored,   // e4m3fn codes (or bf16 values)
  kE5m2,       // each byte as an e5m2 code (Inf and NaN codes included)
  kBf16Bytes,  // the byte buffer addressed as a [S, D] bf16 array, as the fp8-read-as-bf16
               // injection reads it (src/backend/mla_attention_cpu.cpp): element j of slot t is the
               // little-endian bf16 at bytes 2 (t D + j), 2 (t D + j) + 1; 0 past the buffer
  kDequantBf16,  // each element dequantized in bf16 arithmetic: bf16(e4m3(code) * bf16(s)), the
                 // scale s = kv_scale folded into the row (multipliers a = b = 1); FlashInfer's
                 // FP8 MLA kernels (0.6.x) repack FP8 tiles to bf16 this way (__hmul2)
};
enum class WeightRounding : std::uint8_t { kNone, kE4m3 };  // p_t before P.V
enum class LseBase : std::uint8_t { kNatural, kTwo };       // how the candidate's lse is read

// A hypothesis's transform, as values: what it changes in the R8 computation and in how the
// candidate's outputs are read.
struct Transform {
  ScaleRule latent_scale = ScaleRule::kAsIs;  // a: multiplies c_t (scores and out)
  ScaleRule rope_scale = ScaleRule::kAsIs;    // b: multiplies r_t (scores)
  SmScaleRule sm_scale = SmScaleRule::kAsIs;
  PoolRead read = PoolRead::kAsStored;
  WeightRounding weights = WeightRounding::kNone;
  LseBase candidate_lse = LseBase::kNatural;
};

struct HypothesisInfo {
  Hypothesis id;
  const char* name;         // "scale-pow2-floor": what reports print
  const char* description;  // what it models, one line (--list-diagnoses)
  Transform transform;
};

// The catalogue, in the order hypotheses are tried and reported.
std::span<const HypothesisInfo> hypothesis_catalogue();
const HypothesisInfo& hypothesis_info(Hypothesis hypothesis);
const char* hypothesis_name(Hypothesis hypothesis);

// A transform resolved for one layer: the numbers the computation uses. Two hypotheses that
// resolve to equal variants are the same computation on this layer.
struct ResolvedVariant {
  double latent_scale = 1.0;  // a
  double rope_scale = 1.0;    // b
  double sm_scale = 0.0;      // sm'
  PoolRead read = PoolRead::kAsStored;
  WeightRounding weights = WeightRounding::kNone;
  LseBase candidate_lse = LseBase::kNatural;
  bool operator==(const ResolvedVariant&) const = default;
  // The same attention (the candidate's lse may still be read differently).
  bool same_computation(const ResolvedVariant& other) const;
};

double apply_scale_rule(ScaleRule rule, float kv_scale);
ResolvedVariant resolve(const Transform& transform, float kv_scale, double sm_scale);
// What `variant` changes against R8's own variant (`identity`), for reports:
// "kv_scale 0.0029 read as 0.001953125".
std::string describe_variant(const ResolvedVariant& variant, const ResolvedVariant& identity);

// The visible rows of a pool decoded under a PoolRead, unscaled, [n, D] floats (every e4m3, e5m2
// and bf16 value is a float).
class DecodedRows {
 public:
  // `kv_scale` is used by kDequantBf16 only (the other reads are unscaled).
  static DecodedRows decode(const KvPool& pool, PoolRead read,
                            std::span<const std::int64_t> visible, float kv_scale = 1.0f);
  // nullptr for a slot that was not decoded.
  const float* row(std::int64_t slot) const;
  int row_width() const { return row_width_; }

 private:
  std::vector<float> values_;
  std::vector<std::int64_t> index_;  // slot -> row of values_, -1: not decoded
  int row_width_ = 0;
};

// The attention of the header under `variant` (its computation; candidate_lse is not used here),
// plain double, every core (threads = 0). out [Nq, H, Dc], lse [Nq, H].
Status variant_attention(const DumpAttributes& attrs, const StepMeta& step,
                         std::span<const float> q_nope, std::span<const float> q_pe,
                         const DecodedRows& rows, const ResolvedVariant& variant,
                         std::span<double> out, std::span<double> lse, int threads);

// One failing comparison of one (step, layer), with what its candidate read.
struct DiagnosisInput {
  const DumpAttributes& attrs;
  const StepMeta& step;
  const StepLayerTensors& tensors;  // q_nope, q_pe
  float kv_scale;
  const KvPool& pool;                     // the pool the candidate read
  std::span<const std::int64_t> visible;  // the slots the step's rows read
  const ComparisonResult& failed;         // step, layer, comparison and its metrics
  TensorShape3 shape;                     // of the comparison (dims 0: an lse-only capture)
  OutputView reference;                   // what it was judged against (R8 or R8')
  OutputView candidate;
  const Policy& policy;
  int threads = 0;
};

Result<DiagnosisFinding> diagnose(const DiagnosisInput& input);

inline constexpr int kDefaultDiagnoseLimit = 4;

// At most `limit` (step, layer)s are diagnosed per run, the earliest (step, then layer in dump
// order) first. The replay runs layer by layer, so a later layer may bring an earlier step: the
// budget keeps the earliest sites seen so far, and a site is diagnosed only while it ranks among
// them (at most `limit` diagnoses per layer, usually far fewer).
class DiagnosisBudget {
 public:
  explicit DiagnosisBudget(int limit) : limit_(limit) {}
  // Records a failing site; true when it is to be diagnosed now.
  bool admit(int step, std::size_t layer_order);
  void add(int step, std::size_t layer_order, DiagnosisFinding finding);
  std::vector<DiagnosisFinding> findings() const;  // by step, then layer order
  std::size_t failing_sites() const { return failing_.size(); }
  std::size_t diagnosed_sites() const { return kept_.size(); }
  int limit() const { return limit_; }

 private:
  using Site = std::pair<int, std::size_t>;
  int limit_;
  std::set<Site> failing_;
  std::map<Site, std::vector<DiagnosisFinding>> kept_;
};

}  // namespace kvaudit
