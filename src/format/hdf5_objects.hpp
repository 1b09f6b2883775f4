// Checked reads of the HDF5 objects of a file being validated (src/format/kvdump_validator.cpp):
// an attribute holding one value of a given class, a dataset's element class, shape and `dtype`
// attribute (without its data), a group's members. Every error is bad input whose `where` is
// "file:/hdf5/path", so a message always names the object at fault.
#pragma once

#include <hdf5.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "src/core/hdf5_handles.hpp"
#include "src/core/result.hpp"

namespace kvaudit {

// What an element type is, for the format's purposes: u8 and u16 are the raw-bits types (fp8
// codes, bf16 bits), float32 a float tensor, an integer of 32 or 64 bits an index; anything else
// (int8 and int16 included) is kOther.
enum class ElementClass { kU8, kU16, kFloat32, kOtherInteger, kOther };

// One dataset as the validator sees it: no data is read.
struct DatasetDesc {
  ElementClass element = ElementClass::kOther;
  std::string type_text;  // "u8", "int64", "float64", "string", ...
  std::vector<hsize_t> dims;
  std::optional<std::string> dtype;  // the `dtype` attribute
  std::string path;
};

// "u8", "int64", "float32", "string", "compound", ...: how messages name an HDF5 type.
std::string type_text_of(hid_t type);

// The path of `name` under the group at `parent` ("/" + "layers" = "/layers").
std::string join_path(const std::string& parent, const std::string& name);

// Reads objects of one file; `path` arguments are the HDF5 path of the object passed as hid_t.
class ObjectReader {
 public:
  explicit ObjectReader(std::string file) : file_(std::move(file)) {}

  const std::string& file() const { return file_; }
  Error bad(const std::string& path, std::string what) const;
  Error unsupported_at(const std::string& path, std::string what) const;

  // Attributes of `object` that hold exactly one value of the named class.
  Result<std::string> read_string(hid_t object, const std::string& path,
                                  const std::string& name) const;
  Result<std::int64_t> read_int(hid_t object, const std::string& path,
                                const std::string& name) const;
  Result<double> read_float(hid_t object, const std::string& path, const std::string& name) const;
  // An integer attribute that must lie in [lo, hi].
  Result<int> read_int_in(hid_t object, const std::string& path, const std::string& name,
                          std::int64_t lo, std::int64_t hi) const;

  // Whether `group` has a link (dataset or group) called `name`.
  Result<bool> has_link(hid_t group, const std::string& path, const std::string& name) const;
  // The dataset `name` under `group`: it must exist, be an array and, when its storage is
  // contiguous and allocated, hold its whole extent.
  Result<DatasetDesc> describe(hid_t group, const std::string& group_path,
                               const std::string& name) const;
  // Names of the members of `group`, in name order.
  Result<std::vector<std::string>> link_names(hid_t group, const std::string& path) const;
  // Opens the group at `path` (its last component under `parent`); a missing link is refused
  // with `missing_what`.
  Result<h5::Group> open_group(hid_t parent, const std::string& path,
                               const char* missing_what) const;

 private:
  struct TypedAttribute {
    h5::Attribute attribute;
    h5::Type type;
  };
  // The attribute `name`, holding one value of class `cls` (`expected` names it in the error).
  Result<TypedAttribute> open_attribute(hid_t object, const std::string& path,
                                        const std::string& name, H5T_class_t cls,
                                        const char* expected) const;
  Result<std::string> read_variable_string(const TypedAttribute& attribute, const std::string& path,
                                           const std::string& name) const;
  Result<std::string> read_fixed_string(const TypedAttribute& attribute, const std::string& path,
                                        const std::string& name) const;
  // The phases of describe(); each fills part of `desc`.
  Result<std::size_t> describe_element(hid_t dataset, DatasetDesc* desc) const;  // element bytes
  Result<hssize_t> describe_extent(hid_t dataset, DatasetDesc* desc) const;      // points
  Result<std::optional<std::string>> read_dtype_attribute(hid_t dataset,
                                                          const std::string& path) const;
  Status check_contiguous_storage(hid_t dataset, const DatasetDesc& desc,
                                  long double needed_bytes) const;

  std::string file_;
};

}  // namespace kvaudit
