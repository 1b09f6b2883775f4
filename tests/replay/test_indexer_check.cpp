// The indexer cache checks of a kvdump v1.2 dump (src/replay/indexer_check.hpp). The rule's
// codes and scales are checked against values worked out by hand (below, in each case); the
// checks of a dump run on the Python package's small example dump (python -m kvdump.indexer_fp8
// --write-example: one request, page size 4, slot = position, two layers with an indexer of 2
// heads x 32, top-4, 9 cached tokens, a 3-row prefill S000 at positions 9..11 and a decode S001
// at 12), written by Debian's /usr/bin/python3 with numpy and h5py, clean and with one planted
// corruption each, which must be caught with the right check and the slot or row it is in.
#include <hdf5.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "src/replay/indexer_check.hpp"
#include "src/replay/replay.hpp"
#include "tests/cli/shard_commands.hpp"
#include "tests/format/kvdump_fixture.hpp"
#include "tests/test_paths.hpp"

namespace kvaudit {
namespace {

IndexerMeta meta_of(int head_dim, int block, IndexRotation rotation, IndexScaleFormat format) {
  IndexerMeta meta;
  meta.n_heads = 1;
  meta.head_dim = head_dim;
  meta.block_size = block;
  meta.topk = 1;
  meta.rotation = rotation;
  meta.scale_format = format;
  meta.softmax_scale = 1.0;
  return meta;
}

TEST_CASE("indexer rule: Hadamard rotation, power-of-two scale, e4m3 codes by hand",
          "[indexer][v1.2]") {
  // x = [3, 1]: bf16 exact; H_2 x = [4, 2]; times fp32(2^-0.5) = 0.70710677 and rounded to bf16
  // (8 significant bits): 2.828427 -> 2.828125, 1.4142135 -> 1.4140625. amax 2.828125 times
  // fp32(1/448) = 0.0063128 -> the power of two above, 2^-7. Codes: 2.828125 / 2^-7 = 362 ->
  // e4m3 352 (256 x 1.375: 0x7B), 1.4140625 / 2^-7 = 181 -> 176 (128 x 1.375: 0x73).
  const std::vector<float> x = {3.0f, 1.0f};
  const std::vector<float> y = indexer_rotate(x, IndexRotation::kHadamard);
  CHECK(y == std::vector<float>{2.828125f, 1.4140625f});
  const IndexerRow row = indexer_quantize_row(
      x, meta_of(2, 2, IndexRotation::kHadamard, IndexScaleFormat::kPowerOfTwo));
  CHECK(row.codes == std::vector<std::uint8_t>{0x7B, 0x73});
  CHECK(row.scales == std::vector<float>{0.0078125f});
}

TEST_CASE("indexer rule: a Hadamard rotation of a width not a power of two is an error",
          "[indexer][v1.2]") {
  // The reader refuses such a dump; this is the backstop (the transform indexed past its vector).
  const std::vector<float> x(24, 1.0f);
  CHECK_THROWS_AS(indexer_rotate(x, IndexRotation::kHadamard), std::invalid_argument);
  CHECK(indexer_rotate(x, IndexRotation::kNone).size() == 24);
}

TEST_CASE("indexer rule: no rotation, float32 scale, one scale per block, by hand",
          "[indexer][v1.2]") {
  // Two blocks of 2. Block 0: bf16 [1, -0.5], amax 1, s = fp32(1 x fp32(1/448)); codes 1/s =
  // 448 (0x7E), -0.5/s = -224 (128 x 1.75, negative: 0xF6). Block 1: bf16(0.3) = 0.30078125,
  // 2; amax 2, s = 2 fp32(1/448); 0.30078125/s = 67.375 -> 64 (0x68); 2/s = 448 (0x7E).
  const std::vector<float> x = {1.0f, -0.5f, 0.3f, 2.0f};
  const IndexerRow row =
      indexer_quantize_row(x, meta_of(4, 2, IndexRotation::kNone, IndexScaleFormat::kFloat32));
  CHECK(row.codes == std::vector<std::uint8_t>{0x7E, 0xF6, 0x68, 0x7E});
  const float inverse = 1.0f / 448.0f;
  CHECK(row.scales == std::vector<float>{inverse, 2.0f * inverse});
  // The amax floor: an all-zero block gets 1e-4 / 448 rounded up to a power of two, 2^-22.
  const IndexerRow zeros =
      indexer_quantize_row(std::vector<float>{0.0f, 0.0f},
                           meta_of(2, 2, IndexRotation::kNone, IndexScaleFormat::kPowerOfTwo));
  CHECK(zeros.scales == std::vector<float>{0x1p-22f});
  CHECK(zeros.codes == std::vector<std::uint8_t>{0x00, 0x00});
}

TEST_CASE("indexer top-k: a valid top-k, with ties of the k-th score either way",
          "[indexer][v1.2]") {
  const std::vector<double> none(5, 0.0);
  const std::vector<double> scores = {0.5, 0.0, 0.0, 0.9, 0.1};
  std::string why;
  CHECK(is_valid_topk(std::vector<std::int64_t>{3, 0, 4}, scores, none, 3, &why));
  CHECK(is_valid_topk(std::vector<std::int64_t>{4, -1, 0, 3}, scores, none, 3, &why));
  CHECK_FALSE(is_valid_topk(std::vector<std::int64_t>{3, 0, 1}, scores, none, 3, &why));
  CHECK_THAT(why, Catch::Matchers::Contains("position 1 scores 0, below the 3-th largest"));
  CHECK_FALSE(is_valid_topk(std::vector<std::int64_t>{3, 0, 0}, scores, none, 3, &why));
  CHECK_THAT(why, Catch::Matchers::Contains("position 0 is picked twice"));
  CHECK_FALSE(is_valid_topk(std::vector<std::int64_t>{3, 0, 5}, scores, none, 3, &why));
  CHECK_THAT(why, Catch::Matchers::Contains("position 5 is not visible"));
  CHECK_FALSE(is_valid_topk(std::vector<std::int64_t>{3, 0, -1}, scores, none, 3, &why));
  CHECK_THAT(why, Catch::Matchers::Contains("2 positions picked, expected"));
  // Ties: scores [1, 0, 0, 0], k = 2: 0 is the 2nd score; any one of the zeros may join 1.
  const std::vector<double> tied = {1.0, 0.0, 0.0, 0.0};
  const std::vector<double> none4(4, 0.0);
  CHECK(is_valid_topk(std::vector<std::int64_t>{0, 3}, tied, none4, 2, &why));
  CHECK(is_valid_topk(std::vector<std::int64_t>{2, 0}, tied, none4, 2, &why));
  CHECK_FALSE(is_valid_topk(std::vector<std::int64_t>{1, 2}, tied, none4, 2, &why));
  CHECK_THAT(why, Catch::Matchers::Contains("2 positions tied with the 2-th largest"));
  // Fewer visible tokens than K: every visible one.
  CHECK(is_valid_topk(std::vector<std::int64_t>{1, 0, -1, -1}, std::vector<double>{0.2, 0.1},
                      std::vector<double>{0.0, 0.0}, 4, &why));
  // A difference within the rounding tolerance is a tie.
  CHECK(is_valid_topk(std::vector<std::int64_t>{1}, std::vector<double>{1.0, 1.0 - 1e-16},
                      std::vector<double>{1e-15, 1e-15}, 1, &why));
}

TEST_CASE("indexer top-k: a NaN score ranks above every number, as torch.topk ranks it",
          "[indexer][v1.2]") {
  const std::vector<double> scores = {std::nan(""), 0.5, 0.9, std::nan("")};
  const std::vector<double> none(4, 0.0);
  std::string why;
  CHECK(is_valid_topk(std::vector<std::int64_t>{0}, scores, none, 1, &why));
  CHECK(is_valid_topk(std::vector<std::int64_t>{3}, scores, none, 1, &why));  // NaNs tie
  CHECK(is_valid_topk(std::vector<std::int64_t>{3, 0, 2}, scores, none, 3, &why));
  CHECK_FALSE(is_valid_topk(std::vector<std::int64_t>{2}, scores, none, 1, &why));
  CHECK_THAT(why, Catch::Matchers::Contains("position 2 scores 0.9, below the 1-th largest "
                                            "deployed score nan"));
  CHECK_FALSE(is_valid_topk(std::vector<std::int64_t>{0, 2}, scores, none, 2, &why));
  CHECK_THAT(why, Catch::Matchers::Contains("position 2 scores 0.9, below"));
}

TEST_CASE("indexer rule: a NaN in a block makes its scale NaN and its codes NaN (torch's amax)",
          "[indexer][v1.2]") {
  const IndexerRow row =
      indexer_quantize_row(std::vector<float>{std::nanf(""), 1.0f, 2.0f, 4.0f},
                           meta_of(4, 2, IndexRotation::kNone, IndexScaleFormat::kPowerOfTwo));
  REQUIRE(row.scales.size() == 2);
  CHECK(std::isnan(row.scales[0]));
  CHECK(row.scales[1] == 0x1p-6f);  // 4 / 448 rounded up to a power of two
  CHECK(row.codes[0] == 0x7F);
  CHECK(row.codes[1] == 0x7F);
}

TEST_CASE("indexer top-k: a negative entry other than the padding -1 is its own failure",
          "[indexer][v1.2]") {
  // Fewer visible tokens than K, so padding is due: -1 is padding, -5 is not (it was dropped as
  // padding and the row passed).
  const std::vector<double> scores = {0.2, 0.1};
  const std::vector<double> none(2, 0.0);
  std::string why;
  CHECK(is_valid_topk(std::vector<std::int64_t>{1, 0, -1, -1}, scores, none, 4, &why));
  CHECK_FALSE(is_valid_topk(std::vector<std::int64_t>{1, 0, -1, -5}, scores, none, 4, &why));
  CHECK_THAT(why, Catch::Matchers::Contains("entry -5 is neither a position nor the padding -1"));
}

// ---- the checks on the example dump -------------------------------------------------------------

std::filesystem::path example_dump(const std::string& name) {
  const std::filesystem::path path = testing::kvdump_test_dir() / name;
  std::filesystem::remove(path);
  const std::string command = "PYTHONPATH='" + (kvaudit_test::source_dir() / "python").string() +
                              "' /usr/bin/python3 -B -m kvdump.indexer_fp8 --write-example '" +
                              path.string() + "' > /dev/null";
  INFO(command);
  REQUIRE(testing::run_command(command) == 0);
  return path;
}

// Reads a whole dataset as `memory_type` elements of T, lets `edit` change them, writes them back.
template <typename T>
void edit_dataset(const std::filesystem::path& file, const std::string& path, hid_t memory_type,
                  const std::function<void(std::vector<T>&)>& edit) {
  testing::RawFile raw(file);
  const hid_t dataset = H5Dopen2(raw.id(), path.c_str(), H5P_DEFAULT);
  REQUIRE(dataset >= 0);
  const hid_t space = H5Dget_space(dataset);
  std::vector<T> values(static_cast<std::size_t>(H5Sget_simple_extent_npoints(space)));
  REQUIRE(H5Dread(dataset, memory_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()) >= 0);
  edit(values);
  REQUIRE(H5Dwrite(dataset, memory_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()) >= 0);
  H5Sclose(space);
  H5Dclose(dataset);
}

CheckRun check_without_backend(const std::filesystem::path& path) {
  auto reader = DumpReader::open(path);
  if (!reader.ok()) FAIL(reader.error().message());
  ReplayOptions options;
  options.policy = default_policy();
  options.threads = 2;
  auto run = replay_dump(*reader, nullptr, options);
  if (!run.ok()) FAIL(run.error().message());
  return std::move(run.value());
}

std::vector<const IntegrityFinding*> failing(const CheckRun& run) {
  std::vector<const IntegrityFinding*> found;
  for (const IntegrityFinding& f : run.integrity) {
    if (!f.pass) found.push_back(&f);
  }
  return found;
}

constexpr int kWidth = 32;  // the example's index_head_dim (one block: G = 1)

TEST_CASE("check judges the indexer cache of a clean v1.2 dump: every check passes",
          "[indexer][v1.2]") {
  const CheckRun run = check_without_backend(example_dump("indexer-clean.h5"));
  std::size_t indexer_checks = 0;
  for (const IntegrityFinding& f : run.integrity) {
    if (!is_indexer_check(f.check)) continue;
    ++indexer_checks;
    INFO(f.detail);
    CHECK(f.pass);
  }
  // 2 layers x 2 steps x (written slots, unwritten slots, top-k).
  CHECK(indexer_checks == 12);
  CHECK(run.pass());
}

TEST_CASE("check catches each planted corruption of the indexer cache, naming where",
          "[indexer][v1.2]") {
  struct Case {
    const char* name;
    std::function<void(const std::filesystem::path&)> plant;
    IntegrityCheck check;
    int step;
    std::string detail;
  };
  // Planted in the last step's cache after (S001, the decode at position 12: slot 12, page 3
  // offset 0), so that no later step carries the damage.
  const std::string s1 = "/steps/S001/L000/indexer/";
  const std::vector<Case> cases = {
      {"one byte of a written slot (slot 12, element 5)",
       [&](const std::filesystem::path& p) {
         edit_dataset<std::uint8_t>(p, s1 + "k_cache_after", H5T_NATIVE_UINT8,
                                    [](auto& v) { v[12 * kWidth + 5] ^= 0x01; });
       },
       IntegrityCheck::kIndexerWrittenSlots, 1,
       "S001 L000: indexer cache: 1 written slot(s) not holding the deployed rule's bytes "
       "(hadamard, e4m3, power_of_two scale per 32) of their new_k row: slot 12 "
       "(k_cache_after[3, 0, 5]"},
      {"an untouched slot changed (slot 3, a cached token)",
       [&](const std::filesystem::path& p) {
         edit_dataset<std::uint8_t>(p, s1 + "k_cache_after", H5T_NATIVE_UINT8,
                                    [](auto& v) { v[3 * kWidth] ^= 0x10; });
       },
       IntegrityCheck::kIndexerUnwrittenSlots, 1,
       "S001 L000: indexer cache: 1 slot(s) the step did not write changed: slot 3 "
       "(k_cache_after[0, 3, 0]"},
      {"a wrong scale of a written slot (slot 12 doubled)",
       [&](const std::filesystem::path& p) {
         edit_dataset<float>(p, s1 + "k_scales_after", H5T_NATIVE_FLOAT,
                             [](auto& v) { v[12] *= 2.0f; });
       },
       IntegrityCheck::kIndexerWrittenSlots, 1,
       "written slot(s) not holding the deployed rule's bytes (hadamard, e4m3, power_of_two "
       "scale per 32) of their new_k row: slot 12 (k_scales_after[3, 0, 0]"},
      {"a stored top-k that differs (S001 row 0 picks one position twice)",
       [&](const std::filesystem::path& p) {
         edit_dataset<std::int32_t>(p, "/steps/S001/L001/indexer/topk_indices", H5T_NATIVE_INT32,
                                    [](auto& v) { v[0] = v[1]; });
       },
       IntegrityCheck::kIndexerTopk, 1,
       "S001 L001: indexer top-k: 1 row(s) whose stored topk_indices is not a top-k of the "
       "deployed scores recomputed from the FP8 cache and query: rows 0; row 0 (position 12): "
       "position"},
  };
  for (const Case& c : cases) {
    INFO("planted: " << c.name);
    const auto path = example_dump("indexer-planted.h5");
    c.plant(path);
    const CheckRun run = check_without_backend(path);
    // One failing finding of the planted kind, at the planted step. A damaged slot may also move
    // the scores the step's top-k is recomputed from (the row's own key in slot 12), so an
    // indexer_topk failure at that step may come with it; nothing else may fail.
    std::vector<const IntegrityFinding*> of_kind;
    for (const IntegrityFinding* f : failing(run)) {
      INFO(f->detail);
      CHECK(f->step == c.step);
      CHECK((f->check == c.check || f->check == IntegrityCheck::kIndexerTopk));
      if (f->check == c.check) of_kind.push_back(f);
    }
    REQUIRE(of_kind.size() == 1);
    CHECK_THAT(of_kind[0]->detail, Catch::Matchers::Contains(c.detail));
    CHECK_FALSE(run.pass());
  }
}

TEST_CASE("check's stored top-k check catches a pick below the k-th deployed score",
          "[indexer][v1.2]") {
  // S001 of layer 0 (the decode at position 12: 13 visible, top-4): replace the first pick by a
  // position the row did not pick. An unpicked position scores at most the 4th score; one that
  // scores below it (all nine tie with the 4th only if no two keys differ, which the example's
  // random keys rule out) is a disagreement, named by its position.
  const std::string topk = "/steps/S001/L000/indexer/topk_indices";
  std::vector<std::int32_t> stored;
  edit_dataset<std::int32_t>(example_dump("indexer-topk.h5"), topk, H5T_NATIVE_INT32,
                             [&](auto& v) { stored = v; });
  REQUIRE(stored.size() == 4);
  int caught = 0;
  for (int unpicked = 0; unpicked <= 12; ++unpicked) {
    if (std::find(stored.begin(), stored.end(), unpicked) != stored.end()) continue;
    const auto path = example_dump("indexer-topk.h5");
    edit_dataset<std::int32_t>(path, topk, H5T_NATIVE_INT32, [&](auto& v) { v[0] = unpicked; });
    const CheckRun run = check_without_backend(path);
    for (const IntegrityFinding* f : failing(run)) {
      REQUIRE(f->check == IntegrityCheck::kIndexerTopk);
      CHECK_THAT(f->detail,
                 Catch::Matchers::Contains("position " + std::to_string(unpicked) + " scores"));
      ++caught;
    }
  }
  CHECK(caught > 0);
}

TEST_CASE("check names each non-finite value the indexer's scores read as indexer_nonfinite",
          "[indexer][v1.2]") {
  // NaN codes and scales are planted in slot 3 (a cached token every row of both steps reads) of
  // layer 0's cache and of both steps' captured caches alike, so the cache is consistent (no slot
  // moves) and only the non-finite value is wrong; inputs are planted in S001 of layer 0.
  struct Case {
    const char* name;
    std::function<void(const std::filesystem::path&)> plant;
    std::vector<int> steps;  // the steps with an indexer_nonfinite finding
    std::string detail;
  };
  const std::string l0 = "/layers/L000/indexer/";
  const std::string s0 = "/steps/S000/L000/indexer/";
  const std::string s1 = "/steps/S001/L000/indexer/";
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const auto in_every_cache =
      [&](const std::filesystem::path& p, const std::string& name,
          const std::function<void(std::vector<float>&)>& edit_scales,
          const std::function<void(std::vector<std::uint8_t>&)>& edit_codes) {
        const std::string after = name == "scales" ? "k_scales_after" : "k_cache_after";
        const std::string before = name == "scales" ? "k_scales" : "k_cache";
        for (const std::string& path : {l0 + before, s0 + after, s1 + after}) {
          if (name == "scales") {
            edit_dataset<float>(p, path, H5T_NATIVE_FLOAT, edit_scales);
          } else {
            edit_dataset<std::uint8_t>(p, path, H5T_NATIVE_UINT8, edit_codes);
          }
        }
      };
  const std::vector<Case> cases = {
      {"a NaN scale in a slot the rows read",
       [&](const std::filesystem::path& p) {
         in_every_cache(
             p, "scales", [&](auto& v) { v[3] = nan; }, nullptr);
       },
       {0, 1},
       "1 slot(s) the rows read hold NaN codes or non-finite scales: slot 3; slot 3 "
       "(page 0, offset 3): scale nan of block 0"},
      {"a NaN code in a slot the rows read",
       [&](const std::filesystem::path& p) {
         in_every_cache(p, "codes", nullptr, [&](auto& v) { v[3 * kWidth + 7] = 0xFF; });
       },
       {0, 1},
       "slot 3 (page 0, offset 3): NaN code 0xff at element 7"},
      {"a NaN in new_k",
       [&](const std::filesystem::path& p) {
         edit_dataset<float>(p, s1 + "new_k", H5T_NATIVE_FLOAT, [&](auto& v) { v[5] = nan; });
       },
       {1},
       "inputs new_k[0, 5] nan (1 non-finite)"},
      {"a NaN in the indexer query",
       [&](const std::filesystem::path& p) {
         edit_dataset<float>(p, s1 + "q", H5T_NATIVE_FLOAT, [&](auto& v) { v[kWidth + 3] = nan; });
       },
       {1},
       "inputs q[0, 35] nan (1 non-finite)"},
      {"an infinite head weight",
       [&](const std::filesystem::path& p) {
         edit_dataset<float>(p, s1 + "weights", H5T_NATIVE_FLOAT,
                             [&](auto& v) { v[1] = std::numeric_limits<float>::infinity(); });
       },
       {1},
       "inputs weights[0, 1] inf (1 non-finite)"},
  };
  for (const Case& c : cases) {
    INFO("planted: " << c.name);
    const auto path = example_dump("indexer-nonfinite.h5");
    c.plant(path);
    const CheckRun run = check_without_backend(path);
    std::vector<int> steps;
    for (const IntegrityFinding* f : failing(run)) {
      INFO(f->detail);
      // Not a byte mismatch of the writes or a moved slot; the top-k may fail beside it.
      CHECK((f->check == IntegrityCheck::kIndexerNonFinite ||
             f->check == IntegrityCheck::kIndexerTopk));
      if (f->check != IntegrityCheck::kIndexerNonFinite) continue;
      CHECK_THAT(f->detail, Catch::Matchers::Contains(c.detail));
      steps.push_back(f->step);
    }
    CHECK(steps == c.steps);
    CHECK_FALSE(run.pass());
  }
}

TEST_CASE("kvaudit check on a v1.2 dump: exit status, the recall note, merge of shards, repro",
          "[indexer][v1.2][cli]") {
  using kvaudit_test::differing_keys;
  using kvaudit_test::read_json;
  using kvaudit_test::run_kvaudit;
  // Without a backend: the example's captured attention outputs pass, while with cpu-fp8 its
  // kernel lse error (1.6e-3) is past the limit (9.8e-4) and would fail the run on its own.
  // A written slot of layer 1 damaged at S001: the run fails (exit 1) on indexer_written_slots,
  // the console says the recall is not judged and by which command, and the two shards' parts
  // (layer 0, layer 1) merge into the unsharded report, indexer findings in the same order.
  const auto path = example_dump("indexer-cli.h5");
  edit_dataset<std::uint8_t>(path, "/steps/S001/L001/indexer/k_cache_after", H5T_NATIVE_UINT8,
                             [](auto& v) { v[12 * kWidth] ^= 0x01; });
  const std::filesystem::path dir = testing::kvdump_test_dir() / "indexer-cli";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string dump = " '" + path.string() + "' --backend none --threads 2";
  const auto whole = run_kvaudit(
      "indexer-whole", "check" + dump + " --json '" + (dir / "whole.json").string() + "'");
  INFO(whole.out << whole.err);
  CHECK(whole.status == 1);
  CHECK_THAT(whole.out, Catch::Matchers::Contains(
                            "note: the DSA indexer's top-k recall against the exact scores"));
  CHECK_THAT(whole.out, Catch::Matchers::Contains("python -m kvdump.indexer_fp8 "));
  CHECK_THAT(whole.out,
             Catch::Matchers::Contains("step 1 layer 1 indexer_written_slots: S001 L001: indexer "
                                       "cache: 1 written slot(s)"));
  std::string parts;
  for (int index = 0; index < 2; ++index) {
    const auto part = dir / ("part-" + std::to_string(index) + ".json");
    const auto outcome = run_kvaudit(
        "indexer-part-" + std::to_string(index),
        "check" + dump + " --shard " + std::to_string(index) + "/2 --json '" + part.string() + "'");
    INFO(outcome.out << outcome.err);
    REQUIRE((outcome.status == 0 || outcome.status == 1));
    parts += " '" + part.string() + "'";
  }
  const auto merged = run_kvaudit(
      "indexer-merge", "merge" + parts + " --json '" + (dir / "merged.json").string() + "'");
  INFO(merged.out << merged.err);
  CHECK(merged.status == 1);
  const nlohmann::json unsharded = read_json(dir / "whole.json");
  CHECK(differing_keys(unsharded, read_json(dir / "merged.json")) == std::vector<std::string>{});
  std::size_t indexer_findings = 0;
  for (const auto& finding : unsharded.at("integrity")) {
    indexer_findings += finding.at("check").get<std::string>().rfind("indexer_", 0) == 0 ? 1 : 0;
  }
  CHECK(indexer_findings == 12);
  // --emit-repro: a repro leaves the indexer cache out, so a run that failed only there has no
  // repro to write, and says so.
  const auto repro_path = dir / "repro.h5";
  const auto repro =
      run_kvaudit("indexer-repro", "check" + dump + " --emit-repro '" + repro_path.string() + "'");
  INFO(repro.out << repro.err);
  CHECK(repro.status == 1);
  CHECK_THAT(repro.err, Catch::Matchers::Contains(
                            "the run failed only on the DSA indexer cache (kvdump v1.2), which a "
                            "repro leaves out; --emit-repro wrote nothing"));
  CHECK_FALSE(std::filesystem::exists(repro_path));
}

}  // namespace
}  // namespace kvaudit
