// Opening a damaged HDF5 file can crash, hang or end the process inside the HDF5 library itself:
// HDF5 1.10 reads variable-length strings (h5py's default for string attributes) from its global
// heap without checking it (an overlapping memcpy in H5HG_read, or a wild read), and some corrupt
// metadata makes it loop. No checking in kvaudit's own code can prevent that, so the CLI first
// opens the dump in a child process. The child reports its verdict through a pipe and exits 0;
// any other end of it (killed by a signal, an exit status of its own such as a sanitizer's or a
// library's exit(), a verdict never sent, no end within the time limit) means the file is
// damaged, which is bad input (exit 2), not a crash of kvaudit.
#pragma once

#include <filesystem>
#include <functional>

#include "src/core/result.hpp"

namespace kvaudit {

// Validates `path` (DumpReader::open) in a forked child. Returns an error only when the child
// ended abnormally or timed out; a file the reader refuses or accepts returns ok (the caller opens
// it again and reports the reader's own message). Call before any thread or CUDA context exists.
// Opening reads metadata and the small index datasets only, so the time limit is generous:
// 60 s, or the environment variable KVAUDIT_OPEN_TIMEOUT (seconds).
Status probe_dump_in_child(const std::filesystem::path& path);

// The mechanism behind it: runs `probe` in a forked child with a limit of `timeout_seconds`. The
// child's end is normal only when `probe` returns (whatever it returns); any other end is an error
// naming `path` as damaged. Without fork (it failed) it returns ok and runs nothing.
Status probe_in_child(const std::filesystem::path& path, const std::function<void()>& probe,
                      int timeout_seconds);

}  // namespace kvaudit
