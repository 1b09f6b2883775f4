// The bench's peer (`kvaudit bench --peer exec:NAME --peer-command CMD`): a program speaking the
// external backend protocol (docs/backend-protocol.md "bench") times its own kernel on each GPU
// case the bench times, in the same run, next to cuda-fp8, the cast path and the copy. Plain C++
// (no CUDA): the request, the reply, the ratios and the table cells are tested everywhere.
//
// Per case (src/tools/mla_attention_bench.hpp for the counting):
//   peer GB/s         = KV bytes / peer median time
//   peer copy ratio   = peer GB/s / the copy bandwidth of the same run
//   peer / cuda-fp8   = peer median time / cuda-fp8 median time  (> 1: the peer is slower)
//   cast / peer       = cast-path median time / peer median time  (where the cast path ran)
// A case the peer cannot run (an `unsupported` error reply) is recorded as unsupported with its
// message; any other failure of the peer as failed, with the error.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "src/core/result.hpp"
#include "src/tools/mla_attention_bench.hpp"

namespace kvaudit::bench {

// What a `bench` request asks for.
struct PeerBenchRequest {
  GpuCase config;
  int warmup = 5;
  int iterations = 50;
  bool flush_l2 = true;
};

nlohmann::json peer_bench_request_json(const PeerBenchRequest& request);
// The request back (what `kvaudit backend-serve` reads): bad input for a malformed one.
Result<PeerBenchRequest> parse_peer_bench_request(const nlohmann::json& request);

enum class PeerOutcome : std::uint8_t { kMeasured, kUnsupported, kFailed };
const char* peer_outcome_name(PeerOutcome outcome);  // "measured" | "unsupported" | "failed"

struct PeerTiming {
  PeerOutcome outcome = PeerOutcome::kFailed;
  double median_us = 0;
  double min_us = 0;
  int samples = 0;
  std::string method;   // "cuda-events", "cuda-graph", ... as the peer says
  std::string message;  // why not measured
};

// A reply (or the Error that took its place) as a timing: a bench reply with a positive finite
// median_us is measured; an unsupported error reply is unsupported; anything else failed.
PeerTiming peer_timing_from_reply(const Result<nlohmann::json>& reply);

struct PeerRatios {
  double gbps = 0;
  double copy_ratio = 0;     // 0 without a copy bandwidth
  double over_cuda_fp8 = 0;  // 0 when cuda-fp8 was not timed
  std::optional<double> cast_over_peer;
};
// Only for a measured timing.
PeerRatios peer_ratios(const PeerTiming& peer, const GpuCaseResult& result, double copy_gbps);

// The case's "peer" object in bench.json (docs/gpu.md "The JSON report").
nlohmann::json peer_case_json(const PeerTiming& peer, const GpuCaseResult& result,
                              double copy_gbps);
// The table's peer columns: "peer us", "peer/fp8", "peer %copy" (unsupported / failed in place).
std::string peer_table_header();
std::string peer_table_cells(const PeerTiming& peer, const GpuCaseResult& result, double copy_gbps);

}  // namespace kvaudit::bench
