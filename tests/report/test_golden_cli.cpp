// `kvaudit golden record` / `kvaudit golden check` through the binary (KVAUDIT_BINARY): an
// unchanged run passes (exit 0); one flipped bit of a stored output fails (exit 1) naming step,
// layer, row, head and dim, on a tiny dump and on a shipped dump's checked-in golden file; a golden
// file from another dump is refused (exit 2, both digests named); one whose provenance names
// another device is compared and the difference printed; --accept and KVAUDIT_GOLDEN_ACCEPT=1
// rewrite a moved golden file and print what changed; folders give one summary and one verdict.
// Golden files are altered here with the HDF5 C API, not with kvaudit's own writer.
#include <hdf5.h>
#include <sys/wait.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "kvaudit_test_config.hpp"  // KVAUDIT_BINARY, KVAUDIT_SOURCE_DIR, KVAUDIT_TEST_TMPDIR
#include "src/core/sha256.hpp"
#include "tests/replay/check_dumps.hpp"

namespace kvaudit {
namespace {

namespace fs = std::filesystem;
using testing::make_tiny_dump;
using testing::test_tmp_path;
using testing::TinyDump;
using testing::TinySpec;

struct CommandResult {
  int status = -1;
  std::string out;
  std::string err;
};

std::string read_text(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::string quoted(const fs::path& path) { return "'" + path.string() + "'"; }

// Runs `kvaudit ARGUMENTS` with KVAUDIT_GOLDEN_ACCEPT as given (unset: "0", so that a developer's
// exported KVAUDIT_GOLDEN_ACCEPT=1 does not turn these checks into updates).
CommandResult run_kvaudit(const std::string& name, const std::string& arguments,
                          const std::string& accept = "0") {
  const auto out = test_tmp_path("golden_cli_" + name + ".stdout");
  const auto err = test_tmp_path("golden_cli_" + name + ".stderr");
  const std::string command = "KVAUDIT_GOLDEN_ACCEPT=" + accept + " " +
                              std::string(KVAUDIT_BINARY) + " " + arguments + " > " + quoted(out) +
                              " 2> " + quoted(err);
  const int raw = std::system(command.c_str());
  CommandResult result;
  result.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  result.out = read_text(out);
  result.err = read_text(err);
  return result;
}

// A tiny two-layer dump (layer ids 0 and 4) at `path`.
void write_tiny_dump(const fs::path& path, std::uint32_t seed = 12345) {
  TinySpec spec;
  spec.layer_ids = {0, 4};
  spec.seed = seed;
  const TinyDump dump = make_tiny_dump(spec);
  std::string error;
  REQUIRE(dump.write(path, &error));
}

void record(const fs::path& dump, const fs::path& golden) {
  const CommandResult result = run_kvaudit(
      "record", "golden record " + quoted(dump) + " -o " + quoted(golden) + " --threads 2");
  INFO(result.out << result.err);
  REQUIRE(result.status == 0);
  REQUIRE(fs::exists(golden));
}

// XORs `mask` into element `index` of the u16 dataset `dataset` (out: bf16 bits).
void flip_out_bits(const fs::path& golden, const std::string& dataset, std::size_t index,
                   std::uint16_t mask) {
  const hid_t file = H5Fopen(golden.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  REQUIRE(file >= 0);
  const hid_t data = H5Dopen2(file, dataset.c_str(), H5P_DEFAULT);
  REQUIRE(data >= 0);
  const hid_t space = H5Dget_space(data);
  std::vector<std::uint16_t> values(static_cast<std::size_t>(H5Sget_simple_extent_npoints(space)));
  H5Sclose(space);
  REQUIRE(H5Dread(data, H5T_NATIVE_UINT16, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()) >= 0);
  REQUIRE(index < values.size());
  values[index] ^= mask;
  REQUIRE(H5Dwrite(data, H5T_NATIVE_UINT16, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()) >= 0);
  H5Dclose(data);
  REQUIRE(H5Fclose(file) >= 0);
}

std::string read_root_string(const fs::path& golden, const char* name) {
  const hid_t file = H5Fopen(golden.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  REQUIRE(file >= 0);
  const hid_t attribute = H5Aopen_by_name(file, "/", name, H5P_DEFAULT, H5P_DEFAULT);
  REQUIRE(attribute >= 0);
  const hid_t type = H5Aget_type(attribute);
  std::string text(H5Tget_size(type), '\0');
  REQUIRE(H5Aread(attribute, type, text.data()) >= 0);
  H5Tclose(type);
  H5Aclose(attribute);
  H5Fclose(file);
  return text.substr(0, text.find('\0'));
}

// Replaces the root string attribute `name` (fixed-length, as kvaudit writes it).
void write_root_string(const fs::path& golden, const char* name, const std::string& value) {
  const hid_t file = H5Fopen(golden.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  REQUIRE(file >= 0);
  REQUIRE(H5Adelete_by_name(file, "/", name, H5P_DEFAULT) >= 0);
  const hid_t type = H5Tcopy(H5T_C_S1);
  H5Tset_size(type, value.size());
  H5Tset_cset(type, H5T_CSET_UTF8);
  const hid_t space = H5Screate(H5S_SCALAR);
  const hid_t attribute =
      H5Acreate_by_name(file, "/", name, type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
  REQUIRE(attribute >= 0);
  REQUIRE(H5Awrite(attribute, type, value.data()) >= 0);
  H5Aclose(attribute);
  H5Sclose(space);
  H5Tclose(type);
  REQUIRE(H5Fclose(file) >= 0);
}

// out[row, head, dim] of the tiny dump (2 heads, Dc 32), row-major.
std::size_t tiny_out_index(int row, int head, int dim) {
  return (static_cast<std::size_t>(row) * 2 + head) * 32 + dim;
}

fs::path fresh_dir(const std::string& name) {
  const fs::path dir = test_tmp_path(name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

}  // namespace

TEST_CASE("kvaudit golden check: an unchanged run passes", "[cli][golden]") {
  const fs::path dir = fresh_dir("golden_cli_clean");
  write_tiny_dump(dir / "tiny.h5");
  record(dir / "tiny.h5", dir / "tiny.golden.h5");
  const CommandResult result = run_kvaudit(
      "clean", "golden check " + quoted(dir / "tiny.h5") + " " + quoted(dir / "tiny.golden.h5"));
  INFO(result.out << result.err);
  CHECK(result.status == 0);
  CHECK_THAT(result.out, Catch::Contains("mode: exact"));
  CHECK_THAT(result.out, Catch::Contains("verdict: match (0 of 6 (step, layer)s moved"));
  CHECK_THAT(result.out, !Catch::Contains("first moved"));
}

TEST_CASE("kvaudit golden check: one flipped bit of a stored output fails and names the element",
          "[cli][golden]") {
  SECTION("a tiny dump") {
    const fs::path dir = fresh_dir("golden_cli_flip");
    write_tiny_dump(dir / "tiny.h5");
    record(dir / "tiny.h5", dir / "tiny.golden.h5");
    flip_out_bits(dir / "tiny.golden.h5", "/steps/S001/L004/out", tiny_out_index(1, 1, 5), 0x1);
    const CommandResult result = run_kvaudit(
        "flip", "golden check " + quoted(dir / "tiny.h5") + " " + quoted(dir / "tiny.golden.h5"));
    INFO(result.out << result.err);
    CHECK(result.status == 1);
    CHECK_THAT(result.out,
               Catch::Contains("first moved: step 1 layer 4 out[row 1, head 1, dim 5]"));
    CHECK_THAT(result.out, Catch::Contains(", 1 ulp"));
    CHECK_THAT(result.out, Catch::Contains("verdict: MOVED (1 of 6 (step, layer)s moved"));
  }
  SECTION("a shipped dump and its checked-in golden file") {
    const fs::path source = fs::path(KVAUDIT_SOURCE_DIR);
    const fs::path golden = test_tmp_path("golden_cli_shipped.golden.h5");
    fs::copy_file(source / "tests/golden/saturated_page16.cpu-fp8.golden.h5", golden,
                  fs::copy_options::overwrite_existing);
    // Step 2 of saturated_page16 has 3 rows of 16 heads x 512: its last element.
    flip_out_bits(golden, "/steps/S002/L005/out", (2 * 16 + 15) * 512 + 511, 0x1);
    const CommandResult result = run_kvaudit(
        "flip_shipped", "golden check " + quoted(source / "datasets/saturated_page16.h5") + " " +
                            quoted(golden) + " --backend cpu-fp8");
    INFO(result.out << result.err);
    CHECK(result.status == 1);
    CHECK_THAT(result.out,
               Catch::Contains("first moved: step 2 layer 5 out[row 2, head 15, dim 511]"));
  }
}

TEST_CASE("kvaudit golden check: a golden file from another dump is refused", "[cli][golden]") {
  const fs::path dir = fresh_dir("golden_cli_other_dump");
  write_tiny_dump(dir / "a.h5", 1);
  write_tiny_dump(dir / "b.h5", 2);
  record(dir / "a.h5", dir / "a.golden.h5");
  const CommandResult result = run_kvaudit(
      "other_dump", "golden check " + quoted(dir / "b.h5") + " " + quoted(dir / "a.golden.h5"));
  INFO(result.out << result.err);
  CHECK(result.status == 2);
  const auto a = sha256_file_hex(dir / "a.h5");
  const auto b = sha256_file_hex(dir / "b.h5");
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  CHECK_THAT(result.err,
             Catch::Contains(*a) && Catch::Contains(*b) && Catch::Contains("refusing to compare"));
  CHECK_THAT(result.out, !Catch::Contains("verdict"));
  // --accept never overwrites a golden file made from another dump.
  const CommandResult accept =
      run_kvaudit("other_dump_accept", "golden check " + quoted(dir / "b.h5") + " " +
                                           quoted(dir / "a.golden.h5") + " --accept");
  CHECK(accept.status == 2);
  CHECK(read_root_string(dir / "a.golden.h5", "dump_sha256") == *a);
}

TEST_CASE("kvaudit golden check: unreadable golden files and bad output paths are bad input",
          "[cli][golden]") {
  const fs::path dir = fresh_dir("golden_cli_bad_input");
  write_tiny_dump(dir / "tiny.h5");
  { std::ofstream(dir / "garbage.golden.h5") << "garbage"; }
  const CommandResult garbage = run_kvaudit("garbage", "golden check " + quoted(dir / "tiny.h5") +
                                                           " " + quoted(dir / "garbage.golden.h5"));
  CHECK(garbage.status == 2);
  CHECK_THAT(garbage.err, Catch::StartsWith("kvaudit: ") && Catch::Contains("not an HDF5 file"));
  const CommandResult missing = run_kvaudit(
      "missing", "golden check " + quoted(dir / "tiny.h5") + " " + quoted(dir / "none.h5"));
  CHECK(missing.status == 2);
  CHECK_THAT(missing.err, Catch::Contains("no such golden file"));
  const CommandResult no_folder =
      run_kvaudit("no_folder", "golden record " + quoted(dir / "tiny.h5") + " -o " +
                                   quoted(dir / "no/such/folder/x.golden.h5"));
  CHECK(no_folder.status == 2);
  CHECK_THAT(no_folder.err, Catch::Contains("-o") && Catch::Contains("does not exist"));
  const CommandResult none =
      run_kvaudit("none", "golden record " + quoted(dir / "tiny.h5") + " -o " +
                              quoted(dir / "x.h5") + " --backend none");
  CHECK(none.status == 2);
  CHECK_FALSE(fs::exists(dir / "x.h5"));
}

TEST_CASE("kvaudit golden check: another device in the provenance is compared and stated",
          "[cli][golden]") {
  const fs::path dir = fresh_dir("golden_cli_device");
  write_tiny_dump(dir / "tiny.h5");
  record(dir / "tiny.h5", dir / "tiny.golden.h5");
  nlohmann::json description =
      nlohmann::json::parse(read_root_string(dir / "tiny.golden.h5", "backend_description"));
  REQUIRE(description["device"] == "cpu");
  description["device"] = "an older cpu";
  write_root_string(dir / "tiny.golden.h5", "backend_description", description.dump());
  nlohmann::json platform =
      nlohmann::json::parse(read_root_string(dir / "tiny.golden.h5", "platform"));
  platform["libc"] = "glibc 2.0";
  write_root_string(dir / "tiny.golden.h5", "platform", platform.dump());
  const CommandResult result = run_kvaudit(
      "device", "golden check " + quoted(dir / "tiny.h5") + " " + quoted(dir / "tiny.golden.h5"));
  INFO(result.out << result.err);
  CHECK(result.status == 0);
  CHECK_THAT(
      result.out,
      Catch::Contains(R"(note: provenance differs: backend device: "an older cpu" -> "cpu")"));
  CHECK_THAT(result.out,
             Catch::Contains(R"(note: provenance differs: platform libc: "glibc 2.0")"));
  CHECK_THAT(result.out, Catch::Contains("verdict: match"));
}

TEST_CASE("kvaudit golden check --accept rewrites a moved golden file and prints what changed",
          "[cli][golden]") {
  const fs::path dir = fresh_dir("golden_cli_accept");
  write_tiny_dump(dir / "tiny.h5");
  const fs::path golden = dir / "tiny.golden.h5";
  record(dir / "tiny.h5", golden);
  const std::string check = "golden check " + quoted(dir / "tiny.h5") + " " + quoted(golden);
  for (const bool by_environment : {false, true}) {
    flip_out_bits(golden, "/steps/S000/L000/out", tiny_out_index(3, 0, 9), 0x4);
    const CommandResult accepted = by_environment
                                       ? run_kvaudit("accept_env", check, "1")
                                       : run_kvaudit("accept_option", check + " --accept");
    INFO(accepted.out << accepted.err);
    CHECK(accepted.status == 0);
    CHECK_THAT(accepted.out,
               Catch::Contains("first moved: step 0 layer 0 out[row 3, head 0, dim 9]") &&
                   Catch::Contains("4 ulp"));
    CHECK_THAT(accepted.out, Catch::Contains("accepted: rewrote " + golden.string()));
    CHECK_THAT(accepted.out, Catch::Contains("verdict: accepted (1 of 6"));
    const CommandResult after = run_kvaudit("after_accept", check);
    CHECK(after.status == 0);
  }
  // Written beside the golden file, renamed into place: nothing else is left in the folder.
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  CHECK(names == std::vector<std::string>{"tiny.golden.h5", "tiny.h5"});
}

TEST_CASE("kvaudit golden check on folders: one summary, one verdict", "[cli][golden]") {
  const fs::path dumps = fresh_dir("golden_cli_folder_dumps");
  const fs::path goldens = fresh_dir("golden_cli_folder_goldens");
  write_tiny_dump(dumps / "clean.h5", 1);
  write_tiny_dump(dumps / "moved.h5", 2);
  const CommandResult recorded =
      run_kvaudit("folder_record", "golden record " + quoted(dumps) + " -o " + quoted(goldens));
  INFO(recorded.out << recorded.err);
  REQUIRE(recorded.status == 0);
  REQUIRE(fs::exists(goldens / "clean.cpu-fp8.golden.h5"));
  REQUIRE(fs::exists(goldens / "moved.cpu-fp8.golden.h5"));
  flip_out_bits(goldens / "moved.cpu-fp8.golden.h5", "/steps/S002/L000/out",
                tiny_out_index(0, 1, 31), 0x1);
  const std::string check = "golden check " + quoted(dumps) + " " + quoted(goldens);

  const CommandResult moved = run_kvaudit("folder_moved", check);
  INFO(moved.out << moved.err);
  CHECK(moved.status == 1);
  CHECK_THAT(moved.out, Catch::Matches(R"([\s\S]*\nclean\.h5 +match +6 +0 +-\n[\s\S]*)"));
  CHECK_THAT(
      moved.out,
      Catch::Matches(
          R"([\s\S]*\nmoved\.h5 +MOVED +6 +1 +step 2 layer 0 out\[row 0, head 1, dim 31\][\s\S]*)"));
  CHECK_THAT(moved.out, Catch::Contains("verdict: MOVED (2 dumps: 1 match, 1 moved,"));

  // A dump without golden file: "missing", bad input; --accept records it (and accepts the move).
  write_tiny_dump(dumps / "new.h5", 3);
  const CommandResult missing = run_kvaudit("folder_missing", check);
  CHECK(missing.status == 2);
  CHECK_THAT(missing.out, Catch::Contains("1 missing"));
  const CommandResult accepted = run_kvaudit("folder_accept", check + " --accept");
  INFO(accepted.out << accepted.err);
  CHECK(accepted.status == 0);
  CHECK_THAT(accepted.out, Catch::Contains("1 accepted, 1 recorded, 0 missing"));
  CHECK(fs::exists(goldens / "new.cpu-fp8.golden.h5"));
  CHECK(run_kvaudit("folder_after", check).status == 0);
}

TEST_CASE("kvaudit golden on one folder holding dumps and golden files", "[cli][golden]") {
  const fs::path dir = fresh_dir("golden_cli_same_folder");
  write_tiny_dump(dir / "a.h5", 1);
  const std::string folder = quoted(dir);
  REQUIRE(run_kvaudit("same_record", "golden record " + folder + " -o " + folder).status == 0);
  REQUIRE(fs::exists(dir / "a.cpu-fp8.golden.h5"));
  // The golden file is not taken for a dump, neither now nor when recording again.
  const CommandResult check = run_kvaudit("same_check", "golden check " + folder + " " + folder);
  INFO(check.out << check.err);
  CHECK(check.status == 0);
  CHECK_THAT(check.out, Catch::Contains("verdict: MATCH (1 dumps: 1 match"));
  CHECK(run_kvaudit("same_record_again", "golden record " + folder + " -o " + folder).status == 0);
  CHECK_FALSE(fs::exists(dir / "a.cpu-fp8.golden.cpu-fp8.golden.h5"));
}

}  // namespace kvaudit

// ---- exec backends (issue 32, item 1) ----------------------------------------------------------

namespace kvaudit {
namespace {

// --backend exec:cpu-fp8 served by this kvaudit itself (`kvaudit backend-serve cpu-fp8`, the
// external backend protocol; tests/cli/test_backend_serve.cpp), with `serve_options` after it.
std::string exec_cpu_fp8(const std::string& serve_options = "") {
  return "--backend exec:cpu-fp8 --backend-command \"'" + std::string(KVAUDIT_BINARY) +
         "' backend-serve cpu-fp8 --threads 2" + serve_options + "\"";
}

}  // namespace

TEST_CASE("kvaudit golden record and check through an exec backend", "[cli][golden][exec]") {
  const fs::path dir = fresh_dir("golden_cli_exec");
  write_tiny_dump(dir / "tiny.h5");
  const fs::path golden = dir / "tiny.exec.golden.h5";
  const std::string dump = quoted(dir / "tiny.h5");
  const CommandResult recorded = run_kvaudit(
      "exec_record", "golden record " + dump + " -o " + quoted(golden) + " " + exec_cpu_fp8());
  INFO(recorded.out << recorded.err);
  REQUIRE(recorded.status == 0);
  CHECK(read_root_string(golden, "backend") == "exec:cpu-fp8");
  const nlohmann::json description =
      nlohmann::json::parse(read_root_string(golden, "backend_description"));
  CHECK(description.dump().find("backend-serve") != std::string::npos);

  SECTION("the same program matches") {
    const CommandResult result = run_kvaudit(
        "exec_match", "golden check " + dump + " " + quoted(golden) + " " + exec_cpu_fp8());
    INFO(result.out << result.err);
    CHECK(result.status == 0);
    CHECK_THAT(result.out, Catch::Contains("verdict: match (0 of 6 (step, layer)s moved; "
                                           "backend exec:cpu-fp8)"));
  }
  SECTION("a program planted with a read fault moves, and the element is named") {
    const CommandResult result =
        run_kvaudit("exec_moved", "golden check " + dump + " " + quoted(golden) + " " +
                                      exec_cpu_fp8(" --inject scale-mismatch"));
    INFO(result.out << result.err);
    CHECK(result.status == 1);
    CHECK_THAT(result.out, Catch::Contains("first moved: step 0 layer 0 out[row "));
    CHECK_THAT(result.out, Catch::Contains("verdict: MOVED"));
  }
  SECTION("the golden file of the built-in cpu-fp8 matches the program serving it") {
    const fs::path builtin = dir / "tiny.cpu-fp8.golden.h5";
    record(dir / "tiny.h5", builtin);
    const CommandResult result = run_kvaudit(
        "exec_builtin", "golden check " + dump + " " + quoted(builtin) + " " + exec_cpu_fp8());
    INFO(result.out << result.err);
    CHECK(result.status == 0);
    CHECK_THAT(result.out,
               Catch::Contains("note: provenance differs: backend: cpu-fp8 -> exec:cpu-fp8"));
    CHECK_THAT(result.out, Catch::Contains("verdict: match"));
  }
  SECTION("--backend-command without exec:NAME, and --inject with it, are bad input") {
    const CommandResult command = run_kvaudit(
        "exec_bad_command", "golden check " + dump + " " + quoted(golden) +
                                " --backend cpu-fp8 --backend-command 'kvaudit backend-serve'");
    CHECK(command.status == 2);
    CHECK_THAT(command.err, Catch::Contains("kvaudit: --backend-command: starts an exec:NAME "
                                            "backend; --backend is cpu-fp8"));
    const CommandResult inject = run_kvaudit(
        "exec_bad_inject", "golden record " + dump + " -o " + quoted(dir / "other.golden.h5") +
                               " " + exec_cpu_fp8() + " --inject scale-mismatch");
    CHECK(inject.status == 2);
    CHECK_THAT(inject.err, Catch::Contains("kvaudit: --inject: injections are for the built-in"));
    CHECK_FALSE(fs::exists(dir / "other.golden.h5"));
  }
}

TEST_CASE("kvaudit golden on folders through an exec backend: exec:NAME is exec-NAME in names",
          "[cli][golden][exec]") {
  const fs::path dir = fresh_dir("golden_cli_exec_folder");
  fs::create_directories(dir / "dumps");
  write_tiny_dump(dir / "dumps" / "tiny.h5");
  const CommandResult recorded =
      run_kvaudit("exec_folder_record", "golden record " + quoted(dir / "dumps") + " -o " +
                                            quoted(dir / "golden") + " " + exec_cpu_fp8());
  INFO(recorded.out << recorded.err);
  REQUIRE(recorded.status == 0);
  CHECK(fs::exists(dir / "golden" / "tiny.exec-cpu-fp8.golden.h5"));
  const CommandResult checked =
      run_kvaudit("exec_folder_check", "golden check " + quoted(dir / "dumps") + " " +
                                           quoted(dir / "golden") + " " + exec_cpu_fp8());
  INFO(checked.out << checked.err);
  CHECK(checked.status == 0);
  CHECK_THAT(checked.out, Catch::Contains("verdict: MATCH (1 dumps: 1 match"));
  CHECK_THAT(checked.out, !Catch::Contains("has no dump"));
}

// ---- provenance from a dirty tree, unwritten slots in digest storage (issue 32, item 4) ---------

TEST_CASE("kvaudit golden check: a golden file recorded from a dirty tree is flagged",
          "[cli][golden]") {
  const fs::path dir = fresh_dir("golden_cli_dirty");
  write_tiny_dump(dir / "tiny.h5");
  const fs::path golden = dir / "tiny.golden.h5";
  record(dir / "tiny.h5", golden);
  const std::string check = "golden check " + quoted(dir / "tiny.h5") + " " + quoted(golden);
  const std::string warning =
      "warning: the golden file was recorded by a kvaudit built from a dirty tree (revision "
      "0123456789ab-dirty)";
  SECTION("a revision that ends in -dirty, as every golden file records it") {
    write_root_string(golden, "kvaudit_revision", "0123456789ab-dirty");
    const CommandResult result = run_kvaudit("dirty_revision", check);
    INFO(result.out << result.err);
    CHECK(result.status == 0);  // flagged, not failed: the outputs still match
    CHECK_THAT(result.out, Catch::Contains(warning));
  }
  SECTION("the kvaudit_dirty flag") {
    write_root_string(golden, "kvaudit_revision", "0123456789ab");
    const hid_t file = H5Fopen(golden.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    REQUIRE(file >= 0);
    if (H5Aexists(file, "kvaudit_dirty") > 0) {
      REQUIRE(H5Adelete_by_name(file, "/", "kvaudit_dirty", H5P_DEFAULT) >= 0);
    }
    const hid_t space = H5Screate(H5S_SCALAR);
    const hid_t attribute = H5Acreate_by_name(file, "/", "kvaudit_dirty", H5T_STD_I64LE, space,
                                              H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    const std::int64_t one = 1;
    REQUIRE(H5Awrite(attribute, H5T_NATIVE_INT64, &one) >= 0);
    H5Aclose(attribute);
    H5Sclose(space);
    REQUIRE(H5Fclose(file) >= 0);
    const CommandResult result = run_kvaudit("dirty_flag", check);
    INFO(result.out << result.err);
    CHECK(result.status == 0);
    CHECK_THAT(result.out, Catch::Contains("warning: the golden file was recorded by a kvaudit "
                                           "built from a dirty tree (revision 0123456789ab)"));
  }
}

TEST_CASE("kvaudit golden check: digest storage still notes moved unwritten slots",
          "[cli][golden]") {
  const fs::path dir = fresh_dir("golden_cli_unwritten");
  write_tiny_dump(dir / "tiny.h5");
  const fs::path golden = dir / "tiny.golden.h5";
  const CommandResult recorded =
      run_kvaudit("unwritten_record", "golden record " + quoted(dir / "tiny.h5") + " -o " +
                                          quoted(golden) + " --whole-pool-max-bytes 0 --threads 2");
  INFO(recorded.out << recorded.err);
  REQUIRE(recorded.status == 0);
  CHECK_THAT(recorded.out, Catch::Contains("pools as SHA-256 + written rows"));
  // Each write lands in slot + 1: written rows move, and so does a slot the step did not write
  // (the one after the last row written), which digest storage holds only in its SHA-256.
  const CommandResult result =
      run_kvaudit("unwritten_check", "golden check " + quoted(dir / "tiny.h5") + " " +
                                         quoted(golden) + " --inject neighbour-slot-write");
  INFO(result.out << result.err);
  CHECK(result.status == 1);
  CHECK_THAT(result.out, Catch::Contains("first moved: step 0 layer 0 pool[slot "));
  CHECK_THAT(result.out, Catch::Contains("note: step 0 layer 0: pool slots the step did not write "
                                         "moved (digest storage keeps only their SHA-256"));
  CHECK_THAT(result.out, Catch::Contains("+ unwritten slots (digest)"));
}

}  // namespace kvaudit
