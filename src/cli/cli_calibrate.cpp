// `kvaudit calibrate DUMP`: which kv_scale should this cache use (src/tools/calibrate.hpp)?
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <iostream>
#include <memory>
#include <string>

#include "src/cli/cli.hpp"
#include "src/format/dump_probe.hpp"
#include "src/format/kvdump.hpp"
#include "src/tools/calibrate.hpp"

namespace kvaudit {

namespace {

struct CalibrateCliOptions {
  std::string dump;
  std::string layers;
  std::string json_path;
  std::string quantization_param_path;
  std::string safetensors_path;
  std::string model_type;
  int tp_size = 1;
  CalibrationOptions calibration;
};

Result<Calibration> run_calibration(CalibrateCliOptions& options) {
  if (!options.layers.empty()) {
    KVAUDIT_ASSIGN_OR_RETURN(options.calibration.layer_ids,
                             parse_index_list(options.layers, "--layers"));
  }
  KVAUDIT_TRY(probe_dump_in_child(options.dump));
  KVAUDIT_ASSIGN_OR_RETURN(const DumpReader reader, DumpReader::open(options.dump));
  return calibrate_dump(reader, options.calibration);
}

Status write_file(const std::string& path, const char* option, const std::string& text) {
  if (path.empty()) return ok_status();
  KVAUDIT_ASSIGN_OR_RETURN(AtomicOutputFile file, AtomicOutputFile::create(path, option));
  KVAUDIT_TRY(file.write(text));
  return file.commit();
}

// --json, --quantization-param and --safetensors, each written whole or not at all.
Status write_outputs(const CalibrateCliOptions& options, const Calibration& calibration) {
  KVAUDIT_TRY(
      write_file(options.json_path, "--json", calibration_json(calibration).dump(2) + "\n"));
  KVAUDIT_TRY(write_file(
      options.quantization_param_path, "--quantization-param",
      quantization_param_json(calibration, options.model_type, options.tp_size).dump(2) + "\n"));
  return write_file(options.safetensors_path, "--safetensors", scales_safetensors(calibration));
}

int run_calibrate(CalibrateCliOptions& options) {
  const Result<Calibration> calibration = run_calibration(options);
  if (!calibration) return report_error(calibration.error());
  std::cout << format_calibration(*calibration);
  const Status written = write_outputs(options, *calibration);
  if (!written) return report_error(written.error());
  const bool exports =
      !options.quantization_param_path.empty() || !options.safetensors_path.empty();
  const std::string warning = incomplete_layers_warning(*calibration);
  if (exports && !warning.empty()) std::cerr << warning << "\n";
  return kExitPass;
}

// A layer's calibration as the sign-off judges it: the dump's scale (the served one) and the
// recommended one, each with its FP8-storage error over every step.
LayerScaleCheck scale_check_of(const LayerCalibration& layer) {
  LayerScaleCheck check;
  check.layer_id = layer.layer_id;
  const CandidateResult& best = layer.candidates[layer.recommended];
  check.served_scale = layer.dump_scale;
  check.recommended_scale = best.scale;
  check.recommended_rule = candidate_kind_name(best.kind);
  check.recommended_rel_l2 = best.all.out_rel_l2;
  const auto underflow = [](const CandidateResult& c) {
    const std::int64_t count = c.latent.count + c.rope.count;
    const std::int64_t under =
        c.latent.subnormal + c.latent.flushed + c.rope.subnormal + c.rope.flushed;
    return count > 0 ? static_cast<double>(under) / static_cast<double>(count) : 0.0;
  };
  check.recommended_underflow_fraction = underflow(best);
  std::vector<const CandidateResult*> sorted;
  for (const CandidateResult& c : layer.candidates) sorted.push_back(&c);
  std::sort(sorted.begin(), sorted.end(),
            [](const auto* a, const auto* b) { return a->scale < b->scale; });
  for (const CandidateResult* c : sorted) {
    const std::int64_t count = c->latent.count + c->rope.count;
    const double saturated = count > 0
                                 ? static_cast<double>(c->latent.saturated + c->rope.saturated) /
                                       static_cast<double>(count)
                                 : 0.0;
    check.curve.push_back({c->scale, c->all.out_rel_l2, saturated});
    if (c->scale == layer.dump_scale) {  // the dump's scale is always a candidate (deduplicated)
      check.served_rel_l2 = c->all.out_rel_l2;
      check.served_saturated_fraction = saturated;
      check.served_underflow_fraction = underflow(*c);
    }
  }
  return check;
}

}  // namespace

Result<ServedScales> served_scale_checks(const DumpReader& reader,
                                         const std::vector<int>& layer_ids, int threads) {
  const DumpLayout& layout = reader.layout();
  ServedScales served;
  if (layout.attrs.per_token_group()) {
    served.notes.push_back(
        "Scales: not judged: the dump's pools carry per_token_group scales, computed at write "
        "time, so there is no served per-tensor kv_scale to compare with a recommendation");
    return served;
  }
  std::vector<int> without_source;
  for (const LayerMeta& layer : layout.layers) {
    const bool selected = layer_ids.empty() || std::find(layer_ids.begin(), layer_ids.end(),
                                                         layer.layer_id) != layer_ids.end();
    if (selected && !layer.has_source) without_source.push_back(layer.layer_id);
  }
  if (!without_source.empty()) {
    served.notes.push_back(fmt::format(
        "Scales: not judged: layer(s) {} have no kv_source, the unquantized rows a scale's "
        "FP8-storage error is measured on",
        fmt::join(without_source, ", ")));
    return served;
  }
  CalibrationOptions options;
  options.threads = threads;
  options.layer_ids = layer_ids;
  KVAUDIT_ASSIGN_OR_RETURN(const Calibration calibration, calibrate_dump(reader, options));
  for (const LayerCalibration& layer : calibration.layers) {
    if (layer.recommended >= 0) {
      served.checks.push_back(scale_check_of(layer));
    } else {
      served.notes.push_back(
          fmt::format("Scales: layer {}: served kv_scale not judged, no "
                      "recommendation: {}",
                      layer.layer_id, layer.reason));
    }
  }
  return served;
}

void register_calibrate_command(CLI::App& app, CommandRunner& runner) {
  auto options = std::make_shared<CalibrateCliOptions>();
  CLI::App* cmd = add_command(
      app, "calibrate",
      {"Measure what FP8 storage costs each layer under candidate kv_scales, and recommend one.",
       "Needs kv_source (the unquantized rows; a dump without it is refused in one line). Per "
       "layer and part (latent, RoPE): amax, percentiles of |x|, and under the dump's kv_scale "
       "the fractions that saturate (past 464*s: the kvdump write rule, satfinite, stores +-448; "
       "PyTorch's .to(torch.float8_e4m3fn) would store NaN), that become subnormal and that are "
       "flushed to 0. Then, for candidate scales (amax/448; its power of two rounded up; the "
       "dump's kv_scale; 1.0, a server's default without checkpoint scales; and a sweep of "
       "factors 2^(+-1/2) around the best), the error FP8 storage alone causes: attention on the "
       "quantized source against attention on the source (out rel_l2, lse max abs error, worst "
       "row), on the selection steps (even indices) and on the held-out steps (odd), so that a "
       "recommendation is judged on rows it was not chosen on.\n"
       "The recommendation is the rule amax/448 unless another candidate's selection error is "
       "below --margin times the rule's; it is confirmed with the exact reference on the "
       "held-out steps. MLA caches one tensor (the latent is both K and V), so one scale serves "
       "both: k_scale = v_scale. per_token_group dumps (v1.1) compute scales at write time: the "
       "write rule is compared with float32 and power-of-two group scales and against one "
       "per-tensor scale, and no value is recommended.\n"
       "Example: kvaudit calibrate datasets/glm5_page1.h5 --json scales.json",
       "0 measured, 2 bad input (no kv_source, unreadable dump, bad option), 3 internal error"});
  add_input_file(*cmd, "DUMP", options->dump, "kvdump HDF5 file with kv_source")->required();
  cmd->add_option("--layers", options->layers,
                  "Layer ids to calibrate, e.g. 0,1,77 or 0-3 (default: every layer)");
  add_output_path(*cmd, "--json", options->json_path, OutputKind::kFile,
                  "Also write every figure as JSON, with the recommended k_scale = v_scale per "
                  "layer");
  add_output_path(*cmd, "--quantization-param", options->quantization_param_path, OutputKind::kFile,
                  "Write the recommended per-layer scales as the JSON that SGLang's "
                  "--quantization-param-path reads ({\"kv_cache\": {\"scaling_factor\": {rank: "
                  "{layer: s}}}}); one scale serves K and V. Servers expect every layer "
                  "0..N-1: a --layers subset (or a dump with some layers) gets a warning");
  add_output_path(*cmd, "--safetensors", options->safetensors_path, OutputKind::kFile,
                  "Write the recommended scales as a safetensors file of float32 scalars "
                  "model.layers.N.self_attn.k_scale and .v_scale (equal), to merge into a "
                  "checkpoint (docs/calibrate.md)");
  cmd->add_option("--model-type", options->model_type,
                  "model_type written into --quantization-param: the checkpoint config.json's "
                  "model_type (\"deepseek_v3\", \"glm_moe_dsa\"), which servers compare it "
                  "with; default null (the dump's model attribute is a display name, refused)");
  add_integer_option(*cmd, "--tp-size", options->tp_size, 1, 4096,
                     "Tensor-parallel ranks listed in --quantization-param (each gets the same "
                     "per-tensor scales)");
  add_number_option(*cmd, "--margin", options->calibration.margin, 0.0, 1.0,
                    "Another candidate replaces the rule amax/448 only when its selection-step "
                    "out rel_l2 is below this fraction of the rule's (default 0.75)");
  add_integer_option(*cmd, "--threads", options->calibration.threads, 0, kMaxThreads,
                     "Reference threads (0: every core)");
  cmd->callback([options, &runner] { runner = [options] { return run_calibrate(*options); }; });
}

}  // namespace kvaudit
