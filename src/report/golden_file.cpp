// Golden file writer and reader (layout in golden_file.hpp, docs/golden-format.md).
// Shapes: out [Nq, H, Dc] u16, lse [Nq, H] f32, pool [S, row_bytes] u8, written rows [Nw,
// row_bytes].
#include "src/report/golden_file.hpp"

#include <fmt/format.h>
#include <hdf5.h>
#include <unistd.h>

#include <cstdint>
#include <map>
#include <string>
#include <system_error>
#include <vector>

#include "src/core/build_info.hpp"
#include "src/core/hdf5_handles.hpp"
#include "src/format/hdf5_objects.hpp"

namespace kvaudit {
namespace {

using h5::with_hdf5_reason;

constexpr const char* kFormatName = "kvaudit-golden";

std::size_t element_count(const std::vector<hsize_t>& dims) {
  std::size_t n = 1;
  for (const hsize_t d : dims) n *= static_cast<std::size_t>(d);
  return n;
}

// ---- writing -----------------------------------------------------------------------------------

class GoldenWriter {
 public:
  explicit GoldenWriter(std::string file_text) : file_text_(std::move(file_text)) {}

  Status create(const std::filesystem::path& path);
  Status write(const Golden& golden);
  Status close();

 private:
  Error fail(const std::string& object, std::string what) const {
    return internal_error(file_text_ + ":" + object, with_hdf5_reason(std::move(what)));
  }
  Status write_root(hid_t root, const Golden& golden) const;
  Status write_entry(hid_t steps, const GoldenEntry& entry);
  Status write_pool(hid_t group, const std::string& path, const GoldenPool& pool) const;

  Status write_attribute(hid_t object, const std::string& path, const char* name, hid_t file_type,
                         hid_t memory_type, const void* value) const;
  Status write_string(hid_t object, const std::string& path, const char* name,
                      const std::string& value) const;
  Status write_int(hid_t object, const std::string& path, const char* name,
                   std::int64_t value) const {
    return write_attribute(object, path, name, H5T_STD_I64LE, H5T_NATIVE_INT64, &value);
  }
  Status write_dataset(hid_t parent, const std::string& parent_path, const char* name,
                       const std::vector<hsize_t>& dims, hid_t file_type, hid_t memory_type,
                       const void* data, const char* dtype = nullptr) const;
  Result<h5::Group> create_group(hid_t parent, const std::string& name,
                                 const std::string& path) const;

  std::string file_text_;
  h5::File file_;
  h5::PropertyList gcpl_;
  h5::PropertyList acpl_;
  std::map<int, h5::Group> step_groups_;
};

Status GoldenWriter::create(const std::filesystem::path& path) {
  h5::silence_hdf5_errors();
  h5::PropertyList fapl(H5Pcreate(H5P_FILE_ACCESS));
  h5::PropertyList fcpl(H5Pcreate(H5P_FILE_CREATE));
  gcpl_ = h5::PropertyList(H5Pcreate(H5P_GROUP_CREATE));
  acpl_ = h5::PropertyList(H5Pcreate(H5P_ATTRIBUTE_CREATE));
  if (!fapl || !fcpl || !gcpl_ || !acpl_ ||
      H5Pset_libver_bounds(fapl.get(), H5F_LIBVER_V18, H5F_LIBVER_V18) < 0 ||
      H5Pset_obj_track_times(fcpl.get(), false) < 0 ||
      H5Pset_obj_track_times(gcpl_.get(), false) < 0 ||
      H5Pset_char_encoding(acpl_.get(), H5T_CSET_UTF8) < 0) {
    return internal_error(file_text_, with_hdf5_reason("cannot set up HDF5 property lists"));
  }
  H5Pset_file_locking(fapl.get(), false, true);
  file_ = h5::File(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, fcpl.get(), fapl.get()));
  if (!file_) return bad_input(file_text_, with_hdf5_reason("cannot create the golden file"));
  return ok_status();
}

Status GoldenWriter::write(const Golden& golden) {
  h5::Group root(H5Gopen2(file_.get(), "/", H5P_DEFAULT));
  if (!root) return fail("/", "cannot open the root group");
  KVAUDIT_TRY(write_root(root.get(), golden));
  KVAUDIT_ASSIGN_OR_RETURN(const h5::Group steps, create_group(root.get(), "steps", "/steps"));
  for (const GoldenEntry& entry : golden.entries) KVAUDIT_TRY(write_entry(steps.get(), entry));
  step_groups_.clear();
  return ok_status();
}

Status GoldenWriter::close() {
  if (file_.reset() < 0) return internal_error(file_text_, with_hdf5_reason("cannot close"));
  return ok_status();
}

Status GoldenWriter::write_root(hid_t root, const Golden& golden) const {
  const GoldenProvenance& p = golden.provenance;
  KVAUDIT_TRY(write_string(root, "/", "format", kFormatName));
  KVAUDIT_TRY(write_int(root, "/", "format_version", golden.format_version));
  KVAUDIT_TRY(write_string(root, "/", "dump_path", p.dump_path));
  KVAUDIT_TRY(write_string(root, "/", "dump_sha256", p.dump_sha256));
  KVAUDIT_TRY(write_string(root, "/", "backend", p.backend));
  KVAUDIT_TRY(write_string(root, "/", "backend_description", p.backend_description.dump()));
  KVAUDIT_TRY(write_string(root, "/", "kvaudit_version", p.kvaudit_version));
  KVAUDIT_TRY(write_string(root, "/", "kvaudit_revision", p.kvaudit_revision));
  KVAUDIT_TRY(write_int(root, "/", "kvaudit_dirty", p.kvaudit_dirty ? 1 : 0));
  KVAUDIT_TRY(write_string(root, "/", "platform", p.platform.dump()));
  KVAUDIT_TRY(write_string(root, "/", "policy", p.policy));
  KVAUDIT_TRY(write_string(root, "/", "date_utc", p.date_utc));
  KVAUDIT_TRY(write_string(root, "/", "host", p.host));
  KVAUDIT_TRY(write_string(root, "/", "command_line", p.command_line));
  KVAUDIT_TRY(write_int(root, "/", "whole_pool_max_bytes", golden.whole_pool_max_bytes));
  KVAUDIT_TRY(write_dataset(root, "/", "layer_ids", {golden.layer_ids.size()}, H5T_STD_I32LE,
                            H5T_NATIVE_INT, golden.layer_ids.data()));
  return write_dataset(root, "/", "step_indices", {golden.step_indices.size()}, H5T_STD_I32LE,
                       H5T_NATIVE_INT, golden.step_indices.data());
}

Status GoldenWriter::write_entry(hid_t steps, const GoldenEntry& entry) {
  const std::string step_name = step_group_name(entry.step);
  auto step = step_groups_.find(entry.step);
  if (step == step_groups_.end()) {
    KVAUDIT_ASSIGN_OR_RETURN(h5::Group group,
                             create_group(steps, step_name, "/steps/" + step_name));
    step = step_groups_.emplace(entry.step, std::move(group)).first;
  }
  const std::string layer_name = layer_group_name(entry.layer_id);
  const std::string path = fmt::format("/steps/{}/{}", step_name, layer_name);
  KVAUDIT_ASSIGN_OR_RETURN(const h5::Group group,
                           create_group(step->second.get(), layer_name, path));
  const hid_t g = group.get();
  KVAUDIT_TRY(write_int(g, path, "step", entry.step));
  KVAUDIT_TRY(write_int(g, path, "layer_id", entry.layer_id));
  const TensorShape3& shape = entry.shape;
  const auto rows = static_cast<hsize_t>(shape.rows);
  const auto heads = static_cast<hsize_t>(shape.heads);
  KVAUDIT_TRY(write_dataset(g, path, "out", {rows, heads, static_cast<hsize_t>(shape.dims)},
                            H5T_STD_U16LE, H5T_NATIVE_UINT16, entry.out.data(), "bfloat16"));
  KVAUDIT_TRY(write_dataset(g, path, "lse", {rows, heads}, H5T_IEEE_F32LE, H5T_NATIVE_FLOAT,
                            entry.lse.data()));
  return write_pool(g, path, entry.pool);
}

Status GoldenWriter::write_pool(hid_t group, const std::string& path,
                                const GoldenPool& pool) const {
  KVAUDIT_TRY(write_string(group, path, "pool_storage", pool_storage_name(pool.storage)));
  KVAUDIT_TRY(write_string(group, path, "pool_dtype", kv_dtype_name(pool.dtype)));
  KVAUDIT_TRY(write_int(group, path, "pool_num_slots", pool.num_slots));
  KVAUDIT_TRY(write_int(group, path, "pool_row_width", pool.row_width));
  KVAUDIT_TRY(write_string(group, path, "pool_sha256", pool.sha256));
  if (!pool.unwritten_sha256.empty()) {
    KVAUDIT_TRY(write_string(group, path, "pool_unwritten_sha256", pool.unwritten_sha256));
  }
  KVAUDIT_TRY(write_dataset(group, path, "pool_written_slots", {pool.written_slots.size()},
                            H5T_STD_I64LE, H5T_NATIVE_INT64, pool.written_slots.data()));
  const auto row_bytes = static_cast<hsize_t>(pool.row_bytes());
  if (pool.storage == PoolStorage::kWhole) {
    return write_dataset(group, path, "pool", {static_cast<hsize_t>(pool.num_slots), row_bytes},
                         H5T_STD_U8LE, H5T_NATIVE_UINT8, pool.rows.data());
  }
  return write_dataset(group, path, "pool_written_rows", {pool.written_slots.size(), row_bytes},
                       H5T_STD_U8LE, H5T_NATIVE_UINT8, pool.rows.data());
}

Status GoldenWriter::write_attribute(hid_t object, const std::string& path, const char* name,
                                     hid_t file_type, hid_t memory_type, const void* value) const {
  h5::Dataspace space(H5Screate(H5S_SCALAR));
  h5::Attribute attribute(
      H5Acreate2(object, name, file_type, space.get(), acpl_.get(), H5P_DEFAULT));
  if (!attribute || H5Awrite(attribute.get(), memory_type, value) < 0) {
    return fail(path, fmt::format("cannot write attribute {}", name));
  }
  return ok_status();
}

// Fixed-length, NUL-padded UTF-8 (as kvdump_writer.cpp, for the same reason: no global heap).
Status GoldenWriter::write_string(hid_t object, const std::string& path, const char* name,
                                  const std::string& value) const {
  const std::string stored = value.empty() ? std::string(1, '\0') : value;
  h5::Type type(H5Tcopy(H5T_C_S1));
  if (!type || H5Tset_size(type.get(), stored.size()) < 0 ||
      H5Tset_strpad(type.get(), H5T_STR_NULLPAD) < 0 ||
      H5Tset_cset(type.get(), H5T_CSET_UTF8) < 0) {
    return fail(path, "cannot make a string type");
  }
  return write_attribute(object, path, name, type.get(), type.get(), stored.data());
}

// Non-empty datasets: one chunk holding the whole extent, byte shuffle + deflate where the HDF5
// library has the filter (Debian's always does); empty ones contiguous (a chunk cannot be empty).
Status GoldenWriter::write_dataset(hid_t parent, const std::string& parent_path, const char* name,
                                   const std::vector<hsize_t>& dims, hid_t file_type,
                                   hid_t memory_type, const void* data, const char* dtype) const {
  const std::string path = join_path(parent_path, name);
  h5::Dataspace space(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr));
  if (!space) return fail(path, "cannot create dataspace " + h5::shape_text(dims));
  h5::PropertyList dcpl(H5Pcreate(H5P_DATASET_CREATE));
  if (!dcpl || H5Pset_obj_track_times(dcpl.get(), false) < 0) {
    return fail(path, "cannot set up the dataset");
  }
  const std::size_t count = element_count(dims);
  if (count > 0 && H5Zfilter_avail(H5Z_FILTER_DEFLATE) > 0 &&
      (H5Pset_chunk(dcpl.get(), static_cast<int>(dims.size()), dims.data()) < 0 ||
       H5Pset_shuffle(dcpl.get()) < 0 || H5Pset_deflate(dcpl.get(), 9) < 0)) {
    return fail(path, "cannot set up compression");
  }
  h5::Dataset dataset(
      H5Dcreate2(parent, name, file_type, space.get(), H5P_DEFAULT, dcpl.get(), H5P_DEFAULT));
  if (!dataset) return fail(path, "cannot create dataset");
  if (count > 0 && H5Dwrite(dataset.get(), memory_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data) < 0) {
    return fail(path, "cannot write dataset");
  }
  if (dtype != nullptr) KVAUDIT_TRY(write_string(dataset.get(), path, "dtype", dtype));
  return ok_status();
}

Result<h5::Group> GoldenWriter::create_group(hid_t parent, const std::string& name,
                                             const std::string& path) const {
  h5::Group group(H5Gcreate2(parent, name.c_str(), H5P_DEFAULT, gcpl_.get(), H5P_DEFAULT));
  if (!group) return fail(path, "cannot create group");
  return group;
}

// ---- reading -----------------------------------------------------------------------------------

class GoldenReader {
 public:
  explicit GoldenReader(const std::filesystem::path& path) : objects_(path.string()) {}

  Result<Golden> read(const std::filesystem::path& path);

 private:
  Status read_root(hid_t root, Golden& golden) const;
  Result<GoldenEntry> read_entry(hid_t group, const std::string& path) const;
  Status read_pool(hid_t group, const std::string& path, GoldenPool& pool) const;
  // The dataset `name`, of class `element` and shape `dims`, read as `memory_type` into `values`.
  template <typename T>
  Status read_array(hid_t group, const std::string& group_path, const char* name,
                    ElementClass element, hid_t memory_type, const std::vector<hsize_t>& dims,
                    std::vector<T>& values) const;
  // A 1-D dataset of any length.
  template <typename T>
  Status read_vector(hid_t group, const std::string& group_path, const char* name,
                     ElementClass element, hid_t memory_type, std::vector<T>& values) const;

  ObjectReader objects_;
};

Result<Golden> GoldenReader::read(const std::filesystem::path& path) {
  h5::silence_hdf5_errors();
  std::error_code error;
  if (!std::filesystem::is_regular_file(path, error)) {
    return bad_input(path.string(), "no such golden file");
  }
  if (H5Fis_hdf5(path.c_str()) <= 0) {
    return bad_input(path.string(), with_hdf5_reason("not an HDF5 file (a golden file is HDF5)"));
  }
  h5::PropertyList fapl(H5Pcreate(H5P_FILE_ACCESS));
  if (fapl) H5Pset_file_locking(fapl.get(), false, true);
  const h5::File file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl.get()));
  if (!file) return bad_input(path.string(), with_hdf5_reason("cannot open the golden file"));
  const h5::Group root(H5Gopen2(file.get(), "/", H5P_DEFAULT));
  if (!root) return objects_.bad("/", with_hdf5_reason("cannot open the root group"));
  Golden golden;
  KVAUDIT_TRY(read_root(root.get(), golden));
  KVAUDIT_ASSIGN_OR_RETURN(const h5::Group steps,
                           objects_.open_group(root.get(), "/steps", "missing group"));
  KVAUDIT_ASSIGN_OR_RETURN(const std::vector<std::string> step_names,
                           objects_.link_names(steps.get(), "/steps"));
  for (const std::string& step_name : step_names) {
    const std::string step_path = "/steps/" + step_name;
    KVAUDIT_ASSIGN_OR_RETURN(const h5::Group step,
                             objects_.open_group(steps.get(), step_path, "missing group"));
    KVAUDIT_ASSIGN_OR_RETURN(const std::vector<std::string> layer_names,
                             objects_.link_names(step.get(), step_path));
    for (const std::string& layer_name : layer_names) {
      const std::string path = step_path + "/" + layer_name;
      KVAUDIT_ASSIGN_OR_RETURN(const h5::Group group,
                               objects_.open_group(step.get(), path, "missing group"));
      KVAUDIT_ASSIGN_OR_RETURN(GoldenEntry entry, read_entry(group.get(), path));
      golden.entries.push_back(std::move(entry));
    }
  }
  return golden;
}

Status GoldenReader::read_root(hid_t root, Golden& golden) const {
  KVAUDIT_ASSIGN_OR_RETURN(const std::string format, objects_.read_string(root, "/", "format"));
  if (format != kFormatName) {
    return objects_.bad("/", fmt::format("format is '{}', not '{}'", format, kFormatName));
  }
  KVAUDIT_ASSIGN_OR_RETURN(const std::int64_t version,
                           objects_.read_int(root, "/", "format_version"));
  if (version != kGoldenFormatVersion) {
    return objects_.bad("/", fmt::format("format_version {} is not supported (this kvaudit reads "
                                         "version {}; re-record the golden file)",
                                         version, kGoldenFormatVersion));
  }
  golden.format_version = static_cast<int>(version);
  GoldenProvenance& p = golden.provenance;
  const auto text = [&](const char* name, std::string& value) -> Status {
    KVAUDIT_ASSIGN_OR_RETURN(value, objects_.read_string(root, "/", name));
    return ok_status();
  };
  KVAUDIT_TRY(text("dump_path", p.dump_path));
  KVAUDIT_TRY(text("dump_sha256", p.dump_sha256));
  KVAUDIT_TRY(text("backend", p.backend));
  std::string description;
  KVAUDIT_TRY(text("backend_description", description));
  p.backend_description = nlohmann::json::parse(description, nullptr, false);
  if (p.backend_description.is_discarded()) {
    return objects_.bad("/", "attribute backend_description is not JSON");
  }
  KVAUDIT_TRY(text("kvaudit_version", p.kvaudit_version));
  KVAUDIT_TRY(text("kvaudit_revision", p.kvaudit_revision));
  // kvaudit_dirty was added to version 1; a file without it says "-dirty" in the revision.
  p.kvaudit_dirty = revision_is_dirty(p.kvaudit_revision);
  if (H5Aexists(root, "kvaudit_dirty") > 0) {
    KVAUDIT_ASSIGN_OR_RETURN(const std::int64_t dirty,
                             objects_.read_int_in(root, "/", "kvaudit_dirty", 0, 1));
    p.kvaudit_dirty = p.kvaudit_dirty || dirty == 1;
  }
  std::string platform;
  KVAUDIT_TRY(text("platform", platform));
  p.platform = nlohmann::json::parse(platform, nullptr, false);
  if (p.platform.is_discarded()) return objects_.bad("/", "attribute platform is not JSON");
  KVAUDIT_TRY(text("policy", p.policy));
  KVAUDIT_TRY(text("date_utc", p.date_utc));
  KVAUDIT_TRY(text("host", p.host));
  KVAUDIT_TRY(text("command_line", p.command_line));
  KVAUDIT_ASSIGN_OR_RETURN(golden.whole_pool_max_bytes,
                           objects_.read_int(root, "/", "whole_pool_max_bytes"));
  KVAUDIT_TRY(read_vector(root, "/", "layer_ids", ElementClass::kOtherInteger, H5T_NATIVE_INT,
                          golden.layer_ids));
  return read_vector(root, "/", "step_indices", ElementClass::kOtherInteger, H5T_NATIVE_INT,
                     golden.step_indices);
}

Result<GoldenEntry> GoldenReader::read_entry(hid_t group, const std::string& path) const {
  GoldenEntry entry;
  KVAUDIT_ASSIGN_OR_RETURN(entry.step, objects_.read_int_in(group, path, "step", 0, 1 << 30));
  KVAUDIT_ASSIGN_OR_RETURN(entry.layer_id,
                           objects_.read_int_in(group, path, "layer_id", 0, 1 << 30));
  KVAUDIT_ASSIGN_OR_RETURN(const DatasetDesc out, objects_.describe(group, path, "out"));
  if (out.dims.size() != 3) {
    return objects_.bad(out.path,
                        fmt::format("shape {} is not [Nq, H, Dc]", h5::shape_text(out.dims)));
  }
  entry.shape = TensorShape3{static_cast<int>(out.dims[0]), static_cast<int>(out.dims[1]),
                             static_cast<int>(out.dims[2])};
  KVAUDIT_TRY(
      read_array(group, path, "out", ElementClass::kU16, H5T_NATIVE_UINT16, out.dims, entry.out));
  KVAUDIT_TRY(read_array(group, path, "lse", ElementClass::kFloat32, H5T_NATIVE_FLOAT,
                         {out.dims[0], out.dims[1]}, entry.lse));
  KVAUDIT_TRY(read_pool(group, path, entry.pool));
  return entry;
}

Status GoldenReader::read_pool(hid_t group, const std::string& path, GoldenPool& pool) const {
  KVAUDIT_ASSIGN_OR_RETURN(const std::string storage,
                           objects_.read_string(group, path, "pool_storage"));
  if (storage != "whole" && storage != "digest") {
    return objects_.bad(path,
                        fmt::format("pool_storage '{}' is neither whole nor digest", storage));
  }
  pool.storage = storage == "whole" ? PoolStorage::kWhole : PoolStorage::kDigest;
  KVAUDIT_ASSIGN_OR_RETURN(const std::string dtype,
                           objects_.read_string(group, path, "pool_dtype"));
  if (dtype != kv_dtype_name(KvDtype::kFloat8E4m3fn) &&
      dtype != kv_dtype_name(KvDtype::kBfloat16)) {
    return objects_.bad(path, fmt::format("pool_dtype '{}' is not a kvdump kv_dtype", dtype));
  }
  pool.dtype =
      dtype == kv_dtype_name(KvDtype::kBfloat16) ? KvDtype::kBfloat16 : KvDtype::kFloat8E4m3fn;
  KVAUDIT_ASSIGN_OR_RETURN(pool.num_slots, objects_.read_int(group, path, "pool_num_slots"));
  KVAUDIT_ASSIGN_OR_RETURN(pool.row_width,
                           objects_.read_int_in(group, path, "pool_row_width", 1, 1 << 20));
  KVAUDIT_ASSIGN_OR_RETURN(pool.sha256, objects_.read_string(group, path, "pool_sha256"));
  if (pool.sha256.size() != 64) return objects_.bad(path, "pool_sha256 is not 64 hex digits");
  if (H5Aexists(group, "pool_unwritten_sha256") > 0) {  // digest storage, added to version 1
    KVAUDIT_ASSIGN_OR_RETURN(pool.unwritten_sha256,
                             objects_.read_string(group, path, "pool_unwritten_sha256"));
    if (pool.unwritten_sha256.size() != 64) {
      return objects_.bad(path, "pool_unwritten_sha256 is not 64 hex digits");
    }
  }
  if (pool.num_slots < 0) return objects_.bad(path, "pool_num_slots is negative");
  KVAUDIT_TRY(read_vector(group, path, "pool_written_slots", ElementClass::kOtherInteger,
                          H5T_NATIVE_INT64, pool.written_slots));
  for (const std::int64_t slot : pool.written_slots) {
    if (slot < 0 || slot >= pool.num_slots) {
      return objects_.bad(
          path + "/pool_written_slots",
          fmt::format("slot {} is outside the pool's {} slots", slot, pool.num_slots));
    }
  }
  const auto row_bytes = static_cast<hsize_t>(pool.row_bytes());
  if (pool.storage == PoolStorage::kWhole) {
    return read_array(group, path, "pool", ElementClass::kU8, H5T_NATIVE_UINT8,
                      {static_cast<hsize_t>(pool.num_slots), row_bytes}, pool.rows);
  }
  return read_array(group, path, "pool_written_rows", ElementClass::kU8, H5T_NATIVE_UINT8,
                    {pool.written_slots.size(), row_bytes}, pool.rows);
}

template <typename T>
Status GoldenReader::read_array(hid_t group, const std::string& group_path, const char* name,
                                ElementClass element, hid_t memory_type,
                                const std::vector<hsize_t>& dims, std::vector<T>& values) const {
  KVAUDIT_ASSIGN_OR_RETURN(const DatasetDesc desc, objects_.describe(group, group_path, name));
  if (desc.element != element) {
    return objects_.bad(desc.path,
                        fmt::format("element type {} is not expected here", desc.type_text));
  }
  if (desc.dims != dims) {
    return objects_.bad(desc.path, fmt::format("shape {}, expected {}", h5::shape_text(desc.dims),
                                               h5::shape_text(dims)));
  }
  values.assign(element_count(dims), T{});
  if (values.empty()) return ok_status();
  const h5::Dataset dataset(H5Dopen2(group, name, H5P_DEFAULT));
  if (!dataset ||
      H5Dread(dataset.get(), memory_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()) < 0) {
    return objects_.bad(desc.path, with_hdf5_reason("cannot read the data"));
  }
  return ok_status();
}

template <typename T>
Status GoldenReader::read_vector(hid_t group, const std::string& group_path, const char* name,
                                 ElementClass element, hid_t memory_type,
                                 std::vector<T>& values) const {
  KVAUDIT_ASSIGN_OR_RETURN(const DatasetDesc desc, objects_.describe(group, group_path, name));
  if (desc.dims.size() != 1) {
    return objects_.bad(desc.path,
                        fmt::format("shape {} is not one-dimensional", h5::shape_text(desc.dims)));
  }
  return read_array(group, group_path, name, element, memory_type, desc.dims, values);
}

}  // namespace

Status write_golden_file(const std::filesystem::path& path, const Golden& golden) {
  const std::filesystem::path temporary =
      path.parent_path() / fmt::format(".{}.tmp-{}", path.filename().string(), getpid());
  GoldenWriter writer(path.string());
  Status status = writer.create(temporary);
  if (status.ok()) status = writer.write(golden);
  const Status closed = writer.close();
  if (status.ok()) status = closed;
  std::error_code error;
  if (status.ok()) {
    std::filesystem::rename(temporary, path, error);
    if (error)
      status =
          bad_input(path.string(), "cannot rename the golden file into place: " + error.message());
  }
  if (!status.ok()) std::filesystem::remove(temporary, error);
  return status;
}

Result<Golden> read_golden_file(const std::filesystem::path& path) {
  return GoldenReader(path).read(path);
}

Status check_output_file(const std::filesystem::path& path, const std::string& option) {
  std::error_code error;
  if (std::filesystem::is_directory(path, error)) {
    return bad_input(option, fmt::format("{} is a folder, not a file", path.string()));
  }
  const std::filesystem::path folder =
      path.parent_path().empty() ? std::filesystem::path(".") : path.parent_path();
  if (!std::filesystem::is_directory(folder, error)) {
    return bad_input(option,
                     fmt::format("{}: folder {} does not exist", path.string(), folder.string()));
  }
  if (access(folder.c_str(), W_OK) != 0) {
    return bad_input(option,
                     fmt::format("{}: folder {} is not writable", path.string(), folder.string()));
  }
  return ok_status();
}

}  // namespace kvaudit
