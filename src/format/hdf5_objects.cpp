// Checked reads of HDF5 attributes, dataset descriptions and group members
// (src/format/hdf5_objects.hpp).
#include "src/format/hdf5_objects.hpp"

#include <fmt/format.h>

#include <cstring>
#include <limits>

namespace kvaudit {

using h5::shape_text;
using h5::with_hdf5_reason;

std::string type_text_of(hid_t type) {
  const H5T_class_t cls = H5Tget_class(type);
  const std::size_t bits = 8 * H5Tget_size(type);
  switch (cls) {
    case H5T_INTEGER:
      return fmt::format("{}{}", H5Tget_sign(type) == H5T_SGN_2 ? "int" : "u", bits);
    case H5T_FLOAT:
      return fmt::format("float{}", bits);
    case H5T_STRING:
      return "string";
    case H5T_COMPOUND:
      return "compound";
    case H5T_ENUM:
      return "enum";
    case H5T_ARRAY:
      return "array";
    default:
      return fmt::format("HDF5 class {}", static_cast<int>(cls));
  }
}

std::string join_path(const std::string& parent, const std::string& name) {
  return parent == "/" ? "/" + name : parent + "/" + name;
}

Error ObjectReader::bad(const std::string& path, std::string what) const {
  return bad_input(file_ + ":" + path, std::move(what));
}

Error ObjectReader::unsupported_at(const std::string& path, std::string what) const {
  return unsupported(file_ + ":" + path, std::move(what));
}

// ---- attributes --------------------------------------------------------------------------------

Result<ObjectReader::TypedAttribute> ObjectReader::open_attribute(hid_t object,
                                                                  const std::string& path,
                                                                  const std::string& name,
                                                                  H5T_class_t cls,
                                                                  const char* expected) const {
  const htri_t exists = H5Aexists(object, name.c_str());
  if (exists < 0) return bad(path, with_hdf5_reason("cannot look up attribute " + name));
  if (exists == 0) return bad(path, "missing attribute " + name);
  TypedAttribute typed;
  typed.attribute = h5::Attribute(H5Aopen(object, name.c_str(), H5P_DEFAULT));
  if (!typed.attribute) return bad(path, with_hdf5_reason("cannot open attribute " + name));
  h5::Dataspace space(H5Aget_space(typed.attribute.get()));
  if (!space) return bad(path, with_hdf5_reason("cannot read attribute " + name));
  const hssize_t points = H5Sget_simple_extent_npoints(space.get());
  if (points != 1) {
    return bad(path, fmt::format("attribute {} holds {} values; expected one", name, points));
  }
  typed.type = h5::Type(H5Aget_type(typed.attribute.get()));
  if (!typed.type) {
    return bad(path, with_hdf5_reason("cannot read the type of attribute " + name));
  }
  if (H5Tget_class(typed.type.get()) != cls) {
    return bad(path, fmt::format("attribute {} is {}; expected {}", name,
                                 type_text_of(typed.type.get()), expected));
  }
  return typed;
}

Result<std::string> ObjectReader::read_string(hid_t object, const std::string& path,
                                              const std::string& name) const {
  KVAUDIT_ASSIGN_OR_RETURN(const TypedAttribute attribute,
                           open_attribute(object, path, name, H5T_STRING, "a string"));
  const htri_t variable = H5Tis_variable_str(attribute.type.get());
  if (variable < 0) return bad(path, with_hdf5_reason("cannot read attribute " + name));
  if (variable > 0) return read_variable_string(attribute, path, name);
  return read_fixed_string(attribute, path, name);
}

Result<std::string> ObjectReader::read_variable_string(const TypedAttribute& attribute,
                                                       const std::string& path,
                                                       const std::string& name) const {
  h5::Type memory(H5Tcopy(H5T_C_S1));
  if (!memory || H5Tset_size(memory.get(), H5T_VARIABLE) < 0 ||
      H5Tset_cset(memory.get(), H5Tget_cset(attribute.type.get())) < 0) {
    return bad(path, with_hdf5_reason("cannot read attribute " + name));
  }
  char* text = nullptr;
  if (H5Aread(attribute.attribute.get(), memory.get(), &text) < 0) {
    return bad(path, with_hdf5_reason("cannot read attribute " + name));
  }
  std::string value = text != nullptr ? std::string(text) : std::string();
  if (text != nullptr) H5free_memory(text);
  return value;
}

Result<std::string> ObjectReader::read_fixed_string(const TypedAttribute& attribute,
                                                    const std::string& path,
                                                    const std::string& name) const {
  const std::size_t size = H5Tget_size(attribute.type.get());
  if (size == 0 || size > (std::size_t{1} << 20)) {
    return bad(path, fmt::format("attribute {} has an implausible string size {}", name, size));
  }
  std::string buffer(size, '\0');
  if (H5Aread(attribute.attribute.get(), attribute.type.get(), buffer.data()) < 0) {
    return bad(path, with_hdf5_reason("cannot read attribute " + name));
  }
  // Fixed-length strings are NUL-terminated, NUL-padded or space-padded.
  buffer.resize(std::strlen(buffer.c_str()));
  if (H5Tget_strpad(attribute.type.get()) == H5T_STR_SPACEPAD) {
    while (!buffer.empty() && buffer.back() == ' ') buffer.pop_back();
  }
  return buffer;
}

Result<std::int64_t> ObjectReader::read_int(hid_t object, const std::string& path,
                                            const std::string& name) const {
  KVAUDIT_ASSIGN_OR_RETURN(const TypedAttribute attribute,
                           open_attribute(object, path, name, H5T_INTEGER, "an integer"));
  const hid_t type = attribute.type.get();
  if (H5Tget_sign(type) == H5T_SGN_NONE && H5Tget_size(type) >= 8) {
    // Read as uint64 so that a value above int64's range is refused, not wrapped.
    std::uint64_t value = 0;
    if (H5Aread(attribute.attribute.get(), H5T_NATIVE_UINT64, &value) < 0) {
      return bad(path, with_hdf5_reason("cannot read attribute " + name));
    }
    if (value > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
      return bad(path, fmt::format("attribute {} = {} is too large", name, value));
    }
    return static_cast<std::int64_t>(value);
  }
  std::int64_t value = 0;
  if (H5Aread(attribute.attribute.get(), H5T_NATIVE_INT64, &value) < 0) {
    return bad(path, with_hdf5_reason("cannot read attribute " + name));
  }
  return value;
}

Result<double> ObjectReader::read_float(hid_t object, const std::string& path,
                                        const std::string& name) const {
  KVAUDIT_ASSIGN_OR_RETURN(
      const TypedAttribute attribute,
      open_attribute(object, path, name, H5T_FLOAT, "a floating-point number"));
  double value = 0.0;
  if (H5Aread(attribute.attribute.get(), H5T_NATIVE_DOUBLE, &value) < 0) {
    return bad(path, with_hdf5_reason("cannot read attribute " + name));
  }
  return value;
}

Result<int> ObjectReader::read_int_in(hid_t object, const std::string& path,
                                      const std::string& name, std::int64_t lo,
                                      std::int64_t hi) const {
  KVAUDIT_ASSIGN_OR_RETURN(const std::int64_t value, read_int(object, path, name));
  if (value < lo || value > hi) {
    return bad(path, fmt::format("attribute {} = {} is outside {}..{}", name, value, lo, hi));
  }
  return static_cast<int>(value);
}

// ---- datasets ----------------------------------------------------------------------------------

Result<bool> ObjectReader::has_link(hid_t group, const std::string& path,
                                    const std::string& name) const {
  const htri_t exists = H5Lexists(group, name.c_str(), H5P_DEFAULT);
  if (exists < 0) return bad(path, with_hdf5_reason("cannot look up " + name));
  return exists > 0;
}

Result<DatasetDesc> ObjectReader::describe(hid_t group, const std::string& group_path,
                                           const std::string& name) const {
  DatasetDesc desc;
  desc.path = join_path(group_path, name);
  KVAUDIT_ASSIGN_OR_RETURN(const bool exists, has_link(group, group_path, name));
  if (!exists) return bad(desc.path, "missing dataset");
  h5::Object object(H5Oopen(group, name.c_str(), H5P_DEFAULT));
  if (!object) return bad(desc.path, with_hdf5_reason("cannot open"));
  if (H5Iget_type(object.get()) != H5I_DATASET) return bad(desc.path, "is not a dataset");
  const hid_t dataset = object.get();
  KVAUDIT_ASSIGN_OR_RETURN(const std::size_t element_bytes, describe_element(dataset, &desc));
  KVAUDIT_ASSIGN_OR_RETURN(const hssize_t points, describe_extent(dataset, &desc));
  KVAUDIT_ASSIGN_OR_RETURN(desc.dtype, read_dtype_attribute(dataset, desc.path));
  KVAUDIT_TRY(check_contiguous_storage(
      dataset, desc, static_cast<long double>(points) * static_cast<long double>(element_bytes)));
  H5Eclear2(H5E_DEFAULT);
  return desc;
}

Result<std::size_t> ObjectReader::describe_element(hid_t dataset, DatasetDesc* desc) const {
  h5::Type type(H5Dget_type(dataset));
  if (!type) return bad(desc->path, with_hdf5_reason("cannot read the element type"));
  desc->type_text = type_text_of(type.get());
  const H5T_class_t cls = H5Tget_class(type.get());
  const std::size_t size = H5Tget_size(type.get());
  if (cls == H5T_INTEGER) {
    const bool is_signed = H5Tget_sign(type.get()) == H5T_SGN_2;
    if (!is_signed && size == 1) {
      desc->element = ElementClass::kU8;
    } else if (!is_signed && size == 2) {
      desc->element = ElementClass::kU16;
    } else if (size >= 4) {
      desc->element = ElementClass::kOtherInteger;
    }  // int8 / int16: no type of the format (an int16 is more likely bf16 bits than indices)
  } else if (cls == H5T_FLOAT && size == 4) {
    desc->element = ElementClass::kFloat32;
  }
  return size;
}

Result<hssize_t> ObjectReader::describe_extent(hid_t dataset, DatasetDesc* desc) const {
  h5::Dataspace space(H5Dget_space(dataset));
  if (!space) return bad(desc->path, with_hdf5_reason("cannot read the dataspace"));
  const int rank = H5Sget_simple_extent_ndims(space.get());
  if (rank < 0) return bad(desc->path, with_hdf5_reason("cannot read the dataspace"));
  desc->dims.assign(static_cast<std::size_t>(rank), 0);
  if (rank > 0 && H5Sget_simple_extent_dims(space.get(), desc->dims.data(), nullptr) < 0) {
    return bad(desc->path, with_hdf5_reason("cannot read the dataspace"));
  }
  if (H5Sget_simple_extent_type(space.get()) != H5S_SIMPLE) {
    return bad(desc->path, "has a scalar or null dataspace; expected an array");
  }
  return H5Sget_simple_extent_npoints(space.get());
}

Result<std::optional<std::string>> ObjectReader::read_dtype_attribute(
    hid_t dataset, const std::string& path) const {
  const htri_t has_dtype = H5Aexists(dataset, "dtype");
  if (has_dtype < 0) return bad(path, with_hdf5_reason("cannot look up attribute dtype"));
  if (has_dtype == 0) return std::optional<std::string>();
  KVAUDIT_ASSIGN_OR_RETURN(std::string dtype, read_string(dataset, path, "dtype"));
  return std::optional<std::string>(std::move(dtype));
}

// Contiguous storage that is allocated must hold the whole extent; a header whose dimensions were
// damaged would otherwise make a bulk read allocate memory for data that is not there.
Status ObjectReader::check_contiguous_storage(hid_t dataset, const DatasetDesc& desc,
                                              long double needed_bytes) const {
  h5::PropertyList dcpl(H5Dget_create_plist(dataset));
  if (!dcpl || H5Pget_layout(dcpl.get()) != H5D_CONTIGUOUS) return ok_status();
  const hsize_t stored = H5Dget_storage_size(dataset);
  if (stored != 0 && static_cast<long double>(stored) < needed_bytes) {
    return bad(desc.path, fmt::format("contiguous storage of {} bytes cannot hold shape {}", stored,
                                      shape_text(desc.dims)));
  }
  return ok_status();
}

// ---- groups ------------------------------------------------------------------------------------

Result<std::vector<std::string>> ObjectReader::link_names(hid_t group,
                                                          const std::string& path) const {
  std::vector<std::string> names;
  hsize_t index = 0;
  const herr_t status = H5Literate(
      group, H5_INDEX_NAME, H5_ITER_INC, &index,
      [](hid_t, const char* name, const H5L_info_t*, void* data) -> herr_t {
        static_cast<std::vector<std::string>*>(data)->emplace_back(name);
        return 0;
      },
      &names);
  if (status < 0) return bad(path, with_hdf5_reason("cannot list the members"));
  return names;
}

Result<h5::Group> ObjectReader::open_group(hid_t parent, const std::string& path,
                                           const char* missing_what) const {
  const std::string name = path.substr(path.rfind('/') + 1);
  const htri_t exists = H5Lexists(parent, name.c_str(), H5P_DEFAULT);
  if (exists < 0) return bad(path, with_hdf5_reason("cannot look up"));
  if (exists == 0) return bad(path, missing_what);
  h5::Object object(H5Oopen(parent, name.c_str(), H5P_DEFAULT));
  if (!object) return bad(path, with_hdf5_reason("cannot open"));
  if (H5Iget_type(object.get()) != H5I_GROUP) return bad(path, "is not a group");
  h5::Group group(H5Gopen2(parent, name.c_str(), H5P_DEFAULT));
  if (!group) return bad(path, with_hdf5_reason("cannot open"));
  return group;
}

}  // namespace kvaudit
