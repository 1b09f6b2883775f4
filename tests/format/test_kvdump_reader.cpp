// kvdump v1 reader: each rule of the format's Errors section is broken in a small valid dump
// (tests/format/kvdump_fixture.hpp) with raw HDF5 calls, and the error must name the file and the
// HDF5 object. Also the encodings the format allows (fixed/variable strings, any integer type for
// int attributes, float32 in place of bfloat16), file-level failures, the kvaudit info CLI and a
// dump written by a Python script from the format page alone.
#include <catch2/catch.hpp>
#include <cmath>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>

#include "kvaudit_test_config.hpp"  // KVAUDIT_BINARY, KVAUDIT_SOURCE_DIR, KVAUDIT_TEST_TMPDIR
#include "src/format/kvdump.hpp"
#include "src/tools/info.hpp"
#include "tests/format/kvdump_fixture.hpp"

namespace kvaudit {
namespace {

using testing::fresh_dump;
using testing::kvdump_test_dir;
using testing::RawFile;

struct Breakage {
  std::string name;
  std::function<void(RawFile&)> mutate;
  std::string object;  // HDF5 path the error must name
  std::string reason;  // substring of the error's `what`
};

void check_breakages(const std::vector<Breakage>& cases,
                     KvDtype kv_dtype = KvDtype::kFloat8E4m3fn) {
  for (const Breakage& c : cases) {
    INFO("mutation: " << c.name);
    const auto path = fresh_dump("broken.h5", kv_dtype);
    {
      RawFile file(path);
      c.mutate(file);
    }
    auto reader = DumpReader::open(path);
    REQUIRE_FALSE(reader.ok());
    const Error& error = reader.error();
    INFO("error: " << error.message());
    CHECK(error.where == path.string() + ":" + c.object);
    CHECK_THAT(error.what, Catch::Matchers::Contains(c.reason));
    CHECK(error.kind != ErrorKind::kInternal);
  }
}

const std::vector<hsize_t> kPoolShape = {8, 2, 12};

TEST_CASE("kvdump reader accepts the valid small dump and reads its layout", "[kvdump]") {
  const auto path = fresh_dump("valid.h5");
  auto reader = DumpReader::open(path);
  INFO((reader.ok() ? "" : reader.error().message()));
  REQUIRE(reader.ok());
  const DumpLayout& layout = reader->layout();
  CHECK(layout.format_version == 1);
  CHECK(layout.num_pages == 8);
  CHECK(layout.num_slots() == 16);
  REQUIRE(layout.layers.size() == 2);
  CHECK(layout.layers[0].group == "L000");
  CHECK(layout.layers[1].group == "L003");
  CHECK(layout.layers[1].layer_id == 3);
  CHECK(layout.layer_index_of_id(3) == 1);
  REQUIRE(layout.steps.size() == 2);
  CHECK(layout.steps[0].kind == StepKind::kPrefill);
  CHECK(layout.steps[1].kind == StepKind::kDecode);
  CHECK(layout.steps[1].new_kv_slots == std::vector<std::int32_t>{9, 10});
  CHECK(layout.steps[0].has_out == std::vector<bool>{true, true});
  CHECK(layout.steps[1].has_kv_cache_after == std::vector<bool>{true, false});
}

TEST_CASE("kvdump reader refuses missing root attributes, naming /", "[kvdump]") {
  std::vector<Breakage> cases;
  for (const char* name :
       {"format", "format_version", "model", "producer", "num_heads", "kv_lora_rank",
        "qk_rope_head_dim", "sm_scale", "page_size", "kv_dtype", "kv_scale_kind"}) {
    cases.push_back({std::string("delete /") + name,
                     [name](RawFile& f) { f.delete_attribute("/", name); }, "/",
                     std::string("missing attribute ") + name});
  }
  check_breakages(cases);
}

TEST_CASE("kvdump reader refuses bad root attribute values", "[kvdump]") {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  check_breakages({
      {"format hdf5", [](RawFile& f) { f.set_string("/", "format", "hdf5"); }, "/", "format"},
      {"format_version 2", [](RawFile& f) { f.set_int("/", "format_version", 2); }, "/",
       "format_version 2"},
      {"format_version string", [](RawFile& f) { f.set_string("/", "format_version", "1"); }, "/",
       "expected an integer"},
      {"kv_scale_kind per_channel",
       [](RawFile& f) { f.set_string("/", "kv_scale_kind", "per_channel"); }, "/", "kv_scale_kind"},
      {"kv_dtype float16", [](RawFile& f) { f.set_string("/", "kv_dtype", "float16"); }, "/",
       "kv_dtype"},
      {"sm_scale NaN", [nan](RawFile& f) { f.set_double("/", "sm_scale", nan); }, "/",
       "sm_scale is not finite"},
      {"sm_scale inf", [inf](RawFile& f) { f.set_double("/", "sm_scale", inf); }, "/",
       "sm_scale is not finite"},
      {"sm_scale integer", [](RawFile& f) { f.set_int("/", "sm_scale", 1); }, "/",
       "expected a floating-point"},
      {"num_heads float", [](RawFile& f) { f.set_double("/", "num_heads", 2.0); }, "/",
       "expected an integer"},
      {"num_heads 0", [](RawFile& f) { f.set_int("/", "num_heads", 0); }, "/", "num_heads"},
      {"page_size 0", [](RawFile& f) { f.set_int("/", "page_size", 0); }, "/", "page_size"},
      {"model is an integer", [](RawFile& f) { f.set_int("/", "model", 5); }, "/",
       "expected a string"},
      // The optional rope attributes the mscale diagnosis reads: finite floats where present.
      {"rope_factor NaN", [nan](RawFile& f) { f.set_double("/", "rope_factor", nan); }, "/",
       "rope_factor is not finite"},
      {"rope_mscale_all_dim inf",
       [inf](RawFile& f) { f.set_double("/", "rope_mscale_all_dim", inf); }, "/",
       "rope_mscale_all_dim is not finite"},
      {"rope_factor string", [](RawFile& f) { f.set_string("/", "rope_factor", "40"); }, "/",
       "expected a floating-point"},
  });
}

TEST_CASE("kvdump reader: unknown format_version and kv_scale_kind are 'unsupported'", "[kvdump]") {
  for (int which = 0; which < 2; ++which) {
    const auto path = fresh_dump("unsupported.h5");
    {
      RawFile f(path);
      if (which == 0) f.set_int("/", "format_version", 2);
      if (which == 1) f.set_string("/", "kv_scale_kind", "per_token");
    }
    auto reader = DumpReader::open(path);
    REQUIRE_FALSE(reader.ok());
    CHECK(reader.error().kind == ErrorKind::kUnsupported);
  }
}

TEST_CASE("kvdump reader refuses broken layers", "[kvdump]") {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  check_breakages({
      {"no layer_id", [](RawFile& f) { f.delete_attribute("/layers/L003", "layer_id"); },
       "/layers/L003", "missing attribute layer_id"},
      {"no kv_scale", [](RawFile& f) { f.delete_attribute("/layers/L000", "kv_scale"); },
       "/layers/L000", "missing attribute kv_scale"},
      {"kv_scale NaN", [nan](RawFile& f) { f.set_double("/layers/L000", "kv_scale", nan); },
       "/layers/L000", "not finite"},
      {"kv_scale beyond float32",
       [](RawFile& f) { f.set_double("/layers/L000", "kv_scale", 1e300); }, "/layers/L000",
       "not finite"},
      {"kv_scale 0", [](RawFile& f) { f.set_double("/layers/L000", "kv_scale", 0.0); },
       "/layers/L000", "not positive"},
      {"kv_scale negative", [](RawFile& f) { f.set_double("/layers/L003", "kv_scale", -0.5); },
       "/layers/L003", "not positive"},
      {"duplicate layer_id", [](RawFile& f) { f.set_int("/layers/L003", "layer_id", 0); },
       "/layers/L003", "layer_id 0"},
      {"no kv_cache", [](RawFile& f) { f.delete_link("/layers/L000/kv_cache"); },
       "/layers/L000/kv_cache", "missing dataset"},
      {"kv_cache row width 11",
       [](RawFile& f) {
         f.replace_zeros("/layers/L000/kv_cache", {8, 2, 11}, H5T_STD_U8LE, "float8_e4m3fn");
       },
       "/layers/L000/kv_cache", "shape [8, 2, 11]"},
      {"kv_cache page size 1",
       [](RawFile& f) {
         f.replace_zeros("/layers/L000/kv_cache", {16, 1, 12}, H5T_STD_U8LE, "float8_e4m3fn");
       },
       "/layers/L000/kv_cache", "shape [16, 1, 12]"},
      {"kv_cache rank 2",
       [](RawFile& f) {
         f.replace_zeros("/layers/L000/kv_cache", {16, 12}, H5T_STD_U8LE, "float8_e4m3fn");
       },
       "/layers/L000/kv_cache", "shape [16, 12]"},
      {"kv_cache num_pages differs between layers",
       [](RawFile& f) {
         f.replace_zeros("/layers/L003/kv_cache", {7, 2, 12}, H5T_STD_U8LE, "float8_e4m3fn");
       },
       "/layers/L003/kv_cache", "num_pages = 7"},
      {"kv_cache u8 without dtype",
       [](RawFile& f) {
         f.replace_zeros("/layers/L000/kv_cache", kPoolShape, H5T_STD_U8LE, nullptr);
       },
       "/layers/L000/kv_cache", "without a dtype attribute"},
      {"kv_cache u8 labelled bfloat16",
       [](RawFile& f) {
         f.replace_zeros("/layers/L000/kv_cache", kPoolShape, H5T_STD_U8LE, "bfloat16");
       },
       "/layers/L000/kv_cache", "dtype=\"bfloat16\""},
      {"kv_cache u16 without dtype",
       [](RawFile& f) {
         f.replace_zeros("/layers/L000/kv_cache", kPoolShape, H5T_STD_U16LE, nullptr);
       },
       "/layers/L000/kv_cache", "without a dtype attribute"},
      {"kv_cache bf16 in an fp8 dump",
       [](RawFile& f) {
         f.replace_zeros("/layers/L000/kv_cache", kPoolShape, H5T_STD_U16LE, "bfloat16");
       },
       "/layers/L000/kv_cache", "expected u8"},
      {"kv_cache float32 in an fp8 dump",
       [](RawFile& f) {
         f.replace_zeros("/layers/L000/kv_cache", kPoolShape, H5T_IEEE_F32LE, nullptr);
       },
       "/layers/L000/kv_cache", "expected u8"},
      {"kv_cache is a group",
       [](RawFile& f) {
         f.delete_link("/layers/L000/kv_cache");
         f.create_group("/layers/L000/kv_cache");
       },
       "/layers/L000/kv_cache", "not a dataset"},
      {"kv_source wrong shape",
       [](RawFile& f) {
         f.replace_zeros("/layers/L000/kv_source", {8, 2, 13}, H5T_STD_U16LE, "bfloat16");
       },
       "/layers/L000/kv_source", "shape [8, 2, 13]"},
      {"kv_source u16 without dtype",
       [](RawFile& f) {
         f.replace_zeros("/layers/L000/kv_source", kPoolShape, H5T_STD_U16LE, nullptr);
       },
       "/layers/L000/kv_source", "without a dtype attribute"},
      {"kv_source fp8",
       [](RawFile& f) {
         f.replace_zeros("/layers/L000/kv_source", kPoolShape, H5T_STD_U8LE, "float8_e4m3fn");
       },
       "/layers/L000/kv_source", "expected bfloat16"},
      {"kv_source float64",
       [](RawFile& f) {
         f.replace_zeros("/layers/L000/kv_source", kPoolShape, H5T_IEEE_F64LE, nullptr);
       },
       "/layers/L000/kv_source", "float64"},
  });
}

TEST_CASE("kvdump reader refuses a bfloat16 pool with kv_scale != 1", "[kvdump]") {
  check_breakages(
      {{"bf16 pool kv_scale 0.5",
        [](RawFile& f) { f.set_double("/layers/L003", "kv_scale", 0.5, H5T_IEEE_F32LE); },
        "/layers/L003", "kv_scale = 1"},
       {"bf16 pool stored as u8",
        [](RawFile& f) {
          f.replace_zeros("/layers/L000/kv_cache", kPoolShape, H5T_STD_U8LE, "float8_e4m3fn");
        },
        "/layers/L000/kv_cache", "expected bfloat16"}},
      KvDtype::kBfloat16);
}

TEST_CASE("kvdump reader refuses bad group structure", "[kvdump]") {
  check_breakages({
      {"no /layers", [](RawFile& f) { f.delete_link("/layers"); }, "/layers", "missing"},
      {"no /steps", [](RawFile& f) { f.delete_link("/steps"); }, "/steps", "missing"},
      {"empty /layers",
       [](RawFile& f) {
         f.delete_link("/layers/L000");
         f.delete_link("/layers/L003");
       },
       "/layers", "no layer group"},
      {"layer with two digits", [](RawFile& f) { f.move_link("/layers/L003", "/layers/L03"); },
       "/layers/L03", "three or more digits"},
      {"layer with letters", [](RawFile& f) { f.move_link("/layers/L003", "/layers/Lx03"); },
       "/layers/Lx03", "three or more digits"},
      {"layer named layer003", [](RawFile& f) { f.move_link("/layers/L003", "/layers/layer003"); },
       "/layers/layer003", "three or more digits"},
      {"dataset among layers",
       [](RawFile& f) {
         f.replace_index("/layers/L004", {1, 2});
       },
       "/layers/L004", "not a group"},
      {"step with one digit", [](RawFile& f) { f.move_link("/steps/S001", "/steps/S1"); },
       "/steps/S1", "three or more digits"},
      {"step named T001", [](RawFile& f) { f.move_link("/steps/S001", "/steps/T001"); },
       "/steps/T001", "three or more digits"},
      {"two steps numbered 0", [](RawFile& f) { f.move_link("/steps/S001", "/steps/S0000"); },
       "/steps/S0000", "same step number"},
      {"step without L003", [](RawFile& f) { f.delete_link("/steps/S001/L003"); },
       "/steps/S001/L003", "missing group"},
      {"step with an unknown layer", [](RawFile& f) { f.create_group("/steps/S000/L007"); },
       "/steps/S000/L007", "not a layer under /layers"},
      {"step with a misnamed group", [](RawFile& f) { f.create_group("/steps/S000/Lab"); },
       "/steps/S000/Lab", "three or more digits"},
      {"layer renamed but not in steps",
       [](RawFile& f) { f.move_link("/layers/L003", "/layers/L004"); }, "/steps/S000/L003",
       "not a layer under /layers"},
  });
}

TEST_CASE("kvdump reader refuses broken step attributes and index datasets", "[kvdump]") {
  std::vector<Breakage> cases = {
      {"no kind", [](RawFile& f) { f.delete_attribute("/steps/S000", "kind"); }, "/steps/S000",
       "missing attribute kind"},
      {"kind extend", [](RawFile& f) { f.set_string("/steps/S000", "kind", "extend"); },
       "/steps/S000", "\"extend\" is unknown"},
      {"qo_indptr float32",
       [](RawFile& f) {
         const float v[] = {0, 3, 5, 5};
         f.replace_dataset("/steps/S000/qo_indptr", {4}, H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, v,
                           nullptr);
       },
       "/steps/S000/qo_indptr", "expected int32"},
      {"kv_indices u16 without dtype",
       [](RawFile& f) {
         const std::uint16_t v[] = {1, 4, 2};
         f.replace_dataset("/steps/S000/kv_indices", {3}, H5T_STD_U16LE, H5T_NATIVE_UINT16, v,
                           nullptr);
       },
       "/steps/S000/kv_indices", "without a dtype attribute"},
      {"qo_indptr 2-D",
       [](RawFile& f) {
         const std::int32_t v[] = {0, 3, 5, 5};
         f.replace_dataset("/steps/S000/qo_indptr", {2, 2}, H5T_STD_I32LE, H5T_NATIVE_INT32, v,
                           nullptr);
       },
       "/steps/S000/qo_indptr", "not one-dimensional"},
      {"kv_indices beyond int32",
       [](RawFile& f) {
         const std::int64_t v[] = {1, 4, std::int64_t{1} << 40};
         f.replace_dataset("/steps/S000/kv_indices", {3}, H5T_STD_I64LE, H5T_NATIVE_INT64, v,
                           nullptr);
       },
       "/steps/S000/kv_indices", "does not fit in int32"},
      {"qo_indptr starts at 1",
       [](RawFile& f) {
         f.replace_index("/steps/S000/qo_indptr", {1, 3, 5, 5});
       },
       "/steps/S000/qo_indptr", "starts at 1"},
      {"kv_indptr starts at 1",
       [](RawFile& f) {
         f.replace_index("/steps/S000/kv_indptr", {1, 2, 3, 3});
       },
       "/steps/S000/kv_indptr", "starts at 1"},
      {"qo_indptr not monotone",
       [](RawFile& f) {
         f.replace_index("/steps/S000/qo_indptr", {0, 3, 2, 5});
       },
       "/steps/S000/qo_indptr", "not monotone"},
      {"kv_indptr not monotone",
       [](RawFile& f) {
         f.replace_index("/steps/S000/kv_indptr", {0, 2, 1, 3});
       },
       "/steps/S000/kv_indptr", "not monotone"},
      {"kv_indptr does not end at nnz",
       [](RawFile& f) {
         f.replace_index("/steps/S000/kv_indptr", {0, 2, 3, 4});
       },
       "/steps/S000/kv_indptr", "ends at 4"},
      {"qo_indptr does not end at Nq",
       [](RawFile& f) {
         f.replace_index("/steps/S000/new_kv_slots", {2, 3, 8, 4, 5, 6});
       },
       "/steps/S000/qo_indptr", "ends at Nq = 5"},
      {"kv_indptr shorter than qo_indptr",
       [](RawFile& f) {
         f.replace_index("/steps/S000/kv_indptr", {0, 2, 3});
       },
       "/steps/S000/kv_indptr", "qo_indptr has 4"},
      {"kv_last_page_len of 2 requests",
       [](RawFile& f) {
         f.replace_index("/steps/S000/kv_last_page_len", {1, 2});
       },
       "/steps/S000/kv_last_page_len", "expected B = 3"},
      {"page id = num_pages",
       [](RawFile& f) {
         f.replace_index("/steps/S000/kv_indices", {1, 8, 2});
       },
       "/steps/S000/kv_indices", "[1] = 8 is out of range"},
      {"negative page id",
       [](RawFile& f) {
         f.replace_index("/steps/S001/kv_indices", {1, 4, -2, 5});
       },
       "/steps/S001/kv_indices", "[2] = -2 is out of range"},
      {"last page len 0 with pages",
       [](RawFile& f) {
         f.replace_index("/steps/S000/kv_last_page_len", {0, 2, 0});
       },
       "/steps/S000/kv_last_page_len", "[0] = 0"},
      {"last page len above page_size",
       [](RawFile& f) {
         f.replace_index("/steps/S000/kv_last_page_len", {1, 3, 0});
       },
       "/steps/S000/kv_last_page_len", "[1] = 3"},
      {"last page len without pages",
       [](RawFile& f) {
         f.replace_index("/steps/S001/kv_last_page_len", {2, 1, 1});
       },
       "/steps/S001/kv_last_page_len", "[2] = 1"},
      {"new_kv_slots off by one",
       [](RawFile& f) {
         f.replace_index("/steps/S000/new_kv_slots", {2, 3, 8, 4, 6});
       },
       "/steps/S000/new_kv_slots", "[4] = 6"},
      {"new_kv_slots of the next page",
       [](RawFile& f) {
         f.replace_index("/steps/S001/new_kv_slots", {9, 11});
       },
       "/steps/S001/new_kv_slots", "is slot 10"},
      {"rows without tokens",
       [](RawFile& f) {
         // r2 gets a row but has no page.
         f.replace_index("/steps/S001/qo_indptr", {0, 1, 2, 3});
         f.replace_index("/steps/S001/new_kv_slots", {9, 10, 0});
       },
       "/steps/S001", "zero tokens"},
      {"more prefill rows than tokens",
       [](RawFile& f) {
         // r1 claims 3 rows over its 2 tokens.
         f.replace_index("/steps/S000/qo_indptr", {0, 2, 5, 5});
         f.replace_index("/steps/S000/new_kv_slots", {2, 3, 0, 4, 5});
       },
       "/steps/S000", "zero tokens"},
      {"decode with two rows for a request",
       [](RawFile& f) {
         f.replace_index("/steps/S001/qo_indptr", {0, 2, 3, 3});
         f.replace_index("/steps/S001/new_kv_slots", {8, 9, 10});
       },
       "/steps/S001", "decode step has 2 rows"},
  };
  for (const char* name :
       {"qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "new_kv_slots"}) {
    cases.push_back({std::string("no ") + name,
                     [name](RawFile& f) { f.delete_link(std::string("/steps/S001/") + name); },
                     std::string("/steps/S001/") + name, "missing dataset"});
  }
  check_breakages(cases);
}

TEST_CASE("kvdump reader refuses broken per-layer step tensors", "[kvdump]") {
  std::vector<Breakage> cases = {
      {"q_nope with 3 heads",
       [](RawFile& f) {
         f.replace_zeros("/steps/S000/L000/q_nope", {5, 3, 8}, H5T_STD_U16LE, "bfloat16");
       },
       "/steps/S000/L000/q_nope", "shape [5, 3, 8]"},
      {"q_nope with 4 rows",
       [](RawFile& f) {
         f.replace_zeros("/steps/S000/L003/q_nope", {4, 2, 8}, H5T_STD_U16LE, "bfloat16");
       },
       "/steps/S000/L003/q_nope", "shape [4, 2, 8]"},
      {"q_pe width 5",
       [](RawFile& f) {
         f.replace_zeros("/steps/S001/L000/q_pe", {2, 2, 5}, H5T_STD_U16LE, "bfloat16");
       },
       "/steps/S001/L000/q_pe", "shape [2, 2, 5]"},
      {"new_kv width 11",
       [](RawFile& f) {
         f.replace_zeros("/steps/S001/L003/new_kv", {2, 11}, H5T_STD_U16LE, "bfloat16");
       },
       "/steps/S001/L003/new_kv", "shape [2, 11]"},
      {"q_nope u16 without dtype",
       [](RawFile& f) {
         f.replace_zeros("/steps/S000/L000/q_nope", {5, 2, 8}, H5T_STD_U16LE, nullptr);
       },
       "/steps/S000/L000/q_nope", "without a dtype attribute"},
      {"q_nope u16 labelled float8",
       [](RawFile& f) {
         f.replace_zeros("/steps/S000/L000/q_nope", {5, 2, 8}, H5T_STD_U16LE, "float8_e4m3fn");
       },
       "/steps/S000/L000/q_nope", "expected dtype=\"bfloat16\""},
      {"new_kv as fp8 codes",
       [](RawFile& f) {
         f.replace_zeros("/steps/S000/L000/new_kv", {5, 12}, H5T_STD_U8LE, "float8_e4m3fn");
       },
       "/steps/S000/L000/new_kv", "expected bfloat16"},
      {"new_kv u8 without dtype",
       [](RawFile& f) {
         f.replace_zeros("/steps/S000/L000/new_kv", {5, 12}, H5T_STD_U8LE, nullptr);
       },
       "/steps/S000/L000/new_kv", "without a dtype attribute"},
      {"out with 2 rows",
       [](RawFile& f) {
         f.replace_zeros("/steps/S000/L000/out", {2, 2, 8}, H5T_STD_U16LE, "bfloat16");
       },
       "/steps/S000/L000/out", "shape [2, 2, 8]"},
      {"out u16 without dtype",
       [](RawFile& f) {
         f.replace_zeros("/steps/S000/L003/out", {5, 2, 8}, H5T_STD_U16LE, nullptr);
       },
       "/steps/S000/L003/out", "without a dtype attribute"},
      {"lse as bf16",
       [](RawFile& f) {
         f.replace_zeros("/steps/S000/L003/lse", {5, 2}, H5T_STD_U16LE, "bfloat16");
       },
       "/steps/S000/L003/lse", "expected float32"},
      {"lse float64",
       [](RawFile& f) {
         f.replace_zeros("/steps/S000/L003/lse", {5, 2}, H5T_IEEE_F64LE, nullptr);
       },
       "/steps/S000/L003/lse", "expected float32"},
      {"lse rank 1",
       [](RawFile& f) { f.replace_zeros("/steps/S000/L000/lse", {10}, H5T_IEEE_F32LE, nullptr); },
       "/steps/S000/L000/lse", "shape [10]"},
      {"kv_cache_after as bf16 in an fp8 dump",
       [](RawFile& f) {
         f.replace_zeros("/steps/S001/L000/kv_cache_after", kPoolShape, H5T_STD_U16LE, "bfloat16");
       },
       "/steps/S001/L000/kv_cache_after", "expected u8"},
      {"kv_cache_after u8 without dtype",
       [](RawFile& f) {
         f.replace_zeros("/steps/S001/L000/kv_cache_after", kPoolShape, H5T_STD_U8LE, nullptr);
       },
       "/steps/S001/L000/kv_cache_after", "without a dtype attribute"},
      {"kv_cache_after with 9 pages",
       [](RawFile& f) {
         f.replace_zeros("/steps/S001/L003/kv_cache_after", {9, 2, 12}, H5T_STD_U8LE,
                         "float8_e4m3fn");
       },
       "/steps/S001/L003/kv_cache_after", "shape [9, 2, 12]"},
      {"q_nope scalar",
       [](RawFile& f) {
         f.delete_link("/steps/S000/L000/q_nope");
         const hid_t space = H5Screate(H5S_SCALAR);
         const std::uint16_t zero = 0;
         const hid_t d = H5Dcreate2(f.id(), "/steps/S000/L000/q_nope", H5T_STD_U16LE, space,
                                    H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
         H5Dwrite(d, H5T_NATIVE_UINT16, H5S_ALL, H5S_ALL, H5P_DEFAULT, &zero);
         H5Dclose(d);
         H5Sclose(space);
         f.set_string("/steps/S000/L000/q_nope", "dtype", "bfloat16");
       },
       "/steps/S000/L000/q_nope", "scalar"},
  };
  for (const char* name : {"q_nope", "q_pe", "new_kv"}) {
    cases.push_back({std::string("no ") + name,
                     [name](RawFile& f) { f.delete_link(std::string("/steps/S001/L003/") + name); },
                     std::string("/steps/S001/L003/") + name, "missing dataset"});
  }
  check_breakages(cases);
}

TEST_CASE("kvdump reader: files that are not kvdumps are refused naming the file", "[kvdump]") {
  const auto dir = kvdump_test_dir();
  const auto valid = fresh_dump("valid-for-truncation.h5");
  const std::string bytes = testing::read_text(valid);
  REQUIRE(bytes.size() > 1000);

  struct FileCase {
    std::string name;
    std::function<std::filesystem::path()> make;
    std::string reason;
  };
  const std::vector<FileCase> cases = {
      {"missing", [&] { return dir / "does-not-exist.h5"; }, "no such file"},
      {"directory", [&] { return dir; }, "directory"},
      {"empty",
       [&] {
         std::ofstream(dir / "empty.h5").close();
         return dir / "empty.h5";
       },
       "not an HDF5 file"},
      {"text",
       [&] {
         std::ofstream(dir / "text.h5") << "kvdump but not HDF5\n";
         return dir / "text.h5";
       },
       "not an HDF5 file"},
      {"truncated to half",
       [&] {
         std::ofstream(dir / "half.h5", std::ios::binary) << bytes.substr(0, bytes.size() / 2);
         return dir / "half.h5";
       },
       "HDF5"},
      {"truncated by one byte",
       [&] {
         std::ofstream(dir / "minus1.h5", std::ios::binary) << bytes.substr(0, bytes.size() - 1);
         return dir / "minus1.h5";
       },
       "HDF5"},
  };
  for (const FileCase& c : cases) {
    INFO(c.name);
    const auto path = c.make();
    auto reader = DumpReader::open(path);
    REQUIRE_FALSE(reader.ok());
    INFO(reader.error().message());
    CHECK(reader.error().where == path.string());
    CHECK_THAT(reader.error().what, Catch::Matchers::Contains(c.reason));
  }
}

TEST_CASE("kvdump reader accepts the encodings the format allows", "[kvdump]") {
  const auto path = fresh_dump("variants.h5");
  const std::vector<float> q_nope = testing::pattern(5 * 2 * 8, 0);  // S000/L000, seed 10*0+0
  const std::vector<float> q_pe = testing::pattern(5 * 2 * 4, 2);    // S000/L003, seed 1+1
  {
    RawFile f(path);
    f.set_string("/", "model", "test-model", /*fixed=*/true, H5T_STR_NULLPAD);
    f.set_string("/", "producer", "kvaudit tests", /*fixed=*/true, H5T_STR_SPACEPAD);
    f.set_string("/", "format", "kvdump", /*fixed=*/true, H5T_STR_NULLTERM);
    f.set_string("/steps/S001", "kind", "decode", /*fixed=*/true);
    f.set_int("/", "num_heads", 2, H5T_STD_U8LE);
    f.set_int("/", "kv_lora_rank", 8, H5T_STD_U64LE);
    f.set_int("/", "page_size", 2, H5T_STD_I16BE);
    f.set_int("/layers/L003", "layer_id", 3, H5T_STD_I8LE);
    f.set_double("/", "sm_scale", 0.25, H5T_IEEE_F32LE);
    f.set_double("/layers/L000", "kv_scale", 0.5, H5T_IEEE_F64LE);
    f.replace_dataset("/steps/S000/L000/q_nope", {5, 2, 8}, H5T_IEEE_F32LE, H5T_NATIVE_FLOAT,
                      q_nope.data(), nullptr);
    f.replace_dataset("/steps/S000/L003/q_pe", {5, 2, 4}, H5T_IEEE_F32LE, H5T_NATIVE_FLOAT,
                      q_pe.data(), "float32");
    const std::int64_t pages[] = {1, 4, 2};
    f.replace_dataset("/steps/S000/kv_indices", {3}, H5T_STD_I64LE, H5T_NATIVE_INT64, pages,
                      nullptr);
    // NaN codes inside the pool are legal data.
    std::vector<std::uint8_t> codes(8 * 2 * 12, 0x38);
    codes[0] = 0x7F;
    codes[7] = 0xFF;
    f.replace_dataset("/layers/L003/kv_cache", kPoolShape, H5T_STD_U8LE, H5T_NATIVE_UINT8,
                      codes.data(), "float8_e4m3fn");
  }
  auto reader = DumpReader::open(path);
  INFO((reader.ok() ? "" : reader.error().message()));
  REQUIRE(reader.ok());
  const DumpLayout& layout = reader->layout();
  CHECK(layout.attrs.model == "test-model");
  CHECK(layout.attrs.producer == "kvaudit tests");
  CHECK(layout.attrs.num_heads == 2);
  CHECK(layout.attrs.kv_lora_rank == 8);
  CHECK(layout.attrs.page_size == 2);
  CHECK(layout.attrs.sm_scale == 0.25);
  CHECK(layout.layers[0].kv_scale == 0.5f);
  CHECK(layout.layers[1].layer_id == 3);
  CHECK(layout.steps[1].kind == StepKind::kDecode);
  CHECK(layout.steps[0].kv_indices == std::vector<std::int32_t>{1, 4, 2});
  auto s0l0 = reader->read_step_layer(0, 0);
  REQUIRE(s0l0.ok());
  CHECK(s0l0->q_nope == q_nope);
  auto s0l1 = reader->read_step_layer(0, 1);
  REQUIRE(s0l1.ok());
  CHECK(s0l1->q_pe == q_pe);
  auto pool = reader->read_pool(1);
  REQUIRE(pool.ok());
  CHECK(pool->bytes[0] == 0x7F);
  CHECK(pool->bytes[7] == 0xFF);
  CHECK(pool->bytes[1] == 0x38);
}

TEST_CASE("kvdump reader reads chunked deflate-compressed datasets", "[kvdump]") {
  const auto path = fresh_dump("compressed.h5");
  std::vector<std::uint8_t> codes(8 * 2 * 12);
  for (std::size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<std::uint8_t>(i * 37);
  {
    RawFile f(path);
    f.delete_link("/layers/L003/kv_cache");
    const hsize_t dims[] = {8, 2, 12};
    const hsize_t chunk[] = {3, 2, 12};
    const hid_t space = H5Screate_simple(3, dims, nullptr);
    const hid_t dcpl = H5Pcreate(H5P_DATASET_CREATE);
    REQUIRE(H5Pset_chunk(dcpl, 3, chunk) >= 0);
    REQUIRE(H5Pset_deflate(dcpl, 6) >= 0);
    const hid_t dataset = H5Dcreate2(f.id(), "/layers/L003/kv_cache", H5T_STD_U8LE, space,
                                     H5P_DEFAULT, dcpl, H5P_DEFAULT);
    REQUIRE(dataset >= 0);
    REQUIRE(H5Dwrite(dataset, H5T_NATIVE_UINT8, H5S_ALL, H5S_ALL, H5P_DEFAULT, codes.data()) >= 0);
    H5Dclose(dataset);
    H5Pclose(dcpl);
    H5Sclose(space);
    f.set_string("/layers/L003/kv_cache", "dtype", "float8_e4m3fn");
  }
  auto reader = DumpReader::open(path);
  INFO((reader.ok() ? "" : reader.error().message()));
  REQUIRE(reader.ok());
  auto pool = reader->read_pool(1);
  REQUIRE(pool.ok());
  CHECK(pool->bytes == codes);
}

TEST_CASE("kvdump reader replays steps in numeric order of their names", "[kvdump]") {
  const auto path = fresh_dump("order.h5");
  {
    RawFile f(path);
    f.move_link("/steps/S000", "/steps/S999");  // the prefill
    f.move_link("/steps/S001", "/steps/S1000");
  }
  auto reader = DumpReader::open(path);
  REQUIRE(reader.ok());
  REQUIRE(reader->layout().steps.size() == 2);
  CHECK(reader->layout().steps[0].group == "S999");
  CHECK(reader->layout().steps[0].kind == StepKind::kPrefill);
  CHECK(reader->layout().steps[1].group == "S1000");
}

TEST_CASE("kvdump reader keeps a float32 bf16 pool only when its values are bf16", "[kvdump]") {
  const auto path = fresh_dump("bf16-pool-f32.h5", KvDtype::kBfloat16);
  std::vector<float> values(8 * 2 * 12, 1.5f);
  values[3] = -2.0f;
  {
    RawFile f(path);
    f.replace_dataset("/layers/L000/kv_cache", kPoolShape, H5T_IEEE_F32LE, H5T_NATIVE_FLOAT,
                      values.data(), nullptr);
  }
  {
    auto reader = DumpReader::open(path);
    REQUIRE(reader.ok());
    auto pool = reader->read_pool(0);
    REQUIRE(pool.ok());
    CHECK(pool->bf16_bits(0, 3) == 0xC000);  // -2.0
    CHECK(pool->bf16_bits(0, 0) == 0x3FC0);  // 1.5
  }
  values[5] = 1.0f + 1.0f / 1024;  // needs 10 mantissa bits: not a bf16 value
  {
    RawFile f(path);
    f.replace_dataset("/layers/L000/kv_cache", kPoolShape, H5T_IEEE_F32LE, H5T_NATIVE_FLOAT,
                      values.data(), nullptr);
  }
  auto reader = DumpReader::open(path);
  REQUIRE(reader.ok());
  auto pool = reader->read_pool(0);
  REQUIRE_FALSE(pool.ok());
  CHECK(pool.error().where == path.string() + ":/layers/L000/kv_cache");
  CHECK_THAT(pool.error().what, Catch::Matchers::Contains("not a bfloat16 value"));
}

// ---- kvaudit info ----------------------------------------------------------------------------

std::string info_command(const std::filesystem::path& dump, const std::string& flags,
                         const std::string& stem) {
  const auto dir = kvdump_test_dir();
  return std::string("'") + KVAUDIT_BINARY + "' info " + flags + " '" + dump.string() + "' > '" +
         (dir / (stem + ".out")).string() + "' 2> '" + (dir / (stem + ".err")).string() + "'";
}

TEST_CASE("kvaudit info counts NaN and saturated codes of each initial pool", "[kvdump][cli]") {
  testing::SmallDump d = testing::make_small_dump();
  // Layer 0: three NaN codes (0x7F, 0xFF), three saturated (0x7E = 448, 0xFE = -448), and the
  // neighbours 0x7D / 0xFD (416) which are neither.
  std::fill(d.pools[0].bytes.begin(), d.pools[0].bytes.end(), std::uint8_t{0x38});
  d.pools[0].bytes[0] = 0x7F;
  d.pools[0].bytes[5] = 0xFF;
  d.pools[0].bytes[17] = 0x7F;
  d.pools[0].bytes[3] = 0x7E;
  d.pools[0].bytes[4] = 0xFE;
  d.pools[0].bytes[40] = 0x7E;
  d.pools[0].bytes[41] = 0x7D;
  d.pools[0].bytes[42] = 0xFD;
  // Layer 3: one NaN code, nothing saturated.
  std::fill(d.pools[1].bytes.begin(), d.pools[1].bytes.end(), std::uint8_t{0x00});
  d.pools[1].bytes[191] = 0xFF;
  const auto path = kvdump_test_dir() / "codes.h5";
  REQUIRE(testing::write_small_dump(d, path).ok());

  auto reader = DumpReader::open(path);
  REQUIRE(reader.ok());
  auto info = dump_info(*reader);
  REQUIRE(info.ok());
  CHECK((*info)["layers"][0]["nan_codes"] == 3);
  CHECK((*info)["layers"][0]["saturated_codes"] == 3);
  CHECK((*info)["layers"][1]["nan_codes"] == 1);
  CHECK((*info)["layers"][1]["saturated_codes"] == 0);

  REQUIRE(testing::run_command(info_command(path, "--json", "codes")) == 0);
  const auto json = nlohmann::json::parse(testing::read_text(kvdump_test_dir() / "codes.out"));
  CHECK(json["layers"][0]["nan_codes"] == 3);
  CHECK(json["layers"][0]["saturated_codes"] == 3);
  CHECK(json["layers"][1]["nan_codes"] == 1);
  REQUIRE(testing::run_command(info_command(path, "", "codes-text")) == 0);
  const std::string text = testing::read_text(kvdump_test_dir() / "codes-text.out");
  CHECK_THAT(text, Catch::Matchers::Contains("L000  layer_id=0  kv_scale=0.5  kv_source=yes  "
                                             "nan_codes=3  saturated_codes=3"));
}

TEST_CASE("count_pool_codes on a bf16 pool counts NaN bit patterns only", "[kvdump]") {
  KvPool pool = KvPool::zeros(KvDtype::kBfloat16, 1, 6);
  const std::uint16_t bits[] = {0x7FC0, 0xFF81, 0x7F80, 0xFF80, 0x3F80, 0x0001};
  for (int c = 0; c < 6; ++c) pool.set_bf16_bits(0, c, bits[c]);
  const PoolCodeCounts counts = count_pool_codes(pool);
  CHECK(counts.nan == 2);  // 0x7FC0 and 0xFF81; +-inf is not NaN
}

TEST_CASE("kvaudit info summarises a valid dump", "[kvdump][cli]") {
  const auto path = fresh_dump("info.h5");
  REQUIRE(testing::run_command(info_command(path, "", "info")) == 0);
  const std::string text = testing::read_text(kvdump_test_dir() / "info.out");
  CHECK_THAT(text, Catch::Matchers::Contains("test-model"));
  CHECK_THAT(text, Catch::Matchers::Contains("H=2 Dc=8 Dr=4 page_size=2 num_pages=8 slots=16"));
  CHECK_THAT(text, Catch::Matchers::Contains("S001  decode  requests=3  rows=2  tokens=7"));
  CHECK(testing::read_text(kvdump_test_dir() / "info.err").empty());

  REQUIRE(testing::run_command(info_command(path, "--json", "info-json")) == 0);
  const auto json = nlohmann::json::parse(testing::read_text(kvdump_test_dir() / "info-json.out"));
  CHECK(json["model"] == "test-model");
  CHECK(json["producer"] == "kvaudit tests");
  CHECK(json["shapes"]["num_pages"] == 8);
  CHECK(json["shapes"]["num_slots"] == 16);
  CHECK(json["shapes"]["kv_dtype"] == "float8_e4m3fn");
  CHECK(json["shapes"]["sm_scale"] == 0.25);
  REQUIRE(json["layers"].size() == 2);
  CHECK(json["layers"][1]["layer_id"] == 3);
  CHECK(json["layers"][0]["has_kv_source"] == true);
  CHECK(json["layers"][1]["has_kv_source"] == false);
  REQUIRE(json["steps"].size() == 2);
  // S000: r0 3 tokens + r1 2 tokens; pages 1, 4, 2.
  CHECK(json["steps"][0]["kind"] == "prefill");
  CHECK(json["steps"][0]["requests"] == 3);
  CHECK(json["steps"][0]["rows"] == 5);
  CHECK(json["steps"][0]["tokens"] == 5);
  CHECK(json["steps"][0]["pages_used"] == 3);
  CHECK(json["steps"][0]["captures"]["out"] == nlohmann::json({"L000", "L003"}));
  CHECK(json["steps"][0]["captures"]["kv_cache_after"].empty());
  // S001: r0 4 tokens + r1 3 tokens; pages 1, 4, 2, 5.
  CHECK(json["steps"][1]["tokens"] == 7);
  CHECK(json["steps"][1]["pages_used"] == 4);
  CHECK(json["steps"][1]["captures"]["kv_cache_after"] == nlohmann::json({"L000"}));
  CHECK(json["steps"][1]["captures"]["lse"].empty());
}

TEST_CASE("kvaudit info exits 2 with one line naming the object of a malformed dump",
          "[kvdump][cli]") {
  const auto path = fresh_dump("info-bad.h5");
  {
    RawFile f(path);
    f.replace_index("/steps/S000/kv_indices", {1, 9, 2});
  }
  CHECK(testing::run_command(info_command(path, "", "bad")) == 2);
  const std::string err = testing::read_text(kvdump_test_dir() / "bad.err");
  CHECK(err.rfind("kvaudit: " + path.string() + ":/steps/S000/kv_indices: ", 0) == 0);
  CHECK(std::count(err.begin(), err.end(), '\n') == 1);
  CHECK(testing::read_text(kvdump_test_dir() / "bad.out").empty());

  CHECK(testing::run_command(info_command(kvdump_test_dir() / "no-such.h5", "", "missing")) == 2);
  CHECK_THAT(testing::read_text(kvdump_test_dir() / "missing.err"),
             Catch::Matchers::Contains("no-such.h5: no such file"));

  const auto text_file = kvdump_test_dir() / "info-text.h5";
  std::ofstream(text_file) << "hello\n";
  CHECK(testing::run_command(info_command(text_file, "--json", "text")) == 2);
  CHECK(testing::read_text(kvdump_test_dir() / "text.out").empty());
}

TEST_CASE("kvaudit info usage: no file is exit 2, --help is exit 0", "[kvdump][cli]") {
  const auto dir = kvdump_test_dir();
  const std::string bin = std::string("'") + KVAUDIT_BINARY + "'";
  CHECK(testing::run_command(bin + " info > /dev/null 2>&1") == 2);
  CHECK(testing::run_command(bin + " info --help > '" + (dir / "help.out").string() + "' 2>&1") ==
        0);
  const std::string help = testing::read_text(dir / "help.out");
  CHECK_THAT(help, Catch::Matchers::Contains("--json"));
  CHECK_THAT(help, Catch::Matchers::Contains("saturated"));
}

// ---- a dump written from the format page by another implementation ----------------------------

TEST_CASE("kvdump reader accepts a dump written by h5py from the format page", "[kvdump][python]") {
  if (testing::run_command("/usr/bin/python3 -c 'import h5py, numpy' > /dev/null 2>&1") != 0) {
    WARN(
        "SKIPPED: /usr/bin/python3 lacks h5py/numpy; tests/python/write_dump_from_spec.py not "
        "run");
    return;
  }
  const auto path = kvdump_test_dir() / "from-spec.h5";
  std::filesystem::remove(path);
  const std::string script =
      std::string(KVAUDIT_SOURCE_DIR) + "/tests/python/write_dump_from_spec.py";
  REQUIRE(testing::run_command("/usr/bin/python3 '" + script + "' '" + path.string() + "'") == 0);
  auto reader = DumpReader::open(path);
  INFO((reader.ok() ? "" : reader.error().message()));
  REQUIRE(reader.ok());
  // What the script writes (see its header comment).
  const DumpLayout& layout = reader->layout();
  CHECK(layout.attrs.model == "spec-check");
  CHECK(layout.attrs.page_size == 1);
  CHECK(layout.attrs.num_heads == 4);
  CHECK(layout.num_pages == 16);
  REQUIRE(layout.layers.size() == 2);
  CHECK(layout.layers[0].layer_id == 0);
  CHECK(layout.layers[1].layer_id == 61);
  CHECK(layout.layers[1].kv_scale == 0.25f);
  REQUIRE(layout.steps.size() == 2);
  CHECK(layout.steps[0].kind == StepKind::kPrefill);
  CHECK(layout.steps[1].kind == StepKind::kDecode);
  CHECK(layout.steps[1].new_kv_slots == std::vector<std::int32_t>{9, 14});
  auto tensors = reader->read_step_layer(0, 1);
  REQUIRE(tensors.ok());
  CHECK(tensors->q_nope[0] == 1.0f);   // the script pins q_nope[0, 0, 0] = 1
  CHECK(tensors->new_kv[1] == -0.5f);  // and new_kv[0, 1] = -0.5
  auto pool = reader->read_pool(1);
  REQUIRE(pool.ok());
  // The script quantized new_kv[0, 1] = -0.5 with kv_scale 0.25: -2.0 is code 0xC0. S000 row 0
  // is written to slot 3 (see the script), but the pool stored is the one before step 0, where
  // the script leaves padding slots as NaN codes 0x7F.
  CHECK(pool->row(15)[0] == 0x7F);
  CHECK(testing::run_command(info_command(path, "", "from-spec")) == 0);
}

}  // namespace
}  // namespace kvaudit
