// Mutation fuzzing of the kvdump reader through `kvaudit info`: a valid dump is damaged many times
// (byte flips, truncations, attribute and shape edits) and every run must end with exit status 0
// (still valid), 1 or 2 (refused): never a crash, an abort, an internal error or a hang
// (`timeout 20` turns a hang into 124). A failing input is kept as fuzz-failure-N.h5 in the test
// directory so it can be replayed with `kvaudit info`.
//
// Two inputs: the small dump of kvdump_fixture.hpp (written by kvaudit: fixed-length strings), and
// each shipped dump of datasets/ (written by h5py's older writer: variable-length string
// attributes in HDF5's global heap, the structure HDF5 1.10 reads unchecked).
//
// The binary is $KVAUDIT_TEST_BINARY when set (tests/test_paths.hpp), so scripts/run-tests.sh runs
// these cases through a build with -DKVAUDIT_SANITIZE=address,undefined; every sanitizer report
// is then collected (sanitizer_reports.hpp): HDF5's own faults are contained by the probe child,
// a report from kvaudit's own code fails the test. $KVAUDIT_FUZZ_MUTATIONS sets the number of
// mutations per input (default: 160 for the small dump, 12 per shipped dump).
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <limits>
#include <random>

#include "src/format/kvdump.hpp"
#include "tests/format/kvdump_fixture.hpp"
#include "tests/format/sanitizer_reports.hpp"
#include "tests/test_paths.hpp"

namespace kvaudit {
namespace {

using testing::RawFile;

// Mutations per input: $KVAUDIT_FUZZ_MUTATIONS, else `fallback`.
int mutation_count(int fallback) {
  if (const char* text = std::getenv("KVAUDIT_FUZZ_MUTATIONS"); text != nullptr && *text) {
    const int count = std::atoi(text);
    if (count > 0) return count;
  }
  return fallback;
}

struct Outcome {
  int status = 0;
  std::string description;
};

// Structural edits with random parameters, each valid HDF5 but likely breaking the format.
void structural_mutation(RawFile& f, std::mt19937& rng, std::string* description) {
  auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<unsigned>(n)); };
  auto any_int = [&] {
    const std::int64_t choices[] = {0,
                                    -1,
                                    1,
                                    2,
                                    3,
                                    7,
                                    8,
                                    16,
                                    1 << 20,
                                    std::int64_t{1} << 40,
                                    std::numeric_limits<std::int64_t>::min()};
    return choices[pick(11)];
  };
  const char* steps[] = {"/steps/S000", "/steps/S001"};
  const char* layers[] = {"L000", "L003"};
  const char* indices[] = {"qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len",
                           "new_kv_slots"};
  const char* tensors[] = {"q_nope", "q_pe", "new_kv", "out", "lse", "kv_cache_after"};
  const char* root_ints[] = {"num_heads", "kv_lora_rank", "qk_rope_head_dim", "page_size",
                             "format_version"};
  switch (pick(7)) {
    case 0: {
      const char* name = root_ints[pick(5)];
      const std::int64_t value = any_int();
      *description = std::string("/") + name + " = " + std::to_string(value);
      f.set_int("/", name, value);
      break;
    }
    case 1: {
      const double values[] = {0.0,   -1.0,         1e-45,
                               1e300, std::nan(""), std::numeric_limits<double>::infinity()};
      const double value = values[pick(6)];
      const std::string object = std::string("/layers/") + layers[pick(2)];
      *description = object + " kv_scale = " + std::to_string(value);
      f.set_double(object, "kv_scale", value);
      break;
    }
    case 2: {
      const std::string path = std::string(steps[pick(2)]) + "/" + indices[pick(5)];
      std::vector<std::int32_t> values(static_cast<std::size_t>(pick(7)));
      for (auto& v : values) v = static_cast<std::int32_t>(pick(20)) - 2;
      *description = path + " replaced by " + std::to_string(values.size()) + " random values";
      f.replace_index(path, values);
      break;
    }
    case 3: {
      const std::string path =
          std::string(steps[pick(2)]) + "/" + layers[pick(2)] + "/" + tensors[pick(6)];
      std::vector<hsize_t> dims(static_cast<std::size_t>(1 + pick(3)));
      for (auto& d : dims) d = static_cast<hsize_t>(pick(13));
      const hid_t types[] = {H5T_STD_U8LE, H5T_STD_U16LE, H5T_IEEE_F32LE, H5T_STD_I32LE};
      const char* dtypes[] = {nullptr, "bfloat16", "float8_e4m3fn", "float32"};
      *description = path + " replaced by a random shape/type";
      f.replace_zeros(path, dims, types[pick(4)], dtypes[pick(4)]);
      break;
    }
    case 4: {
      const char* objects[] = {"/", "/layers/L000", "/layers/L003", "/steps/S000", "/steps/S001"};
      const char* names[] = {"format",   "model",    "kind",    "layer_id",
                             "kv_scale", "kv_dtype", "sm_scale"};
      const std::string object = objects[pick(5)];
      const std::string name = names[pick(7)];
      *description = "delete attribute " + name + " of " + object;
      if (H5Aexists_by_name(f.id(), object.c_str(), name.c_str(), H5P_DEFAULT) > 0) {
        f.delete_attribute(object, name);
      }
      break;
    }
    case 5: {
      const char* links[] = {"/layers/L000",
                             "/steps/S001",
                             "/steps/S000/L003",
                             "/layers/L003/kv_cache",
                             "/steps/S001/L000/kv_cache_after",
                             "/steps/S000/L000/lse"};
      const std::string link = links[pick(6)];
      *description = "delete " + link;
      f.delete_link(link);
      break;
    }
    default: {
      const char* strings[] = {"kv_dtype", "kv_scale_kind", "format"};
      const char* values[] = {"bfloat16", "", "per_tensor", "float8_e4m3fn", "kvdump", "\xff\xfe"};
      const std::string name = strings[pick(3)];
      const std::string value = values[pick(6)];
      *description = "/" + name + " = \"" + value + "\"";
      f.set_string("/", name, value, pick(2) == 0);
      break;
    }
  }
}

// One damaged copy of `original` at `target`: flips (half the time), a truncation (a fifth), or,
// when `structural` is given, an edit of the dump's structure; the description says which.
std::string mutate(const std::string& original, const std::filesystem::path& target,
                   std::mt19937& rng, bool structural) {
  std::string description;
  std::string bytes = original;
  const int kind = static_cast<int>(rng() % 10);
  if (kind < 5 || (kind >= 7 && !structural)) {
    const int flips = 1 + static_cast<int>(rng() % 8);
    description = std::to_string(flips) + " byte flip(s) at";
    for (int k = 0; k < flips; ++k) {
      const std::size_t at = rng() % bytes.size();
      bytes[at] = static_cast<char>(bytes[at] ^ static_cast<char>(1 + rng() % 255));
      description += " " + std::to_string(at);
    }
  } else if (kind < 7) {
    const std::size_t length = rng() % bytes.size();
    bytes.resize(length);
    description = "truncated to " + std::to_string(length) + " bytes";
  }
  {
    std::ofstream out(target, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  if (kind >= 7 && structural) {
    RawFile f(target);
    structural_mutation(f, rng, &description);
  }
  return description;
}

struct FuzzTally {
  int accepted = 0;
  int refused = 0;
  int hdf5_reports = 0;  // HDF5's own faults, contained by the probe child
  std::vector<Outcome> failures;
};

// `mutations` damaged copies of `original` through `kvaudit info`, each judged by its exit status
// and by the sanitizer reports it left.
FuzzTally fuzz(const std::string& original, const std::string& label, int mutations,
               std::uint32_t seed, bool structural) {
  const auto dir = testing::kvdump_test_dir();
  const auto target = dir / (label + "-fuzz.h5");
  const auto reports = dir / (label + "-sanitizer");
  std::filesystem::create_directories(reports);
  testing::collect_sanitizer_reports(reports);  // from an earlier run
  const std::string command = testing::sanitizer_environment(reports) + "timeout 20 '" +
                              kvaudit_test::kvaudit_binary().string() + "' info '" +
                              target.string() + "' > /dev/null 2>&1";
  std::mt19937 rng(seed);
  FuzzTally tally;
  for (int i = 0; i < mutations; ++i) {
    const std::string description = mutate(original, target, rng, structural);
    const int status = testing::run_command(command);
    const testing::SanitizerReports found = testing::collect_sanitizer_reports(reports);
    tally.accepted += status == 0;
    tally.refused += status == 2;
    tally.hdf5_reports += found.hdf5;
    const bool bad_status = status != 0 && status != 1 && status != 2;
    if (bad_status || !found.kvaudit.empty()) {
      const auto kept = dir / (label + "-fuzz-failure-" + std::to_string(i) + ".h5");
      std::filesystem::copy_file(target, kept, std::filesystem::copy_options::overwrite_existing);
      std::string what = description + " (kept as " + kept.string() + ")";
      for (const std::string& report : found.kvaudit) what += "\n" + report.substr(0, 4000);
      tally.failures.push_back({status, what});
    }
  }
  for (const Outcome& f : tally.failures) {
    UNSCOPED_INFO(label << ": exit status " << f.status << " after " << f.description);
  }
  return tally;
}

TEST_CASE("kvaudit info survives mutated dumps: exit 0, 1 or 2 every time", "[kvdump][fuzz]") {
  const int mutations = mutation_count(160);
  const auto base = testing::fresh_dump("fuzz-base.h5");
  const std::string original = testing::read_text(base);
  REQUIRE(original.size() > 512);
  const FuzzTally tally = fuzz(original, "small", mutations, 20260601, true);
  CHECK(tally.failures.empty());
  // The mutations must actually exercise the refusal paths, not only flip payload bytes.
  CHECK(tally.refused > mutations / 4);
  INFO("accepted " << tally.accepted << ", refused " << tally.refused);
  CHECK(tally.accepted + tally.refused + static_cast<int>(tally.failures.size()) <= mutations);
}

TEST_CASE("kvaudit info survives mutated shipped dumps (h5py-written)", "[kvdump][fuzz]") {
  const int mutations = mutation_count(12);
  const char* dumps[] = {"glm5_page1", "page64_nan", "saturated_page16"};
  for (std::uint32_t d = 0; d < 3; ++d) {
    const std::string original = testing::read_text(kvaudit_test::source_dir() / "datasets" /
                                                    (std::string(dumps[d]) + ".h5"));
    REQUIRE(original.size() > 100000);
    const FuzzTally tally = fuzz(original, dumps[d], mutations, 7 + d, false);
    INFO(dumps[d] << ": accepted " << tally.accepted << ", refused " << tally.refused
                  << ", HDF5 faults contained " << tally.hdf5_reports);
    CHECK(tally.failures.empty());
    CHECK(tally.accepted + tally.refused <= mutations);
  }
}

TEST_CASE("sanitizer reports: HDF5's own faults told apart from kvaudit's", "[kvdump]") {
  // The shape of ASan's report of HDF5 1.10's overlapping memcpy on a damaged global heap.
  const std::string hdf5 =
      "==4242==ERROR: AddressSanitizer: memcpy-param-overlap: memory ranges overlap\n"
      "    #0 0x7f1 in __interceptor_memcpy ../../../../src/libsanitizer/asan/"
      "asan_interceptors.cpp:827\n"
      "    #1 0x7f2 in H5HG_read (/lib/x86_64-linux-gnu/libhdf5_serial.so.103+0x16c1b0)\n"
      "    #2 0x7f3 in kvaudit::ObjectReader::read_string(...) src/format/hdf5_objects.cpp:80\n";
  CHECK(testing::is_hdf5_report(hdf5));
  const std::string ours =
      "==4243==ERROR: AddressSanitizer: heap-buffer-overflow on address 0x602\n"
      "    #0 0x7f1 in __asan_memcpy (/lib/x86_64-linux-gnu/libasan.so.8+0xb8f3c)\n"
      "    #1 0x7f2 in std::vector<int>::assign (/lib/x86_64-linux-gnu/libstdc++.so.6+0x1)\n"
      "    #2 0x7f3 in kvaudit::read_index(...) src/format/kvdump_validator.cpp:190\n"
      "    #3 0x7f4 in H5Dread (/lib/x86_64-linux-gnu/libhdf5_serial.so.103+0x1)\n";
  CHECK_FALSE(testing::is_hdf5_report(ours));
  const std::string undefined =
      "src/format/step_indices.cpp:40:12: runtime error: signed integer overflow\n"
      "    #0 0x55 in kvaudit::check_indptr(...) src/format/step_indices.cpp:40\n";
  CHECK_FALSE(testing::is_hdf5_report(undefined));
  CHECK_FALSE(testing::is_hdf5_report("no stack at all"));
}

}  // namespace
}  // namespace kvaudit
