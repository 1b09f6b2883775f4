// `kvaudit check --layers-in-flight N` through the binary: the same report.json (everything but
// timing and provenance, as scripts/same_report.py compares) and the same saved outputs (every
// dataset) for 1 and 3 layers in flight; --verbose says how many were in flight, or why the run
// fell back to one.
#include <catch2/catch.hpp>
#include <filesystem>
#include <string>

#include "tests/backend/exec_test_support.hpp"
#include "tests/cli/shard_commands.hpp"
#include "tests/gpu_skip.hpp"

namespace kvaudit_test {
namespace {

struct FlightRun {
  CommandOutcome outcome;
  nlohmann::json report;
};

// check DUMP ARGUMENTS --json FILE --verbose --layers-in-flight N, run as `name`-N.
FlightRun check_in_flight(const std::string& name, const std::string& dump,
                          const std::string& arguments, int layers_in_flight) {
  const std::filesystem::path dir = test_tmpdir() / "layers_in_flight";
  std::filesystem::create_directories(dir);
  const std::string run_name = name + "-" + std::to_string(layers_in_flight);
  const std::filesystem::path json = dir / (run_name + ".json");
  std::filesystem::remove(json);
  FlightRun run;
  run.outcome = run_kvaudit("layers_in_flight_" + run_name,
                            "check " + shipped_dump(dump) + " --threads 2 --verbose --json '" +
                                json.string() + "' --layers-in-flight " +
                                std::to_string(layers_in_flight) + " " + arguments);
  if (std::filesystem::exists(json)) run.report = read_json(json);
  return run;
}

// The two runs end alike (exit status and report), and the report has results.
void check_same(const FlightRun& sequential, const FlightRun& in_flight) {
  INFO(sequential.outcome.err << in_flight.outcome.err);
  CHECK(in_flight.outcome.status == sequential.outcome.status);
  REQUIRE(sequential.report.is_object());
  REQUIRE(in_flight.report.is_object());
  CHECK(!sequential.report.at("results").empty());
  CHECK(differing_keys(sequential.report, in_flight.report).empty());
  CHECK(comparable(in_flight.report).dump() == comparable(sequential.report).dump());
}

}  // namespace

TEST_CASE("kvaudit check --layers-in-flight 3 gives the report of 1 for every shipped dump",
          "[cli][layers-in-flight]") {
  for (const char* dump :
       {"glm5_page1", "glm5_outliers_calibrated", "glm5_outliers_scale1", "glm5_dsa_flashmla",
        "glm5_pertoken_fp8rope", "page64_nan", "saturated_page16"}) {
    INFO(dump);
    const FlightRun sequential = check_in_flight(dump, dump, "", 1);
    const FlightRun in_flight = check_in_flight(dump, dump, "", 3);
    check_same(sequential, in_flight);
    // --verbose says how many layers were in flight (none of these dumps makes it fall back):
    // 3, or 2 for a dump of 2 layers, and nothing for a dump of one layer.
    const std::size_t layers = sequential.report.at("dump").at("summary").at("layers").size();
    CHECK(sequential.outcome.out.find("layers in flight") == std::string::npos);
    CHECK((in_flight.outcome.out.find(
               "layers in flight: " + std::to_string(std::min<std::size_t>(3, layers)) + " (") !=
           std::string::npos) == (layers > 1));
  }
}

// On the GPU the two layers' reference and backend calls run on their own CUDA streams, side by
// side: the reports must still be those of one layer at a time.
TEST_CASE(
    "kvaudit check on the GPU (cuda reference and cuda-fp8) gives the report of 1 with 2 "
    "layers in flight",
    "[gpu][cli][layers-in-flight]") {
  KVAUDIT_REQUIRE_GPU();
  for (const char* dump : {"glm5_page1", "glm5_outliers_calibrated", "page64_nan"}) {
    INFO(dump);
    const std::string gpu = "--reference cuda --backend cuda-fp8";
    const FlightRun sequential = check_in_flight(std::string(dump) + "-gpu", dump, gpu, 1);
    const FlightRun in_flight = check_in_flight(std::string(dump) + "-gpu", dump, gpu, 2);
    check_same(sequential, in_flight);
    const std::size_t layers = sequential.report.at("dump").at("summary").at("layers").size();
    CHECK((in_flight.outcome.out.find("layers in flight: 2 (") != std::string::npos) ==
          (layers > 1));
  }
}

namespace {

// A size as format_bytes writes it ("1.23 MiB", "512 B"), in bytes.
double parse_size(const std::string& text) {
  const std::size_t space = text.find(' ');
  const double value = std::stod(text.substr(0, space));
  const std::string unit = text.substr(space + 1);
  double scale = 1.0;
  for (const char* step : {"KiB", "MiB", "GiB"}) {
    scale *= 1024.0;
    if (unit.rfind(step, 0) == 0) return value * scale;
  }
  return value;
}

// The size written just before `marker` in `text` ("<value> <unit><marker>").
double size_before(const std::string& text, const std::string& marker) {
  const std::size_t end = text.find(marker);
  REQUIRE(end != std::string::npos);
  const std::size_t unit_start = text.rfind(' ', end - 1);
  const std::size_t value_start = text.rfind(' ', unit_start - 1) + 1;
  return parse_size(text.substr(value_start, end - value_start));
}

}  // namespace

TEST_CASE(
    "kvaudit check on the GPU runs 4 layers at once by default, fewer where 4 do not fit in "
    "memory",
    "[gpu][cli][layers-in-flight]") {
  KVAUDIT_REQUIRE_GPU();
  const std::filesystem::path dir = test_tmpdir() / "layers_in_flight";
  std::filesystem::create_directories(dir);
  const std::string dump = (dir / "six_layers.h5").string();
  const CommandOutcome synth =
      run_kvaudit("layers_in_flight_default_synth",
                  "synth --out '" + dump +
                      "' --layers 6 --heads 4 --kv-lora-rank 64 --rope-dim 16 --page-size 16 "
                      "--prefix-lens 40,70 --prefill-tokens 8,3 --decode-steps 1");
  REQUIRE(synth.status == 0);
  // The GPU reference takes any shape (the cuda-* backends only 512 + 64); a GPU reference alone
  // makes the default 4.
  const std::string check = "check '" + dump + "' --reference cuda --backend cpu-fp8 --verbose";
  // Room for plenty: 4 layers in flight.
  const CommandOutcome roomy = run_kvaudit("layers_in_flight_default_roomy", check);
  INFO(roomy.err);
  CHECK(roomy.status == 0);
  CHECK(roomy.out.find("layers in flight: 4 (") != std::string::npos);
  // Room for less than one layer: refused, for one layer (no "times N layers in flight"). Its
  // sizes give one layer's read and computed bytes and the read-ahead.
  const CommandOutcome tiny =
      run_kvaudit("layers_in_flight_default_tiny", check, "KVAUDIT_MEMORY_BUDGET=4096");
  INFO(tiny.err);
  REQUIRE(tiny.status == 2);
  CHECK(tiny.err.find("layers in flight") == std::string::npos);
  const double read = size_before(tiny.err, " read from the dump");
  const double computed = size_before(tiny.err, " computed");
  const double ahead = size_before(tiny.err, " read ahead");
  // Half-way between what 2 and 3 layers in flight need: the default steps down to 2.
  const auto budget = static_cast<long long>(2.5 * (read + computed) + ahead);
  const CommandOutcome tight = run_kvaudit("layers_in_flight_default_tight", check,
                                           "KVAUDIT_MEMORY_BUDGET=" + std::to_string(budget));
  INFO(tight.err);
  CHECK(tight.status == 0);
  CHECK(tight.out.find("layers in flight: 2 (") != std::string::npos);
}

TEST_CASE("kvaudit check --layers-in-flight: a failing injection and --save-outputs",
          "[cli][layers-in-flight]") {
  SECTION("--inject bf16-writeback fails alike, with the same findings and diagnoses") {
    const FlightRun sequential =
        check_in_flight("inject", "glm5_page1", "--inject bf16-writeback --diagnose 2", 1);
    const FlightRun in_flight =
        check_in_flight("inject", "glm5_page1", "--inject bf16-writeback --diagnose 2", 3);
    CHECK(sequential.outcome.status == 1);
    check_same(sequential, in_flight);
    CHECK(in_flight.outcome.out.find("layers in flight: 3 (") != std::string::npos);
  }
  SECTION("--save-outputs falls back to one layer, says so, and saves the same outputs") {
    const std::filesystem::path dir = test_tmpdir() / "layers_in_flight";
    std::filesystem::create_directories(dir);
    const std::filesystem::path saved_1 = dir / "saved-1.h5";
    const std::filesystem::path saved_3 = dir / "saved-3.h5";
    std::filesystem::remove(saved_1);
    std::filesystem::remove(saved_3);
    const FlightRun sequential =
        check_in_flight("save", "glm5_page1", "--save-outputs '" + saved_1.string() + "'", 1);
    const FlightRun in_flight =
        check_in_flight("save", "glm5_page1", "--save-outputs '" + saved_3.string() + "'", 3);
    check_same(sequential, in_flight);
    CHECK(in_flight.outcome.out.find("layers in flight: 1 layer in flight, not 3: an observer") !=
          std::string::npos);
    // Every dataset the same, byte for byte (the files differ in HDF5's object times).
    const auto datasets_1 = kvaudit::exec_test::dataset_bytes(saved_1);
    const auto datasets_3 = kvaudit::exec_test::dataset_bytes(saved_3);
    CHECK(datasets_1.size() > 6);
    CHECK(datasets_3.size() == datasets_1.size());
    const bool same_datasets = datasets_3 == datasets_1;
    CHECK(same_datasets);
  }
}

TEST_CASE("kvaudit check --layers-in-flight refuses a negative count and what is not a count",
          "[cli][layers-in-flight]") {
  // 0 (the default) chooses by device; a count is 1 to 64.
  const CommandOutcome negative =
      run_kvaudit("layers_in_flight_negative",
                  "check " + shipped_dump("glm5_page1") + " --layers-in-flight -1");
  CHECK(negative.status == 2);
  CHECK(negative.err.find("--layers-in-flight") != std::string::npos);
  const CommandOutcome word = run_kvaudit(
      "layers_in_flight_word", "check " + shipped_dump("glm5_page1") + " --layers-in-flight two");
  CHECK(word.status == 2);
  CHECK(word.err.find("--layers-in-flight") != std::string::npos);
}

TEST_CASE("kvaudit check's memory guard counts the layers the backend lets run at once",
          "[cli][layers-in-flight]") {
  // An exec backend holds one layer at a time, so --layers-in-flight 3 runs one layer: a budget
  // that holds one layer (about 15 MiB for glm5_page1 with its read-ahead) but not three must
  // not refuse the run.
  const std::string arguments = "check " + shipped_dump("glm5_page1") +
                                " --backend exec:cpu-fp8 --backend-command '" +
                                kvaudit::exec_test::serve_command() + "' --layers-in-flight 3";
  const CommandOutcome fits =
      run_kvaudit("layers_in_flight_guard_exec", arguments, "KVAUDIT_MEMORY_BUDGET=8388608");
  INFO(fits.err);
  CHECK(fits.status == 0);
  // A budget below one layer is still refused, naming the layer.
  const CommandOutcome too_small =
      run_kvaudit("layers_in_flight_guard_small", arguments, "KVAUDIT_MEMORY_BUDGET=65536");
  CHECK(too_small.status == 2);
  CHECK(too_small.err.find("layer") != std::string::npos);
}

}  // namespace kvaudit_test
