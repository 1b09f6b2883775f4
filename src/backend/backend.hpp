// One interface for every attention implementation under test (docs/design.md "Pipeline").
//
// For one (step, layer): write the step's new tokens into `pool` (prefill and decode both write,
// with the kvdump write rule), then run MLA attention for the step's query rows and return
//   out : [Nq, H, Dc] bf16 bits      lse : [Nq, H] fp32, natural log.
// The pool is the backend's own replay pool for that layer: the harness keeps it across steps and
// checks it after every step (integrity), so a backend that corrupts it is caught.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "src/backend/cuda_kernel_variant.hpp"
#include "src/core/device_seconds.hpp"
#include "src/core/result.hpp"
#include "src/format/kvdump.hpp"

namespace kvaudit {

struct AttentionOutput {
  std::vector<std::uint16_t> out_bf16;  // [Nq, H, Dc]
  std::vector<float> lse;               // [Nq, H]
};

struct BackendOptions {
  int threads = 0;                // 0: every core
  std::string injection;          // empty: none; else a name from list_injections()
  bool reciprocal_scale = false;  // write with x * (1/scale) instead of x / scale (named option)
  // exec:NAME backends only (src/backend/exec_backend.hpp): the command line that starts the
  // program (empty: `python3 -m kvdump.backends NAME`) and the dump the run replays (the hello
  // sends its model).
  std::string exec_command;
  const DumpLayout* dump = nullptr;
  // cuda-fp8 and cuda-cast-bf16 only: which kernel variant runs (--cuda-mma, --cuda-decode16,
  // --cuda-host-plan, --cuda-longest-first); recorded in describe()'s "kernel_variant".
  CudaKernelVariant cuda_variant;
};

struct StepLayerInput {
  const DumpAttributes& attrs;
  const StepMeta& step;
  const LayerMeta& layer;
  const StepLayerTensors& tensors;
  std::size_t step_index;
  std::size_t layer_index;
};

// Which run_step calls may overlap when the replay has several layers in flight (ReplayOptions::
// layers_in_flight): each call still gets its own layer's pool.
enum class BackendConcurrency : std::uint8_t {
  kOneCallAtATime,   // calls from different layers, one after the other (device buffers, state)
  kConcurrent,       // calls of different layers at once (no state between calls)
  kOneLayerAtATime,  // every step of a layer before the next layer (a program holding one layer)
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  // Device, driver, versions, options: recorded in reports.
  virtual nlohmann::json describe() const = 0;
  virtual Result<AttentionOutput> run_step(const StepLayerInput& input, KvPool& pool) = 0;
  // What talking to the backend cost beyond its own computing, for report.json's
  // timing.backend_protocol (an exec backend's protocol overhead, docs/report-schema.md); null for
  // a backend that runs inside kvaudit.
  virtual nlohmann::json protocol_statistics() const { return nullptr; }
  virtual BackendConcurrency concurrency() const { return BackendConcurrency::kOneCallAtATime; }
  // Where a backend that runs on a GPU spent its time so far, summed over its run_step calls (host
  // preparation, copies, kernels: src/core/device_seconds.hpp); nullopt for other backends.
  virtual std::optional<DeviceSeconds> device_seconds() const { return std::nullopt; }
};

}  // namespace kvaudit
