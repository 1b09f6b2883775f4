// kvaudit: numerical accuracy harness for FP8 e4m3 KV-cache MLA attention.
#include <exception>
#include <iostream>

#include "src/cli/cli.hpp"

int main(int argc, char** argv) {
  CLI::App app{
      "kvaudit: replay MLA attention kvdumps (HDF5) through FP8 KV-cache kernels and a "
      "high-precision reference; report per-layer kernel and quantization error and cache "
      "integrity.\nExit status: 0 pass, 1 checks failed, 2 bad input or usage, 3 internal error.",
      "kvaudit"};
  app.set_version_flag("--version", std::string("kvaudit ") + KVAUDIT_VERSION);
  app.require_subcommand(1);
  kvaudit::CommandRunner runner;
  kvaudit::register_info_command(app, runner);
  kvaudit::register_synth_command(app, runner);
  kvaudit::register_check_command(app, runner);
  kvaudit::register_bench_command(app, runner);
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
