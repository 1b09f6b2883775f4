// Build and host description for provenance (see build_info.hpp).
#include "src/core/build_info.hpp"

#include <fmt/format.h>
#include <sched.h>

#include <fstream>

#include "kvaudit_git_revision.hpp"  // generated: KVAUDIT_GIT_REVISION

namespace kvaudit {

const char* kvaudit_git_revision() { return KVAUDIT_GIT_REVISION; }

bool revision_is_dirty(std::string_view revision) { return revision.ends_with("-dirty"); }

std::string cpu_description() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  std::string model = "unknown";
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) != 0) continue;
    const auto value = line.find_first_not_of(" \t", line.find(':') + 1);
    if (line.find(':') != std::string::npos && value != std::string::npos) {
      model = line.substr(value);
    }
    break;
  }
  cpu_set_t set;
  CPU_ZERO(&set);
  const int cpus = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 0;
  return cpus > 0 ? fmt::format("{} ({} CPUs)", model, cpus) : model;
}

}  // namespace kvaudit
