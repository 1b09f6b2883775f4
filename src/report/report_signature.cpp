// Writing and reading the manifest and signature of a signed report (see report_signature.hpp).
#include "src/report/report_signature.hpp"

#include <fmt/format.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "src/core/sha256.hpp"
#include "src/verdict/report_digest.hpp"

namespace kvaudit {
namespace {

nlohmann::json text_or_null(const std::string& text) {
  return text.empty() ? nlohmann::json(nullptr) : nlohmann::json(text);
}

// A string member, "" for null; an error for anything else.
Result<std::string> text_member(const nlohmann::json& object, const char* key,
                                const std::string& where) {
  const auto it = object.find(key);
  if (it == object.end()) return bad_input(where, fmt::format("no \"{}\"", key));
  if (it->is_null()) return std::string();
  if (!it->is_string()) return bad_input(where, fmt::format("\"{}\" is not a string", key));
  return it->get<std::string>();
}

// {"algorithm": ALGORITHM, "value": HEX} -> HEX.
Result<std::string> algorithm_value(const nlohmann::json& object, const char* key,
                                    const char* algorithm, const std::string& where) {
  const auto it = object.find(key);
  if (it == object.end() || !it->is_object() || it->value("algorithm", "") != algorithm ||
      !it->contains("value") || !it->at("value").is_string()) {
    return bad_input(where, fmt::format("\"{}\" is not {{\"algorithm\": \"{}\", \"value\": HEX}}",
                                        key, algorithm));
  }
  return it->at("value").get<std::string>();
}

Result<std::vector<ManifestFile>> manifest_files(const nlohmann::json& manifest,
                                                 const std::string& where) {
  const auto it = manifest.find("files");
  if (it == manifest.end() || !it->is_array()) return bad_input(where, "no \"files\" array");
  std::vector<ManifestFile> files;
  for (const nlohmann::json& entry : *it) {
    if (!entry.is_object() || !entry.contains("name") || !entry["name"].is_string() ||
        !entry.contains("sha256") || !entry["sha256"].is_string()) {
      return bad_input(where, "a \"files\" entry is not {\"name\": NAME, \"sha256\": HEX}");
    }
    files.push_back({entry["name"].get<std::string>(), entry["sha256"].get<std::string>()});
  }
  return files;
}

Status write_text(const std::filesystem::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
  if (!out) return bad_input(path.string(), "cannot write the report");
  return ok_status();
}

}  // namespace

std::string manifest_text(const ReportManifest& manifest) {
  nlohmann::json files = nlohmann::json::array();
  for (const ManifestFile& file : manifest.files) {
    files.push_back({{"name", file.name}, {"sha256", file.sha256}});
  }
  const nlohmann::json j = {
      {"format", kManifestFormat},
      {"signed_by", text_or_null(manifest.signer.signed_by)},
      {"model", text_or_null(manifest.signer.model)},
      {"deployment", text_or_null(manifest.signer.deployment)},
      {"public_key", {{"algorithm", kSignatureAlgorithm}, {"value", manifest.signer.public_key}}},
      {"report_checksum",
       {{"algorithm", kReportDigestAlgorithm}, {"value", manifest.report_checksum}}},
      {"files", files}};
  return j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

Result<ReportManifest> parse_manifest(const std::string& text, const std::string& where) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object() || j.value("format", "") != kManifestFormat) {
    return bad_input(
        where, fmt::format("not a kvaudit report manifest (\"format\": \"{}\")", kManifestFormat));
  }
  ReportManifest manifest;
  KVAUDIT_ASSIGN_OR_RETURN(manifest.signer.signed_by, text_member(j, "signed_by", where));
  KVAUDIT_ASSIGN_OR_RETURN(manifest.signer.model, text_member(j, "model", where));
  KVAUDIT_ASSIGN_OR_RETURN(manifest.signer.deployment, text_member(j, "deployment", where));
  KVAUDIT_ASSIGN_OR_RETURN(manifest.signer.public_key,
                           algorithm_value(j, "public_key", kSignatureAlgorithm, where));
  KVAUDIT_ASSIGN_OR_RETURN(manifest.report_checksum,
                           algorithm_value(j, "report_checksum", kReportDigestAlgorithm, where));
  KVAUDIT_ASSIGN_OR_RETURN(manifest.files, manifest_files(j, where));
  return manifest;
}

std::string signature_text(const Ed25519Signature& signature) {
  return fmt::format("{} {}\n", kSignatureAlgorithm, bytes_hex(signature));
}

Result<Ed25519Signature> parse_signature(const std::string& text, const std::string& where) {
  const std::string prefix = std::string(kSignatureAlgorithm) + " ";
  std::string line = text;
  if (!line.empty() && line.back() == '\n') line.pop_back();
  if (line.rfind(prefix, 0) != 0) {
    return bad_input(where, "not a kvaudit signature: expected one line \"ed25519 HEX\"");
  }
  return signature_from_hex(line.substr(prefix.size()), where);
}

Status sign_report_dir(const std::filesystem::path& dir, const ReportModel& model,
                       const std::vector<std::string>& files, const Ed25519KeyPair& key) {
  if (!model.signoff || model.signoff->signer.public_key != bytes_hex(key.public_key)) {
    return internal_error("report signature",
                          "the report's sign-off does not name the signing key's public key");
  }
  ReportManifest manifest;
  manifest.signer = model.signoff->signer;
  manifest.report_checksum = model.signoff->digest.value;
  for (const std::string& name : files) {
    KVAUDIT_ASSIGN_OR_RETURN(std::string sha, sha256_file_hex(dir / name));
    manifest.files.push_back({name, std::move(sha)});
  }
  const std::string text = manifest_text(manifest);
  KVAUDIT_TRY(write_text(dir / kManifestFile, text));
  return write_text(dir / kSignatureFile, signature_text(ed25519_sign(key, text)));
}

}  // namespace kvaudit
