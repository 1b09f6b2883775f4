// Timing harness for the CUDA MLA attention family (src/tools/mla_attention_bench.cu), in plain
// C++ so that src/cli/cli_bench.cpp can include it in every build. The functions that touch the
// device exist only when kvaudit is built with CUDA (KVAUDIT_HAVE_CUDA); the case arithmetic
// below is inline and builds everywhere.
//
// One case: `batch` requests, each with `context` visible tokens after the step's writes and
// `q_len` query rows (1: decode; more: prefill/extend, causal: row j of a request sees tokens
// 0 .. context - q_len + j), `num_heads` heads, pages of `page_size` slots scattered over a pool
// of `pool_slots` slots (a random permutation of its pages).
//   q_nope : [batch * q_len, num_heads, 512] bf16    q_pe : [batch * q_len, num_heads, 64] bf16
//   pool   : [pool_slots, 576] e4m3 codes            out  : [batch * q_len, num_heads, 512] bf16
//
// What is counted per case (docs/kernels.md "Arithmetic of MLA decode"):
//   KV bytes  = batch * context * 576: each request's tokens once, in FP8, however many heads or
//               query rows read them (heads share the row; the kernel must not re-read it).
//   FLOP      = 2176 per (query row, head, visible token): 576 multiply-adds for the score and
//               512 for P.V, two FLOP each. Softmax work is not counted.
//   GB/s      = KV bytes / time; TFLOP/s = FLOP / time; copy ratio = GB/s over the bandwidth of
//               a device-to-device cudaMemcpyAsync measured in the same run (bytes read plus
//               bytes written, so both figures count every byte that crosses HBM once).
//   speedup   = (cast whole pool to bf16 + bf16 attention, timed together per call, as the seed
//               did every layer) / (FP8 attention).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kernels/mla_attention_variant.hpp"
#include "src/core/result.hpp"

namespace kvaudit::bench {

inline constexpr int kRowBytesFp8 = 576;        // Dc + Dr codes of one cached token
inline constexpr int kFlopPerTokenHead = 2176;  // 2 * (576 + 512)

struct GpuCase {
  std::string group;  // "decode", "seed-pool", "pool-sweep", "heads", "page", "prefill", ...
  int batch = 1;
  int context = 4096;
  int q_len = 1;
  int num_heads = 16;
  int page_size = 64;
  std::int64_t pool_slots = 0;  // 0: just the pages the requests need
  bool with_cast = true;        // also time the cuda-cast-bf16 path on the same pool
  std::string target;           // non-empty for a case that a stated target is judged on

  int pages_per_request() const { return (context + page_size - 1) / page_size; }
  std::int64_t needed_slots() const {
    return static_cast<std::int64_t>(batch) * pages_per_request() * page_size;
  }
  std::int64_t effective_pool_slots() const { return pool_slots > 0 ? pool_slots : needed_slots(); }
  std::int64_t num_rows() const { return static_cast<std::int64_t>(batch) * q_len; }
  // KV bytes read: each request's visible tokens once.
  double kv_bytes() const { return static_cast<double>(batch) * context * kRowBytesFp8; }
  // Visible tokens summed over a request's rows: row j sees context - q_len + j + 1 tokens.
  double visible_tokens_per_request() const {
    const double first = static_cast<double>(context) - q_len + 1;
    return q_len * first + 0.5 * static_cast<double>(q_len) * (q_len - 1);
  }
  double flops() const {
    return static_cast<double>(kFlopPerTokenHead) * num_heads * batch *
           visible_tokens_per_request();
  }
  // decode(B=64,ctx=8192,H=16,page=64,pool=524288)
  std::string name() const {
    std::string s = (q_len == 1 ? "decode(" : "prefill(") + std::string("B=") +
                    std::to_string(batch) + ",ctx=" + std::to_string(context);
    if (q_len != 1) s += ",q=" + std::to_string(q_len);
    s += ",H=" + std::to_string(num_heads) + ",page=" + std::to_string(page_size) +
         ",pool=" + std::to_string(effective_pool_slots()) + ")";
    return s;
  }
};

// Median, fastest and slowest of `launches` timed launches (microseconds, CUDA events).
struct LaunchTimes {
  double median_us = 0;
  double min_us = 0;
  double max_us = 0;
  int launches = 0;
};

struct GpuCaseResult {
  GpuCase config;
  std::string skipped;  // non-empty: the kernel refused the shape (the reason); no times
  LaunchTimes fp8;
  std::optional<LaunchTimes> cast;  // cast whole pool + bf16 attention, per call
  std::string cast_skipped;         // non-empty: the bf16 path refused the shape (the reason)
  double fp8_gbps = 0;
  double fp8_tflops = 0;
  double fp8_copy_ratio = 0;
  double cast_speedup = 0;  // cast.median / fp8.median (0 without cast)
  // Sanity of what was timed: lse non-finite count over every (row, head) of the FP8 path, and
  // the largest |out_fp8 - out_cast| (bf16 values; the two paths compute the same function).
  std::int64_t fp8_nonfinite_lse = 0;
  double max_abs_diff_vs_cast = 0;
  // The --peer program's median time on the same case (kvaudit bench; 0: no peer, or the peer did
  // not measure it).
  double peer_median_us = 0;
};

struct CopyBandwidth {
  std::size_t bytes = 0;  // bytes copied per call (read once and written once)
  LaunchTimes times;
  double gbps = 0;  // 2 * bytes / median time
};

struct GpuBenchOptions {
  int warmup = 5;
  int launches = 50;
  std::uint64_t seed = 1;
  std::size_t copy_bytes = std::size_t{1} << 30;
  // Bytes written between timed launches so that no launch finds its KV in L2 (H200: 50 MB L2),
  // as in a model where every layer reads another pool. 0 keeps whatever L2 holds.
  std::size_t l2_flush_bytes = std::size_t{256} << 20;
  // The kernel variant timed (--cuda-mma, --cuda-decode16, --cuda-host-plan, --cuda-longest-first).
  CudaKernelVariant variant;
};

// Measured on device 0. Device errors come back as internal Errors naming the CUDA call.
Result<CopyBandwidth> measure_copy_bandwidth(const GpuBenchOptions& options);

// Runs one case (allocate, fill, warm up, time, check, free). A shape the kernel refuses comes
// back as a result with `skipped` set, not as an error. `copy_gbps` scales fp8_copy_ratio.
Result<GpuCaseResult> run_gpu_case(const GpuCase& config, const GpuBenchOptions& options,
                                   double copy_gbps);

}  // namespace kvaudit::bench
