// The bench's peer: request, reply, ratios and table cells (src/tools/bench_peer.hpp).
#include "src/tools/bench_peer.hpp"

#include <fmt/format.h>

#include <cmath>

namespace kvaudit::bench {
namespace {

constexpr int kMaxCount = 1 << 30;

Result<int> positive_int(const nlohmann::json& object, const char* key, int low, int high) {
  const auto it = object.find(key);
  if (it == object.end() || !it->is_number_integer() || it->get<std::int64_t>() < low ||
      it->get<std::int64_t>() > high) {
    return bad_input("bench",
                     fmt::format("{} is missing or not an integer in {}..{}", key, low, high));
  }
  return static_cast<int>(it->get<std::int64_t>());
}

double number_or(const nlohmann::json& object, const char* key, double fallback) {
  const auto it = object.find(key);
  return it != object.end() && it->is_number() ? it->get<double>() : fallback;
}

}  // namespace

nlohmann::json peer_bench_request_json(const PeerBenchRequest& request) {
  const GpuCase& c = request.config;
  return {{"type", "bench"},
          {"case",
           {{"name", c.name()},
            {"kind", c.q_len == 1 ? "decode" : "prefill"},
            {"batch", c.batch},
            {"context", c.context},
            {"num_heads", c.num_heads},
            {"page_size", c.page_size},
            {"pool_slots", c.effective_pool_slots()},
            {"q_len", c.q_len},
            {"kv_dtype", "float8_e4m3fn"}}},
          {"warmup", request.warmup},
          {"iterations", request.iterations},
          {"flush_l2", request.flush_l2}};
}

Result<PeerBenchRequest> parse_peer_bench_request(const nlohmann::json& request) {
  const auto found = request.find("case");
  if (found == request.end() || !found->is_object()) {
    return bad_input("bench", "case is missing or not an object");
  }
  const nlohmann::json& c = *found;
  PeerBenchRequest parsed;
  GpuCase& config = parsed.config;
  config.group = "peer";
  KVAUDIT_ASSIGN_OR_RETURN(config.batch, positive_int(c, "batch", 1, kMaxCount));
  KVAUDIT_ASSIGN_OR_RETURN(config.context, positive_int(c, "context", 1, kMaxCount));
  KVAUDIT_ASSIGN_OR_RETURN(config.num_heads, positive_int(c, "num_heads", 1, 4096));
  KVAUDIT_ASSIGN_OR_RETURN(config.page_size, positive_int(c, "page_size", 1, 1 << 16));
  KVAUDIT_ASSIGN_OR_RETURN(config.q_len, positive_int(c, "q_len", 1, config.context));
  const auto pool = c.find("pool_slots");
  config.pool_slots = pool != c.end() && pool->is_number_integer() ? pool->get<std::int64_t>() : 0;
  if (config.pool_slots != 0 &&
      (config.pool_slots < config.needed_slots() || config.pool_slots % config.page_size != 0)) {
    return bad_input("bench",
                     "pool_slots is smaller than the case needs or not a multiple of "
                     "page_size");
  }
  const auto kv_dtype = c.find("kv_dtype");
  if (kv_dtype != c.end() && *kv_dtype != "float8_e4m3fn") {
    return unsupported("bench", fmt::format("kv_dtype {} is not float8_e4m3fn", kv_dtype->dump()));
  }
  KVAUDIT_ASSIGN_OR_RETURN(parsed.warmup, positive_int(request, "warmup", 0, kMaxCount));
  KVAUDIT_ASSIGN_OR_RETURN(parsed.iterations, positive_int(request, "iterations", 1, kMaxCount));
  const auto flush = request.find("flush_l2");
  parsed.flush_l2 = flush != request.end() && flush->is_boolean() && flush->get<bool>();
  return parsed;
}

const char* peer_outcome_name(PeerOutcome outcome) {
  switch (outcome) {
    case PeerOutcome::kMeasured:
      return "measured";
    case PeerOutcome::kUnsupported:
      return "unsupported";
    case PeerOutcome::kFailed:
      return "failed";
  }
  return "failed";
}

PeerTiming peer_timing_from_reply(const Result<nlohmann::json>& reply) {
  PeerTiming timing;
  if (!reply) {
    timing.message = reply.error().message();
    return timing;
  }
  const nlohmann::json& message = *reply;
  const std::string type = message.value("type", nlohmann::json()).is_string()
                               ? message["type"].get<std::string>()
                               : std::string();
  if (type == "error") {
    const auto text = message.find("message");
    timing.message = text != message.end() && text->is_string() ? text->get<std::string>()
                                                                : std::string("(no message)");
    const auto kind = message.find("kind");
    if (kind != message.end() && *kind == "unsupported") timing.outcome = PeerOutcome::kUnsupported;
    return timing;
  }
  timing.median_us = number_or(message, "median_us", 0.0);
  if (type != "bench" || !std::isfinite(timing.median_us) || timing.median_us <= 0) {
    timing.message = fmt::format("not a bench reply with a positive median_us: {}", message.dump());
    return timing;
  }
  timing.outcome = PeerOutcome::kMeasured;
  timing.min_us = number_or(message, "min_us", timing.median_us);
  timing.samples = static_cast<int>(number_or(message, "samples", 0.0));
  const auto method = message.find("method");
  timing.method = method != message.end() && method->is_string() ? method->get<std::string>() : "";
  return timing;
}

PeerRatios peer_ratios(const PeerTiming& peer, const GpuCaseResult& result, double copy_gbps) {
  PeerRatios ratios;
  if (peer.outcome != PeerOutcome::kMeasured || peer.median_us <= 0) return ratios;
  ratios.gbps = result.config.kv_bytes() / (peer.median_us * 1e3);
  ratios.copy_ratio = copy_gbps > 0 ? ratios.gbps / copy_gbps : 0.0;
  ratios.over_cuda_fp8 = result.fp8.median_us > 0 ? peer.median_us / result.fp8.median_us : 0.0;
  if (result.cast) ratios.cast_over_peer = result.cast->median_us / peer.median_us;
  return ratios;
}

nlohmann::json peer_case_json(const PeerTiming& peer, const GpuCaseResult& result,
                              double copy_gbps) {
  nlohmann::json j = {{"outcome", peer_outcome_name(peer.outcome)}};
  if (peer.outcome != PeerOutcome::kMeasured) {
    j["message"] = peer.message;
    return j;
  }
  const PeerRatios ratios = peer_ratios(peer, result, copy_gbps);
  j["median_us"] = peer.median_us;
  j["min_us"] = peer.min_us;
  j["samples"] = peer.samples;
  j["method"] = peer.method;
  j["gbps"] = ratios.gbps;
  j["copy_ratio"] = ratios.copy_ratio;
  j["time_over_cuda_fp8"] =
      ratios.over_cuda_fp8 > 0 ? nlohmann::json(ratios.over_cuda_fp8) : nlohmann::json(nullptr);
  j["cast_over_peer"] =
      ratios.cast_over_peer ? nlohmann::json(*ratios.cast_over_peer) : nlohmann::json(nullptr);
  return j;
}

std::string peer_table_header() {
  return fmt::format(" {:>10} {:>9} {:>10}", "peer us", "peer/fp8", "peer %copy");
}

std::string peer_table_cells(const PeerTiming& peer, const GpuCaseResult& result,
                             double copy_gbps) {
  if (peer.outcome != PeerOutcome::kMeasured) {
    return fmt::format("  peer {}: {}", peer_outcome_name(peer.outcome), peer.message);
  }
  const PeerRatios ratios = peer_ratios(peer, result, copy_gbps);
  const std::string over =
      ratios.over_cuda_fp8 > 0 ? fmt::format("{:.2f}x", ratios.over_cuda_fp8) : "-";
  return fmt::format(" {:10.1f} {:>9} {:9.0f}%", peer.median_us, over, 100.0 * ratios.copy_ratio);
}

}  // namespace kvaudit::bench
