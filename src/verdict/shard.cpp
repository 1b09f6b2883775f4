// Shard assignment and the part file (see shard.hpp).
#include "src/verdict/shard.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "src/verdict/json_object_reader.hpp"
#include "src/verdict/report_digest.hpp"

namespace kvaudit {

std::string shard_name(const ShardSpec& spec) {
  return fmt::format("{}/{}", spec.index, spec.count);
}

std::vector<int> shard_layers(const std::vector<int>& layer_ids, const ShardSpec& spec) {
  const std::size_t layers = layer_ids.size();
  const auto count = static_cast<std::size_t>(spec.count);
  const auto index = static_cast<std::size_t>(spec.index);
  const std::size_t base = layers / count;   // every shard holds this many
  const std::size_t extra = layers % count;  // the first `extra` shards hold one more
  const std::size_t begin = index * base + std::min(index, extra);
  const std::size_t size = base + (index < extra ? 1 : 0);
  return std::vector<int>(layer_ids.begin() + static_cast<std::ptrdiff_t>(begin),
                          layer_ids.begin() + static_cast<std::ptrdiff_t>(begin + size));
}

namespace {

// Where each failing followed comparison first diverges, by its index in "results".
nlohmann::json divergences_json(const CheckRun& run) {
  nlohmann::json divergences = nlohmann::json::array();
  for (std::size_t i = 0; i < run.comparisons.size(); ++i) {
    const std::optional<DivergencePoint>& point = run.comparisons[i].divergence;
    if (!point) continue;
    divergences.push_back(
        {{"result", i}, {"request", point->request}, {"row", point->row}, {"head", point->head}});
  }
  return divergences;
}

nlohmann::json shard_json(const CheckRun& run, const ShardInfo& shard) {
  return {{"index", shard.spec.index},
          {"count", shard.spec.count},
          {"assignment", "contiguous"},
          {"layers", shard.layers},
          {"selected_layers", shard.selected_layers},
          {"steps", shard.steps.empty() ? nlohmann::json(nullptr) : nlohmann::json(shard.steps)},
          {"inject", shard.injection},
          {"reciprocal_scale", shard.reciprocal_scale},
          {"run_notes", shard.run_notes},
          {"diagnose", run.diagnose_limit},
          {"diagnosis_failing_sites", run.diagnosis_failing_sites},
          {"divergences", divergences_json(run)}};
}

void read_divergences(JsonObjectReader& reader, CheckRun& run) {
  const nlohmann::json& divergences = reader.array("divergences");
  for (std::size_t i = 0; i < divergences.size(); ++i) {
    JsonObjectReader item = reader.element(divergences, "divergences", i);
    const std::size_t result = item.count("result");
    DivergencePoint point;
    point.request = item.int32("request");
    point.row = item.int32("row");
    point.head = item.int32("head");
    item.finish();
    if (result >= run.comparisons.size()) {
      item.errors().fail(
          fmt::format("{}/{}/result", reader.pointer("divergences"), i),
          fmt::format("no result {} (the part has {})", result, run.comparisons.size()));
      continue;
    }
    run.comparisons[result].divergence = point;
  }
}

ShardInfo read_shard(JsonObjectReader reader, CheckRun& run) {
  ShardInfo shard;
  shard.spec.index = reader.int32("index");
  shard.spec.count = reader.int32("count");
  if (reader.text("assignment") != "contiguous") {
    reader.errors().fail(reader.pointer("assignment"), "expected \"contiguous\"");
  }
  shard.layers = reader.int32s("layers");
  shard.selected_layers = reader.int32s("selected_layers");
  if (!reader.raw("steps").is_null()) shard.steps = reader.int32s("steps");
  shard.injection = reader.text("inject");
  shard.reciprocal_scale = reader.boolean("reciprocal_scale");
  shard.run_notes = reader.count("run_notes");
  run.diagnose_limit = reader.int32("diagnose");
  run.diagnosis_failing_sites = reader.count("diagnosis_failing_sites");
  read_divergences(reader, run);
  reader.finish();
  if (shard.spec.count < 1 || shard.spec.index < 0 || shard.spec.index >= shard.spec.count) {
    reader.errors().fail(
        reader.pointer("index"),
        fmt::format("shard {} is no shard (0 <= index < count)", shard_name(shard.spec)));
  }
  if (shard.run_notes > run.notes.size()) {
    reader.errors().fail(reader.pointer("run_notes"), "more than the part's notes");
  }
  return shard;
}

}  // namespace

nlohmann::json part_to_json(const CheckRun& run, const ShardInfo& shard) {
  nlohmann::json part = to_json(run);
  part["shard"] = shard_json(run, shard);
  // A plain part's checksum covers the part as written, its "shard" block included.
  if (part.contains("checksum")) part["checksum"]["value"] = report_digest(part);
  return part;
}

Result<ShardPart> part_from_json(const nlohmann::json& part, const std::string& file) {
  if (!part.is_object() || !part.contains("shard")) {
    return bad_input(file,
                     "not a shard part (no \"shard\" key): write parts with kvaudit check DUMP "
                     "--shard I/N --json PART.json");
  }
  nlohmann::json report = part;
  report.erase("shard");
  KVAUDIT_ASSIGN_OR_RETURN(CheckRun run, check_run_from_json(report, file));
  JsonReadErrors errors{file, std::nullopt};
  JsonObjectReader reader(part, "", errors);
  ShardInfo shard = read_shard(reader.object("shard"), run);
  if (errors.first) return *errors.first;
  return ShardPart{std::move(run), std::move(shard)};
}

}  // namespace kvaudit
