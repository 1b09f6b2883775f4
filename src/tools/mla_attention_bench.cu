// Device side of `kvaudit bench` (API and what is counted: src/tools/mla_attention_bench.hpp).
//
// Per case: a pool of random valid e4m3 codes (sign, exponent field 0..8, any mantissa: values
// in (-3.75, 3.75), never the NaN codes 0x7F / 0xFF), bf16 queries uniform in [-1, 1), pages
// taken from a random permutation of the pool's pages (so page size 1 is a real gather), and
// each path timed with CUDA events around every launch after a warm-up. Between timed launches
// a buffer larger than L2 is overwritten (outside the events), so a launch reads its KV from
// HBM as it would in a model where every layer has its own pool.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/mla_attention_cuda.hpp"
#include "kernels/mla_attention_model.hpp"
#include "src/tools/mla_attention_bench.hpp"

namespace kvaudit::bench {
namespace {

constexpr const char* kWhere = "src/tools/mla_attention_bench.cu";

Error cuda_error(const char* call, cudaError_t status) {
  return internal_error(kWhere, std::string(call) + ": " + cudaGetErrorString(status));
}

#define BENCH_CUDA(call)                                                       \
  do {                                                                         \
    const cudaError_t bench_status_ = (call);                                  \
    if (bench_status_ != cudaSuccess) return cuda_error(#call, bench_status_); \
  } while (0)

// Owns one cudaMalloc allocation.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  Status allocate(std::size_t bytes) {
    BENCH_CUDA(cudaMalloc(&ptr_, std::max<std::size_t>(bytes, 16)));
    bytes_ = bytes;
    return ok_status();
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  void* get() const { return ptr_; }
  std::size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

// Owns a stream and the events of one timed loop.
class StreamAndEvents {
 public:
  ~StreamAndEvents() {
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  Status create(int launches) {
    BENCH_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    events_.resize(2 * static_cast<std::size_t>(launches), nullptr);
    for (cudaEvent_t& e : events_) BENCH_CUDA(cudaEventCreate(&e));
    return ok_status();
  }
  cudaStream_t stream() const { return stream_; }
  cudaEvent_t start(int i) const { return events_[2 * i]; }
  cudaEvent_t stop(int i) const { return events_[2 * i + 1]; }

 private:
  cudaStream_t stream_ = nullptr;
  std::vector<cudaEvent_t> events_;
};

__device__ __forceinline__ std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// codes: [num_words * 8] e4m3; each byte = sign | exponent field 0..8 | mantissa.
__global__ void fill_e4m3_codes(std::uint64_t* words, std::int64_t num_words, std::uint64_t seed) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t w = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       w < num_words; w += stride) {
    std::uint64_t h = splitmix64(seed ^ (static_cast<std::uint64_t>(w) * 0xD1B54A32D192ED03ull));
    std::uint64_t word = 0;
    for (int b = 0; b < 8; ++b) {
      if (b == 4) h = splitmix64(h);
      const std::uint64_t r = (h >> (16 * (b & 3))) & 0xFFFFu;
      const std::uint64_t sign = r & 0x80u;
      const std::uint64_t exponent = ((r >> 8) % 9u) << 3;  // 0..8: |value| < 3.75
      const std::uint64_t mantissa = r & 0x7u;
      word |= (sign | exponent | mantissa) << (8 * b);
    }
    words[w] = word;
  }
}

// bf16 bits of values uniform in [-1, 1) (round to nearest even from fp32).
__global__ void fill_bf16_uniform(std::uint16_t* out, std::int64_t n, std::uint64_t seed) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += stride) {
    const std::uint64_t h =
        splitmix64(seed ^ (static_cast<std::uint64_t>(i) * 0xA24BAED4963EE407ull));
    const float u = static_cast<float>(h >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f;
    const std::uint32_t bits = __float_as_uint(u);
    out[i] = static_cast<std::uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
  }
}

constexpr int kFillBlocks = 2048;
constexpr int kFillThreads = 256;

float bf16_to_float(std::uint16_t bits) {
  const std::uint32_t u = static_cast<std::uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

LaunchTimes summarize(std::vector<float> ms) {
  LaunchTimes t;
  t.launches = static_cast<int>(ms.size());
  if (ms.empty()) return t;
  std::sort(ms.begin(), ms.end());
  const std::size_t n = ms.size();
  const double median = n % 2 == 1 ? ms[n / 2] : 0.5 * (ms[n / 2 - 1] + ms[n / 2]);
  t.median_us = 1e3 * median;
  t.min_us = 1e3 * ms.front();
  t.max_us = 1e3 * ms.back();
  return t;
}

// Warm up, then time each of `launches` calls of `body` between a pair of events; `flush` (if
// non-null) is overwritten before each timed call, outside the events.
template <typename Body>
Result<LaunchTimes> time_launches(const GpuBenchOptions& options, StreamAndEvents& se,
                                  const DeviceBuffer* flush, Body&& body) {
  for (int i = 0; i < options.warmup; ++i) KVAUDIT_TRY(body());
  std::vector<float> ms(static_cast<std::size_t>(options.launches));
  for (int i = 0; i < options.launches; ++i) {
    if (flush != nullptr && flush->bytes() > 0) {
      BENCH_CUDA(cudaMemsetAsync(flush->get(), i & 0xFF, flush->bytes(), se.stream()));
    }
    BENCH_CUDA(cudaEventRecord(se.start(i), se.stream()));
    KVAUDIT_TRY(body());
    BENCH_CUDA(cudaEventRecord(se.stop(i), se.stream()));
  }
  BENCH_CUDA(cudaStreamSynchronize(se.stream()));
  BENCH_CUDA(cudaGetLastError());
  for (int i = 0; i < options.launches; ++i) {
    BENCH_CUDA(cudaEventElapsedTime(&ms[i], se.start(i), se.stop(i)));
  }
  return summarize(std::move(ms));
}

Status check_launch(Status status) {
  if (!status.ok()) return status;
  BENCH_CUDA(cudaGetLastError());
  return ok_status();
}

std::string gib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", bytes / (1024.0 * 1024.0 * 1024.0));
  return buf;
}

}  // namespace

Result<CopyBandwidth> measure_copy_bandwidth(const GpuBenchOptions& options) {
  CopyBandwidth result;
  result.bytes = options.copy_bytes;
  DeviceBuffer src, dst;
  KVAUDIT_TRY(src.allocate(result.bytes));
  KVAUDIT_TRY(dst.allocate(result.bytes));
  StreamAndEvents se;
  KVAUDIT_TRY(se.create(options.launches));
  fill_e4m3_codes<<<kFillBlocks, kFillThreads, 0, se.stream()>>>(
      src.as<std::uint64_t>(), static_cast<std::int64_t>(result.bytes / 8), options.seed);
  BENCH_CUDA(cudaGetLastError());
  auto copy = [&]() -> Status {
    BENCH_CUDA(
        cudaMemcpyAsync(dst.get(), src.get(), result.bytes, cudaMemcpyDeviceToDevice, se.stream()));
    return ok_status();
  };
  // No flush: the copy itself is far larger than L2.
  KVAUDIT_ASSIGN_OR_RETURN(result.times, time_launches(options, se, nullptr, copy));
  result.gbps = 2.0 * static_cast<double>(result.bytes) / (result.times.median_us * 1e3);
  return result;
}

namespace {

constexpr int kD = mla::kRowWidth;
constexpr int kDc = mla::kKvLoraRank;
constexpr int kDr = mla::kQkRopeHeadDim;

Status check_case(const GpuCase& config) {
  if (config.batch < 1 || config.context < 1 || config.q_len < 1 || config.num_heads < 1 ||
      config.page_size < 1 || config.q_len > config.context) {
    return bad_input(config.name(),
                     "batch, context, q_len, heads and page size must be >= 1 "
                     "and q_len <= context");
  }
  const std::int64_t slots = config.effective_pool_slots();
  if (slots < config.needed_slots()) {
    return bad_input(config.name(),
                     "pool of " + std::to_string(slots) + " slots is smaller than the " +
                         std::to_string(config.needed_slots()) + " slots the requests need");
  }
  if (slots % config.page_size != 0) {
    return bad_input(config.name(), "pool slots must be a multiple of the page size");
  }
  return ok_status();
}

// Device memory needed, checked before allocating so that a case too large for this card is
// reported as skipped rather than failing halfway. Returns the reason it does not fit, or "".
Result<std::string> memory_shortfall(const GpuCase& config, const GpuBenchOptions& options) {
  const double pool_bytes = static_cast<double>(config.effective_pool_slots()) * kD;
  const double needed =
      pool_bytes * (config.with_cast ? 3.0 : 1.0) +
      static_cast<double>(config.num_rows()) * config.num_heads * (kD + kDc) * 2.0 * 2.0 +
      static_cast<double>(options.l2_flush_bytes);
  std::size_t free_bytes = 0, total_bytes = 0;
  BENCH_CUDA(cudaMemGetInfo(&free_bytes, &total_bytes));
  if (needed > 0.9 * static_cast<double>(free_bytes)) {
    return "needs about " + gib(needed) + " of device memory, " + gib(free_bytes) + " free";
  }
  return std::string();
}

// Page table on the host: request b owns pages perm[b * ppr .. (b + 1) * ppr - 1] of a random
// permutation of the pool's pages.
struct HostPageTable {
  std::vector<std::int32_t> perm;
  std::vector<std::int32_t> qo_indptr, kv_indptr, last_page_len;
  std::size_t nnz_pages = 0;
};

HostPageTable page_table(const GpuCase& config, const GpuBenchOptions& options) {
  const std::int64_t slots = config.effective_pool_slots();
  const int ppr = config.pages_per_request();
  HostPageTable t;
  t.perm.resize(static_cast<std::size_t>(slots / config.page_size));
  std::iota(t.perm.begin(), t.perm.end(), 0);
  std::mt19937_64 rng(options.seed ^ (static_cast<std::uint64_t>(slots) * 0x9E3779B97F4A7C15ull));
  std::shuffle(t.perm.begin(), t.perm.end(), rng);
  t.qo_indptr.resize(config.batch + 1);
  t.kv_indptr.resize(config.batch + 1);
  t.last_page_len.resize(config.batch);
  for (int b = 0; b <= config.batch; ++b) {
    t.qo_indptr[b] = b * config.q_len;
    t.kv_indptr[b] = b * ppr;
  }
  for (int b = 0; b < config.batch; ++b) {
    t.last_page_len[b] = config.context - (ppr - 1) * config.page_size;
  }
  t.nnz_pages = static_cast<std::size_t>(config.batch) * ppr;
  return t;
}

// The case's device buffers (freed when it goes out of scope).
struct DeviceCase {
  DeviceBuffer qo_indptr, kv_indptr, kv_indices, last_page_len, pool, q_nope, q_pe, out, lse, flush;
};

Status allocate_case(const GpuCase& config, const GpuBenchOptions& options,
                     const HostPageTable& table, DeviceCase& d) {
  const std::size_t rows_heads = static_cast<std::size_t>(config.num_rows()) * config.num_heads;
  KVAUDIT_TRY(d.qo_indptr.allocate(table.qo_indptr.size() * 4));
  KVAUDIT_TRY(d.kv_indptr.allocate(table.kv_indptr.size() * 4));
  KVAUDIT_TRY(d.kv_indices.allocate(table.nnz_pages * 4));
  KVAUDIT_TRY(d.last_page_len.allocate(table.last_page_len.size() * 4));
  KVAUDIT_TRY(d.pool.allocate(static_cast<std::size_t>(config.effective_pool_slots()) * kD));
  KVAUDIT_TRY(d.q_nope.allocate(rows_heads * kDc * 2));
  KVAUDIT_TRY(d.q_pe.allocate(rows_heads * kDr * 2));
  KVAUDIT_TRY(d.out.allocate(rows_heads * kDc * 2));
  KVAUDIT_TRY(d.lse.allocate(rows_heads * 4));
  if (options.l2_flush_bytes > 0) KVAUDIT_TRY(d.flush.allocate(options.l2_flush_bytes));
  return ok_status();
}

// Page table up; pool (random valid codes) and queries filled on the device.
Status fill_case(const GpuCase& config, const GpuBenchOptions& options, const HostPageTable& table,
                 DeviceCase& d, cudaStream_t stream) {
  const std::int64_t rows_heads = config.num_rows() * config.num_heads;
  BENCH_CUDA(cudaMemcpyAsync(d.qo_indptr.get(), table.qo_indptr.data(), table.qo_indptr.size() * 4,
                             cudaMemcpyHostToDevice, stream));
  BENCH_CUDA(cudaMemcpyAsync(d.kv_indptr.get(), table.kv_indptr.data(), table.kv_indptr.size() * 4,
                             cudaMemcpyHostToDevice, stream));
  BENCH_CUDA(cudaMemcpyAsync(d.kv_indices.get(), table.perm.data(), table.nnz_pages * 4,
                             cudaMemcpyHostToDevice, stream));
  BENCH_CUDA(cudaMemcpyAsync(d.last_page_len.get(), table.last_page_len.data(),
                             table.last_page_len.size() * 4, cudaMemcpyHostToDevice, stream));
  fill_e4m3_codes<<<kFillBlocks, kFillThreads, 0, stream>>>(
      d.pool.as<std::uint64_t>(), config.effective_pool_slots() * kD / 8, options.seed + 1);
  BENCH_CUDA(cudaGetLastError());
  fill_bf16_uniform<<<kFillBlocks, kFillThreads, 0, stream>>>(d.q_nope.as<std::uint16_t>(),
                                                              rows_heads * kDc, options.seed + 2);
  BENCH_CUDA(cudaGetLastError());
  fill_bf16_uniform<<<kFillBlocks, kFillThreads, 0, stream>>>(d.q_pe.as<std::uint16_t>(),
                                                              rows_heads * kDr, options.seed + 3);
  BENCH_CUDA(cudaGetLastError());
  return ok_status();
}

// The device arrays and, for the launcher's host plan, the host table they were copied from (it
// outlives the problem: both live in run_gpu_case).
cuda::MlaAttentionProblem case_problem(const GpuCase& config, const HostPageTable& table,
                                       const DeviceCase& d, const CudaKernelVariant& variant) {
  cuda::MlaAttentionProblem problem;
  problem.qo_indptr = d.qo_indptr.as<std::int32_t>();
  problem.kv_indptr = d.kv_indptr.as<std::int32_t>();
  problem.kv_indices = d.kv_indices.as<std::int32_t>();
  problem.kv_last_page_len = d.last_page_len.as<std::int32_t>();
  problem.host_qo_indptr = table.qo_indptr.data();
  problem.host_kv_indptr = table.kv_indptr.data();
  problem.host_kv_last_page_len = table.last_page_len.data();
  problem.batch = config.batch;
  problem.num_rows = static_cast<int>(config.num_rows());
  problem.num_heads = config.num_heads;
  problem.kv_lora_rank = kDc;
  problem.qk_rope_head_dim = kDr;
  problem.page_size = config.page_size;
  problem.num_slots = config.effective_pool_slots();
  problem.max_kv_len = config.context;
  problem.sm_scale = static_cast<float>(1.0 / std::sqrt(192.0));  // GLM-5/DeepSeek qk head dim
  problem.kv_scale = 0.0625f;
  problem.pool_element = cuda::PoolElement::kFp8E4m3;
  problem.pool = d.pool.get();
  problem.q_nope = d.q_nope.as<std::uint16_t>();
  problem.q_pe = d.q_pe.as<std::uint16_t>();
  problem.out = d.out.as<std::uint16_t>();
  problem.lse = d.lse.as<float>();
  problem.variant = variant;
  return problem;
}

// The FP8 path: one untimed probe (a shape the kernel does not support is reported in
// result.skipped, not timed), the timed launches, and what they produced (out, non-finite lse).
Status time_fp8(const GpuCase& config, const GpuBenchOptions& options, double copy_gbps,
                const cuda::MlaAttentionProblem& problem, const DeviceCase& d, StreamAndEvents& se,
                GpuCaseResult& result, std::vector<std::uint16_t>& out_fp8) {
  const cudaStream_t stream = se.stream();
  DeviceBuffer d_workspace;
  const std::size_t ws_bytes = cuda::mla_attention_workspace_bytes(problem);
  KVAUDIT_TRY(d_workspace.allocate(ws_bytes));
  Status probe = cuda::launch_mla_attention(problem, d_workspace.get(), ws_bytes, stream);
  if (!probe.ok() && probe.error().kind == ErrorKind::kUnsupported) {
    result.skipped = probe.error().message();
    return ok_status();
  }
  KVAUDIT_TRY(check_launch(probe));
  BENCH_CUDA(cudaStreamSynchronize(stream));

  const DeviceBuffer* flush = options.l2_flush_bytes > 0 ? &d.flush : nullptr;
  auto fp8_call = [&]() -> Status {
    return check_launch(cuda::launch_mla_attention(problem, d_workspace.get(), ws_bytes, stream));
  };
  KVAUDIT_ASSIGN_OR_RETURN(result.fp8, time_launches(options, se, flush, fp8_call));

  const std::size_t lse_elements = static_cast<std::size_t>(config.num_rows()) * config.num_heads;
  out_fp8.resize(lse_elements * kDc);
  std::vector<float> lse(lse_elements);
  BENCH_CUDA(cudaMemcpy(out_fp8.data(), d.out.get(), out_fp8.size() * 2, cudaMemcpyDeviceToHost));
  BENCH_CUDA(cudaMemcpy(lse.data(), d.lse.get(), lse.size() * 4, cudaMemcpyDeviceToHost));
  result.fp8_nonfinite_lse =
      std::count_if(lse.begin(), lse.end(), [](float v) { return !std::isfinite(v); });
  const double seconds = result.fp8.median_us * 1e-6;
  result.fp8_gbps = config.kv_bytes() / seconds * 1e-9;
  result.fp8_tflops = config.flops() / seconds * 1e-12;
  result.fp8_copy_ratio = copy_gbps > 0 ? result.fp8_gbps / copy_gbps : 0;
  return ok_status();
}

// The seed's path on the same pool: cast the whole pool to bf16, then bf16 attention, timed
// together per call; its largest |difference| to the FP8 path's out.
Status time_cast(const GpuCase& config, const GpuBenchOptions& options,
                 const cuda::MlaAttentionProblem& problem, const DeviceCase& d, StreamAndEvents& se,
                 const std::vector<std::uint16_t>& out_fp8, GpuCaseResult& result) {
  const cudaStream_t stream = se.stream();
  const std::int64_t slots = config.effective_pool_slots();
  DeviceBuffer d_pool_bf16;
  KVAUDIT_TRY(d_pool_bf16.allocate(static_cast<std::size_t>(slots) * kD * 2));
  cuda::MlaAttentionProblem cast_problem = problem;
  cast_problem.pool_element = cuda::PoolElement::kBf16;
  cast_problem.pool = d_pool_bf16.get();
  DeviceBuffer d_cast_workspace;
  const std::size_t cast_ws_bytes = cuda::mla_attention_workspace_bytes(cast_problem);
  KVAUDIT_TRY(d_cast_workspace.allocate(cast_ws_bytes));
  BENCH_CUDA(cudaMemsetAsync(d.out.get(), 0xFF, out_fp8.size() * 2, stream));
  auto cast_call = [&]() -> Status {
    KVAUDIT_TRY(check_launch(cuda::launch_cast_pool_to_bf16(
        d.pool.as<std::uint8_t>(), slots * kD, d_pool_bf16.as<std::uint16_t>(), stream)));
    return check_launch(
        cuda::launch_mla_attention(cast_problem, d_cast_workspace.get(), cast_ws_bytes, stream));
  };
  const DeviceBuffer* flush = options.l2_flush_bytes > 0 ? &d.flush : nullptr;
  auto cast_times = time_launches(options, se, flush, cast_call);
  if (!cast_times.ok() && cast_times.error().kind == ErrorKind::kUnsupported) {
    result.cast_skipped = cast_times.error().message();
    return ok_status();
  }
  if (!cast_times.ok()) return cast_times.error();
  result.cast = *cast_times;
  result.cast_speedup = result.cast->median_us / result.fp8.median_us;
  std::vector<std::uint16_t> out_cast(out_fp8.size());
  BENCH_CUDA(cudaMemcpy(out_cast.data(), d.out.get(), out_cast.size() * 2, cudaMemcpyDeviceToHost));
  double worst = 0;
  for (std::size_t i = 0; i < out_fp8.size(); ++i) {
    const double diff = std::fabs(static_cast<double>(bf16_to_float(out_fp8[i])) -
                                  static_cast<double>(bf16_to_float(out_cast[i])));
    worst = std::isnan(diff) ? INFINITY : std::max(worst, diff);
  }
  result.max_abs_diff_vs_cast = worst;
  return ok_status();
}

}  // namespace

// validate, check memory, page table, allocate and fill, time FP8, time the cast path.
Result<GpuCaseResult> run_gpu_case(const GpuCase& config, const GpuBenchOptions& options,
                                   double copy_gbps) {
  GpuCaseResult result;
  result.config = config;
  KVAUDIT_TRY(check_case(config));
  KVAUDIT_ASSIGN_OR_RETURN(result.skipped, memory_shortfall(config, options));
  if (!result.skipped.empty()) return result;

  const HostPageTable table = page_table(config, options);
  StreamAndEvents se;
  KVAUDIT_TRY(se.create(options.launches));
  DeviceCase d;
  KVAUDIT_TRY(allocate_case(config, options, table, d));
  KVAUDIT_TRY(fill_case(config, options, table, d, se.stream()));
  const cuda::MlaAttentionProblem problem = case_problem(config, table, d, options.variant);

  std::vector<std::uint16_t> out_fp8;
  KVAUDIT_TRY(time_fp8(config, options, copy_gbps, problem, d, se, result, out_fp8));
  if (!result.skipped.empty() || !config.with_cast) return result;
  KVAUDIT_TRY(time_cast(config, options, problem, d, se, out_fp8, result));
  return result;
}

}  // namespace kvaudit::bench
