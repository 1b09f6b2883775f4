// Turns what the replay computed into the run's judged results. For each comparison the replay
// hands over (the operands of src/verdict/divergence.hpp): the metrics (src/verdict/metrics.hpp),
// the policy's judgement (src/verdict/policy.hpp), whether a failure sets the exit status, the
// request of the worst row, and whether it becomes the run's first divergence. The replay decides
// nothing about pass or fail.
#pragma once

#include "src/verdict/check_result.hpp"
#include "src/verdict/divergence.hpp"
#include "src/verdict/metrics.hpp"
#include "src/verdict/policy.hpp"

namespace kvaudit {

// One comparison of (step, layer), measured and judged with `policy`; where it fails and the first
// divergence follows it, located too (ComparisonResult::divergence).
ComparisonResult judge_comparison(const Policy& policy, const ComparisonSite& site,
                                  Comparison comparison, const TensorShape3& shape,
                                  const ComparisonOperands& operands);

// Judges comparisons into a run (with the run's policy), in replay order, and keeps the run's
// first divergence current.
class RunJudge {
 public:
  explicit RunJudge(CheckRun& run) : run_(run) {}
  // The judged result, as recorded in the run (valid until the next compare).
  const ComparisonResult& compare(const ComparisonSite& site, Comparison comparison,
                                  const TensorShape3& shape, const ComparisonOperands& operands);

 private:
  CheckRun& run_;
  DivergenceTracker divergence_;
};

}  // namespace kvaudit
