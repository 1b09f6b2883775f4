// Checking a signed report against its data (`kvaudit verify-report`): recompute the digest of
// report.json's canonical bytes (src/verdict/report_digest.hpp) and compare it with the digest the
// report states in its "signoff" block; report.md and report.html beside it must state the same
// digest (they are renderings of the same run, and a reader signs what they read).
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "src/core/result.hpp"

namespace kvaudit {

struct ReportVerification {
  std::filesystem::path json_path;    // the report.json checked
  std::string stated;                 // "signoff"."digest"."value"
  std::string computed;               // report_digest(report.json)
  std::vector<std::string> problems;  // each mismatch, one line (empty: the report matches)
  std::string signed_by;              // the signoff fields ("" when not given)
  std::string model;
  std::string deployment;
  std::string verdict;  // report.json's "verdict"
  bool match() const { return problems.empty(); }
};

// `path`: a report directory (its report.json, and report.md / report.html where present) or a
// report.json file. Errors (bad input): no such file, not JSON, not a signed report (no signoff
// block: made without --signoff).
Result<ReportVerification> verify_report(const std::filesystem::path& path);

}  // namespace kvaudit
