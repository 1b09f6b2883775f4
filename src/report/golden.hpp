// Golden files (docs/golden-format.md): what one backend produced on one dump, kept so that a later
// run can be compared with it bit for bit (`kvaudit golden record` / `kvaudit golden check`).
//
// Per recorded (step, layer), from the replay's observer (src/replay/replay.hpp):
//   out  : [Nq, H, Dc] bf16 bits      lse : [Nq, H] fp32 (natural log)
//   pool : the backend's pool after the step, [S, D] storage bytes, either whole or as its SHA-256
//          plus the rows of the slots the step wrote ([Nw, D] bytes), by size (kWholePoolMaxBytes)
// plus provenance: the dump's SHA-256, the backend and its describe() JSON, kvaudit's version and
// git revision, the platform (compiler, C library, HDF5), the policy, date, host and command line.
//
// This file holds the data model and the recording (a replay with an observer); the HDF5 file is
// written and read by src/report/golden_file.hpp, compared by src/report/golden_compare.hpp.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "src/backend/backend.hpp"
#include "src/core/build_info.hpp"
#include "src/core/result.hpp"
#include "src/format/kvdump.hpp"
#include "src/replay/replay.hpp"
#include "src/verdict/metrics.hpp"

namespace kvaudit {

// The golden file format's version (root attribute format_version); a reader refuses others.
inline constexpr int kGoldenFormatVersion = 1;

// A pool is stored whole when it holds at most this many bytes (S * D * bytes per element), else as
// its SHA-256 plus the rows the step wrote. Why 64 KiB: a golden file stores the pool once per
// recorded (step, layer), so a whole pool costs steps * layers * S * D bytes; at 64 KiB a 4-step,
// 3-layer dump adds at most 768 KiB, about what its outputs take, and the golden files of the
// shipped dumps stay near 1 MB. Larger pools (every real server dump: SGLang's GLM-5 pool is
// 495,552 slots, 285 MB per layer) would make golden files as large as the dumps, while the only
// bytes of the pool a backend produces are the rows it writes; the rest must equal the dump's own
// pool, which `kvaudit check`'s integrity checks verify slot by slot and the digest still pins.
inline constexpr std::int64_t kWholePoolMaxBytes = 64 * 1024;

enum class PoolStorage : std::uint8_t { kWhole, kDigest };
const char* pool_storage_name(PoolStorage storage);  // "whole" | "digest"

struct GoldenPool {
  PoolStorage storage = PoolStorage::kWhole;
  KvDtype dtype = KvDtype::kFloat8E4m3fn;
  std::int64_t num_slots = 0;  // S
  int row_width = 0;           // D
  std::string sha256;          // of every byte of the pool, [S, row_bytes], always present
  // Digest storage: SHA-256 of the rows of every slot the step did not write, in slot order, so
  // that a moved unwritten slot is seen even when written rows moved too; empty in whole storage
  // and in golden files recorded before it was kept (then only `sha256` tells).
  std::string unwritten_sha256;
  std::vector<std::int64_t> written_slots;  // the slots the step wrote, in new_kv order, [Nw]
  // whole: every slot [S, row_bytes]; digest: the rows of written_slots [Nw, row_bytes].
  std::vector<std::uint8_t> rows;

  std::size_t row_bytes() const {
    return static_cast<std::size_t>(row_width) * (dtype == KvDtype::kBfloat16 ? 2 : 1);
  }
};

// One recorded (step, layer).
struct GoldenEntry {
  int step = 0;                    // step index (S### of the golden file)
  int layer_id = 0;                // L### of the golden file
  TensorShape3 shape;              // out: [Nq, H, Dc]
  std::vector<std::uint16_t> out;  // [Nq, H, Dc] bf16 bits
  std::vector<float> lse;          // [Nq, H]
  GoldenPool pool;
};

struct GoldenProvenance {
  std::string dump_path;    // as given when recorded (informative; the digest identifies the dump)
  std::string dump_sha256;  // 64 hex digits
  std::string backend;      // "cpu-fp8", ...
  nlohmann::json backend_description = nlohmann::json::object();  // Backend::describe()
  std::string kvaudit_version;
  std::string kvaudit_revision;  // the commit built from (src/core/build_info.hpp), or "unknown"
  // The build came from a tree with uncommitted changes (the revision ends in "-dirty"): the
  // commit does not say what produced these outputs.
  bool kvaudit_dirty = false;
  // What else can move a CPU backend's last bit: {"compiler", "libc", "hdf5"} versions (exp2f and
  // log2f come from the C library).
  nlohmann::json platform = nlohmann::json::object();
  std::string policy;    // the policy the replay ran under (outputs do not depend on it)
  std::string date_utc;  // ISO-8601
  std::string host;
  std::string command_line;
};

struct Golden {
  int format_version = kGoldenFormatVersion;
  GoldenProvenance provenance;
  std::int64_t whole_pool_max_bytes = kWholePoolMaxBytes;
  std::vector<int> layer_ids;        // recorded layers, dump order
  std::vector<int> step_indices;     // recorded steps, ascending
  std::vector<GoldenEntry> entries;  // by step, then layer in dump order
};

// One (step, layer) as the observer sees it: out, lse, and the backend's pool (whole when it holds
// at most whole_pool_max_bytes, else digest and written rows). Needs a backend.
Result<GoldenEntry> capture_golden_entry(const StepLayerOutputs& outputs,
                                         std::int64_t whole_pool_max_bytes);

struct GoldenRecordOptions {
  ReplayOptions replay;  // layers, steps, policy, threads, progress; the observer is set here
  std::int64_t whole_pool_max_bytes = kWholePoolMaxBytes;
  // The revision recorded as the provenance's kvaudit_revision (and kvaudit_dirty): this binary's.
  std::string kvaudit_revision = kvaudit_git_revision();
};

// Replays the dump through `backend` and captures every reported (step, layer), sorted by step,
// then layer in dump order. The recording is held in memory: about the golden file's size before
// compression. Provenance: backend, description, policy, kvaudit version and
// revision, date, host and command line of this process; the caller adds the dump's path and
// SHA-256.
Result<Golden> record_golden(const DumpReader& reader, Backend& backend,
                             const GoldenRecordOptions& options);

// This process's provenance fields (kvaudit version, platform, date, host, command line), with
// `revision` as kvaudit_revision and kvaudit_dirty from it.
GoldenProvenance current_golden_provenance(std::string_view revision = kvaudit_git_revision());

}  // namespace kvaudit
