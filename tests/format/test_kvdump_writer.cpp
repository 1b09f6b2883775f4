// kvdump v1 writer: round trip through the reader, the stored HDF5 types the format names,
// determinism (identical input, identical bytes), and refusal of inputs the reader would refuse.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "src/format/kvdump.hpp"
#include "tests/format/kvdump_fixture.hpp"

namespace kvaudit {
namespace {

using testing::kvdump_test_dir;
using testing::make_small_dump;
using testing::SmallDump;
using testing::write_small_dump;

void check_round_trip(const SmallDump& d, const std::filesystem::path& path) {
  REQUIRE(write_small_dump(d, path).ok());
  auto reader = DumpReader::open(path);
  INFO((reader.ok() ? "" : reader.error().message()));
  REQUIRE(reader.ok());
  const DumpLayout& layout = reader->layout();
  CHECK(layout.attrs.model == d.attrs.model);
  CHECK(layout.attrs.producer == d.attrs.producer);
  CHECK(layout.attrs.num_heads == d.attrs.num_heads);
  CHECK(layout.attrs.kv_lora_rank == d.attrs.kv_lora_rank);
  CHECK(layout.attrs.qk_rope_head_dim == d.attrs.qk_rope_head_dim);
  CHECK(layout.attrs.sm_scale == d.attrs.sm_scale);
  CHECK(layout.attrs.page_size == d.attrs.page_size);
  CHECK(layout.attrs.kv_dtype == d.attrs.kv_dtype);
  CHECK(layout.attrs.kv_scale_kind == "per_tensor");
  CHECK(layout.num_pages == d.num_pages);
  REQUIRE(layout.layers.size() == d.layers.size());
  for (std::size_t l = 0; l < d.layers.size(); ++l) {
    INFO("layer " << l);
    CHECK(layout.layers[l].group == d.layers[l].group);
    CHECK(layout.layers[l].layer_id == d.layers[l].layer_id);
    CHECK(layout.layers[l].kv_scale == d.layers[l].kv_scale);
    CHECK(layout.layers[l].has_source == d.layers[l].has_source);
    auto pool = reader->read_pool(l);
    REQUIRE(pool.ok());
    CHECK(pool->dtype == d.pools[l].dtype);
    CHECK(pool->num_slots == d.pools[l].num_slots);
    CHECK(pool->row_width == d.pools[l].row_width);
    CHECK(pool->bytes == d.pools[l].bytes);
    if (d.layers[l].has_source) {
      auto source = reader->read_source(l);
      REQUIRE(source.ok());
      CHECK(std::equal(source->begin(), source->end(), d.sources[l].begin(), d.sources[l].end()));
    } else {
      CHECK_FALSE(reader->read_source(l).ok());
    }
  }
  REQUIRE(layout.steps.size() == d.steps.size());
  for (std::size_t s = 0; s < d.steps.size(); ++s) {
    INFO("step " << s);
    const StepMeta& got = layout.steps[s];
    const StepMeta& want = d.steps[s];
    CHECK(got.group == want.group);
    CHECK(got.kind == want.kind);
    CHECK(got.qo_indptr == want.qo_indptr);
    CHECK(got.kv_indptr == want.kv_indptr);
    CHECK(got.kv_indices == want.kv_indices);
    CHECK(got.kv_last_page_len == want.kv_last_page_len);
    CHECK(got.new_kv_slots == want.new_kv_slots);
    CHECK(got.has_out == want.has_out);
    CHECK(got.has_lse == want.has_lse);
    CHECK(got.has_kv_cache_after == want.has_kv_cache_after);
    for (std::size_t l = 0; l < d.layers.size(); ++l) {
      INFO("layer " << l);
      auto t = reader->read_step_layer(s, l);
      REQUIRE(t.ok());
      const StepLayerTensors& w = d.tensors[s][l];
      CHECK(t->q_nope == w.q_nope);
      CHECK(t->q_pe == w.q_pe);
      CHECK(t->new_kv == w.new_kv);
      CHECK(t->out == w.out);
      CHECK(t->lse == w.lse);
      REQUIRE(t->kv_cache_after.has_value() == w.kv_cache_after.has_value());
      if (w.kv_cache_after) CHECK(t->kv_cache_after->bytes == w.kv_cache_after->bytes);
    }
  }
}

TEST_CASE("kvdump writer round-trips an fp8 dump bitwise", "[kvdump]") {
  SmallDump d = make_small_dump();
  // Every code, NaN codes included, must survive.
  for (std::size_t i = 0; i < d.pools[1].bytes.size(); ++i) {
    d.pools[1].bytes[i] = static_cast<std::uint8_t>(i % 256);
  }
  check_round_trip(d, kvdump_test_dir() / "round-trip-fp8.h5");
}

TEST_CASE("kvdump writer round-trips a bf16-pool dump bitwise", "[kvdump]") {
  SmallDump d = make_small_dump(KvDtype::kBfloat16);
  d.pools[0].set_bf16_bits(3, 2, 0x7FC1);  // a NaN payload
  d.pools[0].set_bf16_bits(4, 0, 0xFF80);  // -inf
  check_round_trip(d, kvdump_test_dir() / "round-trip-bf16.h5");
}

TEST_CASE("kvdump writer round-trips a step without query rows", "[kvdump]") {
  SmallDump d = make_small_dump();
  // S002: the three requests of S001, none with a row (Nq = 0): every tensor has a zero extent.
  StepMeta empty = d.steps[1];
  empty.group = "S002";
  empty.kind = StepKind::kPrefill;
  empty.qo_indptr = {0, 0, 0, 0};
  empty.new_kv_slots = {};
  empty.has_out = {true, false};
  empty.has_lse = {false, true};
  empty.has_kv_cache_after = {false, false};
  std::vector<StepLayerTensors> tensors(2);
  tensors[0].out = std::vector<float>{};
  tensors[1].lse = std::vector<float>{};
  d.steps.push_back(empty);
  d.tensors.push_back(tensors);
  check_round_trip(d, kvdump_test_dir() / "no-rows.h5");
}

TEST_CASE("kvdump writer output is deterministic", "[kvdump]") {
  const SmallDump d = make_small_dump();
  const auto a = kvdump_test_dir() / "deterministic-a.h5";
  const auto b = kvdump_test_dir() / "deterministic-b.h5";
  REQUIRE(write_small_dump(d, a).ok());
  REQUIRE(write_small_dump(d, b).ok());
  const std::string bytes_a = testing::read_text(a);
  CHECK(bytes_a.size() > 0);
  CHECK(bytes_a == testing::read_text(b));
}

std::string string_attribute(hid_t object, const char* name) {
  const hid_t attr = H5Aopen(object, name, H5P_DEFAULT);
  REQUIRE(attr >= 0);
  const hid_t type = H5Aget_type(attr);
  REQUIRE(H5Tget_class(type) == H5T_STRING);
  std::string value;
  if (H5Tis_variable_str(type) > 0) {
    char* text = nullptr;
    REQUIRE(H5Aread(attr, type, &text) >= 0);
    value = text;
    H5free_memory(text);
  } else {
    std::vector<char> buffer(H5Tget_size(type) + 1, '\0');
    REQUIRE(H5Aread(attr, type, buffer.data()) >= 0);
    value = buffer.data();
  }
  H5Tclose(type);
  H5Aclose(attr);
  return value;
}

// The stored type of a dataset or attribute equals `expected` (H5T_STD_U8LE, ...).
bool dataset_type_is(hid_t file, const char* path, hid_t expected) {
  const hid_t dataset = H5Dopen2(file, path, H5P_DEFAULT);
  REQUIRE(dataset >= 0);
  const hid_t type = H5Dget_type(dataset);
  const bool equal = H5Tequal(type, expected) > 0;
  H5Tclose(type);
  H5Dclose(dataset);
  return equal;
}

bool attribute_type_is(hid_t file, const char* object, const char* name, hid_t expected) {
  const hid_t attr = H5Aopen_by_name(file, object, name, H5P_DEFAULT, H5P_DEFAULT);
  REQUIRE(attr >= 0);
  const hid_t type = H5Aget_type(attr);
  const bool equal = H5Tequal(type, expected) > 0;
  H5Tclose(type);
  H5Aclose(attr);
  return equal;
}

std::string dtype_of(hid_t file, const char* path) {
  const hid_t dataset = H5Dopen2(file, path, H5P_DEFAULT);
  REQUIRE(dataset >= 0);
  const std::string value = string_attribute(dataset, "dtype");
  H5Dclose(dataset);
  return value;
}

TEST_CASE("kvdump writer stores the HDF5 types the format names, without timestamps", "[kvdump]") {
  const auto path = testing::fresh_dump("types.h5");
  testing::RawFile f(path);
  const hid_t id = f.id();
  CHECK(dataset_type_is(id, "/layers/L000/kv_cache", H5T_STD_U8LE));
  CHECK(dtype_of(id, "/layers/L000/kv_cache") == "float8_e4m3fn");
  CHECK(dataset_type_is(id, "/layers/L000/kv_source", H5T_STD_U16LE));
  CHECK(dtype_of(id, "/layers/L000/kv_source") == "bfloat16");
  CHECK(dataset_type_is(id, "/steps/S000/L000/q_nope", H5T_STD_U16LE));
  CHECK(dtype_of(id, "/steps/S000/L000/q_nope") == "bfloat16");
  CHECK(dataset_type_is(id, "/steps/S000/L003/out", H5T_STD_U16LE));
  CHECK(dataset_type_is(id, "/steps/S000/L003/lse", H5T_IEEE_F32LE));
  CHECK(dataset_type_is(id, "/steps/S001/L000/kv_cache_after", H5T_STD_U8LE));
  CHECK(dtype_of(id, "/steps/S001/L000/kv_cache_after") == "float8_e4m3fn");
  for (const char* name :
       {"/steps/S001/qo_indptr", "/steps/S001/kv_indptr", "/steps/S001/kv_indices",
        "/steps/S001/kv_last_page_len", "/steps/S001/new_kv_slots"}) {
    CHECK(dataset_type_is(id, name, H5T_STD_I32LE));
  }
  CHECK(attribute_type_is(id, "/layers/L000", "kv_scale", H5T_IEEE_F32LE));
  CHECK(attribute_type_is(id, "/", "sm_scale", H5T_IEEE_F64LE));
  const hid_t root = H5Gopen2(id, "/", H5P_DEFAULT);
  CHECK(string_attribute(root, "format") == "kvdump");
  CHECK(string_attribute(root, "kv_dtype") == "float8_e4m3fn");
  CHECK(string_attribute(root, "kv_scale_kind") == "per_tensor");
  H5Gclose(root);
  for (const char* object : {"/", "/layers", "/steps/S001", "/steps/S001/L003/q_pe"}) {
    H5O_info_t info;
    REQUIRE(H5Oget_info_by_name2(id, object, &info, H5O_INFO_TIME, H5P_DEFAULT) >= 0);
    INFO(object);
    CHECK(info.ctime == 0);
    CHECK(info.mtime == 0);
  }
}

TEST_CASE("kvdump writer rounds floats to bf16 nearest-even", "[kvdump]") {
  SmallDump d = make_small_dump();
  // 1 + 2^-8 is the midpoint of 1 and 1 + 2^-7: ties to 1 (even). 1 + 3 * 2^-8 is the midpoint of
  // 1 + 2^-7 (odd) and 1 + 2^-6 (even): ties to 1 + 2^-6.
  d.tensors[0][0].q_nope[0] = 1.0f + 1.0f / 256;
  d.tensors[0][0].q_nope[1] = 1.0f + 3.0f / 256;
  d.tensors[0][0].q_nope[2] = 1.0f + 3.0f / 512;  // above the midpoint 1 + 2^-8: up to 1 + 2^-7
  const auto path = kvdump_test_dir() / "bf16-rounding.h5";
  REQUIRE(write_small_dump(d, path).ok());
  auto reader = DumpReader::open(path);
  REQUIRE(reader.ok());
  auto t = reader->read_step_layer(0, 0);
  REQUIRE(t.ok());
  CHECK(t->q_nope[0] == 1.0f);
  CHECK(t->q_nope[1] == 1.0f + 1.0f / 64);
  CHECK(t->q_nope[2] == 1.0f + 1.0f / 128);
}

TEST_CASE("kvdump writer refuses what the reader would refuse", "[kvdump]") {
  const SmallDump d = make_small_dump();
  const auto path = kvdump_test_dir() / "writer-refuses.h5";

  SECTION("a new_kv_slots entry that is not its row's slot") {
    auto writer = DumpWriter::create(path, d.attrs, d.num_pages);
    REQUIRE(writer.ok());
    for (std::size_t l = 0; l < d.layers.size(); ++l) {
      REQUIRE(writer->write_layer(d.layers[l], d.pools[l], nullptr).ok());
    }
    StepMeta step = d.steps[0];
    step.new_kv_slots[1] = 7;
    const Status status = writer->write_step(step);
    REQUIRE_FALSE(status.ok());
    CHECK(status.error().where == path.string() + ":/steps/S000/new_kv_slots");
  }
  SECTION("a tensor of the wrong size") {
    auto writer = DumpWriter::create(path, d.attrs, d.num_pages);
    REQUIRE(writer.ok());
    for (std::size_t l = 0; l < d.layers.size(); ++l) {
      REQUIRE(writer->write_layer(d.layers[l], d.pools[l], nullptr).ok());
    }
    REQUIRE(writer->write_step(d.steps[0]).ok());
    StepLayerTensors t = d.tensors[0][0];
    t.q_pe.pop_back();
    const Status status = writer->write_step_layer(d.steps[0], d.layers[0], t);
    REQUIRE_FALSE(status.ok());
    CHECK(status.error().where == path.string() + ":/steps/S000/L000/q_pe");
  }
  SECTION("a pool of the other dtype or size") {
    auto writer = DumpWriter::create(path, d.attrs, d.num_pages);
    REQUIRE(writer.ok());
    const KvPool bf16 = KvPool::zeros(KvDtype::kBfloat16, 16, 12);
    CHECK_FALSE(writer->write_layer(d.layers[0], bf16, nullptr).ok());
    const KvPool small = KvPool::zeros(KvDtype::kFloat8E4m3fn, 14, 12);
    CHECK_FALSE(writer->write_layer(d.layers[1], small, nullptr).ok());
  }
  SECTION("a step missing a layer at close") {
    auto writer = DumpWriter::create(path, d.attrs, d.num_pages);
    REQUIRE(writer.ok());
    for (std::size_t l = 0; l < d.layers.size(); ++l) {
      REQUIRE(writer->write_layer(d.layers[l], d.pools[l], nullptr).ok());
    }
    REQUIRE(writer->write_step(d.steps[0]).ok());
    REQUIRE(writer->write_step_layer(d.steps[0], d.layers[0], d.tensors[0][0]).ok());
    const Status status = writer->close();
    REQUIRE_FALSE(status.ok());
    CHECK(status.error().where == path.string() + ":/steps/S000");
  }
}

TEST_CASE("kvdump writer: the file appears only when a complete dump is closed", "[kvdump]") {
  const SmallDump d = make_small_dump();
  const auto dir = kvdump_test_dir();
  const auto path = dir / "atomic.h5";
  std::filesystem::remove(path);  // from an earlier run
  const auto others = [&] {
    std::vector<std::string> names;
    for (const auto& entry : std::filesystem::directory_iterator(dir)) {
      if (entry.path() != path) names.push_back(entry.path().filename());
    }
    return names;
  };

  SECTION("abandoned without close: nothing written") {
    {
      auto writer = DumpWriter::create(path, d.attrs, d.num_pages);
      REQUIRE(writer.ok());
      REQUIRE(writer->write_layer(d.layers[0], d.pools[0], nullptr).ok());
      CHECK_FALSE(std::filesystem::exists(path));
    }
    CHECK_FALSE(std::filesystem::exists(path));
    CHECK(others().empty());
  }
  SECTION("closed incomplete: refused, and an existing file is left as it was") {
    std::ofstream(path) << "previous";
    auto writer = DumpWriter::create(path, d.attrs, d.num_pages);
    REQUIRE(writer.ok());
    for (std::size_t l = 0; l < d.layers.size(); ++l) {
      REQUIRE(writer->write_layer(d.layers[l], d.pools[l], nullptr).ok());
    }
    REQUIRE(writer->write_step(d.steps[0]).ok());
    CHECK_FALSE(writer->close().ok());
    CHECK(testing::read_text(path) == "previous");
    CHECK(others().empty());
  }
  SECTION("closed complete: the dump replaces the old file") {
    std::ofstream(path) << "previous";
    REQUIRE(testing::write_small_dump(d, path).ok());
    CHECK(DumpReader::open(path).ok());
    CHECK(others().empty());
  }
}

}  // namespace
}  // namespace kvaudit
