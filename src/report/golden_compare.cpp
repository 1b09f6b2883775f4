// Golden comparison (see golden_compare.hpp). Shapes: out [Nq, H, Dc] bf16 bits, lse [Nq, H] fp32,
// pool rows [S or Nw, row_bytes].
//
// Tolerance mode: what two clean runs of one algorithm may differ by.
//
// The backends here (docs/kernels.md) compute per (row, head): scores s_t in fp32 (576-term dot
// products), an online softmax in base 2 over 64-token tiles with a running maximum m,
// p_t = exp2(s_t - m) in fp32, l = sum_t p_t in fp32, P rounded to bf16 before P.V,
// acc = sum_t bf16(p_t) v_t in fp32, out = bf16(acc * kv_scale / l), lse = (m + log2 l) ln 2 in
// fp32. Two runs that differ in summation order (another tensor-core accumulation order) or in how
// the tokens are split over blocks (split-KV: the split count follows the device's SM count)
// differ by:
//
// lse. l sums the unrounded fp32 p_t, so only fp32 rounding moves it: reordering n positive terms
//   moves a sum by <= 2 gamma_n (gamma_n ~ n 2^-24) of itself in the worst case, ~2 sqrt(n) 2^-24
//   typically, and ln l by the same amount in absolute terms (d ln l = dl / l). The 576-term score
//   moves by ~sqrt(576) 2^-24 sum|q k| typically (~1e-6 |s| for the shipped dumps' scores), and lse
//   with it. cpu-fp8's and cuda-fp8's measured lse error against the exact reference is <= 1e-5
//   (README "The policy"), so two runs lie within 2e-5 of each other: kToleranceLseAbs = 2^-14 =
//   6.1e-5 keeps a factor of 3. It covers the typical reorder of up to 2^16 tokens (2 * 2^8 *
//   2^-24 = 2^-15); the worst case for that many (2^-7) is not covered, and no real order nears it.
//
// out. In units of the element a = out[row, head, dim]:
//   1. fp32 reordering of acc moves it by ~2 sqrt(n) 2^-24 of sum_t p_t |v_t| / l, 2^-15 of the
//      terms' magnitude for n = 2^16. Where they do not cancel (|a| ~ that magnitude) that is 1/128
//      of a bf16 ulp (2^-8): it changes the final bf16 rounding only where acc lies that close to a
//      rounding boundary, by 1 ulp.
//   2. P's bf16 rounding: p_t is rounded relative to the running max current when its tile is
//      processed; another split or order changes that max for some tiles, and p_t's rounding error
//      (<= 2^-9 relative) is drawn anew. a moves by <= 2^-8 sum_t p_t |v_t| / l (all errors
//      aligned), ~2^-9 sqrt(sum_t p_t^2 v_t^2) / l typically. With a dominant token a ~ its v and
//      the move is <= 2^-8 |a|, 1 ulp; with the final rounding, kToleranceOutUlps = 2.
//   3. Cancellation: where a is small against its terms (|a| << sum p|v| / l), effects 1 and 2 are
//      absolute, not relative to a, and a's ULP count is unbounded. They are bounded instead by the
//      (row, head)'s scale S = max_d max(|golden|, |current|), which stands in for
//      sum_t p_t |v_t| / l (the golden file does not hold v): over a broad softmax the typical
//      effect 2 is 2^-9 |v| / sqrt(n_eff) ~ 2^-9 S (out averages n_eff values of random sign),
//      inside kToleranceOutRowScale = 2^-8 with a factor of 2.
// Not covered: aligned P rounding errors over a broad softmax (the worst case of 2, up to
// sqrt(n_eff) times the typical one); a backend whose arithmetic differs beyond order (P or out
// rounded otherwise, fp16 instead of bf16), which `kvaudit check` judges against the reference. A
// real change smaller than bf16 P-rounding noise is invisible in tolerance mode by construction:
// exact mode on one device is the regression test; tolerance mode says whether another device or
// library still computes the same thing.
//
// Exact mode for cpu-fp8: every sum runs sequentially in index order and threads split the work by
// (row, head) units, never inside a reduction, so its output does not depend on the thread count or
// the machine; exp2f and log2f come from the C library, whose version the provenance records.
#include "src/report/golden_compare.hpp"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <ostream>
#include <set>
#include <utility>

#include "src/core/fp8_e4m3.hpp"

namespace kvaudit {
namespace {

// Ordered integer of a float's bits: adjacent floats are 1 apart, +0 and -0 are 0 apart.
std::int64_t float_ordered(float x) {
  const std::uint32_t bits = float_bits(x);
  const auto magnitude = static_cast<std::int64_t>(bits & 0x7FFFFFFFu);
  return (bits & 0x80000000u) != 0 ? -magnitude : magnitude;
}

double fp32_ulp_distance(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b) ? 0.0 : INFINITY;
  return static_cast<double>(std::llabs(float_ordered(a) - float_ordered(b)));
}

double bf16_bits_ulp_distance(std::uint16_t a, std::uint16_t b) {
  const float fa = bf16_to_float(a);
  const float fb = bf16_to_float(b);
  if (std::isnan(fa) || std::isnan(fb)) return std::isnan(fa) && std::isnan(fb) ? 0.0 : INFINITY;
  return bf16_ulp_distance(fa, fb);
}

// Ordered distance between two e4m3 codes (sign-magnitude: adjacent values are 1 apart); a NaN
// code (0x7F, 0xFF) is infinitely far from anything else.
double e4m3_ulp_distance(std::uint8_t a, std::uint8_t b) {
  const auto ordered = [](std::uint8_t code) {
    const int magnitude = code & 0x7F;
    return (code & 0x80) != 0 ? -magnitude : magnitude;
  };
  if ((a & 0x7F) == kE4m3NanCode || (b & 0x7F) == kE4m3NanCode) return INFINITY;
  return std::abs(ordered(a) - ordered(b));
}

// Whether an out element moved, given its (row, head)'s scale (tolerance mode).
bool out_moved(std::uint16_t golden, std::uint16_t current, GoldenMode mode, double row_scale) {
  if (golden == current) return false;
  if (mode == GoldenMode::kExact) return true;
  const double a = bf16_to_float(golden);
  const double b = bf16_to_float(current);
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) != std::isnan(b);
  if (std::isinf(a) || std::isinf(b)) return true;  // different bits: another infinity or finite
  const double diff = std::fabs(a - b);
  return bf16_ulp_distance(a, b) > kToleranceOutUlps && diff > kToleranceOutRowScale * row_scale;
}

bool lse_moved(float golden, float current, GoldenMode mode) {
  if (float_bits(golden) == float_bits(current)) return false;
  if (mode == GoldenMode::kExact) return true;
  if (std::isnan(golden) || std::isnan(current)) return std::isnan(golden) != std::isnan(current);
  if (std::isinf(golden) || std::isinf(current)) return true;
  return std::fabs(static_cast<double>(golden) - current) > kToleranceLseAbs;
}

// max_d max(|golden|, |current|) of one (row, head), NaN and Inf left out.
double row_scale(const std::uint16_t* golden, const std::uint16_t* current, int dims) {
  double scale = 0.0;
  for (int d = 0; d < dims; ++d) {
    for (const double v : {static_cast<double>(bf16_to_float(golden[d])),
                           static_cast<double>(bf16_to_float(current[d]))}) {
      if (std::isfinite(v)) scale = std::max(scale, std::fabs(v));
    }
  }
  return scale;
}

double finite_abs_diff(double a, double b) {
  const double diff = std::fabs(a - b);
  return std::isfinite(diff) ? diff : 0.0;
}

void compare_out(const GoldenEntry& golden, const GoldenEntry& current, GoldenMode mode,
                 EntryDiff& diff) {
  const TensorShape3& shape = golden.shape;
  for (int r = 0; r < shape.rows; ++r) {
    for (int h = 0; h < shape.heads; ++h) {
      const std::size_t base = (static_cast<std::size_t>(r) * shape.heads + h) * shape.dims;
      const double scale =
          mode == GoldenMode::kTolerance
              ? row_scale(golden.out.data() + base, current.out.data() + base, shape.dims)
              : 0.0;
      for (int d = 0; d < shape.dims; ++d) {
        const std::uint16_t g = golden.out[base + d];
        const std::uint16_t c = current.out[base + d];
        if (!out_moved(g, c, mode, scale)) continue;
        ElementMove move{MovedPart::kOut,
                         golden.step,
                         golden.layer_id,
                         r,
                         h,
                         d,
                         -1,
                         g,
                         c,
                         bf16_to_float(g),
                         bf16_to_float(c),
                         bf16_bits_ulp_distance(g, c)};
        ++diff.out_moved;
        diff.out_max_ulps = std::max(diff.out_max_ulps, move.ulps);
        diff.out_max_abs =
            std::max(diff.out_max_abs, finite_abs_diff(move.golden_value, move.current_value));
        if (!diff.first_out) diff.first_out = move;
      }
    }
  }
}

void compare_lse(const GoldenEntry& golden, const GoldenEntry& current, GoldenMode mode,
                 EntryDiff& diff) {
  const int heads = golden.shape.heads;
  for (std::size_t i = 0; i < golden.lse.size(); ++i) {
    const float g = golden.lse[i];
    const float c = current.lse[i];
    if (!lse_moved(g, c, mode)) continue;
    const int row = static_cast<int>(i / heads);
    const int head = static_cast<int>(i % heads);
    ElementMove move{MovedPart::kLse,
                     golden.step,
                     golden.layer_id,
                     row,
                     head,
                     -1,
                     -1,
                     float_bits(g),
                     float_bits(c),
                     g,
                     c,
                     fp32_ulp_distance(g, c)};
    ++diff.lse_moved;
    diff.lse_max_abs = std::max(diff.lse_max_abs, finite_abs_diff(g, c));
    if (!diff.first_lse) diff.first_lse = move;
  }
}

// The element value of pool storage bytes (e4m3 code or little-endian bf16 bits), before kv_scale.
std::pair<std::uint32_t, double> pool_element(const GoldenPool& pool, const std::uint8_t* row,
                                              int col) {
  if (pool.dtype == KvDtype::kBfloat16) {
    const auto bits = static_cast<std::uint16_t>(row[2 * col] | (row[2 * col + 1] << 8));
    return {bits, bf16_to_float(bits)};
  }
  return {row[col], e4m3_decode(row[col])};
}

// Compares the rows of one slot; returns whether it moved and records the first element.
bool compare_slot(const GoldenEntry& golden, const std::uint8_t* golden_row,
                  const std::uint8_t* current_row, std::int64_t slot, EntryDiff& diff) {
  const GoldenPool& pool = golden.pool;
  if (std::memcmp(golden_row, current_row, pool.row_bytes()) == 0) return false;
  if (diff.first_pool) return true;
  for (int col = 0; col < pool.row_width; ++col) {
    const auto [g_bits, g_value] = pool_element(pool, golden_row, col);
    const auto [c_bits, c_value] = pool_element(pool, current_row, col);
    if (g_bits == c_bits) continue;
    const double ulps = pool.dtype == KvDtype::kBfloat16
                            ? bf16_bits_ulp_distance(static_cast<std::uint16_t>(g_bits),
                                                     static_cast<std::uint16_t>(c_bits))
                            : e4m3_ulp_distance(static_cast<std::uint8_t>(g_bits),
                                                static_cast<std::uint8_t>(c_bits));
    diff.first_pool =
        ElementMove{MovedPart::kPool, golden.step, golden.layer_id, -1,      -1,  col, slot,
                    g_bits,           c_bits,      g_value,         c_value, ulps};
    break;
  }
  return true;
}

// Slots whose bytes differ: every slot (whole storage) or the written ones (digest), and the
// digest. `earlier` holds the slots of this layer that moved at earlier steps (carried damage).
void compare_pool(const GoldenEntry& golden, const GoldenEntry& current,
                  std::set<std::int64_t>& earlier, EntryDiff& diff) {
  const GoldenPool& g = golden.pool;
  const GoldenPool& c = current.pool;
  diff.written_slots_differ = g.written_slots != c.written_slots;
  diff.digest_moved = g.sha256 != c.sha256;
  const std::size_t row_bytes = g.row_bytes();
  auto note_slot = [&](std::int64_t slot, const std::uint8_t* g_row, const std::uint8_t* c_row) {
    if (!compare_slot(golden, g_row, c_row, slot, diff)) return;
    ++diff.slots_moved;
    if (!earlier.insert(slot).second) ++diff.slots_carried;
    if (diff.slots.size() < EntryDiff::kListedSlots) diff.slots.push_back(slot);
  };
  if (g.storage == PoolStorage::kWhole) {
    for (std::int64_t slot = 0; slot < g.num_slots; ++slot) {
      note_slot(slot, g.rows.data() + slot * row_bytes, c.rows.data() + slot * row_bytes);
    }
    return;
  }
  if (!diff.written_slots_differ) {  // else rows of other slots: nothing to pair them with
    for (std::size_t i = 0; i < g.written_slots.size(); ++i) {
      note_slot(g.written_slots[i], g.rows.data() + i * row_bytes, c.rows.data() + i * row_bytes);
    }
  }
  // With other written slots the unwritten ones are another set: their digests cannot be paired.
  if (diff.written_slots_differ) return;
  const bool both_known = !g.unwritten_sha256.empty() && !c.unwritten_sha256.empty();
  diff.unwritten_moved = both_known ? g.unwritten_sha256 != c.unwritten_sha256
                                    : diff.digest_moved && diff.slots_moved == 0;
}

// Why two entries cannot be compared element by element, or empty.
std::string structure_difference(const GoldenEntry& golden, const GoldenEntry& current) {
  const TensorShape3& a = golden.shape;
  const TensorShape3& b = current.shape;
  if (a.rows != b.rows || a.heads != b.heads || a.dims != b.dims) {
    return fmt::format("out shape [{}, {}, {}] in the golden file, [{}, {}, {}] now", a.rows,
                       a.heads, a.dims, b.rows, b.heads, b.dims);
  }
  const GoldenPool& p = golden.pool;
  const GoldenPool& q = current.pool;
  if (p.storage != q.storage || p.dtype != q.dtype || p.num_slots != q.num_slots ||
      p.row_width != q.row_width) {
    return fmt::format("pool {} {} [{}, {}] in the golden file, {} {} [{}, {}] now",
                       pool_storage_name(p.storage), kv_dtype_name(p.dtype), p.num_slots,
                       p.row_width, pool_storage_name(q.storage), kv_dtype_name(q.dtype),
                       q.num_slots, q.row_width);
  }
  return "";
}

EntryDiff compare_entry(const GoldenEntry& golden, const GoldenEntry& current, GoldenMode mode,
                        std::set<std::int64_t>& earlier_slots) {
  EntryDiff diff;
  diff.step = golden.step;
  diff.layer_id = golden.layer_id;
  diff.structure = structure_difference(golden, current);
  if (!diff.structure.empty()) return diff;
  compare_pool(golden, current, earlier_slots, diff);
  compare_out(golden, current, mode, diff);
  compare_lse(golden, current, mode, diff);
  return diff;
}

// Golden entries in comparison order: step, then layer in the golden's (dump) order.
std::vector<const GoldenEntry*> ordered_entries(const Golden& golden) {
  std::vector<const GoldenEntry*> entries;
  for (const GoldenEntry& entry : golden.entries) entries.push_back(&entry);
  const auto layer_rank = [&](int layer_id) {
    const auto it = std::find(golden.layer_ids.begin(), golden.layer_ids.end(), layer_id);
    return it - golden.layer_ids.begin();
  };
  std::stable_sort(entries.begin(), entries.end(), [&](const auto* a, const auto* b) {
    if (a->step != b->step) return a->step < b->step;
    return layer_rank(a->layer_id) < layer_rank(b->layer_id);
  });
  return entries;
}

std::string value_text(double value) { return fmt::format("{:.9g}", value); }

// "device: 'NVIDIA H100' -> 'NVIDIA H200'" per key that differs; within an object both sides hold
// ("kernel_variant"), per key of it: "backend kernel_variant.mma: "wgmma" -> "mma-sync"".
void json_differences(const std::string& prefix, const nlohmann::json& golden,
                      const nlohmann::json& current, std::vector<std::string>& lines) {
  std::set<std::string> keys;
  for (const auto* object : {&golden, &current}) {
    if (!object->is_object()) continue;
    for (auto it = object->begin(); it != object->end(); ++it) keys.insert(it.key());
  }
  for (const std::string& key : keys) {
    const nlohmann::json g = golden.is_object() && golden.contains(key) ? golden[key] : nullptr;
    const nlohmann::json c = current.is_object() && current.contains(key) ? current[key] : nullptr;
    if (g == c) continue;
    if (g.is_object() && c.is_object()) {
      json_differences(prefix + key + ".", g, c, lines);
      continue;
    }
    lines.push_back(fmt::format("{}{}: {} -> {}", prefix, key, g.is_null() ? "(none)" : g.dump(),
                                c.is_null() ? "(none)" : c.dump()));
  }
}

}  // namespace

const char* golden_mode_name(GoldenMode mode) {
  return mode == GoldenMode::kExact ? "exact" : "tolerance";
}

std::optional<GoldenMode> parse_golden_mode(std::string_view text) {
  if (text == "exact") return GoldenMode::kExact;
  if (text == "tolerance") return GoldenMode::kTolerance;
  return std::nullopt;
}

// Where the kernel variants of two CUDA descriptions run other kernels ("mma" or "decode16"
// differs; host_plan and longest_first change no bit): "kernel_variant.mma "wgmma" -> "mma-sync"".
// A golden file from before the variant was recorded ran the defaults (auto), so against it a
// run that forces mma or decode16 runs other kernels too. Nothing when they agree, or when this
// run records no variant.
std::optional<std::string> other_kernels(const nlohmann::json& golden,
                                         const nlohmann::json& current) {
  const auto variant = [](const nlohmann::json& description) -> const nlohmann::json* {
    if (!description.is_object() || !description.contains("kernel_variant")) return nullptr;
    const nlohmann::json& v = description["kernel_variant"];
    return v.is_object() ? &v : nullptr;
  };
  const nlohmann::json* g = variant(golden);
  const nlohmann::json* c = variant(current);
  if (c == nullptr) return std::nullopt;
  std::vector<std::string> moved;
  if (g == nullptr) {
    for (const char* key : {"mma_requested", "decode16"}) {
      if (c->contains(key) && (*c)[key] != "auto") {
        moved.push_back(
            fmt::format("kernel_variant.{} (not recorded) -> {}", key, (*c)[key].dump()));
      }
    }
    if (moved.empty()) return std::nullopt;
    return fmt::format("{}", fmt::join(moved, ", "));
  }
  for (const char* key : {"mma", "decode16"}) {
    const nlohmann::json then = g->contains(key) ? (*g)[key] : nullptr;
    const nlohmann::json now = c->contains(key) ? (*c)[key] : nullptr;
    if (then != now)
      moved.push_back(fmt::format("kernel_variant.{} {} -> {}", key, then.dump(), now.dump()));
  }
  if (moved.empty()) return std::nullopt;
  return fmt::format("{}", fmt::join(moved, ", "));
}

// "decode16=auto, host_plan=true, longest_first=true, mma=wgmma, mma_requested=auto"
std::string variant_text(const nlohmann::json& description) {
  if (!description.is_object() || !description.contains("kernel_variant") ||
      !description["kernel_variant"].is_object()) {
    return "(not recorded)";
  }
  std::vector<std::string> fields;
  for (const auto& [key, value] : description["kernel_variant"].items()) {
    fields.push_back(
        fmt::format("{}={}", key, value.is_string() ? value.get<std::string>() : value.dump()));
  }
  return fmt::format("{}", fmt::join(fields, ", "));
}

// The rule per backend where describe() has no "deterministic" field:
//   cpu-fp8                  exact: sequential sums in a fixed order, threads never split a sum
//                            (see the header comment);
//   cuda-fp8, cuda-cast-bf16 exact on the golden's device (same device name and SM count: the
//                            split-KV count follows the SM count, and the kernels use no atomics,
//                            so one device and one shape give one order) with the same kernels
//                            (kernel_variant's mma and decode16); tolerance otherwise;
//   anything else            tolerance.
GoldenModeChoice choose_golden_mode(const GoldenProvenance& golden,
                                    const GoldenProvenance& current) {
  if (golden.backend != current.backend) {
    return {GoldenMode::kTolerance,
            fmt::format("the golden file was recorded with backend {}, this run is {}: another "
                        "implementation can only agree within rounding",
                        golden.backend, current.backend)};
  }
  const nlohmann::json& description = current.backend_description;
  if (description.is_object() && description.contains("deterministic") &&
      description["deterministic"].is_boolean()) {
    const bool deterministic = description["deterministic"].get<bool>();
    return {deterministic ? GoldenMode::kExact : GoldenMode::kTolerance,
            fmt::format("backend {} describes itself as {}deterministic", current.backend,
                        deterministic ? "" : "not ")};
  }
  if (current.backend == "cpu-fp8") {
    return {GoldenMode::kExact,
            "cpu-fp8 sums in a fixed order whatever the threads: bit-reproducible"};
  }
  if (current.backend == "cuda-fp8" || current.backend == "cuda-cast-bf16") {
    const nlohmann::json& recorded = golden.backend_description;
    if (const std::optional<std::string> other = other_kernels(recorded, description)) {
      return {GoldenMode::kTolerance,
              fmt::format("{} ran other kernels than the golden file's ({}): another summation "
                          "order",
                          current.backend, *other)};
    }
    const auto same = [&](const char* key) {
      return recorded.is_object() && description.is_object() && recorded.contains(key) &&
             description.contains(key) && recorded[key] == description[key];
    };
    if (same("device") && same("multiprocessors")) {
      return {GoldenMode::kExact,
              fmt::format("{} on the golden file's device (same name and SM count): one "
                          "summation order",
                          current.backend)};
    }
    return {GoldenMode::kTolerance,
            fmt::format("{} on another device than the golden file's: another split-KV count, "
                        "another summation order",
                        current.backend)};
  }
  return {GoldenMode::kTolerance,
          fmt::format("no determinism is known for backend {}", current.backend)};
}

std::vector<std::string> kernel_variant_lines(const GoldenProvenance& golden,
                                              const GoldenProvenance& current) {
  const auto has_variant = [](const nlohmann::json& description) {
    return description.is_object() && description.contains("kernel_variant");
  };
  if (!has_variant(golden.backend_description) && !has_variant(current.backend_description)) {
    return {};
  }
  const std::string then = variant_text(golden.backend_description);
  const std::string now = variant_text(current.backend_description);
  if (then == now)
    return {fmt::format("kernel variant (the golden file's and this run's): {}", now)};
  return {fmt::format("kernel variant of the golden file: {}", then),
          fmt::format("kernel variant of this run: {}", now)};
}

std::vector<std::string> provenance_differences(const GoldenProvenance& golden,
                                                const GoldenProvenance& current) {
  std::vector<std::string> lines;
  if (golden.backend != current.backend) {
    lines.push_back(fmt::format("backend: {} -> {}", golden.backend, current.backend));
  }
  json_differences("backend ", golden.backend_description, current.backend_description, lines);
  json_differences("platform ", golden.platform, current.platform, lines);
  if (golden.kvaudit_version != current.kvaudit_version) {
    lines.push_back(
        fmt::format("kvaudit version: {} -> {}", golden.kvaudit_version, current.kvaudit_version));
  }
  if (golden.kvaudit_revision != current.kvaudit_revision) {
    lines.push_back(fmt::format("kvaudit revision: {} -> {}", golden.kvaudit_revision,
                                current.kvaudit_revision));
  }
  return lines;
}

const char* moved_part_name(MovedPart part) {
  switch (part) {
    case MovedPart::kPool:
      return "pool";
    case MovedPart::kOut:
      return "out";
    case MovedPart::kLse:
      return "lse";
  }
  return "?";
}

namespace {

// Exactly one of the two values is a NaN: no distance between them means anything.
bool nan_against_number(const ElementMove& move) {
  return std::isnan(move.golden_value) != std::isnan(move.current_value);
}

// "1 ulp, |diff| 0.0078125"; for a NaN against a number, which is which: "NaN where the golden
// value is 0.5", "0.5 where the golden value is NaN".
std::string distance_text(const ElementMove& move) {
  if (nan_against_number(move)) {
    return std::isnan(move.current_value)
               ? fmt::format("NaN where the golden value is {}", value_text(move.golden_value))
               : fmt::format("{} where the golden value is NaN", value_text(move.current_value));
  }
  const std::string ulps = std::isfinite(move.ulps) ? fmt::format("{:g}", move.ulps) : "inf";
  return fmt::format("{} ulp, |diff| {}", ulps,
                     value_text(finite_abs_diff(move.golden_value, move.current_value)));
}

}  // namespace

std::string describe_move(const ElementMove& move) {
  std::string where;
  std::string bits;
  switch (move.part) {
    case MovedPart::kOut:
      where = fmt::format("out[row {}, head {}, dim {}]", move.row, move.head, move.dim);
      bits = fmt::format("0x{:04x} ({}) -> 0x{:04x} ({})", move.golden_bits,
                         value_text(move.golden_value), move.current_bits,
                         value_text(move.current_value));
      break;
    case MovedPart::kLse:
      where = fmt::format("lse[row {}, head {}]", move.row, move.head);
      bits = fmt::format("0x{:08x} ({}) -> 0x{:08x} ({})", move.golden_bits,
                         value_text(move.golden_value), move.current_bits,
                         value_text(move.current_value));
      break;
    case MovedPart::kPool:
      where = fmt::format("pool[slot {}, dim {}]", move.slot, move.dim);
      bits = fmt::format("code 0x{:02x} ({}) -> 0x{:02x} ({})", move.golden_bits,
                         value_text(move.golden_value), move.current_bits,
                         value_text(move.current_value));
      break;
  }
  return fmt::format("step {} layer {} {}: {}, {}", move.step, move.layer_id, where, bits,
                     distance_text(move));
}

bool EntryDiff::moved() const {
  return !structure.empty() || out_moved > 0 || lse_moved > 0 || slots_moved > 0 ||
         written_slots_differ || digest_moved;
}

std::optional<ElementMove> EntryDiff::first() const {
  if (first_pool) return first_pool;
  if (first_out) return first_out;
  return first_lse;
}

GoldenComparison compare_golden(const Golden& golden, const Golden& current, GoldenMode mode) {
  GoldenComparison comparison;
  comparison.mode = mode;
  std::map<std::pair<int, int>, const GoldenEntry*> now;
  for (const GoldenEntry& entry : current.entries) now[{entry.step, entry.layer_id}] = &entry;
  std::map<int, std::set<std::int64_t>> moved_slots;  // per layer id, over the steps so far
  for (const GoldenEntry* entry : ordered_entries(golden)) {
    const auto it = now.find({entry->step, entry->layer_id});
    EntryDiff diff;
    if (it == now.end()) {
      diff.step = entry->step;
      diff.layer_id = entry->layer_id;
      diff.structure = "in the golden file, not in this run";
    } else {
      diff = compare_entry(*entry, *it->second, mode, moved_slots[entry->layer_id]);
      now.erase(it);
    }
    ++comparison.entries_compared;
    if (!diff.moved()) continue;
    if (!comparison.first) comparison.first = diff.first();
    comparison.moved.push_back(std::move(diff));
  }
  for (const auto& [key, entry] : now) {
    EntryDiff diff;
    diff.step = key.first;
    diff.layer_id = key.second;
    diff.structure = "in this run, not in the golden file";
    comparison.moved.push_back(std::move(diff));
  }
  return comparison;
}

namespace {

// "out[3,2,17] (1)", "lse[0,1] (4)", "pool[25,2] (1)": where, and the distance in ulps ("NaN"
// where one of the two is a NaN and the other a number).
std::string compact_move(const ElementMove& move) {
  const std::string ulps = nan_against_number(move)   ? "NaN"
                           : std::isfinite(move.ulps) ? fmt::format("{:g}", move.ulps)
                                                      : "inf";
  switch (move.part) {
    case MovedPart::kOut:
      return fmt::format("out[{},{},{}] ({})", move.row, move.head, move.dim, ulps);
    case MovedPart::kLse:
      return fmt::format("lse[{},{}] ({})", move.row, move.head, ulps);
    case MovedPart::kPool:
      return fmt::format("pool[{},{}] ({})", move.slot, move.dim, ulps);
  }
  return "?";
}

std::string pool_text(const EntryDiff& diff) {
  if (diff.written_slots_differ) return "wrote other slots";
  if (diff.slots_moved == 0) {
    return diff.digest_moved ? "digest moved (unwritten slots)" : "0";
  }
  std::string text = fmt::format("{} ({})", diff.slots_moved, fmt::join(diff.slots, ","));
  if (diff.slots.size() < static_cast<std::size_t>(diff.slots_moved)) {
    text.insert(text.size() - 1, ",...");
  }
  if (diff.slots_carried > 0) text += fmt::format(" {} carried", diff.slots_carried);
  if (diff.unwritten_moved) text += " + unwritten slots (digest)";
  return text;
}

}  // namespace

void print_golden_comparison(std::ostream& out, const GoldenComparison& comparison) {
  if (!comparison.any_moved()) return;
  fmt::print(out, "{:>5} {:>6} {:>9} {:>8} {:>10} {:>9} {:>10}  {:<24} {}\n", "step", "layer",
             "out_moved", "max_ulp", "out_maxabs", "lse_moved", "lse_maxabs", "first (ulps)",
             "pool slots moved");
  for (const EntryDiff& diff : comparison.moved) {
    if (!diff.structure.empty()) {
      fmt::print(out, "{:>5} {:>6}  {}\n", diff.step, diff.layer_id, diff.structure);
      continue;
    }
    const std::string ulps =
        std::isfinite(diff.out_max_ulps) ? fmt::format("{:g}", diff.out_max_ulps) : "inf";
    const std::optional<ElementMove> first = diff.first();
    fmt::print(out, "{:>5} {:>6} {:>9} {:>8} {:>10.3e} {:>9} {:>10.3e}  {:<24} {}\n", diff.step,
               diff.layer_id, diff.out_moved, ulps, diff.out_max_abs, diff.lse_moved,
               diff.lse_max_abs, first ? compact_move(*first) : "-", pool_text(diff));
  }
  if (comparison.first) fmt::print(out, "first moved: {}\n", describe_move(*comparison.first));
  for (const std::string& note : unwritten_slot_notes(comparison)) fmt::print(out, "{}\n", note);
}

std::vector<std::string> dirty_build_lines(const GoldenProvenance& golden,
                                           const GoldenProvenance& current) {
  std::vector<std::string> lines;
  if (golden.kvaudit_dirty) {
    lines.push_back(fmt::format(
        "warning: the golden file was recorded by a kvaudit built from a dirty tree (revision "
        "{}): uncommitted changes made it, so its commit does not say what produced these "
        "outputs; re-record it from a clean build",
        golden.kvaudit_revision));
  }
  if (current.kvaudit_dirty) {
    lines.push_back(fmt::format(
        "note: this kvaudit was built from a dirty tree (revision {}): uncommitted changes may "
        "move the outputs",
        current.kvaudit_revision));
  }
  return lines;
}

std::vector<std::string> unwritten_slot_notes(const GoldenComparison& comparison) {
  std::vector<std::string> notes;
  for (const EntryDiff& diff : comparison.moved) {
    if (!diff.unwritten_moved) continue;
    notes.push_back(fmt::format(
        "note: step {} layer {}: pool slots the step did not write moved (digest storage keeps "
        "only their SHA-256; kvaudit check --steps {} --layers {} names them)",
        diff.step, diff.layer_id, diff.step, diff.layer_id));
  }
  return notes;
}

}  // namespace kvaudit
