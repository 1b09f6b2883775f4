// The runner's skips (tests/test_main.cpp, tests/prerequisites.hpp), through this test binary run
// as a child: a case whose prerequisite is missing is reported skipped, by name, whatever the
// selection, and never counted as passed; the exit status is 77 when nothing else was selected.
// The children run with CUDA_VISIBLE_DEVICES= (no device visible, on a GPU machine too) and
// KVAUDIT_PYTHON pointing nowhere, so the [gpu] and [torch] prerequisites are missing everywhere.
// Also the test-spec rewriting the runner relies on, judged by Catch2's own parser.
#include <sys/wait.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <filesystem>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "tests/runner/spec_filters.hpp"
#include "tests/test_paths.hpp"

namespace {

struct ChildRun {
  int status = -1;
  std::string output;  // stdout and stderr
};

std::string self() { return std::filesystem::read_symlink("/proc/self/exe").string(); }

// This binary with `arguments` (already shell-quoted) under `environment`.
ChildRun run_self(const std::string& environment, const std::string& arguments) {
  const std::string command =
      "env -u KVAUDIT_TORCH_ADAPTER -u KVAUDIT_REQUIRE CUDA_VISIBLE_DEVICES= "
      "KVAUDIT_PYTHON=/nonexistent/python " +
      environment + " '" + self() + "' " + arguments + " 2>&1";
  ChildRun run;
  if (FILE* pipe = popen(command.c_str(), "r")) {
    char buffer[4096];
    for (std::size_t n; (n = std::fread(buffer, 1, sizeof buffer, pipe)) > 0;) {
      run.output.append(buffer, n);
    }
    const int status = pclose(pipe);
    run.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
  return run;
}

// The names a selection lists (Catch2's --list-test-names-only: one per line).
std::vector<std::string> listed(const std::string& selection) {
  std::vector<std::string> names;
  std::istringstream lines(run_self("", "--list-test-names-only " + selection).output);
  for (std::string line; std::getline(lines, line);) {
    if (!line.empty()) names.push_back(line);
  }
  return names;
}

std::string count_line(std::size_t count, const std::string& reason_start) {
  return std::to_string(count) + (count == 1 ? " test case" : " test cases") + " skipped (" +
         reason_start;
}

void check_each_named_skipped(const ChildRun& run, const std::vector<std::string>& names,
                              const std::string& reason_start) {
  for (const std::string& name : names) {
    INFO(name);
    CHECK(run.output.find("SKIPPED: " + name + " (" + reason_start) != std::string::npos);
  }
}

TEST_CASE("runner: without a CUDA device, [gpu]~[injection] reports every case skipped",
          "[runner]") {
  // The selection scripts/gpu-verify.sh runs under compute-sanitizer.
  const std::vector<std::string> gpu_cases = listed("'[gpu]~[injection]'");
  REQUIRE_FALSE(gpu_cases.empty());
  const ChildRun run = run_self("", "'[gpu]~[injection]'");
  INFO(run.output);
  CHECK(run.status == 77);
  check_each_named_skipped(run, gpu_cases, "no ");
  CHECK(run.output.find(count_line(gpu_cases.size(), "no ")) != std::string::npos);
  CHECK(run.output.find("passed") == std::string::npos);
  CHECK(run.output.find("assertions") == std::string::npos);
}

TEST_CASE("runner: a selection of [gpu] and other cases runs the others and skips the [gpu] ones",
          "[runner]") {
  const std::vector<std::string> gpu_cases = listed("'[gpu]'");
  REQUIRE_FALSE(gpu_cases.empty());
  // Comma: alternatives, so every [gpu] case is selected along with the two spec cases.
  const ChildRun run = run_self("", "'[gpu],[runner-spec]'");
  INFO(run.output);
  CHECK(run.status == 0);
  check_each_named_skipped(run, gpu_cases, "no ");
  CHECK(run.output.find(count_line(gpu_cases.size(), "no ")) != std::string::npos);
  CHECK(run.output.find("in 2 test cases)") != std::string::npos);  // "All tests passed (N ...)"
  // A filter left with nothing to run is dropped, not reported as matching no test case.
  CHECK(run.output.find("No test cases matched") == std::string::npos);
}

TEST_CASE("runner: the torch adapter's cases are reported skipped where the venv is missing",
          "[runner]") {
  const std::vector<std::string> torch_cases = listed("'exec torch adapter: *'");
  REQUIRE(torch_cases.size() >= 4);
  const ChildRun run = run_self("", "'exec torch adapter: *'");
  INFO(run.output);
  CHECK(run.status == 77);
  check_each_named_skipped(run, torch_cases, "/nonexistent/python does not exist");
  CHECK(run.output.find(count_line(torch_cases.size(), "/nonexistent/python does not exist")) !=
        std::string::npos);
  CHECK(run.output.find("passed") == std::string::npos);
}

TEST_CASE("runner: a prerequisite KVAUDIT_REQUIRE names fails its cases where it is missing",
          "[runner]") {
  // CI installs torch and sets KVAUDIT_REQUIRE=torch: an install that broke must fail the run,
  // not skip what it was meant to test. Other missing prerequisites still skip.
  const ChildRun torch = run_self("KVAUDIT_REQUIRE=torch", "'exec torch adapter: *'");
  INFO(torch.output);
  CHECK(torch.status == 1);
  CHECK(torch.output.find("its prerequisite [torch] is required here (KVAUDIT_REQUIRE) but "
                          "missing: /nonexistent/python does not exist") != std::string::npos);
  const ChildRun gpu = run_self("KVAUDIT_REQUIRE=torch", "'[gpu]~[injection]'");
  INFO(gpu.output);
  CHECK(gpu.status == 77);
  const ChildRun both = run_self("KVAUDIT_REQUIRE=' Torch , gpu'", "'[gpu]~[injection]'");
  INFO(both.output);
  CHECK(both.status == 1);
  CHECK(both.output.find("its prerequisite [gpu] is required here") != std::string::npos);
}

TEST_CASE("runner: an option missing from the adapter's help text fails, it does not skip",
          "[runner]") {
  const std::string fake =
      (kvaudit_test::source_dir() / "tests" / "python" / "fakes" / "torch_adapter_help.sh")
          .string();
  const std::string help_case =
      "'exec torch adapter: kvaudit'\"'\"'s and the adapter'\"'\"'s help name every option these "
      "cases pass'";
  REQUIRE(listed(help_case).size() == 1);
  const ChildRun current = run_self("KVAUDIT_TORCH_ADAPTER='sh " + fake + " current'", help_case);
  INFO(current.output);
  CHECK(current.status == 0);
  const ChildRun stale =
      run_self("KVAUDIT_TORCH_ADAPTER='sh " + fake + " without-fault'", help_case);
  INFO(stale.output);
  CHECK(stale.status != 0);
  CHECK(stale.status != 77);
  CHECK(stale.output.find("the torch adapter's --help does not mention --fault") !=
        std::string::npos);
}

TEST_CASE("runner: a selection that matches no test case fails, it does not pass", "[runner]") {
  const ChildRun run = run_self("", "'no test case has this name'");
  INFO(run.output);
  CHECK(run.status == 2);
  CHECK(run.output.find("the selection matches no test case: 'no test case has this name'") !=
        std::string::npos);
}

TEST_CASE("runner: every test case name is one CTest name (no semicolon: CMake splits lists on it)",
          "[runner]") {
  // catch_discover_tests makes a CTest entry per name, and CMake lists split at ';': a name
  // holding one became two entries that each selected nothing and passed.
  for (const Catch::TestCase& test :
       Catch::getAllTestCasesSorted(*Catch::getCurrentContext().getConfig())) {
    INFO(test.name);
    CHECK(test.name.find(';') == std::string::npos);
  }
}

// ---- the spec rewriting, against Catch2's own parser -----------------------------------------

std::set<std::string> selected(const std::vector<std::string>& args) {
  return kvaudit_test::names_selected_by(args, *Catch::getCurrentContext().getConfig());
}

bool has_tag(const std::string& name, const std::string& tag) {
  const Catch::IConfig& config = *Catch::getCurrentContext().getConfig();
  for (const Catch::TestCase& test : Catch::getAllTestCasesSorted(config)) {
    if (test.name == name) {
      for (const std::string& t : test.lcaseTags) {
        if (t == tag) return true;
      }
    }
  }
  return false;
}

TEST_CASE("runner: taking a tag out of a test spec keeps every filter's meaning", "[runner-spec]") {
  const std::vector<std::vector<std::string>> specs = {
      {"[gpu]~[injection]"},
      {"[gpu],[runner]"},
      {"[kvdump]", "[v1.1]"},  // two arguments: one filter, both patterns apply
      {"[gpu],", "[runner]"},  // a comma at an argument's end
      {"\"runner: *\",[gpu]~[reference]", "[gpu]"},
      {"runner: *"},
      {"[.],[gpu]"},
      {"~[gpu]", "exclude:[runner]"},
  };
  for (const std::vector<std::string>& spec : specs) {
    std::set<std::string> expected;
    for (const std::string& name : selected(spec)) {
      if (!has_tag(name, "gpu")) expected.insert(name);
    }
    const auto rewritten =
        kvaudit_test::join_spec_filters(kvaudit_test::split_spec_filters(spec), {"gpu"});
    INFO(Catch::Detail::stringify(spec) << " -> " << Catch::Detail::stringify(rewritten));
    CHECK(selected(rewritten) == expected);
  }
  // No spec: every case that is not hidden ([.]) and not [gpu].
  std::set<std::string> expected;
  const Catch::IConfig& config = *Catch::getCurrentContext().getConfig();
  for (const Catch::TestCase& test : Catch::getAllTestCasesSorted(config)) {
    if (!test.isHidden() && !has_tag(test.name, "gpu")) expected.insert(test.name);
  }
  REQUIRE(expected.size() > 100);
  CHECK(selected(kvaudit_test::join_spec_filters({}, {"gpu"})) == expected);
}

TEST_CASE("runner: a test spec splits into its filters at top-level commas", "[runner-spec]") {
  using Filters = std::vector<kvaudit_test::SpecFilter>;
  CHECK(kvaudit_test::split_spec_filters({}) == Filters{});
  CHECK(kvaudit_test::split_spec_filters({"a,b", "c"}) == Filters{{"a"}, {"b", "c"}});
  CHECK(kvaudit_test::split_spec_filters({"a\\,b"}) == Filters{{"a\\,b"}});
  CHECK(kvaudit_test::split_spec_filters({"a,,", " ", "b"}) == Filters{{"a"}, {"b"}});
  CHECK(kvaudit_test::join_spec_filters({{"a"}, {"b", "c"}}, {"gpu", "torch"}) ==
        std::vector<std::string>{"~[gpu]~[torch]a,", "~[gpu]~[torch]b", "c"});
}

}  // namespace
