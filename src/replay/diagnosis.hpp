// Diagnosis of convention mismatches (docs/design.md "Diagnosis"): when a kernel or captured
// comparison fails for a (step, layer), try a catalogue of known implementation choices, alone and
// in combinations, and say which, if any, explains the data: its replay lands close to the
// candidate's own output, closer than any other.
//
// Each hypothesis is a variation of the R8 computation (or, for an output convention, of how the
// candidate's outputs are read), recomputed for the failing (step, layer) on the same pool the
// candidate read. Per query row i, head h, over its visible tokens t, with (c_t, r_t) the pool row
// decoded under the hypothesis (latent part [Dc], rope part [Dr], unscaled or with kv_scale folded
// in by the read), q' = rq(q) the query as the hypothesis rounds it:
//   s_t = sm' * qs * (a * q'_nope[i,h,:] . c_t + b * rho(q'_pe[i,h,:], r_t))
//   m = max_t s_t,  w_t = exp(s_t - m),  p_t = rp(w_t),  l = sum_t w_t (or p_t: Normaliser)
//   out[i,h] = v * sum_t p_t c_t / l  [Dc],   lse[i,h] = m + ln l
// where a (latent multiplier), b (rope multiplier), v (value multiplier), sm' and qs (q's scale)
// come from kv_scale, sm_scale (and YaRN's mscale^2 from the dump's rope attributes) and amax|q|
// by the hypothesis's rules, rho is the RoPE dot q_pe . r_t or a layout mismatch of it
// (RopePairing: q_pe . D(r_t), D(q_pe) . r_t, or 0), rq is none, e4m3 (optionally
// of q / qs) or TF32, and rp none, e4m3 or TF32. p-e4m3-tile replaces the single max by the
// running max of each KV tile within each split (TileShape): p_t = e4m3(exp(s_t - m_j)), the
// split's sums rescaled by exp(m_{j-1} - m_j), the splits merged exactly by their lse. R8 itself
// is a = b = v = kv_scale, sm' = sm_scale, qs = 1, e4m3 decoding, no rounding of q or p.
// A candidate that stores out in bf16 is compared, for the fraction rule, against every replay as
// it would store it, bf16(fp32(out)) [Nq, H, Dc], and its distance to the reference likewise
// against bf16(fp32(reference out)): the output store is a fact about the candidate, so it applies
// to every replay, the no-hypothesis one included (DiagnosisInput::candidate_out).
// Shapes: q_nope [Nq, H, Dc], q_pe [Nq, H, Dr], pool [S, Dc + Dr], out [Nq, H, Dc], lse [Nq, H].
// The variants are evaluated in plain double (~1e-16 relative, far below the clean-kernel level
// they are judged at, 2^-8); the roundings a hypothesis models (e4m3, bf16, fp16, TF32, one fp32
// product) are applied exactly where it says. The exact reference (references/mla_reference.hpp)
// stays the one every verdict is made against. A hypothesis that changes nothing here (kv_scale
// already a power of two for a rounding, 1 for "not applied", a bf16 pool for an FP8 variant, a
// tile that holds every row) is not applicable.
//
// Whether a hypothesis explains the failure is the verdict's rule (judge_hypothesis,
// src/verdict/policy.hpp): the candidate against the hypothesis's reference passes the failing
// comparison's limits, and the replay lands within the policy's explain_fraction of the
// candidate's distance from the reference; diagnose() then keeps the closest (those within
// kHypothesisTieRatio of it are indistinguishable on this data, and the same computation when
// they resolve to the same numbers); none: the closest is named. The search: every single; then
// pairs of each of the kPairAnchors singles that help most with every other single; then the
// closest pair with every other single (triples); only singles that change disjoint parts of the
// computation combine (transform_parts), and a combination competes only when it is closer than
// each of its parts by kHypothesisTieRatio.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
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
  kQueryE4m3,
  kQueryE4m3Scaled,
  kQueryNopeE4m3,
  kDequantFp32Bf16,
  kProbabilitiesE4m3Tile,
  kLseBf16,
  kKeyScaleInSmScale,
  kValueScaleOnOutput,
  kTf32,
  kScaleFp16,
  kValueDescaleMissing,
  kWriteUnitScale,
  kSmScaleMscaleDropped,
  kSmScaleMscaleTwice,
  kKpeDeinterleaved,
  kQpeDeinterleaved,
  kRopeDotMissing,
};

// How a hypothesis derives a KV multiplier from kv_scale s (all in fp32, as a kernel would).
enum class ScaleRule : std::uint8_t {
  kAsIs,         // s
  kPow2Floor,    // 2^floor(log2 s)
  kPow2Nearest,  // power_of_two_scale(s) (src/backend/injection.hpp): 2^round(log2 s), 2s when
                 // s already is a power of two (the scale-mismatch injection)
  kE8m0,         // 2^ceil(log2 s): __nv_cvt_float_to_e8m0(s, ..., cudaRoundPosInf)
  kBf16,         // bf16(s), nearest even
  kFp16,         // fp16(s), nearest even (subnormal below 2^-14, quantum 2^-24)
  kReciprocal,   // fp32(1 / s)
  kSquared,      // fp32(s * s)
  kOne,          // 1: not applied
};
// kTimesKvScaleFp32: fp32(sm_scale * s), the key scale folded into the softmax scale
// (k-scale-in-sm-scale: the scores then read unscaled codes). kWithoutMscale, kMscaleTwice:
// sm_scale / mscale^2 and sm_scale * mscale^2, with mscale^2 = yarn_mscale_squared(attrs)
// (src/backend/injection.hpp) from the dump's rope attributes; not applicable without them.
enum class SmScaleRule : std::uint8_t {
  kAsIs,
  kOne,
  kTimesLog2e,
  kTimesKvScaleFp32,
  kWithoutMscale,
  kMscaleTwice
};
// What multiplies P.V (the value scale): the latent multiplier a (R8), 1 (v-descale-missing; a
// read that folds kv_scale into the rows), or kv_scale itself applied to P.V on the codes
// (v-scale-on-output; with k-scale-in-sm-scale the scores read unscaled codes).
enum class ValueScale : std::uint8_t { kAsLatent, kOne, kKvScale };
// How the pool's bytes are decoded (an FP8 pool; a bf16 pool is always read as stored).
enum class PoolRead : std::uint8_t {
  kAsStored,   // e4m3fn codes (or bf16 values)
  kE5m2,       // each byte as an e5m2 code (Inf and NaN codes included)
  kBf16Bytes,  // the byte buffer addressed as a [S, D] bf16 array, as the fp8-read-as-bf16
               // injection reads it (src/backend/mla_attention_cpu.cpp): element j of slot t is the
               // little-endian bf16 at bytes 2 (t D + j), 2 (t D + j) + 1; 0 past the buffer
  kDequantBf16,      // each element dequantized in bf16 arithmetic: bf16(e4m3(code) * bf16(s)), the
                     // scale s = kv_scale folded into the row (multipliers a = b = 1); FlashInfer's
                     // FP8 MLA kernels (0.6.x) repack FP8 tiles to bf16 this way (__hmul2)
  kDequantFp32Bf16,  // dequantized in fp32, fp32(e4m3(code) * s), then rounded to bf16 (nearest
                     // even) for bf16 MMAs; s folded into the row (a = b = 1)
  kDequantTf32,      // dequantized in fp32, fp32(e4m3(code) * s), then rounded to TF32 (tf32_round:
                     // 10 explicit mantissa bits, ties away from zero) for TF32 MMAs; s folded in
  kRequantizedUnitScale,  // the slot's unquantized row x (kv_source, or the new_kv row a step
                          // wrote) re-quantized with scale 1 by the write rule, e4m3_satfinite(x),
                          // decoded unscaled (the read applies a = b = s): write-unit-scale
};
// How q (q_nope and q_pe) enters the scores.
enum class QueryRounding : std::uint8_t {
  kNone,
  kE4m3,        // e4m3_satfinite(q), no scale (|q| > 448 -> +-448)
  kE4m3Scaled,  // e4m3_satfinite(q * fp32(1 / q_scale)), scores times q_scale (QueryScaleDomain)
  kE4m3Nope,    // e4m3_satfinite(q_nope), no scale; q_pe as it is (a bf16 RoPE dot beside an
                // FP8 latent dot: SGLang's Triton decode, MLA path)
  kTf32,        // tf32_round(q)
};
// Over what q_scale = fp32(amax |q| / 448) of kE4m3Scaled takes its amax. One domain is modelled:
// the step's whole q tensor (every row and head, q_nope and q_pe together), a dynamic per-step q
// scale (vLLM's FlashMLA caller uses a static q_scale, 1.0 by default, with the same reciprocal
// multiply); a per-head or per-row domain would be a new enumerator.
enum class QueryScaleDomain : std::uint8_t { kStepTensor };
// p_t before P.V.
enum class WeightRounding : std::uint8_t {
  kNone,
  kE4m3,      // e4m3_satfinite(exp(s_t - m)), m the row's max
  kE4m3Tile,  // e4m3_satfinite(exp(s_t - m_j)), m_j the running max after KV tile j of a split
              // (TileShape; a split-KV flash kernel)
  kTf32,      // tf32_round(exp(s_t - m)): fp32 P into a TF32 MMA
};
// What the normaliser l sums: the unrounded weights w_t (SGLang's and vLLM's Triton decode:
// `acc += tl.dot(p.to(v.dtype), v); e_sum = e_sum * re_scale + tl.sum(p, 1)`, p unrounded), or
// the rounded p_t. The catalogue models the unrounded sum.
enum class Normaliser : std::uint8_t { kUnrounded, kRounded };
// How q_pe meets the rope part r_t of a row in the scores (RoPE layouts: injection.hpp's
// deinterleave_rope D, interleave_rope I = D^-1):
//   kAsStored            q_pe . r_t
//   kKeyDeinterleaved    q_pe . D(r_t) = I(q_pe) . r_t: the cached RoPE part in the Hugging Face
//                        module's de-interleaved order (even elements, then odd), q_pe interleaved
//   kQueryDeinterleaved  D(q_pe) . r_t: q_pe de-interleaved, the cached part interleaved
//   kDropped             0: the absorbed query formed without its RoPE part
enum class RopePairing : std::uint8_t {
  kAsStored,
  kKeyDeinterleaved,
  kQueryDeinterleaved,
  kDropped
};
// How the candidate's lse is read (kTwo) or stored (kBf16: the reference's lse is rounded to bf16,
// nearest even, before the comparison).
enum class LseBase : std::uint8_t { kNatural, kTwo, kBf16 };

// A split-KV kernel's tiling of a row's visible tokens: n tokens cut into `splits` contiguous
// splits of ceil(ceil(n / splits) / tile) * tile tokens (the last one shorter; a split that
// starts past n is empty), each split cut into tiles of `tile` tokens from its start. splits 1:
// one split, tiles only.
struct TileShape {
  int tile = 0;  // tokens per KV tile; 0: untiled
  int splits = 1;
  bool operator==(const TileShape&) const = default;
};
// The tile sizes tried for p-e4m3-tile when none is given (--diagnose-tile): one split each.
inline constexpr int kDefaultDiagnoseTiles[] = {16, 32, 64, 128};

// A hypothesis's transform, as values: what it changes in the R8 computation and in how the
// candidate's outputs are read.
struct Transform {
  ScaleRule latent_scale = ScaleRule::kAsIs;  // a: multiplies c_t (scores and out)
  ScaleRule rope_scale = ScaleRule::kAsIs;    // b: multiplies r_t (scores)
  SmScaleRule sm_scale = SmScaleRule::kAsIs;
  PoolRead read = PoolRead::kAsStored;
  WeightRounding weights = WeightRounding::kNone;
  LseBase candidate_lse = LseBase::kNatural;
  ValueScale value_scale = ValueScale::kAsLatent;  // v: multiplies P.V (out)
  QueryRounding query = QueryRounding::kNone;
  QueryScaleDomain query_scale_domain = QueryScaleDomain::kStepTensor;
  Normaliser normaliser = Normaliser::kUnrounded;
  RopePairing rope = RopePairing::kAsStored;
};

// The parts of the computation a transform changes. Two hypotheses combine only when they change
// disjoint parts (two q roundings, two P roundings, two scale conventions, two lse readings do
// not combine); a read that folds kv_scale into the rows changes the scale too.
enum TransformPart : unsigned {
  kPartScale = 1u << 0,    // a, b, v, kv_scale folded into sm_scale or into the rows
  kPartSmScale = 1u << 1,  // sm_scale missing or times log2 e
  kPartRead = 1u << 2,     // how the pool's bytes become K/V values
  kPartQuery = 1u << 3,
  kPartWeights = 1u << 4,
  kPartLse = 1u << 5,
  kPartRope = 1u << 6,  // how q_pe meets the rope part (RopePairing)
};
unsigned transform_parts(const Transform& transform);
// Whether two transforms change disjoint parts (transform_parts), and their union.
bool combinable(const Transform& a, const Transform& b);
Transform combine(const Transform& a, const Transform& b);

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
  double value_scale = 1.0;   // v: out = v * sum_t p_t c_t / l
  double sm_scale = 0.0;      // sm' (NaN: a rule this dump lacks the attributes for)
  PoolRead read = PoolRead::kAsStored;
  QueryRounding query = QueryRounding::kNone;
  double query_scale = 1.0;  // q_scale of kE4m3Scaled (1 otherwise)
  WeightRounding weights = WeightRounding::kNone;
  TileShape tiles;  // of kE4m3Tile ({0, 1} otherwise)
  Normaliser normaliser = Normaliser::kUnrounded;
  LseBase candidate_lse = LseBase::kNatural;
  RopePairing rope = RopePairing::kAsStored;
  bool operator==(const ResolvedVariant&) const = default;
  // The same attention (the candidate's lse may still be read differently).
  bool same_computation(const ResolvedVariant& other) const;
};

double apply_scale_rule(ScaleRule rule, float kv_scale);
// `query_amax`: max |q| over the QueryScaleDomain (kE4m3Scaled only); `tiles`: kE4m3Tile only;
// `mscale_squared`: YaRN's mscale^2 from the dump's rope attributes (kWithoutMscale and
// kMscaleTwice only; nullopt: unknown, and those rules resolve to a NaN sm_scale, not applicable).
ResolvedVariant resolve(const Transform& transform, float kv_scale, double sm_scale,
                        float query_amax = 0.0f, TileShape tiles = {},
                        std::optional<double> mscale_squared = std::nullopt);
// fp32 -> TF32 as cvt.rna.tf32.f32 (PTX ISA, "cvt": .rna, round to nearest, ties away from zero;
// Ampere+ SASS adds 0x1000 to the fp32 bits and keeps the top 19, enp1s0's "tf32-rna" note): 10
// explicit mantissa bits, fp32's exponent range; Inf and NaN pass through.
float tf32_round(float x);
// fp32 -> IEEE binary16, nearest even, back to fp32 (no library: C++20 has no std::float16_t).
float fp16_round(float x);
// The [begin, end) token ranges of row length n under `tiles`, in order: splits, then tiles.
struct TokenRange {
  std::int64_t begin = 0;
  std::int64_t end = 0;
  bool split_start = false;  // the first tile of a split
};
std::vector<TokenRange> tile_ranges(std::int64_t n, TileShape tiles);
// What `variant` changes against R8's own variant (`identity`), for reports:
// "kv_scale 0.0029 read as 0.001953125".
std::string describe_variant(const ResolvedVariant& variant, const ResolvedVariant& identity);

// The visible rows of a pool decoded under a PoolRead, unscaled, [n, D] floats (every e4m3, e5m2
// and bf16 value is a float).
class DecodedRows {
 public:
  // `kv_scale` is used by the reads that fold it into the rows (kDequantBf16, kDequantFp32Bf16,
  // kDequantTf32; the other reads are unscaled). `source_row` (kRequantizedUnitScale only): the
  // slot's unquantized row, nullptr where unknown (then that slot is not decoded).
  using SourceRowFn = std::function<const float*(std::int64_t slot)>;
  static DecodedRows decode(const KvPool& pool, PoolRead read,
                            std::span<const std::int64_t> visible, float kv_scale = 1.0f,
                            const SourceRowFn& source_row = {});
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
  // The unquantized row of a slot (kv_source, or the new_kv row the step wrote), nullptr where the
  // dump has none: write-unit-scale is applicable only when every visible slot has one.
  DecodedRows::SourceRowFn source_row = {};
  // p-e4m3-tile's tile shapes: from --diagnose-tile only; empty: the kDefaultDiagnoseTiles with
  // one split each.
  std::vector<TileShape> tiles = {};
  // How the candidate stored its out (a fact about it, not a hypothesis): kBfloat16 (every
  // backend's out, a bfloat16 captured out): the fraction rule compares bf16(fp32(replay out))
  // against it, for every replay and for the no-hypothesis baseline bf16(reference out)
  // (StoredDistances, src/verdict/policy.hpp); kFloat32: the replays are compared unrounded
  // (fp32's 2^-24 rounding is far below the 2^-8 level the rule works at).
  OutputStorage candidate_out = OutputStorage::kFloat32;
};

// The search's cap (docs/design.md "Diagnosis"): pairs of each of the kPairAnchors singles that
// help most with every other single, then triples of the closest pair with every other single:
// at most (kPairAnchors + 1) x (singles) combinations, each one replay of the step.
inline constexpr int kPairAnchors = 2;

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
  // Whether a failing site not yet seen could still be kept: the budget is not full, or the site
  // is earlier than the latest one kept. Once false for a site it stays false (the kept sites only
  // get earlier), so a layer replayed beside others may skip a diagnosis this says no to.
  bool could_admit(int step, std::size_t layer_order) const;
  // Another budget's sites and diagnoses (one layer's, replayed on its own with the same limit),
  // as if its failing sites had been admitted here in turn: its diagnoses of the sites this budget
  // keeps are taken over. The result is the same in whatever order the layers are absorbed.
  void absorb(DiagnosisBudget other);
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
