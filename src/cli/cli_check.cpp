// `kvaudit check DUMP`: validate a kvdump, replay it through a backend and the reference, check
// the cache's integrity after every step, judge every comparison with the policy, and report.
// Exit status: 0 pass, 1 checks failed, 2 bad input (dump, options, policy file, backend, an output
// path), 3 internal error. Every output (--json, --report, --save-outputs, --emit-repro) is
// created under a temporary name before the replay starts and renamed into place only when every
// one of them has been written (src/core/output_file.hpp): a check that fails to run leaves none.
#include <fmt/format.h>
#include <fmt/ostream.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <future>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "src/backend/backend.hpp"
#include "src/backend/injection.hpp"
#include "src/cli/backend_selection.hpp"
#include "src/cli/check_shard.hpp"
#include "src/cli/cli.hpp"
#include "src/core/cuda_device.hpp"
#include "src/core/ed25519.hpp"
#include "src/core/output_file.hpp"
#include "src/core/sha256.hpp"
#include "src/format/dump_probe.hpp"
#include "src/format/kvdump.hpp"
#include "src/replay/diagnosis.hpp"
#include "src/replay/replay.hpp"
#include "src/report/report.hpp"
#include "src/report/repro.hpp"
#include "src/report/save_outputs.hpp"
#include "src/verdict/policy.hpp"
#include "src/verdict/report_model.hpp"

namespace kvaudit {
namespace {

// ---- sign-off fields (--signed-by, --model, --deployment, --signing-key): who signs a --signoff
// report, for what, and the Ed25519 key that signs it. report.json's "signoff" block carries them
// (the public key) with the report's checksum; the report directory its signature
// (src/report/report_signature.hpp), checked later by `kvaudit verify-report`.
struct SignOffFields {
  std::string signed_by;
  std::string model;
  std::string deployment;
  std::string signing_key;  // the private key file (kvaudit keygen)
  bool any() const {
    return !signed_by.empty() || !model.empty() || !deployment.empty() || !signing_key.empty();
  }
};

void add_signoff_options(CLI::App& cmd, SignOffFields& fields) {
  cmd.add_option("--signed-by", fields.signed_by,
                 "With --signoff (required there): who signs the report (a name), written into "
                 "report.json's signoff block and the signed manifest");
  cmd.add_option("--model", fields.model,
                 "With --signoff (required there): the model the sign-off is for (e.g. GLM-5)");
  cmd.add_option("--deployment", fields.deployment,
                 "With --signoff: the deployment the sign-off is for (free text: server, "
                 "kernel version, GPU)");
  add_input_file(cmd, "--signing-key", fields.signing_key,
                 "With --signoff (required there): the Ed25519 private key that signs the report "
                 "(kvaudit keygen --out FILE writes one); its public key goes into the report");
}

// A sign-off: the signer recorded in the run, and the key that signs its report.
struct SignOffRequest {
  SignOff signer;
  Ed25519KeyPair key;
};

// The fields a sign-off cannot do without, each refused on its own line when missing.
Status check_signoff_fields(const SignOffFields& fields, bool writes_report) {
  if (fields.signed_by.empty()) {
    return bad_input("--signoff", "needs --signed-by NAME (a sign-off names who signs it)");
  }
  if (fields.model.empty()) {
    return bad_input("--signoff", "needs --model NAME (a sign-off names the model it is for)");
  }
  if (fields.signing_key.empty()) {
    return bad_input("--signoff",
                     "needs --signing-key FILE (the report is signed with it; kvaudit keygen --out "
                     "FILE makes one)");
  }
  if (!writes_report) {
    return bad_input("--signoff",
                     "needs --report DIR (the signature covers a report directory; a sharded "
                     "check's part, --shard with --json FILE, is signed by kvaudit merge --report "
                     "DIR --signing-key FILE)");
  }
  return ok_status();
}

// The run's sign-off under --signoff (signer and key); the fields without --signoff are a usage
// error. `writes_report`: --report DIR given, or --shard with --json (the part goes to merge).
Result<std::optional<SignOffRequest>> signoff_of(bool signoff, const SignOffFields& fields,
                                                 bool writes_report) {
  if (!signoff) {
    if (fields.any()) {
      return bad_input(!fields.signed_by.empty()    ? "--signed-by"
                       : !fields.model.empty()      ? "--model"
                       : !fields.deployment.empty() ? "--deployment"
                                                    : "--signing-key",
                       "needs --signoff (only a sign-off report is signed)");
    }
    return std::optional<SignOffRequest>();
  }
  KVAUDIT_TRY(check_signoff_fields(fields, writes_report));
  KVAUDIT_ASSIGN_OR_RETURN(const Ed25519KeyPair key, read_private_key_file(fields.signing_key));
  return std::optional<SignOffRequest>(SignOffRequest{
      SignOff{fields.signed_by, fields.model, fields.deployment, bytes_hex(key.public_key)}, key});
}

struct CheckOptions {
  std::string dump;
  BackendSelection
      selection;  // --backend, --backend-command, --inject, --reciprocal-scale, --cuda-*
  std::string layers;
  std::string steps;
  std::string policy_file;
  bool signoff = false;
  SignOffFields signoff_fields;
  std::string json_file;
  std::string report_dir;
  std::string save_outputs;
  std::string emit_repro;
  std::string shard;  // --shard I/N or auto/N (src/cli/check_shard.hpp)
  int threads = 0;
  int layers_in_flight = 0;       // --layers-in-flight; 0: by device (layers_in_flight_for)
  std::string reference = "cpu";  // --reference: cpu or cuda (checked by CLI11)
  bool verbose = false;
  bool progress = false;
  bool list_injections = false;
  bool list_diagnoses = false;
  int diagnose = kDefaultDiagnoseLimit;
  std::string diagnose_tiles;  // --diagnose-tile "64", "64x4,128x2"
  int certify = kDefaultCertificationSamples;
};

// --list-injections: one line each, with the check meant to catch it.
int print_injections() {
  for (const InjectionInfo& info : injection_table()) {
    fmt::print("{:<21} {}  [caught by: {}]\n", info.name, info.description, info.caught_by);
  }
  return kExitPass;
}

// --diagnose-tile (or a backend's describe "diagnose_tiles", named by `origin` in errors):
// comma-separated TILE or TILExSPLITS, each a positive count.
Result<std::vector<TileShape>> parse_tile_shapes(const std::string& text,
                                                 std::string_view origin = "--diagnose-tile") {
  std::vector<TileShape> shapes;
  std::size_t start = 0;
  while (start <= text.size()) {
    const std::size_t comma = std::min(text.find(',', start), text.size());
    const std::string item = text.substr(start, comma - start);
    const std::size_t x = item.find('x');
    TileShape shape;
    std::size_t used_tile = 0;
    std::size_t used_splits = 0;
    try {
      const std::string tile_text = item.substr(0, x);
      shape.tile = std::stoi(tile_text, &used_tile);
      if (used_tile != tile_text.size()) shape.tile = 0;
      if (x != std::string::npos) {
        const std::string splits_text = item.substr(x + 1);
        shape.splits = std::stoi(splits_text, &used_splits);
        if (used_splits != splits_text.size()) shape.splits = 0;
      }
    } catch (const std::exception&) {
      shape.tile = 0;
    }
    if (shape.tile <= 0 || shape.tile > 65536 || shape.splits <= 0 || shape.splits > 65536) {
      return bad_input(std::string(origin),
                       fmt::format("'{}' is not TILE or TILExSPLITS with positive counts up to "
                                   "65536 (e.g. 64 or 64x4)",
                                   item));
    }
    shapes.push_back(shape);
    start = comma + 1;
  }
  return shapes;
}

// --list-diagnoses: the catalogue of convention mismatches, one line each with what it models.
int print_diagnoses() {
  for (const HypothesisInfo& info : hypothesis_catalogue()) {
    fmt::print("{:<19} {}\n", info.name, info.description);
  }
  return kExitPass;
}

std::string format_limits(const ComparisonLimits& limits) {
  std::vector<std::string> judged;
  for (const Limit limit : all_limits()) {
    if (const auto value = limit_value(limits, limit)) {
      judged.push_back(fmt::format("{} <= {:.3g}", limit_name(limit), *value));
    }
  }
  return judged.empty() ? "no limits" : fmt::format("{}", fmt::join(judged, ", "));
}

void print_policy(std::ostream& out, const Policy& policy) {
  fmt::print(out, "policy: {} (rel_floor {:g})\n", policy.name, policy.rel_floor);
  for (const Comparison comparison : all_comparisons()) {
    fmt::print(out, "  {:<13}{}{}\n", comparison_name(comparison),
               format_limits(limits_for(policy, comparison)),
               comparison_sets_exit(policy, comparison) ? "" : "  (reported, does not set exit)");
  }
}

// --emit-repro: the first failure as a one-step, one-layer kvdump (src/report/repro.hpp) written to
// `path` (the temporary of options.emit_repro); nothing when the run passed, or failed only on the
// indexer cache. Returns whether it wrote the repro.
Result<bool> emit_repro(const CheckOptions& options, const std::filesystem::path& path,
                        const DumpReader& reader, const CheckRun& run) {
  if (run.pass()) {
    std::cerr << "kvaudit: the run passed; --emit-repro wrote nothing\n";
    return false;
  }
  std::optional<ReproTarget> target = first_failure_target(reader.layout(), run);
  const bool indexer_failed =
      std::any_of(run.integrity.begin(), run.integrity.end(),
                  [](const IntegrityFinding& f) { return !f.pass && is_indexer_check(f.check); });
  if (!target && indexer_failed) {  // no attention failure to target
    std::cerr << "kvaudit: the run failed only on the DSA indexer cache (kvdump v1.2), which a "
                 "repro leaves out; --emit-repro wrote nothing\n";
    return false;
  }
  if (!target) {
    return internal_error("--emit-repro", "the run failed but no failing step and layer is known");
  }
  target->reciprocal_scale = options.selection.reciprocal_scale;
  const std::string requests = fmt::format("{}", fmt::join(target->requests, ","));
  const std::string producer = fmt::format(
      "kvaudit check --emit-repro from {} (step {}, layer {}, request {}; backend {}{}; {})",
      options.dump, target->step, target->layer_id, requests, options.selection.backend,
      backend_selection_arguments(options.selection, ", "), target->failure);
  KVAUDIT_ASSIGN_OR_RETURN(const ReproSummary written,
                           write_repro(reader, *target, path, producer));
  fmt::print(std::cout,
             "repro: wrote {} (step {} layer {} request {}: {} rows, {} pages{}); check it with "
             "--backend {}{}\n",
             options.emit_repro, target->step, target->layer_id, requests, written.num_rows,
             written.num_pages, written.has_source ? ", kv_source" : "", options.selection.backend,
             backend_selection_arguments(options.selection, " "));
  return true;
}

Result<Policy> check_policy(const CheckOptions& options) {
  if (options.policy_file.empty()) return options.signoff ? signoff_policy() : default_policy();
  KVAUDIT_ASSIGN_OR_RETURN(Policy policy, load_policy(options.policy_file));
  if (options.signoff) policy.quantization_sets_exit = true;
  return policy;
}

// --reference cuda needs a build with CUDA and a usable device; said before any work (exit 2).
Status check_reference_device(ReferenceDevice device) {
  if (device == ReferenceDevice::kCpu) return ok_status();
  if (!reference_device_built(device)) {
    return bad_input("--reference cuda",
                     "this kvaudit was built without CUDA (KVAUDIT_CUDA=OFF): rebuild with "
                     "-DKVAUDIT_CUDA=ON, or use --reference cpu");
  }
  const CudaDeviceInfo info = cuda_device_info();
  if (!info.present) return bad_input("--reference cuda", info.reason);
  return ok_status();
}

// --layers-in-flight: as given, else kGpuLayersInFlight where the reference or the backend runs on
// a GPU (the next layers' GPU work and reads overlap this layer's CPU comparisons), 1 on the CPU
// alone (each layer already uses every core; a second would only add its memory). On an H100
// (reports/whole-model-speed.md, 2026-12-05) the 78-layer prefill check took 27.2 and 32.2 s with
// 2 layers in flight, 24.3 s with 3, and 21.3, 21.7 and 23.7 s with 4; at 4 the GPU is busy with
// the reference's kernels nearly all the time, so more layers would add memory for little.
constexpr int kGpuLayersInFlight = 4;

int layers_in_flight_for(const CheckOptions& options) {
  if (options.layers_in_flight > 0) return options.layers_in_flight;
  const std::string& backend = options.selection.backend;
  const bool on_gpu =
      options.reference == "cuda" || backend == "cuda-fp8" || backend == "cuda-cast-bf16";
  return on_gpu ? kGpuLayersInFlight : 1;
}

// Layers, steps (checked against the dump), policy and the replay's own options.
Result<ReplayOptions> replay_options(const CheckOptions& options, const DumpLayout& layout) {
  ReplayOptions replay;
  if (!options.layers.empty()) {
    KVAUDIT_ASSIGN_OR_RETURN(replay.layer_ids, parse_index_list(options.layers, "--layers"));
  }
  if (!options.steps.empty()) {
    KVAUDIT_ASSIGN_OR_RETURN(replay.step_indices, parse_index_list(options.steps, "--steps"));
  }
  KVAUDIT_TRY(check_selection(layout, replay));
  KVAUDIT_ASSIGN_OR_RETURN(replay.policy, check_policy(options));
  if (kernel_rounds_kv_to_bf16(layout.attrs)) {
    replay.policy = with_bf16_dequantized_kernel(std::move(replay.policy));
  }
  replay.threads = options.threads;
  replay.reference = options.reference == "cuda" ? ReferenceDevice::kCuda : ReferenceDevice::kCpu;
  KVAUDIT_TRY(check_reference_device(replay.reference));
  replay.reciprocal_scale = options.selection.reciprocal_scale;
  replay.diagnose = options.diagnose;
  if (!options.diagnose_tiles.empty()) {
    KVAUDIT_ASSIGN_OR_RETURN(replay.diagnose_tiles, parse_tile_shapes(options.diagnose_tiles));
  }
  replay.certify = options.certify;
  // --save-outputs writes HDF5 during the replay: layers are then read in place (reads_ahead).
  replay.read_ahead = options.save_outputs.empty();
  replay.layers_in_flight = layers_in_flight_for(options);
  replay.progress = options.progress || isatty(STDERR_FILENO) != 0;
  return replay;
}

// The outputs of one check, each under a temporary name from before the replay until commit().
struct CheckOutputs {
  std::optional<AtomicOutputFile> json;
  std::optional<AtomicOutputDirectory> report;
  std::optional<AtomicOutputFile> save_outputs;
  std::optional<AtomicOutputFile> repro;

  // Renames every output into place, once all are written. A repro is kept only when written.
  Status commit(bool repro_written) {
    if (json) KVAUDIT_TRY(json->commit());
    if (report) KVAUDIT_TRY(report->commit());
    if (save_outputs) KVAUDIT_TRY(save_outputs->commit());
    if (repro && repro_written) KVAUDIT_TRY(repro->commit());
    return ok_status();
  }
};

// Creates the temporaries of every output asked for (the paths were validated before parsing
// ended).
Result<CheckOutputs> open_outputs(const CheckOptions& options) {
  CheckOutputs outputs;
  if (!options.json_file.empty()) {
    KVAUDIT_ASSIGN_OR_RETURN(AtomicOutputFile json,
                             AtomicOutputFile::create(options.json_file, "--json"));
    outputs.json.emplace(std::move(json));
  }
  if (!options.report_dir.empty()) {
    KVAUDIT_ASSIGN_OR_RETURN(AtomicOutputDirectory report,
                             AtomicOutputDirectory::create(options.report_dir, "--report"));
    for (const char* name : kReportFiles) report.note_file(name);
    if (options.signoff) {
      for (const char* name : kSignedReportFiles) report.note_file(name);
    }
    outputs.report.emplace(std::move(report));
  }
  if (!options.save_outputs.empty()) {
    KVAUDIT_ASSIGN_OR_RETURN(AtomicOutputFile saved,
                             AtomicOutputFile::create(options.save_outputs, "--save-outputs"));
    outputs.save_outputs.emplace(std::move(saved));
  }
  if (!options.emit_repro.empty()) {
    KVAUDIT_ASSIGN_OR_RETURN(AtomicOutputFile repro,
                             AtomicOutputFile::create(options.emit_repro, "--emit-repro"));
    outputs.repro.emplace(std::move(repro));
  }
  return outputs;
}

// --json (report.json, or with --shard the part file: report.json and its "shard" key),
// --report, --emit-repro into their temporaries, then every output into place.
Status write_outputs(const CheckOptions& options, const DumpReader& reader, const CheckRun& run,
                     const ShardInfo* shard, const Ed25519KeyPair* signing_key,
                     CheckOutputs& outputs) {
  if (outputs.json) {
    const nlohmann::json doc = shard != nullptr ? part_to_json(run, *shard) : to_json(run);
    KVAUDIT_TRY(outputs.json->write(report_json_text(doc)));
  }
  if (outputs.report) {
    KVAUDIT_TRY(write_report_dir(outputs.report->staging_path(), run, signing_key));
  }
  bool repro_written = false;
  if (outputs.repro) {
    KVAUDIT_ASSIGN_OR_RETURN(repro_written,
                             emit_repro(options, outputs.repro->temp_path(), reader, run));
  }
  return outputs.commit(repro_written);
}

// --shard, resolved before any work (nothing without it).
Result<std::optional<ResolvedShard>> check_shard(const CheckOptions& options) {
  if (options.shard.empty()) return std::optional<ResolvedShard>();
  KVAUDIT_ASSIGN_OR_RETURN(ResolvedShard resolved,
                           resolve_shard(options.shard, process_environment));
  return std::optional<ResolvedShard>(std::move(resolved));
}

// A kvdump v1.2 dump's indexer: check judges its cache writes and stored top-k (integrity), not
// the recall of the deployed selection; one console line says so and names the command that
// judges it (on the console, not in the report's notes, which a shard's part would repeat).
void print_indexer_note(std::ostream& out, const DumpLayout& layout, const std::string& dump) {
  const bool has_indexer = std::any_of(layout.layers.begin(), layout.layers.end(),
                                       [](const LayerMeta& layer) { return layer.indexer; });
  if (!has_indexer) return;
  fmt::print(out,
             "note: the DSA indexer's top-k recall against the exact scores (and the attention "
             "error of the tokens it changes) is not judged by check; check judges the indexer "
             "cache's writes and stored top-k (indexer_* integrity checks). Judge the recall "
             "with: python -m kvdump.indexer_fp8 {}\n",
             shell_quote(dump));
}

// The whole check, or with --shard its part (`shard` then says what the part records).
Result<CheckRun> replay_check(const CheckOptions& options, const DumpReader& reader,
                              Backend* backend, const ReplayOptions& replay,
                              const std::optional<ResolvedShard>& resolved,
                              std::optional<ShardInfo>& shard) {
  if (!resolved) return replay_dump(reader, backend, replay);
  KVAUDIT_ASSIGN_OR_RETURN(ShardPart part, replay_shard(reader, backend, replay, resolved->spec,
                                                        options.selection.inject));
  fmt::print(std::cout, "shard {} ({}): layers [{}] of [{}]\n", shard_name(resolved->spec),
             resolved->source, fmt::join(part.shard.layers, ", "),
             fmt::join(part.shard.selected_layers, ", "));
  shard = std::move(part.shard);
  return std::move(part.run);
}

// The tile shapes p-e4m3-tile replays when --diagnose-tile is not given: the ones the backend
// declares for its kernel (describe's "diagnose_tiles", the --diagnose-tile syntax: an exec
// adapter states its kernel's KV tile and split counts, docs/backend-protocol.md); otherwise the
// diagnosis's default tiles. --diagnose-tile wins over the backend's.
Status take_backend_tiles(const CheckOptions& options, const Backend* backend,
                          ReplayOptions& replay) {
  if (!options.diagnose_tiles.empty() || backend == nullptr) return ok_status();
  const nlohmann::json described = backend->describe();
  const auto tiles = described.find("diagnose_tiles");
  if (tiles == described.end() || tiles->is_null()) return ok_status();
  const std::string origin =
      fmt::format("backend {}'s describe \"diagnose_tiles\"", options.selection.backend);
  if (!tiles->is_string()) return bad_input(origin, "is not a string like \"32x4\" or \"64\"");
  KVAUDIT_ASSIGN_OR_RETURN(replay.diagnose_tiles,
                           parse_tile_shapes(tiles->get<std::string>(), origin));
  fmt::print(std::cout, "p-e4m3-tile replays the backend's KV tiles: {}\n",
             tiles->get<std::string>());
  return ok_status();
}

// The memory guard, with the layers in flight the backend as made allows. Where the count is the
// default (no --layers-in-flight) and that many layers do not fit, one fewer is tried, down to one
// layer at a time, before refusing: the default must not refuse a dump that fits one at a time.
Status check_fits(const CheckOptions& options, const DumpLayout& layout, const Backend* backend,
                  ReplayOptions& replay) {
  const bool with_backend = options.selection.backend != "none";
  Status fits = check_replay_fits(layout, replay, with_backend, backend);
  while (!fits.ok() && options.layers_in_flight == 0 && replay.layers_in_flight > 1) {
    --replay.layers_in_flight;
    fits = check_replay_fits(layout, replay, with_backend, backend);
  }
  return fits;
}

// The exit status of a check, or the error that stopped it. Everything is validated before any
// work: dump, selection, policy, backend, output files.
Result<int> check_dump(const CheckOptions& options) {
  if (options.dump.empty()) {
    return bad_input("check", "DUMP is required (unless --list-injections is given)");
  }
  KVAUDIT_ASSIGN_OR_RETURN(const std::optional<SignOffRequest> signoff,
                           signoff_of(options.signoff, options.signoff_fields,
                                      !options.report_dir.empty() ||
                                          (!options.shard.empty() && !options.json_file.empty())));
  KVAUDIT_TRY(probe_dump_in_child(options.dump));
  KVAUDIT_ASSIGN_OR_RETURN(const DumpReader reader, DumpReader::open(options.dump));
  KVAUDIT_ASSIGN_OR_RETURN(ReplayOptions replay, replay_options(options, reader.layout()));
  KVAUDIT_TRY(check_backend_selection(options.selection, NoBackend::kAllowed));
  KVAUDIT_ASSIGN_OR_RETURN(
      const std::unique_ptr<Backend> backend,
      make_selected_backend(options.selection, reader.layout(), options.threads));
  KVAUDIT_TRY(take_backend_tiles(options, backend.get(), replay));
  KVAUDIT_TRY(check_fits(options, reader.layout(), backend.get(), replay));
  KVAUDIT_ASSIGN_OR_RETURN(const std::optional<ResolvedShard> resolved, check_shard(options));
  KVAUDIT_ASSIGN_OR_RETURN(CheckOutputs files, open_outputs(options));
  std::optional<OutputsWriter> outputs;
  if (files.save_outputs) {
    KVAUDIT_ASSIGN_OR_RETURN(OutputsWriter writer,
                             OutputsWriter::create(files.save_outputs->temp_path(), options.dump,
                                                   options.selection.backend));
    outputs.emplace(std::move(writer));
    replay.observer = [&outputs](const StepLayerOutputs& step_layer) {
      return outputs->write(step_layer);
    };
  }
  // The dump's digest on its own thread, beside the replay (an 8 GB dump takes seconds to hash).
  std::future<Result<std::string>> sha = sha256_file_hex_async(options.dump);

  print_policy(std::cout, replay.policy);
  std::cout.flush();
  std::optional<ShardInfo> shard;
  Result<CheckRun> replayed = replay_check(options, reader, backend.get(), replay, resolved, shard);
  // The digest's error first, as when it was computed before the replay.
  KVAUDIT_ASSIGN_OR_RETURN(const std::string dump_sha256, sha.get());
  KVAUDIT_ASSIGN_OR_RETURN(CheckRun run, std::move(replayed));
  run.dump_path = options.dump;
  run.dump_sha256 = dump_sha256;
  run.provenance = current_provenance();
  if (signoff) run.signoff = signoff->signer;
  // The served scale against the recommended one, on the layers checked (a shard's part: its
  // layers, none for a part without layers; kvaudit merge puts the parts' together).
  if (signoff && !(shard && shard->layers.empty())) {
    KVAUDIT_ASSIGN_OR_RETURN(
        ServedScales served,
        served_scale_checks(reader, shard ? shard->layers : replay.layer_ids, options.threads));
    run.scales = std::move(served.checks);
    // On the console, not in the report's notes: a shard's part would state the whole-dump ones
    // once per part, and `kvaudit merge` must give the unsharded report (the report's sign-off
    // gap rule already names layers without kv_source).
    for (const std::string& note : served.notes) fmt::print(std::cout, "note: {}\n", note);
  }
  if (outputs) KVAUDIT_TRY(outputs->close());
  print_indexer_note(std::cout, reader.layout(), options.dump);

  print_check_table(std::cout, run, options.verbose);
  KVAUDIT_TRY(write_outputs(options, reader, run, shard ? &*shard : nullptr,
                            signoff ? &signoff->key : nullptr, files));
  return run.pass() ? kExitPass : kExitChecksFailed;
}

int run_check(const CheckOptions& options) {
  if (options.list_injections) return print_injections();
  if (options.list_diagnoses) return print_diagnoses();
  const Result<int> status = check_dump(options);
  return status.ok() ? *status : report_error(status.error());
}

// What is checked, and how: the dump, backend, injection, selection, policy.
void add_input_options(CLI::App& cmd, CheckOptions& options) {
  add_input_file(cmd, "DUMP", options.dump,
                 "kvdump HDF5 file (required unless --list-injections or --list-diagnoses)");
  add_backend_selection_options(cmd, options.selection, NoBackend::kAllowed);
  cmd.add_flag("--list-injections", options.list_injections,
               "List the fault injections, one line each with the check meant to catch it");
  cmd.add_option("--layers", options.layers,
                 "Layer ids to replay (the model's layer_id, e.g. 0,1,77 or 0-3); default all");
  cmd.add_option("--steps", options.steps,
                 "Step indices to report (e.g. 0,2 or 1-3); every step is still replayed in "
                 "order so the pools evolve as in the dump; default all");
  add_input_file(cmd, "--policy", options.policy_file,
                 "Policy file (JSON, the keys of report.json's policy) instead of the default");
  cmd.add_flag("--signoff", options.signoff,
               "Sign-off: quantization and total error limits also set the exit status, a "
               "step-layer where they could not be measured (no kv_source) fails, the served "
               "kv_scale is judged against the one kvaudit calibrate recommends (a scales "
               "section; it fails past the quantization limit or scale_error_factor x the "
               "recommended error, naming saturation or underflow), and the report directory is "
               "signed. Needs --signed-by, --model, --signing-key and "
               "--report DIR (with --shard, the part: kvaudit merge signs the merged report)");
  add_signoff_options(cmd, options.signoff_fields);
  cmd.add_option("--shard", options.shard,
                 "Check one part of the layers, for kvaudit merge: I/N (0-based shard I of N: "
                 "the layers checked, in dump order, cut into N contiguous groups of near-equal "
                 "size, the larger first) or auto/N (I = SLURM_ARRAY_TASK_ID - "
                 "SLURM_ARRAY_TASK_MIN in a Slurm job array, else JOB_COMPLETION_INDEX in a "
                 "Kubernetes Indexed Job; Slurm's wins when both are set). --json then writes the "
                 "part file; a shard with no layers writes an empty part");
}

// What is written, and how the run is done: reports, saved outputs, repro, threads, verbosity.
void add_output_options(CLI::App& cmd, CheckOptions& options) {
  add_output_path(cmd, "--json", options.json_file, OutputKind::kFile,
                  "Write report.json to this file");
  add_output_path(
      cmd, "--report", options.report_dir, OutputKind::kDirectory,
      "Write a report directory (report.json, report.md, report.html, and under --signoff their "
      "signature: report.manifest.json, report.sig; without --signoff report.json states its "
      "checksum, which kvaudit verify-report DIR recomputes: no signature; created with its "
      "parents, an existing one keeps its other files)");
  add_output_path(cmd, "--save-outputs", options.save_outputs, OutputKind::kFile,
                  "Write the reference and backend outputs per step and layer to this HDF5 file "
                  "(/steps/S###/L###/{reference_out, reference_lse, reference_source_out, "
                  "reference_source_lse, backend_out, backend_lse})");
  add_output_path(cmd, "--emit-repro", options.emit_repro, OutputKind::kFile,
                  "When the run fails, write a minimal kvdump reproducing its first failure (the "
                  "earliest failing step, then layer): one layer (same layer_id and kv_scale), one "
                  "step S000 of the failing step's kind holding only the request of the first "
                  "divergent row (for an integrity failure, the requests that wrote its first "
                  "offending slot; else the first request with rows), its q/new_kv/out/lse rows, "
                  "and the pages it uses renumbered 0..P-1, filled with the reference replay's "
                  "pool just before that step (a captured kv_cache_after restricted likewise, "
                  "kv_source too when every kept slot's source value is known). Check it alone "
                  "with the same --backend and --inject. A passing "
                  "run writes nothing");
  add_integer_option(
      cmd, "--diagnose", options.diagnose, 0, 1000000,
      "When a kernel or captured comparison fails, try the catalogue of convention "
      "mismatches (lse base and storage, kv_scale forms, softmax scale, FP8 variant, q, K/V "
      "and P roundings; --list-diagnoses), alone and then in pairs and triples, on the pool its "
      "candidate read, and name the one whose replay lands closest to the candidate: within "
      "the policy's explain_fraction (1/4) of the candidate's distance from the reference and "
      "within the comparison's limits; at most N failing (step, layer)s, the earliest first "
      "(0: off)")
      ->capture_default_str();
  cmd.add_option("--diagnose-tile", options.diagnose_tiles,
                 "The KV tile (and split count) p-e4m3-tile replays: TILE or TILExSPLITS, "
                 "comma-separated (64, 64x4,128x2), as the kernel under test cuts a row's tokens "
                 "(splits of ceil(len / SPLITS) rounded up to a multiple of TILE). Default: "
                 "the shapes the backend declares (an exec adapter's describe "
                 "\"diagnose_tiles\", docs/backend-protocol.md), else tiles 16, 32, 64 and 128 "
                 "with one split each; the finding says which fits");
  cmd.add_flag("--list-diagnoses", options.list_diagnoses,
               "List the diagnosis catalogue, one line each with what it models");
  add_integer_option(
      cmd, "--certify", options.certify, 0, 1000,
      "Certify the exact reference on this run's data: at N sample (step, layer, row, head) "
      "sites, fixed by the dump's shape, recompute R8 in 50 decimal digits and require the "
      "reference within 1e-15 (relative on out, absolute on lse; above it: exit 3); the largest "
      "deviation goes into the report (0: off)")
      ->capture_default_str();
  cmd.add_option("--reference", options.reference,
                 "Where the exact reference runs: cpu (the default), or cuda: the same "
                 "double-double algorithms as GPU kernels, with the same bound (1e-15), for dumps "
                 "whose prefill steps would take the CPU hours. --certify recomputes its sample "
                 "sites on the CPU either way. cuda needs a build with CUDA and a GPU (exit 2 "
                 "otherwise, with the reason)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  add_integer_option(cmd, "--threads", options.threads, 0, kMaxThreads,
                     "Threads for the reference and CPU backends (0: every core)")
      ->capture_default_str();
  add_integer_option(
      cmd, "--layers-in-flight", options.layers_in_flight, 0, 64,
      "Replay up to N layers at once, each on its own thread, so that one layer's reference and "
      "backend keep a GPU busy while the layer before is compared on the CPU; the report is the "
      "same for every N (each layer's results are merged in layer order). 0, the default: 4 "
      "where the reference or the backend runs on a GPU (--reference cuda, --backend cuda-*), "
      "fewer where 4 do not fit in memory, else 1 (the CPU reference and cpu-fp8 already use "
      "every core per layer; a second layer adds its memory and little speed). N layers are "
      "resident at once (see Memory above). "
      "Falls back to 1, saying why under --verbose, with --save-outputs, a dump with captured "
      "pools (kv_cache_after) or an exec backend")
      ->capture_default_str();
  cmd.add_flag("--verbose", options.verbose,
               "Also print timings and the reference throughput (rows*heads*tokens/s), and how "
               "many layers were in flight (their stage times overlap then)");
  cmd.add_flag("--progress", options.progress,
               "Print progress on stderr even when it is not a terminal: a line per finished "
               "layer (layer i/N, its steps, its time, the time elapsed, an estimate of the time "
               "left from the mean time per layer so far, the time so far in reading, the "
               "reference, the backend and the comparisons, and the bytes the layer held) and, at "
               "most five times a second, the layer and step running");
}

}  // namespace

void register_check_command(CLI::App& app, CommandRunner& runner) {
  auto options = std::make_shared<CheckOptions>();
  CLI::App* cmd = add_command(
      app, "check",
      {"Replay a kvdump through a backend and the high-precision CPU reference, and judge it.",
       "Layer by layer and step by step. Per (step, layer) it reports kernel error (backend vs "
       "R8', the exact attention on the dequantized FP8 pool the backend read), cache error (R8 "
       "on the reference replay's own pool vs R8': zero while the cache is intact), quantization "
       "error (R8 vs Rs, the exact attention on the source KV, where the dump has it), total "
       "error (backend vs Rs) and the captured outputs' error (dump out/lse vs R8); after every "
       "step it checks the cache: storage still FP8, written slots hold e4m3_rne_satfinite(x / "
       "kv_scale), other slots unchanged, no NaN codes written, captured kv_cache_after equal to "
       "the replay (differing slots classified), NaN codes already in the pool reported as data. "
       "A per-step summary says whether each pool is intact and how error evolves.\n"
       "A kvdump v1.2 dump's DSA indexer cache is judged too (docs/indexer-fp8.md): written "
       "slots of a captured k_cache_after hold the declared rule's codes and scales, other slots "
       "unchanged, and each stored top-k is a top-k of the scores recomputed from the FP8 cache "
       "and query (indexer_* integrity checks); its recall is not (python -m kvdump.indexer_fp8 "
       "DUMP measures it).\n"
       "External backends: --backend exec:NAME --backend-command CMD runs CMD once and judges it "
       "like a built-in backend (docs/backend-protocol.md).\n"
       "Sign-off: make a key once (kvaudit keygen --out FILE), then check --signoff --signed-by "
       "NAME --model NAME --signing-key FILE --report DIR signs the report directory (an Ed25519 "
       "signature over a manifest of its files); kvaudit verify-report DIR --public-key FILE.pub "
       "checks it.\n"
       "Every output path is checked before the replay starts; outputs appear only when the "
       "check has run (a failing check, exit 1, writes its reports too).\n"
       "Memory: layers are streamed, one computed while one reader thread reads the next, so "
       "about read(L) + computed(L) + read(L+1) is resident, roughly 2 x (layer bytes); with "
       "--layers-in-flight N, N layers computed at once and the next read: about N x (read + "
       "computed) + read, roughly (N + 1) x (layer bytes). read = "
       "the layer's pool, kv_source and every step's q, new_kv and captures; computed = the "
       "pool's copy for the backend (twice with one), the reference's rows decoded as floats "
       "(4 bytes per element of the slots a step reads) and the largest step's outputs (R8, "
       "Rs, the backend's and their binary64 copies, about 34 bytes per out element). A dump "
       "larger than memory runs; a layer that does not fit is refused before the replay (exit "
       "2, naming the layer and the bytes). Freed buffers of 8 MiB or more (pools, kv_source, "
       "decoded rows) are kept for the next layer's same buffers, up to 8 and 1 GiB: where "
       "layers differ in size, up to 1 GiB more than the above stays resident. "
       "--progress prints each layer's bytes (and "
       "\"up to N layers in flight\"). With "
       "--save-outputs, or a dump with captured pools (kv_cache_after, a whole pool per step), "
       "each layer is read in place instead and its steps one at a time (HDF5 is not "
       "thread-safe), one layer in flight: about read(L) + computed(L) resident, read counting "
       "the largest step.",
       "0 pass, 1 checks failed, 2 bad input or usage (malformed dump, unknown backend, layer or "
       "step not in the dump, bad policy file, an output path that cannot be written, no CUDA "
       "device for a cuda backend, an exec backend's program that fails, refuses or breaks the "
       "protocol), 3 internal error"});
  add_input_options(*cmd, *options);
  add_output_options(*cmd, *options);
  cmd->callback([options, &runner] { runner = [options] { return run_check(*options); }; });
}

}  // namespace kvaudit
