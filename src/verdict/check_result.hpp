// What one `kvaudit check` run found: comparisons per (step, layer), integrity findings per
// (step, layer), the first divergence, notes, and the verdict. Produced by the replay
// (src/replay/replay.cpp) through the run judge (src/verdict/run_judge.hpp); reported through
// src/verdict/report_model.hpp (report.json written and read in report_json.cpp).
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "src/core/device_seconds.hpp"
#include "src/core/result.hpp"
#include "src/verdict/metrics.hpp"
#include "src/verdict/policy.hpp"

namespace kvaudit {

// Where a failing comparison first leaves its reference: the first (row, head) that breaks the
// policy on its own (src/verdict/divergence.hpp), and the request that row belongs to.
struct DivergencePoint {
  int request = -1;
  int row = -1;  // step-global query row
  int head = -1;
};

struct ComparisonResult {
  int step = 0;      // step index (S### number)
  int layer_id = 0;  // model layer id (L### number)
  Comparison comparison = Comparison::kKernel;
  ComparisonMetrics metrics;
  Judgement judgement;
  bool sets_exit = true;  // whether a failure here fails the run under the policy
  // The first failing request/row/head for bug reproduction (row is step-global).
  int worst_request = -1;
  // Set on the failing comparisons the first divergence follows (kernel, cache, captured): the
  // run's first divergence is the earliest of them (DivergenceTracker). Not in report.json, where
  // only the first divergence is; a shard's part carries them (src/verdict/shard.hpp) so that a
  // merge finds the first divergence by the same rule.
  std::optional<DivergencePoint> divergence;
};

// The integrity checks of src/replay/integrity.hpp, in the order a step reports them.
enum class IntegrityCheck {
  kStorage,          // backend pool: still one byte per element of e4m3 codes
  kWrittenSlots,     // backend pool: the step's slots hold the write rule's codes
  kUnwrittenSlots,   // backend pool: every other slot unchanged
  kNanWritten,       // backend pool: no NaN code written for a finite value
  kReadConsistency,  // backend pool: equal to the reference replay's pool
  kCapturedPool,     // the dump's kv_cache_after equal to the reference replay's pool
  kNanCodesInPool,   // data: NaN codes the pool holds (always passes)
  // kvdump v1.2, the DSA indexer's FP8 key cache (src/replay/indexer_check.hpp): not the
  // attention pool of either side, judged as integrity all the same.
  kIndexerWrittenSlots,    // captured k_cache_after: written slots hold the deployed rule's bytes
  kIndexerUnwrittenSlots,  // captured k_cache_after: every other slot unchanged
  kIndexerTopk,            // stored topk_indices: a top-k of the recomputed deployed scores
  kIndexerNonFinite,       // a non-finite value the indexer's scores are computed from
};
// "storage", "written_slots", "unwritten_slots", "nan_written", "read_consistency",
// "captured_pool", "nan_codes_in_pool", "indexer_written_slots", "indexer_unwritten_slots",
// "indexer_topk", "indexer_nonfinite": the names report.json and the reports print.
const char* integrity_check_name(IntegrityCheck check);
// The checks of the DSA indexer's cache (kvdump v1.2), not of an attention pool.
bool is_indexer_check(IntegrityCheck check);

// What is wrong with a slot that differs from the expected pool (src/replay/integrity.hpp).
enum class SlotClass {
  kNone,  // the finding is not about damaged slots
  kWrongSlot,
  kBf16Bytes,
  kNanCode,
  kOffByOneCode,
  // kvdump v1.1 per_token_group pools only:
  kScaleBytes,         // only the group-scale bytes differ
  kSwappedGroupScale,  // only the scales differ, and a group holds another group's scale
  kCodesOtherScale,    // only latent codes differ, by more than one step: another scale used
  kRopeSaturated,      // only the RoPE part differs, and it holds +-448 codes the rule did not
  // A slot no request of the step holds (no token lives there): its bytes are garbage to the
  // step, so no quantization class applies (it holds no written row nor bf16 bytes of one).
  kUnusedSlot,
  kOther,
};
// "" (kNone), "wrong_slot", "bf16_bytes", "nan_code", "off_by_one_code", "scale_bytes",
// "swapped_group_scale", "codes_other_scale", "rope_saturated", "unused_slot", "other".
const char* slot_class_name(SlotClass slot_class);

// A row a step wrote that landed in another slot than its own (wrong_slot findings): where it
// landed, the slot new_kv_slots gave it, and whose row it is (its row of new_kv, the request and
// the token position that query row belongs to; -1 where not known).
struct MisplacedRow {
  std::int64_t slot = -1;
  std::int64_t intended_slot = -1;
  int new_kv_row = -1;
  int request = -1;
  std::int64_t token = -1;
  bool operator==(const MisplacedRow&) const = default;
};
// "request 0 token 6's row, meant for slot 6, landed in slot 7" ("new_kv row 3's row" where the
// request is not known).
std::string misplaced_row_text(const MisplacedRow& row);

struct IntegrityFinding {
  int step = 0;
  int layer_id = 0;
  std::string where;  // the dump's groups, "S001 L000" (step and layer as named in the file)
  IntegrityCheck check = IntegrityCheck::kStorage;
  bool pass = true;
  std::string detail;               // one line naming step, layer and slots
  std::vector<std::int64_t> slots;  // first offending slots (at most kMaxListedSlots)
  std::int64_t slot_count = 0;      // how many slots offend in all (slots may list fewer)
  // The class of the slots (kNanCode for nan_written and nan_codes_in_pool); kNone where the
  // finding is not about damaged slots.
  SlotClass classification = SlotClass::kNone;
  int carried_from_step = -1;  // damage first seen at an earlier step (captured pools), else -1
  // wrong_slot findings new at this step: the rows found in another slot (at most
  // kMaxListedSlots, src/replay/integrity.hpp), in slot order; empty otherwise.
  std::vector<MisplacedRow> misplaced_rows;
};

// The first element where a backend (or, without one, the captured output) leaves the reference:
// the earliest failing step, then layer in dump order, then the first (row, head) in row-major
// order whose error breaks the policy (the worst element when no single row does). Found by
// src/verdict/divergence.hpp.
struct Divergence {
  int step = 0;
  int layer_id = 0;
  int request = -1;
  int row = -1;  // step-global query row
  int head = -1;
  Comparison comparison = Comparison::kKernel;
  std::string reason;  // the comparison's first reason
};

// What a reported (step, layer) read and whether its source was known, recorded by the replay.
// The sign-off verdict rests on it (src/verdict/signoff.hpp: a step-layer whose tokens lack a
// source value has no quantization or total error), and the reports put the saturated codes a
// step read beside the quantization error they cause.
struct StepLayerCoverage {
  int step = 0;
  int layer_id = 0;
  std::int64_t tokens_read = 0;            // distinct slots the step's rows read
  std::int64_t tokens_without_source = 0;  // of those, slots with no source value (Rs needs all)
  std::int64_t codes_read = 0;             // stored elements of those slots (tokens_read x D)
  // e4m3 codes +-448 among them (values past 464 * kv_scale clamped by satfinite), in the
  // reference replay's pool after the step's writes; -1 for a bf16 pool (no saturation).
  std::int64_t saturated_codes = -1;
};

// The served scale against the recommended one, per layer (`kvaudit calibrate`,
// src/tools/calibrate.hpp; measured under --signoff where every layer has kv_source and a
// per-tensor scale). The errors are FP8 storage alone (attention on the source quantized with the
// scale vs on the source, plain binary64 over every step: out relative L2). MLA caches one tensor,
// so the scale is k_scale = v_scale. The sign-off rule is scale_failures (src/verdict/signoff.hpp).
struct ScalePoint {
  double scale = 0.0;
  double rel_l2 = 0.0;
  double saturated_fraction = 0.0;
};
struct LayerScaleCheck {
  int layer_id = 0;
  double served_scale = 0.0;       // the dump's kv_scale: what the server wrote with
  double recommended_scale = 0.0;  // kvaudit calibrate's recommendation
  std::string recommended_rule;    // "amax/448", "pow2-up(amax/448)", "sweep", ...
  double served_rel_l2 = 0.0;
  double recommended_rel_l2 = 0.0;
  double served_saturated_fraction = 0.0;  // values past 464 * s (satfinite: +-448)
  double served_underflow_fraction = 0.0;  // values stored subnormal or flushed to 0
  double recommended_underflow_fraction = 0.0;
  std::vector<ScalePoint> curve;  // every candidate measured, ascending scale
};

// Who and what a sign-off report signs for (--signed-by, --model, --deployment; the deployment
// empty when not given) and the public key of the --signing-key that signs it. Only --signoff
// runs carry one; report.json's "signoff" block adds the report's checksum
// (src/verdict/report_digest.hpp), the report directory the signature
// (src/report/report_signature.hpp).
struct SignOff {
  std::string signed_by;
  std::string model;
  std::string deployment;
  std::string public_key;  // Ed25519, 64 hex digits; empty in reports from before signatures
};

// One part a merged run was made from (`kvaudit merge`): its file, its shard and where it ran.
struct MergedPart {
  std::string file;   // as given to kvaudit merge
  std::string shard;  // "I/N"
  std::string host;
  std::string date_utc;
  std::string command_line;
};

// The three numbers a diagnosis quotes of a comparison's error (with the NaN/Inf mismatches that
// fail it before any of them).
struct ErrorSummary {
  double rel_l2 = 0.0;
  double max_abs_over_ref_max = 0.0;
  bool has_lse = false;
  double lse_max_abs = 0.0;  // meaningful when has_lse
  std::size_t nonfinite_mismatches = 0;
};
ErrorSummary summarize_error(const ComparisonMetrics& metrics);

// One hypothesis of the diagnosis catalogue (src/replay/diagnosis.hpp) tried on a failing
// comparison: the candidate against the reference recomputed under it.
struct HypothesisOutcome {
  std::string hypothesis;  // the catalogue's name, "scale-pow2-floor"
  std::string transform;   // what it changed here, "kv_scale 0.0029 read as 0.00195"
  ErrorSummary after;
  bool explains = false;             // judge_hypothesis (src/verdict/policy.hpp)
  std::vector<std::string> reasons;  // why it does not explain (limits still exceeded)
  double excess = 0.0;  // after's largest metric / limit ratio (<= 1 passes; inf: NaN/Inf)
  // after / before over the metrics the fraction rule compares (judge_hypothesis): <=
  // explain_fraction to explain; +inf with a NaN/Inf mismatch.
  double fraction = 0.0;
  // The candidate against bf16(the hypothesis's out), where the candidate stores out in bf16: the
  // distance the fraction divides (DiagnosisFinding::baseline_stored the divisor); nullopt where
  // out is compared unrounded (then `after` is that distance).
  std::optional<ErrorSummary> after_stored;
};

// The diagnosis of one failing kernel, captured or captured_read comparison: every hypothesis
// that explains it (brings it to a clean kernel's level), or, when none does, the closest one.
struct DiagnosisFinding {
  int step = 0;
  int layer_id = 0;
  Comparison comparison = Comparison::kKernel;
  ErrorSummary before;
  // The candidate against bf16(the reference's out), where it stores out in bf16: the
  // no-hypothesis distance every fraction is taken of (before stays the comparison's metrics).
  std::optional<ErrorSummary> baseline_stored;
  std::vector<HypothesisOutcome> explained_by;  // catalogue order; empty: none explains
  // More than one explains: they are indistinguishable on this data. same_computation: they
  // resolved to the same computation here (e.g. kv_scale rounded down and to the nearest power
  // of two give the same scale), so no data could tell them apart.
  bool same_computation = false;
  // None explains: the one nearest its limits (smallest finite excess), if any has no NaN/Inf.
  std::optional<HypothesisOutcome> closest;
  int tried = 0;                            // hypotheses tried (applicable here)
  std::vector<std::string> not_applicable;  // would change nothing here (e.g. kv_scale = 1)
  // Every hypothesis and combination tried, in the order tried (singles in catalogue order, then
  // pairs, then triples; a combination is named "a + b"): each with its two distances (after's
  // rel_l2 and lse_max_abs) and its fraction, so a reader can check the rule.
  std::vector<HypothesisOutcome> hypotheses;
};
// One line: "explained by NAME (TRANSFORM)", "explained by A, B (indistinguishable on this data:
// ...)", or "no hypothesis in the catalogue explains this failure (N tried; closest NAME ...)".
// explain_fraction: the policy's; where none explains and the closest is within it, the summary
// says that hypothesis carries most of the error and what the limits leave (a residual the
// catalogue does not model), rather than only "closest". NaN: not said.
std::string diagnosis_summary(const DiagnosisFinding& finding,
                              double explain_fraction = std::numeric_limits<double>::quiet_NaN());
// The run's note when the budget left failing (step, layer)s undiagnosed; none otherwise.
std::optional<std::string> diagnosis_budget_note(std::size_t diagnosed_sites,
                                                 std::size_t failing_sites, int limit);

// Where the server's corrupted pool first costs the outputs something: the first (step, then layer
// in dump order) failing captured_cache comparison (R8 on the server's pool vs R8). Reported once
// any captured pool differs from the replay (captured_cache comparisons exist).
struct CapturedPoolCost {
  int damaged_since_step = -1;  // the first failing captured_pool finding's step; -1 unknown
  bool shows = false;           // some step reads a damaged slot
  int step = -1;                // where the cost first shows (when shows)
  int layer_id = -1;
  ErrorSummary cost;  // of that captured_cache comparison
};

// Where and how a run was made, for the report. Empty fields are filled with this process's
// values (current_provenance) when the run is written out.
struct Provenance {
  std::string host;
  std::string date_utc;      // ISO-8601, "2026-11-29T09:30:00Z"
  std::string command_line;  // as typed, arguments shell-quoted where needed
  std::string kvaudit_version;
  std::string git_revision;             // src/core/build_info.hpp
  std::string cpu;                      // the host's CPU model and count
  std::vector<MergedPart> merged_from;  // kvaudit merge: its parts in shard order; else empty
};

// Quotes an argument for a POSIX shell when it holds anything but plainly safe characters.
std::string shell_quote(const std::string& arg);

// This process: host name, the time now (UTC), its command line (from /proc/self/cmdline where
// there is one), KVAUDIT_VERSION, the git revision it was built from, the CPU.
Provenance current_provenance();
// `given` with its empty fields filled from current_provenance().
Provenance completed_provenance(const Provenance& given);
bool is_complete(const Provenance& provenance);
// KVAUDIT_VERSION, or "unknown" in a build without it (report.json's "version").
const char* kvaudit_version();

// One site of the per-run certification of the exact reference (src/replay/certification.hpp):
// R8 of one (row, head) recomputed in 50 digits, and how far the run's reference was from it.
struct CertificationSample {
  int step = 0;
  int layer_id = 0;
  int row = 0;
  int head = 0;
  double out_relative = 0.0;  // max_j |out - out50| / max_j |out50| (0 where both are all zero)
  double lse_absolute = 0.0;  // |lse - lse50|
};
// The bound the reference promises (references/mla_reference.hpp), relative on out and absolute
// on lse; a sample above it is an internal error.
inline constexpr double kReferenceBound = 1e-15;
// The largest deviations over a run's samples (0 for none).
struct CertificationMaxima {
  double out_relative = 0.0;
  double lse_absolute = 0.0;
};
CertificationMaxima certification_maxima(const std::vector<CertificationSample>& samples);

struct CheckRun {
  std::string dump_path;
  std::string dump_sha256;
  std::string backend;  // "cpu-fp8", "none", ...
  nlohmann::json backend_description;
  Policy policy;
  nlohmann::json dump_summary;  // model, producer, shapes, layers, steps
  std::vector<ComparisonResult> comparisons;
  std::vector<IntegrityFinding> integrity;
  std::optional<Divergence> first_divergence;  // none while nothing diverges
  std::vector<std::string> notes;  // what the run could not do, or did differently, and why
  std::vector<StepLayerCoverage> coverage;  // one per reported (step, layer), in replay order
  std::optional<SignOff> signoff;           // --signoff runs
  std::vector<LayerScaleCheck> scales;      // --signoff runs with kv_source (per-tensor scales)
  std::string reference_device = "cpu";     // where the exact reference ran: "cpu" or "cuda"
  double reference_seconds = 0.0;
  double reference_rows_heads_tokens = 0.0;  // work done, for throughput
  double backend_seconds = 0.0;
  double read_seconds = 0.0;           // reading pools and step tensors from the dump
  double judge_seconds = 0.0;          // comparisons: metrics, verdicts, diagnosis
  double diagnosis_seconds = 0.0;      // the diagnosis of failing comparisons
  double certification_seconds = 0.0;  // the 50-digit recomputations (their own threads' time)
  double total_seconds = 0.0;
  // Layers replayed at once (ReplayOptions::layers_in_flight, after its fallbacks) and, where it
  // fell back to 1, why: --verbose prints them; not in report.json (the report is the same for
  // every count).
  int layers_in_flight = 1;
  std::string layers_in_flight_note;
  // Where the GPU's share of reference_seconds and backend_seconds went (host preparation, uploads,
  // kernels, downloads: src/core/device_seconds.hpp), for `check --verbose`; absent where nothing
  // ran on a GPU. Not in report.json.
  std::optional<DeviceSeconds> reference_device_seconds;
  std::optional<DeviceSeconds> backend_device_seconds;
  // An exec backend's protocol overhead (Backend::protocol_statistics); null for in-process ones.
  nlohmann::json backend_protocol;
  Provenance provenance;
  // Diagnoses of failing kernel and captured comparisons, by step then layer in dump order
  // (src/replay/diagnosis.hpp; at most --diagnose N (step, layer)s, the earliest).
  std::vector<DiagnosisFinding> diagnosis;
  // The reference's certification on this run's data, in replay order.
  std::vector<CertificationSample> certification;
  // The diagnosis budget: --diagnose N, and how many (step, layer)s had a failing kernel or
  // captured comparison (diagnosed or not). Not in report.json (its note says them); a shard part
  // records them so that kvaudit merge can apply the budget to the whole run.
  int diagnose_limit = 0;
  std::size_t diagnosis_failing_sites = 0;
  // No failing comparison that sets exit, no failing integrity finding, and, where the policy
  // judges quantization and total error (sign-off), both measured at every reported step-layer.
  bool pass() const;
};

// Whether this comparison fails the run: it failed and either its kind sets the exit status under
// the policy or it has a NaN/Inf mismatch (those always do, docs/design.md "Numerics").
bool fails_run(const ComparisonResult& result);
// The element a reader should look at first: the first NaN/Inf mismatch, else the max_abs one.
const ElementLocation& worst_location(const ComparisonResult& result);

struct RunCounts {
  std::size_t comparisons = 0;
  std::size_t failed = 0;              // failing and failing the run
  std::size_t failed_report_only = 0;  // failing, but reported only under this policy
  std::size_t integrity_checks = 0;
  std::size_t integrity_failed = 0;
  // (step, layer, comparison) sites where quantization or total error could not be measured
  // (src/verdict/signoff.hpp); they fail the run under sign-off.
  std::size_t unmeasured = 0;
};
RunCounts count_results(const CheckRun& run);

// Per step, over the layers checked: whether the pools are intact and how error evolves from step
// to step (report.json "steps", the report's "Across steps" table).
enum class PoolState { kNotChecked, kIntact, kDamaged };
const char* pool_state_name(PoolState state);  // "not checked" | "intact" | "damaged"

struct ComparisonWorst {
  bool present = false;
  double rel_l2 = 0.0;                    // the worst over the step's layers (NaN wins)
  int layer_id = -1;                      // where
  std::int64_t nonfinite_mismatches = 0;  // summed over layers
  int failed = 0;                         // layers where it failed
};

struct StepSummary {
  int step = 0;
  int layers = 0;
  PoolState backend_pool = PoolState::kNotChecked;   // storage .. read_consistency
  PoolState captured_pool = PoolState::kNotChecked;  // kv_cache_after
  std::int64_t damaged_slots = 0;       // backend slots that differ from the reference, all layers
  int damaged_layers = 0;               // layers with such slots
  std::int64_t new_captured_slots = 0;  // captured slots first damaged at this step
  std::int64_t carried_captured_slots = 0;  // captured slots damaged at an earlier step
  std::map<Comparison, ComparisonWorst> worst;
  bool pass = true;  // nothing at this step fails the run
};

std::vector<StepSummary> summarize_steps(const CheckRun& run);

// None while no captured pool differs from the replay (no captured_cache comparison was made).
std::optional<CapturedPoolCost> captured_pool_cost(const CheckRun& run);

nlohmann::json to_json(const CheckRun& run);  // to_json(make_report_model(run)), report_model.hpp

// The inverse of to_json: report.json read back into the run (src/verdict/report_json.cpp).
// Keys to_json derives from the run (verdict, counts, steps, worst, max_abs_over_ref_max, the
// throughput, version) are not read; every other key is, and an unknown key is refused, so that a
// key added to to_json without its reader fails the round-trip test. `where` names the file in
// errors (bad input: "FILE:/results/3/metrics/rms: expected a number").
Result<CheckRun> check_run_from_json(const nlohmann::json& report, const std::string& where);

}  // namespace kvaudit
