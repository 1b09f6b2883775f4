// The checksum of a report (src/verdict/report_digest.hpp): which bytes are hashed, and that
// report.json's signoff block carries it (a sign-off) or its top-level "checksum" (a plain report).
// Expected bytes are written out here; the expected digest was computed outside kvaudit (Python:
// hashlib.sha256(bytes).hexdigest()).
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "src/verdict/check_result.hpp"
#include "src/verdict/report_digest.hpp"
#include "tests/verdict/check_run_fixture.hpp"

TEST_CASE("canonical report bytes: no timing, no digest, sorted keys, compact", "[digest]") {
  const nlohmann::json report = nlohmann::json::parse(R"({
    "verdict": "pass", "timing": {"total_seconds": 3.5},
    "results": [{"rel_l2": 0.001953125, "step": 0}],
    "signoff": {"signed_by": "Ada", "digest": {"value": "ff"}, "model": null},
    "counts": {"failed": 0, "comparisons": 2}})");
  const std::string expected =
      R"({"counts":{"comparisons":2,"failed":0},"results":[{"rel_l2":0.001953125,"step":0}],)"
      R"("signoff":{"model":null,"signed_by":"Ada"},"verdict":"pass"})";
  CHECK(kvaudit::canonical_report_bytes(report) == expected);
  CHECK(kvaudit::report_digest(report) ==
        "ca2b133d79a8043e9151730ca68f89308a2a64811756a692c2816aee92d0e605");
}

TEST_CASE("a sign-off run's report.json carries the digest of its own canonical bytes",
          "[digest]") {
  kvaudit::CheckRun run = kvaudit::testing::make_failing_run();
  run.signoff = kvaudit::SignOff{"Ada Lovelace", "GLM-5", ""};
  const nlohmann::json j = kvaudit::to_json(run);
  const nlohmann::json& signoff = j.at("signoff");
  CHECK(signoff.at("signed_by") == "Ada Lovelace");
  CHECK(signoff.at("model") == "GLM-5");
  CHECK(signoff.at("deployment").is_null());
  CHECK(signoff.at("digest").at("algorithm") == "sha256");
  const std::string digest = signoff.at("digest").at("value");
  CHECK(digest.size() == 64);
  // Written out and read back (as verify-report does), the report hashes to the stated digest.
  const nlohmann::json reread = nlohmann::json::parse(j.dump(2));
  CHECK(kvaudit::report_digest(reread) == digest);
  // Timing is not covered; the signer and every result are.
  nlohmann::json changed = reread;
  changed["timing"]["total_seconds"] = 1234.5;
  CHECK(kvaudit::report_digest(changed) == digest);
  changed["signoff"]["signed_by"] = "Mallory";
  CHECK(kvaudit::report_digest(changed) != digest);
  changed = reread;
  changed["results"][0]["metrics"]["rel_l2"] = 0.0021;
  CHECK(kvaudit::report_digest(changed) != digest);
}

TEST_CASE("a run that is not a sign-off has a null signoff block", "[digest]") {
  CHECK(kvaudit::to_json(kvaudit::testing::make_failing_run()).at("signoff").is_null());
}

TEST_CASE("canonical report bytes of a plain report: no timing, no top-level checksum",
          "[digest][checksum]") {
  const nlohmann::json report = nlohmann::json::parse(R"({
    "verdict": "pass", "timing": {"total_seconds": 3.5}, "signoff": null,
    "checksum": {"algorithm": "sha256", "covers": "...", "value": "ff"},
    "results": [{"rel_l2": 0.001953125, "step": 0}],
    "counts": {"failed": 0, "comparisons": 2}})");
  const std::string expected =
      R"({"counts":{"comparisons":2,"failed":0},"results":[{"rel_l2":0.001953125,"step":0}],)"
      R"("signoff":null,"verdict":"pass"})";
  CHECK(kvaudit::canonical_report_bytes(report) == expected);
  // Python: hashlib.sha256(expected.encode()).hexdigest()
  CHECK(kvaudit::report_digest(report) ==
        "f326687180580542aa2ea2640ca8471fa489840316b8161748d234d539472fff");
}

TEST_CASE("a run that is not a sign-off states its checksum at the top level, not signed",
          "[digest][checksum]") {
  const nlohmann::json j = kvaudit::to_json(kvaudit::testing::make_failing_run());
  REQUIRE(j.contains("checksum"));
  CHECK(j.at("checksum").at("algorithm") == "sha256");
  CHECK(j.at("checksum").at("covers") ==
        "SHA-256 of report.json without \"timing\" and \"checksum\", serialized compactly with "
        "sorted keys (nlohmann::json dump(), UTF-8)");
  const std::string checksum = j.at("checksum").at("value");
  // Written out and read back, the report hashes to the checksum it states; a changed result
  // does not, changed timing does.
  const nlohmann::json reread = nlohmann::json::parse(j.dump(2));
  CHECK(kvaudit::report_digest(reread) == checksum);
  nlohmann::json changed = reread;
  changed["timing"]["total_seconds"] = 1234.5;
  CHECK(kvaudit::report_digest(changed) == checksum);
  changed["results"][0]["metrics"]["rel_l2"] = 0.0021;
  CHECK(kvaudit::report_digest(changed) != checksum);
}
