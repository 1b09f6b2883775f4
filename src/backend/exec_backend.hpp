// `--backend exec:NAME`: a program outside kvaudit as the backend under test, through the external
// backend protocol (docs/backend-protocol.md: version 1 for a per_tensor dump, version 2 for a
// per_token_group one, whose pool file holds the grouped slots' bytes). It is a Backend like the
// built-in ones:
// the replay hands it each (step, layer) and the pool it keeps for the layer, and gets back
// out [Nq, H, Dc] (bf16 bits) and lse [Nq, H] (fp32, natural log), with the pool as the program
// left it, so every comparison and integrity check, the reports and --emit-repro work unchanged.
//
// One program per run (src/backend/exec_session.hpp), started when the backend is made, so that
// its hello reply (what it says about itself) is known before the replay begins. Per step:
//   1. a new layer: the layer's pool into pool.bin, a `layer` request. Otherwise, when the pool
//      the replay passes is not the one the program last returned (the replay gives a program
//      that changed its storage the reference pool back), the pool goes into pool.bin and the
//      step says pool_reloaded;
//   2. the step's index arrays (int32) and q_nope, q_pe, new_kv (bf16 bits, or float32 where a
//      value is not a bf16 value) into files, out.bin and lse.bin removed, the `step` request;
//   3. out.bin and lse.bin read back at exactly their sizes, and the pool file the reply names
//      (a changed storage: its descriptor; else pool.bin) read into the replay's pool.
// A sparse step (kvdump v1.1 topk_indices) is refused before any request, as unsupported (exit 2)
// naming the step: the protocol's steps are dense.
// Protocol overhead: each step's round trip (1-3, as kvaudit measures it) minus the
// compute_seconds the program reports, summed with the layer requests (protocol_statistics()).
#pragma once

#include <memory>
#include <string_view>

#include "src/backend/backend.hpp"
#include "src/core/result.hpp"
#include "src/format/kvdump.hpp"

namespace kvaudit {

// Starts the program (options.exec_command, or `python3 -m kvdump.backends NAME`) and says hello
// with the model of *options.dump (required). `name` is NAME of exec:NAME, already validated.
// Errors: the program cannot start, refuses the hello (unsupported: exit 2), or breaks the
// protocol.
Result<std::unique_ptr<Backend>> make_exec_backend(std::string_view name,
                                                   const BackendOptions& options);

}  // namespace kvaudit
