// The indexer cache checks of a kvdump v1.2 dump; the math and shapes are in indexer_check.hpp.
#include "src/replay/indexer_check.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <utility>

#include "src/core/fp8_e4m3.hpp"
#include "src/core/parallel_for.hpp"
#include "src/replay/integrity.hpp"

namespace kvaudit {

namespace {

constexpr float kAmaxFloor = 1e-4f;  // the deployed act_quant's floor on a block's amax
constexpr double kBinary64UnitRoundoff = 0x1p-53;
constexpr std::int64_t kTopkPadding = -1;  // the format's only padding entry of topk_indices

// In-place Walsh-Hadamard transform in Sylvester's order (H_2n = [[H, H], [H, -H]]).
void hadamard_in_place(std::vector<double>& v) {
  for (std::size_t half = 1; half < v.size(); half *= 2) {
    for (std::size_t start = 0; start < v.size(); start += 2 * half) {
      for (std::size_t j = start; j < start + half; ++j) {
        const double a = v[j];
        const double b = v[j + half];
        v[j] = a + b;
        v[j + half] = a - b;
      }
    }
  }
}

// 2^ceil(log2 s) for a positive normal float32 s, exactly: s = m 2^e with m in [0.5, 1). A
// non-finite s (from a non-finite block) stays as it is.
float power_of_two_above(float s) {
  if (!std::isfinite(s)) return s;
  int exponent = 0;
  const float mantissa = std::frexp(s, &exponent);
  return std::ldexp(1.0f, mantissa == 0.5f ? exponent - 1 : exponent);
}

// The amax propagates NaN as torch's amax and clamp do (std::max would drop it): a block holding
// NaN gets a NaN scale, one holding an infinity an infinite scale.
float block_scale(std::span<const float> block, IndexScaleFormat format) {
  float amax = 0.0f;
  for (const float v : block) amax = std::isnan(v) || std::fabs(v) > amax ? std::fabs(v) : amax;
  if (std::isnan(amax)) return amax;
  const float raw = std::max(amax, kAmaxFloor) * (1.0f / kE4m3MaxFinite);
  return format == IndexScaleFormat::kPowerOfTwo ? power_of_two_above(raw) : raw;
}

}  // namespace

std::vector<float> indexer_rotate(std::span<const float> x, IndexRotation rotation) {
  std::vector<float> y(x.size());
  if (rotation == IndexRotation::kNone) {
    for (std::size_t j = 0; j < x.size(); ++j) y[j] = bf16_round(x[j]);
    return y;
  }
  // Backstop: the reader refuses such a dump; the transform below would index past v otherwise.
  if (!std::has_single_bit(x.size())) {
    throw std::invalid_argument(fmt::format(
        "indexer_rotate: a Hadamard rotation needs a power-of-two width, not {}", x.size()));
  }
  std::vector<double> v(x.size());
  for (std::size_t j = 0; j < x.size(); ++j) v[j] = bf16_round(x[j]);
  hadamard_in_place(v);
  const float norm = static_cast<float>(std::pow(static_cast<double>(x.size()), -0.5));
  for (std::size_t j = 0; j < x.size(); ++j) y[j] = bf16_round(static_cast<float>(v[j]) * norm);
  return y;
}

IndexerRow indexer_quantize_row(std::span<const float> x, const IndexerMeta& meta) {
  const std::vector<float> y = indexer_rotate(x, meta.rotation);
  const std::size_t block = static_cast<std::size_t>(meta.block_size);
  IndexerRow row;
  row.codes.resize(y.size());
  for (std::size_t start = 0; start < y.size(); start += block) {
    const float scale =
        block_scale(std::span<const float>(y).subspan(start, block), meta.scale_format);
    row.scales.push_back(scale);
    for (std::size_t j = start; j < start + block; ++j) {
      row.codes[j] = e4m3_encode(y[j] / scale, E4m3Overflow::kSatFinite);
    }
  }
  return row;
}

bool is_valid_topk(std::span<const std::int64_t> picks, std::span<const double> scores,
                   std::span<const double> tolerances, int topk, std::string* why) {
  const std::size_t visible = scores.size();
  const std::size_t k = std::min<std::size_t>(static_cast<std::size_t>(topk), visible);
  std::vector<std::int64_t> chosen;
  for (const std::int64_t p : picks) {
    if (p == kTopkPadding) continue;
    if (p < 0) {
      *why = fmt::format("entry {} is neither a position nor the padding {}", p, kTopkPadding);
      return false;
    }
    if (static_cast<std::size_t>(p) >= visible) {
      *why = fmt::format("position {} is not visible (the row sees 0 .. {})", p, visible - 1);
      return false;
    }
    if (std::find(chosen.begin(), chosen.end(), p) != chosen.end()) {
      *why = fmt::format("position {} is picked twice", p);
      return false;
    }
    chosen.push_back(p);
  }
  if (chosen.size() != k) {
    *why = fmt::format("{} positions picked, expected min(index_topk, visible) = {}", chosen.size(),
                       k);
    return false;
  }
  if (k == 0) return true;
  std::vector<std::size_t> order(visible);
  for (std::size_t t = 0; t < visible; ++t) order[t] = t;
  // A NaN score (non-finite inputs) ranks above every number, as torch.topk ranks it; NaNs tie.
  auto ranks_above = [&](std::size_t a, std::size_t b) {
    const bool nan_a = std::isnan(scores[a]);
    const bool nan_b = std::isnan(scores[b]);
    return nan_a || nan_b ? nan_a && !nan_b : scores[a] > scores[b];
  };
  std::nth_element(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k - 1), order.end(),
                   ranks_above);
  const std::size_t kth = order[k - 1];
  const double v = scores[kth];
  auto tied = [&](std::size_t t) {
    if (std::isnan(scores[t]) || std::isnan(v)) return std::isnan(scores[t]) && std::isnan(v);
    return scores[t] == v || std::fabs(scores[t] - v) <= tolerances[t] + tolerances[kth];
  };
  auto above = [&](std::size_t t) { return ranks_above(t, kth) && !tied(t); };
  std::size_t tokens_above = 0;
  for (std::size_t t = 0; t < visible; ++t) tokens_above += above(t) ? 1 : 0;
  std::size_t hits_above = 0;
  std::size_t hits_tied = 0;
  for (const std::int64_t p : chosen) {
    const std::size_t t = static_cast<std::size_t>(p);
    if (above(t)) {
      ++hits_above;
    } else if (tied(t)) {
      ++hits_tied;
    } else {
      *why = fmt::format("position {} scores {:.9g}, below the {}-th largest deployed score {:.9g}",
                         p, scores[t], k, v);
      return false;
    }
  }
  if (hits_above + std::min(hits_tied, k - tokens_above) == k) return true;
  *why = fmt::format(
      "{} positions tied with the {}-th largest deployed score {:.9g} picked where "
      "{} places are left to ties",
      hits_tied, k, v, k - tokens_above);
  return false;
}

namespace {

// The replayed indexer cache of one layer: codes [S, Di], scales [S, G].
struct IndexerState {
  std::vector<std::uint8_t> codes;
  std::vector<float> scales;
};

std::uint32_t bits_of(float x) {
  std::uint32_t u = 0;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

// Whether slot s of a and b hold the same bytes (codes, and the scales' float32 bits).
bool same_slot(const IndexerState& a, const std::vector<std::uint8_t>& codes,
               const std::vector<float>& scales, std::int64_t s, const IndexerMeta& meta) {
  const std::size_t d = static_cast<std::size_t>(meta.head_dim);
  const std::size_t g = static_cast<std::size_t>(meta.num_blocks());
  const std::size_t slot = static_cast<std::size_t>(s);
  if (!std::equal(a.codes.begin() + slot * d, a.codes.begin() + (slot + 1) * d,
                  codes.begin() + slot * d)) {
    return false;
  }
  for (std::size_t j = 0; j < g; ++j) {
    if (bits_of(a.scales[slot * g + j]) != bits_of(scales[slot * g + j])) return false;
  }
  return true;
}

// "k_cache_after[page, offset, j] 0x3c, expected 0x3d" for the first byte of slot s that differs
// (codes first, then scales).
std::string first_difference(const IndexerState& expected, const std::vector<std::uint8_t>& codes,
                             const std::vector<float>& scales, std::int64_t s,
                             const IndexerMeta& meta, int page_size, const char* what) {
  const std::size_t d = static_cast<std::size_t>(meta.head_dim);
  const std::size_t g = static_cast<std::size_t>(meta.num_blocks());
  const std::size_t slot = static_cast<std::size_t>(s);
  const std::int64_t page = s / page_size;
  const std::int64_t offset = s % page_size;
  for (std::size_t j = 0; j < d; ++j) {
    const std::uint8_t want = expected.codes[slot * d + j];
    const std::uint8_t got = codes[slot * d + j];
    if (want != got) {
      return fmt::format("k_cache_after[{}, {}, {}] 0x{:02x}, {} 0x{:02x}", page, offset, j, got,
                         what, want);
    }
  }
  for (std::size_t j = 0; j < g; ++j) {
    const float want = expected.scales[slot * g + j];
    const float got = scales[slot * g + j];
    if (bits_of(want) != bits_of(got)) {
      return fmt::format("k_scales_after[{}, {}, {}] {:.9g}, {} {:.9g}", page, offset, j, got, what,
                         want);
    }
  }
  return "";
}

std::string slot_list_text(const std::vector<std::int64_t>& slots) {
  constexpr std::size_t kNamed = 8;
  const std::size_t named = std::min(slots.size(), kNamed);
  std::string text = fmt::format(
      "{}", fmt::join(slots.begin(), slots.begin() + static_cast<std::ptrdiff_t>(named), ", "));
  return slots.size() > named ? text + ", ..." : text;
}

IntegrityFinding finding_at(const StepMeta& step, int step_index, const LayerMeta& layer,
                            IntegrityCheck check) {
  IntegrityFinding finding;
  finding.step = step_index;
  finding.layer_id = layer.layer_id;
  finding.where = step.group + " " + layer.group;
  finding.check = check;
  return finding;
}

void fail_slots(IntegrityFinding& finding, const std::vector<std::int64_t>& slots,
                const std::string& what, const std::string& first) {
  finding.pass = false;
  finding.slots.assign(slots.begin(),
                       slots.begin() + static_cast<std::ptrdiff_t>(
                                           std::min<std::size_t>(slots.size(), kMaxListedSlots)));
  finding.slot_count = static_cast<std::int64_t>(slots.size());
  finding.detail = fmt::format("{}: indexer cache: {} {}: slot {} ({})", finding.where,
                               slots.size(), what, slot_list_text(slots), first);
}

// One step of one layer: its reading, the expected cache after its writes, the captured cache.
struct StepContext {
  const DumpLayout& layout;
  const LayerMeta& layer;
  const IndexerMeta& meta;
  const StepMeta& step;
  int step_index = 0;
  const StepIndexerTensors& tensors;
};

bool all_finite(std::span<const float> values) {
  return std::all_of(values.begin(), values.end(), [](float v) { return std::isfinite(v); });
}

// The slots whose new_k row holds a non-finite value: their bytes are not judged (the deployed
// kernel's NaN handling is not the format's), indexer_nonfinite reports them instead.
std::vector<std::int64_t> slots_of_nonfinite_rows(const StepContext& c) {
  std::vector<std::int64_t> slots;
  if (c.step.attention_only) return slots;
  const std::size_t d = static_cast<std::size_t>(c.meta.head_dim);
  for (std::size_t i = 0; i < c.step.new_kv_slots.size(); ++i) {
    if (!all_finite(std::span<const float>(c.tensors.new_k).subspan(i * d, d))) {
      slots.push_back(c.step.new_kv_slots[i]);
    }
  }
  std::sort(slots.begin(), slots.end());
  return slots;
}

// Applies the step's writes to `state` (the rule's bytes of each new_k row at its slot).
std::vector<std::int64_t> apply_writes(const StepContext& c, IndexerState& state) {
  std::vector<std::int64_t> written;
  if (c.step.attention_only) return written;
  const std::size_t d = static_cast<std::size_t>(c.meta.head_dim);
  const std::size_t g = static_cast<std::size_t>(c.meta.num_blocks());
  for (std::size_t i = 0; i < c.step.new_kv_slots.size(); ++i) {
    const std::size_t slot = static_cast<std::size_t>(c.step.new_kv_slots[i]);
    const IndexerRow row =
        indexer_quantize_row(std::span<const float>(c.tensors.new_k).subspan(i * d, d), c.meta);
    std::copy(row.codes.begin(), row.codes.end(), state.codes.begin() + slot * d);
    std::copy(row.scales.begin(), row.scales.end(), state.scales.begin() + slot * g);
    written.push_back(static_cast<std::int64_t>(slot));
  }
  return written;
}

// indexer_written_slots and indexer_unwritten_slots against the captured cache after the step.
std::vector<IntegrityFinding> check_captured_cache(const StepContext& c, const IndexerState& before,
                                                   const IndexerState& expected,
                                                   std::vector<std::int64_t> written) {
  const std::vector<std::uint8_t>& codes = *c.tensors.codes_after;
  const std::vector<float>& scales = *c.tensors.scales_after;
  std::sort(written.begin(), written.end());
  const std::vector<std::int64_t> unjudged = slots_of_nonfinite_rows(c);
  std::vector<std::int64_t> bad_writes;
  std::vector<std::int64_t> moved;
  const std::int64_t num_slots = c.layout.num_slots();
  for (std::int64_t s = 0; s < num_slots; ++s) {
    const bool was_written = std::binary_search(written.begin(), written.end(), s);
    const bool judged = !std::binary_search(unjudged.begin(), unjudged.end(), s);
    if (was_written && judged && !same_slot(expected, codes, scales, s, c.meta)) {
      bad_writes.push_back(s);
    }
    if (!was_written && !same_slot(before, codes, scales, s, c.meta)) moved.push_back(s);
  }
  const int page_size = c.layout.attrs.page_size;
  IntegrityFinding writes =
      finding_at(c.step, c.step_index, c.layer, IntegrityCheck::kIndexerWrittenSlots);
  if (bad_writes.empty()) {
    writes.detail =
        fmt::format("{}: indexer cache: {} written slots hold the deployed rule's bytes{}",
                    writes.where, written.size() - unjudged.size(),
                    unjudged.empty() ? std::string()
                                     : fmt::format(" ({} written from a non-finite new_k row not "
                                                   "judged: indexer_nonfinite)",
                                                   unjudged.size()));
  } else {
    fail_slots(writes, bad_writes,
               fmt::format("written slot(s) not holding the deployed rule's bytes ({}, e4m3, {} "
                           "scale per {}) of their new_k row",
                           index_rotation_name(c.meta.rotation),
                           index_scale_format_name(c.meta.scale_format), c.meta.block_size),
               first_difference(expected, codes, scales, bad_writes.front(), c.meta, page_size,
                                "expected"));
  }
  IntegrityFinding others =
      finding_at(c.step, c.step_index, c.layer, IntegrityCheck::kIndexerUnwrittenSlots);
  if (moved.empty()) {
    others.detail =
        fmt::format("{}: indexer cache: every slot the step did not write unchanged", others.where);
  } else {
    fail_slots(others, moved, "slot(s) the step did not write changed",
               first_difference(before, codes, scales, moved.front(), c.meta, page_size, "was"));
  }
  return {std::move(writes), std::move(others)};
}

// The deployed scores [visible] of query row i over slots, and their tie tolerances.
struct RowScores {
  std::vector<double> scores;
  std::vector<double> tolerances;
};

RowScores deployed_row_scores(const StepContext& c, const IndexerState& state,
                              const std::vector<double>& query, std::size_t row,
                              const std::vector<std::int64_t>& slots) {
  const std::size_t d = static_cast<std::size_t>(c.meta.head_dim);
  const std::size_t g = static_cast<std::size_t>(c.meta.num_blocks());
  const std::size_t block = static_cast<std::size_t>(c.meta.block_size);
  const std::size_t heads = static_cast<std::size_t>(c.meta.n_heads);
  const double sm = c.meta.softmax_scale;
  const double bound = 2.0 * (static_cast<double>(heads) + 2.0) * kBinary64UnitRoundoff;
  RowScores out;
  std::vector<double> key(d);
  for (const std::int64_t s : slots) {
    const std::size_t slot = static_cast<std::size_t>(s);
    for (std::size_t j = 0; j < d; ++j) {
      key[j] = static_cast<double>(e4m3_decode(state.codes[slot * d + j])) *
               static_cast<double>(state.scales[slot * g + j / block]);
    }
    double score = 0.0;
    double magnitude = 0.0;
    for (std::size_t h = 0; h < heads; ++h) {
      const double* q = query.data() + (row * heads + h) * d;
      double dot = 0.0;
      for (std::size_t j = 0; j < d; ++j) dot += q[j] * key[j];
      const double term =
          static_cast<double>(c.tensors.weights[row * heads + h]) * std::max(sm * dot, 0.0);
      score += term;
      magnitude += std::fabs(term);
    }
    out.scores.push_back(score);
    out.tolerances.push_back(bound * magnitude);
  }
  return out;
}

// The dequantized FP8 query [Nq, Hi, Di] of the step, by the same rule as the keys.
std::vector<double> deployed_query(const StepContext& c) {
  const std::size_t d = static_cast<std::size_t>(c.meta.head_dim);
  const std::size_t block = static_cast<std::size_t>(c.meta.block_size);
  const std::size_t vectors = c.tensors.q.size() / d;
  std::vector<double> query(c.tensors.q.size());
  for (std::size_t v = 0; v < vectors; ++v) {
    const IndexerRow row =
        indexer_quantize_row(std::span<const float>(c.tensors.q).subspan(v * d, d), c.meta);
    for (std::size_t j = 0; j < d; ++j) {
      query[v * d + j] = static_cast<double>(e4m3_decode(row.codes[j])) *
                         static_cast<double>(row.scales[j / block]);
    }
  }
  return query;
}

// indexer_topk: every row's stored top-k against the deployed scores of the cache `state`.
IntegrityFinding check_stored_topk(const StepContext& c, const IndexerState& state, int threads) {
  const int page_size = c.layout.attrs.page_size;
  const std::size_t k = static_cast<std::size_t>(c.meta.topk);
  const std::vector<double> query = deployed_query(c);
  const std::size_t rows = static_cast<std::size_t>(c.step.num_rows());
  std::vector<std::string> why(rows);
  std::vector<char> valid(rows, 1);
  parallel_for(rows, threads, [&] {
    return [&](std::size_t i) {
      const int request = c.step.request_of_row(static_cast<int>(i));
      const std::int64_t position = c.step.position_of_row(static_cast<int>(i), page_size);
      std::vector<std::int64_t> slots;
      for (std::int64_t p = 0; p <= position; ++p) {
        slots.push_back(c.step.slot_of(request, p, page_size));
      }
      const RowScores scored = deployed_row_scores(c, state, query, i, slots);
      const std::span<const std::int64_t> picks(c.tensors.topk_indices.data() + i * k, k);
      valid[i] = is_valid_topk(picks, scored.scores, scored.tolerances, c.meta.topk, &why[i]);
    };
  });
  IntegrityFinding finding =
      finding_at(c.step, c.step_index, c.layer, IntegrityCheck::kIndexerTopk);
  std::vector<std::int64_t> bad_rows;
  for (std::size_t i = 0; i < rows; ++i) {
    if (!valid[i]) bad_rows.push_back(static_cast<std::int64_t>(i));
  }
  if (bad_rows.empty()) {
    finding.detail = fmt::format(
        "{}: indexer top-k: each of the {} rows' stored topk_indices is a top-k of the deployed "
        "scores",
        finding.where, rows);
    return finding;
  }
  const std::int64_t first = bad_rows.front();
  finding.pass = false;
  finding.detail = fmt::format(
      "{}: indexer top-k: {} row(s) whose stored topk_indices is not a top-k of the deployed "
      "scores recomputed from the FP8 cache and query: rows {}; row {} (position {}): {}",
      finding.where, bad_rows.size(), slot_list_text(bad_rows), first,
      c.step.position_of_row(static_cast<int>(first), page_size), why[first]);
  return finding;
}

// The first non-finite element of a float tensor and how many there are.
struct NonFinite {
  std::size_t count = 0;
  std::size_t first = 0;
  float value = 0.0f;
};

NonFinite find_nonfinite(std::span<const float> values) {
  NonFinite found;
  for (std::size_t j = 0; j < values.size(); ++j) {
    if (std::isfinite(values[j])) continue;
    if (found.count++ == 0) {
      found.first = j;
      found.value = values[j];
    }
  }
  return found;
}

// "new_k[1, 5] nan (3 non-finite)" for the flat index of a tensor of rows of `width`.
std::string nonfinite_text(const char* name, const NonFinite& found, std::size_t width) {
  return fmt::format("{}[{}, {}] {} ({} non-finite)", name, found.first / width,
                     found.first % width, found.value, found.count);
}

// The step's inputs: q [Nq, Hi * Di], weights [Nq, Hi], new_k [Nq, Di].
std::vector<std::string> nonfinite_inputs(const StepContext& c) {
  const std::size_t d = static_cast<std::size_t>(c.meta.head_dim);
  const std::size_t heads = static_cast<std::size_t>(c.meta.n_heads);
  const struct {
    const char* name;
    const std::vector<float>& values;
    std::size_t width;
  } inputs[] = {{"q", c.tensors.q, heads * d},
                {"weights", c.tensors.weights, heads},
                {"new_k", c.tensors.new_k, d}};
  std::vector<std::string> found;
  for (const auto& input : inputs) {
    const NonFinite f = find_nonfinite(input.values);
    if (f.count > 0) found.push_back(nonfinite_text(input.name, f, input.width));
  }
  return found;
}

// The slots the step's rows read (every position of each row's request up to its own), sorted.
std::vector<std::int64_t> slots_read(const StepContext& c) {
  const int page_size = c.layout.attrs.page_size;
  std::set<std::int64_t> slots;
  for (int i = 0; i < c.step.num_rows(); ++i) {
    const int request = c.step.request_of_row(i);
    const std::int64_t position = c.step.position_of_row(i, page_size);
    for (std::int64_t p = 0; p <= position; ++p) {
      slots.insert(c.step.slot_of(request, p, page_size));
    }
  }
  return {slots.begin(), slots.end()};
}

// NaN codes (0x7F, 0xFF) and non-finite scales in the slots the rows read of the cache `state`.
std::vector<std::int64_t> nonfinite_slots(const StepContext& c, const IndexerState& state,
                                          std::string* first) {
  const std::size_t d = static_cast<std::size_t>(c.meta.head_dim);
  const std::size_t g = static_cast<std::size_t>(c.meta.num_blocks());
  const int page_size = c.layout.attrs.page_size;
  std::vector<std::int64_t> bad;
  for (const std::int64_t s : slots_read(c)) {
    const std::size_t slot = static_cast<std::size_t>(s);
    std::string what;
    for (std::size_t j = 0; j < g && what.empty(); ++j) {
      const float scale = state.scales[slot * g + j];
      if (!std::isfinite(scale)) what = fmt::format("scale {} of block {}", scale, j);
    }
    for (std::size_t j = 0; j < d && what.empty(); ++j) {
      const std::uint8_t code = state.codes[slot * d + j];
      if (e4m3_is_nan(code)) what = fmt::format("NaN code 0x{:02x} at element {}", code, j);
    }
    if (what.empty()) continue;
    if (bad.empty()) {
      *first =
          fmt::format("slot {} (page {}, offset {}): {}", s, s / page_size, s % page_size, what);
    }
    bad.push_back(s);
  }
  return bad;
}

// indexer_nonfinite, only where the step has one: a non-finite value in the step's q, weights
// or new_k, or a NaN code or non-finite scale in a slot its rows read.
std::optional<IntegrityFinding> check_nonfinite(const StepContext& c, const IndexerState& state) {
  const std::vector<std::string> inputs = nonfinite_inputs(c);
  std::string first_slot;
  const std::vector<std::int64_t> slots = nonfinite_slots(c, state, &first_slot);
  if (inputs.empty() && slots.empty()) return std::nullopt;
  IntegrityFinding finding =
      finding_at(c.step, c.step_index, c.layer, IntegrityCheck::kIndexerNonFinite);
  std::vector<std::string> parts;
  if (!inputs.empty()) parts.push_back(fmt::format("inputs {}", fmt::join(inputs, ", ")));
  if (!slots.empty()) {
    parts.push_back(
        fmt::format("{} slot(s) the rows read hold NaN codes or non-finite scales: "
                    "slot {}; {}",
                    slots.size(), slot_list_text(slots), first_slot));
  }
  finding.pass = false;
  finding.slots.assign(slots.begin(),
                       slots.begin() + static_cast<std::ptrdiff_t>(
                                           std::min<std::size_t>(slots.size(), kMaxListedSlots)));
  finding.slot_count = static_cast<std::int64_t>(slots.size());
  finding.detail = fmt::format(
      "{}: indexer: non-finite values the deployed scores are computed "
      "from: {}",
      finding.where, fmt::join(parts, "; "));
  return finding;
}

bool reported(const std::set<int>& steps, int step) { return steps.empty() || steps.count(step); }

}  // namespace

Result<std::vector<IntegrityFinding>> check_indexer_layer(const DumpReader& reader,
                                                          std::size_t layer_index,
                                                          const std::set<int>& reported_steps,
                                                          int threads) {
  const DumpLayout& layout = reader.layout();
  const LayerMeta& layer = layout.layers.at(layer_index);
  std::vector<IntegrityFinding> findings;
  if (!layer.indexer) return findings;
  if (layer.indexer->rotation == IndexRotation::kHadamard &&
      !std::has_single_bit(static_cast<unsigned>(layer.indexer->head_dim))) {
    return bad_input("/layers/" + layer.group + "/indexer",
                     fmt::format("index_rotation \"hadamard\" needs index_head_dim a power of "
                                 "two; it is {}",
                                 layer.indexer->head_dim));
  }
  KVAUDIT_ASSIGN_OR_RETURN(IndexerCache cache, reader.read_indexer_cache(layer_index));
  IndexerState state{std::move(cache.codes), std::move(cache.scales)};
  for (std::size_t s = 0; s < layout.steps.size(); ++s) {
    KVAUDIT_ASSIGN_OR_RETURN(const StepIndexerTensors tensors,
                             reader.read_step_indexer(s, layer_index));
    const StepContext c{layout, layer, *layer.indexer, layout.steps[s], static_cast<int>(s),
                        tensors};
    const IndexerState before = tensors.codes_after ? state : IndexerState{};
    const std::vector<std::int64_t> written = apply_writes(c, state);
    const bool report = reported(reported_steps, static_cast<int>(s));
    if (tensors.codes_after) {
      if (report) {
        for (IntegrityFinding& f : check_captured_cache(c, before, state, written)) {
          findings.push_back(std::move(f));
        }
      }
      // Later steps read the captured cache, as the server's indexer did.
      state = IndexerState{*tensors.codes_after, *tensors.scales_after};
    }
    if (report) {
      if (std::optional<IntegrityFinding> f = check_nonfinite(c, state)) {
        findings.push_back(std::move(*f));
      }
      findings.push_back(check_stored_topk(c, state, threads));
    }
  }
  return findings;
}

}  // namespace kvaudit
