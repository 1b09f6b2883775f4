// report.json's model, and the one place a report is written and read (report_json.cpp):
//   - the run: CheckRun (src/verdict/check_result.hpp), what `kvaudit check` judged; it holds
//     every key report.json reads back;
//   - what a report derives from it, computed once here (make_report_model): the verdict, the
//     counts, the per-step summary, the captured pool's cost, the certification maxima, what was
//     not measured, the completed provenance and the checksum (under --signoff the sign-off's
//     digest, otherwise the plain report's "checksum");
//   - to_json writes the model (the keys of docs/report.schema.json, the authority on keys and
//     types, described in docs/report-schema.md), check_run_from_json reads a report back into
//     the run (kvaudit merge), and report.md and report.html render the same model
//     (src/report/report.hpp), so that the three cannot disagree on a derived value.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "src/verdict/check_result.hpp"
#include "src/verdict/signoff.hpp"

namespace kvaudit {

// report.json's checksum (src/verdict/report_digest.hpp): "signoff"."digest" of a sign-off, the
// top-level "checksum" of a report made without --signoff.
struct ReportDigest {
  std::string algorithm;
  std::string covers;
  std::string value;  // 64 lower-case hex digits
};

// A sign-off as the report states it: who signed, and the digest that binds the report to its
// data.
struct SignOffRecord {
  SignOff signer;
  ReportDigest digest;
};

// A run and what its report derives from it, computed once.
struct ReportModel {
  CheckRun run;  // its provenance completed (empty fields filled from this process, once)
  bool pass = false;
  RunCounts counts;
  std::vector<StepSummary> steps;
  std::optional<CapturedPoolCost> captured_pool_cost;  // none while no captured pool differs
  CertificationMaxima certification_maxima;
  std::vector<MeasurementGap> unmeasured;
  std::optional<SignOffRecord> signoff;  // --signoff runs
  std::optional<ReportDigest> checksum;  // runs without --signoff: a checksum, no signature
};

ReportModel make_report_model(const CheckRun& run);

// report.json (docs/report.schema.json): the model's JSON, keys in sorted order (nlohmann::json's
// objects are std::maps).
nlohmann::json to_json(const ReportModel& model);

// report.json's text: pretty-printed (two spaces), a final newline; strings from the dump (model,
// producer) that are not UTF-8 have their bad bytes replaced rather than failing the write.
std::string report_json_text(const nlohmann::json& report);

}  // namespace kvaudit
