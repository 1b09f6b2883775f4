// The command line's conventions (src/cli/cli.hpp), end to end through the kvaudit binary:
//   - every error is one line on stderr starting "kvaudit: ", CLI11's own included, exit 2;
//     numeric options say their range plainly; a mistyped command or option gets a suggestion;
//     `kvaudit help [COMMAND]` works; an option given an empty value is refused;
//   - help is wrapped to the terminal (COLUMNS), every command states its exit statuses, file and
//     directory options show as FILE / DIR;
//   - every output path is checked before any work (nothing printed, exit 2), and a command that
//     fails leaves no output and no temporary behind (an existing file stays as it was);
//   - sizes a machine cannot hold are refused before allocating, with the size needed.
// The commands listed by `kvaudit help` are all checked, so a command added later is held to the
// same rules.
#include <sys/wait.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "tests/test_paths.hpp"

namespace {

namespace fs = std::filesystem;

struct Run {
  int status = -1;
  std::string out;
  std::string err;
};

fs::path case_dir() {
  std::string name = Catch::getResultCapture().getCurrentTestName();
  for (char& c : name) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '-';
  }
  const fs::path dir = kvaudit_test::test_tmpdir() / "cli_conventions" / name.substr(0, 60);
  fs::create_directories(dir);
  return dir;
}

// A fresh, empty folder for outputs.
fs::path empty_dir(const std::string& name) {
  const fs::path dir = case_dir() / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

// `env kvaudit args`, its exit status, stdout and stderr.
Run kvaudit(const std::string& args, const std::string& env = "") {
  const fs::path dir = case_dir();
  const fs::path out = dir / "run.out";
  const fs::path err = dir / "run.err";
  const std::string command = env + " '" + kvaudit_test::kvaudit_binary().string() + "' " + args +
                              " > '" + out.string() + "' 2> '" + err.string() + "'";
  const int raw = std::system(command.c_str());
  Run run;
  run.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  run.out = read_text(out);
  run.err = read_text(err);
  return run;
}

std::string dump(const std::string& name = "glm5_page1.h5") {
  return "'" + (kvaudit_test::source_dir() / "datasets" / name).string() + "'";
}

// Exit 2 with exactly `line` on stderr and nothing on stdout.
void check_usage_error(const Run& run, const std::string& line) {
  INFO("stderr: " << run.err << "stdout: " << run.out.substr(0, 300));
  CHECK(run.status == 2);
  CHECK(run.err == line + "\n");
  CHECK(run.out.empty());
}

// One line on stderr starting "kvaudit: ", exit 2, nothing on stdout.
void check_one_line_error(const Run& run) {
  INFO("stderr: " << run.err << "stdout: " << run.out.substr(0, 300));
  CHECK(run.status == 2);
  CHECK(run.err.rfind("kvaudit: ", 0) == 0);
  CHECK(std::count(run.err.begin(), run.err.end(), '\n') == 1);
  CHECK(run.out.empty());
}

// The commands `kvaudit help` lists (the lines under "Commands:").
std::vector<std::string> listed_commands() {
  const Run run = kvaudit("help", "COLUMNS=100");
  REQUIRE(run.status == 0);
  std::vector<std::string> commands;
  std::istringstream lines(run.out);
  std::string line;
  bool in_list = false;
  while (std::getline(lines, line)) {
    if (line == "Commands:") {
      in_list = true;
    } else if (in_list && line.rfind("  ", 0) == 0 && line.size() > 2 && line[2] != ' ') {
      commands.push_back(line.substr(2, line.find(' ', 2) - 2));
    } else if (in_list && line.empty()) {
      in_list = false;
    }
  }
  return commands;
}

std::vector<std::string> entries(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename());
  std::sort(names.begin(), names.end());
  return names;
}

TEST_CASE("option errors: one plain line, exit 2", "[cli]") {
  check_usage_error(kvaudit("check " + dump() + " --threads -1"),
                    "kvaudit: check --threads: '-1' is not an integer from 0 to 1024");
  check_usage_error(kvaudit("check " + dump() + " --threads abc"),
                    "kvaudit: check --threads: 'abc' is not an integer from 0 to 1024");
  check_usage_error(kvaudit("check " + dump() + " --threads 1000000000"),
                    "kvaudit: check --threads: '1000000000' is not an integer from 0 to 1024");
  check_usage_error(kvaudit("check " + dump() + " --threads"),
                    "kvaudit: check --threads: needs a value");
  check_usage_error(kvaudit("check " + dump() + " --steps ''"),
                    "kvaudit: check --steps: the value is empty");
  check_usage_error(kvaudit("check " + dump() + " --layers ''"),
                    "kvaudit: check --layers: the value is empty");
  check_usage_error(kvaudit("check"),
                    "kvaudit: check: DUMP is required (unless --list-injections is given)");
  check_usage_error(kvaudit("info"), "kvaudit: info: DUMP is required");
  check_usage_error(kvaudit("info ''"), "kvaudit: info DUMP: the value is empty");
  check_usage_error(kvaudit("synth"), "kvaudit: synth: --out is required");
  check_usage_error(kvaudit("bench --cpu-only --gpu-only"),
                    "kvaudit: bench: --cpu-only excludes --gpu-only");
  check_usage_error(kvaudit("bench --cpu-threads 5000"),
                    "kvaudit: bench --cpu-threads: '5000' is not an integer from 0 to 1024");
  check_usage_error(kvaudit("synth --out x.h5 --sm-scale nan"),
                    "kvaudit: synth --sm-scale: 'nan' is not a number from 1e-30 to 1e+30");

  const Run backend = kvaudit("check " + dump() + " --backend nosuch");
  check_one_line_error(backend);
  CHECK_THAT(backend.err, Catch::Matchers::Contains("unknown backend 'nosuch'"));
  CHECK_THAT(backend.err, Catch::Matchers::Contains(", none;"));

  const fs::path empty = case_dir() / "empty.h5";
  std::ofstream(empty).close();
  check_usage_error(kvaudit("info '" + empty.string() + "'"),
                    "kvaudit: " + empty.string() + ": is empty (0 bytes), not an HDF5 file");
}

TEST_CASE("a mistyped command or option gets a suggestion - kvaudit help [COMMAND]", "[cli]") {
  const Run typo = kvaudit("chek x.h5");
  check_one_line_error(typo);
  CHECK(typo.err.rfind("kvaudit: unknown command 'chek' (did you mean check?); commands: ", 0) ==
        0);
  check_one_line_error(kvaudit(""));
  check_usage_error(kvaudit("check " + dump() + " --tread 3"),
                    "kvaudit: check: unknown option --tread (did you mean --threads?)");
  check_usage_error(kvaudit("info " + dump() + " extra"),
                    "kvaudit: info: unexpected argument 'extra'");

  const Run help = kvaudit("help", "COLUMNS=100");
  CHECK(help.status == 0);
  CHECK(help.err.empty());
  const std::vector<std::string> commands = listed_commands();
  for (const char* name : {"info", "synth", "check", "bench", "help"}) {
    CHECK(std::find(commands.begin(), commands.end(), name) != commands.end());
  }
  const Run help_check = kvaudit("help check", "COLUMNS=100");
  CHECK(help_check.status == 0);
  CHECK(help_check.out == kvaudit("check --help", "COLUMNS=100").out);
  CHECK_THAT(help_check.out, Catch::Matchers::Contains("Usage: kvaudit check"));
  const Run unknown = kvaudit("help chekc");
  check_one_line_error(unknown);
  CHECK(unknown.err.rfind("kvaudit: unknown command 'chekc' (did you mean check?)", 0) == 0);
}

TEST_CASE("help: wrapped to COLUMNS, exit statuses stated, FILE and DIR shown", "[cli]") {
  const std::vector<std::string> commands = listed_commands();
  REQUIRE(commands.size() >= 5);
  for (const int width : {60, 80, 120}) {
    std::vector<std::string> pages = {""};
    for (const std::string& command : commands) pages.push_back(command);
    for (const std::string& page : pages) {
      const Run run = kvaudit("help " + page, "COLUMNS=" + std::to_string(width));
      INFO("kvaudit help " << page << " at " << width << " columns");
      REQUIRE(run.status == 0);
      CHECK_THAT(run.out, Catch::Matchers::Contains("Exit status"));
      std::istringstream lines(run.out);
      std::string line;
      while (std::getline(lines, line)) {
        INFO(line);
        CHECK(line.size() <= static_cast<std::size_t>(width));
      }
    }
  }
  const std::string check = kvaudit("help check").out;
  for (const char* option : {"--json FILE", "--report DIR", "--save-outputs FILE",
                             "--emit-repro FILE", "--policy FILE"}) {
    CHECK_THAT(check, Catch::Matchers::Contains(option));
  }
  CHECK_THAT(kvaudit("help synth").out, Catch::Matchers::Contains("--out FILE"));
  CHECK_THAT(kvaudit("help bench").out, Catch::Matchers::Contains("--json FILE"));
  // Without a terminal and without COLUMNS: 80 columns.
  std::istringstream lines(kvaudit("help check", "env -u COLUMNS").out);
  std::string line;
  while (std::getline(lines, line)) CHECK(line.size() <= 80);
}

TEST_CASE("output paths are checked before any work", "[cli]") {
  const fs::path dir = empty_dir("outputs");
  check_usage_error(kvaudit("check " + dump() + " --report /proc/nope"),
                    "kvaudit: --report /proc/nope: cannot create files in /proc: No such file or "
                    "directory");
  check_usage_error(kvaudit("check " + dump() + " --json /nonexistent/dir/r.json"),
                    "kvaudit: --json /nonexistent/dir/r.json: folder /nonexistent/dir does not "
                    "exist");
  check_usage_error(
      kvaudit("check " + dump() + " --save-outputs '" + dir.string() + "'"),
      "kvaudit: --save-outputs " + dir.string() + ": is a directory; expected a file");
  // A failing run (exit 1) with a bad --emit-repro path: refused before the replay, not after.
  check_usage_error(kvaudit("check " + dump() +
                            " --inject scale-mismatch --emit-repro "
                            "/nonexistent/repro.h5"),
                    "kvaudit: --emit-repro /nonexistent/repro.h5: folder /nonexistent does not "
                    "exist");
  check_usage_error(kvaudit("check " + dump() + " --json '" + (dir / "r").string() +
                            "' --report '" + (dir / "r").string() + "'"),
                    "kvaudit: --report " + (dir / "r").string() + ": is also the path of --json");
  check_usage_error(kvaudit("check " + dump() + " --emit-repro " + dump()),
                    "kvaudit: --emit-repro " +
                        (kvaudit_test::source_dir() / "datasets" / "glm5_page1.h5").string() +
                        ": is the input DUMP; write elsewhere");
  check_one_line_error(kvaudit("bench --quick --cpu-only --json /nonexistent/b.json"));
  check_one_line_error(kvaudit("synth --out /nonexistent/t.h5"));
  CHECK(entries(dir).empty());
}

TEST_CASE("a command that fails writes nothing - one that succeeds writes every output", "[cli]") {
  const fs::path dir = empty_dir("outputs");
  const std::string json = "'" + (dir / "r.json").string() + "'";
  const std::string outputs = " --json " + json + " --report '" + (dir / "report").string() +
                              "' --save-outputs '" + (dir / "saved.h5").string() +
                              "' --emit-repro '" + (dir / "repro.h5").string() + "'";
  SECTION("a layer that is not in the dump") {
    std::ofstream(dir / "r.json") << "old";
    check_one_line_error(kvaudit("check " + dump() + " --layers 99" + outputs));
    CHECK(entries(dir) == std::vector<std::string>{"r.json"});
    CHECK(read_text(dir / "r.json") == "old");
  }
  SECTION("a passing run: reports and saved outputs, no repro, no temporary") {
    const Run run = kvaudit("check " + dump() + " --layers 0 --steps 0 --threads 2" + outputs);
    INFO(run.err);
    CHECK(run.status == 0);
    CHECK(entries(dir) == std::vector<std::string>{"r.json", "report", "saved.h5"});
    const std::vector<std::string> report = entries(dir / "report");  // report.html may follow
    CHECK(std::find(report.begin(), report.end(), "report.json") != report.end());
    CHECK(std::find(report.begin(), report.end(), "report.md") != report.end());
    CHECK(std::none_of(report.begin(), report.end(),
                       [](const std::string& name) { return name[0] == '.'; }));
  }
}

TEST_CASE("sizes the machine cannot hold are refused before allocating", "[cli][synth]") {
  const fs::path dir = empty_dir("synth");
  const std::string out = " --out '" + (dir / "t.h5").string() + "'";
  // Absurd on any machine: the plan alone would need thousands of TiB.
  for (const char* options : {" --decode-steps 100000000", " --prefix-lens 100000000",
                              " --prefix-lens 0 --prefill-tokens 2000000000"}) {
    const Run run = kvaudit("synth" + out + options);
    check_one_line_error(run);
    CHECK(run.err.rfind("kvaudit: synth: needs about ", 0) == 0);
    CHECK_THAT(run.err, Catch::Matchers::Contains("of memory ("));
  }
  // Large, refused against a budget of 1 GiB (the test does not depend on this machine's memory).
  const Run heads = kvaudit("synth" + out + " --heads 100000", "KVAUDIT_MEMORY_BUDGET=1G");
  check_one_line_error(heads);
  CHECK_THAT(heads.err, Catch::Matchers::Contains("25 query rows of 100000 heads); 1 GiB is "
                                                  "available"));
  CHECK(entries(dir).empty());
  // check: a dump whose layer cannot be held is refused before the replay (no table printed).
  const Run check = kvaudit("check " + dump(), "KVAUDIT_MEMORY_BUDGET=64K");
  check_one_line_error(check);
  CHECK(check.err.rfind("kvaudit: check: needs about ", 0) == 0);
  // It names the layer that needs the most, and what is read and computed for it.
  CHECK_THAT(check.err, Catch::Matchers::Contains("of memory (layer L"));
  CHECK_THAT(check.err, Catch::Matchers::Contains("read from the dump and"));
  // bench: the CPU reference's case.
  const Run bench = kvaudit("bench --cpu-only --cpu-batch 65536 --cpu-context 16777216");
  check_one_line_error(bench);
  CHECK(bench.err.rfind("kvaudit: bench: needs about ", 0) == 0);
  // The same budget lets a small trace through.
  const Run small = kvaudit("synth" + out + " --heads 2 --kv-lora-rank 16 --rope-dim 8",
                            "KVAUDIT_MEMORY_BUDGET=1G");
  CHECK(small.status == 0);
  CHECK(entries(dir) == std::vector<std::string>{"t.h5"});
}

}  // namespace
