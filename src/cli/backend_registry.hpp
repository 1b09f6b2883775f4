// The backend registry: --backend NAME -> a Backend (src/backend/backend.hpp). It lives with the
// command line because it is the one place that knows every implementation (kernels/ registers
// nothing itself), so the backend interface below it depends on none of them.
//
// Names: the built-in backends (backend_names()), and exec:NAME, a program outside kvaudit that
// speaks the external backend protocol (src/backend/exec_backend.hpp, docs/backend-protocol.md);
// NAME is letters, digits, '-', '_', '.'.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "src/backend/backend.hpp"
#include "src/core/result.hpp"

namespace kvaudit {

// Names of the built-in backends, in the order --help lists them ("none" is handled by the
// caller; exec:NAME is not listed).
std::vector<std::string> backend_names();

inline constexpr std::string_view kExecPrefix = "exec:";
// NAME of "exec:NAME"; nothing for another name. Does not validate NAME.
std::optional<std::string_view> exec_backend_name(std::string_view backend);

// A built-in backend, or for exec:NAME the program started and greeted (options.exec_command,
// options.dump).
Result<std::unique_ptr<Backend>> make_backend(std::string_view name, const BackendOptions& options);

}  // namespace kvaudit
