// The `cpu-fp8` backend: the CPU model of the FP8 MLA attention kernels
// (kernels/mla_attention_cpu_model.hpp states its math and rounding points) adapted to a dump: the
// kvdump write rule (or a write fault) on the backend's KvPool, then attention over the step's
// operands. Tokens a row does not see are never read: NaN codes in masked, unused or past-the-end
// slots cannot reach an output (they are skipped, never multiplied by zero).
//
// Any Dc/Dr is accepted (the CUDA kernels are specialised for 512 + 64; small widths keep tests
// fast). Error against the exact attention on the same pool (R8) is dominated by the two bf16
// roundings (P and out, 2^-8 relative each); tests/backend/test_mla_attention_cpu.cpp derives the
// full bound.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>

#include "kernels/mla_attention_cpu_model.hpp"  // mla_score_scale
#include "src/backend/backend.hpp"
#include "src/backend/injection.hpp"
#include "src/core/result.hpp"
#include "src/format/kvdump.hpp"

namespace kvaudit {

// Fault injections (src/backend/injection.hpp, `--inject NAME`): every entry of that catalogue is
// implemented here, as a branch in write_new_kv (bf16-writeback, round-toward-zero,
// no-saturation, neighbour-slot-write), in the attention (scale-mismatch, fp8-read-as-bf16,
// masked-nan-leak) or in the backend (whole-pool-cast). An unknown name is bad input.
Result<Injection> parse_cpu_injection(std::string_view name);

struct MlaAttentionCpuOptions {
  int threads = 0;  // 0: std::thread::hardware_concurrency()
  Injection injection = Injection::kNone;
};

// The kvdump write rule for a step: row i of new_kv ([Nq, D]) goes to slot new_kv_slots[i] as
// e4m3_rne_satfinite(fp32(v) / kv_scale) (or v * fp32(1 / kv_scale) with reciprocal_scale); a
// bf16 pool stores the bf16 bits of v. No other slot changes.
// `injection` selects a faulty write (the harness's mutation test); kNone is the kvdump rule.
Status write_new_kv(const StepMeta& step, std::span<const float> new_kv, float kv_scale,
                    bool reciprocal_scale, KvPool& pool, Injection injection = Injection::kNone);

// Attention on a pool that already holds the step's writes; the pure function the GPU tests
// compare the CUDA kernels with.
Result<AttentionOutput> mla_attention_cpu(const DumpAttributes& attrs, const StepMeta& step,
                                          float kv_scale, std::span<const float> q_nope,
                                          std::span<const float> q_pe, const KvPool& pool,
                                          const MlaAttentionCpuOptions& options = {});

// The `cpu-fp8` backend: write_new_kv, then mla_attention_cpu.
Result<std::unique_ptr<Backend>> make_cpu_fp8_backend(const BackendOptions& options);

}  // namespace kvaudit
