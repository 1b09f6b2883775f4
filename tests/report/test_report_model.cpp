// The report model (src/verdict/report_model.hpp): what it derives once is what the verdict
// functions say, report.json is its JSON, and the renderings state the digest report.json holds.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>
#include <string>

#include "src/report/report.hpp"
#include "src/report/report_html.hpp"
#include "src/verdict/report_digest.hpp"
#include "src/verdict/report_model.hpp"
#include "tests/verdict/check_run_fixture.hpp"

namespace {

kvaudit::CheckRun signed_run() {
  kvaudit::CheckRun run = kvaudit::testing::make_failing_run();
  run.signoff = kvaudit::SignOff{"Ada Lovelace", "GLM-5", ""};
  return run;
}

}  // namespace

TEST_CASE("the report model derives what the verdict functions say, once", "[report_model]") {
  const kvaudit::CheckRun run = signed_run();
  const kvaudit::ReportModel model = kvaudit::make_report_model(run);
  CHECK(model.pass == run.pass());
  CHECK(model.counts.comparisons == kvaudit::count_results(run).comparisons);
  CHECK(model.counts.failed == kvaudit::count_results(run).failed);
  CHECK(model.counts.integrity_failed == kvaudit::count_results(run).integrity_failed);
  CHECK(model.steps.size() == kvaudit::summarize_steps(run).size());
  CHECK(model.unmeasured.size() == kvaudit::measurement_gaps(run).size());
  CHECK(model.captured_pool_cost.has_value() == kvaudit::captured_pool_cost(run).has_value());
  CHECK(kvaudit::is_complete(model.run.provenance));
}

TEST_CASE("report.json is the model's JSON, and its digest covers it", "[report_model]") {
  const kvaudit::CheckRun run = signed_run();  // its provenance is complete: nothing filled in
  const kvaudit::ReportModel model = kvaudit::make_report_model(run);
  const nlohmann::json j = kvaudit::to_json(model);
  CHECK(j == kvaudit::to_json(run));
  REQUIRE(model.signoff.has_value());
  CHECK(model.signoff->signer.signed_by == "Ada Lovelace");
  CHECK(model.signoff->digest.value == kvaudit::report_digest(j));
  CHECK(j.at("signoff").at("digest").at("value") == model.signoff->digest.value);
  CHECK(kvaudit::report_json_text(j) == j.dump(2) + "\n");
}

TEST_CASE("report.md and report.html state the model's digest", "[report_model]") {
  const kvaudit::ReportModel model = kvaudit::make_report_model(signed_run());
  REQUIRE(model.signoff.has_value());
  const std::string& digest = model.signoff->digest.value;
  CHECK(kvaudit::render_markdown(model).find(digest) != std::string::npos);
  CHECK(kvaudit::render_html(model).find(digest) != std::string::npos);
  // The run's overloads make the same model: the same pages.
  CHECK(kvaudit::render_markdown(signed_run()) == kvaudit::render_markdown(model));
  CHECK(kvaudit::render_html(signed_run()) == kvaudit::render_html(model));
}

TEST_CASE("a plain report's model holds its checksum, which report.md and report.html state",
          "[report_model][checksum]") {
  const kvaudit::ReportModel model =
      kvaudit::make_report_model(kvaudit::testing::make_failing_run());
  REQUIRE_FALSE(model.signoff.has_value());
  REQUIRE(model.checksum.has_value());
  const nlohmann::json j = kvaudit::to_json(model);
  CHECK(j.at("checksum").at("value") == model.checksum->value);
  CHECK(kvaudit::report_digest(j) == model.checksum->value);
  for (const std::string& page : {kvaudit::render_markdown(model), kvaudit::render_html(model)}) {
    CHECK_THAT(page, Catch::Contains(model.checksum->value));
    CHECK_THAT(page, Catch::Contains("a checksum, not a signature"));
  }
  // A sign-off's checksum is its signoff block's digest; no second one at the top level.
  const kvaudit::ReportModel signed_model = kvaudit::make_report_model(signed_run());
  CHECK_FALSE(signed_model.checksum.has_value());
  CHECK_FALSE(kvaudit::to_json(signed_model).contains("checksum"));
}
