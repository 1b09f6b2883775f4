// Policy: hand-built metrics that pass or fail each limit, the exit rule per comparison, and
// policy-file parsing. Limit values below are written out from the derivations in policy.cpp
// (2^-8 = 0.00390625 ...), not read back from the code.
#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "kvaudit_test_config.hpp"  // KVAUDIT_BINARY, KVAUDIT_SOURCE_DIR, KVAUDIT_TEST_TMPDIR
#include "src/verdict/policy.hpp"

using kvaudit::Comparison;
using kvaudit::ComparisonMetrics;
using kvaudit::Judgement;
using kvaudit::Policy;

namespace {

std::filesystem::path test_dir(const std::string& name) {
#ifdef KVAUDIT_TEST_TMPDIR
  const std::filesystem::path base = KVAUDIT_TEST_TMPDIR;
#else
  const std::filesystem::path base = std::filesystem::temp_directory_path();
#endif
  const std::filesystem::path dir = base / ("kvaudit_test_policy_" + name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

std::filesystem::path write_file(const std::filesystem::path& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
  return path;
}

// A clean comparison: every error far below every limit, lse present.
ComparisonMetrics quiet_metrics() {
  ComparisonMetrics m;
  m.elements = 1024;
  m.finite_elements = 1024;
  m.reference_max_abs = 1.0;
  m.has_lse = true;
  return m;
}

bool mentions(const Judgement& judgement, const std::string& text) {
  for (const std::string& reason : judgement.reasons) {
    if (reason.find(text) != std::string::npos) return true;
  }
  return false;
}

}  // namespace

TEST_CASE("default policy passes the clean-kernel estimate", "[policy]") {
  // The derivation's clean estimate and the simulated worst clean case: rel_l2 ~ 2^-8.8 =
  // 0.0022, cos_diff ~ rel_l2^2 / 2, worst element 3.0e-3 of max|out|, lse error ~2^-12.8.
  ComparisonMetrics m = quiet_metrics();
  m.rel_l2 = 0.0022;
  m.cos_diff = 0.0022 * 0.0022 / 2;
  m.max_abs = 0.003;
  m.max_ulp_bf16 = 30000;  // not judged: near-zero outputs reach thousands of ULPs
  m.lse_max_abs = 0.00014;
  const Judgement judgement = kvaudit::judge(kvaudit::default_policy(), Comparison::kKernel, m);
  CHECK(judgement.pass);
  CHECK(judgement.reasons.empty());
}

TEST_CASE("kernel limits catch P rounded to e4m3 and a power-of-two kv_scale", "[policy]") {
  const Policy policy = kvaudit::default_policy();
  SECTION("P in e4m3, its mildest simulated case (sharp attention): rel_l2 2^-7.7") {
    ComparisonMetrics m = quiet_metrics();
    m.rel_l2 = 0.0048;
    m.cos_diff = 1.16e-5;
    m.max_abs = 0.0139;
    const Judgement judgement = kvaudit::judge(policy, Comparison::kKernel, m);
    CHECK_FALSE(judgement.pass);
    CHECK(mentions(judgement, "rel_l2 0.0048 > 0.00391 (kernel limit)"));
    CHECK(mentions(judgement, "cos_diff 1.16e-05 > 7.63e-06 (kernel limit)"));
    CHECK(mentions(judgement, "max_abs/ref_max 0.0139 > 0.00781 (kernel limit)"));
  }
  SECTION("P in e4m3, diffuse attention: rel_l2 2^-5.7") {
    ComparisonMetrics m = quiet_metrics();
    m.rel_l2 = 0.019;
    m.cos_diff = 1.8e-4;
    m.max_abs = 0.0166;
    CHECK_FALSE(kvaudit::judge(policy, Comparison::kKernel, m).pass);
  }
  SECTION("kv_scale rounded to a power of two: out off by up to sqrt(2), lse by O(|s|)") {
    ComparisonMetrics m = quiet_metrics();
    m.rel_l2 = 0.3;
    m.cos_diff = 0.04;
    m.max_abs = 0.35;
    m.lse_max_abs = 2.0;
    const Judgement judgement = kvaudit::judge(policy, Comparison::kKernel, m);
    CHECK_FALSE(judgement.pass);
    CHECK(judgement.reasons.size() == 4);
    CHECK(mentions(judgement, "max_abs/ref_max 0.35 > 0.00781"));
    CHECK(mentions(judgement, "lse_max_abs 2 > 0.000977"));
  }
}

TEST_CASE("each kernel limit on its own: just below passes, just above fails", "[policy]") {
  const Policy policy = kvaudit::default_policy();
  struct Case {
    const char* name;
    double limit;  // from the derivation
    void (*set)(ComparisonMetrics&, double);
  };
  const Case cases[] = {
      {"max_abs/ref_max", 0.0078125, [](ComparisonMetrics& m, double v) { m.max_abs = v; }},
      {"rel_l2", 0.00390625, [](ComparisonMetrics& m, double v) { m.rel_l2 = v; }},
      {"cos_diff", 7.62939453125e-06, [](ComparisonMetrics& m, double v) { m.cos_diff = v; }},
      {"lse_max_abs", 0.0009765625, [](ComparisonMetrics& m, double v) { m.lse_max_abs = v; }},
  };
  for (const Case& c : cases) {
    INFO(c.name);
    ComparisonMetrics at_limit = quiet_metrics();
    c.set(at_limit, c.limit);
    CHECK(kvaudit::judge(policy, Comparison::kKernel, at_limit).pass);
    ComparisonMetrics above = quiet_metrics();
    c.set(above, c.limit * 1.01);
    const Judgement judgement = kvaudit::judge(policy, Comparison::kKernel, above);
    CHECK_FALSE(judgement.pass);
    REQUIRE(judgement.reasons.size() == 1);
    CHECK(judgement.reasons[0].rfind(c.name, 0) == 0);
  }
}

TEST_CASE("max_abs against an all-zero reference fails - a NaN metric fails", "[policy]") {
  ComparisonMetrics m = quiet_metrics();
  m.reference_max_abs = 0.0;
  m.max_abs = 1e-30;
  CHECK_FALSE(kvaudit::judge(kvaudit::default_policy(), Comparison::kKernel, m).pass);
  ComparisonMetrics nan_metric = quiet_metrics();
  nan_metric.rel_l2 = std::numeric_limits<double>::quiet_NaN();
  CHECK_FALSE(kvaudit::judge(kvaudit::default_policy(), Comparison::kKernel, nan_metric).pass);
}

TEST_CASE("lse limit applies only when the comparison has lse", "[policy]") {
  ComparisonMetrics m = quiet_metrics();
  m.lse_max_abs = 1.0;
  m.has_lse = false;
  CHECK(kvaudit::judge(kvaudit::default_policy(), Comparison::kKernel, m).pass);
  m.has_lse = true;
  CHECK_FALSE(kvaudit::judge(kvaudit::default_policy(), Comparison::kKernel, m).pass);
}

TEST_CASE("a NaN/Inf mismatch fails first, with its location, whatever the norms", "[policy]") {
  ComparisonMetrics m = quiet_metrics();
  m.nonfinite_mismatches = 3;
  m.candidate_nonfinite = 3;
  m.first_nonfinite_mismatch = {7, 2, 100, 0.5, std::numeric_limits<double>::quiet_NaN()};
  m.rel_l2 = 0.5;  // also over the limit: reported after the NaN reason
  for (const Comparison comparison : {Comparison::kKernel, Comparison::kQuantization,
                                      Comparison::kTotal, Comparison::kCaptured}) {
    const Judgement judgement = kvaudit::judge(kvaudit::default_policy(), comparison, m);
    CHECK_FALSE(judgement.pass);
    REQUIRE(judgement.reasons.size() == 2);
    CHECK(judgement.reasons[0] ==
          "3 NaN/Inf mismatches, first at row 7 head 2 dim 100: NaN where the reference is 0.5");
    CHECK(judgement.reasons[1].rfind("rel_l2", 0) == 0);
  }
}

TEST_CASE("sign-off limits: quantization and total", "[policy]") {
  const Policy policy = kvaudit::signoff_policy();
  ComparisonMetrics typical = quiet_metrics();  // the derivation's expected ~2^-4.8 = 0.036
  typical.rel_l2 = 0.036;
  typical.cos_diff = 0.036 * 0.036 / 2;
  typical.max_abs = 0.15;
  typical.lse_max_abs = 0.1;
  CHECK(kvaudit::judge(policy, Comparison::kQuantization, typical).pass);
  // The same numbers would fail the kernel: quantization must not be judged as kernel error.
  CHECK_FALSE(kvaudit::judge(policy, Comparison::kKernel, typical).pass);

  ComparisonMetrics over = quiet_metrics();
  over.rel_l2 = 0.065;  // > 2^-4
  CHECK_FALSE(kvaudit::judge(policy, Comparison::kQuantization, over).pass);
  // Total allows 2^-4 + 2^-8 (1 + 2^-4) = 0.066650390625.
  CHECK(kvaudit::judge(policy, Comparison::kTotal, over).pass);
  over.rel_l2 = 0.0667;
  CHECK_FALSE(kvaudit::judge(policy, Comparison::kTotal, over).pass);
}

TEST_CASE("which comparisons set the exit status", "[policy]") {
  const Policy fallback = kvaudit::default_policy();
  CHECK(kvaudit::comparison_sets_exit(fallback, Comparison::kKernel));
  CHECK(kvaudit::comparison_sets_exit(fallback, Comparison::kCaptured));
  CHECK_FALSE(kvaudit::comparison_sets_exit(fallback, Comparison::kQuantization));
  CHECK_FALSE(kvaudit::comparison_sets_exit(fallback, Comparison::kTotal));
  const Policy signoff = kvaudit::signoff_policy();
  CHECK(signoff.name == "signoff");
  CHECK(kvaudit::comparison_sets_exit(signoff, Comparison::kQuantization));
  CHECK(kvaudit::comparison_sets_exit(signoff, Comparison::kTotal));
}

TEST_CASE("policy JSON carries every limit with its derivation", "[policy]") {
  const nlohmann::json j = kvaudit::to_json(kvaudit::default_policy());
  CHECK(j.at("name") == "default");
  CHECK(j.at("quantization_sets_exit") == false);
  CHECK(j.at("rel_floor").at("value") == 0.00390625);
  CHECK(j.at("kernel").at("rel_l2").at("limit") == 0.00390625);
  CHECK(j.at("kernel").at("max_ulp_bf16").at("limit").is_null());
  CHECK(j.at("quantization").at("rel_l2").at("limit") == 0.0625);
  for (const char* comparison : {"kernel", "captured", "quantization", "total"}) {
    for (const auto& [name, limit] : j.at(comparison).items()) {
      INFO(comparison << "." << name);
      CHECK_FALSE(limit.at("derivation").get<std::string>().empty());
    }
  }
}

TEST_CASE("a policy written by to_json loads back unchanged", "[policy]") {
  const std::filesystem::path dir = test_dir("round_trip");
  Policy original = kvaudit::signoff_policy();
  original.kernel.rel_l2 = 0.01;
  original.kernel.derivations[kvaudit::Limit::kRelL2] = "calibrated on 12 dumps";
  original.captured.lse_max_abs.reset();
  const auto path = write_file(dir / "mine.json", kvaudit::to_json(original).dump(2));
  const auto loaded = kvaudit::load_policy(path);
  REQUIRE(loaded.ok());
  CHECK(kvaudit::to_json(*loaded) == kvaudit::to_json(original));
  CHECK(loaded->name == "signoff");
  CHECK(loaded->quantization_sets_exit);
  CHECK(*loaded->kernel.rel_l2 == 0.01);
  CHECK_FALSE(loaded->captured.lse_max_abs.has_value());
}

TEST_CASE("a short policy file overrides the defaults it names", "[policy]") {
  const std::filesystem::path dir = test_dir("short");
  const auto path = write_file(dir / "strict.json",
                               R"({"kernel": {"rel_l2": 0.004, "lse_max_abs": null},
                                   "rel_floor": 0.001})");
  const auto loaded = kvaudit::load_policy(path);
  REQUIRE(loaded.ok());
  CHECK(loaded->name == "strict");  // the file's name when it has no "name"
  CHECK(*loaded->kernel.rel_l2 == 0.004);
  CHECK(loaded->kernel.derivations.at(kvaudit::Limit::kRelL2).find("strict.json") !=
        std::string::npos);
  CHECK_FALSE(loaded->kernel.lse_max_abs.has_value());
  CHECK(*loaded->kernel.cos_diff == 7.62939453125e-06);  // untouched default, 2^-17
  CHECK(loaded->rel_floor == 0.001);
  CHECK_FALSE(loaded->quantization_sets_exit);
}

TEST_CASE("policy file errors name the file and the key", "[policy]") {
  const std::filesystem::path dir = test_dir("errors");
  struct Case {
    const char* text;
    const char* where_suffix;  // the JSON pointer after "file:"
    const char* what;          // a fragment of the reason
  };
  const Case cases[] = {
      {R"({"kernal": {}})", ":/kernal", "unknown key"},
      {R"({"kernel": {"rel_l3": 0.1}})", ":/kernel/rel_l3", "unknown limit"},
      {R"({"kernel": {"rel_l2": "0.1"}})", ":/kernel/rel_l2", "expected a number, got string"},
      {R"({"kernel": {"rel_l2": -1}})", ":/kernel/rel_l2", ">= 0"},
      {R"({"kernel": {"rel_l2": {"limit": true}}})", ":/kernel/rel_l2/limit", "got boolean"},
      {R"({"kernel": {"rel_l2": {"limit": 0.1, "why": "x"}}})", ":/kernel/rel_l2/why",
       "unknown key"},
      {R"({"kernel": {"rel_l2": {"derivation": "x"}}})", ":/kernel/rel_l2", "missing key limit"},
      {R"({"kernel": [1]})", ":/kernel", "expected an object"},
      {R"({"quantization_sets_exit": 1})", ":/quantization_sets_exit", "expected true or false"},
      {R"({"name": 5})", ":/name", "expected a string"},
      {R"({"rel_floor": {"value": "a"}})", ":/rel_floor/value", "expected a number"},
      {R"([1, 2])", ":/", "expected a JSON object"},
  };
  int index = 0;
  for (const Case& c : cases) {
    INFO(c.text);
    const auto path = write_file(dir / ("p" + std::to_string(index++) + ".json"), c.text);
    const auto loaded = kvaudit::load_policy(path);
    REQUIRE_FALSE(loaded.ok());
    CHECK(loaded.error().kind == kvaudit::ErrorKind::kBadInput);
    CHECK(loaded.error().where == path.string() + c.where_suffix);
    CHECK(loaded.error().what.find(c.what) != std::string::npos);
  }
  const auto broken = kvaudit::load_policy(write_file(dir / "broken.json", "{\"kernel\": "));
  REQUIRE_FALSE(broken.ok());
  CHECK(broken.error().where == (dir / "broken.json").string());
  CHECK(broken.error().what.find("not valid JSON") != std::string::npos);
  const auto missing = kvaudit::load_policy(dir / "absent.json");
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.error().what.find("cannot open") != std::string::npos);
}

TEST_CASE("default policy: every limit of every comparison, written out", "[policy]") {
  using kvaudit::Limit;
  struct Row {
    Comparison comparison;
    double max_abs_over_ref_max, rel_l2, cos_diff, lse_max_abs;
  };
  // total: quantization + kernel * (1 + quantization); lse: quantization + kernel.
  const Row rows[] = {
      {Comparison::kKernel, 0.0078125, 0.00390625, 7.62939453125e-06, 0.0009765625},
      {Comparison::kCache, 0.0, 0.0, 0.0, 0.0},
      {Comparison::kCaptured, 0.0625, 0.03125, 0.00048828125, 0.25},
      {Comparison::kQuantization, 0.25, 0.0625, 0.001953125, 0.25},
      {Comparison::kTotal, 0.259765625, 0.066650390625, 0.066650390625 * 0.066650390625 / 2,
       0.2509765625},
  };
  const Policy policy = kvaudit::default_policy();
  for (const Row& row : rows) {
    INFO(kvaudit::comparison_name(row.comparison));
    const kvaudit::ComparisonLimits& limits = kvaudit::limits_for(policy, row.comparison);
    CHECK(limits.max_abs_over_ref_max == row.max_abs_over_ref_max);
    CHECK(limits.rel_l2 == row.rel_l2);
    CHECK(limits.cos_diff == row.cos_diff);
    CHECK_FALSE(limits.max_ulp_bf16.has_value());
    CHECK(limits.lse_max_abs == row.lse_max_abs);
    CHECK(limits.derivations.size() == 5);  // every limit says where it comes from
  }
  CHECK(policy.kernel.derivations.at(Limit::kRelL2).rfind("2^-8: 2x the clean estimate", 0) == 0);
  CHECK(policy.cache.derivations.at(Limit::kMaxUlpBf16) ==
        "none: implied by the other limits being zero");
}

TEST_CASE("limit names are the keys of report.json and policy files, in report order", "[policy]") {
  std::vector<std::string> names;
  for (const kvaudit::Limit limit : kvaudit::all_limits()) {
    names.push_back(kvaudit::limit_name(limit));
  }
  CHECK(names == std::vector<std::string>{"max_abs_over_ref_max", "rel_l2", "cos_diff",
                                          "max_ulp_bf16", "lse_max_abs"});
}

TEST_CASE("captured_read and captured_cache: the captured and cache limits, report-only",
          "[policy]") {
  const Policy policy = kvaudit::default_policy();
  // No policy keys of their own: they borrow the captured and the cache limit sets.
  CHECK(&kvaudit::limits_for(policy, Comparison::kCapturedRead) == &policy.captured);
  CHECK(&kvaudit::limits_for(policy, Comparison::kCapturedCache) == &policy.cache);
  CHECK(kvaudit::comparison_name(Comparison::kCapturedRead) == std::string("captured_read"));
  CHECK(kvaudit::comparison_name(Comparison::kCapturedCache) == std::string("captured_cache"));
  CHECK(kvaudit::all_comparisons().size() == 5);
  CHECK(kvaudit::to_json(policy).count("captured_read") == 0);
  CHECK_FALSE(kvaudit::comparison_sets_exit(policy, Comparison::kCapturedRead));
  CHECK_FALSE(kvaudit::comparison_sets_exit(kvaudit::signoff_policy(), Comparison::kCapturedCache));
  ComparisonMetrics m = quiet_metrics();
  m.rel_l2 = 0.02;  // within 2^-5 (captured), not within 0 (cache)
  CHECK(kvaudit::judge(policy, Comparison::kCapturedRead, m).pass);
  const Judgement cache = kvaudit::judge(policy, Comparison::kCapturedCache, m);
  CHECK_FALSE(cache.pass);
  CHECK(mentions(cache, "rel_l2 0.02 > 0 (captured_cache limit)"));
}

TEST_CASE("judge_hypothesis: explains when the failing comparison passes against it",
          "[policy][diagnosis]") {
  const Policy policy = kvaudit::default_policy();
  ComparisonMetrics before = quiet_metrics();
  before.rel_l2 = 0.3;  // a wrong scale
  before.lse_max_abs = 2.0;
  ComparisonMetrics after = quiet_metrics();
  after.rel_l2 = 0.0018;  // a clean kernel's level
  after.max_abs = 0.003;
  after.lse_max_abs = 2e-6;

  const kvaudit::HypothesisJudgement explains =
      kvaudit::judge_hypothesis(policy, Comparison::kKernel, before, after, 10.0);
  CHECK(explains.explains);
  CHECK(explains.reasons.empty());
  // Largest ratio to its limit: rel_l2 0.0018 / 2^-8 = 0.4608 (max_abs/ref_max 0.003 / 2^-7 =
  // 0.384, lse 2e-6 / 2^-10).
  CHECK(explains.excess == Approx(0.4608));

  // Nothing failed: nothing to explain.
  const kvaudit::HypothesisJudgement nothing =
      kvaudit::judge_hypothesis(policy, Comparison::kKernel, after, after, 10.0);
  CHECK_FALSE(nothing.explains);

  // Still past a limit: rel_l2 2^-7 = 2x the kernel's 2^-8.
  ComparisonMetrics still = after;
  still.rel_l2 = 0.0078125;
  const kvaudit::HypothesisJudgement no =
      kvaudit::judge_hypothesis(policy, Comparison::kKernel, before, still, 10.0);
  CHECK_FALSE(no.explains);
  CHECK(no.excess == Approx(2.0));
  REQUIRE(no.reasons.size() == 1);
  CHECK(no.reasons[0] == "rel_l2 0.00781 > 0.00391 (kernel limit)");

  // A NaN/Inf mismatch never explains, and is no approach at all.
  ComparisonMetrics nan = after;
  nan.nonfinite_mismatches = 1;
  const kvaudit::HypothesisJudgement with_nan =
      kvaudit::judge_hypothesis(policy, Comparison::kKernel, before, nan, 10.0);
  CHECK_FALSE(with_nan.explains);
  CHECK(with_nan.excess == std::numeric_limits<double>::infinity());
}

TEST_CASE("judge_hypothesis: the lse limit follows the hypothesis's lse past 2^7",
          "[policy][diagnosis]") {
  const Policy policy = kvaudit::default_policy();
  ComparisonMetrics before = quiet_metrics();
  before.rel_l2 = 100.0;
  before.lse_max_abs = 1e5;
  ComparisonMetrics after = quiet_metrics();
  after.rel_l2 = 0.002;
  after.lse_max_abs = 0.03;  // fp32 lse of ~1e5 is off by ~2^-24 * 1e5 = 0.006 by itself
  // |lse| up to 1.2e5: the kernel's 2^-10 becomes 2^-10 * 1.2e5 / 128 = 0.916.
  const kvaudit::HypothesisJudgement large =
      kvaudit::judge_hypothesis(policy, Comparison::kKernel, before, after, 1.2e5);
  CHECK(large.explains);
  // rel_l2 0.002 / 2^-8 = 0.512 is now the largest ratio (lse: 0.03 / 0.916 = 0.033).
  CHECK(large.excess == Approx(0.512));
  // Within the range the limit was derived for (|lse| <= 128) it stays 2^-10.
  const kvaudit::HypothesisJudgement small =
      kvaudit::judge_hypothesis(policy, Comparison::kKernel, before, after, 100.0);
  CHECK_FALSE(small.explains);
  REQUIRE(small.reasons.size() == 1);
  CHECK(small.reasons[0] == "lse_max_abs 0.03 > 0.000977 (kernel limit)");
  // A widened limit says so in its reason.
  after.lse_max_abs = 2.0;
  const kvaudit::HypothesisJudgement past =
      kvaudit::judge_hypothesis(policy, Comparison::kKernel, before, after, 1.2e5);
  CHECK_FALSE(past.explains);
  REQUIRE(past.reasons.size() == 1);
  CHECK(past.reasons[0] ==
        "lse_max_abs 2 > 0.916 (kernel limit; lse limit x938 for |lse| up to 1.2e+05)");
}

TEST_CASE(
    "judge_hypothesis: nothing finite compared is no fraction, unless the replay "
    "reproduces the candidate's NaN/Inf",
    "[policy][diagnosis]") {
  const Policy policy = kvaudit::default_policy();
  // The candidate fails only on NaN/Inf mismatches: every finite metric is clean.
  ComparisonMetrics before = quiet_metrics();
  before.rel_l2 = 0.0018;
  before.nonfinite_mismatches = 3;
  ComparisonMetrics after = quiet_metrics();
  after.rel_l2 = 0.0018;
  // The replay leaves the mismatches where they were (the same NaN/Inf against it as against the
  // reference): no fraction, not within, not closest.
  ComparisonMetrics unreproduced = after;
  unreproduced.nonfinite_mismatches = 3;
  const kvaudit::HypothesisJudgement left =
      kvaudit::judge_hypothesis(policy, Comparison::kKernel, before, unreproduced, 10.0);
  CHECK_FALSE(left.within_fraction);
  CHECK_FALSE(left.explains);
  // A finite failing metric that is not finite: rel_l2 NaN, nothing else fails.
  ComparisonMetrics nan_metric = quiet_metrics();
  nan_metric.rel_l2 = std::numeric_limits<double>::quiet_NaN();
  const kvaudit::HypothesisJudgement unknown =
      kvaudit::judge_hypothesis(policy, Comparison::kKernel, nan_metric, after, 10.0);
  CHECK(std::isnan(unknown.fraction));
  CHECK_FALSE(unknown.within_fraction);
  CHECK_FALSE(unknown.explains);
  CHECK(mentions(Judgement{false, unknown.reasons}, "nothing finite was compared"));
  // The replay reproduces every NaN/Inf of the candidate (none left against it): it explains.
  const kvaudit::HypothesisJudgement reproduced =
      kvaudit::judge_hypothesis(policy, Comparison::kKernel, before, after, 10.0);
  CHECK(reproduced.fraction == 0.0);
  CHECK(reproduced.within_fraction);
  CHECK(reproduced.explains);
}
