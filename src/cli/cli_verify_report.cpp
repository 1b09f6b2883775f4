// `kvaudit verify-report DIR|report.json`: check a signed report against its data
// (src/report/report_verify.hpp). Exit status: 0 the digest matches (and report.md / report.html
// state it), 1 mismatch, 2 bad input (no such file, not JSON, a report made without --signoff).
#include <fmt/format.h>
#include <fmt/ostream.h>

#include <iostream>
#include <memory>
#include <string>

#include "src/cli/cli.hpp"
#include "src/report/report_verify.hpp"

namespace kvaudit {
namespace {

std::string or_not_given(const std::string& text) { return text.empty() ? "(not given)" : text; }

int run_verify_report(const std::string& path) {
  const Result<ReportVerification> verified = verify_report(path);
  if (!verified) return report_error(verified.error());
  const ReportVerification& v = *verified;
  if (!v.match()) {
    for (const std::string& problem : v.problems) fmt::print(std::cout, "MISMATCH: {}\n", problem);
    return kExitChecksFailed;
  }
  fmt::print(std::cout,
             "match: {} digest sha256 {}\n  signed by {}, model {}, deployment {}; verdict {}\n",
             v.json_path.string(), v.computed, or_not_given(v.signed_by), or_not_given(v.model),
             or_not_given(v.deployment), v.verdict);
  return kExitPass;
}

}  // namespace

void register_verify_report_command(CLI::App& app, CommandRunner& runner) {
  auto path = std::make_shared<std::string>();
  CLI::App* cmd = add_command(
      app, "verify-report",
      {"Check a signed report against its data.",
       "For a report written by kvaudit check --signoff --report DIR: recompute the SHA-256 of "
       "report.json without \"timing\" and \"signoff\".\"digest\", serialized compactly with "
       "sorted keys, compare it with the digest the report states, and check that report.md and "
       "report.html beside it state the same digest.",
       "0 match, 1 mismatch, 2 bad input (no such file, not JSON, a report made without "
       "--signoff), 3 internal error"});
  add_input_file(*cmd, "REPORT", *path, "Report directory, or its report.json")->required();
  cmd->callback([path, &runner] { runner = [path] { return run_verify_report(*path); }; });
}

}  // namespace kvaudit
