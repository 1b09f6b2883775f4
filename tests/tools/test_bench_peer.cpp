// `kvaudit bench --peer`: the plumbing that does not need a GPU (src/tools/bench_peer.hpp): the
// bench request and its parse, replies turned into timings, the ratios against hand-computed
// numbers, the table cells and JSON, a whole session with a fake peer (tests/backend/fakes/
// fake_peer.py: 10 us per request, page_size 1 unsupported), and the command line's refusals.
#include <catch2/catch.hpp>
#include <string>

#include "src/backend/exec_session.hpp"
#include "src/tools/bench_peer.hpp"
#include "tests/backend/exec_test_support.hpp"

namespace kvaudit {
namespace {

using bench::GpuCase;
using bench::GpuCaseResult;
using bench::PeerOutcome;
using bench::PeerTiming;

GpuCase small_case(int batch, int context, int page_size, int q_len = 1) {
  GpuCase c;
  c.group = "decode";
  c.batch = batch;
  c.context = context;
  c.page_size = page_size;
  c.q_len = q_len;
  return c;
}

PeerTiming measured(double median_us) {
  nlohmann::json reply = {{"type", "bench"},
                          {"median_us", median_us},
                          {"min_us", median_us - 1},
                          {"samples", 50},
                          {"method", "cuda-graph"}};
  return bench::peer_timing_from_reply(Result<nlohmann::json>(reply));
}

std::string fake_peer_command() {
  return "python3 " +
         (kvaudit_test::source_dir() / "tests" / "backend" / "fakes" / "fake_peer.py").string();
}

}  // namespace

TEST_CASE("bench peer: the request carries the case and parses back to it", "[bench][peer]") {
  bench::PeerBenchRequest request{small_case(8, 4096, 64, 4), 3, 20, true};
  request.config.pool_slots = 65536;
  const nlohmann::json json = bench::peer_bench_request_json(request);
  CHECK(json["type"] == "bench");
  CHECK(json["case"]["kind"] == "prefill");
  CHECK(json["case"]["pool_slots"] == 65536);
  CHECK(json["case"]["name"] == "prefill(B=8,ctx=4096,q=4,H=16,page=64,pool=65536)");
  const auto parsed = bench::parse_peer_bench_request(nlohmann::json::parse(json.dump()));
  REQUIRE(parsed.ok());
  CHECK(parsed->config.name() == request.config.name());
  CHECK(parsed->warmup == 3);
  CHECK(parsed->iterations == 20);
  CHECK(parsed->flush_l2);
  nlohmann::json too_small = json;
  too_small["case"]["pool_slots"] = 64;  // the case needs 8 * 64 pages of 64 slots
  CHECK_FALSE(bench::parse_peer_bench_request(too_small).ok());
  nlohmann::json bf16 = json;
  bf16["case"]["kv_dtype"] = "bfloat16";
  const auto refused = bench::parse_peer_bench_request(bf16);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.error().kind == ErrorKind::kUnsupported);
}

TEST_CASE("bench peer: replies become measured, unsupported or failed timings", "[bench][peer]") {
  const PeerTiming ok = measured(40.0);
  CHECK(ok.outcome == PeerOutcome::kMeasured);
  CHECK(ok.median_us == 40.0);
  CHECK(ok.min_us == 39.0);
  CHECK(ok.samples == 50);
  CHECK(ok.method == "cuda-graph");
  const PeerTiming refused = bench::peer_timing_from_reply(Result<nlohmann::json>(
      nlohmann::json{{"type", "error"}, {"kind", "unsupported"}, {"message", "fa3 needs SM90"}}));
  CHECK(refused.outcome == PeerOutcome::kUnsupported);
  CHECK(refused.message == "fa3 needs SM90");
  const PeerTiming failed =
      bench::peer_timing_from_reply(Result<nlohmann::json>(bad_input("exec:p", "it exited")));
  CHECK(failed.outcome == PeerOutcome::kFailed);
  CHECK(failed.message == "exec:p: it exited");
  const PeerTiming no_time = bench::peer_timing_from_reply(
      Result<nlohmann::json>(nlohmann::json{{"type", "bench"}, {"median_us", 0}}));
  CHECK(no_time.outcome == PeerOutcome::kFailed);
}

TEST_CASE("bench peer: ratios against the case's bytes, cuda-fp8, the cast path and the copy",
          "[bench][peer]") {
  GpuCaseResult result;
  result.config = small_case(2, 1000, 64);  // KV bytes = 2 * 1000 * 576 = 1,152,000
  result.fp8.median_us = 20.0;
  bench::LaunchTimes cast;
  cast.median_us = 50.0;
  result.cast = cast;
  const PeerTiming peer = measured(10.0);
  const bench::PeerRatios ratios = bench::peer_ratios(peer, result, 1000.0);
  CHECK(ratios.gbps == Approx(115.2));  // 1,152,000 B / 10 us
  CHECK(ratios.copy_ratio == Approx(0.1152));
  CHECK(ratios.over_cuda_fp8 == Approx(0.5));
  REQUIRE(ratios.cast_over_peer.has_value());
  CHECK(*ratios.cast_over_peer == Approx(5.0));
  const nlohmann::json json = bench::peer_case_json(peer, result, 1000.0);
  CHECK(json["outcome"] == "measured");
  CHECK(json["time_over_cuda_fp8"].get<double>() == Approx(0.5));
  CHECK(json["cast_over_peer"].get<double>() == Approx(5.0));
  CHECK(json["method"] == "cuda-graph");
  CHECK(bench::peer_table_cells(peer, result, 1000.0) == "       10.0     0.50x        12%");
  result.cast.reset();
  CHECK(bench::peer_case_json(peer, result, 1000.0)["cast_over_peer"].is_null());
  PeerTiming refused;
  refused.outcome = PeerOutcome::kUnsupported;
  refused.message = "page 1";
  CHECK(bench::peer_case_json(refused, result, 1000.0) ==
        nlohmann::json{{"outcome", "unsupported"}, {"message", "page 1"}});
  CHECK(bench::peer_table_cells(refused, result, 1000.0) == "  peer unsupported: page 1");
}

TEST_CASE("bench peer: a session with a fake peer times one case and records another unsupported",
          "[bench][peer][exec]") {
  auto session = exec::ExecSession::start("exec:fake-peer", fake_peer_command());
  REQUIRE(session.ok());
  const auto hello = (*session)->hello("fake-peer", nullptr, false);
  REQUIRE(hello.ok());
  CHECK(hello->describe.value("library", "") == "fake-peer 1.0");
  GpuCaseResult result;
  result.config = small_case(3, 300, 64);
  result.fp8.median_us = 60.0;
  const bench::PeerBenchRequest request{result.config, 2, 5, false};
  const PeerTiming timing = bench::peer_timing_from_reply((*session)->request_allowing_unsupported(
      bench::peer_bench_request_json(request), "bench", result.config.name()));
  REQUIRE(timing.outcome == PeerOutcome::kMeasured);
  CHECK(timing.median_us == 30.0);  // 10 us per request
  CHECK(timing.samples == 5);
  CHECK(bench::peer_ratios(timing, result, 0.0).over_cuda_fp8 == Approx(0.5));
  const bench::PeerBenchRequest page1{small_case(3, 300, 1), 2, 5, false};
  const PeerTiming unsupported =
      bench::peer_timing_from_reply((*session)->request_allowing_unsupported(
          bench::peer_bench_request_json(page1), "bench", page1.config.name()));
  CHECK(unsupported.outcome == PeerOutcome::kUnsupported);
  CHECK(unsupported.message == "page_size 1 (fake)");
  // The session is still good after an unsupported reply.
  const PeerTiming again = bench::peer_timing_from_reply((*session)->request_allowing_unsupported(
      bench::peer_bench_request_json(request), "bench", result.config.name()));
  CHECK(again.outcome == PeerOutcome::kMeasured);
}

TEST_CASE("bench peer: the command line checks --peer and starts no peer without GPU cases",
          "[bench][peer]") {
  const auto dir = exec_test::case_dir("bench_peer_cli");
  const std::string bench = exec_test::kvaudit() + " bench --quick --cpu-only";
  const auto not_exec = exec_test::run_shell(bench + " --peer torch", dir);
  CHECK(not_exec.status == 2);
  CHECK_THAT(not_exec.output, Catch::Contains("--peer: 'torch' is not exec:NAME"));
  const auto bad_name = exec_test::run_shell(bench + " --peer 'exec:a b'", dir);
  CHECK(bad_name.status == 2);
  const auto lonely = exec_test::run_shell(bench + " --peer-command true", dir);
  CHECK(lonely.status == 2);
  CHECK_THAT(lonely.output, Catch::Contains("--peer-command: starts the program of --peer"));
  // --cpu-only: no GPU case, so the peer (a command that would fail) is never started.
  const auto cpu = exec_test::run_shell(
      bench + " --peer exec:fake --peer-command false --json " + exec_test::quoted(dir / "b.json"),
      dir);
  INFO(cpu.output);
  CHECK(cpu.status == 0);
  CHECK_THAT(cpu.output, Catch::Contains("peer exec:fake not started: no GPU case runs"));
  const auto help = exec_test::run_shell(exec_test::kvaudit() + " bench --help", dir);
  CHECK_THAT(help.output, Catch::Contains("--peer-command"));
}

}  // namespace kvaudit
