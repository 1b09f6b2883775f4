// `kvaudit info` summary of a kvdump (see info.hpp for the JSON schema).
#include "src/tools/info.hpp"

#include <cstdio>
#include <set>
#include <string>

namespace kvaudit {

PoolCodeCounts count_pool_codes(const KvPool& pool) {
  PoolCodeCounts counts;
  if (pool.dtype == KvDtype::kFloat8E4m3fn) {
    for (const std::uint8_t code : pool.bytes) {
      const std::uint8_t magnitude = code & 0x7F;
      counts.nan += magnitude == kE4m3NanCode;
      counts.saturated += magnitude == kE4m3MaxFiniteCode;
    }
    return counts;
  }
  for (std::size_t i = 0; i + 1 < pool.bytes.size(); i += 2) {
    const std::uint16_t bits = static_cast<std::uint16_t>(pool.bytes[i] | (pool.bytes[i + 1] << 8));
    counts.nan += (bits & 0x7FFF) > 0x7F80;  // exponent all ones, mantissa non-zero
  }
  return counts;
}

Result<nlohmann::json> dump_info(const DumpReader& reader) {
  const DumpLayout& layout = reader.layout();
  const DumpAttributes& a = layout.attrs;
  nlohmann::json info;
  info["file"] = reader.path().string();
  info["format_version"] = layout.format_version;
  info["model"] = a.model;
  info["producer"] = a.producer;
  info["shapes"] = {{"num_heads", a.num_heads},
                    {"kv_lora_rank", a.kv_lora_rank},
                    {"qk_rope_head_dim", a.qk_rope_head_dim},
                    {"page_size", a.page_size},
                    {"num_pages", layout.num_pages},
                    {"num_slots", layout.num_slots()},
                    {"kv_dtype", kv_dtype_name(a.kv_dtype)},
                    {"kv_scale_kind", a.kv_scale_kind},
                    {"sm_scale", a.sm_scale}};
  nlohmann::json layers = nlohmann::json::array();
  for (std::size_t l = 0; l < layout.layers.size(); ++l) {
    const LayerMeta& layer = layout.layers[l];
    auto pool = reader.read_pool(l);
    if (!pool.ok()) return pool.error();
    const PoolCodeCounts counts = count_pool_codes(*pool);
    nlohmann::json entry = {{"group", layer.group},
                            {"layer_id", layer.layer_id},
                            {"kv_scale", layer.kv_scale},
                            {"has_kv_source", layer.has_source},
                            {"nan_codes", counts.nan}};
    if (a.kv_dtype == KvDtype::kFloat8E4m3fn) {
      entry["saturated_codes"] = counts.saturated;
    } else {
      entry["saturated_codes"] = nullptr;
    }
    layers.push_back(std::move(entry));
  }
  info["layers"] = std::move(layers);
  nlohmann::json steps = nlohmann::json::array();
  for (const StepMeta& step : layout.steps) {
    std::int64_t tokens = 0;
    for (int b = 0; b < step.batch_size(); ++b) tokens += step.kv_len(b, a.page_size);
    const std::set<std::int32_t> distinct(step.kv_indices.begin(), step.kv_indices.end());
    nlohmann::json captures = {{"out", nlohmann::json::array()},
                               {"lse", nlohmann::json::array()},
                               {"kv_cache_after", nlohmann::json::array()}};
    for (std::size_t l = 0; l < layout.layers.size(); ++l) {
      if (step.has_out[l]) captures["out"].push_back(layout.layers[l].group);
      if (step.has_lse[l]) captures["lse"].push_back(layout.layers[l].group);
      if (step.has_kv_cache_after[l]) captures["kv_cache_after"].push_back(layout.layers[l].group);
    }
    steps.push_back({{"group", step.group},
                     {"kind", step_kind_name(step.kind)},
                     {"requests", step.batch_size()},
                     {"rows", step.num_rows()},
                     {"tokens", tokens},
                     {"page_refs", step.kv_indices.size()},
                     {"pages_used", distinct.size()},
                     {"captures", std::move(captures)}});
  }
  info["steps"] = std::move(steps);
  return info;
}

namespace {

std::string number_text(double value, int digits) {
  char text[64];
  std::snprintf(text, sizeof text, "%.*g", digits, value);
  return text;
}

// "all" / "none" / "L000 L003" for a capture present in some layers.
std::string capture_text(const nlohmann::json& groups, std::size_t layer_count) {
  if (groups.empty()) return "none";
  if (groups.size() == layer_count) return "all";
  std::string text;
  for (const auto& group : groups) {
    if (!text.empty()) text += ' ';
    text += group.get<std::string>();
  }
  return text;
}

}  // namespace

std::string format_dump_info(const nlohmann::json& info) {
  const auto& s = info["shapes"];
  std::string text;
  text += "file      " + info["file"].get<std::string>() + "\n";
  text += "format    kvdump v" + std::to_string(info["format_version"].get<int>()) + "\n";
  text += "model     " + info["model"].get<std::string>() + "\n";
  text += "producer  " + info["producer"].get<std::string>() + "\n";
  text += "shapes    H=" + std::to_string(s["num_heads"].get<int>()) +
          " Dc=" + std::to_string(s["kv_lora_rank"].get<int>()) +
          " Dr=" + std::to_string(s["qk_rope_head_dim"].get<int>()) +
          " page_size=" + std::to_string(s["page_size"].get<int>()) +
          " num_pages=" + std::to_string(s["num_pages"].get<std::int64_t>()) +
          " slots=" + std::to_string(s["num_slots"].get<std::int64_t>()) + "\n";
  text += "kv        kv_dtype=" + s["kv_dtype"].get<std::string>() +
          " kv_scale_kind=" + s["kv_scale_kind"].get<std::string>() +
          " sm_scale=" + number_text(s["sm_scale"].get<double>(), 17) + "\n";
  const auto& layers = info["layers"];
  text += "layers    " + std::to_string(layers.size()) + "\n";
  for (const auto& layer : layers) {
    text += "  " + layer["group"].get<std::string>() +
            "  layer_id=" + std::to_string(layer["layer_id"].get<int>()) +
            "  kv_scale=" + number_text(layer["kv_scale"].get<double>(), 9) +
            "  kv_source=" + (layer["has_kv_source"].get<bool>() ? "yes" : "no") +
            "  nan_codes=" + std::to_string(layer["nan_codes"].get<std::int64_t>()) +
            "  saturated_codes=" +
            (layer["saturated_codes"].is_null()
                 ? std::string("n/a")
                 : std::to_string(layer["saturated_codes"].get<std::int64_t>())) +
            "\n";
  }
  const auto& steps = info["steps"];
  text += "steps     " + std::to_string(steps.size()) + "\n";
  for (const auto& step : steps) {
    const auto& c = step["captures"];
    text += "  " + step["group"].get<std::string>() + "  " + step["kind"].get<std::string>() +
            "  requests=" + std::to_string(step["requests"].get<int>()) +
            "  rows=" + std::to_string(step["rows"].get<int>()) +
            "  tokens=" + std::to_string(step["tokens"].get<std::int64_t>()) +
            "  pages_used=" + std::to_string(step["pages_used"].get<std::int64_t>()) +
            "  page_refs=" + std::to_string(step["page_refs"].get<std::int64_t>()) +
            "  out=" + capture_text(c["out"], layers.size()) +
            "  lse=" + capture_text(c["lse"], layers.size()) +
            "  kv_cache_after=" + capture_text(c["kv_cache_after"], layers.size()) + "\n";
  }
  return text;
}

}  // namespace kvaudit
