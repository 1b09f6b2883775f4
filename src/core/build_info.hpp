// What this binary was built from and runs on, for report provenance: the git revision of the
// source tree (written into a generated header at build time, cmake/git_revision.cmake) and the
// host's CPU model (/proc/cpuinfo).
#pragma once

#include <string>
#include <string_view>

namespace kvaudit {

// 12 hex digits of the commit, with "-dirty" when tracked files differed from it at build time;
// "unknown" when the build had no git checkout.
const char* kvaudit_git_revision();

// Whether `revision` (as kvaudit_git_revision() writes it) names a tree with uncommitted changes:
// it ends in "-dirty". Outputs of such a build are not reproducible from the commit alone.
bool revision_is_dirty(std::string_view revision);

// "AMD EPYC 9654 96-Core Processor (2 CPUs)": the first "model name" of /proc/cpuinfo and the
// CPUs this process may run on; "unknown" where /proc/cpuinfo has no model name.
std::string cpu_description();

}  // namespace kvaudit
