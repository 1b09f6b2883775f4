// Verifying a signed report (see report_verify.hpp).
#include "src/report/report_verify.hpp"

#include <fmt/format.h>

#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>

#include "src/verdict/report_digest.hpp"

namespace kvaudit {
namespace {

Result<std::string> read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return bad_input(path.string(), "cannot open the report");
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::string text_field(const nlohmann::json& object, const char* key) {
  const auto it = object.find(key);
  return it != object.end() && it->is_string() ? it->get<std::string>() : "";
}

// The digest as the signoff block states it; an error when the report is not signed.
Result<std::string> stated_digest(const nlohmann::json& report, const std::string& where) {
  const auto signoff = report.find("signoff");
  if (signoff == report.end() || !signoff->is_object()) {
    return bad_input(where, "not a signed report: no signoff block (made without --signoff)");
  }
  const auto digest = signoff->find("digest");
  if (digest == signoff->end() || !digest->is_object() ||
      text_field(*digest, "algorithm") != kReportDigestAlgorithm ||
      text_field(*digest, "value").empty()) {
    return bad_input(
        where + ":/signoff/digest",
        fmt::format("expected {{\"algorithm\": \"{}\", \"value\": HEX}}", kReportDigestAlgorithm));
  }
  return text_field(*digest, "value");
}

// report.md and report.html beside report.json, where present, must state the same digest.
void check_renderings(const std::filesystem::path& dir, ReportVerification& result) {
  for (const char* name : {"report.md", "report.html"}) {
    const std::filesystem::path path = dir / name;
    if (!std::filesystem::exists(path)) continue;
    const Result<std::string> text = read_file(path);
    if (!text || text->find(result.stated) == std::string::npos) {
      result.problems.push_back(
          fmt::format("{} does not state the digest {} (it was not made with this report.json)",
                      path.string(), result.stated));
    }
  }
}

}  // namespace

Result<ReportVerification> verify_report(const std::filesystem::path& path) {
  ReportVerification result;
  const bool is_dir = std::filesystem::is_directory(path);
  result.json_path = is_dir ? path / "report.json" : path;
  KVAUDIT_ASSIGN_OR_RETURN(const std::string text, read_file(result.json_path));
  const nlohmann::json report = nlohmann::json::parse(text, nullptr, false);
  if (report.is_discarded() || !report.is_object()) {
    return bad_input(result.json_path.string(), "not a JSON object (not a kvaudit report.json)");
  }
  KVAUDIT_ASSIGN_OR_RETURN(result.stated, stated_digest(report, result.json_path.string()));
  result.computed = report_digest(report);
  if (result.computed != result.stated) {
    result.problems.push_back(fmt::format(
        "{}: digest mismatch: the report states {}, its data hashes to {} (changed after it was "
        "signed)",
        result.json_path.string(), result.stated, result.computed));
  }
  const nlohmann::json& signoff = report.at("signoff");
  result.signed_by = text_field(signoff, "signed_by");
  result.model = text_field(signoff, "model");
  result.deployment = text_field(signoff, "deployment");
  result.verdict = text_field(report, "verdict");
  if (is_dir) check_renderings(path, result);
  return result;
}

}  // namespace kvaudit
