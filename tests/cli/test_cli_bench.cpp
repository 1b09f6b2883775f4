// `kvaudit bench`: the case arithmetic (bytes and FLOP counted by hand here), the grid covering
// the stated targets, target verdicts on made-up timings, the CPU reference throughput, the
// command line (help, argument errors, no-GPU behaviour), and on a GPU a tiny timed grid.
#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "kvaudit_test_config.hpp"  // KVAUDIT_BINARY, KVAUDIT_SOURCE_DIR, KVAUDIT_TEST_TMPDIR
#include "src/tools/bench_cpu.hpp"
#include "src/tools/bench_grid.hpp"
#include "src/tools/mla_attention_bench.hpp"
#include "tests/gpu_skip.hpp"

namespace {

using kvaudit::bench::GpuCase;
using kvaudit::bench::GpuCaseResult;

struct CommandOutput {
  int exit_status = -1;
  std::string text;  // stdout and stderr
};

CommandOutput run_kvaudit(const std::string& args) {
  CommandOutput result;
  const std::string command = std::string("\"") + KVAUDIT_BINARY + "\" " + args + " 2>&1";
  FILE* pipe = popen(command.c_str(), "r");
  REQUIRE(pipe != nullptr);
  std::array<char, 4096> buf{};
  std::size_t n = 0;
  while ((n = std::fread(buf.data(), 1, buf.size(), pipe)) > 0) result.text.append(buf.data(), n);
  const int status = pclose(pipe);
  result.exit_status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return result;
}

std::filesystem::path temp_path(const std::string& name) {
  std::filesystem::path dir(KVAUDIT_TEST_TMPDIR);
  std::filesystem::create_directories(dir);
  return dir / name;
}

GpuCase make_case(int batch, int context, int heads, int page, std::int64_t pool = 0,
                  int q_len = 1) {
  GpuCase c;
  c.batch = batch;
  c.context = context;
  c.num_heads = heads;
  c.page_size = page;
  c.pool_slots = pool;
  c.q_len = q_len;
  return c;
}

GpuCaseResult timed(GpuCase c, double fp8_us, double cast_us, double copy_ratio = 0) {
  GpuCaseResult r;
  r.config = std::move(c);
  r.fp8.median_us = fp8_us;
  r.fp8.launches = 10;
  r.fp8_copy_ratio = copy_ratio;
  if (cast_us > 0) {
    kvaudit::bench::LaunchTimes t;
    t.median_us = cast_us;
    t.launches = 10;
    r.cast = t;
    r.cast_speedup = cast_us / fp8_us;
  }
  return r;
}

}  // namespace

TEST_CASE("bench case arithmetic counts KV bytes once per request and 2176 FLOP per token-head",
          "[bench]") {
  // Decode: 3 requests x 10 tokens x 576 bytes, whatever the head count.
  const GpuCase decode = make_case(3, 10, 16, 4);
  CHECK(decode.kv_bytes() == 3.0 * 10 * 576);
  CHECK(make_case(3, 10, 128, 4).kv_bytes() == decode.kv_bytes());
  CHECK(decode.flops() == 3.0 * 16 * 10 * 2176);
  CHECK(decode.pages_per_request() == 3);
  CHECK(decode.needed_slots() == 3 * 3 * 4);
  CHECK(decode.effective_pool_slots() == 36);
  CHECK(make_case(3, 10, 16, 4, 400).effective_pool_slots() == 400);
  // Prefill, causal: 2 rows of a 5-token request see 4 and 5 tokens.
  const GpuCase prefill = make_case(1, 5, 2, 1, 0, 2);
  CHECK(prefill.num_rows() == 2);
  CHECK(prefill.flops() == (4.0 + 5.0) * 2 * 2176);
  CHECK(prefill.kv_bytes() == 5.0 * 576);
  CHECK(decode.name() == "decode(B=3,ctx=10,H=16,page=4,pool=36)");
  CHECK(prefill.name() == "prefill(B=1,ctx=5,q=2,H=2,page=1,pool=5)");
}

TEST_CASE("bench default grid covers every stated target shape", "[bench]") {
  const auto grid = kvaudit::bench::bench_grid(false);
  auto has = [&](const char* target, int batch, int context, int heads, int page,
                 std::int64_t pool) {
    return std::any_of(grid.begin(), grid.end(), [&](const GpuCase& c) {
      return c.target == target && c.batch == batch && c.context == context &&
             c.num_heads == heads && c.page_size == page && c.q_len == 1 &&
             (pool == 0 || c.effective_pool_slots() == pool);
    });
  };
  CHECK(has("copy-ratio", 64, 8192, 16, 64, 0));
  CHECK(has("heads128-tflops", 64, 4096, 128, 64, 0));
  CHECK(std::any_of(grid.begin(), grid.end(), [](const GpuCase& c) {
    return c.target == "prefill-tflops" && c.batch == 1 && c.context == 4096 && c.q_len == 4096 &&
           c.num_heads == 16;
  }));
  for (int page : {1, 64}) {
    CHECK(has("seed-speedup-b1", 1, 4096, 16, page, 495552));
    CHECK(has("seed-speedup-b64", 64, 4096, 16, page, 495552));
    CHECK(has("pool-sweep", 8, 4096, 16, page, 65536));
    CHECK(has("pool-sweep", 8, 4096, 16, page, 1048576));
  }
  std::set<int> heads;
  for (const GpuCase& c : grid) {
    heads.insert(c.num_heads);
    CHECK(c.effective_pool_slots() >= c.needed_slots());
    CHECK(c.effective_pool_slots() % c.page_size == 0);
    CHECK(c.q_len <= c.context);
  }
  CHECK(heads.count(16) == 1);
  CHECK(heads.count(64) == 1);
  CHECK(heads.count(128) == 1);
  CHECK(std::any_of(grid.begin(), grid.end(), [](const GpuCase& c) { return c.q_len > 1; }));

  const auto quick = kvaudit::bench::bench_grid(true);
  CHECK(quick.size() <= 8);
  for (const GpuCase& c : quick) {
    CHECK(c.kv_bytes() < 1e6);
    CHECK(c.target.empty());  // targets are judged on the full grid only
  }
}

TEST_CASE("bench targets are judged from the measured figures", "[bench]") {
  std::vector<GpuCaseResult> results;
  GpuCase copy = make_case(64, 8192, 16, 64);
  copy.target = "copy-ratio";
  GpuCase seed1 = make_case(1, 4096, 16, 1, 495552);
  seed1.target = "seed-speedup-b1";
  GpuCase seed64 = make_case(64, 4096, 16, 1, 495552);
  seed64.target = "seed-speedup-b64";
  results.push_back(timed(copy, 100, 0, 0.85));
  results.push_back(timed(seed1, 50, 400));    // 8x: below 20x; 50 us: above 12 us
  results.push_back(timed(seed64, 100, 350));  // 3.5x: above 3x
  GpuCase seed1_page64 = make_case(1, 4096, 16, 64, 495552);
  seed1_page64.target = "seed-speedup-b1";
  results.push_back(timed(seed1_page64, 11.5, 276));  // 24x, 11.5 us: both met
  GpuCase heads128 = make_case(64, 4096, 128, 64);
  heads128.target = "heads128-tflops";
  results.push_back(timed(heads128, 100, 0));
  results.back().fp8_tflops = 390;  // below 400
  GpuCase prefill = make_case(1, 4096, 16, 64, 0, 4096);
  prefill.target = "prefill-tflops";
  results.push_back(timed(prefill, 100, 0));
  results.back().fp8_tflops = 351;
  const double fp8_times[] = {100, 104, 109};  // 9% spread
  const double cast_times[] = {50, 200, 800};  // 16x growth
  const std::int64_t pools[] = {65536, 262144, 1048576};
  for (int i = 0; i < 3; ++i) {
    GpuCase c = make_case(8, 4096, 16, 64, pools[i]);
    c.target = "pool-sweep";
    results.push_back(timed(c, fp8_times[i], cast_times[i]));
  }
  GpuCase skipped = make_case(8, 4096, 16, 1, 65536);
  skipped.target = "pool-sweep";
  GpuCaseResult skipped_result;
  skipped_result.config = skipped;
  skipped_result.skipped = "unsupported";
  results.push_back(skipped_result);
  GpuCase other = make_case(8, 4096, 16, 1, 131072);
  other.target = "pool-sweep";
  results.push_back(timed(other, 100, 100));

  // The verdict called `name` when the targets are judged on `results` as they are now.
  auto judged = [&](const std::string& name) {
    const auto verdicts = kvaudit::bench::evaluate_targets(results);
    const auto it = std::find_if(verdicts.begin(), verdicts.end(),
                                 [&](const auto& v) { return v.name == name; });
    REQUIRE(it != verdicts.end());
    return *it;
  };
  CHECK(judged("copy-ratio").met);
  CHECK(judged("copy-ratio").measured == Approx(0.85));
  CHECK_FALSE(judged("seed-speedup-b1-page1").met);
  CHECK(judged("seed-speedup-b1-page1").measured == Approx(8.0));
  CHECK(judged("seed-speedup-b1-page64").met);
  CHECK_FALSE(judged("seed-latency-b1-page1").met);
  CHECK(judged("seed-latency-b1-page1").measured == Approx(50.0));
  CHECK(judged("seed-latency-b1-page64").met);
  CHECK_FALSE(judged("heads128-tflops").met);
  CHECK(judged("heads128-tflops").measured == Approx(390.0));
  CHECK(judged("prefill-tflops").met);
  // No peer ran: not judged.
  CHECK_FALSE(judged("peer-faster").evaluated);
  CHECK(judged("seed-speedup-b64-page1").met);
  CHECK(judged("pool-flat-page64").met);
  CHECK(judged("pool-flat-page64").measured == Approx(0.09));
  CHECK(judged("pool-cast-grows-page64").met);
  CHECK(judged("pool-cast-grows-page64").measured == Approx(16.0));
  // Page 1's sweep has a skipped case: not judged, and so neither met nor missed.
  CHECK_FALSE(judged("pool-flat-page1").evaluated);
  CHECK_FALSE(judged("pool-flat-page1").met);

  // A spread of 10% or more misses.
  const auto first_sweep = std::find_if(results.begin(), results.end(), [](const auto& r) {
    return r.config.target == "pool-sweep" && r.config.page_size == 64;
  });
  REQUIRE(first_sweep != results.end());
  first_sweep->fp8.median_us = 95;  // 95 .. 109: a 15% spread
  CHECK(judged("pool-flat-page64").evaluated);
  CHECK_FALSE(judged("pool-flat-page64").met);

  // With a peer: the slowest ratio decides; one case where the peer is faster misses.
  results[0].peer_median_us = 300;  // 3x
  results[1].peer_median_us = 60;   // 1.2x
  CHECK(judged("peer-faster").evaluated);
  CHECK(judged("peer-faster").met);
  CHECK(judged("peer-faster").measured == Approx(1.2));
  results[2].peer_median_us = 90;  // 0.9x: the peer is faster here
  CHECK_FALSE(judged("peer-faster").met);
  CHECK(judged("peer-faster").measured == Approx(0.9));
}

TEST_CASE("bench CPU reference throughput counts row*head*tokens and projects a GLM-5 step",
          "[bench]") {
  kvaudit::bench::CpuBenchOptions options;
  options.batch = 2;
  options.context = 40;
  options.num_heads = 3;
  options.threads = 2;
  options.min_seconds = 0;
  const auto result = kvaudit::bench::run_cpu_reference_bench(options);
  REQUIRE(result.ok());
  CHECK(result->units_per_run == 2 * 40 * 3);
  CHECK(result->runs >= 1);
  CHECK(result->units_per_second > 0);
  CHECK(result->project_units == 78.0 * 64 * 4096 * 16);
  CHECK(result->project_seconds == Approx(result->project_units / result->units_per_second));
  // The plain binary64 baseline computes the same attention (its error is binary64's, ~1e-15 of
  // the output's scale; a wrong softmax or scale would be O(1)) and is timed in the same run.
  CHECK(result->plain_runs >= 1);
  CHECK(result->plain_units_per_second > 0);
  CHECK(result->plain_max_out_difference < 1e-12);
  CHECK(result->cost_of_exactness ==
        Approx(result->plain_units_per_second / result->units_per_second));

  options.context = 0;
  const auto bad = kvaudit::bench::run_cpu_reference_bench(options);
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.error().kind == kvaudit::ErrorKind::kBadInput);
}

TEST_CASE("kvaudit bench --help documents the modes", "[bench][cli]") {
  const auto out = run_kvaudit("bench --help");
  CHECK(out.exit_status == 0);
  for (const char* word : {"--cpu-only", "--gpu-only", "--quick", "--json", "--launches", "exit 2",
                           "--check-targets"}) {
    INFO(word);
    CHECK(out.text.find(word) != std::string::npos);
  }
}

TEST_CASE("kvaudit bench rejects bad arguments with exit 2", "[bench][cli]") {
  for (const char* args :
       {"bench --launches 0", "bench --cpu-only --gpu-only", "bench --cpu-batch 0 --cpu-only",
        "bench --no-such-option", "bench --q-len 10 --context 5", "bench --batch 4 --pool-slots 3",
        "bench --page-size 64 --pool-slots 100 --batch 1 --context 8"}) {
    INFO(args);
    const auto out = run_kvaudit(args);
    CHECK(out.exit_status == 2);
    CHECK_FALSE(out.text.empty());
  }
}

TEST_CASE("kvaudit bench --list prints the target cases without running them", "[bench][cli]") {
  const auto out = run_kvaudit("bench --list");
  CHECK(out.exit_status == 0);
  CHECK(out.text.find("decode(B=64,ctx=8192,H=16,page=64,pool=524288)  [target copy-ratio]") !=
        std::string::npos);
  CHECK(out.text.find("pool=495552") != std::string::npos);
}

TEST_CASE("kvaudit bench --cpu-only reports a positive reference rate in text and JSON",
          "[bench][cli]") {
  const auto json_path = temp_path("bench_cpu_only.json");
  std::filesystem::remove(json_path);
  const auto out =
      run_kvaudit("bench --cpu-only --quick --cpu-threads 2 --json \"" + json_path.string() + "\"");
  INFO(out.text);
  REQUIRE(out.exit_status == 0);
  CHECK(out.text.find("CPU reference") != std::string::npos);
  CHECK(out.text.find("GPU cases skipped") == std::string::npos);
  std::ifstream in(json_path);
  REQUIRE(in.good());
  const auto doc = nlohmann::json::parse(in);
  const auto& cpu = doc.at("cpu_reference");
  // --quick: 2 requests x 128 tokens x 4 heads.
  CHECK(cpu.at("units_per_run").get<std::int64_t>() == 2 * 128 * 4);
  CHECK(cpu.at("row_head_tokens_per_second").get<double>() > 0);
  CHECK(cpu.at("projection").at("layers").get<int>() == 78);
  CHECK(cpu.at("projection").at("seconds").get<double>() > 0);
  CHECK(cpu.at("plain_binary64").at("row_head_tokens_per_second").get<double>() > 0);
  CHECK(cpu.at("cost_of_exactness").get<double>() > 0);
  CHECK(out.text.find("the exact reference costs") != std::string::npos);
  CHECK_FALSE(doc.contains("cases"));
}

TEST_CASE("kvaudit bench without a GPU skips GPU cases, unless they were asked for",
          "[bench][cli]") {
  const auto device = kvaudit::cuda_device_info();
  if (device.present) {
    WARN("a CUDA device is present: the no-GPU behaviour is not exercised here");
    return;
  }
  const auto plain = run_kvaudit("bench --quick --cpu-threads 2");
  INFO(plain.text);
  CHECK(plain.exit_status == 0);
  CHECK(plain.text.find("GPU cases skipped: " + device.reason) != std::string::npos);
  CHECK(plain.text.find("CPU reference") != std::string::npos);
  CHECK(run_kvaudit("bench --quick --gpu-only").exit_status == 2);
  CHECK(run_kvaudit("bench --batch 2 --context 64").exit_status == 2);
}

#ifdef KVAUDIT_HAVE_CUDA
TEST_CASE("GPU bench times the quick grid: positive times, finite outputs, paths agree",
          "[gpu][bench]") {
  KVAUDIT_REQUIRE_GPU();
  kvaudit::bench::GpuBenchOptions options;
  options.warmup = 1;
  options.launches = 3;
  options.copy_bytes = std::size_t{64} << 20;
  options.l2_flush_bytes = std::size_t{64} << 20;
  const auto copy = kvaudit::bench::measure_copy_bandwidth(options);
  REQUIRE(copy.ok());
  CHECK(copy->gbps > 10.0);  // any GPU copies faster than 10 GB/s
  for (const GpuCase& c : kvaudit::bench::bench_grid(true)) {
    INFO(c.name());
    const auto r = kvaudit::bench::run_gpu_case(c, options, copy->gbps);
    REQUIRE(r.ok());
    REQUIRE(r->skipped.empty());
    CHECK(r->fp8.launches == 3);
    CHECK(r->fp8.median_us > 0);
    CHECK(r->fp8.min_us <= r->fp8.median_us);
    CHECK(r->fp8_gbps > 0);
    CHECK(r->fp8_nonfinite_lse == 0);
    REQUIRE(r->cast.has_value());
    CHECK(r->cast->median_us > 0);
    // Same codes, same scale, the cast is exact: the two paths compute the same function; the
    // outputs are bf16 of magnitude < 3.75 * 0.0625, so a few bf16 ulps of that at most.
    CHECK(r->max_abs_diff_vs_cast <= 0.25 * 0.0625);
  }
}
#endif
