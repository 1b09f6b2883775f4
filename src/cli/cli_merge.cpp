// `kvaudit merge PART.json... [--json OUT] [--report DIR] [--signing-key FILE]`: the parts of a
// sharded check
// (`kvaudit check DUMP --shard I/N --json PART.json`, src/cli/check_shard.hpp) put back into the
// report the unsharded check gives (src/verdict/merge.hpp says what is equal, what is refused and
// why). Prints the same table as check, then writes the outputs.
// Exit status: 0 pass, 1 checks failed (the merged verdict), 2 bad input (a file that is no part,
// parts that are not one run, a shard given twice or missing), 3 internal error.
#include <fmt/format.h>
#include <fmt/ostream.h>

#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "src/cli/cli.hpp"
#include "src/core/ed25519.hpp"
#include "src/core/output_file.hpp"
#include "src/report/report.hpp"
#include "src/verdict/merge.hpp"
#include "src/verdict/report_model.hpp"
#include "src/verdict/shard.hpp"

namespace kvaudit {
namespace {

struct MergeOptions {
  std::vector<std::string> parts;
  std::string json_file;
  std::string report_dir;
  std::string signing_key;  // signs the merged report of sign-off parts
  bool verbose = false;
};

Result<NamedPart> read_part(const std::string& file) {
  std::ifstream in(file);
  if (!in) return bad_input(file, "cannot open the part");
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(in);
  } catch (const nlohmann::json::parse_error& e) {
    return bad_input(file, fmt::format("not valid JSON: {}", e.what()));
  }
  KVAUDIT_ASSIGN_OR_RETURN(ShardPart part, part_from_json(json, file));
  return NamedPart{file, std::move(part)};
}

// The key that signs the merged report: needed, with --report, when the parts are a sign-off
// (check --signoff --shard), and then the key the parts name; refused otherwise.
Result<std::optional<Ed25519KeyPair>> merge_signing_key(const MergeOptions& options,
                                                        const CheckRun& run) {
  if (!run.signoff) {
    if (!options.signing_key.empty()) {
      return bad_input("--signing-key", "the parts are no sign-off (made without --signoff)");
    }
    return std::optional<Ed25519KeyPair>();
  }
  if (options.signing_key.empty() || options.report_dir.empty()) {
    return bad_input("merge",
                     "the parts are a sign-off: needs --signing-key FILE and --report DIR (the "
                     "merged report directory is signed with the key)");
  }
  // The parts are plain JSON anyone can write: a sign-off without a signer, a model or the key
  // that `check --signoff` records is refused here as check refuses it.
  if (run.signoff->signed_by.empty() || run.signoff->model.empty() ||
      run.signoff->public_key.empty()) {
    return bad_input("merge",
                     fmt::format("the parts are a sign-off without {} (check --signoff records "
                                 "--signed-by, --model and the signing key's public key)",
                                 run.signoff->signed_by.empty() ? "a signer"
                                 : run.signoff->model.empty()   ? "a model"
                                                                : "a public key"));
  }
  KVAUDIT_ASSIGN_OR_RETURN(const Ed25519KeyPair key, read_private_key_file(options.signing_key));
  const std::string public_key = bytes_hex(key.public_key);
  if (run.signoff->public_key != public_key) {
    return bad_input(options.signing_key,
                     fmt::format("its public key {} is not the one the parts name, {} (check "
                                 "--signing-key)",
                                 public_key, run.signoff->public_key));
  }
  return std::optional<Ed25519KeyPair>(key);
}

// Each output under a temporary name, renamed into place once both are written.
Status write_outputs(const MergeOptions& options, const CheckRun& run,
                     const Ed25519KeyPair* signing_key) {
  std::optional<AtomicOutputFile> json_file;
  std::optional<AtomicOutputDirectory> report;
  if (!options.json_file.empty()) {
    KVAUDIT_ASSIGN_OR_RETURN(AtomicOutputFile file,
                             AtomicOutputFile::create(options.json_file, "--json"));
    json_file.emplace(std::move(file));
    KVAUDIT_TRY(json_file->write(report_json_text(to_json(run))));
  }
  if (!options.report_dir.empty()) {
    KVAUDIT_ASSIGN_OR_RETURN(AtomicOutputDirectory dir,
                             AtomicOutputDirectory::create(options.report_dir, "--report"));
    for (const char* name : kReportFiles) dir.note_file(name);
    if (run.signoff) {
      for (const char* name : kSignedReportFiles) dir.note_file(name);
    }
    report.emplace(std::move(dir));
    KVAUDIT_TRY(write_report_dir(report->staging_path(), run, signing_key));
  }
  if (json_file) KVAUDIT_TRY(json_file->commit());
  if (report) KVAUDIT_TRY(report->commit());
  return ok_status();
}

Result<int> merge(const MergeOptions& options) {
  std::vector<NamedPart> parts;
  for (const std::string& file : options.parts) {
    KVAUDIT_ASSIGN_OR_RETURN(NamedPart part, read_part(file));
    parts.push_back(std::move(part));
  }
  KVAUDIT_ASSIGN_OR_RETURN(CheckRun run, merge_parts(std::move(parts)));
  KVAUDIT_ASSIGN_OR_RETURN(const std::optional<Ed25519KeyPair> key,
                           merge_signing_key(options, run));
  if (key) run.signoff->public_key = bytes_hex(key->public_key);
  fmt::print(std::cout, "merged {} parts of {}\n", run.provenance.merged_from.size(),
             run.dump_path);
  print_check_table(std::cout, run, options.verbose);
  KVAUDIT_TRY(write_outputs(options, run, key ? &*key : nullptr));
  return run.pass() ? kExitPass : kExitChecksFailed;
}

int run_merge(const MergeOptions& options) {
  const Result<int> status = merge(options);
  return status.ok() ? *status : report_error(status.error());
}

}  // namespace

void register_merge_command(CLI::App& app, CommandRunner& runner) {
  auto options = std::make_shared<MergeOptions>();
  CLI::App* cmd = add_command(
      app, "merge",
      {"Merge the parts of a sharded check into the report the unsharded check gives.",
       "The parts are written by kvaudit check DUMP --shard I/N --json PART.json, one per shard "
       "0..N-1, given in any order. The merged run has the same verdict, results, integrity "
       "findings, steps summary, notes and first divergence (found again from the merged "
       "results); timing is summed over the parts, and the provenance names them (merged_from). "
       "Parts of different dumps (SHA-256), backends, policies, selections, injections or kvaudit "
       "versions are refused, as are a shard given twice and a missing shard. Parts of a "
       "sign-off (check --signoff --shard) need --report DIR and --signing-key FILE, the key the "
       "parts were made with: the merged report directory is signed with it.",
       "0 pass, 1 checks failed, 2 bad input (naming the part), 3 internal error"});
  cmd->add_option("PART", options->parts, "Part files (JSON) written by check --shard")
      ->type_name("FILE ...")
      ->required();
  add_output_path(*cmd, "--json", options->json_file, OutputKind::kFile,
                  "Write the merged report.json to this file");
  add_output_path(*cmd, "--report", options->report_dir, OutputKind::kDirectory,
                  "Write a report directory (report.json, report.md, report.html; signed, with "
                  "report.manifest.json and report.sig, for parts of a sign-off) of the merged "
                  "run");
  add_input_file(*cmd, "--signing-key", options->signing_key,
                 "Parts of a sign-off: the Ed25519 private key (kvaudit keygen) that signs the "
                 "merged report; the parts must name its public key");
  cmd->add_flag("--verbose", options->verbose,
                "Also print the timings (summed over the parts) and the reference throughput");
  cmd->callback([options, &runner] { runner = [options] { return run_merge(*options); }; });
}

}  // namespace kvaudit
