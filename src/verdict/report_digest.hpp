// The digest that binds a signed report to its data, so a signed report.json can be checked later
// (`kvaudit verify-report`): SHA-256 (src/core/sha256.hpp) of the report's canonical bytes.
//
// Canonical bytes: report.json as a JSON value, less its "timing" object (wall times, which say
// nothing about the results and would differ on a re-run) and less "signoff"."digest" (the digest
// itself), serialized compactly: no whitespace, object keys in sorted (byte) order, numbers as
// nlohmann::json writes them (integers exactly, doubles in their shortest round-trip form),
// strings as UTF-8 with invalid bytes replaced by U+FFFD. Everything else is covered: verdict,
// results, integrity, policy, dump SHA-256, provenance, and who signed ("signoff"."signed_by",
// "model", "deployment"). Parsing report.json and serializing it again gives the same bytes, so
// the digest can be recomputed from the file alone.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace kvaudit {

inline constexpr const char* kReportDigestAlgorithm = "sha256";
// report.json's "signoff"."digest"."covers": the definition above, in one line.
inline constexpr const char* kReportDigestCovers =
    "SHA-256 of report.json without \"timing\" and \"signoff\".\"digest\", serialized compactly "
    "with sorted keys (nlohmann::json dump(), UTF-8)";

std::string canonical_report_bytes(const nlohmann::json& report);
std::string report_digest(const nlohmann::json& report);  // 64 lower-case hex digits

}  // namespace kvaudit
