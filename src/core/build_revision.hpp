// The git revision kvaudit was configured from (`git describe --always --dirty`, "unknown" outside
// a git checkout), for provenance: golden files record it beside KVAUDIT_VERSION. CMake writes it
// at configure time into one generated source (src/core/build_revision.cpp.in), so a new revision
// recompiles that file alone, never the whole tree; it is the revision of the last configure.
#pragma once

namespace kvaudit {

const char* kvaudit_git_revision();

}  // namespace kvaudit
