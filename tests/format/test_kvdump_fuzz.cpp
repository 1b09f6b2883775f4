// Mutation fuzzing of the kvdump reader through `kvaudit info`: a valid dump is damaged many times
// (byte flips, truncations, attribute and shape edits) and every run must end with exit status 0
// (still valid), 1 or 2 (refused): never a crash, an abort, an internal error or a hang
// (`timeout 20` turns a hang into 124). A failing input is kept as fuzz-failure-N.h5 in the test
// directory so it can be replayed with `kvaudit info`.
//
// The seed dumps: kvdump v1, the small dump of kvdump_fixture.hpp (written by kvaudit:
// fixed-length strings) and each shipped v1 dump of datasets/ (written by h5py's older writer:
// variable-length string attributes in HDF5's global heap, the structure HDF5 1.10 reads
// unchecked); kvdump v1.1, three small `synth` dumps (per-token-group scales in each of the three
// scale formats, the split layout with an e4m3 and the packed flashmla_fp8 layout with a bf16
// RoPE part, topk_indices) and the two shipped v1.1 dumps; kvdump v1.2, the Python package's small
// indexer example dump (kvdump.indexer_fp8 --write-example), with edits of its indexer objects. The
// v1.1 seeds also get edits of the v1.1 objects (the root's scale attributes, kv_scales, kv_rope,
// the packed slot, topk_indices), and every mutated input of a small v1.1 seed that `info` accepts
// goes on through `kvaudit check
// --backend cpu-fp8`, which reads the step tensors (topk_indices' values are checked there) and
// judges the group scales: it too must end with exit 0, 1 or 2 (the shipped v1.1 dumps, 40 times
// larger, go through `info` only, to keep the sanitizer run short).
//
// Each case prints one line, "fuzz: N mutated inputs over K seed dumps, F findings, ...", which
// scripts/run-tests.sh adds up.
//
// The binary is $KVAUDIT_TEST_BINARY when set (tests/test_paths.hpp), so scripts/run-tests.sh runs
// these cases through a build with -DKVAUDIT_SANITIZE=address,undefined; every sanitizer report
// is then collected (sanitizer_reports.hpp): HDF5's own faults are contained by the probe child,
// a report from kvaudit's own code fails the test. $KVAUDIT_FUZZ_MUTATIONS sets the number of
// mutations per input (default: 160 for the small dump, 12 per shipped dump, 60 per small v1.1
// dump); $KVAUDIT_FUZZ_V1_1_MUTATIONS, where set, the v1.1 seeds' alone.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <limits>
#include <optional>
#include <random>

#include "src/format/kvdump.hpp"
#include "src/tools/synth.hpp"
#include "tests/format/kvdump_fixture.hpp"
#include "tests/format/sanitizer_reports.hpp"
#include "tests/test_paths.hpp"

namespace kvaudit {
namespace {

using testing::RawFile;

// Mutations per input: $variable, else `fallback`.
int mutation_count(int fallback, const char* variable = "KVAUDIT_FUZZ_MUTATIONS") {
  if (const char* text = std::getenv(variable); text != nullptr && *text) {
    const int count = std::atoi(text);
    if (count > 0) return count;
  }
  return fallback;
}

struct Outcome {
  int status = 0;
  std::string description;
};

// The groups a seed's structural edits aim at, read from the seed itself.
struct DumpShape {
  std::vector<std::string> steps;   // "/steps/S000", ...
  std::vector<std::string> layers;  // "L000", ...
  bool v1_1 = false;                // the root says format_minor_version 1 (or 2)
  bool v1_2 = false;                // the root says format_minor_version 2: indexer objects
};

std::vector<std::string> members(hid_t file, const std::string& group) {
  std::vector<std::string> names;
  H5G_info_t info{};
  if (H5Gget_info_by_name(file, group.c_str(), &info, H5P_DEFAULT) < 0) return names;
  for (hsize_t i = 0; i < info.nlinks; ++i) {
    char name[256] = {};
    if (H5Lget_name_by_idx(file, group.c_str(), H5_INDEX_NAME, H5_ITER_INC, i, name, sizeof name,
                           H5P_DEFAULT) > 0) {
      names.emplace_back(name);
    }
  }
  return names;
}

// Opened read-only: a seed may be a shipped dump of datasets/.
DumpShape shape_of(const std::filesystem::path& seed) {
  const hid_t file = H5Fopen(seed.string().c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  REQUIRE(file >= 0);
  DumpShape shape;
  for (const std::string& step : members(file, "/steps")) shape.steps.push_back("/steps/" + step);
  shape.layers = members(file, "/layers");
  std::int64_t minor = 0;
  if (H5Aexists_by_name(file, "/", "format_minor_version", H5P_DEFAULT) > 0) {
    const hid_t attr = H5Aopen_by_name(file, "/", "format_minor_version", H5P_DEFAULT, H5P_DEFAULT);
    H5Aread(attr, H5T_NATIVE_INT64, &minor);
    H5Aclose(attr);
  }
  H5Fclose(file);
  shape.v1_1 = minor >= 1;
  shape.v1_2 = minor == 2;
  REQUIRE(shape.steps.size() >= 2);
  REQUIRE_FALSE(shape.layers.empty());
  return shape;
}

bool link_exists(const RawFile& f, const std::string& path) {
  // Walks the path one link at a time: H5Lexists fails on a missing intermediate group.
  std::string prefix;
  for (std::size_t at = 1; at <= path.size(); ++at) {
    if (at < path.size() && path[at] != '/') continue;
    prefix = path.substr(0, at);
    if (H5Lexists(f.id(), prefix.c_str(), H5P_DEFAULT) <= 0) return false;
  }
  return true;
}

std::vector<hsize_t> dims_of(const RawFile& f, const std::string& path) {
  const hid_t dataset = H5Dopen2(f.id(), path.c_str(), H5P_DEFAULT);
  REQUIRE(dataset >= 0);
  const hid_t space = H5Dget_space(dataset);
  std::vector<hsize_t> dims(
      static_cast<std::size_t>(std::max(0, H5Sget_simple_extent_ndims(space))));
  H5Sget_simple_extent_dims(space, dims.data(), nullptr);
  H5Sclose(space);
  H5Dclose(dataset);
  return dims;
}

using Pick = std::function<int(int)>;

std::int64_t any_int(const Pick& pick) {
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
}

// Edits of the v1.1 objects: the root's scale attributes, the layer's kv_scales / kv_rope / packed
// kv_cache, the scale values, topk_indices.
void v1_1_mutation(RawFile& f, const DumpShape& shape, const Pick& pick, std::string* description) {
  const std::string layer = "/layers/" + shape.layers[pick(static_cast<int>(shape.layers.size()))];
  const std::string step = shape.steps[pick(static_cast<int>(shape.steps.size()))];
  const std::string step_layer =
      step + "/" + shape.layers[pick(static_cast<int>(shape.layers.size()))];
  switch (pick(6)) {
    case 0: {
      const char* names[] = {"format_minor_version", "kv_scale_group_size"};
      const char* name = names[pick(2)];
      const std::int64_t value = any_int(pick);
      *description = std::string("/") + name + " = " + std::to_string(value);
      f.set_int("/", name, value);
      break;
    }
    case 1: {
      const char* names[] = {"kv_scale_kind", "kv_scale_format", "kv_rope_dtype",
                             "kv_cache_layout"};
      const char* values[] = {"per_token_group",
                              "per_tensor",
                              "float32",
                              "power_of_two",
                              "e8m0",
                              "bfloat16",
                              "float8_e4m3fn",
                              "split",
                              "flashmla_fp8",
                              "",
                              "\xff"};
      const std::string name = names[pick(4)];
      const std::string value = values[pick(11)];
      *description = "/" + name + " = \"" + value + "\"";
      f.set_string("/", name, value, pick(2) == 0);
      break;
    }
    case 2: {
      const char* datasets[] = {"kv_scales", "kv_rope", "kv_cache"};
      const std::string path = layer + "/" + datasets[pick(3)];
      std::vector<hsize_t> dims(static_cast<std::size_t>(1 + pick(3)));
      for (auto& d : dims) d = static_cast<hsize_t>(pick(40));
      const hid_t types[] = {H5T_STD_U8LE, H5T_STD_U16LE, H5T_IEEE_F32LE, H5T_STD_I32LE};
      const char* dtypes[] = {nullptr, "bfloat16", "float8_e4m3fn", "float8_e8m0fnu",
                              "flashmla_fp8"};
      *description = path + " replaced by a random shape/type";
      f.replace_zeros(path, dims, types[pick(4)], dtypes[pick(5)]);
      break;
    }
    case 3: {
      // Scale values no write rule makes: the file still opens (they are judged where read).
      const std::string path = layer + "/kv_scales";
      if (!link_exists(f, path)) break;
      const std::vector<hsize_t> dims = dims_of(f, path);
      const double values[] = {0.0,   -1.0, std::nan(""), std::numeric_limits<double>::infinity(),
                               1e-45, 3e38, 255.0};
      const double value = values[pick(7)];
      *description = path + " filled with " + std::to_string(value);
      std::size_t n = 1;
      for (hsize_t d : dims) n *= d;
      const hid_t dataset = H5Dopen2(f.id(), path.c_str(), H5P_DEFAULT);
      const hid_t type = H5Dget_type(dataset);
      const bool integer = H5Tget_class(type) == H5T_INTEGER;
      std::vector<float> floats(n, static_cast<float>(value));
      std::vector<std::uint8_t> bytes(
          n, static_cast<std::uint8_t>(std::isfinite(value) && value >= 0 && value <= 255 ? value
                                                                                          : 255));
      REQUIRE(H5Dwrite(dataset, integer ? H5T_NATIVE_UINT8 : H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL,
                       H5P_DEFAULT,
                       integer ? static_cast<const void*>(bytes.data()) : floats.data()) >= 0);
      H5Tclose(type);
      H5Dclose(dataset);
      break;
    }
    case 4: {
      const std::string path = step_layer + "/topk_indices";
      hsize_t rows = static_cast<hsize_t>(pick(6));
      if (pick(2) == 0 && link_exists(f, path)) rows = dims_of(f, path)[0];
      const std::vector<hsize_t> dims = {rows, static_cast<hsize_t>(pick(5))};
      std::vector<std::int32_t> values(rows * dims[1]);
      const std::int32_t extremes[] = {std::numeric_limits<std::int32_t>::min(),
                                       std::numeric_limits<std::int32_t>::max()};
      for (auto& v : values) v = pick(10) == 0 ? extremes[pick(2)] : pick(60) - 2;
      *description = path + " replaced by [" + std::to_string(dims[0]) + ", " +
                     std::to_string(dims[1]) + "] random positions";
      f.replace_dataset(path, dims, H5T_STD_I32LE, H5T_NATIVE_INT32,
                        values.empty() ? nullptr : values.data(), nullptr);
      break;
    }
    default: {
      const std::string targets[] = {layer + "/kv_scales", layer + "/kv_rope",
                                     step_layer + "/topk_indices", layer + "/kv_cache"};
      const std::string link = targets[pick(4)];
      *description = "delete " + link;
      if (link_exists(f, link)) f.delete_link(link);
      break;
    }
  }
}

// Edits of the v1.2 indexer objects: their attributes, datasets replaced by random shapes and
// types, links deleted.
void v1_2_mutation(RawFile& f, const DumpShape& shape, const Pick& pick, std::string* description) {
  const std::string layer =
      "/layers/" + shape.layers[pick(static_cast<int>(shape.layers.size()))] + "/indexer";
  const std::string step = shape.steps[pick(static_cast<int>(shape.steps.size()))] + "/" +
                           shape.layers[pick(static_cast<int>(shape.layers.size()))] + "/indexer";
  switch (pick(4)) {
    case 0: {
      const char* names[] = {"index_n_heads", "index_head_dim", "index_block_size", "index_topk",
                             "index_softmax_scale"};
      const std::string name = names[pick(5)];
      const std::int64_t value = any_int(pick);
      *description = layer + " " + name + " = " + std::to_string(value);
      if (link_exists(f, layer)) f.set_int(layer, name, value);
      break;
    }
    case 1: {
      const char* names[] = {"index_scale_format", "index_rotation"};
      const char* values[] = {"power_of_two", "float32", "hadamard", "none", "e8m0", "", "\xff"};
      const std::string name = names[pick(2)];
      const std::string value = values[pick(7)];
      *description = layer + " " + name + " = \"" + value + "\"";
      if (link_exists(f, layer)) f.set_string(layer, name, value, pick(2) == 0);
      break;
    }
    case 2: {
      const std::string layer_sets[] = {"k_cache", "k_scales", "k_source"};
      const std::string step_sets[] = {
          "q", "weights", "new_k", "topk_indices", "k_cache_after", "k_scales_after"};
      const std::string path =
          pick(2) == 0 ? layer + "/" + layer_sets[pick(3)] : step + "/" + step_sets[pick(6)];
      std::vector<hsize_t> dims(static_cast<std::size_t>(1 + pick(3)));
      for (auto& d : dims) d = static_cast<hsize_t>(pick(40));
      const hid_t types[] = {H5T_STD_U8LE, H5T_STD_U16LE, H5T_IEEE_F32LE, H5T_STD_I32LE};
      const char* dtypes[] = {nullptr, "bfloat16", "float8_e4m3fn", "float32"};
      *description = path + " replaced by a random shape/type";
      if (link_exists(f, path.substr(0, path.rfind('/')))) {
        f.replace_zeros(path, dims, types[pick(4)], dtypes[pick(4)]);
      }
      break;
    }
    default: {
      const std::string targets[] = {layer, step, layer + "/k_scales", step + "/k_cache_after",
                                     step + "/topk_indices"};
      const std::string link = targets[pick(5)];
      *description = "delete " + link;
      if (link_exists(f, link)) f.delete_link(link);
      break;
    }
  }
}

// Structural edits with random parameters, each valid HDF5 but likely breaking the format.
void structural_mutation(RawFile& f, const DumpShape& shape, std::mt19937& rng,
                         std::string* description) {
  const Pick pick = [&](int n) { return static_cast<int>(rng() % static_cast<unsigned>(n)); };
  const std::string first_layer = shape.layers.front();
  const std::string last_layer = shape.layers.back();
  const std::vector<std::string>& steps = shape.steps;
  const std::vector<std::string> layers = {first_layer, last_layer};
  const char* indices[] = {"qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len",
                           "new_kv_slots"};
  const char* tensors[] = {"q_nope", "q_pe", "new_kv", "out", "lse", "kv_cache_after"};
  const char* root_ints[] = {"num_heads", "kv_lora_rank", "qk_rope_head_dim", "page_size",
                             "format_version"};
  const std::string first_step = steps.front();
  const std::string second_step = steps[1];
  switch (pick(shape.v1_2 ? 10 : shape.v1_1 ? 8 : 7)) {
    case 0: {
      const char* name = root_ints[pick(5)];
      const std::int64_t value = any_int(pick);
      *description = std::string("/") + name + " = " + std::to_string(value);
      f.set_int("/", name, value);
      break;
    }
    case 1: {
      const double values[] = {0.0,   -1.0,         1e-45,
                               1e300, std::nan(""), std::numeric_limits<double>::infinity()};
      const double value = values[pick(6)];
      const std::string object = "/layers/" + layers[pick(2)];
      *description = object + " kv_scale = " + std::to_string(value);
      f.set_double(object, "kv_scale", value);
      break;
    }
    case 2: {
      const std::string path = (pick(2) == 0 ? first_step : second_step) + "/" + indices[pick(5)];
      std::vector<std::int32_t> values(static_cast<std::size_t>(pick(7)));
      for (auto& v : values) v = static_cast<std::int32_t>(pick(20)) - 2;
      *description = path + " replaced by " + std::to_string(values.size()) + " random values";
      f.replace_index(path, values);
      break;
    }
    case 3: {
      const std::string step = pick(2) == 0 ? first_step : second_step;
      const std::string path = step + "/" + layers[pick(2)] + "/" + tensors[pick(6)];
      std::vector<hsize_t> dims(static_cast<std::size_t>(1 + pick(3)));
      for (auto& d : dims) d = static_cast<hsize_t>(pick(13));
      const hid_t types[] = {H5T_STD_U8LE, H5T_STD_U16LE, H5T_IEEE_F32LE, H5T_STD_I32LE};
      const char* dtypes[] = {nullptr, "bfloat16", "float8_e4m3fn", "float32"};
      *description = path + " replaced by a random shape/type";
      f.replace_zeros(path, dims, types[pick(4)], dtypes[pick(4)]);
      break;
    }
    case 4: {
      const std::string objects[] = {"/", "/layers/" + first_layer, "/layers/" + last_layer,
                                     first_step, second_step};
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
      const std::string links[] = {"/layers/" + first_layer,
                                   second_step,
                                   first_step + "/" + last_layer,
                                   "/layers/" + last_layer + "/kv_cache",
                                   second_step + "/" + first_layer + "/kv_cache_after",
                                   first_step + "/" + first_layer + "/lse"};
      const std::string link = links[pick(6)];
      *description = "delete " + link;
      if (link_exists(f, link)) f.delete_link(link);
      break;
    }
    case 6: {
      const char* strings[] = {"kv_dtype", "kv_scale_kind", "format"};
      const char* values[] = {"bfloat16", "", "per_tensor", "float8_e4m3fn", "kvdump", "\xff\xfe"};
      const std::string name = strings[pick(3)];
      const std::string value = values[pick(6)];
      *description = "/" + name + " = \"" + value + "\"";
      f.set_string("/", name, value, pick(2) == 0);
      break;
    }
    case 7:
      v1_1_mutation(f, shape, pick, description);
      break;
    default:
      v1_2_mutation(f, shape, pick, description);
      break;
  }
}

// One damaged copy of `original` at `target`: flips (half the time), a truncation (a fifth), or,
// when `structural` is given, an edit of the dump's structure; the description says which.
std::string mutate(const std::string& original, const std::filesystem::path& target,
                   std::mt19937& rng, const DumpShape* structural) {
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
    structural_mutation(f, *structural, rng, &description);
  }
  return description;
}

struct FuzzTally {
  int inputs = 0;
  int accepted = 0;
  int refused = 0;       // by info, or (v1.1) by check when it read the step tensors
  int checked = 0;       // v1.1: accepted by info and run through check
  int hdf5_reports = 0;  // HDF5's own faults, contained by the probe child
  std::vector<Outcome> failures;
};

// How a seed is fuzzed: its label, whether structural edits apply (the shape they aim at), and
// whether `kvaudit check` follows an accepted `info`.
struct Seed {
  std::string label;
  std::string bytes;
  std::optional<DumpShape> shape;
  bool check = false;
  // KVAUDIT_OPEN_TIMEOUT for its runs (0: kvaudit's default, 60 s). HDF5 1.10 can spin forever
  // on some damaged metadata of h5py-written files; kvaudit's probe child then refuses the file
  // (exit 2) when the timeout passes, which must come before the fuzz's own 20 s hang limit.
  int open_timeout_s = 0;
};

// The command lines of one mutated input: `info`, then (for v1.1 seeds) `check` on the CPU.
struct FuzzCommands {
  std::string info;
  std::string check;
};

FuzzCommands fuzz_commands(const std::filesystem::path& target,
                           const std::filesystem::path& reports, int open_timeout_s) {
  const std::string open_timeout =
      open_timeout_s > 0 ? "KVAUDIT_OPEN_TIMEOUT=" + std::to_string(open_timeout_s) + " " : "";
  const std::string prefix = testing::sanitizer_environment(reports) + open_timeout +
                             "timeout 20 '" + kvaudit_test::kvaudit_binary().string() + "' ";
  const std::string file = " '" + target.string() + "' > /dev/null 2>&1";
  // Two layers in flight: a read error in a later layer must end the run at the earliest failing
  // layer (the reader stops after it), not leave the replay waiting for a layer never read.
  const std::string check =
      "check --backend cpu-fp8 --certify 0 --diagnose 1 --threads 1 --layers-in-flight 2";
  return {prefix + "info" + file, prefix + check + file};
}

// One run judged: by its exit status and the sanitizer reports it left. A bad one is kept.
void judge(int status, const testing::SanitizerReports& found, const std::string& description,
           const std::filesystem::path& target, const std::filesystem::path& kept,
           FuzzTally& tally) {
  tally.hdf5_reports += found.hdf5;
  const bool bad_status = status != 0 && status != 1 && status != 2;
  if (!bad_status && found.kvaudit.empty()) return;
  std::filesystem::copy_file(target, kept, std::filesystem::copy_options::overwrite_existing);
  std::string what = description + " (kept as " + kept.string() + ")";
  for (const std::string& report : found.kvaudit) what += "\n" + report.substr(0, 4000);
  tally.failures.push_back({status, what});
}

// `mutations` damaged copies of the seed through `kvaudit info` (and `check`), each judged by its
// exit status and by the sanitizer reports it left.
FuzzTally fuzz(const Seed& seed, int mutations, std::uint32_t rng_seed) {
  const auto dir = testing::kvdump_test_dir();
  const auto target = dir / (seed.label + "-fuzz.h5");
  const auto reports = dir / (seed.label + "-sanitizer");
  std::filesystem::create_directories(reports);
  testing::collect_sanitizer_reports(reports);  // from an earlier run
  const FuzzCommands commands = fuzz_commands(target, reports, seed.open_timeout_s);
  std::mt19937 rng(rng_seed);
  FuzzTally tally;
  for (int i = 0; i < mutations; ++i) {
    const std::string description =
        mutate(seed.bytes, target, rng, seed.shape ? &*seed.shape : nullptr);
    const auto kept = dir / (seed.label + "-fuzz-failure-" + std::to_string(i) + ".h5");
    ++tally.inputs;
    int status = testing::run_command(commands.info);
    judge(status, testing::collect_sanitizer_reports(reports), description + " [info]", target,
          kept, tally);
    if (status == 0 && seed.check) {
      ++tally.checked;
      status = testing::run_command(commands.check);
      judge(status, testing::collect_sanitizer_reports(reports), description + " [check]", target,
            kept, tally);
    }
    tally.accepted += status == 0 || status == 1;
    tally.refused += status == 2;
  }
  for (const Outcome& f : tally.failures) {
    UNSCOPED_INFO(seed.label << ": exit status " << f.status << " after " << f.description);
  }
  return tally;
}

// The line scripts/run-tests.sh adds up: "fuzz: N mutated inputs over K seed dumps, F findings,
// H HDF5 faults contained: WHAT" (a finding: a crash, a hang, exit 3, or a sanitizer report from
// kvaudit's own code).
void print_fuzz_line(const std::string& what, int inputs, int seeds, int findings, int hdf5) {
  std::cout << "fuzz: " << inputs << " mutated inputs over " << seeds << " seed dumps, " << findings
            << " findings, " << hdf5 << " HDF5 faults contained: " << what << std::endl;
}

// A seed read from a file: with `structural`, the structural edits aim at the groups it holds;
// with `check`, inputs that `info` accepts go on through `check`.
Seed seed_from_file(const std::string& label, const std::filesystem::path& path, bool structural,
                    bool check = false) {
  Seed seed{label, testing::read_text(path), std::nullopt, check};
  if (structural) seed.shape = shape_of(path);
  return seed;
}

TEST_CASE("kvaudit info survives mutated dumps: exit 0, 1 or 2 every time", "[kvdump][fuzz]") {
  const int mutations = mutation_count(160);
  const Seed seed = seed_from_file("small", testing::fresh_dump("fuzz-base.h5"), true);
  REQUIRE(seed.bytes.size() > 512);
  const FuzzTally tally = fuzz(seed, mutations, 20260601);
  print_fuzz_line("v1: the small kvaudit-written dump", tally.inputs, 1,
                  static_cast<int>(tally.failures.size()), tally.hdf5_reports);
  CHECK(tally.failures.empty());
  // The mutations must actually exercise the refusal paths, not only flip payload bytes.
  CHECK(tally.refused > mutations / 4);
  INFO("accepted " << tally.accepted << ", refused " << tally.refused);
  CHECK(tally.accepted + tally.refused + static_cast<int>(tally.failures.size()) <= mutations);
}

TEST_CASE("kvaudit info survives mutated shipped dumps (h5py-written)", "[kvdump][fuzz]") {
  const int mutations = mutation_count(12);
  const char* dumps[] = {"glm5_page1", "page64_nan", "saturated_page16"};
  int inputs = 0, findings = 0, hdf5 = 0;
  for (std::uint32_t d = 0; d < 3; ++d) {
    const Seed seed = seed_from_file(
        dumps[d], kvaudit_test::source_dir() / "datasets" / (std::string(dumps[d]) + ".h5"), false);
    REQUIRE(seed.bytes.size() > 100000);
    const FuzzTally tally = fuzz(seed, mutations, 7 + d);
    INFO(dumps[d] << ": accepted " << tally.accepted << ", refused " << tally.refused
                  << ", HDF5 faults contained " << tally.hdf5_reports);
    CHECK(tally.failures.empty());
    CHECK(tally.accepted + tally.refused <= mutations);
    inputs += tally.inputs;
    findings += static_cast<int>(tally.failures.size());
    hdf5 += tally.hdf5_reports;
  }
  print_fuzz_line("v1: 3 shipped dumps", inputs, 3, findings, hdf5);
}

// A small v1.1 dump of `synth` (two steps or more, so that the structural edits find a decode).
std::filesystem::path small_v1_1_dump(const std::string& name, GroupScaleFormat format,
                                      KvDtype rope, PoolLayout layout, int topk) {
  SynthSpec spec;
  spec.seed = 11;
  spec.layer_ids = {0, 3};
  spec.num_heads = 2;
  spec.kv_lora_rank = 16;
  spec.rope_dim = 4;
  spec.page_size = 4;
  spec.prefix_lens = {9, 0, 5};
  spec.prefill_tokens = {3, 2, 0};
  spec.decode_steps = 1;
  spec.scale_group_size = 8;
  spec.scale_format = format;
  spec.rope_dtype = rope;
  spec.layout = layout;
  spec.topk = topk;
  spec.zero_group_every = 4;
  spec.with_source = layout == PoolLayout::kSplit;
  const auto path = testing::kvdump_test_dir() / name;
  const auto written = write_synth_dump(path, spec);
  INFO((written.ok() ? std::string() : written.error().message()));
  REQUIRE(written.ok());
  return path;
}

TEST_CASE("kvaudit info and check survive mutated kvdump v1.1 dumps", "[kvdump][fuzz][v1.1]") {
  // Its own count ($KVAUDIT_FUZZ_V1_1_MUTATIONS): an input of a small seed may run check too.
  const int small_mutations = mutation_count(mutation_count(60), "KVAUDIT_FUZZ_V1_1_MUTATIONS");
  const int shipped_mutations = mutation_count(mutation_count(12), "KVAUDIT_FUZZ_V1_1_MUTATIONS");
  const std::vector<Seed> seeds = {
      seed_from_file("v1_1-split-e8m0-topk",
                     small_v1_1_dump("split-e8m0.h5", GroupScaleFormat::kE8m0,
                                     KvDtype::kFloat8E4m3fn, PoolLayout::kSplit, 3),
                     true, true),
      seed_from_file("v1_1-split-float32",
                     small_v1_1_dump("split-float32.h5", GroupScaleFormat::kFloat32,
                                     KvDtype::kBfloat16, PoolLayout::kSplit, 0),
                     true, true),
      seed_from_file("v1_1-packed-topk",
                     small_v1_1_dump("packed.h5", GroupScaleFormat::kPowerOfTwo, KvDtype::kBfloat16,
                                     PoolLayout::kFlashMlaFp8, 4),
                     true),
      seed_from_file("glm5_dsa_flashmla",
                     kvaudit_test::source_dir() / "datasets" / "glm5_dsa_flashmla.h5", true),
      seed_from_file("glm5_pertoken_fp8rope",
                     kvaudit_test::source_dir() / "datasets" / "glm5_pertoken_fp8rope.h5", true),
  };
  int inputs = 0, findings = 0, hdf5 = 0, checked = 0;
  for (std::size_t s = 0; s < seeds.size(); ++s) {
    REQUIRE(seeds[s].shape);
    CHECK(seeds[s].shape->v1_1);
    const int mutations = s < 3 ? small_mutations : shipped_mutations;
    const FuzzTally tally = fuzz(seeds[s], mutations, 1100 + static_cast<std::uint32_t>(s));
    INFO(seeds[s].label << ": accepted " << tally.accepted << ", refused " << tally.refused
                        << ", through check " << tally.checked << ", HDF5 faults contained "
                        << tally.hdf5_reports);
    CHECK(tally.failures.empty());
    // The edits reach the refusals (given enough of them); only the small seeds' inputs run check.
    if (mutations >= 20) CHECK(tally.refused > 0);
    if (!seeds[s].check) CHECK(tally.checked == 0);
    inputs += tally.inputs;
    findings += static_cast<int>(tally.failures.size());
    hdf5 += tally.hdf5_reports;
    checked += tally.checked;
  }
  // Past info, check: the small seeds' inputs that info accepts reach it.
  if (small_mutations >= 20) CHECK(checked > 0);
  print_fuzz_line(
      "v1.1: 3 small synth dumps (split e8m0 with an e4m3 RoPE part, split float32, "
      "packed flashmla_fp8; topk_indices), " +
          std::to_string(checked) + " of their inputs also through check; the 2 shipped v1.1 dumps",
      inputs, static_cast<int>(seeds.size()), findings, hdf5);
}

// The small v1.2 example dump of the Python package (kvdump.indexer_fp8 --write-example), written
// by Debian's /usr/bin/python3 with numpy and h5py.
std::filesystem::path small_v1_2_dump(const std::string& name) {
  const auto path = testing::kvdump_test_dir() / name;
  std::filesystem::remove(path);
  const std::string command = "PYTHONPATH='" + (kvaudit_test::source_dir() / "python").string() +
                              "' /usr/bin/python3 -B -m kvdump.indexer_fp8 --write-example '" +
                              path.string() + "' > /dev/null";
  INFO(command);
  REQUIRE(testing::run_command(command) == 0);
  return path;
}

TEST_CASE("kvaudit info and check survive mutated kvdump v1.2 dumps", "[kvdump][fuzz][v1.2]") {
  const int mutations = mutation_count(mutation_count(60), "KVAUDIT_FUZZ_V1_1_MUTATIONS");
  Seed seed = seed_from_file("v1_2-indexer", small_v1_2_dump("indexer-seed.h5"), true, true);
  seed.open_timeout_s = 5;
  REQUIRE(seed.shape);
  CHECK(seed.shape->v1_2);
  const FuzzTally tally = fuzz(seed, mutations, 1200);
  INFO(seed.label << ": accepted " << tally.accepted << ", refused " << tally.refused
                  << ", through check " << tally.checked << ", HDF5 faults contained "
                  << tally.hdf5_reports);
  CHECK(tally.failures.empty());
  if (mutations >= 20) {
    CHECK(tally.refused > 0);
    CHECK(tally.checked > 0);
  }
  print_fuzz_line("v1.2: the small indexer example dump (indexer attributes, datasets, links), " +
                      std::to_string(tally.checked) + " of its inputs also through check",
                  tally.inputs, 1, static_cast<int>(tally.failures.size()), tally.hdf5_reports);
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
