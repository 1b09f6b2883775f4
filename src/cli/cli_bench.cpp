// `kvaudit bench`: times the CUDA MLA kernels (cuda-fp8 against the seed's cuda-cast-bf16 path)
// over the grid of src/tools/bench_grid.hpp, with the device-to-device copy bandwidth of the same
// run as the yardstick, and measures the CPU reference's throughput. What is counted per case:
// kernels/mla_attention_bench.hpp; the CPU step: src/tools/bench_cpu.hpp.
//
// Without a usable GPU (none present, or a build without CUDA) the GPU part is skipped with the
// reason and the CPU part still runs (exit 0), unless GPU cases were asked for explicitly
// (--gpu-only or a single case by --batch/--context/...): then exit 2.
#include <cctype>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/mla_attention_bench.hpp"
#include "src/cli/cli.hpp"
#include "src/core/cuda_device.hpp"
#include "src/tools/bench_cpu.hpp"
#include "src/tools/bench_grid.hpp"

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
  bench::GpuBenchOptions gpu;
  std::size_t copy_mib = 1024;
  std::size_t flush_mib = 256;
  bench::GpuCase custom;
  bench::CpuBenchOptions cpu;
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

std::string version_string(int v) {  // 13000 -> "13.0"
  return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
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

std::string format(const char* fmt, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, v);
  return buf;
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

[[maybe_unused]] void print_case_header() {
  std::printf("%-11s %-52s %10s %8s %6s %8s %10s %8s\n", "group", "case", "fp8 us", "GB/s", "%copy",
              "TFLOP/s", "cast us", "speedup");
}

[[maybe_unused]] void print_case(const bench::GpuCaseResult& r) {
  if (!r.skipped.empty()) {
    std::printf("%-11s %-52s skipped: %s\n", r.config.group.c_str(), r.config.name().c_str(),
                r.skipped.c_str());
  } else {
    const std::string cast = r.cast ? format("%.1f", r.cast->median_us) : "-";
    const std::string speedup = r.cast ? format("%.1fx", r.cast_speedup) : "-";
    std::printf("%-11s %-52s %10.1f %8.0f %5.0f%% %8.1f %10s %8s%s\n", r.config.group.c_str(),
                r.config.name().c_str(), r.fp8.median_us, r.fp8_gbps, 100.0 * r.fp8_copy_ratio,
                r.fp8_tflops, cast.c_str(), speedup.c_str(),
                r.fp8_nonfinite_lse > 0 ? "  (non-finite lse!)" : "");
  }
  std::fflush(stdout);
}

json cpu_json(const bench::CpuBenchResult& r) {
  return {{"accumulation", r.accumulation},
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
            {"seconds", r.project_seconds}}}};
}

int run_bench(BenchCliOptions& o) {
  const auto wall_start = std::chrono::steady_clock::now();
  bool custom = false;
  for (CLI::Option* opt : o.custom_options) custom |= opt->count() > 0;
  if (o.quick) {
    // Small defaults unless given explicitly.
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

  std::vector<bench::GpuCase> grid;
  if (custom) {
    o.custom.group = "custom";
    grid.push_back(o.custom);
    if (o.custom.q_len > o.custom.context) {
      return report_error(bad_input("bench", "--q-len must not exceed --context"));
    }
    if (o.custom.pool_slots > 0 && o.custom.pool_slots < o.custom.needed_slots()) {
      return report_error(bad_input(
          "bench", "--pool-slots " + std::to_string(o.custom.pool_slots) + " is smaller than the " +
                       std::to_string(o.custom.needed_slots()) + " slots the requests need"));
    }
    if (o.custom.pool_slots % o.custom.page_size != 0) {
      return report_error(bad_input("bench", "--pool-slots must be a multiple of --page-size"));
    }
  } else {
    grid = bench::bench_grid(o.quick);
  }
  if (o.no_cast) {
    for (bench::GpuCase& c : grid) c.with_cast = false;
  }
  if (o.list) {
    for (const bench::GpuCase& c : grid) {
      std::printf("%-11s %s%s\n", c.group.c_str(), c.name().c_str(),
                  c.target.empty() ? "" : ("  [target " + c.target + "]").c_str());
    }
    return kExitPass;
  }

  const CudaDeviceInfo device = cuda_device_info();
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

  bool run_gpu = !o.cpu_only;
  if (run_gpu && !device.present) {
    if (o.gpu_only || custom) {
      return report_error(bad_input("bench", "GPU cases were asked for, but " + device.reason));
    }
    std::printf("GPU cases skipped: %s\n", device.reason.c_str());
    doc["gpu_skipped"] = device.reason;
    run_gpu = false;
  }

  std::vector<bench::GpuCaseResult> results;
  if (run_gpu) {
#ifdef KVAUDIT_HAVE_CUDA
    std::printf("kvaudit bench: %s (sm_%d, %d SMs, %.1f GiB), driver %s (CUDA %s), runtime %s\n",
                device.name.c_str(), device.compute_capability, device.multiprocessors,
                device.global_memory_bytes / 1073741824.0, driver_release().c_str(),
                version_string(device.driver_version).c_str(),
                version_string(device.runtime_version).c_str());
    std::printf(
        "timing: %d warm-up, then median of %d launches (CUDA events); %zu MiB written "
        "between launches to evict L2\n",
        o.gpu.warmup, o.gpu.launches, o.flush_mib);
    auto copy = bench::measure_copy_bandwidth(o.gpu);
    if (!copy) return report_error(copy.error());
    std::printf("device-to-device copy: %zu MiB in %.1f us -> %.0f GB/s (bytes read + written)\n",
                copy->bytes >> 20, copy->times.median_us, copy->gbps);
    doc["copy"] = {{"bytes", copy->bytes},
                   {"times", times_json(copy->times)},
                   {"gbps_read_plus_written", copy->gbps}};
    print_case_header();
    json cases = json::array();
    for (const bench::GpuCase& c : grid) {
      auto r = bench::run_gpu_case(c, o.gpu, copy->gbps);
      if (!r) return report_error(r.error());
      print_case(*r);
      cases.push_back(case_json(*r));
      results.push_back(std::move(*r));
    }
    doc["cases"] = cases;
#endif
  }

  bool targets_missed = false;
  if (!results.empty()) {
    json targets = json::array();
    std::printf("targets:\n");
    for (const bench::TargetVerdict& v : bench::evaluate_targets(results)) {
      const char* mark = !v.evaluated ? "n/a   " : v.met ? "met   " : "MISSED";
      std::printf("  %s %-26s measured %-8s threshold %-6s %s\n", mark, v.name.c_str(),
                  v.evaluated ? format("%.3g", v.measured).c_str() : "-",
                  format("%.3g", v.threshold).c_str(), v.statement.c_str());
      targets_missed |= v.evaluated && !v.met;
      targets.push_back({{"name", v.name},
                         {"statement", v.statement},
                         {"cases", v.cases},
                         {"measured", v.evaluated ? json(v.measured) : json(nullptr)},
                         {"threshold", v.threshold},
                         {"evaluated", v.evaluated},
                         {"met", v.met}});
    }
    doc["targets"] = targets;
  }

  if (!o.gpu_only) {
    auto cpu = bench::run_cpu_reference_bench(o.cpu);
    if (!cpu) return report_error(cpu.error());
    std::printf(
        "CPU reference (%s, %d threads): decode B=%d x ctx=%d x H=%d, %d run(s) in %.2f s: "
        "%.3g row*head*tokens/s; projected full GLM-5 dump step (%d layers x B=%d x ctx=%d x "
        "H=%d): %.1f s\n",
        cpu->accumulation.c_str(), cpu->threads, cpu->options.batch, cpu->options.context,
        cpu->options.num_heads, cpu->runs, cpu->seconds, cpu->units_per_second,
        cpu->options.project_layers, cpu->options.project_batch, cpu->options.project_context,
        cpu->options.project_heads, cpu->project_seconds);
    doc["cpu_reference"] = cpu_json(*cpu);
  }

  const double wall =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
  doc["wall_seconds"] = wall;
  std::printf("bench finished in %.1f s\n", wall);
  if (!o.json_path.empty()) {
    std::ofstream out(o.json_path);
    out << doc.dump(2) << "\n";
    if (!out) return report_error(bad_input(o.json_path, "cannot write the JSON report"));
  }
  return o.check_targets && targets_missed ? kExitChecksFailed : kExitPass;
}

}  // namespace

void register_bench_command(CLI::App& app, CommandRunner& runner) {
  auto o = std::make_shared<BenchCliOptions>();
  CLI::App* cmd = app.add_subcommand(
      "bench",
      "Time the CUDA MLA attention kernels: cuda-fp8 (reads the FP8 pool directly) against the "
      "seed's cuda-cast-bf16 (cast the whole pool to bf16, then attend; timed together per "
      "call), over a grid of batch, context, heads, page size and pool size, with a "
      "device-to-device copy measured in the same run as the bandwidth yardstick; and measure "
      "the CPU reference's throughput. Per case: median time of many launches (CUDA events, "
      "after warm-up, L2 evicted between launches), KV bytes (576 per visible token, each "
      "request's tokens once), GB/s, % of copy bandwidth, TFLOP/s (2176 FLOP per token per "
      "head), cast time and speedup.\n"
      "Without a GPU (or in a build without CUDA) the GPU cases are skipped with the reason and "
      "the CPU part still runs (exit 0); asking for GPU cases explicitly (--gpu-only, or one "
      "case by --batch/--context/--heads/--page-size/--pool-slots/--q-len) exits 2 there.");
  cmd->add_flag("--quick", o->quick,
                "Tiny grid and few launches (tests, smoke runs); explicit options still apply");
  auto* cpu_only =
      cmd->add_flag("--cpu-only", o->cpu_only, "Only the CPU reference throughput (no GPU needed)");
  cmd->add_flag("--gpu-only", o->gpu_only, "Only the GPU cases (exit 2 without a GPU)")
      ->excludes(cpu_only);
  cmd->add_flag("--list", o->list, "Print the GPU cases that would run, and exit");
  cmd->add_option("--json", o->json_path, "Also write every figure to this JSON file");
  cmd->add_flag("--no-cast", o->no_cast, "Do not time the cuda-cast-bf16 path");
  cmd->add_flag("--check-targets", o->check_targets,
                "Exit 1 when a stated target (see the 'targets' lines) is evaluated and missed");
  o->launches_option = cmd->add_option("--launches", o->gpu.launches,
                                       "Timed launches per case and path (median reported)")
                           ->check(CLI::Range(1, 100000))
                           ->capture_default_str();
  o->warmup_option = cmd->add_option("--warmup", o->gpu.warmup, "Untimed launches first")
                         ->check(CLI::Range(0, 100000))
                         ->capture_default_str();
  cmd->add_option("--seed", o->gpu.seed, "Seed of pools, queries and page permutations")
      ->capture_default_str();
  o->copy_option =
      cmd->add_option("--copy-mib", o->copy_mib, "Bytes of the device-to-device copy (MiB)")
          ->check(CLI::Range(std::size_t{1}, std::size_t{65536}))
          ->capture_default_str();
  o->flush_option =
      cmd->add_option("--l2-flush-mib", o->flush_mib,
                      "MiB overwritten between timed launches so KV is read from HBM (0: none)")
          ->check(CLI::Range(std::size_t{0}, std::size_t{65536}))
          ->capture_default_str();
  const std::string custom_group = "One GPU case (any of these replaces the grid)";
  o->custom_options = {
      cmd->add_option("--batch", o->custom.batch, "Requests")
          ->check(CLI::Range(1, 1 << 20))
          ->group(custom_group),
      cmd->add_option("--context", o->custom.context, "Visible tokens per request")
          ->check(CLI::Range(1, 1 << 24))
          ->group(custom_group),
      cmd->add_option("--heads", o->custom.num_heads, "Query heads")
          ->check(CLI::Range(1, 1024))
          ->group(custom_group),
      cmd->add_option("--page-size", o->custom.page_size, "Slots per page")
          ->check(CLI::Range(1, 1 << 16))
          ->group(custom_group),
      cmd->add_option("--pool-slots", o->custom.pool_slots,
                      "Pool size in slots (default: just what the requests need)")
          ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 34))
          ->group(custom_group),
      cmd->add_option("--q-len", o->custom.q_len,
                      "Query rows per request (1: decode; more: causal prefill/extend)")
          ->check(CLI::Range(1, 1 << 24))
          ->group(custom_group)};
  const std::string cpu_group = "CPU reference";
  o->cpu_batch_option = cmd->add_option("--cpu-batch", o->cpu.batch, "Decode requests")
                            ->check(CLI::Range(1, 1 << 16))
                            ->capture_default_str()
                            ->group(cpu_group);
  o->cpu_context_option = cmd->add_option("--cpu-context", o->cpu.context, "Tokens per request")
                              ->check(CLI::Range(1, 1 << 24))
                              ->capture_default_str()
                              ->group(cpu_group);
  o->cpu_heads_option = cmd->add_option("--cpu-heads", o->cpu.num_heads, "Query heads")
                            ->check(CLI::Range(1, 1024))
                            ->capture_default_str()
                            ->group(cpu_group);
  cmd->add_option("--cpu-threads", o->cpu.threads, "Threads (0: every core)")
      ->check(CLI::Range(0, 4096))
      ->capture_default_str()
      ->group(cpu_group);
  o->cpu_seconds_option =
      cmd->add_option("--cpu-seconds", o->cpu.min_seconds,
                      "Repeat the reference until this much wall time has passed (at least once)")
          ->check(CLI::Range(0.0, 3600.0))
          ->capture_default_str()
          ->group(cpu_group);
  cmd->add_option("--project-batch", o->cpu.project_batch,
                  "Requests of the projected GLM-5 decode step")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str()
      ->group(cpu_group);
  cmd->add_option("--project-context", o->cpu.project_context,
                  "Tokens per request of the projected step")
      ->check(CLI::Range(1, 1 << 24))
      ->capture_default_str()
      ->group(cpu_group);
  cmd->add_option("--project-layers", o->cpu.project_layers, "Layers of the projected step")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str()
      ->group(cpu_group);
  cmd->add_option("--project-heads", o->cpu.project_heads, "Heads of the projected step")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str()
      ->group(cpu_group);
  cmd->callback([o, &runner] { runner = [o] { return run_bench(*o); }; });
}

}  // namespace kvaudit
