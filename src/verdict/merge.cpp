// Putting a sharded check back together (see merge.hpp). Phases: every part the same run, every
// shard exactly once with its own layers, each part's first divergence what its results give,
// then the parts in shard order (= layers in dump order, the unsharded run's order) and the
// merged run's first divergence.
#include "src/verdict/merge.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <utility>

#include "src/verdict/divergence.hpp"

namespace kvaudit {
namespace {

// One property every part of a run shares: its name in messages and its value in each part.
struct SharedProperty {
  const char* name;
  nlohmann::json first;
  nlohmann::json other;
  bool show_values = true;  // false for large objects
};

std::vector<std::string> run_notes(const ShardPart& part) {
  const std::vector<std::string>& notes = part.run.notes;
  return {notes.begin(), notes.begin() + static_cast<std::ptrdiff_t>(part.shard.run_notes)};
}

nlohmann::json signoff_json(const std::optional<SignOff>& signoff) {
  if (!signoff) return nullptr;
  return {signoff->signed_by, signoff->model, signoff->deployment, signoff->public_key};
}

std::vector<SharedProperty> shared_properties(const ShardPart& a, const ShardPart& b) {
  return {
      {"the dump's SHA-256", a.run.dump_sha256, b.run.dump_sha256},
      {"the kvaudit version", a.run.provenance.kvaudit_version, b.run.provenance.kvaudit_version},
      {"the git revision kvaudit was built from", a.run.provenance.git_revision,
       b.run.provenance.git_revision},
      {"the backend", a.run.backend, b.run.backend},
      {"the backend's description", a.run.backend_description, b.run.backend_description, false},
      {"the policy", to_json(a.run.policy), to_json(b.run.policy), false},
      {"the dump's summary", a.run.dump_summary, b.run.dump_summary, false},
      {"the shard count", a.shard.spec.count, b.shard.spec.count},
      {"the layers checked (--layers)", a.shard.selected_layers, b.shard.selected_layers},
      {"the steps reported (--steps)", a.shard.steps, b.shard.steps},
      {"--inject", a.shard.injection, b.shard.injection},
      {"--reciprocal-scale", a.shard.reciprocal_scale, b.shard.reciprocal_scale},
      {"the notes about the whole run", run_notes(a), run_notes(b), false},
      {"--diagnose", a.run.diagnose_limit, b.run.diagnose_limit},
      {"the sign-off (--signoff, --signed-by, --model, --deployment, --signing-key)",
       signoff_json(a.run.signoff), signoff_json(b.run.signoff)},
  };
}

// Every part from the same run as the first, and written by this kvaudit.
Status check_same_run(const std::vector<NamedPart>& parts) {
  const NamedPart& first = parts.front();
  for (const NamedPart& named : parts) {
    if (named.part.run.provenance.kvaudit_version != kvaudit_version()) {
      return bad_input(named.file,
                       fmt::format("written by kvaudit {}, this is kvaudit {}: merge with the "
                                   "kvaudit that wrote the parts",
                                   named.part.run.provenance.kvaudit_version, kvaudit_version()));
    }
    for (const SharedProperty& property : shared_properties(first.part, named.part)) {
      if (property.first == property.other) continue;
      const std::string values =
          property.show_values
              ? fmt::format(" ({} there, {} here)", property.first.dump(), property.other.dump())
              : "";
      return bad_input(named.file, fmt::format("differs from {} in {}{}: not parts of one run",
                                               first.file, property.name, values));
    }
  }
  return ok_status();
}

// Each shard 0..N-1 given once.
Status check_each_shard_once(const std::vector<NamedPart>& parts) {
  const int count = parts.front().part.shard.spec.count;
  std::vector<const NamedPart*> by_index(static_cast<std::size_t>(count), nullptr);
  for (const NamedPart& named : parts) {
    const NamedPart*& slot = by_index[static_cast<std::size_t>(named.part.shard.spec.index)];
    if (slot != nullptr) {
      return bad_input(named.file, fmt::format("is shard {} as {} is: each shard once",
                                               shard_name(named.part.shard.spec), slot->file));
    }
    slot = &named;
  }
  std::vector<std::string> missing;
  std::vector<std::string> given;
  for (int index = 0; index < count; ++index) {
    const NamedPart* named = by_index[static_cast<std::size_t>(index)];
    if (named == nullptr) missing.push_back(shard_name({index, count}));
    if (named != nullptr) given.push_back(fmt::format("{} ({})", named->file, index));
  }
  if (missing.empty()) return ok_status();
  return bad_input("kvaudit merge", fmt::format("missing shard {} (given: {})",
                                                fmt::join(missing, ", "), fmt::join(given, ", ")));
}

// A part holds its shard's layers, and results and findings of those layers only.
Status check_part_layers(const NamedPart& named) {
  const ShardInfo& shard = named.part.shard;
  const std::vector<int> expected = shard_layers(shard.selected_layers, shard.spec);
  if (shard.layers != expected) {
    return bad_input(
        named.file, fmt::format("holds layers [{}], but shard {} of layers [{}] is [{}]",
                                fmt::join(shard.layers, ", "), shard_name(shard.spec),
                                fmt::join(shard.selected_layers, ", "), fmt::join(expected, ", ")));
  }
  auto foreign = [&](int layer_id) {
    return std::find(expected.begin(), expected.end(), layer_id) == expected.end();
  };
  for (const ComparisonResult& result : named.part.run.comparisons) {
    if (foreign(result.layer_id)) {
      return bad_input(named.file, fmt::format("has a result of layer {}, not one of its layers",
                                               result.layer_id));
    }
  }
  for (const IntegrityFinding& finding : named.part.run.integrity) {
    if (foreign(finding.layer_id)) {
      return bad_input(named.file, fmt::format("has an integrity finding of layer {}, not one of "
                                               "its layers",
                                               finding.layer_id));
    }
  }
  for (const DiagnosisFinding& finding : named.part.run.diagnosis) {
    if (foreign(finding.layer_id)) {
      return bad_input(named.file, fmt::format("has a diagnosis of layer {}, not one of its layers",
                                               finding.layer_id));
    }
  }
  for (const StepLayerCoverage& site : named.part.run.coverage) {
    if (foreign(site.layer_id)) {
      return bad_input(named.file, fmt::format("has coverage of layer {}, not one of its layers",
                                               site.layer_id));
    }
  }
  return ok_status();
}

// Each layer id's position in the dump (dump summary "layers", in dump order).
Result<std::map<int, std::size_t>> layer_positions(const NamedPart& named) {
  const nlohmann::json& layers = named.part.run.dump_summary.value("layers", nlohmann::json());
  std::map<int, std::size_t> positions;
  for (std::size_t i = 0; layers.is_array() && i < layers.size(); ++i) {
    const auto id = layers[i].find("layer_id");
    if (id == layers[i].end() || !id->is_number_integer()) break;
    positions[id->get<int>()] = i;
  }
  if (layers.is_array() && positions.size() == layers.size()) return positions;
  return bad_input(named.file + ":/dump/summary/layers", "expected the dump's layers with ids");
}

// The first divergence of `results` in their order (the replay's rule), or the index of a failing
// followed result without a divergence point.
struct DivergenceSearch {
  std::optional<Divergence> first;
  std::optional<std::size_t> unlocated;
};

DivergenceSearch search_divergence(const std::vector<ComparisonResult>& results,
                                   const std::map<int, std::size_t>& positions) {
  DivergenceTracker tracker;
  DivergenceSearch search;
  for (std::size_t i = 0; i < results.size(); ++i) {
    const auto position = positions.find(results[i].layer_id);
    const std::size_t order = position == positions.end() ? positions.size() : position->second;
    if (!tracker.consider(order, results[i]) && !search.unlocated) search.unlocated = i;
  }
  search.first = tracker.first();
  return search;
}

nlohmann::json divergence_fields(const std::optional<Divergence>& divergence) {
  if (!divergence) return nullptr;
  return {divergence->step,  divergence->layer_id, divergence->request,
          divergence->row,   divergence->head,     comparison_name(divergence->comparison),
          divergence->reason};
}

// A part's own first divergence is the one its results give (the parts were written by one
// rule; a part edited or written otherwise is refused rather than merged into a wrong report).
Status check_part_divergence(const NamedPart& named, const std::map<int, std::size_t>& positions) {
  const CheckRun& run = named.part.run;
  const DivergenceSearch search = search_divergence(run.comparisons, positions);
  if (search.unlocated) {
    const ComparisonResult& result = run.comparisons[*search.unlocated];
    return bad_input(named.file,
                     fmt::format("result {} (step {} layer {} {}) fails, but the part gives no "
                                 "divergence point for it (shard/divergences)",
                                 *search.unlocated, result.step, result.layer_id,
                                 comparison_name(result.comparison)));
  }
  if (divergence_fields(search.first) != divergence_fields(run.first_divergence)) {
    return bad_input(named.file,
                     fmt::format("its first_divergence {} is not the one its results give {}",
                                 divergence_fields(run.first_divergence).dump(),
                                 divergence_fields(search.first).dump()));
  }
  return ok_status();
}

MergedPart merged_part(const NamedPart& named) {
  const Provenance& provenance = named.part.run.provenance;
  return MergedPart{named.file, shard_name(named.part.shard.spec), provenance.host,
                    provenance.date_utc, provenance.command_line};
}

// A part's notes about its own layers: after the run's notes, without its diagnosis budget note
// (the merged run states the budget over all parts).
std::vector<std::string> layer_notes(const NamedPart& named) {
  const CheckRun& part = named.part.run;
  std::set<std::pair<int, int>> sites;
  for (const DiagnosisFinding& finding : part.diagnosis)
    sites.insert({finding.step, finding.layer_id});
  const std::optional<std::string> budget =
      diagnosis_budget_note(sites.size(), part.diagnosis_failing_sites, part.diagnose_limit);
  std::vector<std::string> notes;
  for (std::size_t i = named.part.shard.run_notes; i < part.notes.size(); ++i) {
    if (!budget || part.notes[i] != *budget) notes.push_back(part.notes[i]);
  }
  return notes;
}

// An exec backend's protocol statistics over the parts: counts and seconds summed, the
// per-step overhead recomputed; null when no part has them.
nlohmann::json merged_protocol(const std::vector<NamedPart>& parts) {
  nlohmann::json merged;
  for (const NamedPart& named : parts) {
    const nlohmann::json& part = named.part.run.backend_protocol;
    if (!part.is_object()) continue;
    if (merged.is_null()) {
      merged = part;
      continue;
    }
    for (const auto& [key, value] : part.items()) {
      if (key == "protocol_version" || !value.is_number() || !merged[key].is_number()) continue;
      merged[key] = merged[key].get<double>() + value.get<double>();
    }
  }
  if (merged.is_object() && merged.contains("overhead_seconds")) {
    const double steps = merged.value("steps_with_compute_seconds", 0.0);
    merged["overhead_per_step_ms"] =
        steps > 0 ? nlohmann::json(1e3 * merged["overhead_seconds"].get<double>() / steps)
                  : nlohmann::json(nullptr);
  }
  return merged;
}

// The --diagnose budget over the whole run: the parts' findings (each part kept its own earliest
// sites) ordered by step, then layer in dump order, and those of the earliest `limit` sites kept,
// as the unsharded replay keeps them (src/replay/diagnosis.hpp DiagnosisBudget).
void merge_diagnosis(const std::vector<NamedPart>& parts,
                     const std::map<int, std::size_t>& positions, CheckRun& run) {
  for (const NamedPart& named : parts) {
    const CheckRun& part = named.part.run;
    run.diagnosis.insert(run.diagnosis.end(), part.diagnosis.begin(), part.diagnosis.end());
    run.diagnosis_failing_sites += part.diagnosis_failing_sites;
  }
  auto site = [&positions](const DiagnosisFinding& finding) {
    return std::pair<int, std::size_t>(finding.step, positions.at(finding.layer_id));
  };
  std::stable_sort(
      run.diagnosis.begin(), run.diagnosis.end(),
      [&site](const DiagnosisFinding& a, const DiagnosisFinding& b) { return site(a) < site(b); });
  std::set<std::pair<int, std::size_t>> kept;
  std::vector<DiagnosisFinding> findings;
  for (DiagnosisFinding& finding : run.diagnosis) {
    const auto where = site(finding);
    if (!kept.count(where) && kept.size() >= static_cast<std::size_t>(run.diagnose_limit)) break;
    kept.insert(where);
    findings.push_back(std::move(finding));
  }
  run.diagnosis = std::move(findings);
  if (const std::optional<std::string> note =
          diagnosis_budget_note(kept.size(), run.diagnosis_failing_sites, run.diagnose_limit)) {
    run.notes.push_back(*note);
  }
}

// The parts, in shard order, as one run (first divergence not yet set).
CheckRun concatenate(const std::vector<NamedPart>& parts,
                     const std::map<int, std::size_t>& positions) {
  const ShardPart& first = parts.front().part;
  CheckRun run;
  run.dump_path = first.run.dump_path;
  run.dump_sha256 = first.run.dump_sha256;
  run.backend = first.run.backend;
  run.backend_description = first.run.backend_description;
  run.policy = first.run.policy;
  run.dump_summary = first.run.dump_summary;
  run.signoff = first.run.signoff;
  run.diagnose_limit = first.run.diagnose_limit;
  run.reference_device = first.run.reference_device;
  run.notes = run_notes(first);
  for (const NamedPart& named : parts) {
    const CheckRun& part = named.part.run;
    run.comparisons.insert(run.comparisons.end(), part.comparisons.begin(), part.comparisons.end());
    run.integrity.insert(run.integrity.end(), part.integrity.begin(), part.integrity.end());
    run.coverage.insert(run.coverage.end(), part.coverage.begin(), part.coverage.end());
    run.scales.insert(run.scales.end(), part.scales.begin(), part.scales.end());
    run.certification.insert(run.certification.end(), part.certification.begin(),
                             part.certification.end());
    const std::vector<std::string> notes = layer_notes(named);
    run.notes.insert(run.notes.end(), notes.begin(), notes.end());
    if (part.reference_device != run.reference_device) run.reference_device = "mixed";
    run.reference_seconds += part.reference_seconds;
    run.reference_rows_heads_tokens += part.reference_rows_heads_tokens;
    run.backend_seconds += part.backend_seconds;
    run.read_seconds += part.read_seconds;
    run.judge_seconds += part.judge_seconds;
    run.diagnosis_seconds += part.diagnosis_seconds;
    run.certification_seconds += part.certification_seconds;
    run.total_seconds += part.total_seconds;
    run.provenance.merged_from.push_back(merged_part(named));
  }
  merge_diagnosis(parts, positions, run);
  run.backend_protocol = merged_protocol(parts);
  return run;
}

// The layers checked are layers of the dump, in dump order (as the replay selects them).
Status check_selection(const NamedPart& named, const std::map<int, std::size_t>& positions) {
  std::optional<std::size_t> last;
  for (const int layer_id : named.part.shard.selected_layers) {
    const auto position = positions.find(layer_id);
    if (position == positions.end() || (last && position->second <= *last)) {
      return bad_input(named.file + ":/shard/selected_layers",
                       fmt::format("layer {} is not the next layer of the dump", layer_id));
    }
    last = position->second;
  }
  return ok_status();
}

// Layer-outer, as the replay: the merged results' layers never go back in dump order.
Status check_layer_order(const CheckRun& run, const std::map<int, std::size_t>& positions) {
  std::size_t last = 0;
  for (const ComparisonResult& result : run.comparisons) {
    const std::size_t position = positions.at(result.layer_id);  // check_selection: present
    if (position < last) {
      return internal_error(
          "kvaudit merge",
          fmt::format("layer {} comes after a later layer of the dump", result.layer_id));
    }
    last = position;
  }
  return ok_status();
}

}  // namespace

Result<CheckRun> merge_parts(std::vector<NamedPart> parts) {
  if (parts.empty()) return bad_input("kvaudit merge", "no parts given");
  KVAUDIT_TRY(check_same_run(parts));
  KVAUDIT_TRY(check_each_shard_once(parts));
  KVAUDIT_ASSIGN_OR_RETURN(const auto positions, layer_positions(parts.front()));
  KVAUDIT_TRY(check_selection(parts.front(), positions));
  for (const NamedPart& named : parts) {
    KVAUDIT_TRY(check_part_layers(named));
    KVAUDIT_TRY(check_part_divergence(named, positions));
  }
  std::sort(parts.begin(), parts.end(), [](const NamedPart& a, const NamedPart& b) {
    return a.part.shard.spec.index < b.part.shard.spec.index;
  });
  CheckRun run = concatenate(parts, positions);
  KVAUDIT_TRY(check_layer_order(run, positions));
  run.first_divergence = search_divergence(run.comparisons, positions).first;
  const Provenance here = current_provenance();
  run.provenance.host = here.host;
  run.provenance.date_utc = here.date_utc;
  run.provenance.command_line = here.command_line;
  run.provenance.kvaudit_version = here.kvaudit_version;
  run.provenance.git_revision = here.git_revision;
  run.provenance.cpu = here.cpu;
  return run;
}

}  // namespace kvaudit
