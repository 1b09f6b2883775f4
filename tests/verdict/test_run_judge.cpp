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

}  // namespace kvaudit
