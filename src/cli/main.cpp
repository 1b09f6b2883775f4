// kvaudit: numerical accuracy harness for FP8 e4m3 KV-cache MLA attention.
//
// main() builds the command line from the subcommands (each registers itself from its
// src/cli/cli_<name>.cpp), then: refuses an unknown command by name (with a suggestion), parses,
// turns any parser error into one line on stderr (exit 2), checks every output path the chosen
// command was given (before any work), and runs the command. Exit status: 0 pass, 1 checks
// failed, 2 bad input or usage, 3 internal error (src/cli/cli.hpp).
#include <fmt/format.h>

#include <exception>
#include <iostream>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include "src/cli/cli.hpp"

namespace kvaudit {
namespace {

constexpr const char* kDescription =
    "kvaudit: replay MLA attention kvdumps (HDF5) through FP8 KV-cache kernels and a "
    "high-precision reference; report per-layer kernel and quantization error and cache "
    "integrity.\n"
    "Exit status of every command: 0 pass, 1 checks failed, 2 bad input or usage (one line on "
    "stderr says what), 3 internal error.";

constexpr const char* kFooter =
    "`kvaudit help COMMAND` (or `kvaudit COMMAND --help`) describes a command and its options.";

// The names of the commands of `level`, for messages.
std::vector<std::string> command_names(const CLI::App& level) {
  std::vector<std::string> names;
  for (const CLI::App* sub : level.get_subcommands({})) names.push_back(sub->get_name());
  return names;
}

// Names of the long options of `cmd` ("--threads"), for suggestions.
std::vector<std::string> option_names(const CLI::App& cmd) {
  std::vector<std::string> names;
  for (const CLI::Option* option : cmd.get_options()) {
    for (const std::string& name : option->get_lnames()) names.push_back("--" + name);
  }
  return names;
}

// An argument the parser did not expect: an unknown option (with the closest one) or a surplus
// positional argument.
std::string unexpected_arguments(const CLI::App& app, const CLI::App* cmd) {
  const std::vector<std::string> extras = app.remaining(true);
  for (const std::string& extra : extras) {
    if (extra.size() < 2 || extra[0] != '-') continue;
    const std::string given = extra.substr(0, extra.find('='));
    const std::string closest = cmd ? closest_name(given, option_names(*cmd)) : std::string();
    return fmt::format("unknown option {}{}", given,
                       closest.empty() ? "" : fmt::format(" (did you mean {}?)", closest));
  }
  return extras.empty() ? std::string("unexpected arguments")
                        : fmt::format("unexpected argument '{}'", extras.front());
}

// A parser error as one line: "kvaudit: check --threads: '-1' is not an integer from 0 to 1024",
// "kvaudit: info: DUMP is required", "kvaudit: check: unknown option --tread (did you mean
// --threads?)".
std::string parse_error_line(const CLI::App& app, const CLI::App* cmd, const CLI::ParseError& e) {
  std::string what = e.what();
  for (char& c : what) {
    if (c == '\n') c = ' ';
  }
  while (!what.empty() && what.back() == ' ') what.pop_back();
  if (dynamic_cast<const CLI::ExtrasError*>(&e) != nullptr) what = unexpected_arguments(app, cmd);
  if (what.find("subcommand is required") != std::string::npos) {
    what =
        fmt::format("a command is required: {}", fmt::join(command_names(cmd ? *cmd : app), ", "));
  }
  // "--threads: 1 required INT missing": the option was given without its value.
  if (dynamic_cast<const CLI::ArgumentMismatch*>(&e) != nullptr && what.ends_with(" missing")) {
    what = what.substr(0, what.find(": ") + 2) + "needs a value";
  }
  std::string where;
  for (const CLI::App* level = cmd; level != nullptr && level->get_parent() != nullptr;
       level = level->get_parent()) {
    where = level->get_name() + (where.empty() ? "" : " " + where);
  }
  // "--threads: ..." or "DUMP: ..." (a validator's message): the option joins the command.
  if (const std::size_t colon = what.find(": ");
      colon != std::string::npos && what.substr(0, colon).find(' ') == std::string::npos) {
    where += (where.empty() ? "" : " ") + what.substr(0, colon);
    what = what.substr(colon + 2);
  }
  return where.empty() ? fmt::format("kvaudit: {}", what)
                       : fmt::format("kvaudit: {}: {}", where, what);
}

// Before parsing: a command must be named, and it must exist (at every level: "golden record").
// The exit status when it ends the run here.
std::optional<int> check_command_name(const CLI::App& app, int argc, char** argv) {
  if (argc < 2) {
    std::cerr << fmt::format("kvaudit: a command is required: {} (kvaudit --help)\n",
                             fmt::join(command_names(app), ", "));
    return kExitBadInput;
  }
  const CLI::App* level = &app;
  for (int i = 1; i < argc && !level->get_subcommands({}).empty(); ++i) {
    const std::string word = argv[i];
    if (word.empty() || word[0] == '-') break;  // --help, --version, an option, or an error
    const CLI::App* next = nullptr;
    for (const CLI::App* sub : level->get_subcommands({})) {
      if (sub->get_name() == word) next = sub;
    }
    if (next == nullptr) {
      // A positional argument where the level takes one; else a mistyped command.
      if (level != &app && level->get_require_subcommand_min() == 0) break;
      return report_error(unknown_command(*level, word));
    }
    level = next;
  }
  return std::nullopt;
}

// The innermost command named by the leading words of the command line ("golden record"), for
// messages; nothing when the first word names none.
const CLI::App* named_command(const CLI::App& app, int argc, char** argv) {
  const CLI::App* named = nullptr;
  const CLI::App* level = &app;
  for (int i = 1; i < argc; ++i) {
    const CLI::App* next = nullptr;
    for (const CLI::App* sub : level->get_subcommands({})) {
      if (sub->get_name() == argv[i]) next = sub;
    }
    if (next == nullptr) break;
    named = level = next;
  }
  return named;
}

// Parses the command line. Returns the exit status when parsing ends the run: --help and
// --version (0, after printing), a usage error (2, after one line on stderr); nothing otherwise.
std::optional<int> parse_command_line(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << parse_error_line(app, named_command(app, argc, argv), e) << "\n";
    return kExitBadInput;
  }
  return std::nullopt;
}

// Every command chosen on the parsed command line, outermost first ("golden", then "record").
std::vector<const CLI::App*> chosen_commands(const CLI::App& app) {
  std::vector<const CLI::App*> chosen;
  for (const CLI::App* level = &app; !level->get_subcommands().empty();) {
    level = level->get_subcommands().front();
    chosen.push_back(level);
  }
  return chosen;
}

// Runs the chosen command. Errors are values inside kvaudit; an exception that still escapes
// (out of memory, a library's) is an internal error, reported on one line.
int run_command(const CommandRunner& runner) {
  try {
    return runner ? runner() : kExitBadInput;
  } catch (const std::bad_alloc&) {
    std::cerr << "kvaudit: out of memory\n";
    return kExitInternal;
  } catch (const std::exception& e) {
    std::cerr << "kvaudit: internal error: " << e.what() << "\n";
    return kExitInternal;
  }
}

}  // namespace
}  // namespace kvaudit

int main(int argc, char** argv) {
  using namespace kvaudit;
  CLI::App app{kDescription, "kvaudit"};
  use_wrapping_help(app, help_width());  // before the subcommands, which copy the formatter
  app.footer(kFooter);
  app.set_version_flag("--version", std::string("kvaudit ") + KVAUDIT_VERSION);
  app.require_subcommand(1);
  CommandRunner runner;
  register_info_command(app, runner);
  register_synth_command(app, runner);
  register_check_command(app, runner);
  register_calibrate_command(app, runner);
  register_bench_command(app, runner);
  register_golden_command(app, runner);
  register_verify_report_command(app, runner);
  register_keygen_command(app, runner);
  register_merge_command(app, runner);
  register_backend_serve_command(app, runner);
  register_help_command(app, runner);
  refuse_empty_values(app);
  if (const std::optional<int> status = check_command_name(app, argc, argv)) return *status;
  if (const std::optional<int> status = parse_command_line(app, argc, argv)) return *status;
  for (const CLI::App* command : chosen_commands(app)) {
    if (const Status outputs = validate_output_options(*command); !outputs) {
      return report_error(outputs.error());
    }
  }
  return run_command(runner);
}
