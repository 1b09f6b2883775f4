// The diagnosis of convention mismatches (math, shapes and the catalogue's meaning:
// diagnosis.hpp). Work is split over (row, head) pairs as in the reference; each pair makes two
// passes over its visible tokens (scores, then weights and P.V), in double.
#include "src/replay/diagnosis.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <limits>
#include <string>

#include "src/backend/injection.hpp"
#include "src/core/fp8_e4m3.hpp"
#include "src/core/parallel_for.hpp"
#include "src/format/step_indices.hpp"

namespace kvaudit {
namespace {

constexpr double kLog2e = 1.4426950408889634074;
constexpr double kLn2 = 0.69314718055994530942;

// Shorthands for the table.
constexpr Transform scaled(ScaleRule rule) { return {rule, rule}; }
constexpr Transform with_sm(SmScaleRule rule) {
  Transform t;
  t.sm_scale = rule;
  return t;
}
constexpr Transform with_read(PoolRead read) {
  Transform t;
  t.read = read;
  return t;
}

constexpr HypothesisInfo kCatalogue[] = {
    {Hypothesis::kLseBase2, "lse-base-2",
     "the candidate's lse is log2 of the softmax sum (FlashInfer's convention): compared as "
     "lse * ln 2",
     Transform{ScaleRule::kAsIs, ScaleRule::kAsIs, SmScaleRule::kAsIs, PoolRead::kAsStored,
               WeightRounding::kNone, LseBase::kTwo}},
    {Hypothesis::kScalePow2Floor, "scale-pow2-floor",
     "kv_scale rounded down to a power of two, 2^floor(log2 s)", scaled(ScaleRule::kPow2Floor)},
    {Hypothesis::kScalePow2Nearest, "scale-pow2-nearest",
     "kv_scale rounded to the nearest power of two in log2, 2^round(log2 s) (2s when s already "
     "is one: the scale-mismatch injection)",
     scaled(ScaleRule::kPow2Nearest)},
    {Hypothesis::kScaleE8m0, "scale-e8m0",
     "kv_scale converted to e8m0 rounding up (__nv_cvt_float_to_e8m0, cudaRoundPosInf): "
     "2^ceil(log2 s)",
     scaled(ScaleRule::kE8m0)},
    {Hypothesis::kScaleBf16, "scale-bf16", "kv_scale rounded to bf16 (nearest even)",
     scaled(ScaleRule::kBf16)},
    {Hypothesis::kScaleReciprocal, "scale-reciprocal",
     "kv_scale applied as its reciprocal, fp32(1 / s)", scaled(ScaleRule::kReciprocal)},
    {Hypothesis::kScaleSquared, "scale-squared", "kv_scale applied twice, fp32(s * s)",
     scaled(ScaleRule::kSquared)},
    {Hypothesis::kScaleNotApplied, "scale-not-applied",
     "kv_scale not applied: the FP8 codes read as the values", scaled(ScaleRule::kOne)},
    {Hypothesis::kScaleLatentOnly, "scale-latent-only",
     "kv_scale applied to the latent part (the first Dc columns: K and V) only; the rope part "
     "read unscaled",
     Transform{ScaleRule::kAsIs, ScaleRule::kOne}},
    {Hypothesis::kSmScaleMissing, "sm-scale-missing",
     "the softmax scale not applied (sm_scale = 1)", with_sm(SmScaleRule::kOne)},
    {Hypothesis::kSmScaleLog2e, "sm-scale-log2e",
     "the softmax scale with log2(e) folded in, used with exp: scores multiplied by log2 e",
     with_sm(SmScaleRule::kTimesLog2e)},
    {Hypothesis::kReadAsE5m2, "fp8-read-as-e5m2",
     "the FP8 bytes decoded as e5m2 instead of e4m3fn (times kv_scale)",
     with_read(PoolRead::kE5m2)},
    {Hypothesis::kReadAsBf16, "fp8-read-as-bf16",
     "the FP8 pool addressed as a [S, D] bf16 array (the kv_data_type mix-up, as the injection "
     "reads it: element j of slot t from bytes 2 (t D + j), 0 past the buffer; times kv_scale)",
     with_read(PoolRead::kBf16Bytes)},
    {Hypothesis::kProbabilitiesE4m3, "p-e4m3",
     "the softmax weights exp(s - m) (m: the row's max) rounded to e4m3 (satfinite) before P.V; "
     "the normaliser l summed unrounded",
     Transform{ScaleRule::kAsIs, ScaleRule::kAsIs, SmScaleRule::kAsIs, PoolRead::kAsStored,
               WeightRounding::kE4m3}},
    {Hypothesis::kDequantBf16, "dequant-bf16",
     "each K/V element dequantized in bf16 arithmetic, bf16(code * bf16(kv_scale)), before the "
     "bf16 MMAs (FlashInfer 0.6's FP8 MLA repack of FP8 tiles to bf16)",
     Transform{ScaleRule::kOne, ScaleRule::kOne, SmScaleRule::kAsIs, PoolRead::kDequantBf16}},
};

// s = f * 2^e with f in [0.5, 1): floor(log2 s) = e - 1, and s is a power of two iff f = 0.5.
float pow2_floor(float s) {
  int exponent = 0;
  std::frexp(s, &exponent);
  return std::ldexp(1.0f, exponent - 1);
}

float pow2_ceil(float s) {
  int exponent = 0;
  const float fraction = std::frexp(s, &exponent);
  return fraction == 0.5f ? s : std::ldexp(1.0f, exponent);
}

double sm_scale_of(SmScaleRule rule, double sm_scale) {
  switch (rule) {
    case SmScaleRule::kAsIs:
      return sm_scale;
    case SmScaleRule::kOne:
      return 1.0;
    case SmScaleRule::kTimesLog2e:
      return sm_scale * kLog2e;
  }
  return sm_scale;
}

// "0.00195312 (2^-9)": six digits, and the power of two when the number is one.
std::string number_text(double value) {
  int exponent = 0;
  const double fraction = std::frexp(value, &exponent);
  if (fraction == 0.5) return fmt::format("{:.6g} (2^{})", value, exponent - 1);
  return fmt::format("{:.6g}", value);
}

// e5m2: S.EEEEE.MM, bias 15; E = 31 is Inf (M = 0) or NaN.
float e5m2_decode(std::uint8_t code) {
  const bool negative = (code & 0x80) != 0;
  const int exponent = (code >> 2) & 0x1F;
  const int mantissa = code & 0x3;
  float magnitude = 0.0f;
  if (exponent == 31) {
    magnitude = mantissa == 0 ? std::numeric_limits<float>::infinity()
                              : std::numeric_limits<float>::quiet_NaN();
  } else if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -16);  // M/4 * 2^-14
  } else {
    magnitude = std::ldexp(1.0f + static_cast<float>(mantissa) / 4.0f, exponent - 15);
  }
  return negative ? -magnitude : magnitude;
}

// One decoded element (column j of slot t) under a PoolRead.
float decode_element(const KvPool& pool, PoolRead read, std::int64_t slot, int j, float kv_scale) {
  if (pool.dtype == KvDtype::kBfloat16) return bf16_to_float(pool.bf16_bits(slot, j));
  switch (read) {
    case PoolRead::kAsStored:
      return e4m3_decode(pool.row(slot)[j]);
    case PoolRead::kDequantBf16:
      // e4m3 values and bf16(s) have 4 and 8 significant bits: their fp32 product is exact, and
      // its bf16 rounding is __hmul2's.
      return bf16_round(e4m3_decode(pool.row(slot)[j]) * bf16_round(kv_scale));
    case PoolRead::kE5m2:
      return e5m2_decode(pool.row(slot)[j]);
    case PoolRead::kBf16Bytes: {
      const std::size_t byte = 2 * (static_cast<std::size_t>(slot) * pool.row_width + j);
      if (byte + 1 >= pool.bytes.size()) return 0.0f;
      return bf16_to_float(
          static_cast<std::uint16_t>(pool.bytes[byte] | pool.bytes[byte + 1] << 8));
    }
  }
  return 0.0f;
}

}  // namespace

std::span<const HypothesisInfo> hypothesis_catalogue() { return kCatalogue; }

const HypothesisInfo& hypothesis_info(Hypothesis hypothesis) {
  for (const HypothesisInfo& info : kCatalogue) {
    if (info.id == hypothesis) return info;
  }
  return kCatalogue[0];  // every enumerator has a row (tests/replay/test_diagnosis.cpp)
}

const char* hypothesis_name(Hypothesis hypothesis) { return hypothesis_info(hypothesis).name; }

bool ResolvedVariant::same_computation(const ResolvedVariant& other) const {
  return latent_scale == other.latent_scale && rope_scale == other.rope_scale &&
         sm_scale == other.sm_scale && read == other.read && weights == other.weights;
}

double apply_scale_rule(ScaleRule rule, float kv_scale) {
  switch (rule) {
    case ScaleRule::kAsIs:
      return kv_scale;
    case ScaleRule::kPow2Floor:
      return pow2_floor(kv_scale);
    case ScaleRule::kPow2Nearest:
      return power_of_two_scale(kv_scale);
    case ScaleRule::kE8m0:
      return pow2_ceil(kv_scale);
    case ScaleRule::kBf16:
      return bf16_round(kv_scale);
    case ScaleRule::kReciprocal:
      return 1.0f / kv_scale;
    case ScaleRule::kSquared:
      return kv_scale * kv_scale;
    case ScaleRule::kOne:
      return 1.0;
  }
  return kv_scale;
}

ResolvedVariant resolve(const Transform& transform, float kv_scale, double sm_scale) {
  ResolvedVariant variant;
  variant.latent_scale = apply_scale_rule(transform.latent_scale, kv_scale);
  variant.rope_scale = apply_scale_rule(transform.rope_scale, kv_scale);
  variant.sm_scale = sm_scale_of(transform.sm_scale, sm_scale);
  variant.read = transform.read;
  variant.weights = transform.weights;
  variant.candidate_lse = transform.candidate_lse;
  return variant;
}

std::string describe_variant(const ResolvedVariant& v, const ResolvedVariant& identity) {
  std::vector<std::string> parts;
  if (v.read == PoolRead::kDequantBf16) {  // the scale is inside the rows (a = b = 1)
    parts.push_back(fmt::format("K/V elements bf16(code * {}): kv_scale {} in bf16",
                                number_text(bf16_round(static_cast<float>(identity.latent_scale))),
                                number_text(identity.latent_scale)));
  } else if (v.latent_scale != v.rope_scale) {
    parts.push_back(fmt::format("kv_scale {}: latent part scaled by {}, rope part by {}",
                                number_text(identity.latent_scale), number_text(v.latent_scale),
                                number_text(v.rope_scale)));
  } else if (v.latent_scale != identity.latent_scale) {
    parts.push_back(fmt::format("kv_scale {} read as {}", number_text(identity.latent_scale),
                                number_text(v.latent_scale)));
  }
  if (v.sm_scale != identity.sm_scale) {
    parts.push_back(fmt::format("sm_scale {} read as {}", number_text(identity.sm_scale),
                                number_text(v.sm_scale)));
  }
  if (v.read == PoolRead::kE5m2) parts.emplace_back("FP8 bytes decoded as e5m2");
  if (v.read == PoolRead::kBf16Bytes) parts.emplace_back("FP8 pool read as bf16, 2 bytes/element");
  if (v.weights == WeightRounding::kE4m3) {
    parts.emplace_back("P = exp(s - m) rounded to e4m3 before P.V, l unrounded");
  }
  if (v.candidate_lse == LseBase::kTwo) {
    parts.emplace_back("candidate lse read as log2 of the sum: compared as lse * ln 2");
  }
  return parts.empty() ? "no change" : fmt::format("{}", fmt::join(parts, "; "));
}

// ---- DecodedRows -------------------------------------------------------------------------------

DecodedRows DecodedRows::decode(const KvPool& pool, PoolRead read,
                                std::span<const std::int64_t> visible, float kv_scale) {
  DecodedRows rows;
  rows.row_width_ = pool.row_width;
  rows.index_.assign(static_cast<std::size_t>(pool.num_slots), -1);
  std::int64_t held = 0;
  for (const std::int64_t slot : visible) {
    if (slot >= 0 && slot < pool.num_slots && rows.index_[slot] < 0) rows.index_[slot] = held++;
  }
  rows.values_.resize(static_cast<std::size_t>(held) * pool.row_width);
  for (std::int64_t slot = 0; slot < pool.num_slots; ++slot) {
    if (rows.index_[slot] < 0) continue;
    float* dst = rows.values_.data() + rows.index_[slot] * pool.row_width;
    for (int j = 0; j < pool.row_width; ++j) {
      dst[j] = decode_element(pool, read, slot, j, kv_scale);
    }
  }
  return rows;
}

const float* DecodedRows::row(std::int64_t slot) const {
  if (slot < 0 || slot >= static_cast<std::int64_t>(index_.size()) || index_[slot] < 0) {
    return nullptr;
  }
  return values_.data() + index_[slot] * row_width_;
}

// ---- variant_attention -------------------------------------------------------------------------

namespace {

// What every (row, head) pair of one call reads.
struct VariantProblem {
  int heads = 0;
  int dc = 0;
  int dr = 0;
  ResolvedVariant variant;
  std::span<const float> q_nope;
  std::span<const float> q_pe;
  std::span<double> out;
  std::span<double> lse;
  std::vector<int> request_of_row;
  std::vector<std::int64_t> visible_of_row;           // position + 1
  std::vector<std::vector<const float*>> token_rows;  // per request: the row of each position
  std::int64_t max_visible = 0;
};

Status resolve_variant_problem(const DumpAttributes& attrs, const StepMeta& step,
                               const DecodedRows& rows, VariantProblem& problem) {
  const int page = attrs.page_size;
  problem.token_rows.resize(step.batch_size());
  for (int b = 0; b < step.batch_size(); ++b) {
    if (step.rows_of(b) == 0) continue;
    const std::int64_t len = step.kv_len(b, page);
    for (std::int64_t p = 0; p < len; ++p) {
      const float* row = rows.row(step.slot_of(b, p, page));
      if (row == nullptr) {
        return internal_error("diagnosis step " + step.group,
                              fmt::format("slot of position {} of request {} not decoded", p, b));
      }
      problem.token_rows[b].push_back(row);
    }
  }
  for (int i = 0; i < step.num_rows(); ++i) {
    problem.request_of_row.push_back(step.request_of_row(i));
    problem.visible_of_row.push_back(step.position_of_row(i, page) + 1);
    problem.max_visible = std::max(problem.max_visible, problem.visible_of_row.back());
  }
  return ok_status();
}

// sum_j q_j k_j in double, four partial sums (the order is free at double's precision; four
// independent sums let the compiler use vector registers).
double dot(const double* q, const float* k, int n) {
  double partial[4] = {0.0, 0.0, 0.0, 0.0};
  int j = 0;
  for (; j + 4 <= n; j += 4) {
    for (int lane = 0; lane < 4; ++lane) partial[lane] += q[j + lane] * k[j + lane];
  }
  for (; j < n; ++j) partial[0] += q[j] * k[j];
  return (partial[0] + partial[1]) + (partial[2] + partial[3]);
}

// One (row, head) pair: the header's formulas in double.
class VariantKernel {
 public:
  explicit VariantKernel(const VariantProblem& problem)
      : p_(problem),
        q_(static_cast<std::size_t>(problem.dc + problem.dr)),
        s_(static_cast<std::size_t>(problem.max_visible)),
        acc_(problem.dc) {}

  void run(int row, int head) {
    const std::size_t pair = static_cast<std::size_t>(row) * p_.heads + head;
    const ResolvedVariant& v = p_.variant;
    std::copy_n(p_.q_nope.data() + pair * p_.dc, p_.dc, q_.begin());
    std::copy_n(p_.q_pe.data() + pair * p_.dr, p_.dr, q_.begin() + p_.dc);
    const auto& rows = p_.token_rows[p_.request_of_row[row]];
    const std::int64_t n = p_.visible_of_row[row];
    double* out = p_.out.data() + pair * p_.dc;
    double m = -std::numeric_limits<double>::infinity();
    for (std::int64_t t = 0; t < n; ++t) {
      const float* k = rows[t];
      const double latent = dot(q_.data(), k, p_.dc);
      const double rope = dot(q_.data() + p_.dc, k + p_.dc, p_.dr);
      s_[t] = v.sm_scale * (v.latent_scale * latent + v.rope_scale * rope);
      if (std::isnan(s_[t])) {
        std::fill_n(out, p_.dc, std::numeric_limits<double>::quiet_NaN());
        p_.lse[pair] = std::numeric_limits<double>::quiet_NaN();
        return;
      }
      m = std::max(m, s_[t]);
    }
    // e4m3 codes are finite (a NaN code made its score NaN above), so a zero weight adds
    // nothing; other reads may hold Inf, where 0 x Inf must stay NaN, as in a kernel.
    const bool skip_zero_weights = v.read == PoolRead::kAsStored;
    std::fill(acc_.begin(), acc_.end(), 0.0);
    double l = 0.0;
    for (std::int64_t t = 0; t < n; ++t) {
      const double w = std::exp(s_[t] - m);
      l += w;
      const double p = v.weights == WeightRounding::kE4m3
                           ? e4m3_decode(e4m3_encode(w, E4m3Overflow::kSatFinite))
                           : w;
      if (p == 0.0 && skip_zero_weights) continue;
      const float* c = rows[t];
      for (int d = 0; d < p_.dc; ++d) acc_[d] += p * c[d];
    }
    for (int d = 0; d < p_.dc; ++d) out[d] = v.latent_scale * acc_[d] / l;
    p_.lse[pair] = m + std::log(l);
  }

 private:
  const VariantProblem& p_;
  std::vector<double> q_;  // q_nope then q_pe, widened once per pair
  std::vector<double> s_;
  std::vector<double> acc_;
};

}  // namespace

Status variant_attention(const DumpAttributes& attrs, const StepMeta& step,
                         std::span<const float> q_nope, std::span<const float> q_pe,
                         const DecodedRows& rows, const ResolvedVariant& variant,
                         std::span<double> out, std::span<double> lse, int threads) {
  const std::size_t pairs = static_cast<std::size_t>(step.num_rows()) * attrs.num_heads;
  if (rows.row_width() != attrs.row_width() || q_nope.size() != pairs * attrs.kv_lora_rank ||
      q_pe.size() != pairs * attrs.qk_rope_head_dim || out.size() != pairs * attrs.kv_lora_rank ||
      lse.size() != pairs) {
    return internal_error("diagnosis step " + step.group,
                          "q_nope/q_pe/out/lse or KV row sizes disagree with [Nq, H, Dc/Dr]");
  }
  VariantProblem problem;
  problem.heads = attrs.num_heads;
  problem.dc = attrs.kv_lora_rank;
  problem.dr = attrs.qk_rope_head_dim;
  problem.variant = variant;
  problem.q_nope = q_nope;
  problem.q_pe = q_pe;
  problem.out = out;
  problem.lse = lse;
  KVAUDIT_TRY(resolve_variant_problem(attrs, step, rows, problem));
  const std::size_t heads = static_cast<std::size_t>(attrs.num_heads);
  parallel_for(pairs, threads, [&] {
    return [&problem, heads, kernel = VariantKernel(problem)](std::size_t pair) mutable {
      kernel.run(static_cast<int>(pair / heads), static_cast<int>(pair % heads));
    };
  });
  return ok_status();
}

// ---- diagnose ----------------------------------------------------------------------------------

namespace {

// What one resolved variant gave on the failing comparison (shared by hypotheses that resolve to
// the same variant).
struct Evaluation {
  ErrorSummary after;
  HypothesisJudgement judgement;
};

double max_abs_finite(std::span<const double> values) {
  double largest = 0.0;
  for (const double x : values) {
    if (std::isfinite(x)) largest = std::max(largest, std::abs(x));
  }
  return largest;
}

// Whether the hypothesis could change anything here.
bool applicable(const DiagnosisInput& input, const ResolvedVariant& v,
                const ResolvedVariant& identity) {
  if (v.read != PoolRead::kAsStored && input.pool.dtype != KvDtype::kFloat8E4m3fn) return false;
  if (v.candidate_lse == LseBase::kTwo && input.candidate.lse.empty()) return false;
  return !(v.same_computation(identity) && v.candidate_lse == identity.candidate_lse);
}

class Diagnoser {
 public:
  explicit Diagnoser(const DiagnosisInput& input)
      : input_(input),
        identity_(resolve(Transform{}, input.kv_scale, input.attrs.sm_scale)),
        compares_out_(!input.reference.out.empty()),
        compares_lse_(!input.reference.lse.empty()) {}

  const ResolvedVariant& identity() const { return identity_; }

  // The variant's evaluation, computed once per distinct variant.
  Result<Evaluation> evaluate(const ResolvedVariant& variant) {
    for (const auto& [seen, evaluation] : evaluated_) {
      if (seen == variant) return evaluation;
    }
    KVAUDIT_ASSIGN_OR_RETURN(const Evaluation evaluation, compute(variant));
    evaluated_.emplace_back(variant, evaluation);
    return evaluation;
  }

 private:
  Result<Evaluation> compute(const ResolvedVariant& variant) {
    // The hypothesis's reference: the comparison's own where the computation is R8's.
    OutputView reference = input_.reference;
    if (!variant.same_computation(identity_)) {
      KVAUDIT_TRY(compute_reference(variant));
      reference = {compares_out_ ? std::span<const double>(out_) : std::span<const double>(),
                   compares_lse_ ? std::span<const double>(lse_) : std::span<const double>()};
    }
    OutputView candidate = input_.candidate;
    std::vector<double> lse_natural;
    if (variant.candidate_lse == LseBase::kTwo) {
      for (const double x : candidate.lse) lse_natural.push_back(x * kLn2);
      candidate.lse = lse_natural;
    }
    const ComparisonMetrics after =
        compare_outputs(input_.shape, reference.out, candidate.out, reference.lse, candidate.lse,
                        input_.policy.rel_floor);
    Evaluation evaluation;
    evaluation.after = summarize_error(after);
    evaluation.judgement =
        judge_hypothesis(input_.policy, input_.failed.comparison, input_.failed.metrics, after,
                         max_abs_finite(reference.lse));
    return evaluation;
  }

  Status compute_reference(const ResolvedVariant& variant) {
    auto decoded = decoded_.find(variant.read);
    if (decoded == decoded_.end()) {
      decoded = decoded_
                    .emplace(variant.read, DecodedRows::decode(input_.pool, variant.read,
                                                               input_.visible, input_.kv_scale))
                    .first;
    }
    const TensorShape3 full{input_.shape.rows, input_.shape.heads, input_.attrs.kv_lora_rank};
    out_.assign(full.size(), 0.0);
    lse_.assign(static_cast<std::size_t>(full.rows) * full.heads, 0.0);
    return variant_attention(input_.attrs, input_.step, input_.tensors.q_nope, input_.tensors.q_pe,
                             decoded->second, variant, out_, lse_, input_.threads);
  }

  const DiagnosisInput& input_;
  ResolvedVariant identity_;
  bool compares_out_;
  bool compares_lse_;
  std::map<PoolRead, DecodedRows> decoded_;
  std::vector<double> out_;
  std::vector<double> lse_;
  std::vector<std::pair<ResolvedVariant, Evaluation>> evaluated_;
};

// The closest hypothesis that does not explain: the smallest finite excess over its limits (a
// NaN/Inf mismatch or a NaN metric is no approach at all).
bool closer(const HypothesisOutcome& candidate, const std::optional<HypothesisOutcome>& current) {
  if (!std::isfinite(candidate.excess)) return false;
  return !current || candidate.excess < current->excess;
}

}  // namespace

Result<DiagnosisFinding> diagnose(const DiagnosisInput& input) {
  DiagnosisFinding finding;
  finding.step = input.failed.step;
  finding.layer_id = input.failed.layer_id;
  finding.comparison = input.failed.comparison;
  finding.before = summarize_error(input.failed.metrics);
  Diagnoser diagnoser(input);
  std::vector<ResolvedVariant> explaining;
  for (const HypothesisInfo& info : kCatalogue) {
    const ResolvedVariant variant = resolve(info.transform, input.kv_scale, input.attrs.sm_scale);
    if (!applicable(input, variant, diagnoser.identity())) {
      finding.not_applicable.emplace_back(info.name);
      continue;
    }
    ++finding.tried;
    KVAUDIT_ASSIGN_OR_RETURN(const Evaluation evaluation, diagnoser.evaluate(variant));
    HypothesisOutcome outcome{info.name,
                              describe_variant(variant, diagnoser.identity()),
                              evaluation.after,
                              evaluation.judgement.explains,
                              evaluation.judgement.reasons,
                              evaluation.judgement.excess};
    if (outcome.explains) {
      finding.explained_by.push_back(std::move(outcome));
      explaining.push_back(variant);
    } else if (closer(outcome, finding.closest)) {
      finding.closest = std::move(outcome);
    }
  }
  if (!finding.explained_by.empty()) finding.closest.reset();
  finding.same_computation =
      explaining.size() > 1 &&
      std::all_of(explaining.begin(), explaining.end(),
                  [&](const ResolvedVariant& v) { return v == explaining.front(); });
  return finding;
}

// ---- DiagnosisBudget ---------------------------------------------------------------------------

bool DiagnosisBudget::admit(int step, std::size_t layer_order) {
  const Site site{step, layer_order};
  failing_.insert(site);
  if (limit_ <= 0) return false;
  if (kept_.count(site) != 0) return true;
  if (kept_.size() >= static_cast<std::size_t>(limit_)) {
    if (!(site < kept_.rbegin()->first)) return false;
    kept_.erase(std::prev(kept_.end()));  // a later site gives way to this earlier one
  }
  kept_[site];
  return true;
}

void DiagnosisBudget::add(int step, std::size_t layer_order, DiagnosisFinding finding) {
  kept_[{step, layer_order}].push_back(std::move(finding));
}

std::vector<DiagnosisFinding> DiagnosisBudget::findings() const {
  std::vector<DiagnosisFinding> all;
  for (const auto& [site, findings] : kept_)
    all.insert(all.end(), findings.begin(), findings.end());
  return all;
}

}  // namespace kvaudit
