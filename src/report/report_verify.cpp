// Verifying a report: its signature, or a plain report's checksum (see report_verify.hpp).
#include "src/report/report_verify.hpp"

#include <fmt/format.h>

#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>

#include "src/core/sha256.hpp"
#include "src/report/report.hpp"
#include "src/report/report_signature.hpp"
#include "src/verdict/report_digest.hpp"

namespace kvaudit {
namespace {

Result<std::string> read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return bad_input(path.string(), "cannot open the file");
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::string text_field(const nlohmann::json& object, const char* key) {
  const auto it = object.find(key);
  return it != object.end() && it->is_string() ? it->get<std::string>() : "";
}

bool is_signoff(const nlohmann::json& report) {
  const auto signoff = report.find("signoff");
  return signoff != report.end() && signoff->is_object();
}

// report.json's signoff block; an error when the report is not a signed one.
Result<nlohmann::json> signoff_block(const nlohmann::json& report, const std::string& where,
                                     bool has_manifest) {
  if (!is_signoff(report)) {
    return bad_input(where, "not a signed report: no signoff block (made without --signoff)");
  }
  const auto signoff = report.find("signoff");
  if (!signoff->contains("public_key") && !has_manifest) {
    return bad_input(where,
                     "not a signed report: made before kvaudit signed reports (no public key, no "
                     "report.manifest.json): its digest is a checksum that anyone who edits the "
                     "report can recompute, not a signature; sign it again with kvaudit check "
                     "--signoff --signing-key FILE");
  }
  return *signoff;
}

// Step 2: the signature over the manifest's bytes, and the key against the expected one.
void check_signature(const std::filesystem::path& dir, const std::string& manifest_bytes,
                     const ReportManifest& manifest,
                     const std::optional<Ed25519PublicKey>& expected_key,
                     ReportVerification& result) {
  const std::filesystem::path sig_path = dir / kSignatureFile;
  const Result<Ed25519PublicKey> key = public_key_from_hex(
      manifest.signer.public_key, (dir / kManifestFile).string() + ": public_key");
  if (!key) {
    result.problems.push_back(key.error().message());
    return;
  }
  if (expected_key && *key != *expected_key) {
    result.problems.push_back(fmt::format(
        "{}: signed with the public key {}, not the expected {} (signed by someone else)",
        (dir / kManifestFile).string(), manifest.signer.public_key, bytes_hex(*expected_key)));
  }
  const Result<std::string> sig_text = read_file(sig_path);
  if (!sig_text) {
    result.problems.push_back(sig_path.string() + ": missing (the report's signature)");
    return;
  }
  const Result<Ed25519Signature> signature = parse_signature(*sig_text, sig_path.string());
  if (!signature) {
    result.problems.push_back(signature.error().message());
    return;
  }
  if (!ed25519_verify(*key, manifest_bytes, *signature)) {
    result.problems.push_back(fmt::format(
        "{}: the signature does not verify: {} or the signature was changed after signing",
        sig_path.string(), kManifestFile));
  }
}

// Step 3: every file against the manifest, and every file the report writes listed.
void check_files(const std::filesystem::path& dir, const ReportManifest& manifest,
                 ReportVerification& result) {
  for (const char* name : kReportFiles) {
    bool listed = false;
    for (const ManifestFile& file : manifest.files) listed = listed || file.name == name;
    if (!listed) {
      result.problems.push_back(
          fmt::format("{}: does not list {}", (dir / kManifestFile).string(), name));
    }
  }
  for (const ManifestFile& file : manifest.files) {
    const std::filesystem::path path = dir / file.name;
    const Result<std::string> sha = sha256_file_hex(path);
    if (!sha) {
      result.problems.push_back(path.string() + ": missing (listed in the signed manifest)");
    } else if (*sha != file.sha256) {
      result.problems.push_back(
          fmt::format("{}: changed after signing: its SHA-256 is {}, the signed manifest lists {}",
                      path.string(), *sha, file.sha256));
    }
  }
}

// Step 4: report.json's sign-off block and checksum against the manifest.
void check_report_json(const std::filesystem::path& json_path, const nlohmann::json& report,
                       const nlohmann::json& signoff, const ReportManifest& manifest,
                       ReportVerification& result) {
  const auto key = signoff.find("public_key");
  const std::string json_key =
      key != signoff.end() && key->is_object() ? text_field(*key, "value") : std::string();
  const std::pair<const char*, std::pair<std::string, std::string>> fields[] = {
      {"signed_by", {text_field(signoff, "signed_by"), manifest.signer.signed_by}},
      {"model", {text_field(signoff, "model"), manifest.signer.model}},
      {"deployment", {text_field(signoff, "deployment"), manifest.signer.deployment}},
      {"public_key", {json_key, manifest.signer.public_key}}};
  for (const auto& [name, values] : fields) {
    if (values.first != values.second) {
      result.problems.push_back(fmt::format("{}: signoff.{} is '{}', the signed manifest says '{}'",
                                            json_path.string(), name, values.first, values.second));
    }
  }
  result.checksum = report_digest(report);
  const auto digest = signoff.find("digest");
  const std::string stated =
      digest != signoff.end() && digest->is_object() ? text_field(*digest, "value") : "";
  if (result.checksum != manifest.report_checksum || result.checksum != stated) {
    result.problems.push_back(fmt::format(
        "{}: checksum mismatch: its data hashes to {}, it states {}, the signed manifest {}",
        json_path.string(), result.checksum, stated, manifest.report_checksum));
  }
}

// A report made without --signoff: the value its "checksum" states (bad input when malformed or
// absent, or when a signer's key is expected: nobody signed it).
Result<std::string> stated_checksum(const nlohmann::json& report, const std::string& where,
                                    bool key_expected) {
  const auto checksum = report.find("checksum");
  if (checksum == report.end()) {
    return bad_input(where,
                     "not a signed report and no checksum: made without --signoff by a kvaudit "
                     "from before plain reports kept their checksum; make it again to check it");
  }
  if (key_expected) {
    return bad_input(where,
                     "the report is not signed (made without --signoff): it carries a checksum, "
                     "not a signature, so there is no signer to compare with --public-key");
  }
  if (!checksum->is_object() || checksum->value("algorithm", "") != kReportDigestAlgorithm ||
      !checksum->contains("value") || !checksum->at("value").is_string()) {
    return bad_input(where, fmt::format("\"checksum\" is not {{\"algorithm\": \"{}\", \"value\": "
                                        "HEX, ...}}",
                                        kReportDigestAlgorithm));
  }
  return checksum->at("value").get<std::string>();
}

// A report made without --signoff: its data against the checksum it states.
Result<ReportVerification> verify_checksum(ReportVerification result,
                                           const std::filesystem::path& json_path,
                                           const nlohmann::json& report) {
  result.proof = ReportProof::kChecksum;
  KVAUDIT_ASSIGN_OR_RETURN(const std::string stated,
                           stated_checksum(report, json_path.string(), result.key_expected));
  result.checksum = report_digest(report);
  if (result.checksum != stated) {
    result.problems.push_back(fmt::format(
        "{}: checksum mismatch: its data hashes to {}, it states {} (changed after it was written)",
        json_path.string(), result.checksum, stated));
  }
  return result;
}

}  // namespace

Result<ReportVerification> verify_report(const std::filesystem::path& path,
                                         const std::optional<Ed25519PublicKey>& expected_key) {
  ReportVerification result;
  result.dir = std::filesystem::is_directory(path) ? path : path.parent_path();
  if (result.dir.empty()) result.dir = ".";
  const std::filesystem::path json_path = result.dir / kReportFiles[0];
  const std::filesystem::path manifest_path = result.dir / kManifestFile;
  result.key_expected = expected_key.has_value();
  // Step 1: a signed report (or a plain one, with its checksum).
  KVAUDIT_ASSIGN_OR_RETURN(const std::string text, read_file(json_path));
  const nlohmann::json report = nlohmann::json::parse(text, nullptr, false);
  if (report.is_discarded() || !report.is_object()) {
    return bad_input(json_path.string(), "not a JSON object (not a kvaudit report.json)");
  }
  result.verdict = text_field(report, "verdict");
  if (!is_signoff(report)) return verify_checksum(std::move(result), json_path, report);
  const bool has_manifest = std::filesystem::exists(manifest_path);
  KVAUDIT_ASSIGN_OR_RETURN(const nlohmann::json signoff,
                           signoff_block(report, json_path.string(), has_manifest));
  if (!has_manifest) {
    result.problems.push_back(manifest_path.string() +
                              ": missing (report.json names a public key: it was signed)");
    return result;
  }
  const Result<std::string> manifest_bytes = read_file(manifest_path);
  Result<ReportManifest> manifest = manifest_bytes
                                        ? parse_manifest(*manifest_bytes, manifest_path.string())
                                        : Result<ReportManifest>(manifest_bytes.error());
  if (!manifest) {
    result.problems.push_back(manifest.error().message());
    return result;
  }
  result.public_key = manifest->signer.public_key;
  result.signed_by = manifest->signer.signed_by;
  result.model = manifest->signer.model;
  result.deployment = manifest->signer.deployment;
  check_signature(result.dir, *manifest_bytes, *manifest, expected_key, result);
  check_files(result.dir, *manifest, result);
  check_report_json(json_path, report, signoff, *manifest, result);
  return result;
}

}  // namespace kvaudit
