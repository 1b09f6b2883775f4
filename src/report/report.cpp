// Check-run reports: the stdout table, report.json and report.md (docs/report-schema.md,
// reports/README.md). Numbers are printed with 3-4 significant digits: every limit is a power of
// two stated with its derivation, so more digits would only suggest a precision the policy does
// not have.
#include "src/report/report.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <map>
#include <ostream>
#include <set>
#include <sstream>
#include <system_error>
#include <utility>
#include <vector>

namespace kvaudit {
namespace {

std::string sci(double value) {  // fixed width for the stdout table
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  char text[32];
  std::snprintf(text, sizeof text, "%.3e", value);
  return text;
}

std::string short_number(double value) {  // for Markdown
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  char text[32];
  std::snprintf(text, sizeof text, "%.4g", value);
  return text;
}

std::string ulp_text(double ulps) {  // a count: no exponent
  if (!std::isfinite(ulps)) return sci(ulps);
  char text[32];
  std::snprintf(text, sizeof text, "%.0f", ulps);
  return text;
}

std::string location_text(const ElementLocation& at) {
  if (at.row < 0) return "-";
  std::ostringstream text;
  text << "(" << at.row << "," << at.head << ",";
  if (at.dim >= 0) {
    text << at.dim;
  } else {
    text << "lse";
  }
  text << ")";
  return text.str();
}

std::string result_text(const ComparisonResult& result) {
  const bool counts = fails_run(result) || result.sets_exit;
  const char* verdict = result.judgement.pass ? "PASS" : "FAIL";
  return counts ? verdict : std::string(verdict) + " report-only";
}

std::string pad_left(const std::string& text, std::size_t width) {
  return text.size() >= width ? text : std::string(width - text.size(), ' ') + text;
}
std::string pad_right(const std::string& text, std::size_t width) {
  return text.size() >= width ? text : text + std::string(width - text.size(), ' ');
}

// ---- Markdown
// ------------------------------------------------------------------------------------

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

std::string code(const std::string& text) {
  // Appended piecewise: GCC 12 warns (-Wrestrict, a false positive) on "`" + std::string&&.
  std::string quoted = "`";
  quoted += cell(text);
  quoted += '`';
  return quoted;
}

std::string json_value_text(const nlohmann::json& value) {
  if (value.is_string()) return value.get<std::string>();
  return value.dump();
}

void key_value_table(std::ostream& md, const nlohmann::json& object) {
  if (!object.is_object() || object.empty()) {
    md << "(none recorded)\n\n";
    return;
  }
  md << "| key | value |\n| --- | --- |\n";
  for (const auto& [key, value] : object.items()) {
    md << "| " << cell(key) << " | " << cell(json_value_text(value)) << " |\n";
  }
  md << "\n";
}

bool is_array_of_objects(const nlohmann::json& value) {
  return value.is_array() && !value.empty() &&
         std::all_of(value.begin(), value.end(),
                     [](const nlohmann::json& item) { return item.is_object(); });
}

// One row per object, one column per key (in first-seen order).
void array_table(std::ostream& md, const nlohmann::json& array) {
  std::vector<std::string> columns;
  for (const nlohmann::json& item : array) {
    for (const auto& [key, value] : item.items()) {
      if (std::find(columns.begin(), columns.end(), key) == columns.end()) columns.push_back(key);
    }
  }
  md << "|";
  for (const std::string& column : columns) md << " " << cell(column) << " |";
  md << "\n|";
  for (std::size_t i = 0; i < columns.size(); ++i) md << " --- |";
  md << "\n";
  for (const nlohmann::json& item : array) {
    md << "|";
    for (const std::string& column : columns) {
      md << " " << (item.contains(column) ? cell(json_value_text(item[column])) : "") << " |";
    }
    md << "\n";
  }
  md << "\n";
}

void policy_section(std::ostream& md, const Policy& policy) {
  md << "## Policy\n\n";
  md << "Policy " << code(policy.name) << ". NaN/Inf mismatches fail every comparison and always "
     << "set the exit status; then each limit below is checked. Quantization and total "
     << (policy.quantization_sets_exit ? "**set** the exit status (sign-off)."
                                       : "are judged against the sign-off limits but are "
                                         "**report-only** (run with `--signoff` to make them "
                                         "count).")
     << "\n\n";
  md << "max_rel denominator floor (reported, not judged): " << short_number(policy.rel_floor)
     << " — " << cell(policy.rel_floor_derivation) << "\n\n";
  md << "| comparison | metric | limit | sets exit | derivation |\n"
     << "| --- | --- | --- | --- | --- |\n";
  for (const Comparison comparison : all_comparisons()) {
    const ComparisonLimits& limits = limits_for(policy, comparison);
    for (const Limit limit : all_limits()) {
      const std::optional<double> value = limit_value(limits, limit);
      const auto derivation = limits.derivations.find(limit);
      md << "| " << comparison_name(comparison) << " | " << limit_name(limit) << " | "
         << (value ? short_number(*value) : std::string("not judged")) << " | "
         << (comparison_sets_exit(policy, comparison) ? "yes" : "no") << " | "
         << cell(derivation == limits.derivations.end() ? "" : derivation->second) << " |\n";
    }
  }
  md << "\n";
}

void results_section(std::ostream& md, const CheckRun& run) {
  md << "## Results per step, layer and comparison\n\n";
  if (run.comparisons.empty()) {
    md << "No comparisons ran.\n\n";
    return;
  }
  md << "Kernel = backend vs R8 (exact attention on the dequantized FP8 pool the backend read); "
        "cache = R8 on the backend's pool vs R8 on the reference replay's pool (zero while the "
        "cache is intact); quantization = R8 vs Rs (exact attention on the source KV); total = "
        "backend vs Rs; captured = the dump's own out/lse vs R8. Worst = (row, head, dim) of the "
        "first NaN/Inf mismatch, else of "
        "max_abs.\n\n";
  md << "| step | layer | comparison | max_abs | max_abs/ref_max | rel_l2 | cos_diff | max_ulp | "
        "lse_err | NaN/Inf mismatches | result | worst (row,head,dim) | reasons |\n"
     << "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | --- "
        "|\n";
  for (const ComparisonResult& r : run.comparisons) {
    const ComparisonMetrics& m = r.metrics;
    std::string reasons;
    for (const std::string& reason : r.judgement.reasons) {
      reasons += (reasons.empty() ? "" : "; ") + reason;
    }
    md << "| " << r.step << " | " << r.layer_id << " | " << comparison_name(r.comparison) << " | "
       << short_number(m.max_abs) << " | " << short_number(max_abs_over_ref_max(m)) << " | "
       << short_number(m.rel_l2) << " | " << short_number(m.cos_diff) << " | "
       << ulp_text(m.max_ulp_bf16) << " | "
       << (m.has_lse ? short_number(m.lse_max_abs) : std::string("-")) << " | "
       << m.nonfinite_mismatches << " | " << (r.judgement.pass ? "" : "**") << result_text(r)
       << (r.judgement.pass ? "" : "**") << " | " << location_text(worst_location(r)) << " | "
       << cell(reasons) << " |\n";
  }
  md << "\n";
}

// Per layer, the worst quantization / total / kernel figures over all steps: what FP8 storage
// costs in that layer, and what the kernel adds on top.
void signoff_section(std::ostream& md, const CheckRun& run) {
  md << "## Quantization sign-off per layer\n\n";
  struct LayerWorst {
    int comparisons = 0;
    double quant_rel_l2 = 0, quant_cos = 0, quant_over_max = 0, quant_lse = 0;
    double total_rel_l2 = 0, kernel_rel_l2 = 0;
    bool has_quant = false, has_total = false, has_kernel = false, pass = true;
  };
  std::map<int, LayerWorst> layers;
  for (const ComparisonResult& r : run.comparisons) {
    LayerWorst& w = layers[r.layer_id];
    const ComparisonMetrics& m = r.metrics;
    // std::max(NaN, x) keeps the first argument; comparisons as written let NaN win.
    auto worse = [](double current, double value) { return !(value <= current) ? value : current; };
    switch (r.comparison) {
      case Comparison::kQuantization:
        w.has_quant = true;
        w.quant_rel_l2 = worse(w.quant_rel_l2, m.rel_l2);
        w.quant_cos = worse(w.quant_cos, m.cos_diff);
        w.quant_over_max = worse(w.quant_over_max, max_abs_over_ref_max(m));
        if (m.has_lse) w.quant_lse = worse(w.quant_lse, m.lse_max_abs);
        w.pass = w.pass && r.judgement.pass;
        break;
      case Comparison::kTotal:
        w.has_total = true;
        w.total_rel_l2 = worse(w.total_rel_l2, m.rel_l2);
        w.pass = w.pass && r.judgement.pass;
        break;
      case Comparison::kKernel:
        w.has_kernel = true;
        w.kernel_rel_l2 = worse(w.kernel_rel_l2, m.rel_l2);
        break;
      case Comparison::kCaptured:
      case Comparison::kCache:
        break;
    }
  }
  const bool any_quant = std::any_of(layers.begin(), layers.end(),
                                     [](const auto& entry) { return entry.second.has_quant; });
  if (!any_quant) {
    md << "No quantization comparisons: the dump holds no `kv_source` covering the tokens the "
          "steps read, so R8 - Rs could not be measured.\n\n";
    return;
  }
  md << "Worst value over the steps of each layer. kernel/quant = kernel rel_l2 / quantization "
        "rel_l2: how much the kernel adds relative to what FP8 storage costs. Sign-off limits: "
        "see the policy ("
     << (run.policy.quantization_sets_exit ? "they set the exit status" : "report-only here")
     << ").\n\n";
  md << "| layer | quant rel_l2 | quant cos_diff | quant max_abs/ref_max | quant lse_err | "
        "kernel rel_l2 | kernel/quant | total rel_l2 | sign-off |\n"
     << "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n";
  for (const auto& [layer, w] : layers) {
    if (!w.has_quant && !w.has_total) continue;
    const std::string ratio = w.has_kernel && w.has_quant && w.quant_rel_l2 > 0
                                  ? short_number(w.kernel_rel_l2 / w.quant_rel_l2)
                                  : std::string("-");
    md << "| " << layer << " | " << (w.has_quant ? short_number(w.quant_rel_l2) : "-") << " | "
       << (w.has_quant ? short_number(w.quant_cos) : "-") << " | "
       << (w.has_quant ? short_number(w.quant_over_max) : "-") << " | "
       << (w.has_quant ? short_number(w.quant_lse) : "-") << " | "
       << (w.has_kernel ? short_number(w.kernel_rel_l2) : "-") << " | " << ratio << " | "
       << (w.has_total ? short_number(w.total_rel_l2) : "-") << " | "
       << (w.pass ? "PASS" : "**FAIL**") << " |\n";
  }
  md << "\n";
}

std::string pool_text(PoolState state, std::int64_t slots, const char* unit) {
  if (state == PoolState::kNotChecked) return "-";
  if (state == PoolState::kIntact) return "intact";
  if (slots == 0) return "damaged";  // e.g. storage changed: no slot-level count
  return "damaged (" + std::to_string(slots) + " " + unit + ")";
}

std::string worst_text(const StepSummary& summary, Comparison comparison) {
  const auto it = summary.worst.find(comparison);
  if (it == summary.worst.end()) return "-";
  std::string text = sci(it->second.rel_l2) + " L" + std::to_string(it->second.layer_id);
  if (it->second.nonfinite_mismatches > 0) text += " nan/inf";
  return text;
}

std::string captured_text(const StepSummary& summary) {
  if (summary.captured_pool != PoolState::kDamaged) {
    return pool_text(summary.captured_pool, 0, "");
  }
  std::string text = "damaged (" + std::to_string(summary.new_captured_slots) + " new";
  if (summary.carried_captured_slots > 0) {
    text += ", " + std::to_string(summary.carried_captured_slots) + " carried";
  }
  return text + ")";
}

void steps_section(std::ostream& md, const CheckRun& run) {
  const std::vector<StepSummary> steps = summarize_steps(run);
  if (steps.empty()) return;
  md << "## Across steps\n\n";
  md << "Per step, over the layers checked: whether the backend's pool and the captured pool "
        "are intact (damaged: how many slots differ from the reference replay's pool; captured "
        "damage new at this step or carried from an earlier one), and the worst rel_l2 of each "
        "comparison with its layer, so corruption shows as the step it starts at and the error "
        "that follows it.\n\n";
  md << "| step | layers | backend pool | damaged slots | captured pool | kernel rel_l2 | cache "
        "rel_l2 | total rel_l2 | quantization rel_l2 | NaN/Inf mismatches kernel / cache | "
        "result |\n"
     << "| ---: | ---: | --- | ---: | --- | --- | --- | --- | --- | ---: | --- |\n";
  auto worst = [](const StepSummary& s, Comparison comparison) {
    const auto it = s.worst.find(comparison);
    if (it == s.worst.end()) return std::string("-");
    return short_number(it->second.rel_l2) + " (L" + std::to_string(it->second.layer_id) + ")";
  };
  for (const StepSummary& s : steps) {
    auto nonfinite = [&s](Comparison comparison) {
      const auto it = s.worst.find(comparison);
      return it == s.worst.end() ? std::string("-")
                                 : std::to_string(it->second.nonfinite_mismatches);
    };
    md << "| " << s.step << " | " << s.layers << " | " << pool_state_name(s.backend_pool) << " | "
       << s.damaged_slots << " | " << captured_text(s) << " | " << worst(s, Comparison::kKernel)
       << " | " << worst(s, Comparison::kCache) << " | " << worst(s, Comparison::kTotal) << " | "
       << worst(s, Comparison::kQuantization) << " | " << nonfinite(Comparison::kKernel) << " / "
       << nonfinite(Comparison::kCache) << " | " << (s.pass ? "PASS" : "**FAIL**") << " |\n";
  }
  md << "\n";
}

void integrity_section(std::ostream& md, const CheckRun& run) {
  md << "## Cache integrity\n\n";
  if (run.integrity.empty()) {
    md << "No integrity checks ran (no backend pool to check, or no step).\n\n";
    return;
  }
  const RunCounts counts = count_results(run);
  md << counts.integrity_checks << " checks, " << counts.integrity_failed << " failed.\n\n";
  md << "| step | layer | check | result | classification | slots | message |\n"
     << "| ---: | ---: | --- | --- | --- | --- | --- |\n";
  for (const IntegrityFinding& f : run.integrity) {
    std::string slots;
    for (const std::int64_t slot : f.slots)
      slots += (slots.empty() ? "" : ", ") + std::to_string(slot);
    md << "| " << f.step << " | " << f.layer_id << " | " << cell(integrity_check_name(f.check))
       << " | " << (f.pass ? "PASS" : "**FAIL**") << " | "
       << cell(slot_class_name(f.classification)) << " | " << cell(slots) << " | " << cell(f.detail)
       << " |\n";
  }
  md << "\n";
}

}  // namespace

std::string verdict_summary(const CheckRun& run) {
  const RunCounts counts = count_results(run);
  std::ostringstream text;
  text << "verdict: " << (run.pass() ? "PASS" : "FAIL") << " (policy " << run.policy.name
       << ", backend " << (run.backend.empty() ? "none" : run.backend) << ", " << counts.comparisons
       << " comparisons, " << counts.failed << " failed";
  if (counts.failed_report_only > 0) {
    text << ", " << counts.failed_report_only << " failed report-only";
  }
  text << ", " << counts.integrity_checks << " integrity checks, " << counts.integrity_failed
       << " failed)";
  return text.str();
}

void print_comparison_table(std::ostream& out, const CheckRun& run) {
  static const std::size_t kWidths[] = {5, 6, 13, 10, 10, 10, 8, 10, 8, 17};
  const char* headers[] = {"step",     "layer",   "comparison", "max_abs", "rel_l2",
                           "cos_diff", "max_ulp", "lse_err",    "nan/inf", "result"};
  for (std::size_t i = 0; i < std::size(headers); ++i) {
    // Text columns left-aligned, numbers right-aligned.
    out << (i == 2 || i == 9 ? pad_right(headers[i], kWidths[i]) : pad_left(headers[i], kWidths[i]))
        << " ";
  }
  out << "worst (row,head,dim)\n";
  for (const ComparisonResult& r : run.comparisons) {
    const ComparisonMetrics& m = r.metrics;
    out << pad_left(std::to_string(r.step), kWidths[0]) << " "
        << pad_left(std::to_string(r.layer_id), kWidths[1]) << " "
        << pad_right(comparison_name(r.comparison), kWidths[2]) << " "
        << pad_left(sci(m.max_abs), kWidths[3]) << " " << pad_left(sci(m.rel_l2), kWidths[4]) << " "
        << pad_left(sci(m.cos_diff), kWidths[5]) << " "
        << pad_left(ulp_text(m.max_ulp_bf16), kWidths[6]) << " "
        << pad_left(m.has_lse ? sci(m.lse_max_abs) : "-", kWidths[7]) << " "
        << pad_left(std::to_string(m.nonfinite_mismatches), kWidths[8]) << " "
        << pad_right(result_text(r), kWidths[9]) << " " << location_text(worst_location(r)) << "\n";
  }
  bool header_printed = false;
  for (const ComparisonResult& r : run.comparisons) {
    if (r.judgement.pass) continue;
    if (!header_printed) {
      out << "failures:\n";
      header_printed = true;
    }
    out << "  step " << r.step << " layer " << r.layer_id << " " << comparison_name(r.comparison)
        << (fails_run(r) ? "" : " (report-only)") << ":";
    for (std::size_t i = 0; i < r.judgement.reasons.size(); ++i) {
      out << (i == 0 ? " " : "; ") << r.judgement.reasons[i];
    }
    if (r.worst_request >= 0) out << " [request " << r.worst_request << "]";
    out << "\n";
  }
}

void print_integrity_failures(std::ostream& out, const CheckRun& run) {
  bool header_printed = false;
  for (const IntegrityFinding& f : run.integrity) {
    if (f.pass) continue;
    if (!header_printed) {
      out << "integrity failures:\n";
      header_printed = true;
    }
    out << "  step " << f.step << " layer " << f.layer_id << " " << integrity_check_name(f.check);
    if (f.classification != SlotClass::kNone)
      out << " [" << slot_class_name(f.classification) << "]";
    out << ": " << f.detail << "\n";
  }
}

void print_pool_data(std::ostream& out, const CheckRun& run) {
  // Per layer, the first step and every step where the set of slots holding NaN codes changed.
  std::map<int, std::pair<std::int64_t, std::vector<std::int64_t>>> last_seen;
  bool header = false;
  for (const IntegrityFinding& f : run.integrity) {
    if (f.check != IntegrityCheck::kNanCodesInPool) continue;
    auto [it, first] = last_seen.try_emplace(f.layer_id, f.slot_count, f.slots);
    if (!first && it->second.first == f.slot_count && it->second.second == f.slots) continue;
    it->second = {f.slot_count, f.slots};
    if (!header) out << "pool data (NaN codes, where they change; every step in the report):\n";
    header = true;
    out << "  " << f.detail << "\n";
  }
}

void print_step_summary(std::ostream& out, const CheckRun& run) {
  const std::vector<StepSummary> steps = summarize_steps(run);
  if (steps.empty()) return;
  constexpr std::size_t kWidth = 28;
  out << "per step (worst rel_l2 over the layers, and where):\n"
      << pad_left("step", 5) << " " << pad_right("backend pool", kWidth) << " "
      << pad_right("captured pool", kWidth) << " " << pad_right("kernel", kWidth) << " "
      << pad_right("cache", kWidth) << " " << pad_right("total", kWidth) << " result\n";
  for (const StepSummary& s : steps) {
    out << pad_left(std::to_string(s.step), 5) << " "
        << pad_right(pool_text(s.backend_pool, s.damaged_slots, "slots"), kWidth) << " "
        << pad_right(captured_text(s), kWidth) << " "
        << pad_right(worst_text(s, Comparison::kKernel), kWidth) << " "
        << pad_right(worst_text(s, Comparison::kCache), kWidth) << " "
        << pad_right(worst_text(s, Comparison::kTotal), kWidth) << " " << (s.pass ? "PASS" : "FAIL")
        << "\n";
  }
}

void print_notes(std::ostream& out, const CheckRun& run) {
  for (const std::string& note : run.notes) out << "note: " << note << "\n";
  if (!run.first_divergence) return;
  const Divergence& d = *run.first_divergence;
  out << "first divergence (" << comparison_name(d.comparison) << "): step " << d.step << " layer "
      << d.layer_id << " request " << d.request << " row " << d.row << " head " << d.head;
  if (!d.reason.empty()) out << ": " << d.reason;
  out << "\n";
}

void print_timing(std::ostream& out, const CheckRun& run) {
  const double throughput =
      run.reference_seconds > 0.0 ? run.reference_rows_heads_tokens / run.reference_seconds : 0.0;
  std::ostringstream text;
  text << std::setprecision(4) << "timing: reference " << run.reference_seconds << " s, backend "
       << run.backend_seconds << " s, total " << run.total_seconds
       << " s\nreference throughput: " << throughput << " rows*heads*tokens/s ("
       << run.reference_rows_heads_tokens << " in all)\n";
  out << text.str();
}

void print_check_table(std::ostream& out, const CheckRun& run, bool with_timing) {
  print_comparison_table(out, run);
  print_integrity_failures(out, run);
  print_pool_data(out, run);
  print_step_summary(out, run);
  print_notes(out, run);
  if (with_timing) print_timing(out, run);
  out << verdict_summary(run) << "\n";
}

std::string render_markdown(const CheckRun& run) {
  std::ostringstream md;
  const RunCounts counts = count_results(run);
  md << "# kvaudit check report\n\n";
  md << "**Verdict: " << (run.pass() ? "PASS" : "FAIL") << "** — policy " << code(run.policy.name)
     << ", backend " << code(run.backend.empty() ? "none" : run.backend) << ": "
     << counts.comparisons << " comparisons, " << counts.failed << " failed";
  if (counts.failed_report_only > 0) {
    md << " (and " << counts.failed_report_only << " failed report-only)";
  }
  md << "; " << counts.integrity_checks << " integrity checks, " << counts.integrity_failed
     << " failed.\n\n";

  if (run.first_divergence) {
    // The keys in report.json's (alphabetical) order.
    const Divergence& d = *run.first_divergence;
    md << "First divergence: comparison " << code(comparison_name(d.comparison)) << " head "
       << code(std::to_string(d.head)) << " layer_id " << code(std::to_string(d.layer_id))
       << " reason " << code(d.reason) << " request " << code(std::to_string(d.request)) << " row "
       << code(std::to_string(d.row)) << " step " << code(std::to_string(d.step)) << " \n\n";
  }

  md << "## Dump\n\n";
  md << "| key | value |\n| --- | --- |\n";
  md << "| path | " << code(run.dump_path) << " |\n";
  md << "| SHA-256 | " << code(run.dump_sha256.empty() ? "not computed" : run.dump_sha256)
     << " |\n";
  // Scalars go in the table; arrays of objects (layers, steps) get a table of their own.
  std::vector<std::pair<std::string, const nlohmann::json*>> listings;
  if (run.dump_summary.is_object()) {
    for (const auto& [key, value] : run.dump_summary.items()) {
      if (is_array_of_objects(value)) {
        listings.emplace_back(key, &value);
      } else {
        md << "| " << cell(key) << " | " << cell(json_value_text(value)) << " |\n";
      }
    }
  }
  md << "\n";
  for (const auto& [key, value] : listings) {
    md << "### " << cell(key) << "\n\n";
    array_table(md, *value);
  }

  md << "## Backend\n\n";
  md << "Backend " << code(run.backend.empty() ? "none" : run.backend) << ".\n\n";
  key_value_table(md, run.backend_description);

  policy_section(md, run.policy);
  results_section(md, run);
  signoff_section(md, run);
  steps_section(md, run);
  integrity_section(md, run);

  if (!run.notes.empty()) {
    md << "## Notes\n\n";
    for (const std::string& note : run.notes) md << "- " << note << "\n";
    md << "\n";
  }

  md << "## Timing\n\n| quantity | value |\n| --- | --- |\n";
  md << "| reference (CPU, high precision) | " << short_number(run.reference_seconds) << " s |\n";
  if (run.reference_seconds > 0) {
    md << "| reference throughput | "
       << short_number(run.reference_rows_heads_tokens / run.reference_seconds)
       << " rows x heads x tokens / s |\n";
  }
  md << "| backend | " << short_number(run.backend_seconds) << " s |\n";
  md << "| total | " << short_number(run.total_seconds) << " s |\n\n";

  // The keys of report.json's provenance, in its (alphabetical) order.
  const Provenance provenance = completed_provenance(run.provenance);
  md << "## Provenance\n\n| key | value |\n| --- | --- |\n";
  md << "| command_line | " << cell(provenance.command_line) << " |\n";
  md << "| date | " << cell(provenance.date_utc) << " |\n";
  md << "| host | " << cell(provenance.host) << " |\n";
  md << "| kvaudit_version | " << cell(provenance.kvaudit_version) << " |\n\n";
  md << "Produced by " << code(std::string("kvaudit ") + kvaudit_version())
     << "; report.json beside this file holds every number above (docs/report-schema.md).\n";
  return md.str();
}

Status write_report_dir(const std::filesystem::path& dir, const CheckRun& run) {
  if (!is_complete(run.provenance)) {
    // report.json and report.md name the same moment: fill the provenance once, for both.
    CheckRun completed = run;
    completed.provenance = completed_provenance(run.provenance);
    return write_report_dir(dir, completed);
  }
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error) {
    return bad_input(dir.string(), "cannot create the report directory: " + error.message());
  }
  const std::filesystem::path json_path = dir / "report.json";
  {
    std::ofstream out(json_path);
    // Strings from the dump (model, producer) may not be UTF-8: replace bad bytes, don't throw.
    out << to_json(run).dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    if (!out) return bad_input(json_path.string(), "cannot write the report");
  }
  const std::filesystem::path md_path = dir / "report.md";
  {
    std::ofstream out(md_path);
    out << render_markdown(run);
    if (!out) return bad_input(md_path.string(), "cannot write the report");
  }
  return ok_status();
}

}  // namespace kvaudit
