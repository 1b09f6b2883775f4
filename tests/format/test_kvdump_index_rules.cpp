// Index rules added to kvdump v1's refusals (docs/kvdump-v1.md "Errors"): two rows of one step
// writing the same slot (the step's writes race on a GPU), index datasets of 8 or 16 bits (the
// format's indices are 32- or 64-bit integers), and an empty file named as empty. The small dump
// of kvdump_fixture.hpp: S001 (decode) has request 0 on pages [1, 4] (4 tokens, its row at
// position 3 = slot 4 * 2 + 1 = 9) and request 1 on pages [2, 5] (3 tokens, slot 10).
#include <catch2/catch.hpp>
#include <cstdint>
#include <fstream>
#include <string>

#include "src/format/kvdump.hpp"
#include "src/format/step_indices.hpp"
#include "tests/format/kvdump_fixture.hpp"

namespace kvaudit {
namespace {

using testing::fresh_dump;
using testing::kvdump_test_dir;
using testing::make_small_dump;
using testing::RawFile;

// S001 with request 1 moved onto request 0's pages [1, 4] and 4 tokens: both rows write slot 9.
StepMeta racing_decode_step() {
  StepMeta step = make_small_dump().steps[1];
  step.kv_indices = {1, 4, 1, 4};
  step.kv_last_page_len = {2, 2, 0};
  step.new_kv_slots = {9, 9};
  return step;
}

std::string refusal(const std::filesystem::path& path) {
  const auto reader = DumpReader::open(path);
  return reader.ok() ? std::string("accepted") : reader.error().message();
}

TEST_CASE("two rows of one step writing the same slot are refused by name", "[kvdump]") {
  const StepMeta step = racing_decode_step();
  const Status status = validate_step_indices(step, 8, 2, "dump.h5:/steps/S001");
  REQUIRE_FALSE(status.ok());
  CHECK(status.error().message() ==
        "dump.h5:/steps/S001/new_kv_slots: rows 0 and 1 both write slot 9: two writes of one "
        "slot in one step would race");

  const auto path = fresh_dump("racing.h5");
  {
    RawFile f(path);
    f.replace_index("/steps/S001/kv_indices", step.kv_indices);
    f.replace_index("/steps/S001/kv_last_page_len", step.kv_last_page_len);
    f.replace_index("/steps/S001/new_kv_slots", step.new_kv_slots);
  }
  CHECK(refusal(path) == path.string() +
                             ":/steps/S001/new_kv_slots: rows 0 and 1 both write slot 9: two "
                             "writes of one slot in one step would race");
}

TEST_CASE("the writer refuses a step whose rows write one slot twice", "[kvdump]") {
  const testing::SmallDump d = make_small_dump();
  const auto path = kvdump_test_dir() / "writer-racing.h5";
  auto writer = DumpWriter::create(path, d.attrs, d.num_pages);
  REQUIRE(writer.ok());
  for (std::size_t l = 0; l < d.layers.size(); ++l) {
    REQUIRE(writer->write_layer(d.layers[l], d.pools[l], nullptr).ok());
  }
  StepMeta step = racing_decode_step();
  step.group = "S000";
  const Status status = writer->write_step(step);
  REQUIRE_FALSE(status.ok());
  CHECK(status.error().where == path.string() + ":/steps/S000/new_kv_slots");
}

TEST_CASE("index datasets of 8 or 16 bits are refused - 32 and 64 bits are read", "[kvdump]") {
  const std::int16_t narrow[] = {0, 3, 5, 5};
  const std::int64_t wide[] = {0, 3, 5, 5};
  const std::uint32_t unsigned_wide[] = {0, 3, 5, 5};
  const auto path = fresh_dump("index-types.h5");
  const std::string where = path.string() + ":/steps/S000/qo_indptr: ";

  SECTION("int16") {
    RawFile(path).replace_dataset("/steps/S000/qo_indptr", {4}, H5T_STD_I16LE, H5T_NATIVE_INT16,
                                  narrow, nullptr);
    CHECK(refusal(path) ==
          where + "element type int16; expected int32 (indices are 32- or 64-bit integers)");
  }
  SECTION("int8") {
    RawFile(path).replace_dataset("/steps/S000/qo_indptr", {4}, H5T_STD_I8LE, H5T_NATIVE_INT16,
                                  narrow, nullptr);
    CHECK(refusal(path) ==
          where + "element type int8; expected int32 (indices are 32- or 64-bit integers)");
  }
  SECTION("int64 and uint32") {
    RawFile(path).replace_dataset("/steps/S000/qo_indptr", {4}, H5T_STD_I64LE, H5T_NATIVE_INT64,
                                  wide, nullptr);
    CHECK(refusal(path) == "accepted");
    RawFile(path).replace_dataset("/steps/S000/qo_indptr", {4}, H5T_STD_U32LE, H5T_NATIVE_UINT32,
                                  unsigned_wide, nullptr);
    CHECK(refusal(path) == "accepted");
  }
}

TEST_CASE("an empty file is called empty", "[kvdump]") {
  const auto path = kvdump_test_dir() / "empty.h5";
  std::ofstream(path).close();
  CHECK(refusal(path) == path.string() + ": is empty (0 bytes), not an HDF5 file");
}

}  // namespace
}  // namespace kvaudit
