// The signature of a sign-off report directory (`kvaudit check --signoff --signing-key FILE`):
// beside report.json, report.md and report.html, `report --signoff` writes
//
//   report.manifest.json  every file the report wrote with its SHA-256, the report's checksum
//                         (the SHA-256 of report.json's canonical bytes,
//                         src/verdict/report_digest.hpp), who signed, for which model and
//                         deployment, and the Ed25519 public key;
//   report.sig            "ed25519 <128 hex digits>\n": the Ed25519 signature
//   (src/core/ed25519.hpp)
//                         over the manifest's bytes exactly as written.
//
// The signature binds every byte of every file to the holder of the private key: a file edited
// after signing no longer has the SHA-256 the manifest lists, an edited manifest no longer
// verifies under the signature, and a report signed again by someone else names another public
// key (`kvaudit verify-report DIR --public-key KEY` compares it with the one expected). The
// manifest is JSON so that names and signers need no quoting rules of their own.
#pragma once

#include <array>
#include <filesystem>
#include <string>
#include <vector>

#include "src/core/ed25519.hpp"
#include "src/core/result.hpp"
#include "src/verdict/report_model.hpp"

namespace kvaudit {

inline constexpr const char* kManifestFile = "report.manifest.json";
inline constexpr const char* kSignatureFile = "report.sig";
inline constexpr const char* kManifestFormat = "kvaudit-report-manifest-1";

// One file the manifest lists.
struct ManifestFile {
  std::string name;    // relative to the report directory
  std::string sha256;  // 64 lower-case hex digits
};

// The manifest of a signed report directory.
struct ReportManifest {
  SignOff signer;               // signed_by, model, deployment, public_key (hex)
  std::string report_checksum;  // report_digest(report.json), 64 hex digits
  std::vector<ManifestFile> files;
};

// The manifest's bytes (pretty-printed JSON, a final newline), and its inverse (errors name
// `where`: a manifest that is not one this kvaudit writes).
std::string manifest_text(const ReportManifest& manifest);
Result<ReportManifest> parse_manifest(const std::string& text, const std::string& where);

// report.sig's line, and its inverse.
std::string signature_text(const Ed25519Signature& signature);
Result<Ed25519Signature> parse_signature(const std::string& text, const std::string& where);

// Hashes `files` in `dir` (written already), writes the manifest and its signature there. The
// model's sign-off must name `key`'s public key (an internal error otherwise).
Status sign_report_dir(const std::filesystem::path& dir, const ReportModel& model,
                       const std::vector<std::string>& files, const Ed25519KeyPair& key);

}  // namespace kvaudit
