// `kvaudit check --signoff` on the shipped dumps, `kvaudit keygen` and `kvaudit verify-report` end
// to end: a sign-off does not pass on what it never measured (page64_nan has no kv_source), a
// failing sign-off names the saturated codes beside the quantization error (saturated_page16), a
// sign-off needs a signer, a model, a key and a report directory, and a signed report verifies
// until any of its files, its manifest, its signature or its key changes; a plain report keeps a
// checksum that verify-report recomputes (no signature).
#include <sys/wait.h>

#include <algorithm>
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

// A key pair made by `kvaudit keygen` in a fresh folder: NAME/key and NAME/key.pub.
std::filesystem::path make_key(const std::string& name) {
  const std::filesystem::path dir = fresh_dir(name);
  std::filesystem::create_directories(dir);
  const Ran made = kvaudit(name + "_keygen", "keygen --out '" + (dir / "key").string() + "'");
  INFO(made.out);
  REQUIRE(made.status == 0);
  return dir / "key";
}

// The sign-off options with a signer, a model and a fresh key.
std::string signoff_options(const std::string& name) {
  return " --signoff --signed-by 'Ada Lovelace' --model GLM-5 --signing-key '" +
         make_key(name).string() + "'";
}

void write_text(const std::filesystem::path& path, const std::string& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

// `text` with its first `from` replaced by `to` (which must be there).
std::string replaced(std::string text, const std::string& from, const std::string& to) {
  const std::size_t at = text.find(from);
  REQUIRE(at != std::string::npos);
  return text.replace(at, from.size(), to);
}

}  // namespace

TEST_CASE("check --signoff on a dump without kv_source fails and says what was not measured",
          "[cli][signoff]") {
  const std::filesystem::path dir = fresh_dir("signoff_page64_nan");
  const Ran ran =
      kvaudit("signoff_page64_nan", "check " + dataset("page64_nan.h5") + " --threads 2" +
                                        signoff_options("page64_nan_key") + " --report '" +
                                        dir.string() + "'");
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
      kvaudit("signoff_saturated", "check " + dataset("saturated_page16.h5") + " --threads 2" +
                                       signoff_options("saturated_key") + " --report '" +
                                       dir.string() + "'");
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

TEST_CASE("kvaudit keygen writes a key pair, the private key 0600, and never overwrites",
          "[cli][signoff]") {
  const std::filesystem::path dir = fresh_dir("keygen_cli");
  std::filesystem::create_directories(dir);
  const Ran made = kvaudit("keygen_cli", "keygen --out '" + (dir / "key").string() + "'");
  INFO(made.out);
  REQUIRE(made.status == 0);
  const std::string public_line = read_text(dir / "key.pub");
  CHECK_THAT(public_line, Catch::StartsWith("kvaudit-ed25519-public-key "));
  CHECK(public_line.size() == std::string("kvaudit-ed25519-public-key ").size() + 64 + 1);
  CHECK_THAT(made.out, Catch::Contains("ed25519 " + public_line.substr(27, 64)));
  CHECK((std::filesystem::status(dir / "key").permissions() & std::filesystem::perms::all) ==
        (std::filesystem::perms::owner_read | std::filesystem::perms::owner_write));
  const std::string private_key = read_text(dir / "key");

  const Ran again = kvaudit("keygen_cli_again", "keygen --out '" + (dir / "key").string() + "'");
  CHECK(again.status == 2);
  CHECK_THAT(again.out, Catch::Contains("key: exists already"));
  CHECK(read_text(dir / "key") == private_key);
}

TEST_CASE("check --signoff without a signer, a model, a key or a report is refused",
          "[cli][signoff]") {
  const std::filesystem::path dir = fresh_dir("refused_signoff");
  // Nothing but --signoff and a report: not a sign-off (it used to pass, "(not given)").
  const Ran bare =
      kvaudit("signoff_bare", "check " + dataset("glm5_page1.h5") +
                                  " --threads 2 --signoff --report '" + dir.string() + "'");
  INFO(bare.out);
  CHECK(bare.status == 2);
  CHECK_THAT(bare.out, Catch::StartsWith("kvaudit: --signoff: needs --signed-by NAME"));
  CHECK_FALSE(std::filesystem::exists(dir));
  const std::string key = make_key("refused_key").string();
  const std::string report = " --report '" + dir.string() + "'";
  const std::string signer = " --signed-by 'Ada Lovelace'";
  const std::string model = " --model GLM-5";
  const std::string signing_key = " --signing-key '" + key + "'";
  const struct {
    const char* name;
    std::string options;
    const char* message;
  } cases[] = {
      {"no_signer", model + signing_key + report, "kvaudit: --signoff: needs --signed-by NAME"},
      {"no_model", signer + signing_key + report, "kvaudit: --signoff: needs --model NAME"},
      {"no_key", signer + model + report, "kvaudit: --signoff: needs --signing-key FILE"},
      {"no_report", signer + model + signing_key, "kvaudit: --signoff: needs --report DIR"},
      // A shard without --json writes no part: nothing would be signed, by the merge either.
      {"shard_no_json", signer + model + signing_key + " --shard 0/2",
       "kvaudit: --signoff: needs --report DIR"},
  };
  for (const auto& c : cases) {
    const Ran ran =
        kvaudit(std::string("signoff_") + c.name,
                "check " + dataset("glm5_page1.h5") + " --threads 2 --signoff" + c.options);
    INFO(c.name << ": " << ran.out);
    CHECK(ran.status == 2);
    CHECK_THAT(ran.out, Catch::StartsWith(c.message));
    CHECK(std::count(ran.out.begin(), ran.out.end(), '\n') == 1);  // one line, before any work
    CHECK_FALSE(std::filesystem::exists(dir));
  }
  // A file that is no key: refused, naming it.
  const std::filesystem::path not_a_key = dir.parent_path() / "refused_not_a_key";
  write_text(not_a_key, "hello\n");
  const Ran bad_key = kvaudit("signoff_bad_key",
                              "check " + dataset("glm5_page1.h5") + " --signoff" + signer + model +
                                  " --signing-key '" + not_a_key.string() + "'" + report);
  CHECK(bad_key.status == 2);
  CHECK_THAT(bad_key.out,
             Catch::StartsWith("kvaudit: " + not_a_key.string() + ": not a kvaudit key file"));
}

TEST_CASE(
    "verify-report: a signed report verifies until a file, the manifest, the signature or "
    "the key changes",
    "[cli][signoff]") {
  const std::filesystem::path key = make_key("signed_glm5_key");
  const std::filesystem::path dir = fresh_dir("signed_glm5");
  const Ran signed_run =
      kvaudit("signed_glm5", "check " + dataset("glm5_page1.h5") +
                                 " --threads 2 --steps 0 --signoff --signed-by 'Ada Lovelace' "
                                 "--model GLM-5 --deployment 'test deployment' --signing-key '" +
                                 key.string() + "' --report '" + dir.string() + "'");
  INFO(signed_run.out);
  REQUIRE(signed_run.status == 0);
  for (const char* name :
       {"report.json", "report.md", "report.html", "report.manifest.json", "report.sig"}) {
    CHECK(std::filesystem::exists(dir / name));
  }
  const std::string public_hex = read_text(key.string() + ".pub").substr(27, 64);
  const nlohmann::json report = nlohmann::json::parse(read_text(dir / "report.json"));
  CHECK(report.at("signoff").at("public_key").at("value") == public_hex);
  CHECK(report.at("signoff").at("public_key").at("algorithm") == "ed25519");
  CHECK_THAT(read_text(dir / "report.md"), Catch::Contains(public_hex));
  CHECK_THAT(read_text(dir / "report.html"), Catch::Contains(public_hex));

  const std::string expect_key = " --public-key '" + key.string() + ".pub'";
  const Ran verified = kvaudit("verify_glm5", "verify-report '" + dir.string() + "'" + expect_key);
  INFO(verified.out);
  CHECK(verified.status == 0);
  CHECK_THAT(verified.out, Catch::StartsWith("match: "));
  CHECK_THAT(verified.out, Catch::Contains("signed by Ada Lovelace, model GLM-5"));
  CHECK_THAT(verified.out, Catch::Contains("public key " + public_hex + " (the expected key)"));
  CHECK(
      kvaudit("verify_glm5_hex", "verify-report '" + dir.string() + "' --public-key " + public_hex)
          .status == 0);
  // Without an expected key it verifies, and says that who signed was not checked.
  const Ran any_key = kvaudit("verify_glm5_any_key", "verify-report '" + dir.string() + "'");
  CHECK(any_key.status == 0);
  CHECK_THAT(any_key.out, Catch::Contains("not compared with an expected key"));
  CHECK(any_key.out.find("not signed (not in the manifest") == std::string::npos);
  // A file the manifest does not cover (a rendered PNG, a log) is named as not signed, so that
  // "verifies" is not read as covering it.
  write_text(dir / "notes.txt", "added after signing\n");
  const Ran extra = kvaudit("verify_glm5_extra_file", "verify-report '" + dir.string() + "'");
  CHECK(extra.status == 0);
  CHECK_THAT(extra.out, Catch::Contains("report.json, report.md and report.html as signed"));
  CHECK_THAT(extra.out,
             Catch::Contains("not signed (not in the manifest, not checked): notes.txt"));
  std::filesystem::remove(dir / "notes.txt");

  // Another key expected: the report was not signed by its holder.
  const std::filesystem::path other_key = make_key("signed_glm5_other_key");
  const Ran other =
      kvaudit("verify_glm5_other",
              "verify-report '" + dir.string() + "' --public-key '" + other_key.string() + ".pub'");
  CHECK(other.status == 1);
  CHECK_THAT(other.out, Catch::Contains("not the expected"));

  // Each edit, on a fresh copy of the signed directory, fails verification (exit 1) naming what.
  const std::string manifest = read_text(dir / "report.manifest.json");
  const std::string signature = read_text(dir / "report.sig");
  const std::string json_text = read_text(dir / "report.json");
  const std::string other_hex = read_text(other_key.string() + ".pub").substr(27, 64);
  const struct {
    const char* name;
    const char* file;
    std::string text;
    const char* message;
  } edits[] = {
      {"json_result", "report.json",
       replaced(json_text, "\"verdict\": \"pass\"", "\"verdict\": \"fail\""),
       "report.json: changed after signing"},
      {"json_timing", "report.json", replaced(json_text, "\"timing\": {", "\"timing\": { "),
       "report.json: changed after signing"},
      {"json_key", "report.json", replaced(json_text, public_hex, other_hex),
       "report.json: changed after signing"},
      {"md", "report.md", replaced(read_text(dir / "report.md"), "Ada Lovelace", "Mallory"),
       "report.md: changed after signing"},
      {"html", "report.html", replaced(read_text(dir / "report.html"), "PASS", "FAIL"),
       "report.html: changed after signing"},
      {"manifest_signer", "report.manifest.json", replaced(manifest, "Ada Lovelace", "Mallory"),
       "the signature does not verify"},
      {"manifest_key", "report.manifest.json", replaced(manifest, public_hex, other_hex),
       "the signature does not verify"},
      {"signature", "report.sig",
       // the signature's first hex byte, edited where it stands (a find() could hit the same two
       // digits inside the "ed25519 " prefix and edit that instead)
       std::string(signature).replace(8, 2, signature.substr(8, 2) == "00" ? "01" : "00"),
       "the signature does not verify"},
  };
  for (const auto& edit : edits) {
    const std::filesystem::path copy = fresh_dir(std::string("edited_") + edit.name);
    std::filesystem::copy(dir, copy);
    write_text(copy / edit.file, edit.text);
    const Ran ran = kvaudit(std::string("verify_edited_") + edit.name,
                            "verify-report '" + copy.string() + "'" + expect_key);
    INFO(edit.name << ": " << ran.out);
    CHECK(ran.status == 1);
    CHECK_THAT(ran.out, Catch::StartsWith("MISMATCH: "));
    CHECK_THAT(ran.out, Catch::Contains(edit.message));
  }
  // A missing signature or manifest fails too.
  for (const char* name : {"report.sig", "report.manifest.json"}) {
    const std::filesystem::path copy = fresh_dir(std::string("removed_") + name);
    std::filesystem::copy(dir, copy);
    std::filesystem::remove(copy / name);
    const Ran ran = kvaudit(std::string("verify_removed_") + name,
                            "verify-report '" + copy.string() + "'" + expect_key);
    INFO(name << ": " << ran.out);
    CHECK(ran.status == 1);
    CHECK_THAT(ran.out, Catch::Contains(std::string(name) + ": missing"));
  }
  // A sign-off states its checksum in its signoff block only: no top-level "checksum".
  CHECK_FALSE(report.contains("checksum"));
}

namespace {

// A fresh plain report (check --report DIR, no --signoff) of glm5_page1's step 0, and its
// report.json.
struct PlainReport {
  std::filesystem::path dir;
  nlohmann::json json;
  std::string checksum;  // report.json's "checksum"."value", "" when it has none
};

PlainReport make_plain_report(const std::string& name) {
  const std::filesystem::path dir = fresh_dir(name);
  const Ran made = kvaudit(name, "check " + dataset("glm5_page1.h5") +
                                     " --threads 2 --steps 0 --report '" + dir.string() + "'");
  INFO(made.out);
  REQUIRE(made.status == 0);
  const nlohmann::json json = nlohmann::json::parse(read_text(dir / "report.json"));
  const nlohmann::json checksum = json.value("checksum", nlohmann::json::object());
  return {dir, json, checksum.is_object() ? checksum.value("value", "") : ""};
}

}  // namespace

TEST_CASE("a plain report carries its checksum, and verify-report recomputes and matches it",
          "[cli][checksum]") {
  const PlainReport plain = make_plain_report("plain_glm5");
  CHECK_FALSE(std::filesystem::exists(plain.dir / "report.manifest.json"));
  CHECK_FALSE(std::filesystem::exists(plain.dir / "report.sig"));
  CHECK(plain.json.at("signoff").is_null());
  REQUIRE(plain.json.contains("checksum"));
  CHECK(plain.json.at("checksum").at("algorithm") == "sha256");
  CHECK(plain.checksum.size() == 64);
  CHECK(plain.checksum.find_first_not_of("0123456789abcdef") == std::string::npos);

  const Ran verified = kvaudit("verify_plain", "verify-report '" + plain.dir.string() + "'");
  INFO(verified.out);
  CHECK(verified.status == 0);
  CHECK_THAT(verified.out, Catch::StartsWith("checksum matches (not a signature"));
  CHECK_THAT(verified.out, Catch::Contains(plain.checksum));
  // Given report.json itself, the same.
  CHECK(kvaudit("verify_plain_json", "verify-report '" + (plain.dir / "report.json").string() + "'")
            .status == 0);
  // Timing is not covered (it differs on every run): edited, the checksum still matches.
  nlohmann::json retimed = plain.json;
  retimed["timing"]["total_seconds"] = 1234.5;
  write_text(plain.dir / "report.json", retimed.dump(2) + "\n");
  CHECK(kvaudit("verify_plain_retimed", "verify-report '" + plain.dir.string() + "'").status == 0);
}

TEST_CASE("verify-report: a plain report whose results were edited no longer matches its checksum",
          "[cli][checksum]") {
  const PlainReport plain = make_plain_report("plain_edited");
  nlohmann::json edited = plain.json;
  edited["results"][0]["metrics"]["rel_l2"] = 0.5;
  nlohmann::json failed = plain.json;
  failed["verdict"] = "fail";
  for (const auto& [name, json] : {std::pair{"results", edited}, std::pair{"verdict", failed}}) {
    write_text(plain.dir / "report.json", json.dump(2) + "\n");
    const Ran ran = kvaudit(std::string("verify_plain_edited_") + name,
                            "verify-report '" + plain.dir.string() + "'");
    INFO(name << ": " << ran.out);
    CHECK(ran.status == 1);
    CHECK_THAT(ran.out, Catch::StartsWith("MISMATCH: " + (plain.dir / "report.json").string() +
                                          ": checksum mismatch"));
    CHECK_THAT(ran.out, Catch::Contains("it states " + plain.checksum));
  }
}

TEST_CASE("verify-report --public-key against a plain report fails: it is not signed",
          "[cli][checksum]") {
  const PlainReport plain = make_plain_report("plain_with_key");
  // Without a key the checksum matches; with one, there is no signer to compare.
  CHECK(kvaudit("verify_plain_no_key", "verify-report '" + plain.dir.string() + "'").status == 0);
  const std::filesystem::path key = make_key("plain_glm5_key");
  const Ran with_key =
      kvaudit("verify_plain_with_key",
              "verify-report '" + plain.dir.string() + "' --public-key '" + key.string() + ".pub'");
  INFO(with_key.out);
  CHECK((with_key.status == 1 || with_key.status == 2));
  CHECK_THAT(with_key.out, Catch::Contains("the report is not signed"));
  CHECK_THAT(with_key.out, !Catch::Contains("matches"));
  CHECK(std::count(with_key.out.begin(), with_key.out.end(), '\n') == 1);
}

TEST_CASE("report.md and report.html of a plain report state its checksum, not a signature",
          "[cli][checksum]") {
  const PlainReport plain = make_plain_report("plain_pages");
  CHECK(plain.checksum.size() == 64);
  for (const char* page : {"report.md", "report.html"}) {
    const std::string text = read_text(plain.dir / page);
    INFO(page);
    CHECK_THAT(text, Catch::Contains("Checksum"));
    CHECK_THAT(text, Catch::Contains(plain.checksum));
    CHECK_THAT(text, Catch::Contains("a checksum, not a signature"));
    CHECK_THAT(text, Catch::Contains("anyone who edits the report can compute it again"));
  }
}

TEST_CASE(
    "a plain report without a checksum (an older kvaudit's) or with a malformed one is refused "
    "in one line",
    "[cli][checksum]") {
  const PlainReport plain = make_plain_report("plain_without_checksum");
  nlohmann::json old = plain.json;
  old.erase("checksum");
  write_text(plain.dir / "report.json", old.dump(2) + "\n");
  const Ran ran =
      kvaudit("verify_plain_without_checksum", "verify-report '" + plain.dir.string() + "'");
  CHECK(ran.status == 2);
  CHECK_THAT(ran.out, Catch::Contains("not a signed report and no checksum"));
  CHECK(std::count(ran.out.begin(), ran.out.end(), '\n') == 1);
  // A checksum that is not {"algorithm": "sha256", "value": HEX}: bad input, one line.
  old["checksum"] = "sha256:" + plain.checksum;
  write_text(plain.dir / "report.json", old.dump(2) + "\n");
  const Ran malformed =
      kvaudit("verify_plain_malformed_checksum", "verify-report '" + plain.dir.string() + "'");
  CHECK(malformed.status == 2);
  CHECK_THAT(malformed.out, Catch::Contains((plain.dir / "report.json").string() +
                                            ": \"checksum\" is not {\"algorithm\": \"sha256\""));
  CHECK(std::count(malformed.out.begin(), malformed.out.end(), '\n') == 1);
}

TEST_CASE(
    "verify-report: a report re-signed with another key verifies only without the expected "
    "key",
    "[cli][signoff]") {
  // Someone edits a signed report and signs it again with a key of their own: every file and the
  // signature agree, so only the expected public key tells.
  const std::filesystem::path key = make_key("resigned_key");
  const std::filesystem::path forger_key = make_key("resigned_forger_key");
  const std::filesystem::path dir = fresh_dir("resigned");
  const std::string run = "check " + dataset("glm5_page1.h5") +
                          " --threads 2 --steps 0 --signoff --signed-by 'Ada Lovelace' --model "
                          "GLM-5 --report '" +
                          dir.string() + "' --signing-key ";
  REQUIRE(kvaudit("resigned_original", run + "'" + key.string() + "'").status == 0);
  REQUIRE(kvaudit("resigned_forged", run + "'" + forger_key.string() + "'").status == 0);
  CHECK(kvaudit("verify_resigned_any", "verify-report '" + dir.string() + "'").status == 0);
  const Ran expected =
      kvaudit("verify_resigned_expected",
              "verify-report '" + dir.string() + "' --public-key '" + key.string() + ".pub'");
  CHECK(expected.status == 1);
  CHECK_THAT(expected.out, Catch::Contains("not the expected"));
}

TEST_CASE("a report signed before kvaudit signed reports is refused as unsigned",
          "[cli][signoff]") {
  // The form of report.json's signoff block before signatures: a digest, no public key, no
  // manifest beside it. It proves nothing, so it does not verify.
  const std::filesystem::path dir = fresh_dir("old_signed");
  std::filesystem::create_directories(dir);
  const nlohmann::json old = {
      {"tool", "kvaudit"},
      {"verdict", "pass"},
      {"signoff",
       {{"signed_by", "Ada"},
        {"model", "GLM-5"},
        {"deployment", nullptr},
        {"digest", {{"algorithm", "sha256"}, {"value", std::string(64, '0')}}}}}};
  write_text(dir / "report.json", old.dump(2));
  const Ran ran = kvaudit("verify_old_signed", "verify-report '" + dir.string() + "'");
  CHECK(ran.status == 2);
  CHECK_THAT(ran.out, Catch::Contains("made before kvaudit signed reports"));
  CHECK(std::count(ran.out.begin(), ran.out.end(), '\n') == 1);
}

TEST_CASE("sign-off fields without --signoff are a usage error", "[cli][signoff]") {
  const Ran ran = kvaudit("signed_by_without_signoff",
                          "check " + dataset("glm5_page1.h5") + " --signed-by Ada");
  CHECK(ran.status == 2);
  CHECK_THAT(ran.out, Catch::Contains("--signed-by: needs --signoff"));
  const Ran key_only = kvaudit("signing_key_without_signoff",
                               "check " + dataset("glm5_page1.h5") + " --signing-key '" +
                                   make_key("key_without_signoff").string() + "'");
  CHECK(key_only.status == 2);
  CHECK_THAT(key_only.out, Catch::Contains("--signing-key: needs --signoff"));
}
