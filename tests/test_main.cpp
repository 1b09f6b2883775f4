// Catch2 runner. Catch2 2.13 has no skip, so the runner decides it before anything runs: every
// selected case whose prerequisite is missing on this machine (tests/prerequisites.hpp: [gpu]
// without a CUDA device, [torch] without PyTorch in the Python venv) is taken out of the
// selection, whatever the selection is ("[gpu]", "[gpu]~[injection]", none at all, names). Each
// such case is listed before the run as "SKIPPED: NAME (REASON)", the count follows the run's
// summary ("N test cases skipped (REASON)"), and the exit status is
//   77  every selected case was skipped (CTest's SKIP_RETURN_CODE: CTest says Skipped);
//   else the status of the cases that ran (Catch2's: 0, or the number of failed assertions up to
//       255; 77 failed assertions exit 78, so that a failure never reads as a skip).
// A selection that matches no test case at all exits 2 (Catch2 2.13 would exit 0: nothing ran).
// Listing (--list-tests, --list-test-names-only, ...) and --help are Catch2's, untouched.
// KVAUDIT_REQUIRE=TAG[,TAG...] names prerequisites this machine must have (CI sets "torch" where it
// installed PyTorch): a selected case needing a missing one is then a failure (exit 1, naming the
// prerequisite and why it is missing), not a skip, so that an install that broke cannot make the
// run green by skipping what it was meant to test.
#define CATCH_CONFIG_RUNNER
#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdlib>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "tests/prerequisites.hpp"
#include "tests/runner/spec_filters.hpp"

namespace {

constexpr int kExitSkipped = 77;

struct SkippedCase {
  std::string name;
  std::string reason;
};

struct SkipPlan {
  std::vector<SkippedCase> skipped;
  std::vector<std::string> excluded_tags;  // the tags of the missing prerequisites
  std::vector<std::string> notes;          // what the present prerequisites found
};

bool is_run(const Catch::ConfigData& data) {
  return !(data.showHelp || data.libIdentify || data.listTests || data.listTestNamesOnly ||
           data.listTags || data.listReporters);
}

bool has_tag(const Catch::TestCaseInfo& test, const std::string& tag) {
  return std::find(test.lcaseTags.begin(), test.lcaseTags.end(), tag) != test.lcaseTags.end();
}

// The cases a test spec given as command-line arguments selects.
std::vector<Catch::TestCase> selected_by(const std::vector<std::string>& args,
                                         const Catch::IConfig& config) {
  Catch::TestSpecParser parser(Catch::ITagAliasRegistry::get());
  for (const std::string& arg : args) parser.parse(Catch::trim(arg));
  return Catch::filterTests(Catch::getAllTestCasesSorted(config), parser.testSpec(), config);
}

std::set<std::string> names_of(const std::vector<Catch::TestCase>& tests) {
  std::set<std::string> names;
  for (const Catch::TestCase& test : tests) names.insert(test.name);
  return names;
}

// Asks each prerequisite that a selected case needs, once; a missing one skips all its cases.
SkipPlan plan_skips(const std::vector<Catch::TestCase>& selected) {
  SkipPlan plan;
  std::set<std::string> already_skipped;
  for (const kvaudit_test::Prerequisite& prerequisite : kvaudit_test::prerequisites()) {
    std::vector<const Catch::TestCase*> needing;
    for (const Catch::TestCase& test : selected) {
      if (has_tag(test, prerequisite.tag)) needing.push_back(&test);
    }
    if (needing.empty()) continue;
    const kvaudit_test::PrerequisiteState state = prerequisite.probe();
    if (state.present) {
      if (!state.note.empty()) plan.notes.push_back(state.note);
      continue;
    }
    plan.excluded_tags.push_back(prerequisite.tag);
    for (const Catch::TestCase* test : needing) {
      if (already_skipped.insert(test->name).second) {
        plan.skipped.push_back({test->name, state.note});
      }
    }
  }
  return plan;
}

// The command line's selection less the skipped tags. A filter that selected skipped cases only
// goes (it would select nothing, and Catch2 would say "No test cases matched"); one that selected
// nothing from the start stays, so that a mistyped name is still reported.
std::vector<std::string> selection_without(const std::vector<std::string>& args,
                                           const std::vector<std::string>& excluded_tags,
                                           const Catch::IConfig& config) {
  std::vector<kvaudit_test::SpecFilter> kept;
  for (const kvaudit_test::SpecFilter& filter : kvaudit_test::split_spec_filters(args)) {
    const bool selected_before = !selected_by(filter, config).empty();
    const bool selects_after =
        !selected_by(kvaudit_test::join_spec_filters({filter}, excluded_tags), config).empty();
    if (selects_after || !selected_before) kept.push_back(filter);
  }
  return kvaudit_test::join_spec_filters(kept, excluded_tags);
}

// The tags in $KVAUDIT_REQUIRE ("torch,gpu"), lower case.
std::set<std::string> required_tags() {
  std::set<std::string> tags;
  const char* value = std::getenv("KVAUDIT_REQUIRE");
  if (value == nullptr) return tags;
  std::istringstream list(value);
  std::string tag;
  while (std::getline(list, tag, ',')) {
    tag = Catch::toLower(Catch::trim(tag));
    if (!tag.empty()) tags.insert(tag);
  }
  return tags;
}

// Prints one line per skipped case whose prerequisite KVAUDIT_REQUIRE names; true when any.
bool report_required_missing(const SkipPlan& plan, const std::vector<Catch::TestCase>& selected) {
  const std::set<std::string> required = required_tags();
  bool missing = false;
  for (const SkippedCase& skipped : plan.skipped) {
    for (const Catch::TestCase& test : selected) {
      if (test.name != skipped.name) continue;
      for (const std::string& tag : required) {
        if (!has_tag(test, tag)) continue;
        std::cerr << "FAILED: " << test.name << ": its prerequisite [" << tag
                  << "] is required here (KVAUDIT_REQUIRE) but missing: " << skipped.reason << "\n";
        missing = true;
      }
    }
  }
  return missing;
}

void print_skipped(const SkipPlan& plan) {
  for (const SkippedCase& test : plan.skipped) {
    std::cout << "SKIPPED: " << test.name << " (" << test.reason << ")\n";
  }
  std::cout.flush();
}

// One line per reason: "6 test cases skipped (no CUDA device: ...)".
void print_skip_summary(const SkipPlan& plan) {
  std::map<std::string, int> per_reason;
  for (const SkippedCase& test : plan.skipped) ++per_reason[test.reason];
  for (const auto& [reason, count] : per_reason) {
    std::cout << count << (count == 1 ? " test case" : " test cases") << " skipped (" << reason
              << ")\n";
  }
  std::cout.flush();
}

// Runs the selection less the skipped cases; checks first that the rewritten spec selects exactly
// those (a runner that ran a skipped case, or lost another, would report a false result).
int run_without_skipped(Catch::Session& session, const SkipPlan& plan,
                        const std::vector<Catch::TestCase>& selected) {
  std::set<std::string> expected = names_of(selected);
  for (const SkippedCase& test : plan.skipped) expected.erase(test.name);
  Catch::ConfigData data = session.configData();
  data.testsOrTags = selection_without(data.testsOrTags, plan.excluded_tags, session.config());
  session.useConfigData(data);
  if (names_of(selected_by(data.testsOrTags, session.config())) != expected) {
    std::cerr << "test runner: the selection without the skipped cases does not select the "
                 "cases left to run (tests/test_main.cpp)\n";
    return 1;
  }
  const int status = session.run();
  print_skip_summary(plan);
  return status == kExitSkipped ? kExitSkipped + 1 : status;
}

}  // namespace

std::set<std::string> kvaudit_test::names_selected_by(const std::vector<std::string>& args,
                                                      const Catch::IConfig& config) {
  return names_of(selected_by(args, config));
}

int main(int argc, char** argv) {
  Catch::Session session;
  if (const int rc = session.applyCommandLine(argc, argv); rc != 0) return rc;
  if (!is_run(session.configData())) return session.run();

  const Catch::Config& config = session.config();
  const std::vector<Catch::TestCase> selected =
      Catch::filterTests(Catch::getAllTestCasesSorted(config), config.testSpec(), config);
  if (selected.empty() && config.testSpec().hasFilters()) {
    // Catch2 2.13 exits 0 here: a CTest entry whose name it cannot match (a ';' splits a name
    // into two entries) would pass without running anything.
    std::cerr << "test runner: the selection matches no test case:";
    for (const std::string& arg : session.configData().testsOrTags) std::cerr << " '" << arg << "'";
    std::cerr << "\n";
    return 2;
  }
  const SkipPlan plan = plan_skips(selected);
  for (const std::string& note : plan.notes) std::cout << note << "\n";
  if (plan.skipped.empty()) {
    const int status = session.run();
    return status == kExitSkipped ? kExitSkipped + 1 : status;
  }
  if (report_required_missing(plan, selected)) return 1;
  print_skipped(plan);
  if (plan.skipped.size() == selected.size()) {
    print_skip_summary(plan);
    return kExitSkipped;
  }
  return run_without_skipped(session, plan, selected);
}
