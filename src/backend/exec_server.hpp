// The program side of the external backend protocol (docs/backend-protocol.md, version 1) for a
// backend that lives inside kvaudit: `kvaudit backend-serve BACKEND` serves cpu-fp8, cuda-fp8, ...
// on its standard input and output, so that `check --backend exec:cpu-fp8 --backend-command
// "kvaudit backend-serve cpu-fp8"` can be compared with `--backend cpu-fp8` (the protocol must
// lose nothing: same report, bit-identical outputs), and the protocol's overhead measured against
// an in-process run of the same backend.
//
// Per request: hello makes the backend (BackendOptions with the hello's reciprocal_scale); layer
// reads the layer's pool file into a KvPool; step reads the inputs (index arrays checked with the
// kvdump rules), calls Backend::run_step on the layer's pool exactly as the replay does, writes
// out, lse and the whole pool back to the layer's pool file (with the new descriptor in the
// reply where the backend changed its storage); pool_reloaded re-reads the pool file; bench is
// handed to the caller's bench function. A request that cannot be served gets an error reply
// (bad_input, unsupported, internal after the Error's kind) and the server goes on; a hello that
// cannot be read or is refused ends it with exit status 2.
#pragma once

#include <cstdio>
#include <functional>
#include <istream>
#include <memory>
#include <nlohmann/json.hpp>

#include "src/backend/backend.hpp"
#include "src/core/result.hpp"

namespace kvaudit::exec {

struct ServerHooks {
  // Makes the served backend at hello.
  std::function<Result<std::unique_ptr<Backend>>(const BackendOptions&)> make_backend;
  // Answers a `bench` request (the whole request object) with the reply's fields (median_us,
  // min_us, samples, method); an unsupported Error for a case it cannot time. Empty: every bench
  // request is unsupported.
  std::function<Result<nlohmann::json>(const nlohmann::json&)> bench;
  BackendOptions options;  // threads, injection; reciprocal_scale comes from the hello
};

// Serves until bye (exit status 0), the end of the input (0), or a refused hello (2). Replies go
// to `replies`, one line each, flushed.
int serve_backend(std::istream& requests, std::FILE* replies, const ServerHooks& hooks);

}  // namespace kvaudit::exec
