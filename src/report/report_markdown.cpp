// report.md (see report.hpp): a summary a person can sign first, then the failures with their
// likely cause, the diagnosis, the details (per layer, per step, per comparison, the failing
// integrity checks), and the dump, backend, policy, timing and provenance as appendices. The
// words of the summary and the failures come from src/report/report_summary.hpp, shared with
// report.html. Numbers are printed with 4 significant digits: every limit is a power of two stated
// with its derivation, so more digits would only suggest a precision the policy does not have.
#include <fmt/format.h>

#include <algorithm>
#include <iterator>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "src/report/diagnosis_report.hpp"
#include "src/report/json_layout.hpp"
#include "src/report/report.hpp"
#include "src/report/report_summary.hpp"
#include "src/verdict/signoff.hpp"

namespace kvaudit {
namespace {

// What a bf16 ULP count means, for the results table.
constexpr const char* kUlpExplanation =
    "max_ulp: the largest distance in bf16 units in the last place between reference and "
    "candidate, each rounded to bf16, with the reference value where it is (in parentheses). It "
    "is not judged. It is counted only where |reference| >= 2^-4 of the largest |reference| of "
    "the same (row, head) (and >= rel_floor, 2^-8): an output's errors are absolute at the scale "
    "of its terms, so below that a bf16 ULP is too fine to mean anything (an output 0.01 that "
    "changes sign moves by about 30,800 ULPs) and the absolute metrics judge it. Adjacent bf16 "
    "values are 1 apart and a factor of 2 is 128 apart; a clean kernel stays at a few ULPs, "
    "e4m3 storage (quantization, total) costs up to about 2^-4 of the row's scale, tens to "
    "hundreds of ULPs.";

// ---- Markdown building blocks ------------------------------------------------------------------

using Markdown = fmt::memory_buffer;

template <typename... Args>
void append(Markdown& md, fmt::format_string<Args...> format, Args&&... args) {
  fmt::format_to(std::back_inserter(md), format, std::forward<Args>(args)...);
}

// A table cell: pipes escaped, line breaks folded into spaces.
std::string cell(const std::string& text) {
  std::string escaped;
  for (const char c : text) {
    if (c == '|') {
      escaped += "\\|";
    } else if (c == '\n' || c == '\r') {
      escaped += ' ';
    } else {
      escaped += c;
    }
  }
  return escaped;
}

std::string code(const std::string& text) { return fmt::format("`{}`", cell(text)); }

// A free-form object's fields as a key/value table (json_layout.hpp).
void key_value_table(Markdown& md, const nlohmann::json& object) {
  const JsonObjectLayout layout = json_object_layout(object, JsonListings::kAsFields);
  if (layout.fields.empty()) {
    append(md, "(none recorded)\n\n");
    return;
  }
  append(md, "| key | value |\n| --- | --- |\n");
  for (const auto& [key, text] : layout.fields) append(md, "| {} | {} |\n", cell(key), cell(text));
  append(md, "\n");
}

void json_table(Markdown& md, const JsonTable& table) {
  append(md, "|");
  for (const std::string& column : table.columns) append(md, " {} |", cell(column));
  append(md, "\n|");
  for (std::size_t i = 0; i < table.columns.size(); ++i) append(md, " --- |");
  append(md, "\n");
  for (const std::vector<std::string>& row : table.rows) {
    append(md, "|");
    for (const std::string& text : row) append(md, " {} |", cell(text));
    append(md, "\n");
  }
  append(md, "\n");
}

void verdict_section(Markdown& md, const ReportModel& model) {
  const CheckRun& run = model.run;
  const RunCounts& counts = model.counts;
  append(md, "# kvaudit check report\n\n");
  append(md, "**Verdict: {}** — policy {}, backend {}: {} comparisons, {} failed",
         model.pass ? "PASS" : "FAIL", code(run.policy.name), code(backend_text(run)),
         counts.comparisons, counts.failed);
  if (counts.failed_report_only > 0) {
    append(md, " (and {} failed report-only)", counts.failed_report_only);
  }
  append(md, "; {} integrity checks, {} failed.\n\n", counts.integrity_checks,
         counts.integrity_failed);
  const std::vector<MeasurementGap>& gaps = model.unmeasured;
  if (!gaps.empty()) {
    append(md, "**{}:** {}.\n\n",
           run.policy.quantization_sets_exit ? "Sign-off incomplete" : "Not measured",
           gaps_headline(gaps));
  }
  if (!run.first_divergence) return;
  // Its fields in report.json's (alphabetical) key order.
  const Divergence& d = *run.first_divergence;
  append(md,
         "First divergence: comparison {} head {} layer_id {} reason {} request {} row {} step {} "
         "\n\n",
         code(comparison_name(d.comparison)), code(std::to_string(d.head)),
         code(std::to_string(d.layer_id)), code(d.reason), code(std::to_string(d.request)),
         code(std::to_string(d.row)), code(std::to_string(d.step)));
}

void dump_section(Markdown& md, const CheckRun& run) {
  append(md, "## Appendix: dump\n\n| key | value |\n| --- | --- |\n");
  append(md, "| path | {} |\n", code(run.dump_path));
  append(md, "| SHA-256 | {} |\n",
         code(run.dump_sha256.empty() ? "not computed" : run.dump_sha256));
  // Scalars go in the table; arrays of objects (layers, steps) get a table of their own.
  const JsonObjectLayout layout = json_object_layout(run.dump_summary, JsonListings::kAsTables);
  for (const auto& [key, text] : layout.fields) append(md, "| {} | {} |\n", cell(key), cell(text));
  append(md, "\n");
  for (const JsonTable& table : layout.tables) {
    append(md, "### {}\n\n", cell(table.name));
    json_table(md, table);
  }
}

void backend_section(Markdown& md, const CheckRun& run) {
  append(md, "## Appendix: backend\n\nBackend {}.\n\n", code(backend_text(run)));
  key_value_table(md, run.backend_description);
}

void policy_section(Markdown& md, const Policy& policy) {
  append(md, "## Appendix: policy\n\n");
  append(md,
         "Policy {}. NaN/Inf mismatches fail every comparison and always set the exit status; "
         "then each limit below is checked. Quantization and total {}\n\n",
         code(policy.name),
         policy.quantization_sets_exit
             ? "**set** the exit status (sign-off)."
             : "are judged against the sign-off limits but are **report-only** (run with "
               "`--signoff` to make them count).");
  append(md, "max_rel denominator floor (reported, not judged): {} — {}\n\n",
         short_number(policy.rel_floor), cell(policy.rel_floor_derivation));
  append(md,
         "| comparison | metric | limit | sets exit | derivation |\n"
         "| --- | --- | --- | --- | --- |\n");
  for (const Comparison comparison : all_comparisons()) {
    const ComparisonLimits& limits = limits_for(policy, comparison);
    for (const Limit limit : all_limits()) {
      const std::optional<double> value = limit_value(limits, limit);
      const auto derivation = limits.derivations.find(limit);
      const char* sets_exit = !value                                     ? "-"
                              : comparison_sets_exit(policy, comparison) ? "yes"
                                                                         : "no";
      append(md, "| {} | {} | {} | {} | {} |\n", comparison_name(comparison), limit_name(limit),
             value ? short_number(*value) : "not judged", sets_exit,
             cell(derivation == limits.derivations.end() ? "" : derivation->second));
    }
  }
  append(md, "\n");
}

// "12 (ref 1.031)": the ULP count with the reference value it was counted at, which says how
// fine a ULP is there; "0" where nothing differs.
std::string ulp_cell(const ComparisonMetrics& m) {
  if (m.max_ulp_bf16 == 0.0 || m.max_ulp_at.row < 0) return ulp_text(m.max_ulp_bf16);
  return fmt::format("{} (ref {})", ulp_text(m.max_ulp_bf16), short_number(m.max_ulp_at.reference));
}

void result_row(Markdown& md, const ComparisonResult& r) {
  const ComparisonMetrics& m = r.metrics;
  const char* emphasis = r.judgement.pass ? "" : "**";
  append(md, "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {}{}{} | {} | {} |\n", r.step,
         r.layer_id, comparison_name(r.comparison), short_number(m.max_abs),
         short_number(max_abs_over_ref_max(m)), short_number(m.rel_l2), short_number(m.cos_diff),
         ulp_cell(m), m.has_lse ? short_number(m.lse_max_abs) : "-", m.nonfinite_mismatches,
         emphasis, result_text(r), emphasis, location_text(worst_location(r)),
         cell(fmt::format("{}", fmt::join(r.judgement.reasons, "; "))));
}

void results_section(Markdown& md, const CheckRun& run) {
  append(md, "## Results per step, layer and comparison\n\n");
  if (run.comparisons.empty()) {
    append(md, "No comparisons ran.\n\n");
    return;
  }
  append(md,
         "Kernel = backend vs R8\u2032 (R8 on the pool the backend read: exact attention on the "
         "dequantized FP8 pool it read, its own pool after its writes); cache = R8\u2032 vs R8 "
         "on the reference replay's pool (zero while the cache is intact); quantization = R8 vs Rs "
         "(exact attention on the source KV); total = backend vs Rs; captured = the dump's own "
         "out/lse vs R8. Worst = (row, head, dim) of the first NaN/Inf mismatch, else of "
         "max_abs.\n\n");
  append(md, "{}\n\n", kUlpExplanation);
  append(md,
         "| step | layer | comparison | max_abs | max_abs/ref_max | rel_l2 | cos_diff | max_ulp | "
         "lse_err | NaN/Inf mismatches | result | worst (row,head,dim) | reasons |\n"
         "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | --- "
         "|\n");
  for (const ComparisonResult& r : run.comparisons) result_row(md, r);
  append(md, "\n");
}

// Per layer, the worst quantization / total / kernel figures over all steps: what FP8 storage
// costs in that layer, and what the kernel adds on top.
struct LayerWorst {
  double quant_rel_l2 = 0, quant_cos = 0, quant_over_max = 0, quant_lse = 0;
  double total_rel_l2 = 0, kernel_rel_l2 = 0;
  bool has_quant = false, has_total = false, has_kernel = false, pass = true;

  void add(const ComparisonResult& r) {
    const ComparisonMetrics& m = r.metrics;
    switch (r.comparison) {
      case Comparison::kQuantization:
        has_quant = true;
        quant_rel_l2 = worse(quant_rel_l2, m.rel_l2);
        quant_cos = worse(quant_cos, m.cos_diff);
        quant_over_max = worse(quant_over_max, max_abs_over_ref_max(m));
        if (m.has_lse) quant_lse = worse(quant_lse, m.lse_max_abs);
        pass = pass && r.judgement.pass;
        break;
      case Comparison::kTotal:
        has_total = true;
        total_rel_l2 = worse(total_rel_l2, m.rel_l2);
        pass = pass && r.judgement.pass;
        break;
      case Comparison::kKernel:
        has_kernel = true;
        kernel_rel_l2 = worse(kernel_rel_l2, m.rel_l2);
        break;
      case Comparison::kCaptured:
      case Comparison::kCache:
      case Comparison::kCapturedRead:
      case Comparison::kCapturedCache:
        break;
    }
  }

  // std::max(NaN, x) keeps the first argument; the comparison as written lets NaN win.
  static double worse(double current, double value) {
    return !(value <= current) ? value : current;
  }
};

void signoff_row(Markdown& md, int layer, const LayerWorst& w, const Saturation& saturation) {
  auto quant = [&w](double value) { return w.has_quant ? short_number(value) : "-"; };
  const std::string ratio = w.has_kernel && w.has_quant && w.quant_rel_l2 > 0
                                ? short_number(w.kernel_rel_l2 / w.quant_rel_l2)
                                : "-";
  append(md, "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n", layer, quant(w.quant_rel_l2),
         quant(w.quant_cos), quant(w.quant_over_max), quant(w.quant_lse),
         saturation.known ? saturation_text(saturation) : "-",
         w.has_kernel ? short_number(w.kernel_rel_l2) : "-", ratio,
         w.has_total ? short_number(w.total_rel_l2) : "-", w.pass ? "PASS" : "**FAIL**");
}

void signoff_section(Markdown& md, const CheckRun& run) {
  append(md, "## Quantization sign-off per layer\n\n");
  std::map<int, LayerWorst> layers;
  for (const ComparisonResult& r : run.comparisons) layers[r.layer_id].add(r);
  const bool any_quant = std::any_of(layers.begin(), layers.end(),
                                     [](const auto& entry) { return entry.second.has_quant; });
  if (!any_quant) {
    append(md,
           "No quantization comparisons: the dump holds no `kv_source` covering the tokens the "
           "steps read, so R8 - Rs could not be measured (see the summary).\n\n");
    return;
  }
  append(md,
         "Worst value over the steps of each layer. kernel/quant = kernel rel_l2 / quantization "
         "rel_l2: how much the kernel adds relative to what FP8 storage costs. Saturated codes: "
         "e4m3 codes +-448 among the codes the layer's steps read (the step with the most), "
         "values past 464 * kv_scale that satfinite clamped: they explain a large quantization "
         "error. Sign-off limits: see the policy ({}).\n\n",
         run.policy.quantization_sets_exit ? "they set the exit status" : "report-only here");
  append(md,
         "| layer | quant rel_l2 | quant cos_diff | quant max_abs/ref_max | quant lse_err | "
         "saturated codes | kernel rel_l2 | kernel/quant | total rel_l2 | sign-off |\n"
         "| ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- |\n");
  std::map<int, Saturation> saturation = layer_saturation(run);
  for (const auto& [layer, w] : layers) {
    if (w.has_quant || w.has_total) signoff_row(md, layer, w, saturation[layer]);
  }
  append(md, "\n");
}

void step_row(Markdown& md, const StepSummary& s) {
  auto worst = [&s](Comparison comparison) {
    const auto it = s.worst.find(comparison);
    if (it == s.worst.end()) return std::string("-");
    return fmt::format("{} (L{})", short_number(it->second.rel_l2), it->second.layer_id);
  };
  auto nonfinite = [&s](Comparison comparison) {
    const auto it = s.worst.find(comparison);
    return it == s.worst.end() ? std::string("-") : std::to_string(it->second.nonfinite_mismatches);
  };
  append(md, "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} / {} | {} |\n", s.step, s.layers,
         pool_state_name(s.backend_pool), s.damaged_slots, captured_text(s),
         worst(Comparison::kKernel), worst(Comparison::kCache), worst(Comparison::kTotal),
         worst(Comparison::kQuantization), nonfinite(Comparison::kKernel),
         nonfinite(Comparison::kCache), s.pass ? "PASS" : "**FAIL**");
}

void steps_section(Markdown& md, const std::vector<StepSummary>& steps) {
  if (steps.empty()) return;
  append(md, "## Across steps\n\n");
  append(md,
         "Per step, over the layers checked: whether the backend's pool and the captured pool "
         "are intact (damaged: how many slots differ from the reference replay's pool; captured "
         "damage new at this step or carried from an earlier one), and the worst rel_l2 of each "
         "comparison with its layer, so corruption shows as the step it starts at and the error "
         "that follows it.\n\n");
  append(md,
         "| step | layers | backend pool | damaged slots | captured pool | kernel rel_l2 | cache "
         "rel_l2 | total rel_l2 | quantization rel_l2 | NaN/Inf mismatches kernel / cache | "
         "result |\n"
         "| ---: | ---: | --- | ---: | --- | --- | --- | --- | --- | ---: | --- |\n");
  for (const StepSummary& s : steps) step_row(md, s);
  append(md, "\n");
}

// "written_slots 12, unwritten_slots 12, nan_codes_in_pool 12 (data)": passing checks per kind.
std::string passing_counts_text(const CheckRun& run) {
  std::map<IntegrityCheck, int> passing;
  for (const IntegrityFinding& f : run.integrity) passing[f.check] += f.pass ? 1 : 0;
  std::vector<std::string> parts;
  for (const auto& [check, count] : passing) {
    parts.push_back(fmt::format("{} {}{}", integrity_check_name(check), count,
                                check == IntegrityCheck::kNanCodesInPool ? " (data)" : ""));
  }
  return fmt::format("{}", fmt::join(parts, ", "));
}

void integrity_section(Markdown& md, const ReportModel& model) {
  const CheckRun& run = model.run;
  append(md, "## Cache integrity\n\n");
  if (run.integrity.empty()) {
    append(md, "No integrity checks ran (no backend pool to check, or no step).\n\n");
    return;
  }
  const RunCounts& counts = model.counts;
  append(md, "{} checks, {} failed. Passing checks are counted, not listed: {}.\n\n",
         counts.integrity_checks, counts.integrity_failed, passing_counts_text(run));
  if (counts.integrity_failed == 0) return;
  append(md,
         "| step | layer | check | result | classification | slots | message |\n"
         "| ---: | ---: | --- | --- | --- | --- | --- |\n");
  for (const IntegrityFinding& f : run.integrity) {
    if (f.pass) continue;
    append(md, "| {} | {} | {} | {} | {} | {} | {} |\n", f.step, f.layer_id,
           cell(integrity_check_name(f.check)), f.pass ? "PASS" : "**FAIL**",
           cell(slot_class_name(f.classification)),
           cell(fmt::format("{}", fmt::join(f.slots, ", "))), cell(f.detail));
  }
  append(md, "\n");
}

void notes_section(Markdown& md, const CheckRun& run) {
  if (run.notes.empty()) return;
  append(md, "## Notes\n\n");
  for (const std::string& note : run.notes) append(md, "- {}\n", note);
  append(md, "\n");
}

void timing_section(Markdown& md, const CheckRun& run) {
  append(md, "## Appendix: timing\n\n| quantity | value |\n| --- | --- |\n");
  append(md, "| reference (exact, on the {}) | {} s |\n",
         run.reference_device == "cuda" ? "GPU" : "CPU", short_number(run.reference_seconds));
  if (run.reference_seconds > 0) {
    append(md, "| reference throughput | {} rows x heads x tokens / s |\n",
           short_number(run.reference_rows_heads_tokens / run.reference_seconds));
  }
  append(md, "| backend | {} s |\n", short_number(run.backend_seconds));
  if (run.diagnosis_seconds > 0) {
    append(md, "| diagnosis | {} s |\n", short_number(run.diagnosis_seconds));
  }
  if (!run.certification.empty()) {
    append(md, "| reference certification (50 digits) | {} s |\n",
           short_number(run.certification_seconds));
  }
  if (const nlohmann::json& protocol = run.backend_protocol; protocol.is_object()) {
    append(md, "| of which protocol overhead (exec backend) | {} s over {} steps |\n",
           short_number(protocol.value("overhead_seconds", 0.0)), protocol.value("steps", 0));
  }
  append(md, "| total | {} s |\n\n", short_number(run.total_seconds));
}

// The reference's certification on this run (src/replay/certification.hpp).
void certification_section(Markdown& md, const ReportModel& model) {
  const CheckRun& run = model.run;
  append(md, "## Appendix: reference certification\n\n");
  if (run.certification.empty()) {
    append(md, "Not certified on this run (`--certify 0`, or no step with query rows).\n\n");
    return;
  }
  const CertificationMaxima& maxima = model.certification_maxima;
  append(md,
         "At {} sample sites R8 of one (row, head) was recomputed in 50 decimal digits (Boost "
         "cpp_bin_float_50): the reference deviates by at most {} (out, relative to the row's "
         "largest |out|) and {} (lse, absolute); the bound is {}.\n\n"
         "| step | layer | row | head | out relative | lse absolute |\n"
         "| ---: | ---: | ---: | ---: | ---: | ---: |\n",
         run.certification.size(), short_number(maxima.out_relative),
         short_number(maxima.lse_absolute), short_number(kReferenceBound));
  for (const CertificationSample& s : run.certification) {
    append(md, "| {} | {} | {} | {} | {} | {} |\n", s.step, s.layer_id, s.row, s.head,
           short_number(s.out_relative), short_number(s.lse_absolute));
  }
  append(md, "\n");
}

void provenance_section(Markdown& md, const CheckRun& run) {
  // report.json's provenance keys, in its (alphabetical) order; completed by make_report_model.
  const Provenance& provenance = run.provenance;
  append(md, "## Provenance\n\n| key | value |\n| --- | --- |\n");
  append(md, "| command_line | {} |\n", cell(provenance.command_line));
  append(md, "| date | {} |\n", cell(provenance.date_utc));
  append(md, "| host | {} |\n", cell(provenance.host));
  append(md, "| kvaudit_version | {} |\n\n", cell(provenance.kvaudit_version));
  append(md, "### Build and machine\n\n| key | value |\n| --- | --- |\n");
  append(md, "| git_revision | {} |\n", cell(provenance.git_revision));
  append(md, "| cpu | {} |\n", cell(provenance.cpu));
  append(md, "| backend | {} |\n", cell(backend_machine_text(run)));
  append(md, "| dump SHA-256 | {} |\n\n",
         code(run.dump_sha256.empty() ? "not computed" : run.dump_sha256));
  if (!provenance.merged_from.empty()) {
    append(md,
           "### Merged from\n\nThis run is `kvaudit merge` of {} parts; timing above is summed "
           "over them.\n\n| shard | part file | host | date | command_line |\n"
           "| --- | --- | --- | --- | --- |\n",
           provenance.merged_from.size());
    for (const MergedPart& part : provenance.merged_from) {
      append(md, "| {} | {} | {} | {} | {} |\n", part.shard, cell(part.file), cell(part.host),
             cell(part.date_utc), cell(part.command_line));
    }
    append(md, "\n");
  }
  append(md,
         "Produced by {}; report.json beside this file holds every number above "
         "(docs/report-schema.md).\n",
         code(fmt::format("kvaudit {}", kvaudit_version())));
}

// ---- the summary a person signs ------------------------------------------------------------

const char* state_mark(LineState state) {
  switch (state) {
    case LineState::kPass:
      return "**PASS** ";
    case LineState::kFail:
      return "**FAIL** ";
    case LineState::kReportOnly:
      return "**over the sign-off limit (report-only)** ";
    case LineState::kUnmeasured:
      return "**NOT MEASURED** ";
    case LineState::kInfo:
      return "";
  }
  return "";
}

void summary_section(Markdown& md, const CheckRun& run) {
  append(md, "## Summary\n\n");
  for (const SummaryLine& line : summary_lines(run)) {
    append(md, "- {}{}\n", state_mark(line.state), line.text);
  }
  append(md, "\n");
}

// Under --signoff: who signed for what, with which key, and the report's checksum; the signature
// itself is beside this file (report.sig over report.manifest.json, which lists this file too).
void signoff_block(Markdown& md, const std::optional<SignOffRecord>& signoff) {
  if (!signoff) return;
  auto text = [](const std::string& given) {
    return given.empty() ? std::string("(not given)") : cell(given);
  };
  append(md, "## Sign-off\n\n| field | value |\n| --- | --- |\n");
  append(md, "| signed by | {} |\n| model | {} |\n| deployment | {} |\n",
         text(signoff->signer.signed_by), text(signoff->signer.model),
         text(signoff->signer.deployment));
  append(md, "| public key (Ed25519) | {} |\n", code(signoff->signer.public_key));
  append(md, "| report checksum (SHA-256) | {} |\n\n", code(signoff->digest.value));
  append(md,
         "The signature is `report.sig`, an Ed25519 signature over `report.manifest.json`, which "
         "lists the SHA-256 of report.json, report.md (this file) and report.html and the "
         "checksum of report.json ({}). Check all of it with `kvaudit verify-report DIR "
         "--public-key KEY`, KEY the signer's public key.\n\n",
         signoff->digest.covers);
}

// Without --signoff: report.json's checksum, called what it is (no signature: nobody vouches for
// it).
void checksum_section(Markdown& md, const std::optional<ReportDigest>& checksum) {
  if (!checksum) return;
  append(md, "## Checksum\n\n| field | value |\n| --- | --- |\n");
  append(md, "| report checksum (SHA-256) | {} |\n\n", code(checksum->value));
  append(md,
         "This report is not signed (made without `--signoff`). report.json states the checksum "
         "above ({}). It is a checksum, not a signature: it detects a report.json changed by "
         "accident, but anyone who edits the report can compute it again. Recompute it with "
         "`kvaudit verify-report DIR`.\n\n",
         checksum->covers);
}

void failures_section(Markdown& md, const CheckRun& run) {
  const std::vector<FailureItem> items = failure_items(run);
  if (items.empty()) return;
  append(md, "## Failures and their likely cause\n\n");
  for (const FailureItem& item : items) {
    append(md, "### {}{}\n\n", item.title, item.sets_exit ? "" : " (report-only)");
    for (const std::string& detail : item.details) append(md, "- {}\n", detail);
    if (!item.likely_cause.empty()) append(md, "\nLikely cause: {}\n", item.likely_cause);
    append(md, "\n");
  }
}

}  // namespace

std::string render_markdown(const CheckRun& run) { return render_markdown(make_report_model(run)); }

// The served scale against the recommended one (CheckRun::scales; src/verdict/signoff.hpp).
void scales_section(Markdown& md, const CheckRun& run) {
  if (run.scales.empty()) return;
  append(md, "## Scales: the served kv_scale against the recommended one\n\n");
  append(md,
         "FP8-storage error alone (attention on the source quantized with the scale vs on the "
         "source, out rel_l2 over every step; `kvaudit calibrate` gives every candidate). MLA "
         "caches one tensor (the latent is both K and V): one scale serves both, k_scale = "
         "v_scale. A served scale fails when its error exceeds the quantization rel_l2 limit or "
         "{}x the recommended scale's (policy `scale_error_factor`).\n\n",
         run.policy.scale_error_factor);
  append(md,
         "| layer | served kv_scale | rel_l2 | saturated | underflow | recommended (k_scale = "
         "v_scale) | rel_l2 | underflow | result |\n"
         "| ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- |\n");
  for (const LayerScaleCheck& layer : run.scales) {
    const std::optional<ScaleFailure> failure = judge_served_scale(run.policy, layer);
    append(md,
           "| {} | {:.9g} | {:.3e} | {:.3g}% | {:.3g}% | {:.9g} ({}) | {:.3e} | {:.3g}% | {} |\n",
           layer.layer_id, layer.served_scale, layer.served_rel_l2,
           100.0 * layer.served_saturated_fraction, 100.0 * layer.served_underflow_fraction,
           layer.recommended_scale, cell(layer.recommended_rule), layer.recommended_rel_l2,
           100.0 * layer.recommended_underflow_fraction,
           failure ? fmt::format("FAIL: {}", scale_cause_name(failure->cause)) : "PASS");
  }
  append(md, "\n");
  for (const ScaleFailure& failure : scale_failures(run)) append(md, "- {}\n", failure.sentence);
  if (!scale_failures(run).empty()) append(md, "\n");
}

std::string render_markdown(const ReportModel& model) {
  const CheckRun& run = model.run;
  Markdown md;
  verdict_section(md, model);
  signoff_block(md, model.signoff);
  summary_section(md, run);
  failures_section(md, run);
  append(md, "{}", render_diagnosis_markdown(run));
  signoff_section(md, run);
  scales_section(md, run);
  steps_section(md, model.steps);
  results_section(md, run);
  integrity_section(md, model);
  notes_section(md, run);
  policy_section(md, run.policy);
  dump_section(md, run);
  backend_section(md, run);
  timing_section(md, run);
  certification_section(md, model);
  provenance_section(md, run);
  checksum_section(md, model.checksum);
  return fmt::to_string(md);
}

}  // namespace kvaudit
