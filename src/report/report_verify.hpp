// Checking a report (`kvaudit verify-report DIR [--public-key KEY]`). A report made without
// --signoff has no signature, only its top-level "checksum": that is recomputed from report.json
// (src/verdict/report_digest.hpp) and compared with the value stated, which detects a report.json
// changed by accident, not one edited on purpose (the editor can recompute it); --public-key
// against such a report is bad input (there is no signer to compare). A signed report, in this
// order:
//   1. report.json has a sign-off block naming a public key, and report.manifest.json and
//      report.sig are beside it (a report signed before kvaudit signed reports has a checksum
//      only: refused, it proves nothing);
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

// What a report carries to be checked against.
enum class ReportProof {
  kSignature,  // --signoff: Ed25519 over the manifest of its files
  kChecksum,   // no --signoff: report.json's checksum alone, no signature
};

struct ReportVerification {
  ReportProof proof = ReportProof::kSignature;
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
// known. Errors (bad input): no such file, not JSON, neither signed nor with a checksum (made
// without --signoff by a kvaudit from before plain reports kept their checksum), signed before
// signatures (no public key and no manifest), a malformed "checksum", or `expected_key` given for
// a report that is not signed.
Result<ReportVerification> verify_report(const std::filesystem::path& path,
                                         const std::optional<Ed25519PublicKey>& expected_key);

}  // namespace kvaudit
