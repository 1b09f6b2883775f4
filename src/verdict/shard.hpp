// A check run cut by layer into N parts (`kvaudit check DUMP --shard I/N --json PART.json`) and
// put back together (`kvaudit merge`, src/verdict/merge.hpp). Layers are independent (each has
// its own pool, replayed over every step), so a part is a set of layers with all their steps.
//
// Assignment (contiguous): the layers checked (all, or --layers), in dump order, are cut into N
// contiguous groups whose sizes differ by at most one, the larger groups first. With L layers,
// q = L / N and r = L % N, shard i (0-based) holds q + (i < r) layers starting at position
// i * q + min(i, r); shards i >= L are empty (a valid part with no results). Contiguous groups keep
// the unsharded run's order when the parts are put back in shard order: the replay is layer-outer
// (src/replay/replay.hpp), so a run's results, integrity findings and notes come layer by layer.
//
// A part file is the part's report.json (to_json of its run, a complete report of its layers)
// with one more key, "shard" (docs/report-schema.md "Shard parts"): which shard it is, what was
// selected, how many leading notes concern the whole run, and where each failing followed
// comparison first diverges (ComparisonResult::divergence, which report.json does not hold).
#pragma once

#include <cstddef>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "src/core/result.hpp"
#include "src/verdict/check_result.hpp"

namespace kvaudit {

struct ShardSpec {
  int index = 0;  // 0-based, below count
  int count = 1;  // N >= 1
};

std::string shard_name(const ShardSpec& spec);  // "I/N"

// The layer ids of shard `spec` among `layer_ids` (the layers checked, in dump order): the
// contiguous assignment of the header comment. spec must be valid (0 <= index < count).
std::vector<int> shard_layers(const std::vector<int>& layer_ids, const ShardSpec& spec);

// What a part records beyond its report, for the merge to check and to put back together.
struct ShardInfo {
  ShardSpec spec;
  std::vector<int> layers;           // this part's layer ids, dump order
  std::vector<int> selected_layers;  // the layers the N parts cover together, dump order
  std::vector<int> steps;            // the reported steps (--steps), empty for every step
  std::string injection;             // --inject, empty for none
  bool reciprocal_scale = false;     // --reciprocal-scale
  std::size_t run_notes = 0;  // the leading notes about the run as a whole (every part has them)
};

struct ShardPart {
  CheckRun run;  // with each failing followed comparison's divergence point
  ShardInfo shard;
};

// The part file: to_json(run) and "shard" (header comment).
nlohmann::json part_to_json(const CheckRun& run, const ShardInfo& shard);
// A part file read back; bad input naming `file` when it is no part (no "shard" key: a report of an
// unsharded run) or a key is wrong.
Result<ShardPart> part_from_json(const nlohmann::json& part, const std::string& file);

}  // namespace kvaudit
