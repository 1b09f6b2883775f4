// The kvaudit command line: each subcommand lives in its own src/cli/cli_<name>.cpp and registers
// itself here; main.cpp parses and runs the one chosen. A runner returns the exit status: 0 pass,
// 1 checks failed, 2 bad input or usage (anything the user can fix), 3 internal error (kvaudit's
// own fault) (docs/design.md "Exit status").
//
// The conventions every command follows, built here once so that a new command or option gets them
// by using these functions (src/cli/cli_conventions.cpp, src/cli/help_format.cpp):
//   - errors: one line on stderr, "kvaudit: WHERE: WHAT" (report_error for an Error, main() for
//     the parser's own errors); a mistyped command or option gets "did you mean ...?";
//   - help: add_command() gives a command its one-sentence summary (the line in `kvaudit --help`),
//     its details and its exit statuses (every command states them); all help is wrapped to the
//     terminal (at most 120 columns; COLUMNS overrides), `kvaudit help [COMMAND]` prints it;
//   - files: add_input_file() / add_output_path() show FILE or DIR instead of TEXT. Every output
//     path given is checked by validate_output_options() in main() before the command runs
//     (src/core/output_file.hpp: folder exists, writable, not a directory where a file is
//     expected, not the same path as another output or an input); the command then writes it
//     through AtomicOutputFile / AtomicOutputDirectory, so a failed command leaves nothing;
//   - numbers: add_integer_option() / add_number_option() refuse a value that is not a number or
//     out of range with a plain message ("--threads: '-1' is not an integer from 0 to 1024");
//   - every option that takes a value refuses an empty one (--steps "" is not "all steps").
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "src/backend/cuda_kernel_variant.hpp"
#include "src/core/output_file.hpp"
#include "src/core/result.hpp"
#include "src/format/kvdump.hpp"
#include "src/verdict/check_result.hpp"

namespace kvaudit {

inline constexpr int kExitPass = 0;
inline constexpr int kExitChecksFailed = 1;
inline constexpr int kExitBadInput = 2;
inline constexpr int kExitInternal = 3;

// --threads and the like: 0 means every core. Each thread is a std::thread of the reference or a
// CPU backend; 1024 is above the core count of any machine kvaudit runs on (more threads than
// cores only add scheduling), and keeps a typo such as 1000000000 from exhausting the process.
inline constexpr int kMaxThreads = 1024;

using CommandRunner = std::function<int()>;

// Each sets `runner` (from its subcommand's callback) when that subcommand is chosen.
void register_info_command(CLI::App& app, CommandRunner& runner);
void register_synth_command(CLI::App& app, CommandRunner& runner);
void register_check_command(CLI::App& app, CommandRunner& runner);
void register_calibrate_command(CLI::App& app, CommandRunner& runner);
// check --signoff's scales section: `kvaudit calibrate` on the layers checked (`layer_ids`, empty:
// all), as CheckRun::scales. What it cannot judge is a note (check prints it), never silently
// absent: a dump whose checked layers lack kv_source (the sign-off's gap rule also speaks for it),
// one with per_token_group scales (computed at write time: no served per-tensor scale to judge), a
// layer with no recommendation (no finite nonzero amax). Defined in cli_calibrate.cpp.
struct ServedScales {
  std::vector<LayerScaleCheck> checks;
  std::vector<std::string> notes;
};
Result<ServedScales> served_scale_checks(const DumpReader& reader,
                                         const std::vector<int>& layer_ids, int threads);
void register_bench_command(CLI::App& app, CommandRunner& runner);
void register_golden_command(CLI::App& app, CommandRunner& runner);
// `kvaudit help [COMMAND]`: prints the help of the program or of one command.
void register_help_command(CLI::App& app, CommandRunner& runner);

// "0,1,77" or ranges "0-3,7": non-negative integers (--layers, --steps); bad input naming
// `option` otherwise (defined in index_list.cpp).
Result<std::vector<int>> parse_index_list(const std::string& text, const std::string& option);
void register_verify_report_command(CLI::App& app, CommandRunner& runner);
void register_keygen_command(CLI::App& app, CommandRunner& runner);
void register_merge_command(CLI::App& app, CommandRunner& runner);
void register_backend_serve_command(CLI::App& app, CommandRunner& runner);

// Prints "kvaudit: <where>: <what>" on stderr and returns the exit status for the error's kind:
// 3 for an internal error, 2 otherwise (defined in cli_info.cpp).
int report_error(const Error& error);

// ---- conventions (src/cli/cli_conventions.cpp) ------------------------------------------------

// What `kvaudit --help` and `kvaudit help COMMAND` say about a command.
struct CommandHelp {
  std::string summary;        // one sentence: the command's line in `kvaudit --help`
  std::string details;        // what it does; "\n" separates paragraphs
  std::string exit_statuses;  // "0 pass, 1 checks failed, 2 bad input or usage, 3 internal error"
};

// Adds the subcommand `name` with its help: summary, details, then "Exit status: ...".
CLI::App* add_command(CLI::App& app, const std::string& name, const CommandHelp& help);

// A file the command reads, shown as FILE. The command's reader checks it (and names what is
// wrong); an output option naming the same path is refused.
CLI::Option* add_input_file(CLI::App& cmd, const std::string& name, std::string& path,
                            const std::string& description);

// A file or directory the command writes, shown as FILE or DIR, validated before the command runs
// (validate_output_options). Write it through AtomicOutputFile / AtomicOutputDirectory.
CLI::Option* add_output_path(CLI::App& cmd, const std::string& name, std::string& path,
                             OutputKind kind, const std::string& description);

// An integer option in [lo, hi] (the range is appended to the description).
CLI::Option* add_integer_option(CLI::App& cmd, const std::string& name, int& value, int lo, int hi,
                                const std::string& description);
CLI::Option* add_integer_option(CLI::App& cmd, const std::string& name, std::int64_t& value,
                                std::int64_t lo, std::int64_t hi, const std::string& description);
CLI::Option* add_integer_option(CLI::App& cmd, const std::string& name, std::size_t& value,
                                std::size_t lo, std::size_t hi, const std::string& description);
// An unsigned 64-bit integer (seeds): any value 0 .. 2^64-1.
CLI::Option* add_seed_option(CLI::App& cmd, const std::string& name, std::uint64_t& value,
                             const std::string& description);
// A finite number in [lo, hi].
CLI::Option* add_number_option(CLI::App& cmd, const std::string& name, double& value, double lo,
                               double hi, const std::string& description);
CLI::Option* add_number_option(CLI::App& cmd, const std::string& name, float& value, double lo,
                               double hi, const std::string& description);

// The validators behind them, for options declared otherwise (e.g. a delimited list of integers:
// each item is checked). Messages name the value and the range, never a 300-digit bound.
CLI::Validator integer_in(std::int64_t lo, std::int64_t hi);
CLI::Validator number_in(double lo, double hi);

// Every output path given to the chosen subcommand `cmd`, checked with validate_output_path, and
// no two outputs (or an output and an input file) naming the same path. Called by main() between
// parsing and running.
Status validate_output_options(const CLI::App& cmd);

// Adds the empty-value check to every option of `app` and its subcommands that takes a value.
// Called by main() once every command is registered.
void refuse_empty_values(CLI::App& app);

// "unknown command 'chek' (did you mean check?); commands: info, synth, check, bench, help".
Error unknown_command(const CLI::App& app, const std::string& given);

// The closest of `names` to `given` (optimal string alignment distance at most 2, and less than
// half of the name), for "did you mean ...?"; empty when none is close.
std::string closest_name(const std::string& given, const std::vector<std::string>& names);

// ---- the CUDA kernel variant (src/cli/cuda_variant_options.cpp) -------------------------------

// --cuda-mma auto|mma-sync, --cuda-decode16 auto|shared-tile|registers, --cuda-host-plan on|off,
// --cuda-longest-first on|off: the one place a command line chooses the kernel variant of the CUDA
// backends (src/backend/cuda_kernel_variant.hpp). Every command that builds a cuda-* backend or
// times the kernels adds them (check, golden record, golden check, bench, backend-serve); a value
// outside the set is a usage error (exit 2) naming the option and the valid values.
struct CudaVariantOptions {
  CudaKernelVariant variant;
  std::vector<CLI::Option*> options;  // the four, to tell which were given
};
void add_cuda_variant_options(CLI::App& cmd, CudaVariantOptions& options);

// The options apply to the CUDA backends only: any of them given with another `backend` (cpu-fp8,
// exec:NAME, none) is bad input naming the first one given, rather than silently ignored.
Status check_cuda_variant_applies(const CudaVariantOptions& options, const std::string& backend);

// The options that give `variant` where it is not the default, each preceded by `separator`
// ("--cuda-mma mma-sync"), for a command line that repeats a run (--emit-repro's hint).
std::string cuda_variant_arguments(const CudaKernelVariant& variant, const char* separator);

// ---- help (src/cli/help_format.cpp) -----------------------------------------------------------

// The width help is wrapped to: COLUMNS when set, else the terminal's, else 80; within 40..120.
std::size_t help_width();

// Installs the wrapping help formatter on `app` (before its subcommands are added: they copy it).
void use_wrapping_help(CLI::App& app, std::size_t width);

// `text` wrapped to `width` columns, paragraphs ("\n"-separated) kept; every line but the first
// indented by `indent` spaces (the first by `first_indent`). For help texts and long messages.
std::string wrap_text(const std::string& text, std::size_t width, std::size_t first_indent = 0,
                      std::size_t indent = 0);

}  // namespace kvaudit
