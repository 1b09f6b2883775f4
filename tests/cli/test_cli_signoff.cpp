// `kvaudit check --signoff` on the shipped dumps and `kvaudit verify-report` end to end: a
// sign-off does not pass on what it never measured (page64_nan has no kv_source), a failing
// sign-off names the saturated codes beside the quantization error (saturated_page16), and a
// signed report verifies until its data changes.
#include <sys/wait.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "tests/test_paths.hpp"

namespace {

struct Ran {
  int status = -1;
  std::string out;
};

std::string read_text(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// `kvaudit ARGUMENTS`, stdout and stderr together.
Ran kvaudit(const std::string& name, const std::string& arguments) {
  const std::filesystem::path out = kvaudit_test::test_tmpdir() / (name + ".out");
  std::filesystem::create_directories(out.parent_path());
  const std::string command =
      kvaudit_test::kvaudit_binary().string() + " " + arguments + " > '" + out.string() + "' 2>&1";
  const int raw = std::system(command.c_str());
  return {WIFEXITED(raw) ? WEXITSTATUS(raw) : -1, read_text(out)};
}

std::string dataset(const char* name) {
  return "'" + (kvaudit_test::source_dir() / "datasets" / name).string() + "'";
}

std::filesystem::path fresh_dir(const std::string& name) {
  const std::filesystem::path dir = kvaudit_test::test_tmpdir() / name;
  std::filesystem::remove_all(dir);
  return dir;
}

}  // namespace

TEST_CASE("check --signoff on a dump without kv_source fails and says what was not measured",
          "[cli][signoff]") {
  const std::filesystem::path dir = fresh_dir("signoff_page64_nan");
  const Ran ran =
      kvaudit("signoff_page64_nan", "check " + dataset("page64_nan.h5") +
                                        " --threads 2 --signoff --report '" + dir.string() + "'");
  INFO(ran.out);
  CHECK(ran.status == 1);
  CHECK_THAT(ran.out,
             Catch::Contains("verdict: FAIL (policy signoff, backend cpu-fp8, 12 comparisons, 0 "
                             "failed, 36 integrity checks, 0 failed) - sign-off incomplete: "
                             "quantization and total error not measured in layers 0, 1"));
  // The note says none was measured (every reported step), not "some visible tokens".
  CHECK_THAT(ran.out, Catch::Contains("L000: quantization and total error not measured at any "
                                      "of the 3 reported steps"));
  CHECK_THAT(ran.out, !Catch::Contains("some visible tokens"));
  const nlohmann::json report = nlohmann::json::parse(read_text(dir / "report.json"));
  CHECK(report.at("verdict") == "fail");
  CHECK(report.at("counts").at("unmeasured") == 12);  // 2 layers x 3 steps x 2 comparisons
  const std::string md = read_text(dir / "report.md");
  CHECK_THAT(md, Catch::Contains("**Sign-off incomplete:** quantization and total error not "
                                 "measured in layers 0, 1"));
  CHECK_THAT(md, Catch::Contains("- **NOT MEASURED** FP8 storage cost"));

  // The same dump under the default policy passes, the gap reported.
  const Ran by_default =
      kvaudit("default_page64_nan", "check " + dataset("page64_nan.h5") + " --threads 2");
  CHECK(by_default.status == 0);
}

TEST_CASE("a failing sign-off puts the saturated codes beside the quantization error",
          "[cli][signoff]") {
  const std::filesystem::path dir = fresh_dir("signoff_saturated");
  const Ran ran =
      kvaudit("signoff_saturated", "check " + dataset("saturated_page16.h5") +
                                       " --threads 2 --signoff --report '" + dir.string() + "'");
  CHECK(ran.status == 1);
  const nlohmann::json report = nlohmann::json::parse(read_text(dir / "report.json"));
  // Layer 5 at step 1 read 165 saturated codes (kvaudit info counts the pool's the same way).
  bool found = false;
  for (const nlohmann::json& site : report.at("coverage")) {
    if (site.at("step") == 1 && site.at("layer") == 5) {
      found = true;
      CHECK(site.at("saturated_codes") == 165);
      CHECK(site.at("tokens_without_source") == 0);
    }
  }
  CHECK(found);
  const std::string md = read_text(dir / "report.md");
  CHECK_THAT(md, Catch::Contains("### quantization error over the sign-off limit in layer 5"));
  CHECK_THAT(md,
             Catch::Contains("saturated codes read: 165 of 83,520 codes read (0.2%) at step 1"));
  CHECK_THAT(md, Catch::Contains("Likely cause: Saturation"));
}

TEST_CASE("verify-report: a signed report matches until its data changes", "[cli][signoff]") {
  const std::filesystem::path dir = fresh_dir("signed_glm5");
  const Ran signed_run =
      kvaudit("signed_glm5", "check " + dataset("glm5_page1.h5") +
                                 " --threads 2 --signoff --signed-by 'Ada Lovelace' --model GLM-5 "
                                 "--deployment 'test deployment' --report '" +
                                 dir.string() + "'");
  REQUIRE(signed_run.status == 0);
  const Ran verified = kvaudit("verify_glm5", "verify-report '" + dir.string() + "'");
  INFO(verified.out);
  CHECK(verified.status == 0);
  CHECK_THAT(verified.out, Catch::StartsWith("match: "));
  CHECK_THAT(verified.out, Catch::Contains("signed by Ada Lovelace, model GLM-5"));

  // Timing is not covered: changing it keeps the match.
  nlohmann::json report = nlohmann::json::parse(read_text(dir / "report.json"));
  report["timing"]["total_seconds"] = 12345.0;
  std::ofstream(dir / "report.json") << report.dump(2) << "\n";
  CHECK(kvaudit("verify_glm5_timing", "verify-report '" + dir.string() + "'").status == 0);

  // One result changed: mismatch, exit 1.
  report["results"][0]["metrics"]["rel_l2"] = 0.5;
  std::ofstream(dir / "report.json") << report.dump(2) << "\n";
  const Ran tampered = kvaudit("verify_glm5_tampered", "verify-report '" + dir.string() + "'");
  CHECK(tampered.status == 1);
  CHECK_THAT(tampered.out, Catch::Contains("digest mismatch"));

  // A report made without --signoff is not a signed report: bad input, one line.
  const std::filesystem::path unsigned_dir = fresh_dir("unsigned_glm5");
  REQUIRE(kvaudit("unsigned_glm5", "check " + dataset("glm5_page1.h5") +
                                       " --threads 2 --steps 0 --report '" + unsigned_dir.string() +
                                       "'")
              .status == 0);
  const Ran not_signed =
      kvaudit("verify_unsigned", "verify-report '" + unsigned_dir.string() + "'");
  CHECK(not_signed.status == 2);
  CHECK_THAT(not_signed.out, Catch::Contains("not a signed report"));
}

TEST_CASE("sign-off fields without --signoff are a usage error", "[cli][signoff]") {
  const Ran ran = kvaudit("signed_by_without_signoff",
                          "check " + dataset("glm5_page1.h5") + " --signed-by Ada");
  CHECK(ran.status == 2);
  CHECK_THAT(ran.out, Catch::Contains("--signed-by: needs --signoff"));
}
