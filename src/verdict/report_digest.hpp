// The checksum of a report: SHA-256 (src/core/sha256.hpp) of report.json's canonical bytes. It
// detects a report changed by accident, never one changed on purpose: anyone who edits the report
// can compute it again. A report made without --signoff states it as its top-level "checksum"; a
// sign-off states it as "signoff"."digest" and is signed with an Ed25519 key over a manifest of the
// report's files and this checksum (src/report/report_signature.hpp); the checksum alone is no
// signature.
//
// Canonical bytes: report.json as a JSON value, less its "timing" object (wall times, which say
// nothing about the results and would differ on a re-run) and less the checksum itself (the
// top-level "checksum" of a plain report, "signoff"."digest" of a sign-off), serialized compactly:
// no whitespace, object keys in sorted (byte) order, numbers as nlohmann::json writes them
// (integers exactly, doubles in their shortest round-trip form), strings as UTF-8 with invalid
// bytes replaced by U+FFFD. Everything else is covered: verdict, results, integrity, policy, dump
// SHA-256, provenance, and who signed with which key
// ("signoff"."signed_by", "model", "deployment", "public_key"). Parsing report.json and
// serializing it again gives the same bytes, so the checksum can be recomputed from the file alone.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace kvaudit {

inline constexpr const char* kReportDigestAlgorithm = "sha256";
// report.json's "signoff"."digest"."covers": the definition above, in one line (the JSON key is
// "digest", as in reports from before signatures; the documents call it the checksum).
inline constexpr const char* kReportDigestCovers =
    "SHA-256 of report.json without \"timing\" and \"signoff\".\"digest\", serialized compactly "
    "with sorted keys (nlohmann::json dump(), UTF-8)";

// report.json's "checksum"."covers" in a report made without --signoff.
inline constexpr const char* kPlainReportChecksumCovers =
    "SHA-256 of report.json without \"timing\" and \"checksum\", serialized compactly with "
    "sorted keys (nlohmann::json dump(), UTF-8)";

std::string canonical_report_bytes(const nlohmann::json& report);
std::string report_digest(const nlohmann::json& report);  // 64 lower-case hex digits

}  // namespace kvaudit
