// Synthetic kvdump generator (see synth.hpp for the trace, the value model and the shapes).
//
// Determinism: every random draw comes from xoshiro256** streams seeded through splitmix64 from
// (seed, purpose, layer_id, request, position); normals are Irwin-Hall sums (exact integer to
// double conversions and IEEE double additions), rounded once to float and once to bf16. No
// libm transcendental is used (only sqrt, which IEEE 754 rounds correctly), and the project
// builds as ISO C++ (CMAKE_CXX_EXTENSIONS OFF), where GCC does not contract a * b + c into an
// FMA, so the bytes of a dump depend only on the spec.
#include "src/tools/synth.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <numeric>

#include "src/core/fp8_e4m3.hpp"
#include "src/core/memory_budget.hpp"
#include "src/core/parallel_for.hpp"
#include "src/format/group_scales.hpp"
#include "src/tools/model_presets.hpp"

namespace kvaudit {
namespace {

constexpr const char* kWhere = "synth";

// Purposes of the random streams: a stream is keyed by its purpose first, so that no two
// purposes can share draws.
enum StreamTag : std::uint64_t {
  kTagProfile = 1,  // per-layer channel and head scales
  kTagToken = 2,    // one cached token's KV row
  kTagQuery = 3,    // one query row
  kTagPages = 4,    // page shuffle
  kTagUnused = 5,   // NaN code signs of one unused slot
  kTagTopk = 6,     // a sparse row's topk_indices
};

// 2% of the ckv channels are outliers, 10-20x larger (what latent caches of DeepSeek-V3 and
// GLM-5 show: a handful of channels dominate amax and so the per-tensor scale).
constexpr double kOutlierChannelFraction = 0.02;
// Cached tokens drawn per unit of work on the generation threads.
constexpr std::int64_t kTokensPerChunk = 256;
constexpr double kCkvSigma = 0.5;
constexpr double kKpeSigma = 2.0;
// Score standard deviation 2 * f_h, f_h in [0.5, 1.5): softmax weights that are neither uniform
// (std << 1) nor one-hot (std >> log(context)).
constexpr double kScoreStd = 2.0;
// Saturated values are m * 448 * kv_scale with m in [1.1, 2): above 464 * kv_scale (the
// overflow midpoint of e4m3, see fp8_e4m3.hpp) even after bf16 rounding (relative 2^-8).
constexpr double kSaturateMin = 1.1;
constexpr double kSaturateSpan = 0.9;

std::uint64_t splitmix64_next(std::uint64_t& state) {
  std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// xoshiro256** (Blackman and Vigna), state filled from splitmix64 of a hash of the key.
class Rng {
 public:
  Rng(std::initializer_list<std::uint64_t> key) {
    std::uint64_t h = 0x243F6A8885A308D3ull;  // pi's fraction: any fixed non-zero start
    for (const std::uint64_t k : key) {
      std::uint64_t mixed = h ^ k;
      h = splitmix64_next(mixed);
    }
    for (auto& word : s_) word = splitmix64_next(h);
  }

  std::uint64_t next() {
    const std::uint64_t result = rotl(s_[1] * 5, 7) * 9;
    const std::uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
  }

  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

  // Uniform integer in [0, n) (multiply-shift; the bias, below n / 2^64, does not matter here).
  std::uint64_t below(std::uint64_t n) {
    return static_cast<std::uint64_t>((static_cast<unsigned __int128>(next()) * n) >> 64);
  }

  // Irwin-Hall: sum of twelve 32-bit uniforms minus 6; mean 0, variance 12 * 1/12 = 1. Each
  // uniform is exact in double and so is the sum of twelve (< 2^4 with 32 fraction bits).
  double normal() {
    double sum = 0.0;
    for (int i = 0; i < 6; ++i) {
      const std::uint64_t x = next();
      sum += static_cast<double>(x >> 32) * 0x1.0p-32;
      sum += static_cast<double>(x & 0xFFFFFFFFull) * 0x1.0p-32;
    }
    return sum - 6.0;
  }

 private:
  static std::uint64_t rotl(std::uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  std::uint64_t s_[4];
};

std::uint64_t key_of(int value) {
  return static_cast<std::uint64_t>(static_cast<std::int64_t>(value));
}

struct LayerProfile {
  std::vector<double> sigma;        // [D] per-channel standard deviation of the KV row
  std::vector<double> query_sigma;  // [H] per-head standard deviation of q_nope and q_pe
};

LayerProfile make_profile(const SynthSpec& spec, int layer_id) {
  const int dc = spec.kv_lora_rank;
  const int dr = spec.rope_dim;
  Rng rng{spec.seed, kTagProfile, key_of(layer_id)};
  LayerProfile profile;
  const double layer_factor = 0.5 + 1.5 * rng.uniform();
  profile.sigma.resize(static_cast<std::size_t>(dc + dr));
  for (int c = 0; c < dc; ++c)
    profile.sigma[c] = kCkvSigma * layer_factor * (0.6 + 0.8 * rng.uniform());
  for (int r = 0; r < dr; ++r) {
    profile.sigma[dc + r] = kKpeSigma * spec.rope_gain * layer_factor * (0.6 + 0.8 * rng.uniform());
  }
  // Outlier channels: a partial Fisher-Yates pick of distinct ckv channels.
  const int outliers = spec.outlier_channels.value_or(std::max(
      1, static_cast<int>(std::lround(kOutlierChannelFraction * static_cast<double>(dc)))));
  std::vector<int> channels(static_cast<std::size_t>(dc));
  std::iota(channels.begin(), channels.end(), 0);
  for (int i = 0; i < outliers && i < dc; ++i) {
    const auto j = i + static_cast<int>(rng.below(static_cast<std::uint64_t>(dc - i)));
    std::swap(channels[i], channels[j]);
    profile.sigma[channels[i]] *= spec.outlier_gain + spec.outlier_gain * rng.uniform();
  }
  // var(q . k) = s_h^2 * sum_c sigma_c^2 for iid zero-mean q and k; pick s_h for the score std.
  double sum_sq = 0.0;
  for (const double s : profile.sigma) sum_sq += s * s;
  const double key_norm = std::sqrt(sum_sq);
  profile.query_sigma.resize(static_cast<std::size_t>(spec.num_heads));
  for (auto& s : profile.query_sigma) {
    const double head_factor = 0.5 + rng.uniform();
    s = kScoreStd * head_factor / (*synth_sm_scale(spec) * key_norm);
  }
  return profile;
}

// One token's KV row, [D] bf16 values. Values drawn past the range by saturate_fraction are set
// from kv_scale; `regular_amax` is raised to the largest magnitude of the other values.
void generate_token(const SynthSpec& spec, const LayerProfile& profile, int layer_id, int request,
                    std::int64_t position, float kv_scale, float* row, float* regular_amax) {
  Rng rng{spec.seed, kTagToken, key_of(layer_id), key_of(request),
          static_cast<std::uint64_t>(position)};
  const std::size_t width = profile.sigma.size();
  for (std::size_t c = 0; c < width; ++c) {
    float value = bf16_round(static_cast<float>(profile.sigma[c] * rng.normal()));
    if (spec.saturate_fraction > 0.0 && rng.uniform() < spec.saturate_fraction) {
      const double draw = rng.uniform();
      const double magnitude = (kSaturateMin + kSaturateSpan * draw) * kE4m3MaxFinite * kv_scale;
      value = bf16_round(static_cast<float>((rng.next() & 1) ? -magnitude : magnitude));
    } else {
      *regular_amax = std::max(*regular_amax, std::fabs(value));
    }
    row[c] = value;
  }
  if (spec.scale_group_size > 0 && spec.zero_group_every > 0 &&
      position % spec.zero_group_every == 0) {
    std::fill(row + spec.kv_lora_rank - spec.scale_group_size, row + spec.kv_lora_rank, 0.0f);
  }
}

// One query row: q_nope [H, Dc] and q_pe [H, Dr] bf16 values.
void generate_query(const SynthSpec& spec, const LayerProfile& profile, int layer_id, int request,
                    std::int64_t position, float* q_nope, float* q_pe) {
  Rng rng{spec.seed, kTagQuery, key_of(layer_id), key_of(request),
          static_cast<std::uint64_t>(position)};
  for (int h = 0; h < spec.num_heads; ++h) {
    const double s = profile.query_sigma[h];
    for (int c = 0; c < spec.kv_lora_rank; ++c) {
      q_nope[static_cast<std::size_t>(h) * spec.kv_lora_rank + c] =
          bf16_round(static_cast<float>(s * rng.normal()));
    }
    for (int r = 0; r < spec.rope_dim; ++r) {
      q_pe[static_cast<std::size_t>(h) * spec.rope_dim + r] =
          bf16_round(static_cast<float>(s * rng.normal()));
    }
  }
}

// A sparse row's topk_indices (see synth.hpp): its own position, the sinks 0..3, then seeded draws
// from 0..pos until min(k, pos + 1) distinct positions are listed; -1 pads, in a seeded order.
void select_topk(const SynthSpec& spec, int layer_id, int request, std::int64_t position,
                 std::int32_t* out) {
  Rng rng{spec.seed, kTagTopk, key_of(layer_id), key_of(request),
          static_cast<std::uint64_t>(position)};
  const std::int64_t wanted = std::min<std::int64_t>(spec.topk, position + 1);
  std::vector<std::int32_t> listed;
  std::vector<char> taken(static_cast<std::size_t>(position + 1), 0);
  const auto take = [&](std::int64_t p) {
    if (static_cast<std::int64_t>(listed.size()) < wanted && !taken[p]) {
      taken[p] = 1;
      listed.push_back(static_cast<std::int32_t>(p));
    }
  };
  take(position);
  for (std::int64_t p = 0; p < 4 && p <= position; ++p) take(p);
  if (wanted * 2 > position + 1) {  // dense enough: walk the positions in a seeded order
    std::vector<std::int64_t> order(static_cast<std::size_t>(position + 1));
    std::iota(order.begin(), order.end(), 0);
    for (std::size_t i = order.size(); i > 1; --i) {
      std::swap(order[i - 1], order[rng.next() % i]);
    }
    for (const std::int64_t p : order) take(p);
  } else {
    while (static_cast<std::int64_t>(listed.size()) < wanted) {
      take(static_cast<std::int64_t>(rng.next() % static_cast<std::uint64_t>(position + 1)));
    }
  }
  listed.resize(static_cast<std::size_t>(spec.topk), -1);
  for (std::size_t i = listed.size(); i > 1; --i) std::swap(listed[i - 1], listed[rng.next() % i]);
  std::copy(listed.begin(), listed.end(), out);
}

std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// Broadcast a list of one entry to `n` entries.
std::vector<int> broadcast(const std::vector<int>& list, std::size_t n) {
  if (list.size() == 1 && n > 1) return std::vector<int>(n, list[0]);
  return list;
}

// Builds one step from the request lengths after its writes and its rows per request.
StepMeta make_step(int index, StepKind kind, const std::vector<std::int64_t>& lengths,
                   const std::vector<int>& rows, const SynthPlan& plan, int page_size,
                   std::size_t num_layers) {
  StepMeta step;
  step.group = step_group_name(index);
  step.kind = kind;
  step.qo_indptr.push_back(0);
  step.kv_indptr.push_back(0);
  for (std::size_t b = 0; b < lengths.size(); ++b) {
    const std::int64_t pages = ceil_div(lengths[b], page_size);
    for (std::int64_t p = 0; p < pages; ++p) step.kv_indices.push_back(plan.request_pages[b][p]);
    step.kv_indptr.push_back(static_cast<std::int32_t>(step.kv_indices.size()));
    step.kv_last_page_len.push_back(
        pages == 0 ? 0 : static_cast<std::int32_t>(lengths[b] - (pages - 1) * page_size));
    step.qo_indptr.push_back(step.qo_indptr.back() + rows[b]);
  }
  for (std::size_t b = 0; b < lengths.size(); ++b) {
    for (int j = 0; j < rows[b]; ++j) {
      const std::int64_t pos = lengths[b] - rows[b] + j;
      step.new_kv_slots.push_back(
          static_cast<std::int32_t>(step.slot_of(static_cast<int>(b), pos, page_size)));
    }
  }
  step.has_out.assign(num_layers, false);
  step.has_lse.assign(num_layers, false);
  step.has_kv_cache_after.assign(num_layers, false);
  return step;
}

std::vector<int> sorted_layer_ids(const SynthSpec& spec) {
  std::vector<int> ids = spec.layer_ids;
  std::sort(ids.begin(), ids.end());
  return ids;
}

}  // namespace

Result<std::vector<int>> parse_layer_list(const std::string& text) {
  const auto bad = [&](const std::string& why) {
    return bad_input(kWhere, fmt::format("--layers '{}': {}", text, why));
  };
  if (text.empty()) return bad("empty");
  const bool is_list = text.find(',') != std::string::npos;
  std::vector<int> values;
  std::size_t start = 0;
  while (start <= text.size()) {
    const std::size_t end = std::min(text.find(',', start), text.size());
    const std::string item = text.substr(start, end - start);
    if (item.empty()) {
      if (end == text.size() && is_list && !values.empty()) break;  // "77," : a one-id list
      return bad("empty item");
    }
    if (item.size() > 9 || item.find_first_not_of("0123456789") != std::string::npos) {
      return bad(fmt::format("'{}' is not a non-negative integer", item));
    }
    values.push_back(std::stoi(item));
    start = end + 1;
  }
  if (!is_list) {
    if (values[0] < 1) return bad("a layer count must be at least 1");
    if (values[0] > kMaxSynthLayers) {
      return bad(fmt::format("a layer count must be at most {}", kMaxSynthLayers));
    }
    std::vector<int> ids(static_cast<std::size_t>(values[0]));
    std::iota(ids.begin(), ids.end(), 0);
    return ids;
  }
  return values;
}

Status validate_synth_spec(const SynthSpec& spec) {
  const auto bad = [](const std::string& what) { return bad_input(kWhere, what); };
  if (spec.layer_ids.empty()) return bad("--layers: no layer");
  {
    std::vector<int> ids = sorted_layer_ids(spec);
    if (ids.front() < 0) return bad(fmt::format("--layers: negative layer id {}", ids.front()));
    if (std::adjacent_find(ids.begin(), ids.end()) != ids.end()) {
      return bad("--layers: layer id listed twice");
    }
  }
  if (spec.num_heads < 1) return bad("--heads must be at least 1");
  if (spec.kv_lora_rank < 1) return bad("--kv-lora-rank must be at least 1");
  if (spec.rope_dim < 1) return bad("--rope-dim must be at least 1");
  if (spec.page_size < 1) return bad("--page-size must be at least 1");
  if (spec.prefix_lens.empty()) return bad("--prefix-lens: no request");
  if (spec.prefill_tokens.empty()) return bad("--prefill-tokens: no request");
  if (spec.prefix_lens.size() != spec.prefill_tokens.size() && spec.prefix_lens.size() != 1 &&
      spec.prefill_tokens.size() != 1) {
    return bad(fmt::format("--prefix-lens has {} requests but --prefill-tokens has {}",
                           spec.prefix_lens.size(), spec.prefill_tokens.size()));
  }
  for (const int n : spec.prefix_lens) {
    if (n < 0) return bad(fmt::format("--prefix-lens: negative length {}", n));
  }
  for (const int n : spec.prefill_tokens) {
    if (n < 0) return bad(fmt::format("--prefill-tokens: negative count {}", n));
  }
  if (spec.decode_steps < 0) return bad("--decode-steps must be at least 0");
  if (spec.num_pages && *spec.num_pages < 1) return bad("--num-pages must be at least 1");
  if (spec.kv_scale) {
    // 1e30 keeps 2 * 448 * kv_scale (the largest saturated value) finite in float.
    if (!std::isfinite(*spec.kv_scale) || *spec.kv_scale <= 0.0f || *spec.kv_scale > 1e30f) {
      return bad("--kv-scale must be finite, > 0 and <= 1e30");
    }
    if (spec.kv_dtype == KvDtype::kBfloat16 && *spec.kv_scale != 1.0f) {
      return bad("--kv-scale must be 1 for a bfloat16 pool");
    }
  }
  if (!(spec.saturate_fraction >= 0.0 && spec.saturate_fraction <= 0.5)) {
    return bad("--saturate-fraction must be in [0, 0.5]");
  }
  if (spec.saturate_fraction > 0.0 && spec.kv_dtype == KvDtype::kBfloat16) {
    return bad("--saturate-fraction needs a float8_e4m3fn pool");
  }
  const std::optional<double> sm_scale = synth_sm_scale(spec);
  if (!sm_scale) {
    return bad(
        fmt::format("--model '{}' has no preset (GLM-5, DeepSeek-V3, DeepSeek-V3.2): give "
                    "its softmax scale as --sm-scale",
                    spec.model));
  }
  if (!std::isfinite(*sm_scale) || *sm_scale <= 0.0) {
    return bad("--sm-scale must be finite and > 0");
  }
  if (spec.scale_group_size < 0 ||
      (spec.scale_group_size > 0 && spec.kv_lora_rank % spec.scale_group_size != 0)) {
    return bad("--scale-group-size must divide --kv-lora-rank");
  }
  if (spec.scale_group_size > 0 && spec.kv_dtype != KvDtype::kFloat8E4m3fn) {
    return bad("--scale-group-size needs a float8_e4m3fn pool");
  }
  if (spec.layout == PoolLayout::kFlashMlaFp8 &&
      (spec.scale_group_size == 0 || spec.scale_format == GroupScaleFormat::kE8m0 ||
       spec.rope_dtype != KvDtype::kBfloat16)) {
    return bad(
        "--layout flashmla_fp8 needs --scale-group-size, float32 or power_of_two scales "
        "and --rope-dtype bfloat16");
  }
  if (spec.topk < 0 || spec.zero_group_every < 0 || !(spec.rope_gain > 0.0)) {
    return bad("--topk and --zero-group-every must be >= 0, --rope-gain > 0");
  }
  if (spec.outlier_channels &&
      (*spec.outlier_channels < 0 || *spec.outlier_channels > spec.kv_lora_rank)) {
    return bad(fmt::format("--outlier-channels {} is not from 0 to --kv-lora-rank {}",
                           *spec.outlier_channels, spec.kv_lora_rank));
  }
  if (!(spec.outlier_gain > 0.0)) return bad("--outlier-gain must be > 0");
  return ok_status();
}

namespace {

// ---- planning ----------------------------------------------------------------------------------

// Whether each request decodes (it holds a token after the prefill; an empty one stays empty),
// and what the requests need in total.
struct RequestPlan {
  std::vector<bool> active;
  std::int64_t pages_needed = 0;
  bool any_prefill = false;
  bool any_active = false;
};

// Broadcasts the request lists into `plan` and sets its final_lens.
RequestPlan plan_requests(const SynthSpec& spec, SynthPlan* plan) {
  const std::size_t batch = std::max(spec.prefix_lens.size(), spec.prefill_tokens.size());
  plan->prefix_lens = broadcast(spec.prefix_lens, batch);
  plan->prefill_tokens = broadcast(spec.prefill_tokens, batch);
  plan->final_lens.resize(batch);
  RequestPlan requests;
  requests.active.resize(batch);
  for (std::size_t b = 0; b < batch; ++b) {
    const std::int64_t after_prefill =
        static_cast<std::int64_t>(plan->prefix_lens[b]) + plan->prefill_tokens[b];
    requests.active[b] = after_prefill > 0;
    requests.any_active = requests.any_active || requests.active[b];
    requests.any_prefill = requests.any_prefill || plan->prefill_tokens[b] > 0;
    plan->final_lens[b] = after_prefill + (requests.active[b] ? spec.decode_steps : 0);
    requests.pages_needed += ceil_div(plan->final_lens[b], spec.page_size);
  }
  return requests;
}

// The trace must have a step, and decode steps something to decode.
Status check_trace(const SynthSpec& spec, const RequestPlan& requests) {
  if (!requests.any_prefill && (spec.decode_steps == 0 || !requests.any_active)) {
    return bad_input(kWhere, "the trace has no step: no prefill token and nothing to decode");
  }
  if (spec.decode_steps > 0 && !requests.any_active) {
    return bad_input(kWhere, "--decode-steps: every request is empty, nothing to decode");
  }
  return ok_status();
}

// --num-pages, or the pages needed plus spare pages (one in eight, at least two) that stay unused,
// so that unused slots exist in the pool.
Result<std::int64_t> plan_num_pages(const SynthSpec& spec, std::int64_t pages_needed) {
  const std::int64_t num_pages =
      spec.num_pages ? *spec.num_pages
                     : pages_needed + std::max<std::int64_t>(2, ceil_div(pages_needed, 8));
  if (num_pages < pages_needed) {
    return bad_input(kWhere, fmt::format("--num-pages {} is less than the {} pages the requests "
                                         "need",
                                         num_pages, pages_needed));
  }
  if (num_pages * spec.page_size > std::numeric_limits<std::int32_t>::max()) {
    return bad_input(kWhere, "the pool's slots exceed int32 indices");
  }
  return num_pages;
}

// Scattered allocation: a seeded Fisher-Yates shuffle of every page id; request b takes the next
// ceil(final_len(b) / page_size) pages.
std::vector<std::vector<std::int32_t>> allocate_pages(const SynthSpec& spec,
                                                      const SynthPlan& plan) {
  std::vector<std::int32_t> pages(static_cast<std::size_t>(plan.num_pages));
  std::iota(pages.begin(), pages.end(), 0);
  Rng rng{spec.seed, kTagPages};
  for (std::size_t i = pages.size(); i > 1; --i) std::swap(pages[i - 1], pages[rng.below(i)]);
  std::vector<std::vector<std::int32_t>> request_pages(plan.final_lens.size());
  std::size_t next = 0;
  for (std::size_t b = 0; b < request_pages.size(); ++b) {
    const auto count = static_cast<std::size_t>(ceil_div(plan.final_lens[b], spec.page_size));
    request_pages[b].assign(pages.begin() + next, pages.begin() + next + count);
    next += count;
  }
  return request_pages;
}

// The prefill step (when a request has prefill tokens), then decode_steps decode steps.
std::vector<StepMeta> plan_steps(const SynthSpec& spec, const SynthPlan& plan,
                                 const RequestPlan& requests) {
  const std::size_t batch = plan.prefix_lens.size();
  const std::size_t num_layers = spec.layer_ids.size();
  std::vector<StepMeta> steps;
  int index = 0;
  if (requests.any_prefill) {
    std::vector<std::int64_t> lengths(batch);
    for (std::size_t b = 0; b < batch; ++b) {
      lengths[b] = static_cast<std::int64_t>(plan.prefix_lens[b]) + plan.prefill_tokens[b];
    }
    steps.push_back(make_step(index++, StepKind::kPrefill, lengths, plan.prefill_tokens, plan,
                              spec.page_size, num_layers));
  }
  for (int k = 1; k <= spec.decode_steps; ++k) {
    std::vector<std::int64_t> lengths(batch, 0);
    std::vector<int> rows(batch, 0);
    for (std::size_t b = 0; b < batch; ++b) {
      if (!requests.active[b]) continue;
      lengths[b] = static_cast<std::int64_t>(plan.prefix_lens[b]) + plan.prefill_tokens[b] + k;
      rows[b] = 1;
    }
    steps.push_back(
        make_step(index++, StepKind::kDecode, lengths, rows, plan, spec.page_size, num_layers));
  }
  return steps;
}

}  // namespace

Result<SynthPlan> plan_synth(const SynthSpec& spec) {
  KVAUDIT_TRY(validate_synth_spec(spec));
  SynthPlan plan;
  const RequestPlan requests = plan_requests(spec, &plan);
  KVAUDIT_TRY(check_trace(spec, requests));
  KVAUDIT_ASSIGN_OR_RETURN(plan.num_pages, plan_num_pages(spec, requests.pages_needed));
  plan.request_pages = allocate_pages(spec, plan);
  plan.steps = plan_steps(spec, plan, requests);
  return plan;
}

// ---- footprint ----------------------------------------------------------------------------------

namespace {

// The reader refuses an index dataset longer than this (docs/kvdump-v1.md "Element encodings").
constexpr double kMaxIndexEntries = 268435456.0;  // 2^28

// Sum over the decode steps k = 1..K of ceil((base + k) / P), the pages a request lists, bounded
// above by the sum of (base + k) / P + 1.
double decode_pages_sum(double base, double steps, int page_size) {
  return steps * base / page_size + steps * (steps + 1) / (2.0 * page_size) + steps;
}

// Requests, rows and listed pages of the trace a spec describes, in doubles.
struct TraceCounts {
  double batch = 0;
  double pages_needed = 0;     // over the whole trace
  double prefill_rows = 0;     // rows of S000 when it is a prefill
  double active = 0;           // requests that decode (one row per decode step)
  double listed_pages = 0;     // kv_indices entries over every step
  double longest_listing = 0;  // kv_indices entries of the longest step
  double steps = 0;
};

TraceCounts count_trace(const SynthSpec& spec) {
  const std::size_t batch = std::max(spec.prefix_lens.size(), spec.prefill_tokens.size());
  const std::vector<int> prefix = broadcast(spec.prefix_lens, batch);
  const std::vector<int> prefill = broadcast(spec.prefill_tokens, batch);
  const double decode = spec.decode_steps;
  const double page = spec.page_size;
  TraceCounts counts;
  counts.batch = static_cast<double>(batch);
  double prefill_listing = 0, last_listing = 0;
  bool any_prefill = false;
  for (std::size_t b = 0; b < batch; ++b) {
    const double base = static_cast<double>(prefix[b]) + prefill[b];
    const bool active = base > 0;
    const double final_len = base + (active ? decode : 0.0);
    counts.pages_needed += std::ceil(final_len / page);
    counts.prefill_rows += prefill[b];
    any_prefill = any_prefill || prefill[b] > 0;
    prefill_listing += std::ceil(base / page);
    if (active) {
      counts.active += 1;
      counts.listed_pages += decode_pages_sum(base, decode, spec.page_size);
      last_listing += std::ceil(final_len / page);
    }
  }
  if (any_prefill) counts.listed_pages += prefill_listing;
  counts.longest_listing = std::max(any_prefill ? prefill_listing : 0.0, last_listing);
  counts.steps = (any_prefill ? 1.0 : 0.0) + decode;
  return counts;
}

}  // namespace

SynthFootprint estimate_synth_footprint(const SynthSpec& spec) {
  const TraceCounts t = count_trace(spec);
  const double layers = static_cast<double>(spec.layer_ids.size());
  const double width = static_cast<double>(spec.kv_lora_rank) + spec.rope_dim;
  const double query_width = static_cast<double>(spec.num_heads) * width;
  const double num_pages = spec.num_pages
                               ? static_cast<double>(*spec.num_pages)
                               : t.pages_needed + std::max(2.0, std::ceil(t.pages_needed / 8.0));
  const double slots = num_pages * spec.page_size;
  const double pool_element = spec.kv_dtype == KvDtype::kFloat8E4m3fn ? 1.0 : 2.0;
  const double decode_rows = static_cast<double>(spec.decode_steps) * t.active;
  // Indices: [B+1] x 2, [B], kv_indices and new_kv_slots per step, int32.
  const double index_bytes =
      4.0 * (t.steps * (3.0 * t.batch + 2.0) + t.listed_pages + t.prefill_rows + decode_rows);
  // Each StepMeta also costs its object, eight allocations and three bit vectors of L.
  const double plan_bytes =
      index_bytes + t.steps * (sizeof(StepMeta) + 8 * 16 + layers * 3 / 8) + 4.0 * t.pages_needed;
  // One layer: the pool, kv_source as floats and as bf16 bits for writing, the prefix bitmap.
  const double layer_bytes =
      slots * width * pool_element + (spec.with_source ? slots * width * 6.0 : 0.0) + slots / 8;
  // One (step, layer): q_nope, q_pe, new_kv as floats, and the largest one's bf16 copy.
  const double rows = std::max(t.prefill_rows, t.active);
  const double step_bytes =
      rows * (query_width + width) * 4.0 + rows * spec.num_heads * spec.kv_lora_rank * 2.0;
  SynthFootprint footprint;
  footprint.memory_bytes = plan_bytes + std::max(layer_bytes, step_bytes);
  footprint.file_bytes = layers * slots * width * (pool_element + (spec.with_source ? 2.0 : 0.0)) +
                         index_bytes +
                         layers * (t.prefill_rows + decode_rows) * (query_width + width) * 2.0;
  footprint.largest_index = t.longest_listing;
  footprint.slots = slots;
  footprint.steps = t.steps;
  footprint.rows = rows;
  return footprint;
}

Status check_synth_fits(const SynthSpec& spec, const std::filesystem::path& out) {
  KVAUDIT_TRY(validate_synth_spec(spec));
  const SynthFootprint footprint = estimate_synth_footprint(spec);
  const std::string what = fmt::format(
      "{} layer(s) of {:.3g} slots x {} channels, {:.3g} steps, up to {:.3g} query rows of {} "
      "heads",
      spec.layer_ids.size(), footprint.slots, spec.kv_lora_rank + spec.rope_dim, footprint.steps,
      footprint.rows, spec.num_heads);
  KVAUDIT_TRY(check_memory_fits(footprint.memory_bytes, kWhere, what));
  const std::filesystem::path folder = out.parent_path().empty() ? "." : out.parent_path();
  KVAUDIT_TRY(check_disk_fits(footprint.file_bytes, folder, kWhere, "the dump " + out.string()));
  if (footprint.largest_index > kMaxIndexEntries) {
    return bad_input(kWhere, fmt::format("a step would list {:.3g} pages, more than the 2^28 "
                                         "entries a kvdump index may hold (fewer or shorter "
                                         "requests, fewer decode steps or a larger --page-size)",
                                         footprint.largest_index));
  }
  return ok_status();
}

std::optional<double> synth_sm_scale(const SynthSpec& spec) {
  if (spec.sm_scale) return spec.sm_scale;
  const ModelPreset* preset = find_model_preset(spec.model);
  if (preset == nullptr) return std::nullopt;
  return preset_softmax_scale(*preset);
}

std::string describe_synth_spec(const SynthSpec& spec) {
  const bool quote = spec.model.find_first_of(" \t'\"") != std::string::npos;
  // A single layer id is written "77," so that it is not read back as a layer count.
  std::string text = fmt::format(
      "kvaudit synth --seed {} --model {} --layers {}{} --heads {} --kv-lora-rank {} --rope-dim {} "
      "--page-size {} --prefix-lens {} --prefill-tokens {} --decode-steps {}",
      spec.seed, quote ? "'" + spec.model + "'" : spec.model,
      fmt::join(sorted_layer_ids(spec), ","), spec.layer_ids.size() == 1 ? "," : "", spec.num_heads,
      spec.kv_lora_rank, spec.rope_dim, spec.page_size, fmt::join(spec.prefix_lens, ","),
      fmt::join(spec.prefill_tokens, ","), spec.decode_steps);
  if (spec.num_pages) text += fmt::format(" --num-pages {}", *spec.num_pages);
  // Enough digits to read back the same float (9) or double (17).
  if (spec.kv_scale) text += fmt::format(" --kv-scale {:.9g}", static_cast<double>(*spec.kv_scale));
  if (spec.saturate_fraction > 0.0) {
    text += fmt::format(" --saturate-fraction {:.17g}", spec.saturate_fraction);
  }
  if (spec.nan_unused) text += " --nan-unused";
  if (spec.with_source) text += " --with-source";
  if (spec.scale_group_size > 0) {
    text += fmt::format(" --scale-group-size {} --scale-format {} --rope-dtype {} --layout {}",
                        spec.scale_group_size, group_scale_format_name(spec.scale_format),
                        kv_dtype_name(spec.rope_dtype), pool_layout_name(spec.layout));
  }
  if (spec.zero_group_every > 0)
    text += fmt::format(" --zero-group-every {}", spec.zero_group_every);
  if (spec.rope_gain != 1.0) text += fmt::format(" --rope-gain {:.17g}", spec.rope_gain);
  if (spec.outlier_channels) text += fmt::format(" --outlier-channels {}", *spec.outlier_channels);
  if (spec.outlier_gain != 10.0) text += fmt::format(" --outlier-gain {:.17g}", spec.outlier_gain);
  if (spec.topk > 0) text += fmt::format(" --topk {}", spec.topk);
  if (const std::optional<double> sm_scale = synth_sm_scale(spec)) {
    text += fmt::format(" --sm-scale {:.17g}", *sm_scale);
  }
  text += fmt::format(" --kv-dtype {}", kv_dtype_name(spec.kv_dtype));
  return text;
}

namespace {

// ---- writing -----------------------------------------------------------------------------------

DumpAttributes synth_attributes(const SynthSpec& spec) {
  DumpAttributes attrs;
  attrs.model = spec.model;
  attrs.producer = describe_synth_spec(spec);
  attrs.num_heads = spec.num_heads;
  attrs.kv_lora_rank = spec.kv_lora_rank;
  attrs.qk_rope_head_dim = spec.rope_dim;
  attrs.sm_scale = *synth_sm_scale(spec);
  attrs.page_size = spec.page_size;
  attrs.kv_dtype = spec.kv_dtype;
  attrs.kv_scale_kind = "per_tensor";
  if (spec.scale_group_size > 0) {
    attrs.kv_scale_kind = "per_token_group";
    attrs.kv_scale_group_size = spec.scale_group_size;
    attrs.kv_scale_format = spec.scale_format;
    attrs.kv_rope_dtype = spec.rope_dtype;
    attrs.kv_cache_layout = spec.layout;
  }
  if (spec.scale_group_size > 0 || spec.topk > 0) attrs.format_minor_version = 1;
  return attrs;
}

// The slot of token `pos` of request b over the whole trace.
std::int64_t trace_slot(const SynthPlan& plan, int page_size, std::size_t b, std::int64_t pos) {
  return static_cast<std::int64_t>(plan.request_pages[b][pos / page_size]) * page_size +
         pos % page_size;
}

// One layer as the steps need it: its value model and its scale.
struct SynthLayer {
  LayerProfile profile;
  LayerMeta meta;
};

// 1 for a bf16 pool; --kv-scale; or calibrated: amax / 448 over the prefix tokens and every
// token the steps will write (saturated values left out).
float layer_kv_scale(const SynthSpec& spec, const SynthPlan& plan, const LayerProfile& profile,
                     int layer_id) {
  if (spec.kv_dtype != KvDtype::kFloat8E4m3fn) return 1.0f;
  if (spec.scale_group_size > 0 && spec.rope_dtype == KvDtype::kBfloat16) return 1.0f;
  if (spec.kv_scale) return *spec.kv_scale;
  // Per tensor: over every regular value; per token group: over the RoPE part only (the latent's
  // scales are per token). Each request's tokens in chunks on spec.threads threads, each chunk's
  // largest magnitudes kept apart: the maximum over them does not depend on the order.
  const bool rope_only = spec.scale_group_size > 0;
  float amax = 0.0f;
  float regular_amax = 0.0f;
  for (std::size_t b = 0; b < plan.prefix_lens.size(); ++b) {
    const std::int64_t tokens = plan.final_lens[b];
    const std::size_t chunks =
        static_cast<std::size_t>((tokens + kTokensPerChunk - 1) / kTokensPerChunk);
    std::vector<float> chunk_amax(chunks, 0.0f);
    std::vector<float> chunk_regular_amax(chunks, 0.0f);
    parallel_for(chunks, spec.threads, [&] {
      return [&, row = std::vector<float>(profile.sigma.size())](std::size_t chunk) mutable {
        const std::int64_t begin = static_cast<std::int64_t>(chunk) * kTokensPerChunk;
        const std::int64_t end = std::min(tokens, begin + kTokensPerChunk);
        for (std::int64_t p = begin; p < end; ++p) {
          generate_token(spec, profile, layer_id, static_cast<int>(b), p, 1.0f, row.data(),
                         &chunk_regular_amax[chunk]);
          if (rope_only) {
            chunk_amax[chunk] =
                std::max(chunk_amax[chunk], finite_amax({row.data() + spec.kv_lora_rank,
                                                         static_cast<std::size_t>(spec.rope_dim)}));
          }
        }
      };
    });
    for (std::size_t chunk = 0; chunk < chunks; ++chunk) {
      amax = std::max(amax, chunk_amax[chunk]);
      regular_amax = std::max(regular_amax, chunk_regular_amax[chunk]);
    }
  }
  if (!rope_only) amax = regular_amax;
  return amax > 0.0f ? amax / kE4m3MaxFinite : 1.0f;
}

// The pool (and kv_source, [num_slots, D], when spec.with_source) before step 0.
struct InitialPool {
  KvPool pool;
  std::vector<float> source;
};

// Every prefix token, written with the kvdump write rule (and kept as is in kv_source).
void write_prefix_tokens(const SynthSpec& spec, const SynthPlan& plan, const SynthLayer& layer,
                         InitialPool* initial) {
  const int width = initial->pool.row_width;
  for (std::size_t b = 0; b < plan.prefix_lens.size(); ++b) {
    const std::int64_t tokens = plan.prefix_lens[b];
    const std::size_t chunks =
        static_cast<std::size_t>((tokens + kTokensPerChunk - 1) / kTokensPerChunk);
    // Each token has its own slot: the chunks write disjoint rows.
    parallel_for(chunks, spec.threads, [&] {
      return [&, row = std::vector<float>(static_cast<std::size_t>(width))](
                 std::size_t chunk) mutable {
        const std::int64_t begin = static_cast<std::int64_t>(chunk) * kTokensPerChunk;
        const std::int64_t end = std::min(tokens, begin + kTokensPerChunk);
        for (std::int64_t p = begin; p < end; ++p) {
          float unused_amax = 0.0f;
          generate_token(spec, layer.profile, layer.meta.layer_id, static_cast<int>(b), p,
                         layer.meta.kv_scale, row.data(), &unused_amax);
          const std::int64_t slot = trace_slot(plan, spec.page_size, b, p);
          initial->pool.write_row(slot, row.data(), layer.meta.kv_scale);
          if (spec.with_source)
            std::copy(row.begin(), row.end(), initial->source.begin() + slot * width);
        }
      };
    });
  }
}

// --nan-unused: NaN codes of random sign in every slot that holds no prefix token (NaN in
// kv_source).
void fill_unused_with_nan(const SynthSpec& spec, const std::vector<bool>& holds_prefix,
                          int layer_id, InitialPool* initial) {
  KvPool& pool = initial->pool;
  const int width = pool.row_width;
  for (std::int64_t slot = 0; slot < pool.num_slots; ++slot) {
    if (holds_prefix[slot]) continue;
    Rng rng{spec.seed, kTagUnused, key_of(layer_id), static_cast<std::uint64_t>(slot)};
    std::uint64_t bits = 0;
    for (int c = 0; c < width; ++c) {
      if (c % 64 == 0) bits = rng.next();
      const bool negative = (bits >> (c % 64)) & 1;
      if (pool.grouped()) {  // the latent codes; scales and RoPE stay zero
        if (c < pool.latent_width) pool.row(slot)[c] = negative ? 0xFF : kE4m3NanCode;
      } else if (spec.kv_dtype == KvDtype::kBfloat16) {
        pool.set_bf16_bits(slot, c, negative ? 0xFFC0 : 0x7FC0);
      } else {
        pool.row(slot)[c] = negative ? 0xFF : kE4m3NanCode;
      }
      if (spec.with_source) {
        initial->source[slot * width + c] = negative ? -std::numeric_limits<float>::quiet_NaN()
                                                     : std::numeric_limits<float>::quiet_NaN();
      }
    }
  }
}

// Generates and writes every layer (kv_scale, initial pool, kv_source), in layer id order.
Result<std::vector<SynthLayer>> write_layers(DumpWriter& writer, const SynthSpec& spec,
                                             const SynthPlan& plan) {
  const int width = spec.kv_lora_rank + spec.rope_dim;
  const std::int64_t num_slots = plan.num_pages * spec.page_size;
  std::vector<bool> holds_prefix(static_cast<std::size_t>(num_slots), false);
  for (std::size_t b = 0; b < plan.prefix_lens.size(); ++b) {
    for (std::int64_t p = 0; p < plan.prefix_lens[b]; ++p) {
      holds_prefix[trace_slot(plan, spec.page_size, b, p)] = true;
    }
  }
  std::vector<SynthLayer> layers;
  for (const int layer_id : sorted_layer_ids(spec)) {
    SynthLayer layer{make_profile(spec, layer_id), {}};
    layer.meta.group = layer_group_name(layer_id);
    layer.meta.layer_id = layer_id;
    layer.meta.kv_scale = layer_kv_scale(spec, plan, layer.profile, layer_id);
    layer.meta.has_source = spec.with_source;
    InitialPool initial{KvPool::zeros_for(synth_attributes(spec), num_slots), {}};
    if (spec.with_source) {
      initial.source.assign(static_cast<std::size_t>(num_slots) * width, 0.0f);
    }
    write_prefix_tokens(spec, plan, layer, &initial);
    if (spec.nan_unused) fill_unused_with_nan(spec, holds_prefix, layer_id, &initial);
    KVAUDIT_TRY(
        writer.write_layer(layer.meta, initial.pool, spec.with_source ? &initial.source : nullptr));
    layers.push_back(std::move(layer));
  }
  return layers;
}

// q_nope, q_pe and new_kv of every row of one (step, layer).
StepLayerTensors step_layer_tensors(const SynthSpec& spec, const StepMeta& step,
                                    const SynthLayer& layer) {
  const auto rows = static_cast<std::size_t>(step.num_rows());
  const auto q_nope_floats = static_cast<std::size_t>(spec.num_heads) * spec.kv_lora_rank;
  const auto q_pe_floats = static_cast<std::size_t>(spec.num_heads) * spec.rope_dim;
  const auto row_floats = static_cast<std::size_t>(spec.kv_lora_rank + spec.rope_dim);
  StepLayerTensors tensors;
  tensors.q_nope.resize(rows * q_nope_floats);
  tensors.q_pe.resize(rows * q_pe_floats);
  tensors.new_kv.resize(rows * row_floats);
  // Each row's values land in its own part of the tensors.
  parallel_for(rows, spec.threads, [&] {
    return [&](std::size_t i) {
      const int b = step.request_of_row(static_cast<int>(i));
      const std::int64_t pos = step.position_of_row(static_cast<int>(i), spec.page_size);
      float unused_amax = 0.0f;
      generate_token(spec, layer.profile, layer.meta.layer_id, b, pos, layer.meta.kv_scale,
                     tensors.new_kv.data() + i * row_floats, &unused_amax);
      generate_query(spec, layer.profile, layer.meta.layer_id, b, pos,
                     tensors.q_nope.data() + i * q_nope_floats,
                     tensors.q_pe.data() + i * q_pe_floats);
    };
  });
  if (spec.topk > 0) {
    tensors.topk = spec.topk;
    tensors.topk_indices.resize(rows * static_cast<std::size_t>(spec.topk));
    for (std::size_t i = 0; i < rows; ++i) {
      const int b = step.request_of_row(static_cast<int>(i));
      const std::int64_t pos = step.position_of_row(static_cast<int>(i), spec.page_size);
      select_topk(spec, layer.meta.layer_id, b, pos,
                  tensors.topk_indices.data() + i * static_cast<std::size_t>(spec.topk));
    }
  }
  return tensors;
}

Status write_steps(DumpWriter& writer, const SynthSpec& spec, const SynthPlan& plan,
                   const std::vector<SynthLayer>& layers) {
  for (const StepMeta& step : plan.steps) {
    KVAUDIT_TRY(writer.write_step(step));
    for (const SynthLayer& layer : layers) {
      KVAUDIT_TRY(writer.write_step_layer(step, layer.meta, step_layer_tensors(spec, step, layer)));
    }
  }
  return ok_status();
}

}  // namespace

Result<std::vector<float>> write_synth_dump(const std::filesystem::path& path,
                                            const SynthSpec& spec) {
  KVAUDIT_TRY(check_synth_fits(spec, path));
  KVAUDIT_ASSIGN_OR_RETURN(const SynthPlan plan, plan_synth(spec));
  KVAUDIT_ASSIGN_OR_RETURN(DumpWriter writer,
                           DumpWriter::create(path, synth_attributes(spec), plan.num_pages));
  KVAUDIT_ASSIGN_OR_RETURN(const std::vector<SynthLayer> layers, write_layers(writer, spec, plan));
  KVAUDIT_TRY(write_steps(writer, spec, plan, layers));
  KVAUDIT_TRY(writer.close());
  std::vector<float> scales;
  for (const SynthLayer& layer : layers) scales.push_back(layer.meta.kv_scale);
  return scales;
}

}  // namespace kvaudit
