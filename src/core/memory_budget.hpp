// What this machine can hold, so that a command asked for an absurd size refuses before it
// allocates (exit 2, with the size it would need) instead of growing until the kernel or
// std::bad_alloc stops it minutes later.
//
//   memory: MemAvailable (/proc/meminfo), lowered to what the process's cgroup still allows
//           (cgroup v2 memory.max - memory.current, or v1 memory.limit_in_bytes - usage), or the
//           environment variable KVAUDIT_MEMORY_BUDGET when set: bytes, or a number with a
//           suffix K, M, G or T (powers of 1024), e.g. "512M" (tests use it to be independent of
//           the machine);
//   disk:   the space an unprivileged user may still take in a folder (statvfs f_bavail).
//
// Sizes are doubles: estimates multiply user-given counts, which can overflow 64-bit integers.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>

#include "src/core/result.hpp"

namespace kvaudit {

// "512 B", "3.2 KiB", "6.3 GiB", "1.2e+06 TiB".
std::string format_bytes(double bytes);

// Parses KVAUDIT_MEMORY_BUDGET's syntax ("123", "64K", "512M", "8G", "1T"); nothing when malformed.
std::optional<double> parse_byte_count(std::string_view text);

// Bytes of memory a command may still allocate (see above); nothing when it cannot be told.
std::optional<double> available_memory_bytes();

// Bytes that may still be written in `folder`; nothing when it cannot be told.
std::optional<double> free_disk_bytes(const std::filesystem::path& folder);

// Bad input at `where` when `bytes` exceeds the available memory: "needs about 6.3 GiB of memory
// (<what>); 4.0 GiB is available".
Status check_memory_fits(double bytes, std::string_view where, std::string_view what);

// The same for disk space in `folder`.
Status check_disk_fits(double bytes, const std::filesystem::path& folder, std::string_view where,
                       std::string_view what);

}  // namespace kvaudit
