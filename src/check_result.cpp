// The verdict of a check run and its report.json form (docs/report-schema.md).
#include "src/check_result.hpp"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <ctime>
#include <fstream>
#include <iterator>
#include <limits>

namespace kvaudit {
namespace {

// Quotes an argument for a POSIX shell when it holds anything but plainly safe characters.
std::string shell_quote(const std::string& arg) {
  const bool plain = !arg.empty() && arg.find_first_not_of(
                                         "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                         "0123456789_-./=:,+@%") == std::string::npos;
  if (plain) return arg;
  std::string quoted = "'";
  for (const char c : arg) {
    if (c == '\'') {
      quoted += "'\\''";
    } else {
      quoted += c;
    }
  }
  return quoted + "'";
}

std::string process_command_line() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  if (!in) return "";
  const std::string raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::string line;
  std::size_t start = 0;
  while (start < raw.size()) {
    std::size_t end = raw.find('\0', start);
    if (end == std::string::npos) end = raw.size();
    if (!line.empty()) line += ' ';
    line += shell_quote(raw.substr(start, end - start));
    start = end + 1;
  }
  return line;
}

}  // namespace

Provenance current_provenance() {
  Provenance provenance;
  char host[256] = {};
  if (gethostname(host, sizeof host - 1) == 0) provenance.host = host;
  const std::time_t now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm utc{};
  gmtime_r(&now, &utc);
  char date[32];
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", &utc);
  provenance.date_utc = date;
  provenance.command_line = process_command_line();
#ifdef KVAUDIT_VERSION
  provenance.kvaudit_version = KVAUDIT_VERSION;
#endif
  return provenance;
}

double max_abs_over_ref_max(const ComparisonMetrics& metrics) {
  if (metrics.reference_max_abs > 0.0) return metrics.max_abs / metrics.reference_max_abs;
  return metrics.max_abs > 0.0 ? std::numeric_limits<double>::infinity() : 0.0;
}

bool fails_run(const ComparisonResult& result) {
  return !result.judgement.pass && (result.sets_exit || result.metrics.nonfinite_mismatches > 0);
}

const ElementLocation& worst_location(const ComparisonResult& result) {
  return result.metrics.nonfinite_mismatches > 0 ? result.metrics.first_nonfinite_mismatch
                                                 : result.metrics.max_abs_at;
}

bool CheckRun::pass() const {
  for (const ComparisonResult& result : comparisons) {
    if (fails_run(result)) return false;
  }
  for (const IntegrityFinding& finding : integrity) {
    if (!finding.pass) return false;
  }
  return true;
}

RunCounts count_results(const CheckRun& run) {
  RunCounts counts;
  counts.comparisons = run.comparisons.size();
  for (const ComparisonResult& result : run.comparisons) {
    if (result.judgement.pass) continue;
    if (fails_run(result)) {
      ++counts.failed;
    } else {
      ++counts.failed_report_only;
    }
  }
  counts.integrity_checks = run.integrity.size();
  for (const IntegrityFinding& finding : run.integrity) counts.integrity_failed += !finding.pass;
  return counts;
}

nlohmann::json to_json(const CheckRun& run) {
  nlohmann::json j;
  j["tool"] = "kvaudit";
#ifdef KVAUDIT_VERSION
  j["version"] = KVAUDIT_VERSION;
#else
  j["version"] = "unknown";
#endif
  j["verdict"] = run.pass() ? "pass" : "fail";
  const RunCounts counts = count_results(run);
  j["counts"] = {{"comparisons", counts.comparisons},
                 {"failed", counts.failed},
                 {"failed_report_only", counts.failed_report_only},
                 {"integrity_checks", counts.integrity_checks},
                 {"integrity_failed", counts.integrity_failed}};
  j["backend"] = run.backend;
  j["backend_description"] =
      run.backend_description.is_null() ? nlohmann::json::object() : run.backend_description;
  j["policy"] = to_json(run.policy);
  j["dump"] = {
      {"path", run.dump_path},
      {"sha256", run.dump_sha256},
      {"summary", run.dump_summary.is_null() ? nlohmann::json::object() : run.dump_summary}};

  nlohmann::json results = nlohmann::json::array();
  for (const ComparisonResult& result : run.comparisons) {
    nlohmann::json metrics = to_json(result.metrics);
    metrics["max_abs_over_ref_max"] = json_number(max_abs_over_ref_max(result.metrics));
    results.push_back({{"step", result.step},
                       {"layer", result.layer_id},
                       {"comparison", comparison_name(result.comparison)},
                       {"metrics", std::move(metrics)},
                       {"worst", to_json(worst_location(result))},
                       {"worst_request", result.worst_request},
                       {"pass", result.judgement.pass},
                       {"sets_exit", result.sets_exit || result.metrics.nonfinite_mismatches > 0},
                       {"reasons", result.judgement.reasons}});
  }
  j["results"] = std::move(results);

  nlohmann::json integrity = nlohmann::json::array();
  for (const IntegrityFinding& finding : run.integrity) {
    integrity.push_back({{"step", finding.step},
                         {"layer", finding.layer_id},
                         {"check", finding.check},
                         {"pass", finding.pass},
                         {"where", finding.where},
                         {"detail", finding.detail},
                         {"slots", finding.slots},
                         {"slot_count", finding.slot_count},
                         {"classification", finding.classification},
                         {"carried_from_step", finding.carried_from_step >= 0
                                                   ? nlohmann::json(finding.carried_from_step)
                                                   : nlohmann::json(nullptr)}});
  }
  j["integrity"] = std::move(integrity);

  const double throughput = run.reference_seconds > 0.0
                                ? run.reference_rows_heads_tokens / run.reference_seconds
                                : std::numeric_limits<double>::quiet_NaN();
  j["timing"] = {{"reference_seconds", json_number(run.reference_seconds)},
                 {"reference_rows_heads_tokens", json_number(run.reference_rows_heads_tokens)},
                 {"reference_throughput_rows_heads_tokens_per_s",
                  std::isnan(throughput) ? nlohmann::json(nullptr) : json_number(throughput)},
                 {"backend_seconds", json_number(run.backend_seconds)},
                 {"total_seconds", json_number(run.total_seconds)}};

  // Fill what the caller left empty with this process's values.
  Provenance provenance = run.provenance;
  if (provenance.host.empty() || provenance.date_utc.empty() || provenance.command_line.empty() ||
      provenance.kvaudit_version.empty()) {
    const Provenance here = current_provenance();
    if (provenance.host.empty()) provenance.host = here.host;
    if (provenance.date_utc.empty()) provenance.date_utc = here.date_utc;
    if (provenance.command_line.empty()) provenance.command_line = here.command_line;
    if (provenance.kvaudit_version.empty()) provenance.kvaudit_version = here.kvaudit_version;
  }
  j["provenance"] = {{"host", provenance.host},
                     {"date", provenance.date_utc},
                     {"command_line", provenance.command_line},
                     {"kvaudit_version", provenance.kvaudit_version}};
  return j;
}

}  // namespace kvaudit
