// The sign-off rule: gaps in what was measured (see signoff.hpp).
#include "src/verdict/signoff.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>
#include <tuple>
#include <utility>

namespace kvaudit {

const char* gap_reason_name(GapReason reason) {
  switch (reason) {
    case GapReason::kNoSource:
      return "no_source";
    case GapReason::kNoBackend:
      return "no_backend";
  }
  return "unknown";
}

namespace {

using Site = std::pair<int, int>;  // (step, layer)

// The comparisons measured at each (step, layer).
std::map<Site, std::set<Comparison>> measured_sites(const CheckRun& run) {
  std::map<Site, std::set<Comparison>> measured;
  for (const ComparisonResult& result : run.comparisons) {
    measured[{result.step, result.layer_id}].insert(result.comparison);
  }
  return measured;
}

// Why `comparison` is missing at a coverage site.
GapReason gap_reason(const CheckRun& run, const StepLayerCoverage& site) {
  if (site.tokens_without_source > 0) return GapReason::kNoSource;
  return run.backend == "none" || run.backend.empty() ? GapReason::kNoBackend
                                                      : GapReason::kNoSource;
}

}  // namespace

std::vector<MeasurementGap> measurement_gaps(const CheckRun& run) {
  const std::map<Site, std::set<Comparison>> measured = measured_sites(run);
  std::vector<MeasurementGap> gaps;
  // Index into gaps by (layer, comparison, reason), keeping first-seen (coverage) order.
  std::map<std::tuple<int, Comparison, GapReason>, std::size_t> index;
  for (const StepLayerCoverage& site : run.coverage) {
    const auto found = measured.find({site.step, site.layer_id});
    for (const Comparison comparison : {Comparison::kQuantization, Comparison::kTotal}) {
      if (found != measured.end() && found->second.count(comparison) != 0) continue;
      const GapReason reason = gap_reason(run, site);
      const auto key = std::make_tuple(site.layer_id, comparison, reason);
      auto [it, inserted] = index.try_emplace(key, gaps.size());
      if (inserted) {
        gaps.push_back(
            {site.layer_id, comparison, reason, {}, site.tokens_read, site.tokens_without_source});
      }
      gaps[it->second].steps.push_back(site.step);
    }
  }
  for (MeasurementGap& gap : gaps) std::sort(gap.steps.begin(), gap.steps.end());
  return gaps;
}

std::size_t unmeasured_sites(const std::vector<MeasurementGap>& gaps) {
  std::size_t sites = 0;
  for (const MeasurementGap& gap : gaps) sites += gap.steps.size();
  return sites;
}

bool gaps_fail_run(const CheckRun& run) {
  return run.policy.quantization_sets_exit && !measurement_gaps(run).empty();
}

const char* gap_reason_text(GapReason reason) {
  switch (reason) {
    case GapReason::kNoSource:
      return "the tokens the steps read have no source value: no kv_source";
    case GapReason::kNoBackend:
      return "no backend ran";
  }
  return "unknown";
}

std::string gaps_headline(const std::vector<MeasurementGap>& gaps) {
  // Per reason: which comparisons are missing, in which layers.
  std::map<GapReason, std::pair<std::set<Comparison>, std::set<int>>> by_reason;
  for (const MeasurementGap& gap : gaps) {
    by_reason[gap.reason].first.insert(gap.comparison);
    by_reason[gap.reason].second.insert(gap.layer_id);
  }
  std::vector<std::string> clauses;
  for (const auto& [reason, missing] : by_reason) {
    const auto& [comparisons, layers] = missing;
    std::vector<std::string> names;
    for (const Comparison comparison : comparisons) names.push_back(comparison_name(comparison));
    clauses.push_back(fmt::format("{} error not measured in layer{} {} ({})",
                                  fmt::join(names, " and "), layers.size() == 1 ? "" : "s",
                                  fmt::join(layers, ", "), gap_reason_text(reason)));
  }
  return fmt::format("{}", fmt::join(clauses, "; "));
}

}  // namespace kvaudit

namespace kvaudit {

const char* scale_cause_name(ScaleCause cause) {
  switch (cause) {
    case ScaleCause::kSaturation:
      return "saturation";
    case ScaleCause::kUnderflow:
      return "underflow";
    case ScaleCause::kBoth:
      return "saturation and underflow";
    case ScaleCause::kNeither:
      return "neither saturation nor underflow";
  }
  return "unknown";
}

namespace {

ScaleCause cause_of(const LayerScaleCheck& layer) {
  const bool saturates = layer.served_saturated_fraction > 0.0;
  const bool underflows = layer.served_underflow_fraction > layer.recommended_underflow_fraction;
  if (saturates && underflows) return ScaleCause::kBoth;
  if (saturates) return ScaleCause::kSaturation;
  if (underflows) return ScaleCause::kUnderflow;
  return ScaleCause::kNeither;
}

std::string cause_text(const LayerScaleCheck& layer, ScaleCause cause) {
  const std::string saturation = fmt::format("saturation ({:.3g}% of the values past 464*s)",
                                             100.0 * layer.served_saturated_fraction);
  const std::string underflow = fmt::format(
      "underflow ({:.3g}% of the values subnormal or flushed to 0, {:.3g}% under the "
      "recommended scale)",
      100.0 * layer.served_underflow_fraction, 100.0 * layer.recommended_underflow_fraction);
  switch (cause) {
    case ScaleCause::kSaturation:
      return saturation;
    case ScaleCause::kUnderflow:
      return underflow;
    case ScaleCause::kBoth:
      return saturation + " and " + underflow;
    case ScaleCause::kNeither:
      return "neither saturation nor underflow (the rounding at this scale)";
  }
  return "";
}

}  // namespace

std::optional<ScaleFailure> judge_served_scale(const Policy& policy, const LayerScaleCheck& layer) {
  const std::optional<double> limit = policy.quantization.rel_l2;
  const double relative_bound = policy.scale_error_factor * layer.recommended_rel_l2;
  std::vector<std::string> exceeded;
  if (limit && !(layer.served_rel_l2 <= *limit)) {
    exceeded.push_back(fmt::format("over the quantization limit {:.3g}", *limit));
  }
  if (!(layer.served_rel_l2 <= relative_bound)) {
    exceeded.push_back(fmt::format("over {:.3g}x the recommended scale's {:.3g}",
                                   policy.scale_error_factor, layer.recommended_rel_l2));
  }
  if (exceeded.empty()) return std::nullopt;
  ScaleFailure failure;
  failure.layer_id = layer.layer_id;
  failure.cause = cause_of(layer);
  failure.sentence = fmt::format(
      "layer {}: the served kv_scale {:.9g} costs out rel_l2 {:.3g} ({}): {}; use k_scale = "
      "v_scale = {:.9g} ({})",
      layer.layer_id, layer.served_scale, layer.served_rel_l2, fmt::join(exceeded, " and "),
      cause_text(layer, failure.cause), layer.recommended_scale, layer.recommended_rule);
  return failure;
}

std::vector<ScaleFailure> scale_failures(const CheckRun& run) {
  std::vector<ScaleFailure> failures;
  for (const LayerScaleCheck& layer : run.scales) {
    if (auto failure = judge_served_scale(run.policy, layer)) failures.push_back(*failure);
  }
  return failures;
}

bool scales_fail_run(const CheckRun& run) {
  return run.policy.quantization_sets_exit && !scale_failures(run).empty();
}

}  // namespace kvaudit
