// `kvaudit check` end to end: the binary (KVAUDIT_BINARY) on tiny dumps written here, its exit
// status (0 pass, 1 checks failed, 2 bad input), the report directory and --save-outputs.
#include <hdf5.h>
#include <sys/wait.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "kvaudit_test_config.hpp"  // KVAUDIT_BINARY, KVAUDIT_SOURCE_DIR, KVAUDIT_TEST_TMPDIR
#include "src/core/cuda_device.hpp"
#include "tests/replay/check_dumps.hpp"

namespace kvaudit {
namespace {

using testing::find_reciprocal_disagreement;
using testing::make_tiny_dump;
using testing::test_tmp_path;
using testing::TinyDump;
using testing::TinySpec;

struct CommandResult {
  int status = -1;
  std::string out;
  std::string err;
};

std::string read_text(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

CommandResult run_check(const std::string& name, const std::string& arguments) {
  const auto out = test_tmp_path(name + ".stdout");
  const auto err = test_tmp_path(name + ".stderr");
  const std::string command = std::string(KVAUDIT_BINARY) + " check " + arguments + " > '" +
                              out.string() + "' 2> '" + err.string() + "'";
  const int raw = std::system(command.c_str());
  CommandResult result;
  result.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  result.out = read_text(out);
  result.err = read_text(err);
  return result;
}

std::string write_dump(const TinyDump& dump, const std::string& name) {
  const auto path = test_tmp_path(name + ".h5");
  std::string error;
  REQUIRE(dump.write(path, &error));
  return "'" + path.string() + "'";
}

TinySpec two_layer_spec() {
  TinySpec spec;
  spec.layer_ids = {0, 4};
  return spec;
}

// Dims of a dataset and its string attribute "dtype" (empty when absent).
struct DatasetInfo {
  std::vector<hsize_t> dims;
  std::string dtype_attribute;
  bool is_u16 = false;
  bool is_f64 = false;
  bool is_f32 = false;
};

bool read_dataset_info(hid_t file, const std::string& path, DatasetInfo& info) {
  const hid_t dataset = H5Dopen2(file, path.c_str(), H5P_DEFAULT);
  if (dataset < 0) return false;
  const hid_t space = H5Dget_space(dataset);
  info.dims.resize(H5Sget_simple_extent_ndims(space));
  H5Sget_simple_extent_dims(space, info.dims.data(), nullptr);
  H5Sclose(space);
  const hid_t type = H5Dget_type(dataset);
  info.is_u16 = H5Tequal(type, H5T_STD_U16LE) > 0;
  info.is_f64 = H5Tequal(type, H5T_IEEE_F64LE) > 0;
  info.is_f32 = H5Tequal(type, H5T_IEEE_F32LE) > 0;
  H5Tclose(type);
  if (H5Aexists(dataset, "dtype") > 0) {
    const hid_t attribute = H5Aopen(dataset, "dtype", H5P_DEFAULT);
    const hid_t attribute_type = H5Aget_type(attribute);
    if (H5Tis_variable_str(attribute_type) > 0) {
      char* text = nullptr;
      // Read with the attribute's own type: HDF5 converts no character sets.
      if (H5Aread(attribute, attribute_type, &text) >= 0 && text != nullptr) {
        info.dtype_attribute = text;
      }
      H5free_memory(text);
    }
    H5Tclose(attribute_type);
    H5Aclose(attribute);
  }
  H5Dclose(dataset);
  return true;
}

}  // namespace

TEST_CASE("kvaudit check: clean dump passes, writes the report and the saved outputs",
          "[cli][check]") {
  const TinyDump dump = make_tiny_dump(two_layer_spec());
  const std::string file = write_dump(dump, "cli_clean");
  const auto report_dir = test_tmp_path("cli_clean_report");
  const auto outputs = test_tmp_path("cli_clean_outputs.h5");
  std::filesystem::remove_all(report_dir);
  const CommandResult result =
      run_check("cli_clean", file + " --threads 2 --verbose --report '" + report_dir.string() +
                                 "' --save-outputs '" + outputs.string() + "'");
  INFO(result.out << result.err);
  CHECK(result.status == 0);
  CHECK_THAT(result.out, Catch::Contains("policy: default"));
  CHECK_THAT(result.out, Catch::Contains("verdict: PASS"));
  CHECK_THAT(result.out, Catch::Contains("rows*heads*tokens/s"));

  const nlohmann::json report = nlohmann::json::parse(read_text(report_dir / "report.json"));
  CHECK(report.at("verdict") == "pass");
  CHECK(report.at("backend") == "cpu-fp8");
  CHECK(report.at("dump").at("sha256").get<std::string>().size() == 64);
  CHECK(std::filesystem::exists(report_dir / "report.md"));

  const hid_t h5 = H5Fopen(outputs.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  REQUIRE(h5 >= 0);
  const int heads = dump.attrs.num_heads;
  const int dc = dump.attrs.kv_lora_rank;
  for (std::size_t s = 0; s < dump.steps.size(); ++s) {
    for (const int layer_id : {0, 4}) {
      const std::string group =
          "/steps/" + step_group_name(static_cast<int>(s)) + "/" + layer_group_name(layer_id);
      const auto nq = static_cast<hsize_t>(dump.steps[s].num_rows());
      const std::vector<hsize_t> out_dims = {nq, static_cast<hsize_t>(heads),
                                             static_cast<hsize_t>(dc)};
      const std::vector<hsize_t> lse_dims = {nq, static_cast<hsize_t>(heads)};
      INFO(group);
      DatasetInfo info;
      REQUIRE(read_dataset_info(h5, group + "/reference_out", info));
      CHECK((info.is_f64 && info.dims == out_dims));
      REQUIRE(read_dataset_info(h5, group + "/reference_lse", info));
      CHECK((info.is_f64 && info.dims == lse_dims));
      REQUIRE(read_dataset_info(h5, group + "/reference_source_out", info));
      CHECK((info.is_f64 && info.dims == out_dims));
      REQUIRE(read_dataset_info(h5, group + "/reference_source_lse", info));
      CHECK((info.is_f64 && info.dims == lse_dims));
      REQUIRE(read_dataset_info(h5, group + "/backend_out", info));
      CHECK((info.is_u16 && info.dims == out_dims && info.dtype_attribute == "bfloat16"));
      REQUIRE(read_dataset_info(h5, group + "/backend_lse", info));
      CHECK((info.is_f32 && info.dims == lse_dims));
    }
  }
  H5Fclose(h5);
}

TEST_CASE("kvaudit check: saturating scale passes by default and fails under --signoff",
          "[cli][check]") {
  TinySpec spec;
  spec.outlier_channel = 1;
  spec.outlier_gain = 8.0f;  // 8 / 0.0029 = 2759 codes, far past 464: saturates at 448
  const std::string file = write_dump(make_tiny_dump(spec), "cli_saturating");
  const CommandResult by_default = run_check("cli_saturating_default", file + " --threads 2");
  INFO(by_default.out << by_default.err);
  CHECK(by_default.status == 0);
  CHECK_THAT(by_default.out, Catch::Contains("report-only"));
  const auto json = test_tmp_path("cli_saturating_signoff.json");
  const auto report_dir = test_tmp_path("cli_saturating_signoff_report");
  const auto key = test_tmp_path("cli_saturating_signoff.key");
  std::filesystem::remove(key);
  std::filesystem::remove(key.string() + ".pub");
  REQUIRE(std::system(("'" + std::string(KVAUDIT_BINARY) + "' keygen --out '" + key.string() +
                       "' > /dev/null")
                          .c_str()) == 0);
  const CommandResult signoff = run_check(
      "cli_saturating_signoff",
      file + " --threads 2 --signoff --signed-by A --model M --signing-key '" + key.string() +
          "' --report '" + report_dir.string() + "' --json '" + json.string() + "'");
  INFO(signoff.out << signoff.err);
  CHECK(signoff.status == 1);
  CHECK_THAT(signoff.out, Catch::Contains("verdict: FAIL"));
  const nlohmann::json report = nlohmann::json::parse(read_text(json));
  CHECK(report.at("verdict") == "fail");
  CHECK(report.at("policy").at("name") == "signoff");
}

TEST_CASE("kvaudit check --reciprocal-scale: backend and reference both use it, and it is noted",
          "[cli][check]") {
  // A value where x / s and x * (1 / s) store different codes, written at step 1: a backend that
  // ignored the flag would store the kvdump code and fail written_slots against the reference.
  const auto disagreement = find_reciprocal_disagreement(0.0029f);
  REQUIRE(disagreement.value != 0.0f);
  TinySpec spec;
  spec.kv_scale = disagreement.kv_scale;
  TinyDump dump = make_tiny_dump(spec);
  dump.tensors[1][0].new_kv[0] = disagreement.value;
  const std::string file = write_dump(dump, "cli_reciprocal");
  // Without the flag the same dump passes too (both sides divide): the flag changes both.
  const CommandResult plain =
      run_check("cli_reciprocal_plain", file + " --backend cpu-fp8 --threads 2");
  CHECK(plain.status == 0);
  const auto json = test_tmp_path("cli_reciprocal.json");
  const CommandResult named =
      run_check("cli_reciprocal", file + " --backend cpu-fp8 --threads 2 --reciprocal-scale " +
                                      "--json '" + json.string() + "'");
  INFO(named.out << named.err);
  CHECK(named.status == 0);
  CHECK_THAT(named.out, Catch::Contains("note: --reciprocal-scale"));
  const nlohmann::json report = nlohmann::json::parse(read_text(json));
  CHECK(report.at("backend_description").at("write_rule").get<std::string>().find("1 / kv_scale") !=
        std::string::npos);
  CHECK(report.at("notes").at(0).get<std::string>().find("--reciprocal-scale") == 0);
}

TEST_CASE("kvaudit check: a captured pool with NaN codes fails with --backend none",
          "[cli][check]") {
  TinySpec spec;
  spec.outlier_channel = 2;
  spec.outlier_gain = 8.0f;
  TinyDump dump = make_tiny_dump(spec);
  KvPool after = dump.pool_after(0, 0);
  const std::int32_t slot = dump.steps[0].new_kv_slots[0];
  after.row(slot)[2] = kE4m3NanCode;
  dump.tensors[0][0].kv_cache_after = after;
  const std::string file = write_dump(dump, "cli_nan_pool");
  const CommandResult result = run_check("cli_nan_pool", file + " --backend none");
  INFO(result.out << result.err);
  CHECK(result.status == 1);
  CHECK_THAT(result.out, Catch::Contains("S000 L000") && Catch::Contains("nan_code"));
}

TEST_CASE("kvaudit check --list-diagnoses lists the catalogue - --diagnose N names the mismatch",
          "[cli][check][diagnosis]") {
  const CommandResult listed = run_check("cli_list_diagnoses", "--list-diagnoses");
  CHECK(listed.status == 0);
  for (const char* name :
       {"lse-base-2", "scale-pow2-floor", "scale-pow2-nearest", "scale-e8m0", "scale-bf16",
        "scale-reciprocal", "scale-squared", "scale-not-applied", "scale-latent-only",
        "sm-scale-missing", "sm-scale-log2e", "fp8-read-as-e5m2", "fp8-read-as-bf16", "p-e4m3"}) {
    CHECK_THAT(listed.out, Catch::Contains(std::string("\n") + name + " ") ||
                               Catch::StartsWith(std::string(name) + " "));
  }
  // kv_scale 0.0029 (log2 -8.43): the scale-mismatch injection reads 2^-8, its ceiling too.
  const std::string file = write_dump(make_tiny_dump(two_layer_spec()), "cli_diagnose");
  const auto json = test_tmp_path("cli_diagnose.json");
  const std::string injected = file + " --backend cpu-fp8 --threads 2 --inject scale-mismatch";
  const CommandResult named =
      run_check("cli_diagnose", injected + " --diagnose 1 --json '" + json.string() + "'");
  INFO(named.out << named.err);
  CHECK(named.status == 1);
  CHECK_THAT(named.out,
             Catch::Contains("diagnosis (convention mismatches") &&
                 Catch::Contains("step 0 layer 0 kernel: explained by scale-pow2-nearest, "
                                 "scale-e8m0 (indistinguishable on this data: the same "
                                 "computation here, kv_scale 0.0029 read as 0.00390625 (2^-8))") &&
                 Catch::Contains("note: diagnosis: 1 of 6 (step, layer)s"));
  const nlohmann::json report = nlohmann::json::parse(read_text(json));
  REQUIRE(report.at("diagnosis").size() == 1);
  CHECK(report.at("diagnosis")[0].at("explained_by")[0].at("hypothesis") == "scale-pow2-nearest");
  const CommandResult off = run_check("cli_diagnose_off", injected + " --diagnose 0");
  CHECK(off.status == 1);
  CHECK(off.out.find("diagnosis") == std::string::npos);
  const CommandResult negative = run_check("cli_diagnose_negative", file + " --diagnose -1");
  CHECK(negative.status == 2);
  CHECK_THAT(negative.err, Catch::Contains("--diagnose"));
}

TEST_CASE("kvaudit check --progress: one line per finished layer, with the time left",
          "[cli][check]") {
  TinySpec spec;
  spec.layer_ids = {0, 4, 9};
  const std::string file = write_dump(make_tiny_dump(spec), "cli_progress");
  const CommandResult result = run_check("cli_progress", file + " --progress");
  INFO(result.out << result.err);
  CHECK(result.status == 0);
  CHECK_THAT(result.err, Catch::Contains("layer 1/3 (layer_id 0) done in "));
  CHECK_THAT(result.err, Catch::Contains("layer 2/3 (layer_id 4) done in "));
  CHECK_THAT(result.err, Catch::Contains("layer 3/3 (layer_id 9) done in "));
  CHECK_THAT(result.err, Catch::Contains(" left\n"));  // an estimate until the last layer
  const std::size_t last = result.err.find("layer 3/3 (layer_id 9) done");
  REQUIRE(last != std::string::npos);
  CHECK(result.err.find(" left", last) == std::string::npos);  // none after the last
  // The time so far per stage, and the bytes the layer held.
  const std::string last_line = result.err.substr(last, result.err.find('\n', last) - last);
  CHECK_THAT(last_line,
             Catch::Matches("layer 3/3 \\(layer_id 9\\) done in [0-9.]+ s \\([0-9]+ steps; so "
                            "far read [0-9.]+ s, waited [0-9.]+ s for it, reference "
                            "[0-9.]+ s, backend [0-9.]+ s, compare [0-9.]+ s; layer "
                            "[0-9.]+ (B|KiB|MiB|GiB)\\); [0-9.]+ s elapsed"));
}

TEST_CASE("kvaudit check: bad input exits 2 with one line on stderr", "[cli][check]") {
  const std::string file = write_dump(make_tiny_dump(two_layer_spec()), "cli_bad");
  const auto bad_policy = test_tmp_path("cli_bad_policy.json");
  std::ofstream(bad_policy) << "{ this is not json";
  struct Case {
    std::string name;
    std::string arguments;
    std::string says;
  };
  std::vector<Case> cases = {
      {"backend", file + " --backend no-such-backend", "no-such-backend"},
      {"layer", file + " --layers 7", "layer id 7"},
      {"step", file + " --steps 9", "step 9"},
      {"policy", file + " --policy '" + bad_policy.string() + "'", "cli_bad_policy.json"},
      {"missing", "'" + test_tmp_path("no_such_dump.h5").string() + "'", "no_such_dump.h5"},
  };
  if (!cuda_device_info().present) {
    cases.push_back({"cuda", file + " --backend cuda-fp8", "cuda"});
  }
  for (const Case& c : cases) {
    const CommandResult result = run_check("cli_bad_" + c.name, c.arguments);
    INFO(c.name << ": " << result.out << result.err);
    CHECK(result.status == 2);
    CHECK_THAT(result.err, Catch::Contains(c.says));
    CHECK(std::count(result.err.begin(), result.err.end(), '\n') == 1);
  }
}

TEST_CASE(
    "kvaudit check --reference cuda: the GPU reference where a GPU is, else exit 2 saying why",
    "[cli][check]") {
  const TinyDump dump = make_tiny_dump(two_layer_spec());
  const std::string file = write_dump(dump, "cli_reference_cuda");
  const auto json_cpu = test_tmp_path("cli_reference_cpu.json");
  const auto json_cuda = test_tmp_path("cli_reference_cuda.json");
  const CommandResult unknown = run_check("cli_reference_unknown", file + " --reference gpu");
  CHECK(unknown.status == 2);
  CHECK_THAT(unknown.err, Catch::Contains("--reference: gpu not in {cpu,cuda}"));
  const CudaDeviceInfo device = cuda_device_info();
  const CommandResult cuda =
      run_check("cli_reference_cuda",
                file + " --reference cuda --certify 8 --json '" + json_cuda.string() + "'");
  INFO(cuda.out << cuda.err);
  if (!device.present) {
    CHECK(cuda.status == 2);
    CHECK_THAT(cuda.err, Catch::Contains("--reference cuda"));
    CHECK(cuda.out.find("verdict") == std::string::npos);  // refused before any work
    CHECK_FALSE(std::filesystem::exists(json_cuda));
    return;
  }
  REQUIRE(cuda.status == 0);
  const CommandResult cpu =
      run_check("cli_reference_cpu", file + " --certify 8 --json '" + json_cpu.string() + "'");
  REQUIRE(cpu.status == 0);
  const nlohmann::json on_gpu = nlohmann::json::parse(read_text(json_cuda));
  const nlohmann::json on_cpu = nlohmann::json::parse(read_text(json_cpu));
  CHECK(on_gpu.at("timing").at("reference_device") == "cuda");
  CHECK(on_cpu.at("timing").at("reference_device") == "cpu");
  // The CPU certified the GPU reference at 8 sites; the verdicts and results agree.
  CHECK(on_gpu.at("certification").at("samples").size() == 8);
  CHECK(on_gpu.at("verdict") == on_cpu.at("verdict"));
  CHECK(on_gpu.at("comparisons").size() == on_cpu.at("comparisons").size());
}

}  // namespace kvaudit
