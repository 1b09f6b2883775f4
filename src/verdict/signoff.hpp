// The sign-off rule: a verdict rests only on what was measured. Quantization error (R8 vs Rs) and
// total error (backend vs Rs) need the source value of every token a step reads; a step-layer
// whose tokens lack one (no kv_source, and written before the dump's first step), or a run
// without a backend (no total), leaves them unmeasured there. Under a policy that judges them
// (--signoff, or a policy file with quantization_sets_exit) such a gap fails the run: a sign-off
// cannot pass on what it never measured. Under the default policy gaps are reported, not judged.
//
// The replay records what each reported (step, layer) read (CheckRun::coverage); the gaps are the
// coverage sites without a quantization or total result, grouped per layer, comparison and reason.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "src/verdict/check_result.hpp"

namespace kvaudit {

enum class GapReason {
  kNoSource,   // some token the step reads has no source value
  kNoBackend,  // --backend none: no backend output to compare with Rs (total only)
};
const char* gap_reason_name(GapReason reason);  // "no_source" | "no_backend"
// "the tokens the steps read have no source value: no kv_source" | "no backend ran".
const char* gap_reason_text(GapReason reason);

// One layer's unmeasured comparison, and the steps where it is missing.
struct MeasurementGap {
  int layer_id = 0;
  Comparison comparison = Comparison::kQuantization;  // kQuantization or kTotal
  GapReason reason = GapReason::kNoSource;
  std::vector<int> steps;  // ascending
  // At the first of those steps (kNoSource): tokens read, and how many have no source value.
  std::int64_t tokens_read = 0;
  std::int64_t tokens_without_source = 0;
};

// Every gap of the run, by layer (in coverage order), then quantization before total.
std::vector<MeasurementGap> measurement_gaps(const CheckRun& run);

// (step, layer, comparison) sites the gaps cover (RunCounts::unmeasured).
std::size_t unmeasured_sites(const std::vector<MeasurementGap>& gaps);

// Whether the gaps fail the run: the policy judges quantization and total, and some are missing.
bool gaps_fail_run(const CheckRun& run);

// The headline: "quantization and total error not measured in layers 0, 1 (the tokens the steps
// read have no source value: no kv_source)"; one clause per distinct (comparisons, reason); empty
// when nothing is missing.
std::string gaps_headline(const std::vector<MeasurementGap>& gaps);

}  // namespace kvaudit
