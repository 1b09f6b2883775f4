// `kvaudit check --shard I/N` and `kvaudit merge` end to end on every shipped dump: for N = 1..5
// (5 is more shards than any shipped dump has layers: empty parts) the merged report equals the
// unsharded one in everything but timing, provenance and the dump's path (verdict, counts,
// results in order, integrity findings, steps, notes, first divergence), with a backend, without
// one (captured comparisons only) and with fault injections whose first divergence, integrity
// failures and notes the merge must reproduce. Then the refusals: exit 2 naming the part.
#include <algorithm>
#include <catch2/catch.hpp>
#include <fstream>
#include <string>
#include <vector>

#include "tests/cli/shard_commands.hpp"

namespace kvaudit_test {
namespace {

struct Variant {
  const char* name;
  const char* arguments;
};

// A clean run, one with a note about the whole run (which the merged report holds once), no
// backend, a write fault (integrity findings, cache error) and a read fault (kernel divergence at
// a named row and head), a diagnosis limited to one site and a sign-off.
constexpr Variant kVariants[] = {
    {"cpu-fp8", "--backend cpu-fp8"},
    {"reciprocal", "--backend cpu-fp8 --reciprocal-scale"},
    {"none", "--backend none"},
    {"bf16-writeback", "--backend cpu-fp8 --inject bf16-writeback"},
    {"scale-mismatch", "--backend cpu-fp8 --inject scale-mismatch"},
    // Every layer fails at step 0: the diagnosis budget (1 site) spans the parts, and its note.
    {"diagnose-1", "--backend cpu-fp8 --inject scale-mismatch --diagnose 1"},
    // A sign-off: its fields, key and checksum, coverage and the unmeasured sites.
    {"signoff", "--backend cpu-fp8 --signoff --signed-by 'A. Reviewer' --model GLM-5"},
};

bool is_signoff(const Variant& variant) { return std::string(variant.name) == "signoff"; }

// The variant's check options; a sign-off's with the test key.
std::string check_arguments(const Variant& variant) {
  return std::string(variant.arguments) + (is_signoff(variant) ? signing_key_option() : "");
}

std::filesystem::path scratch(const std::string& name) {
  const std::filesystem::path dir = test_tmpdir() / "merge" / name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// The N parts of a check, written to DIR/part-I.json; returns their paths, quoted, shard order.
std::string check_in_parts(const std::string& dump, const Variant& variant, int count,
                           const std::filesystem::path& dir) {
  std::string parts;
  for (int index = 0; index < count; ++index) {
    const auto part = dir / ("part-" + std::to_string(index) + ".json");
    const CommandOutcome outcome =
        run_kvaudit(dir.filename().string() + "-" + std::to_string(index),
                    "check " + shipped_dump(dump) + " " + check_arguments(variant) +
                        " --threads 2 --shard " + std::to_string(index) + "/" +
                        std::to_string(count) + " --json '" + part.string() + "'");
    INFO(outcome.out << outcome.err);
    REQUIRE((outcome.status == 0 || outcome.status == 1));
    parts += " '" + part.string() + "'";
  }
  return parts;
}

void require_merge_equals_unsharded(const std::string& dump) {
  for (const Variant& variant : kVariants) {
    const std::filesystem::path dir = scratch(dump + "-" + variant.name);
    // A sign-off writes (and signs) a report directory; merging one needs it and the key.
    const std::string whole_report =
        is_signoff(variant) ? " --report '" + (dir / "whole").string() + "'" : "";
    const CommandOutcome whole = run_kvaudit(
        dump + "-" + variant.name + "-whole",
        "check " + shipped_dump(dump) + " " + check_arguments(variant) + " --threads 2 --json '" +
            (dir / "whole.json").string() + "'" + whole_report);
    REQUIRE((whole.status == 0 || whole.status == 1));
    const nlohmann::json unsharded = read_json(dir / "whole.json");
    for (int count = 1; count <= 5; ++count) {
      const std::filesystem::path parts_dir =
          scratch(dump + "-" + variant.name + "-" + std::to_string(count));
      const std::string parts = check_in_parts(dump, variant, count, parts_dir);
      const auto merged_path = parts_dir / "merged.json";
      const auto merged_report = parts_dir / "merged";
      const std::string signed_report =
          is_signoff(variant) ? " --report '" + merged_report.string() + "'" + signing_key_option()
                              : "";
      const CommandOutcome merged =
          run_kvaudit(parts_dir.filename().string() + "-merge",
                      "merge" + parts + " --json '" + merged_path.string() + "'" + signed_report);
      INFO(dump << " " << variant.name << " in " << count << " parts: " << merged.out
                << merged.err);
      CHECK(merged.status == whole.status);
      const nlohmann::json report = read_json(merged_path);
      CHECK(differing_keys(unsharded, report) == std::vector<std::string>{});
      CHECK(report.at("provenance").at("merged_from").size() == static_cast<std::size_t>(count));
      if (report.at("signoff").is_object()) {  // the merged report directory is signed
        const CommandOutcome verified =
            run_kvaudit(parts_dir.filename().string() + "-verify",
                        "verify-report '" + merged_report.string() + "'");
        INFO(verified.out << verified.err);
        CHECK(verified.status == 0);
      }
    }
  }
}

}  // namespace

TEST_CASE("kvaudit merge of 1..5 shards equals the unsharded check: glm5_page1", "[cli][merge]") {
  require_merge_equals_unsharded("glm5_page1");
}

TEST_CASE("kvaudit merge of 1..5 shards equals the unsharded check: page64_nan", "[cli][merge]") {
  require_merge_equals_unsharded("page64_nan");
}

TEST_CASE("kvaudit merge of 1..5 shards equals the unsharded check: saturated_page16",
          "[cli][merge]") {
  require_merge_equals_unsharded("saturated_page16");
}

TEST_CASE("kvaudit merge: the first divergence is the earliest over all parts", "[cli][merge]") {
  // scale-mismatch fails every layer's kernel comparison at step 0 (docs/design.md "Failure
  // modes"): the run's first divergence is layer 0's, which only part 0 of 3 holds; part 2's
  // own first divergence is layer 77's.
  const std::filesystem::path dir = scratch("divergence");
  const Variant variant = kVariants[4];  // scale-mismatch
  const std::string parts = check_in_parts("glm5_page1", variant, 3, dir);
  const nlohmann::json last_part = read_json(dir / "part-2.json");
  REQUIRE(last_part.at("first_divergence").is_object());
  CHECK(last_part.at("first_divergence").at("layer_id") == 77);
  const CommandOutcome merged = run_kvaudit(
      "divergence-merge", "merge" + parts + " --json '" + (dir / "merged.json").string() + "'");
  CHECK(merged.status == 1);
  const nlohmann::json report = read_json(dir / "merged.json");
  CHECK(report.at("first_divergence").at("step") == 0);
  CHECK(report.at("first_divergence").at("layer_id") == 0);
  CHECK(report.at("first_divergence").at("comparison") == "kernel");
}

TEST_CASE("kvaudit merge refuses parts that are not one run, exit 2 naming the part",
          "[cli][merge]") {
  const std::filesystem::path dir = scratch("refusals");
  auto part = [&](const std::string& name, const std::string& dump, const std::string& options) {
    const auto path = dir / (name + ".json");
    const CommandOutcome outcome =
        run_kvaudit("refusal-" + name, "check " + shipped_dump(dump) + " --threads 2 " + options +
                                           " --json '" + path.string() + "'");
    INFO(outcome.out << outcome.err);
    REQUIRE((outcome.status == 0 || outcome.status == 1));
    return "'" + path.string() + "'";
  };
  const std::string p0 = part("p0", "glm5_page1", "--shard 0/2");
  const std::string p1 = part("p1", "glm5_page1", "--shard 1/2");
  struct Case {
    const char* name;
    std::string parts;
    std::vector<std::string> says;
  };
  const std::vector<Case> cases = {
      {"other dump",
       p0 + " " + part("q1", "page64_nan", "--shard 1/2"),
       {"q1.json", "SHA-256", "p0.json"}},
      {"other backend",
       p0 + " " + part("none1", "glm5_page1", "--backend none --shard 1/2"),
       {"none1.json", "backend"}},
      {"other policy",
       p0 + " " +
           part("signoff1", "glm5_page1",
                "--signoff --signed-by A --model M" + signing_key_option() + " --shard 1/2"),
       {"signoff1.json", "policy"}},
      {"other injection",
       p0 + " " + part("inject1", "glm5_page1", "--inject scale-mismatch --shard 1/2"),
       {"inject1.json", "backend"}},
      {"other selection",
       p0 + " " + part("steps1", "glm5_page1", "--steps 0-1 --shard 1/2"),
       {"steps1.json", "--steps"}},
      {"other count",
       p0 + " " + part("of3", "glm5_page1", "--shard 1/3"),
       {"of3.json", "shard count"}},
      {"overlap",
       p0 + " " + p1 + " " + part("p1again", "glm5_page1", "--shard 1/2"),
       {"p1again.json", "shard 1/2", "p1.json"}},
      {"missing", p1, {"missing shard 0/2", "p1.json"}},
      {"no part", p0 + " " + part("whole", "glm5_page1", ""), {"whole.json", "not a shard part"}},
  };
  for (const Case& c : cases) {
    const CommandOutcome outcome = run_kvaudit("refusal-merge", "merge " + c.parts);
    INFO(c.name << ": " << outcome.out << outcome.err);
    CHECK(outcome.status == 2);
    for (const std::string& text : c.says) CHECK_THAT(outcome.err, Catch::Contains(text));
    CHECK(std::count(outcome.err.begin(), outcome.err.end(), '\n') == 1);
  }
  const CommandOutcome both = run_kvaudit("refusal-good", "merge " + p0 + " " + p1);
  CHECK(both.status == 0);
}

TEST_CASE("kvaudit merge of sign-off parts signs with their key, and refuses to without it",
          "[cli][merge][signoff]") {
  const std::filesystem::path dir = scratch("signed_parts");
  const std::string signoff = " --signoff --signed-by A --model M" + signing_key_option();
  std::string parts;
  for (int index = 0; index < 2; ++index) {
    const auto path = dir / ("part-" + std::to_string(index) + ".json");
    const CommandOutcome outcome =
        run_kvaudit("signed-part-" + std::to_string(index),
                    "check " + shipped_dump("glm5_page1") + " --threads 2 --steps 0" + signoff +
                        " --shard " + std::to_string(index) + "/2 --json '" + path.string() + "'");
    INFO(outcome.out << outcome.err);
    REQUIRE((outcome.status == 0 || outcome.status == 1));
    parts += " '" + path.string() + "'";
  }
  const std::string report = " --report '" + (dir / "merged").string() + "'";
  // Without the key or without a report directory: refused, one line, nothing written.
  for (const std::string& options : {report, signing_key_option()}) {
    const CommandOutcome refused = run_kvaudit("signed-merge-refused", "merge" + parts + options);
    INFO(refused.out << refused.err);
    CHECK(refused.status == 2);
    CHECK_THAT(refused.err, Catch::StartsWith("kvaudit: merge: the parts are a sign-off: needs "
                                              "--signing-key FILE and --report DIR"));
    CHECK(std::count(refused.err.begin(), refused.err.end(), '\n') == 1);
    CHECK_FALSE(std::filesystem::exists(dir / "merged"));
  }
  // Another key than the parts name: refused, naming both public keys.
  const std::filesystem::path other = dir / "other-key";
  REQUIRE(run_kvaudit("signed-merge-keygen", "keygen --out '" + other.string() + "'").status == 0);
  const CommandOutcome wrong_key =
      run_kvaudit("signed-merge-wrong-key",
                  "merge" + parts + report + " --signing-key '" + other.string() + "'");
  CHECK(wrong_key.status == 2);
  CHECK_THAT(wrong_key.err, Catch::Contains("is not the one the parts name"));
  CHECK_FALSE(std::filesystem::exists(dir / "merged"));
  // Parts edited to drop the signer, the model or the public key: refused, as check refuses a
  // sign-off without them (the parts are plain JSON anyone can write).
  for (const char* field : {"signed_by", "model", "public_key"}) {
    std::string edited_parts;
    for (int index = 0; index < 2; ++index) {
      nlohmann::json part = read_json(dir / ("part-" + std::to_string(index) + ".json"));
      REQUIRE(part.at("signoff").contains(field));
      if (std::string(field) == "public_key") {
        part["signoff"].erase(field);  // as in a part from before signatures
      } else {
        part["signoff"][field] = nullptr;
      }
      const auto path = dir / ("edited-" + std::to_string(index) + ".json");
      std::ofstream(path) << part.dump();
      edited_parts += " '" + path.string() + "'";
    }
    const CommandOutcome unsigned_parts =
        run_kvaudit("signed-merge-no-" + std::string(field),
                    "merge" + edited_parts + report + signing_key_option());
    INFO(field << ": " << unsigned_parts.out << unsigned_parts.err);
    CHECK(unsigned_parts.status == 2);
    CHECK_THAT(unsigned_parts.err, Catch::Contains("the parts are a sign-off without"));
    CHECK_FALSE(std::filesystem::exists(dir / "merged"));
  }
  // With the parts' key: a signed report directory that verifies.
  const CommandOutcome merged =
      run_kvaudit("signed-merge", "merge" + parts + report + signing_key_option());
  INFO(merged.out << merged.err);
  REQUIRE(merged.status == 0);
  const CommandOutcome verified =
      run_kvaudit("signed-merge-verify", "verify-report '" + (dir / "merged").string() + "'");
  INFO(verified.out << verified.err);
  CHECK(verified.status == 0);
}

}  // namespace kvaudit_test
