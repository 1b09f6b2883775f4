// --shard: its value, the environment of a job array, and the replay of one shard (see
// check_shard.hpp).
#include "src/cli/check_shard.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cstdlib>

namespace kvaudit {
namespace {

// A plain decimal integer >= 0 (no sign, no spaces), as std::from_chars reads it whole.
std::optional<long long> plain_integer(const std::string& text) {
  long long value = 0;
  const char* end = text.data() + text.size();
  if (text.empty() || text.front() < '0' || text.front() > '9') return std::nullopt;
  const auto [stop, error] = std::from_chars(text.data(), end, value);
  if (error != std::errc() || stop != end) return std::nullopt;
  return value;
}

Result<long long> integer_variable(const EnvironmentLookup& environment, const char* name,
                                   long long if_unset) {
  const std::optional<std::string> text = environment(name);
  if (!text) return if_unset;
  if (const std::optional<long long> value = plain_integer(*text)) return *value;
  return bad_input(name, fmt::format("'{}' is not a plain decimal integer", *text));
}

// I from a Slurm job array task (check_shard.hpp, rule 1).
Result<ResolvedShard> slurm_shard(const EnvironmentLookup& environment, int count) {
  KVAUDIT_ASSIGN_OR_RETURN(const long long id,
                           integer_variable(environment, "SLURM_ARRAY_TASK_ID", 0));
  KVAUDIT_ASSIGN_OR_RETURN(const long long min,
                           integer_variable(environment, "SLURM_ARRAY_TASK_MIN", 0));
  KVAUDIT_ASSIGN_OR_RETURN(const long long tasks,
                           integer_variable(environment, "SLURM_ARRAY_TASK_COUNT", count));
  KVAUDIT_ASSIGN_OR_RETURN(const long long max,
                           integer_variable(environment, "SLURM_ARRAY_TASK_MAX", min + tasks - 1));
  if (tasks != count) {
    return bad_input("SLURM_ARRAY_TASK_COUNT",
                     fmt::format("the job array has {} tasks but --shard auto/{} asks for {} "
                                 "parts: submit --array=0-{}",
                                 tasks, count, count, count - 1));
  }
  if (max - min + 1 != tasks || id < min || id > max) {
    return bad_input("SLURM_ARRAY_TASK_ID",
                     fmt::format("task {} of an array {}-{} with {} tasks: --shard auto/N needs "
                                 "consecutive indices (e.g. --array=0-{}, no step)",
                                 id, min, max, tasks, count - 1));
  }
  const std::string source =
      fmt::format("SLURM_ARRAY_TASK_ID={} - SLURM_ARRAY_TASK_MIN={}", id, min);
  return ResolvedShard{{static_cast<int>(id - min), count}, source};
}

// I from a Kubernetes Indexed Job pod (check_shard.hpp, rule 2).
Result<ResolvedShard> kubernetes_shard(const EnvironmentLookup& environment, int count) {
  KVAUDIT_ASSIGN_OR_RETURN(const long long index,
                           integer_variable(environment, "JOB_COMPLETION_INDEX", 0));
  if (index >= count) {
    return bad_input("JOB_COMPLETION_INDEX",
                     fmt::format("index {} is not below --shard auto/{}: the Job's completions "
                                 "must be {}",
                                 index, count, count));
  }
  return ResolvedShard{{static_cast<int>(index), count},
                       fmt::format("JOB_COMPLETION_INDEX={}", index)};
}

Result<ResolvedShard> environment_shard(const EnvironmentLookup& environment, int count) {
  if (environment("SLURM_ARRAY_TASK_ID")) return slurm_shard(environment, count);
  if (environment("JOB_COMPLETION_INDEX")) return kubernetes_shard(environment, count);
  return bad_input("--shard",
                   fmt::format("auto/{}: neither SLURM_ARRAY_TASK_ID (a Slurm job array task) "
                               "nor JOB_COMPLETION_INDEX (a Kubernetes Indexed Job pod) is set; "
                               "give the index, --shard I/{}",
                               count, count));
}

}  // namespace

std::optional<std::string> process_environment(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return std::nullopt;
  return std::string(value);
}

Result<ResolvedShard> resolve_shard(const std::string& text, const EnvironmentLookup& environment) {
  const std::size_t slash = text.find('/');
  const std::string index_text = text.substr(0, slash);
  const std::string count_text = slash == std::string::npos ? "" : text.substr(slash + 1);
  const std::optional<long long> count = plain_integer(count_text);
  constexpr int kMaxShards = 1 << 20;  // far beyond any layer count; keeps the arithmetic in int
  if (!count || *count < 1 || *count > kMaxShards) {
    return bad_input("--shard", fmt::format("'{}': expected I/N or auto/N with N a whole number "
                                            "from 1 to {} (I 0-based, below N)",
                                            text, kMaxShards));
  }
  const int shards = static_cast<int>(*count);
  if (index_text == "auto") return environment_shard(environment, shards);
  const std::optional<long long> index = plain_integer(index_text);
  if (!index) {
    return bad_input("--shard", fmt::format("'{}': the index '{}' is neither a whole number nor "
                                            "auto",
                                            text, index_text));
  }
  if (*index >= shards) {
    return bad_input("--shard", fmt::format("'{}': index {} is not below {} (indices are 0-based: "
                                            "0..{})",
                                            text, *index, shards, shards - 1));
  }
  return ResolvedShard{{static_cast<int>(*index), shards}, "--shard"};
}

std::vector<int> checked_layer_ids(const DumpLayout& layout, const std::vector<int>& requested) {
  std::vector<int> ids;
  for (const LayerMeta& layer : layout.layers) {
    const bool wanted = requested.empty() || std::find(requested.begin(), requested.end(),
                                                       layer.layer_id) != requested.end();
    if (wanted) ids.push_back(layer.layer_id);
  }
  return ids;
}

Result<ShardPart> replay_shard(const DumpReader& reader, Backend* backend, ReplayOptions options,
                               const ShardSpec& spec, const std::string& injection) {
  ShardInfo shard;
  shard.spec = spec;
  shard.selected_layers = checked_layer_ids(reader.layout(), options.layer_ids);
  shard.layers = shard_layers(shard.selected_layers, spec);
  shard.steps = options.step_indices;
  std::sort(shard.steps.begin(), shard.steps.end());
  shard.steps.erase(std::unique(shard.steps.begin(), shard.steps.end()), shard.steps.end());
  shard.injection = injection;
  shard.reciprocal_scale = options.reciprocal_scale;
  shard.run_notes = begin_run(reader, backend, options).notes.size();
  if (shard.layers.empty()) return ShardPart{begin_run(reader, backend, options), shard};
  options.certification_layer_ids = shard.selected_layers;  // the whole check's sites
  options.layer_ids = shard.layers;
  KVAUDIT_ASSIGN_OR_RETURN(CheckRun run, replay_dump(reader, backend, options));
  return ShardPart{std::move(run), std::move(shard)};
}

}  // namespace kvaudit
