// The diagnosis of convention mismatches (src/replay/diagnosis.hpp): every catalogue entry planted
// (tests/replay/planted_kernel.hpp: a kernel model that commits it, written from the mismatch's
// definition) must make `check` fail and be named by the diagnosis, alone, or with exactly the
// hypotheses it cannot be told from on that data; a clean run has no diagnosis; an unexplained
// failure says that none fits; the cpu-fp8 injections scale-mismatch and fp8-read-as-bf16 are
// named on every shipped dump.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <iostream>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "references/mla_reference.hpp"
#include "src/backend/injection.hpp"
#include "src/cli/backend_registry.hpp"
#include "src/replay/diagnosis.hpp"
#include "src/replay/replay.hpp"
#include "src/report/diagnosis_report.hpp"
#include "src/report/report.hpp"
#include "tests/replay/check_dumps.hpp"
#include "tests/replay/planted_kernel.hpp"
#include "tests/test_paths.hpp"

namespace kvaudit {
namespace {

using testing::make_tiny_dump;
using testing::PlantedBackend;
using testing::TinyDump;
using testing::TinySpec;
using H = Hypothesis;

CheckRun replay_file(const std::filesystem::path& path, Backend* backend,
                     ReplayOptions options = {}) {
  if (options.policy.name.empty()) options.policy = default_policy();
  options.threads = 2;
  auto reader = DumpReader::open(path);
  if (!reader.ok()) FAIL(reader.error().message());
  auto outcome = replay_dump(*reader, backend, options);
  if (!outcome.ok()) FAIL(outcome.error().message());
  return std::move(outcome.value());
}

CheckRun replay_tiny(const TinyDump& dump, const std::string& name, Backend* backend,
                     ReplayOptions options = {}) {
  const auto path = testing::test_tmp_path(name + ".h5");
  std::string error;
  REQUIRE(dump.write(path, &error));
  return replay_file(path, backend, std::move(options));
}

std::vector<std::string> names(std::initializer_list<H> hypotheses) {
  std::vector<std::string> list;
  for (const H h : hypotheses) list.emplace_back(hypothesis_name(h));
  return list;
}

std::vector<std::string> explaining(const DiagnosisFinding& finding) {
  std::vector<std::string> list;
  for (const HypothesisOutcome& outcome : finding.explained_by) list.push_back(outcome.hypothesis);
  return list;
}

// One planted mismatch: where, and which hypotheses must explain it (catalogue order).
struct PlantedCase {
  H planted;
  float kv_scale;
  double sm_scale;
  std::vector<std::string> expected;
  bool same_computation;             // the expected set resolves to one computation on this data
  std::vector<int> prefix = {6, 0};  // tokens cached per request before step 0
  // The dump carries DeepSeek-V3's YaRN rope attributes (rope_factor 40, rope_mscale_all_dim 1:
  // mscale^2 = (0.1 ln 40 + 1)^2 = 1.8739); without them the mscale hypotheses do not apply.
  bool yarn_rope = false;
};

// kv_scale 0.0029: log2 = -8.43, so the nearest power of two is the ceiling (e8m0's) 2^-8, and
// the floor 2^-9 stands alone. 0.0022: log2 = -8.83, nearest = floor = 2^-9, e8m0 2^-8 alone.
// 2^-8: already a power of two: floor and e8m0 change nothing, nearest reads 2^-7.
// 0.0048979 = (1.25 + 0.99 * 2^-8) * 2^-8: bf16 rounds it down by 0.31%, which moves the lse by
// more than the kernel's 2^-10 once the scores are O(1); the same for dequant-bf16, which rounds
// the scale to bf16 too (and each dequantized element). sm_scale 4 makes the scores large enough
// that the out error (not only the lse) stands 4x above the planted kernel's own bf16 rounding,
// as the fraction rule (explain_fraction 1/4) needs on both.
// The small roundings need large scores to fail the kernel limits at all (the lse moves by about
// |s| times the relative rounding): sm_scale 8 to 20. 0.0039119 = 1.00145 * 2^-8: fp16 rounds it
// down by 2^-11 (bf16 and the powers of two to 2^-8, three times further). p-e4m3-tile needs rows
// longer than the 64-token tile: 150 tokens cached.
std::vector<PlantedCase> planted_cases() {
  return {
      {H::kLseBase2, 0.0029f, 0.35, names({H::kLseBase2}), false},
      {H::kScalePow2Floor, 0.0029f, 0.35, names({H::kScalePow2Floor}), false},
      {H::kScalePow2Floor, 0.0022f, 0.35, names({H::kScalePow2Floor, H::kScalePow2Nearest}), true},
      {H::kScalePow2Nearest, 0.00390625f, 0.35, names({H::kScalePow2Nearest}), false},
      {H::kScalePow2Nearest, 0.0029f, 0.35, names({H::kScalePow2Nearest, H::kScaleE8m0}), true},
      {H::kScaleE8m0, 0.0022f, 0.35, names({H::kScaleE8m0}), false},
      {H::kScaleE8m0, 0.0029f, 0.35, names({H::kScalePow2Nearest, H::kScaleE8m0}), true},
      // dequant-bf16 rounds the scale the same way, and its per-element bf16 rounding (2^-9
      // relative) stays within a clean kernel's level on this tiny dump: twins here. FlashInfer's
      // outputs on the shipped dumps tell them apart (reports/flashinfer-h200.md).
      {H::kScaleBf16, 0.0048979f, 8.0, names({H::kScaleBf16, H::kDequantBf16}), false},
      {H::kScaleReciprocal, 0.0029f, 0.35, names({H::kScaleReciprocal}), false},
      {H::kScaleSquared, 0.0029f, 0.35, names({H::kScaleSquared}), false},
      {H::kScaleNotApplied, 0.0029f, 0.35, names({H::kScaleNotApplied}), false},
      {H::kScaleLatentOnly, 0.0029f, 0.35, names({H::kScaleLatentOnly}), false},
      {H::kSmScaleMissing, 0.0029f, 0.35, names({H::kSmScaleMissing}), false},
      {H::kSmScaleLog2e, 0.0029f, 0.35, names({H::kSmScaleLog2e}), false},
      {H::kReadAsE5m2, 0.0029f, 0.35, names({H::kReadAsE5m2}), false},
      {H::kReadAsBf16, 0.0029f, 0.35, names({H::kReadAsBf16}), false},
      {H::kProbabilitiesE4m3, 0.0029f, 0.35, names({H::kProbabilitiesE4m3}), false},
      {H::kDequantBf16, 0.0048979f, 8.0, names({H::kScaleBf16, H::kDequantBf16}), false},
      {H::kQueryE4m3, 0.0029f, 0.35, names({H::kQueryE4m3}), false},
      {H::kQueryE4m3Scaled, 0.0029f, 0.35, names({H::kQueryE4m3Scaled}), false},
      {H::kQueryNopeE4m3, 0.0029f, 20.0, names({H::kQueryNopeE4m3}), false},
      {H::kDequantFp32Bf16, 0.0048979f, 8.0, names({H::kDequantFp32Bf16}), false},
      {H::kProbabilitiesE4m3Tile, 0.0029f, 0.35, {"p-e4m3-tile"}, false, {300, 20}},
      {H::kLseBf16, 0.0029f, 0.35, names({H::kLseBf16}), false},
      {H::kTf32, 0.0029f, 20.0, names({H::kTf32}), false},
      {H::kScaleFp16, 0.0039119f, 20.0, names({H::kScaleFp16}), false},
      {H::kValueDescaleMissing, 0.0029f, 0.35, names({H::kValueDescaleMissing}), false},
      // The translation faults (issue 33): the scale off by YaRN's mscale^2 either way, q_pe and
      // the cached RoPE part in different layouts (each direction its own permutation: D and
      // D^-1 differ for Dr = 8), the RoPE dot left out.
      {H::kSmScaleMscaleDropped,
       0.0029f,
       0.35,
       names({H::kSmScaleMscaleDropped}),
       false,
       {6, 0},
       true},
      {H::kSmScaleMscaleTwice, 0.0029f, 0.35, names({H::kSmScaleMscaleTwice}), false, {6, 0}, true},
      {H::kKpeDeinterleaved, 0.0029f, 0.35, names({H::kKpeDeinterleaved}), false},
      {H::kQpeDeinterleaved, 0.0029f, 0.35, names({H::kQpeDeinterleaved}), false},
      {H::kRopeDotMissing, 0.0029f, 0.35, names({H::kRopeDotMissing}), false},
  };
}

TinySpec planted_spec(const PlantedCase& c) {
  TinySpec spec;
  spec.layer_ids = {4};
  spec.kv_scale = c.kv_scale;
  spec.sm_scale = c.sm_scale;
  spec.prefix = c.prefix;
  if (c.yarn_rope) {
    spec.rope_factor = 40.0;
    spec.rope_mscale_all_dim = 1.0;
  }
  return spec;
}

// The transforms of the findings' explaining hypotheses, for INFO.
std::string distances(const DiagnosisFinding& finding) {
  std::ostringstream text;
  text << "before rel_l2 " << finding.before.rel_l2 << " lse " << finding.before.lse_max_abs;
  for (const HypothesisOutcome& h : finding.hypotheses) {
    if (h.fraction < 1.0) {
      text << "\n  " << h.hypothesis << " [" << h.transform << "] fraction " << h.fraction
           << " rel_l2 " << h.after.rel_l2 << " lse " << h.after.lse_max_abs << " excess "
           << h.excess;
    }
  }
  return text.str();
}

void check_findings(const CheckRun& run, const PlantedCase& c, Comparison comparison) {
  CHECK_FALSE(run.pass());
  REQUIRE_FALSE(run.diagnosis.empty());
  for (const DiagnosisFinding& finding : run.diagnosis) {
    INFO("step " << finding.step << " " << comparison_name(finding.comparison) << ": "
                 << diagnosis_summary(finding) << "\n"
                 << distances(finding));
    CHECK(finding.comparison == comparison);
    CHECK(finding.layer_id == 4);
    CHECK(explaining(finding) == c.expected);
    CHECK(finding.same_computation == c.same_computation);
    CHECK_FALSE(finding.closest.has_value());
    for (const HypothesisOutcome& outcome : finding.explained_by) {
      CHECK(outcome.explains);
      CHECK(outcome.excess <= 1.0);
      CHECK(outcome.after.nonfinite_mismatches == 0);
    }
  }
}

}  // namespace

TEST_CASE("diagnosis: the catalogue has one row per hypothesis, each name once", "[diagnosis]") {
  std::set<std::string> seen;
  std::set<H> ids;
  for (const HypothesisInfo& info : hypothesis_catalogue()) {
    CHECK(seen.insert(info.name).second);
    ids.insert(info.id);
    CHECK(std::string(info.description).size() > 20);
    CHECK(std::string(hypothesis_name(info.id)) == info.name);
  }
  CHECK(ids.size() == static_cast<std::size_t>(H::kRopeDotMissing) + 1);
  // Every case below plants one of them; together they cover the catalogue (write-unit-scale on
  // the captured comparison, k-scale-in-sm-scale and v-scale-on-output as kernels that pass).
  std::set<H> planted = {H::kWriteUnitScale, H::kKeyScaleInSmScale, H::kValueScaleOnOutput};
  for (const PlantedCase& c : planted_cases()) planted.insert(c.planted);
  CHECK(planted == ids);
}

TEST_CASE("diagnosis: scale rules on known numbers", "[diagnosis]") {
  // 0.0029 = 1.4848 * 2^-9; 0.0022 = 1.1264 * 2^-9; 2^-8 already a power of two.
  CHECK(apply_scale_rule(ScaleRule::kPow2Floor, 0.0029f) == 0.001953125);
  CHECK(apply_scale_rule(ScaleRule::kPow2Nearest, 0.0029f) == 0.00390625);
  CHECK(apply_scale_rule(ScaleRule::kE8m0, 0.0029f) == 0.00390625);
  CHECK(apply_scale_rule(ScaleRule::kPow2Nearest, 0.0022f) == 0.001953125);
  CHECK(apply_scale_rule(ScaleRule::kE8m0, 0.0022f) == 0.00390625);
  CHECK(apply_scale_rule(ScaleRule::kPow2Floor, 0.00390625f) == 0.00390625);
  CHECK(apply_scale_rule(ScaleRule::kE8m0, 0.00390625f) == 0.00390625);
  CHECK(apply_scale_rule(ScaleRule::kPow2Nearest, 0.00390625f) == 0.0078125);
  // bf16: 7 stored bits; 1.2538672 * 2^-8 rounds down to 1.25 * 2^-8.
  CHECK(apply_scale_rule(ScaleRule::kBf16, 0.0048979f) == 0.0048828125);
  CHECK(apply_scale_rule(ScaleRule::kReciprocal, 0.5f) == 2.0);
  CHECK(apply_scale_rule(ScaleRule::kSquared, 0.5f) == 0.25);
  CHECK(apply_scale_rule(ScaleRule::kOne, 0.5f) == 1.0);
  const ResolvedVariant identity = resolve(Transform{}, 0.5f, 0.125);
  const ResolvedVariant latent_only =
      resolve(hypothesis_info(H::kScaleLatentOnly).transform, 0.5f, 0.125);
  CHECK(latent_only.latent_scale == 0.5);
  CHECK(latent_only.rope_scale == 1.0);
  CHECK(resolve(hypothesis_info(H::kSmScaleLog2e).transform, 0.5f, 0.125).sm_scale ==
        Approx(0.125 * 1.4426950408889634).epsilon(1e-15));
  CHECK(describe_variant(resolve(hypothesis_info(H::kScalePow2Floor).transform, 0.75f, 0.125),
                         resolve(Transform{}, 0.75f, 0.125)) == "kv_scale 0.75 read as 0.5 (2^-1)");
  CHECK(identity.same_computation(resolve(hypothesis_info(H::kLseBase2).transform, 0.5f, 0.125)));
}

TEST_CASE(
    "diagnosis: the fraction rule: passing the limits is not enough, the replay must land "
    "within explain_fraction of the candidate's distance",
    "[diagnosis]") {
  const Policy policy = default_policy();
  REQUIRE(policy.explain_fraction == 0.25);
  // Kernel limits: rel_l2 2^-8 = 0.0039, lse 2^-10. The candidate fails rel_l2 (0.006) and lse.
  ComparisonMetrics before;
  before.rel_l2 = 0.006;
  before.cos_diff = 0.0;
  before.has_lse = true;
  before.lse_max_abs = 0.004;
  ComparisonMetrics after = before;
  after.rel_l2 = 0.003;  // passes the rel_l2 limit, but only half way to the candidate
  after.lse_max_abs = 1e-6;
  HypothesisJudgement j = judge_hypothesis(policy, Comparison::kKernel, before, after, 1.0);
  CHECK(j.passes_limits);
  CHECK(j.fraction == Approx(0.5));
  CHECK_FALSE(j.within_fraction);
  CHECK_FALSE(j.explains);
  after.rel_l2 = 0.0012;  // 1/5 of the candidate's distance: explains
  j = judge_hypothesis(policy, Comparison::kKernel, before, after, 1.0);
  CHECK(j.fraction == Approx(0.2));
  CHECK(j.explains);
  // A metric the candidate passes (lse 1e-6) is held to the limit, not to the fraction.
  before.lse_max_abs = 1e-6;
  after.lse_max_abs = 2e-6;
  j = judge_hypothesis(policy, Comparison::kKernel, before, after, 1.0);
  CHECK(j.fraction == Approx(0.2));
  CHECK(j.explains);
}

TEST_CASE("diagnosis: the double variant of R8 agrees with the exact reference", "[diagnosis]") {
  TinySpec spec;
  spec.page_size = 2;
  const TinyDump dump = make_tiny_dump(spec);
  const std::size_t s = 1;
  const KvPool pool = dump.pool_after(s, 0);
  const StepMeta& step = dump.steps[s];
  const StepLayerTensors& t = dump.tensors[s][0];
  const std::vector<std::int64_t> visible = visible_slots(step, dump.attrs.page_size);
  const std::size_t pairs = static_cast<std::size_t>(step.num_rows()) * dump.attrs.num_heads;
  std::vector<double> exact_out(pairs * spec.dc), exact_lse(pairs);
  const KvRows rows = KvRows::from_pool_slots(pool, spec.kv_scale, visible);
  REQUIRE(mla_reference_attention(dump.attrs, step, t.q_nope, t.q_pe, rows, exact_out, exact_lse, 2)
              .ok());
  std::vector<double> out(pairs * spec.dc), lse(pairs);
  const DecodedRows decoded = DecodedRows::decode(pool, PoolRead::kAsStored, visible);
  const ResolvedVariant identity = resolve(Transform{}, spec.kv_scale, spec.sm_scale);
  REQUIRE(
      variant_attention(dump.attrs, step, t.q_nope, t.q_pe, decoded, identity, out, lse, 2).ok());
  double max_out = 0.0;
  for (const double v : exact_out) max_out = std::max(max_out, std::abs(v));
  for (std::size_t k = 0; k < out.size(); ++k)
    CHECK(std::abs(out[k] - exact_out[k]) < 1e-13 * max_out);
  for (std::size_t k = 0; k < lse.size(); ++k) CHECK(std::abs(lse[k] - exact_lse[k]) < 1e-13);
}

TEST_CASE(
    "diagnosis: each planted kernel mismatch fails check and is named, alone or with its "
    "twins on the data",
    "[diagnosis]") {
  const std::vector<PlantedCase> cases = planted_cases();
  REQUIRE(cases.size() == 32);
  // range's end is exclusive: every case, the last (rope-dot-missing) included.
  const std::size_t index = GENERATE(range<std::size_t>(0, 32));
  const PlantedCase& c = cases[index];
  INFO("planted " << hypothesis_name(c.planted) << ", kv_scale " << c.kv_scale);
  const TinyDump dump = make_tiny_dump(planted_spec(c));
  PlantedBackend backend(c.planted);
  const CheckRun run =
      replay_tiny(dump, std::string("planted_kernel_") + std::to_string(index), &backend);
  // The mismatch fails the kernel comparison at every step; the four earliest are diagnosed
  // (three steps, one layer: all of them).
  int failing_kernels = 0;
  for (const ComparisonResult& r : run.comparisons) {
    if (r.comparison == Comparison::kKernel && !r.judgement.pass) ++failing_kernels;
  }
  REQUIRE(failing_kernels == static_cast<int>(dump.steps.size()));
  REQUIRE(run.diagnosis.size() == dump.steps.size());
  check_findings(run, c, Comparison::kKernel);
  if (c.planted == H::kProbabilitiesE4m3Tile) {  // the tile the kernel used (64) is the one named
    for (const DiagnosisFinding& finding : run.diagnosis) {
      for (const HypothesisOutcome& outcome : finding.explained_by) {
        CHECK_THAT(outcome.transform, Catch::Contains("tile 64, 1 split"));
      }
    }
  }
}

TEST_CASE(
    "diagnosis: a captured output computed under a mismatch is named on the captured "
    "comparison",
    "[diagnosis]") {
  // The captured limits are loose (a server may round K and V to bf16): the mismatches that move
  // outputs by O(1) fail them; each must be named alone.
  const std::vector<PlantedCase> all = planted_cases();
  const std::size_t index = GENERATE(0, 1, 8, 9, 10, 12, 14, 15, 27, 28, 29, 30, 31);
  const PlantedCase& c = all[index];
  INFO("planted " << hypothesis_name(c.planted));
  TinyDump dump = make_tiny_dump(planted_spec(c));
  for (std::size_t s = 0; s < dump.steps.size(); ++s) {
    testing::plant_captured(dump, s, 0, dump.pool_after(s, 0), c.planted);
  }
  const CheckRun run =
      replay_tiny(dump, std::string("planted_captured_") + std::to_string(index), nullptr);
  for (const ComparisonResult& r : run.comparisons) {
    if (r.comparison == Comparison::kCaptured) CHECK_FALSE(r.judgement.pass);
  }
  REQUIRE(run.diagnosis.size() == dump.steps.size());
  check_findings(run, c, Comparison::kCaptured);
}

TEST_CASE("diagnosis: a server whose cache was written with scale 1 is named write-unit-scale",
          "[diagnosis]") {
  // The server quantized every row it cached (kv_source before step 0, new_kv after) with scale 1
  // and read the codes times kv_scale: its captured out/lse, computed here on such a pool.
  TinyDump dump = make_tiny_dump(planted_spec({H::kWriteUnitScale, 0.0029f, 0.35, {}, false}));
  KvPool unit = dump.pools[0];
  for (std::int64_t slot = 0; slot < dump.num_slots(); ++slot) {
    unit.write_row(slot, dump.sources[0].data() + slot * dump.width(), 1.0f);
  }
  for (std::size_t s = 0; s < dump.steps.size(); ++s) {
    for (int i = 0; i < dump.steps[s].num_rows(); ++i) {
      unit.write_row(dump.steps[s].new_kv_slots[i],
                     dump.tensors[s][0].new_kv.data() + i * dump.width(), 1.0f);
    }
    testing::plant_captured(dump, s, 0, unit, std::nullopt);
  }
  const CheckRun run = replay_tiny(dump, "planted_write_unit_scale", nullptr);
  REQUIRE(run.diagnosis.size() == dump.steps.size());
  check_findings(run, {H::kWriteUnitScale, 0.0029f, 0.35, names({H::kWriteUnitScale}), false},
                 Comparison::kCaptured);

  // Without kv_source the rows cached before step 0 have no unquantized value: not applicable.
  TinySpec no_source = planted_spec({H::kWriteUnitScale, 0.0029f, 0.35, {}, false});
  no_source.with_source = false;
  TinyDump bare = make_tiny_dump(no_source);
  for (std::size_t s = 0; s < bare.steps.size(); ++s) {
    bare.tensors[s][0].out = dump.tensors[s][0].out;
    bare.tensors[s][0].lse = dump.tensors[s][0].lse;
  }
  const CheckRun without = replay_tiny(bare, "planted_write_unit_scale_bare", nullptr);
  REQUIRE_FALSE(without.diagnosis.empty());
  for (const DiagnosisFinding& finding : without.diagnosis) {
    INFO(diagnosis_summary(finding));  // scale-squared may come near: codes e4m3(x) ~ s (x / s)
    CHECK(std::none_of(
        finding.explained_by.begin(), finding.explained_by.end(),
        [](const HypothesisOutcome& o) { return o.hypothesis == "write-unit-scale"; }));
    CHECK(std::count(finding.not_applicable.begin(), finding.not_applicable.end(),
                     "write-unit-scale") == 1);
  }
}

TEST_CASE(
    "diagnosis: kv_scale folded into the softmax scale or applied to the output passes check: "
    "nothing to diagnose",
    "[diagnosis]") {
  // In fp32 these differ from scaling K and V by one rounding of sm_scale * s (or none): a clean
  // kernel's level. The diagnosis runs only on failures, so they are never named here; alone,
  // v-scale-on-output is R8's own computation in double (not applicable).
  const H planted = GENERATE(H::kKeyScaleInSmScale, H::kValueScaleOnOutput);
  INFO("planted " << hypothesis_name(planted));
  const TinyDump dump = make_tiny_dump(planted_spec({planted, 0.0029f, 0.35, {}, false}));
  PlantedBackend backend(planted);
  const CheckRun run =
      replay_tiny(dump, std::string("planted_pass_") + hypothesis_name(planted), &backend);
  CHECK(run.pass());
  CHECK(run.diagnosis.empty());
  const ResolvedVariant identity = resolve(Transform{}, 0.0029f, 0.35);
  CHECK(resolve(hypothesis_info(H::kValueScaleOnOutput).transform, 0.0029f, 0.35) == identity);
  const ResolvedVariant folded =
      resolve(hypothesis_info(H::kKeyScaleInSmScale).transform, 0.0029f, 0.35);
  // SGLang's rule: sm_scale * k_scale in double (Python floats), one rounding to fp32; an fp32
  // product of fp32(0.35) and 0.0029f would be 0.0010149999, this is 0.001015.
  const double product = 0.35 * static_cast<double>(0.0029f);
  CHECK(folded.sm_scale == static_cast<double>(static_cast<float>(product)));
  CHECK(folded.sm_scale != static_cast<double>(0.35f * 0.0029f));
  CHECK(folded.value_scale == static_cast<double>(0.0029f));
  CHECK_FALSE(folded.same_computation(identity));
}

TEST_CASE("diagnosis: a kernel committing q-e4m3 and p-e4m3-tile (tile 64) is named as that pair",
          "[diagnosis]") {
  TinySpec spec;
  spec.layer_ids = {4};
  spec.prefix = {300, 20};
  const TinyDump dump = make_tiny_dump(spec);
  PlantedBackend backend(
      testing::PlantedChoices({H::kQueryE4m3, H::kProbabilitiesE4m3Tile}, 64, 1));
  const CheckRun run = replay_tiny(dump, "planted_pair", &backend);
  CHECK_FALSE(run.pass());
  REQUIRE(run.diagnosis.size() == dump.steps.size());
  for (const DiagnosisFinding& finding : run.diagnosis) {
    INFO("step " << finding.step << ": " << diagnosis_summary(finding) << "\n"
                 << distances(finding));
    CHECK(explaining(finding) == std::vector<std::string>{"q-e4m3 + p-e4m3-tile"});
    for (const HypothesisOutcome& outcome : finding.explained_by) {
      CHECK_THAT(outcome.transform,
                 Catch::Contains("q cast to e4m3") && Catch::Contains("tile 64, 1 split"));
      CHECK(outcome.fraction <= 0.25);
    }
  }
}

// vLLM's Triton MLA decode (docs/peer-kernels.md): K and V dequantized as bf16(fp32(code) * s),
// lse stored in a bf16 buffer. Its failure is on the lse alone, and each choice hides the other:
// bf16(lse) is off by up to half a bf16 ulp (2^-6 for lse in [4, 8)) whatever K was, and the
// dequantization moves the fp32 lse (by ~1e-2 on vLLM's runs), so that the exact lse rounded to
// bf16 lands on another bf16 neighbour somewhere in the step. Neither single brings the lse
// closer, yet the pair reproduces every bf16 lse. Before, the search anchored its pairs on the
// failing metrics only and never tried the pair; the out error the dequantization removes
// (though within the limit) now makes k-dequant-fp32-bf16 an anchor. Not covered: where that out
// improvement is under 1.25x (an outlier gain of 16 with sm_scale 0.1 here), the pair is not
// tried and the step stays unexplained.
TEST_CASE(
    "diagnosis: K dequantized in fp32 then bf16 with the lse in bf16 (vLLM's Triton decode) is "
    "named as that pair, though neither helps the failing lse alone",
    "[diagnosis]") {
  TinySpec spec;
  spec.layer_ids = {4};
  spec.heads = 8;
  spec.dc = 512;
  spec.dr = 64;
  spec.prefix = {300, 20};
  // One outlier channel (gain 8 or 32) carries the out norm, so that, as on vLLM's runs, the
  // dequantization moves out by less than the kernel limit; kv_scale 1.1 x the outlier's amax /
  // 448 (not a power of two).
  spec.outlier_channel = 3;
  spec.outlier_gain = GENERATE(8.0f, 32.0f);
  spec.kv_scale = 0.0029f * spec.outlier_gain * 1.1f;
  spec.sm_scale = 0.35;
  INFO("outlier gain " << spec.outlier_gain << ", kv_scale " << spec.kv_scale);
  const TinyDump dump = make_tiny_dump(spec);
  PlantedBackend backend(testing::PlantedChoices({H::kDequantFp32Bf16, H::kLseBf16}, 64, 1));
  const CheckRun run = replay_tiny(dump, "planted_vllm_triton", &backend);
  CHECK_FALSE(run.pass());
  REQUIRE_FALSE(run.diagnosis.empty());
  int masked = 0;  // findings where neither single helps the lse by 1.25x
  for (const DiagnosisFinding& finding : run.diagnosis) {
    INFO("step " << finding.step << ": " << diagnosis_summary(finding) << "\n"
                 << distances(finding));
    const auto fraction_of = [&](const char* name) {
      const auto it =
          std::find_if(finding.hypotheses.begin(), finding.hypotheses.end(),
                       [&](const HypothesisOutcome& h) { return h.hypothesis == name; });
      return it == finding.hypotheses.end() ? 0.0 : it->fraction;
    };
    // The vLLM premise: the lse fails, the out passes.
    CHECK(finding.before.rel_l2 < 0.00390625);
    CHECK(finding.before.lse_max_abs > 0.0009765625);
    // Explained, every bf16 lse reproduced: by lse-bf16 alone where the dequantization moved no
    // lse across a bf16 rounding boundary, else by the pair.
    CHECK_FALSE(finding.explained_by.empty());
    for (const HypothesisOutcome& outcome : finding.explained_by) {
      CHECK(outcome.after.lse_max_abs == 0.0);
    }
    if (fraction_of("k-dequant-fp32-bf16") * kHypothesisTieRatio > 1.0 &&
        fraction_of("lse-bf16") * kHypothesisTieRatio > 1.0) {
      ++masked;
      const std::vector<std::string> found = explaining(finding);
      CHECK(std::find(found.begin(), found.end(), "k-dequant-fp32-bf16 + lse-bf16") != found.end());
    }
  }
  CHECK(masked > 0);  // the case this test is about occurs on this data
}

TEST_CASE(
    "diagnosis: a fault no hypothesis models (q_pe negated) is unexplained, naming the closest",
    "[diagnosis]") {
  TinyDump dump = make_tiny_dump(TinySpec{});
  for (std::size_t s = 0; s < dump.steps.size(); ++s) {
    StepLayerTensors flipped = dump.tensors[s][0];
    for (float& x : flipped.q_pe) x = -x;
    const testing::PlantedOutput output =
        testing::planted_attention(dump.attrs, dump.steps[s], flipped, dump.layers[0].kv_scale,
                                   dump.pool_after(s, 0), std::nullopt);
    dump.tensors[s][0].out = output.out;
    dump.tensors[s][0].lse = output.lse;
  }
  const CheckRun run = replay_tiny(dump, "diagnosis_unmodelled", nullptr);
  CHECK_FALSE(run.pass());
  REQUIRE(run.diagnosis.size() == dump.steps.size());
  for (const DiagnosisFinding& finding : run.diagnosis) {
    INFO(diagnosis_summary(finding) << "\n" << distances(finding));
    CHECK(finding.explained_by.empty());
    CHECK_THAT(diagnosis_summary(finding),
               Catch::StartsWith("no hypothesis in the catalogue explains this failure"));
    REQUIRE(finding.closest.has_value());
    CHECK(finding.closest->fraction > 0.25);
    // Every hypothesis tried is reported with its distances, so the rule can be checked.
    CHECK(static_cast<int>(finding.hypotheses.size()) == finding.tried);
    for (const HypothesisOutcome& h : finding.hypotheses) CHECK_FALSE(h.explains);
  }
}

TEST_CASE("diagnosis: a clean run has none, and prints nothing", "[diagnosis]") {
  TinySpec spec;
  spec.layer_ids = {0, 3};
  TinyDump dump = make_tiny_dump(spec);
  for (std::size_t s = 0; s < dump.steps.size(); ++s) {
    for (std::size_t l = 0; l < dump.layers.size(); ++l) {
      testing::plant_captured(dump, s, l, dump.pool_after(s, l), std::nullopt);
    }
  }
  PlantedBackend backend(std::nullopt);
  const CheckRun run = replay_tiny(dump, "diagnosis_clean", &backend);
  CHECK(run.pass());
  CHECK(run.diagnosis.empty());
  CHECK(to_json(run).at("diagnosis") == nlohmann::json::array());
  std::ostringstream out;
  print_check_table(out, run);
  CHECK(out.str().find("diagnosis") == std::string::npos);
  CHECK(render_diagnosis_markdown(run).empty());
  CHECK(render_markdown(run).find("## Diagnosis") == std::string::npos);
}

TEST_CASE("diagnosis: random captured outputs are explained by no hypothesis, and it says so",
          "[diagnosis]") {
  TinyDump dump = make_tiny_dump(TinySpec{});
  testing::Lcg rng(99);
  for (std::size_t s = 0; s < dump.steps.size(); ++s) {
    testing::plant_captured(dump, s, 0, dump.pool_after(s, 0), std::nullopt);
    for (float& v : *dump.tensors[s][0].out) v = bf16_round(rng.symmetric());
    for (float& v : *dump.tensors[s][0].lse) v = 3.0f * rng.symmetric();
  }
  const CheckRun run = replay_tiny(dump, "diagnosis_random", nullptr);
  CHECK_FALSE(run.pass());
  REQUIRE(run.diagnosis.size() == dump.steps.size());
  for (const DiagnosisFinding& finding : run.diagnosis) {
    CHECK(finding.comparison == Comparison::kCaptured);
    CHECK(finding.explained_by.empty());
    CHECK(finding.tried > 0);
    CHECK_THAT(diagnosis_summary(finding),
               Catch::StartsWith("no hypothesis in the catalogue explains this failure"));
    if (finding.closest) CHECK(finding.closest->excess > 1.0);
  }
  std::ostringstream out;
  print_check_table(out, run);
  CHECK_THAT(out.str(), Catch::Contains("diagnosis (convention mismatches") &&
                            Catch::Contains("step 1 layer 0 captured: no hypothesis in the "
                                            "catalogue explains this failure"));
  CHECK_THAT(render_markdown(run),
             Catch::Contains("## Diagnosis") && Catch::Contains("no hypothesis in the catalogue"));
}

TEST_CASE("diagnosis: at most N (step, layer)s, the earliest steps first, and a note says so",
          "[diagnosis]") {
  TinySpec spec;
  spec.layer_ids = {0, 1, 2};
  const TinyDump dump = make_tiny_dump(spec);  // 3 steps x 3 layers, every one failing
  PlantedBackend backend(H::kScalePow2Floor);
  ReplayOptions options;
  options.diagnose = 2;
  const CheckRun capped = replay_tiny(dump, "diagnosis_capped", &backend, options);
  // Replayed layer by layer, but the earliest steps win: step 0 of layers 0 and 1.
  REQUIRE(capped.diagnosis.size() == 2);
  CHECK(capped.diagnosis[0].step == 0);
  CHECK(capped.diagnosis[0].layer_id == 0);
  CHECK(capped.diagnosis[1].step == 0);
  CHECK(capped.diagnosis[1].layer_id == 1);
  CHECK(std::any_of(capped.notes.begin(), capped.notes.end(), [](const std::string& note) {
    return note.find("diagnosis: 2 of 9 (step, layer)s") != std::string::npos &&
           note.find("--diagnose 2") != std::string::npos;
  }));

  options.diagnose = 0;
  const CheckRun off = replay_tiny(dump, "diagnosis_off", &backend, options);
  CHECK(off.diagnosis.empty());
  CHECK_FALSE(off.pass());
  for (const std::string& note : off.notes) CHECK(note.find("diagnosis") == std::string::npos);

  options.diagnose = 9;
  const CheckRun all = replay_tiny(dump, "diagnosis_all", &backend, options);
  CHECK(all.diagnosis.size() == 9);
  for (const std::string& note : all.notes) CHECK(note.find("diagnosis") == std::string::npos);
}

TEST_CASE("diagnosis: YaRN's mscale^2 from the dump's rope attributes, on known numbers",
          "[diagnosis]") {
  DumpAttributes attrs;
  attrs.sm_scale = 0.35;
  CHECK_FALSE(yarn_mscale_squared(attrs).has_value());  // absent: nothing is guessed
  attrs.rope_factor = 40.0;
  CHECK_FALSE(yarn_mscale_squared(attrs).has_value());  // rope_mscale_all_dim still absent
  attrs.rope_mscale_all_dim = 1.0;
  // DeepSeek-V3's config: (0.1 ln 40 + 1)^2 = 1.368879...^2, and 192^-0.5 times it is the
  // model's softmax scale 0.1352337788608801 (src/tools/model_presets.hpp).
  REQUIRE(yarn_mscale_squared(attrs).has_value());
  CHECK(*yarn_mscale_squared(attrs) == Approx(1.8738542070926265).epsilon(1e-15));
  CHECK(std::pow(192.0, -0.5) * *yarn_mscale_squared(attrs) ==
        Approx(0.1352337788608801).epsilon(1e-15));
  const std::optional<double> m2 = yarn_mscale_squared(attrs);
  CHECK(resolve(hypothesis_info(H::kSmScaleMscaleDropped).transform, 0.0029f, 0.35, 0.0f, {}, m2)
            .sm_scale == Approx(0.18678080646575038).epsilon(1e-15));
  CHECK(resolve(hypothesis_info(H::kSmScaleMscaleTwice).transform, 0.0029f, 0.35, 0.0f, {}, m2)
            .sm_scale == Approx(0.6558489724824192).epsilon(1e-15));
  // Unknown mscale: the rule resolves to no number (not applicable), never to sm_scale itself.
  CHECK(std::isnan(
      resolve(hypothesis_info(H::kSmScaleMscaleDropped).transform, 0.0029f, 0.35).sm_scale));
  attrs.rope_mscale_all_dim = 0.0;  // YaRN without mscale_all_dim: the scale is not changed
  CHECK(yarn_mscale_squared(attrs) == 1.0);
  attrs.rope_mscale_all_dim = 1.0;
  attrs.rope_factor = 1.0;  // yarn_get_mscale is 1 for factor <= 1
  CHECK(yarn_mscale_squared(attrs) == 1.0);
}

TEST_CASE("diagnosis: RoPE layouts: de-interleaved is even elements then odd, and back",
          "[diagnosis]") {
  const std::vector<float> x = {0, 1, 2, 3, 4, 5, 6, 7};
  std::vector<float> y(8);
  deinterleave_rope(x, y);
  CHECK(y == std::vector<float>{0, 2, 4, 6, 1, 3, 5, 7});
  interleave_rope(x, y);
  CHECK(y == std::vector<float>{0, 4, 1, 5, 2, 6, 3, 7});
  // The injections hand the attention q_pe permuted per (row, head): kpe-deinterleaved's
  // q_pe . D(r) as I(q_pe) . r, qpe-deinterleaved's D(q_pe) . r.
  DumpAttributes attrs;
  attrs.qk_rope_head_dim = 8;
  StepLayerTensors q_pe;  // two (row, head) pairs
  q_pe.q_pe = {0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12, 13, 14, 15, 16, 17};
  auto kpe = translate_input(Injection::kKpeDeinterleaved, attrs, q_pe);
  REQUIRE(kpe.ok());
  CHECK(kpe->tensors.q_pe ==
        std::vector<float>{0, 4, 1, 5, 2, 6, 3, 7, 10, 14, 11, 15, 12, 16, 13, 17});
  auto qpe = translate_input(Injection::kQpeDeinterleaved, attrs, q_pe);
  REQUIRE(qpe.ok());
  CHECK(qpe->tensors.q_pe ==
        std::vector<float>{0, 2, 4, 6, 1, 3, 5, 7, 10, 12, 14, 16, 11, 13, 15, 17});
  auto dropped = translate_input(Injection::kRopeDotMissing, attrs, q_pe);
  REQUIRE(dropped.ok());
  CHECK(dropped->tensors.q_pe == std::vector<float>(16, 0.0f));
  // The mscale faults need the rope attributes: refused without them, naming them.
  auto refused = translate_input(Injection::kMscaleDropped, attrs, q_pe);
  REQUIRE_FALSE(refused.ok());
  CHECK_THAT(refused.error().message(), Catch::Contains("rope_mscale_all_dim"));
}

TEST_CASE(
    "diagnosis: without rope attributes the mscale hypotheses are not tried, and the report "
    "says why",
    "[diagnosis]") {
  const PlantedCase c{H::kSmScaleMissing, 0.0029f, 0.35, names({H::kSmScaleMissing}), false};
  const TinyDump dump = make_tiny_dump(planted_spec(c));
  PlantedBackend backend(c.planted);
  const CheckRun run = replay_tiny(dump, "planted_no_rope_attributes", &backend);
  REQUIRE_FALSE(run.diagnosis.empty());
  for (const DiagnosisFinding& finding : run.diagnosis) {
    for (const char* name : {"sm-scale-mscale-dropped", "sm-scale-mscale-twice"}) {
      INFO(name);
      CHECK(std::count(
                finding.not_applicable.begin(), finding.not_applicable.end(),
                std::string(name) + " (the dump has no rope_factor and rope_mscale_all_dim)") == 1);
      CHECK(std::none_of(finding.hypotheses.begin(), finding.hypotheses.end(),
                         [&](const HypothesisOutcome& o) {
                           return o.hypothesis.find(name) != std::string::npos;
                         }));
    }
  }
}

TEST_CASE("diagnosis: cpu-fp8 with a translation injection is named as that translation fault",
          "[diagnosis]") {
  // The backend under test commits the fault (src/backend/injection.cpp); the planted kernel
  // cases above check the hypotheses against a model written from the definitions.
  const auto [injection, hypothesis] =
      GENERATE(std::make_pair("mscale-dropped", H::kSmScaleMscaleDropped),
               std::make_pair("mscale-twice", H::kSmScaleMscaleTwice),
               std::make_pair("kpe-deinterleaved", H::kKpeDeinterleaved),
               std::make_pair("qpe-deinterleaved", H::kQpeDeinterleaved),
               std::make_pair("rope-dot-missing", H::kRopeDotMissing));
  INFO("--inject " << injection);
  const PlantedCase c{hypothesis, 0.0029f, 0.35, names({hypothesis}), false, {6, 0}, true};
  const TinyDump dump = make_tiny_dump(planted_spec(c));
  BackendOptions backend_options;
  backend_options.threads = 2;
  backend_options.injection = injection;
  auto backend = make_backend("cpu-fp8", backend_options);
  REQUIRE(backend.ok());
  const CheckRun run = replay_tiny(dump, std::string("translation_") + injection, backend->get());
  REQUIRE(run.diagnosis.size() == dump.steps.size());
  check_findings(run, c, Comparison::kKernel);
}

TEST_CASE(
    "diagnosis: cpu-fp8's scale-mismatch and fp8-read-as-bf16 injections are named on every "
    "shipped dump",
    "[diagnosis][datasets]") {
  const char* dump = GENERATE("glm5_page1", "page64_nan", "saturated_page16");
  const char* injection = GENERATE("scale-mismatch", "fp8-read-as-bf16");
  INFO(dump << " --inject " << injection);
  BackendOptions backend_options;
  backend_options.threads = 2;
  backend_options.injection = injection;
  auto backend = make_backend("cpu-fp8", backend_options);
  REQUIRE(backend.ok());
  const CheckRun run = replay_file(
      kvaudit_test::source_dir() / "datasets" / (std::string(dump) + ".h5"), backend->get());
  CHECK_FALSE(run.pass());
  REQUIRE_FALSE(run.diagnosis.empty());
  const std::set<std::string> rounding = {"scale-pow2-floor", "scale-pow2-nearest", "scale-e8m0"};
  int misreads_explained = 0;
  for (const DiagnosisFinding& finding : run.diagnosis) {
    INFO("step " << finding.step << " layer " << finding.layer_id << ": "
                 << diagnosis_summary(finding));
    CHECK(finding.comparison == Comparison::kKernel);
    const std::vector<std::string> found = explaining(finding);
    if (std::string(injection) == "fp8-read-as-bf16") {
      // Bytes of saturated codes read as bf16 are near bf16's largest (~3e38): the kernel's fp32
      // q.k can overflow to Inf where the hypothesis, replayed in binary64, stays finite (step 0
      // of saturated_page16 since its queries follow GLM-5's scale 1/16). Such a finding has
      // NaN/Inf mismatches and no hypothesis explains it; every other finding must be the misread.
      if (finding.before.nonfinite_mismatches > 0 && found.empty()) continue;
      CHECK(found == std::vector<std::string>{"fp8-read-as-bf16"});
      ++misreads_explained;
      continue;
    }
    // kv_scale rounded to the nearest power of two, which is also its floor or its ceiling
    // (e8m0's): the same computation, named together.
    REQUIRE(found.size() == 2);
    CHECK(std::find(found.begin(), found.end(), "scale-pow2-nearest") != found.end());
    for (const std::string& name : found) CHECK(rounding.count(name) == 1);
    CHECK(finding.same_computation);
  }
  if (std::string(injection) == "fp8-read-as-bf16") CHECK(misreads_explained > 0);
}

TEST_CASE("diagnosis: cpu-fp8's RoPE translation injections are named on every shipped dump",
          "[diagnosis][datasets]") {
  const char* dump = GENERATE("glm5_page1", "page64_nan", "saturated_page16");
  const char* injection = GENERATE("kpe-deinterleaved", "qpe-deinterleaved", "rope-dot-missing");
  INFO(dump << " --inject " << injection);
  BackendOptions backend_options;
  backend_options.threads = 2;
  backend_options.injection = injection;
  auto backend = make_backend("cpu-fp8", backend_options);
  REQUIRE(backend.ok());
  const CheckRun run = replay_file(
      kvaudit_test::source_dir() / "datasets" / (std::string(dump) + ".h5"), backend->get());
  CHECK_FALSE(run.pass());
  REQUIRE_FALSE(run.diagnosis.empty());
  for (const DiagnosisFinding& finding : run.diagnosis) {
    INFO("step " << finding.step << " layer " << finding.layer_id << ": "
                 << diagnosis_summary(finding));
    CHECK(finding.comparison == Comparison::kKernel);
    CHECK(explaining(finding) == std::vector<std::string>{injection});
  }
}

// The candidate's bf16 out store (docs/design.md "The candidate's output store"): rounding out to
// bf16 costs rel_l2 ~0.0017, which no replay in double reproduces, so a kernel failing rel_l2 by
// little (2^-8 < rel_l2 < 4 x 0.0017) could not be explained even by a replay of its exact math.
// The planted kernels take P in fp32 (PlantedChoices::p_bf16), so that what separates them from a
// replay of their choices is their fp32 arithmetic and their bf16 out store.
namespace {

TinySpec out_store_spec() {
  TinySpec spec;
  spec.layer_ids = {4};
  spec.heads = 8;
  spec.dc = 512;
  spec.dr = 64;
  spec.prefix = {300, 20};
  spec.sm_scale = 0.3;
  return spec;
}

const HypothesisOutcome* outcome_named(const DiagnosisFinding& finding, const std::string& name) {
  for (const HypothesisOutcome& h : finding.hypotheses) {
    if (h.hypothesis == name) return &h;
  }
  return nullptr;
}

}  // namespace

TEST_CASE(
    "diagnosis: a kernel failing rel_l2 by little, through k-dequant-fp32-bf16 and its bf16 out, "
    "is explained once the replays are compared as it stores out",
    "[diagnosis]") {
  const TinyDump dump = make_tiny_dump(out_store_spec());
  testing::PlantedChoices choices({H::kDequantFp32Bf16}, 64, 1);
  choices.p_bf16 = false;
  PlantedBackend backend(choices);
  const CheckRun run = replay_tiny(dump, "planted_out_store", &backend);
  CHECK_FALSE(run.pass());
  REQUIRE_FALSE(run.diagnosis.empty());
  int out_bound = 0;  // findings the unrounded replay could not explain on rel_l2
  for (const DiagnosisFinding& finding : run.diagnosis) {
    INFO("step " << finding.step << ": " << diagnosis_summary(finding) << "\n"
                 << distances(finding));
    CHECK(explaining(finding) == names({H::kDequantFp32Bf16}));
    REQUIRE(finding.baseline_stored.has_value());
    const HypothesisOutcome* replay = outcome_named(finding, "k-dequant-fp32-bf16");
    REQUIRE(replay != nullptr);
    REQUIRE(replay->after_stored.has_value());
    CHECK(replay->fraction <= 0.25);
    if (finding.before.rel_l2 > 0.00390625) {
      // The case of issue 29: the unrounded replay stays at the bf16 store's ~0.0017, more than
      // 1/4 of the kernel's distance; stored as the kernel stores it, it is within 2^-12. The
      // rule's rel_l2 ratio, as report.json lets a reader recompute it, is within the fraction.
      CHECK(replay->after.rel_l2 / finding.before.rel_l2 > 0.25);
      CHECK(replay->after_stored->rel_l2 / finding.baseline_stored->rel_l2 <= replay->fraction);
      CHECK(replay->after_stored->rel_l2 < 0.000244140625);
      ++out_bound;
    }
  }
  CHECK(out_bound > 0);  // the case this test is about occurs on this data
}

TEST_CASE(
    "diagnosis: a kernel whose out is off by 2^-8 (no hypothesis models it) stays unexplained "
    "when the replays are compared as it stores out",
    "[diagnosis]") {
  // The clean model with fp32 P, its out scaled by 1 + 2^-8 before the bf16 store: about one bf16
  // rounding, uncatalogued. No hypothesis moves out that way here (kv_scale 0.0029: bf16 rounds it
  // by -2.5e-4, fp16 by less, a power of two by a third or more), so each replay, rounded as the
  // kernel stores out, stays about 2^-8 from it while the baseline is about as far.
  TinyDump dump = make_tiny_dump(out_store_spec());
  testing::PlantedChoices clean;
  clean.p_bf16 = false;
  for (std::size_t s = 0; s < dump.steps.size(); ++s) {
    testing::PlantedOutput output =
        testing::planted_attention(dump.attrs, dump.steps[s], dump.tensors[s][0],
                                   dump.layers[0].kv_scale, dump.pool_after(s, 0), clean);
    for (float& v : output.out) v = bf16_round(v * (1.0f + 0.00390625f));
    dump.tensors[s][0].out = std::move(output.out);
    dump.tensors[s][0].lse = std::move(output.lse);
  }
  // The captured limits (2^-5) would pass this; judged with the kernel's, as a kernel would be.
  ReplayOptions options;
  options.policy = default_policy();
  options.policy.captured = options.policy.kernel;
  const CheckRun run = replay_tiny(dump, "planted_out_scaled", nullptr, options);
  CHECK_FALSE(run.pass());
  REQUIRE_FALSE(run.diagnosis.empty());
  for (const DiagnosisFinding& finding : run.diagnosis) {
    INFO("step " << finding.step << ": " << diagnosis_summary(finding) << "\n"
                 << distances(finding));
    CHECK(finding.comparison == Comparison::kCaptured);
    CHECK(finding.before.rel_l2 > 0.00390625);
    REQUIRE(finding.baseline_stored.has_value());  // a bfloat16 capture: the store is modelled
    CHECK(finding.explained_by.empty());
    REQUIRE(finding.closest.has_value());
    CHECK(finding.closest->fraction > 0.5);
    for (const HypothesisOutcome& h : finding.hypotheses) {
      CHECK_FALSE(h.explains);
      if (h.after_stored) CHECK(h.after_stored->rel_l2 > 0.5 * finding.baseline_stored->rel_l2);
    }
  }
}

}  // namespace kvaudit
