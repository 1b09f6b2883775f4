// Reports of a hand-built run: the stdout table, report.json and report.md in a directory.
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "kvaudit_test_config.hpp"  // KVAUDIT_BINARY, KVAUDIT_SOURCE_DIR, KVAUDIT_TEST_TMPDIR
#include "src/report/report.hpp"
#include "src/report/report_html.hpp"
#include "src/report/report_summary.hpp"
#include "tests/verdict/check_run_fixture.hpp"

using kvaudit::CheckRun;
using kvaudit::testing::make_failing_run;

namespace {

std::filesystem::path test_dir(const std::string& name) {
#ifdef KVAUDIT_TEST_TMPDIR
  const std::filesystem::path base = KVAUDIT_TEST_TMPDIR;
#else
  const std::filesystem::path base = std::filesystem::temp_directory_path();
#endif
  const std::filesystem::path dir = base / ("kvaudit_test_report_" + name);
  std::filesystem::remove_all(dir);
  return dir;
}

std::string read_text(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// The table line that starts with this step, layer and comparison.
std::string table_line(const std::string& table, int step, int layer,
                       const std::string& comparison) {
  std::istringstream lines(table);
  std::string line;
  while (std::getline(lines, line)) {
    std::istringstream fields(line);
    std::string s, l, c;
    fields >> s >> l >> c;
    if (s == std::to_string(step) && l == std::to_string(layer) && c == comparison) return line;
  }
  return "";
}

}  // namespace

TEST_CASE("stdout table: FAIL, report-only, worst location, integrity, verdict", "[report]") {
  std::ostringstream out;
  kvaudit::print_check_table(out, make_failing_run());
  const std::string table = out.str();
  INFO(table);
  CHECK(table.find("comparison") != std::string::npos);
  CHECK(table.find("rel_l2") != std::string::npos);

  const std::string failing = table_line(table, 1, 3, "kernel");
  CHECK(failing.find("FAIL") != std::string::npos);
  CHECK(failing.find("report-only") == std::string::npos);
  CHECK(failing.find("(5,2,17)") != std::string::npos);
  CHECK(failing.find("2.500e-02") != std::string::npos);  // rel_l2

  const std::string passing = table_line(table, 0, 0, "kernel");
  CHECK(passing.find("PASS") != std::string::npos);
  CHECK(passing.find("FAIL") == std::string::npos);
  CHECK(table_line(table, 1, 3, "quantization").find("FAIL report-only") != std::string::npos);
  CHECK(table_line(table, 0, 0, "quantization").find("PASS report-only") != std::string::npos);

  CHECK(table.find("step 1 layer 3 kernel: rel_l2 0.025 > 0.00391 (kernel limit) [request 1]") !=
        std::string::npos);
  CHECK(table.find("step 1 layer 3 written_slots [bf16_bytes]: step 1 layer 3: slots 12, 13") !=
        std::string::npos);
  CHECK(table.find("verdict: FAIL (policy default, backend cpu-fp8, 4 comparisons, 1 failed, 1 "
                   "failed report-only, 2 integrity checks, 1 failed)\n") != std::string::npos);
}

TEST_CASE("verdict line of a passing run", "[report]") {
  CheckRun run = make_failing_run();
  run.comparisons.resize(2);  // the two passing comparisons
  run.integrity.resize(1);
  CHECK(kvaudit::verdict_summary(run) ==
        "verdict: PASS (policy default, backend cpu-fp8, 2 comparisons, 0 failed, 1 integrity "
        "checks, 0 failed)");
}

TEST_CASE("report directory: report.json parses with the schema's keys", "[report]") {
  const std::filesystem::path dir = test_dir("json") / "nested";
  const CheckRun run = make_failing_run();
  const kvaudit::Status written = kvaudit::write_report_dir(dir, run);
  REQUIRE(written.ok());
  const nlohmann::json j = nlohmann::json::parse(read_text(dir / "report.json"));
  for (const char* key : {"tool", "version", "verdict", "backend", "backend_description", "policy",
                          "dump", "results", "integrity", "timing", "provenance"}) {
    INFO(key);
    CHECK(j.contains(key));
  }
  CHECK(j.at("verdict") == "fail");
  CHECK(j.at("dump").at("sha256") ==
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  CHECK(j.at("results").size() == 4);
  CHECK(j.at("results")[2].at("pass") == false);
  CHECK(j.at("integrity")[1].at("classification") == "bf16_bytes");
  CHECK(j.at("integrity")[1].at("detail") == "step 1 layer 3: slots 12, 13 hold bf16 bytes");
}

TEST_CASE("report directory: report.md holds verdict, provenance, tables", "[report]") {
  const std::filesystem::path dir = test_dir("md");
  CheckRun run = make_failing_run();
  run.notes = {"step 0 layer 3: no kv_source for 2 tokens"};
  REQUIRE(kvaudit::write_report_dir(dir, run).ok());
  const std::string md = read_text(dir / "report.md");
  INFO(md);
  CHECK(md.rfind("# kvaudit check report\n", 0) == 0);
  CHECK(md.find("**Verdict: FAIL** — policy `default`, backend `cpu-fp8`: 4 comparisons, 1 failed "
                "(and 1 failed report-only); 2 integrity checks, 1 failed.\n") !=
        std::string::npos);
  CHECK(md.find("ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad") !=
        std::string::npos);
  CHECK(md.find("| model | GLM-5 |") != std::string::npos);
  // The summary's list of layers becomes its own table.
  // (nlohmann's objects keep keys sorted: group, kv_scale, layer_id.)
  CHECK(
      md.find("### layers\n\n| group | kv_scale | layer_id |\n| --- | --- | --- |\n| L000 | 0.5 | "
              "0 |\n| L003 | 0.25 | 3 |\n") != std::string::npos);
  // Result rows, the failing one marked and with its reason.
  CHECK(md.find("| 0 | 0 | kernel | ") != std::string::npos);
  // max_abs 0.0125 = 0.5 * rel_l2, over max|ref| 2; ULPs as a plain count.
  CHECK(md.find("| 1 | 3 | kernel | 0.0125 | 0.00625 | 0.025 | 0.0003125 | 3 | 1e-05 | 0 | ") !=
        std::string::npos);
  CHECK(md.find("**FAIL** | (5,2,17) | rel_l2 0.025 > 0.00391 (kernel limit) |") !=
        std::string::npos);
  CHECK(md.find("**FAIL report-only**") != std::string::npos);
  // Policy with derivations.
  CHECK(md.find("| kernel | rel_l2 | 0.003906 | yes | 2^-8:") != std::string::npos);
  CHECK(md.find("| quantization | rel_l2 | 0.0625 | no |") != std::string::npos);
  // Sign-off per layer: layer 3's worst quantization rel_l2 0.07, kernel 0.025, ratio 0.3571.
  CHECK(md.find("| 3 | 0.07 | 0.00245 | ") != std::string::npos);
  CHECK(md.find("| 0.025 | 0.3571 | - | **FAIL** |") != std::string::npos);
  CHECK(md.find("| 1 | 3 | written_slots | **FAIL** | bf16_bytes | 12, 13 |") != std::string::npos);
  CHECK(md.find("- step 0 layer 3: no kv_source for 2 tokens") != std::string::npos);
  // Across steps: step 1 has one layer (3), its pool damaged, the kernel's worst rel_l2 there.
  CHECK(md.find("## Across steps") != std::string::npos);
  CHECK(md.find("| 1 | 1 | damaged | 0 | - | 0.025 (L3) | - |") != std::string::npos);
  CHECK(md.find("| host | testhost |") != std::string::npos);
  CHECK(md.find("| reference throughput | 5e+05 rows x heads x tokens / s |") != std::string::npos);
}

TEST_CASE("report directory that cannot be created is bad input naming it", "[report]") {
  const std::filesystem::path dir = test_dir("blocked");
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "file") << "x";
  const kvaudit::Status written =
      kvaudit::write_report_dir(dir / "file" / "sub", make_failing_run());
  REQUIRE_FALSE(written.ok());
  CHECK(written.error().kind == kvaudit::ErrorKind::kBadInput);
  CHECK(written.error().where.find("file/sub") != std::string::npos);
}

TEST_CASE("report.md and stdout render the run's first divergence, notes and provenance",
          "[report]") {
  CheckRun run = make_failing_run();
  kvaudit::Divergence divergence;
  divergence.step = 1;
  divergence.layer_id = 3;
  divergence.request = 1;
  divergence.row = 5;
  divergence.head = 2;
  divergence.comparison = kvaudit::Comparison::kKernel;
  divergence.reason = "rel_l2 0.025 > 0.00391 (kernel limit)";
  run.first_divergence = divergence;
  run.notes = {"S000 L003: a note"};

  const std::string md = kvaudit::render_markdown(run);
  INFO(md);
  CHECK(md.find("First divergence: comparison `kernel` head `2` layer_id `3` reason `rel_l2 0.025 "
                "> 0.00391 (kernel limit)` request `1` row `5` step `1` \n\n") !=
        std::string::npos);
  CHECK(md.find("## Notes\n\n- S000 L003: a note\n\n") != std::string::npos);
  CHECK(md.find("## Provenance\n\n| key | value |\n| --- | --- |\n| command_line | kvaudit check "
                "/data/glm5_two_layers.h5 |\n| date | 2026-11-29T09:30:00Z |\n| host | testhost "
                "|\n| kvaudit_version | 0.1.0 |\n\n") != std::string::npos);

  std::ostringstream out;
  kvaudit::print_notes(out, run);
  CHECK(out.str() ==
        "note: S000 L003: a note\nfirst divergence (kernel): step 1 layer 3 request 1 row 5 head "
        "2: rel_l2 0.025 > 0.00391 (kernel limit)\n");
}

TEST_CASE("diagnosis: a stdout block after the table and a report.md section after the failures",
          "[report]") {
  CheckRun run = make_failing_run();
  run.diagnosis = kvaudit::testing::make_diagnosis();
  std::ostringstream out;
  kvaudit::print_check_table(out, run);
  const std::string text = out.str();
  const std::size_t block = text.find("diagnosis (convention mismatches");
  REQUIRE(block != std::string::npos);
  CHECK(block > text.find("failures:"));
  CHECK(block < text.find("integrity failures:"));
  CHECK_THAT(text, Catch::Contains("  step 1 layer 3 kernel: explained by lse-base-2 (candidate "
                                   "lse read as log2 of the sum)\n"
                                   "    rel_l2 0.025 -> 0.0018, lse_max_abs 1.5 -> 2e-06, "
                                   "max_abs/ref_max 0.031 -> 0.0022\n"));
  CHECK_THAT(text, Catch::Contains("  step 2 layer 3 kernel: no hypothesis in the catalogue "
                                   "explains this failure (14 tried; closest: scale-bf16"));
  CHECK_THAT(text, Catch::Contains("rel_l2 0.025 -> 0.02, lse_max_abs 1.5 -> 0.4"));

  const std::string md = kvaudit::render_markdown(run);
  const std::size_t section = md.find("## Diagnosis");
  REQUIRE(section != std::string::npos);
  // Summary first: the diagnosis follows the failures it explains, before the long tables.
  CHECK(section > md.find("## Failures and their likely cause"));
  CHECK(section < md.find("## Results per step"));
  CHECK_THAT(md, Catch::Contains("| 1 | 0 | kernel | explained by scale-pow2-floor, "
                                 "scale-pow2-nearest (indistinguishable on this data"));
  CHECK_THAT(md, Catch::Contains("rel_l2 0.025 -> 0.0017"));

  // report.html: the same rows as a table of words, not the JSON of the findings.
  const std::string html = kvaudit::render_html(run);
  const std::size_t html_section = html.find("<section id=\"diagnosis\">");
  REQUIRE(html_section != std::string::npos);
  const std::string html_diagnosis =
      html.substr(html_section, html.find("</section>", html_section) - html_section);
  CHECK_THAT(html_diagnosis, Catch::Contains("<td>explained by lse-base-2 (candidate lse read as "
                                             "log2 of the sum)</td>"));
  CHECK_THAT(html_diagnosis, Catch::Contains("rel_l2 0.025 -&gt; 0.0018"));
  CHECK(html_diagnosis.find("explained_by") == std::string::npos);
  CHECK(html_diagnosis.find("hypotheses_tried") == std::string::npos);

  // Nothing diagnosed: no block, no section.
  run.diagnosis.clear();
  std::ostringstream clean;
  kvaudit::print_check_table(clean, run);
  CHECK(clean.str().find("diagnosis") == std::string::npos);
  CHECK(kvaudit::render_markdown(run).find("## Diagnosis") == std::string::npos);
  CHECK(kvaudit::render_html(run).find("<section id=\"diagnosis\">") == std::string::npos);
}

TEST_CASE("report.md and report.html: the server's pool cost and a merged run's parts",
          "[report]") {
  CheckRun run = make_failing_run();
  // A captured_cache comparison that fails at step 1 layer 3: the captured pool's cost shows.
  kvaudit::ComparisonResult cost = run.comparisons.front();
  cost.comparison = kvaudit::Comparison::kCapturedCache;
  cost.step = 1;
  cost.layer_id = 3;
  cost.metrics.rel_l2 = 0.125;
  cost.judgement.pass = false;
  cost.sets_exit = false;
  run.comparisons.push_back(cost);
  run.provenance.merged_from = {
      {"p0.json", "0/2", "node1", "2026-11-29T09:30:00Z", "kvaudit check --shard 0/2"},
      {"p1.json", "1/2", "node2", "2026-11-29T09:31:00Z", "kvaudit check --shard 1/2"}};
  const std::string md = kvaudit::render_markdown(run);
  CHECK_THAT(md, Catch::Contains("The server's pool: captured pool cost first shows at step 1 "
                                 "layer 3"));
  CHECK_THAT(md, Catch::Contains("rel_l2 0.125"));
  CHECK_THAT(md, Catch::Contains("### Merged from"));
  CHECK_THAT(md, Catch::Contains("| 1/2 | p1.json | node2 |"));
  const std::string html = kvaudit::render_html(run);
  CHECK_THAT(html, Catch::Contains("The server's pool: captured pool cost first shows at step "
                                   "1 layer 3"));
  CHECK_THAT(html, Catch::Contains("<h3>Merged from</h3>"));
}

TEST_CASE("where the backend ran: only what its description names", "[report]") {
  CheckRun run = make_failing_run();
  run.backend = "exec:flashinfer-fp8";
  // An exec adapter's description (the keys of python -m kvdump.backends' hello).
  run.backend_description = {{"device", "NVIDIA H200"},
                             {"compute_capability", "9.0"},
                             {"driver", "580.159.04"},
                             {"torch", "2.11.0+cu130"},
                             {"flashinfer", "0.6.18"}};
  CHECK(kvaudit::backend_machine_text(run) ==
        "exec:flashinfer-fp8 on NVIDIA H200 (compute capability 9.0, driver 580.159.04, torch "
        "2.11.0+cu130, flashinfer 0.6.18)");
  run.backend_description = {{"device", "NVIDIA H200"}};
  CHECK(kvaudit::backend_machine_text(run) == "exec:flashinfer-fp8 on NVIDIA H200");
}

TEST_CASE("timing: the GPU split is printed only for the parts that ran on a GPU", "[report]") {
  CheckRun run = make_failing_run();
  run.reference_seconds = 3.0;
  run.backend_seconds = 1.5;
  SECTION("nothing ran on a GPU: no split line") {
    std::ostringstream out;
    kvaudit::print_timing(out, run);
    CHECK(out.str().find("timing: reference") != std::string::npos);
    CHECK(out.str().find("on the GPU") == std::string::npos);
  }
  SECTION("the GPU reference: its four parts, summed") {
    kvaudit::DeviceSeconds reference;
    reference.prepare = 0.25;
    reference.upload = 0.5;
    reference.kernels = 2.0;
    reference.download = 0.125;
    reference.calls = 6;
    run.reference_device_seconds = reference;
    std::ostringstream out;
    kvaudit::print_timing(out, run);
    CHECK(out.str().find("timing on the GPU: reference 2.875 s over 6 calls = prepare 0.25 s, "
                         "upload 0.5 s, kernels 2 s, download 0.125 s\n") != std::string::npos);
    CHECK(out.str().find("timing on the GPU: backend") == std::string::npos);
  }
  SECTION("a cuda backend: its line apart from the reference's") {
    kvaudit::DeviceSeconds backend;
    backend.prepare = 0.5;
    backend.upload = 0.25;
    backend.kernels = 0.5;
    backend.download = 0.25;
    backend.calls = 2;
    run.backend_device_seconds = backend;
    std::ostringstream out;
    kvaudit::print_timing(out, run);
    CHECK(out.str().find("timing on the GPU: backend 1.5 s over 2 calls = prepare 0.5 s, upload "
                         "0.25 s, kernels 0.5 s, download 0.25 s\n") != std::string::npos);
    CHECK(out.str().find("timing on the GPU: reference") == std::string::npos);
  }
}

TEST_CASE("device seconds: a run's share is the difference of two readings of the totals",
          "[report]") {
  kvaudit::DeviceSeconds before;
  before.prepare = 1.0;
  before.kernels = 4.0;
  before.calls = 3;
  kvaudit::DeviceSeconds after = before;
  kvaudit::DeviceSeconds call;
  call.prepare = 0.5;
  call.upload = 0.25;
  call.kernels = 2.0;
  call.download = 0.125;
  call.calls = 1;
  after += call;
  const kvaudit::DeviceSeconds run = after - before;
  CHECK(run.prepare == 0.5);
  CHECK(run.upload == 0.25);
  CHECK(run.kernels == 2.0);
  CHECK(run.download == 0.125);
  CHECK(run.calls == 1);
  CHECK(run.total() == 2.875);
}
