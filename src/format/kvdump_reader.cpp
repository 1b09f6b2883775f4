// kvdump v1 reader (docs/kvdump-v1.md): validates the whole layout when a file is opened,
// then reads the bulk tensors one layer (pool, source) or one (step, layer) at a time.
//
// Shapes (H = num_heads, Dc = kv_lora_rank, Dr = qk_rope_head_dim, D = Dc + Dr, Nq = rows):
//   /layers/L###/kv_cache, kv_source, /steps/S###/L###/kv_cache_after : [num_pages, page_size, D]
//   /steps/S###/L###/q_nope, out : [Nq, H, Dc]   q_pe : [Nq, H, Dr]   new_kv : [Nq, D]
//   /steps/S###/L###/lse : [Nq, H]
//   /steps/S###/qo_indptr, kv_indptr : [B+1]  kv_last_page_len : [B]  kv_indices : [nnz_pages]
//   /steps/S###/new_kv_slots : [Nq]
//
// Element types: bfloat16 tensors are u16 + dtype="bfloat16" or float32 (kept exactly as stored;
// a float32 value is not rounded to bf16, since the write rule quantizes fp32(value)); the fp8
// pool is u8 + dtype="float8_e4m3fn"; index datasets are any HDF5 integer type whose values fit
// in int32. Open reads only attributes, dataspaces and the small index datasets.
//
// HDF5 here is the serial (not thread-safe) build: use one DumpReader from one thread at a time.
// Damaged files: HDF5's metadata checksums (v2 superblock and object headers, as kvaudit's writer
// produces) and its end-of-file check make it refuse most damage with an error. One structure has
// no checksum in any HDF5 file format: the global heap holding variable-length strings (h5py's
// default for str attributes). HDF5 1.10 does not bounds-check it (H5HG_read), so a damaged
// global heap can crash or stall the process inside the library; no API reads such a string
// without going through it. kvaudit's own files use fixed-length strings and have no global heap.
#include <hdf5.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <new>
#include <optional>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "src/core/hdf5_handles.hpp"
#include "src/format/kvdump.hpp"
#include "src/format/step_indices.hpp"

namespace kvaudit {
namespace {

constexpr const char* kDtypeBf16 = "bfloat16";
constexpr const char* kDtypeFp8 = "float8_e4m3fn";
constexpr const char* kDtypeF32 = "float32";

// Upper bounds on the root integers. They are far above any real MLA model (Dc = 512, Dr = 64,
// H <= 128) and keep every product of shapes below in int64.
constexpr std::int64_t kMaxDim = 1 << 20;
// An index dataset longer than this (1 GiB of int32) is refused rather than read at open.
constexpr hsize_t kMaxIndexLength = hsize_t{1} << 28;

std::string join_path(const std::string& parent, const std::string& name) {
  return parent == "/" ? "/" + name : parent + "/" + name;
}

using h5::shape_text;
using h5::with_hdf5_reason;

// What an element type is, for the format's purposes.
enum class ElementClass { kU8, kU16, kFloat32, kOtherInteger, kOther };

struct DatasetDesc {
  ElementClass element = ElementClass::kOther;
  std::string type_text;  // "u8", "int64", "float64", "string", ...
  std::vector<hsize_t> dims;
  std::optional<std::string> dtype;  // the `dtype` attribute
  std::string path;
};

std::string type_text_of(hid_t type) {
  const H5T_class_t cls = H5Tget_class(type);
  const std::size_t size = H5Tget_size(type);
  switch (cls) {
    case H5T_INTEGER: {
      const bool is_signed = H5Tget_sign(type) == H5T_SGN_2;
      return (is_signed ? "int" : "u") + std::to_string(8 * size);
    }
    case H5T_FLOAT:
      return "float" + std::to_string(8 * size);
    case H5T_STRING:
      return "string";
    case H5T_COMPOUND:
      return "compound";
    case H5T_ENUM:
      return "enum";
    case H5T_ARRAY:
      return "array";
    default:
      return "HDF5 class " + std::to_string(static_cast<int>(cls));
  }
}

// Reads and validates against the format; every error names `file:path`.
class Validator {
 public:
  explicit Validator(std::string file) : file_(std::move(file)) {}

  Error bad(const std::string& path, std::string what) const {
    return bad_input(file_ + ":" + path, std::move(what));
  }
  Error unsupported_at(const std::string& path, std::string what) const {
    return unsupported(file_ + ":" + path, std::move(what));
  }

  // ---- attributes ------------------------------------------------------------------------------

  Result<h5::Attribute> open_attribute(hid_t object, const std::string& path,
                                       const std::string& name) const {
    const htri_t exists = H5Aexists(object, name.c_str());
    if (exists < 0) return bad(path, with_hdf5_reason("cannot look up attribute " + name));
    if (exists == 0) return bad(path, "missing attribute " + name);
    h5::Attribute attribute(H5Aopen(object, name.c_str(), H5P_DEFAULT));
    if (!attribute) return bad(path, with_hdf5_reason("cannot open attribute " + name));
    h5::Dataspace space(H5Aget_space(attribute.get()));
    if (!space) return bad(path, with_hdf5_reason("cannot read attribute " + name));
    const hssize_t points = H5Sget_simple_extent_npoints(space.get());
    if (points != 1) {
      return bad(
          path, "attribute " + name + " holds " + std::to_string(points) + " values; expected one");
    }
    return attribute;
  }

  Result<std::string> read_string(hid_t object, const std::string& path,
                                  const std::string& name) const {
    auto attribute = open_attribute(object, path, name);
    if (!attribute.ok()) return attribute.error();
    h5::Type type(H5Aget_type(attribute->get()));
    if (!type) return bad(path, with_hdf5_reason("cannot read the type of attribute " + name));
    if (H5Tget_class(type.get()) != H5T_STRING) {
      return bad(path,
                 "attribute " + name + " is " + type_text_of(type.get()) + "; expected a string");
    }
    const htri_t variable = H5Tis_variable_str(type.get());
    if (variable < 0) return bad(path, with_hdf5_reason("cannot read attribute " + name));
    if (variable > 0) {
      h5::Type memory(H5Tcopy(H5T_C_S1));
      if (!memory || H5Tset_size(memory.get(), H5T_VARIABLE) < 0 ||
          H5Tset_cset(memory.get(), H5Tget_cset(type.get())) < 0) {
        return bad(path, with_hdf5_reason("cannot read attribute " + name));
      }
      char* text = nullptr;
      if (H5Aread(attribute->get(), memory.get(), &text) < 0) {
        return bad(path, with_hdf5_reason("cannot read attribute " + name));
      }
      std::string value = text != nullptr ? std::string(text) : std::string();
      if (text != nullptr) H5free_memory(text);
      return value;
    }
    const std::size_t size = H5Tget_size(type.get());
    if (size == 0 || size > (std::size_t{1} << 20)) {
      return bad(path,
                 "attribute " + name + " has an implausible string size " + std::to_string(size));
    }
    std::string buffer(size, '\0');
    if (H5Aread(attribute->get(), type.get(), buffer.data()) < 0) {
      return bad(path, with_hdf5_reason("cannot read attribute " + name));
    }
    // Fixed-length strings are NUL-terminated, NUL-padded or space-padded.
    buffer.resize(std::strlen(buffer.c_str()));
    if (H5Tget_strpad(type.get()) == H5T_STR_SPACEPAD) {
      while (!buffer.empty() && buffer.back() == ' ') buffer.pop_back();
    }
    return buffer;
  }

  Result<std::int64_t> read_int(hid_t object, const std::string& path,
                                const std::string& name) const {
    auto attribute = open_attribute(object, path, name);
    if (!attribute.ok()) return attribute.error();
    h5::Type type(H5Aget_type(attribute->get()));
    if (!type) return bad(path, with_hdf5_reason("cannot read the type of attribute " + name));
    if (H5Tget_class(type.get()) != H5T_INTEGER) {
      return bad(path,
                 "attribute " + name + " is " + type_text_of(type.get()) + "; expected an integer");
    }
    if (H5Tget_sign(type.get()) == H5T_SGN_NONE && H5Tget_size(type.get()) >= 8) {
      std::uint64_t value = 0;
      if (H5Aread(attribute->get(), H5T_NATIVE_UINT64, &value) < 0) {
        return bad(path, with_hdf5_reason("cannot read attribute " + name));
      }
      if (value > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
        return bad(path, "attribute " + name + " = " + std::to_string(value) + " is too large");
      }
      return static_cast<std::int64_t>(value);
    }
    std::int64_t value = 0;
    if (H5Aread(attribute->get(), H5T_NATIVE_INT64, &value) < 0) {
      return bad(path, with_hdf5_reason("cannot read attribute " + name));
    }
    return value;
  }

  Result<double> read_float(hid_t object, const std::string& path, const std::string& name) const {
    auto attribute = open_attribute(object, path, name);
    if (!attribute.ok()) return attribute.error();
    h5::Type type(H5Aget_type(attribute->get()));
    if (!type) return bad(path, with_hdf5_reason("cannot read the type of attribute " + name));
    if (H5Tget_class(type.get()) != H5T_FLOAT) {
      return bad(path, "attribute " + name + " is " + type_text_of(type.get()) +
                           "; expected a floating-point number");
    }
    double value = 0.0;
    if (H5Aread(attribute->get(), H5T_NATIVE_DOUBLE, &value) < 0) {
      return bad(path, with_hdf5_reason("cannot read attribute " + name));
    }
    return value;
  }

  // An int attribute that must lie in [lo, hi].
  Result<int> read_int_in(hid_t object, const std::string& path, const std::string& name,
                          std::int64_t lo, std::int64_t hi) const {
    auto value = read_int(object, path, name);
    if (!value.ok()) return value.error();
    if (*value < lo || *value > hi) {
      return bad(path, "attribute " + name + " = " + std::to_string(*value) + " is outside " +
                           std::to_string(lo) + ".." + std::to_string(hi));
    }
    return static_cast<int>(*value);
  }

  // ---- datasets --------------------------------------------------------------------------------

  // Existence of a link (dataset or group) under `group`.
  Result<bool> has_link(hid_t group, const std::string& path, const std::string& name) const {
    const htri_t exists = H5Lexists(group, name.c_str(), H5P_DEFAULT);
    if (exists < 0) return bad(path, with_hdf5_reason("cannot look up " + name));
    return exists > 0;
  }

  Result<DatasetDesc> describe(hid_t group, const std::string& group_path,
                               const std::string& name) const {
    DatasetDesc desc;
    desc.path = join_path(group_path, name);
    auto exists = has_link(group, group_path, name);
    if (!exists.ok()) return exists.error();
    if (!*exists) return bad(desc.path, "missing dataset");
    h5::Object object(H5Oopen(group, name.c_str(), H5P_DEFAULT));
    if (!object) return bad(desc.path, with_hdf5_reason("cannot open"));
    if (H5Iget_type(object.get()) != H5I_DATASET) return bad(desc.path, "is not a dataset");
    const hid_t dataset = object.get();
    h5::Type type(H5Dget_type(dataset));
    if (!type) return bad(desc.path, with_hdf5_reason("cannot read the element type"));
    desc.type_text = type_text_of(type.get());
    const H5T_class_t cls = H5Tget_class(type.get());
    const std::size_t size = H5Tget_size(type.get());
    if (cls == H5T_INTEGER) {
      const bool is_signed = H5Tget_sign(type.get()) == H5T_SGN_2;
      if (!is_signed && size == 1) {
        desc.element = ElementClass::kU8;
      } else if (!is_signed && size == 2) {
        desc.element = ElementClass::kU16;
      } else {
        desc.element = ElementClass::kOtherInteger;
      }
    } else if (cls == H5T_FLOAT && size == 4) {
      desc.element = ElementClass::kFloat32;
    }
    h5::Dataspace space(H5Dget_space(dataset));
    if (!space) return bad(desc.path, with_hdf5_reason("cannot read the dataspace"));
    const int rank = H5Sget_simple_extent_ndims(space.get());
    if (rank < 0) return bad(desc.path, with_hdf5_reason("cannot read the dataspace"));
    desc.dims.assign(static_cast<std::size_t>(rank), 0);
    if (rank > 0 && H5Sget_simple_extent_dims(space.get(), desc.dims.data(), nullptr) < 0) {
      return bad(desc.path, with_hdf5_reason("cannot read the dataspace"));
    }
    if (H5Sget_simple_extent_type(space.get()) != H5S_SIMPLE) {
      return bad(desc.path, "has a scalar or null dataspace; expected an array");
    }
    const htri_t has_dtype = H5Aexists(dataset, "dtype");
    if (has_dtype < 0) return bad(desc.path, with_hdf5_reason("cannot look up attribute dtype"));
    if (has_dtype > 0) {
      auto dtype = read_string(dataset, desc.path, "dtype");
      if (!dtype.ok()) return dtype.error();
      desc.dtype = *dtype;
    }
    // Contiguous storage that is allocated must hold the whole extent; a header whose dimensions
    // were damaged would otherwise make a bulk read allocate memory for data that is not there.
    h5::PropertyList dcpl(H5Dget_create_plist(dataset));
    if (dcpl && H5Pget_layout(dcpl.get()) == H5D_CONTIGUOUS) {
      const hsize_t stored = H5Dget_storage_size(dataset);
      const long double needed =
          static_cast<long double>(H5Sget_simple_extent_npoints(space.get())) *
          static_cast<long double>(size);
      if (stored != 0 && static_cast<long double>(stored) < needed) {
        return bad(desc.path, "contiguous storage of " + std::to_string(stored) +
                                  " bytes cannot hold shape " + shape_text(desc.dims));
      }
    }
    H5Eclear2(H5E_DEFAULT);
    return desc;
  }

  Status expect_shape(const DatasetDesc& desc, const std::vector<hsize_t>& expected,
                      const std::string& meaning) const {
    if (desc.dims != expected) {
      return bad(desc.path, "shape " + shape_text(desc.dims) + " disagrees with " + meaning +
                                " = " + shape_text(expected));
    }
    return ok_status();
  }

  Status missing_dtype(const DatasetDesc& desc, const char* wanted) const {
    return bad(desc.path, desc.type_text + " dataset without a dtype attribute (raw bits need " +
                              "dtype=\"" + wanted + "\")");
  }

  // A tensor the format names bfloat16: u16 + dtype "bfloat16", or float32.
  Status expect_bf16(const DatasetDesc& desc) const {
    switch (desc.element) {
      case ElementClass::kU16:
        if (!desc.dtype) return missing_dtype(desc, kDtypeBf16);
        if (*desc.dtype != kDtypeBf16) {
          return bad(desc.path,
                     "u16 dataset with dtype=\"" + *desc.dtype + "\"; expected dtype=\"bfloat16\"");
        }
        return ok_status();
      case ElementClass::kFloat32:
        if (desc.dtype && *desc.dtype != kDtypeF32 && *desc.dtype != kDtypeBf16) {
          return bad(desc.path, "float32 dataset with dtype=\"" + *desc.dtype + "\"");
        }
        return ok_status();
      case ElementClass::kU8:
        if (!desc.dtype) return missing_dtype(desc, kDtypeBf16);
        [[fallthrough]];
      default:
        return bad(desc.path, "element type " + desc.type_text +
                                  (desc.dtype ? " (dtype=\"" + *desc.dtype + "\")" : "") +
                                  "; expected bfloat16 (u16 with dtype=\"bfloat16\") or float32");
    }
  }

  // A pool tensor: the fp8 codes, or bfloat16 for a bf16 baseline pool.
  Status expect_pool_type(const DatasetDesc& desc, KvDtype kv_dtype) const {
    if (kv_dtype == KvDtype::kBfloat16) return expect_bf16(desc);
    if (desc.element == ElementClass::kU8) {
      if (!desc.dtype) return missing_dtype(desc, kDtypeFp8);
      if (*desc.dtype != kDtypeFp8) {
        return bad(desc.path, "u8 dataset with dtype=\"" + *desc.dtype +
                                  "\"; expected dtype=\"float8_e4m3fn\"");
      }
      return ok_status();
    }
    if (desc.element == ElementClass::kU16 && !desc.dtype) return missing_dtype(desc, kDtypeFp8);
    return bad(desc.path, "element type " + desc.type_text +
                              (desc.dtype ? " (dtype=\"" + *desc.dtype + "\")" : "") +
                              "; kv_dtype is float8_e4m3fn, so expected u8 with "
                              "dtype=\"float8_e4m3fn\"");
  }

  Status expect_float32(const DatasetDesc& desc) const {
    if (desc.element == ElementClass::kFloat32 && (!desc.dtype || *desc.dtype == kDtypeF32)) {
      return ok_status();
    }
    if ((desc.element == ElementClass::kU8 || desc.element == ElementClass::kU16) && !desc.dtype) {
      return missing_dtype(desc, kDtypeF32);
    }
    return bad(desc.path, "element type " + desc.type_text +
                              (desc.dtype ? " (dtype=\"" + *desc.dtype + "\")" : "") +
                              "; expected float32");
  }

  // A rank-1 integer dataset read whole, values in int32.
  Result<std::vector<std::int32_t>> read_index(hid_t group, const std::string& group_path,
                                               const std::string& name) const {
    auto desc = describe(group, group_path, name);
    if (!desc.ok()) return desc.error();
    // Any integer type wider than 16 bits holds indices (int64 from PyTorch is common); u8/u16 are
    // the raw-bits types of the format and never indices.
    if (desc->element != ElementClass::kOtherInteger) {
      if ((desc->element == ElementClass::kU8 || desc->element == ElementClass::kU16) &&
          !desc->dtype) {
        return bad(desc->path,
                   desc->type_text + " dataset without a dtype attribute; indices must be int32");
      }
      return bad(desc->path, "element type " + desc->type_text +
                                 (desc->dtype ? " (dtype=\"" + *desc->dtype + "\")" : "") +
                                 "; expected int32");
    }
    if (desc->dims.size() != 1) {
      return bad(desc->path, "shape " + shape_text(desc->dims) + " is not one-dimensional");
    }
    const hsize_t length = desc->dims[0];
    if (length > kMaxIndexLength) {
      return bad(desc->path, "length " + std::to_string(length) + " exceeds " +
                                 std::to_string(kMaxIndexLength));
    }
    std::vector<std::int64_t> wide(static_cast<std::size_t>(length));
    if (length > 0) {
      h5::Dataset dataset(H5Dopen2(group, name.c_str(), H5P_DEFAULT));
      if (!dataset || H5Dread(dataset.get(), H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT,
                              wide.data()) < 0) {
        return bad(desc->path, with_hdf5_reason("cannot read"));
      }
    }
    std::vector<std::int32_t> values(wide.size());
    for (std::size_t i = 0; i < wide.size(); ++i) {
      if (wide[i] < std::numeric_limits<std::int32_t>::min() ||
          wide[i] > std::numeric_limits<std::int32_t>::max()) {
        return bad(desc->path, "[" + std::to_string(i) + "] = " + std::to_string(wide[i]) +
                                   " does not fit in int32");
      }
      values[i] = static_cast<std::int32_t>(wide[i]);
    }
    return values;
  }

  const std::string& file() const { return file_; }

 private:
  std::string file_;
};

// "L" or "S" followed by three or more digits; the number, or nothing.
std::optional<std::int64_t> group_number(const std::string& name, char prefix) {
  if (name.size() < 4 || name.size() > 19 || name[0] != prefix) return std::nullopt;
  std::int64_t number = 0;
  for (std::size_t i = 1; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
    number = number * 10 + (name[i] - '0');
  }
  return number;
}

Result<std::vector<std::string>> link_names(const Validator& v, hid_t group,
                                            const std::string& path) {
  std::vector<std::string> names;
  hsize_t index = 0;
  const herr_t status = H5Literate(
      group, H5_INDEX_NAME, H5_ITER_INC, &index,
      [](hid_t, const char* name, const H5L_info_t*, void* data) -> herr_t {
        static_cast<std::vector<std::string>*>(data)->emplace_back(name);
        return 0;
      },
      &names);
  if (status < 0) return v.bad(path, with_hdf5_reason("cannot list the members"));
  return names;
}

// Opens `name` under `parent` and requires a group.
Result<h5::Group> open_group(const Validator& v, hid_t parent, const std::string& path,
                             const char* missing_what) {
  const std::string name = path.substr(path.rfind('/') + 1);
  const htri_t exists = H5Lexists(parent, name.c_str(), H5P_DEFAULT);
  if (exists < 0) return v.bad(path, with_hdf5_reason("cannot look up"));
  if (exists == 0) return v.bad(path, missing_what);
  h5::Object object(H5Oopen(parent, name.c_str(), H5P_DEFAULT));
  if (!object) return v.bad(path, with_hdf5_reason("cannot open"));
  if (H5Iget_type(object.get()) != H5I_GROUP) return v.bad(path, "is not a group");
  h5::Group group(H5Gopen2(parent, name.c_str(), H5P_DEFAULT));
  if (!group) return v.bad(path, with_hdf5_reason("cannot open"));
  return group;
}

// Numbered member groups of /layers or /steps, sorted by number (then name).
Result<std::vector<std::pair<std::int64_t, std::string>>> numbered_groups(const Validator& v,
                                                                          hid_t group,
                                                                          const std::string& path,
                                                                          char prefix) {
  auto names = link_names(v, group, path);
  if (!names.ok()) return names.error();
  std::vector<std::pair<std::int64_t, std::string>> groups;
  for (const std::string& name : *names) {
    const std::string member = join_path(path, name);
    const auto number = group_number(name, prefix);
    if (!number) {
      return v.bad(member, std::string("name does not match ") + prefix +
                               " followed by three or more digits");
    }
    h5::Object object(H5Oopen(group, name.c_str(), H5P_DEFAULT));
    if (!object) return v.bad(member, with_hdf5_reason("cannot open"));
    if (H5Iget_type(object.get()) != H5I_GROUP) return v.bad(member, "is not a group");
    groups.emplace_back(*number, name);
  }
  std::sort(groups.begin(), groups.end());
  return groups;
}

Result<DumpAttributes> read_root_attributes(const Validator& v, hid_t root, int* format_version) {
  DumpAttributes attrs;
  auto format = v.read_string(root, "/", "format");
  if (!format.ok()) return format.error();
  if (*format != "kvdump")
    return v.bad("/", "attribute format is \"" + *format + "\", not \"kvdump\"");
  auto version = v.read_int(root, "/", "format_version");
  if (!version.ok()) return version.error();
  if (*version != 1) {
    return v.unsupported_at("/", "format_version " + std::to_string(*version) +
                                     " is unknown; this reader reads version 1");
  }
  *format_version = 1;
  auto model = v.read_string(root, "/", "model");
  if (!model.ok()) return model.error();
  attrs.model = *model;
  auto producer = v.read_string(root, "/", "producer");
  if (!producer.ok()) return producer.error();
  attrs.producer = *producer;
  auto heads = v.read_int_in(root, "/", "num_heads", 1, kMaxDim);
  if (!heads.ok()) return heads.error();
  attrs.num_heads = *heads;
  auto rank = v.read_int_in(root, "/", "kv_lora_rank", 1, kMaxDim);
  if (!rank.ok()) return rank.error();
  attrs.kv_lora_rank = *rank;
  auto rope = v.read_int_in(root, "/", "qk_rope_head_dim", 0, kMaxDim);
  if (!rope.ok()) return rope.error();
  attrs.qk_rope_head_dim = *rope;
  auto sm_scale = v.read_float(root, "/", "sm_scale");
  if (!sm_scale.ok()) return sm_scale.error();
  if (!std::isfinite(*sm_scale)) return v.bad("/", "attribute sm_scale is not finite");
  attrs.sm_scale = *sm_scale;
  auto page_size = v.read_int_in(root, "/", "page_size", 1, kMaxDim);
  if (!page_size.ok()) return page_size.error();
  attrs.page_size = *page_size;
  auto kv_dtype = v.read_string(root, "/", "kv_dtype");
  if (!kv_dtype.ok()) return kv_dtype.error();
  if (*kv_dtype == kDtypeFp8) {
    attrs.kv_dtype = KvDtype::kFloat8E4m3fn;
  } else if (*kv_dtype == kDtypeBf16) {
    attrs.kv_dtype = KvDtype::kBfloat16;
  } else {
    return v.unsupported_at(
        "/", "kv_dtype \"" + *kv_dtype + "\" is unknown; expected float8_e4m3fn or bfloat16");
  }
  auto scale_kind = v.read_string(root, "/", "kv_scale_kind");
  if (!scale_kind.ok()) return scale_kind.error();
  if (*scale_kind != "per_tensor") {
    return v.unsupported_at(
        "/", "kv_scale_kind \"" + *scale_kind + "\" is unknown; version 1 has per_tensor only");
  }
  attrs.kv_scale_kind = *scale_kind;
  return attrs;
}

}  // namespace

// ---- DumpReader ---------------------------------------------------------------------------------

struct DumpReader::Impl {
  std::filesystem::path path;
  std::string file_text;
  h5::File file;
  DumpLayout layout;
};

DumpReader::DumpReader(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DumpReader::DumpReader(DumpReader&&) noexcept = default;
DumpReader& DumpReader::operator=(DumpReader&&) noexcept = default;
DumpReader::~DumpReader() = default;

const DumpLayout& DumpReader::layout() const { return impl_->layout; }
const std::filesystem::path& DumpReader::path() const { return impl_->path; }

namespace {

Status validate_layer(const Validator& v, hid_t layers, const std::string& name,
                      const DumpAttributes& attrs, std::int64_t* num_pages, LayerMeta* meta) {
  const std::string path = "/layers/" + name;
  h5::Group group(H5Gopen2(layers, name.c_str(), H5P_DEFAULT));
  if (!group) return v.bad(path, with_hdf5_reason("cannot open"));
  meta->group = name;
  auto layer_id =
      v.read_int_in(group.get(), path, "layer_id", 0, std::numeric_limits<std::int32_t>::max());
  if (!layer_id.ok()) return layer_id.error();
  meta->layer_id = *layer_id;
  auto scale = v.read_float(group.get(), path, "kv_scale");
  if (!scale.ok()) return scale.error();
  // The write rule divides by fp32(kv_scale).
  const float kv_scale = static_cast<float>(*scale);
  if (!std::isfinite(*scale) || !std::isfinite(kv_scale)) {
    return v.bad(path, "attribute kv_scale is not finite in float32");
  }
  if (!(kv_scale > 0.0f)) {
    return v.bad(path, "attribute kv_scale = " + std::to_string(*scale) + " is not positive");
  }
  if (attrs.kv_dtype == KvDtype::kBfloat16 && kv_scale != 1.0f) {
    return v.bad(path, "attribute kv_scale = " + std::to_string(*scale) +
                           " but a bfloat16 pool requires kv_scale = 1");
  }
  meta->kv_scale = kv_scale;

  auto cache = v.describe(group.get(), path, "kv_cache");
  if (!cache.ok()) return cache.error();
  KVAUDIT_TRY(v.expect_pool_type(*cache, attrs.kv_dtype));
  const auto& dims = cache->dims;
  const std::vector<hsize_t> row_shape = {static_cast<hsize_t>(attrs.page_size),
                                          static_cast<hsize_t>(attrs.row_width())};
  if (dims.size() != 3 || dims[1] != row_shape[0] || dims[2] != row_shape[1]) {
    return v.bad(cache->path, "shape " + shape_text(dims) +
                                  " disagrees with [num_pages, page_size, kv_lora_rank + "
                                  "qk_rope_head_dim] = [num_pages, " +
                                  std::to_string(attrs.page_size) + ", " +
                                  std::to_string(attrs.row_width()) + "]");
  }
  if (*num_pages < 0) {
    // Keep num_pages * page_size * D (bytes of one pool) inside int64.
    const long double slots = static_cast<long double>(dims[0]) * attrs.page_size;
    if (slots * attrs.row_width() * 2 > static_cast<long double>(std::int64_t{1} << 62)) {
      return v.bad(cache->path, "num_pages = " + std::to_string(dims[0]) + " is implausibly large");
    }
    *num_pages = static_cast<std::int64_t>(dims[0]);
  } else if (static_cast<std::int64_t>(dims[0]) != *num_pages) {
    return v.bad(cache->path, "num_pages = " + std::to_string(dims[0]) +
                                  " disagrees with the first layer's " +
                                  std::to_string(*num_pages));
  }
  const std::vector<hsize_t> pool_shape = {static_cast<hsize_t>(*num_pages), row_shape[0],
                                           row_shape[1]};
  auto has_source = v.has_link(group.get(), path, "kv_source");
  if (!has_source.ok()) return has_source.error();
  meta->has_source = *has_source;
  if (*has_source) {
    auto source = v.describe(group.get(), path, "kv_source");
    if (!source.ok()) return source.error();
    KVAUDIT_TRY(v.expect_bf16(*source));
    KVAUDIT_TRY(v.expect_shape(*source, pool_shape, "kv_cache's shape"));
  }
  return ok_status();
}

Status validate_step_layer(const Validator& v, hid_t step_group, const std::string& step_path,
                           const LayerMeta& layer, const DumpLayout& layout, int rows,
                           bool* has_out, bool* has_lse, bool* has_after) {
  const std::string path = step_path + "/" + layer.group;
  auto group = open_group(v, step_group, path, "missing group: every step needs one per layer");
  if (!group.ok()) return group.error();
  const hid_t g = group->get();
  const auto& a = layout.attrs;
  const hsize_t nq = static_cast<hsize_t>(rows);
  const hsize_t heads = static_cast<hsize_t>(a.num_heads);
  const hsize_t dc = static_cast<hsize_t>(a.kv_lora_rank);
  const hsize_t dr = static_cast<hsize_t>(a.qk_rope_head_dim);
  struct Required {
    const char* name;
    std::vector<hsize_t> shape;
    const char* meaning;
  };
  const Required required[] = {
      {"q_nope", {nq, heads, dc}, "[Nq, num_heads, kv_lora_rank]"},
      {"q_pe", {nq, heads, dr}, "[Nq, num_heads, qk_rope_head_dim]"},
      {"new_kv", {nq, dc + dr}, "[Nq, kv_lora_rank + qk_rope_head_dim]"},
  };
  for (const Required& r : required) {
    auto desc = v.describe(g, path, r.name);
    if (!desc.ok()) return desc.error();
    KVAUDIT_TRY(v.expect_bf16(*desc));
    KVAUDIT_TRY(v.expect_shape(*desc, r.shape, r.meaning));
  }
  auto present = [&](const char* name) -> Result<bool> { return v.has_link(g, path, name); };
  auto out = present("out");
  if (!out.ok()) return out.error();
  *has_out = *out;
  if (*out) {
    auto desc = v.describe(g, path, "out");
    if (!desc.ok()) return desc.error();
    KVAUDIT_TRY(v.expect_bf16(*desc));
    KVAUDIT_TRY(v.expect_shape(*desc, {nq, heads, dc}, "[Nq, num_heads, kv_lora_rank]"));
  }
  auto lse = present("lse");
  if (!lse.ok()) return lse.error();
  *has_lse = *lse;
  if (*lse) {
    auto desc = v.describe(g, path, "lse");
    if (!desc.ok()) return desc.error();
    KVAUDIT_TRY(v.expect_float32(*desc));
    KVAUDIT_TRY(v.expect_shape(*desc, {nq, heads}, "[Nq, num_heads]"));
  }
  auto after = present("kv_cache_after");
  if (!after.ok()) return after.error();
  *has_after = *after;
  if (*after) {
    auto desc = v.describe(g, path, "kv_cache_after");
    if (!desc.ok()) return desc.error();
    KVAUDIT_TRY(v.expect_pool_type(*desc, a.kv_dtype));
    KVAUDIT_TRY(v.expect_shape(
        *desc, {static_cast<hsize_t>(layout.num_pages), static_cast<hsize_t>(a.page_size), dc + dr},
        "[num_pages, page_size, kv_lora_rank + qk_rope_head_dim]"));
  }
  return ok_status();
}

Status validate_step(const Validator& v, hid_t steps, const std::string& name,
                     const DumpLayout& layout, StepMeta* step) {
  const std::string path = "/steps/" + name;
  h5::Group group(H5Gopen2(steps, name.c_str(), H5P_DEFAULT));
  if (!group) return v.bad(path, with_hdf5_reason("cannot open"));
  step->group = name;
  auto kind = v.read_string(group.get(), path, "kind");
  if (!kind.ok()) return kind.error();
  if (*kind == "prefill") {
    step->kind = StepKind::kPrefill;
  } else if (*kind == "decode") {
    step->kind = StepKind::kDecode;
  } else {
    return v.bad(path, "attribute kind = \"" + *kind + "\" is unknown; expected prefill or decode");
  }
  struct Index {
    const char* name;
    std::vector<std::int32_t>* values;
  };
  const Index indices[] = {{"qo_indptr", &step->qo_indptr},
                           {"kv_indptr", &step->kv_indptr},
                           {"kv_indices", &step->kv_indices},
                           {"kv_last_page_len", &step->kv_last_page_len},
                           {"new_kv_slots", &step->new_kv_slots}};
  for (const Index& index : indices) {
    auto values = v.read_index(group.get(), path, index.name);
    if (!values.ok()) return values.error();
    *index.values = std::move(*values);
  }
  KVAUDIT_TRY(validate_step_indices(*step, layout.num_pages, layout.attrs.page_size,
                                    v.file() + ":" + path));

  // Member groups: each must be one of the layers under /layers; every layer must be present.
  auto names = link_names(v, group.get(), path);
  if (!names.ok()) return names.error();
  for (const std::string& member : *names) {
    h5::Object object(H5Oopen(group.get(), member.c_str(), H5P_DEFAULT));
    if (!object) return v.bad(path + "/" + member, with_hdf5_reason("cannot open"));
    if (H5Iget_type(object.get()) != H5I_GROUP) continue;
    if (!group_number(member, 'L')) {
      return v.bad(path + "/" + member, "name does not match L followed by three or more digits");
    }
    const bool known = std::any_of(layout.layers.begin(), layout.layers.end(),
                                   [&](const LayerMeta& l) { return l.group == member; });
    if (!known) return v.bad(path + "/" + member, "is not a layer under /layers");
  }
  const std::size_t count = layout.layers.size();
  step->has_out.assign(count, false);
  step->has_lse.assign(count, false);
  step->has_kv_cache_after.assign(count, false);
  for (std::size_t l = 0; l < count; ++l) {
    bool out = false, lse = false, after = false;
    KVAUDIT_TRY(validate_step_layer(v, group.get(), path, layout.layers[l], layout,
                                    step->num_rows(), &out, &lse, &after));
    step->has_out[l] = out;
    step->has_lse[l] = lse;
    step->has_kv_cache_after[l] = after;
  }
  return ok_status();
}

}  // namespace

Result<DumpReader> DumpReader::open(const std::filesystem::path& path) {
  h5::silence_hdf5_errors();
  const std::string file_text = path.string();
  const Validator v(file_text);
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (ec || !std::filesystem::exists(status)) return bad_input(file_text, "no such file");
  if (std::filesystem::is_directory(status)) return bad_input(file_text, "is a directory");
  const htri_t is_hdf5 = H5Fis_hdf5(file_text.c_str());
  if (is_hdf5 <= 0) {
    return bad_input(file_text, with_hdf5_reason("is not an HDF5 file (no HDF5 signature)"));
  }
  h5::PropertyList fapl(H5Pcreate(H5P_FILE_ACCESS));
  // A dump is only read: do not take a lock, which fails on read-only or network file systems.
  if (fapl) H5Pset_file_locking(fapl.get(), false, true);
  auto impl = std::make_unique<Impl>();
  impl->path = path;
  impl->file_text = file_text;
  impl->file = h5::File(H5Fopen(file_text.c_str(), H5F_ACC_RDONLY, fapl.get()));
  if (!impl->file) {
    return bad_input(file_text,
                     with_hdf5_reason("cannot be opened as HDF5 (truncated or damaged?)"));
  }
  h5::Group root(H5Gopen2(impl->file.get(), "/", H5P_DEFAULT));
  if (!root) return v.bad("/", with_hdf5_reason("cannot open the root group"));
  DumpLayout& layout = impl->layout;
  auto attrs = read_root_attributes(v, root.get(), &layout.format_version);
  if (!attrs.ok()) return attrs.error();
  layout.attrs = *attrs;

  auto layers = open_group(v, root.get(), "/layers", "missing group");
  if (!layers.ok()) return layers.error();
  auto layer_names = numbered_groups(v, layers->get(), "/layers", 'L');
  if (!layer_names.ok()) return layer_names.error();
  if (layer_names->empty()) return v.bad("/layers", "holds no layer group");
  std::int64_t num_pages = -1;
  std::map<int, std::string> layer_ids;
  for (const auto& [number, name] : *layer_names) {
    LayerMeta meta;
    KVAUDIT_TRY(validate_layer(v, layers->get(), name, layout.attrs, &num_pages, &meta));
    const auto [it, inserted] = layer_ids.emplace(meta.layer_id, name);
    if (!inserted) {
      return v.bad("/layers/" + name, "layer_id " + std::to_string(meta.layer_id) +
                                          " is also the layer_id of /layers/" + it->second);
    }
    layout.layers.push_back(std::move(meta));
  }
  layout.num_pages = num_pages;

  auto steps = open_group(v, root.get(), "/steps", "missing group");
  if (!steps.ok()) return steps.error();
  auto step_names = numbered_groups(v, steps->get(), "/steps", 'S');
  if (!step_names.ok()) return step_names.error();
  for (std::size_t i = 1; i < step_names->size(); ++i) {
    if ((*step_names)[i].first == (*step_names)[i - 1].first) {
      return v.bad("/steps/" + (*step_names)[i].second, "has the same step number as /steps/" +
                                                            (*step_names)[i - 1].second +
                                                            ": the replay order is ambiguous");
    }
  }
  for (const auto& [number, name] : *step_names) {
    StepMeta step;
    KVAUDIT_TRY(validate_step(v, steps->get(), name, layout, &step));
    layout.steps.push_back(std::move(step));
  }
  H5Eclear2(H5E_DEFAULT);
  return DumpReader(std::move(impl));
}

// ---- bulk reads ---------------------------------------------------------------------------------

namespace {

// Reads a whole dataset whose type and shape open() validated. `elements` is its element count.
template <typename T>
Status read_all(hid_t file, const std::string& where, const std::string& path, hid_t memory_type,
                std::size_t elements, std::vector<T>* values) {
  try {
    values->assign(elements, T{});
  } catch (const std::bad_alloc&) {
    return internal_error(where + ":" + path, "out of memory reading " +
                                                  std::to_string(elements * sizeof(T)) + " bytes");
  }
  if (elements == 0) return ok_status();
  h5::Dataset dataset(H5Dopen2(file, path.c_str(), H5P_DEFAULT));
  if (!dataset ||
      H5Dread(dataset.get(), memory_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, values->data()) < 0) {
    return bad_input(where + ":" + path, with_hdf5_reason("cannot read"));
  }
  return ok_status();
}

// Element class of an existing dataset (validated at open).
Result<ElementClass> element_class(hid_t file, const std::string& where, const std::string& path) {
  h5::Dataset dataset(H5Dopen2(file, path.c_str(), H5P_DEFAULT));
  if (!dataset) return bad_input(where + ":" + path, with_hdf5_reason("cannot open"));
  h5::Type type(H5Dget_type(dataset.get()));
  if (!type) return bad_input(where + ":" + path, with_hdf5_reason("cannot read the type"));
  const H5T_class_t cls = H5Tget_class(type.get());
  const std::size_t size = H5Tget_size(type.get());
  if (cls == H5T_INTEGER && size == 1) return ElementClass::kU8;
  if (cls == H5T_INTEGER && size == 2) return ElementClass::kU16;
  if (cls == H5T_FLOAT && size == 4) return ElementClass::kFloat32;
  return bad_input(where + ":" + path, "element type changed since the file was opened");
}

// A bfloat16-or-float32 tensor as float.
Result<std::vector<float>> read_bf16_tensor(hid_t file, const std::string& where,
                                            const std::string& path, std::size_t elements) {
  auto cls = element_class(file, where, path);
  if (!cls.ok()) return cls.error();
  std::vector<float> values;
  if (*cls == ElementClass::kFloat32) {
    KVAUDIT_TRY(read_all(file, where, path, H5T_NATIVE_FLOAT, elements, &values));
    return values;
  }
  std::vector<std::uint16_t> bits;
  KVAUDIT_TRY(read_all(file, where, path, H5T_NATIVE_UINT16, elements, &bits));
  values.resize(bits.size());
  for (std::size_t i = 0; i < bits.size(); ++i) values[i] = bf16_to_float(bits[i]);
  return values;
}

Result<KvPool> read_pool_dataset(hid_t file, const std::string& where, const std::string& path,
                                 const DumpLayout& layout) {
  KvPool pool;
  pool.dtype = layout.attrs.kv_dtype;
  pool.num_slots = layout.num_slots();
  pool.row_width = layout.attrs.row_width();
  const std::size_t elements = static_cast<std::size_t>(pool.num_slots) * pool.row_width;
  if (pool.dtype == KvDtype::kFloat8E4m3fn) {
    KVAUDIT_TRY(read_all(file, where, path, H5T_NATIVE_UINT8, elements, &pool.bytes));
    return pool;
  }
  auto cls = element_class(file, where, path);
  if (!cls.ok()) return cls.error();
  std::vector<std::uint16_t> bits;
  if (*cls == ElementClass::kFloat32) {
    std::vector<float> values;
    KVAUDIT_TRY(read_all(file, where, path, H5T_NATIVE_FLOAT, elements, &values));
    bits.resize(elements);
    for (std::size_t i = 0; i < elements; ++i) {
      bits[i] = bf16_from_float(values[i]);
      // A float32 bf16 pool must hold widened bf16 values: the pool stores bf16 bits.
      if (!std::isnan(values[i]) && bf16_to_float(bits[i]) != values[i]) {
        return bad_input(where + ":" + path, "float32 element " + std::to_string(i) + " = " +
                                                 std::to_string(values[i]) +
                                                 " is not a bfloat16 value");
      }
    }
  } else {
    KVAUDIT_TRY(read_all(file, where, path, H5T_NATIVE_UINT16, elements, &bits));
  }
  try {
    pool.bytes.resize(2 * elements);
  } catch (const std::bad_alloc&) {
    return internal_error(where + ":" + path, "out of memory");
  }
  for (std::size_t i = 0; i < elements; ++i) {
    pool.bytes[2 * i] = static_cast<std::uint8_t>(bits[i] & 0xFF);
    pool.bytes[2 * i + 1] = static_cast<std::uint8_t>(bits[i] >> 8);
  }
  return pool;
}

}  // namespace

Result<KvPool> DumpReader::read_pool(std::size_t layer_index) const {
  const DumpLayout& layout = impl_->layout;
  if (layer_index >= layout.layers.size()) {
    return internal_error(impl_->file_text,
                          "layer index " + std::to_string(layer_index) + " out of range");
  }
  return read_pool_dataset(impl_->file.get(), impl_->file_text,
                           "/layers/" + layout.layers[layer_index].group + "/kv_cache", layout);
}

Result<std::vector<float>> DumpReader::read_source(std::size_t layer_index) const {
  const DumpLayout& layout = impl_->layout;
  if (layer_index >= layout.layers.size()) {
    return internal_error(impl_->file_text,
                          "layer index " + std::to_string(layer_index) + " out of range");
  }
  const LayerMeta& layer = layout.layers[layer_index];
  const std::string path = "/layers/" + layer.group + "/kv_source";
  if (!layer.has_source) return bad_input(impl_->file_text + ":" + path, "missing dataset");
  return read_bf16_tensor(impl_->file.get(), impl_->file_text, path,
                          static_cast<std::size_t>(layout.num_slots()) * layout.attrs.row_width());
}

Result<StepLayerTensors> DumpReader::read_step_layer(std::size_t step_index,
                                                     std::size_t layer_index) const {
  const DumpLayout& layout = impl_->layout;
  if (step_index >= layout.steps.size() || layer_index >= layout.layers.size()) {
    return internal_error(impl_->file_text, "step " + std::to_string(step_index) + " / layer " +
                                                std::to_string(layer_index) + " out of range");
  }
  const StepMeta& step = layout.steps[step_index];
  const std::string base = "/steps/" + step.group + "/" + layout.layers[layer_index].group + "/";
  const auto& a = layout.attrs;
  const std::size_t nq = static_cast<std::size_t>(step.num_rows());
  const std::size_t heads = static_cast<std::size_t>(a.num_heads);
  const hid_t file = impl_->file.get();
  const std::string& where = impl_->file_text;
  StepLayerTensors tensors;
  auto q_nope = read_bf16_tensor(file, where, base + "q_nope", nq * heads * a.kv_lora_rank);
  if (!q_nope.ok()) return q_nope.error();
  tensors.q_nope = std::move(*q_nope);
  auto q_pe = read_bf16_tensor(file, where, base + "q_pe", nq * heads * a.qk_rope_head_dim);
  if (!q_pe.ok()) return q_pe.error();
  tensors.q_pe = std::move(*q_pe);
  auto new_kv = read_bf16_tensor(file, where, base + "new_kv", nq * a.row_width());
  if (!new_kv.ok()) return new_kv.error();
  tensors.new_kv = std::move(*new_kv);
  if (step.has_out[layer_index]) {
    auto out = read_bf16_tensor(file, where, base + "out", nq * heads * a.kv_lora_rank);
    if (!out.ok()) return out.error();
    tensors.out = std::move(*out);
  }
  if (step.has_lse[layer_index]) {
    std::vector<float> lse;
    KVAUDIT_TRY(read_all(file, where, base + "lse", H5T_NATIVE_FLOAT, nq * heads, &lse));
    tensors.lse = std::move(lse);
  }
  if (step.has_kv_cache_after[layer_index]) {
    auto after = read_pool_dataset(file, where, base + "kv_cache_after", layout);
    if (!after.ok()) return after.error();
    tensors.kv_cache_after = std::move(*after);
  }
  return tensors;
}

}  // namespace kvaudit
