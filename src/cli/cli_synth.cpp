// `kvaudit synth`: writes a deterministic synthetic kvdump (src/tools/synth.hpp) from command-line
// options. The dump's producer attribute repeats the full command, so a file says how to
// regenerate itself. Sizes are checked against the machine before anything is allocated
// (check_synth_fits), and the file appears only once complete (DumpWriter writes it atomically).
#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "src/cli/cli.hpp"
#include "src/tools/synth.hpp"

namespace kvaudit {
namespace {

struct SynthOptions {
  std::string out;
  SynthSpec spec;
  std::string layers = "1";
  std::string kv_dtype = "float8_e4m3fn";
  std::string scale_format = "float32";
  std::string rope_dtype = "bfloat16";
  std::string layout = "split";
  std::int64_t num_pages = 0;
  float kv_scale = 0.0f;
  CLI::Option* num_pages_option = nullptr;
  CLI::Option* kv_scale_option = nullptr;
  int outlier_channels = 0;
  CLI::Option* outlier_channels_option = nullptr;
  double sm_scale = 0.0;
  CLI::Option* sm_scale_option = nullptr;
};

// The spec the options describe (the options CLI11 cannot hold in a SynthSpec directly).
Result<SynthSpec> spec_of(const SynthOptions& options) {
  SynthSpec spec = options.spec;
  KVAUDIT_ASSIGN_OR_RETURN(spec.layer_ids, parse_layer_list(options.layers));
  spec.kv_dtype = options.kv_dtype == "bfloat16" ? KvDtype::kBfloat16 : KvDtype::kFloat8E4m3fn;
  spec.scale_format = options.scale_format == "e8m0"           ? GroupScaleFormat::kE8m0
                      : options.scale_format == "power_of_two" ? GroupScaleFormat::kPowerOfTwo
                                                               : GroupScaleFormat::kFloat32;
  spec.rope_dtype =
      options.rope_dtype == "float8_e4m3fn" ? KvDtype::kFloat8E4m3fn : KvDtype::kBfloat16;
  spec.layout = options.layout == "flashmla_fp8" ? PoolLayout::kFlashMlaFp8 : PoolLayout::kSplit;
  if (options.num_pages_option->count() > 0) spec.num_pages = options.num_pages;
  if (options.kv_scale_option->count() > 0) spec.kv_scale = options.kv_scale;
  if (options.outlier_channels_option->count() > 0) {
    spec.outlier_channels = options.outlier_channels;
  }
  if (options.sm_scale_option->count() > 0) spec.sm_scale = options.sm_scale;
  return spec;
}

// "wrote FILE: ..." and one line per layer with its kv_scale (9 digits: the float exactly).
std::string summary(const std::string& out, const SynthSpec& spec, const SynthPlan& plan,
                    const std::vector<float>& scales) {
  std::vector<int> ids = spec.layer_ids;
  std::sort(ids.begin(), ids.end());
  std::string text = fmt::format(
      "wrote {}: {} layer(s), {} step(s), {} request(s), {} pages of {} slot(s), kv_dtype {}\n",
      out, ids.size(), plan.steps.size(), plan.prefix_lens.size(), plan.num_pages, spec.page_size,
      kv_dtype_name(spec.kv_dtype));
  for (std::size_t l = 0; l < ids.size(); ++l) {
    text += fmt::format("  {} kv_scale {:.9g}\n", layer_group_name(ids[l]),
                        static_cast<double>(scales[l]));
  }
  return text;
}

int run_synth(const SynthOptions& options) {
  const Result<SynthSpec> spec = spec_of(options);
  if (!spec) return report_error(spec.error());
  // Before plan_synth, which allocates the indices of every step.
  if (const Status fits = check_synth_fits(*spec, options.out); !fits) {
    return report_error(fits.error());
  }
  const Result<SynthPlan> plan = plan_synth(*spec);
  if (!plan) return report_error(plan.error());
  const Result<std::vector<float>> scales = write_synth_dump(options.out, *spec);
  if (!scales) return report_error(scales.error());
  std::cout << summary(options.out, *spec, *plan, *scales);
  return kExitPass;
}

// The trace's shapes: layers, widths, pages, requests and steps.
void add_shape_options(CLI::App& cmd, SynthOptions& options) {
  SynthSpec& spec = options.spec;
  constexpr int kMaxDim = 1 << 20;  // the reader's bound on num_heads, kv_lora_rank, ... (v1)
  cmd.add_option("--layers", options.layers,
                 "Layers: a count N (ids 0..N-1, N <= 4096) or a comma list of layer ids "
                 "(0,1,77; a single id as 77,)")
      ->capture_default_str();
  add_integer_option(cmd, "--heads", spec.num_heads, 1, kMaxDim, "Query heads H")
      ->capture_default_str();
  add_integer_option(cmd, "--kv-lora-rank", spec.kv_lora_rank, 1, kMaxDim, "Latent width Dc (ckv)")
      ->capture_default_str();
  add_integer_option(cmd, "--rope-dim", spec.rope_dim, 1, kMaxDim, "Rope width Dr (kpe)")
      ->capture_default_str();
  add_integer_option(cmd, "--page-size", spec.page_size, 1, kMaxDim,
                     "Tokens per page (1: one slot per token)")
      ->capture_default_str();
  cmd.add_option("--prefix-lens", spec.prefix_lens,
                 "Per request, tokens already cached before step 0 (comma list; 0 = none). A "
                 "single value applies to every request")
      ->delimiter(',')
      ->check(integer_in(0, INT_MAX))
      ->capture_default_str();
  cmd.add_option("--prefill-tokens", spec.prefill_tokens,
                 "Per request, new tokens in the prefill step S000 (comma list; 0 = no rows in "
                 "that step). A request with no prefix and no prefill tokens stays empty in "
                 "every step")
      ->delimiter(',')
      ->check(integer_in(0, INT_MAX))
      ->capture_default_str();
  add_integer_option(cmd, "--decode-steps", spec.decode_steps, 0, INT_MAX,
                     "Decode steps after the prefill, one new token per non-empty request each")
      ->capture_default_str();
  options.num_pages_option =
      add_integer_option(cmd, "--num-pages", options.num_pages, 1, INT_MAX,
                         "Pages in the pool (default: the pages needed plus 1/8, at least 2, "
                         "spare unused pages)");
}

// The values: scales, saturation, NaN codes, kv_source, storage type.
void add_value_options(CLI::App& cmd, SynthOptions& options) {
  SynthSpec& spec = options.spec;
  options.kv_scale_option = add_number_option(
      cmd, "--kv-scale", options.kv_scale, 1e-30, 1e30,
      "Fixed per-tensor kv_scale for every layer (default: calibrated per layer as amax/448)");
  add_number_option(cmd, "--saturate-fraction", spec.saturate_fraction, 0.0, 0.5,
                    "Fraction of KV values set beyond 448*kv_scale (1.1x to 2x), so that "
                    "satfinite stores +-448; they are left out of the calibration")
      ->capture_default_str();
  cmd.add_flag("--nan-unused", spec.nan_unused,
               "Fill every slot that holds no cached token before step 0 (unused pages, tails "
               "of last pages, slots later steps write) with NaN codes 0x7F/0xFF");
  cmd.add_flag("--with-source", spec.with_source,
               "Write kv_source: the bf16 values the initial pool was quantized from");
  options.sm_scale_option = add_number_option(
      cmd, "--sm-scale", options.sm_scale, 1e-30, 1e30,
      "Softmax scale (default: the --model preset's, as its attention code derives it: "
      "(qk_nope_head_dim + qk_rope_head_dim)^-0.5, times YaRN's mscale^2 where the config has "
      "mscale_all_dim; GLM-5 1/16, DeepSeek-V3 and V3.2 0.1352; needed for other models)");
  cmd.add_option("--kv-dtype", options.kv_dtype, "Pool storage type")
      ->check(CLI::IsMember({"float8_e4m3fn", "bfloat16"}))
      ->capture_default_str();
}

// kvdump v1.1: per-token-group scales (GLM-5 / DeepSeek-V3.2 FP8 caches) and sparse rows (DSA).
void add_v1_1_options(CLI::App& cmd, SynthOptions& options) {
  SynthSpec& spec = options.spec;
  add_integer_option(cmd, "--scale-group-size", spec.scale_group_size, 0, INT_MAX,
                     "v1.1: per_token_group scales, one per this many latent channels per token "
                     "(128 for FlashMLA / SGLang / FlashInfer's ckv_scale_arr); 0: per_tensor");
  cmd.add_option("--scale-format", options.scale_format,
                 "v1.1: how group scales are chosen and stored")
      ->check(CLI::IsMember({"float32", "power_of_two", "e8m0"}))
      ->capture_default_str();
  cmd.add_option("--rope-dtype", options.rope_dtype,
                 "v1.1: the RoPE part of a per_token_group pool: bf16 values (FlashMLA, SGLang) "
                 "or e4m3 codes with the layer's kv_scale (FlashInfer ckv_scale_arr)")
      ->check(CLI::IsMember({"bfloat16", "float8_e4m3fn"}))
      ->capture_default_str();
  cmd.add_option("--layout", options.layout,
                 "v1.1: split datasets, or FlashMLA's packed 656-byte slot (flashmla_fp8)")
      ->check(CLI::IsMember({"split", "flashmla_fp8"}))
      ->capture_default_str();
  add_integer_option(cmd, "--zero-group-every", spec.zero_group_every, 0, INT_MAX,
                     "v1.1: zero the last latent group of every Nth token (an all-zero group)");
  add_number_option(cmd, "--rope-gain", spec.rope_gain, 1e-6, 1e6,
                    "Multiply the RoPE part's spread (larger RoPE than latent values)");
  options.outlier_channels_option = add_integer_option(
      cmd, "--outlier-channels", options.outlier_channels, 0, 1 << 20,
      "Latent channels drawn as outliers, as real MLA latents have a few (default: 2% of "
      "--kv-lora-rank, at least 1; at most --kv-lora-rank), chosen from the seed");
  add_number_option(cmd, "--outlier-gain", spec.outlier_gain, 1e-6, 1e6,
                    "An outlier channel's spread is G to 2G times a regular channel's (drawn "
                    "per channel from the seed); with --rope-gain it makes the statistics "
                    "`kvaudit calibrate` is for")
      ->capture_default_str();
  add_integer_option(cmd, "--topk", spec.topk, 0, INT_MAX,
                     "v1.1: sparse attention (DSA): each row lists this many token positions "
                     "(its own, the first four, the rest drawn), -1 padded");
}

}  // namespace

void register_synth_command(CLI::App& app, CommandRunner& runner) {
  auto options = std::make_shared<SynthOptions>();
  CLI::App* cmd = add_command(
      app, "synth",
      {"Write a deterministic synthetic kvdump.",
       "GLM-5/DeepSeek-shaped MLA latent cache (a few outlier channels, larger rope part), "
       "scattered pages, one prefill step then decode steps. The same options and seed give the "
       "same bytes on every platform. Sizes are checked against the memory and disk space "
       "available before anything is allocated (KVAUDIT_MEMORY_BUDGET overrides the memory "
       "figure); the file appears only once complete.",
       "0 written, 2 bad options or sizes this machine cannot hold (the size it would need is "
       "named), or an unwritable --out, 3 internal error"});
  add_output_path(*cmd, "--out", options->out, OutputKind::kFile,
                  "Output HDF5 file (replaced when the dump is complete)")
      ->required();
  add_seed_option(*cmd, "--seed", options->spec.seed, "Seed of every random draw")
      ->capture_default_str();
  add_integer_option(*cmd, "--threads", options->spec.threads, 0, kMaxThreads,
                     "Threads that draw the values (0: every core); the dump is the same for any "
                     "count, as each draw is keyed by its layer, request and position")
      ->capture_default_str();
  cmd->add_option("--model", options->spec.model,
                  "Model name stored in the dump; GLM-5, DeepSeek-V3 and DeepSeek-V3.2 also "
                  "give the default --sm-scale")
      ->capture_default_str();
  add_shape_options(*cmd, *options);
  add_value_options(*cmd, *options);
  add_v1_1_options(*cmd, *options);
  cmd->callback([options, &runner] { runner = [options] { return run_synth(*options); }; });
}

}  // namespace kvaudit
