// The repro writer of `kvaudit check --emit-repro` (see repro.hpp). Pools [S, D] as stored bytes,
// per-row tensors sliced by the original qo_indptr: q_nope rows of H * Dc, q_pe rows of H * Dr,
// new_kv rows of D, out rows of H * Dc, lse rows of H. Values are copied, never recomputed, so
// there is no rounding and no tolerance here.
#include "src/report/repro.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <tuple>
#include <unordered_map>

#include "src/verdict/check_result.hpp"

namespace kvaudit {
namespace {

// Position of a layer id in dump order (the order the replay reports layers in).
int layer_order(const DumpLayout& layout, int layer_id) {
  const int index = layout.layer_index_of_id(layer_id);
  return index < 0 ? static_cast<int>(layout.layers.size()) : index;
}

// Requests whose new_kv_slots at this step hold `slot`.
std::vector<int> writers_of_slot(const StepMeta& step, std::int64_t slot) {
  std::vector<int> requests;
  for (int row = 0; row < step.num_rows(); ++row) {
    if (step.new_kv_slots[row] == slot) requests.push_back(step.request_of_row(row));
  }
  return requests;
}

// Copies `count` elements per row for the rows [begin, end) of `source` onto `target`.
template <typename T>
void append_rows(const std::vector<T>& source, std::size_t per_row, int begin, int end,
                 std::vector<T>& target) {
  target.insert(target.end(), source.begin() + static_cast<std::ptrdiff_t>(begin * per_row),
                source.begin() + static_cast<std::ptrdiff_t>(end * per_row));
}

// The pages of `pages` (original ids -> repro ids) copied out of a pool of the same dtype/width.
KvPool gather_pages(const KvPool& pool, const std::vector<std::int32_t>& pages, int page_size) {
  KvPool kept = pool.zeros_like(static_cast<std::int64_t>(pages.size()) * page_size);
  const std::size_t page_bytes = pool.row_bytes() * page_size;
  for (std::size_t i = 0; i < pages.size(); ++i) {
    std::memcpy(kept.bytes.data() + i * page_bytes,
                pool.bytes.data() + static_cast<std::size_t>(pages[i]) * page_bytes, page_bytes);
  }
  return kept;
}

// ---- the first failure -------------------------------------------------------------------------

// The (step, layer in dump order) of a run's first failure, and what is known about it there.
class FirstFailure {
 public:
  FirstFailure(const DumpLayout& layout, int step, int order)
      : layout_(layout), step_(step), order_(order) {}

  // The earliest (step, layer order) among the first divergence, failing integrity findings and
  // comparisons that fail the run; none when the run passed or names no step of the dump.
  static std::optional<FirstFailure> of(const DumpLayout& layout, const CheckRun& run) {
    std::optional<std::tuple<int, int>> first;
    auto consider = [&](int step, int layer_id) {
      const std::tuple<int, int> key{step, layer_order(layout, layer_id)};
      if (!first || key < *first) first = key;
    };
    if (run.first_divergence) consider(run.first_divergence->step, run.first_divergence->layer_id);
    // A repro leaves the indexer cache out (docs/kvdump-v1.md), so its failures are not targets.
    for (const IntegrityFinding& finding : run.integrity) {
      if (!finding.pass && !is_indexer_check(finding.check)) {
        consider(finding.step, finding.layer_id);
      }
    }
    for (const ComparisonResult& result : run.comparisons) {
      if (fails_run(result)) consider(result.step, result.layer_id);
    }
    if (!first) return std::nullopt;
    const auto [step, order] = *first;
    if (step < 0 || static_cast<std::size_t>(step) >= layout.steps.size() ||
        order >= static_cast<int>(layout.layers.size())) {
      return std::nullopt;
    }
    return FirstFailure(layout, step, order);
  }

  int step() const { return step_; }
  int layer_id() const { return layout_.layers[order_].layer_id; }
  const StepMeta& step_meta() const { return layout_.steps[step_]; }
  bool here(int step, int layer_id) const {
    return step == step_ && layer_order(layout_, layer_id) == order_;
  }

 private:
  const DumpLayout& layout_;
  int step_;
  int order_;
};

// What failed first and the requests to keep, in order of preference: the first divergence's
// request; for an integrity failure, the requests that wrote its first offending slot; the worst
// request of a failing comparison; the first request of the step with query rows.
struct FailureNames {
  std::vector<int> requests;
  std::string failure;
};

void name_divergence(const FirstFailure& at, const CheckRun& run, FailureNames& names) {
  if (!run.first_divergence ||
      !at.here(run.first_divergence->step, run.first_divergence->layer_id)) {
    return;
  }
  const Divergence& d = *run.first_divergence;
  if (d.request >= 0) names.requests.push_back(d.request);
  names.failure = fmt::format("first divergence ({}) at row {} head {}",
                              comparison_name(d.comparison), d.row, d.head);
}

// The first failing integrity finding here: the requests that wrote its first offending slot.
void name_integrity_failure(const FirstFailure& at, const CheckRun& run, FailureNames& names) {
  for (const IntegrityFinding& finding : run.integrity) {
    if (finding.pass || is_indexer_check(finding.check) ||
        !at.here(finding.step, finding.layer_id)) {
      continue;
    }
    if (!finding.slots.empty()) {
      for (const int b : writers_of_slot(at.step_meta(), finding.slots.front())) {
        names.requests.push_back(b);
      }
    }
    if (names.failure.empty()) {
      names.failure = fmt::format("{} integrity", integrity_check_name(finding.check));
    }
    return;
  }
}

void name_comparison_failure(const FirstFailure& at, const CheckRun& run, FailureNames& names) {
  for (const ComparisonResult& result : run.comparisons) {
    if (!fails_run(result) || !at.here(result.step, result.layer_id)) continue;
    if (result.worst_request >= 0) names.requests.push_back(result.worst_request);
    if (names.failure.empty()) {
      names.failure = fmt::format("{} comparison", comparison_name(result.comparison));
    }
    return;
  }
}

std::vector<int> first_request_with_rows(const StepMeta& step) {
  for (int b = 0; b < step.batch_size(); ++b) {
    if (step.rows_of(b) > 0) return {b};
  }
  return step.batch_size() > 0 ? std::vector<int>{0} : std::vector<int>{};
}

// ---- the repro ---------------------------------------------------------------------------------

// The pages the kept requests use at the failing step, renumbered 0..P-1 in order of first use.
class KeptPages {
 public:
  KeptPages(const StepMeta& step, const std::vector<int>& requests, int page_size)
      : page_size_(page_size) {
    for (const int b : requests) {
      for (int k = step.kv_indptr[b]; k < step.kv_indptr[b + 1]; ++k) {
        const std::int32_t p = step.kv_indices[k];
        if (map_.emplace(p, static_cast<std::int32_t>(pages_.size())).second) pages_.push_back(p);
      }
    }
  }
  const std::vector<std::int32_t>& pages() const { return pages_; }  // original ids, in order
  std::int64_t num_slots() const { return static_cast<std::int64_t>(pages_.size()) * page_size_; }
  std::int32_t page(std::int32_t original) const { return map_.at(original); }
  // The repro slot of an original slot, -1 when its page is not kept.
  std::int64_t slot(std::int64_t original) const {
    const auto it = map_.find(static_cast<std::int32_t>(original / page_size_));
    return it == map_.end() ? -1 : std::int64_t{it->second} * page_size_ + original % page_size_;
  }
  // "3-5,9": every original page, runs of consecutive pages as first-last.
  std::string list() const {
    std::string text;
    for (std::size_t i = 0; i < pages_.size();) {
      std::size_t j = i;
      while (j + 1 < pages_.size() && pages_[j + 1] == pages_[j] + 1) ++j;
      if (i > 0) text += ',';
      text += j > i ? fmt::format("{}-{}", pages_[i], pages_[j]) : std::to_string(pages_[i]);
      i = j + 1;
    }
    return text;
  }

 private:
  int page_size_;
  std::vector<std::int32_t> pages_;
  std::unordered_map<std::int32_t, std::int32_t> map_;
};

// The reference pool just before the failing step, on the kept pages, and the source values.
struct KeptPool {
  KvPool pool;
  std::vector<float> source;       // [kept slots, D]
  std::vector<char> source_known;  // per kept slot
  bool source_complete() const {
    return std::all_of(source_known.begin(), source_known.end(), [](char known) { return known; });
  }
};

// kv_cache, then every earlier step's writes with the kvdump write rule, restricted to the kept
// pages; the source values alongside (the dump's kv_source, or the values the writes stored).
Result<KeptPool> reference_pool_before(const DumpReader& reader, std::size_t li, std::size_t si,
                                       const KeptPages& kept, bool reciprocal_scale) {
  const DumpLayout& layout = reader.layout();
  const LayerMeta& layer = layout.layers[li];
  const int page = layout.attrs.page_size;
  const int width = layout.attrs.row_width();
  KeptPool result;
  {
    KVAUDIT_ASSIGN_OR_RETURN(const KvPool pool, reader.read_pool(li));
    result.pool = gather_pages(pool, kept.pages(), page);
  }
  result.source.assign(static_cast<std::size_t>(kept.num_slots()) * width, 0.0f);
  result.source_known.assign(static_cast<std::size_t>(kept.num_slots()), 0);
  if (layer.has_source) {
    KVAUDIT_ASSIGN_OR_RETURN(const CachedFloats dense, reader.read_source(li));
    const std::size_t page_values = static_cast<std::size_t>(page) * width;
    for (std::size_t i = 0; i < kept.pages().size(); ++i) {
      std::copy_n(dense.begin() + static_cast<std::ptrdiff_t>(kept.pages()[i] * page_values),
                  page_values,
                  result.source.begin() + static_cast<std::ptrdiff_t>(i * page_values));
    }
    std::fill(result.source_known.begin(), result.source_known.end(), 1);
  }
  for (std::size_t k = 0; k < si; ++k) {
    const StepMeta& earlier = layout.steps[k];
    KVAUDIT_ASSIGN_OR_RETURN(const StepLayerTensors tensors, reader.read_step_layer(k, li));
    for (int row = 0; row < earlier.num_rows(); ++row) {
      const std::int64_t slot = kept.slot(earlier.new_kv_slots[row]);
      if (slot < 0) continue;
      const float* values = tensors.new_kv.data() + static_cast<std::size_t>(row) * width;
      result.pool.write_row(slot, values, layer.kv_scale, reciprocal_scale);
      std::copy_n(values, width, result.source.begin() + slot * width);
      result.source_known[slot] = 1;
    }
  }
  return result;
}

// The failing step as S000, restricted to the kept requests and renumbered pages.
StepMeta restrict_step(const StepMeta& step, const std::vector<int>& requests,
                       const KeptPages& kept) {
  StepMeta repro;
  repro.group = step_group_name(0);
  repro.kind = step.kind;
  repro.qo_indptr = {0};
  repro.kv_indptr = {0};
  for (const int b : requests) {
    repro.qo_indptr.push_back(repro.qo_indptr.back() + step.rows_of(b));
    for (int k = step.kv_indptr[b]; k < step.kv_indptr[b + 1]; ++k) {
      repro.kv_indices.push_back(kept.page(step.kv_indices[k]));
    }
    repro.kv_indptr.push_back(static_cast<std::int32_t>(repro.kv_indices.size()));
    repro.kv_last_page_len.push_back(step.kv_last_page_len[b]);
    for (int row = step.qo_indptr[b]; row < step.qo_indptr[b + 1]; ++row) {
      repro.new_kv_slots.push_back(static_cast<std::int32_t>(kept.slot(step.new_kv_slots[row])));
    }
  }
  return repro;
}

// The failing step's tensors, restricted to the kept requests' rows and the kept pages.
StepLayerTensors restrict_tensors(const StepLayerTensors& tensors, const DumpAttributes& attrs,
                                  const StepMeta& step, const std::vector<int>& requests,
                                  const KeptPages& kept) {
  const std::size_t heads = static_cast<std::size_t>(attrs.num_heads);
  const std::size_t dc = static_cast<std::size_t>(attrs.kv_lora_rank);
  const std::size_t dr = static_cast<std::size_t>(attrs.qk_rope_head_dim);
  StepLayerTensors restricted;
  if (tensors.out) restricted.out.emplace();
  if (tensors.lse) restricted.lse.emplace();
  for (const int b : requests) {
    const int begin = step.qo_indptr[b];
    const int end = step.qo_indptr[b + 1];
    append_rows(tensors.q_nope, heads * dc, begin, end, restricted.q_nope);
    append_rows(tensors.q_pe, heads * dr, begin, end, restricted.q_pe);
    append_rows(tensors.new_kv, static_cast<std::size_t>(attrs.row_width()), begin, end,
                restricted.new_kv);
    if (tensors.out) append_rows(*tensors.out, heads * dc, begin, end, *restricted.out);
    if (tensors.lse) append_rows(*tensors.lse, heads, begin, end, *restricted.lse);
    if (tensors.sparse()) {  // v1.1: token positions of the request, valid as they are
      const auto k = static_cast<std::size_t>(tensors.topk);
      restricted.topk_indices.insert(restricted.topk_indices.end(),
                                     tensors.topk_indices.begin() + begin * k,
                                     tensors.topk_indices.begin() + end * k);
    }
  }
  restricted.topk = tensors.topk;
  if (tensors.kv_cache_after) {
    restricted.kv_cache_after =
        gather_pages(*tensors.kv_cache_after, kept.pages(), attrs.page_size);
  }
  return restricted;
}

// Everything the repro file holds.
struct Repro {
  DumpAttributes attrs;
  LayerMeta layer;
  KeptPool pool;
  StepMeta step;
  StepLayerTensors tensors;
  std::int64_t num_pages = 0;
};

// Writes the repro to `path`; DumpWriter renames it there only once complete, so a failure leaves
// no half-written file (and an existing file unchanged).
Status write_repro_file(const std::filesystem::path& path, const Repro& repro) {
  const bool keep_source = repro.layer.has_source;
  KVAUDIT_ASSIGN_OR_RETURN(DumpWriter writer,
                           DumpWriter::create(path, repro.attrs, repro.num_pages));
  KVAUDIT_TRY(
      writer.write_layer(repro.layer, repro.pool.pool, keep_source ? &repro.pool.source : nullptr));
  KVAUDIT_TRY(writer.write_step(repro.step));
  KVAUDIT_TRY(writer.write_step_layer(repro.step, repro.layer, repro.tensors));
  return writer.close();
}

}  // namespace

std::optional<ReproTarget> first_failure_target(const DumpLayout& layout, const CheckRun& run) {
  const std::optional<FirstFailure> at = FirstFailure::of(layout, run);
  if (!at) return std::nullopt;
  FailureNames names;
  name_divergence(*at, run, names);
  name_integrity_failure(*at, run, names);
  if (names.requests.empty()) name_comparison_failure(*at, run, names);
  if (names.requests.empty()) names.requests = first_request_with_rows(at->step_meta());
  std::sort(names.requests.begin(), names.requests.end());
  names.requests.erase(std::unique(names.requests.begin(), names.requests.end()),
                       names.requests.end());
  ReproTarget target;
  target.step = at->step();
  target.layer_id = at->layer_id();
  target.requests = std::move(names.requests);
  target.failure = std::move(names.failure);
  return target;
}

Result<ReproSummary> write_repro(const DumpReader& reader, const ReproTarget& target,
                                 const std::filesystem::path& path, const std::string& producer) {
  const DumpLayout& layout = reader.layout();
  const int li_signed = layout.layer_index_of_id(target.layer_id);
  if (li_signed < 0 || target.step < 0 ||
      static_cast<std::size_t>(target.step) >= layout.steps.size()) {
    return internal_error(path.string(), "repro target is not in the dump");
  }
  const auto li = static_cast<std::size_t>(li_signed);
  const auto si = static_cast<std::size_t>(target.step);
  const StepMeta& step = layout.steps[si];
  for (const int b : target.requests) {
    if (b < 0 || b >= step.batch_size()) {
      return internal_error(path.string(), fmt::format("repro request {} is not in the step", b));
    }
  }
  const KeptPages kept(step, target.requests, layout.attrs.page_size);

  Repro repro;
  KVAUDIT_ASSIGN_OR_RETURN(repro.pool,
                           reference_pool_before(reader, li, si, kept, target.reciprocal_scale));
  repro.step = restrict_step(step, target.requests, kept);
  {
    KVAUDIT_ASSIGN_OR_RETURN(const StepLayerTensors tensors, reader.read_step_layer(si, li));
    repro.tensors = restrict_tensors(tensors, layout.attrs, step, target.requests, kept);
  }
  repro.step.has_out = {repro.tensors.out.has_value()};
  repro.step.has_lse = {repro.tensors.lse.has_value()};
  repro.step.has_kv_cache_after = {repro.tensors.kv_cache_after.has_value()};
  const LayerMeta& layer = layout.layers[li];
  repro.layer.group = layer_group_name(layer.layer_id);
  repro.layer.layer_id = layer.layer_id;
  repro.layer.kv_scale = layer.kv_scale;
  repro.layer.has_source = repro.pool.source_complete();
  repro.num_pages = static_cast<std::int64_t>(kept.pages().size());
  repro.attrs = layout.attrs;
  // Where the kept pages came from, so a slot the repro names maps back to the original: repro
  // slot s is original slot pages[s / page_size] * page_size + s % page_size.
  repro.attrs.producer =
      fmt::format("{}; repro pages 0..{} are original pages {} in that order (page size {})",
                  producer, repro.num_pages - 1, kept.list(), layout.attrs.page_size);
  KVAUDIT_TRY(write_repro_file(path, repro));

  ReproSummary summary;
  summary.num_pages = repro.num_pages;
  summary.num_rows = repro.step.num_rows();
  summary.has_source = repro.layer.has_source;
  return summary;
}

}  // namespace kvaudit
