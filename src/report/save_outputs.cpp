// --save-outputs writer (layout in save_outputs.hpp). Shapes: out [Nq, H, Dc], lse [Nq, H].
#include "src/report/save_outputs.hpp"

#include <fmt/format.h>
#include <hdf5.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "src/core/hdf5_handles.hpp"

namespace kvaudit {

struct OutputsWriter::Impl {
  std::string file_text;
  h5::File file;
  h5::Group steps;
  std::map<std::string, h5::Group> step_groups;

  Error fail(const std::string& object, const std::string& what) const {
    const std::string reason = h5::hdf5_error_text();
    return internal_error(fmt::format("{}:{}", file_text, object),
                          reason.empty() ? what : fmt::format("{} (HDF5: {})", what, reason));
  }

  Status write_string_attribute(hid_t object, const char* name, const std::string& value,
                                const std::string& where) {
    h5::Type type(H5Tcopy(H5T_C_S1));
    if (!type || H5Tset_size(type.get(), H5T_VARIABLE) < 0 ||
        H5Tset_cset(type.get(), H5T_CSET_UTF8) < 0) {
      return fail(where, "cannot make a string type");
    }
    h5::Dataspace space(H5Screate(H5S_SCALAR));
    h5::Attribute attribute(
        H5Acreate2(object, name, type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT));
    const char* text = value.c_str();
    if (!attribute || H5Awrite(attribute.get(), type.get(), &text) < 0) {
      return fail(where, fmt::format("cannot write attribute {}", name));
    }
    return ok_status();
  }

  template <typename T>
  Status write_dataset(hid_t group, const std::string& group_path, const char* name,
                       hid_t file_type, hid_t memory_type, const std::vector<hsize_t>& dims,
                       const T* data) {
    const std::string where = fmt::format("{}/{}", group_path, name);
    h5::Dataspace space(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr));
    if (!space) return fail(where, "cannot make a dataspace");
    h5::Dataset dataset(
        H5Dcreate2(group, name, file_type, space.get(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT));
    if (!dataset) return fail(where, "cannot create the dataset");
    if (H5Dwrite(dataset.get(), memory_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data) < 0) {
      return fail(where, "cannot write the dataset");
    }
    if (file_type == H5T_STD_U16LE) {
      KVAUDIT_TRY(write_string_attribute(dataset.get(), "dtype", "bfloat16", where));
    }
    return ok_status();
  }

  Result<hid_t> step_group(const std::string& name) {
    auto it = step_groups.find(name);
    if (it != step_groups.end()) return it->second.get();
    h5::Group group(H5Gcreate2(steps.get(), name.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT));
    if (!group) return fail(fmt::format("/steps/{}", name), "cannot create the group");
    const hid_t id = group.get();
    step_groups.emplace(name, std::move(group));
    return id;
  }
};

OutputsWriter::OutputsWriter(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
OutputsWriter::OutputsWriter(OutputsWriter&&) noexcept = default;
OutputsWriter& OutputsWriter::operator=(OutputsWriter&&) noexcept = default;
OutputsWriter::~OutputsWriter() = default;

Result<OutputsWriter> OutputsWriter::create(const std::filesystem::path& path,
                                            const std::string& dump_path,
                                            const std::string& backend) {
  h5::silence_hdf5_errors();
  auto impl = std::make_unique<Impl>();
  impl->file_text = path.string();
  impl->file = h5::File(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT));
  if (!impl->file) {
    const std::string reason = h5::hdf5_error_text();
    return bad_input(path.string(),
                     reason.empty()
                         ? "cannot create the --save-outputs file"
                         : fmt::format("cannot create the --save-outputs file (HDF5: {})", reason));
  }
  const hid_t root = impl->file.get();
  KVAUDIT_TRY(impl->write_string_attribute(root, "format", "kvaudit-outputs", "/"));
  KVAUDIT_TRY(impl->write_string_attribute(root, "dump", dump_path, "/"));
  KVAUDIT_TRY(impl->write_string_attribute(root, "backend", backend, "/"));
  impl->steps = h5::Group(H5Gcreate2(root, "steps", H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT));
  if (!impl->steps) return impl->fail("/steps", "cannot create the group");
  return OutputsWriter(std::move(impl));
}

Status OutputsWriter::write(const StepLayerOutputs& outputs) {
  Impl& impl = *impl_;
  const std::string step_name = step_group_name(outputs.step);
  const std::string layer_name = layer_group_name(outputs.layer_id);
  const std::string group_path = fmt::format("/steps/{}/{}", step_name, layer_name);
  KVAUDIT_ASSIGN_OR_RETURN(const hid_t parent, impl.step_group(step_name));
  h5::Group group(H5Gcreate2(parent, layer_name.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT));
  if (!group) return impl.fail(group_path, "cannot create the group");

  const TensorShape3& shape = outputs.shape;
  const std::vector<hsize_t> out_dims = {static_cast<hsize_t>(shape.rows),
                                         static_cast<hsize_t>(shape.heads),
                                         static_cast<hsize_t>(shape.dims)};
  const std::vector<hsize_t> lse_dims = {static_cast<hsize_t>(shape.rows),
                                         static_cast<hsize_t>(shape.heads)};
  const hid_t g = group.get();
  KVAUDIT_TRY(impl.write_dataset(g, group_path, "reference_out", H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE,
                                 out_dims, outputs.reference_out.data()));
  KVAUDIT_TRY(impl.write_dataset(g, group_path, "reference_lse", H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE,
                                 lse_dims, outputs.reference_lse.data()));
  if (!outputs.reference_source_out.empty()) {
    KVAUDIT_TRY(impl.write_dataset(g, group_path, "reference_source_out", H5T_IEEE_F64LE,
                                   H5T_NATIVE_DOUBLE, out_dims,
                                   outputs.reference_source_out.data()));
    KVAUDIT_TRY(impl.write_dataset(g, group_path, "reference_source_lse", H5T_IEEE_F64LE,
                                   H5T_NATIVE_DOUBLE, lse_dims,
                                   outputs.reference_source_lse.data()));
  }
  if (outputs.backend != nullptr) {
    KVAUDIT_TRY(impl.write_dataset(g, group_path, "backend_out", H5T_STD_U16LE, H5T_NATIVE_UINT16,
                                   out_dims, outputs.backend->out_bf16.data()));
    KVAUDIT_TRY(impl.write_dataset(g, group_path, "backend_lse", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT,
                                   lse_dims, outputs.backend->lse.data()));
  }
  return ok_status();
}

Status OutputsWriter::close() {
  if (!impl_) return ok_status();
  impl_->step_groups.clear();
  impl_->steps.reset();
  if (impl_->file.reset() < 0) return impl_->fail("/", "cannot close the file");
  return ok_status();
}

}  // namespace kvaudit
