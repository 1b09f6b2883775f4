// The `cuda-fp8` and `cuda-cast-bf16` backends (src/backend/backend.hpp) on the CUDA MLA attention
// family.
//
// Per run_step (one step, one layer): upload the layer's pool bytes [S, D], the step's indices and
// q_nope [Nq, H, Dc], q_pe [Nq, H, Dr], new_kv [Nq, D] (floats that are bf16 values -> bf16 bits),
// run launch_kv_write (the kvdump write rule on the device) then attention, and copy out
// [Nq, H, Dc] bf16, lse [Nq, H] and the pool back into the KvPool (the harness checks its
// integrity). cuda-fp8 attends on the FP8 pool directly; cuda-cast-bf16 reproduces the seed's bug:
// every call casts the whole pool into a bf16 buffer [S, D] and attends on that (same math: the
// cast is exact and kv_scale is kept, so only accumulation order differs).
//
// Device memory is held in buffers that grow on demand and are counted by role (pool, bf16 copy,
// everything else), so a test can show that cuda-fp8 holds nothing pool-sized besides the pool.
// q (converted to bf16 on the backend's threads) and out pass through page-locked host buffers that
// grow the same way. device_seconds() splits the calls' time (src/core/device_seconds.hpp).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "kernels/mla_attention_cuda.hpp"
#include "kernels/mla_attention_model.hpp"
#include "src/backend/injection.hpp"
#include "src/backend/mla_attention_cuda_backend.hpp"
#include "src/backend/mla_attention_operands.hpp"
#include "src/core/cuda_device.hpp"
#include "src/core/fp8_e4m3.hpp"
#include "src/core/parallel_for.hpp"
#include "src/format/step_indices.hpp"

namespace kvaudit::cuda {

namespace {

using Clock = std::chrono::steady_clock;

Status cuda_check(cudaError_t status, const std::string& where, const char* what) {
  if (status == cudaSuccess) return ok_status();
  return internal_error(where, std::string(what) + ": " + cudaGetErrorString(status));
}

// How a DeviceBuffer grows: to the bytes asked for, or by at least a quarter (cudaFree waits for
// the whole device, the GPU reference's stream too, and a decode dump's indices and workspace grow
// a little at every step).
enum class Growth : std::uint8_t { kExact, kByQuarter };

// A device allocation that only grows; `held` counts the bytes of the role it serves.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(std::size_t* held, Growth growth = Growth::kByQuarter)
      : held_(held), growth_(growth) {}
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { release(); }

  Status reserve(std::size_t bytes, const std::string& where) {
    if (bytes <= capacity_) return ok_status();
    if (growth_ == Growth::kByQuarter) bytes = std::max(bytes, capacity_ + capacity_ / 4);
    release();
    void* data = nullptr;
    KVAUDIT_TRY(cuda_check(cudaMalloc(&data, bytes), where, "cudaMalloc"));
    data_ = data;
    capacity_ = bytes;
    *held_ += bytes;
    return ok_status();
  }
  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }

 private:
  void release() {
    if (data_ != nullptr) {
      cudaFree(data_);
      *held_ -= capacity_;
    }
    data_ = nullptr;
    capacity_ = 0;
  }
  std::size_t* held_;
  Growth growth_;
  void* data_ = nullptr;
  std::size_t capacity_ = 0;
};

// Page-locked host memory that only grows, kept between calls: copies to and from the device run
// from it at the link's speed (pageable memory goes through the driver's own staging copy first).
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer() {
    if (data_ != nullptr) cudaFreeHost(data_);
  }

  template <typename T>
  Result<T*> reserve(std::size_t count, const std::string& where) {
    const std::size_t bytes = std::max<std::size_t>(count * sizeof(T), 16);
    if (bytes > capacity_) {
      if (data_ != nullptr) cudaFreeHost(data_);
      data_ = nullptr;
      capacity_ = 0;
      KVAUDIT_TRY(cuda_check(cudaHostAlloc(&data_, bytes, cudaHostAllocDefault), where,
                             "cudaHostAlloc (page-locked host memory)"));
      capacity_ = bytes;
    }
    return static_cast<T*>(data_);
  }

 private:
  void* data_ = nullptr;
  std::size_t capacity_ = 0;
};

// bf16 bits of each value into `bits`, on up to `threads` threads (each element its own: the
// thread count changes nothing).
void to_bf16_bits(std::span<const float> values, std::uint16_t* bits, int threads) {
  constexpr std::size_t kChunk = std::size_t{1} << 16;
  parallel_for((values.size() + kChunk - 1) / kChunk, threads, [&] {
    return [&](std::size_t chunk) {
      const std::size_t end = std::min(values.size(), (chunk + 1) * kChunk);
      for (std::size_t i = chunk * kChunk; i < end; ++i) bits[i] = bf16_from_float(values[i]);
    };
  });
}

// The step's inputs as the device takes them: the five int32 index arrays in one buffer, q (q_nope
// then q_pe, in a page-locked buffer the caller holds) and new_kv as bf16 bits.
struct HostStaging {
  std::vector<std::int32_t> indices;  // qo_indptr | kv_indptr | kv_indices | last_page_len | slots
  std::size_t qo_count = 0, kv_indptr_count = 0, kv_indices_count = 0, last_page_count = 0;
  const std::uint16_t* q = nullptr;  // [Nq, H, Dc] then [Nq, H, Dr]
  std::size_t q_elements = 0;
  std::size_t q_nope_elements = 0;
  std::vector<std::uint16_t> new_kv;  // [Nq, D]
};

std::size_t q_elements(const StepLayerInput& input) {
  return input.tensors.q_nope.size() + input.tensors.q_pe.size();
}

// q converted into `q_bits` (q_elements(input) of them) on `threads` threads.
HostStaging stage_inputs(const StepLayerInput& input, std::uint16_t* q_bits, int threads) {
  const StepMeta& step = input.step;
  HostStaging h;
  h.qo_count = step.qo_indptr.size();
  h.kv_indptr_count = step.kv_indptr.size();
  h.kv_indices_count = step.kv_indices.size();
  h.last_page_count = step.kv_last_page_len.size();
  h.indices.reserve(h.qo_count + h.kv_indptr_count + h.kv_indices_count + h.last_page_count +
                    step.new_kv_slots.size());
  for (const auto* v : {&step.qo_indptr, &step.kv_indptr, &step.kv_indices, &step.kv_last_page_len,
                        &step.new_kv_slots}) {
    h.indices.insert(h.indices.end(), v->begin(), v->end());
  }
  h.q_nope_elements = input.tensors.q_nope.size();
  h.q_elements = q_elements(input);
  to_bf16_bits(input.tensors.q_nope, q_bits, threads);
  to_bf16_bits(input.tensors.q_pe, q_bits + h.q_nope_elements, threads);
  h.q = q_bits;
  h.new_kv.resize(input.tensors.new_kv.size());
  to_bf16_bits(input.tensors.new_kv, h.new_kv.data(), threads);
  return h;
}

// Device pointers into the uploaded index buffer.
struct DeviceIndices {
  const std::int32_t* qo_indptr;
  const std::int32_t* kv_indptr;
  const std::int32_t* kv_indices;
  const std::int32_t* kv_last_page_len;
  const std::int32_t* new_kv_slots;
};

DeviceIndices device_indices(const std::int32_t* base, const HostStaging& h) {
  DeviceIndices d;
  d.qo_indptr = base;
  d.kv_indptr = d.qo_indptr + h.qo_count;
  d.kv_indices = d.kv_indptr + h.kv_indptr_count;
  d.kv_last_page_len = d.kv_indices + h.kv_indices_count;
  d.new_kv_slots = d.kv_last_page_len + h.last_page_count;
  return d;
}

// The output buffer holds out [Nq, H, Dc] bf16, then (16-byte aligned) lse [Nq, H] fp32.
std::size_t out_elements(const StepLayerInput& input) {
  return static_cast<std::size_t>(input.step.num_rows()) *
         static_cast<std::size_t>(input.attrs.num_heads) * input.attrs.kv_lora_rank;
}
std::size_t lse_offset_bytes(const StepLayerInput& input) {
  return (out_elements(input) * 2 + 15) / 16 * 16;
}

// Longest kv_len over the requests with rows this step (sizes the split-KV grid).
int max_kv_len(const StepMeta& step, int page_size) {
  int longest = 0;
  for (int b = 0; b < step.batch_size(); ++b) {
    if (step.rows_of(b) > 0) {
      longest = std::max<int>(longest, static_cast<int>(step.kv_len(b, page_size)));
    }
  }
  return longest;
}

// The device write takes bf16 bits. kvdump accepts float32 new_kv, and the write rule divides
// fp32(value): a value that is not a bf16 value would be rounded twice here (bf16, then e4m3),
// so such a step is refused by name rather than written differently from the rule.
Status check_new_kv_is_bf16(const std::vector<float>& new_kv, const std::string& where) {
  for (std::size_t i = 0; i < new_kv.size(); ++i) {
    const float value = new_kv[i];
    if (!std::isnan(value) && bf16_round(value) != value) {
      return unsupported(where, "new_kv[" + std::to_string(i) + "] = " + std::to_string(value) +
                                    " is not a bf16 value; the CUDA write takes bf16 new_kv "
                                    "(float32 new_kv needs --backend cpu-fp8)");
    }
  }
  return ok_status();
}

Status check_step(const StepLayerInput& input, const KvPool& pool, const std::string& where) {
  const DumpAttributes& attrs = input.attrs;
  const StepMeta& step = input.step;
  const int dc = attrs.kv_lora_rank;
  const int dr = attrs.qk_rope_head_dim;
  const int width = attrs.row_width();
  if (dc != mla::kKvLoraRank || dr != mla::kQkRopeHeadDim) {
    return unsupported(where, "MLA shape kv_lora_rank=" + std::to_string(dc) +
                                  ", qk_rope_head_dim=" + std::to_string(dr) +
                                  " (the CUDA kernels support 512 + 64 only)");
  }
  if (pool.row_width != width) {
    return bad_input(
        where, "pool row width " + std::to_string(pool.row_width) + " != " + std::to_string(width));
  }
  const std::size_t rows = static_cast<std::size_t>(step.num_rows());
  const std::size_t heads = static_cast<std::size_t>(attrs.num_heads);
  if (input.tensors.q_nope.size() != rows * heads * dc ||
      input.tensors.q_pe.size() != rows * heads * dr ||
      input.tensors.new_kv.size() != rows * width || step.new_kv_slots.size() != rows) {
    return bad_input(where, "tensor sizes disagree with the step's rows");
  }
  // The device writes through these indices: refuse anything out of range here.
  KVAUDIT_TRY(check_step_indices(step, attrs.page_size, pool.num_slots));
  return check_new_kv_is_bf16(input.tensors.new_kv, where);
}

class CudaMlaBackend final : public Backend {
 public:
  CudaMlaBackend(bool cast_whole_pool, CudaDeviceInfo device, BackendOptions options,
                 Injection injection)
      : cast_whole_pool_(cast_whole_pool),
        device_(std::move(device)),
        options_(std::move(options)),
        injection_(injection),
        mma_ran_(mla_attention_64_row_path(options_.cuda_variant.mma)) {}
  ~CudaMlaBackend() override {
    if (stream_ == nullptr) return;
    cudaStreamSynchronize(stream_);  // a failed step may have left copies queued to our buffers
    cudaStreamDestroy(stream_);
  }
  CudaMlaBackend(const CudaMlaBackend&) = delete;
  CudaMlaBackend& operator=(const CudaMlaBackend&) = delete;

  std::string name() const override { return cast_whole_pool_ ? "cuda-cast-bf16" : "cuda-fp8"; }

  nlohmann::json describe() const override {
    nlohmann::json j;
    j["backend"] = name();
    j["device"] = device_.name;
    j["compute_capability"] = std::to_string(device_.compute_capability / 10) + "." +
                              std::to_string(device_.compute_capability % 10);
    j["driver_version"] = device_.driver_version;
    j["runtime_version"] = device_.runtime_version;
    j["multiprocessors"] = device_.multiprocessors;
    j["kernel"] = cast_whole_pool_
                      ? "whole pool cast to bf16 every call, then the bf16 attention kernels "
                        "(kernel_variant), split-KV with exact merge"
                      : "fp8 e4m3 pool read directly, decoded to bf16 per KV tile (shared-memory "
                        "or register tile), bf16 tensor cores -> fp32 (kernel_variant), split-KV "
                        "with exact merge";
    j["kernel_variant"] = kernel_variant_json(options_.cuda_variant, mma_ran_);
    j["kv_tile_tokens"] = mla::kKvTileTokens;
    j["write_rule"] = "cvt.rn.satfinite.e4m3x2.f32 of fp32(x) / fp32(kv_scale)";
    if (injection_ != Injection::kNone) j["injection"] = injection_info(injection_).name;
    if (options_.reciprocal_scale) j["write_rule"] = "x * fp32(1 / kv_scale), then satfinite e4m3";
    j["device_bytes"] = {{"pool", allocations_.pool_bytes},
                         {"pool_bf16", allocations_.pool_bf16_bytes},
                         {"other", allocations_.other_bytes}};
    return j;
  }

  // validate, stage the inputs on the host, upload, write the step's KV, attend (on the FP8 pool,
  // or a bf16 view of it), download out, lse and the pool. kvdump v1.1 forms
  // (src/backend/mla_attention_operands.hpp): sparse rows attend over attention_view's step after
  // the writes; a per_token_group pool is written on the host (the v1.1 rule) and its dequantized
  // bf16 rows are attended on the device.
  Result<AttentionOutput> run_step(const StepLayerInput& input, KvPool& pool) override;

  CudaBackendAllocations allocations() const { return allocations_; }
  std::optional<DeviceSeconds> device_seconds() const override { return seconds_; }

 private:
  // run_step on what the attention is handed (a translation fault's input, else the step's own).
  Result<AttentionOutput> run_handed(const StepLayerInput& input, KvPool& pool);
  // The device pipeline: upload, write (if `write`), attend (if `attend`), download.
  Result<AttentionOutput> run_on_device(const StepLayerInput& input, KvPool& pool, bool write,
                                        bool attend);
  Status upload(const StepLayerInput& input, const HostStaging& staged, const KvPool& pool,
                const std::string& where);
  Status synchronize(const std::string& where, const char* what);
  Status write_kv(const StepLayerInput& input, const KvPool& pool, const DeviceIndices& indices,
                  const std::string& where, cudaStream_t stream);
  MlaAttentionProblem attention_problem(const StepLayerInput& input, const KvPool& pool,
                                        const DeviceIndices& indices,
                                        const HostStaging& staged) const;
  Status select_attention_pool(const KvPool& pool, MlaAttentionProblem& problem,
                               const std::string& where, cudaStream_t stream);
  Status attend(const MlaAttentionProblem& problem, const std::string& where, cudaStream_t stream);
  Result<AttentionOutput> download(const StepLayerInput& input, const MlaAttentionProblem& problem,
                                   KvPool& pool, const std::string& where);

  bool cast_whole_pool_;
  CudaDeviceInfo device_;
  BackendOptions options_;
  Injection injection_;
  TensorCorePath mma_ran_;  // the 64-row blocks' instructions on this device (kernel_variant)
  CudaBackendAllocations allocations_;
  DeviceSeconds seconds_;  // summed over run_on_device calls
  // The backend's own stream (non-blocking), made at the first step: its copies and kernels
  // overlap the GPU reference's, which has its own, when two layers are in flight.
  cudaStream_t stream_ = nullptr;
  DeviceBuffer pool_{&allocations_.pool_bytes, Growth::kExact};
  DeviceBuffer pool_bf16_{&allocations_.pool_bf16_bytes, Growth::kExact};
  DeviceBuffer indices_{&allocations_.other_bytes};
  DeviceBuffer q_{&allocations_.other_bytes};
  DeviceBuffer new_kv_{&allocations_.other_bytes};
  DeviceBuffer out_{&allocations_.other_bytes};
  DeviceBuffer workspace_{&allocations_.other_bytes};
  PinnedBuffer q_host_;    // q as bf16 bits, staged for upload
  PinnedBuffer out_host_;  // out as downloaded, before it is copied out
};

Result<AttentionOutput> CudaMlaBackend::run_step(const StepLayerInput& input, KvPool& pool) {
  ++seconds_.calls;
  if (injection_translates(injection_)) {
    // A translation fault: the attention is handed a faulty sm_scale or q_pe (as cpu-fp8).
    KVAUDIT_ASSIGN_OR_RETURN(const TranslatedInput translated,
                             translate_input(injection_, input.attrs, input.tensors));
    return run_handed({translated.attrs, input.step, input.layer, translated.tensors,
                       input.step_index, input.layer_index},
                      pool);
  }
  return run_handed(input, pool);
}

Result<AttentionOutput> CudaMlaBackend::run_handed(const StepLayerInput& input, KvPool& pool) {
  KVAUDIT_TRY(check_injection_applies(injection_, input.attrs));
  if (!pool.grouped() && !input.tensors.sparse()) return run_on_device(input, pool, true, true);
  auto start = Clock::now();
  if (pool.grouped()) {
    const std::string where = name() + ": step " + input.step.group;
    KVAUDIT_TRY(check_step_indices(input.step, input.attrs.page_size, pool.num_slots));
    KVAUDIT_TRY(write_grouped_step(input.step, input.tensors.new_kv, input.layer.kv_scale,
                                   options_.reciprocal_scale, pool, injection_));
  } else {
    const Result<AttentionOutput> written = run_on_device(input, pool, true, false);
    if (!written.ok()) return written.error();
    start = Clock::now();
  }
  AttentionOperands operands = attention_operands(input, pool, injection_);
  LayerMeta layer = input.layer;
  layer.kv_scale = operands.kv_scale;
  const StepLayerInput attention{operands.view.attrs, operands.view.step, layer,
                                 input.tensors,       input.step_index,   input.layer_index};
  // The attended pool comes back unchanged (no write): the backend's own pool is `pool`.
  KvPool& read = operands.dequantized ? *operands.dequantized : pool;
  seconds_.prepare += elapsed_seconds_since(start);  // the v1.1 forms' host work
  return run_on_device(attention, read, false, true);
}

Result<AttentionOutput> CudaMlaBackend::run_on_device(const StepLayerInput& input, KvPool& pool,
                                                      bool write, bool attend_rows) {
  const std::string where = name() + ": step " + input.step.group + " layer " + input.layer.group;
  auto start = Clock::now();
  KVAUDIT_TRY(check_step(input, pool, where));
  if (stream_ == nullptr) {
    KVAUDIT_TRY(cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), where,
                           "stream creation"));
  }
  KVAUDIT_ASSIGN_OR_RETURN(std::uint16_t * q_bits,
                           q_host_.reserve<std::uint16_t>(q_elements(input), where));
  const HostStaging staged = stage_inputs(input, q_bits, options_.threads);
  seconds_.prepare += elapsed_seconds_since(start);
  start = Clock::now();
  if (const Status uploaded = upload(input, staged, pool, where); !uploaded.ok()) {
    cudaStreamSynchronize(stream_);  // copies queued before the failure read q_host_
    return uploaded.error();
  }
  seconds_.upload += elapsed_seconds_since(start);
  start = Clock::now();
  const DeviceIndices indices = device_indices(indices_.as<std::int32_t>(), staged);
  cudaStream_t stream = stream_;
  if (write) KVAUDIT_TRY(write_kv(input, pool, indices, where, stream));
  MlaAttentionProblem problem = attention_problem(input, pool, indices, staged);
  if (attend_rows) {
    KVAUDIT_TRY(select_attention_pool(pool, problem, where, stream));
    KVAUDIT_TRY(attend(problem, where, stream));
  } else {
    KVAUDIT_TRY(synchronize(where, "kv write"));  // a write alone: its time is the kernels'
  }
  seconds_.kernels += elapsed_seconds_since(start);
  start = Clock::now();
  Result<AttentionOutput> output = download(input, problem, pool, where);
  if (!output.ok()) cudaStreamSynchronize(stream_);  // a queued download may still fill out_host_
  seconds_.download += elapsed_seconds_since(start);
  return output;
}

// Device buffers: pool; int32 indices; q (nope then pe); new_kv; out (bf16) then lse (fp32).
Status CudaMlaBackend::upload(const StepLayerInput& input, const HostStaging& staged,
                              const KvPool& pool, const std::string& where) {
  const std::size_t pool_bytes = pool.bytes.size();
  const std::size_t lse_bytes =
      static_cast<std::size_t>(input.step.num_rows()) * input.attrs.num_heads * 4;
  KVAUDIT_TRY(pool_.reserve(std::max<std::size_t>(pool_bytes, 16), where));
  KVAUDIT_TRY(indices_.reserve(std::max<std::size_t>(staged.indices.size() * 4, 16), where));
  KVAUDIT_TRY(q_.reserve(std::max<std::size_t>(staged.q_elements * 2, 16), where));
  KVAUDIT_TRY(new_kv_.reserve(std::max<std::size_t>(staged.new_kv.size() * 2, 16), where));
  KVAUDIT_TRY(out_.reserve(lse_offset_bytes(input) + lse_bytes + 16, where));

  KVAUDIT_TRY(cuda_check(
      cudaMemcpyAsync(pool_.data(), pool.bytes.data(), pool_bytes, cudaMemcpyHostToDevice, stream_),
      where, "pool upload"));
  KVAUDIT_TRY(
      cuda_check(cudaMemcpyAsync(indices_.data(), staged.indices.data(), staged.indices.size() * 4,
                                 cudaMemcpyHostToDevice, stream_),
                 where, "index upload"));
  KVAUDIT_TRY(cuda_check(
      cudaMemcpyAsync(q_.data(), staged.q, staged.q_elements * 2, cudaMemcpyHostToDevice, stream_),
      where, "q upload"));
  KVAUDIT_TRY(cuda_check(cudaMemcpyAsync(new_kv_.data(), staged.new_kv.data(),
                                         staged.new_kv.size() * 2, cudaMemcpyHostToDevice, stream_),
                         where, "new_kv upload"));
  // Waited for here: the staged sources are reused by the next step, and the split stays honest.
  return synchronize(where, "uploads");
}

Status CudaMlaBackend::synchronize(const std::string& where, const char* what) {
  return cuda_check(cudaStreamSynchronize(stream_), where, what);
}

// The write: kvdump's rule, or the named reciprocal option, or an injected write fault (the rules
// of src/backend/injection.hpp, which the CPU model writes with too).
Status CudaMlaBackend::write_kv(const StepLayerInput& input, const KvPool& pool,
                                const DeviceIndices& indices, const std::string& where,
                                cudaStream_t stream) {
  const bool fp8_pool = pool.dtype == KvDtype::kFloat8E4m3fn;
  const PoolElement element = fp8_pool ? PoolElement::kFp8E4m3 : PoolElement::kBf16;
  const int rows = input.step.num_rows();
  const int width = input.attrs.row_width();
  const float kv_scale = input.layer.kv_scale;
  const KvWriteRule rule = kv_write_rule_of(injection_, options_.reciprocal_scale);
  const int slot_offset = kv_write_slot_offset(injection_);
  if (rule == KvWriteRule::kDivide && slot_offset == 0) {
    return launch_kv_write(new_kv_.as<std::uint16_t>(), indices.new_kv_slots, rows, width, kv_scale,
                           element, pool_.data(), stream);
  }
  if (fp8_pool) {
    return launch_kv_write_rule(new_kv_.as<std::uint16_t>(), indices.new_kv_slots, rows, width,
                                kv_scale, pool_.as<std::uint8_t>(), pool.num_slots, rule,
                                slot_offset, stream);
  }
  return unsupported(where, std::string("the CUDA backends apply ") +
                                (slot_offset ? "neighbour-slot-write" : "this write rule") +
                                " to fp8 pools only");
}

MlaAttentionProblem CudaMlaBackend::attention_problem(const StepLayerInput& input,
                                                      const KvPool& pool,
                                                      const DeviceIndices& indices,
                                                      const HostStaging& staged) const {
  const DumpAttributes& attrs = input.attrs;
  const float kv_scale = input.layer.kv_scale;
  MlaAttentionProblem problem;
  problem.qo_indptr = indices.qo_indptr;
  problem.kv_indptr = indices.kv_indptr;
  problem.kv_indices = indices.kv_indices;
  problem.kv_last_page_len = indices.kv_last_page_len;
  problem.host_qo_indptr = input.step.qo_indptr.data();  // what `indices` holds on the device
  problem.host_kv_indptr = input.step.kv_indptr.data();
  problem.host_kv_last_page_len = input.step.kv_last_page_len.data();
  problem.batch = input.step.batch_size();
  problem.num_rows = input.step.num_rows();
  problem.num_heads = attrs.num_heads;
  problem.kv_lora_rank = attrs.kv_lora_rank;
  problem.qk_rope_head_dim = attrs.qk_rope_head_dim;
  problem.page_size = attrs.page_size;
  problem.num_slots = pool.num_slots;
  problem.max_kv_len = max_kv_len(input.step, attrs.page_size);
  problem.sm_scale = static_cast<float>(attrs.sm_scale);
  problem.kv_scale =
      injection_ == Injection::kScaleMismatch ? power_of_two_scale(kv_scale) : kv_scale;
  // As the CPU model: the double sm_scale times kv_scale times log2 e, rounded once to fp32.
  problem.score_scale =
      static_cast<float>(attrs.sm_scale * static_cast<double>(problem.kv_scale) * mla::kLog2e);
  problem.pool_element =
      pool.dtype == KvDtype::kFloat8E4m3fn ? PoolElement::kFp8E4m3 : PoolElement::kBf16;
  problem.pool = pool_.data();
  problem.read_masked_tail = injection_ == Injection::kMaskedNanLeak;
  problem.q_nope = q_.as<std::uint16_t>();
  problem.q_pe = q_.as<std::uint16_t>() + staged.q_nope_elements;
  problem.out = out_.as<std::uint16_t>();
  problem.lse = reinterpret_cast<float*>(out_.as<unsigned char>() + lse_offset_bytes(input));
  problem.variant = options_.cuda_variant;
  return problem;
}

// cuda-fp8 attends on the FP8 pool itself. cuda-cast-bf16 (and the fault whole-pool-cast) casts
// the whole pool to bf16 first; the fault fp8-read-as-bf16 reads the fp8 bytes as bf16.
Status CudaMlaBackend::select_attention_pool(const KvPool& pool, MlaAttentionProblem& problem,
                                             const std::string& where, cudaStream_t stream) {
  if (pool.dtype != KvDtype::kFloat8E4m3fn) return ok_status();
  if (cast_whole_pool_ || injection_ == Injection::kWholePoolCast) {
    const std::int64_t elements = pool.num_slots * pool.row_width;
    KVAUDIT_TRY(pool_bf16_.reserve(
        static_cast<std::size_t>(std::max<std::int64_t>(elements, 8)) * 2, where));
    KVAUDIT_TRY(launch_cast_pool_to_bf16(pool_.as<std::uint8_t>(), elements,
                                         pool_bf16_.as<std::uint16_t>(), stream));
    problem.pool_element = PoolElement::kBf16;
    problem.pool = pool_bf16_.data();
  } else if (injection_ == Injection::kFp8ReadAsBf16) {
    // The kv_data_type mix-up: the fp8 bytes addressed as a [S, D] bf16 array. Rows past the
    // buffer's end read zeros (a copy with a zero-filled second half), as the CPU model does.
    const std::size_t pool_bytes = pool.bytes.size();
    KVAUDIT_TRY(pool_bf16_.reserve(std::max<std::size_t>(2 * pool_bytes, 16), where));
    KVAUDIT_TRY(
        cuda_check(cudaMemsetAsync(pool_bf16_.data(), 0, 2 * pool_bytes, stream), where, "memset"));
    KVAUDIT_TRY(cuda_check(cudaMemcpyAsync(pool_bf16_.data(), pool_.data(), pool_bytes,
                                           cudaMemcpyDeviceToDevice, stream),
                           where, "pool copy"));
    problem.pool_element = PoolElement::kBf16;
    problem.pool = pool_bf16_.data();
  }
  return ok_status();
}

Status CudaMlaBackend::attend(const MlaAttentionProblem& problem, const std::string& where,
                              cudaStream_t stream) {
  const std::size_t workspace_bytes = mla_attention_workspace_bytes(problem);
  if (workspace_bytes > 0) KVAUDIT_TRY(workspace_.reserve(workspace_bytes, where));
  KVAUDIT_TRY(launch_mla_attention(problem, workspace_.data(), workspace_bytes, stream));
  return cuda_check(cudaStreamSynchronize(stream), where, "attention");
}

// out, lse and the pool after the step's writes (the harness checks its integrity).
// out comes through a page-locked buffer and is copied out on the backend's threads.
Result<AttentionOutput> CudaMlaBackend::download(const StepLayerInput& input,
                                                 const MlaAttentionProblem& problem, KvPool& pool,
                                                 const std::string& where) {
  AttentionOutput output;
  const std::size_t out_count = out_elements(input);
  output.out_bf16.resize(out_count);
  output.lse.resize(static_cast<std::size_t>(input.step.num_rows()) * input.attrs.num_heads);
  KVAUDIT_ASSIGN_OR_RETURN(std::uint16_t * out_bits,
                           out_host_.reserve<std::uint16_t>(out_count, where));
  KVAUDIT_TRY(cuda_check(
      cudaMemcpyAsync(out_bits, problem.out, out_count * 2, cudaMemcpyDeviceToHost, stream_), where,
      "out download"));
  KVAUDIT_TRY(cuda_check(cudaMemcpyAsync(output.lse.data(), problem.lse, output.lse.size() * 4,
                                         cudaMemcpyDeviceToHost, stream_),
                         where, "lse download"));
  KVAUDIT_TRY(cuda_check(cudaMemcpyAsync(pool.bytes.data(), pool_.data(), pool.bytes.size(),
                                         cudaMemcpyDeviceToHost, stream_),
                         where, "pool download"));
  KVAUDIT_TRY(synchronize(where, "downloads"));
  parallel_copy(out_bits, out_count, output.out_bf16.data(), options_.threads);
  return output;
}

Result<std::unique_ptr<Backend>> make_backend_on_device(bool cast_whole_pool,
                                                        const BackendOptions& options) {
  const char* flag = cast_whole_pool ? "--backend cuda-cast-bf16" : "--backend cuda-fp8";
  CudaDeviceInfo device = cuda_device_info();
  if (!device.present) return bad_input(flag, device.reason);
  KVAUDIT_ASSIGN_OR_RETURN(const Injection injection, parse_injection(options.injection));
  return std::unique_ptr<Backend>(
      new CudaMlaBackend(cast_whole_pool, std::move(device), options, injection));
}

}  // namespace

std::optional<CudaBackendAllocations> cuda_backend_allocations(const Backend& backend) {
  if (const auto* cuda = dynamic_cast<const CudaMlaBackend*>(&backend)) return cuda->allocations();
  return std::nullopt;
}

Result<std::unique_ptr<Backend>> make_cuda_fp8_backend(const BackendOptions& options) {
  return make_backend_on_device(false, options);
}

Result<std::unique_ptr<Backend>> make_cuda_cast_bf16_backend(const BackendOptions& options) {
  return make_backend_on_device(true, options);
}

}  // namespace kvaudit::cuda
