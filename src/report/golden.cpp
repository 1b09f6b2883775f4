// Golden recording (see golden.hpp): a replay whose observer copies each reported (step, layer)'s
// backend out [Nq, H, Dc] (bf16 bits), lse [Nq, H] (fp32) and pool after the step.
#include "src/report/golden.hpp"

#include <fmt/format.h>
#include <hdf5.h>

#if __has_include(<gnu/libc-version.h>)
#include <gnu/libc-version.h>
#define KVAUDIT_HAVE_GLIBC_VERSION 1
#endif

#include <algorithm>
#include <cstring>

#include "src/core/build_info.hpp"
#include "src/core/sha256.hpp"
#include "src/verdict/check_result.hpp"

namespace kvaudit {
namespace {

// SHA-256 of the rows of the slots not in `written_slots`, in slot order.
std::string unwritten_rows_sha256(const KvPool& pool, std::span<const std::int32_t> written_slots) {
  std::vector<bool> written(static_cast<std::size_t>(pool.num_slots), false);
  for (const std::int32_t slot : written_slots) {
    if (slot >= 0 && slot < pool.num_slots) written[static_cast<std::size_t>(slot)] = true;
  }
  const std::size_t row_bytes = pool.row_bytes();
  Sha256 sha;
  for (std::int64_t slot = 0; slot < pool.num_slots; ++slot) {
    if (written[static_cast<std::size_t>(slot)]) continue;
    sha.update(std::span<const std::uint8_t>(pool.row(slot), row_bytes));
  }
  return to_hex(sha.finish());
}

// The pool after the step: its digest always, then every byte (small) or the written rows (with
// the digest of the others).
GoldenPool capture_pool(const KvPool& pool, std::span<const std::int32_t> written_slots,
                        std::int64_t whole_pool_max_bytes) {
  GoldenPool golden;
  golden.dtype = pool.dtype;
  golden.num_slots = pool.num_slots;
  golden.row_width = pool.row_width;
  golden.sha256 = to_hex([&] {
    Sha256 sha;
    sha.update(pool.bytes);
    return sha.finish();
  }());
  golden.written_slots.assign(written_slots.begin(), written_slots.end());
  const bool whole = static_cast<std::int64_t>(pool.bytes.size()) <= whole_pool_max_bytes;
  golden.storage = whole ? PoolStorage::kWhole : PoolStorage::kDigest;
  if (whole) {
    golden.rows.assign(pool.bytes.begin(), pool.bytes.end());
    return golden;
  }
  golden.unwritten_sha256 = unwritten_rows_sha256(pool, written_slots);
  const std::size_t row_bytes = pool.row_bytes();
  golden.rows.resize(golden.written_slots.size() * row_bytes);
  for (std::size_t i = 0; i < golden.written_slots.size(); ++i) {
    std::memcpy(golden.rows.data() + i * row_bytes, pool.row(golden.written_slots[i]), row_bytes);
  }
  return golden;
}

// Entries by step, then layer in dump order (the replay observes layer-outer, step-inner).
void sort_entries(const DumpLayout& layout, std::vector<GoldenEntry>& entries) {
  std::stable_sort(entries.begin(), entries.end(), [&](const GoldenEntry& a, const GoldenEntry& b) {
    if (a.step != b.step) return a.step < b.step;
    return layout.layer_index_of_id(a.layer_id) < layout.layer_index_of_id(b.layer_id);
  });
}

}  // namespace

const char* pool_storage_name(PoolStorage storage) {
  return storage == PoolStorage::kWhole ? "whole" : "digest";
}

Result<GoldenEntry> capture_golden_entry(const StepLayerOutputs& outputs,
                                         std::int64_t whole_pool_max_bytes) {
  const std::string where = fmt::format("step {} layer {}", outputs.step, outputs.layer_id);
  if (outputs.backend == nullptr || outputs.backend_pool == nullptr) {
    return internal_error(where, "a golden file needs the backend's outputs and pool");
  }
  GoldenEntry entry;
  entry.step = outputs.step;
  entry.layer_id = outputs.layer_id;
  entry.shape = outputs.shape;
  entry.out = outputs.backend->out_bf16;
  entry.lse = outputs.backend->lse;
  entry.pool = capture_pool(*outputs.backend_pool, outputs.written_slots, whole_pool_max_bytes);
  return entry;
}

// Compiler, C library and HDF5 versions of this binary.
nlohmann::json current_platform() {
  nlohmann::json platform = nlohmann::json::object();
#if defined(__clang__)
  platform["compiler"] = fmt::format("clang {}", __clang_version__);
#elif defined(__GNUC__)
  platform["compiler"] = fmt::format("gcc {}", __VERSION__);
#endif
#if defined(KVAUDIT_HAVE_GLIBC_VERSION)
  platform["libc"] = fmt::format("glibc {}", gnu_get_libc_version());
#endif
  unsigned major = 0;
  unsigned minor = 0;
  unsigned release = 0;
  if (H5get_libversion(&major, &minor, &release) >= 0) {
    platform["hdf5"] = fmt::format("{}.{}.{}", major, minor, release);
  }
  return platform;
}

GoldenProvenance current_golden_provenance(std::string_view revision) {
  const Provenance process = current_provenance();
  GoldenProvenance provenance;
  provenance.kvaudit_version = kvaudit_version();
  provenance.kvaudit_revision = std::string(revision);
  provenance.kvaudit_dirty = revision_is_dirty(revision);
  provenance.platform = current_platform();
  provenance.date_utc = process.date_utc;
  provenance.host = process.host;
  provenance.command_line = process.command_line;
  return provenance;
}

Result<Golden> record_golden(const DumpReader& reader, Backend& backend,
                             const GoldenRecordOptions& options) {
  Golden golden;
  golden.whole_pool_max_bytes = options.whole_pool_max_bytes;
  ReplayOptions replay = options.replay;
  replay.observer = [&golden, &options](const StepLayerOutputs& outputs) -> Status {
    KVAUDIT_ASSIGN_OR_RETURN(GoldenEntry entry,
                             capture_golden_entry(outputs, options.whole_pool_max_bytes));
    golden.entries.push_back(std::move(entry));
    return ok_status();
  };
  KVAUDIT_ASSIGN_OR_RETURN(const CheckRun run, replay_dump(reader, &backend, replay));
  const DumpLayout& layout = reader.layout();
  sort_entries(layout, golden.entries);
  for (const LayerMeta& layer : layout.layers) {
    const auto& ids = options.replay.layer_ids;
    if (ids.empty() || std::find(ids.begin(), ids.end(), layer.layer_id) != ids.end()) {
      golden.layer_ids.push_back(layer.layer_id);
    }
  }
  for (std::size_t s = 0; s < layout.steps.size(); ++s) {
    const auto& steps = options.replay.step_indices;
    if (steps.empty() ||
        std::find(steps.begin(), steps.end(), static_cast<int>(s)) != steps.end()) {
      golden.step_indices.push_back(static_cast<int>(s));
    }
  }
  golden.provenance = current_golden_provenance(options.kvaudit_revision);
  golden.provenance.backend = run.backend;
  golden.provenance.backend_description = run.backend_description;
  golden.provenance.policy = run.policy.name;
  return golden;
}

}  // namespace kvaudit
