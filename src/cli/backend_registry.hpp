// The backend registry: --backend NAME -> a Backend (src/backend/backend.hpp). It lives with the
// command line because it is the one place that knows every implementation (kernels/ registers
// nothing itself), so the backend interface below it depends on none of them.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "src/backend/backend.hpp"
#include "src/core/result.hpp"

namespace kvaudit {

// Names accepted by --backend, in the order --help lists them ("none" is handled by the caller).
std::vector<std::string> backend_names();
Result<std::unique_ptr<Backend>> make_backend(std::string_view name, const BackendOptions& options);

}  // namespace kvaudit
