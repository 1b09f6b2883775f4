// The run judge on hand-built operands: 3 rows (request 0: row 0, request 1: rows 1-2), 2 heads,
// 4 dims, a reference of all ones; every expected number is written out.
#include <catch2/catch.hpp>
#include <vector>

#include "src/verdict/run_judge.hpp"

namespace kvaudit {
namespace {

constexpr TensorShape3 kShape{3, 2, 4};

StepMeta two_requests() {
  StepMeta step;
  step.qo_indptr = {0, 1, 3};
  step.kv_indptr = {0, 1, 2};
  step.kv_indices = {0, 1};
  step.kv_last_page_len = {1, 2};
  step.new_kv_slots = {0, 1, 2};
  return step;
}

}  // namespace

TEST_CASE("the run judge measures, judges and records each comparison", "[run_judge]") {
  const StepMeta step = two_requests();
  const std::vector<double> reference_out(24, 1.0);
  const std::vector<double> lse(6, 0.5);
  std::vector<double> candidate_out = reference_out;
  candidate_out[(2 * 2 + 0) * 4 + 3] += 0.25;  // max_abs 0.25 at row 2 (request 1), head 0
  const ComparisonSite site{step, 4, 6, 0};
  const ComparisonOperands operands{{reference_out, lse}, {candidate_out, lse}};

  const ComparisonResult kernel =
      judge_comparison(default_policy(), site, Comparison::kKernel, kShape, operands);
  CHECK(kernel.step == 4);
  CHECK(kernel.layer_id == 6);
  CHECK(kernel.metrics.max_abs == 0.25);
  CHECK_FALSE(kernel.judgement.pass);
  CHECK(kernel.sets_exit);
  CHECK(kernel.worst_request == 1);
  // The same error is within the quantization limits, which are report-only by default.
  const ComparisonResult quantization =
      judge_comparison(default_policy(), site, Comparison::kQuantization, kShape, operands);
  CHECK(quantization.judgement.pass);
  CHECK_FALSE(quantization.sets_exit);

  CheckRun run;
  run.policy = default_policy();
  RunJudge judge(run);
  judge.compare(site, Comparison::kQuantization, kShape, operands);
  CHECK_FALSE(run.first_divergence);
  judge.compare(site, Comparison::kKernel, kShape, operands);
  REQUIRE(run.comparisons.size() == 2);
  CHECK(run.comparisons[1].comparison == Comparison::kKernel);
  REQUIRE(run.first_divergence);
  CHECK(run.first_divergence->step == 4);
  CHECK(run.first_divergence->row == 2);
  CHECK(run.first_divergence->head == 0);
  CHECK(run.first_divergence->request == 1);
  CHECK(run.first_divergence->reason == "max_abs/ref_max 0.25 > 0.00781 (kernel limit)");
}

TEST_CASE("the run judge locates every failing followed comparison, for a merge", "[run_judge]") {
  const StepMeta step = two_requests();
  const std::vector<double> reference_out(24, 1.0);
  const std::vector<double> lse(6, 0.5);
  std::vector<double> candidate_out = reference_out;
  candidate_out[(1 * 2 + 1) * 4 + 0] += 0.5;  // row 1 (request 1), head 1
  const ComparisonSite site{step, 2, 9, 1};
  const ComparisonOperands operands{{reference_out, lse}, {candidate_out, lse}};

  const ComparisonResult kernel =
      judge_comparison(default_policy(), site, Comparison::kKernel, kShape, operands);
  REQUIRE(kernel.divergence);
  CHECK(kernel.divergence->row == 1);
  CHECK(kernel.divergence->head == 1);
  CHECK(kernel.divergence->request == 1);
  // Not followed (sign-off comparisons), or passing: no point.
  const ComparisonResult total =
      judge_comparison(signoff_policy(), site, Comparison::kTotal, kShape, operands);
  CHECK_FALSE(total.judgement.pass);
  CHECK_FALSE(total.divergence);
  const ComparisonResult clean =
      judge_comparison(default_policy(), site, Comparison::kKernel, kShape,
                       {{reference_out, lse}, {reference_out, lse}});
  CHECK_FALSE(clean.divergence);

  // The tracker on located results (as kvaudit merge runs it) keeps the same first divergence.
  DivergenceTracker tracker;
  CHECK(tracker.consider(0, clean));
  CHECK(tracker.consider(1, kernel));
  REQUIRE(tracker.first());
  CHECK(tracker.first()->step == 2);
  CHECK(tracker.first()->layer_id == 9);
  CHECK(tracker.first()->row == 1);
  CHECK(tracker.first()->head == 1);
  CHECK(tracker.first()->request == 1);
  ComparisonResult unlocated = kernel;
  unlocated.divergence.reset();
  CHECK_FALSE(tracker.consider(0, unlocated));
}

}  // namespace kvaudit
