// The repro writer of `kvaudit check --emit-repro` (see repro.hpp). Pools [S, D] as stored bytes,
// per-row tensors sliced by the original qo_indptr: q_nope rows of H * Dc, q_pe rows of H * Dr,
// new_kv rows of D, out rows of H * Dc, lse rows of H. Values are copied, never recomputed, so
// there is no rounding and no tolerance here.
#include "src/report/repro.hpp"

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
  KvPool kept = KvPool::zeros(pool.dtype, static_cast<std::int64_t>(pages.size()) * page_size,
                              pool.row_width);
  const std::size_t page_bytes = pool.row_bytes() * page_size;
  for (std::size_t i = 0; i < pages.size(); ++i) {
    std::memcpy(kept.bytes.data() + i * page_bytes,
                pool.bytes.data() + static_cast<std::size_t>(pages[i]) * page_bytes, page_bytes);
  }
  return kept;
}

}  // namespace

std::optional<ReproTarget> first_failure_target(const DumpLayout& layout, const CheckRun& run) {
  using Key = std::tuple<int, int>;  // (step, layer order)
  std::optional<Key> first;
  auto consider = [&](int step, int layer_id) {
    const Key key{step, layer_order(layout, layer_id)};
    if (!first || key < *first) first = key;
  };
  if (run.first_divergence) {
    consider(run.first_divergence->step, run.first_divergence->layer_id);
  }
  for (const IntegrityFinding& finding : run.integrity) {
    if (!finding.pass) consider(finding.step, finding.layer_id);
  }
  for (const ComparisonResult& result : run.comparisons) {
    if (fails_run(result)) consider(result.step, result.layer_id);
  }
  if (!first) return std::nullopt;

  const auto [step_index, order] = *first;
  if (step_index < 0 || static_cast<std::size_t>(step_index) >= layout.steps.size() ||
      order >= static_cast<int>(layout.layers.size())) {
    return std::nullopt;
  }
  const StepMeta& step = layout.steps[step_index];
  ReproTarget target;
  target.step = step_index;
  target.layer_id = layout.layers[order].layer_id;
  auto here = [&](int s, int layer_id) {
    return s == step_index && layer_order(layout, layer_id) == order;
  };
  std::vector<int> requests;
  if (run.first_divergence && here(run.first_divergence->step, run.first_divergence->layer_id)) {
    const Divergence& d = *run.first_divergence;
    if (d.request >= 0) requests.push_back(d.request);
    target.failure = "first divergence (" + std::string(comparison_name(d.comparison)) +
                     ") at row " + std::to_string(d.row) + " head " + std::to_string(d.head);
  }
  // The first failing integrity finding here: the requests that wrote its first offending slot.
  for (const IntegrityFinding& finding : run.integrity) {
    if (finding.pass || !here(finding.step, finding.layer_id)) continue;
    if (!finding.slots.empty()) {
      for (const int b : writers_of_slot(step, finding.slots.front())) requests.push_back(b);
    }
    if (target.failure.empty())
      target.failure = std::string(integrity_check_name(finding.check)) + " integrity";
    break;
  }
  if (requests.empty()) {
    for (const ComparisonResult& result : run.comparisons) {
      if (!fails_run(result) || !here(result.step, result.layer_id)) continue;
      if (result.worst_request >= 0) requests.push_back(result.worst_request);
      if (target.failure.empty()) {
        target.failure = std::string(comparison_name(result.comparison)) + " comparison";
      }
      break;
    }
  }
  if (requests.empty()) {
    for (int b = 0; b < step.batch_size(); ++b) {
      if (step.rows_of(b) > 0) {
        requests.push_back(b);
        break;
      }
    }
  }
  if (requests.empty() && step.batch_size() > 0) requests.push_back(0);
  std::sort(requests.begin(), requests.end());
  requests.erase(std::unique(requests.begin(), requests.end()), requests.end());
  target.requests = std::move(requests);
  return target;
}

Result<ReproSummary> write_repro(const DumpReader& reader, const ReproTarget& target,
                                 const std::filesystem::path& path, const std::string& producer) {
  const DumpLayout& layout = reader.layout();
  const DumpAttributes& attrs = layout.attrs;
  const std::string where = path.string();
  const int li_signed = layout.layer_index_of_id(target.layer_id);
  if (li_signed < 0 || target.step < 0 ||
      static_cast<std::size_t>(target.step) >= layout.steps.size()) {
    return internal_error(where, "repro target is not in the dump");
  }
  const auto li = static_cast<std::size_t>(li_signed);
  const auto si = static_cast<std::size_t>(target.step);
  const LayerMeta& layer = layout.layers[li];
  const StepMeta& step = layout.steps[si];
  const int page = attrs.page_size;
  const int width = attrs.row_width();
  for (const int b : target.requests) {
    if (b < 0 || b >= step.batch_size()) {
      return internal_error(where, "repro request " + std::to_string(b) + " is not in the step");
    }
  }

  // Pages the kept requests use at the failing step, renumbered in order of first use.
  std::vector<std::int32_t> pages;
  std::unordered_map<std::int32_t, std::int32_t> page_map;
  for (const int b : target.requests) {
    for (int k = step.kv_indptr[b]; k < step.kv_indptr[b + 1]; ++k) {
      const std::int32_t p = step.kv_indices[k];
      if (page_map.emplace(p, static_cast<std::int32_t>(pages.size())).second) pages.push_back(p);
    }
  }
  auto map_slot = [&](std::int64_t slot) -> std::int64_t {
    const auto it = page_map.find(static_cast<std::int32_t>(slot / page));
    return it == page_map.end() ? -1 : std::int64_t{it->second} * page + slot % page;
  };
  const std::int64_t kept_slots = static_cast<std::int64_t>(pages.size()) * page;

  // The reference pool before the failing step: kv_cache, then every earlier step's writes with
  // the kvdump write rule, restricted to the kept pages; the source values alongside.
  auto pool = reader.read_pool(li);
  if (!pool.ok()) return pool.error();
  KvPool kept_pool = gather_pages(pool.value(), pages, page);
  pool.value().bytes = {};
  std::vector<float> source(static_cast<std::size_t>(kept_slots) * width, 0.0f);
  std::vector<char> source_known(static_cast<std::size_t>(kept_slots), 0);
  if (layer.has_source) {
    auto dense = reader.read_source(li);
    if (!dense.ok()) return dense.error();
    for (std::size_t i = 0; i < pages.size(); ++i) {
      const std::size_t page_values = static_cast<std::size_t>(page) * width;
      std::copy_n(dense->begin() + static_cast<std::ptrdiff_t>(pages[i] * page_values), page_values,
                  source.begin() + static_cast<std::ptrdiff_t>(i * page_values));
    }
    std::fill(source_known.begin(), source_known.end(), 1);
  }
  for (std::size_t k = 0; k < si; ++k) {
    const StepMeta& earlier = layout.steps[k];
    auto tensors = reader.read_step_layer(k, li);
    if (!tensors.ok()) return tensors.error();
    for (int row = 0; row < earlier.num_rows(); ++row) {
      const std::int64_t slot = map_slot(earlier.new_kv_slots[row]);
      if (slot < 0) continue;
      const float* values = tensors->new_kv.data() + static_cast<std::size_t>(row) * width;
      kept_pool.write_row(slot, values, layer.kv_scale, target.reciprocal_scale);
      std::copy_n(values, width, source.begin() + slot * width);
      source_known[slot] = 1;
    }
  }
  const bool keep_source =
      std::all_of(source_known.begin(), source_known.end(), [](char known) { return known; });

  // The failing step, restricted to the kept requests.
  StepMeta repro_step;
  repro_step.group = step_group_name(0);
  repro_step.kind = step.kind;
  repro_step.qo_indptr = {0};
  repro_step.kv_indptr = {0};
  for (const int b : target.requests) {
    repro_step.qo_indptr.push_back(repro_step.qo_indptr.back() + step.rows_of(b));
    for (int k = step.kv_indptr[b]; k < step.kv_indptr[b + 1]; ++k) {
      repro_step.kv_indices.push_back(page_map.at(step.kv_indices[k]));
    }
    repro_step.kv_indptr.push_back(static_cast<std::int32_t>(repro_step.kv_indices.size()));
    repro_step.kv_last_page_len.push_back(step.kv_last_page_len[b]);
    for (int row = step.qo_indptr[b]; row < step.qo_indptr[b + 1]; ++row) {
      repro_step.new_kv_slots.push_back(
          static_cast<std::int32_t>(map_slot(step.new_kv_slots[row])));
    }
  }

  auto read = reader.read_step_layer(si, li);
  if (!read.ok()) return read.error();
  const StepLayerTensors& tensors = read.value();
  const std::size_t heads = static_cast<std::size_t>(attrs.num_heads);
  const std::size_t dc = static_cast<std::size_t>(attrs.kv_lora_rank);
  const std::size_t dr = static_cast<std::size_t>(attrs.qk_rope_head_dim);
  StepLayerTensors kept;
  if (tensors.out) kept.out.emplace();
  if (tensors.lse) kept.lse.emplace();
  for (const int b : target.requests) {
    const int begin = step.qo_indptr[b];
    const int end = step.qo_indptr[b + 1];
    append_rows(tensors.q_nope, heads * dc, begin, end, kept.q_nope);
    append_rows(tensors.q_pe, heads * dr, begin, end, kept.q_pe);
    append_rows(tensors.new_kv, static_cast<std::size_t>(width), begin, end, kept.new_kv);
    if (tensors.out) append_rows(*tensors.out, heads * dc, begin, end, *kept.out);
    if (tensors.lse) append_rows(*tensors.lse, heads, begin, end, *kept.lse);
  }
  if (tensors.kv_cache_after)
    kept.kv_cache_after = gather_pages(*tensors.kv_cache_after, pages, page);
  repro_step.has_out = {kept.out.has_value()};
  repro_step.has_lse = {kept.lse.has_value()};
  repro_step.has_kv_cache_after = {kept.kv_cache_after.has_value()};

  LayerMeta repro_layer;
  repro_layer.group = layer_group_name(layer.layer_id);
  repro_layer.layer_id = layer.layer_id;
  repro_layer.kv_scale = layer.kv_scale;
  repro_layer.has_source = keep_source;

  DumpAttributes repro_attrs = attrs;
  // Where the kept pages came from, so a slot the repro names maps back to the original: repro
  // slot s is original slot pages[s / page_size] * page_size + s % page_size. Every page is listed
  // (runs of consecutive pages as first-last).
  std::string page_list;
  for (std::size_t i = 0; i < pages.size();) {
    std::size_t j = i;
    while (j + 1 < pages.size() && pages[j + 1] == pages[j] + 1) ++j;
    if (i > 0) page_list += ',';
    page_list += std::to_string(pages[i]);
    if (j > i) {
      page_list += '-';
      page_list += std::to_string(pages[j]);
    }
    i = j + 1;
  }
  repro_attrs.producer = producer + "; repro pages 0.." +
                         std::to_string(static_cast<std::int64_t>(pages.size()) - 1) +
                         " are original pages " + page_list + " in that order (page size " +
                         std::to_string(page) + ")";
  auto written = [&]() -> Status {
    auto writer = DumpWriter::create(path, repro_attrs, static_cast<std::int64_t>(pages.size()));
    if (!writer.ok()) return writer.error();
    KVAUDIT_TRY(writer->write_layer(repro_layer, kept_pool, keep_source ? &source : nullptr));
    KVAUDIT_TRY(writer->write_step(repro_step));
    KVAUDIT_TRY(writer->write_step_layer(repro_step, repro_layer, kept));
    return writer->close();
  }();
  if (!written.ok()) {
    std::error_code ignored;
    std::filesystem::remove(path, ignored);
    return written.error();
  }
  ReproSummary summary;
  summary.num_pages = static_cast<std::int64_t>(pages.size());
  summary.num_rows = repro_step.num_rows();
  summary.has_source = keep_source;
  return summary;
}

}  // namespace kvaudit
