// Per-run certification of the exact reference (docs/design.md "Exactness of the reference").
//
// The reference (references/mla_reference.hpp, double-double) promises, for R8 of one query row i
// and head h over its visible tokens t:
//   |out_dd[i,h,:] - out_true[i,h,:]|_max <= 1e-15 * max_j |out_true[i,h,j]|      [Dc]
//   |lse_dd[i,h] - lse_true[i,h]|          <= 1e-15 (absolute)
// The tests check it on fixed problems; a run checks it on its own data: at a few sample sites
// (step, layer, row, head) R8 of that one (row, head) is recomputed with Boost cpp_bin_float_50
// (50 decimal digits, the reference's Float50 instantiation) and compared with what the run's
// reference gave. A deviation above the bound is kvaudit's own fault: an internal error (exit 3).
//
// The sites are a function of the dump's shape alone, so that two runs of one check (and the
// shards of a sharded check, src/verdict/shard.hpp) certify the same sites: among the selected
// (step, layer)s with query rows, the `samples` whose splitmix64 hash of (step, layer id) is
// smallest; at each, the row and head come from the same hash. Cost: one (row, head) in 50-digit
// arithmetic per site, about 1 us per multiply-add (a 4,096-token row: a few seconds).
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <utility>
#include <vector>

#include "src/core/result.hpp"
#include "src/format/kvdump.hpp"
#include "src/verdict/check_result.hpp"

namespace kvaudit {

inline constexpr int kDefaultCertificationSamples = 4;

// Where each planned (step, layer id) site certifies: its query row and head.
struct CertificationSite {
  int row = 0;
  int head = 0;
  bool operator==(const CertificationSite&) const = default;
};
using CertificationPlan = std::map<std::pair<int, int>, CertificationSite>;

// The sites of a run over `layer_ids` (dump order) and `steps` (reported step indices, ascending).
CertificationPlan plan_certification(const DumpLayout& layout, const std::vector<int>& layer_ids,
                                     const std::vector<int>& steps, int samples);

// One site's recomputation, holding copies of everything it reads (the one row's visible KV rows,
// its q, the run's out and lse there), so that it can run on another thread while the replay goes
// on and changes the pool (`kvaudit check` runs them beside the replay).
struct CertificationJob {
  DumpAttributes attrs;  // one head
  StepMeta step;         // the one row's request, one query row
  std::vector<float> q_nope;
  std::vector<float> q_pe;
  std::vector<float> kv_values;     // the visible rows, compacted; slots renumbered 0..n-1
  std::vector<float> kv_values_lo;  // their residuals (KvRows::row_lo), or empty
  double kv_scale = 1.0;
  std::vector<double> out;  // the run's reference at the site: [Dc]
  double lse = 0.0;
  CertificationSample sample;  // the site (deviations filled by run_certification)
};

// The job for (site.row, site.head) of `step` on `pool` (dequantized with kv_scale), against the
// run's reference `out` [Nq, H, Dc] and `lse` [Nq, H].
CertificationJob prepare_certification(const DumpAttributes& attrs, const StepMeta& step,
                                       const StepLayerTensors& tensors, const KvPool& pool,
                                       float kv_scale, std::span<const double> out,
                                       std::span<const double> lse, int step_index, int layer_id,
                                       const CertificationSite& site);

// R8 of the job's site recomputed in 50 digits. Returns the deviation found; an internal error
// when it exceeds the bound.
Result<CertificationSample> run_certification(const CertificationJob& job);

// prepare_certification, then run_certification.
Result<CertificationSample> certify_site(const DumpAttributes& attrs, const StepMeta& step,
                                         const StepLayerTensors& tensors, const KvPool& pool,
                                         float kv_scale, std::span<const double> out,
                                         std::span<const double> lse, int step_index, int layer_id,
                                         const CertificationSite& site);

}  // namespace kvaudit
