// Golden files as a library (src/report/golden*.hpp): recording captures the backend's outputs and
// the pool after each step (checked against the write rule applied here, TinyDump::pool_after),
// the file round-trips, and the comparison names what moved: one flipped bit of out, lse or the
// pool by step, layer, row, head, dim or slot; tolerance mode lets through what another summation
// order may change and nothing more; the mode follows the backend's description; provenance
// differences are listed. The command line is tested in test_golden_cli.cpp.
#include <fmt/format.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <memory>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "src/backend/mla_attention_cpu.hpp"
#include "src/core/build_info.hpp"
#include "src/core/fp8_e4m3.hpp"
#include "src/core/sha256.hpp"
#include "src/report/golden.hpp"
#include "src/report/golden_compare.hpp"
#include "src/report/golden_file.hpp"
#include "src/verdict/policy.hpp"
#include "tests/replay/check_dumps.hpp"

namespace kvaudit {
namespace {

using testing::make_tiny_dump;
using testing::test_tmp_path;
using testing::TinyDump;
using testing::TinySpec;

struct Recorded {
  TinyDump dump;
  Golden golden;
};

// Records a tiny two-layer dump (ids 0 and 4) with cpu-fp8.
Recorded record_tiny(const std::string& name,
                     std::int64_t whole_pool_max_bytes = kWholePoolMaxBytes,
                     const std::string& kvaudit_revision = kvaudit_git_revision()) {
  TinySpec spec;
  spec.layer_ids = {0, 4};
  Recorded recorded{make_tiny_dump(spec), {}};
  const auto path = test_tmp_path(name + ".h5");
  std::string error;
  REQUIRE(recorded.dump.write(path, &error));
  auto reader = DumpReader::open(path);
  REQUIRE(reader.ok());
  BackendOptions backend_options;
  backend_options.threads = 2;
  auto backend = make_cpu_fp8_backend(backend_options);
  REQUIRE(backend.ok());
  GoldenRecordOptions options;
  options.replay.threads = 2;
  options.replay.policy = default_policy();
  options.whole_pool_max_bytes = whole_pool_max_bytes;
  options.kvaudit_revision = kvaudit_revision;
  auto golden = record_golden(*reader, **backend, options);
  REQUIRE(golden.ok());
  recorded.golden = std::move(*golden);
  return recorded;
}

GoldenEntry& entry_of(Golden& golden, int step, int layer_id) {
  for (GoldenEntry& entry : golden.entries) {
    if (entry.step == step && entry.layer_id == layer_id) return entry;
  }
  FAIL("no entry for step " << step << " layer " << layer_id);
  return golden.entries.front();
}

std::size_t out_index(const GoldenEntry& entry, int row, int head, int dim) {
  return (static_cast<std::size_t>(row) * entry.shape.heads + head) * entry.shape.dims + dim;
}

// A hand-made (step, layer): one row, one head, `values` as bf16, lse 3.5, a 2-slot pool.
Golden one_entry_golden(const std::vector<float>& values) {
  Golden golden;
  golden.layer_ids = {7};
  golden.step_indices = {0};
  GoldenEntry entry;
  entry.layer_id = 7;
  entry.shape = TensorShape3{1, 1, static_cast<int>(values.size())};
  for (const float v : values) entry.out.push_back(bf16_from_float(v));
  entry.lse = {3.5f};
  entry.pool.num_slots = 2;
  entry.pool.row_width = 4;
  entry.pool.rows.assign(8, 0x38);
  entry.pool.sha256 = std::string(64, '0');
  golden.entries.push_back(entry);
  return golden;
}

}  // namespace

TEST_CASE("golden record: out, lse and the backend's pool after every step", "[golden]") {
  const Recorded recorded = record_tiny("golden_record");
  const Golden& golden = recorded.golden;
  const TinyDump& dump = recorded.dump;
  REQUIRE(golden.entries.size() == dump.steps.size() * 2);
  CHECK(golden.layer_ids == std::vector<int>{0, 4});
  CHECK(golden.step_indices == std::vector<int>{0, 1, 2});
  CHECK(golden.provenance.backend == "cpu-fp8");
  CHECK(golden.provenance.backend_description.value("device", "") == "cpu");
  CHECK(golden.provenance.policy == "default");
  CHECK_FALSE(golden.provenance.kvaudit_revision.empty());
  CHECK(golden.provenance.platform.contains("hdf5"));
  // Sorted by step, then layer in dump order.
  for (std::size_t i = 0; i < golden.entries.size(); ++i) {
    CHECK(golden.entries[i].step == static_cast<int>(i / 2));
    CHECK(golden.entries[i].layer_id == (i % 2 == 0 ? 0 : 4));
  }
  for (const GoldenEntry& entry : golden.entries) {
    const std::size_t layer = entry.layer_id == 0 ? 0 : 1;
    const StepMeta& step = dump.steps[entry.step];
    CHECK(entry.shape.rows == step.num_rows());
    CHECK(entry.out.size() == entry.shape.size());
    CHECK(entry.lse.size() == static_cast<std::size_t>(step.num_rows()) * dump.attrs.num_heads);
    // A tiny pool (19 slots of 40 bytes) is stored whole: the write rule applied here.
    CHECK(entry.pool.storage == PoolStorage::kWhole);
    CHECK(entry.pool.rows == dump.pool_after(entry.step, layer).bytes);
    CHECK(entry.pool.written_slots ==
          std::vector<std::int64_t>(step.new_kv_slots.begin(), step.new_kv_slots.end()));
  }
}

TEST_CASE("golden record: a pool above the limit is its SHA-256 and the written rows", "[golden]") {
  const Recorded recorded = record_tiny("golden_record_digest", 100);
  const TinyDump& dump = recorded.dump;
  for (const GoldenEntry& entry : recorded.golden.entries) {
    CHECK(entry.pool.storage == PoolStorage::kDigest);
    const KvPool after = dump.pool_after(entry.step, entry.layer_id == 0 ? 0 : 1);
    REQUIRE(entry.pool.rows.size() == entry.pool.written_slots.size() * after.row_bytes());
    for (std::size_t i = 0; i < entry.pool.written_slots.size(); ++i) {
      const std::uint8_t* expected = after.row(entry.pool.written_slots[i]);
      CHECK(std::vector<std::uint8_t>(entry.pool.rows.begin() + i * after.row_bytes(),
                                      entry.pool.rows.begin() + (i + 1) * after.row_bytes()) ==
            std::vector<std::uint8_t>(expected, expected + after.row_bytes()));
    }
    CHECK(entry.pool.sha256.size() == 64);
  }
  // The digest is of the whole pool: steps that write change it.
  CHECK(recorded.golden.entries[0].pool.sha256 != recorded.golden.entries[2].pool.sha256);
}

TEST_CASE("golden record: digest storage also keeps the SHA-256 of the unwritten slots",
          "[golden]") {
  const Recorded recorded = record_tiny("golden_record_unwritten", 100);
  const TinyDump& dump = recorded.dump;
  for (const GoldenEntry& entry : recorded.golden.entries) {
    const KvPool after = dump.pool_after(entry.step, entry.layer_id == 0 ? 0 : 1);
    Sha256 unwritten;  // every slot the step did not write, in slot order
    for (std::int64_t slot = 0; slot < after.num_slots; ++slot) {
      const auto& written = entry.pool.written_slots;
      if (std::find(written.begin(), written.end(), slot) != written.end()) continue;
      unwritten.update(std::span<const std::uint8_t>(after.row(slot), after.row_bytes()));
    }
    CHECK(entry.pool.unwritten_sha256 == to_hex(unwritten.finish()));
  }
  // Whole storage names every slot: no second digest.
  const Recorded whole = record_tiny("golden_record_unwritten_whole");
  CHECK(whole.golden.entries[0].pool.unwritten_sha256.empty());
}

TEST_CASE("golden record: a build from a dirty tree is flagged in the file and by golden check",
          "[golden]") {
  const Recorded dirty = record_tiny("golden_dirty", kWholePoolMaxBytes, "0123456789ab-dirty");
  const Recorded clean = record_tiny("golden_clean", kWholePoolMaxBytes, "0123456789ab");
  CHECK(dirty.golden.provenance.kvaudit_dirty);
  CHECK_FALSE(clean.golden.provenance.kvaudit_dirty);
  const auto path = test_tmp_path("golden_dirty.golden.h5");
  REQUIRE(write_golden_file(path, dirty.golden).ok());
  const auto read = read_golden_file(path);
  REQUIRE(read.ok());
  CHECK(read->provenance.kvaudit_dirty);
  CHECK(read->provenance.kvaudit_revision == "0123456789ab-dirty");
  const std::vector<std::string> lines =
      dirty_build_lines(read->provenance, clean.golden.provenance);
  REQUIRE(lines.size() == 1);
  CHECK_THAT(lines[0], Catch::StartsWith("warning: the golden file was recorded by a kvaudit "
                                         "built from a dirty tree (revision 0123456789ab-dirty)"));
  // This run's build is flagged too; two clean builds say nothing.
  CHECK(dirty_build_lines(clean.golden.provenance, dirty.golden.provenance) ==
        std::vector<std::string>{"note: this kvaudit was built from a dirty tree (revision "
                                 "0123456789ab-dirty): uncommitted changes may move the outputs"});
  CHECK(dirty_build_lines(clean.golden.provenance, clean.golden.provenance).empty());
}

TEST_CASE("golden file: written and read back unchanged, whole and digest pools", "[golden]") {
  for (const std::int64_t limit : {kWholePoolMaxBytes, std::int64_t{100}}) {
    const Recorded recorded = record_tiny("golden_roundtrip_dump", limit);
    Golden golden = recorded.golden;
    golden.provenance.dump_sha256 = std::string(64, 'a');
    golden.provenance.dump_path = "tiny.h5";
    const auto path = test_tmp_path("golden_roundtrip.golden.h5");
    REQUIRE(write_golden_file(path, golden).ok());
    const auto read = read_golden_file(path);
    REQUIRE(read.ok());
    CHECK(read->provenance.dump_sha256 == golden.provenance.dump_sha256);
    CHECK(read->provenance.backend_description == golden.provenance.backend_description);
    CHECK(read->provenance.platform == golden.provenance.platform);
    CHECK(read->provenance.kvaudit_revision == golden.provenance.kvaudit_revision);
    CHECK(read->whole_pool_max_bytes == limit);
    CHECK(read->layer_ids == golden.layer_ids);
    CHECK(read->step_indices == golden.step_indices);
    REQUIRE(read->entries.size() == golden.entries.size());
    const GoldenComparison same = compare_golden(golden, *read, GoldenMode::kExact);
    CHECK_FALSE(same.any_moved());
    CHECK(same.entries_compared == golden.entries.size());
    for (std::size_t i = 0; i < golden.entries.size(); ++i) {
      CHECK(read->entries[i].out == golden.entries[i].out);
      CHECK(read->entries[i].pool.rows == golden.entries[i].pool.rows);
      CHECK(read->entries[i].pool.sha256 == golden.entries[i].pool.sha256);
    }
  }
}

TEST_CASE("golden file: other files are refused as bad input naming the object", "[golden]") {
  const auto not_hdf5 = test_tmp_path("golden_not_hdf5.h5");
  { std::ofstream(not_hdf5) << "not an HDF5 file"; }
  const auto refused = read_golden_file(not_hdf5);
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.error().kind == ErrorKind::kBadInput);

  TinySpec spec;
  const TinyDump dump = make_tiny_dump(spec);
  const auto dump_path = test_tmp_path("golden_not_golden.h5");
  std::string error;
  REQUIRE(dump.write(dump_path, &error));
  const auto kvdump = read_golden_file(dump_path);
  REQUIRE_FALSE(kvdump.ok());
  CHECK_THAT(kvdump.error().message(), Catch::Contains("format is 'kvdump'"));

  const auto missing = read_golden_file(test_tmp_path("golden_missing.h5"));
  REQUIRE_FALSE(missing.ok());
  CHECK_THAT(missing.error().message(), Catch::Contains("no such golden file"));
}

TEST_CASE("golden compare: a NaN against a number is named as a NaN, not as inf ulp", "[golden]") {
  const Recorded recorded = record_tiny("golden_nan_out");
  Golden current = recorded.golden;
  GoldenEntry& entry = entry_of(current, 1, 4);
  const std::size_t index = out_index(entry, 1, 1, 5);
  const double golden_value = bf16_to_float(entry.out[index]);
  REQUIRE(std::isfinite(golden_value));
  entry.out[index] = 0x7FC0;  // bf16 quiet NaN
  const GoldenComparison comparison = compare_golden(recorded.golden, current, GoldenMode::kExact);
  REQUIRE(comparison.first);
  const std::string text = describe_move(*comparison.first);
  CHECK_THAT(text,
             Catch::Contains(fmt::format("NaN where the golden value is {:.9g}", golden_value)));
  CHECK_THAT(text, !Catch::Contains("inf ulp") && !Catch::Contains("|diff| 0"));
  std::ostringstream printed;
  print_golden_comparison(printed, comparison);
  CHECK_THAT(printed.str(), Catch::Contains("out[1,1,5] (NaN)"));
  // And the reverse: a number where the golden file holds a NaN.
  Golden nan_golden = recorded.golden;
  entry_of(nan_golden, 1, 4).out[index] = 0x7FC0;
  const GoldenComparison reverse = compare_golden(nan_golden, recorded.golden, GoldenMode::kExact);
  REQUIRE(reverse.first);
  CHECK_THAT(describe_move(*reverse.first),
             Catch::Contains(fmt::format("{:.9g} where the golden value is NaN", golden_value)));
}

TEST_CASE("golden compare: one flipped bit of out names step, layer, row, head and dim",
          "[golden]") {
  const Recorded recorded = record_tiny("golden_flip_out");
  Golden current = recorded.golden;
  GoldenEntry& entry = entry_of(current, 1, 4);
  const std::size_t index = out_index(entry, 1, 1, 5);
  const std::uint16_t before = entry.out[index];
  entry.out[index] ^= 1;  // one ulp, the last mantissa bit
  const GoldenComparison comparison = compare_golden(recorded.golden, current, GoldenMode::kExact);
  REQUIRE(comparison.moved.size() == 1);
  const EntryDiff& diff = comparison.moved[0];
  CHECK(diff.step == 1);
  CHECK(diff.layer_id == 4);
  CHECK(diff.out_moved == 1);
  CHECK(diff.lse_moved == 0);
  CHECK(diff.slots_moved == 0);
  CHECK(diff.out_max_ulps == 1.0);
  REQUIRE(comparison.first);
  const ElementMove& first = *comparison.first;
  CHECK(first.part == MovedPart::kOut);
  CHECK(first.step == 1);
  CHECK(first.layer_id == 4);
  CHECK(first.row == 1);
  CHECK(first.head == 1);
  CHECK(first.dim == 5);
  CHECK(first.golden_bits == before);
  CHECK(first.current_bits == static_cast<std::uint32_t>(before ^ 1));
  CHECK(first.ulps == 1.0);
  CHECK_THAT(describe_move(first), Catch::Contains("step 1 layer 4 out[row 1, head 1, dim 5]") &&
                                       Catch::Contains("1 ulp"));
  std::ostringstream printed;
  print_golden_comparison(printed, comparison);
  CHECK_THAT(printed.str(),
             Catch::Matches(R"([\s\S]*\n +1 +4 +1 +1 [^\n]* out\[1,1,5\] \(1\) +0\n[\s\S]*)"));
  CHECK_THAT(printed.str(),
             Catch::Contains("first moved: step 1 layer 4 out[row 1, head 1, dim 5]"));
  // Tolerance mode lets one ulp through.
  CHECK_FALSE(compare_golden(recorded.golden, current, GoldenMode::kTolerance).any_moved());
}

TEST_CASE("golden compare: the first moved element is the earliest step, then layer", "[golden]") {
  const Recorded recorded = record_tiny("golden_first");
  Golden current = recorded.golden;
  entry_of(current, 2, 0).out[0] ^= 0x40;
  GoldenEntry& step1 = entry_of(current, 1, 4);
  step1.lse[1] = std::nextafter(step1.lse[1], 100.0f);  // row 0, head 1
  step1.out[out_index(step1, 1, 0, 7)] ^= 2;
  const GoldenComparison comparison = compare_golden(recorded.golden, current, GoldenMode::kExact);
  REQUIRE(comparison.moved.size() == 2);
  CHECK(comparison.moved[0].step == 1);
  CHECK(comparison.moved[0].lse_moved == 1);
  REQUIRE(comparison.moved[0].first_lse);
  CHECK(comparison.moved[0].first_lse->row == 0);
  CHECK(comparison.moved[0].first_lse->head == 1);
  CHECK(comparison.moved[0].first_lse->ulps == 1.0);
  REQUIRE(comparison.first);
  // Within a (step, layer), out comes before lse (even at a later row).
  CHECK(comparison.first->part == MovedPart::kOut);
  CHECK(comparison.first->step == 1);
  CHECK(comparison.first->layer_id == 4);
  CHECK(comparison.first->row == 1);
  CHECK(comparison.first->head == 0);
  CHECK(comparison.first->dim == 7);
  CHECK(comparison.first->ulps == 2.0);
  CHECK(comparison.moved[1].step == 2);
  CHECK(comparison.moved[1].layer_id == 0);
}

TEST_CASE("golden compare: the pool moves by slot, and damage carried to later steps is counted",
          "[golden]") {
  const Recorded recorded = record_tiny("golden_pool");
  Golden current = recorded.golden;
  // Slot 3 of layer 0 changes at step 0 and stays changed (the pool is state).
  for (GoldenEntry& entry : current.entries) {
    if (entry.layer_id != 0) continue;
    entry.pool.rows[3 * entry.pool.row_bytes() + 2] ^= 0x01;
  }
  const GoldenComparison comparison =
      compare_golden(recorded.golden, current, GoldenMode::kTolerance);
  REQUIRE(comparison.moved.size() == 3);  // steps 0, 1, 2 of layer 0; pools are exact in tolerance
  CHECK(comparison.moved[0].slots == std::vector<std::int64_t>{3});
  CHECK(comparison.moved[0].slots_carried == 0);
  CHECK(comparison.moved[1].slots_carried == 1);
  REQUIRE(comparison.first);
  CHECK(comparison.first->part == MovedPart::kPool);
  CHECK(comparison.first->step == 0);
  CHECK(comparison.first->slot == 3);
  CHECK(comparison.first->dim == 2);
  CHECK(comparison.first->ulps == 1.0);
}

TEST_CASE("golden compare: digest pools name moved written slots and moved unwritten ones",
          "[golden]") {
  const Recorded recorded = record_tiny("golden_digest", 100);
  Golden current = recorded.golden;
  GoldenEntry& entry = entry_of(current, 1, 0);
  entry.pool.rows[entry.pool.row_bytes() + 4] ^= 0x80;  // the second written slot's row
  entry.pool.sha256[0] = entry.pool.sha256[0] == 'f' ? '0' : 'f';
  GoldenEntry& other = entry_of(current, 2, 4);
  other.pool.sha256[5] = other.pool.sha256[5] == 'f' ? '0' : 'f';  // outside the written rows
  const GoldenComparison comparison = compare_golden(recorded.golden, current, GoldenMode::kExact);
  REQUIRE(comparison.moved.size() == 2);
  CHECK(comparison.moved[0].slots ==
        std::vector<std::int64_t>{recorded.golden.entries[2].pool.written_slots[1]});
  CHECK(comparison.moved[1].slots_moved == 0);
  CHECK(comparison.moved[1].digest_moved);
}

TEST_CASE("golden compare: digest storage notes moved unwritten slots when written ones moved too",
          "[golden]") {
  Recorded recorded = record_tiny("golden_digest_both", 100);
  Golden current = recorded.golden;
  GoldenEntry& entry = entry_of(current, 1, 0);
  entry.pool.rows[entry.pool.row_bytes() + 4] ^= 0x80;  // the second written slot's row
  entry.pool.sha256[0] = entry.pool.sha256[0] == 'f' ? '0' : 'f';
  entry.pool.unwritten_sha256[0] = entry.pool.unwritten_sha256[0] == 'f' ? '0' : 'f';
  const GoldenComparison comparison = compare_golden(recorded.golden, current, GoldenMode::kExact);
  REQUIRE(comparison.moved.size() == 1);
  CHECK(comparison.moved[0].slots_moved == 1);
  CHECK(comparison.moved[0].unwritten_moved);
  std::ostringstream printed;
  print_golden_comparison(printed, comparison);
  CHECK_THAT(printed.str(), Catch::Contains("+ unwritten slots (digest)"));
  CHECK_THAT(printed.str(),
             Catch::Contains("note: step 1 layer 0: pool slots the step did not write moved"));
  // Only the written row moved: no note.
  entry.pool.unwritten_sha256 = entry_of(recorded.golden, 1, 0).pool.unwritten_sha256;
  const GoldenComparison written_only =
      compare_golden(recorded.golden, current, GoldenMode::kExact);
  REQUIRE(written_only.moved.size() == 1);
  CHECK_FALSE(written_only.moved[0].unwritten_moved);
  CHECK(unwritten_slot_notes(written_only).empty());
}

TEST_CASE("golden compare: tolerance mode allows 2 ulps or 2^-8 of the row's scale, no more",
          "[golden]") {
  // Row scale 256: 2^-8 of it is 1.0. bf16 ulp of 1.0 is 2^-7, of 256 it is 2.
  const Golden golden = one_entry_golden({1.0f, 256.0f, 0.001f, 3.0f});
  auto with = [&](int dim, float value) {
    Golden current = golden;
    current.entries[0].out[dim] = bf16_from_float(value);
    return current;
  };
  auto moved = [&](const Golden& current, GoldenMode mode) {
    return compare_golden(golden, current, mode).any_moved();
  };
  // Alone in its row, 1.0 has a row scale of ~1 (2^-8 of it is below one ulp, 2^-7): ulps decide.
  const Golden unit = one_entry_golden({1.0f});
  auto unit_with = [&](float value) {
    Golden current = unit;
    current.entries[0].out[0] = bf16_from_float(value);
    return compare_golden(unit, current, GoldenMode::kTolerance).any_moved();
  };
  CHECK_FALSE(unit_with(1.015625f));  // 1 + 2 * 2^-7: 2 ulps
  CHECK(unit_with(1.0234375f));       // 3 ulps
  CHECK(compare_golden(unit, unit, GoldenMode::kExact).entries_compared == 1);
  const Golden two_ulps = with(0, 1.015625f);
  CHECK(moved(two_ulps, GoldenMode::kExact));
  CHECK_FALSE(moved(two_ulps, GoldenMode::kTolerance));
  // 0.001 -> 0.5: hundreds of ulps, but 0.499 <= 1.0 = 2^-8 * 256 (a cancelling element).
  CHECK_FALSE(moved(with(2, 0.5f), GoldenMode::kTolerance));
  // 3 -> 4.5: 1.5 > 1.0 and 12 ulps: moved.
  CHECK(moved(with(3, 4.5f), GoldenMode::kTolerance));
  // NaN appearing is always a move.
  CHECK(moved(with(0, NAN), GoldenMode::kTolerance));
  // lse: 5e-5 passes (2^-14 = 6.1e-5), 1e-4 does not.
  Golden lse_close = golden;
  lse_close.entries[0].lse[0] = 3.5f + 5e-5f;
  CHECK(moved(lse_close, GoldenMode::kExact));
  CHECK_FALSE(moved(lse_close, GoldenMode::kTolerance));
  Golden lse_far = golden;
  lse_far.entries[0].lse[0] = 3.5f + 1e-4f;
  CHECK(moved(lse_far, GoldenMode::kTolerance));
}

TEST_CASE("golden mode: from the backend's deterministic field, else a rule per backend",
          "[golden]") {
  GoldenProvenance golden;
  golden.backend = "cpu-fp8";
  golden.backend_description = {{"device", "cpu"}};
  GoldenProvenance current = golden;
  CHECK(choose_golden_mode(golden, current).mode == GoldenMode::kExact);

  current.backend_description["deterministic"] = false;
  CHECK(choose_golden_mode(golden, current).mode == GoldenMode::kTolerance);

  GoldenProvenance cuda_golden;
  cuda_golden.backend = "cuda-fp8";
  cuda_golden.backend_description = {{"device", "NVIDIA H200"}, {"multiprocessors", 132}};
  GoldenProvenance cuda_now = cuda_golden;
  CHECK(choose_golden_mode(cuda_golden, cuda_now).mode == GoldenMode::kExact);
  cuda_now.backend_description["multiprocessors"] = 114;
  const GoldenModeChoice other_device = choose_golden_mode(cuda_golden, cuda_now);
  CHECK(other_device.mode == GoldenMode::kTolerance);
  CHECK_THAT(other_device.reason, Catch::Contains("another device"));
  cuda_now = cuda_golden;
  cuda_now.backend_description["deterministic"] = true;
  cuda_now.backend_description["multiprocessors"] = 114;
  CHECK(choose_golden_mode(cuda_golden, cuda_now).mode == GoldenMode::kExact);

  CHECK(choose_golden_mode(cuda_golden, golden).mode == GoldenMode::kTolerance);  // another backend
  GoldenProvenance unknown;
  unknown.backend = "flashinfer";
  CHECK(choose_golden_mode(unknown, unknown).mode == GoldenMode::kTolerance);
}

TEST_CASE("golden provenance: device, driver and library differences are listed", "[golden]") {
  GoldenProvenance golden;
  golden.backend = "cuda-fp8";
  golden.backend_description = {{"device", "NVIDIA H100"}, {"driver_version", 12040}};
  golden.platform = {{"libc", "glibc 2.36"}};
  golden.kvaudit_version = "0.1.0";
  golden.kvaudit_revision = "abc1234";
  golden.date_utc = "2026-01-01T00:00:00Z";
  GoldenProvenance current = golden;
  current.date_utc = "2026-02-02T00:00:00Z";  // never listed
  current.host = "elsewhere";
  CHECK(provenance_differences(golden, current).empty());
  current.backend_description["device"] = "NVIDIA H200";
  current.platform["libc"] = "glibc 2.39";
  current.kvaudit_revision = "def5678";
  const std::vector<std::string> lines = provenance_differences(golden, current);
  REQUIRE(lines.size() == 3);
  CHECK(lines[0] == R"(backend device: "NVIDIA H100" -> "NVIDIA H200")");
  CHECK(lines[1] == R"(platform libc: "glibc 2.36" -> "glibc 2.39")");
  CHECK(lines[2] == "kvaudit revision: abc1234 -> def5678");
}

}  // namespace kvaudit

namespace kvaudit {
namespace {

// A cuda-fp8 golden provenance on an H200 with the kernel variant `variant` (describe()'s
// "kernel_variant", written out here rather than by kernel_variant_json).
GoldenProvenance cuda_provenance(const nlohmann::json& variant) {
  GoldenProvenance provenance;
  provenance.backend = "cuda-fp8";
  provenance.backend_description = {
      {"device", "NVIDIA H200"}, {"multiprocessors", 132}, {"kernel_variant", variant}};
  return provenance;
}

const nlohmann::json kDefaultVariant = {{"mma", "wgmma"},
                                        {"mma_requested", "auto"},
                                        {"decode16", "auto"},
                                        {"host_plan", true},
                                        {"longest_first", true}};

}  // namespace

TEST_CASE("golden file: the backend's kernel variant is stored and read back", "[golden]") {
  Golden golden = one_entry_golden({1.0f, 2.0f});
  golden.provenance = cuda_provenance(kDefaultVariant);
  golden.provenance.dump_sha256 = std::string(64, 'b');
  const auto path = test_tmp_path("golden_kernel_variant.golden.h5");
  REQUIRE(write_golden_file(path, golden).ok());
  const auto read = read_golden_file(path);
  REQUIRE(read.ok());
  REQUIRE(read->provenance.backend_description.contains("kernel_variant"));
  CHECK(read->provenance.backend_description["kernel_variant"] == kDefaultVariant);
  CHECK(read->provenance.backend_description["kernel_variant"]["mma"] == "wgmma");
}

TEST_CASE(
    "golden check: another kernel variant is listed per field, and mma or decode16 make it "
    "tolerance",
    "[golden]") {
  const GoldenProvenance golden = cuda_provenance(kDefaultVariant);
  CHECK(choose_golden_mode(golden, golden).mode == GoldenMode::kExact);
  CHECK(provenance_differences(golden, golden).empty());

  nlohmann::json mma_sync = kDefaultVariant;
  mma_sync["mma"] = "mma-sync";
  mma_sync["mma_requested"] = "mma-sync";
  const GoldenProvenance other_mma = cuda_provenance(mma_sync);
  const GoldenModeChoice mode = choose_golden_mode(golden, other_mma);
  CHECK(mode.mode == GoldenMode::kTolerance);
  CHECK_THAT(mode.reason, Catch::Contains(R"(kernel_variant.mma "wgmma" -> "mma-sync")"));
  const std::vector<std::string> lines = provenance_differences(golden, other_mma);
  REQUIRE(lines.size() == 2);
  CHECK(lines[0] == R"(backend kernel_variant.mma: "wgmma" -> "mma-sync")");
  CHECK(lines[1] == R"(backend kernel_variant.mma_requested: "auto" -> "mma-sync")");

  nlohmann::json registers = kDefaultVariant;
  registers["decode16"] = "registers";
  CHECK(choose_golden_mode(golden, cuda_provenance(registers)).mode == GoldenMode::kTolerance);

  // A golden file from before the variant was recorded ran the defaults: exact against a default
  // run on its device, tolerance against a run that forces another kernel.
  GoldenProvenance unrecorded = golden;
  unrecorded.backend_description.erase("kernel_variant");
  CHECK(choose_golden_mode(unrecorded, golden).mode == GoldenMode::kExact);
  const GoldenModeChoice forced = choose_golden_mode(unrecorded, other_mma);
  CHECK(forced.mode == GoldenMode::kTolerance);
  CHECK_THAT(forced.reason,
             Catch::Contains(R"(kernel_variant.mma_requested (not recorded) -> "mma-sync")"));

  // The host plan and the row groups' order change no bit: still exact on the same device.
  nlohmann::json plan_off = kDefaultVariant;
  plan_off["host_plan"] = false;
  plan_off["longest_first"] = false;
  const GoldenProvenance same_kernels = cuda_provenance(plan_off);
  CHECK(choose_golden_mode(golden, same_kernels).mode == GoldenMode::kExact);
  CHECK(provenance_differences(golden, same_kernels) ==
        std::vector<std::string>{"backend kernel_variant.host_plan: true -> false",
                                 "backend kernel_variant.longest_first: true -> false"});
}

TEST_CASE("golden check: a mismatch names the kernel variant of the golden file and of this run",
          "[golden]") {
  const GoldenProvenance golden = cuda_provenance(kDefaultVariant);
  CHECK(kernel_variant_lines(golden, golden) ==
        std::vector<std::string>{
            "kernel variant (the golden file's and this run's): decode16=auto, host_plan=true, "
            "longest_first=true, mma=wgmma, mma_requested=auto"});

  nlohmann::json shared_tile = kDefaultVariant;
  shared_tile["decode16"] = "shared-tile";
  CHECK(
      kernel_variant_lines(golden, cuda_provenance(shared_tile)) ==
      std::vector<std::string>{"kernel variant of the golden file: decode16=auto, host_plan=true, "
                               "longest_first=true, mma=wgmma, mma_requested=auto",
                               "kernel variant of this run: decode16=shared-tile, host_plan=true, "
                               "longest_first=true, mma=wgmma, mma_requested=auto"});

  // A golden file from before the variant was recorded, and a backend without one (cpu-fp8).
  GoldenProvenance old = golden;
  old.backend_description.erase("kernel_variant");
  CHECK(kernel_variant_lines(old, golden) ==
        std::vector<std::string>{"kernel variant of the golden file: (not recorded)",
                                 "kernel variant of this run: decode16=auto, host_plan=true, "
                                 "longest_first=true, mma=wgmma, mma_requested=auto"});
  CHECK(choose_golden_mode(old, golden).mode == GoldenMode::kExact);
  CHECK(kernel_variant_lines(old, old).empty());
}

}  // namespace kvaudit
