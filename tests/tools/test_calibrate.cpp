// Tests of `kvaudit calibrate` (src/tools/calibrate.hpp): each candidate's FP8-storage error
// against an independent float64 computation written here (its own e4m3 rounding and its own
// attention loop, not the reference's), the held-out figures reported apart from the selection
// ones, and the one-line refusal of a dump without kv_source.
#include <hdf5.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "src/format/kvdump.hpp"
#include "src/tools/calibrate.hpp"
#include "src/tools/synth.hpp"
#include "tests/datasets/dump_equality.hpp"

namespace kvaudit {
namespace {

using testing::test_tmp_dir;

// e4m3fn round to nearest even with satfinite, on x / s in double (x / s is formed in fp32 as the
// write rule says): 3 mantissa bits, quantum 2^(e-3) for |q| >= 2^-6, 2^-9 below, clamp to 448.
double e4m3_value(float x, float s) {
  const double q = static_cast<double>(x / s);
  const double magnitude = std::fabs(q);
  if (magnitude == 0.0) return 0.0;
  int exponent = 0;
  std::frexp(magnitude, &exponent);  // magnitude in [2^(exponent-1), 2^exponent)
  const double quantum = std::ldexp(1.0, std::max(exponent - 1, -6) - 3);
  double rounded = std::nearbyint(magnitude / quantum) * quantum;  // FE_TONEAREST: ties to even
  if (magnitude > 464.0) rounded = 448.0;
  rounded = std::min(rounded, 448.0);
  return std::copysign(rounded, q);
}

struct Sums {
  double diff_sq = 0.0, ref_sq = 0.0, lse_max = 0.0;
  double rel_l2() const { return std::sqrt(diff_sq / ref_sq); }
};

// Plain attention in double of one row and head over KV rows `kv` (visible tokens in order).
void attend(const std::vector<double>& q, const std::vector<std::vector<double>>& kv, int dc,
            double sm_scale, std::vector<double>& out, double& lse) {
  std::vector<double> s(kv.size());
  double m = -INFINITY;
  for (std::size_t t = 0; t < kv.size(); ++t) {
    double dot = 0.0;
    for (std::size_t j = 0; j < q.size(); ++j) dot += q[j] * kv[t][j];
    s[t] = sm_scale * dot;
    m = std::max(m, s[t]);
  }
  double l = 0.0;
  out.assign(dc, 0.0);
  for (std::size_t t = 0; t < kv.size(); ++t) {
    const double w = std::exp(s[t] - m);
    l += w;
    for (int j = 0; j < dc; ++j) out[j] += w * kv[t][j];
  }
  for (double& o : out) o /= l;
  lse = m + std::log(l);
}

// The FP8-storage error of per-tensor scale `scale` on the steps `steps` of layer 0, computed
// from the dump's tensors with this file's own rounding and attention.
Sums independent_error(const DumpReader& reader, float scale, const std::vector<int>& steps) {
  const DumpLayout& layout = reader.layout();
  const DumpAttributes& a = layout.attrs;
  const int width = a.row_width();
  auto source = reader.read_source(0);
  REQUIRE(source);
  std::vector<float> current(source->begin(), source->end());
  Sums sums;
  for (std::size_t s = 0; s < layout.steps.size(); ++s) {
    const StepMeta& step = layout.steps[s];
    auto tensors = reader.read_step_layer(s, 0);
    REQUIRE(tensors);
    for (std::size_t i = 0; i < step.new_kv_slots.size(); ++i) {
      for (int c = 0; c < width; ++c) {
        current[step.new_kv_slots[i] * width + c] = tensors->new_kv[i * width + c];
      }
    }
    if (std::find(steps.begin(), steps.end(), static_cast<int>(s)) == steps.end()) continue;
    for (int row = 0; row < step.num_rows(); ++row) {
      const int b = step.request_of_row(row);
      const std::int64_t pos = step.position_of_row(row, a.page_size);
      std::vector<std::vector<double>> exact, quantized;
      for (std::int64_t t = 0; t <= pos; ++t) {
        const std::int64_t slot = step.slot_of(b, t, a.page_size);
        std::vector<double> x(width), xq(width);
        for (int c = 0; c < width; ++c) {
          x[c] = current[slot * width + c];
          xq[c] = e4m3_value(current[slot * width + c], scale) * scale;
        }
        exact.push_back(x);
        quantized.push_back(xq);
      }
      for (int h = 0; h < a.num_heads; ++h) {
        std::vector<double> q(width);
        for (int j = 0; j < a.kv_lora_rank; ++j) {
          q[j] = tensors->q_nope[(row * a.num_heads + h) * a.kv_lora_rank + j];
        }
        for (int j = 0; j < a.qk_rope_head_dim; ++j) {
          q[a.kv_lora_rank + j] = tensors->q_pe[(row * a.num_heads + h) * a.qk_rope_head_dim + j];
        }
        std::vector<double> out_s, out_8;
        double lse_s = 0.0, lse_8 = 0.0;
        attend(q, exact, a.kv_lora_rank, a.sm_scale, out_s, lse_s);
        attend(q, quantized, a.kv_lora_rank, a.sm_scale, out_8, lse_8);
        for (int j = 0; j < a.kv_lora_rank; ++j) {
          sums.diff_sq += (out_8[j] - out_s[j]) * (out_8[j] - out_s[j]);
          sums.ref_sq += out_s[j] * out_s[j];
        }
        sums.lse_max = std::max(sums.lse_max, std::fabs(lse_8 - lse_s));
      }
    }
  }
  return sums;
}

SynthSpec outlier_spec() {
  SynthSpec spec;
  spec.seed = 30;
  spec.layer_ids = {0};
  spec.num_heads = 2;
  spec.kv_lora_rank = 32;
  spec.rope_dim = 8;
  spec.page_size = 4;
  spec.prefix_lens = {6, 11};
  spec.prefill_tokens = {3, 2};
  spec.decode_steps = 2;  // steps 0, 1, 2: selection 0 and 2, held out 1
  spec.with_source = true;
  spec.outlier_channels = 2;
  spec.outlier_gain = 1000.0;
  spec.rope_gain = 4.0;
  spec.kv_scale = 1.0f;
  return spec;
}

DumpReader synth_dump(const SynthSpec& spec, const std::string& name) {
  const auto path = test_tmp_dir("calibrate") / name;
  auto scales = write_synth_dump(path, spec);
  if (!scales) FAIL(scales.error().message());
  auto reader = DumpReader::open(path);
  if (!reader) FAIL(reader.error().message());
  return std::move(*reader);
}

TEST_CASE("calibrate: each candidate's error equals an independent float64 computation",
          "[calibrate]") {
  const DumpReader reader = synth_dump(outlier_spec(), "outliers.h5");
  auto calibration = calibrate_dump(reader, CalibrationOptions{});
  REQUIRE(calibration);
  REQUIRE(calibration->selection_steps == std::vector<int>{0, 2});
  REQUIRE(calibration->held_out_steps == std::vector<int>{1});
  const LayerCalibration& layer = calibration->layers.at(0);
  REQUIRE(layer.candidates.size() >= 5);  // rule, pow2, dump (1.0), sweep points
  for (const CandidateResult& candidate : layer.candidates) {
    INFO(candidate_kind_name(candidate.kind) << " scale " << candidate.scale);
    const Sums selection = independent_error(reader, candidate.scale, {0, 2});
    const Sums held_out = independent_error(reader, candidate.scale, {1});
    CHECK(candidate.selection.out_rel_l2 == Approx(selection.rel_l2()).epsilon(1e-9));
    CHECK(candidate.held_out.out_rel_l2 == Approx(held_out.rel_l2()).epsilon(1e-9));
    CHECK(candidate.selection.lse_max_abs == Approx(selection.lse_max).epsilon(1e-6).margin(1e-12));
    CHECK(candidate.held_out.lse_max_abs == Approx(held_out.lse_max).epsilon(1e-6).margin(1e-12));
  }
}

TEST_CASE("calibrate: the recommendation's held-out error is reported, confirmed exactly",
          "[calibrate]") {
  const DumpReader reader = synth_dump(outlier_spec(), "held_out.h5");
  auto calibration = calibrate_dump(reader, CalibrationOptions{});
  REQUIRE(calibration);
  const LayerCalibration& layer = calibration->layers.at(0);
  const CandidateResult& best = layer.candidates.at(layer.recommended);
  REQUIRE(layer.confirmed_on_held_out);
  const Sums held_out = independent_error(reader, best.scale, {1});
  CHECK(layer.confirmed.out_rel_l2 == Approx(held_out.rel_l2()).epsilon(1e-9));
  CHECK(layer.confirmed.worst_step == 1);  // a held-out step, not a selection one
  const std::string text = format_calibration(*calibration);
  CHECK(text.find("held-out steps 1") != std::string::npos);
  CHECK(text.find("confirmed with the exact reference on the held-out steps") != std::string::npos);
  const nlohmann::json json = calibration_json(*calibration);
  CHECK(json["layers"][0]["confirmed_on_held_out"] == true);
  CHECK(json["layers"][0]["k_scale"] == json["layers"][0]["v_scale"]);
}

TEST_CASE("calibrate: the unit scale saturates the outliers and is not recommended",
          "[calibrate]") {
  const DumpReader reader = synth_dump(outlier_spec(), "unit.h5");
  auto calibration = calibrate_dump(reader, CalibrationOptions{});
  REQUIRE(calibration);
  const LayerCalibration& layer = calibration->layers.at(0);
  CHECK(layer.dump_scale == 1.0f);
  CHECK(layer.latent.saturated > 0);  // outliers past 464 under the dump's scale 1.0
  const CandidateResult& best = layer.candidates.at(layer.recommended);
  CHECK(best.scale != 1.0f);
  CHECK(best.latent.saturated + best.rope.saturated == 0);
}

TEST_CASE("calibrate: a dump without kv_source is refused in one line naming the layer",
          "[calibrate]") {
  SynthSpec spec = outlier_spec();
  spec.with_source = false;
  const DumpReader reader = synth_dump(spec, "no_source.h5");
  auto calibration = calibrate_dump(reader, CalibrationOptions{});
  REQUIRE_FALSE(calibration);
  const std::string message = calibration.error().message();
  CHECK(message.find("/layers/L000") != std::string::npos);
  CHECK(message.find("no kv_source") != std::string::npos);
  CHECK(message.find('\n') == std::string::npos);
}

// kv_source (bf16) of layer L000 with column 0 of every slot NaN and column 1 +Inf: the format
// allows NaN there; returns the number of slots.
std::int64_t plant_nonfinite_source(const std::filesystem::path& path) {
  const hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  REQUIRE(file >= 0);
  const hid_t dataset = H5Dopen2(file, "/layers/L000/kv_source", H5P_DEFAULT);
  REQUIRE(dataset >= 0);
  const hid_t space = H5Dget_space(dataset);
  hsize_t dims[3] = {0, 0, 0};
  REQUIRE(H5Sget_simple_extent_dims(space, dims, nullptr) == 3);
  std::vector<std::uint16_t> bits(dims[0] * dims[1] * dims[2]);
  REQUIRE(H5Dread(dataset, H5T_NATIVE_UINT16, H5S_ALL, H5S_ALL, H5P_DEFAULT, bits.data()) >= 0);
  const std::int64_t slots = static_cast<std::int64_t>(dims[0] * dims[1]);
  for (std::int64_t t = 0; t < slots; ++t) {
    bits[t * dims[2] + 0] = 0x7FC0;  // bf16 quiet NaN
    bits[t * dims[2] + 1] = 0x7F80;  // bf16 +Inf
  }
  REQUIRE(H5Dwrite(dataset, H5T_NATIVE_UINT16, H5S_ALL, H5S_ALL, H5P_DEFAULT, bits.data()) >= 0);
  H5Sclose(space);
  H5Dclose(dataset);
  H5Fclose(file);
  return slots;
}

TEST_CASE("calibrate: NaN and Inf in kv_source are left out of the statistics and counted",
          "[calibrate]") {
  const auto path = test_tmp_dir("calibrate") / "nonfinite_source.h5";
  REQUIRE(write_synth_dump(path, outlier_spec()));
  plant_nonfinite_source(path);
  auto reader = DumpReader::open(path);
  REQUIRE(reader);
  auto calibration = calibrate_dump(*reader, CalibrationOptions{});
  REQUIRE(calibration);
  const LayerCalibration& layer = calibration->layers.at(0);
  // Columns 0 and 1 of every visible slot that kv_source still holds (a step's new_kv row
  // replaces its slot's source row): some, and two per such row.
  CHECK(layer.latent.nonfinite > 0);
  CHECK(layer.latent.nonfinite % 2 == 0);
  CHECK(layer.rope.nonfinite == 0);
  CHECK(std::isfinite(layer.latent.amax));
  CHECK(std::isfinite(layer.latent.p999));
  REQUIRE(layer.recommended >= 0);
  REQUIRE(layer.recommended < static_cast<int>(layer.candidates.size()));
  CHECK(std::isfinite(layer.candidates[layer.recommended].scale));
  const std::string text = format_calibration(*calibration);
  CHECK(text.find(std::to_string(layer.latent.nonfinite) + " non-finite source values, left out") !=
        std::string::npos);
}

}  // namespace
}  // namespace kvaudit

namespace kvaudit {
namespace {

// safetensors read back by hand (8-byte little-endian header length, JSON header, raw data), so
// the test does not trust the writer's own layout.
TEST_CASE("calibrate: the exports carry k_scale = v_scale per layer in the servers' forms",
          "[calibrate]") {
  const DumpReader reader = synth_dump(outlier_spec(), "exports.h5");
  auto calibration = calibrate_dump(reader, CalibrationOptions{});
  REQUIRE(calibration);
  const float recommended =
      calibration->layers[0].candidates[calibration->layers[0].recommended].scale;
  const nlohmann::json param = quantization_param_json(*calibration, "glm_moe", 2);
  CHECK(param["model_type"] == "glm_moe");
  CHECK(param["kv_cache"]["dtype"] == "float8_e4m3fn");
  CHECK(param["kv_cache"]["scaling_factor"]["0"]["0"].get<float>() == recommended);
  CHECK(param["kv_cache"]["scaling_factor"]["1"]["0"].get<float>() == recommended);
  // Without --model-type: null (the schema's Optional[str] key), never the dump's model name.
  const nlohmann::json untyped = quantization_param_json(*calibration, "", 1);
  REQUIRE(untyped.contains("model_type"));
  CHECK(untyped["model_type"].is_null());
  // Layer 0 alone is every layer 0..N-1 of a one-layer dump: no warning; layers {1, 3} are not.
  CHECK(incomplete_layers_warning(*calibration).empty());
  Calibration partial = *calibration;
  partial.layers = {calibration->layers[0], calibration->layers[0]};
  partial.layers[0].layer_id = 1;
  partial.layers[1].layer_id = 3;
  const std::string warning = incomplete_layers_warning(partial);
  CHECK(warning.find("cover 2 layer(s), not every layer 0..N-1") != std::string::npos);
  CHECK(warning.find('\n') == std::string::npos);
  const std::string file = scales_safetensors(*calibration);
  REQUIRE(file.size() > 8);
  std::uint64_t length = 0;
  for (int i = 7; i >= 0; --i) length = (length << 8) | static_cast<unsigned char>(file[i]);
  CHECK(length % 8 == 0);
  const nlohmann::json header = nlohmann::json::parse(file.substr(8, length));
  for (const char* name :
       {"model.layers.0.self_attn.k_scale", "model.layers.0.self_attn.v_scale"}) {
    INFO(name);
    REQUIRE(header.contains(name));
    CHECK(header[name]["dtype"] == "F32");
    CHECK(header[name]["shape"] == nlohmann::json::array());
    const std::size_t begin = header[name]["data_offsets"][0].get<std::size_t>();
    float value = 0.0f;
    std::memcpy(&value, file.data() + 8 + length + begin, sizeof value);
    CHECK(value == recommended);
  }
}

}  // namespace
}  // namespace kvaudit
