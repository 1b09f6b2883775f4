// The replay engine of `kvaudit check` (docs/design.md "Pipeline", docs/kvdump-v1.md "Semantics").
//
// Layer-outer, step-inner, so that one layer's pool is in memory at a time (layers_in_flight of
// them where several layers run at once, each on its own thread and merged in layer order: the run
// is the same). For each selected
// layer: the reference replay keeps its own pool (reference_pool) and the backend a separate copy
// (backend_pool), both read from kv_cache; the source rows [S, D] come from kv_source (NaN where
// the dump has none). Every step is replayed in order (steps not selected are replayed and not
// reported). Per step:
//   1. reference write: new_kv[i] goes into slot new_kv_slots[i] of reference_pool with the kvdump
//      write rule (e4m3_rne_satfinite(fp32(x) / fp32(kv_scale))); the source row becomes new_kv[i];
//   2. R8 = reference attention on reference_pool dequantized (code x kv_scale);
//      Rs = reference attention on the source rows, when every visible token has a source;
//   3. backend: run_step on backend_pool, then the integrity checks (src/replay/integrity.hpp); R8'
//   =
//      reference attention on backend_pool, the pool the backend read (computed only when the
//      slots the step reads differ from reference_pool; otherwise R8' = R8 exactly);
//   4. comparisons, shapes out: [Nq, H, Dc], lse: [Nq, H], all widened to double:
//        kernel       backend vs R8'      (what the kernel adds to what it read)
//        cache        R8 vs R8'           (what a corrupted cache costs; zero while intact)
//        quantization R8 vs Rs            (what FP8 storage costs)
//        total        backend vs Rs
//        captured     dump's out/lse vs R8
//      handed to the run judge (src/verdict/run_judge.hpp), which measures, judges and keeps the
//      first divergence; which of R8 and R8' the kernel is judged against is the verdict's
//      choice too (src/verdict/divergence.hpp); captured kv_cache_after against the reference
//      pool after the writes (slot-level classification).
//   5. the server's pool: once a captured kv_cache_after differs from the reference pool, the
//      layer keeps server_pool (the captured pool where the step has one, else the previous
//      server pool plus the reference's writes of the step: what the server's attention read)
//      and R8s = R8 on it (computed only where the slots the step reads differ), and adds
//        captured_read   dump's out/lse vs R8s   (the server's kernel on what it read)
//        captured_cache  R8 vs R8s               (what the server's corrupted cache costs)
//      at every later reported step (report-only: src/verdict/policy.cpp's header says why).
//   6. diagnosis (src/replay/diagnosis.hpp): a failing kernel comparison (on the pool the backend
//      read), captured comparison (on the reference pool) or, where the server's pool differs,
//      captured_read comparison (on the server's pool) is tried against the catalogue of
//      convention mismatches, for at most options.diagnose (step, layer)s, the earliest first.
// A failure never stops the replay: the report is complete.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "references/reference_device.hpp"
#include "src/backend/backend.hpp"
#include "src/core/result.hpp"
#include "src/format/kvdump.hpp"
#include "src/replay/certification.hpp"
#include "src/replay/diagnosis.hpp"
#include "src/verdict/check_result.hpp"
#include "src/verdict/metrics.hpp"
#include "src/verdict/policy.hpp"

namespace kvaudit {

// What one (step, layer) produced, handed to an observer (--save-outputs, golden files).
struct StepLayerOutputs {
  int step = 0;                                  // S### number
  int layer_id = 0;                              // L### number
  TensorShape3 shape;                            // [Nq, H, Dc]
  std::span<const double> reference_out;         // R8: [Nq, H, Dc]
  std::span<const double> reference_lse;         // R8: [Nq, H]
  std::span<const double> reference_source_out;  // Rs, empty when the source is unknown
  std::span<const double> reference_source_lse;
  const AttentionOutput* backend = nullptr;  // null without a backend
  // The backend's pool after the step, as it left it (null without a backend), and the slots the
  // step wrote (new_kv_slots, [Nq]).
  const KvPool* backend_pool = nullptr;
  std::span<const std::int32_t> written_slots;
};

using StepLayerObserver = std::function<Status(const StepLayerOutputs&)>;

struct ReplayOptions {
  std::vector<int> layer_ids;     // empty: every layer of the dump
  std::vector<int> step_indices;  // reported steps; empty: every step
  Policy policy;
  int threads = 0;  // reference threads; 0: every core
  // Where the exact reference runs (--reference); certification stays on the CPU either way.
  ReferenceDevice reference = ReferenceDevice::kCpu;
  bool progress = false;       // stderr: "layer 1/3 step 2/4"; a line per finished layer
  StepLayerObserver observer;  // called for every reported (step, layer)
  // The reference writes with the named reciprocal convention (x * fp32(1 / kv_scale)) instead
  // of kvdump-v1's x / kv_scale (`kvaudit check --reciprocal-scale`).
  bool reciprocal_scale = false;
  // At most this many failing (step, layer)s are diagnosed (the earliest); 0: no diagnosis.
  int diagnose = kDefaultDiagnoseLimit;
  // p-e4m3-tile's tile shapes (--diagnose-tile); empty: kDefaultDiagnoseTiles, one split each.
  std::vector<TileShape> diagnose_tiles;
  // Sites where the reference is certified against 50 digits (src/replay/certification.hpp); 0:
  // none. Drawn from `certification_layer_ids` (empty: the replayed layers), so that the shards
  // of one check certify the sites the whole check would.
  int certify = kDefaultCertificationSamples;
  std::vector<int> certification_layer_ids;
  // Read layer L+1 on one reader thread while layer L is computed (one layer in flight). Off, or
  // with an observer (it may write HDF5, which Debian's build does not allow from two threads at
  // once), each layer is read in place before it is computed. The run is the same either way.
  bool read_ahead = true;
  // Layers replayed at once, each on its own thread (`kvaudit check --layers-in-flight`): while
  // one layer's comparisons run on the CPU, the next one's reference and backend can keep a GPU
  // busy. Each layer writes into its own outcome, merged into the run strictly in layer order, so
  // the run is the same for every N (layers_in_flight says where it falls back to 1).
  int layers_in_flight = 1;
};

// Checks that every requested layer id and step index exists (bad input naming it otherwise).
Status check_selection(const DumpLayout& layout, const ReplayOptions& options);

// The run before any layer is replayed: dump path and summary, backend and its description,
// policy, and the notes about the run as a whole (replay_dump starts from it; a shard's part counts
// its notes, and a shard with no layers is this run, src/verdict/shard.hpp). `backend` may be null.
CheckRun begin_run(const DumpReader& reader, const Backend* backend, const ReplayOptions& options);

// Replays the dump into a judged run (comparisons, integrity, first divergence, notes, timings;
// the caller adds the dump's SHA-256 and provenance). `backend` may be null (--backend none):
// only captured outputs and pools are compared. Errors are I/O or backend failures; checks that
// fail are results, not errors.
Result<CheckRun> replay_dump(const DumpReader& reader, Backend* backend,
                             const ReplayOptions& options);

// Whether replay_dump reads layer L+1 on a reader thread while it computes L: options.read_ahead,
// no observer (it may write HDF5, and Debian's HDF5 allows one thread at a time), and no step
// with a captured pool (kv_cache_after: a whole pool per step, read step by step instead). Else
// each layer's pool and kv_source are read in place and its steps one at a time.
bool reads_ahead(const DumpLayout& layout, const ReplayOptions& options);

// How many layers replay_dump replays at once: options.layers_in_flight (at least 1, at most the
// selected layers), or 1 where a layer must be replayed alone (LayersInFlight::reason): layers read
// in place (!reads_ahead: an observer, which may write HDF5 and must see the layers in order, or
// captured pools, whose steps are read from the dump while the layer runs) or a backend that holds
// one layer at a time (an exec program). `backend` may be null (none, or not yet made).
struct LayersInFlight {
  int count = 1;
  std::string reason;  // why count is below what was asked; empty otherwise
};
LayersInFlight layers_in_flight(const DumpLayout& layout, const ReplayOptions& options,
                                const Backend* backend);

// The memory the replay of one layer holds, from the layout alone (before anything is read), in
// bytes: what is read from the dump (its pool, kv_source, and every step's tensors and captures
// when `steps_up_front` (read ahead), else the largest step's) and what is computed beside it
// (the replay's pool copy for the backend and, with a backend, its before-image; the reference's
// decoded rows for the most slots a step reads; the largest step's R8 and Rs, the backend's
// outputs and the binary64 copies the comparisons read; R8' and R8s, computed only where a pool
// differs from the replay's, come on top). Read ahead, about read(L) + computed(L) + read(L+1)
// is resident; in place, read(L) + computed(L).
struct LayerBytes {
  double read = 0.0;
  double computed = 0.0;
};
LayerBytes estimate_layer_bytes(const DumpLayout& layout, std::size_t layer_index,
                                bool with_backend, bool steps_up_front);

// Whether the machine can hold the replay of every selected layer with the next one read ahead,
// layers_in_flight(layout, options, backend) layers at once (each counted as the one that needs
// the most; the backend as made, since one that holds one layer at a time runs one): bad input
// "check" naming the layer that needs the most and its bytes otherwise.
Status check_replay_fits(const DumpLayout& layout, const ReplayOptions& options, bool with_backend,
                         const Backend* backend = nullptr);

// Dump facts for the report: model, producer, shapes, layers, steps.
nlohmann::json summarize_dump(const DumpLayout& layout);

}  // namespace kvaudit
