// `kvaudit backend-serve BACKEND`: serves a built-in backend (cpu-fp8, cuda-fp8, cuda-cast-bf16)
// over the external backend protocol on standard input and output (src/backend/exec_server.hpp),
// for testing the protocol: `check DUMP --backend exec:cpu-fp8 --backend-command "kvaudit
// backend-serve cpu-fp8"` must give the report and outputs of `--backend cpu-fp8`, and the
// difference in wall time is the protocol's overhead. In a CUDA build the CUDA backends also
// answer `bench` requests with kvaudit's own bench harness (src/tools/mla_attention_bench.hpp), so
// `bench --peer exec:cuda-fp8 --peer-command "kvaudit backend-serve cuda-fp8"` checks the peer
// plumbing on a GPU (its time over cuda-fp8's should be about 1).
//
// Standard output carries replies only: the real descriptor 1 is kept for them and descriptor 1
// is pointed at standard error, so that nothing else printed can corrupt the protocol.
#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <memory>
#include <string>

#include "src/backend/exec_server.hpp"
#include "src/cli/backend_registry.hpp"
#include "src/cli/cli.hpp"
#include "src/tools/bench_peer.hpp"
#include "src/tools/mla_attention_bench.hpp"

namespace kvaudit {
namespace {

struct ServeOptions {
  std::string backend;
  std::string inject;
  int threads = 0;
  CudaVariantOptions cuda;  // --cuda-* (cuda-fp8 and cuda-cast-bf16 only)
};

// A stream on the real standard output for replies; descriptor 1 then points at stderr.
std::FILE* reply_stream() {
  std::fflush(stdout);
  const int reply_fd = ::dup(STDOUT_FILENO);
  ::dup2(STDERR_FILENO, STDOUT_FILENO);
  return reply_fd < 0 ? nullptr : ::fdopen(reply_fd, "w");
}

// A bench request timed by kvaudit's own harness: cuda-fp8's kernel, or cuda-cast-bf16's cast
// plus attention (CUDA builds only; elsewhere there is no bench).
[[maybe_unused]] Result<nlohmann::json> bench_with_harness(const std::string& backend,
                                                           const CudaKernelVariant& variant,
                                                           const nlohmann::json& request) {
  KVAUDIT_ASSIGN_OR_RETURN(bench::PeerBenchRequest parsed,
                           bench::parse_peer_bench_request(request));
  parsed.config.with_cast = backend == "cuda-cast-bf16";
  bench::GpuBenchOptions options;
  options.warmup = parsed.warmup;
  options.launches = parsed.iterations;
  options.l2_flush_bytes = parsed.flush_l2 ? options.l2_flush_bytes : 0;
  options.variant = variant;
  KVAUDIT_ASSIGN_OR_RETURN(const bench::GpuCaseResult result,
                           bench::run_gpu_case(parsed.config, options, 0.0));
  if (!result.skipped.empty()) return unsupported("bench", result.skipped);
  const bench::LaunchTimes* times = &result.fp8;
  if (parsed.config.with_cast) {
    if (!result.cast) return unsupported("bench", result.cast_skipped);
    times = &*result.cast;
  }
  return nlohmann::json{{"median_us", times->median_us},
                        {"min_us", times->min_us},
                        {"samples", times->launches},
                        {"method", "cuda-events"}};
}

exec::ServerHooks server_hooks(const ServeOptions& options) {
  exec::ServerHooks hooks;
  hooks.options.threads = options.threads;
  hooks.options.injection = options.inject;
  hooks.options.cuda_variant = options.cuda.variant;
  const std::string backend = options.backend;
  hooks.make_backend = [backend](const BackendOptions& backend_options) {
    return make_backend(backend, backend_options);
  };
#ifdef KVAUDIT_HAVE_CUDA
  if (backend == "cuda-fp8" || backend == "cuda-cast-bf16") {
    hooks.bench = [backend, variant = options.cuda.variant](const nlohmann::json& request) {
      return bench_with_harness(backend, variant, request);
    };
  }
#endif
  return hooks;
}

int run_serve(const ServeOptions& options) {
  if (exec_backend_name(options.backend)) {
    return report_error(bad_input("backend-serve", "serves a built-in backend, not exec:NAME"));
  }
  if (const Status applies = check_cuda_variant_applies(options.cuda, options.backend); !applies) {
    return report_error(applies.error());
  }
  std::FILE* replies = reply_stream();
  if (replies == nullptr) {
    return report_error(internal_error("backend-serve", "cannot duplicate standard output"));
  }
  const int status = exec::serve_backend(std::cin, replies, server_hooks(options));
  std::fclose(replies);
  return status;
}

}  // namespace

void register_backend_serve_command(CLI::App& app, CommandRunner& runner) {
  auto options = std::make_shared<ServeOptions>();
  std::string backends;
  for (const std::string& name : backend_names()) backends += (backends.empty() ? "" : ", ") + name;
  CLI::App* cmd = add_command(
      app, "backend-serve",
      {"For testing the external backend protocol: serve a built-in backend over it.",
       "Speaks docs/backend-protocol.md on standard input/output, as a program started by check "
       "--backend exec:NAME --backend-command CMD (or bench --peer) would.",
       "0 after bye or the end of input, 2 when the hello is refused, 3 internal error"});
  cmd->add_option("BACKEND", options->backend, "The backend to serve: " + backends)->required();
  cmd->add_option("--inject", options->inject,
                  "A fault injection of the served backend (check --list-injections)");
  add_integer_option(*cmd, "--threads", options->threads, 0, kMaxThreads,
                     "Threads of a CPU backend (0: every core)")
      ->capture_default_str();
  add_cuda_variant_options(*cmd, options->cuda);
  cmd->callback([options, &runner] { runner = [options] { return run_serve(*options); }; });
}

}  // namespace kvaudit
