// The replay engine (see replay.hpp for the pipeline and the five comparisons).
//
// Shapes per (step, layer): q_nope [Nq, H, Dc], q_pe [Nq, H, Dr], new_kv [Nq, D], out [Nq, H, Dc],
// lse [Nq, H]; pools [S, D]. The reference (references/mla_reference.hpp) is exact to double
// precision (relative <= 1e-15), so every difference measured here is the candidate's: a bf16
// backend output carries at least bf16 rounding (2^-8 relative) and R8 - Rs the e4m3 storage
// rounding (2^-4 relative per element). Tolerances live in the policy, not here.
#include "src/replay/replay.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <set>
#include <sstream>
#include <unordered_map>

#include "references/mla_reference.hpp"
#include "src/replay/integrity.hpp"
#include "src/verdict/divergence.hpp"
#include "src/verdict/run_judge.hpp"

namespace kvaudit {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// "layer 2/3 step 1/4" on stderr, at most five times per second.
class Progress {
 public:
  explicit Progress(bool enabled) : enabled_(enabled) {}
  void update(std::size_t layer, std::size_t layers, std::size_t step, std::size_t steps) {
    if (!enabled_) return;
    const auto now = Clock::now();
    if (printed_ && now - last_ < std::chrono::milliseconds(200)) return;
    printed_ = true;
    last_ = now;
    std::fprintf(stderr, "kvaudit: layer %zu/%zu step %zu/%zu\n", layer + 1, layers, step + 1,
                 steps);
  }

 private:
  bool enabled_;
  bool printed_ = false;
  Clock::time_point last_;
};

std::vector<double> widen(std::span<const float> values) {
  return std::vector<double>(values.begin(), values.end());
}

std::vector<double> widen_bf16(std::span<const std::uint16_t> bits) {
  std::vector<double> values(bits.size());
  for (std::size_t i = 0; i < bits.size(); ++i) values[i] = bf16_to_float(bits[i]);
  return values;
}

// The unquantized value of each slot, where known: the dump's kv_source (dense, every slot), or
// without it only the rows the replay wrote (sparse: such a dump may hold a pool far larger than
// the tokens its steps write, and a dense [S, D] copy would double the layer's memory).
class SourceRows {
 public:
  SourceRows(std::int64_t num_slots, int width)
      : width_(width), known_(static_cast<std::size_t>(num_slots), 0) {}

  void set_dense(std::vector<float> values) {
    dense_ = std::move(values);
    std::fill(known_.begin(), known_.end(), 1);
  }

  void write(std::int64_t slot, const float* values) {
    if (!dense_.empty()) {
      std::copy(values, values + width_, dense_.begin() + slot * width_);
    } else {
      sparse_[slot].assign(values, values + width_);
    }
    known_[slot] = 1;
  }

  // Whether every token a row of the step sees has a known source value.
  bool covers(const std::vector<std::int64_t>& visible) const {
    return std::all_of(visible.begin(), visible.end(),
                       [&](std::int64_t slot) { return known_[slot] != 0; });
  }

  // Rs for the step (the step must be covered). Sparse rows are gathered into the pages the step
  // uses, renumbered 0..P'-1 in a copy of the step, so memory follows the step.
  Result<std::int64_t> attention(const DumpAttributes& attrs, const StepMeta& step,
                                 const StepLayerTensors& tensors, std::span<double> out,
                                 std::span<double> lse, int threads) const {
    if (!dense_.empty()) {
      const KvRows rows = KvRows::from_values(dense_, width_, 1.0);
      return mla_reference_attention(attrs, step, tensors.q_nope, tensors.q_pe, rows, out, lse,
                                     threads);
    }
    const int page = attrs.page_size;
    std::vector<std::int32_t> pages(step.kv_indices.begin(), step.kv_indices.end());
    std::sort(pages.begin(), pages.end());
    pages.erase(std::unique(pages.begin(), pages.end()), pages.end());
    std::unordered_map<std::int32_t, std::int32_t> compact_page;
    for (std::size_t i = 0; i < pages.size(); ++i) {
      compact_page[pages[i]] = static_cast<std::int32_t>(i);
    }
    StepMeta compact = step;
    for (std::int32_t& p : compact.kv_indices) p = compact_page.at(p);
    for (std::int32_t& slot : compact.new_kv_slots) {
      slot = compact_page.at(slot / page) * page + slot % page;
    }
    std::vector<float> values(pages.size() * page * width_, 0.0f);
    for (std::size_t i = 0; i < pages.size(); ++i) {
      for (int offset = 0; offset < page; ++offset) {
        const auto it = sparse_.find(std::int64_t{pages[i]} * page + offset);
        if (it == sparse_.end()) continue;  // a slot no row sees (covers() held)
        std::copy(it->second.begin(), it->second.end(),
                  values.begin() + (i * page + offset) * width_);
      }
    }
    const KvRows rows = KvRows::from_values(values, width_, 1.0);
    return mla_reference_attention(attrs, compact, tensors.q_nope, tensors.q_pe, rows, out, lse,
                                   threads);
  }

 private:
  int width_;
  std::vector<char> known_;
  std::vector<float> dense_;
  std::unordered_map<std::int64_t, std::vector<float>> sparse_;
};

}  // namespace

Status check_selection(const DumpLayout& layout, const ReplayOptions& options) {
  for (const int id : options.layer_ids) {
    if (layout.layer_index_of_id(id) < 0) {
      std::ostringstream known;
      for (std::size_t i = 0; i < layout.layers.size(); ++i) {
        known << (i ? ", " : "") << layout.layers[i].layer_id;
      }
      return bad_input("--layers", "layer id " + std::to_string(id) +
                                       " is not in the dump (it holds " + known.str() + ")");
    }
  }
  for (const int step : options.step_indices) {
    if (step < 0 || static_cast<std::size_t>(step) >= layout.steps.size()) {
      return bad_input("--steps", "step " + std::to_string(step) +
                                      " is not in the dump (it holds " +
                                      std::to_string(layout.steps.size()) + " steps)");
    }
  }
  return ok_status();
}

nlohmann::json summarize_dump(const DumpLayout& layout) {
  const DumpAttributes& attrs = layout.attrs;
  nlohmann::json layers = nlohmann::json::array();
  for (const LayerMeta& layer : layout.layers) {
    layers.push_back({{"group", layer.group},
                      {"layer_id", layer.layer_id},
                      {"kv_scale", layer.kv_scale},
                      {"has_source", layer.has_source}});
  }
  nlohmann::json steps = nlohmann::json::array();
  for (const StepMeta& step : layout.steps) {
    steps.push_back({{"group", step.group},
                     {"kind", step_kind_name(step.kind)},
                     {"requests", step.batch_size()},
                     {"rows", step.num_rows()}});
  }
  return {{"format_version", layout.format_version},
          {"model", attrs.model},
          {"producer", attrs.producer},
          {"num_heads", attrs.num_heads},
          {"kv_lora_rank", attrs.kv_lora_rank},
          {"qk_rope_head_dim", attrs.qk_rope_head_dim},
          {"sm_scale", attrs.sm_scale},
          {"page_size", attrs.page_size},
          {"kv_dtype", kv_dtype_name(attrs.kv_dtype)},
          {"kv_scale_kind", attrs.kv_scale_kind},
          {"num_pages", layout.num_pages},
          {"layers", layers},
          {"steps", steps}};
}

Result<CheckRun> replay_dump(const DumpReader& reader, Backend* backend,
                             const ReplayOptions& options) {
  const auto total_start = Clock::now();
  const DumpLayout& layout = reader.layout();
  const DumpAttributes& attrs = layout.attrs;
  KVAUDIT_TRY(check_selection(layout, options));

  CheckRun run;
  RunJudge judge(run);
  run.dump_path = reader.path().string();
  run.backend = backend ? backend->name() : "none";
  run.backend_description = backend ? backend->describe() : nlohmann::json::object();
  run.policy = options.policy;
  run.dump_summary = summarize_dump(layout);
  if (options.reciprocal_scale) {
    run.notes.push_back(
        "--reciprocal-scale: pools were written (and captured pools judged) with "
        "e4m3_rne_satfinite(x * fp32(1 / kv_scale)), not kvdump-v1's x / kv_scale");
  }

  std::vector<std::size_t> layer_indices;
  for (std::size_t li = 0; li < layout.layers.size(); ++li) {
    const int id = layout.layers[li].layer_id;
    if (options.layer_ids.empty() || std::find(options.layer_ids.begin(), options.layer_ids.end(),
                                               id) != options.layer_ids.end()) {
      layer_indices.push_back(li);
    }
  }
  const std::set<int> reported_steps(options.step_indices.begin(), options.step_indices.end());
  auto is_reported = [&](std::size_t step) {
    return reported_steps.empty() || reported_steps.count(static_cast<int>(step)) != 0;
  };

  const int num_heads = attrs.num_heads;
  const int dc = attrs.kv_lora_rank;
  const int width = attrs.row_width();
  const std::int64_t num_slots = layout.num_slots();
  Progress progress(options.progress);

  for (std::size_t order = 0; order < layer_indices.size(); ++order) {
    const std::size_t li = layer_indices[order];
    const LayerMeta& layer = layout.layers[li];
    const std::string where = reader.path().string() + ":/layers/" + layer.group;

    auto pool = reader.read_pool(li);
    if (!pool.ok()) return pool.error();
    KvPool reference_pool = std::move(pool.value());
    KvPool backend_pool = reference_pool;
    PoolDamageHistory captured_damage;  // slots of kv_cache_after that differ, step to step
    PoolNanCodes reference_nan_codes;   // NaN codes of reference_pool (data), kept per write
    reference_nan_codes.scan(reference_pool);

    SourceRows source(num_slots, width);
    if (layer.has_source) {
      auto read = reader.read_source(li);
      if (!read.ok()) return read.error();
      if (read->size() != static_cast<std::size_t>(num_slots) * width) {
        return internal_error(where + "/kv_source", "source has an unexpected size");
      }
      source.set_dense(std::move(read.value()));
    }

    bool noted_missing_source = false;
    for (std::size_t si = 0; si < layout.steps.size(); ++si) {
      progress.update(order, layer_indices.size(), si, layout.steps.size());
      const StepMeta& step = layout.steps[si];
      const int step_number = static_cast<int>(si);
      const bool reported = is_reported(si);
      auto read = reader.read_step_layer(si, li);
      if (!read.ok()) return read.error();
      const StepLayerTensors& tensors = read.value();
      const int nq = step.num_rows();

      // 1. The reference replay's own writes (kvdump write rule) and the source of each new row.
      for (int i = 0; i < nq; ++i) {
        const std::int64_t slot = step.new_kv_slots[i];
        const float* values = tensors.new_kv.data() + static_cast<std::size_t>(i) * width;
        reference_pool.write_row(slot, values, layer.kv_scale, options.reciprocal_scale);
        source.write(slot, values);
      }
      reference_nan_codes.update(reference_pool, step.new_kv_slots);
      // Messages name the dump's own groups (a dump may start at S001, or name layer 5 L000).
      const std::string where = step.group + " " + layer.group;
      StepLayerWrites writes{step_number,    layer.layer_id, step.new_kv_slots,
                             tensors.new_kv, layer.kv_scale, where};
      if (options.reciprocal_scale) writes.rule = "e4m3_rne_satfinite(new_kv * fp32(1 / kv_scale))";

      // 2. References: R8 on the dequantized pool, Rs on the source rows.
      const TensorShape3 shape{nq, num_heads, dc};
      std::vector<double> r8_out;
      std::vector<double> r8_lse;
      std::vector<double> rs_out;
      std::vector<double> rs_lse;
      bool have_source_reference = false;
      // The slots the step's rows read (only reported steps need them).
      const std::vector<std::int64_t> visible =
          reported ? visible_slots(step, attrs.page_size) : std::vector<std::int64_t>{};
      // R8 on `pool`: the exact attention on the visible slots, dequantized with kv_scale.
      auto reference_on_pool = [&](const KvPool& pool, std::vector<double>& out,
                                   std::vector<double>& lse) -> Status {
        out.assign(shape.size(), 0.0);
        lse.assign(static_cast<std::size_t>(nq) * num_heads, 0.0);
        const KvRows dequantized = KvRows::from_pool_slots(pool, layer.kv_scale, visible);
        auto work = mla_reference_attention(attrs, step, tensors.q_nope, tensors.q_pe, dequantized,
                                            out, lse, options.threads);
        if (!work.ok()) return work.error();
        run.reference_rows_heads_tokens += static_cast<double>(work.value());
        return ok_status();
      };
      if (reported) {
        const auto reference_start = Clock::now();
        KVAUDIT_TRY(reference_on_pool(reference_pool, r8_out, r8_lse));
        if (source.covers(visible)) {
          rs_out.assign(shape.size(), 0.0);
          rs_lse.assign(r8_lse.size(), 0.0);
          auto source_work =
              source.attention(attrs, step, tensors, rs_out, rs_lse, options.threads);
          if (!source_work.ok()) return source_work.error();
          run.reference_rows_heads_tokens += static_cast<double>(source_work.value());
          have_source_reference = true;
        } else if (!noted_missing_source) {
          noted_missing_source = true;
          run.notes.push_back(
              where +
              ": the dump has no source value for some visible tokens (no kv_source); "
              "quantization and total error are not measured where that holds");
        }
        run.reference_seconds += seconds_since(reference_start);
      }

      // 3. The backend under test, on its own pool, then the integrity of that pool.
      std::optional<AttentionOutput> backend_output;
      // R8 on the pool the backend read (docs/design.md "Numerics"): its own pool after its writes.
      // Equal to R8 while the slots the step reads hold the reference's bytes (the reference is
      // deterministic), so it is only computed again when they do not.
      std::vector<double> r8_read_out;
      std::vector<double> r8_read_lse;
      bool read_differs = false;
      if (backend != nullptr) {
        const KvPool before = backend_pool;
        const StepLayerInput input{attrs, step, layer, tensors, si, li};
        const auto backend_start = Clock::now();
        auto output = backend->run_step(input, backend_pool);
        run.backend_seconds += seconds_since(backend_start);
        if (!output.ok()) return output.error();
        if (output->out_bf16.size() != shape.size() ||
            output->lse.size() != static_cast<std::size_t>(nq) * num_heads) {
          return internal_error(
              where, "backend " + backend->name() + " returned out/lse of the wrong size");
        }
        backend_output = std::move(output.value());
        for (IntegrityFinding& finding :
             check_backend_pool(writes, before, backend_pool, reference_pool)) {
          if (reported) {
            run.integrity.push_back(std::move(finding));
          } else if (!finding.pass) {
            run.notes.push_back("(step not reported) " + finding.detail);
          }
        }
        // A backend that changed its storage cannot be replayed further on its own pool: give it
        // the reference pool so later steps measure the kernel, while this step's findings stand.
        const bool same_storage = backend_pool.bytes.size() == reference_pool.bytes.size() &&
                                  backend_pool.dtype == reference_pool.dtype;
        if (reported && same_storage) {
          read_differs = std::any_of(visible.begin(), visible.end(), [&](std::int64_t slot) {
            return std::memcmp(backend_pool.row(slot), reference_pool.row(slot),
                               reference_pool.row_bytes()) != 0;
          });
          if (read_differs) {
            const auto reference_start = Clock::now();
            KVAUDIT_TRY(reference_on_pool(backend_pool, r8_read_out, r8_read_lse));
            run.reference_seconds += seconds_since(reference_start);
          }
        }
        if (!same_storage) backend_pool = reference_pool;
      }

      // Captured pool after the step.
      if (tensors.kv_cache_after) {
        for (IntegrityFinding& finding : check_captured_pool(writes, *tensors.kv_cache_after,
                                                             reference_pool, &captured_damage)) {
          if (reported) {
            run.integrity.push_back(std::move(finding));
          } else if (!finding.pass) {
            run.notes.push_back("(step not reported) " + finding.detail);
          }
        }
      }
      if (!reported) continue;

      // NaN codes in the reference pool: data (unused slots may hold them), reported per step.
      if (auto nan_codes = reference_nan_codes.report(writes, reference_pool.num_slots, visible)) {
        run.integrity.push_back(std::move(*nan_codes));
      }

      // 4. Comparisons, judged by the run judge.
      const ComparisonSite site{step, step_number, layer.layer_id, order};
      const OutputView r8{r8_out, r8_lse};
      std::vector<double> backend_out;
      std::vector<double> backend_lse;
      if (backend_output) {
        backend_out = widen_bf16(backend_output->out_bf16);
        backend_lse = widen(backend_output->lse);
        const OutputView backend_view{backend_out, backend_lse};
        const OutputView read = read_differs ? OutputView{r8_read_out, r8_read_lse} : r8;
        // Where the pool the backend read differs from the reference pool, the verdict chooses
        // which of the two the kernel is judged against (src/verdict/divergence.hpp).
        const KernelReferenceChoice choice =
            read_differs
                ? choose_kernel_reference(options.policy, shape, backend_view, read, r8, where)
                : KernelReferenceChoice{};
        if (!choice.note.empty()) run.notes.push_back(choice.note);
        judge.compare(
            site, Comparison::kKernel, shape,
            {choice.reference == KernelReference::kReferencePool ? r8 : read, backend_view});
        judge.compare(site, Comparison::kCache, shape, {r8, read});
      }
      if (have_source_reference) {
        const OutputView rs{rs_out, rs_lse};
        judge.compare(site, Comparison::kQuantization, shape, {rs, r8});
        if (backend_output) {
          judge.compare(site, Comparison::kTotal, shape, {rs, {backend_out, backend_lse}});
        }
      }
      if (tensors.out || tensors.lse) {
        // out and lse are captured independently: an lse-only capture is compared on lse alone
        // (an out shape with no dims).
        const std::vector<double> captured_out =
            tensors.out ? widen(*tensors.out) : std::vector<double>{};
        const std::vector<double> captured_lse =
            tensors.lse ? widen(*tensors.lse) : std::vector<double>{};
        const TensorShape3 captured_shape{nq, num_heads, tensors.out ? dc : 0};
        const OutputView reference{
            tensors.out ? std::span<const double>(r8_out) : std::span<const double>(),
            tensors.lse ? std::span<const double>(r8_lse) : std::span<const double>()};
        judge.compare(site, Comparison::kCaptured, captured_shape,
                      {reference, {captured_out, captured_lse}});
      }

      if (options.observer) {
        StepLayerOutputs outputs;
        outputs.step = step_number;
        outputs.layer_id = layer.layer_id;
        outputs.shape = shape;
        outputs.reference_out = r8_out;
        outputs.reference_lse = r8_lse;
        if (have_source_reference) {
          outputs.reference_source_out = rs_out;
          outputs.reference_source_lse = rs_lse;
        }
        outputs.backend = backend_output ? &*backend_output : nullptr;
        KVAUDIT_TRY(options.observer(outputs));
      }
    }
  }
  run.total_seconds = seconds_since(total_start);
  return run;
}

}  // namespace kvaudit
