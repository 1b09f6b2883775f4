// report.json read back into the run it was written from: check_run_from_json, the inverse of
// to_json (check_result.cpp), used by `kvaudit merge` to read shard parts. Each reader below
// mirrors one writer there, key for key; keys the writer derives from the run (verdict, counts,
// steps, a result's worst and max_abs_over_ref_max, the throughput, version, captured_pool_cost,
// unmeasured, a diagnosis' summary, the sign-off digest) are skipped, any key
// it does not write is refused. Numbers may be json_number's strings "nan", "inf", "-inf".
#include <fmt/format.h>

#include <array>
#include <cstdint>

#include "src/verdict/check_result.hpp"
#include "src/verdict/json_object_reader.hpp"

namespace kvaudit {
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
constexpr std::array kIntegrityChecks = {
    IntegrityCheck::kStorage,         IntegrityCheck::kWrittenSlots,
    IntegrityCheck::kUnwrittenSlots,  IntegrityCheck::kNanWritten,
    IntegrityCheck::kReadConsistency, IntegrityCheck::kCapturedPool,
    IntegrityCheck::kNanCodesInPool};
constexpr std::array kSlotClasses = {SlotClass::kNone,
                                     SlotClass::kWrongSlot,
                                     SlotClass::kBf16Bytes,
                                     SlotClass::kNanCode,
                                     SlotClass::kOffByOneCode,
                                     SlotClass::kScaleBytes,
                                     SlotClass::kSwappedGroupScale,
                                     SlotClass::kCodesOtherScale,
                                     SlotClass::kRopeSaturated,
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

HypothesisOutcome read_outcome(JsonObjectReader reader) {
  HypothesisOutcome outcome;
  outcome.hypothesis = reader.text("hypothesis");
  outcome.transform = reader.text("transform");
  outcome.after = read_error_summary(reader.object("after"));
  outcome.explains = reader.boolean("explains");
  outcome.excess = reader.number("excess");
  outcome.reasons = reader.texts("reasons");
  reader.finish();
  return outcome;
}

DiagnosisFinding read_diagnosis(JsonObjectReader reader) {
  DiagnosisFinding finding;
  finding.step = reader.int32("step");
  finding.layer_id = reader.int32("layer");
  finding.comparison = read_enum(reader, "comparison", all_comparisons(), comparison_name);
  finding.before = read_error_summary(reader.object("before"));
  finding.explained_by = read_array<HypothesisOutcome>(reader, "explained_by", read_outcome);
  // Derived from explained_by: whether any explains, whether more than one, and the sentence.
  for (const char* derived : {"explained", "indistinguishable", "summary"}) reader.skip(derived);
  finding.same_computation = reader.boolean("same_computation");
  if (!reader.raw("closest").is_null()) finding.closest = read_outcome(reader.object("closest"));
  finding.tried = reader.int32("hypotheses_tried");
  finding.not_applicable = reader.texts("not_applicable");
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
  reader.skip("unmeasured");  // measurement_gaps(run)
  run.signoff = read_signoff(reader);
  read_timing(reader.object("timing"), run);
  run.provenance = read_provenance(reader.object("provenance"));
  reader.finish();
  if (errors.first) return *errors.first;
  return run;
}

}  // namespace kvaudit
