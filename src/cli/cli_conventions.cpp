// The conventions of kvaudit's command line (src/cli/cli.hpp): commands with their help and exit
// statuses, FILE/DIR options and the up-front check of every output path, numeric options with
// plain range messages, the refusal of empty values, and "did you mean" suggestions.
#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "src/cli/cli.hpp"

namespace kvaudit {
namespace {

// A FILE or DIR option: where its value lands, and whether kvaudit writes it.
struct PathOption {
  const CLI::Option* option = nullptr;
  const std::string* value = nullptr;
  OutputKind kind = OutputKind::kFile;
  bool output = false;
};

// Every FILE/DIR option declared by any command (one CLI::App per process).
std::vector<PathOption>& path_options() {
  static std::vector<PathOption> options;
  return options;
}

const PathOption* find_path_option(const CLI::Option* option) {
  for (const PathOption& entry : path_options()) {
    if (entry.option == option) return &entry;
  }
  return nullptr;
}

// The path two options are compared by: absolute, with existing links and dots resolved.
std::filesystem::path comparable(const std::string& path) {
  std::error_code error;
  std::filesystem::path resolved = std::filesystem::weakly_canonical(path, error);
  if (error) resolved = std::filesystem::absolute(path, error);
  return resolved;
}

// The given FILE/DIR options of `cmd`, in declaration order.
std::vector<const PathOption*> given_path_options(const CLI::App& cmd) {
  std::vector<const PathOption*> given;
  for (const CLI::Option* option : cmd.get_options()) {
    const PathOption* entry = find_path_option(option);
    if (entry != nullptr && option->count() > 0 && !entry->value->empty()) given.push_back(entry);
  }
  return given;
}

// No output names the same path as an earlier output or as any input.
Status check_distinct_paths(const std::vector<const PathOption*>& given) {
  for (std::size_t i = 0; i < given.size(); ++i) {
    if (!given[i]->output) continue;
    const std::filesystem::path path = comparable(*given[i]->value);
    for (std::size_t j = 0; j < given.size(); ++j) {
      if (j == i || (given[j]->output && j > i)) continue;
      if (comparable(*given[j]->value) != path) continue;
      const std::string other = given[j]->option->get_name();
      return bad_input(fmt::format("{} {}", given[i]->option->get_name(), *given[i]->value),
                       given[j]->output ? fmt::format("is also the path of {}", other)
                                        : fmt::format("is the input {}; write elsewhere", other));
    }
  }
  return ok_status();
}

// Optimal string alignment distance (Levenshtein plus adjacent transpositions).
std::size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::vector<std::size_t>> d(a.size() + 1, std::vector<std::size_t>(b.size() + 1));
  for (std::size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[a.size()][b.size()];
}

template <typename Integer>
CLI::Option* add_bounded_integer(CLI::App& cmd, const std::string& name, Integer& value,
                                 std::int64_t lo, std::int64_t hi, const std::string& description) {
  return cmd.add_option(name, value, fmt::format("{} ({}..{})", description, lo, hi))
      ->check(integer_in(lo, hi));
}

}  // namespace

CLI::App* add_command(CLI::App& app, const std::string& name, const CommandHelp& help) {
  std::string description = help.summary;
  if (!help.details.empty()) description += "\n" + help.details;
  description += "\nExit status: " + help.exit_statuses + ".";
  return app.add_subcommand(name, description)->group("Commands");
}

CLI::Option* add_input_file(CLI::App& cmd, const std::string& name, std::string& path,
                            const std::string& description) {
  CLI::Option* option = cmd.add_option(name, path, description)->type_name("FILE");
  path_options().push_back({option, &path, OutputKind::kFile, false});
  return option;
}

CLI::Option* add_output_path(CLI::App& cmd, const std::string& name, std::string& path,
                             OutputKind kind, const std::string& description) {
  CLI::Option* option =
      cmd.add_option(name, path, description)->type_name(std::string(output_kind_name(kind)));
  path_options().push_back({option, &path, kind, true});
  return option;
}

CLI::Option* add_integer_option(CLI::App& cmd, const std::string& name, int& value, int lo, int hi,
                                const std::string& description) {
  return add_bounded_integer(cmd, name, value, lo, hi, description);
}

CLI::Option* add_integer_option(CLI::App& cmd, const std::string& name, std::int64_t& value,
                                std::int64_t lo, std::int64_t hi, const std::string& description) {
  return add_bounded_integer(cmd, name, value, lo, hi, description);
}

CLI::Option* add_integer_option(CLI::App& cmd, const std::string& name, std::size_t& value,
                                std::size_t lo, std::size_t hi, const std::string& description) {
  return add_bounded_integer(cmd, name, value, static_cast<std::int64_t>(lo),
                             static_cast<std::int64_t>(hi), description);
}

CLI::Option* add_seed_option(CLI::App& cmd, const std::string& name, std::uint64_t& value,
                             const std::string& description) {
  const CLI::Validator seed(
      [](std::string& text) -> std::string {
        std::uint64_t parsed = 0;
        const char* end = text.data() + text.size();
        const auto [stop, error] = std::from_chars(text.data(), end, parsed);
        if (error != std::errc() || stop != end) {
          return fmt::format("'{}' is not an integer from 0 to 2^64-1", text);
        }
        return {};
      },
      "", "");
  return cmd.add_option(name, value, description)->check(seed);
}

CLI::Option* add_number_option(CLI::App& cmd, const std::string& name, double& value, double lo,
                               double hi, const std::string& description) {
  return cmd.add_option(name, value, fmt::format("{} ({:g}..{:g})", description, lo, hi))
      ->check(number_in(lo, hi));
}

CLI::Option* add_number_option(CLI::App& cmd, const std::string& name, float& value, double lo,
                               double hi, const std::string& description) {
  return cmd.add_option(name, value, fmt::format("{} ({:g}..{:g})", description, lo, hi))
      ->check(number_in(lo, hi));
}

CLI::Validator integer_in(std::int64_t lo, std::int64_t hi) {
  return CLI::Validator(
      [lo, hi](std::string& text) -> std::string {
        std::int64_t parsed = 0;
        const char* end = text.data() + text.size();
        const auto [stop, error] = std::from_chars(text.data(), end, parsed);
        if (error != std::errc() || stop != end || parsed < lo || parsed > hi) {
          return fmt::format("'{}' is not an integer from {} to {}", text, lo, hi);
        }
        return {};
      },
      "", "");
}

CLI::Validator number_in(double lo, double hi) {
  return CLI::Validator(
      [lo, hi](std::string& text) -> std::string {
        char* end = nullptr;
        const double parsed = std::strtod(text.c_str(), &end);
        if (text.empty() || end != text.c_str() + text.size() || !std::isfinite(parsed) ||
            parsed < lo || parsed > hi) {
          return fmt::format("'{}' is not a number from {:g} to {:g}", text, lo, hi);
        }
        return {};
      },
      "", "");
}

Status validate_output_options(const CLI::App& cmd) {
  const std::vector<const PathOption*> given = given_path_options(cmd);
  for (const PathOption* entry : given) {
    if (!entry->output) continue;
    KVAUDIT_TRY(validate_output_path(*entry->value, entry->kind, entry->option->get_name()));
  }
  return check_distinct_paths(given);
}

void refuse_empty_values(CLI::App& app) {
  const CLI::Validator not_empty(
      [](std::string& text) -> std::string { return text.empty() ? "the value is empty" : ""; }, "",
      "");
  for (CLI::Option* option : app.get_options()) {
    if (option->get_type_size() != 0) option->check(not_empty);
  }
  for (CLI::App* sub : app.get_subcommands({})) refuse_empty_values(*sub);
}

Error unknown_command(const CLI::App& app, const std::string& given) {
  std::vector<std::string> names;
  for (const CLI::App* sub : app.get_subcommands({})) names.push_back(sub->get_name());
  const std::string closest = closest_name(given, names);
  const std::string suggestion = closest.empty() ? "" : fmt::format(" (did you mean {}?)", closest);
  return bad_input("", fmt::format("unknown command '{}'{}; commands: {}", given, suggestion,
                                   fmt::join(names, ", ")));
}

std::string closest_name(const std::string& given, const std::vector<std::string>& names) {
  std::string best;
  std::size_t best_distance = 3;
  for (const std::string& name : names) {
    const std::size_t distance = edit_distance(given, name);
    if (distance < best_distance && 2 * distance < name.size()) {
      best = name;
      best_distance = distance;
    }
  }
  return best;
}

}  // namespace kvaudit
