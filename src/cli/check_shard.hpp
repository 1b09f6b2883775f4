// `kvaudit check --shard I/N`: one part of a check cut by layer (src/verdict/shard.hpp says which
// layers a shard holds and what its part file records; `kvaudit merge` puts the parts together).
//
// The shard option, exactly:
//   --shard I/N     shard I of N, both plain decimal integers, N >= 1 and 0 <= I < N (0-based, as
//                   Slurm's default array indices and Kubernetes' completion indices are). The
//                   environment is not read.
//   --shard auto/N  I from the environment, for one command line on every task of a job array:
//     1. SLURM_ARRAY_TASK_ID (a Slurm job array task): I = SLURM_ARRAY_TASK_ID -
//        SLURM_ARRAY_TASK_MIN (MIN taken as 0 where unset), so --array=0-3 and --array=1-4 both
//        give 0..3. The array's indices must be consecutive: where Slurm sets them,
//        SLURM_ARRAY_TASK_COUNT must equal N and SLURM_ARRAY_TASK_MAX - SLURM_ARRAY_TASK_MIN + 1
//        must equal the count (a step such as --array=0-6:2 is refused).
//     2. else JOB_COMPLETION_INDEX (a Kubernetes Indexed Job pod): I = JOB_COMPLETION_INDEX.
//     SLURM_ARRAY_TASK_ID wins when both are set: Slurm sets it for the task itself, whereas sbatch
//     passes the submitting shell's environment on (--export=ALL), which may hold a
//     JOB_COMPLETION_INDEX of the pod it was submitted from. An empty variable counts as unset.
//     Neither set: bad input (exit 2), as is any value that is not a plain decimal integer, or an
//     index that is not below N.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "src/backend/backend.hpp"
#include "src/core/result.hpp"
#include "src/format/kvdump.hpp"
#include "src/replay/replay.hpp"
#include "src/verdict/shard.hpp"

namespace kvaudit {

// The value of an environment variable, nullopt when unset or empty.
using EnvironmentLookup = std::function<std::optional<std::string>(const char* name)>;
std::optional<std::string> process_environment(const char* name);

struct ResolvedShard {
  ShardSpec spec;
  std::string source;  // where the index came from: "--shard", "SLURM_ARRAY_TASK_ID=3 - ..."
};

// --shard's value (header comment); errors are bad input naming --shard or the variable.
Result<ResolvedShard> resolve_shard(const std::string& text, const EnvironmentLookup& environment);

// The layer ids a check replays, in dump order: every layer, or those `requested` (--layers).
std::vector<int> checked_layer_ids(const DumpLayout& layout, const std::vector<int>& requested);

// Replays the layers of shard `spec` of the check `options` selects (a shard with none gives the
// run begin_run starts, with no results) and says what its part records. `injection`: --inject.
Result<ShardPart> replay_shard(const DumpReader& reader, Backend* backend, ReplayOptions options,
                               const ShardSpec& spec, const std::string& injection);

}  // namespace kvaudit
