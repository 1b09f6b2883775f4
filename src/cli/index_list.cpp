// Index lists of the command line (--layers, --steps): "0,1,77" or ranges "0-3,7", non-negative
// integers; shared by `kvaudit check` and `kvaudit golden`.
#include <fmt/format.h>

#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "src/cli/cli.hpp"

namespace kvaudit {
namespace {

// One item of an index list, "7" or "0-3", onto `values`. Returns why it is neither; std::stoi
// throws where it does not start with a number.
std::optional<std::string> parse_index_item(const std::string& item, std::vector<int>& values) {
  const auto dash = item.find('-', 1);
  std::size_t used = 0;
  if (dash == std::string::npos) {
    const int value = std::stoi(item, &used);
    if (used != item.size() || value < 0) return fmt::format("'{}' is not an index", item);
    values.push_back(value);
    return std::nullopt;
  }
  const std::string low_text = item.substr(0, dash);
  const std::string high_text = item.substr(dash + 1);
  std::size_t used_high = 0;
  const int low = std::stoi(low_text, &used);
  const int high = std::stoi(high_text, &used_high);
  if (used != low_text.size() || used_high != high_text.size() || low < 0 || high < low) {
    return fmt::format("'{}' is not a range", item);
  }
  for (int v = low; v <= high; ++v) values.push_back(v);
  return std::nullopt;
}

}  // namespace

Result<std::vector<int>> parse_index_list(const std::string& text, const std::string& option) {
  auto bad = [&](const std::string& why) {
    return bad_input(option, fmt::format("'{}': {} (expected e.g. 0,1,77 or 0-3)", text, why));
  };
  std::vector<int> values;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ',')) {
    if (item.empty()) continue;
    try {
      if (const std::optional<std::string> why = parse_index_item(item, values)) return bad(*why);
    } catch (const std::exception&) {
      return bad(fmt::format("'{}' is not an index", item));
    }
  }
  if (values.empty()) return bad("no index given");
  return values;
}

}  // namespace kvaudit
