// Checking a signed report (`kvaudit verify-report DIR [--public-key KEY]`), in this order:
//   1. report.json has a sign-off block (a report made without --signoff has nothing to verify)
//      naming a public key, and report.manifest.json and report.sig are beside it (a report
//      signed before kvaudit signed reports has a checksum only: refused, it proves nothing);
//   2. report.sig is a valid Ed25519 signature over report.manifest.json's bytes under the public
//      key the manifest names, and, given --public-key, that key is the one expected;
//   3. every file the manifest lists (report.json, report.md, report.html) has the SHA-256 it
//      lists, and the manifest lists each of them;
//   4. report.json agrees with the manifest: the same signer, model, deployment and public key,
//      and its canonical checksum (src/verdict/report_digest.hpp) is the manifest's and the one
//      it states.
// Every failing check is one problem line naming the file; all are collected.
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "src/core/ed25519.hpp"
#include "src/core/result.hpp"

namespace kvaudit {

struct ReportVerification {
  std::filesystem::path dir;          // the report directory checked
  std::string public_key;             // the manifest's (hex)
  bool key_expected = false;          // --public-key given (and then compared)
  std::string checksum;               // report_digest(report.json)
  std::vector<std::string> problems;  // each mismatch, one line (empty: the report verifies)
  std::string signed_by;              // the manifest's signer fields ("" when not given)
  std::string model;
  std::string deployment;
  std::string verdict;  // report.json's "verdict"
  bool match() const { return problems.empty(); }
};

// `path`: a report directory, or its report.json. `expected_key`: the signer's public key, when
// known. Errors (bad input): no such file, not JSON, not a signed report (no signoff block, or
// signed before signatures: no public key and no manifest).
Result<ReportVerification> verify_report(const std::filesystem::path& path,
                                         const std::optional<Ed25519PublicKey>& expected_key);

}  // namespace kvaudit
