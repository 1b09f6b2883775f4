// kvdump v1.2 (docs/kvdump-v1.md "Version 1.2"): the DSA indexer's FP8 key cache. The seed is the
// small example dump of the Python package (python -m kvdump.indexer_fp8 --write-example: one
// request, page size 4, 5 pages, two layers with an indexer of 2 heads x 32, top-4, a 3-row
// prefill step S000 and a decode step S001), written by Debian's /usr/bin/python3 with numpy and
// h5py (installed in CI). The reader must accept it and describe its indexer as written, and refuse
// each malformed indexer object with exit status 2 naming the object.
#include <hdf5.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "src/format/kvdump.hpp"
#include "tests/format/kvdump_fixture.hpp"
#include "tests/test_paths.hpp"

namespace kvaudit {
namespace {

using testing::RawFile;

// Writes the example v1.2 dump at kvdump_test_dir()/name (overwriting it).
std::filesystem::path example_v1_2(const std::string& name) {
  const std::filesystem::path path = testing::kvdump_test_dir() / name;
  std::filesystem::remove(path);
  const std::string command = "PYTHONPATH='" + (kvaudit_test::source_dir() / "python").string() +
                              "' /usr/bin/python3 -B -m kvdump.indexer_fp8 --write-example '" +
                              path.string() + "' > /dev/null";
  INFO(command);
  REQUIRE(testing::run_command(command) == 0);
  return path;
}

TEST_CASE("v1.2 reader accepts the indexer cache and describes it as written", "[kvdump][v1.2]") {
  const auto path = example_v1_2("indexer.h5");
  auto reader = DumpReader::open(path);
  INFO((reader.ok() ? std::string() : reader.error().message()));
  REQUIRE(reader.ok());
  const DumpLayout& layout = reader->layout();
  CHECK(layout.format_minor_version == 2);
  REQUIRE(layout.layers.size() == 2);
  for (const LayerMeta& layer : layout.layers) {
    REQUIRE(layer.indexer);
    CHECK(layer.indexer->n_heads == 2);
    CHECK(layer.indexer->head_dim == 32);
    CHECK(layer.indexer->block_size == 32);
    CHECK(layer.indexer->topk == 4);
    CHECK(layer.indexer->scale_format == IndexScaleFormat::kPowerOfTwo);
    CHECK(layer.indexer->rotation == IndexRotation::kHadamard);
    CHECK(layer.indexer->softmax_scale == Approx(1.0 / std::sqrt(32.0)).epsilon(1e-15));
  }
  REQUIRE(layout.steps.size() == 2);
  for (const StepMeta& step : layout.steps) {
    CHECK(step.has_indexer_cache_after == std::vector<bool>{true, true});
  }
  const std::string info = testing::kvdump_test_dir().string() + "/indexer-info.txt";
  REQUIRE(testing::run_command("'" + kvaudit_test::kvaudit_binary().string() + "' info '" +
                               path.string() + "' > '" + info + "'") == 0);
  const std::string text = testing::read_text(info);
  CHECK_THAT(text, Catch::Matchers::Contains("kvdump v1.2"));
  CHECK_THAT(text, Catch::Matchers::Contains(
                       "indexer: 2 heads x 32, top-4, e4m3 + power_of_two scale per 32, hadamard"));
  CHECK_THAT(text, Catch::Matchers::Contains("indexer_cache_after=all"));
}

TEST_CASE("v1.2 reader refuses each malformed indexer object, naming it", "[kvdump][v1.2]") {
  struct Case {
    const char* name;
    std::function<void(RawFile&)> mutate;
    std::string object;
    std::string reason;
  };
  const std::string layer = "/layers/L000/indexer";
  const std::string step = "/steps/S000/L000/indexer";
  const std::vector<Case> cases = {
      {"format_minor_version 1", [](RawFile& f) { f.set_int("/", "format_minor_version", 1); },
       layer, "is kvdump v1.2: the root needs format_minor_version = 2"},
      {"unknown scale format",
       [&](RawFile& f) { f.set_string(layer, "index_scale_format", "ue8m0", false); }, layer,
       "index_scale_format \"ue8m0\" is unknown"},
      {"unknown rotation",
       [&](RawFile& f) { f.set_string(layer, "index_rotation", "walsh", false); }, layer,
       "index_rotation \"walsh\" is unknown"},
      {"block not dividing the head", [&](RawFile& f) { f.set_int(layer, "index_block_size", 24); },
       layer, "index_block_size 24 does not divide index_head_dim 32"},
      {"hadamard over a head dim not a power of two",
       [&](RawFile& f) {
         f.set_int(layer, "index_head_dim", 24);
         f.set_int(layer, "index_block_size", 24);
       },
       layer, "index_rotation \"hadamard\" needs index_head_dim a power of two"},
      {"top-k 0", [&](RawFile& f) { f.set_int(layer, "index_topk", 0); }, layer, "index_topk"},
      {"no index_n_heads", [&](RawFile& f) { f.delete_attribute(layer, "index_n_heads"); }, layer,
       "index_n_heads"},
      {"negative softmax scale",
       [&](RawFile& f) { f.set_double(layer, "index_softmax_scale", -1.0); }, layer,
       "index_softmax_scale is not finite and positive"},
      {"codes without dtype",
       [&](RawFile& f) {
         f.replace_zeros(layer + "/k_cache", {5, 4, 32}, H5T_STD_U8LE, nullptr);
       },
       layer + "/k_cache", "without a dtype attribute"},
      {"scales of the wrong shape",
       [&](RawFile& f) {
         f.replace_zeros(layer + "/k_scales", {5, 4, 2}, H5T_IEEE_F32LE, nullptr);
       },
       layer + "/k_scales", "disagrees with [num_pages, page_size, index_head_dim / block]"},
      {"source rows as u16",
       [&](RawFile& f) {
         f.replace_zeros(layer + "/k_source", {5, 4, 32}, H5T_STD_U16LE, "bfloat16");
       },
       layer + "/k_source", "expected float32"},
      {"a step without the layer's indexer group", [&](RawFile& f) { f.delete_link(step); }, step,
       "missing group"},
      {"no query", [&](RawFile& f) { f.delete_link(step + "/q"); }, step + "/q", ""},
      {"weights of the wrong shape",
       [&](RawFile& f) {
         f.replace_zeros(step + "/weights", {3, 3}, H5T_IEEE_F32LE, nullptr);
       },
       step + "/weights", "disagrees with [Nq, index_n_heads]"},
      {"top-k as float32",
       [&](RawFile& f) {
         f.replace_zeros(step + "/topk_indices", {3, 4}, H5T_IEEE_F32LE, nullptr);
       },
       step + "/topk_indices", "expected int32 token positions"},
      {"top-k of another K",
       [&](RawFile& f) {
         f.replace_zeros(step + "/topk_indices", {3, 5}, H5T_STD_I32LE, nullptr);
       },
       step + "/topk_indices", "disagrees with [Nq, index_topk]"},
      {"codes after without scales after",
       [&](RawFile& f) { f.delete_link(step + "/k_scales_after"); }, step + "/k_cache_after",
       "present without its companion"},
      {"an indexer step group for a layer without one",
       [](RawFile& f) { f.delete_link("/layers/L001/indexer"); }, "/steps/S000/L001/indexer",
       "present, but /layers/L001 has no indexer group"},
  };
  for (const Case& c : cases) {
    INFO("mutation: " << c.name);
    const auto path = example_v1_2("indexer-broken.h5");
    {
      RawFile file(path);
      c.mutate(file);
    }
    auto reader = DumpReader::open(path);
    REQUIRE_FALSE(reader.ok());
    INFO("error: " << reader.error().message());
    CHECK(reader.error().where == path.string() + ":" + c.object);
    CHECK_THAT(reader.error().what, Catch::Matchers::Contains(c.reason));
    CHECK(testing::run_command("'" + kvaudit_test::kvaudit_binary().string() + "' info '" +
                               path.string() + "' > /dev/null 2>&1") == 2);
  }
}

// The example narrowed to index_head_dim = index_block_size = 24 with the Hadamard rotation, every
// Di-wide dataset cut to 24 columns of zeros: consistent in every shape, so only the power-of-two
// rule stands between it and a Walsh-Hadamard transform of 24 values (which wrote past its vector
// and aborted kvaudit check with heap corruption, exit 134).
TEST_CASE("v1.2: kvaudit check refuses a Hadamard indexer whose head dim is not a power of two",
          "[kvdump][v1.2]") {
  const auto path = example_v1_2("indexer-dim24.h5");
  {
    RawFile f(path);
    const char* e4m3 = "float8_e4m3fn";
    for (const std::string layer : {"L000", "L001"}) {
      const std::string group = "/layers/" + layer + "/indexer";
      f.set_int(group, "index_head_dim", 24);
      f.set_int(group, "index_block_size", 24);
      f.replace_zeros(group + "/k_cache", {5, 4, 24}, H5T_STD_U8LE, e4m3);
      f.replace_zeros(group + "/k_source", {5, 4, 24}, H5T_IEEE_F32LE, nullptr);
      for (const auto& [step, rows] : {std::pair<std::string, hsize_t>{"S000", 3}, {"S001", 1}}) {
        const std::string s = "/steps/" + step + "/" + layer + "/indexer";
        f.replace_zeros(s + "/q", {rows, 2, 24}, H5T_IEEE_F32LE, nullptr);
        f.replace_zeros(s + "/new_k", {rows, 24}, H5T_IEEE_F32LE, nullptr);
        f.replace_zeros(s + "/k_cache_after", {5, 4, 24}, H5T_STD_U8LE, e4m3);
      }
    }
  }
  const std::string err = testing::kvdump_test_dir().string() + "/indexer-dim24.err";
  const int status =
      testing::run_command("'" + kvaudit_test::kvaudit_binary().string() + "' check '" +
                           path.string() + "' > /dev/null 2> '" + err + "'");
  const std::string text = testing::read_text(err);
  INFO(text);
  CHECK(status == 2);
  CHECK_THAT(text, Catch::Matchers::Contains(path.string() +
                                             ":/layers/L000/indexer: index_rotation \"hadamard\" "
                                             "needs index_head_dim a power of two"));
}

}  // namespace
}  // namespace kvaudit
