// `kvaudit golden record` and `kvaudit golden check`: keep a backend's outputs on a dump as a
// golden file (docs/golden-format.md), and fail when a later run moves them
// (src/report/golden*.hpp).
//
//   golden record DUMP -o GOLDEN.h5 --backend NAME [--layers L] [--steps S]
//   golden record DIR  -o GOLDEN_DIR --backend NAME          every DIR/*.h5
//   golden check  DUMP GOLDEN.h5 --backend NAME [--mode auto|exact|tolerance] [--accept]
//   golden check  DIR  GOLDEN_DIR --backend NAME [...]       pairs DIR/<stem>.h5 with
//                                                            GOLDEN_DIR/<stem>.<tag>.golden.h5
// The backend is chosen as `check` chooses it (src/cli/backend_selection.hpp): a built-in one, or
// exec:NAME with --backend-command, started once per dump with that dump's model; <tag> is the
// backend's name with ':' written '-' (exec:torch -> exec-torch).
// --accept (or KVAUDIT_GOLDEN_ACCEPT=1) rewrites a golden file that moved, atomically, after
// printing what changed, and records missing ones; it never overwrites a golden file made from
// another dump. Exit status: 0 everything matches (or was accepted/recorded), 1 something moved,
// 2 bad input (a dump or golden file unreadable, a golden file from another dump, a dump without
// golden file), 3 internal error.
#include <fmt/format.h>
#include <fmt/ostream.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "src/backend/backend.hpp"
#include "src/cli/backend_selection.hpp"
#include "src/cli/cli.hpp"
#include "src/core/build_info.hpp"
#include "src/core/sha256.hpp"
#include "src/format/dump_probe.hpp"
#include "src/format/kvdump.hpp"
#include "src/replay/replay.hpp"
#include "src/report/golden.hpp"
#include "src/report/golden_compare.hpp"
#include "src/report/golden_file.hpp"
#include "src/verdict/policy.hpp"

namespace kvaudit {
namespace {

namespace fs = std::filesystem;

struct GoldenOptions {
  std::string dump;    // a dump, or a folder of dumps
  std::string golden;  // record: -o; check: the golden file or folder
  BackendSelection
      selection;       // --backend, --backend-command, --inject, --reciprocal-scale, --cuda-*
  std::string layers;  // record only: check replays the golden file's selection
  std::string steps;
  std::string mode = "auto";  // check only
  std::int64_t whole_pool_max_bytes = kWholePoolMaxBytes;
  int threads = 0;
  bool accept = false;
  bool progress = false;
};

// What became of one dump.
enum class PairStatus { kMatch, kMoved, kAccepted, kRecorded, kMissing, kRefused, kError };

const char* pair_status_name(PairStatus status) {
  switch (status) {
    case PairStatus::kMatch:
      return "match";
    case PairStatus::kMoved:
      return "MOVED";
    case PairStatus::kAccepted:
      return "accepted";
    case PairStatus::kRecorded:
      return "recorded";
    case PairStatus::kMissing:
      return "missing";
    case PairStatus::kRefused:
      return "refused";
    case PairStatus::kError:
      return "error";
  }
  return "?";
}

struct PairOutcome {
  PairStatus status = PairStatus::kMatch;
  std::size_t compared = 0;  // (step, layer)s
  std::size_t moved = 0;
  std::string first;  // the first moved element, or the reason of a refusal or error
};

// KVAUDIT_GOLDEN_ACCEPT set to anything but "" or "0" accepts, like EXPECTTEST_ACCEPT.
bool accept_from_environment() {
  const char* value = std::getenv("KVAUDIT_GOLDEN_ACCEPT");
  return value != nullptr && *value != '\0' && std::string(value) != "0";
}

// The backend as a file name's part: its name, with the ':' of exec:NAME written '-' (a colon is
// refused by some file systems and CI artifact stores).
std::string backend_file_tag(const std::string& backend) {
  std::string tag = backend;
  std::replace(tag.begin(), tag.end(), ':', '-');
  return tag;
}

// <stem>.<tag>.golden.h5 (docs/golden-format.md "Naming").
fs::path golden_path_for(const fs::path& dump, const fs::path& folder, const std::string& backend) {
  return folder / fmt::format("{}.{}.golden.h5", dump.stem().string(), backend_file_tag(backend));
}

// DIR/*.h5 but golden files (*.golden.h5: a folder may hold both), sorted by name.
Result<std::vector<fs::path>> dumps_in(const fs::path& folder) {
  std::vector<fs::path> dumps;
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(folder, error)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_regular_file() && name.ends_with(".h5") && !name.ends_with(".golden.h5")) {
      dumps.push_back(entry.path());
    }
  }
  if (error) return bad_input(folder.string(), "cannot list the folder: " + error.message());
  std::sort(dumps.begin(), dumps.end());
  if (dumps.empty()) return bad_input(folder.string(), "holds no dump (*.h5)");
  return dumps;
}

ReplayOptions base_replay_options(const GoldenOptions& options) {
  ReplayOptions replay;
  replay.policy = default_policy();
  replay.threads = options.threads;
  replay.reciprocal_scale = options.selection.reciprocal_scale;
  replay.progress = options.progress || isatty(STDERR_FILENO) != 0;
  return replay;
}

// The backend's outputs on `reader`'s dump, recorded with the dump's path and digest.
Result<Golden> run_and_capture(const GoldenOptions& options, const DumpReader& reader,
                               const std::string& sha, ReplayOptions replay,
                               std::int64_t whole_pool_max_bytes) {
  KVAUDIT_TRY(check_selection(reader.layout(), replay));
  KVAUDIT_ASSIGN_OR_RETURN(
      const std::unique_ptr<Backend> backend,
      make_selected_backend(options.selection, reader.layout(), options.threads));
  GoldenRecordOptions record;
  record.replay = std::move(replay);
  record.whole_pool_max_bytes = whole_pool_max_bytes;
  KVAUDIT_ASSIGN_OR_RETURN(Golden golden, record_golden(reader, *backend, record));
  golden.provenance.dump_path = reader.path().string();
  golden.provenance.dump_sha256 = sha;
  return golden;
}

// "12 (step, layer)s, backend cpu-fp8, pools as SHA-256 + written rows, 764433 bytes"
std::string golden_summary(const Golden& golden, const fs::path& path) {
  std::size_t whole = 0;
  for (const GoldenEntry& entry : golden.entries) {
    whole += entry.pool.storage == PoolStorage::kWhole ? 1 : 0;
  }
  std::error_code error;
  const auto bytes = fs::file_size(path, error);
  return fmt::format("{} (step, layer)s, backend {}, pools {}, {} bytes", golden.entries.size(),
                     golden.provenance.backend,
                     whole == golden.entries.size() ? "whole"
                     : whole == 0                   ? "as SHA-256 + written rows"
                                                    : "mixed",
                     error ? 0 : bytes);
}

// ---- record ------------------------------------------------------------------------------------

Status record_one(const GoldenOptions& options, const fs::path& dump, const fs::path& output) {
  KVAUDIT_ASSIGN_OR_RETURN(const DumpReader reader, DumpReader::open(dump));
  ReplayOptions replay = base_replay_options(options);
  if (!options.layers.empty()) {
    KVAUDIT_ASSIGN_OR_RETURN(replay.layer_ids, parse_index_list(options.layers, "--layers"));
  }
  if (!options.steps.empty()) {
    KVAUDIT_ASSIGN_OR_RETURN(replay.step_indices, parse_index_list(options.steps, "--steps"));
  }
  KVAUDIT_ASSIGN_OR_RETURN(const std::string sha, sha256_file_hex(dump));
  KVAUDIT_ASSIGN_OR_RETURN(
      const Golden golden,
      run_and_capture(options, reader, sha, std::move(replay), options.whole_pool_max_bytes));
  KVAUDIT_TRY(write_golden_file(output, golden));
  fmt::print("recorded {}: {}\n", output.string(), golden_summary(golden, output));
  if (golden.provenance.kvaudit_dirty) {
    fmt::print(
        "note: this kvaudit was built from a dirty tree (revision {}); the golden file says so "
        "(kvaudit_dirty = 1), and golden check will warn about it\n",
        golden.provenance.kvaudit_revision);
  }
  return ok_status();
}

// Every dump of a folder into GOLDEN_DIR/<stem>.<backend>.golden.h5 (created when missing).
Status record_folder(const GoldenOptions& options) {
  KVAUDIT_ASSIGN_OR_RETURN(const std::vector<fs::path> dumps, dumps_in(options.dump));
  std::error_code error;
  fs::create_directories(options.golden, error);
  if (error) {
    return bad_input("-o " + options.golden, "cannot create the folder: " + error.message());
  }
  std::vector<fs::path> outputs;
  for (const fs::path& dump : dumps) {
    outputs.push_back(golden_path_for(dump, options.golden, options.selection.backend));
    KVAUDIT_TRY(check_output_file(outputs.back(), "-o"));
    KVAUDIT_TRY(probe_dump_in_child(dump));
  }
  for (std::size_t i = 0; i < dumps.size(); ++i) {
    KVAUDIT_TRY(record_one(options, dumps[i], outputs[i]));
  }
  return ok_status();
}

int run_record(const GoldenOptions& options) {
  const auto record = [&]() -> Status {
    if (options.golden.empty()) return bad_input("golden record", "-o is required");
    KVAUDIT_TRY(check_backend_selection(options.selection, NoBackend::kRefused));
    std::error_code error;
    if (fs::is_directory(options.dump, error)) return record_folder(options);
    KVAUDIT_TRY(check_output_file(options.golden, "-o"));
    KVAUDIT_TRY(probe_dump_in_child(options.dump));
    return record_one(options, options.dump, options.golden);
  };
  const Status status = record();
  return status.ok() ? kExitPass : report_error(status.error());
}

// ---- check -------------------------------------------------------------------------------------

Result<GoldenModeChoice> check_mode(const GoldenOptions& options, const Golden& golden,
                                    const Golden& current) {
  if (options.mode == "auto") return choose_golden_mode(golden.provenance, current.provenance);
  const std::optional<GoldenMode> mode = parse_golden_mode(options.mode);
  if (!mode) {
    return bad_input("--mode", fmt::format("'{}' is not auto, exact or tolerance", options.mode));
  }
  return GoldenModeChoice{*mode, "chosen with --mode"};
}

void print_mode(const GoldenModeChoice& choice) {
  if (choice.mode == GoldenMode::kExact) {
    fmt::print("mode: exact ({}): out, lse and pool bit for bit\n", choice.reason);
    return;
  }
  fmt::print(
      "mode: tolerance ({}): out within {:g} bf16 ulps or {:g} of its (row, head)'s largest "
      "|out|, lse within {:g}; pool bit for bit\n",
      choice.reason, kToleranceOutUlps, kToleranceOutRowScale, kToleranceLseAbs);
}

// Why the golden file does not belong to this dump (its SHA-256 differs), or nothing.
std::optional<std::string> other_dump(const fs::path& golden_path, const Golden& golden,
                                      const fs::path& dump, const std::string& sha) {
  if (golden.provenance.dump_sha256 == sha) return std::nullopt;
  return fmt::format(
      "{}: recorded from a dump with SHA-256 {} ({}), but {} has SHA-256 {}: a golden file "
      "belongs to one dump; refusing to compare",
      golden_path.string(), golden.provenance.dump_sha256, golden.provenance.dump_path,
      dump.string(), sha);
}

// Re-runs the dump, compares, prints what moved and, with --accept, rewrites the golden file.
Result<PairOutcome> compare_pair(const GoldenOptions& options, const DumpReader& reader,
                                 const std::string& sha, const fs::path& golden_path,
                                 const Golden& golden) {
  ReplayOptions replay = base_replay_options(options);
  replay.layer_ids = golden.layer_ids;
  replay.step_indices = golden.step_indices;
  KVAUDIT_ASSIGN_OR_RETURN(
      const Golden current,
      run_and_capture(options, reader, sha, std::move(replay), golden.whole_pool_max_bytes));
  KVAUDIT_ASSIGN_OR_RETURN(const GoldenModeChoice mode, check_mode(options, golden, current));
  fmt::print("golden {}: recorded {} by kvaudit {} (revision {}) with {}\n", golden_path.string(),
             golden.provenance.date_utc, golden.provenance.kvaudit_version,
             golden.provenance.kvaudit_revision, golden.provenance.backend);
  for (const std::string& line : dirty_build_lines(golden.provenance, current.provenance)) {
    fmt::print("{}\n", line);
  }
  print_mode(mode);
  for (const std::string& line : provenance_differences(golden.provenance, current.provenance)) {
    fmt::print("note: provenance differs: {}\n", line);
  }
  const GoldenComparison comparison = compare_golden(golden, current, mode.mode);
  print_golden_comparison(std::cout, comparison);
  if (comparison.any_moved()) {
    for (const std::string& line : kernel_variant_lines(golden.provenance, current.provenance)) {
      fmt::print("{}\n", line);
    }
  }
  PairOutcome outcome;
  outcome.compared = comparison.entries_compared;
  outcome.moved = comparison.moved.size();
  outcome.status = comparison.any_moved() ? PairStatus::kMoved : PairStatus::kMatch;
  if (comparison.first) {
    outcome.first = describe_move(*comparison.first);
  } else if (const std::vector<std::string> notes = unwritten_slot_notes(comparison);
             !notes.empty()) {
    outcome.first = notes.front().substr(std::string_view("note: ").size());
  }
  if (comparison.any_moved() && options.accept) {
    KVAUDIT_TRY(write_golden_file(golden_path, current));
    fmt::print("accepted: rewrote {} with this run ({} of {} (step, layer)s changed, above)\n",
               golden_path.string(), outcome.moved, outcome.compared);
    outcome.status = PairStatus::kAccepted;
  }
  return outcome;
}

// One dump against one golden file. Errors are bad input or internal; a golden file from another
// dump is refused (status kRefused, the reason in `first`).
Result<PairOutcome> check_pair(const GoldenOptions& options, const fs::path& dump,
                               const fs::path& golden_path) {
  KVAUDIT_ASSIGN_OR_RETURN(const DumpReader reader, DumpReader::open(dump));
  KVAUDIT_ASSIGN_OR_RETURN(const std::string sha, sha256_file_hex(dump));
  std::error_code error;
  if (!fs::exists(golden_path, error) && options.accept) {
    KVAUDIT_TRY(check_output_file(golden_path, "--accept"));
    GoldenOptions record = options;
    record.layers.clear();
    record.steps.clear();
    KVAUDIT_TRY(record_one(record, dump, golden_path));
    return PairOutcome{PairStatus::kRecorded, 0, 0, ""};
  }
  KVAUDIT_ASSIGN_OR_RETURN(const Golden golden, read_golden_file(golden_path));
  if (const std::optional<std::string> reason = other_dump(golden_path, golden, dump, sha)) {
    return PairOutcome{PairStatus::kRefused, 0, 0, *reason};
  }
  if (options.accept) KVAUDIT_TRY(check_output_file(golden_path, "--accept"));
  return compare_pair(options, reader, sha, golden_path, golden);
}

int exit_status_of(PairStatus status) {
  switch (status) {
    case PairStatus::kMatch:
    case PairStatus::kAccepted:
    case PairStatus::kRecorded:
      return kExitPass;
    case PairStatus::kMoved:
      return kExitChecksFailed;
    default:
      return kExitBadInput;
  }
}

int check_single(const GoldenOptions& options) {
  Status probed = probe_dump_in_child(options.dump);
  if (!probed.ok()) return report_error(probed.error());
  const Result<PairOutcome> outcome = check_pair(options, options.dump, options.golden);
  if (!outcome.ok()) return report_error(outcome.error());
  if (outcome->status == PairStatus::kRefused) {
    fmt::print(stderr, "kvaudit: {}\n", outcome->first);
    return kExitBadInput;
  }
  fmt::print("verdict: {} ({} of {} (step, layer)s moved; backend {})\n",
             pair_status_name(outcome->status), outcome->moved, outcome->compared,
             options.selection.backend);
  return exit_status_of(outcome->status);
}

// ---- folders -----------------------------------------------------------------------------------

struct FolderRow {
  fs::path dump;
  PairOutcome outcome;
};

// The pair's outcome, an error turned into a row (printed on stderr as usual).
PairOutcome folder_pair(const GoldenOptions& options, const fs::path& dump,
                        const fs::path& golden) {
  fmt::print("== {} against {}\n", dump.filename().string(), golden.string());
  std::error_code error;
  if (!options.accept && !fs::exists(golden, error)) {
    fmt::print("no golden file: record it with --accept or kvaudit golden record\n");
    return PairOutcome{PairStatus::kMissing, 0, 0, "no golden file " + golden.string()};
  }
  const Result<PairOutcome> outcome = check_pair(options, dump, golden);
  if (!outcome.ok()) {
    report_error(outcome.error());
    return PairOutcome{PairStatus::kError, 0, 0, outcome.error().message()};
  }
  if (outcome->status == PairStatus::kRefused) fmt::print(stderr, "kvaudit: {}\n", outcome->first);
  return *outcome;
}

// Golden files of this backend whose dump is not in the folder: reported, not judged.
void note_orphans(const GoldenOptions& options, const std::vector<FolderRow>& rows) {
  std::error_code error;
  const std::string suffix =
      fmt::format(".{}.golden.h5", backend_file_tag(options.selection.backend));
  for (const auto& entry : fs::directory_iterator(options.golden, error)) {
    const std::string name = entry.path().filename().string();
    if (name.size() <= suffix.size() || !name.ends_with(suffix)) continue;
    const bool paired = std::any_of(rows.begin(), rows.end(), [&](const FolderRow& row) {
      return golden_path_for(row.dump, options.golden, options.selection.backend).filename() ==
             name;
    });
    if (!paired) fmt::print("note: {} has no dump in {}\n", entry.path().string(), options.dump);
  }
}

int print_folder_summary(const GoldenOptions& options, const std::vector<FolderRow>& rows) {
  fmt::print("\n{:<28} {:<9} {:>8} {:>6}  {}\n", "dump", "status", "compared", "moved",
             "first moved / reason");
  int status = kExitPass;
  std::vector<std::size_t> counts(7, 0);
  for (const FolderRow& row : rows) {
    const PairOutcome& o = row.outcome;
    fmt::print("{:<28} {:<9} {:>8} {:>6}  {}\n", row.dump.filename().string(),
               pair_status_name(o.status), o.compared, o.moved, o.first.empty() ? "-" : o.first);
    ++counts[static_cast<std::size_t>(o.status)];
    status = std::max(status, exit_status_of(o.status));
  }
  const bool bad = status == kExitBadInput;
  fmt::print(
      "verdict: {} ({} dumps: {} match, {} moved, {} accepted, {} recorded, {} missing, {} "
      "refused, {} errors; backend {}, golden files in {})\n",
      bad                           ? "ERROR"
      : status == kExitChecksFailed ? "MOVED"
                                    : "MATCH",
      rows.size(), counts[0], counts[1], counts[2], counts[3], counts[4], counts[5], counts[6],
      options.selection.backend, options.golden);
  return status;
}

int check_folder(const GoldenOptions& options) {
  const Result<std::vector<fs::path>> dumps = dumps_in(options.dump);
  if (!dumps.ok()) return report_error(dumps.error());
  std::error_code error;
  if (!fs::is_directory(options.golden, error)) {
    if (!options.accept) {
      return report_error(bad_input(options.golden, "is not a folder of golden files"));
    }
    fs::create_directories(options.golden, error);
    if (error) return report_error(bad_input(options.golden, "cannot create: " + error.message()));
  }
  // Every dump is probed before any backend runs (the probe forks: no threads or CUDA yet).
  for (const fs::path& dump : *dumps) {
    const Status probed = probe_dump_in_child(dump);
    if (!probed.ok()) return report_error(probed.error());
  }
  std::vector<FolderRow> rows;
  for (const fs::path& dump : *dumps) {
    const fs::path golden = golden_path_for(dump, options.golden, options.selection.backend);
    rows.push_back(FolderRow{dump, folder_pair(options, dump, golden)});
  }
  note_orphans(options, rows);
  return print_folder_summary(options, rows);
}

int run_golden_check(GoldenOptions options) {
  options.accept = options.accept || accept_from_environment();
  if (options.dump.empty() || options.golden.empty()) {
    return report_error(bad_input("golden check", "DUMP and GOLDEN are required"));
  }
  if (const Status applies = check_backend_selection(options.selection, NoBackend::kRefused);
      !applies) {
    return report_error(applies.error());
  }
  std::error_code error;
  return fs::is_directory(options.dump, error) ? check_folder(options) : check_single(options);
}

// ---- command line ------------------------------------------------------------------------------

void add_common_options(CLI::App& cmd, GoldenOptions& options) {
  add_backend_selection_options(cmd, options.selection, NoBackend::kRefused);
  add_integer_option(cmd, "--threads", options.threads, 0, kMaxThreads,
                     "Threads for the reference and CPU backends (0: every core)")
      ->capture_default_str();
  cmd.add_flag("--progress", options.progress,
               "Print progress on stderr even when it is not a terminal");
}

void add_record_command(CLI::App& golden, CommandRunner& runner) {
  auto options = std::make_shared<GoldenOptions>();
  CLI::App* cmd = add_command(
      golden, "record",
      {"Record a backend's outputs on a dump (or a folder of dumps) as golden files.",
       "Replay DUMP through the backend and store, per step and layer, its out (bf16 bits), lse "
       "(fp32) and pool after the step (whole up to --whole-pool-max-bytes, else its SHA-256 and "
       "the rows of the slots the step wrote), with provenance (dump SHA-256, backend and its "
       "description, kvaudit version and git revision (a build from a tree with uncommitted "
       "changes is flagged dirty), platform, policy, date, command line). "
       "The backend is chosen as kvaudit check chooses it: a built-in one, or exec:NAME with "
       "--backend-command (its program is started once per dump). "
       "DUMP may be a folder: every DUMP/*.h5 goes to OUTPUT/<stem>.<backend>.golden.h5 (exec:NAME "
       "written exec-NAME). Format: docs/golden-format.md.",
       "0 recorded, 2 bad input, 3 internal error"});
  cmd->add_option("DUMP", options->dump, "kvdump HDF5 file, or a folder of them")
      ->type_name("PATH")
      ->required();
  cmd->add_option("-o,--output", options->golden, "Golden file to write (a folder for a folder)")
      ->type_name("PATH")
      ->required();
  add_common_options(*cmd, *options);
  cmd->add_option("--layers", options->layers, "Layer ids to record (e.g. 0,1,77 or 0-3)");
  cmd->add_option("--steps", options->steps,
                  "Step indices to record (every step is still replayed in order)");
  add_integer_option(*cmd, "--whole-pool-max-bytes", options->whole_pool_max_bytes, std::int64_t{0},
                     std::int64_t{1} << 40,
                     "Store a pool whole up to this many bytes, else as SHA-256 + written rows")
      ->capture_default_str();
  cmd->callback([options, &runner] { runner = [options] { return run_record(*options); }; });
}

void add_check_command(CLI::App& golden, CommandRunner& runner) {
  auto options = std::make_shared<GoldenOptions>();
  CLI::App* cmd = add_command(
      golden, "check",
      {"Check a backend's outputs on a dump (or a folder of dumps) against golden files.",
       "Re-run DUMP through the backend (the golden file's layers and steps) and compare with "
       "GOLDEN: bit for bit in exact mode, within the tolerance of another summation order in "
       "tolerance mode (out: 2 bf16 ulps or 2^-8 of the (row, head)'s largest |out|; lse: 2^-14), "
       "the pool always bit for bit. Prints what moved (step, layer, row, head, dim, by how many "
       "ulps and how much) and the first element that moved; provenance that differs (device, "
       "library versions) is stated, and so is a golden file or a run from a kvaudit built from "
       "a dirty tree. A golden file made from another dump is refused. The backend is chosen as "
       "kvaudit check chooses it (exec:NAME with --backend-command included). DUMP and "
       "GOLDEN may be folders: DUMP/<stem>.h5 pairs with GOLDEN/<stem>.<backend>.golden.h5 "
       "(exec:NAME written exec-NAME), one summary and one verdict.",
       "0 match, 1 moved, 2 bad input (unreadable dump or golden file, a golden file from another "
       "dump, a dump without golden file), 3 internal error"});
  cmd->add_option("DUMP", options->dump, "kvdump HDF5 file, or a folder of them")
      ->type_name("PATH")
      ->required();
  cmd->add_option("GOLDEN", options->golden, "Golden file, or a folder of them")
      ->type_name("PATH")
      ->required();
  add_common_options(*cmd, *options);
  cmd->add_option("--mode", options->mode,
                  "auto (from the backend: exact for cpu-fp8, and for cuda-fp8 on the golden "
                  "file's device), exact, or tolerance")
      ->capture_default_str();
  cmd->add_flag("--accept", options->accept,
                "Rewrite golden files that moved with this run (atomically, after printing what "
                "changed) and record missing ones; also KVAUDIT_GOLDEN_ACCEPT=1");
  cmd->callback([options, &runner] { runner = [options] { return run_golden_check(*options); }; });
}

}  // namespace

void register_golden_command(CLI::App& app, CommandRunner& runner) {
  CLI::App* golden = add_command(
      app, "golden",
      {"Golden files: record a backend's outputs on a dump, and check later runs against them.",
       "Regression tests for CI (docs/golden-format.md): `kvaudit golden record` and `kvaudit "
       "golden check`; `kvaudit help golden record` describes each.",
       "that of the subcommand: 0 recorded or matching, 1 moved (check), 2 bad input, 3 "
       "internal error"});
  golden->require_subcommand(1);
  add_record_command(*golden, runner);
  add_check_command(*golden, runner);
}

}  // namespace kvaudit
