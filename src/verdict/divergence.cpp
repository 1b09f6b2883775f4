// The first divergence and the kernel's reference (see divergence.hpp). Operands per (row, head):
// out [Dc] at (row * H + head) * Dc, lse at row * H + head.
#include "src/verdict/divergence.hpp"

#include <cmath>

namespace kvaudit {
namespace {

// Whether one (row, head) breaks the limits on its own (first_divergent_row_head).
class RowHeadLimits {
 public:
  RowHeadLimits(const ComparisonLimits& limits, double reference_max_abs)
      : limits_(limits), reference_max_abs_(reference_max_abs) {}

  bool out_breaks(std::span<const double> reference, std::span<const double> candidate) const {
    double diff_sq = 0.0;
    double ref_sq = 0.0;
    for (std::size_t d = 0; d < reference.size(); ++d) {
      const double a = reference[d];
      const double b = candidate[d];
      if (std::isfinite(a) != std::isfinite(b)) return true;
      if (!std::isfinite(a)) continue;
      if (exceeds(limits_.max_abs_over_ref_max,
                  over_reference_max(std::abs(a - b), reference_max_abs_))) {
        return true;
      }
      diff_sq += (a - b) * (a - b);
      ref_sq += a * a;
    }
    return ref_sq > 0.0 && exceeds(limits_.rel_l2, std::sqrt(diff_sq / ref_sq));
  }

  bool lse_breaks(double a, double b) const {
    if (std::isfinite(a) != std::isfinite(b)) return true;
    return std::isfinite(a) && exceeds(limits_.lse_max_abs, std::abs(a - b));
  }

 private:
  static bool exceeds(const std::optional<double>& limit, double value) {
    return limit && value > *limit;
  }

  const ComparisonLimits& limits_;
  double reference_max_abs_;
};

}  // namespace

RowHead first_divergent_row_head(const TensorShape3& shape, const ComparisonOperands& operands,
                                 const ComparisonMetrics& metrics, const ComparisonLimits& limits) {
  const RowHeadLimits row_head_limits(limits, metrics.reference_max_abs);
  const OutputView& reference = operands.reference;
  const OutputView& candidate = operands.candidate;
  const bool has_lse = !reference.lse.empty() && !candidate.lse.empty();
  const auto dims = static_cast<std::size_t>(shape.dims);
  for (int row = 0; row < shape.rows; ++row) {
    for (int head = 0; head < shape.heads; ++head) {
      const std::size_t index = static_cast<std::size_t>(row) * shape.heads + head;
      if (row_head_limits.out_breaks(reference.out.subspan(index * dims, dims),
                                     candidate.out.subspan(index * dims, dims))) {
        return {row, head};
      }
      if (has_lse && row_head_limits.lse_breaks(reference.lse[index], candidate.lse[index])) {
        return {row, head};
      }
    }
  }
  const ElementLocation& at =
      metrics.nonfinite_mismatches > 0 ? metrics.first_nonfinite_mismatch : metrics.max_abs_at;
  return {at.row, at.head};
}

bool follows_divergence(Comparison comparison) {
  switch (comparison) {
    case Comparison::kKernel:
    case Comparison::kCache:
    case Comparison::kCaptured:
      return true;
    case Comparison::kQuantization:
    case Comparison::kTotal:
    case Comparison::kCapturedRead:  // report-only: they attribute a captured failure
    case Comparison::kCapturedCache:
      return false;
  }
  return false;
}

DivergencePoint locate_divergence(const ComparisonSite& site, const TensorShape3& shape,
                                  const ComparisonOperands& operands,
                                  const ComparisonMetrics& metrics,
                                  const ComparisonLimits& limits) {
  const RowHead at = first_divergent_row_head(shape, operands, metrics, limits);
  DivergencePoint point;
  point.row = at.row;
  point.head = at.head;
  point.request =
      at.row >= 0 && at.row < site.step.num_rows() ? site.step.request_of_row(at.row) : -1;
  return point;
}

bool DivergenceTracker::takes_over(int step, std::size_t layer_order, Comparison comparison) const {
  const bool earlier =
      !first_ || step < first_->step || (step == first_->step && layer_order < layer_order_);
  const bool replaces_captured = first_ && first_->step == step && layer_order == layer_order_ &&
                                 first_->comparison == Comparison::kCaptured &&
                                 comparison != Comparison::kCaptured;
  return earlier || replaces_captured;
}

void DivergenceTracker::take(int step, int layer_id, std::size_t layer_order,
                             const ComparisonResult& result, const DivergencePoint& at) {
  Divergence divergence;
  divergence.step = step;
  divergence.layer_id = layer_id;
  divergence.row = at.row;
  divergence.head = at.head;
  divergence.request = at.request;
  divergence.comparison = result.comparison;
  divergence.reason = result.judgement.reasons.empty() ? "" : result.judgement.reasons.front();
  first_ = std::move(divergence);
  layer_order_ = layer_order;
}

void DivergenceTracker::consider(const ComparisonSite& site, const ComparisonResult& result,
                                 const TensorShape3& shape, const ComparisonOperands& operands,
                                 const ComparisonLimits& limits) {
  if (!follows_divergence(result.comparison) || result.judgement.pass) return;
  if (!takes_over(site.step_index, site.layer_order, result.comparison)) return;
  take(site.step_index, site.layer_id, site.layer_order, result,
       locate_divergence(site, shape, operands, result.metrics, limits));
}

bool DivergenceTracker::consider(std::size_t layer_order, const ComparisonResult& result) {
  if (!follows_divergence(result.comparison) || result.judgement.pass) return true;
  if (!result.divergence) return false;
  if (takes_over(result.step, layer_order, result.comparison)) {
    take(result.step, result.layer_id, layer_order, result, *result.divergence);
  }
  return true;
}

KernelReferenceChoice choose_kernel_reference(const Policy& policy, const TensorShape3& shape,
                                              const OutputView& backend,
                                              const OutputView& pool_read,
                                              const OutputView& reference_pool,
                                              const std::string& where) {
  auto passes_against = [&](const OutputView& reference) {
    const ComparisonMetrics metrics = compare_outputs(shape, reference.out, backend.out,
                                                      reference.lse, backend.lse, policy.rel_floor);
    return judge(policy, Comparison::kKernel, metrics).pass;
  };
  KernelReferenceChoice choice;
  if (passes_against(pool_read) || !passes_against(reference_pool)) return choice;
  choice.reference = KernelReference::kReferencePool;
  choice.note = where +
                ": the backend's output matches attention on the reference pool, not on its own "
                "pool after the step: it read the step's tokens before (or without) the writes "
                "that damaged its pool; kernel error is measured against R8 there";
  return choice;
}

}  // namespace kvaudit
