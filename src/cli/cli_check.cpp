// `kvaudit check DUMP`: validate a kvdump, replay it through a backend and the reference, check
// the cache's integrity after every step, judge every comparison with the policy, and report.
// Exit status: 0 pass, 1 checks failed, 2 bad input (dump, options, policy file, backend), 3
// internal error.
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "src/backend/backend.hpp"
#include "src/backend/injection.hpp"
#include "src/cli/backend_registry.hpp"
#include "src/cli/cli.hpp"
#include "src/core/sha256.hpp"
#include "src/format/dump_probe.hpp"
#include "src/format/kvdump.hpp"
#include "src/replay/replay.hpp"
#include "src/report/report.hpp"
#include "src/report/repro.hpp"
#include "src/report/save_outputs.hpp"
#include "src/verdict/policy.hpp"

namespace kvaudit {
namespace {

struct CheckOptions {
  std::string dump;
  std::string backend = "cpu-fp8";
  std::string inject;
  std::string layers;
  std::string steps;
  std::string policy_file;
  bool signoff = false;
  std::string json_file;
  std::string report_dir;
  std::string save_outputs;
  std::string emit_repro;
  int threads = 0;
  bool verbose = false;
  bool progress = false;
  bool list_injections = false;
  bool reciprocal_scale = false;
};

// --list-injections: one line each, with the check meant to catch it.
int print_injections() {
  for (const InjectionInfo& info : injection_table()) {
    std::printf("%-21s %s  [caught by: %s]\n", info.name, info.description, info.caught_by);
  }
  return kExitPass;
}

// "0,1,77" or ranges "0-3,7": non-negative integers.
Result<std::vector<int>> parse_index_list(const std::string& text, const std::string& option) {
  std::vector<int> values;
  std::stringstream stream(text);
  std::string item;
  auto bad = [&](const std::string& why) {
    return bad_input(option, "'" + text + "': " + why + " (expected e.g. 0,1,77 or 0-3)");
  };
  while (std::getline(stream, item, ',')) {
    if (item.empty()) continue;
    const auto dash = item.find('-', 1);
    try {
      std::size_t used = 0;
      if (dash == std::string::npos) {
        const int value = std::stoi(item, &used);
        if (used != item.size() || value < 0) return bad("'" + item + "' is not an index");
        values.push_back(value);
      } else {
        const std::string low_text = item.substr(0, dash);
        const std::string high_text = item.substr(dash + 1);
        std::size_t used_high = 0;
        const int low = std::stoi(low_text, &used);
        const int high = std::stoi(high_text, &used_high);
        if (used != low_text.size() || used_high != high_text.size() || low < 0 || high < low) {
          return bad("'" + item + "' is not a range");
        }
        for (int v = low; v <= high; ++v) values.push_back(v);
      }
    } catch (const std::exception&) {
      return bad("'" + item + "' is not an index");
    }
  }
  if (values.empty()) return bad("no index given");
  return values;
}

std::string format_limits(const ComparisonLimits& limits) {
  std::ostringstream text;
  bool any = false;
  for (const Limit limit : all_limits()) {
    const auto value = limit_value(limits, limit);
    if (!value) continue;
    text << (any ? ", " : "") << limit_name(limit) << " <= " << std::setprecision(3) << *value;
    any = true;
  }
  return any ? text.str() : "no limits";
}

void print_policy(std::ostream& out, const Policy& policy) {
  out << "policy: " << policy.name << " (rel_floor " << policy.rel_floor << ")\n";
  for (const Comparison comparison : all_comparisons()) {
    out << "  " << std::left << std::setw(13) << comparison_name(comparison)
        << format_limits(limits_for(policy, comparison))
        << (comparison_sets_exit(policy, comparison) ? "" : "  (reported, does not set exit)")
        << "\n";
  }
}

// --emit-repro: the first failure as a one-step, one-layer kvdump (src/report/repro.hpp); nothing
// when the run passed.
Status emit_repro(const CheckOptions& options, const DumpReader& reader, const CheckRun& run) {
  if (run.pass()) {
    std::cerr << "kvaudit: the run passed; --emit-repro wrote nothing\n";
    return ok_status();
  }
  const auto target = first_failure_target(reader.layout(), run);
  if (!target) {
    return internal_error("--emit-repro", "the run failed but no failing step and layer is known");
  }
  std::string requests;
  for (const int b : target->requests)
    requests += (requests.empty() ? "" : ",") + std::to_string(b);
  std::string producer = "kvaudit check --emit-repro from " + options.dump + " (step " +
                         std::to_string(target->step) + ", layer " +
                         std::to_string(target->layer_id) + ", request " + requests + "; backend " +
                         options.backend;
  if (!options.inject.empty()) producer += ", --inject " + options.inject;
  if (options.reciprocal_scale) producer += ", --reciprocal-scale";
  producer += "; " + target->failure + ")";
  ReproTarget repro_target = *target;
  repro_target.reciprocal_scale = options.reciprocal_scale;
  auto written = write_repro(reader, repro_target, options.emit_repro, producer);
  if (!written.ok()) return written.error();
  std::cout << "repro: wrote " << options.emit_repro << " (step " << target->step << " layer "
            << target->layer_id << " request " << requests << ": " << written->num_rows << " rows, "
            << written->num_pages << " pages" << (written->has_source ? ", kv_source" : "")
            << "); check it with --backend " << options.backend
            << (options.inject.empty() ? "" : " --inject " + options.inject)
            << (options.reciprocal_scale ? " --reciprocal-scale" : "") << "\n";
  return ok_status();
}

int run_check(const CheckOptions& options) {
  if (options.list_injections) return print_injections();
  if (options.dump.empty()) {
    return report_error(bad_input("kvaudit check", "a DUMP file is required (see --help)"));
  }
  // Validate everything before any work: dump, selection, policy, backend.
  if (const Status probe = probe_dump_in_child(options.dump); !probe.ok()) {
    return report_error(probe.error());
  }
  auto reader = DumpReader::open(options.dump);
  if (!reader.ok()) return report_error(reader.error());

  ReplayOptions replay;
  if (!options.layers.empty()) {
    auto ids = parse_index_list(options.layers, "--layers");
    if (!ids.ok()) return report_error(ids.error());
    replay.layer_ids = ids.value();
  }
  if (!options.steps.empty()) {
    auto steps = parse_index_list(options.steps, "--steps");
    if (!steps.ok()) return report_error(steps.error());
    replay.step_indices = steps.value();
  }
  if (auto selection = check_selection(reader->layout(), replay); !selection.ok()) {
    return report_error(selection.error());
  }

  if (!options.policy_file.empty()) {
    auto policy = load_policy(options.policy_file);
    if (!policy.ok()) return report_error(policy.error());
    replay.policy = policy.value();
    if (options.signoff) replay.policy.quantization_sets_exit = true;
  } else {
    replay.policy = options.signoff ? signoff_policy() : default_policy();
  }
  replay.threads = options.threads;
  replay.reciprocal_scale = options.reciprocal_scale;
  replay.progress = options.progress || isatty(STDERR_FILENO) != 0;

  std::unique_ptr<Backend> backend;
  if (options.backend == "none" && !options.inject.empty()) {
    return report_error(bad_input("--inject", "needs a backend (--backend none runs none)"));
  }
  if (options.backend != "none") {
    BackendOptions backend_options;
    backend_options.threads = options.threads;
    backend_options.injection = options.inject;
    backend_options.reciprocal_scale = options.reciprocal_scale;
    auto made = make_backend(options.backend, backend_options);
    if (!made.ok()) return report_error(made.error());
    backend = std::move(made.value());
  }

  std::optional<OutputsWriter> outputs;
  if (!options.save_outputs.empty()) {
    auto created = OutputsWriter::create(options.save_outputs, options.dump, options.backend);
    if (!created.ok()) return report_error(created.error());
    outputs.emplace(std::move(created.value()));
    replay.observer = [&outputs](const StepLayerOutputs& step_layer) {
      return outputs->write(step_layer);
    };
  }

  auto sha = sha256_file_hex(options.dump);
  if (!sha.ok()) return report_error(sha.error());

  print_policy(std::cout, replay.policy);
  std::cout.flush();

  auto replayed = replay_dump(*reader, backend.get(), replay);
  if (!replayed.ok()) return report_error(replayed.error());
  CheckRun& run = replayed.value();
  run.dump_path = options.dump;
  run.dump_sha256 = sha.value();
  run.provenance = current_provenance();
  if (outputs) {
    if (auto closed = outputs->close(); !closed.ok()) return report_error(closed.error());
  }

  print_check_table(std::cout, run, options.verbose);

  if (!options.json_file.empty()) {
    std::ofstream file(options.json_file);
    file << to_json(run).dump(2) << "\n";
    if (!file) {
      return report_error(bad_input(options.json_file, "cannot write the JSON report"));
    }
  }
  if (!options.report_dir.empty()) {
    if (auto written = write_report_dir(options.report_dir, run); !written.ok()) {
      return report_error(written.error());
    }
  }
  if (!options.emit_repro.empty()) {
    if (auto emitted = emit_repro(options, *reader, run); !emitted.ok()) {
      return report_error(emitted.error());
    }
  }
  return run.pass() ? kExitPass : kExitChecksFailed;
}

}  // namespace

void register_check_command(CLI::App& app, CommandRunner& runner) {
  auto options = std::make_shared<CheckOptions>();
  CLI::App* cmd = app.add_subcommand(
      "check",
      "Replay a kvdump through a backend and the high-precision CPU reference, layer by layer "
      "and step by step. Per (step, layer) it reports kernel error (backend vs R8', the exact "
      "attention on the dequantized FP8 pool the backend read), cache error (R8 on the "
      "reference replay's own pool vs R8': zero while the cache is intact), quantization error "
      "(R8 vs Rs, the exact attention on the source KV, where the dump has it), total error "
      "(backend vs Rs) and the captured outputs' error (dump out/lse vs R8); after every step it "
      "checks the cache: storage still FP8, written slots hold e4m3_rne_satfinite(x / "
      "kv_scale), other slots unchanged, no NaN codes written, captured kv_cache_after equal to "
      "the replay (differing slots classified), NaN codes already in the pool reported as data. "
      "A per-step summary says whether each pool is intact and how error evolves.\n"
      "Exit status: 0 pass, 1 checks failed, 2 bad input or usage (malformed dump, unknown "
      "backend, layer or step not in the dump, bad policy file, no CUDA device for a cuda "
      "backend), 3 internal error.");
  cmd->add_option("DUMP", options->dump, "kvdump HDF5 file (required unless --list-injections)");
  std::string backends;
  for (const std::string& name : backend_names()) backends += name + ", ";
  cmd->add_option("--backend", options->backend,
                  "Backend under test: " + backends +
                      "or none (compare only the captured outputs and pools)")
      ->capture_default_str();
  std::string injections;
  for (const InjectionInfo& info : injection_table()) {
    injections += std::string(injections.empty() ? "" : ", ") + info.name;
  }
  cmd->add_option("--inject", options->inject,
                  "Fault injection into the backend, a mutation test of the harness: " +
                      injections + " (each names the check meant to catch it)");
  cmd->add_flag("--list-injections", options->list_injections,
                "List the fault injections, one line each with the check meant to catch it");
  cmd->add_option("--layers", options->layers,
                  "Layer ids to replay (the model's layer_id, e.g. 0,1,77 or 0-3); default all");
  cmd->add_option("--steps", options->steps,
                  "Step indices to report (e.g. 0,2 or 1-3); every step is still replayed in "
                  "order so the pools evolve as in the dump; default all");
  cmd->add_option("--policy", options->policy_file,
                  "Policy file (JSON, the keys of report.json's policy) instead of the default");
  cmd->add_flag("--signoff", options->signoff,
                "Sign-off policy: quantization and total error limits also set the exit status");
  cmd->add_option("--json", options->json_file, "Write report.json to this file");
  cmd->add_option("--report", options->report_dir,
                  "Write a report directory (report.json, report.md)");
  cmd->add_option("--save-outputs", options->save_outputs,
                  "Write the reference and backend outputs per step and layer to this HDF5 file "
                  "(/steps/S###/L###/{reference_out, reference_lse, reference_source_out, "
                  "reference_source_lse, backend_out, backend_lse})");
  cmd->add_option("--emit-repro", options->emit_repro,
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
  cmd->add_flag("--reciprocal-scale", options->reciprocal_scale,
                "Write with e4m3_rne_satfinite(x * fp32(1 / kv_scale)), the convention of servers "
                "that multiply by a reciprocal scale, instead of kvdump-v1's x / kv_scale: in the "
                "reference replay (so captured pools are judged by it) and in the backend. It "
                "differs in the last bit of rare codes; the report notes it");
  cmd->add_option("--threads", options->threads,
                  "Threads for the reference and CPU backends (0: every core)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_flag("--verbose", options->verbose,
                "Also print timings and the reference throughput (rows*heads*tokens/s)");
  cmd->add_flag("--progress", options->progress,
                "Print progress on stderr even when it is not a terminal");
  cmd->callback([options, &runner] { runner = [options] { return run_check(*options); }; });
}

}  // namespace kvaudit
