// Judging the replay's comparisons into a run (see run_judge.hpp).
#include "src/verdict/run_judge.hpp"

namespace kvaudit {

ComparisonResult judge_comparison(const Policy& policy, const ComparisonSite& site,
                                  Comparison comparison, const TensorShape3& shape,
                                  const ComparisonOperands& operands) {
  ComparisonResult result;
  result.step = site.step_index;
  result.layer_id = site.layer_id;
  result.comparison = comparison;
  result.metrics =
      compare_outputs(shape, operands.reference.out, operands.candidate.out, operands.reference.lse,
                      operands.candidate.lse, policy.rel_floor);
  result.judgement = judge(policy, comparison, result.metrics);
  result.sets_exit = comparison_sets_exit(policy, comparison);
  const int row = worst_location(result).row;
  if (row >= 0 && row < site.step.num_rows()) result.worst_request = site.step.request_of_row(row);
  // Located on every failing followed comparison, not only the one that becomes the first
  // divergence, so that a merge of shards can find the first divergence from the results alone.
  if (!result.judgement.pass && follows_divergence(comparison)) {
    result.divergence =
        locate_divergence(site, shape, operands, result.metrics, limits_for(policy, comparison));
  }
  return result;
}

const ComparisonResult& RunJudge::compare(const ComparisonSite& site, Comparison comparison,
                                          const TensorShape3& shape,
                                          const ComparisonOperands& operands) {
  ComparisonResult result = judge_comparison(run_.policy, site, comparison, shape, operands);
  divergence_.consider(site.layer_order, result);
  run_.first_divergence = divergence_.first();
  run_.comparisons.push_back(std::move(result));
  return run_.comparisons.back();
}

}  // namespace kvaudit
