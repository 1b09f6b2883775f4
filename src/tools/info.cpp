// `kvaudit info` summary of a kvdump (see info.hpp for the JSON schema).
#include "src/tools/info.hpp"

#include <fmt/format.h>

#include <cmath>
#include <set>
#include <string>
#include <vector>

namespace kvaudit {
namespace {

nlohmann::json shapes_info(const DumpLayout& layout) {
  const DumpAttributes& a = layout.attrs;
  return {{"num_heads", a.num_heads},
          {"kv_lora_rank", a.kv_lora_rank},
          {"qk_rope_head_dim", a.qk_rope_head_dim},
          {"page_size", a.page_size},
          {"num_pages", layout.num_pages},
          {"num_slots", layout.num_slots()},
          {"kv_dtype", kv_dtype_name(a.kv_dtype)},
          {"kv_scale_kind", a.kv_scale_kind},
          {"sm_scale", a.sm_scale}};
}

// v1.1: the per_token_group pool's form (null for a per_tensor dump).
nlohmann::json group_scales_info(const DumpAttributes& a) {
  if (!a.per_token_group()) return nullptr;
  return {{"group_size", a.kv_scale_group_size},
          {"groups", a.num_scale_groups()},
          {"scale_format", group_scale_format_name(a.kv_scale_format)},
          {"rope_dtype", kv_dtype_name(a.kv_rope_dtype)},
          {"layout", pool_layout_name(a.kv_cache_layout)}};
}

// The NaN values of a layer's kv_source [S, D]: a NaN there makes Rs NaN for every row that reads
// the slot, whatever the pool holds (the source's fault, not a kernel's). null without kv_source.
Result<nlohmann::json> source_nan_info(const DumpReader& reader, std::size_t layer_index) {
  if (!reader.layout().layers[layer_index].has_source) return nlohmann::json(nullptr);
  KVAUDIT_ASSIGN_OR_RETURN(const CachedFloats source, reader.read_source(layer_index));
  const std::size_t width = static_cast<std::size_t>(reader.layout().attrs.row_width());
  constexpr std::size_t kListed = 8;
  std::int64_t values = 0;
  std::int64_t slot_count = 0;
  nlohmann::json slots = nlohmann::json::array();
  for (std::size_t slot = 0; width > 0 && slot < source.size() / width; ++slot) {
    std::int64_t in_slot = 0;
    for (std::size_t c = 0; c < width; ++c) in_slot += std::isnan(source[slot * width + c]);
    if (in_slot == 0) continue;
    values += in_slot;
    if (slots.size() < kListed) slots.push_back(slot);
    ++slot_count;
  }
  return nlohmann::json{{"values", values}, {"slot_count", slot_count}, {"slots", slots}};
}

// One layer, with the codes of its initial pool and the NaN values of its kv_source (read here).
// v1.2: the layer's indexer key cache, or null.
nlohmann::json indexer_info(const LayerMeta& layer) {
  if (!layer.indexer) return nullptr;
  const IndexerMeta& m = *layer.indexer;
  return {{"n_heads", m.n_heads},
          {"head_dim", m.head_dim},
          {"block_size", m.block_size},
          {"topk", m.topk},
          {"scale_format", index_scale_format_name(m.scale_format)},
          {"rotation", index_rotation_name(m.rotation)},
          {"softmax_scale", m.softmax_scale}};
}

Result<nlohmann::json> layer_info(const DumpReader& reader, std::size_t layer_index) {
  const DumpLayout& layout = reader.layout();
  const LayerMeta& layer = layout.layers[layer_index];
  KVAUDIT_ASSIGN_OR_RETURN(const KvPool pool, reader.read_pool(layer_index));
  const PoolCodeCounts counts = count_pool_codes(pool);
  nlohmann::json entry = {{"group", layer.group},
                          {"layer_id", layer.layer_id},
                          {"kv_scale", layer.kv_scale},
                          {"has_kv_source", layer.has_source},
                          {"nan_codes", counts.nan}};
  if (layout.attrs.kv_dtype == KvDtype::kFloat8E4m3fn) {
    entry["saturated_codes"] = counts.saturated;
  } else {
    entry["saturated_codes"] = nullptr;
  }
  if (layout.attrs.per_token_group()) entry["nan_scales"] = counts.nan_scales;
  entry["indexer"] = indexer_info(layer);
  KVAUDIT_ASSIGN_OR_RETURN(entry["kv_source_nan"], source_nan_info(reader, layer_index));
  return entry;
}

nlohmann::json step_info(const DumpLayout& layout, const StepMeta& step) {
  std::int64_t tokens = 0;
  for (int b = 0; b < step.batch_size(); ++b) tokens += step.kv_len(b, layout.attrs.page_size);
  const std::set<std::int32_t> distinct(step.kv_indices.begin(), step.kv_indices.end());
  nlohmann::json captures = {{"out", nlohmann::json::array()},
                             {"lse", nlohmann::json::array()},
                             {"kv_cache_after", nlohmann::json::array()},
                             {"indexer_cache_after", nlohmann::json::array()}};
  for (std::size_t l = 0; l < layout.layers.size(); ++l) {
    if (step.has_out[l]) captures["out"].push_back(layout.layers[l].group);
    if (step.has_lse[l]) captures["lse"].push_back(layout.layers[l].group);
    if (step.has_kv_cache_after[l]) captures["kv_cache_after"].push_back(layout.layers[l].group);
    if (l < step.has_indexer_cache_after.size() && step.has_indexer_cache_after[l]) {
      captures["indexer_cache_after"].push_back(layout.layers[l].group);
    }
  }
  nlohmann::json topk = nlohmann::json::object();  // v1.1 sparse layers: group -> K
  for (std::size_t l = 0; l < layout.layers.size() && l < step.topk.size(); ++l) {
    if (step.topk[l] > 0) topk[layout.layers[l].group] = step.topk[l];
  }
  return {{"group", step.group},
          {"kind", step_kind_name(step.kind)},
          {"topk", std::move(topk)},
          {"requests", step.batch_size()},
          {"rows", step.num_rows()},
          {"tokens", tokens},
          {"page_refs", step.kv_indices.size()},
          {"pages_used", distinct.size()},
          {"captures", std::move(captures)}};
}

// v1.1: reads every topk_indices dataset, so that their values are checked by the rules of
// "Sparse attention" as `check` would check them (the first bad one is the error).
Status check_sparse_indices(const DumpReader& reader) {
  const DumpLayout& layout = reader.layout();
  for (std::size_t s = 0; s < layout.steps.size(); ++s) {
    for (std::size_t l = 0; l < layout.layers.size(); ++l) {
      KVAUDIT_TRY(reader.read_topk_indices(s, l));
    }
  }
  return ok_status();
}

}  // namespace

Result<nlohmann::json> dump_info(const DumpReader& reader) {
  KVAUDIT_TRY(check_sparse_indices(reader));
  const DumpLayout& layout = reader.layout();
  nlohmann::json info;
  info["file"] = reader.path().string();
  info["format_version"] = layout.format_version;
  info["format_minor_version"] = layout.format_minor_version;
  info["group_scales"] = group_scales_info(layout.attrs);
  info["model"] = layout.attrs.model;
  info["producer"] = layout.attrs.producer;
  info["shapes"] = shapes_info(layout);
  nlohmann::json layers = nlohmann::json::array();
  for (std::size_t l = 0; l < layout.layers.size(); ++l) {
    KVAUDIT_ASSIGN_OR_RETURN(nlohmann::json layer, layer_info(reader, l));
    layers.push_back(std::move(layer));
  }
  info["layers"] = std::move(layers);
  nlohmann::json steps = nlohmann::json::array();
  for (const StepMeta& step : layout.steps) steps.push_back(step_info(layout, step));
  info["steps"] = std::move(steps);
  return info;
}

namespace {

// "all" / "none" / "L000 L003" for a capture present in some layers.
std::string capture_text(const nlohmann::json& groups, std::size_t layer_count) {
  if (groups.empty()) return "none";
  if (groups.size() == layer_count) return "all";
  std::vector<std::string> names;
  for (const auto& group : groups) names.push_back(group.get<std::string>());
  return fmt::format("{}", fmt::join(names, " "));
}

// "yes", "no", "yes (1 NaN value in slot 2)", "yes (130 NaN values in slots 2, 9, ... (12 in
// all))".
std::string source_text(const nlohmann::json& layer) {
  if (!layer["has_kv_source"].get<bool>()) return "no";
  const nlohmann::json& nan = layer.value("kv_source_nan", nlohmann::json(nullptr));
  if (nan.is_null() || nan["values"].get<std::int64_t>() == 0) return "yes";
  const std::int64_t values = nan["values"].get<std::int64_t>();
  const std::int64_t slot_count = nan["slot_count"].get<std::int64_t>();
  std::vector<std::int64_t> slots;
  for (const auto& slot : nan["slots"]) slots.push_back(slot.get<std::int64_t>());
  const std::string more = static_cast<std::int64_t>(slots.size()) < slot_count
                               ? fmt::format(", ... ({} in all)", slot_count)
                               : "";
  return fmt::format("yes ({} NaN value{} in slot{} {}{})", values, values == 1 ? "" : "s",
                     slot_count == 1 ? "" : "s", fmt::join(slots, ", "), more);
}

// "" without an indexer cache; else (v1.2) a line of its own:
// "        indexer: 32 heads x 128, top-2048, e4m3 + power_of_two scale per 128, hadamard".
std::string indexer_text(const nlohmann::json& layer) {
  if (!layer.contains("indexer") || layer["indexer"].is_null()) return "";
  const auto& x = layer["indexer"];
  return fmt::format("        indexer: {} heads x {}, top-{}, e4m3 + {} scale per {}, {}\n",
                     x["n_heads"].get<int>(), x["head_dim"].get<int>(), x["topk"].get<int>(),
                     x["scale_format"].get<std::string>(), x["block_size"].get<int>(),
                     x["rotation"].get<std::string>());
}

std::string layer_line(const nlohmann::json& layer) {
  const auto& saturated = layer["saturated_codes"];
  const std::string nan_scales =
      layer.contains("nan_scales")
          ? fmt::format("  nan_scales={}", layer["nan_scales"].get<std::int64_t>())
          : std::string();
  return fmt::format(
             "  {}  layer_id={}  kv_scale={:.9g}  kv_source={}  nan_codes={}  "
             "saturated_codes={}{}\n",
             layer["group"].get<std::string>(), layer["layer_id"].get<int>(),
             layer["kv_scale"].get<double>(), source_text(layer),
             layer["nan_codes"].get<std::int64_t>(),
             saturated.is_null() ? std::string("n/a")
                                 : std::to_string(saturated.get<std::int64_t>()),
             nan_scales) +
         indexer_text(layer);
}

// "" for a dense step; "    sparse: L000 top-64, L001 top-64" (v1.1) on a line of its own.
std::string topk_text(const nlohmann::json& step) {
  if (!step.contains("topk") || step["topk"].empty()) return "";
  std::vector<std::string> layers;
  for (const auto& [group, k] : step["topk"].items()) {
    layers.push_back(fmt::format("{} top-{}", group, k.get<int>()));
  }
  return fmt::format("        sparse: {}\n", fmt::join(layers, ", "));
}

// "" for a dump without an indexer cache captured after a step; else "  indexer_cache_after=all".
std::string indexer_after_text(const nlohmann::json& captures, std::size_t layer_count) {
  if (!captures.contains("indexer_cache_after") || captures["indexer_cache_after"].empty()) {
    return "";
  }
  return "  indexer_cache_after=" + capture_text(captures["indexer_cache_after"], layer_count);
}

std::string step_line(const nlohmann::json& step, std::size_t layer_count) {
  const auto& c = step["captures"];
  return fmt::format(
             "  {}  {}  requests={}  rows={}  tokens={}  pages_used={}  page_refs={}  out={}  "
             "lse={}  "
             "kv_cache_after={}{}\n",
             step["group"].get<std::string>(), step["kind"].get<std::string>(),
             step["requests"].get<int>(), step["rows"].get<int>(),
             step["tokens"].get<std::int64_t>(), step["pages_used"].get<std::int64_t>(),
             step["page_refs"].get<std::int64_t>(), capture_text(c["out"], layer_count),
             capture_text(c["lse"], layer_count), capture_text(c["kv_cache_after"], layer_count),
             indexer_after_text(c, layer_count)) +
         topk_text(step);
}

}  // namespace

std::string format_dump_info(const nlohmann::json& info) {
  const auto& s = info["shapes"];
  const auto& layers = info["layers"];
  const auto& steps = info["steps"];
  std::string text = fmt::format(
      "file      {}\n"
      "format    kvdump v{}.{}\n"
      "model     {}\n"
      "producer  {}\n"
      "shapes    H={} Dc={} Dr={} page_size={} num_pages={} slots={}\n"
      "kv        kv_dtype={} kv_scale_kind={} sm_scale={:.17g}\n",
      info["file"].get<std::string>(), info["format_version"].get<int>(),
      info.value("format_minor_version", 0), info["model"].get<std::string>(),
      info["producer"].get<std::string>(), s["num_heads"].get<int>(), s["kv_lora_rank"].get<int>(),
      s["qk_rope_head_dim"].get<int>(), s["page_size"].get<int>(),
      s["num_pages"].get<std::int64_t>(), s["num_slots"].get<std::int64_t>(),
      s["kv_dtype"].get<std::string>(), s["kv_scale_kind"].get<std::string>(),
      s["sm_scale"].get<double>());
  if (info.contains("group_scales") && !info["group_scales"].is_null()) {
    const auto& g = info["group_scales"];
    text += fmt::format(
        "scales    per_token_group: {} groups of {} latent channels, {} scales, RoPE {}, "
        "layout {}\n",
        g["groups"].get<int>(), g["group_size"].get<int>(), g["scale_format"].get<std::string>(),
        g["rope_dtype"].get<std::string>(), g["layout"].get<std::string>());
  }
  text += fmt::format("layers    {}\n", layers.size());
  for (const auto& layer : layers) text += layer_line(layer);
  text += fmt::format("steps     {}\n", steps.size());
  for (const auto& step : steps) text += step_line(step, layers.size());
  return text;
}

}  // namespace kvaudit
