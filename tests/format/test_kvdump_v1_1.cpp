// kvdump v1.1 (docs/kvdump-v1.md "Version 1.1"): the per_token_group write rule and scale
// encodings, both file layouts, the reader's new refusals, sparse rows, and the exact reference on
// group-scaled pools. Expected values are written down by hand or computed here from the format's
// definitions (code * scale in binary64, Boost at 100 digits), not by the code under test.
#include <hdf5.h>
#include <sys/wait.h>

#include <bit>
#include <boost/multiprecision/cpp_bin_float.hpp>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "references/mla_reference.hpp"
#include "src/format/group_scales.hpp"
#include "src/format/kvdump.hpp"
#include "src/format/step_indices.hpp"
#include "src/tools/synth.hpp"
#include "tests/format/kvdump_fixture.hpp"
#include "tests/mla_case.hpp"

namespace kvaudit {
namespace {

using testing::kvdump_test_dir;
using testing::RawFile;

TEST_CASE("v1.1 group scales: the write rule's choice in each format", "[kvdump][v1.1]") {
  // amax 1344 = 3 * 448: float32 3, the power of two at or above 3 is 4 (e8m0 code 127 + 2).
  CHECK(group_scale_for(1344.0f, GroupScaleFormat::kFloat32) == 3.0f);
  CHECK(group_scale_for(1344.0f, GroupScaleFormat::kPowerOfTwo) == 4.0f);
  CHECK(group_scale_for(1344.0f, GroupScaleFormat::kE8m0) == 4.0f);
  CHECK(e8m0_encode(4.0f) == 129);
  // Exactly a power of two times 448: that power, not the next.
  CHECK(group_scale_for(896.0f, GroupScaleFormat::kPowerOfTwo) == 2.0f);
  CHECK(group_scale_for(0.875f, GroupScaleFormat::kPowerOfTwo) == 0.001953125f);  // 2^-9
  // An all-zero group: scale 1 in every format.
  for (auto f :
       {GroupScaleFormat::kFloat32, GroupScaleFormat::kPowerOfTwo, GroupScaleFormat::kE8m0}) {
    CHECK(group_scale_for(0.0f, f) == 1.0f);
  }
  CHECK(e8m0_decode(127) == 1.0f);
  CHECK(e8m0_decode(0) == std::ldexp(1.0f, -127));
  CHECK(std::isnan(e8m0_decode(0xFF)));
  // Non-finite elements do not enter amax.
  const std::vector<float> x = {1.0f, -INFINITY, NAN, -2.5f};
  CHECK(finite_amax(x) == 2.5f);
}

// A grouped pool of `slots` slots: Dc = 16 in groups of 8, Dr = 4.
KvPool grouped_pool(GroupScaleFormat format, KvDtype rope, std::int64_t slots) {
  DumpAttributes attrs;
  attrs.kv_lora_rank = 16;
  attrs.qk_rope_head_dim = 4;
  attrs.kv_scale_kind = "per_token_group";
  attrs.kv_scale_group_size = 8;
  attrs.kv_scale_format = format;
  attrs.kv_rope_dtype = rope;
  return KvPool::zeros_for(attrs, slots);
}

TEST_CASE("v1.1 write rule: codes, scales and RoPE of one row, by hand", "[kvdump][v1.1]") {
  std::vector<float> row(20, 0.0f);
  row[0] = 1344.0f;  // group 0: amax 1344 -> float32 scale 3
  row[1] = -3.0f;    // 3 / 3 = 1: code 0x38; -1 -> 0xB8
  row[2] = 2.0f;     // 2/3 = 0.667 -> e4m3 0.625 (0x32) or 0.6875 (0x33): nearest is 0.6875
  row[8] = 0.0f;     // group 1 all zero: scale 1, codes 0
  row[16] = 2.5f;    // RoPE
  row[19] = -600.0f;
  KvPool bf16_rope = grouped_pool(GroupScaleFormat::kFloat32, KvDtype::kBfloat16, 2);
  REQUIRE(bf16_rope.row_bytes() == 16 + 2 * 4 + 4 * 2);
  write_grouped_row(bf16_rope, 1, row.data(), 1.0f, false);
  CHECK(bf16_rope.group_scale(1, 0) == 3.0f);
  CHECK(bf16_rope.group_scale(1, 1) == 1.0f);
  const std::uint8_t* codes = bf16_rope.row(1);
  CHECK(codes[0] == 0x7E);  // 1344 / 3 = 448
  CHECK(codes[1] == 0xB8);
  CHECK(codes[2] == 0x33);
  for (int j = 8; j < 16; ++j) CHECK(codes[j] == 0);
  CHECK(bf16_rope.element(1, 16) == 2.5f);
  CHECK(bf16_rope.element(1, 19) == -600.0f);
  CHECK(bf16_rope.dequantized(1, 0, 1.0f) == 1344.0);
  CHECK(bf16_rope.dequantized(1, 2, 1.0f) == 0.6875 * 3.0);
  // Bytes: the scale of group 0 (3.0f) little-endian at offset 16, RoPE bf16 bits at 24.
  std::uint32_t bits = 0;
  std::memcpy(&bits, codes + 16, 4);
  CHECK(bits == std::bit_cast<std::uint32_t>(3.0f));
  CHECK((codes[24] | (codes[25] << 8)) == 0x4020);  // bf16 2.5

  // e4m3 RoPE with kv_scale 2: 2.5 / 2 = 1.25, -600 / 2 = -300 -> -288 (between 288 and 320);
  // the e8m0 form stores the power of two 4 as the byte 129 and the zero group's 1 as 127.
  KvPool fp8_rope = grouped_pool(GroupScaleFormat::kE8m0, KvDtype::kFloat8E4m3fn, 1);
  write_grouped_row(fp8_rope, 0, row.data(), 2.0f, false);
  CHECK(fp8_rope.row(0)[16] == 129);
  CHECK(fp8_rope.row(0)[17] == 127);
  CHECK(fp8_rope.group_scale(0, 0) == 4.0f);
  CHECK(fp8_rope.element(0, 16) == 1.25f);
  CHECK(fp8_rope.element(0, 19) == -288.0f);
  CHECK(fp8_rope.dequantized(0, 19, 2.0f) == -576.0);
  // 1344 / 4 = 336, the midpoint of 320 (0x7A, even mantissa) and 352: ties to even.
  CHECK(fp8_rope.row(0)[0] == 0x7A);
}

TEST_CASE("v1.1 write faults change what the v1.1 rule stores, as named", "[kvdump][v1.1]") {
  std::vector<float> row(20, 0.0f);
  for (int j = 0; j < 8; ++j) row[j] = 0.5f * static_cast<float>(j + 1);  // group 1 stays zero
  row[16] = 100.0f;
  KvPool clean = grouped_pool(GroupScaleFormat::kFloat32, KvDtype::kFloat8E4m3fn, 1);
  write_grouped_row(clean, 0, row.data(), 1.0f, false);
  KvPool zero = clean;
  write_grouped_row(zero, 0, row.data(), 1.0f, false, GroupWriteFault::kZeroGroupScale);
  CHECK(zero.group_scale(0, 1) == 0.0f);
  for (int j = 8; j < 16; ++j) CHECK(e4m3_is_nan(zero.row(0)[j]));
  KvPool one = clean;
  write_grouped_row(one, 0, row.data(), 1.0f, false, GroupWriteFault::kScaleOne);
  CHECK(one.group_scale(0, 0) == clean.group_scale(0, 0));
  CHECK(one.row(0)[7] == kvdump_quantize(4.0f, 1.0f));
  KvPool rope = clean;  // RoPE 100 with the latent's scale 4 / 448: 11200 saturates to 448
  write_grouped_row(rope, 0, row.data(), 1.0f, false, GroupWriteFault::kRopeLatentScale);
  CHECK(rope.element(0, 16) == 448.0f);
  CHECK(clean.element(0, 16) == 96.0f);  // 100 rounds to 96 in e4m3
}

// Writes a two-layout pair of the same synthetic trace and returns the paths.
std::filesystem::path synth_v1_1(const std::string& name, PoolLayout layout, int topk) {
  SynthSpec spec;
  spec.seed = 7;
  spec.layer_ids = {0};
  spec.num_heads = 2;
  spec.kv_lora_rank = 16;
  spec.rope_dim = 4;
  spec.page_size = 4;
  spec.prefix_lens = {9, 30};
  spec.prefill_tokens = {3, 2};
  spec.decode_steps = 1;
  spec.scale_group_size = 8;
  spec.scale_format = GroupScaleFormat::kPowerOfTwo;
  spec.rope_dtype = KvDtype::kBfloat16;
  spec.layout = layout;
  spec.topk = topk;
  spec.zero_group_every = 5;
  const auto path = kvdump_test_dir() / name;
  const auto written = write_synth_dump(path, spec);
  INFO((written.ok() ? std::string() : written.error().message()));
  REQUIRE(written.ok());
  return path;
}

TEST_CASE("v1.1 pools read the same from the split and the packed FlashMLA layout",
          "[kvdump][v1.1]") {
  const auto split = synth_v1_1("split.h5", PoolLayout::kSplit, 0);
  const auto packed = synth_v1_1("packed.h5", PoolLayout::kFlashMlaFp8, 0);
  Result<KvPool> pool_a = internal_error("", "");
  Result<KvPool> pool_b = internal_error("", "");
  {
    auto a = DumpReader::open(split);
    auto b = DumpReader::open(packed);
    REQUIRE(a.ok());
    REQUIRE(b.ok());
    CHECK(a->layout().format_minor_version == 1);
    CHECK(a->layout().attrs.kv_cache_layout == PoolLayout::kSplit);
    CHECK(b->layout().attrs.kv_cache_layout == PoolLayout::kFlashMlaFp8);
    pool_a = a->read_pool(0);
    pool_b = b->read_pool(0);
  }
  REQUIRE(pool_a.ok());
  REQUIRE(pool_b.ok());
  CHECK(pool_a->grouped());
  CHECK(pool_a->bytes == pool_b->bytes);
  // The packed dataset holds, per slot, 16 codes, 2 fp32 scales, 4 bf16 RoPE values: 32 bytes.
  const hid_t file = H5Fopen(packed.string().c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  REQUIRE(file >= 0);
  const hid_t dataset = H5Dopen2(file, "/layers/L000/kv_cache", H5P_DEFAULT);
  REQUIRE(dataset >= 0);
  std::vector<std::uint8_t> raw(pool_b->bytes.size());
  REQUIRE(H5Dread(dataset, H5T_NATIVE_UINT8, H5S_ALL, H5S_ALL, H5P_DEFAULT, raw.data()) >= 0);
  H5Dclose(dataset);
  H5Fclose(file);
  CHECK(raw == pool_a->bytes);
  REQUIRE(pool_a->row_bytes() == 32);
  // Some slot holds a token: its scales are powers of two >= 2^-9 / 448 and its bytes say so.
  bool found = false;
  for (std::int64_t s = 0; s < pool_a->num_slots && !found; ++s) {
    const float scale = pool_a->group_scale(s, 0);
    if (scale == 0.0f) continue;
    found = true;
    std::uint32_t bits = 0;
    std::memcpy(&bits, raw.data() + s * 32 + 16, 4);
    CHECK(std::bit_cast<float>(bits) == scale);
    int e = 0;
    CHECK(std::frexp(scale, &e) == 0.5f);
  }
  CHECK(found);
}

TEST_CASE("v1.1 reader refuses what the format forbids, naming the object", "[kvdump][v1.1]") {
  struct Case {
    const char* name;
    std::function<void(RawFile&)> mutate;
    std::string object;
    std::string reason;
  };
  const std::vector<Case> cases = {
      {"no format_minor_version",
       [](RawFile& f) { f.delete_attribute("/", "format_minor_version"); }, "/",
       "format_minor_version = 1"},
      {"format_minor_version 3", [](RawFile& f) { f.set_int("/", "format_minor_version", 3); }, "/",
       "format_minor_version 3 is unknown"},
      {"group size not dividing Dc", [](RawFile& f) { f.set_int("/", "kv_scale_group_size", 5); },
       "/", "does not divide kv_lora_rank"},
      {"unknown scale format",
       [](RawFile& f) { f.set_string("/", "kv_scale_format", "fp16", false); }, "/",
       "kv_scale_format \"fp16\" is unknown"},
      {"unknown RoPE dtype",
       [](RawFile& f) { f.set_string("/", "kv_rope_dtype", "float16", false); }, "/",
       "kv_rope_dtype \"float16\" is unknown"},
      {"packed layout with e8m0",
       [](RawFile& f) {
         f.set_string("/", "kv_cache_layout", "flashmla_fp8", false);
         f.set_string("/", "kv_scale_format", "e8m0", false);
       },
       "/", "flashmla_fp8 holds float32 scales"},
      {"kv_scale with a bf16 RoPE part",
       [](RawFile& f) { f.set_double("/layers/L000", "kv_scale", 0.5, H5T_IEEE_F32LE); },
       "/layers/L000", "bfloat16 RoPE part requires kv_scale = 1"},
      {"no kv_scales", [](RawFile& f) { f.delete_link("/layers/L000/kv_scales"); },
       "/layers/L000/kv_scales", ""},
  };
  for (const Case& c : cases) {
    INFO("mutation: " << c.name);
    const auto path = synth_v1_1("broken.h5", PoolLayout::kSplit, 0);
    {
      RawFile file(path);
      c.mutate(file);
    }
    auto reader = DumpReader::open(path);
    REQUIRE_FALSE(reader.ok());
    INFO("error: " << reader.error().message());
    CHECK(reader.error().where == path.string() + ":" + c.object);
    CHECK_THAT(reader.error().what, Catch::Matchers::Contains(c.reason));
  }
}

// The num_pages of a dump that opens.
hsize_t num_pages_of(const std::filesystem::path& path) {
  auto reader = DumpReader::open(path);
  REQUIRE(reader.ok());
  return static_cast<hsize_t>(reader->layout().num_pages);
}

TEST_CASE("v1.1 split-layout dataset names are refused where the pool does not use them",
          "[kvdump][v1.1]") {
  // A packed pool (16 codes, 2 float32 scales, 4 bf16 RoPE values per slot) with a stray
  // kv_scales beside it: the producer and the root attributes disagree about the layout.
  const auto packed = synth_v1_1("packed-stray.h5", PoolLayout::kFlashMlaFp8, 0);
  const hsize_t pages = num_pages_of(packed);
  struct Case {
    const char* name;
    std::string dataset;
    std::vector<hsize_t> dims;
    hid_t type;
    const char* dtype;
    const char* reason;
  };
  const Case cases[] = {
      {"kv_scales beside a packed pool",
       "/layers/L000/kv_scales",
       {pages, 4, 2},
       H5T_IEEE_F32LE,
       nullptr,
       "is a dataset of the v1.1 split layout, but kv_cache_layout is flashmla_fp8"},
      {"kv_rope beside a packed pool",
       "/layers/L000/kv_rope",
       {pages, 4, 4},
       H5T_STD_U16LE,
       "bfloat16",
       "is a dataset of the v1.1 split layout, but kv_cache_layout is flashmla_fp8"},
      {"kv_scales_after in a packed step",
       "/steps/S000/L000/kv_scales_after",
       {pages, 4, 2},
       H5T_IEEE_F32LE,
       nullptr,
       "present without kv_cache_after"},
  };
  for (const Case& c : cases) {
    INFO(c.name);
    const auto path = synth_v1_1("packed-stray.h5", PoolLayout::kFlashMlaFp8, 0);
    {
      RawFile file(path);
      file.replace_zeros(c.dataset, c.dims, c.type, c.dtype);
    }
    auto reader = DumpReader::open(path);
    REQUIRE_FALSE(reader.ok());
    INFO(reader.error().message());
    CHECK(reader.error().where == path.string() + ":" + c.dataset);
    CHECK_THAT(reader.error().what, Catch::Matchers::Contains(c.reason));
    CHECK(reader.error().kind == ErrorKind::kBadInput);
  }
}

TEST_CASE("v1.1 kv_rope_after and kv_scales_after without kv_cache_after are refused",
          "[kvdump][v1.1]") {
  for (const char* name : {"kv_rope_after", "kv_scales_after"}) {
    INFO(name);
    const auto path = synth_v1_1("companions.h5", PoolLayout::kSplit, 0);
    const hsize_t pages = num_pages_of(path);
    const std::string dataset = std::string("/steps/S000/L000/") + name;
    {
      RawFile file(path);
      if (std::string(name) == "kv_rope_after") {
        file.replace_zeros(dataset, {pages, 4, 4}, H5T_STD_U16LE, "bfloat16");
      } else {
        file.replace_zeros(dataset, {pages, 4, 2}, H5T_IEEE_F32LE, nullptr);
      }
    }
    auto reader = DumpReader::open(path);
    REQUIRE_FALSE(reader.ok());
    INFO(reader.error().message());
    CHECK(reader.error().where == path.string() + ":" + dataset);
    CHECK_THAT(reader.error().what, Catch::Matchers::Contains("present without kv_cache_after"));
  }
}

TEST_CASE("v1.1 a float32 group scale that would underflow to 0 is the least float",
          "[kvdump][v1.1]") {
  // amax 2^-145: fp32(2^-145 / 448) rounds to 0 (it is below 2^-150). The scale is 2^-149, the
  // least float, and the codes are x / 2^-149: 16 (0x58) and zeros; never a NaN code (0 / 0).
  const float least = std::ldexp(1.0f, -149);
  CHECK(group_scale_for(std::ldexp(1.0f, -145), GroupScaleFormat::kFloat32) == least);
  std::vector<float> row(20, 0.0f);
  row[0] = std::ldexp(1.0f, -145);
  row[9] = 1.0f;  // group 1 a normal one
  KvPool pool = grouped_pool(GroupScaleFormat::kFloat32, KvDtype::kBfloat16, 1);
  write_grouped_row(pool, 0, row.data(), 1.0f, false);
  CHECK(pool.group_scale(0, 0) == least);
  CHECK(pool.row(0)[0] == 0x58);
  for (int j = 1; j < 16; ++j) CHECK_FALSE(e4m3_is_nan(pool.row(0)[j]));
  CHECK(pool.dequantized(0, 0, 1.0f) == std::ldexp(1.0, -145));
}

// Overwrites entry [row, col] of /steps/S000/L000/topk_indices.
void set_topk_entry(const std::filesystem::path& path, int row, int col, std::int32_t value) {
  RawFile file(path);
  const hid_t dataset = H5Dopen2(file.id(), "/steps/S000/L000/topk_indices", H5P_DEFAULT);
  REQUIRE(dataset >= 0);
  const hid_t space = H5Dget_space(dataset);
  hsize_t dims[2] = {0, 0};
  H5Sget_simple_extent_dims(space, dims, nullptr);
  std::vector<std::int32_t> values(dims[0] * dims[1]);
  REQUIRE(H5Dread(dataset, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()) >= 0);
  values[static_cast<std::size_t>(row) * dims[1] + col] = value;
  REQUIRE(H5Dwrite(dataset, H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()) >= 0);
  H5Sclose(space);
  H5Dclose(dataset);
}

TEST_CASE("v1.1 topk_indices: causal, distinct, at least one per row, checked when read",
          "[kvdump][v1.1]") {
  // Row 0 of S000 is request 0's first prefill row, at position 9 (9 cached tokens before it).
  struct Case {
    const char* name;
    std::int32_t first;   // entry [0, 0]
    std::int32_t second;  // entry [0, 1]
    const char* reason;
  };
  const Case cases[] = {
      {"a later position", 10, -1, "sees positions 0..9"},
      {"below -1", -2, -1, "neither -1 nor a token position"},
      {"twice", 3, 3, "lists token position 3 twice"},
  };
  for (const Case& c : cases) {
    INFO(c.name);
    const auto path = synth_v1_1("topk.h5", PoolLayout::kSplit, 4);
    set_topk_entry(path, 0, 0, c.first);
    set_topk_entry(path, 0, 1, c.second);
    auto reader = DumpReader::open(path);
    REQUIRE(reader.ok());  // values are read with the step's tensors
    auto tensors = reader->read_step_layer(0, 0);
    REQUIRE_FALSE(tensors.ok());
    INFO(tensors.error().message());
    CHECK(tensors.error().where == path.string() + ":/steps/S000/L000/topk_indices");
    CHECK_THAT(tensors.error().what, Catch::Matchers::Contains(c.reason));
    CHECK(tensors.error().kind == ErrorKind::kBadInput);
  }
  const auto path = synth_v1_1("topk_empty.h5", PoolLayout::kSplit, 4);
  for (int j = 0; j < 4; ++j) set_topk_entry(path, 0, j, -1);
  auto reader = DumpReader::open(path);
  REQUIRE(reader.ok());
  auto tensors = reader->read_step_layer(0, 0);
  REQUIRE_FALSE(tensors.ok());
  CHECK_THAT(tensors.error().what, Catch::Matchers::Contains("row 0 lists no token position"));
}

TEST_CASE("a sparse row attends to exactly its listed tokens, in position order",
          "[kvdump][v1.1]") {
  // One request of 6 tokens, page size 2 (pages 3, 0, 1), two prefill rows at positions 4, 5.
  DumpAttributes attrs;
  attrs.page_size = 2;
  StepMeta step;
  step.group = "S000";
  step.qo_indptr = {0, 2};
  step.kv_indptr = {0, 3};
  step.kv_indices = {3, 0, 1};
  step.kv_last_page_len = {2};
  step.new_kv_slots = {2, 3};
  StepLayerTensors tensors;
  tensors.topk = 3;
  tensors.topk_indices = {4,  -1, 1,   // row 0: positions 1 and 4
                          -1, 5,  0};  // row 1: positions 0 and 5
  REQUIRE(check_topk_indices(step, 2, tensors.topk_indices, 3, "t").ok());
  const AttentionView view = attention_view(attrs, step, tensors);
  CHECK(view.attrs.page_size == 1);
  CHECK(view.step.attention_only);
  CHECK(view.step.kind == StepKind::kDecode);
  CHECK(view.step.qo_indptr == std::vector<std::int32_t>{0, 1, 2});
  CHECK(view.step.kv_indptr == std::vector<std::int32_t>{0, 2, 4});
  // position 1 -> page 3 offset 1 = slot 7; position 4 -> page 1 offset 0 = slot 2;
  // position 0 -> slot 6; position 5 -> slot 3.
  CHECK(view.step.kv_indices == std::vector<std::int32_t>{7, 2, 6, 3});
  CHECK(check_step_indices(view.step, 1, 8).ok());
}

// The exact attention of one (row, head) at 100 digits from exact KV values (naive formulas).
void exact_attention_100(const std::vector<std::vector<double>>& keys, const float* q_nope,
                         const float* q_pe, int dc, int dr, double sm_scale,
                         std::vector<double>& out, double& lse) {
  using Boost100 = boost::multiprecision::cpp_bin_float_100;
  std::vector<Boost100> s(keys.size());
  for (std::size_t t = 0; t < keys.size(); ++t) {
    Boost100 dot = 0;
    for (int j = 0; j < dc; ++j) dot += Boost100(q_nope[j]) * Boost100(keys[t][j]);
    for (int j = 0; j < dr; ++j) dot += Boost100(q_pe[j]) * Boost100(keys[t][dc + j]);
    s[t] = Boost100(sm_scale) * dot;
  }
  Boost100 m = s[0];
  for (const auto& v : s) m = v > m ? v : m;
  Boost100 l = 0;
  std::vector<Boost100> acc(static_cast<std::size_t>(dc), Boost100(0));
  for (std::size_t t = 0; t < keys.size(); ++t) {
    const Boost100 e = exp(s[t] - m);
    l += e;
    for (int d = 0; d < dc; ++d) acc[d] += e * Boost100(keys[t][d]);
  }
  out.resize(static_cast<std::size_t>(dc));
  for (int d = 0; d < dc; ++d) out[d] = static_cast<double>(acc[d] / l);
  lse = static_cast<double>(m + log(l));
}

TEST_CASE("the exact reference on a float32-group-scaled pool: values of 28 bits, to 1e-15",
          "[kvdump][v1.1][reference]") {
  testing::MlaCaseSpec spec;
  spec.nan_unused = false;
  spec.dc = 16;
  spec.dr = 4;
  spec.requests = {{9, 3}, {5, 1}};
  testing::MlaCase c = testing::make_mla_case(spec);
  c.attrs.kv_scale_kind = "per_token_group";
  c.attrs.kv_scale_group_size = 8;
  c.attrs.kv_scale_format = GroupScaleFormat::kFloat32;
  c.attrs.kv_rope_dtype = KvDtype::kFloat8E4m3fn;
  c.attrs.format_minor_version = 1;
  KvPool pool = KvPool::zeros_for(c.attrs, c.pool.num_slots);
  std::mt19937 rng(11);
  std::vector<float> row(20);
  for (std::int64_t s = 0; s < pool.num_slots; ++s) {
    for (auto& v : row) v = testing::random_bf16(rng, 3.0f);
    write_grouped_row(pool, s, row.data(), 0.0371f, false);
  }
  const KvRows rows = KvRows::from_pool(pool, 0.0371f);
  CHECK(rows.has_residual());  // fp32 scales: some code * scale is not a float
  const std::size_t pairs = static_cast<std::size_t>(c.step.num_rows()) * spec.heads;
  std::vector<double> out(pairs * spec.dc);
  std::vector<double> lse(pairs);
  REQUIRE(
      mla_reference_attention(c.attrs, c.step, c.tensors.q_nope, c.tensors.q_pe, rows, out, lse, 2)
          .ok());
  for (int i = 0; i < c.step.num_rows(); ++i) {
    const int b = c.step.request_of_row(i);
    std::vector<std::vector<double>> keys;
    for (std::int64_t p = 0; p <= c.step.position_of_row(i, 1); ++p) {
      std::vector<double> key(20);
      const std::int64_t slot = c.step.slot_of(b, p, 1);
      for (int j = 0; j < 20; ++j) key[j] = pool.dequantized(slot, j, 0.0371f);
      keys.push_back(key);
    }
    for (int h = 0; h < spec.heads; ++h) {
      const std::size_t pair = static_cast<std::size_t>(i) * spec.heads + h;
      std::vector<double> want;
      double want_lse = 0;
      exact_attention_100(keys, c.tensors.q_nope.data() + pair * spec.dc,
                          c.tensors.q_pe.data() + pair * spec.dr, spec.dc, spec.dr, spec.sm_scale,
                          want, want_lse);
      for (int d = 0; d < spec.dc; ++d) {
        CHECK(std::abs(out[pair * spec.dc + d] - want[d]) <= 1e-15 * std::abs(want[d]) + 1e-300);
      }
      CHECK(std::abs(lse[pair] - want_lse) <= 1e-15);
    }
  }
}

}  // namespace
}  // namespace kvaudit

namespace kvaudit {
namespace {

// Runs `kvaudit ARGS`, returning the exit status and stdout + stderr.
std::pair<int, std::string> run_kvaudit(const std::string& args) {
  const auto log = kvdump_test_dir() / "out.log";
  const int status = std::system(
      (std::string(KVAUDIT_BINARY) + " " + args + " > " + log.string() + " 2>&1").c_str());
  std::ifstream in(log);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, text};
}

TEST_CASE("kvaudit info describes a v1.1 dump: version, scale form, sparse layers",
          "[kvdump][v1.1][cli]") {
  const std::string dump = std::string(KVAUDIT_SOURCE_DIR) + "/datasets/glm5_dsa_flashmla.h5";
  const auto [status, text] = run_kvaudit("info " + dump);
  INFO(text);
  CHECK(status == 0);
  CHECK_THAT(text, Catch::Matchers::Contains("format    kvdump v1.1"));
  CHECK_THAT(text, Catch::Matchers::Contains(
                       "per_token_group: 4 groups of 128 latent channels, power_of_two scales, "
                       "RoPE bfloat16, layout flashmla_fp8"));
  CHECK_THAT(text, Catch::Matchers::Contains("sparse: L000 top-64, L001 top-64"));
  const auto [json_status, json] = run_kvaudit("info --json " + dump);
  REQUIRE(json_status == 0);
  const auto info = nlohmann::json::parse(json);
  CHECK(info.at("format_minor_version") == 1);
  CHECK(info.at("group_scales").at("layout") == "flashmla_fp8");
  CHECK(info.at("steps").at(0).at("topk").at("L001") == 64);
}

TEST_CASE("kvaudit info refuses a dump whose topk_indices break the sparse rules",
          "[kvdump][v1.1][cli]") {
  // Row 0 of S000 sits at position 9: position 10 is in its future.
  const auto path = synth_v1_1("info-topk.h5", PoolLayout::kSplit, 4);
  REQUIRE(run_kvaudit("info " + path.string()).first == 0);
  set_topk_entry(path, 0, 0, 10);
  const auto [status, text] = run_kvaudit("info " + path.string());
  INFO(text);
  CHECK(status == 2);
  CHECK_THAT(text, Catch::Matchers::Contains("kvaudit: " + path.string() +
                                             ":/steps/S000/L000/topk_indices: "));
  CHECK_THAT(text, Catch::Matchers::Contains("sees positions 0..9"));
}

TEST_CASE("kvaudit check of the v1.1 dumps passes with none and cpu-fp8, with the limits it says",
          "[kvdump][v1.1][cli]") {
  for (const char* name : {"glm5_dsa_flashmla.h5", "glm5_pertoken_fp8rope.h5"}) {
    const std::string dump = std::string(KVAUDIT_SOURCE_DIR) + "/datasets/" + name;
    for (const char* backend : {"none", "cpu-fp8"}) {
      const auto [status, text] =
          run_kvaudit("check " + dump + " --backend " + std::string(backend) + " --threads 2");
      INFO(name << " " << backend << "\n" << text);
      CHECK(status == 0);
      CHECK_THAT(text, Catch::Matchers::Contains("verdict: PASS"));
    }
  }
  // float32 group scales: the policy's kernel limits are the captured ones, and say why.
  const auto [status, text] =
      run_kvaudit("check " + std::string(KVAUDIT_SOURCE_DIR) +
                  "/datasets/glm5_pertoken_fp8rope.h5 --backend cpu-fp8 --threads 2");
  CHECK_THAT(text, Catch::Matchers::Contains("kernel       max_abs_over_ref_max <= 0.0625, rel_l2 "
                                             "<= 0.0312"));
}

TEST_CASE("emit-repro on a v1.1 dump keeps its form and its sparse rows, and still fails",
          "[kvdump][v1.1][cli]") {
  const auto repro = kvdump_test_dir() / "repro.h5";
  std::filesystem::remove(repro);
  const std::string dump = std::string(KVAUDIT_SOURCE_DIR) + "/datasets/glm5_dsa_flashmla.h5";
  const auto [status, text] = run_kvaudit("check " + dump +
                                          " --backend cpu-fp8 --threads 2 --inject "
                                          "scale-read-as-e8m0 --emit-repro " +
                                          repro.string());
  INFO(text);
  CHECK(status == 1);
  REQUIRE(std::filesystem::exists(repro));
  const auto [info_status, info] = run_kvaudit("info " + repro.string());
  CHECK_THAT(info, Catch::Matchers::Contains("layout flashmla_fp8"));
  CHECK_THAT(info, Catch::Matchers::Contains("sparse: L000 top-64"));
  CHECK(run_kvaudit("check " + repro.string() + " --backend cpu-fp8 --inject scale-read-as-e8m0")
            .first == 1);
  CHECK(run_kvaudit("check " + repro.string() + " --backend cpu-fp8").first == 0);
}

}  // namespace
}  // namespace kvaudit
