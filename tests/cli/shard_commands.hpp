// `kvaudit check --shard` and `kvaudit merge` through the binary, for the sharding tests: run a
// command line, check a shipped dump whole or in N parts, merge, and compare two reports the way
// scripts/same_report.py does (everything but timing, provenance and the dump's path).
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "tests/test_paths.hpp"

namespace kvaudit_test {

struct CommandOutcome {
  int status = -1;
  std::string out;
  std::string err;
};

inline std::string file_text(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// `arguments` after the binary, run in a shell (with `environment` before it: "A=1 B=2"); stdout
// and stderr go to files named after `name` in the test scratch folder.
inline CommandOutcome run_kvaudit(const std::string& name, const std::string& arguments,
                                  const std::string& environment = "") {
  const std::filesystem::path dir = test_tmpdir() / "shard_commands";
  std::filesystem::create_directories(dir);
  const auto out = dir / (name + ".stdout");
  const auto err = dir / (name + ".stderr");
  const std::string command = "env -u SLURM_ARRAY_TASK_ID -u JOB_COMPLETION_INDEX " + environment +
                              " '" + kvaudit_binary().string() + "' " + arguments + " > '" +
                              out.string() + "' 2> '" + err.string() + "'";
  const int raw = std::system(command.c_str());
  CommandOutcome outcome;
  outcome.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  outcome.out = file_text(out);
  outcome.err = file_text(err);
  return outcome;
}

// A signing key made once per test process by `kvaudit keygen` (sign-off runs need one); its
// path, quoted, after " --signing-key ". The folder is the process's own: CTest runs cases in
// parallel processes, and one process must not replace the key another is signing with.
inline std::string signing_key_option() {
  static const std::string option = [] {
    const std::filesystem::path dir =
        test_tmpdir() / ("shard_commands_key." + std::to_string(getpid()));
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    const CommandOutcome made =
        run_kvaudit("shard_commands_keygen", "keygen --out '" + (dir / "key").string() + "'");
    if (made.status != 0) throw std::runtime_error("kvaudit keygen failed: " + made.err);
    return " --signing-key '" + (dir / "key").string() + "'";
  }();
  return option;
}

inline std::string shipped_dump(const std::string& dump) {
  return "'" + (source_dir() / "datasets" / (dump + ".h5")).string() + "'";
}

inline nlohmann::json read_json(const std::filesystem::path& path) {
  return nlohmann::json::parse(file_text(path));
}

// A report without what may differ between two runs of the same check: timing, provenance, the
// dump's path and the checksum value (a sign-off's digest, a plain report's checksum), which
// covers the provenance (scripts/same_report.py drops the same keys).
inline nlohmann::json comparable(nlohmann::json report) {
  report.erase("timing");
  report.erase("provenance");
  if (report.contains("checksum") && report["checksum"].is_object()) {
    report["checksum"].erase("value");
  }
  if (report.contains("dump")) report["dump"].erase("path");
  if (report.contains("signoff") && report["signoff"].is_object()) {
    report["signoff"]["digest"].erase("value");
  }
  return report;
}

// The keys where two reports differ (after comparable()), for messages; empty when equal.
inline std::vector<std::string> differing_keys(const nlohmann::json& a, const nlohmann::json& b) {
  std::vector<std::string> keys;
  const nlohmann::json ca = comparable(a);
  const nlohmann::json cb = comparable(b);
  for (const auto& item : ca.items()) {
    if (!cb.contains(item.key()) || cb.at(item.key()) != item.value()) keys.push_back(item.key());
  }
  for (const auto& item : cb.items()) {
    if (!ca.contains(item.key())) keys.push_back(item.key());
  }
  return keys;
}

}  // namespace kvaudit_test
