// Comparing a run with its golden file (`kvaudit golden check`): what moved, by how much, and which
// element moved first.
//
// Per (step, layer), shapes out [Nq, H, Dc] bf16 bits, lse [Nq, H] fp32, pool [S, D] bytes:
//   exact mode      out and lse bit for bit (a deterministic backend on the same platform);
//   tolerance mode  out within kToleranceOutUlps bf16 ULPs of the element or kToleranceOutRowScale
//                   of its (row, head)'s largest |out|, lse within kToleranceLseAbs (derived in
//                   golden_compare.cpp: two runs that differ only in summation order and in the
//                   running maximum P is rounded against);
//   the pool always bit for bit, in both modes: the write rule is exact (kvdump-v1), so any moved
//   byte is a change of behaviour, never noise.
// "First moved" is the earliest step, then layer in dump order; within one (step, layer) the pool
// (ascending slot) before out before lse, each row-major: the step writes before it attends, so a
// moved write explains the outputs that moved after it.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "src/report/golden.hpp"

namespace kvaudit {

enum class GoldenMode : std::uint8_t { kExact, kTolerance };
const char* golden_mode_name(GoldenMode mode);  // "exact" | "tolerance"
std::optional<GoldenMode> parse_golden_mode(std::string_view text);

// Tolerance mode (derivation in golden_compare.cpp).
inline constexpr double kToleranceOutUlps = 2.0;
inline constexpr double kToleranceOutRowScale = 0x1p-8;  // of max_d |out[row, head, d]|
inline constexpr double kToleranceLseAbs = 0x1p-14;      // 6.1e-5, natural log units

struct GoldenModeChoice {
  GoldenMode mode = GoldenMode::kExact;
  std::string reason;  // one sentence: why this mode
};

// The mode for comparing a run of `current` with `golden`, when --mode does not choose: the
// backend's describe() field "deterministic" (a boolean) where it has one, else a rule per
// backend (golden_compare.cpp); another backend than the golden's is always tolerance, and so is
// a CUDA run of other kernels (kernel_variant "mma" or "decode16" differs).
GoldenModeChoice choose_golden_mode(const GoldenProvenance& golden,
                                    const GoldenProvenance& current);

// What provenance says differs between the golden file and this run: backend, each key of the
// backend description, platform (compiler, C library, HDF5), kvaudit version and revision. Date,
// host and command line always differ and are not listed. One line each, "what: golden -> now".
std::vector<std::string> provenance_differences(const GoldenProvenance& golden,
                                                const GoldenProvenance& current);

// Lines that flag a build from a tree with uncommitted changes (kvaudit_dirty): "warning: the
// golden file was recorded by a kvaudit built from a dirty tree (revision ...-dirty): ..." for the
// golden file, "note: this kvaudit was built from a dirty tree (...)" for this run. Nothing when
// both are clean.
std::vector<std::string> dirty_build_lines(const GoldenProvenance& golden,
                                           const GoldenProvenance& current);

// The CUDA kernel variant (describe()'s "kernel_variant", src/backend/cuda_kernel_variant.hpp) of
// the golden file and of this run, for a check that moved: one line when they agree ("kernel
// variant (the golden file's and this run's): decode16=auto, host_plan=true, ..."), else one line
// each ("kernel variant of the golden file: ...", "kernel variant of this run: ..."; "(not
// recorded)" for a golden file from before it was). Nothing when neither records one (cpu-fp8).
std::vector<std::string> kernel_variant_lines(const GoldenProvenance& golden,
                                              const GoldenProvenance& current);

enum class MovedPart : std::uint8_t { kPool, kOut, kLse };
const char* moved_part_name(MovedPart part);  // "pool" | "out" | "lse"

// One element that moved. out: row, head, dim; lse: row, head; pool: slot and dim (the element of
// the slot's row), values are e4m3 / bf16 values before kv_scale.
struct ElementMove {
  MovedPart part = MovedPart::kOut;
  int step = 0;
  int layer_id = 0;
  int row = -1;
  int head = -1;
  int dim = -1;
  std::int64_t slot = -1;
  std::uint32_t golden_bits = 0;
  std::uint32_t current_bits = 0;
  double golden_value = 0.0;
  double current_value = 0.0;
  double ulps = 0.0;  // ordered distance in units in the last place of the element's type
};

// "out[row 3, head 2, dim 17] 0x3f80 (1) -> 0x3f81 (1.0078125), 1 ulp, |diff| 0.0078125"; a NaN
// against a number is named as such: "..., NaN where the golden value is 1" (or "1 where the
// golden value is NaN"), no ulp count.
std::string describe_move(const ElementMove& move);

// What moved in one (step, layer).
struct EntryDiff {
  int step = 0;
  int layer_id = 0;
  std::string structure;  // shapes or presence differ: nothing else was compared
  std::size_t out_moved = 0;
  double out_max_ulps = 0.0;
  double out_max_abs = 0.0;
  std::optional<ElementMove> first_out;
  std::size_t lse_moved = 0;
  double lse_max_abs = 0.0;
  std::optional<ElementMove> first_lse;
  std::int64_t slots_moved = 0;     // slots whose bytes differ (whole pool, or written rows)
  std::int64_t slots_carried = 0;   // of those, moved already at an earlier step of the layer
  std::vector<std::int64_t> slots;  // the first moved slots (at most kListedSlots)
  std::optional<ElementMove> first_pool;
  bool written_slots_differ = false;  // the step wrote other slots than the golden step did
  bool digest_moved = false;          // digest storage: the pool's SHA-256 differs
  // Digest storage: slots the step did not write moved (their SHA-256 differs; for a golden file
  // without it, the pool's SHA-256 differs while no written row does). Their numbers are not
  // known here: `kvaudit check` names them.
  bool unwritten_moved = false;

  static constexpr std::size_t kListedSlots = 8;
  bool moved() const;
  std::optional<ElementMove> first() const;  // pool, then out, then lse
};

struct GoldenComparison {
  GoldenMode mode = GoldenMode::kExact;
  std::size_t entries_compared = 0;
  std::vector<EntryDiff> moved;  // the (step, layer)s that moved, step then layer in dump order
  std::optional<ElementMove> first;

  bool any_moved() const { return !moved.empty(); }
};

// Compares `current` (a run recorded the same way, src/report/golden.hpp) with `golden`. Entries
// are matched by (step, layer_id) and ordered by the golden's step_indices and layer_ids.
GoldenComparison compare_golden(const Golden& golden, const Golden& current, GoldenMode mode);

// One line per moved (step, layer) under a header (counts, largest distances, its first moved
// element as "out[row,head,dim] (ulps)", the pool slots that moved), then "first moved: ..." in
// full, then one note per (step, layer) whose unwritten slots moved in digest storage
// (unwritten_slot_notes). Nothing when nothing moved.
void print_golden_comparison(std::ostream& out, const GoldenComparison& comparison);

// "note: step 1 layer 0: pool slots the step did not write moved (digest storage: ...)", one per
// moved (step, layer) with unwritten_moved, in comparison order; whether or not its written rows
// or outputs moved too.
std::vector<std::string> unwritten_slot_notes(const GoldenComparison& comparison);

}  // namespace kvaudit
