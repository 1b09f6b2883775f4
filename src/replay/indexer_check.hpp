// Integrity of the DSA indexer's FP8 key cache of a kvdump v1.2 dump (docs/kvdump-v1.md
// "Version 1.2", docs/indexer-fp8.md), judged by `kvaudit check`.
//
// This is an implementation independent of the Python writer and judge
// (python/kvdump/indexer_fp8.py), written from the rule in docs/indexer-fp8.md, as the main pool's
// integrity check (src/replay/integrity.hpp) is independent of kvdump's writer: the two agree on
// a dump only where both follow the documented rule.
//
// Shapes: Di = index_head_dim, Hi = index_n_heads, B = index_block_size, G = Di / B, K =
// index_topk, S = num_slots, Nq = rows of a step. Cache: codes [S, Di] e4m3, scales [S, G]
// float32. Per step: q [Nq, Hi, Di], w [Nq, Hi], new_k [Nq, Di], topk_indices [Nq, K].
//
// The deployed write rule of one row x [Di] (a key row, or one head of a query row):
//   y     = bf16(fp32(Had_Di . bf16(x)) * fp32(Di^-0.5))   rotation "hadamard": Sylvester's
//                                                          Hadamard (H_2n = [[H, H], [H, -H]]),
//                                                          the +-1 sums in binary64 (exact for
//                                                          bf16 inputs), rounded once to fp32;
//           bf16(x)                                        rotation "none"
//   a_g   = max(max_{j in block g} |y_j|, fp32(1e-4))      one per block of B values; NaN
//                                                          propagates (torch's amax, clamp)
//   s_g   = fp32(a_g * fp32(1/448))                        scale format "float32";
//           2^ceil(log2 s_g), from s_g's float32 bits      scale format "power_of_two"
//   c_j   = e4m3_rne_satfinite(fp32(y_j / s_g))            one code per value
// Deployed score of token t for a query row (q_h [Di] per head, w_h its head weight, sm =
// index_softmax_scale), binary64 on the dequantized values (code x scale, exact in binary64):
//   score(t) = sum_h w_h * relu(sm * deq(q_h) . deq(k_t))
// (equal to the deployed fp8_index's k_scale * sum_h relu(q_fp8 . k_fp8) * w_h * q_scale * sm,
// every scale being positive).
//
// Checks per (step, layer), exact (bytewise) for the writes:
//   indexer_written_slots    (where the step captured k_cache_after / k_scales_after) each slot
//                            of new_kv_slots holds the rule's codes of its new_k row and the
//                            rule's float32 scale bits;
//   indexer_unwritten_slots  (likewise) every other slot holds the bytes it held before the step
//                            (the layer's k_cache, then each captured cache after);
//   indexer_topk             each row's stored topk_indices (positions of its request, -1
//                            padding) is a top-k of the deployed scores over the positions it
//                            sees (0 .. its own, after the step's writes): k = min(K, visible)
//                            distinct visible positions, all of them hits by the tie rule below
//                            (an entry below -1 is no padding: a failure of its own);
//   indexer_nonfinite        (only where found) a non-finite value in the step's q, w or new_k,
//                            or a NaN code / non-finite scale in a slot the rows read; slots
//                            written from a non-finite new_k row are left out of
//                            indexer_written_slots (docs/indexer-fp8.md "Non-finite values").
// Scores rank as torch.topk ranks them: NaN above every number, NaNs tied with each other.
// Tie rule (any valid tie-break is accepted): with v the k-th largest score, a pick scoring above
// v is a hit, and picks tied with v share the k - #{scores above v} places left. "Tied" allows
// the rounding of two binary64 evaluations of the score (this one and the writer's, whose order
// of summation may differ): |s - v| <= tie_tolerance(t) + tie_tolerance(k-th), with
// tie_tolerance(t) = 2 (Hi + 2) 2^-53 sum_h |w_h| sm relu(deq(q_h) . deq(k_t)) (the dot products
// of e4m3 values times power-of-two scales are exact in binary64; the rest is Hi + 2 roundings).
// After a step with a captured cache, later steps read that captured cache (as a server would).
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "src/core/result.hpp"
#include "src/format/kvdump.hpp"
#include "src/verdict/check_result.hpp"

namespace kvaudit {

// y [Di] = the rotated row of x [Di] by `rotation` (the first line of the rule above).
std::vector<float> indexer_rotate(std::span<const float> x, IndexRotation rotation);

// The rule's codes [Di] and scales [G] of one row x [Di].
struct IndexerRow {
  std::vector<std::uint8_t> codes;
  std::vector<float> scales;
};
IndexerRow indexer_quantize_row(std::span<const float> x, const IndexerMeta& meta);

// The tie rule above: whether `picks` (positions into `scores`, -1 padding dropped; any other
// negative entry is not valid) is a top-k of
// scores [visible] for k = min(topk, visible), each score with its tie tolerance. When it is not,
// `why` says how (the first offending pick).
bool is_valid_topk(std::span<const std::int64_t> picks, std::span<const double> scores,
                   std::span<const double> tolerances, int topk, std::string* why);

// The indexer checks of one layer over every step of the dump, as integrity findings of the
// checks indexer_written_slots, indexer_unwritten_slots and indexer_topk (one each per reported
// step, passing or failing; the first two only where the step captured the cache after it), and
// indexer_nonfinite where a step has a non-finite value. An error for a "hadamard" rotation of a
// head dim that is not a power of two (the reader refuses such a dump).
// `reported_steps`: the steps to report (empty: all); every step is replayed. Reads the dump, so it
// must not run beside another thread reading it (Debian's HDF5 is not thread-safe).
Result<std::vector<IntegrityFinding>> check_indexer_layer(const DumpReader& reader,
                                                          std::size_t layer_index,
                                                          const std::set<int>& reported_steps,
                                                          int threads);

}  // namespace kvaudit
