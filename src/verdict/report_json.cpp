// report.json, written and read here alone (src/verdict/report_model.hpp): the writer, to_json of
// the report model, key for key the schema docs/report.schema.json holds (docs/report-schema.md
// says what the keys mean); and check_run_from_json, its inverse, used by `kvaudit merge` to read
// shard parts. Each reader mirrors one writer, key for key; keys the writer derives from the run
// (verdict, counts, steps, a result's worst and max_abs_over_ref_max, the throughput, version,
// captured_pool_cost, unmeasured, a diagnosis' summary, the certification maxima, the sign-off
// digest and the plain report's checksum) are skipped, any key it does not write is refused.
// Numbers may be json_number's strings "nan", "inf", "-inf".
#include <fmt/format.h>

#include <array>
#include <cstdint>
#include <limits>

#include "src/core/ed25519.hpp"
#include "src/verdict/check_result.hpp"
#include "src/verdict/json_object_reader.hpp"
#include "src/verdict/report_digest.hpp"
#include "src/verdict/report_model.hpp"
#include "src/verdict/signoff.hpp"

namespace kvaudit {

// ---- writing ------------------------------------------------------------------------------------

namespace {

nlohmann::json pool_state_json(PoolState state) {
  return state == PoolState::kNotChecked ? nlohmann::json(nullptr)
                                         : nlohmann::json(pool_state_name(state));
}

nlohmann::json object_or_empty(const nlohmann::json& value) {
  return value.is_null() ? nlohmann::json::object() : value;
}

nlohmann::json counts_json(const RunCounts& counts) {
  return {{"comparisons", counts.comparisons},
          {"failed", counts.failed},
          {"failed_report_only", counts.failed_report_only},
          {"integrity_checks", counts.integrity_checks},
          {"integrity_failed", counts.integrity_failed},
          {"unmeasured", counts.unmeasured}};
}

nlohmann::json result_json(const ComparisonResult& result) {
  nlohmann::json metrics = to_json(result.metrics);
  metrics["max_abs_over_ref_max"] = json_number(max_abs_over_ref_max(result.metrics));
  return {{"step", result.step},
          {"layer", result.layer_id},
          {"comparison", comparison_name(result.comparison)},
          {"metrics", std::move(metrics)},
          {"worst", to_json(worst_location(result))},
          {"worst_request", result.worst_request},
          {"pass", result.judgement.pass},
          {"sets_exit", result.sets_exit || result.metrics.nonfinite_mismatches > 0},
          {"reasons", result.judgement.reasons}};
}

nlohmann::json misplaced_rows_json(const std::vector<MisplacedRow>& rows) {
  nlohmann::json array = nlohmann::json::array();
  for (const MisplacedRow& row : rows) {
    array.push_back({{"slot", row.slot},
                     {"intended_slot", row.intended_slot},
                     {"new_kv_row", row.new_kv_row},
                     {"request", row.request},
                     {"token", row.token}});
  }
  return array;
}

nlohmann::json finding_json(const IntegrityFinding& finding) {
  return {{"step", finding.step},
          {"layer", finding.layer_id},
          {"check", integrity_check_name(finding.check)},
          {"pass", finding.pass},
          {"where", finding.where},
          {"detail", finding.detail},
          {"slots", finding.slots},
          {"slot_count", finding.slot_count},
          {"classification", slot_class_name(finding.classification)},
          {"carried_from_step", finding.carried_from_step >= 0
                                    ? nlohmann::json(finding.carried_from_step)
                                    : nlohmann::json(nullptr)},
          {"misplaced_rows", misplaced_rows_json(finding.misplaced_rows)}};
}

nlohmann::json step_json(const StepSummary& summary) {
  nlohmann::json comparisons = nlohmann::json::object();
  for (const auto& [comparison, worst] : summary.worst) {
    comparisons[comparison_name(comparison)] = {
        {"worst_rel_l2", json_number(worst.rel_l2)},
        {"worst_layer", worst.layer_id},
        {"nonfinite_mismatches", worst.nonfinite_mismatches},
        {"failed_layers", worst.failed}};
  }
  return {{"step", summary.step},
          {"layers", summary.layers},
          {"backend_pool", pool_state_json(summary.backend_pool)},
          {"damaged_slots", summary.damaged_slots},
          {"damaged_layers", summary.damaged_layers},
          {"captured_pool", pool_state_json(summary.captured_pool)},
          {"new_captured_slots", summary.new_captured_slots},
          {"carried_captured_slots", summary.carried_captured_slots},
          {"comparisons", std::move(comparisons)},
          {"pass", summary.pass}};
}

nlohmann::json error_json(const ErrorSummary& error) {
  return {{"rel_l2", json_number(error.rel_l2)},
          {"max_abs_over_ref_max", json_number(error.max_abs_over_ref_max)},
          {"lse_max_abs", error.has_lse ? json_number(error.lse_max_abs) : nlohmann::json(nullptr)},
          {"nonfinite_mismatches", error.nonfinite_mismatches}};
}

nlohmann::json optional_error_json(const std::optional<ErrorSummary>& error) {
  return error ? error_json(*error) : nlohmann::json(nullptr);
}

nlohmann::json outcome_json(const HypothesisOutcome& outcome) {
  return {{"hypothesis", outcome.hypothesis},
          {"transform", outcome.transform},
          {"after", error_json(outcome.after)},
          {"explains", outcome.explains},
          {"excess", json_number(outcome.excess)},
          {"reasons", outcome.reasons},
          {"fraction", json_number(outcome.fraction)},
          {"after_stored", optional_error_json(outcome.after_stored)}};
}

nlohmann::json diagnosis_json(const DiagnosisFinding& finding, double explain_fraction) {
  nlohmann::json explained_by = nlohmann::json::array();
  for (const HypothesisOutcome& outcome : finding.explained_by) {
    explained_by.push_back(outcome_json(outcome));
  }
  nlohmann::json hypotheses = nlohmann::json::array();
  for (const HypothesisOutcome& outcome : finding.hypotheses) {
    hypotheses.push_back(outcome_json(outcome));
  }
  return {{"step", finding.step},
          {"layer", finding.layer_id},
          {"comparison", comparison_name(finding.comparison)},
          {"before", error_json(finding.before)},
          {"baseline_stored", optional_error_json(finding.baseline_stored)},
          {"explained", !finding.explained_by.empty()},
          {"explained_by", std::move(explained_by)},
          {"indistinguishable", finding.explained_by.size() > 1},
          {"same_computation", finding.same_computation},
          {"closest", finding.closest ? outcome_json(*finding.closest) : nlohmann::json(nullptr)},
          {"hypotheses_tried", finding.tried},
          {"not_applicable", finding.not_applicable},
          {"hypotheses", std::move(hypotheses)},
          {"summary", diagnosis_summary(finding, explain_fraction)}};
}

nlohmann::json captured_pool_cost_json(const std::optional<CapturedPoolCost>& cost) {
  if (!cost) return nullptr;
  auto optional_int = [](int value) {
    return value >= 0 ? nlohmann::json(value) : nlohmann::json(nullptr);
  };
  return {{"damaged_since_step", optional_int(cost->damaged_since_step)},
          {"shows", cost->shows},
          {"step", optional_int(cost->step)},
          {"layer", cost->shows ? nlohmann::json(cost->layer_id) : nlohmann::json(nullptr)},
          {"cost", cost->shows ? error_json(cost->cost) : nlohmann::json(nullptr)}};
}

nlohmann::json divergence_json(const std::optional<Divergence>& divergence) {
  if (!divergence) return nullptr;
  return {{"step", divergence->step},       {"layer_id", divergence->layer_id},
          {"request", divergence->request}, {"row", divergence->row},
          {"head", divergence->head},       {"comparison", comparison_name(divergence->comparison)},
          {"reason", divergence->reason}};
}

nlohmann::json timing_json(const CheckRun& run) {
  const nlohmann::json throughput =
      run.reference_seconds > 0.0
          ? json_number(run.reference_rows_heads_tokens / run.reference_seconds)
          : nlohmann::json(nullptr);
  return {{"reference_device", run.reference_device},
          {"reference_seconds", json_number(run.reference_seconds)},
          {"reference_rows_heads_tokens", json_number(run.reference_rows_heads_tokens)},
          {"reference_throughput_rows_heads_tokens_per_s", throughput},
          {"backend_seconds", json_number(run.backend_seconds)},
          {"read_seconds", json_number(run.read_seconds)},
          {"judge_seconds", json_number(run.judge_seconds)},
          {"diagnosis_seconds", json_number(run.diagnosis_seconds)},
          {"certification_seconds", json_number(run.certification_seconds)},
          {"total_seconds", json_number(run.total_seconds)},
          {"backend_protocol", run.backend_protocol}};
}

// The reference's certification: the bound, each sample, and the largest deviations (derived).
nlohmann::json certification_json(const std::vector<CertificationSample>& samples,
                                  const CertificationMaxima& maxima) {
  nlohmann::json items = nlohmann::json::array();
  for (const CertificationSample& s : samples) {
    items.push_back({{"step", s.step},
                     {"layer", s.layer_id},
                     {"row", s.row},
                     {"head", s.head},
                     {"out_relative", json_number(s.out_relative)},
                     {"lse_absolute", json_number(s.lse_absolute)}});
  }
  return {{"method",
           "R8 of one (row, head) per sample site recomputed in 50 decimal digits (Boost "
           "cpp_bin_float_50) and compared with the run's reference"},
          {"bound", json_number(kReferenceBound)},
          {"samples", std::move(items)},
          {"max_out_relative", json_number(maxima.out_relative)},
          {"max_lse_absolute", json_number(maxima.lse_absolute)}};
}

nlohmann::json merged_part_json(const MergedPart& part) {
  return {{"file", part.file},
          {"shard", part.shard},
          {"host", part.host},
          {"date", part.date_utc},
          {"command_line", part.command_line}};
}

// merged_from only in a merged run's report, so that other reports keep their keys.
nlohmann::json provenance_json(const Provenance& provenance) {
  nlohmann::json j = {{"host", provenance.host},
                      {"date", provenance.date_utc},
                      {"command_line", provenance.command_line},
                      {"kvaudit_version", provenance.kvaudit_version},
                      {"git_revision", provenance.git_revision},
                      {"cpu", provenance.cpu}};
  if (!provenance.merged_from.empty()) {
    j["merged_from"] = nlohmann::json::array();
    for (const MergedPart& part : provenance.merged_from) {
      j["merged_from"].push_back(merged_part_json(part));
    }
  }
  return j;
}

nlohmann::json coverage_json(const StepLayerCoverage& site) {
  return {{"step", site.step},
          {"layer", site.layer_id},
          {"tokens_read", site.tokens_read},
          {"tokens_without_source", site.tokens_without_source},
          {"codes_read", site.codes_read},
          {"saturated_codes", site.saturated_codes >= 0 ? nlohmann::json(site.saturated_codes)
                                                        : nlohmann::json(nullptr)}};
}

nlohmann::json scale_point_json(const ScalePoint& point) {
  return {{"scale", point.scale},
          {"rel_l2", json_number(point.rel_l2)},
          {"saturated_fraction", point.saturated_fraction}};
}

// One layer's served scale against the recommended one, with the rule's verdict on it.
nlohmann::json scale_json(const Policy& policy, const LayerScaleCheck& layer) {
  nlohmann::json curve = nlohmann::json::array();
  for (const ScalePoint& point : layer.curve) curve.push_back(scale_point_json(point));
  const std::optional<ScaleFailure> failure = judge_served_scale(policy, layer);
  return {{"layer", layer.layer_id},
          {"served_scale", layer.served_scale},
          {"recommended_scale", layer.recommended_scale},
          {"recommended_rule", layer.recommended_rule},
          {"served_rel_l2", json_number(layer.served_rel_l2)},
          {"recommended_rel_l2", json_number(layer.recommended_rel_l2)},
          {"served_saturated_fraction", layer.served_saturated_fraction},
          {"served_underflow_fraction", layer.served_underflow_fraction},
          {"recommended_underflow_fraction", layer.recommended_underflow_fraction},
          {"curve", curve},
          {"pass", !failure.has_value()},
          {"cause", failure ? nlohmann::json(scale_cause_name(failure->cause)) : nullptr},
          {"sentence", failure ? nlohmann::json(failure->sentence) : nullptr}};
}

nlohmann::json gap_json(const MeasurementGap& gap) {
  return {{"layer", gap.layer_id},
          {"comparison", comparison_name(gap.comparison)},
          {"reason", gap_reason_name(gap.reason)},
          {"steps", gap.steps},
          {"tokens_read", gap.tokens_read},
          {"tokens_without_source", gap.tokens_without_source}};
}

nlohmann::json text_or_null(const std::string& text) {
  return text.empty() ? nlohmann::json(nullptr) : nlohmann::json(text);
}

// Who signs, for what, and with which key (the key only where there is one: a report from before
// signatures has none).
nlohmann::json signer_json(const SignOff& signer) {
  nlohmann::json j = {{"signed_by", text_or_null(signer.signed_by)},
                      {"model", text_or_null(signer.model)},
                      {"deployment", text_or_null(signer.deployment)}};
  if (!signer.public_key.empty()) {
    j["public_key"] = {{"algorithm", kSignatureAlgorithm}, {"value", signer.public_key}};
  }
  return j;
}

// A checksum: "signoff"."digest", or a plain report's top-level "checksum".
nlohmann::json digest_json(const ReportDigest& digest) {
  return {{"algorithm", digest.algorithm}, {"covers", digest.covers}, {"value", digest.value}};
}

// Who signed, and the checksum of everything else but timing (src/verdict/report_digest.hpp; the
// signature is beside report.json, src/report/report_signature.hpp); null for a run that is not
// a sign-off.
nlohmann::json signoff_json(const std::optional<SignOffRecord>& signoff) {
  if (!signoff) return nullptr;
  nlohmann::json j = signer_json(signoff->signer);
  j["digest"] = digest_json(signoff->digest);
  return j;
}

template <typename T, typename ToJson>
nlohmann::json array_json(const std::vector<T>& items, ToJson to_json_item) {
  nlohmann::json array = nlohmann::json::array();
  for (const T& item : items) array.push_back(to_json_item(item));
  return array;
}

// Every key but "signoff": what the sign-off digest covers (with the signer and less timing).
nlohmann::json unsigned_json(const ReportModel& model) {
  const CheckRun& run = model.run;
  nlohmann::json j;
  j["tool"] = "kvaudit";
  j["version"] = kvaudit_version();
  j["verdict"] = model.pass ? "pass" : "fail";
  j["counts"] = counts_json(model.counts);
  j["backend"] = run.backend;
  j["backend_description"] = object_or_empty(run.backend_description);
  j["policy"] = to_json(run.policy);
  j["dump"] = {{"path", run.dump_path},
               {"sha256", run.dump_sha256},
               {"summary", object_or_empty(run.dump_summary)}};
  j["results"] = array_json(run.comparisons, result_json);
  j["integrity"] = array_json(run.integrity, finding_json);
  j["steps"] = array_json(model.steps, step_json);
  j["first_divergence"] = divergence_json(run.first_divergence);
  j["diagnosis"] = array_json(run.diagnosis, [&](const DiagnosisFinding& finding) {
    return diagnosis_json(finding, run.policy.explain_fraction);
  });
  j["captured_pool_cost"] = captured_pool_cost_json(model.captured_pool_cost);
  j["certification"] = certification_json(run.certification, model.certification_maxima);
  j["notes"] = run.notes;
  j["coverage"] = array_json(run.coverage, coverage_json);
  j["unmeasured"] = array_json(model.unmeasured, gap_json);
  if (!run.scales.empty()) {  // absent from runs without a scales section (and older reports)
    j["scales"] = nlohmann::json::array();
    for (const LayerScaleCheck& layer : run.scales)
      j["scales"].push_back(scale_json(run.policy, layer));
  }
  j["timing"] = timing_json(run);
  j["provenance"] = provenance_json(run.provenance);
  return j;
}

// The digest over the report with the signer in it (report_digest ignores timing and the digest).
SignOffRecord signed_record(const ReportModel& model, const SignOff& signer) {
  nlohmann::json j = unsigned_json(model);
  j["signoff"] = signer_json(signer);
  return {signer, {kReportDigestAlgorithm, kReportDigestCovers, report_digest(j)}};
}

// The checksum of a report made without --signoff: over what to_json writes ("signoff" null;
// report_digest ignores timing and the checksum itself). Not a signature: anyone can recompute it.
ReportDigest plain_checksum(const ReportModel& model) {
  nlohmann::json j = unsigned_json(model);
  j["signoff"] = nullptr;
  return {kReportDigestAlgorithm, kPlainReportChecksumCovers, report_digest(j)};
}

}  // namespace

ReportModel make_report_model(const CheckRun& run) {
  ReportModel model;
  model.run = run;
  model.run.provenance = completed_provenance(run.provenance);
  model.pass = run.pass();
  model.counts = count_results(run);
  model.steps = summarize_steps(run);
  model.captured_pool_cost = captured_pool_cost(run);
  model.certification_maxima = certification_maxima(run.certification);
  model.unmeasured = measurement_gaps(run);
  if (run.signoff) {
    model.signoff = signed_record(model, *run.signoff);
  } else {
    model.checksum = plain_checksum(model);
  }
  return model;
}

nlohmann::json to_json(const ReportModel& model) {
  nlohmann::json j = unsigned_json(model);
  j["signoff"] = signoff_json(model.signoff);
  if (model.checksum) j["checksum"] = digest_json(*model.checksum);
  return j;
}

// Read back by check_run_from_json (below): a key added here needs its reader there, its entry
// in docs/report.schema.json and its line in docs/report-schema.md, or the round-trip test over
// the shipped dumps' reports or ctest -R report_schema fails.
nlohmann::json to_json(const CheckRun& run) { return to_json(make_report_model(run)); }

std::string report_json_text(const nlohmann::json& report) {
  return report.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

// ---- reading ------------------------------------------------------------------------------------

namespace {

// The array `key` of `parent`, each element read by `read` (one reader per element, so errors
// name the element's pointer).
template <typename T, typename Read>
std::vector<T> read_array(JsonObjectReader& parent, const std::string& key, Read read) {
  std::vector<T> items;
  const nlohmann::json& array = parent.array(key);
  for (std::size_t i = 0; i < array.size(); ++i) {
    items.push_back(read(parent.element(array, key, i)));
  }
  return items;
}

// Every value of the enums report.json names (their name functions are in check_result.hpp;
// comparisons: all_comparisons() in policy.hpp).
constexpr std::array kIntegrityChecks = {IntegrityCheck::kStorage,
                                         IntegrityCheck::kWrittenSlots,
                                         IntegrityCheck::kUnwrittenSlots,
                                         IntegrityCheck::kNanWritten,
                                         IntegrityCheck::kReadConsistency,
                                         IntegrityCheck::kCapturedPool,
                                         IntegrityCheck::kNanCodesInPool,
                                         IntegrityCheck::kIndexerWrittenSlots,
                                         IntegrityCheck::kIndexerUnwrittenSlots,
                                         IntegrityCheck::kIndexerTopk,
                                         IntegrityCheck::kIndexerNonFinite};
constexpr std::array kSlotClasses = {SlotClass::kNone,
                                     SlotClass::kWrongSlot,
                                     SlotClass::kBf16Bytes,
                                     SlotClass::kNanCode,
                                     SlotClass::kOffByOneCode,
                                     SlotClass::kScaleBytes,
                                     SlotClass::kSwappedGroupScale,
                                     SlotClass::kCodesOtherScale,
                                     SlotClass::kRopeSaturated,
                                     SlotClass::kUnusedSlot,
                                     SlotClass::kOther};

// A name back to its enum value, by the enum's own name function; an unknown name is an error.
template <typename Values, typename Enum = typename Values::value_type>
Enum read_enum(JsonObjectReader& reader, const std::string& key, const Values& values,
               const char* (*name)(Enum)) {
  const std::string text = reader.text(key);
  for (const Enum value : values) {
    if (text == name(value)) return value;
  }
  reader.errors().fail(reader.pointer(key), fmt::format("unknown name \"{}\"", text));
  return *values.begin();
}

ElementLocation read_location(JsonObjectReader reader) {
  ElementLocation at;
  at.row = reader.int32("row");
  at.head = reader.int32("head");
  at.dim = reader.int32("dim");
  at.reference = reader.number("reference");
  at.candidate = reader.number("candidate");
  reader.finish();
  return at;
}

// A location, or null (the default location) where to_json writes null.
ElementLocation read_location_or_default(JsonObjectReader& parent, const std::string& key) {
  if (parent.raw(key).is_null()) return ElementLocation{};
  return read_location(parent.object(key));
}

ComparisonMetrics read_metrics(JsonObjectReader reader) {
  ComparisonMetrics m;
  m.elements = reader.count("elements");
  m.finite_elements = reader.count("finite_elements");
  m.max_abs = reader.number("max_abs");
  m.max_abs_at = read_location(reader.object("max_abs_at"));
  reader.skip("max_abs_over_ref_max");  // max_abs / reference_max_abs
  m.max_rel = reader.number("max_rel");
  m.rel_floor = reader.number("rel_floor");
  m.max_rel_at = read_location(reader.object("max_rel_at"));
  m.rms = reader.number("rms");
  m.rel_l2 = reader.number("rel_l2");
  m.cos_diff = reader.number("cos_diff");
  m.max_ulp_bf16 = reader.number("max_ulp_bf16");
  m.max_ulp_at = read_location(reader.object("max_ulp_at"));
  m.reference_max_abs = reader.number("reference_max_abs");
  m.has_lse = reader.boolean("has_lse");
  if (m.has_lse) {
    m.lse_max_abs = reader.number("lse_max_abs");
    m.lse_max_abs_at = read_location(reader.object("lse_max_abs_at"));
  } else {
    reader.skip("lse_max_abs");  // null without lse
    reader.skip("lse_max_abs_at");
  }
  m.reference_nonfinite = reader.count("reference_nonfinite");
  m.candidate_nonfinite = reader.count("candidate_nonfinite");
  m.nonfinite_mismatches = reader.count("nonfinite_mismatches");
  m.first_nonfinite_mismatch = read_location_or_default(reader, "first_nonfinite_mismatch");
  reader.finish();
  return m;
}

ComparisonResult read_result(JsonObjectReader reader) {
  ComparisonResult result;
  result.step = reader.int32("step");
  result.layer_id = reader.int32("layer");
  result.comparison = read_enum(reader, "comparison", all_comparisons(), comparison_name);
  result.metrics = read_metrics(reader.object("metrics"));
  reader.skip("worst");  // worst_location(result)
  result.worst_request = reader.int32("worst_request");
  result.judgement.pass = reader.boolean("pass");
  // Written as sets_exit || nonfinite_mismatches > 0: reading it back as sets_exit keeps both
  // fails_run and the written value.
  result.sets_exit = reader.boolean("sets_exit");
  result.judgement.reasons = reader.texts("reasons");
  reader.finish();
  return result;
}

// misplaced_rows: absent in reports written before it was recorded (none then).
std::vector<MisplacedRow> read_misplaced_rows(JsonObjectReader& parent) {
  std::vector<MisplacedRow> rows;
  if (!parent.has("misplaced_rows")) return rows;
  const nlohmann::json& array = parent.array("misplaced_rows");
  for (std::size_t i = 0; i < array.size(); ++i) {
    JsonObjectReader reader = parent.element(array, "misplaced_rows", i);
    MisplacedRow row;
    row.slot = reader.integer("slot");
    row.intended_slot = reader.integer("intended_slot");
    row.new_kv_row = reader.int32("new_kv_row");
    row.request = reader.int32("request");
    row.token = reader.integer("token");
    reader.finish();
    rows.push_back(row);
  }
  return rows;
}

IntegrityFinding read_finding(JsonObjectReader reader) {
  IntegrityFinding finding;
  finding.step = reader.int32("step");
  finding.layer_id = reader.int32("layer");
  finding.check = read_enum(reader, "check", kIntegrityChecks, integrity_check_name);
  finding.pass = reader.boolean("pass");
  finding.where = reader.text("where");
  finding.detail = reader.text("detail");
  finding.slots = reader.int64s("slots");
  finding.slot_count = reader.integer("slot_count");
  finding.classification = read_enum(reader, "classification", kSlotClasses, slot_class_name);
  finding.carried_from_step = reader.int32_or_null("carried_from_step", -1);
  finding.misplaced_rows = read_misplaced_rows(reader);
  reader.finish();
  return finding;
}

std::optional<Divergence> read_divergence(JsonObjectReader& parent) {
  if (parent.raw("first_divergence").is_null()) return std::nullopt;
  JsonObjectReader reader = parent.object("first_divergence");
  Divergence divergence;
  divergence.step = reader.int32("step");
  divergence.layer_id = reader.int32("layer_id");
  divergence.request = reader.int32("request");
  divergence.row = reader.int32("row");
  divergence.head = reader.int32("head");
  divergence.comparison = read_enum(reader, "comparison", all_comparisons(), comparison_name);
  divergence.reason = reader.text("reason");
  reader.finish();
  return divergence;
}

void read_timing(JsonObjectReader reader, CheckRun& run) {
  // Absent from reports written before --reference existed: those ran on the CPU.
  run.reference_device = reader.has("reference_device") ? reader.text("reference_device") : "cpu";
  run.reference_seconds = reader.number("reference_seconds");
  run.reference_rows_heads_tokens = reader.number("reference_rows_heads_tokens");
  reader.skip("reference_throughput_rows_heads_tokens_per_s");  // the ratio of the two above
  run.backend_seconds = reader.number("backend_seconds");
  // Absent from reports written before these were measured.
  run.read_seconds = reader.has("read_seconds") ? reader.number("read_seconds") : 0.0;
  run.judge_seconds = reader.has("judge_seconds") ? reader.number("judge_seconds") : 0.0;
  run.diagnosis_seconds = reader.number("diagnosis_seconds");
  run.certification_seconds = reader.number("certification_seconds");
  run.total_seconds = reader.number("total_seconds");
  run.backend_protocol = reader.raw("backend_protocol");  // the exec backend's own statistics
  reader.finish();
}

ErrorSummary read_error_summary(JsonObjectReader reader) {
  ErrorSummary error;
  error.rel_l2 = reader.number("rel_l2");
  error.max_abs_over_ref_max = reader.number("max_abs_over_ref_max");
  error.has_lse = !reader.raw("lse_max_abs").is_null();
  if (error.has_lse) error.lse_max_abs = reader.number("lse_max_abs");
  error.nonfinite_mismatches = reader.count("nonfinite_mismatches");
  reader.finish();
  return error;
}

// Absent (reports from before the bf16 out store was modelled) or null: nullopt.
std::optional<ErrorSummary> read_optional_error_summary(JsonObjectReader& reader, const char* key) {
  if (!reader.has(key) || reader.raw(key).is_null()) return std::nullopt;
  return read_error_summary(reader.object(key));
}

HypothesisOutcome read_outcome(JsonObjectReader reader) {
  HypothesisOutcome outcome;
  outcome.hypothesis = reader.text("hypothesis");
  outcome.transform = reader.text("transform");
  outcome.after = read_error_summary(reader.object("after"));
  outcome.explains = reader.boolean("explains");
  outcome.excess = reader.number("excess");
  outcome.reasons = reader.texts("reasons");
  // Absent in reports from before the fraction rule (issue 29): unknown, not 0.
  outcome.fraction =
      reader.has("fraction") ? reader.number("fraction") : std::numeric_limits<double>::quiet_NaN();
  outcome.after_stored = read_optional_error_summary(reader, "after_stored");
  reader.finish();
  return outcome;
}

DiagnosisFinding read_diagnosis(JsonObjectReader reader) {
  DiagnosisFinding finding;
  finding.step = reader.int32("step");
  finding.layer_id = reader.int32("layer");
  finding.comparison = read_enum(reader, "comparison", all_comparisons(), comparison_name);
  finding.before = read_error_summary(reader.object("before"));
  finding.baseline_stored = read_optional_error_summary(reader, "baseline_stored");
  finding.explained_by = read_array<HypothesisOutcome>(reader, "explained_by", read_outcome);
  // Derived from explained_by: whether any explains, whether more than one, and the sentence.
  for (const char* derived : {"explained", "indistinguishable", "summary"}) reader.skip(derived);
  finding.same_computation = reader.boolean("same_computation");
  if (!reader.raw("closest").is_null()) finding.closest = read_outcome(reader.object("closest"));
  finding.tried = reader.int32("hypotheses_tried");
  finding.not_applicable = reader.texts("not_applicable");
  if (reader.has("hypotheses")) {  // absent in reports from before issue 29
    finding.hypotheses = read_array<HypothesisOutcome>(reader, "hypotheses", read_outcome);
  }
  reader.finish();
  return finding;
}

CertificationSample read_certification_sample(JsonObjectReader reader) {
  CertificationSample sample;
  sample.step = reader.int32("step");
  sample.layer_id = reader.int32("layer");
  sample.row = reader.int32("row");
  sample.head = reader.int32("head");
  sample.out_relative = reader.number("out_relative");
  sample.lse_absolute = reader.number("lse_absolute");
  reader.finish();
  return sample;
}

std::vector<CertificationSample> read_certification(JsonObjectReader reader) {
  // method and bound are this kvaudit's constants; the maxima derive from the samples.
  for (const char* derived : {"method", "bound", "max_out_relative", "max_lse_absolute"}) {
    reader.skip(derived);
  }
  std::vector<CertificationSample> samples =
      read_array<CertificationSample>(reader, "samples", read_certification_sample);
  reader.finish();
  return samples;
}

ScalePoint read_scale_point(JsonObjectReader reader) {
  ScalePoint point;
  point.scale = reader.number("scale");
  point.rel_l2 = reader.number("rel_l2");
  point.saturated_fraction = reader.number("saturated_fraction");
  reader.finish();
  return point;
}

LayerScaleCheck read_scale(JsonObjectReader reader) {
  LayerScaleCheck layer;
  layer.layer_id = reader.int32("layer");
  layer.served_scale = reader.number("served_scale");
  layer.recommended_scale = reader.number("recommended_scale");
  layer.recommended_rule = reader.text("recommended_rule");
  layer.served_rel_l2 = reader.number("served_rel_l2");
  layer.recommended_rel_l2 = reader.number("recommended_rel_l2");
  layer.served_saturated_fraction = reader.number("served_saturated_fraction");
  layer.served_underflow_fraction = reader.number("served_underflow_fraction");
  layer.recommended_underflow_fraction = reader.number("recommended_underflow_fraction");
  layer.curve = read_array<ScalePoint>(reader, "curve", read_scale_point);
  for (const char* derived : {"pass", "cause", "sentence"}) reader.skip(derived);  // the rule's
  reader.finish();
  return layer;
}

StepLayerCoverage read_coverage(JsonObjectReader reader) {
  StepLayerCoverage site;
  site.step = reader.int32("step");
  site.layer_id = reader.int32("layer");
  site.tokens_read = reader.integer("tokens_read");
  site.tokens_without_source = reader.integer("tokens_without_source");
  site.codes_read = reader.integer("codes_read");
  site.saturated_codes =
      reader.raw("saturated_codes").is_null() ? -1 : reader.integer("saturated_codes");
  reader.finish();
  return site;
}

// signoff: who signed (null fields as empty), or null for a run that is no sign-off. The digest
// is skipped: to_json computes it again over what it writes.
std::optional<SignOff> read_signoff(JsonObjectReader& parent) {
  if (parent.raw("signoff").is_null()) return std::nullopt;
  JsonObjectReader reader = parent.object("signoff");
  auto text_or_empty = [&reader](const std::string& key) {
    return reader.raw(key).is_null() ? std::string() : reader.text(key);
  };
  SignOff signoff;
  signoff.signed_by = text_or_empty("signed_by");
  signoff.model = text_or_empty("model");
  signoff.deployment = text_or_empty("deployment");
  if (reader.has("public_key")) {  // absent in reports from before signatures
    JsonObjectReader key = reader.object("public_key");
    if (key.text("algorithm") != kSignatureAlgorithm) {
      key.errors().fail(key.pointer("algorithm"), "expected \"ed25519\"");
    }
    signoff.public_key = key.text("value");
    key.finish();
  }
  reader.skip("digest");
  reader.finish();
  return signoff;
}

MergedPart read_merged_part(JsonObjectReader reader) {
  MergedPart part;
  part.file = reader.text("file");
  part.shard = reader.text("shard");
  part.host = reader.text("host");
  part.date_utc = reader.text("date");
  part.command_line = reader.text("command_line");
  reader.finish();
  return part;
}

Provenance read_provenance(JsonObjectReader reader) {
  Provenance provenance;
  provenance.host = reader.text("host");
  provenance.date_utc = reader.text("date");
  provenance.command_line = reader.text("command_line");
  provenance.kvaudit_version = reader.text("kvaudit_version");
  provenance.git_revision = reader.text("git_revision");
  provenance.cpu = reader.text("cpu");
  if (reader.has("merged_from")) {  // merged runs only
    provenance.merged_from = read_array<MergedPart>(reader, "merged_from", read_merged_part);
  }
  reader.finish();
  return provenance;
}

// dump: path, sha256, summary (kept as written: the replay's description of the dump).
void read_dump(JsonObjectReader reader, CheckRun& run) {
  run.dump_path = reader.text("path");
  run.dump_sha256 = reader.text("sha256");
  run.dump_summary = reader.raw("summary");
  reader.finish();
}

}  // namespace

Result<CheckRun> check_run_from_json(const nlohmann::json& report, const std::string& where) {
  JsonReadErrors errors{where, std::nullopt};
  JsonObjectReader reader(report, "", errors);
  CheckRun run;
  if (reader.text("tool") != "kvaudit") errors.fail("/tool", "expected \"kvaudit\"");
  for (const char* derived : {"version", "verdict", "counts", "steps"}) reader.skip(derived);
  run.backend = reader.text("backend");
  run.backend_description = reader.raw("backend_description");
  Result<Policy> policy = policy_from_json(reader.raw("policy"), where, "/policy");
  if (policy.ok()) run.policy = std::move(*policy);
  if (!policy.ok() && !errors.first) errors.first = policy.error();
  read_dump(reader.object("dump"), run);
  run.comparisons = read_array<ComparisonResult>(reader, "results", read_result);
  run.integrity = read_array<IntegrityFinding>(reader, "integrity", read_finding);
  run.first_divergence = read_divergence(reader);
  run.diagnosis = read_array<DiagnosisFinding>(reader, "diagnosis", read_diagnosis);
  reader.skip("captured_pool_cost");  // captured_pool_cost(run): the results and findings give it
  run.certification = read_certification(reader.object("certification"));
  run.notes = reader.texts("notes");
  run.coverage = read_array<StepLayerCoverage>(reader, "coverage", read_coverage);
  reader.skip("unmeasured");   // measurement_gaps(run)
  if (reader.has("scales")) {  // absent where the run has no scales section (and older reports)
    run.scales = read_array<LayerScaleCheck>(reader, "scales", read_scale);
  }
  run.signoff = read_signoff(reader);
  reader.skip("checksum");  // a plain report's: derived (absent in sign-offs and older reports)
  read_timing(reader.object("timing"), run);
  run.provenance = read_provenance(reader.object("provenance"));
  reader.finish();
  if (errors.first) return *errors.first;
  return run;
}

}  // namespace kvaudit
