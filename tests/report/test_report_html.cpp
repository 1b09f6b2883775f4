// report.html and the new parts of report.md, on a hand-built run
// (tests/verdict/check_run_fixture.hpp), and the SVG primitives they use. Counts and strings are
// written out here from the fixture's numbers; tests/report/test_report_browser.cpp checks the
// page as a browser draws it.
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>

#include "kvaudit_test_config.hpp"  // KVAUDIT_TEST_TMPDIR
#include "src/report/report.hpp"
#include "src/report/report_html.hpp"
#include "src/report/svg_chart.hpp"
#include "src/verdict/check_result.hpp"
#include "tests/verdict/check_run_fixture.hpp"

using kvaudit::CheckRun;
using kvaudit::testing::make_failing_run;

namespace {

std::size_t count(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (std::size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) {
    ++n;
  }
  return n;
}

// The fixture with what the replay records per step-layer: layer 3 read saturated codes.
CheckRun run_with_coverage() {
  CheckRun run = make_failing_run();
  run.coverage = {{0, 0, 40, 0, 23040, 0}, {1, 3, 50, 0, 28800, 123}};
  return run;
}

}  // namespace

TEST_CASE("xml_escape: markup characters escaped, invalid UTF-8 replaced", "[report_html]") {
  CHECK(kvaudit::xml_escape("a<b>&\"c'") == "a&lt;b&gt;&amp;&quot;c&#39;");
  CHECK(kvaudit::xml_escape("caf\xC3\xA9") == "caf\xC3\xA9");  // valid UTF-8 kept
  CHECK(kvaudit::xml_escape("x\xFFy") == "x\xEF\xBF\xBDy");    // a stray byte
  CHECK(kvaudit::xml_escape(std::string("a\x01z")) == "a z");  // a control character
}

TEST_CASE("log axis: decades onto pixels, values clamped, zero at the bottom", "[report_html]") {
  const kvaudit::LogAxis axis{-4, 0, 100.0, 0.0};
  CHECK(axis.pixel(1e-3) == Approx(75.0));
  CHECK(axis.pixel(1.0) == Approx(0.0));
  CHECK(axis.pixel(10.0) == Approx(0.0));
  CHECK(axis.pixel(1e-9) == Approx(100.0));
  CHECK(axis.pixel(0.0) == Approx(100.0));
  const kvaudit::LogAxis fitted = kvaudit::LogAxis::fitting({0.0, 0.0019, 0.031, 0.0625}, 1, 0);
  CHECK(fitted.low_exp == -3);
  CHECK(fitted.high_exp == -1);
}

TEST_CASE("heat colour: white for 0, red at the limit, blue below it", "[report_html]") {
  CHECK(kvaudit::heat_colour(0.0, 0.0039) == "#ffffff");
  CHECK(kvaudit::heat_colour(0.0039, 0.0039) == "#cb181d");
  CHECK(kvaudit::heat_colour(0.5, 0.0625) == "#cb181d");
  CHECK(kvaudit::heat_colour(1e-9, 0.0) == "#cb181d");          // any cache error against limit 0
  CHECK(kvaudit::heat_colour(0.0039e-3, 0.0039) == "#eff3ff");  // 1/1000 of the limit: palest
  CHECK(kvaudit::heat_colour(0.0038999, 0.0039) == "#08519c");  // just under: deepest blue
}

TEST_CASE("heat colour: linear in value / limit, so the headroom to the limit shows",
          "[report_html]") {
  // pale #eff3ff at 0, deep #08519c at the limit, each channel mixed linearly and rounded:
  // half the limit is (0xef + 0x08) / 2 = 123.5 -> 0x7c, (0xf3 + 0x51) / 2 = 162 -> 0xa2,
  // (0xff + 0x9c) / 2 = 205.5 -> 0xce; a tenth is 239 - 23.1 -> 0xd8, 243 - 16.2 -> 0xe3,
  // 255 - 9.9 -> 0xf5.
  CHECK(kvaudit::heat_colour(0.0039 / 2, 0.0039) == "#7ca2ce");
  CHECK(kvaudit::heat_colour(0.0039 / 10, 0.0039) == "#d8e3f5");
}

TEST_CASE("heatmap: one cell per (row, column), unmeasured ones hatched", "[report_html]") {
  kvaudit::Heatmap map;
  map.id = "kernel";
  map.limit = 0.0039;
  map.row_labels = {"L0", "L1", "L2"};
  map.column_labels = {"0", "1"};
  map.cells.assign(3, std::vector<kvaudit::HeatCell>(2, {true, 0.002, false, "tip"}));
  map.cells[2][1] = {};
  const std::string svg = kvaudit::heatmap_svg(map);
  CHECK(count(svg, "class=\"heat-cell") == 6);
  CHECK(count(svg, "class=\"heat-cell unmeasured\"") == 1);
  CHECK(svg.find("url(#hatch-kernel)") != std::string::npos);
}

TEST_CASE("report.html: self-contained, every heatmap cell drawn, strings escaped",
          "[report_html]") {
  CheckRun run = run_with_coverage();
  run.dump_summary["model"] = "<script>alert(1)</script>";
  const std::string html = kvaudit::render_html(run);
  CHECK(html.rfind("<!DOCTYPE html>\n<html lang=\"en\">", 0) == 0);
  // 2 layers (0, 3) x 2 steps (0, 1) x 4 comparisons.
  CHECK(count(html, "class=\"heat-cell") == 16);
  CHECK(count(html, "<svg ") == 7);  // 4 heatmaps, per layer, across steps, integrity timeline
  CHECK(count(html, "class=\"timeline-cell\"") == 4);  // 2 layers x 2 steps, backend pool
  CHECK(html.find("<script") == std::string::npos);
  CHECK(html.find("&lt;script&gt;alert(1)&lt;/script&gt;") != std::string::npos);
  // Nothing fetched: the only URL is the SVG namespace name, which is never requested.
  const std::regex url("(https?:)?//[A-Za-z0-9.-]+\\.[a-z]+");
  const std::string without_namespace =
      std::regex_replace(html, std::regex("xmlns=\"http://www.w3.org/2000/svg\""), "");
  CHECK_FALSE(std::regex_search(without_namespace, url));
  CHECK(html.find("<link") == std::string::npos);
  CHECK(html.find("@import") == std::string::npos);
  CHECK(count(html, "url(") == count(html, "url(#"));
  CHECK(html.find("<h1>FAIL</h1>") != std::string::npos);
  CHECK(html.find("backend vs R8\u2032") != std::string::npos);
}

TEST_CASE("report.html and report.md: sign-off block with the public key and the checksum",
          "[report_html]") {
  CheckRun run = run_with_coverage();
  const std::string key(64, 'a');
  run.signoff = kvaudit::SignOff{"Ada Lovelace", "GLM-5", "sglang on H200", key};
  const std::string digest = kvaudit::to_json(run).at("signoff").at("digest").at("value");
  const std::string html = kvaudit::render_html(run);
  CHECK(html.find("<code class=\"digest\">" + digest + "</code>") != std::string::npos);
  CHECK(html.find("<code class=\"digest\">" + key + "</code>") != std::string::npos);
  CHECK(html.find("Ada Lovelace") != std::string::npos);
  const std::string md = kvaudit::render_markdown(run);
  CHECK(md.find("| report checksum (SHA-256) | `" + digest + "` |") != std::string::npos);
  CHECK(md.find("| public key (Ed25519) | `" + key + "` |") != std::string::npos);
  CHECK(md.find("| deployment | sglang on H200 |") != std::string::npos);
  // The checksum is not called the report's digest (it is no signature).
  CHECK(md.find("report digest") == std::string::npos);
  CHECK(html.find("report digest") == std::string::npos);
}

TEST_CASE("report.md: summary first, failures with saturation, passing checks counted",
          "[report_html]") {
  const std::string md = kvaudit::render_markdown(run_with_coverage());
  INFO(md);
  const auto summary = md.find("## Summary\n");
  REQUIRE(summary != std::string::npos);
  CHECK(summary < md.find("## Failures and their likely cause"));
  CHECK(md.find("## Failures and their likely cause") < md.find("## Appendix: dump"));
  CHECK(md.find("## Appendix: policy") < md.find("## Appendix: dump"));
  // The fixture's worst kernel rel_l2 is 0.025 in layer 3 at step 1.
  CHECK(md.find("- **FAIL** The kernel adds at most rel_l2 0.025 in layer 3 at step 1 (kernel "
                "error, backend vs R8'") != std::string::npos);
  CHECK(md.find("### quantization error over the sign-off limit in layer 3 (report-only)") !=
        std::string::npos);
  CHECK(md.find("saturated codes read: 123 of 28,800 codes read (0.43%) at step 1") !=
        std::string::npos);
  CHECK(md.find("Likely cause: Saturation: 123 of 28,800 codes read") != std::string::npos);
  CHECK(md.find("### cache integrity: written_slots [bf16_bytes] in layer 3") != std::string::npos);
  // Passing integrity checks: counted, not listed.
  CHECK(md.find("2 checks, 1 failed. Passing checks are counted, not listed: written_slots 1.") !=
        std::string::npos);
  CHECK(md.find("4 written slots hold") == std::string::npos);
  // Limits not judged say nothing about the exit status; the kernel is named against R8'.
  CHECK(md.find("| not judged | yes |") == std::string::npos);
  CHECK(md.find("| not judged | - |") != std::string::npos);
  CHECK(md.find("Kernel = backend vs R8\u2032") != std::string::npos);
  // The ULP glossary says where a count is kept and why (src/verdict/metrics.cpp).
  CHECK(md.find("counted only where |reference| >= 2^-4 of the largest |reference| of the same "
                "(row, head)") != std::string::npos);
  CHECK(md.find("0.01 that changes sign moves by about 30,800 ULPs") != std::string::npos);
  CHECK(md.find("| 3 | 0.07 | 0.00245 | 0.0175 | 1e-05 | 123 of 28,800 codes read (0.43%) at "
                "step 1 | 0.025 |") != std::string::npos);
}

TEST_CASE("report directory holds report.html beside report.json and report.md", "[report_html]") {
  const std::filesystem::path dir =
      std::filesystem::path(KVAUDIT_TEST_TMPDIR) / "kvaudit_test_report_html_dir";
  std::filesystem::remove_all(dir);
  REQUIRE(kvaudit::write_report_dir(dir, run_with_coverage()).ok());
  std::ifstream in(dir / "report.html");
  std::stringstream text;
  text << in.rdbuf();
  CHECK(text.str().find("<h1>FAIL</h1>") != std::string::npos);
  CHECK(std::filesystem::exists(dir / "report.json"));
  CHECK(std::filesystem::exists(dir / "report.md"));
}
