// Available memory and disk space (src/core/memory_budget.hpp).
#include "src/core/memory_budget.hpp"

#include <fmt/format.h>
#include <sys/statvfs.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

namespace kvaudit {
namespace {

// The first number in a file ("max" and unreadable files give nothing).
std::optional<double> read_number(const char* path) {
  std::ifstream in(path);
  double value = 0;
  if (!(in >> value)) return std::nullopt;
  return value;
}

// MemAvailable in bytes.
std::optional<double> meminfo_available() {
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("MemAvailable:", 0) == 0) {
      std::istringstream fields(line.substr(13));
      double kib = 0;
      if (fields >> kib) return kib * 1024.0;
    }
  }
  return std::nullopt;
}

// What the cgroup still allows (limit - usage), where a limit is set. Unlimited reads as a huge
// number (v1) or "max" (v2, no number).
std::optional<double> cgroup_available() {
  constexpr double kUnlimited = 1e18;
  const std::pair<const char*, const char*> files[] = {
      {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"},
      {"/sys/fs/cgroup/memory/memory.limit_in_bytes",
       "/sys/fs/cgroup/memory/memory.usage_in_bytes"}};
  for (const auto& [limit_file, usage_file] : files) {
    const std::optional<double> limit = read_number(limit_file);
    if (!limit || *limit >= kUnlimited) continue;
    const double usage = read_number(usage_file).value_or(0.0);
    return std::max(0.0, *limit - usage);
  }
  return std::nullopt;
}

}  // namespace

std::string format_bytes(double bytes) {
  constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int unit = 0;
  while (bytes >= 1024.0 && unit < 4) {
    bytes /= 1024.0;
    ++unit;
  }
  if (unit == 0) return fmt::format("{:.0f} B", bytes);
  return fmt::format("{:.3g} {}", bytes, kUnits[unit]);
}

std::optional<double> parse_byte_count(std::string_view text) {
  if (text.empty()) return std::nullopt;
  double multiplier = 1.0;
  switch (text.back()) {
    case 'K':
    case 'k':
      multiplier = 1024.0;
      break;
    case 'M':
    case 'm':
      multiplier = 1024.0 * 1024.0;
      break;
    case 'G':
    case 'g':
      multiplier = 1024.0 * 1024.0 * 1024.0;
      break;
    case 'T':
    case 't':
      multiplier = 1024.0 * 1024.0 * 1024.0 * 1024.0;
      break;
    default:
      break;
  }
  if (multiplier != 1.0) text.remove_suffix(1);
  const std::string number(text);
  char* end = nullptr;
  const double value = std::strtod(number.c_str(), &end);
  if (number.empty() || end != number.c_str() + number.size() || !std::isfinite(value) ||
      value < 0) {
    return std::nullopt;
  }
  return value * multiplier;
}

std::optional<double> available_memory_bytes() {
  if (const char* budget = std::getenv("KVAUDIT_MEMORY_BUDGET"); budget != nullptr && *budget) {
    if (const std::optional<double> bytes = parse_byte_count(budget)) return bytes;
  }
  std::optional<double> available = meminfo_available();
  if (const std::optional<double> cgroup = cgroup_available()) {
    available = available ? std::min(*available, *cgroup) : *cgroup;
  }
  return available;
}

std::optional<double> free_disk_bytes(const std::filesystem::path& folder) {
  struct statvfs info {};
  if (statvfs(folder.empty() ? "." : folder.c_str(), &info) != 0) return std::nullopt;
  return static_cast<double>(info.f_bavail) * static_cast<double>(info.f_frsize);
}

Status check_memory_fits(double bytes, std::string_view where, std::string_view what) {
  const std::optional<double> available = available_memory_bytes();
  if (!available || bytes <= *available) return ok_status();
  return bad_input(std::string(where),
                   fmt::format("needs about {} of memory ({}); {} is available",
                               format_bytes(bytes), what, format_bytes(*available)));
}

Status check_disk_fits(double bytes, const std::filesystem::path& folder, std::string_view where,
                       std::string_view what) {
  const std::optional<double> available = free_disk_bytes(folder);
  if (!available || bytes <= *available) return ok_status();
  return bad_input(
      std::string(where),
      fmt::format("needs about {} of disk space ({}); {} is free in {}", format_bytes(bytes), what,
                  format_bytes(*available), folder.empty() ? std::string(".") : folder.string()));
}

}  // namespace kvaudit
