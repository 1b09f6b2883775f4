// Where a run first leaves the reference (docs/design.md "Numerics"), and which reference the
// kernel is judged against.
//
// Operands, for one (step, layer, comparison): out [Nq, H, Dc] and lse [Nq, H] of a reference and
// a candidate, widened to double, rows step-global (the rows of q_nope). The replay computes them
// and hands them over; the decisions are made here and in policy.cpp:
//   * the first divergence: the earliest failing step, then layer in dump order, then the first
//     (row, head) in row-major order whose error breaks the policy on its own (the worst element's
//     when no single row does). Followed on the comparisons that judge the implementation under
//     test: kernel (what it computed) and cache (what it stored) with a backend, captured without.
//   * the kernel's reference: R8' (attention on the pool the backend read, its own pool after its
//     writes) unless the backend fails against R8' and passes against R8, the reference pool: it
//     then read the step's tokens before (or without) its damaging writes, and is judged on R8.
#pragma once

#include <cstddef>
#include <optional>
#include <span>
#include <string>

#include "src/format/kvdump.hpp"
#include "src/verdict/check_result.hpp"
#include "src/verdict/metrics.hpp"
#include "src/verdict/policy.hpp"

namespace kvaudit {

// One attention result: out [Nq, H, Dc] (or empty, an lse-only capture) and lse [Nq, H] (or
// empty, not compared).
struct OutputView {
  std::span<const double> out;
  std::span<const double> lse;
};

struct ComparisonOperands {
  OutputView reference;
  OutputView candidate;
};

// Where a comparison was made: the step (its rows name their requests), its index, the layer id
// and the layer's position in dump order (which layer comes first at a step).
struct ComparisonSite {
  const StepMeta& step;
  int step_index = 0;
  int layer_id = 0;
  std::size_t layer_order = 0;
};

struct RowHead {
  int row = -1;  // step-global query row
  int head = -1;
};

// First (row, head), row-major, that on its own breaks `limits`: a NaN/Inf where the reference is
// finite (or the reverse), an element whose |error| / max|reference| is past
// max_abs_over_ref_max, a [Dc] vector whose relative L2 error is past rel_l2, or an lse past
// lse_max_abs. The worst element's (row, head) when no single one does (the failure is then in
// the aggregate).
RowHead first_divergent_row_head(const TensorShape3& shape, const ComparisonOperands& operands,
                                 const ComparisonMetrics& metrics, const ComparisonLimits& limits);

// Whether a comparison's failures can be the run's first divergence: kernel, cache, captured.
bool follows_divergence(Comparison comparison);

// Where a failing comparison at `site` first leaves its reference: first_divergent_row_head and
// the request of that row (-1 where the row is not in the step).
DivergencePoint locate_divergence(const ComparisonSite& site, const TensorShape3& shape,
                                  const ComparisonOperands& operands,
                                  const ComparisonMetrics& metrics, const ComparisonLimits& limits);

// The first divergence of a run, kept while the comparisons are judged in replay order (or, in
// `kvaudit merge`, in the merged run's order, which is the same).
class DivergenceTracker {
 public:
  // A failing, followed comparison becomes the first divergence when it is at an earlier step, or
  // an earlier layer of the same step, than the current one; or at the same (step, layer) when the
  // current one is a captured comparison and this one is not (the backend is what is under test).
  // Locates the divergence in the operands (locate_divergence) when it does.
  void consider(const ComparisonSite& site, const ComparisonResult& result,
                const TensorShape3& shape, const ComparisonOperands& operands,
                const ComparisonLimits& limits);
  // The same rule on a result whose divergence point is already known (result.divergence, set on
  // every failing followed comparison by judge_comparison); `layer_order` is its layer's position
  // in dump order. Returns false when the result fails, is followed and has no point.
  bool consider(std::size_t layer_order, const ComparisonResult& result);
  const std::optional<Divergence>& first() const { return first_; }

 private:
  bool takes_over(int step, std::size_t layer_order, Comparison comparison) const;
  void take(int step, int layer_id, std::size_t layer_order, const ComparisonResult& result,
            const DivergencePoint& at);

  std::optional<Divergence> first_;
  std::size_t layer_order_ = 0;  // of first_
};

enum class KernelReference {
  kPoolRead,       // R8': the pool the backend read, its own pool after its writes
  kReferencePool,  // R8: the reference replay's pool
};

struct KernelReferenceChoice {
  KernelReference reference = KernelReference::kPoolRead;
  std::string note;  // for the run's notes, when judged against R8; else empty
};

// Which reference the backend's output is judged against when the pool it read differs from the
// reference pool (header comment). `where` ("S001 L003") starts the note.
KernelReferenceChoice choose_kernel_reference(const Policy& policy, const TensorShape3& shape,
                                              const OutputView& backend,
                                              const OutputView& pool_read,
                                              const OutputView& reference_pool,
                                              const std::string& where);

}  // namespace kvaudit
