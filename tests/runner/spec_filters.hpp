// Test specs as Catch2 2.13 reads them, for the runner's skips (tests/test_main.cpp): every
// command-line argument goes through one parser; a top-level comma ends a filter (the filters are
// alternatives), the end of an argument only ends the pattern it was in, so one filter may span
// several arguments (their patterns all apply); a backslash escapes the next character. Taking a
// tag out of a selection therefore means adding `~[tag]` at the start of every filter.
#pragma once

#include <set>
#include <string>
#include <vector>

namespace Catch {
struct IConfig;
}

namespace kvaudit_test {

// The names of the cases a test spec, given as command-line arguments, selects: Catch2's own
// parser (defined in tests/test_main.cpp, the one file that compiles Catch2's implementation).
std::set<std::string> names_selected_by(const std::vector<std::string>& args,
                                        const Catch::IConfig& config);

// One filter: the pieces of the arguments it spans, blank pieces left out.
using SpecFilter = std::vector<std::string>;

inline bool blank(const std::string& text) {
  return text.find_first_not_of(" \t") == std::string::npos;
}

// The filters of a command line's test spec, in order; filters with no pattern are left out.
inline std::vector<SpecFilter> split_spec_filters(const std::vector<std::string>& args) {
  std::vector<SpecFilter> filters(1);
  auto end_piece = [&](std::string& piece) {
    if (!blank(piece)) filters.back().push_back(piece);
    piece.clear();
  };
  for (const std::string& arg : args) {
    std::string piece;
    for (std::size_t i = 0; i < arg.size(); ++i) {
      if (arg[i] == '\\' && i + 1 < arg.size()) {
        piece += arg.substr(i++, 2);
      } else if (arg[i] == ',') {
        end_piece(piece);
        filters.emplace_back();
      } else {
        piece += arg[i];
      }
    }
    end_piece(piece);
  }
  std::erase_if(filters, [](const SpecFilter& filter) { return filter.empty(); });
  return filters;
}

// Command-line arguments that select what `filters` select, less every case carrying one of
// `excluded_tags` (lower case, without brackets). No filters at all selects every case that is
// not hidden, so that selection becomes `~[.]` and the exclusions.
inline std::vector<std::string> join_spec_filters(const std::vector<SpecFilter>& filters,
                                                  const std::vector<std::string>& excluded_tags) {
  std::string exclusions;
  for (const std::string& tag : excluded_tags) exclusions += "~[" + tag + "]";
  if (filters.empty()) return {"~[.]" + exclusions};
  std::vector<std::string> args;
  for (std::size_t f = 0; f < filters.size(); ++f) {
    for (std::size_t p = 0; p < filters[f].size(); ++p) {
      args.push_back(p == 0 ? exclusions + filters[f][p] : filters[f][p]);
    }
    if (f + 1 < filters.size()) args.back() += ",";
  }
  return args;
}

}  // namespace kvaudit_test
