// The first-divergence search, its bookkeeping across a run, and the choice between R8 and R8'
// as the kernel's reference, on hand-built operands: 3 rows, 2 heads, 4 dims, a reference of all
// ones (so max|reference| = 1 and the kernel's absolute limit is 2^-7 = 0.0078125).
#include <catch2/catch.hpp>
#include <cmath>
#include <vector>

#include "src/verdict/divergence.hpp"

namespace kvaudit {
namespace {

constexpr TensorShape3 kShape{3, 2, 4};

struct Outputs {
  std::vector<double> out = std::vector<double>(24, 1.0);
  std::vector<double> lse = std::vector<double>(6, 0.5);
  OutputView view() const { return {out, lse}; }
  double& at(int row, int head, int dim) { return out[(row * 2 + head) * 4 + dim]; }
};

// Rows 0 | 1 2: request 0 has one row, request 1 two.
StepMeta two_requests() {
  StepMeta step;
  step.qo_indptr = {0, 1, 3};
  step.kv_indptr = {0, 1, 2};
  step.kv_indices = {0, 1};
  step.kv_last_page_len = {1, 2};
  step.new_kv_slots = {0, 1, 2};
  return step;
}

ComparisonMetrics unit_reference_metrics() {
  ComparisonMetrics metrics;
  metrics.reference_max_abs = 1.0;
  metrics.max_abs_at = {2, 0, 1, 1.0, 1.001};
  return metrics;
}

RowHead search(const Outputs& reference, const Outputs& candidate,
               const ComparisonMetrics& metrics = unit_reference_metrics()) {
  return first_divergent_row_head(kShape, {reference.view(), candidate.view()}, metrics,
                                  default_policy().kernel);
}

ComparisonResult failing(int step, int layer_id, Comparison comparison, const char* reason) {
  ComparisonResult result;
  result.step = step;
  result.layer_id = layer_id;
  result.comparison = comparison;
  result.judgement.pass = false;
  result.judgement.reasons = {reason};
  result.metrics = unit_reference_metrics();
  return result;
}

}  // namespace

TEST_CASE("first divergent (row, head): the first one past a limit on its own", "[divergence]") {
  const Outputs reference;
  SECTION("an element past max_abs_over_ref_max, after one that is not") {
    Outputs candidate;
    candidate.at(0, 0, 1) += 0.001;  // below 2^-7, and its head's rel_l2 0.0005 below 2^-8
    candidate.at(1, 1, 2) += 0.01;
    const RowHead at = search(reference, candidate);
    CHECK(at.row == 1);
    CHECK(at.head == 1);
  }
  SECTION("a NaN where the reference is finite") {
    Outputs candidate;
    candidate.at(1, 1, 2) += 0.01;
    candidate.at(0, 1, 3) = std::nan("");
    const RowHead at = search(reference, candidate);
    CHECK(at.row == 0);
    CHECK(at.head == 1);
  }
  SECTION("a head whose relative L2 error is past rel_l2, no element past the absolute limit") {
    Outputs candidate;
    for (int d = 0; d < 4; ++d) candidate.at(2, 1, d) += 0.006;  // rel_l2 0.006 > 2^-8
    const RowHead at = search(reference, candidate);
    CHECK(at.row == 2);
    CHECK(at.head == 1);
  }
  SECTION("an lse past lse_max_abs") {
    Outputs candidate;
    candidate.lse[1 * 2 + 0] += 0.002;  // > 2^-10
    const RowHead at = search(reference, candidate);
    CHECK(at.row == 1);
    CHECK(at.head == 0);
  }
  SECTION("no single (row, head) breaks a limit: the worst element's") {
    Outputs candidate;
    candidate.at(2, 0, 1) += 0.001;
    const RowHead at = search(reference, candidate);
    CHECK(at.row == 2);
    CHECK(at.head == 0);
  }
  SECTION("an all-zero reference: any error is past the absolute limit") {
    Outputs zeros;
    std::fill(zeros.out.begin(), zeros.out.end(), 0.0);
    Outputs candidate = zeros;
    candidate.at(1, 0, 3) = 1e-9;
    ComparisonMetrics metrics = unit_reference_metrics();
    metrics.reference_max_abs = 0.0;
    const RowHead at = search(zeros, candidate, metrics);
    CHECK(at.row == 1);
    CHECK(at.head == 0);
  }
}

TEST_CASE("the first divergence: earliest step, then layer - kernel before captured",
          "[divergence]") {
  const StepMeta step = two_requests();
  const Policy policy = default_policy();
  const Outputs reference;
  Outputs candidate;
  candidate.at(2, 1, 0) += 0.5;  // row 2 (request 1), head 1
  const ComparisonOperands operands{reference.view(), candidate.view()};
  auto at = [&](int step_index, int layer_id, std::size_t order) {
    return ComparisonSite{step, step_index, layer_id, order};
  };

  DivergenceTracker tracker;
  CHECK_FALSE(tracker.first());
  tracker.consider(at(2, 7, 1), failing(2, 7, Comparison::kKernel, "kernel at S2 L7"), kShape,
                   operands, policy.kernel);
  REQUIRE(tracker.first());
  CHECK(tracker.first()->step == 2);
  CHECK(tracker.first()->layer_id == 7);
  CHECK(tracker.first()->row == 2);
  CHECK(tracker.first()->head == 1);
  CHECK(tracker.first()->request == 1);
  CHECK(tracker.first()->comparison == Comparison::kKernel);
  CHECK(tracker.first()->reason == "kernel at S2 L7");

  // Later steps, passing comparisons and the sign-off comparisons do not move it.
  tracker.consider(at(3, 0, 0), failing(3, 0, Comparison::kKernel, "later"), kShape, operands,
                   policy.kernel);
  ComparisonResult passing = failing(1, 0, Comparison::kKernel, "passes");
  passing.judgement.pass = true;
  tracker.consider(at(1, 0, 0), passing, kShape, operands, policy.kernel);
  tracker.consider(at(1, 0, 0), failing(1, 0, Comparison::kQuantization, "quantization"), kShape,
                   operands, policy.quantization);
  CHECK(tracker.first()->reason == "kernel at S2 L7");

  // An earlier layer (in dump order) of the same step does.
  tracker.consider(at(2, 9, 0), failing(2, 9, Comparison::kCache, "cache at S2 L9"), kShape,
                   operands, policy.cache);
  CHECK(tracker.first()->layer_id == 9);
  CHECK(tracker.first()->comparison == Comparison::kCache);

  // A captured divergence gives way to the backend's at the same (step, layer).
  DivergenceTracker captured_first;
  captured_first.consider(at(1, 4, 0), failing(1, 4, Comparison::kCaptured, "captured"), kShape,
                          operands, policy.captured);
  captured_first.consider(at(1, 4, 0), failing(1, 4, Comparison::kKernel, "kernel"), kShape,
                          operands, policy.kernel);
  REQUIRE(captured_first.first());
  CHECK(captured_first.first()->comparison == Comparison::kKernel);
}

TEST_CASE("the kernel is judged against R8 only when it matches R8 and not R8'", "[divergence]") {
  const Policy policy = default_policy();
  const Outputs reference_pool;  // R8: all ones
  Outputs pool_read;             // R8': what the damaged pool gives
  std::fill(pool_read.out.begin(), pool_read.out.end(), 2.0);
  SECTION("output equal to R8: read before its damaging writes; judged against R8, noted") {
    const KernelReferenceChoice choice =
        choose_kernel_reference(policy, kShape, reference_pool.view(), pool_read.view(),
                                reference_pool.view(), "S001 L003");
    CHECK(choice.reference == KernelReference::kReferencePool);
    CHECK(choice.note.rfind("S001 L003: the backend's output matches attention on the reference "
                            "pool, not on its own pool after the step",
                            0) == 0);
  }
  SECTION("output equal to R8': judged against what it read") {
    const KernelReferenceChoice choice = choose_kernel_reference(
        policy, kShape, pool_read.view(), pool_read.view(), reference_pool.view(), "S001 L003");
    CHECK(choice.reference == KernelReference::kPoolRead);
    CHECK(choice.note.empty());
  }
  SECTION("output wrong against both: judged against what it read") {
    Outputs garbage;
    std::fill(garbage.out.begin(), garbage.out.end(), 5.0);
    const KernelReferenceChoice choice = choose_kernel_reference(
        policy, kShape, garbage.view(), pool_read.view(), reference_pool.view(), "S001 L003");
    CHECK(choice.reference == KernelReference::kPoolRead);
    CHECK(choice.note.empty());
  }
}

}  // namespace kvaudit
