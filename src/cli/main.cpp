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
  // "--threads: 1 required INT missing": the option was given without its value.
  if (dynamic_cast<const CLI::ArgumentMismatch*>(&e) != nullptr && what.ends_with(" missing")) {
    what = what.substr(0, what.find(": ") + 2) + "needs a value";
  }
  std::string where = cmd ? cmd->get_name() : std::string();
  // "--threads: ..." or "DUMP: ..." (a validator's message): the option joins the command.
  if (const std::size_t colon = what.find(": ");
      colon != std::string::npos && what.substr(0, colon).find(' ') == std::string::npos) {
    where += (where.empty() ? "" : " ") + what.substr(0, colon);
    what = what.substr(colon + 2);
  }
  return where.empty() ? fmt::format("kvaudit: {}", what)
                       : fmt::format("kvaudit: {}: {}", where, what);
}

// Before parsing: a command must be named, and it must exist. The exit status when it ends the
// run here.
std::optional<int> check_command_name(const CLI::App& app, int argc, char** argv) {
  if (argc < 2) {
    std::vector<std::string> names;
    for (const CLI::App* sub : app.get_subcommands({})) names.push_back(sub->get_name());
    std::cerr << fmt::format("kvaudit: a command is required: {} (kvaudit --help)\n",
                             fmt::join(names, ", "));
    return kExitBadInput;
  }
  const std::string first = argv[1];
  if (first.empty() || first[0] == '-') return std::nullopt;  // --help, --version, or an error
  for (const CLI::App* sub : app.get_subcommands({})) {
    if (sub->get_name() == first) return std::nullopt;
  }
  return report_error(unknown_command(app, first));
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
    const CLI::App* cmd = nullptr;
    for (const CLI::App* sub : app.get_subcommands({})) {
      if (argc > 1 && sub->get_name() == argv[1]) cmd = sub;
    }
    std::cerr << parse_error_line(app, cmd, e) << "\n";
    return kExitBadInput;
  }
  return std::nullopt;
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
  register_bench_command(app, runner);
  register_help_command(app, runner);
  refuse_empty_values(app);
  if (const std::optional<int> status = check_command_name(app, argc, argv)) return *status;
  if (const std::optional<int> status = parse_command_line(app, argc, argv)) return *status;
  if (const Status outputs = validate_output_options(*app.get_subcommands().front()); !outputs) {
    return report_error(outputs.error());
  }
  return run_command(runner);
}
