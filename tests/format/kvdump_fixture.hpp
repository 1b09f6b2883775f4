// A small valid kvdump for the reader, writer, info and fuzz tests, and raw HDF5 C calls that
// break it one rule at a time.
//
// The dump (page_size 2, 8 pages = 16 slots, H = 2, Dc = 8, Dr = 4, D = 12):
//   layers L000 (layer_id 0, kv_scale 0.5, kv_source) and L003 (layer_id 3, kv_scale 1)
//   S000 prefill, 3 requests:
//     r0 pages [1, 4], 3 tokens (last page 1), 3 rows at positions 0,1,2 -> slots 2, 3, 8
//     r1 page  [2],    2 tokens (last page 2), 2 rows at positions 0,1   -> slots 4, 5
//     r2 no page, no rows
//     captures: out and lse in both layers
//   S001 decode, 3 requests:
//     r0 pages [1, 4], 4 tokens (last page 2), 1 row at position 3 -> slot 9
//     r1 pages [2, 5], 3 tokens (last page 1), 1 row at position 2 -> slot 10
//     r2 no page, no rows
//     captures: kv_cache_after in L000
// Tensor values are multiples of 1/8 in [-1, 1], exact in bf16, so they round-trip bitwise.
#pragma once

#include <hdf5.h>
#include <sys/wait.h>

#include <catch2/catch.hpp>
#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "kvaudit_test_config.hpp"  // KVAUDIT_BINARY, KVAUDIT_SOURCE_DIR, KVAUDIT_TEST_TMPDIR
#include "src/format/kvdump.hpp"

namespace kvaudit::testing {

// A directory of its own for the running test case (named after it), so that CTest may run cases
// in parallel processes without two of them writing the same file.
inline std::filesystem::path kvdump_test_dir() {
#ifdef KVAUDIT_TEST_TMPDIR
  std::filesystem::path dir = std::filesystem::path(KVAUDIT_TEST_TMPDIR) / "kvdump";
#else
  std::filesystem::path dir = std::filesystem::temp_directory_path() / "kvaudit-kvdump";
#endif
  std::string name = Catch::getResultCapture().getCurrentTestName();
  for (char& c : name) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '-';
  }
  dir /= name.substr(0, 80);
  std::filesystem::create_directories(dir);
  return dir;
}

struct SmallDump {
  DumpAttributes attrs;
  std::int64_t num_pages = 8;
  std::vector<LayerMeta> layers;
  std::vector<KvPool> pools;
  std::vector<std::vector<float>> sources;  // empty: no kv_source
  std::vector<StepMeta> steps;
  std::vector<std::vector<StepLayerTensors>> tensors;  // [step][layer]
};

// Multiples of 1/8 in [-1, 1]: exact in bf16 and e4m3.
inline std::vector<float> pattern(std::size_t n, int seed) {
  std::vector<float> values(n);
  for (std::size_t i = 0; i < n; ++i) {
    values[i] = static_cast<float>(static_cast<int>((i * 7 + seed * 13) % 17) - 8) / 8.0f;
  }
  return values;
}

inline SmallDump make_small_dump(KvDtype kv_dtype = KvDtype::kFloat8E4m3fn) {
  SmallDump d;
  d.attrs.model = "test-model";
  d.attrs.producer = "kvaudit tests";
  d.attrs.num_heads = 2;
  d.attrs.kv_lora_rank = 8;
  d.attrs.qk_rope_head_dim = 4;
  d.attrs.sm_scale = 0.25;
  d.attrs.page_size = 2;
  d.attrs.kv_dtype = kv_dtype;
  const bool fp8 = kv_dtype == KvDtype::kFloat8E4m3fn;
  const int width = d.attrs.row_width();
  const std::int64_t slots = d.num_pages * d.attrs.page_size;
  d.layers = {{"L000", 0, fp8 ? 0.5f : 1.0f, true}, {"L003", 3, 1.0f, false}};
  for (std::size_t l = 0; l < d.layers.size(); ++l) {
    KvPool pool = KvPool::zeros(kv_dtype, slots, width);
    const std::vector<float> values = pattern(static_cast<std::size_t>(slots) * width, 3 + l);
    for (std::int64_t s = 0; s < slots; ++s)
      pool.write_row(s, &values[s * width], d.layers[l].kv_scale);
    d.pools.push_back(pool);
    d.sources.push_back(d.layers[l].has_source ? values : std::vector<float>{});
  }
  StepMeta prefill;
  prefill.group = "S000";
  prefill.kind = StepKind::kPrefill;
  prefill.qo_indptr = {0, 3, 5, 5};
  prefill.kv_indptr = {0, 2, 3, 3};
  prefill.kv_indices = {1, 4, 2};
  prefill.kv_last_page_len = {1, 2, 0};
  prefill.new_kv_slots = {2, 3, 8, 4, 5};
  StepMeta decode;
  decode.group = "S001";
  decode.kind = StepKind::kDecode;
  decode.qo_indptr = {0, 1, 2, 2};
  decode.kv_indptr = {0, 2, 4, 4};
  decode.kv_indices = {1, 4, 2, 5};
  decode.kv_last_page_len = {2, 1, 0};
  decode.new_kv_slots = {9, 10};
  d.steps = {prefill, decode};
  const std::size_t heads = 2, dc = 8, dr = 4;
  for (std::size_t s = 0; s < d.steps.size(); ++s) {
    StepMeta& step = d.steps[s];
    const std::size_t nq = static_cast<std::size_t>(step.num_rows());
    step.has_out.assign(2, s == 0);
    step.has_lse.assign(2, s == 0);
    step.has_kv_cache_after = {s == 1, false};
    std::vector<StepLayerTensors> per_layer;
    for (std::size_t l = 0; l < d.layers.size(); ++l) {
      const int seed = static_cast<int>(10 * s + l);
      StepLayerTensors t;
      t.q_nope = pattern(nq * heads * dc, seed);
      t.q_pe = pattern(nq * heads * dr, seed + 1);
      t.new_kv = pattern(nq * (dc + dr), seed + 2);
      if (step.has_out[l]) t.out = pattern(nq * heads * dc, seed + 3);
      if (step.has_lse[l]) t.lse = pattern(nq * heads, seed + 4);
      if (step.has_kv_cache_after[l]) {
        KvPool after = d.pools[l];
        for (std::size_t i = 0; i < nq; ++i) {
          after.write_row(step.new_kv_slots[i], &t.new_kv[i * (dc + dr)], d.layers[l].kv_scale);
        }
        t.kv_cache_after = after;
      }
      per_layer.push_back(std::move(t));
    }
    d.tensors.push_back(std::move(per_layer));
  }
  return d;
}

inline Status write_small_dump(const SmallDump& d, const std::filesystem::path& path) {
  auto writer = DumpWriter::create(path, d.attrs, d.num_pages);
  if (!writer.ok()) return writer.error();
  for (std::size_t l = 0; l < d.layers.size(); ++l) {
    KVAUDIT_TRY(writer->write_layer(d.layers[l], d.pools[l],
                                    d.sources[l].empty() ? nullptr : &d.sources[l]));
  }
  for (std::size_t s = 0; s < d.steps.size(); ++s) {
    KVAUDIT_TRY(writer->write_step(d.steps[s]));
    for (std::size_t l = 0; l < d.layers.size(); ++l) {
      KVAUDIT_TRY(writer->write_step_layer(d.steps[s], d.layers[l], d.tensors[s][l]));
    }
  }
  return writer->close();
}

// A freshly written valid small dump at kvdump_test_dir()/name.
inline std::filesystem::path fresh_dump(const std::string& name,
                                        KvDtype kv_dtype = KvDtype::kFloat8E4m3fn) {
  const std::filesystem::path path = kvdump_test_dir() / name;
  const Status status = write_small_dump(make_small_dump(kv_dtype), path);
  INFO((status.ok() ? std::string() : status.error().message()));
  REQUIRE(status.ok());
  return path;
}

// ---- raw HDF5 edits --------------------------------------------------------------------------

// A file opened read-write for one edit; every call REQUIREs success.
class RawFile {
 public:
  explicit RawFile(const std::filesystem::path& path) {
    id_ = H5Fopen(path.string().c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    REQUIRE(id_ >= 0);
  }
  RawFile(const RawFile&) = delete;
  RawFile& operator=(const RawFile&) = delete;
  ~RawFile() { H5Fclose(id_); }
  hid_t id() const { return id_; }

  void delete_attribute(const std::string& object, const std::string& name) {
    REQUIRE(H5Adelete_by_name(id_, object.c_str(), name.c_str(), H5P_DEFAULT) >= 0);
  }
  void delete_link(const std::string& path) {
    REQUIRE(H5Ldelete(id_, path.c_str(), H5P_DEFAULT) >= 0);
  }
  void move_link(const std::string& from, const std::string& to) {
    REQUIRE(H5Lmove(id_, from.c_str(), id_, to.c_str(), H5P_DEFAULT, H5P_DEFAULT) >= 0);
  }
  void create_group(const std::string& path) {
    const hid_t g = H5Gcreate2(id_, path.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    REQUIRE(g >= 0);
    H5Gclose(g);
  }

  // Replaces (or adds) a scalar attribute of the given file type from a value in memory_type.
  void set_attribute(const std::string& object, const std::string& name, hid_t file_type,
                     hid_t memory_type, const void* value) {
    if (H5Aexists_by_name(id_, object.c_str(), name.c_str(), H5P_DEFAULT) > 0) {
      delete_attribute(object, name);
    }
    const hid_t space = H5Screate(H5S_SCALAR);
    const hid_t attr = H5Acreate_by_name(id_, object.c_str(), name.c_str(), file_type, space,
                                         H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    REQUIRE(attr >= 0);
    REQUIRE(H5Awrite(attr, memory_type, value) >= 0);
    H5Aclose(attr);
    H5Sclose(space);
  }
  void set_int(const std::string& object, const std::string& name, std::int64_t value,
               hid_t file_type = H5T_STD_I64LE) {
    set_attribute(object, name, file_type, H5T_NATIVE_INT64, &value);
  }
  void set_double(const std::string& object, const std::string& name, double value,
                  hid_t file_type = H5T_IEEE_F64LE) {
    set_attribute(object, name, file_type, H5T_NATIVE_DOUBLE, &value);
  }
  // Variable-length UTF-8, or fixed-length with the given padding.
  void set_string(const std::string& object, const std::string& name, const std::string& value,
                  bool fixed = false, H5T_str_t pad = H5T_STR_NULLPAD) {
    const hid_t type = H5Tcopy(H5T_C_S1);
    if (fixed) {
      std::string padded = value;
      if (pad == H5T_STR_SPACEPAD) padded += "   ";
      H5Tset_size(type, padded.empty() ? 1 : padded.size());
      H5Tset_strpad(type, pad);
      std::vector<char> buffer(padded.empty() ? 1 : padded.size(), '\0');
      std::copy(padded.begin(), padded.end(), buffer.begin());
      set_attribute(object, name, type, type, buffer.data());
    } else {
      H5Tset_size(type, H5T_VARIABLE);
      H5Tset_cset(type, H5T_CSET_UTF8);
      const char* text = value.c_str();
      set_attribute(object, name, type, type, &text);
    }
    H5Tclose(type);
  }

  // Replaces the dataset at `path` with one of the given shape and type (data may be null: the
  // dataset then holds its fill value), and a dtype attribute when `dtype` is not null.
  void replace_dataset(const std::string& path, const std::vector<hsize_t>& dims, hid_t file_type,
                       hid_t memory_type, const void* data, const char* dtype) {
    if (H5Lexists(id_, path.c_str(), H5P_DEFAULT) > 0) delete_link(path);
    const hid_t space = H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr);
    const hid_t dataset =
        H5Dcreate2(id_, path.c_str(), file_type, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
    REQUIRE(dataset >= 0);
    if (data != nullptr) {
      REQUIRE(H5Dwrite(dataset, memory_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data) >= 0);
    }
    H5Dclose(dataset);
    H5Sclose(space);
    if (dtype != nullptr) set_string(path, "dtype", dtype);
  }
  void replace_index(const std::string& path, const std::vector<std::int32_t>& values) {
    replace_dataset(path, {values.size()}, H5T_STD_I32LE, H5T_NATIVE_INT32, values.data(), nullptr);
  }
  // A zero-filled dataset of the given shape, type and dtype attribute.
  void replace_zeros(const std::string& path, const std::vector<hsize_t>& dims, hid_t file_type,
                     const char* dtype) {
    std::size_t n = 1;
    for (hsize_t d : dims) n *= d;
    std::vector<double> zeros(n, 0.0);
    replace_dataset(path, dims, file_type, H5T_NATIVE_DOUBLE, n > 0 ? zeros.data() : nullptr,
                    dtype);
  }

 private:
  hid_t id_ = -1;
};

// Runs a shell command; returns its exit status, or -1 when it did not exit normally (signal).
inline int run_command(const std::string& command) {
  const int status = std::system(command.c_str());
  if (status == -1 || !WIFEXITED(status)) return -1;
  return WEXITSTATUS(status);
}

inline std::string read_text(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

}  // namespace kvaudit::testing
