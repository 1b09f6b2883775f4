// `kvaudit calibrate`: the math and the shapes are stated in calibrate.hpp.
#include "src/tools/calibrate.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <span>

#include "references/mla_reference.hpp"
#include "src/format/step_indices.hpp"

namespace kvaudit {

namespace {

// Past this quotient round-to-nearest leaves e4m3's range (the midpoint between 448 and 480).
constexpr double kOverflowQuotient = 464.0;
constexpr double kSmallestNormal = 0.015625;  // 2^-6

// A step of the layer as read once: its tensors, which set it belongs to.
struct LayerStep {
  StepLayerTensors tensors;
  bool held_out = false;
};

struct LayerInput {
  const DumpAttributes* attrs = nullptr;
  const DumpLayout* layout = nullptr;
  CachedFloats source;  // kv_source [S, D]
  std::vector<LayerStep> steps;
  std::vector<float> rows;  // every source row attention reads, once per value held [N, D]
  std::int64_t num_rows = 0;
};

// How a candidate writes a row: the dump form (per-tensor or grouped) and the multiplier.
struct WriteForm {
  DumpAttributes attrs;
  float kv_scale = 1.0f;
};

WriteForm per_tensor_form(const DumpAttributes& attrs, float scale) {
  WriteForm form{attrs, scale};
  form.attrs.kv_scale_kind = "per_tensor";
  form.attrs.kv_scale_group_size = 0;
  form.attrs.format_minor_version = 0;
  return form;
}

WriteForm group_form(const DumpAttributes& attrs, GroupScaleFormat format, float rope_scale) {
  WriteForm form{attrs, rope_scale};
  form.attrs.kv_scale_format = format;
  return form;
}

WriteForm form_of(const CandidateResult& candidate, const DumpAttributes& attrs) {
  switch (candidate.kind) {
    case CandidateKind::kGroupFloat32:
      return group_form(attrs, GroupScaleFormat::kFloat32, candidate.scale);
    case CandidateKind::kGroupPow2:
      return group_form(attrs, GroupScaleFormat::kPowerOfTwo, candidate.scale);
    default:
      return per_tensor_form(attrs, candidate.scale);
  }
}

// ---- phase 1: read the layer and collect the rows attention reads ----------------------------

// Writes the step's new_kv rows into `source` (the slots it writes), before its attention.
void apply_writes(const StepMeta& step, const StepLayerTensors& tensors, int width,
                  std::vector<float>& source) {
  if (step.attention_only) return;
  for (std::size_t i = 0; i < step.new_kv_slots.size(); ++i) {
    std::copy_n(tensors.new_kv.begin() + static_cast<std::ptrdiff_t>(i * width), width,
                source.begin() + step.new_kv_slots[i] * width);
  }
}

std::vector<std::int64_t> step_visible_slots(const DumpAttributes& attrs, const StepMeta& step,
                                             const StepLayerTensors& tensors) {
  const AttentionView view = attention_view(attrs, step, tensors);
  return visible_slots(view.step, view.attrs.page_size);
}

Result<LayerInput> read_layer(const DumpReader& reader, std::size_t layer_index) {
  const DumpLayout& layout = reader.layout();
  LayerInput input;
  input.attrs = &layout.attrs;
  input.layout = &layout;
  KVAUDIT_ASSIGN_OR_RETURN(input.source, reader.read_source(layer_index));
  const int width = layout.attrs.row_width();
  std::vector<float> current(input.source.begin(), input.source.end());
  std::vector<char> counted(static_cast<std::size_t>(layout.num_slots()), 0);
  for (std::size_t s = 0; s < layout.steps.size(); ++s) {
    LayerStep step;
    KVAUDIT_ASSIGN_OR_RETURN(step.tensors, reader.read_step_layer(s, layer_index));
    step.held_out = s % 2 == 1;
    const StepMeta& meta = layout.steps[s];
    apply_writes(meta, step.tensors, width, current);
    if (!meta.attention_only) {
      for (const std::int32_t slot : meta.new_kv_slots) counted[slot] = 0;
    }
    for (const std::int64_t slot : step_visible_slots(layout.attrs, meta, step.tensors)) {
      if (counted[slot]) continue;
      counted[slot] = 1;
      input.rows.insert(input.rows.end(), current.begin() + slot * width,
                        current.begin() + (slot + 1) * width);
      ++input.num_rows;
    }
    input.steps.push_back(std::move(step));
  }
  return input;
}

// ---- phase 2: statistics ------------------------------------------------------------------------

double nearest_rank(std::vector<double>& magnitudes, double fraction) {
  if (magnitudes.empty()) return 0.0;
  const auto rank =
      static_cast<std::size_t>(std::ceil(fraction * static_cast<double>(magnitudes.size())));
  const std::size_t index = std::min(magnitudes.size() - 1, rank == 0 ? 0 : rank - 1);
  std::nth_element(magnitudes.begin(), magnitudes.begin() + static_cast<std::ptrdiff_t>(index),
                   magnitudes.end());
  return magnitudes[index];
}

// Over the finite values only: NaN breaks max and nth_element's ordering (undefined behaviour),
// and an Inf amax gives no scale; they are counted in stats.nonfinite and reported.
void distribution(const LayerInput& input, int begin, int end, PartStats& stats) {
  const int width = input.attrs->row_width();
  std::vector<double> magnitudes;
  magnitudes.reserve(static_cast<std::size_t>(input.num_rows * (end - begin)));
  for (std::int64_t n = 0; n < input.num_rows; ++n) {
    for (int c = begin; c < end; ++c) {
      const float x = input.rows[n * width + c];
      if (!std::isfinite(x)) {
        ++stats.nonfinite;
        continue;
      }
      magnitudes.push_back(std::fabs(x));
    }
  }
  stats.count = static_cast<std::int64_t>(magnitudes.size());
  stats.amax = magnitudes.empty() ? 0.0 : *std::max_element(magnitudes.begin(), magnitudes.end());
  stats.p50 = nearest_rank(magnitudes, 0.5);
  stats.p90 = nearest_rank(magnitudes, 0.9);
  stats.p99 = nearest_rank(magnitudes, 0.99);
  stats.p999 = nearest_rank(magnitudes, 0.999);
}

// Whether element `col` of a row of this form is stored as e4m3 (a bf16 RoPE part is not).
bool stored_as_e4m3(const KvPool& pool, int col) {
  if (pool.grouped()) return col < pool.latent_width || pool.rope_dtype == KvDtype::kFloat8E4m3fn;
  return pool.dtype == KvDtype::kFloat8E4m3fn;
}

// Saturation, subnormals and flushes of every collected row written under `form`: the pool's own
// write rule decides each code.
void classify(const LayerInput& input, const WriteForm& form, PartStats& latent, PartStats& rope) {
  const int width = input.attrs->row_width();
  const int dc = input.attrs->kv_lora_rank;
  KvPool pool = KvPool::zeros_for(form.attrs, 1);
  for (std::int64_t n = 0; n < input.num_rows; ++n) {
    const float* x = input.rows.data() + n * width;
    pool.write_row(0, x, form.kv_scale);
    for (int c = 0; c < width; ++c) {
      if (!stored_as_e4m3(pool, c) || !std::isfinite(x[c])) continue;
      PartStats& part = c < dc ? latent : rope;
      const double code = std::fabs(pool.element(0, c));
      part.max_code = std::max(part.max_code, code);
      const double stored = std::fabs(pool.dequantized(0, c, form.kv_scale));
      if (code == kE4m3MaxFinite && std::fabs(x[c]) > stored * (kOverflowQuotient / 448.0)) {
        ++part.saturated;
      } else if (x[c] != 0.0f && code == 0.0) {
        ++part.flushed;
      } else if (code != 0.0 && code < kSmallestNormal) {
        ++part.subnormal;
      }
    }
  }
}

// ---- phase 3: attention error per candidate ----------------------------------------------------

struct ErrorSums {
  double diff_sq = 0.0;
  double ref_sq = 0.0;
  StorageError error;

  void add_step(int step, std::span<const double> candidate, std::span<const double> reference,
                std::span<const double> candidate_lse, std::span<const double> reference_lse,
                int heads, int dc) {
    error.measured = true;
    const std::size_t rows = reference_lse.size() / static_cast<std::size_t>(heads);
    for (std::size_t i = 0; i < rows; ++i) {
      double row_diff = 0.0, row_ref = 0.0;
      for (std::size_t e = i * heads * dc; e < (i + 1) * heads * dc; ++e) {
        const double d = candidate[e] - reference[e];
        row_diff += d * d;
        row_ref += reference[e] * reference[e];
      }
      diff_sq += row_diff;
      ref_sq += row_ref;
      const double row_rel = row_ref > 0.0 ? std::sqrt(row_diff / row_ref) : std::sqrt(row_diff);
      if (!(row_rel <= error.worst_row_rel_l2)) {
        error.worst_row_rel_l2 = row_rel;
        error.worst_step = step;
        error.worst_row = static_cast<int>(i);
      }
      for (int h = 0; h < heads; ++h) {
        const double d = std::fabs(candidate_lse[i * heads + h] - reference_lse[i * heads + h]);
        if (!(d <= error.lse_max_abs)) error.lse_max_abs = d;
      }
    }
    error.out_rel_l2 = ref_sq > 0.0 ? std::sqrt(diff_sq / ref_sq) : std::sqrt(diff_sq);
  }
};

struct CandidateSums {
  ErrorSums selection, held_out, all;
};

struct StepReference {
  std::vector<double> out, lse;
};

enum class Precision : std::uint8_t { kBinary64, kExact };

// One attention of a step on KV rows; out [Nq, H, Dc], lse [Nq, H].
Status attend(const DumpAttributes& attrs, const StepMeta& step, const StepLayerTensors& tensors,
              const KvRows& rows, Precision precision, int threads, StepReference& result) {
  const AttentionView view = attention_view(attrs, step, tensors);
  const std::size_t pairs = static_cast<std::size_t>(step.num_rows()) * attrs.num_heads;
  result.out.assign(pairs * attrs.kv_lora_rank, 0.0);
  result.lse.assign(pairs, 0.0);
  if (precision == Precision::kExact) {
    KVAUDIT_TRY(exact_reference_attention(ReferenceDevice::kCpu, view.attrs, view.step,
                                          tensors.q_nope, tensors.q_pe, rows, result.out,
                                          result.lse, threads));
  } else {
    KVAUDIT_TRY(mla_reference_attention<double>(view.attrs, view.step, tensors.q_nope, tensors.q_pe,
                                                rows, result.out, result.lse, threads));
  }
  return ok_status();
}

// The pool one candidate writes, kept across the steps: a slot is written again only when a step
// has written a new source row into it (each slot's current value is quantized once).
class CandidatePool {
 public:
  CandidatePool(const LayerInput& input, WriteForm form)
      : form_(std::move(form)),
        pool_(KvPool::zeros_for(form_.attrs, input.layout->num_slots())),
        fresh_(static_cast<std::size_t>(input.layout->num_slots()), 0) {}

  void invalidate(const StepMeta& step) {
    if (step.attention_only) return;
    for (const std::int32_t slot : step.new_kv_slots) fresh_[slot] = 0;
  }

  // The step's visible rows of `current`, quantized by the form's write rule.
  KvRows rows(const std::vector<float>& current, int width,
              const std::vector<std::int64_t>& slots) {
    for (const std::int64_t slot : slots) {
      if (fresh_[slot]) continue;
      pool_.write_row(slot, current.data() + slot * width, form_.kv_scale);
      fresh_[slot] = 1;
    }
    return KvRows::from_pool_slots(pool_, form_.kv_scale, slots);
  }

 private:
  WriteForm form_;
  KvPool pool_;
  std::vector<char> fresh_;
};

// Rs of every step, exactly, once per layer.
Status source_references(const LayerInput& input, int threads,
                         std::vector<StepReference>& references) {
  const int width = input.attrs->row_width();
  std::vector<float> current(input.source.begin(), input.source.end());
  for (std::size_t s = 0; s < input.steps.size(); ++s) {
    const StepMeta& meta = input.layout->steps[s];
    apply_writes(meta, input.steps[s].tensors, width, current);
    StepReference reference;
    const KvRows rows = KvRows::from_values(current, width, 1.0);
    KVAUDIT_TRY(attend(*input.attrs, meta, input.steps[s].tensors, rows, Precision::kExact, threads,
                       reference));
    references.push_back(std::move(reference));
  }
  return ok_status();
}

// One candidate over every step (held_out_only: the held-out steps) against the stored Rs.
Status evaluate_candidate(const LayerInput& input, CandidateResult& candidate,
                          const std::vector<StepReference>& references, Precision precision,
                          int threads, bool held_out_only = false) {
  const DumpAttributes& attrs = *input.attrs;
  const int width = attrs.row_width();
  std::vector<float> current(input.source.begin(), input.source.end());
  CandidatePool pool(input, form_of(candidate, attrs));
  CandidateSums sums;
  for (std::size_t s = 0; s < input.steps.size(); ++s) {
    const StepMeta& meta = input.layout->steps[s];
    const LayerStep& step = input.steps[s];
    apply_writes(meta, step.tensors, width, current);
    pool.invalidate(meta);
    if (held_out_only && !step.held_out) continue;
    const KvRows rows = pool.rows(current, width, step_visible_slots(attrs, meta, step.tensors));
    StepReference quantized;
    KVAUDIT_TRY(attend(attrs, meta, step.tensors, rows, precision, threads, quantized));
    for (ErrorSums* target : {step.held_out ? &sums.held_out : &sums.selection, &sums.all}) {
      target->add_step(static_cast<int>(s), quantized.out, references[s].out, quantized.lse,
                       references[s].lse, attrs.num_heads, attrs.kv_lora_rank);
    }
  }
  candidate.selection = sums.selection.error;
  candidate.held_out = sums.held_out.error;
  candidate.all = sums.all.error;
  return ok_status();
}

// Evaluates `candidates` over every step; Rs from `references`, computed (exactly) and stored
// the first time.
Status evaluate(const LayerInput& input, std::vector<CandidateResult*> candidates,
                std::vector<StepReference>& references, Precision precision, int threads) {
  if (references.empty()) KVAUDIT_TRY(source_references(input, threads, references));
  for (CandidateResult* candidate : candidates) {
    KVAUDIT_TRY(evaluate_candidate(input, *candidate, references, precision, threads));
  }
  return ok_status();
}

// ---- phase 4: candidates and the recommendation ------------------------------------------------

float pow2_up(double value) {
  if (!(value > 0.0)) return 1.0f;
  return static_cast<float>(std::exp2(std::ceil(std::log2(value))));
}

void add_candidate(std::vector<CandidateResult>& list, CandidateKind kind, float scale) {
  if (!(scale > 0.0f) || !std::isfinite(scale)) return;
  for (const CandidateResult& existing : list) {
    if (existing.scale == scale && existing.kind != CandidateKind::kGroupFloat32 &&
        existing.kind != CandidateKind::kGroupPow2 && kind != CandidateKind::kGroupFloat32 &&
        kind != CandidateKind::kGroupPow2) {
      return;  // the same computation as a candidate already listed
    }
  }
  CandidateResult candidate;
  candidate.kind = kind;
  candidate.scale = scale;
  list.push_back(candidate);
}

float amax_rule(const LayerCalibration& layer) {
  const double amax = std::max(layer.latent.amax, layer.rope.amax);
  return amax > 0.0 ? static_cast<float>(amax) / kE4m3MaxFinite : 1.0f;
}

std::vector<CandidateResult> base_candidates(const LayerCalibration& layer) {
  std::vector<CandidateResult> list;
  const float rule = amax_rule(layer);
  if (layer.grouped) {
    add_candidate(list, CandidateKind::kGroupFloat32, layer.dump_scale);
    add_candidate(list, CandidateKind::kGroupPow2, layer.dump_scale);
    add_candidate(list, CandidateKind::kAmaxRule, rule);
    return list;
  }
  add_candidate(list, CandidateKind::kAmaxRule, rule);
  add_candidate(list, CandidateKind::kAmaxRulePow2, pow2_up(rule));
  add_candidate(list, CandidateKind::kDumpScale, layer.dump_scale);
  add_candidate(list, CandidateKind::kUnit, 1.0f);
  return list;
}

double selection_error(const CandidateResult& candidate) {
  return candidate.selection.measured ? candidate.selection.out_rel_l2 : candidate.all.out_rel_l2;
}

std::size_t best_candidate(const std::vector<CandidateResult>& list) {
  std::size_t best = 0;
  for (std::size_t i = 1; i < list.size(); ++i) {
    if (selection_error(list[i]) < selection_error(list[best])) best = i;
  }
  return best;
}

void choose(LayerCalibration& layer, const CalibrationOptions& options) {
  const auto rule_it =
      std::find_if(layer.candidates.begin(), layer.candidates.end(), [&](const auto& c) {
        return c.kind == (layer.grouped ? CandidateKind::kGroupFloat32 : CandidateKind::kAmaxRule);
      });
  if (rule_it == layer.candidates.end()) {  // amax/448 is no usable scale (0 in fp32)
    layer.recommended = -1;
    layer.reason = fmt::format("amax {:.4g} gives no usable amax/448 scale: no recommendation",
                               std::max(layer.latent.amax, layer.rope.amax));
    return;
  }
  const std::size_t rule = static_cast<std::size_t>(rule_it - layer.candidates.begin());
  const std::size_t best = best_candidate(layer.candidates);
  const double rule_error = selection_error(layer.candidates[rule]);
  const float rule_scale = layer.candidates[rule].scale;
  layer.flat = !layer.grouped;
  for (const CandidateResult& c : layer.candidates) {
    if (layer.grouped || c.scale < rule_scale || c.scale > 2.0f * rule_scale) continue;
    if (c.latent.saturated + c.rope.saturated > 0 ||
        selection_error(c) > rule_error * (1.0 + options.flat_tolerance)) {
      layer.flat = false;
    }
  }
  if (best != rule && selection_error(layer.candidates[best]) < options.margin * rule_error) {
    layer.recommended = static_cast<int>(best);
    layer.reason = fmt::format(
        "{} has {:.3g} of the rule's out rel_l2 on the selection steps (below the margin {:.3g})",
        candidate_kind_name(layer.candidates[best].kind),
        selection_error(layer.candidates[best]) / rule_error, options.margin);
  } else {
    layer.recommended = static_cast<int>(rule);
    layer.reason = fmt::format(
        "the rule ({}): no candidate is below {:.3g} of its out rel_l2 on the selection steps{}",
        candidate_kind_name(layer.candidates[rule].kind), options.margin,
        layer.flat ? "; the curve is flat above amax/448 (nothing saturates there)" : "");
  }
}

// A candidate's saturation and underflow, over the same values as the layer's statistics.
void classify_candidate(const LayerInput& input, const LayerCalibration& layer,
                        CandidateResult& candidate) {
  candidate.latent.count = layer.latent.count;
  candidate.rope.count = layer.rope.count;
  classify(input, form_of(candidate, *input.attrs), candidate.latent, candidate.rope);
}

Result<LayerCalibration> calibrate_layer(const DumpReader& reader, std::size_t layer_index,
                                         const CalibrationOptions& options) {
  const DumpLayout& layout = reader.layout();
  const LayerMeta& meta = layout.layers[layer_index];
  KVAUDIT_ASSIGN_OR_RETURN(const LayerInput input, read_layer(reader, layer_index));
  LayerCalibration layer;
  layer.layer_id = meta.layer_id;
  layer.dump_scale = meta.kv_scale;
  layer.grouped = layout.attrs.per_token_group();
  const int dc = layout.attrs.kv_lora_rank;
  distribution(input, 0, dc, layer.latent);
  distribution(input, dc, layout.attrs.row_width(), layer.rope);
  classify(input, WriteForm{layout.attrs, meta.kv_scale}, layer.latent, layer.rope);
  if (!(std::max(layer.latent.amax, layer.rope.amax) > 0.0)) {
    layer.recommended = -1;
    layer.reason = "no finite nonzero value in kv_source: no scale to recommend";
    return layer;
  }
  layer.candidates = base_candidates(layer);
  for (CandidateResult& c : layer.candidates) classify_candidate(input, layer, c);
  std::vector<StepReference> references;
  std::vector<CandidateResult*> pending;
  for (CandidateResult& c : layer.candidates) pending.push_back(&c);
  KVAUDIT_TRY(evaluate(input, pending, references, Precision::kBinary64, options.threads));
  if (!layer.grouped) {
    const float center = layer.candidates[best_candidate(layer.candidates)].scale;
    const std::size_t before = layer.candidates.size();
    for (const int k : {-1, 1}) {
      add_candidate(layer.candidates, CandidateKind::kSweep,
                    static_cast<float>(center * std::exp2(0.5 * k)));
    }
    pending.clear();
    for (std::size_t i = before; i < layer.candidates.size(); ++i) {
      classify_candidate(input, layer, layer.candidates[i]);
      pending.push_back(&layer.candidates[i]);
    }
    KVAUDIT_TRY(evaluate(input, pending, references, Precision::kBinary64, options.threads));
  }
  choose(layer, options);
  if (layer.recommended < 0) return layer;
  // The confirmation runs where the recommendation is judged: the held-out steps, if any.
  CandidateResult confirm = layer.candidates[layer.recommended];
  const bool any_held_out = layout.steps.size() > 1;
  KVAUDIT_TRY(evaluate_candidate(input, confirm, references, Precision::kExact, options.threads,
                                 any_held_out));
  layer.confirmed_on_held_out = confirm.held_out.measured;
  layer.confirmed = confirm.held_out.measured ? confirm.held_out : confirm.all;
  return layer;
}

Status require_source(const DumpReader& reader, const std::vector<std::size_t>& layers) {
  for (const std::size_t index : layers) {
    const LayerMeta& meta = reader.layout().layers[index];
    if (!meta.has_source) {
      return bad_input(
          fmt::format("{}:/layers/{}", reader.path().string(), meta.group),
          "no kv_source: calibrate needs the unquantized rows (capture kv_source, or synth "
          "--with-source)");
    }
  }
  return ok_status();
}

Result<std::vector<std::size_t>> selected_layers(const DumpReader& reader,
                                                 const CalibrationOptions& options) {
  const DumpLayout& layout = reader.layout();
  std::vector<std::size_t> indices;
  if (options.layer_ids.empty()) {
    for (std::size_t i = 0; i < layout.layers.size(); ++i) indices.push_back(i);
    return indices;
  }
  for (const int id : options.layer_ids) {
    const int index = layout.layer_index_of_id(id);
    if (index < 0) {
      return bad_input(reader.path().string(),
                       fmt::format("--layers: the dump has no layer {}", id));
    }
    indices.push_back(static_cast<std::size_t>(index));
  }
  return indices;
}

}  // namespace

const char* candidate_kind_name(CandidateKind kind) {
  switch (kind) {
    case CandidateKind::kAmaxRule:
      return "amax/448";
    case CandidateKind::kAmaxRulePow2:
      return "pow2-up(amax/448)";
    case CandidateKind::kDumpScale:
      return "dump kv_scale";
    case CandidateKind::kUnit:
      return "1.0";
    case CandidateKind::kSweep:
      return "sweep";
    case CandidateKind::kGroupFloat32:
      return "group amax/448 (fp32)";
    case CandidateKind::kGroupPow2:
      return "group pow2-up(amax/448)";
  }
  return "?";
}

Result<Calibration> calibrate_dump(const DumpReader& reader, const CalibrationOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  KVAUDIT_ASSIGN_OR_RETURN(const std::vector<std::size_t> layers, selected_layers(reader, options));
  KVAUDIT_TRY(require_source(reader, layers));
  Calibration calibration;
  calibration.dump = reader.path().string();
  calibration.model = reader.layout().attrs.model;
  calibration.write_rule = "satfinite";
  for (std::size_t s = 0; s < reader.layout().steps.size(); ++s) {
    (s % 2 == 1 ? calibration.held_out_steps : calibration.selection_steps)
        .push_back(static_cast<int>(s));
  }
  for (const std::size_t index : layers) {
    KVAUDIT_ASSIGN_OR_RETURN(LayerCalibration layer, calibrate_layer(reader, index, options));
    calibration.layers.push_back(std::move(layer));
  }
  calibration.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return calibration;
}

}  // namespace kvaudit

namespace kvaudit {

namespace {

double fraction(std::int64_t part, std::int64_t count) {
  return count > 0 ? static_cast<double>(part) / static_cast<double>(count) : 0.0;
}

std::string error_text(const StorageError& error) {
  if (!error.measured) return "-";
  return fmt::format("{:.3e} {:.2e} {:.2e}@S{}r{}", error.out_rel_l2, error.lse_max_abs,
                     error.worst_row_rel_l2, error.worst_step, error.worst_row);
}

std::string part_text(const char* name, const PartStats& stats) {
  return fmt::format(
      "    {:<6} amax {:.4g}  |x| p50 {:.3g} p90 {:.3g} p99 {:.3g} p99.9 {:.3g}  saturated "
      "{:.3g}%  subnormal {:.3g}%  flushed to 0 {:.3g}%\n",
      name, stats.amax, stats.p50, stats.p90, stats.p99, stats.p999,
      100.0 * fraction(stats.saturated, stats.count),
      100.0 * fraction(stats.subnormal, stats.count), 100.0 * fraction(stats.flushed, stats.count));
}

std::string candidate_line(const CandidateResult& c, bool recommended) {
  const std::int64_t count = c.latent.count + c.rope.count;
  return fmt::format(
      "    {} {:<24} {:<12.6g} {:>7.3g}% {:>7.3g}%  {:<36} {}\n", recommended ? "*" : " ",
      candidate_kind_name(c.kind), c.scale,
      100.0 * fraction(c.latent.saturated + c.rope.saturated, count),
      100.0 * fraction(c.latent.flushed + c.rope.flushed + c.latent.subnormal + c.rope.subnormal,
                       count),
      error_text(c.selection), error_text(c.held_out));
}

std::string layer_text(const LayerCalibration& layer) {
  std::string text = fmt::format("  layer {} (kv_scale in the dump {:.6g}{}):\n", layer.layer_id,
                                 layer.dump_scale, layer.grouped ? ", the RoPE part's" : "");
  text += part_text("latent", layer.latent);
  text += part_text("rope", layer.rope);
  if (layer.latent.nonfinite + layer.rope.nonfinite > 0) {
    text += fmt::format("    {} non-finite source values, left out of the statistics\n",
                        layer.latent.nonfinite + layer.rope.nonfinite);
  }
  if (layer.recommended < 0) return text + fmt::format("    no recommendation: {}\n", layer.reason);
  text += fmt::format("    {:<26} {:<12} {:>8} {:>8}  {:<36} {}\n", "candidate", "scale", "satur.",
                      "underfl.", "selection: rel_l2 lse_err worst_row",
                      "held out: rel_l2 lse_err worst_row");
  for (std::size_t i = 0; i < layer.candidates.size(); ++i) {
    text += candidate_line(layer.candidates[i], static_cast<int>(i) == layer.recommended);
  }
  const CandidateResult& best = layer.candidates[layer.recommended];
  if (layer.grouped) {
    text += fmt::format(
        "    recommended: the write rule {} (scales are computed per token and group at write "
        "time: no value to store); headroom 448/max|code| = {:.3g}; {}\n",
        candidate_kind_name(best.kind),
        best.latent.max_code > 0 ? 448.0 / best.latent.max_code : 0.0, layer.reason);
  } else {
    text += fmt::format("    recommended: k_scale = v_scale = {:.9g} ({}); {}\n", best.scale,
                        candidate_kind_name(best.kind), layer.reason);
  }
  text += fmt::format(
      "    confirmed with the exact reference on the {} steps: out rel_l2 {:.4e}, "
      "lse error {:.3e}, worst row rel_l2 {:.3e} (step {}, row {})\n",
      layer.confirmed_on_held_out ? "held-out" : "(no held-out step:) all",
      layer.confirmed.out_rel_l2, layer.confirmed.lse_max_abs, layer.confirmed.worst_row_rel_l2,
      layer.confirmed.worst_step, layer.confirmed.worst_row);
  return text;
}

std::string steps_text(const std::vector<int>& steps) {
  if (steps.empty()) return "none";
  std::string text;
  for (const int s : steps) text += (text.empty() ? "" : ",") + std::to_string(s);
  return text;
}

nlohmann::json part_json(const PartStats& stats) {
  return {{"count", stats.count},
          {"nonfinite", stats.nonfinite},
          {"amax", stats.amax},
          {"abs_percentiles",
           {{"p50", stats.p50}, {"p90", stats.p90}, {"p99", stats.p99}, {"p99.9", stats.p999}}},
          {"saturated_fraction", fraction(stats.saturated, stats.count)},
          {"subnormal_fraction", fraction(stats.subnormal, stats.count)},
          {"flushed_fraction", fraction(stats.flushed, stats.count)},
          {"max_code", stats.max_code}};
}

nlohmann::json error_json(const StorageError& error) {
  if (!error.measured) return nullptr;
  return {
      {"out_rel_l2", error.out_rel_l2},
      {"lse_max_abs", error.lse_max_abs},
      {"worst_row",
       {{"step", error.worst_step}, {"row", error.worst_row}, {"rel_l2", error.worst_row_rel_l2}}}};
}

nlohmann::json layer_json(const LayerCalibration& layer) {
  nlohmann::json candidates = nlohmann::json::array();
  for (const CandidateResult& c : layer.candidates) {
    candidates.push_back({{"kind", candidate_kind_name(c.kind)},
                          {"scale", c.scale},
                          {"latent", part_json(c.latent)},
                          {"rope", part_json(c.rope)},
                          {"selection", error_json(c.selection)},
                          {"held_out", error_json(c.held_out)},
                          {"all", error_json(c.all)}});
  }
  const bool recommends = layer.recommended >= 0;
  nlohmann::json json = {{"layer_id", layer.layer_id},
                         {"dump_kv_scale", layer.dump_scale},
                         {"per_token_group", layer.grouped},
                         {"latent", part_json(layer.latent)},
                         {"rope", part_json(layer.rope)},
                         {"candidates", candidates},
                         {"recommended", nullptr},
                         {"reason", layer.reason},
                         {"flat", layer.flat},
                         {"confirmed_exact", recommends ? error_json(layer.confirmed) : nullptr},
                         {"confirmed_on_held_out", layer.confirmed_on_held_out}};
  if (!recommends) return json;  // "recommended": null, "reason" says why
  const CandidateResult& best = layer.candidates[layer.recommended];
  json["recommended"] = candidate_kind_name(best.kind);
  if (!layer.grouped) {
    json["k_scale"] = best.scale;
    json["v_scale"] = best.scale;
  }
  return json;
}

}  // namespace

std::string format_calibration(const Calibration& calibration) {
  std::string text = fmt::format(
      "calibrate {}\n  write rule: satfinite (the kvdump write rule: values past 464*s are stored "
      "as +-448; a PyTorch .to(torch.float8_e4m3fn) cast would store NaN for the same values)\n"
      "  MLA caches one tensor (the latent is both K and V): one scale serves both, k_scale = "
      "v_scale\n  selection steps {} / held-out steps {}{}\n"
      "  error = attention on the quantized source vs on the source (out rel_l2, lse max abs, "
      "worst row rel_l2 @ step,row); underflow = subnormal or flushed to 0\n",
      calibration.dump, steps_text(calibration.selection_steps),
      steps_text(calibration.held_out_steps),
      calibration.held_out_steps.empty()
          ? " (one step: nothing is held out; the figures are on the rows chosen on)"
          : "");
  for (const LayerCalibration& layer : calibration.layers) text += layer_text(layer);
  return text;
}

nlohmann::json calibration_json(const Calibration& calibration) {
  nlohmann::json layers = nlohmann::json::array();
  for (const LayerCalibration& layer : calibration.layers) layers.push_back(layer_json(layer));
  return {
      {"dump", calibration.dump},
      {"write_rule", calibration.write_rule},
      {"scales_note", "MLA caches one tensor: the latent is both K and V, so k_scale = v_scale"},
      {"selection_steps", calibration.selection_steps},
      {"held_out_steps", calibration.held_out_steps},
      {"layers", layers}};
}

}  // namespace kvaudit

namespace kvaudit {

nlohmann::json quantization_param_json(const Calibration& calibration,
                                       const std::string& model_type, int tp_size) {
  nlohmann::json layers = nlohmann::json::object();
  for (const LayerCalibration& layer : calibration.layers) {
    if (layer.grouped || layer.recommended < 0) continue;
    layers[std::to_string(layer.layer_id)] = layer.candidates[layer.recommended].scale;
  }
  nlohmann::json ranks = nlohmann::json::object();
  for (int rank = 0; rank < tp_size; ++rank) ranks[std::to_string(rank)] = layers;
  nlohmann::json type = nullptr;
  if (!model_type.empty()) type = model_type;
  return {{"model_type", type},
          {"kv_cache", {{"dtype", "float8_e4m3fn"}, {"scaling_factor", ranks}}}};
}

std::string incomplete_layers_warning(const Calibration& calibration) {
  std::vector<int> ids;
  for (const LayerCalibration& layer : calibration.layers) {
    if (!layer.grouped && layer.recommended >= 0) ids.push_back(layer.layer_id);
  }
  std::sort(ids.begin(), ids.end());
  bool complete = true;
  for (std::size_t i = 0; i < ids.size(); ++i) complete = complete && ids[i] == static_cast<int>(i);
  if (complete) return "";
  return fmt::format(
      "warning: the exported scales cover {} layer(s), not every layer 0..N-1; servers expect a "
      "scale for every layer (vLLM's loader refuses the file, logs an error and serves 1.0)",
      ids.size());
}

// safetensors (the format of Hugging Face checkpoints): an 8-byte little-endian header length,
// a JSON header {name: {"dtype", "shape", "data_offsets": [begin, end]}} padded with spaces to a
// multiple of 8, then the raw little-endian data. Written here (a few lines) because Debian ships
// no C++ library for it; the Python `safetensors` package reads the result (docs/calibrate.md).
std::string scales_safetensors(const Calibration& calibration) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  std::string data;
  for (const LayerCalibration& layer : calibration.layers) {
    if (layer.grouped || layer.recommended < 0) continue;
    const float scale = layer.candidates[layer.recommended].scale;
    for (const char* name : {"k_scale", "v_scale"}) {
      const std::size_t begin = data.size();
      char bytes[4];
      std::memcpy(bytes, &scale, sizeof bytes);  // little-endian hosts only (x86-64, aarch64)
      data.append(bytes, sizeof bytes);
      header[fmt::format("model.layers.{}.self_attn.{}", layer.layer_id, name)] = {
          {"dtype", "F32"},
          {"shape", nlohmann::json::array()},
          {"data_offsets", {begin, data.size()}}};
    }
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string file(8, '\0');
  std::uint64_t length = text.size();
  for (int i = 0; i < 8; ++i) file[i] = static_cast<char>((length >> (8 * i)) & 0xFF);
  return file + text + data;
}

}  // namespace kvaudit
