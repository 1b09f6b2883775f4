// Output paths and atomic outputs (src/core/output_file.hpp): the checks every command makes before
// any work (a missing folder, a directory where a file is expected, a file where a directory is
// expected, a folder nothing can be created in, an empty path), and the temporaries that become
// the output only on commit(): nothing at the final path before, the old file untouched and no
// temporary left when a writer is abandoned, a plain file's permissions after the rename.
#include <sys/stat.h>

#include <catch2/catch.hpp>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

#include "src/core/output_file.hpp"
#include "tests/test_paths.hpp"

namespace kvaudit {
namespace {

namespace fs = std::filesystem;

// A fresh, empty folder for the running test case.
fs::path case_dir() {
  std::string name = Catch::getResultCapture().getCurrentTestName();
  for (char& c : name) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '-';
  }
  const fs::path dir = kvaudit_test::test_tmpdir() / "output_file" / name.substr(0, 60);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

std::vector<std::string> entries(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename());
  std::sort(names.begin(), names.end());
  return names;
}

std::string message_of(const Status& status) {
  return status.ok() ? std::string("ok") : status.error().message();
}

mode_t umask_now() {
  const mode_t mask = umask(022);
  umask(mask);
  return mask;
}

TEST_CASE("validate_output_path refuses what could not be written, naming option and path",
          "[output]") {
  const fs::path dir = case_dir();
  std::ofstream(dir / "file.txt") << "x";
  fs::create_directories(dir / "folder");

  CHECK(message_of(validate_output_path(dir / "missing" / "r.json", OutputKind::kFile, "--json")) ==
        "--json " + (dir / "missing" / "r.json").string() + ": folder " +
            (dir / "missing").string() + " does not exist");
  CHECK(message_of(validate_output_path(dir / "folder", OutputKind::kFile, "--json")) ==
        "--json " + (dir / "folder").string() + ": is a directory; expected a file");
  CHECK(message_of(validate_output_path(dir / "file.txt" / "r.json", OutputKind::kFile, "--out")) ==
        "--out " + (dir / "file.txt" / "r.json").string() + ": " + (dir / "file.txt").string() +
            " is not a folder");
  CHECK(message_of(validate_output_path(dir / "file.txt", OutputKind::kDirectory, "--report")) ==
        "--report " + (dir / "file.txt").string() + ": exists and is not a directory");
  CHECK(message_of(validate_output_path("", OutputKind::kFile, "--json")) ==
        "--json: the FILE path is empty");
  // /proc exists and is a folder, but no file can be created in it, even by root.
  const Status proc = validate_output_path("/proc/nope", OutputKind::kDirectory, "--report");
  REQUIRE_FALSE(proc.ok());
  CHECK(proc.error().message().rfind("--report /proc/nope: cannot create files in /proc", 0) == 0);

  CHECK(validate_output_path(dir / "new.json", OutputKind::kFile, "--json").ok());
  CHECK(validate_output_path(dir / "file.txt", OutputKind::kFile, "--json").ok());  // replaced
  CHECK(validate_output_path(dir / "a" / "b" / "report", OutputKind::kDirectory, "--report").ok());
  CHECK(validate_output_path("/dev/null", OutputKind::kFile, "--json").ok());
  CHECK(entries(dir) == std::vector<std::string>{"file.txt", "folder"});  // the probes are gone
}

TEST_CASE("AtomicOutputFile: the file appears on commit, never half-written", "[output]") {
  const fs::path dir = case_dir();
  const fs::path path = dir / "out.json";

  SECTION("commit renames the temporary, with a plain file's permissions") {
    auto file = AtomicOutputFile::create(path, "--json");
    REQUIRE(file.ok());
    REQUIRE(file->write("{}\n").ok());
    CHECK_FALSE(fs::exists(path));
    CHECK(fs::exists(file->temp_path()));
    CHECK(file->temp_path().parent_path() == dir);
    REQUIRE(file->commit().ok());
    CHECK(read_text(path) == "{}\n");
    CHECK(entries(dir) == std::vector<std::string>{"out.json"});
    struct stat info {};
    REQUIRE(stat(path.c_str(), &info) == 0);
    CHECK((info.st_mode & 0777) == (0666 & ~umask_now()));
  }
  SECTION("abandoned: no file, no temporary, an existing file unchanged") {
    std::ofstream(path) << "old";
    {
      auto file = AtomicOutputFile::create(path, "--json");
      REQUIRE(file.ok());
      REQUIRE(file->write("new").ok());
    }
    CHECK(read_text(path) == "old");
    CHECK(entries(dir) == std::vector<std::string>{"out.json"});
  }
  SECTION("moved: the temporary belongs to the new owner only") {
    std::optional<AtomicOutputFile> kept;
    {
      auto file = AtomicOutputFile::create(path, "--json");
      REQUIRE(file.ok());
      kept.emplace(std::move(*file));
    }
    REQUIRE(kept->write("moved").ok());
    REQUIRE(kept->commit().ok());
    CHECK(read_text(path) == "moved");
  }
  SECTION("a device is written in place") {
    auto file = AtomicOutputFile::create("/dev/null", "--json");
    REQUIRE(file.ok());
    CHECK(file->temp_path() == "/dev/null");
    CHECK(file->write("discarded").ok());
    CHECK(file->commit().ok());
  }
  SECTION("a bad path is refused at create") {
    auto file = AtomicOutputFile::create(dir / "missing" / "out.json", "--json");
    REQUIRE_FALSE(file.ok());
    CHECK(file.error().where == "--json " + (dir / "missing" / "out.json").string());
  }
}

TEST_CASE("AtomicOutputDirectory: staged, then created or merged on commit", "[output]") {
  const fs::path dir = case_dir();

  SECTION("a new directory, its parents created at commit") {
    const fs::path report = dir / "a" / "b" / "report";
    auto out = AtomicOutputDirectory::create(report, "--report");
    REQUIRE(out.ok());
    std::ofstream(out->staging_path() / "report.json") << "{}";
    CHECK_FALSE(fs::exists(dir / "a"));
    REQUIRE(out->commit().ok());
    CHECK(read_text(report / "report.json") == "{}");
    CHECK(entries(dir) == std::vector<std::string>{"a"});
  }
  SECTION("an existing directory keeps its other files; namesakes are replaced") {
    const fs::path report = dir / "report";
    fs::create_directories(report / "assets");
    std::ofstream(report / "notes.txt") << "mine";
    std::ofstream(report / "report.json") << "old";
    std::ofstream(report / "assets" / "old.css") << "old";
    auto out = AtomicOutputDirectory::create(report, "--report");
    REQUIRE(out.ok());
    std::ofstream(out->staging_path() / "report.json") << "new";
    fs::create_directories(out->staging_path() / "assets");
    std::ofstream(out->staging_path() / "assets" / "style.css") << "css";
    REQUIRE(message_of(out->commit()) == "ok");
    CHECK(read_text(report / "report.json") == "new");
    CHECK(read_text(report / "notes.txt") == "mine");
    CHECK(read_text(report / "assets" / "old.css") == "old");
    CHECK(read_text(report / "assets" / "style.css") == "css");
    CHECK(entries(dir) == std::vector<std::string>{"report"});
  }
  SECTION("abandoned: nothing is left") {
    {
      auto out = AtomicOutputDirectory::create(dir / "report", "--report");
      REQUIRE(out.ok());
      std::ofstream(out->staging_path() / "report.json") << "{}";
    }
    CHECK(entries(dir).empty());
  }
}

}  // namespace
}  // namespace kvaudit
