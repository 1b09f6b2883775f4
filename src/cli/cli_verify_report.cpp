// `kvaudit verify-report DIR [--public-key KEY]`: check a signed report directory
// (src/report/report_verify.hpp): its signature over its manifest, every file against the
// manifest, report.json against both, and, given --public-key, the signer's key. A report made
// without --signoff: its checksum recomputed from report.json (no signature, no signer).
// Exit status: 0 the report verifies (or its checksum matches), 1 it does not (each problem
// printed), 2 bad input (no such file, not JSON, a report with neither a signature nor a
// checksum, one signed before kvaudit signed reports, --public-key for a report that is not
// signed, a bad key).
#include <fmt/format.h>
#include <fmt/ostream.h>

#include <algorithm>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "src/cli/cli.hpp"
#include "src/core/ed25519.hpp"
#include "src/report/report_verify.hpp"

namespace kvaudit {
namespace {

struct VerifyOptions {
  std::string path;
  std::string public_key;  // a key file or 64 hex digits; empty: not checked
};

std::string or_not_given(const std::string& text) { return text.empty() ? "(not given)" : text; }

// Files beside a signed report that its manifest does not cover (a rendered PNG, a log): named,
// so that nobody takes them for signed. The manifest lists report.json, report.md, report.html.
std::vector<std::string> files_not_signed(const std::filesystem::path& dir) {
  static const std::set<std::string> kSigned = {"report.json", "report.md", "report.html",
                                                "report.manifest.json", "report.sig"};
  std::vector<std::string> names;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
    const std::string name = entry.path().filename().string();
    if (kSigned.count(name) == 0) names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  return names;
}

Result<int> verify(const VerifyOptions& options) {
  std::optional<Ed25519PublicKey> expected;
  if (!options.public_key.empty()) {
    KVAUDIT_ASSIGN_OR_RETURN(expected, read_public_key(options.public_key, "--public-key"));
  }
  KVAUDIT_ASSIGN_OR_RETURN(const ReportVerification v, verify_report(options.path, expected));
  if (!v.match()) {
    for (const std::string& problem : v.problems) fmt::print(std::cout, "MISMATCH: {}\n", problem);
    return kExitChecksFailed;
  }
  if (v.proof == ReportProof::kChecksum) {
    fmt::print(std::cout,
               "checksum matches (not a signature: anyone who edits the report can compute it "
               "again): {} sha256 {}; verdict {}\n"
               "  not signed (made without --signoff): who made it is not known\n",
               (v.dir / "report.json").string(), v.checksum, v.verdict);
    return kExitPass;
  }
  fmt::print(std::cout,
             "match: {} signature ed25519 verifies, report.json, report.md and report.html as "
             "signed, checksum sha256 {}\n"
             "  signed by {}, model {}, deployment {}; verdict {}\n"
             "  public key {} ({})\n",
             v.dir.string(), v.checksum, or_not_given(v.signed_by), or_not_given(v.model),
             or_not_given(v.deployment), v.verdict, v.public_key,
             v.key_expected ? "the expected key"
                            : "not compared with an expected key: give --public-key to know who "
                              "signed");
  if (const std::vector<std::string> others = files_not_signed(v.dir); !others.empty()) {
    fmt::print(std::cout, "  not signed (not in the manifest, not checked): {}\n",
               fmt::join(others, ", "));
  }
  return kExitPass;
}

int run_verify_report(const VerifyOptions& options) {
  const Result<int> status = verify(options);
  return status.ok() ? *status : report_error(status.error());
}

}  // namespace

void register_verify_report_command(CLI::App& app, CommandRunner& runner) {
  auto options = std::make_shared<VerifyOptions>();
  CLI::App* cmd = add_command(
      app, "verify-report",
      {"Check a report: a signed one's signature, every file and who signed it; a plain one's "
       "checksum.",
       "For a report directory written by kvaudit check --signoff --signing-key FILE (or kvaudit "
       "merge of sign-off parts): check that report.sig is an Ed25519 signature over "
       "report.manifest.json by the public key the manifest names, that report.json, report.md "
       "and report.html have the SHA-256 the manifest lists, and that report.json names the same "
       "signer, model, deployment and public key and hashes to the checksum the manifest lists "
       "(report.json without \"timing\" and \"signoff\".\"digest\", serialized compactly with "
       "sorted keys). Any edited file, edited manifest or replaced signature fails. Without "
       "--public-key this proves the report is as its key holder signed it, not who that is: "
       "give the signer's public key to check that too.\n"
       "For a report made without --signoff (kvaudit check --report DIR): recompute the checksum "
       "report.json states (report.json without \"timing\" and \"checksum\", serialized the "
       "same way) and print \"checksum matches (not a signature ...)\": it detects a report.json "
       "changed by accident, but anyone who edits the report can compute it again, and report.md "
       "and report.html are not covered. --public-key is refused for such a report: nobody "
       "signed it.",
       "0 the report verifies (a plain report: its checksum matches), 1 it does not (each "
       "problem printed), 2 bad input (no such file, not JSON, --public-key for a report made "
       "without --signoff, a report with neither signature nor checksum (made without --signoff "
       "by an older kvaudit) or signed before kvaudit signed reports, a bad key), 3 internal "
       "error"});
  add_input_file(*cmd, "REPORT", options->path, "Report directory, or its report.json")->required();
  cmd->add_option("--public-key", options->public_key,
                  "The signer's public key: the FILE.pub kvaudit keygen wrote, or its 64 hex "
                  "digits; the report must be signed with it")
      ->type_name("FILE|HEX");
  cmd->callback([options, &runner] { runner = [options] { return run_verify_report(*options); }; });
}

}  // namespace kvaudit
