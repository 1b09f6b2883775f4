// `kvaudit check --emit-repro FILE`: a minimal kvdump that reproduces the first failure of a run.
//
// The repro holds one layer (the failing one, same layer_id and kv_scale) and one step (S000, the
// failing step's kind) restricted to the selected requests. Its pool is the REFERENCE replay's
// pool just before the failing step (the dump's kv_cache with the kvdump write rule applied for
// every earlier step, i.e. the correct state, not the backend's), restricted to the pages the
// selected requests use at that step, renumbered 0..P-1 in order of first use (page_size kept).
// Shapes are those of kvdump-v1: pools [P, page_size, D], q_nope [Nq', H, Dc], q_pe [Nq', H, Dr],
// new_kv [Nq', D], out [Nq', H, Dc], lse [Nq', H], with Nq' the rows of the selected requests.
// kv_source is kept (restricted the same way) only when every slot of those pages has a known
// source value: the dump's kv_source, or a value an earlier step wrote. Captured out / lse /
// kv_cache_after are restricted the same way when the dump has them. Nothing is compared here,
// so no tolerance applies: the values are copied bit for bit.
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "src/core/result.hpp"
#include "src/format/kvdump.hpp"
#include "src/verdict/check_result.hpp"

namespace kvaudit {

// What the repro keeps from the original dump.
struct ReproTarget {
  int step = 0;                   // step index in the original dump
  int layer_id = 0;               // model layer id
  std::vector<int> requests;      // original request indices, ascending
  std::string failure;            // one line: what failed first (for the producer attribute / log)
  bool reciprocal_scale = false;  // the run wrote with --reciprocal-scale: so does the repro's pool
};

// The first failure of a replay: the earliest (step, layer in dump order) among the first
// divergence, failing integrity findings and failing comparisons that fail the run. Requests kept:
// the request of the first divergent row; for an integrity failure the requests whose
// new_kv_slots hold the finding's first offending slot; otherwise the worst request of the
// failing comparison; and when none of those names a request, the first request of the step that
// has query rows. Empty when the run passed, or failed only on the indexer cache (kvdump v1.2),
// which a repro leaves out.
std::optional<ReproTarget> first_failure_target(const DumpLayout& layout, const CheckRun& run);

struct ReproSummary {
  std::int64_t num_pages = 0;  // pages kept
  int num_rows = 0;            // query rows kept
  bool has_source = false;     // kv_source kept
};

// Writes the repro of `target` from `reader` to `path` (overwritten). `producer`, followed by the
// original page of each kept page, becomes the root producer attribute.
Result<ReproSummary> write_repro(const DumpReader& reader, const ReproTarget& target,
                                 const std::filesystem::path& path, const std::string& producer);

}  // namespace kvaudit
