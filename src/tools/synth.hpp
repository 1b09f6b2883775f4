// Synthetic kvdumps: deterministic, seeded MLA traces shaped like GLM-5 / DeepSeek-V3 latent
// caches, written through DumpWriter (docs/kvdump-v1.md).
//
// Shapes (H = num_heads, Dc = kv_lora_rank, Dr = rope_dim, D = Dc + Dr, Nq = rows of a step):
//   kv_cache, kv_source : [num_pages, page_size, D]
//   q_nope : [Nq, H, Dc]   q_pe : [Nq, H, Dr]   new_kv : [Nq, D]
//
// The trace: request b has prefix_lens[b] tokens cached before step 0. Step S000 ("prefill")
// appends prefill_tokens[b] tokens to each request (causal extend); then decode_steps steps
// ("decode") append one token to every request that holds at least one token. A request with no
// prefix and no prefill tokens stays empty in every step: it is part of B with no rows and no
// pages. When no request has prefill tokens, S000 is a decode step (there is no prefill step).
//
// Values (all rounded to bf16, as a server's latent cache is):
//   ckv channel c ~ N(0, sigma_c^2), sigma_c = 0.5 * layer_factor * u_c, u_c in [0.6, 1.4);
//     2% of the Dc channels (at least one; outlier_channels when given, 0 allowed) are outliers,
//     sigma G-2G times larger, G = outlier_gain (default 10), drawn from the seed;
//   kpe channel  ~ N(0, sigma^2), sigma = 2 * layer_factor * u, u in [0.6, 1.4);
//   layer_factor in [0.5, 2) per layer, so calibrated scales differ between layers.
//   q_nope, q_pe ~ N(0, s_h^2), s_h chosen so that the score s_t = sm_scale * q . k has standard
//     deviation 2 * f_h, f_h in [0.5, 1.5) per head: softmax neither uniform nor one-hot.
// Normals are the Irwin-Hall sum of twelve uniforms minus 6 (mean 0, variance 1, |z| <= 6): only
// integer and IEEE double additions, so every platform draws the same bits (std::normal_
// distribution is implementation-defined). Each token's row and each query row comes from its own
// stream keyed by (seed, layer_id, request, position), so a token is the same whatever else the
// trace holds.
//
// v1.1 (scale_group_size > 0): the pool is per_token_group (group scales chosen by the v1.1 write
// rule, src/format/group_scales.hpp); kv_scale is then the RoPE part's multiplier, calibrated over
// RoPE values only for an e4m3 RoPE part, 1 for a bf16 one. zero_group_every N zeroes the last
// latent group of token positions divisible by N (an all-zero group, for the zero-scale fault).
// topk K > 0 (sparse, DSA-like): row i lists min(K, pos + 1) positions of its request: its own
// position, positions 0..3 (attention sinks), and the rest drawn from 0..pos by the seeded stream
// of (layer, request, position), padded with -1 in a seeded order.
//
// kv_scale per layer: fixed (spec.kv_scale) or calibrated as fp32(amax / 448), amax over every
// generated value of that layer (the prefix tokens and every step's new tokens) except the ones
// deliberately pushed past the range by saturate_fraction. Those (a fraction F of elements) are
// set to +-m * 448 * kv_scale, m in [1.1, 2): beyond 464 * kv_scale, the midpoint where round-to-
// nearest would overflow, so satfinite stores the code +-448 (0x7E / 0xFE) and a no-saturation
// encoder would store NaN.
//
// Pages: the num_pages page ids are shuffled with the seed; request b takes the next
// ceil(final_len(b) / page_size) of them; the rest stay unused. A step lists, for each request,
// the pages holding its tokens after the step's writes. Slots that hold no prefix token before
// step 0 (unused pages, the tails of last pages, slots later steps will write) hold zeros, or NaN
// codes (0x7F / 0xFF, bf16 0x7FC0 / 0xFFC0 for a bf16 pool) with nan_unused; kv_source mirrors
// them (0 or NaN).
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "src/core/result.hpp"
#include "src/format/kvdump.hpp"

namespace kvaudit {

struct SynthSpec {
  std::uint64_t seed = 1;
  std::string model = "GLM-5";
  std::vector<int> layer_ids = {0};
  int num_heads = 16;
  int kv_lora_rank = 512;
  int rope_dim = 64;
  int page_size = 1;
  // One entry per request; a list of one entry is broadcast to the other list's length.
  std::vector<int> prefix_lens = {0, 37, 300};
  std::vector<int> prefill_tokens = {16, 8, 1};
  int decode_steps = 2;
  std::optional<std::int64_t> num_pages;  // default: the pages needed plus spare unused pages
  std::optional<float> kv_scale;          // default: calibrated amax / 448 per layer
  double saturate_fraction = 0.0;
  bool nan_unused = false;
  bool with_source = false;
  // Default: the softmax scale of the `model` preset's attention (src/tools/model_presets.hpp:
  // GLM-5 1/16, DeepSeek-V3 and V3.2 192^-0.5 * mscale^2); a model without a preset needs it.
  std::optional<double> sm_scale;
  KvDtype kv_dtype = KvDtype::kFloat8E4m3fn;
  // kvdump v1.1 (any of these makes the dump v1.1):
  int scale_group_size = 0;  // > 0: per_token_group scales over groups of this many channels
  GroupScaleFormat scale_format = GroupScaleFormat::kFloat32;
  KvDtype rope_dtype = KvDtype::kBfloat16;  // of a per_token_group pool
  PoolLayout layout = PoolLayout::kSplit;
  int zero_group_every = 0;  // > 0: the last latent group of every Nth token position is zero
  double rope_gain = 1.0;    // multiplies the RoPE part's sigma
  int topk = 0;              // > 0: sparse rows, topk_indices [Nq, topk] per (step, layer)
  // Outlier latent channels (the statistics `kvaudit calibrate` is for): how many (default: 2% of
  // Dc, at least one), and G: each one's sigma is G to 2G times its regular value.
  std::optional<int> outlier_channels;
  double outlier_gain = 10.0;
  // Threads that draw the values (0: every core). Every draw is keyed by what it is for (layer,
  // request, position), not by the order of the draws, so the dump is the same for any count.
  int threads = 0;
};

// The request/page plan a spec produces (no tensors): what write_synth_dump writes as steps.
struct SynthPlan {
  std::int64_t num_pages = 0;
  std::vector<int> prefix_lens;                          // [B], broadcast
  std::vector<int> prefill_tokens;                       // [B], broadcast
  std::vector<std::int64_t> final_lens;                  // [B] tokens after the last step
  std::vector<std::vector<std::int32_t>> request_pages;  // [B][pages of b over the whole trace]
  std::vector<StepMeta> steps;
};

// The softmax scale a spec's dump carries: its sm_scale, else its model preset's; none when the
// model has no preset and no sm_scale is given.
std::optional<double> synth_sm_scale(const SynthSpec& spec);

// Checks a spec; errors are bad input with where = "synth" and the option at fault in `what`.
Status validate_synth_spec(const SynthSpec& spec);

// Broadcasts the lists, allocates pages and builds every step's indices.
Result<SynthPlan> plan_synth(const SynthSpec& spec);

// What a valid spec will take, from its shapes alone (nothing is allocated): the peak memory of
// write_synth_dump (the plan's indices, then the larger of one layer's pool with its kv_source and
// the tensors of one (step, layer) with their bf16 copies) and the size of the file (pools, indices
// and step tensors; HDF5's metadata left out). Doubles: absurd options overflow 64-bit integers.
struct SynthFootprint {
  double memory_bytes = 0;
  double file_bytes = 0;
  double largest_index = 0;  // entries of the longest index dataset (kv_indices of the last step)
  double slots = 0;          // of the pool
  double steps = 0;
  double rows = 0;  // query rows of the largest step
};
SynthFootprint estimate_synth_footprint(const SynthSpec& spec);

// Refuses, before anything is allocated, a valid spec whose dump this machine cannot build
// (memory_budget.hpp: exit 2 with the size it would need) or whose file does not fit in the
// folder of `out`, or whose indices the format's reader would refuse (more than 2^28 entries, or
// slot numbers past int32).
Status check_synth_fits(const SynthSpec& spec, const std::filesystem::path& out);

// One line naming the spec (used as the dump's producer attribute).
std::string describe_synth_spec(const SynthSpec& spec);

// Generates the trace and writes it to `path` (replaced only when the whole file is written:
// DumpWriter is atomic), after check_synth_fits. On success returns the kv_scale of each layer,
// in layer_ids order after sorting.
Result<std::vector<float>> write_synth_dump(const std::filesystem::path& path,
                                            const SynthSpec& spec);

// Parses "3" (layers 0, 1, 2) or "0,1,77" / "77," (those ids). A count is at most kMaxSynthLayers.
inline constexpr int kMaxSynthLayers = 4096;  // real models have about 100 (GLM-5: 78)
Result<std::vector<int>> parse_layer_list(const std::string& text);

}  // namespace kvaudit
