// `kvaudit bench`: times the CUDA MLA kernels (cuda-fp8 against the seed's cuda-cast-bf16 path)
// over the grid of src/tools/bench_grid.hpp, with the device-to-device copy bandwidth of the same
// run as the yardstick, and measures the CPU reference's throughput. What is counted per case:
// src/tools/mla_attention_bench.hpp; the CPU step: src/tools/bench_cpu.hpp.
//
// Without a usable GPU (none present, or a build without CUDA) the GPU part is skipped with the
// reason and the CPU part still runs (exit 0), unless GPU cases were asked for explicitly
// (--gpu-only or a single case by --batch/--context/...): then exit 2.
//
// --peer exec:NAME --peer-command CMD: a program speaking the external backend protocol times its
// own kernel on every GPU case, in the same run (src/tools/bench_peer.hpp); its time and ratios
// join the table and the JSON. The program is started only when GPU cases run. A case it cannot
// run is recorded as unsupported; a peer that fails a case is recorded as failed, the bench goes
// on, and exits 2 at the end.
#include <fmt/format.h>

#include <cctype>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "src/backend/exec_protocol.hpp"
#include "src/backend/exec_session.hpp"
#include "src/cli/backend_registry.hpp"
#include "src/cli/cli.hpp"
#include "src/core/cuda_device.hpp"
#include "src/core/memory_budget.hpp"
#include "src/core/output_file.hpp"
#include "src/tools/bench_cpu.hpp"
#include "src/tools/bench_grid.hpp"
#include "src/tools/bench_peer.hpp"
#include "src/tools/mla_attention_bench.hpp"

#if defined(KVAUDIT_HAVE_CUDA)
#include "kernels/mla_attention_cuda.hpp"
#endif

namespace kvaudit {
namespace {

using nlohmann::json;

struct BenchCliOptions {
  bool quick = false;
  bool cpu_only = false;
  bool gpu_only = false;
  bool list = false;
  bool no_cast = false;
  bool check_targets = false;
  std::string json_path;
  std::string peer;          // exec:NAME
  std::string peer_command;  // empty: python3 -m kvdump.backends NAME
  bench::GpuBenchOptions gpu;
  std::size_t copy_mib = 1024;
  std::size_t flush_mib = 256;
  bench::GpuCase custom;
  bench::CpuBenchOptions cpu;
  CudaVariantOptions cuda;                   // --cuda-*: the kernel variant timed
  std::vector<CLI::Option*> custom_options;  // any given: one custom GPU case
  CLI::Option* launches_option = nullptr;
  CLI::Option* warmup_option = nullptr;
  CLI::Option* copy_option = nullptr;
  CLI::Option* flush_option = nullptr;
  CLI::Option* cpu_batch_option = nullptr;
  CLI::Option* cpu_context_option = nullptr;
  CLI::Option* cpu_heads_option = nullptr;
  CLI::Option* cpu_seconds_option = nullptr;
};

// The peer of a run: its session and how many cases it failed.
struct PeerRun {
  std::unique_ptr<exec::ExecSession> session;
  int failures = 0;
};

std::string version_string(int v) {  // 13000 -> "13.0"
  return fmt::format("{}.{}", v / 1000, (v % 1000) / 10);
}

// The kernel driver's release ("580.95.05") where Linux exposes it; empty elsewhere.
std::string driver_release() {
  std::ifstream in("/proc/driver/nvidia/version");
  std::string line;
  if (!in || !std::getline(in, line)) return {};
  std::istringstream words(line);
  std::string word;
  while (words >> word) {
    if (!word.empty() && std::isdigit(static_cast<unsigned char>(word[0])) &&
        word.find('.') != std::string::npos) {
      return word;
    }
  }
  return {};
}

json times_json(const bench::LaunchTimes& t) {
  return {{"median_us", t.median_us},
          {"min_us", t.min_us},
          {"max_us", t.max_us},
          {"launches", t.launches}};
}

[[maybe_unused]] json case_json(const bench::GpuCaseResult& r) {
  const bench::GpuCase& c = r.config;
  json j = {{"group", c.group},         {"name", c.name()},
            {"batch", c.batch},         {"context", c.context},
            {"q_len", c.q_len},         {"num_heads", c.num_heads},
            {"page_size", c.page_size}, {"pool_slots", c.effective_pool_slots()},
            {"target", c.target},       {"kv_bytes", c.kv_bytes()},
            {"flop", c.flops()}};
  if (!r.skipped.empty()) {
    j["skipped"] = r.skipped;
    return j;
  }
  j["fp8"] = times_json(r.fp8);
  j["fp8_gbps"] = r.fp8_gbps;
  j["fp8_tflops"] = r.fp8_tflops;
  j["fp8_copy_ratio"] = r.fp8_copy_ratio;
  j["fp8_nonfinite_lse"] = r.fp8_nonfinite_lse;
  j["cast"] = r.cast ? times_json(*r.cast) : json(nullptr);
  if (!r.cast_skipped.empty()) j["cast_skipped"] = r.cast_skipped;
  j["cast_speedup"] = r.cast ? json(r.cast_speedup) : json(nullptr);
  j["max_abs_diff_vs_cast"] = r.cast ? json(r.max_abs_diff_vs_cast) : json(nullptr);
  return j;
}

[[maybe_unused]] void print_case_header(bool with_peer) {
  fmt::print("{:<11} {:<52} {:>10} {:>8} {:>6} {:>8} {:>10} {:>8}{}\n", "group", "case", "fp8 us",
             "GB/s", "%copy", "TFLOP/s", "cast us", "speedup",
             with_peer ? bench::peer_table_header() : "");
}

// One row; `peer` holds the peer's cells (empty without a peer).
[[maybe_unused]] void print_case(const bench::GpuCaseResult& r, const std::string& peer) {
  if (!r.skipped.empty()) {
    fmt::print("{:<11} {:<52} skipped: {}{}\n", r.config.group, r.config.name(), r.skipped, peer);
  } else {
    const std::string cast = r.cast ? fmt::format("{:.1f}", r.cast->median_us) : "-";
    const std::string speedup = r.cast ? fmt::format("{:.1f}x", r.cast_speedup) : "-";
    fmt::print("{:<11} {:<52} {:10.1f} {:8.0f} {:5.0f}% {:8.1f} {:>10} {:>8}{}{}\n", r.config.group,
               r.config.name(), r.fp8.median_us, r.fp8_gbps, 100.0 * r.fp8_copy_ratio, r.fp8_tflops,
               cast, speedup, peer, r.fp8_nonfinite_lse > 0 ? "  (non-finite lse!)" : "");
  }
  std::fflush(stdout);
}

// The peer's time for one case (nothing without a peer), into the case's JSON and the row's cells.
[[maybe_unused]] std::string time_on_peer(PeerRun* peer, const BenchCliOptions& o,
                                          bench::GpuCaseResult& r, double copy_gbps,
                                          json& case_doc) {
  if (peer == nullptr) return {};
  const bench::PeerBenchRequest request{r.config, o.gpu.warmup, o.gpu.launches,
                                        o.gpu.l2_flush_bytes > 0};
  const bench::PeerTiming timing =
      bench::peer_timing_from_reply(peer->session->request_allowing_unsupported(
          bench::peer_bench_request_json(request), "bench", r.config.name()));
  if (timing.outcome == bench::PeerOutcome::kFailed) peer->failures += 1;
  if (timing.outcome == bench::PeerOutcome::kMeasured) r.peer_median_us = timing.median_us;
  case_doc["peer"] = bench::peer_case_json(timing, r, copy_gbps);
  return bench::peer_table_cells(timing, r, copy_gbps);
}

json cpu_json(const bench::CpuBenchResult& r) {
  return {
      {"accumulation", r.accumulation},
      {"threads", r.threads},
      {"batch", r.options.batch},
      {"context", r.options.context},
      {"num_heads", r.options.num_heads},
      {"runs", r.runs},
      {"seconds", r.seconds},
      {"units_per_run", r.units_per_run},
      {"row_head_tokens_per_second", r.units_per_second},
      {"projection",
       {{"what", "one decode step of a full GLM-5 dump: layers x batch x context x heads"},
        {"layers", r.options.project_layers},
        {"batch", r.options.project_batch},
        {"context", r.options.project_context},
        {"num_heads", r.options.project_heads},
        {"row_head_tokens", r.project_units},
        {"seconds", r.project_seconds}}},
      {"plain_binary64",
       {{"what", "the same step in plain uncompensated binary64 (online softmax), same threads"},
        {"runs", r.plain_runs},
        {"seconds", r.plain_seconds},
        {"row_head_tokens_per_second", r.plain_units_per_second},
        {"max_out_difference_over_ref_max", r.plain_max_out_difference}}},
      {"cost_of_exactness", r.cost_of_exactness}};
}

// --quick: small defaults for every option not given explicitly.
void apply_options(BenchCliOptions& o) {
  if (o.quick) {
    if (o.launches_option->count() == 0) o.gpu.launches = 5;
    if (o.warmup_option->count() == 0) o.gpu.warmup = 2;
    if (o.copy_option->count() == 0) o.copy_mib = 64;
    if (o.flush_option->count() == 0) o.flush_mib = 64;
    if (o.cpu_batch_option->count() == 0) o.cpu.batch = 2;
    if (o.cpu_context_option->count() == 0) o.cpu.context = 128;
    if (o.cpu_heads_option->count() == 0) o.cpu.num_heads = 4;
    if (o.cpu_seconds_option->count() == 0) o.cpu.min_seconds = 0;
  }
  o.gpu.copy_bytes = o.copy_mib << 20;
  o.gpu.l2_flush_bytes = o.flush_mib << 20;
  o.cpu.seed = o.gpu.seed;
  o.gpu.variant = o.cuda.variant;
}

bool custom_case_given(const BenchCliOptions& o) {
  bool custom = false;
  for (CLI::Option* opt : o.custom_options) custom |= opt->count() > 0;
  return custom;
}

// The GPU cases to run: the one custom case (checked here), or the grid.
Result<std::vector<bench::GpuCase>> gpu_cases(BenchCliOptions& o, bool custom) {
  std::vector<bench::GpuCase> grid;
  if (custom) {
    o.custom.group = "custom";
    grid.push_back(o.custom);
    if (o.custom.q_len > o.custom.context) {
      return bad_input("bench", "--q-len must not exceed --context");
    }
    if (o.custom.pool_slots > 0 && o.custom.pool_slots < o.custom.needed_slots()) {
      return bad_input("bench",
                       fmt::format("--pool-slots {} is smaller than the {} slots the requests need",
                                   o.custom.pool_slots, o.custom.needed_slots()));
    }
    if (o.custom.pool_slots % o.custom.page_size != 0) {
      return bad_input("bench", "--pool-slots must be a multiple of --page-size");
    }
  } else {
    grid = bench::bench_grid(o.quick);
  }
  if (o.no_cast) {
    for (bench::GpuCase& c : grid) c.with_cast = false;
  }
  return grid;
}

void print_cases(const std::vector<bench::GpuCase>& grid) {
  for (const bench::GpuCase& c : grid) {
    fmt::print("{:<11} {}{}\n", c.group, c.name(),
               c.target.empty() ? "" : fmt::format("  [target {}]", c.target));
  }
}

// What the JSON report says about the run before any figure: tool, build, device, options.
json describe_run(const BenchCliOptions& o, const CudaDeviceInfo& device) {
  json doc;
  doc["tool"] = "kvaudit bench";
  doc["kvaudit_version"] = KVAUDIT_VERSION;
#ifdef KVAUDIT_HAVE_CUDA
  doc["built_with_cuda"] = true;
#else
  doc["built_with_cuda"] = false;
#endif
  json dev = {{"present", device.present}};
  if (device.present) {
    dev["name"] = device.name;
    dev["compute_capability"] = device.compute_capability;
    dev["multiprocessors"] = device.multiprocessors;
    dev["global_memory_bytes"] = device.global_memory_bytes;
    dev["driver_cuda_version"] = version_string(device.driver_version);
    dev["runtime_version"] = version_string(device.runtime_version);
    dev["driver_release"] = driver_release();
  } else {
    dev["reason"] = device.reason;
  }
  doc["device"] = dev;
  doc["options"] = {{"quick", o.quick},
                    {"warmup", o.gpu.warmup},
                    {"launches", o.gpu.launches},
                    {"timing", "CUDA events around each launch; median over launches"},
                    {"l2_flush_bytes_between_launches", o.gpu.l2_flush_bytes},
                    {"copy_bytes", o.gpu.copy_bytes},
                    {"seed", o.gpu.seed}};
  return doc;
}

// Copy bandwidth, then every case, printed as it finishes and recorded in doc["copy"] and
// doc["cases"]. Nothing runs in a build without CUDA (the caller has reported the skip).
Result<std::vector<bench::GpuCaseResult>> run_gpu_cases(
    [[maybe_unused]] const BenchCliOptions& o, [[maybe_unused]] const CudaDeviceInfo& device,
    [[maybe_unused]] const std::vector<bench::GpuCase>& grid, [[maybe_unused]] PeerRun* peer,
    [[maybe_unused]] json& doc) {
  std::vector<bench::GpuCaseResult> results;
#ifdef KVAUDIT_HAVE_CUDA
  fmt::print("kvaudit bench: {} (sm_{}, {} SMs, {:.1f} GiB), driver {} (CUDA {}), runtime {}\n",
             device.name, device.compute_capability, device.multiprocessors,
             device.global_memory_bytes / 1073741824.0, driver_release(),
             version_string(device.driver_version), version_string(device.runtime_version));
  fmt::print(
      "timing: {} warm-up, then median of {} launches (CUDA events); {} MiB written "
      "between launches to evict L2\n",
      o.gpu.warmup, o.gpu.launches, o.flush_mib);
  doc["kernel_variant"] =
      kernel_variant_json(o.gpu.variant, cuda::mla_attention_64_row_path(o.gpu.variant.mma));
  fmt::print(
      "kernel variant: mma {} (--cuda-mma {}), --cuda-decode16 {}, --cuda-host-plan {}, "
      "--cuda-longest-first {}\n",
      doc["kernel_variant"]["mma"].get<std::string>(), mma_choice_name(o.gpu.variant.mma),
      decode16_choice_name(o.gpu.variant.decode16), on_off_name(o.gpu.variant.host_plan),
      on_off_name(o.gpu.variant.longest_first));
  KVAUDIT_ASSIGN_OR_RETURN(const bench::CopyBandwidth copy, bench::measure_copy_bandwidth(o.gpu));
  fmt::print("device-to-device copy: {} MiB in {:.1f} us -> {:.0f} GB/s (bytes read + written)\n",
             copy.bytes >> 20, copy.times.median_us, copy.gbps);
  doc["copy"] = {{"bytes", copy.bytes},
                 {"times", times_json(copy.times)},
                 {"gbps_read_plus_written", copy.gbps}};
  print_case_header(peer != nullptr);
  json cases = json::array();
  for (const bench::GpuCase& c : grid) {
    KVAUDIT_ASSIGN_OR_RETURN(bench::GpuCaseResult r, bench::run_gpu_case(c, o.gpu, copy.gbps));
    json case_doc = case_json(r);
    print_case(r, time_on_peer(peer, o, r, copy.gbps, case_doc));
    cases.push_back(std::move(case_doc));
    results.push_back(std::move(r));
  }
  doc["cases"] = cases;
#endif
  return results;
}

// Prints and records (doc["targets"]) every target the results allow judging; returns whether
// one was evaluated and missed.
bool report_targets(const std::vector<bench::GpuCaseResult>& results, json& doc) {
  if (results.empty()) return false;
  bool missed = false;
  json targets = json::array();
  fmt::print("targets:\n");
  for (const bench::TargetVerdict& v : bench::evaluate_targets(results)) {
    const char* mark = !v.evaluated ? "n/a   " : v.met ? "met   " : "MISSED";
    fmt::print("  {} {:<26} measured {:<8} threshold {:<6} {}\n", mark, v.name,
               v.evaluated ? fmt::format("{:.3g}", v.measured) : "-",
               fmt::format("{:.3g}", v.threshold), v.statement);
    missed |= v.evaluated && !v.met;
    targets.push_back({{"name", v.name},
                       {"statement", v.statement},
                       {"cases", v.cases},
                       {"measured", v.evaluated ? json(v.measured) : json(nullptr)},
                       {"threshold", v.threshold},
                       {"evaluated", v.evaluated},
                       {"met", v.met}});
  }
  doc["targets"] = targets;
  return missed;
}

// The CPU reference's throughput and the projection to a full GLM-5 decode step.
Status run_cpu_part(const BenchCliOptions& o, json& doc) {
  KVAUDIT_ASSIGN_OR_RETURN(const bench::CpuBenchResult cpu, bench::run_cpu_reference_bench(o.cpu));
  fmt::print(
      "CPU reference ({}, {} threads): decode B={} x ctx={} x H={}, {} run(s) in {:.2f} s: "
      "{:.3g} row*head*tokens/s; projected full GLM-5 dump step ({} layers x B={} x ctx={} x "
      "H={}): {:.1f} s\n",
      cpu.accumulation, cpu.threads, cpu.options.batch, cpu.options.context, cpu.options.num_heads,
      cpu.runs, cpu.seconds, cpu.units_per_second, cpu.options.project_layers,
      cpu.options.project_batch, cpu.options.project_context, cpu.options.project_heads,
      cpu.project_seconds);
  fmt::print(
      "plain binary64 loop (no compensation), same step and threads: {} run(s) in {:.2f} s: {:.3g} "
      "row*head*tokens/s; the exact reference costs {:.2f}x (its out differs from the plain "
      "loop's by {:.2g} of max |out|)\n",
      cpu.plain_runs, cpu.plain_seconds, cpu.plain_units_per_second, cpu.cost_of_exactness,
      cpu.plain_max_out_difference);
  doc["cpu_reference"] = cpu_json(cpu);
  return ok_status();
}

// The memory the CPU part allocates: the pool's values as floats plus the permutation and page
// list (batch x context slots), and per query row its q, out (double) and lse, twice (the
// reference's and the plain baseline's).
double cpu_bench_bytes(const bench::CpuBenchOptions& cpu) {
  const double slots = static_cast<double>(cpu.batch) * cpu.context;
  const double rows = static_cast<double>(cpu.batch) * cpu.num_heads;
  return slots * (576.0 * 4.0 + 8.0) + rows * (576.0 * 4.0 + 2.0 * (512.0 * 8.0 + 8.0));
}

// Before any work: the JSON file's temporary (its path was validated before parsing ended) and
// whether the CPU part fits in memory.
Result<std::optional<AtomicOutputFile>> prepare_bench(const BenchCliOptions& o) {
  if (!o.gpu_only) {
    KVAUDIT_TRY(
        check_memory_fits(cpu_bench_bytes(o.cpu), "bench",
                          fmt::format("--cpu-batch {} x --cpu-context {} tokens of 576 channels",
                                      o.cpu.batch, o.cpu.context)));
  }
  std::optional<AtomicOutputFile> json_file;
  if (!o.json_path.empty()) {
    KVAUDIT_ASSIGN_OR_RETURN(AtomicOutputFile file,
                             AtomicOutputFile::create(o.json_path, "--json"));
    json_file.emplace(std::move(file));
  }
  return json_file;
}

// --peer exec:NAME and --peer-command, checked before anything runs.
Status check_peer_options(const BenchCliOptions& o) {
  if (o.peer.empty()) {
    if (o.peer_command.empty()) return ok_status();
    return bad_input("--peer-command", "starts the program of --peer exec:NAME; no --peer given");
  }
  const std::optional<std::string_view> name = exec_backend_name(o.peer);
  if (!name) {
    return bad_input("--peer", fmt::format("'{}' is not exec:NAME (a program speaking the "
                                           "external backend protocol)",
                                           o.peer));
  }
  return exec::check_exec_name(*name, "--peer");
}

// Starts the peer and says hello without a model (a bench session); what it says about itself
// goes into doc["peer"].
Result<PeerRun> start_peer(const BenchCliOptions& o, json& doc) {
  const std::string name(*exec_backend_name(o.peer));
  const std::string command =
      o.peer_command.empty() ? exec::default_exec_command(name) : o.peer_command;
  PeerRun peer;
  KVAUDIT_ASSIGN_OR_RETURN(peer.session, exec::ExecSession::start(o.peer, command));
  KVAUDIT_ASSIGN_OR_RETURN(const exec::HelloReply hello, peer.session->hello(name, nullptr, false));
  doc["peer"] = {{"backend", o.peer},
                 {"command", command},
                 {"protocol_version", exec::kProtocolVersion},
                 {"capabilities", hello.capabilities},
                 {"describe", hello.describe}};
  fmt::print("peer: {} ({}), timing each GPU case in the same run\n", o.peer, command);
  return peer;
}

// The GPU cases, with the peer where one is given; exit 2 when it failed a case.
Result<std::vector<bench::GpuCaseResult>> run_gpu_part(const BenchCliOptions& o,
                                                       const CudaDeviceInfo& device,
                                                       const std::vector<bench::GpuCase>& grid,
                                                       json& doc, int& peer_failures) {
  std::optional<PeerRun> peer;
  if (!o.peer.empty()) {
    KVAUDIT_ASSIGN_OR_RETURN(peer, start_peer(o, doc));
  }
  KVAUDIT_ASSIGN_OR_RETURN(std::vector<bench::GpuCaseResult> results,
                           run_gpu_cases(o, device, grid, peer ? &*peer : nullptr, doc));
  if (peer && peer->failures > 0) {
    peer_failures = peer->failures;
    fmt::print(stderr,
               "kvaudit: {}: the peer failed {} case(s) (their \"peer\" objects in the "
               "JSON say why)\n",
               o.peer, peer->failures);
  }
  return results;
}

// options, cases (or --list), device, GPU cases (and the peer), targets, CPU reference, JSON.
int run_bench(BenchCliOptions& o) {
  const auto wall_start = std::chrono::steady_clock::now();
  apply_options(o);
  const bool custom = custom_case_given(o);
  auto grid = gpu_cases(o, custom);
  if (!grid) return report_error(grid.error());
  if (const Status peer = check_peer_options(o); !peer) return report_error(peer.error());
  if (o.list) {
    print_cases(*grid);
    return kExitPass;
  }
  auto json_file = prepare_bench(o);
  if (!json_file) return report_error(json_file.error());

  const CudaDeviceInfo device = cuda_device_info();
  json doc = describe_run(o, device);
  bool run_gpu = !o.cpu_only;
  if (run_gpu && !device.present) {
    if (o.gpu_only || custom) {
      return report_error(bad_input("bench", "GPU cases were asked for, but " + device.reason));
    }
    fmt::print("GPU cases skipped: {}\n", device.reason);
    doc["gpu_skipped"] = device.reason;
    run_gpu = false;
  }
  std::vector<bench::GpuCaseResult> results;
  int peer_failures = 0;
  if (run_gpu) {
    auto ran = run_gpu_part(o, device, *grid, doc, peer_failures);
    if (!ran) return report_error(ran.error());
    results = std::move(*ran);
  } else if (!o.peer.empty()) {
    fmt::print("peer {} not started: no GPU case runs\n", o.peer);
  }
  const bool targets_missed = report_targets(results, doc);
  if (!o.gpu_only) {
    const Status cpu = run_cpu_part(o, doc);
    if (!cpu.ok()) return report_error(cpu.error());
  }

  const double wall =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
  doc["wall_seconds"] = wall;
  fmt::print("bench finished in {:.1f} s\n", wall);
  if (*json_file) {
    Status written = (*json_file)->write(doc.dump(2) + "\n");
    if (written.ok()) written = (*json_file)->commit();
    if (!written.ok()) return report_error(written.error());
  }
  if (peer_failures > 0) return kExitBadInput;
  return o.check_targets && targets_missed ? kExitChecksFailed : kExitPass;
}

// --peer and --peer-command (src/tools/bench_peer.hpp).
void add_peer_options(CLI::App& cmd, BenchCliOptions& o) {
  cmd.add_option("--peer", o.peer,
                 "Also time a program outside kvaudit on every GPU case, in the same run: "
                 "exec:NAME, speaking the external backend protocol's bench request "
                 "(docs/backend-protocol.md); its time, its time over cuda-fp8's and its share "
                 "of the copy bandwidth join the table and the JSON (\"peer\"); cases it cannot "
                 "run are recorded as unsupported");
  cmd.add_option("--peer-command", o.peer_command,
                 "The command that starts the --peer program, run by /bin/sh -c (default: "
                 "python3 -m kvdump.backends NAME)");
}

// The grid's run: what runs, how long, what is written.
void add_run_options(CLI::App& cmd, BenchCliOptions& o) {
  cmd.add_flag("--quick", o.quick,
               "Tiny grid and few launches (tests, smoke runs); explicit options still apply");
  auto* cpu_only =
      cmd.add_flag("--cpu-only", o.cpu_only, "Only the CPU reference throughput (no GPU needed)");
  cmd.add_flag("--gpu-only", o.gpu_only, "Only the GPU cases (exit 2 without a GPU)")
      ->excludes(cpu_only);
  cmd.add_flag("--list", o.list, "Print the GPU cases that would run, and exit");
  add_output_path(cmd, "--json", o.json_path, OutputKind::kFile,
                  "Also write every figure to this JSON file");
  cmd.add_flag("--no-cast", o.no_cast, "Do not time the cuda-cast-bf16 path");
  cmd.add_flag("--check-targets", o.check_targets,
               "Exit 1 when a stated target (see the 'targets' lines) is evaluated and missed");
  o.launches_option = add_integer_option(cmd, "--launches", o.gpu.launches, 1, 100000,
                                         "Timed launches per case and path (median reported)")
                          ->capture_default_str();
  o.warmup_option =
      add_integer_option(cmd, "--warmup", o.gpu.warmup, 0, 100000, "Untimed launches first")
          ->capture_default_str();
  add_seed_option(cmd, "--seed", o.gpu.seed, "Seed of pools, queries and page permutations")
      ->capture_default_str();
  o.copy_option = add_integer_option(cmd, "--copy-mib", o.copy_mib, std::size_t{1},
                                     std::size_t{65536}, "Bytes of the device-to-device copy (MiB)")
                      ->capture_default_str();
  o.flush_option =
      add_integer_option(cmd, "--l2-flush-mib", o.flush_mib, std::size_t{0}, std::size_t{65536},
                         "MiB overwritten between timed launches so KV is read from HBM (0: none)")
          ->capture_default_str();
}

// One custom GPU case instead of the grid.
void add_custom_case_options(CLI::App& cmd, BenchCliOptions& o) {
  const std::string group = "One GPU case (any of these replaces the grid)";
  o.custom_options = {
      add_integer_option(cmd, "--batch", o.custom.batch, 1, 1 << 20, "Requests")->group(group),
      add_integer_option(cmd, "--context", o.custom.context, 1, 1 << 24,
                         "Visible tokens per request")
          ->group(group),
      add_integer_option(cmd, "--heads", o.custom.num_heads, 1, 1024, "Query heads")->group(group),
      add_integer_option(cmd, "--page-size", o.custom.page_size, 1, 1 << 16, "Slots per page")
          ->group(group),
      add_integer_option(cmd, "--pool-slots", o.custom.pool_slots, std::int64_t{0},
                         std::int64_t{1} << 34,
                         "Pool size in slots (default: just what the requests need)")
          ->group(group),
      add_integer_option(cmd, "--q-len", o.custom.q_len, 1, 1 << 24,
                         "Query rows per request (1: decode; more: causal prefill/extend)")
          ->group(group)};
}

// The CPU reference's throughput and the GLM-5 step it is projected to.
void add_cpu_options(CLI::App& cmd, BenchCliOptions& o) {
  const std::string group = "CPU reference";
  o.cpu_batch_option =
      add_integer_option(cmd, "--cpu-batch", o.cpu.batch, 1, 1 << 16, "Decode requests")
          ->capture_default_str()
          ->group(group);
  o.cpu_context_option =
      add_integer_option(cmd, "--cpu-context", o.cpu.context, 1, 1 << 24, "Tokens per request")
          ->capture_default_str()
          ->group(group);
  o.cpu_heads_option =
      add_integer_option(cmd, "--cpu-heads", o.cpu.num_heads, 1, 1024, "Query heads")
          ->capture_default_str()
          ->group(group);
  add_integer_option(cmd, "--cpu-threads", o.cpu.threads, 0, kMaxThreads, "Threads (0: every core)")
      ->capture_default_str()
      ->group(group);
  o.cpu_seconds_option =
      add_number_option(cmd, "--cpu-seconds", o.cpu.min_seconds, 0.0, 3600.0,
                        "Repeat the reference until this much wall time has passed (at least once)")
          ->capture_default_str()
          ->group(group);
  add_integer_option(cmd, "--project-batch", o.cpu.project_batch, 1, 1 << 20,
                     "Requests of the projected GLM-5 decode step")
      ->capture_default_str()
      ->group(group);
  add_integer_option(cmd, "--project-context", o.cpu.project_context, 1, 1 << 24,
                     "Tokens per request of the projected step")
      ->capture_default_str()
      ->group(group);
  add_integer_option(cmd, "--project-layers", o.cpu.project_layers, 1, 1024,
                     "Layers of the projected step")
      ->capture_default_str()
      ->group(group);
  add_integer_option(cmd, "--project-heads", o.cpu.project_heads, 1, 1024,
                     "Heads of the projected step")
      ->capture_default_str()
      ->group(group);
}

}  // namespace

void register_bench_command(CLI::App& app, CommandRunner& runner) {
  auto o = std::make_shared<BenchCliOptions>();
  CLI::App* cmd = add_command(
      app, "bench",
      {"Time the CUDA MLA attention kernels and measure the CPU reference's throughput.",
       "cuda-fp8 (reads the FP8 pool directly) against the seed's cuda-cast-bf16 (cast the whole "
       "pool to bf16, then attend; timed together per call), over a grid of batch, context, "
       "heads, page size and pool size, with a device-to-device copy measured in the same run as "
       "the bandwidth yardstick. Per case: median time of many launches (CUDA events, after "
       "warm-up, L2 evicted between launches), KV bytes (576 per visible token, each request's "
       "tokens once), GB/s, % of copy bandwidth, TFLOP/s (2176 FLOP per token per head), cast "
       "time and speedup.\n"
       "Without a GPU (or in a build without CUDA) the GPU cases are skipped with the reason and "
       "the CPU part still runs (exit 0); asking for GPU cases explicitly (--gpu-only, or one "
       "case by --batch/--context/--heads/--page-size/--pool-slots/--q-len) exits 2 there.\n"
       "--peer exec:NAME --peer-command CMD times another implementation (e.g. FlashInfer "
       "through python3 -m kvdump.backends flashinfer-fp8) on the same cases, side by side.",
       "0 done, 1 a stated target missed under --check-targets, 2 bad options, GPU cases asked "
       "for without a GPU, sizes this machine cannot hold, or a --peer that failed a case, 3 "
       "internal error"});
  add_run_options(*cmd, *o);
  add_peer_options(*cmd, *o);
  add_custom_case_options(*cmd, *o);
  add_cpu_options(*cmd, *o);
  add_cuda_variant_options(*cmd, o->cuda);
  cmd->callback([o, &runner] { runner = [o] { return run_bench(*o); }; });
}

}  // namespace kvaudit
