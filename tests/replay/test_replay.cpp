// Replay engine tests on tiny dumps made here (tests/replay/check_dumps.hpp).
//
// Planted captured outputs come from a small model of the FP8 kernel written in this file
// (planted_attention): fp32 scores on the decoded codes with kv_scale folded into the score scale,
// a base-2 softmax, P rounded before P.V, out rounded to bf16. Its two faulty variants are the
// bugs the captured comparison must catch: P rounded to e4m3 instead of bf16 (2^-4 instead of
// 2^-8 relative per weight), and the pool dequantized with kv_scale rounded to a power of two.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "src/backend/backend.hpp"
#include "src/cli/backend_registry.hpp"
#include "src/core/fp8_e4m3.hpp"
#include "src/format/kvdump.hpp"
#include "src/replay/replay.hpp"
#include "src/verdict/check_result.hpp"
#include "tests/replay/check_dumps.hpp"
#include "tests/replay/replay_tiny.hpp"
#include "tests/test_paths.hpp"

namespace kvaudit {
namespace {

using testing::make_tiny_dump;
using testing::replay_tiny;
using testing::TinyDump;
using testing::TinySpec;

enum class Fault { kNone, kProbabilitiesE4m3, kPowerOfTwoScale };

// out: [Nq, H, Dc] (bf16 values), lse: [Nq, H] (natural log), for step s, layer l of the dump.
void planted_attention(const TinyDump& dump, std::size_t s, std::size_t l, Fault fault,
                       std::vector<float>& out, std::vector<float>& lse) {
  const KvPool pool = dump.pool_after(s, l);
  const StepMeta& step = dump.steps[s];
  const StepLayerTensors& t = dump.tensors[s][l];
  const int heads = dump.attrs.num_heads;
  const int dc = dump.attrs.kv_lora_rank;
  const int dr = dump.attrs.qk_rope_head_dim;
  const int page = dump.attrs.page_size;
  float scale = dump.layers[l].kv_scale;
  if (fault == Fault::kPowerOfTwoScale) scale = std::exp2(std::round(std::log2(scale)));
  const float score_scale = static_cast<float>(dump.attrs.sm_scale * scale * 1.4426950408889634);
  const int nq = step.num_rows();
  out.assign(static_cast<std::size_t>(nq) * heads * dc, 0.0f);
  lse.assign(static_cast<std::size_t>(nq) * heads, 0.0f);
  for (int i = 0; i < nq; ++i) {
    const int b = step.request_of_row(i);
    const std::int64_t visible = step.position_of_row(i, page) + 1;
    for (int h = 0; h < heads; ++h) {
      const float* qn = t.q_nope.data() + (static_cast<std::size_t>(i) * heads + h) * dc;
      const float* qp = t.q_pe.data() + (static_cast<std::size_t>(i) * heads + h) * dr;
      std::vector<float> scores(visible);
      float m = -INFINITY;
      for (std::int64_t p = 0; p < visible; ++p) {
        const std::int64_t slot = step.slot_of(b, p, page);
        float dot = 0.0f;
        for (int c = 0; c < dc; ++c) dot += qn[c] * pool.element(slot, c);
        for (int c = 0; c < dr; ++c) dot += qp[c] * pool.element(slot, dc + c);
        scores[p] = dot * score_scale;
        m = std::max(m, scores[p]);
      }
      float sum = 0.0f;
      std::vector<float> acc(dc, 0.0f);
      for (std::int64_t p = 0; p < visible; ++p) {
        const float weight = std::exp2(scores[p] - m);
        sum += weight;
        const float rounded = fault == Fault::kProbabilitiesE4m3 ? e4m3_decode(e4m3_encode(weight))
                                                                 : bf16_round(weight);
        const std::int64_t slot = step.slot_of(b, p, page);
        for (int c = 0; c < dc; ++c) acc[c] += rounded * pool.element(slot, c);
      }
      float* o = out.data() + (static_cast<std::size_t>(i) * heads + h) * dc;
      for (int c = 0; c < dc; ++c) o[c] = bf16_round(acc[c] * (scale / sum));
      lse[static_cast<std::size_t>(i) * heads + h] =
          static_cast<float>((m + std::log2(sum)) * 0.6931471805599453);
    }
  }
}

void plant_outputs(TinyDump& dump, std::size_t s, std::size_t l, Fault fault) {
  std::vector<float> out;
  std::vector<float> lse;
  planted_attention(dump, s, l, fault, out, lse);
  dump.tensors[s][l].out = std::move(out);
  dump.tensors[s][l].lse = std::move(lse);
}

const ComparisonResult* find_comparison(const CheckRun& run, int step, int layer_id,
                                        Comparison kind) {
  for (const ComparisonResult& c : run.comparisons) {
    if (c.step == step && c.layer_id == layer_id && c.comparison == kind) return &c;
  }
  return nullptr;
}

std::vector<const IntegrityFinding*> failing_integrity(const CheckRun& run) {
  std::vector<const IntegrityFinding*> failing;
  for (const IntegrityFinding& f : run.integrity) {
    if (!f.pass) failing.push_back(&f);
  }
  return failing;
}

std::vector<const ComparisonResult*> failing_comparisons(const CheckRun& run) {
  std::vector<const ComparisonResult*> failing;
  for (const ComparisonResult& c : run.comparisons) {
    if (!c.judgement.pass) failing.push_back(&c);
  }
  return failing;
}

std::unique_ptr<Backend> cpu_backend() {
  BackendOptions options;
  options.threads = 2;
  auto backend = make_backend("cpu-fp8", options);
  if (!backend.ok()) FAIL(backend.error().message());
  return std::move(backend.value());
}

// A test-only backend: cpu-fp8, then one corruption of the pool at one (step, layer).
enum class Corruption { kNeighbourSlot, kNothingWritten, kNanWritten };

class CorruptingBackend : public Backend {
 public:
  CorruptingBackend(Corruption corruption, std::size_t step, std::size_t layer_index)
      : inner_(cpu_backend()), corruption_(corruption), step_(step), layer_index_(layer_index) {}
  std::string name() const override { return "corrupting-cpu-fp8"; }
  nlohmann::json describe() const override { return {{"name", name()}}; }
  Result<AttentionOutput> run_step(const StepLayerInput& input, KvPool& pool) override {
    const KvPool before = pool;
    auto output = inner_->run_step(input, pool);
    if (!output.ok() || input.step_index != step_ || input.layer_index != layer_index_) {
      return output;
    }
    const std::int64_t slot = input.step.new_kv_slots[corrupted_row];
    const std::size_t bytes = pool.row_bytes();
    switch (corruption_) {
      case Corruption::kNeighbourSlot:  // the row goes to slot + 1, slot keeps its old bytes
        std::copy_n(pool.row(slot), bytes, pool.row(slot + 1));
        std::copy_n(before.row(slot), bytes, pool.row(slot));
        break;
      case Corruption::kNothingWritten:
        for (const std::int32_t written : input.step.new_kv_slots) {
          std::copy_n(before.row(written), bytes, pool.row(written));
        }
        break;
      case Corruption::kNanWritten:
        pool.row(slot)[1] = kE4m3NanCode;
        break;
    }
    return output;
  }
  static constexpr int corrupted_row = 1;

 private:
  std::unique_ptr<Backend> inner_;
  Corruption corruption_;
  std::size_t step_;
  std::size_t layer_index_;
};

TinySpec crafted_spec() {
  TinySpec spec;
  spec.layer_ids = {0, 5};
  spec.prefix = {8, 6};
  spec.prefill = {2, 3};
  spec.crafted_scores = true;
  spec.sm_scale = 1.0;
  // -224 * 0.0028343 = -0.63488 = ln(0.53): every weight but the first token's is 0.53, which
  // e4m3 rounds to 0.5 (its grid in [0.5, 1) is 2^-4) and bf16 keeps to 2^-9.
  spec.kv_scale = 0.0028343f;
  return spec;
}

}  // namespace

TEST_CASE("planted captured outputs: the correct kernel model passes", "[replay]") {
  TinyDump dump = make_tiny_dump(crafted_spec());
  for (std::size_t s = 0; s < dump.steps.size(); ++s) {
    for (std::size_t l = 0; l < dump.layers.size(); ++l) plant_outputs(dump, s, l, Fault::kNone);
  }
  const CheckRun run = replay_tiny(dump, "planted_correct", nullptr);
  CHECK(run.backend == "none");
  // Every step and layer has a captured comparison, all passing.
  CHECK(std::count_if(run.comparisons.begin(), run.comparisons.end(), [](const auto& c) {
          return c.comparison == Comparison::kCaptured;
        }) == static_cast<long>(dump.steps.size() * dump.layers.size()));
  for (const ComparisonResult* c : failing_comparisons(run)) {
    FAIL_CHECK("S" << c->step << " L" << c->layer_id << " " << comparison_name(c->comparison)
                   << " fails: " << c->judgement.reasons.front());
  }
  CHECK(run.pass());
  CHECK_FALSE(run.first_divergence.has_value());
}

TEST_CASE(
    "planted captured outputs: P rounded to e4m3 or a power-of-two scale fail at their "
    "step and layer",
    "[replay]") {
  const Fault fault = GENERATE(Fault::kProbabilitiesE4m3, Fault::kPowerOfTwoScale);
  INFO((fault == Fault::kProbabilitiesE4m3 ? "P rounded to e4m3" : "power-of-two scale"));
  TinyDump dump = make_tiny_dump(crafted_spec());
  for (std::size_t s = 0; s < dump.steps.size(); ++s) {
    for (std::size_t l = 0; l < dump.layers.size(); ++l) {
      const bool faulty = s == 1 && l == 1;  // S001, layer id 5
      plant_outputs(dump, s, l, faulty ? fault : Fault::kNone);
    }
  }
  const CheckRun outcome = replay_tiny(
      dump, fault == Fault::kProbabilitiesE4m3 ? "planted_p_e4m3" : "planted_pow2", nullptr);
  const auto failing = failing_comparisons(outcome);
  REQUIRE(failing.size() == 1);
  CHECK(failing[0]->step == 1);
  CHECK(failing[0]->layer_id == 5);
  CHECK(failing[0]->comparison == Comparison::kCaptured);
  CHECK(failing[0]->sets_exit);
  CHECK_FALSE(outcome.pass());
  REQUIRE(outcome.first_divergence.has_value());
  CHECK(outcome.first_divergence->step == 1);
  CHECK(outcome.first_divergence->layer_id == 5);
  CHECK(outcome.first_divergence->row >= 0);
  CHECK(outcome.first_divergence->head >= 0);
}

TEST_CASE("a pool captured from a reciprocal-scale server fails by default, passes when named",
          "[replay]") {
  // Plant a value where the two rules disagree (found by search) in step 1's first new row.
  const auto [scale, planted] = testing::find_reciprocal_disagreement(0.0029f);
  REQUIRE(planted != 0.0f);
  TinySpec spec;
  spec.layer_ids = {2};
  spec.kv_scale = scale;
  TinyDump dump = make_tiny_dump(spec);
  dump.tensors[1][0].new_kv[0] = planted;
  int differing_codes = 0;
  for (std::size_t s = 0; s < dump.steps.size(); ++s) {
    dump.tensors[s][0].kv_cache_after = dump.pool_after(s, 0, /*reciprocal_scale=*/true);
    const KvPool kvdump_rule = dump.pool_after(s, 0);
    for (std::size_t b = 0; b < kvdump_rule.bytes.size(); ++b) {
      differing_codes += kvdump_rule.bytes[b] != dump.tensors[s][0].kv_cache_after->bytes[b];
    }
  }
  // Meaningful only if x / s and x * (1 / s) round apart somewhere in this dump.
  REQUIRE(differing_codes > 0);

  const CheckRun by_default = replay_tiny(dump, "pool_reciprocal_default", nullptr);
  const auto failing = failing_integrity(by_default);
  REQUIRE_FALSE(failing.empty());
  CHECK(failing[0]->check == IntegrityCheck::kCapturedPool);
  CHECK(failing[0]->classification == SlotClass::kOffByOneCode);

  ReplayOptions named;
  named.reciprocal_scale = true;
  const CheckRun with_option = replay_tiny(dump, "pool_reciprocal_named", nullptr, named);
  CHECK(failing_integrity(with_option).empty());
  CHECK(with_option.pass());
}

TEST_CASE("captured pool: saturated codes pass, NaN codes for them and BF16 high bytes fail",
          "[replay]") {
  TinySpec spec;
  spec.layer_ids = {2};
  spec.outlier_channel = 3;
  spec.outlier_gain = 8.0f;  // up to 8 / 0.0029 = 2759 codes: far past 464, satfinite -> 448
  TinyDump dump = make_tiny_dump(spec);
  for (std::size_t s = 0; s < dump.steps.size(); ++s) {
    dump.tensors[s][0].kv_cache_after = dump.pool_after(s, 0);
  }
  // The test means something only if the step's writes saturate.
  const KvPool& after1 = *dump.tensors[1][0].kv_cache_after;
  int saturated = 0;
  for (const std::int32_t slot : dump.steps[1].new_kv_slots) {
    saturated += (after1.row(slot)[3] & 0x7F) == kE4m3MaxFiniteCode;
  }
  REQUIRE(saturated > 0);

  SECTION("correctly saturated pool passes") {
    const CheckRun outcome = replay_tiny(dump, "pool_saturated", nullptr);
    CHECK(failing_integrity(outcome).empty());
    CHECK(outcome.integrity.size() == dump.steps.size());
    CHECK(outcome.pass());
  }
  SECTION("NaN codes where satfinite gives +-448") {
    KvPool& captured = *dump.tensors[1][0].kv_cache_after;
    std::vector<std::int64_t> nan_slots;
    for (const std::int32_t slot : dump.steps[1].new_kv_slots) {
      std::uint8_t& code = captured.row(slot)[3];
      if ((code & 0x7F) == kE4m3MaxFiniteCode) {
        code |= 0x7F;
        nan_slots.push_back(slot);
      }
    }
    // Later steps keep the NaN codes in the captured pool as the buggy server would.
    for (std::size_t s = 2; s < dump.steps.size(); ++s) {
      for (const std::int64_t slot : nan_slots) {
        dump.tensors[s][0].kv_cache_after->row(slot)[3] |= 0x7F;
      }
    }
    const CheckRun outcome = replay_tiny(dump, "pool_nan", nullptr);
    const auto failing = failing_integrity(outcome);
    REQUIRE(failing.size() == dump.steps.size() - 1);
    CHECK(failing[0]->step == 1);
    CHECK(failing[0]->layer_id == 2);
    CHECK(failing[0]->check == IntegrityCheck::kCapturedPool);
    CHECK(failing[0]->classification == SlotClass::kNanCode);
    CHECK(failing[0]->slots == nan_slots);
    CHECK_THAT(failing[0]->detail,
               Catch::Contains("S001 L002") && Catch::Contains(std::to_string(nan_slots[0])));
    CHECK_FALSE(outcome.pass());
  }
  SECTION("BF16 high bytes in one written slot") {
    const int row = 1;
    const std::int32_t slot = dump.steps[2].new_kv_slots[row];
    const int width = dump.width();
    for (std::size_t s = 2; s < dump.steps.size(); ++s) {
      KvPool& captured = *dump.tensors[s][0].kv_cache_after;
      for (int c = 0; c < width; ++c) {
        const float value = dump.tensors[2][0].new_kv[row * width + c];
        captured.row(slot)[c] = static_cast<std::uint8_t>(bf16_from_float(value) >> 8);
      }
    }
    const CheckRun outcome = replay_tiny(dump, "pool_bf16", nullptr);
    const auto failing = failing_integrity(outcome);
    REQUIRE_FALSE(failing.empty());
    CHECK(failing[0]->step == 2);
    CHECK(failing[0]->layer_id == 2);
    CHECK(failing[0]->classification == SlotClass::kBf16Bytes);
    // The later steps still hold it: carried, with the step it was first seen at.
    REQUIRE(failing.size() == dump.steps.size() - 2);
    for (std::size_t i = 1; i < failing.size(); ++i) CHECK(failing[i]->carried_from_step == 2);
    CHECK(failing[0]->slots == std::vector<std::int64_t>{slot});
    CHECK_THAT(failing[0]->detail, Catch::Contains("S002 L002"));
  }
}

TEST_CASE("clean cpu-fp8 replay passes with every comparison and integrity check", "[replay]") {
  TinySpec spec;
  spec.layer_ids = {0, 3};
  spec.page_size = 2;
  TinyDump dump = make_tiny_dump(spec);
  auto backend = cpu_backend();
  // Captured outputs equal to cpu-fp8's own outputs must pass: replay once to get them.
  {
    std::vector<KvPool> pools = dump.pools;
    for (std::size_t s = 0; s < dump.steps.size(); ++s) {
      for (std::size_t l = 0; l < dump.layers.size(); ++l) {
        const StepLayerInput input{dump.attrs, dump.steps[s], dump.layers[l], dump.tensors[s][l], s,
                                   l};
        auto output = backend->run_step(input, pools[l]);
        REQUIRE(output.ok());
        std::vector<float> out(output->out_bf16.size());
        for (std::size_t k = 0; k < out.size(); ++k) out[k] = bf16_to_float(output->out_bf16[k]);
        dump.tensors[s][l].out = std::move(out);
        dump.tensors[s][l].lse = output->lse;
      }
    }
  }
  const CheckRun run = replay_tiny(dump, "clean_cpu", backend.get());
  CHECK(run.backend == "cpu-fp8");
  for (const ComparisonResult* c : failing_comparisons(run)) {
    FAIL_CHECK("S" << c->step << " L" << c->layer_id << " " << comparison_name(c->comparison)
                   << " fails: " << c->judgement.reasons.front());
  }
  for (const IntegrityFinding* f : failing_integrity(run)) FAIL_CHECK(f->detail);
  for (const int layer_id : {0, 3}) {
    for (int s = 0; s < static_cast<int>(dump.steps.size()); ++s) {
      for (const Comparison kind : {Comparison::kKernel, Comparison::kQuantization,
                                    Comparison::kTotal, Comparison::kCaptured}) {
        CHECK(find_comparison(run, s, layer_id, kind) != nullptr);
      }
    }
  }
  // 5 backend-pool checks per (step, layer).
  CHECK(run.integrity.size() == 5 * dump.steps.size() * dump.layers.size());
  const ComparisonResult* kernel = find_comparison(run, 2, 3, Comparison::kKernel);
  REQUIRE(kernel != nullptr);
  CHECK(kernel->metrics.max_abs > 0.0);  // bf16 output: never bit-equal to the double reference
  CHECK(run.reference_rows_heads_tokens > 0.0);
  CHECK(run.pass());
  CHECK_FALSE(run.first_divergence.has_value());
}

TEST_CASE("integrity catches a backend that corrupts its pool, naming step, layer and slot",
          "[replay]") {
  const Corruption corruption =
      GENERATE(Corruption::kNeighbourSlot, Corruption::kNothingWritten, Corruption::kNanWritten);
  TinySpec spec;
  spec.layer_ids = {0, 3};
  TinyDump dump = make_tiny_dump(spec);
  // Corrupt S001 (decode) in layer id 3 (index 1).
  CorruptingBackend backend(corruption, 1, 1);
  const CheckRun outcome = replay_tiny(dump, "corrupt", &backend);
  const std::int64_t slot = dump.steps[1].new_kv_slots[CorruptingBackend::corrupted_row];
  const auto failing = failing_integrity(outcome);
  REQUIRE_FALSE(failing.empty());
  CHECK(failing[0]->step == 1);
  CHECK(failing[0]->layer_id == 3);
  CHECK_THAT(failing[0]->detail, Catch::Contains("S001 L003"));
  auto failed = [&](IntegrityCheck check) {
    return std::find_if(failing.begin(), failing.end(), [&](const IntegrityFinding* f) {
      return f->check == check && f->step == 1 && f->layer_id == 3;
    });
  };
  const auto written = failed(IntegrityCheck::kWrittenSlots);
  REQUIRE(written != failing.end());
  CHECK(std::find((*written)->slots.begin(), (*written)->slots.end(), slot) !=
        (*written)->slots.end());
  switch (corruption) {
    case Corruption::kNeighbourSlot: {
      const auto unwritten = failed(IntegrityCheck::kUnwrittenSlots);
      REQUIRE(unwritten != failing.end());
      CHECK((*unwritten)->slots == std::vector<std::int64_t>{slot + 1});
      break;
    }
    case Corruption::kNothingWritten:
      CHECK((*written)->slots.size() == dump.steps[1].new_kv_slots.size());
      break;
    case Corruption::kNanWritten: {
      const auto nan = failed(IntegrityCheck::kNanWritten);
      REQUIRE(nan != failing.end());
      CHECK((*nan)->slots == std::vector<std::int64_t>{slot});
      break;
    }
  }
  // Layer 0 and step 0 are clean.
  for (const IntegrityFinding* f : failing) {
    CHECK(f->layer_id == 3);
    CHECK(f->step >= 1);
  }
  // The cost of the corruption shows as cache error (R8 on the backend's pool vs R8 on the
  // reference pool) from S001 on, in every later step that reads the slot. The kernel is not
  // blamed at any step: from S002 on it reads its own (corrupted) pool, R8' is what it read; at
  // S001 this backend attended before corrupting the pool, so its output matches R8, and a note
  // says that is what it is judged against. Where the pools agree the cache comparison is zero.
  for (const ComparisonResult& c : outcome.comparisons) {
    INFO("step " << c.step << " layer " << c.layer_id << " " << comparison_name(c.comparison));
    const bool corrupted = c.layer_id == 3 && c.step >= 1;
    if (c.comparison == Comparison::kCache) {
      CHECK(c.judgement.pass == !corrupted);
      if (!corrupted) CHECK(c.metrics.max_abs == 0.0);
    }
    if (c.comparison == Comparison::kKernel) CHECK(c.judgement.pass);
  }
  CHECK(std::any_of(outcome.notes.begin(), outcome.notes.end(), [](const std::string& note) {
    return note.find("S001 L003: the backend's output matches attention on the reference pool") !=
           std::string::npos;
  }));
  CHECK_FALSE(outcome.pass());
}

TEST_CASE("saturating scale: large quantization error and clean kernel, fails only under signoff",
          "[replay]") {
  TinySpec spec;
  spec.outlier_channel = 0;
  // Channel 0 (a ckv channel, so the output reads it) up to 8 / 0.0029 = 2759 codes: the scale
  // was calibrated without the outliers, which saturate at 448 codes = 1.3.
  spec.outlier_gain = 8.0f;
  TinyDump dump = make_tiny_dump(spec);
  auto backend = cpu_backend();
  const CheckRun by_default = replay_tiny(dump, "saturating_default", backend.get());
  bool quantization_failed = false;
  for (const ComparisonResult& c : by_default.comparisons) {
    if (c.comparison == Comparison::kKernel) {
      INFO("S" << c.step << " kernel");
      CHECK(c.judgement.pass);
    }
    if (c.comparison == Comparison::kQuantization) {
      quantization_failed |= !c.judgement.pass;
      CHECK_FALSE(c.sets_exit);
      // FP8 storage costs far more than the kernel adds.
      const ComparisonResult* kernel =
          find_comparison(by_default, c.step, c.layer_id, Comparison::kKernel);
      REQUIRE(kernel != nullptr);
      CHECK(c.metrics.rel_l2 > 10 * kernel->metrics.rel_l2);
    }
  }
  CHECK(quantization_failed);
  CHECK(by_default.pass());

  ReplayOptions signoff;
  signoff.policy = signoff_policy();
  const CheckRun under_signoff = replay_tiny(dump, "saturating_signoff", backend.get(), signoff);
  CHECK_FALSE(under_signoff.pass());
}

TEST_CASE("unselected steps are replayed but not reported, and no source means no quantization",
          "[replay]") {
  TinySpec spec;
  spec.with_source = false;
  TinyDump dump = make_tiny_dump(spec);
  auto backend = cpu_backend();
  ReplayOptions options;
  options.step_indices = {2};
  int observed = 0;
  options.observer = [&observed](const StepLayerOutputs& outputs) {
    ++observed;
    CHECK(outputs.step == 2);
    CHECK(outputs.reference_source_out.empty());
    CHECK(outputs.backend != nullptr);
    return ok_status();
  };
  const CheckRun outcome = replay_tiny(dump, "steps_no_source", backend.get(), options);
  CHECK(observed == 1);
  for (const ComparisonResult& c : outcome.comparisons) {
    CHECK(c.step == 2);
    CHECK((c.comparison == Comparison::kKernel || c.comparison == Comparison::kCache));
    CHECK(c.judgement.pass);  // the pools evolved through S000 and S001 first
  }
  CHECK(outcome.comparisons.size() == 2);
  REQUIRE_FALSE(outcome.notes.empty());
  CHECK_THAT(outcome.notes.front(), Catch::Contains("no source"));
  CHECK(outcome.pass());
}

TEST_CASE("selection of layers and steps is checked against the dump", "[replay]") {
  const TinyDump dump = make_tiny_dump(TinySpec{});
  DumpLayout layout;
  layout.layers = dump.layers;
  layout.steps = dump.steps;
  ReplayOptions options;
  options.layer_ids = {7};
  const Status bad_layer = check_selection(layout, options);
  REQUIRE_FALSE(bad_layer.ok());
  CHECK_THAT(bad_layer.error().message(), Catch::Contains("layer id 7"));
  options.layer_ids = {0};
  options.step_indices = {3};
  CHECK_FALSE(check_selection(layout, options).ok());
  options.step_indices = {2};
  CHECK(check_selection(layout, options).ok());
}

}  // namespace kvaudit

namespace kvaudit {

TEST_CASE("without kv_source, steps whose tokens were all written are measured against the source",
          "[replay]") {
  // Empty pools before step 0: the replay knows the source of every token it writes. The result
  // must not depend on whether the source came from kv_source or from the writes.
  TinySpec spec;
  spec.prefix = {0, 0};
  spec.page_size = 2;
  spec.with_source = false;
  const TinyDump sparse = make_tiny_dump(spec);
  spec.with_source = true;
  const TinyDump dense = make_tiny_dump(spec);
  const CheckRun from_writes = replay_tiny(sparse, "source_from_writes", nullptr);
  const CheckRun from_dataset = replay_tiny(dense, "source_from_dataset", nullptr);
  CHECK(from_writes.notes.empty());
  for (int s = 0; s < static_cast<int>(sparse.steps.size()); ++s) {
    const ComparisonResult* a = find_comparison(from_writes, s, 0, Comparison::kQuantization);
    const ComparisonResult* b = find_comparison(from_dataset, s, 0, Comparison::kQuantization);
    REQUIRE(a != nullptr);
    REQUIRE(b != nullptr);
    CHECK(a->metrics.rel_l2 > 0.0);
    CHECK(a->metrics.rel_l2 == b->metrics.rel_l2);
    CHECK(a->metrics.lse_max_abs == b->metrics.lse_max_abs);
  }
}

}  // namespace kvaudit

namespace kvaudit {

TEST_CASE("first divergence names the earliest step and its first failing row and head",
          "[replay]") {
  TinySpec spec;
  spec.heads = 3;
  TinyDump dump = make_tiny_dump(spec);
  for (std::size_t s = 0; s < dump.steps.size(); ++s) plant_outputs(dump, s, 0, Fault::kNone);
  const int heads = spec.heads;
  const int dc = spec.dc;
  auto head_values = [&](std::size_t s, int row, int head) {
    return dump.tensors[s][0].out->data() + (static_cast<std::size_t>(row) * heads + head) * dc;
  };
  // S002: request 1's decode row (row 1), head 2 is 25% too large in every element.
  for (int d = 0; d < dc; ++d) head_values(2, 1, 2)[d] *= 1.25f;
  const CheckRun later_only = replay_tiny(dump, "divergence_scaled", nullptr);
  REQUIRE(later_only.first_divergence.has_value());
  CHECK(later_only.first_divergence->step == 2);
  CHECK(later_only.first_divergence->layer_id == 0);
  CHECK(later_only.first_divergence->request == 1);
  CHECK(later_only.first_divergence->row == 1);
  CHECK(later_only.first_divergence->head == 2);
  const ComparisonResult* scaled = find_comparison(later_only, 2, 0, Comparison::kCaptured);
  REQUIRE(scaled != nullptr);
  CHECK(scaled->worst_request == 1);

  // An earlier NaN (S001, row 0, head 1, one element) takes precedence.
  head_values(1, 0, 1)[5] = std::nanf("");
  const CheckRun with_nan = replay_tiny(dump, "divergence_nan", nullptr);
  REQUIRE(with_nan.first_divergence.has_value());
  CHECK(with_nan.first_divergence->step == 1);
  CHECK(with_nan.first_divergence->request == 0);
  CHECK(with_nan.first_divergence->row == 0);
  CHECK(with_nan.first_divergence->head == 1);
  CHECK(failing_comparisons(with_nan).size() == 2);
}

TEST_CASE("a captured lse without a captured out is compared on its own", "[replay]") {
  TinyDump dump = make_tiny_dump(crafted_spec());
  for (std::size_t s = 0; s < dump.steps.size(); ++s) {
    for (std::size_t l = 0; l < dump.layers.size(); ++l) plant_outputs(dump, s, l, Fault::kNone);
  }
  // S001, layer id 5: only lse is captured, and it is off by 0.5 in one place (limit 2^-2).
  StepLayerTensors& lse_only = dump.tensors[1][1];
  lse_only.out.reset();
  (*lse_only.lse)[3] += 0.5f;
  const CheckRun outcome = replay_tiny(dump, "captured_lse_only", nullptr);
  const auto failing = failing_comparisons(outcome);
  REQUIRE(failing.size() == 1);
  CHECK(failing[0]->step == 1);
  CHECK(failing[0]->layer_id == 5);
  CHECK(failing[0]->comparison == Comparison::kCaptured);
  CHECK(failing[0]->metrics.has_lse);
  CHECK(failing[0]->metrics.elements == 0);
  CHECK(failing[0]->metrics.lse_max_abs == Approx(0.5).epsilon(1e-3));
}

}  // namespace kvaudit

namespace kvaudit {
namespace {

// report.json of a run without what differs from run to run (timing, provenance).
nlohmann::json report_without_timing(const CheckRun& run) {
  nlohmann::json report = to_json(run);
  report.erase("timing");
  report.erase("provenance");
  return report;
}

}  // namespace

TEST_CASE("reading ahead on a reader thread gives the report of reading each layer in place",
          "[replay]") {
  // Every shipped dump of more than one layer, so that layer L+1 is read while L is computed.
  for (const char* name :
       {"glm5_page1.h5", "glm5_outliers_calibrated.h5", "page64_nan.h5", "glm5_dsa_flashmla.h5"}) {
    INFO(name);
    Result<DumpReader> reader = DumpReader::open(kvaudit_test::source_dir() / "datasets" / name);
    REQUIRE(reader.ok());
    ReplayOptions options;
    options.certify = 0;
    options.threads = 2;
    options.read_ahead = false;
    auto in_place_backend = cpu_backend();
    Result<CheckRun> in_place = replay_dump(*reader, in_place_backend.get(), options);
    REQUIRE(in_place.ok());
    options.read_ahead = true;
    auto ahead_backend = cpu_backend();
    Result<CheckRun> ahead = replay_dump(*reader, ahead_backend.get(), options);
    REQUIRE(ahead.ok());
    REQUIRE(reader->layout().layers.size() > 1);
    CHECK(!in_place->comparisons.empty());
    CHECK(report_without_timing(*ahead).dump() == report_without_timing(*in_place).dump());
  }
}

TEST_CASE(
    "captured pools and an observer read in place one step at a time and the estimate says so",
    "[replay]") {
  Result<DumpReader> reader =
      DumpReader::open(kvaudit_test::source_dir() / "datasets" / "glm5_page1.h5");
  REQUIRE(reader.ok());
  DumpLayout layout = reader->layout();
  REQUIRE(layout.steps.size() > 1);
  ReplayOptions options;
  CHECK(reads_ahead(layout, options));
  options.read_ahead = false;
  CHECK_FALSE(reads_ahead(layout, options));
  options.read_ahead = true;
  options.observer = [](const StepLayerOutputs&) { return ok_status(); };
  CHECK_FALSE(reads_ahead(layout, options));
  options.observer = nullptr;

  // A captured pool in every step: each is a whole pool, so the layer is read step by step and
  // its read counts one step's pool, not every step's.
  const double pool = static_cast<double>(layout.num_slots()) * layout.attrs.row_width();
  const LayerBytes before = estimate_layer_bytes(layout, 0, true, true);
  for (StepMeta& step : layout.steps) step.has_kv_cache_after.assign(layout.layers.size(), true);
  CHECK_FALSE(reads_ahead(layout, options));
  const LayerBytes in_place = estimate_layer_bytes(layout, 0, true, false);
  const LayerBytes up_front = estimate_layer_bytes(layout, 0, true, true);
  CHECK(up_front.read - before.read == Approx(pool * layout.steps.size()));
  CHECK(in_place.read < up_front.read - pool * (layout.steps.size() - 1) + 1.0);
  // Without a backend the replay still copies the pool once, and the reference decodes the rows
  // a step reads as floats (4 bytes each): both held beside the outputs.
  double most_visible = 0.0;
  for (const StepMeta& step : layout.steps) {
    most_visible = std::max(most_visible,
                            static_cast<double>(step.kv_indices.size()) * layout.attrs.page_size);
  }
  most_visible = std::min(most_visible, static_cast<double>(layout.num_slots()));
  CHECK(estimate_layer_bytes(layout, 0, false, false).computed >=
        pool + 4.0 * most_visible * layout.attrs.row_width());
}

}  // namespace kvaudit
