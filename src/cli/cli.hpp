// The kvaudit command line: each subcommand lives in its own src/cli/cli_<name>.cpp and registers
// itself here; main.cpp parses and runs the one chosen. A runner returns the exit status: 0 pass,
// 1 checks failed, 2 bad input or usage, 3 internal error (docs/design.md).
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <string>
#include <vector>

#include "src/core/result.hpp"

namespace kvaudit {

inline constexpr int kExitPass = 0;
inline constexpr int kExitChecksFailed = 1;
inline constexpr int kExitBadInput = 2;
inline constexpr int kExitInternal = 3;

using CommandRunner = std::function<int()>;

// Each sets `runner` (from its subcommand's callback) when that subcommand is chosen.
void register_info_command(CLI::App& app, CommandRunner& runner);
void register_synth_command(CLI::App& app, CommandRunner& runner);
void register_check_command(CLI::App& app, CommandRunner& runner);
void register_bench_command(CLI::App& app, CommandRunner& runner);
void register_golden_command(CLI::App& app, CommandRunner& runner);

// "0,1,77" or ranges "0-3,7": non-negative integers (--layers, --steps); bad input naming
// `option` otherwise (defined in index_list.cpp).
Result<std::vector<int>> parse_index_list(const std::string& text, const std::string& option);
void register_verify_report_command(CLI::App& app, CommandRunner& runner);
void register_merge_command(CLI::App& app, CommandRunner& runner);
void register_backend_serve_command(CLI::App& app, CommandRunner& runner);

// Prints "kvaudit: <where>: <what>" on stderr and returns the exit status for the error's kind:
// 3 for an internal error, 2 otherwise (defined in cli_info.cpp).
int report_error(const Error& error);

}  // namespace kvaudit
