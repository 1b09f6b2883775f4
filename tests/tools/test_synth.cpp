// Tests of the synthetic kvdump generator (src/tools/synth.hpp): the request/page plan against
// hand- computed indices, determinism, calibration (kv_scale = fp32(amax / 448)), saturation, NaN
// codes in unused slots only, the empty request, and the value model's stated shape.
#include <stdlib.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <set>

#include "src/core/fp8_e4m3.hpp"
#include "src/format/kvdump.hpp"
#include "src/tools/synth.hpp"
#include "tests/datasets/dump_equality.hpp"

namespace kvaudit {
namespace {

using testing::run_synth_cli;
using testing::test_tmp_dir;

// A small spec (H 2, Dc 32, Dr 8) so that whole-file checks stay fast.
SynthSpec small_spec() {
  SynthSpec spec;
  spec.seed = 11;
  spec.layer_ids = {3, 0};
  spec.num_heads = 2;
  spec.kv_lora_rank = 32;
  spec.rope_dim = 8;
  spec.page_size = 4;
  spec.prefix_lens = {0, 7, 20, 0};
  spec.prefill_tokens = {3, 0, 5, 0};
  spec.decode_steps = 2;
  spec.with_source = true;
  return spec;
}

DumpReader write_and_open(const SynthSpec& spec, const std::string& name) {
  const auto path = test_tmp_dir("synth") / name;
  auto scales = write_synth_dump(path, spec);
  if (!scales) FAIL(scales.error().message());
  auto reader = DumpReader::open(path);
  if (!reader) FAIL(reader.error().message());
  return std::move(*reader);
}

// new_kv of one (step, layer), by value (a range-for over a member of the temporary Result would
// dangle).
std::vector<float> new_kv_of(const DumpReader& reader, std::size_t step, std::size_t layer) {
  auto tensors = reader.read_step_layer(step, layer);
  if (!tensors) FAIL(tensors.error().message());
  return std::move(tensors->new_kv);
}

// Slots holding a prefix token before step 0: positions < prefix_lens[b], through the page list
// of the first step (pages only grow, so it lists every prefix page).
std::set<std::int64_t> prefix_slots(const DumpLayout& layout, const std::vector<int>& prefix) {
  std::set<std::int64_t> slots;
  const StepMeta& first = layout.steps.front();
  for (int b = 0; b < first.batch_size(); ++b) {
    for (int p = 0; p < prefix[b]; ++p) slots.insert(first.slot_of(b, p, layout.attrs.page_size));
  }
  return slots;
}

TEST_CASE("parse_layer_list takes a count or a list of ids", "[synth]") {
  CHECK(*parse_layer_list("3") == std::vector<int>{0, 1, 2});
  CHECK(*parse_layer_list("0,1,77") == std::vector<int>{0, 1, 77});
  CHECK(*parse_layer_list("77,") == std::vector<int>{77});
  CHECK_FALSE(parse_layer_list("").ok());
  CHECK_FALSE(parse_layer_list("0").ok());
  CHECK_FALSE(parse_layer_list("1,,2").ok());
  CHECK_FALSE(parse_layer_list("a,1").ok());
  CHECK_FALSE(parse_layer_list("-1,2").ok());
}

TEST_CASE("validate_synth_spec refuses inconsistent specs with the option named", "[synth]") {
  const auto refused_with = [](SynthSpec spec, const std::string& option) {
    const Status status = validate_synth_spec(spec);
    REQUIRE_FALSE(status.ok());
    CHECK(status.error().kind == ErrorKind::kBadInput);
    CHECK(status.error().what.find(option) != std::string::npos);
  };
  CHECK(validate_synth_spec(small_spec()).ok());
  SynthSpec spec = small_spec();
  spec.prefill_tokens = {1, 2};
  refused_with(spec, "--prefill-tokens");
  spec = small_spec();
  spec.prefix_lens = {3, -1, 0, 0};
  refused_with(spec, "--prefix-lens");
  spec = small_spec();
  spec.layer_ids = {1, 1};
  refused_with(spec, "--layers");
  spec = small_spec();
  spec.kv_scale = -0.5f;
  refused_with(spec, "--kv-scale");
  spec = small_spec();
  spec.kv_dtype = KvDtype::kBfloat16;
  spec.saturate_fraction = 0.01;
  refused_with(spec, "--saturate-fraction");
  spec = small_spec();
  spec.kv_dtype = KvDtype::kBfloat16;
  spec.kv_scale = 0.5f;
  refused_with(spec, "--kv-scale");
  spec = small_spec();
  spec.sm_scale = std::nan("");
  refused_with(spec, "--sm-scale");
  spec = small_spec();
  spec.page_size = 0;
  refused_with(spec, "--page-size");
  spec = small_spec();
  spec.model = "Llama-3";  // no preset, so no softmax scale to take from it
  refused_with(spec, "--sm-scale");
}

TEST_CASE("synth takes the softmax scale from the model's preset unless --sm-scale is given",
          "[synth]") {
  // The values as each model's attention code derives them (Hugging Face transformers 5.25.0):
  // GLM-5 (glm_moe_dsa): (qk_nope 192 + qk_rope 64)^-0.5 = 1/16, no mscale_all_dim in its rope
  // config. DeepSeek-V3 and V3.2: (128 + 64)^-0.5 * mscale^2 with YaRN factor 40,
  // mscale_all_dim 1: mscale = 0.1 ln 40 + 1 = 1.36888794541139..., 192^-0.5 * mscale^2 =
  // 0.13523377886088... (worked out by hand to 14 digits, not by this code).
  const auto sm_scale_of = [](const std::string& model, std::optional<double> given) {
    SynthSpec spec = small_spec();
    spec.model = model;
    spec.sm_scale = given;
    return write_and_open(spec, "preset.h5").layout().attrs.sm_scale;
  };
  CHECK(sm_scale_of("GLM-5", std::nullopt) == 0.0625);
  CHECK(sm_scale_of("DeepSeek-V3", std::nullopt) == Approx(0.13523377886088).epsilon(1e-13));
  CHECK(sm_scale_of("DeepSeek-V3.2", std::nullopt) == Approx(0.13523377886088).epsilon(1e-13));
  CHECK(sm_scale_of("GLM-5", 0.07216878364870323) == 0.07216878364870323);
  CHECK(sm_scale_of("Llama-3", 0.125) == 0.125);
}

TEST_CASE("plan_synth: page size 1, an empty request, a request with no prefill rows", "[synth]") {
  SynthSpec spec;
  spec.prefix_lens = {0, 40, 130, 257};
  spec.prefill_tokens = {0, 0, 9, 4};
  spec.decode_steps = 3;
  spec.page_size = 1;
  auto plan = plan_synth(spec);
  REQUIRE(plan.ok());
  // Pages needed: 0 + 43 + 142 + 264 = 449; spare: max(2, ceil(449 / 8)) = 57.
  CHECK(plan->num_pages == 506);
  REQUIRE(plan->steps.size() == 4);

  const StepMeta& prefill = plan->steps[0];
  CHECK(prefill.group == "S000");
  CHECK(prefill.kind == StepKind::kPrefill);
  CHECK(prefill.qo_indptr == std::vector<std::int32_t>{0, 0, 0, 9, 13});
  CHECK(prefill.kv_indptr == std::vector<std::int32_t>{0, 0, 40, 179, 440});
  CHECK(prefill.kv_last_page_len == std::vector<std::int32_t>{0, 1, 1, 1});
  REQUIRE(prefill.new_kv_slots.size() == 13);
  // Row 0 is request 2's token at position 130; row 9 is request 3's token at position 257.
  CHECK(prefill.new_kv_slots[0] == plan->request_pages[2][130]);
  CHECK(prefill.new_kv_slots[9] == plan->request_pages[3][257]);

  const StepMeta& last = plan->steps[3];
  CHECK(last.group == "S003");
  CHECK(last.kind == StepKind::kDecode);
  CHECK(last.qo_indptr == std::vector<std::int32_t>{0, 0, 1, 2, 3});
  CHECK(last.kv_indptr == std::vector<std::int32_t>{0, 0, 43, 185, 449});
  CHECK(last.new_kv_slots == std::vector<std::int32_t>{plan->request_pages[1][42],
                                                       plan->request_pages[2][141],
                                                       plan->request_pages[3][263]});

  // Each row's slot is the slot of its position (kvdump-v1 "Semantics").
  for (const StepMeta& step : plan->steps) {
    for (int i = 0; i < step.num_rows(); ++i) {
      CHECK(step.new_kv_slots[i] ==
            step.slot_of(step.request_of_row(i), step.position_of_row(i, 1), 1));
    }
  }
  // Distinct pages across requests, scattered (not in ascending order), unused pages left.
  std::set<std::int32_t> used;
  for (const auto& pages : plan->request_pages) used.insert(pages.begin(), pages.end());
  CHECK(used.size() == 449);
  CHECK(plan->request_pages[0].empty());
  CHECK_FALSE(std::is_sorted(plan->request_pages[3].begin(), plan->request_pages[3].end()));
}

TEST_CASE("plan_synth: page size 64, last page lengths, decode-only trace, errors", "[synth]") {
  SynthSpec spec;
  spec.page_size = 64;
  spec.prefix_lens = {100, 0};
  spec.prefill_tokens = {30, 0};
  spec.decode_steps = 3;
  auto plan = plan_synth(spec);
  REQUIRE(plan.ok());
  CHECK(plan->num_pages == 5);  // 3 pages for 133 tokens, 2 spare
  REQUIRE(plan->steps.size() == 4);
  CHECK(plan->steps[0].kv_indptr == std::vector<std::int32_t>{0, 3, 3});
  CHECK(plan->steps[0].kv_last_page_len == std::vector<std::int32_t>{2, 0});  // 130 = 2*64 + 2
  CHECK(plan->steps[3].kv_last_page_len == std::vector<std::int32_t>{5, 0});  // 133
  CHECK(plan->steps[3].new_kv_slots ==
        std::vector<std::int32_t>{plan->request_pages[0][2] * 64 + 4});

  SynthSpec decode_only;
  decode_only.prefix_lens = {10};
  decode_only.prefill_tokens = {0};
  decode_only.decode_steps = 2;
  auto decode_plan = plan_synth(decode_only);
  REQUIRE(decode_plan.ok());
  REQUIRE(decode_plan->steps.size() == 2);
  CHECK(decode_plan->steps[0].kind == StepKind::kDecode);
  CHECK(decode_plan->steps[0].kv_last_page_len == std::vector<std::int32_t>{1});
  CHECK(decode_plan->steps[0].kv_indptr == std::vector<std::int32_t>{0, 11});

  decode_only.decode_steps = 0;
  CHECK_FALSE(plan_synth(decode_only).ok());  // no step at all
  SynthSpec empty;
  empty.prefix_lens = {0, 0};
  empty.prefill_tokens = {0};
  CHECK_FALSE(plan_synth(empty).ok());  // nothing to decode
  spec.num_pages = 2;
  CHECK_FALSE(plan_synth(spec).ok());  // fewer pages than needed
}

TEST_CASE("synth is deterministic: same seed same bits, another seed other bits", "[synth]") {
  SynthSpec spec = small_spec();
  spec.nan_unused = true;
  spec.saturate_fraction = 0.01;
  const DumpReader a = write_and_open(spec, "det_a.h5");
  const DumpReader b = write_and_open(spec, "det_b.h5");
  testing::require_same_dump(a, b);

  spec.seed = 12;
  const DumpReader c = write_and_open(spec, "det_c.h5");
  REQUIRE(c.layout().layers.size() == 2);
  CHECK(a.read_pool(0)->bytes != c.read_pool(0)->bytes);
  CHECK_FALSE(testing::same_bits(a.read_step_layer(0, 0)->q_nope, c.read_step_layer(0, 0)->q_nope));
  CHECK(a.layout().steps[0].new_kv_slots != c.layout().steps[0].new_kv_slots);
}

TEST_CASE("synth draws the same dump on 1 thread and on 3", "[synth]") {
  SynthSpec spec = small_spec();
  spec.nan_unused = true;
  spec.saturate_fraction = 0.01;
  spec.prefix_lens = {700, 0, 300};  // several chunks of 256 tokens per request
  spec.prefill_tokens = {40, 9, 0};
  spec.threads = 1;
  const DumpReader one = write_and_open(spec, "threads_1.h5");
  spec.threads = 3;
  const DumpReader three = write_and_open(spec, "threads_3.h5");
  testing::require_same_dump(one, three);
  REQUIRE(one.layout().layers.size() == 2);
  CHECK(one.layout().layers[0].kv_scale == three.layout().layers[0].kv_scale);
}

TEST_CASE("synth file: layers sorted, shapes, empty request without rows or pages", "[synth]") {
  const SynthSpec spec = small_spec();
  const DumpReader reader = write_and_open(spec, "shapes.h5");
  const DumpLayout& layout = reader.layout();
  CHECK(layout.attrs.model == "GLM-5");
  CHECK(layout.attrs.num_heads == 2);
  CHECK(layout.attrs.row_width() == 40);
  CHECK(layout.attrs.page_size == 4);
  // GLM-5's attention: qk_head_dim^-0.5 with qk_head_dim = 192 + 64 = 256, no YaRN mscale.
  CHECK(layout.attrs.sm_scale == 0.0625);
  CHECK(layout.attrs.producer.rfind("kvaudit synth --seed 11", 0) == 0);
  REQUIRE(layout.layers.size() == 2);
  CHECK(layout.layers[0].layer_id == 0);
  CHECK(layout.layers[1].layer_id == 3);
  CHECK(layout.layers[1].group == "L003");
  CHECK(layout.layers[0].has_source);
  REQUIRE(layout.steps.size() == 3);
  CHECK(layout.steps[0].kind == StepKind::kPrefill);
  for (const StepMeta& step : layout.steps) {
    CHECK(step.batch_size() == 4);
    CHECK(step.rows_of(3) == 0);  // request 3 is empty: no rows, no pages, in every step
    CHECK(step.kv_indptr[4] == step.kv_indptr[3]);
    CHECK(step.kv_last_page_len[3] == 0);
  }
  CHECK(layout.steps[0].rows_of(1) == 0);  // prefix only: no rows in the prefill
  CHECK(layout.steps[1].rows_of(1) == 1);  // but it decodes
  auto tensors = reader.read_step_layer(0, 1);
  REQUIRE(tensors.ok());
  CHECK(tensors->q_nope.size() == 8u * 2 * 32);
  CHECK(tensors->q_pe.size() == 8u * 2 * 8);
  CHECK(tensors->new_kv.size() == 8u * 40);
}

TEST_CASE("synth calibrates kv_scale per layer as fp32(amax / 448) over source and new tokens",
          "[synth]") {
  const SynthSpec spec = small_spec();
  const DumpReader reader = write_and_open(spec, "calibrated.h5");
  const DumpLayout& layout = reader.layout();
  const auto prefix = prefix_slots(layout, spec.prefix_lens);
  const int width = layout.attrs.row_width();
  std::vector<float> scales;
  for (std::size_t l = 0; l < layout.layers.size(); ++l) {
    auto source = reader.read_source(l);
    auto pool = reader.read_pool(l);
    REQUIRE(source.ok());
    REQUIRE(pool.ok());
    const float kv_scale = layout.layers[l].kv_scale;
    float amax = 0.0f;
    for (const std::int64_t slot : prefix) {
      for (int c = 0; c < width; ++c) {
        const float v = (*source)[slot * width + c];
        amax = std::max(amax, std::fabs(v));
        // The pool holds the kvdump write rule applied to the source.
        REQUIRE(pool->row(slot)[c] == kvdump_quantize(v, kv_scale));
      }
    }
    for (std::size_t s = 0; s < layout.steps.size(); ++s) {
      for (const float v : new_kv_of(reader, s, l)) amax = std::max(amax, std::fabs(v));
    }
    CHECK(kv_scale == amax / 448.0f);
    CHECK(std::fabs(kv_scale) != std::exp2(std::round(std::log2(kv_scale))));  // not 2^k
    scales.push_back(kv_scale);
  }
  CHECK(scales[0] != scales[1]);
}

TEST_CASE("synth --kv-scale fixes the scale - bfloat16 pools store the source bits", "[synth]") {
  SynthSpec spec = small_spec();
  spec.kv_scale = 0.0371f;
  const DumpReader fixed = write_and_open(spec, "fixed.h5");
  for (const LayerMeta& layer : fixed.layout().layers) CHECK(layer.kv_scale == 0.0371f);

  spec = small_spec();
  spec.kv_dtype = KvDtype::kBfloat16;
  const DumpReader bf16 = write_and_open(spec, "bf16.h5");
  CHECK(bf16.layout().attrs.kv_dtype == KvDtype::kBfloat16);
  CHECK(bf16.layout().layers[0].kv_scale == 1.0f);
  auto pool = bf16.read_pool(0);
  auto source = bf16.read_source(0);
  REQUIRE(pool.ok());
  REQUIRE(source.ok());
  const int width = bf16.layout().attrs.row_width();
  for (const std::int64_t slot : prefix_slots(bf16.layout(), spec.prefix_lens)) {
    for (int c = 0; c < width; ++c) {
      REQUIRE(pool->bf16_bits(slot, c) == bf16_from_float((*source)[slot * width + c]));
    }
  }
}

TEST_CASE("synth --saturate-fraction puts values past 464*scale that satfinite clamps to 448",
          "[synth]") {
  SynthSpec spec = small_spec();
  spec.layer_ids = {0};
  spec.prefix_lens = {200};
  spec.prefill_tokens = {20};
  spec.saturate_fraction = 0.01;
  const DumpReader reader = write_and_open(spec, "saturate.h5");
  const DumpLayout& layout = reader.layout();
  const float kv_scale = layout.layers[0].kv_scale;
  const int width = layout.attrs.row_width();
  auto source = reader.read_source(0);
  auto pool = reader.read_pool(0);
  REQUIRE(source.ok());
  REQUIRE(pool.ok());
  // 464 * scale: the midpoint above which round-to-nearest leaves e4m3's range.
  const double overflow = 464.0 * kv_scale;
  int saturated = 0;
  int negative = 0;
  int total = 0;
  float regular_amax = 0.0f;
  for (const std::int64_t slot : prefix_slots(layout, spec.prefix_lens)) {
    for (int c = 0; c < width; ++c) {
      const float v = (*source)[slot * width + c];
      const std::uint8_t code = pool->row(slot)[c];
      ++total;
      if (std::fabs(v) > overflow) {
        ++saturated;
        negative += v < 0;
        REQUIRE((code == 0x7E || code == 0xFE));
        REQUIRE((code == 0xFE) == (v < 0));
      } else {
        regular_amax = std::max(regular_amax, std::fabs(v));
      }
    }
  }
  // 8000 elements, F = 1%: 80 expected; [40, 120] is more than 4 standard deviations.
  CHECK(saturated >= 40);
  CHECK(saturated <= 120);
  CHECK(negative > 0);
  CHECK(negative < saturated);
  int new_saturated = 0;
  REQUIRE(layout.steps.size() == 3);
  for (std::size_t s = 0; s < layout.steps.size(); ++s) {
    for (const float v : new_kv_of(reader, s, 0)) {
      if (std::fabs(v) > overflow) {
        ++new_saturated;
      } else {
        // The deliberately saturated values are left out of the calibration.
        regular_amax = std::max(regular_amax, std::fabs(v));
      }
    }
  }
  CHECK(new_saturated > 0);
  CHECK(kv_scale == regular_amax / 448.0f);
}

TEST_CASE("synth --nan-unused: NaN codes only in slots no request holds before step 0", "[synth]") {
  SynthSpec spec = small_spec();
  spec.page_size = 16;
  spec.prefix_lens = {0, 20, 5, 0};
  spec.prefill_tokens = {0, 3, 40, 0};
  spec.nan_unused = true;
  const DumpReader reader = write_and_open(spec, "nan_unused.h5");
  const DumpLayout& layout = reader.layout();
  const int width = layout.attrs.row_width();
  const auto prefix = prefix_slots(layout, spec.prefix_lens);
  for (std::size_t l = 0; l < layout.layers.size(); ++l) {
    auto pool = reader.read_pool(l);
    auto source = reader.read_source(l);
    REQUIRE(pool.ok());
    REQUIRE(source.ok());
    int positive_nan = 0;
    int negative_nan = 0;
    for (std::int64_t slot = 0; slot < layout.num_slots(); ++slot) {
      for (int c = 0; c < width; ++c) {
        const std::uint8_t code = pool->row(slot)[c];
        if (prefix.count(slot)) {
          REQUIRE_FALSE(e4m3_is_nan(code));
        } else {
          REQUIRE((code == 0x7F || code == 0xFF));
          REQUIRE(std::isnan((*source)[slot * width + c]));
          positive_nan += code == 0x7F;
          negative_nan += code == 0xFF;
        }
      }
    }
    CHECK(positive_nan > 0);
    CHECK(negative_nan > 0);
  }

  // Replaying the writes, every slot a step lets a request see holds a prefix token or was
  // written by that step or an earlier one: NaN codes are never visible, only masked.
  std::set<std::int64_t> written = prefix;
  std::size_t masked_tail_slots = 0;
  for (const StepMeta& step : layout.steps) {
    written.insert(step.new_kv_slots.begin(), step.new_kv_slots.end());
    for (int b = 0; b < step.batch_size(); ++b) {
      const std::int64_t len = step.kv_len(b, layout.attrs.page_size);
      for (std::int64_t p = 0; p < len; ++p) {
        REQUIRE(written.count(step.slot_of(b, p, layout.attrs.page_size)));
      }
    }
  }
  // The last step's last pages end in slots that hold NaN and are never written.
  const StepMeta& last = layout.steps.back();
  for (int b = 0; b < last.batch_size(); ++b) {
    const std::int64_t len = last.kv_len(b, layout.attrs.page_size);
    const std::int64_t pages = last.kv_indptr[b + 1] - last.kv_indptr[b];
    for (std::int64_t p = len; p < pages * layout.attrs.page_size; ++p) {
      const std::int64_t page = last.kv_indices[last.kv_indptr[b] + p / layout.attrs.page_size];
      CHECK_FALSE(written.count(page * layout.attrs.page_size + p % layout.attrs.page_size));
      ++masked_tail_slots;
    }
  }
  CHECK(masked_tail_slots > 0);
}

TEST_CASE("synth values: outlier ckv channels, larger rope part, scores neither flat nor peaked",
          "[synth]") {
  SynthSpec spec;  // GLM-5 shape: H 16, Dc 512, Dr 64
  spec.seed = 3;
  spec.prefix_lens = {256};
  spec.prefill_tokens = {4};
  spec.decode_steps = 0;
  spec.with_source = true;
  const DumpReader reader = write_and_open(spec, "values.h5");
  const DumpLayout& layout = reader.layout();
  const int dc = 512;
  const int width = 576;
  auto source = reader.read_source(0);
  REQUIRE(source.ok());
  const auto prefix = prefix_slots(layout, spec.prefix_lens);
  std::vector<double> rms(width, 0.0);
  for (const std::int64_t slot : prefix) {
    for (int c = 0; c < width; ++c) rms[c] += std::pow((*source)[slot * width + c], 2);
  }
  for (double& r : rms) r = std::sqrt(r / static_cast<double>(prefix.size()));
  std::vector<double> ckv(rms.begin(), rms.begin() + dc);
  std::vector<double> kpe(rms.begin() + dc, rms.end());
  std::nth_element(ckv.begin(), ckv.begin() + dc / 2, ckv.end());
  const double ckv_median = ckv[dc / 2];
  std::nth_element(kpe.begin(), kpe.begin() + 32, kpe.end());
  const double kpe_median = kpe[32];
  const auto outliers =
      std::count_if(rms.begin(), rms.begin() + dc, [&](double r) { return r > 4.0 * ckv_median; });
  CHECK(outliers == 10);  // 2% of 512 channels
  CHECK(kpe_median / ckv_median > 2.5);
  CHECK(kpe_median / ckv_median < 6.0);

  // Scores of the prefill rows against the prefix tokens (on the source values).
  auto tensors = reader.read_step_layer(0, 0);
  REQUIRE(tensors.ok());
  const double sm_scale = layout.attrs.sm_scale;
  for (int row = 0; row < 4; ++row) {
    for (int h = 0; h < 16; ++h) {
      std::vector<double> scores;
      for (const std::int64_t slot : prefix) {
        double dot = 0.0;
        for (int c = 0; c < dc; ++c) {
          dot += tensors->q_nope[(row * 16 + h) * dc + c] * (*source)[slot * width + c];
        }
        for (int r = 0; r < 64; ++r) {
          dot += tensors->q_pe[(row * 16 + h) * 64 + r] * (*source)[slot * width + dc + r];
        }
        scores.push_back(sm_scale * dot);
      }
      double mean = 0.0;
      for (const double s : scores) mean += s;
      mean /= scores.size();
      double var = 0.0;
      double max_score = -1e300;
      for (const double s : scores) {
        var += (s - mean) * (s - mean);
        max_score = std::max(max_score, s);
      }
      const double std_dev = std::sqrt(var / scores.size());
      double sum = 0.0;
      for (const double s : scores) sum += std::exp(s - max_score);
      const double max_weight = 1.0 / sum;
      INFO("row " << row << " head " << h);
      CHECK(std_dev > 0.6);  // target 2 * [0.5, 1.5)
      CHECK(std_dev < 3.6);
      CHECK(max_weight > 2.0 / 256);  // not uniform
      CHECK(max_weight < 0.9);        // not one-hot
    }
  }
}

TEST_CASE("kvaudit synth command line writes the dump and refuses bad options with status 2",
          "[synth][cli]") {
  const auto path = test_tmp_dir("synth") / "cli.h5";
  REQUIRE(
      run_synth_cli(
          {"--out",          path.string(), "--seed",         "5",   "--layers",         "0,1,77",
           "--heads",        "2",           "--kv-lora-rank", "16",  "--rope-dim",       "8",
           "--page-size",    "8",           "--prefix-lens",  "0,9", "--prefill-tokens", "2",
           "--decode-steps", "1",           "--num-pages",    "9",   "--kv-scale",       "0.125",
           "--nan-unused"}) == 0);
  auto reader = DumpReader::open(path);
  REQUIRE(reader.ok());
  const DumpLayout& layout = reader->layout();
  CHECK(layout.num_pages == 9);
  REQUIRE(layout.layers.size() == 3);
  CHECK(layout.layers[2].layer_id == 77);
  CHECK(layout.layers[2].kv_scale == 0.125f);
  CHECK_FALSE(layout.layers[0].has_source);
  CHECK(layout.steps[0].qo_indptr == std::vector<std::int32_t>{0, 2, 4});  // broadcast "2"
  CHECK(layout.attrs.producer.find("--prefill-tokens 2 ") != std::string::npos);

  const std::string out = (test_tmp_dir("synth") / "cli_bad.h5").string();
  CHECK(run_synth_cli({"--seed", "1"}) == kExitBadInput);  // --out is required
  CHECK(run_synth_cli({"--out", out, "--prefix-lens", "1,2", "--prefill-tokens", "1,2,3"}) ==
        kExitBadInput);
  CHECK(run_synth_cli({"--out", out, "--kv-dtype", "float16"}) == kExitBadInput);
  CHECK(run_synth_cli({"--out", out, "--layers", "x"}) == kExitBadInput);
  CHECK(run_synth_cli({"--out", out, "--num-pages", "3"}) == kExitBadInput);
  CHECK_FALSE(std::filesystem::exists(out));
}

TEST_CASE("synth footprint: the file size it estimates, and specs it refuses before allocating",
          "[synth]") {
  SynthSpec spec;  // GLM-5 shapes: H 16, Dc 512, Dr 64; prefix 0/37/300, prefill 16/8/1, 2 decodes
  spec.with_source = true;
  const SynthFootprint footprint = estimate_synth_footprint(spec);
  const auto path = test_tmp_dir("synth") / "footprint.h5";
  REQUIRE(write_synth_dump(path, spec).ok());
  // Pools, kv_source, indices and tensors are counted; HDF5's metadata (a few KiB) is not.
  const double actual = static_cast<double>(std::filesystem::file_size(path));
  CHECK(footprint.file_bytes <= actual);
  CHECK(footprint.file_bytes > 0.95 * actual);
  // 414 pages of one slot (355 needed + 1/8 spare) in 3 steps, up to 25 rows.
  CHECK(footprint.slots == 414);
  CHECK(footprint.steps == 3);
  CHECK(footprint.rows == 25);
  // One layer: pool 414 x 576 bytes, kv_source as floats and bf16 bits (6 bytes per value).
  CHECK(footprint.memory_bytes >= 414.0 * 576 * 7);

  REQUIRE(setenv("KVAUDIT_MEMORY_BUDGET", "64K", 1) == 0);
  const Status refused = check_synth_fits(spec, path);
  unsetenv("KVAUDIT_MEMORY_BUDGET");
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.error().message().rfind("synth: needs about ", 0) == 0);
  CHECK_THAT(refused.error().message(), Catch::Matchers::EndsWith("; 64 KiB is available"));
  const auto refused_write = write_synth_dump(test_tmp_dir("synth") / "refused.h5", [&] {
    SynthSpec huge = spec;
    huge.decode_steps = 100000000;
    return huge;
  }());
  REQUIRE_FALSE(refused_write.ok());
  CHECK_FALSE(std::filesystem::exists(test_tmp_dir("synth") / "refused.h5"));
  CHECK(check_synth_fits(spec, path).ok());
}

TEST_CASE("synth refuses a layer count beyond kMaxSynthLayers before allocating it", "[synth]") {
  CHECK(parse_layer_list("4096").ok());
  const auto refused = parse_layer_list("100000000");
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.error().message() ==
        "synth: --layers '100000000': a layer count must be at most 4096");
}

}  // namespace
}  // namespace kvaudit
