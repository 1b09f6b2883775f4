// The golden file on disk: HDF5, format "kvaudit-golden" version 1 (docs/golden-format.md).
//
//   /                        attributes: format, format_version, dump_path, dump_sha256, backend,
//                            backend_description (JSON text), kvaudit_version, kvaudit_revision,
//                            platform (JSON text), policy, date_utc, host, command_line,
//                            whole_pool_max_bytes
//   /layer_ids               int32 [L]   recorded layers (dump order)
//   /step_indices            int32 [St]  recorded steps
//   /steps/S###/L###         attributes: step, layer_id, pool_storage ("whole" | "digest"),
//                            pool_dtype, pool_num_slots, pool_row_width, pool_sha256
//     out                    u16 [Nq, H, Dc]  bf16 bits (attribute dtype = "bfloat16")
//     lse                    float32 [Nq, H]
//     pool_written_slots     int64 [Nw]
//     pool                   u8 [S, row_bytes]   (pool_storage = whole)
//     pool_written_rows      u8 [Nw, row_bytes]  (pool_storage = digest)
// S### is the step index, L### the layer id. Non-empty datasets are chunked whole and compressed
// (byte shuffle + deflate 9: bf16 bits compress to ~70%, close to the entropy of their mantissas).
// Strings are fixed-length (no HDF5 global heap, whose damage HDF5 1.10 does not survive), and no
// object carries a timestamp.
#pragma once

#include <filesystem>

#include "src/core/result.hpp"
#include "src/report/golden.hpp"

namespace kvaudit {

// Writes `golden` to `path` atomically: into a temporary file beside it, renamed over `path` once
// complete, so a reader (or a CI job killed half-way) never sees a partial golden file.
Status write_golden_file(const std::filesystem::path& path, const Golden& golden);

// Reads and validates a golden file: every error is bad input naming "file:/hdf5/object" (not an
// HDF5 file, another format, a version this kvaudit does not read, missing or misshapen objects).
Result<Golden> read_golden_file(const std::filesystem::path& path);

// Before any work: `path` can be written (its folder exists and is writable, and it is not a
// folder itself). Bad input naming `option` and the path otherwise.
Status check_output_file(const std::filesystem::path& path, const std::string& option);

}  // namespace kvaudit
