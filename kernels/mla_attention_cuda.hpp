// Host-side API of the CUDA MLA attention family (kernels/mla_attention.cu launches, device code
// in kernels/mla_attention.cuh). Plain C++: includable from .cpp files; pointers are device
// pointers unless named host_. The backends built on it (cuda-fp8, cuda-cast-bf16) are in
// src/backend/mla_attention_cuda_backend.hpp.
//
// Shapes (H = num_heads, Dc = 512, Dr = 64, D = 576, S = slots = num_pages * page_size):
//   q_nope : [num_rows, H, Dc] bf16 bits     q_pe : [num_rows, H, Dr] bf16 bits
//   new_kv : [num_rows, D] bf16 bits          new_kv_slots : [num_rows] int32
//   pool   : [S, D] e4m3 codes (Fp8) or bf16 bits (Bf16)
//   out    : [num_rows, H, Dc] bf16 bits     lse : [num_rows, H] fp32 (natural log)
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "kernels/kv_write_rules.hpp"
#include "kernels/mla_attention_variant.hpp"
#include "src/core/result.hpp"

typedef struct CUstream_st* cudaStream_t;

namespace kvaudit::cuda {

enum class PoolElement : std::uint8_t { kFp8E4m3, kBf16 };

struct MlaAttentionProblem {
  // Requests and their pages (kvdump-v1 semantics, after this step's writes).
  const std::int32_t* qo_indptr = nullptr;         // [batch + 1]
  const std::int32_t* kv_indptr = nullptr;         // [batch + 1]
  const std::int32_t* kv_indices = nullptr;        // [nnz_pages]
  const std::int32_t* kv_last_page_len = nullptr;  // [batch]
  // Optional host copies of the three request arrays above, holding the same values (all three or
  // none). With them, a problem of at most 16 query rows is located on the host, and each row's
  // request, first kv_indices entry and token count travel in the launch parameters (a host-side
  // plan, as FlashInfer's plan() reads host indptr): its blocks skip one dependent read of the
  // request arrays from memory. The plan is taken at launch and travels by value: a CUDA graph
  // captured with it replays the captured rows whatever the device arrays hold later, so leave
  // these null when capturing a graph that is replayed with other requests.
  // variant.host_plan = false ignores them (A/B runs).
  const std::int32_t* host_qo_indptr = nullptr;
  const std::int32_t* host_kv_indptr = nullptr;
  const std::int32_t* host_kv_last_page_len = nullptr;
  int batch = 0;
  int num_rows = 0;
  int num_heads = 0;
  int kv_lora_rank = 512;
  int qk_rope_head_dim = 64;
  int page_size = 1;
  std::int64_t num_slots = 0;
  int max_kv_len = 0;  // upper bound over requests (host knows it); sizes the split-KV grid
  float sm_scale = 0.f;
  float kv_scale = 1.f;  // multiplier applied to pool values (a cast pool keeps the fp8 scale)
  // fp32(sm_scale * kv_scale * log2 e), the scores' multiplier; 0: computed from the two floats
  // above. Callers holding a double sm_scale pass fp32(double(sm_scale) * kv_scale * log2 e), as
  // the CPU model (mla_score_scale) rounds it.
  float score_scale = 0.f;
  PoolElement pool_element = PoolElement::kFp8E4m3;
  // Fault injection masked-nan-leak only (src/backend/injection.hpp; its kernels are separate
  // instantiations, kernels/mla_attention_faults.cu): also load the rest of each
  // request's last page (slots no row may see) and mask those tokens by a zero weight, as a kernel
  // that masks by multiplying would; NaN codes there then reach the output (0 * NaN).
  bool read_masked_tail = false;
  const void* pool = nullptr;
  const std::uint16_t* q_nope = nullptr;
  const std::uint16_t* q_pe = nullptr;
  std::uint16_t* out = nullptr;
  float* lse = nullptr;
  // Which kernel variant runs (kernels/mla_attention_variant.hpp): the launcher's choices are a
  // function of this problem, the device and `variant`, made in one place (mla_attention.cu).
  CudaKernelVariant variant;
};

// What the launcher chooses for a problem, for tests and provenance (the choice itself is made in
// one place, mla_attention.cu "Kernel variant"):

// The tensor-core instructions of the 64-row blocks (decode above 32 heads, prefill and extend)
// on the current device: wgmma where the binary has sm_90a code for it and `mma` is kAuto, else
// mma.sync. The other blocks always run mma.sync.
using kvaudit::TensorCorePath;
TensorCorePath mla_attention_64_row_path(MmaChoice mma);

// The kernel that runs a problem's blocks of at most 16 heads (decode): with variant.decode16
// kAuto, the KV tile in registers when each block streams at least 8 of the 64-token tiles, else
// through shared memory (the register-tile kernel's first tile is slower, every later one faster;
// docs/kernels.md); kSharedTile or kRegisters forces one. kNone: the problem has no such blocks
// (more than 16 heads, prefill and extend) or is unsupported.
enum class Decode16Kernel { kNone, kSharedTile, kRegisterTile };
Decode16Kernel mla_attention_decode16_kernel(const MlaAttentionProblem& problem);

// Whether launch_mla_attention locates the problem's rows on the host (the host_* arrays given, at
// most 16 rows, variant.host_plan) rather than in the kernels. Same results.
bool mla_attention_host_planned(const MlaAttentionProblem& problem);

// Whether launch_mla_attention starts the problem's row groups longest first (prefill and extend:
// at least two rows per request on average; variant.longest_first). Same results.
bool mla_attention_longest_first(const MlaAttentionProblem& problem);

// Scratch for split-KV partial (out, lse); sized by mla_attention_workspace_bytes.
std::size_t mla_attention_workspace_bytes(const MlaAttentionProblem& problem);

// Runs attention. Unsupported shapes (Dc != 512, Dr != 64, H > 128, ...) return an
// `unsupported` Error naming the shape; CUDA failures an internal Error.
Status launch_mla_attention(const MlaAttentionProblem& problem, void* workspace,
                            std::size_t workspace_bytes, cudaStream_t stream);

// kvdump write rule on the device: pool[new_kv_slots[i], :] = e4m3_rne_satfinite(new_kv / scale)
// (cvt.rn.satfinite.e4m3x2.f32) for an fp8 pool, or the bf16 bits unchanged for a bf16 pool.
Status launch_kv_write(const std::uint16_t* new_kv, const std::int32_t* new_kv_slots, int num_rows,
                       int row_width, float kv_scale, PoolElement pool_element, void* pool,
                       cudaStream_t stream);

// Write rules besides the kvdump one: the harness's named --reciprocal-scale option and the write
// faults, defined once in kernels/kv_write_rules.hpp for the CUDA write kernel and the CPU model.
using kvaudit::KvWriteRule;

// launch_kv_write for an fp8 pool under `rule`; slot_offset 1 writes slot (s + 1) mod num_slots
// (fault neighbour-slot-write), 0 the slot itself. For the --reciprocal-scale option and the write
// faults: its kernels are in kernels/kv_write_rules.cu, not in the production launcher's object.
Status launch_kv_write_rule(const std::uint16_t* new_kv, const std::int32_t* new_kv_slots,
                            int num_rows, int row_width, float kv_scale, std::uint8_t* pool,
                            std::int64_t num_slots, KvWriteRule rule, int slot_offset,
                            cudaStream_t stream);

// The seed's bug, kept on purpose for cuda-cast-bf16: decode every code of the pool into a bf16
// buffer ([S, D], values without kv_scale: e4m3 -> bf16 is exact).
Status launch_cast_pool_to_bf16(const std::uint8_t* pool, std::int64_t num_elements,
                                std::uint16_t* pool_bf16, cudaStream_t stream);

}  // namespace kvaudit::cuda
