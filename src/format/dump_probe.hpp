// Opening a damaged HDF5 file can crash or hang inside the HDF5 library itself: HDF5 1.10 reads
// variable-length strings (h5py's default for string attributes) from its global heap without
// checking it, and some corrupt metadata makes it loop. No checking in kvaudit's own code can
// prevent that, so the CLI first opens the dump in a child process: a child that dies by a
// signal or does not finish in time means the file is damaged, which is bad input (exit 2), not
// a crash of kvaudit.
#pragma once

#include <filesystem>

#include "src/core/result.hpp"

namespace kvaudit {

// Validates `path` (DumpReader::open) in a forked child. Returns an error only when the child
// crashed or timed out; a file the reader refuses or accepts returns ok (the caller opens it
// again and reports the reader's own message). Call before any thread or CUDA context exists.
// Opening reads metadata and the small index datasets only, so the time limit is generous:
// 60 s, or the environment variable KVAUDIT_OPEN_TIMEOUT (seconds).
Status probe_dump_in_child(const std::filesystem::path& path);

}  // namespace kvaudit
