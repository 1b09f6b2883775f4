// Host launcher of the CUDA MLA attention family: the only place that chooses grid shapes and
// template arguments (device code in kernels/mla_attention.cuh, the math it computes in
// kernels/mla_attention_model.hpp). It instantiates the production kernels only: the fault variant
// masked-nan-leak (AttentionFault::kMaskedNanLeak) is instantiated in
// kernels/mla_attention_faults.cu, which this launcher calls for it
// (scripts/check_fault_free_kernels.py checks the two objects).
//
// Grid of the attention kernel: row_groups * head_blocks * num_splits blocks of 256 threads, one
// block per (group of rows_per_block query rows, block of heads, split of the rows' 64-token
// tiles), one block per SM. Shapes (choose_rows_and_heads):
//   decode, H <= 16: one row x 16 heads; a split of >= 8 tiles runs mla_decode_registers_kernel
//     (each warp keeps 64 columns of every token of a tile in registers, ~39 KiB shared memory),
//     a shorter one kMTiles = 1 (8 warps split Q.K^T into 4 token quarters x 2 k halves with Q
//     fragments in registers, P.V into 8 dim slices; ~104 KiB shared memory);
//   decode, H <= 32: kMTiles = 2, one row x 32 heads (~116 KiB);
//   decode, H > 32: kMTiles = 4, one row x 64 heads, ceil(H / 64) head blocks (~193 KiB with
//     mma.sync, ~207 KiB with wgmma, whose two warpgroups trade partial scores through 16 KiB);
//   prefill / extend (rows >= 2 x requests), H <= 32: kMTiles = 4, 4 (or 2) consecutive causal
//     rows x 16 (or 32) heads sharing each decoded KV tile.
// Split-KV (flash-decoding): when the blocks alone leave SMs idle, each row group's tiles are split
// over several blocks and a merge kernel (mla_merge_kernel, or mla_merge_window_kernel from 16
// splits), a programmatic dependent launch, combines the partial (out, lse) exactly. Runtime ->
// compile-time dispatch happens here only, one axis at a time (pool element, m16 tiles per block;
// the write rule through dispatch_kv_write_rule), each with a default that is `unsupported`.
// Host plan (plan_rows_on_host): given host copies of the request arrays, a problem of at most
// kMaxPlannedRows rows has its rows located here, by the kernels' own rule, and passed in the
// launch parameters, so that its blocks start at the page-table lookup.
//
// Kernel variant (MlaAttentionProblem::variant, kernels/mla_attention_variant.hpp): every choice
// between kernels that compute the same attention (wgmma or mma.sync, the 16-head decode kernel,
// the host plan, the row groups' order) is made in the section "Kernel variant" below, from the
// problem, the device and the variant the caller passes; nothing is read from the environment.
// Measured times and what limits them: reports/bench-h200.md, docs/kernels.md.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>

#include "kernels/mla_attention.cuh"
#include "kernels/mla_attention_cuda.hpp"
#include "kernels/mla_attention_launch.cuh"
#include "kernels/mla_decode_registers.cuh"

namespace kvaudit::cuda {

namespace {

using namespace launch;  // kWhere, cuda_status, the dispatch and the launch of one instantiation

int device_multiprocessors() {
  int device = 0;
  int count = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      count <= 0) {
    return 132;  // H100/H200 SXM
  }
  return count;
}

struct LaunchShape {
  int m_tiles = 1;
  int block_heads = 16;    // heads per row in a block (a multiple of 16)
  int rows_per_block = 1;  // query rows sharing a block's KV tiles
  int row_groups = 0;
  int head_blocks = 1;
  int num_splits = 1;
  bool longest_first = false;  // row groups in reverse order (choose_rows_and_heads)
};

// ---- Kernel variant: every choice between kernels of the same attention, made here only -------
// Each is a function of the problem, the device and problem.variant (CudaKernelVariant, chosen
// once on the command line: --cuda-mma, --cuda-decode16, --cuda-host-plan, --cuda-longest-first).
// host_plan and longest_first change no bit of the results; mma and decode16 run other kernels
// (another summation order), within the kernel error bound.

// Prefill and extend (two or more rows per request on average) start their row groups longest
// first (detail::locate_work) unless variant.longest_first is off (A/B measurements, the [gpu]
// test that runs both): the same bits either way.
bool longest_first_applies(const MlaAttentionProblem& problem) {
  return problem.num_rows >= 2 * problem.batch && problem.variant.longest_first;
}

// Tensor-core path of the four-m16-tile kernels (64 M rows): wgmma where this binary has sm_90a
// code for the device (probed once, by running wgmma_probe_kernel) and variant.mma is auto, else
// mma.sync (--cuda-mma mma-sync: A/B measurements, bisecting a doubt about the wgmma path, the
// [gpu] test that runs both). A launch asks for the path only for four-tile blocks
// (FourTilePath); describe() (kernel_variant.mma) asks once per backend.
bool probe_wgmma() {
  int* flag = nullptr;
  int has_wgmma = 0;
  if (cudaMalloc(&flag, sizeof(int)) != cudaSuccess) return false;
  detail::wgmma_probe_kernel<<<1, 1>>>(flag);
  const bool copied =
      cudaGetLastError() == cudaSuccess &&
      cudaMemcpy(&has_wgmma, flag, sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess;
  cudaFree(flag);
  return copied && has_wgmma == 1;
}

detail::MmaPath probed_mma_path() {
  static const bool has_wgmma = probe_wgmma();
  return has_wgmma ? detail::MmaPath::kWgmma : detail::MmaPath::kMmaSync;
}

detail::MmaPath mma_sync_path() { return detail::MmaPath::kMmaSync; }

FourTilePath four_tile_mma_path(MmaChoice mma) {
  return mma == MmaChoice::kMmaSync ? mma_sync_path : probed_mma_path;
}

// Blocks of one m16 tile (decode, H <= 16): mla_decode_registers_kernel (the KV tile in registers,
// kernels/mla_decode_registers.cuh) when a split holds at least kRegisterTileMinTiles tiles, else
// mla_attention_kernel<1, ...> (the tile through shared memory), unless variant.decode16 forces
// one (A/B measurements, the [gpu] test that runs both). The threshold is the crossover measured
// on the H200 (registers / shared-tile time 1.01-1.08 at 1-4 tiles per split, 0.975-0.994 at 8,
// 0.87 from 128 on: docs/kernel-experiments.md, round 11).
constexpr int kRegisterTileMinTiles = 8;

Decode16Kernel decode16_kernel(const LaunchShape& shape, int max_tiles, Decode16Choice choice) {
  switch (choice) {
    case Decode16Choice::kSharedTile:
      return Decode16Kernel::kSharedTile;
    case Decode16Choice::kRegisters:
      return Decode16Kernel::kRegisterTile;
    case Decode16Choice::kAuto:
      break;
  }
  const int tiles_per_split = (max_tiles + shape.num_splits - 1) / shape.num_splits;
  return tiles_per_split >= kRegisterTileMinTiles ? Decode16Kernel::kRegisterTile
                                                  : Decode16Kernel::kSharedTile;
}

// The host plan (MlaAttentionProblem::host_*): every row of a problem of at most kMaxPlannedRows
// rows located on the host by the kernels' own rule (detail::row_range), unless the caller gave no
// host copies or variant.host_plan is off.
bool host_plan_applies(const MlaAttentionProblem& problem) {
  return problem.host_qo_indptr != nullptr && problem.host_kv_indptr != nullptr &&
         problem.host_kv_last_page_len != nullptr && problem.num_rows <= detail::kMaxPlannedRows &&
         problem.variant.host_plan;
}

// Rows and heads per block. Decode (about one row per request): one row, its heads in 1, 2 or 4
// m16 tiles (16, 32, 64 heads per block). Prefill and extend (two or more rows per request on
// average), at most 32 heads: 64 M rows of 4 (or 2) consecutive query rows, so that each decoded
// KV tile serves four times the rows. The pool element does not enter: a bf16 pool cast from the
// FP8 one runs the same tiling and gives the same bits. The order of the row groups:
// longest_first_applies (Kernel variant).
void choose_rows_and_heads(const MlaAttentionProblem& problem, LaunchShape& shape) {
  const int heads16 = (problem.num_heads + 15) / 16 * 16;
  const bool many_rows_per_request = problem.num_rows >= 2 * problem.batch;
  shape.longest_first = longest_first_applies(problem);
  // The kernel takes row groups with four m16 tiles only (kRowGroups in mla_attention_kernel).
  if (many_rows_per_request && heads16 <= 32) {
    shape.m_tiles = 4;
    shape.block_heads = heads16;
    shape.rows_per_block = 64 / heads16;
  } else {
    shape.m_tiles = heads16 <= 16 ? 1 : (heads16 <= 32 ? 2 : 4);
    shape.block_heads = 16 * shape.m_tiles;
    shape.rows_per_block = 1;
  }
  shape.head_blocks = (problem.num_heads + shape.block_heads - 1) / shape.block_heads;
  shape.row_groups = (problem.num_rows + shape.rows_per_block - 1) / shape.rows_per_block;
}

// Splits: with base = row_groups * head_blocks blocks over `slots` resident block slots, a split
// count s costs about waves(s) * (tiles per split + kSplitOverheadTiles), where waves(s) =
// ceil(base * s / slots) and the overhead stands for a block's start (Q staging, first load) and
// its partial (out, lse) written and merged. The cheapest s in 1 .. max_tiles wins (ties: fewer).
// Rows shorter than max_kv_len get empty splits, which exit at once.
constexpr int kSplitOverheadTiles = 3;

int max_kv_tiles(const MlaAttentionProblem& problem) {
  return std::max(1, (problem.max_kv_len + mla::kKvTileTokens - 1) / mla::kKvTileTokens);
}

LaunchShape launch_shape(const MlaAttentionProblem& problem) {
  LaunchShape shape;
  choose_rows_and_heads(problem, shape);
  const long long base = static_cast<long long>(shape.row_groups) * shape.head_blocks;
  const int max_tiles = max_kv_tiles(problem);
  const long long slots = static_cast<long long>(device_multiprocessors()) * detail::kBlocksPerSm;
  if (base <= 0 || base >= slots) return shape;
  long long best_cost = -1;
  for (int s = 1; s <= max_tiles && s <= slots; ++s) {
    const long long waves = (base * s + slots - 1) / slots;
    const long long cost = waves * ((max_tiles + s - 1) / s + kSplitOverheadTiles);
    if (best_cost < 0 || cost < best_cost) {
      best_cost = cost;
      shape.num_splits = s;
    }
  }
  return shape;
}

Status check_problem(const MlaAttentionProblem& problem) {
  if (problem.kv_lora_rank != mla::kKvLoraRank || problem.qk_rope_head_dim != mla::kQkRopeHeadDim) {
    return unsupported(kWhere,
                       "MLA shape kv_lora_rank=" + std::to_string(problem.kv_lora_rank) +
                           ", qk_rope_head_dim=" + std::to_string(problem.qk_rope_head_dim) +
                           " (the CUDA kernels support 512 + 64 only)");
  }
  if (problem.num_heads < 1 || problem.num_heads > 128) {
    return unsupported(kWhere, "num_heads=" + std::to_string(problem.num_heads) +
                                   " (the CUDA kernels support 1..128)");
  }
  if (problem.page_size < 1) {
    return unsupported(kWhere, "page_size=" + std::to_string(problem.page_size));
  }
  if (problem.num_slots < 0 || problem.num_slots > static_cast<std::int64_t>(0x7FFFFFFF)) {
    return unsupported(kWhere, "num_slots=" + std::to_string(problem.num_slots) +
                                   " (slots are 32-bit in the CUDA kernels)");
  }
  if (problem.batch < 0 || problem.num_rows < 0 || problem.max_kv_len < 0) {
    return unsupported(kWhere, "negative batch, num_rows or max_kv_len");
  }
  return ok_status();
}

float score_scale_of(const MlaAttentionProblem& problem) {
  if (problem.score_scale != 0.f) return problem.score_scale;
  return static_cast<float>(static_cast<double>(problem.sm_scale) *
                            static_cast<double>(problem.kv_scale) * mla::kLog2e);
}

// ---- launches ----------------------------------------------------------------------------------

// The merge as a programmatic dependent of the attention kernel (cudaLaunchKernelEx with
// programmatic stream serialization, sm_90): it launches once every attention block has started
// (each signals griddepcontrol.launch_dependents first), takes only what they leave free of the
// SMs, and waits for their writes (griddepcontrol.wait) before reading the partials. Few splits:
// mla_merge_kernel<NarrowMerge>; from kWideMergeMinSplits on, mla_merge_window_kernel<WideMerge>;
// from kLongMergeMinSplits on, mla_merge_window_kernel<LongMerge> (a window of 8 splits a thread).
// grid: Shape::kDimChunks blocks of Shape::kThreads per (row, head); dynamic shared memory: one
// float per split.
template <typename Shape, typename Kernel>
Status launch_merge_grid(Kernel kernel, const detail::MlaMergeParams& params, long long row_heads,
                         cudaStream_t stream) {
  cudaLaunchAttribute dependency{};
  dependency.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  dependency.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(row_heads * Shape::kDimChunks));
  config.blockDim = dim3(static_cast<unsigned>(Shape::kThreads));
  config.dynamicSmemBytes = static_cast<std::size_t>(params.num_splits) * sizeof(float);
  config.stream = stream;
  config.attrs = &dependency;
  config.numAttrs = 1;
  return cuda_status(cudaLaunchKernelEx(&config, kernel, params), "mla_merge_kernel launch");
}

Status launch_merge_kernel(const detail::MlaAttentionParams& attention, cudaStream_t stream) {
  detail::MlaMergeParams params{};
  params.partial_out = attention.partial_out;
  params.partial_lse = attention.partial_lse;
  params.out = attention.out;
  params.lse = attention.lse;
  params.num_heads = attention.num_heads;
  params.num_splits = attention.num_splits;
  params.kv_scale = attention.kv_scale;
  const long long row_heads = static_cast<long long>(attention.num_rows) * attention.num_heads;
  using detail::LongMerge, detail::WideMerge, detail::NarrowMerge;
  if (params.num_splits >= detail::kLongMergeMinSplits) {
    return launch_merge_grid<LongMerge>(detail::mla_merge_window_kernel<LongMerge>, params,
                                        row_heads, stream);
  }
  if (params.num_splits >= detail::kWideMergeMinSplits) {
    return launch_merge_grid<WideMerge>(detail::mla_merge_window_kernel<WideMerge>, params,
                                        row_heads, stream);
  }
  return launch_merge_grid<NarrowMerge>(detail::mla_merge_kernel<NarrowMerge>, params, row_heads,
                                        stream);
}

std::size_t partial_rows(const MlaAttentionProblem& problem, const LaunchShape& shape) {
  return static_cast<std::size_t>(problem.num_rows) * static_cast<std::size_t>(shape.num_splits) *
         static_cast<std::size_t>(problem.num_heads);
}

detail::MlaAttentionParams attention_params(const MlaAttentionProblem& problem,
                                            const LaunchShape& shape) {
  detail::MlaAttentionParams params{};
  params.qo_indptr = problem.qo_indptr;
  params.kv_indptr = problem.kv_indptr;
  params.kv_indices = problem.kv_indices;
  params.kv_last_page_len = problem.kv_last_page_len;
  params.batch = problem.batch;
  params.num_rows = problem.num_rows;
  params.num_heads = problem.num_heads;
  params.page_size = problem.page_size;
  params.num_splits = shape.num_splits;
  params.head_blocks = shape.head_blocks;
  params.rows_per_block = shape.rows_per_block;
  params.block_heads = shape.block_heads;
  params.mark_nan = shape.rows_per_block > 1 && !problem.read_masked_tail ? 1 : 0;
  params.longest_first = shape.longest_first ? 1 : 0;
  params.score_scale = score_scale_of(problem);
  params.kv_scale = problem.kv_scale;
  params.pool = static_cast<const std::uint8_t*>(problem.pool);
  params.q_nope = problem.q_nope;
  params.q_pe = problem.q_pe;
  params.out = problem.out;
  params.lse = problem.lse;
  return params;
}

void plan_rows_on_host(const MlaAttentionProblem& problem, detail::MlaAttentionParams& params) {
  params.planned_rows = 0;
  if (!host_plan_applies(problem)) return;
  for (int row = 0; row < problem.num_rows; ++row) {
    detail::PlannedRow& planned = params.planned[row];
    planned.range = detail::row_range(problem.host_qo_indptr, problem.host_kv_indptr,
                                      problem.host_kv_last_page_len, problem.batch,
                                      problem.page_size, problem.read_masked_tail, row);
    planned.request_row_end = problem.host_qo_indptr[planned.range.request + 1];
  }
  params.planned_rows = problem.num_rows;
}

// Split-KV: the partial (out, lse) live in the caller's workspace, [rows, splits, H, Dc] fp32
// then [rows, splits, H] fp32.
Status assign_workspace(const MlaAttentionProblem& problem, const LaunchShape& shape,
                        void* workspace, std::size_t workspace_bytes,
                        detail::MlaAttentionParams& params) {
  const std::size_t needed = mla_attention_workspace_bytes(problem);
  if (workspace == nullptr || workspace_bytes < needed) {
    return internal_error(kWhere, "workspace of " + std::to_string(workspace_bytes) +
                                      " bytes, need " + std::to_string(needed));
  }
  params.partial_out = static_cast<float*>(workspace);
  params.partial_lse = params.partial_out + partial_rows(problem, shape) * mla::kKvLoraRank;
  return ok_status();
}

}  // namespace

TensorCorePath mla_attention_64_row_path(MmaChoice mma) {
  return four_tile_mma_path(mma)() == detail::MmaPath::kWgmma ? TensorCorePath::kWgmma
                                                              : TensorCorePath::kMmaSync;
}

Decode16Kernel mla_attention_decode16_kernel(const MlaAttentionProblem& problem) {
  if (!check_problem(problem).ok()) return Decode16Kernel::kNone;
  const LaunchShape shape = launch_shape(problem);
  if (shape.m_tiles != 1) return Decode16Kernel::kNone;
  return decode16_kernel(shape, max_kv_tiles(problem), problem.variant.decode16);
}

bool mla_attention_host_planned(const MlaAttentionProblem& problem) {
  return check_problem(problem).ok() && host_plan_applies(problem);
}

bool mla_attention_longest_first(const MlaAttentionProblem& problem) {
  return check_problem(problem).ok() && launch_shape(problem).longest_first;
}

std::size_t mla_attention_workspace_bytes(const MlaAttentionProblem& problem) {
  if (!check_problem(problem).ok()) return 0;
  const LaunchShape shape = launch_shape(problem);
  if (shape.num_splits <= 1) return 0;
  return partial_rows(problem, shape) * (mla::kKvLoraRank + 1) * sizeof(float);
}

Status launch_mla_attention(const MlaAttentionProblem& problem, void* workspace,
                            std::size_t workspace_bytes, cudaStream_t stream) {
  KVAUDIT_TRY(check_problem(problem));
  if (problem.num_rows == 0 || problem.batch == 0) return ok_status();
  const LaunchShape shape = launch_shape(problem);
  detail::MlaAttentionParams params = attention_params(problem, shape);
  plan_rows_on_host(problem, params);
  if (shape.num_splits > 1) {
    KVAUDIT_TRY(assign_workspace(problem, shape, workspace, workspace_bytes, params));
  }
  const long long blocks =
      static_cast<long long>(shape.row_groups) * shape.head_blocks * shape.num_splits;
  if (blocks > 0x7FFFFFFFLL) {
    return unsupported(kWhere, "grid of " + std::to_string(blocks) + " blocks");
  }
  const Decode16Kernel decode16 =
      decode16_kernel(shape, max_kv_tiles(problem), problem.variant.decode16);
  const FourTilePath four_tile_path = four_tile_mma_path(problem.variant.mma);
  if (problem.read_masked_tail) {
    // Fault masked-nan-leak: its own kernel instantiations, in kernels/mla_attention_faults.cu.
    KVAUDIT_TRY(launch_masked_nan_leak_attention(problem.pool_element, shape.m_tiles, params,
                                                 blocks, decode16, four_tile_path, stream));
  } else {
    KVAUDIT_TRY(launch_attention_blocks<detail::AttentionFault::kNone>(
        problem.pool_element, shape.m_tiles, params, blocks, decode16, four_tile_path, stream));
  }
  if (shape.num_splits > 1) KVAUDIT_TRY(launch_merge_kernel(params, stream));
  return ok_status();
}

Status launch_kv_write(const std::uint16_t* new_kv, const std::int32_t* new_kv_slots, int num_rows,
                       int row_width, float kv_scale, PoolElement pool_element, void* pool,
                       cudaStream_t stream) {
  if (num_rows <= 0 || row_width <= 0) return ok_status();
  const long long blocks =
      elementwise_blocks(static_cast<long long>(num_rows) * row_width, kMaxWriteBlocks);
  if (pool_element == PoolElement::kFp8E4m3) {
    const detail::KvWriteParams<std::uint8_t> params{
        new_kv, new_kv_slots, num_rows, row_width, kv_scale, static_cast<std::uint8_t*>(pool), 0,
        0};
    detail::kv_write_fp8_kernel<KvWriteRule::kDivide, false>
        <<<static_cast<unsigned>(blocks), kElementwiseThreads, 0, stream>>>(params);
  } else {
    const detail::KvWriteParams<std::uint16_t> params{
        new_kv, new_kv_slots, num_rows, row_width, kv_scale, static_cast<std::uint16_t*>(pool), 0,
        0};
    detail::kv_write_bf16_kernel<<<static_cast<unsigned>(blocks), kElementwiseThreads, 0, stream>>>(
        params);
  }
  return cuda_status(cudaGetLastError(), "kv_write kernel launch");
}

Status launch_cast_pool_to_bf16(const std::uint8_t* pool, std::int64_t num_elements,
                                std::uint16_t* pool_bf16, cudaStream_t stream) {
  if (num_elements <= 0) return ok_status();
  // + 1: at least one block, also for a pool of fewer than 4 elements (the tail loop only).
  const long long blocks = std::min<long long>(
      (num_elements / 4 + kElementwiseThreads - 1) / kElementwiseThreads + 1, kMaxCastBlocks);
  const detail::CastPoolParams params{pool, num_elements, pool_bf16};
  detail::cast_pool_kernel<<<static_cast<unsigned>(blocks), kElementwiseThreads, 0, stream>>>(
      params);
  return cuda_status(cudaGetLastError(), "cast_pool kernel launch");
}

}  // namespace kvaudit::cuda
