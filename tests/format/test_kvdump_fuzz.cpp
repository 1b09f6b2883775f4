// Mutation fuzzing of the kvdump reader through `kvaudit info`: a small valid dump is damaged
// many times (byte flips, truncations, attribute and shape edits) and every run must end with
// exit status 0 (still valid), 1 or 2 (refused): never a crash, an abort, an internal error or a
// hang (`timeout 20` turns a hang into 124). A failing input is kept as fuzz-failure-N.h5 in the
// test directory so it can be replayed with `kvaudit info`.
#include <catch2/catch.hpp>
#include <cmath>
#include <functional>
#include <limits>
#include <random>

#include "kvaudit_test_config.hpp"  // KVAUDIT_BINARY, KVAUDIT_SOURCE_DIR, KVAUDIT_TEST_TMPDIR
#include "src/format/kvdump.hpp"
#include "tests/format/kvdump_fixture.hpp"

namespace kvaudit {
namespace {

using testing::RawFile;

constexpr int kMutations = 160;

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

TEST_CASE("kvaudit info survives mutated dumps: exit 0, 1 or 2 every time", "[kvdump][fuzz]") {
  const auto dir = testing::kvdump_test_dir();
  const auto base = testing::fresh_dump("fuzz-base.h5");
  const std::string original = testing::read_text(base);
  REQUIRE(original.size() > 512);
  const auto target = dir / "fuzz.h5";
  const std::string command = std::string("timeout 20 '") + KVAUDIT_BINARY + "' info '" +
                              target.string() + "' > /dev/null 2>&1";
  std::mt19937 rng(20260601);
  std::vector<Outcome> failures;
  int accepted = 0, refused = 0;
  for (int i = 0; i < kMutations; ++i) {
    std::string description;
    std::string bytes = original;
    const int kind = static_cast<int>(rng() % 10);
    if (kind < 5) {
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
    if (kind >= 7) {
      RawFile f(target);
      structural_mutation(f, rng, &description);
    }
    const int status = testing::run_command(command);
    if (status == 0) ++accepted;
    if (status == 2) ++refused;
    if (status != 0 && status != 1 && status != 2) {
      const auto kept = dir / ("fuzz-failure-" + std::to_string(i) + ".h5");
      std::filesystem::copy_file(target, kept, std::filesystem::copy_options::overwrite_existing);
      failures.push_back({status, description + " (kept as " + kept.string() + ")"});
    }
  }
  for (const Outcome& f : failures) {
    UNSCOPED_INFO("exit status " << f.status << " after " << f.description);
  }
  CHECK(failures.empty());
  // The mutations must actually exercise the refusal paths, not only flip payload bytes.
  CHECK(refused > kMutations / 4);
  INFO("accepted " << accepted << ", refused " << refused);
  CHECK(accepted + refused + static_cast<int>(failures.size()) <= kMutations);
}

}  // namespace
}  // namespace kvaudit
