// `kvaudit merge`: the N parts of a sharded check (src/verdict/shard.hpp) put back into the run the
// unsharded check gives: the same results, integrity findings and notes in the same order, so the
// same steps summary, counts and verdict; and the first divergence found again from the merged
// results by the replay's own rule (DivergenceTracker, src/verdict/divergence.hpp), not taken
// from a part. Timing is summed over the parts (the work done, not the wall time of a parallel
// run); the provenance is this process's, with merged_from naming every part.
//
// Refused (bad input, naming the parts): parts of different dumps (SHA-256), backends (name and
// description), policies, selections (--layers, --steps), --inject or --reciprocal-scale, run
// notes, shard counts or kvaudit versions (also this one's: the merged report is written as this
// version's); two parts of one shard; a missing shard; a part whose layers are not its shard's.
#pragma once

#include <string>
#include <vector>

#include "src/core/result.hpp"
#include "src/verdict/check_result.hpp"
#include "src/verdict/shard.hpp"

namespace kvaudit {

struct NamedPart {
  std::string file;  // as given, for messages and provenance
  ShardPart part;
};

// Parts in any order.
Result<CheckRun> merge_parts(std::vector<NamedPart> parts);

}  // namespace kvaudit
