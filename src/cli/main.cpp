// kvaudit: numerical accuracy harness for FP8 e4m3 KV-cache MLA attention.
//
// main() builds the command line from the subcommands (each registers itself from its
// src/cli/cli_<name>.cpp), parses it, then runs the chosen command. Exit status: 0 pass, 1 checks
// failed, 2 bad input or usage, 3 internal error (src/cli/cli.hpp).
#include <exception>
#include <iostream>
#include <new>
#include <optional>
#include <string>

#include "src/cli/cli.hpp"

namespace {

constexpr const char* kDescription =
    "kvaudit: replay MLA attention kvdumps (HDF5) through FP8 KV-cache kernels and a "
    "high-precision reference; report per-layer kernel and quantization error and cache "
    "integrity.\nExit status: 0 pass, 1 checks failed, 2 bad input or usage, 3 internal error.";

// Parses the command line. Returns the exit status when parsing ends the run: --help and
// --version (0, after printing), a usage error (2, after CLI11's message); nothing otherwise.
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
    app.exit(e);
    return kvaudit::kExitBadInput;
  }
  return std::nullopt;
}

// Runs the chosen command. Errors are values inside kvaudit; an exception that still escapes
// (out of memory, a library's) is an internal error, reported on one line.
int run_command(const kvaudit::CommandRunner& runner) {
  try {
    return runner ? runner() : kvaudit::kExitBadInput;
  } catch (const std::bad_alloc&) {
    std::cerr << "kvaudit: out of memory\n";
    return kvaudit::kExitInternal;
  } catch (const std::exception& e) {
    std::cerr << "kvaudit: internal error: " << e.what() << "\n";
    return kvaudit::kExitInternal;
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{kDescription, "kvaudit"};
  app.set_version_flag("--version", std::string("kvaudit ") + KVAUDIT_VERSION);
  app.require_subcommand(1);
  kvaudit::CommandRunner runner;
  kvaudit::register_info_command(app, runner);
  kvaudit::register_synth_command(app, runner);
  kvaudit::register_check_command(app, runner);
  kvaudit::register_bench_command(app, runner);
  kvaudit::register_golden_command(app, runner);
  kvaudit::register_verify_report_command(app, runner);
  kvaudit::register_merge_command(app, runner);
  kvaudit::register_backend_serve_command(app, runner);
  if (const std::optional<int> status = parse_command_line(app, argc, argv)) return *status;
  return run_command(runner);
}
