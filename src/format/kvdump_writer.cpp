// kvdump v1 and v1.1 writer (docs/kvdump-v1.md).
//
// Shapes (H = num_heads, Dc = kv_lora_rank, Dr = qk_rope_head_dim, D = Dc + Dr, Nq = rows):
//   /layers/L###/kv_cache, kv_source, /steps/S###/L###/kv_cache_after : [num_pages, page_size, D]
//   /steps/S###/L###/q_nope, out : [Nq, H, Dc]   q_pe : [Nq, H, Dr]   new_kv : [Nq, D]
//   /steps/S###/L###/lse : [Nq, H]   /steps/S###/{qo,kv}_indptr : [B+1] ...
//
// Stored types: bfloat16 tensors as H5T_STD_U16LE bits + dtype="bfloat16" (float inputs rounded
// to nearest-even, exact for bf16 values); the fp8 pool as H5T_STD_U8LE codes +
// dtype="float8_e4m3fn"; lse as H5T_IEEE_F32LE; indices as H5T_STD_I32LE; strings as
// fixed-length NUL-padded UTF-8 scalars.
//
// The file is written under a temporary name in its folder and renamed onto the path given to
// create() by a close() that finds it complete (src/core/output_file.hpp): a writer closed with an
// error, destroyed without close(), or a process that dies on the way leaves no partial dump (and
// an existing file of that name unchanged).
//
// The output is deterministic: no object timestamps (H5Pset_obj_track_times false), contiguous
// storage, fixed object order and the 1.8 file-format objects (H5F_LIBVER_V18), whose metadata
// carries checksums so a damaged file is refused by HDF5 rather than misparsed. Identical input
// gives identical bytes.
#include <fmt/format.h>
#include <hdf5.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "src/core/hdf5_handles.hpp"
#include "src/core/output_file.hpp"
#include "src/format/kvdump.hpp"
#include "src/format/kvdump_validator.hpp"
#include "src/format/step_indices.hpp"

namespace kvaudit {
namespace {

using h5::shape_text;
using h5::with_hdf5_reason;

std::size_t element_count(const std::vector<hsize_t>& dims) {
  std::size_t n = 1;
  for (hsize_t d : dims) n *= static_cast<std::size_t>(d);
  return n;
}

}  // namespace

struct DumpWriter::Impl {
  std::filesystem::path file_path;
  std::string file_text;
  std::optional<AtomicOutputFile> output;  // the temporary the file is written to
  h5::File file;
  h5::PropertyList gcpl;  // groups: no timestamps
  h5::PropertyList dcpl;  // datasets: no timestamps, contiguous
  h5::PropertyList acpl;  // attributes: UTF-8 names
  DumpAttributes attrs;
  std::int64_t num_pages = 0;
  std::vector<LayerMeta> layers;  // written, in order
  struct StepState {
    std::string group;
    std::set<std::string> layers_written;
  };
  std::vector<StepState> steps;

  Error fail(const std::string& object, std::string what) const {
    return internal_error(file_text + ":" + object, with_hdf5_reason(std::move(what)));
  }
  Error misuse(const std::string& object, std::string what) const {
    return internal_error(file_text + ":" + object, std::move(what));
  }
  // A step is complete once every layer has its (step, layer) group.
  bool last_step_complete() const {
    return steps.empty() || steps.back().layers_written.size() == layers.size();
  }
  Error incomplete_last_step() const {
    return misuse("/steps/" + steps.back().group,
                  fmt::format("has {} of {} layers written", steps.back().layers_written.size(),
                              layers.size()));
  }

  // The file-access, file-creation and object-creation property lists of a deterministic file.
  Status set_up_property_lists(h5::PropertyList* fapl, h5::PropertyList* fcpl);
  Status write_root_attributes(hid_t root) const;
  // The layer group name of the next (step, layer) of the last step written, or why there is none.
  Result<std::string> next_step_layer(const StepMeta& step, const LayerMeta& layer) const;
  // q_nope, q_pe, new_kv and the captures present, under the (step, layer) group.
  Status write_step_tensors(hid_t group, const std::string& path, int rows,
                            const StepLayerTensors& tensors) const;

  Result<h5::Group> create_group(hid_t parent, const std::string& name,
                                 const std::string& path) const {
    h5::Group group(H5Gcreate2(parent, name.c_str(), H5P_DEFAULT, gcpl.get(), H5P_DEFAULT));
    if (!group) return fail(path, "cannot create group");
    return group;
  }

  Status write_attribute(hid_t object, const std::string& path, const char* name, hid_t file_type,
                         hid_t memory_type, const void* value) const {
    h5::Dataspace space(H5Screate(H5S_SCALAR));
    h5::Attribute attribute(
        H5Acreate2(object, name, file_type, space.get(), acpl.get(), H5P_DEFAULT));
    if (!attribute || H5Awrite(attribute.get(), memory_type, value) < 0) {
      return fail(path, fmt::format("cannot write attribute {}", name));
    }
    return ok_status();
  }

  // Fixed-length, NUL-padded UTF-8. Variable-length strings would live in a global heap, the one
  // HDF5 metadata structure without a checksum; HDF5 1.10 crashes (H5HG_read) on a damaged one, so
  // kvaudit's own files avoid it and every metadata byte stays checksummed.
  Status write_string(hid_t object, const std::string& path, const char* name,
                      const std::string& value) const {
    std::string stored = value.empty() ? std::string(1, '\0') : value;
    h5::Type type(H5Tcopy(H5T_C_S1));
    if (!type || H5Tset_size(type.get(), stored.size()) < 0 ||
        H5Tset_strpad(type.get(), H5T_STR_NULLPAD) < 0 ||
        H5Tset_cset(type.get(), H5T_CSET_UTF8) < 0) {
      return fail(path, "cannot make a string type");
    }
    return write_attribute(object, path, name, type.get(), type.get(), stored.data());
  }

  Status write_int(hid_t object, const std::string& path, const char* name,
                   std::int32_t value) const {
    return write_attribute(object, path, name, H5T_STD_I32LE, H5T_NATIVE_INT32, &value);
  }

  Status write_dataset(hid_t parent, const std::string& parent_path, const char* name,
                       const std::vector<hsize_t>& dims, hid_t file_type, hid_t memory_type,
                       const void* data, const char* dtype) const {
    const std::string path = parent_path + "/" + name;
    h5::Dataspace space(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr));
    if (!space) return fail(path, "cannot create dataspace " + shape_text(dims));
    h5::Dataset dataset(
        H5Dcreate2(parent, name, file_type, space.get(), H5P_DEFAULT, dcpl.get(), H5P_DEFAULT));
    if (!dataset) return fail(path, "cannot create dataset");
    if (element_count(dims) > 0 &&
        H5Dwrite(dataset.get(), memory_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, data) < 0) {
      return fail(path, "cannot write dataset");
    }
    if (dtype != nullptr) KVAUDIT_TRY(write_string(dataset.get(), path, "dtype", dtype));
    return ok_status();
  }

  // float values stored as bf16 bits (u16 + dtype), rounded to nearest-even.
  Status write_bf16(hid_t parent, const std::string& parent_path, const char* name,
                    const std::vector<hsize_t>& dims, const std::vector<float>& values) const {
    if (values.size() != element_count(dims)) {
      return misuse(parent_path + "/" + name,
                    fmt::format("holds {} values; shape {} needs {}", values.size(),
                                shape_text(dims), element_count(dims)));
    }
    std::vector<std::uint16_t> bits(values.size());
    for (std::size_t i = 0; i < values.size(); ++i) bits[i] = bf16_from_float(values[i]);
    return write_dataset(parent, parent_path, name, dims, H5T_STD_U16LE, H5T_NATIVE_UINT16,
                         bits.data(), "bfloat16");
  }

  Status write_int32(hid_t parent, const std::string& parent_path, const char* name,
                     const std::vector<std::int32_t>& values) const {
    return write_dataset(parent, parent_path, name, {static_cast<hsize_t>(values.size())},
                         H5T_STD_I32LE, H5T_NATIVE_INT32, values.data(), nullptr);
  }

  std::vector<hsize_t> pool_dims() const {
    return {static_cast<hsize_t>(num_pages), static_cast<hsize_t>(attrs.page_size),
            static_cast<hsize_t>(attrs.row_width())};
  }

  // A per_token_group pool in the file's layout: its memory form is the packed slot already;
  // the split layout takes each part's bytes out of every slot.
  Status write_grouped_pool(hid_t parent, const std::string& parent_path, const char* name,
                            const KvPool& pool) const {
    const std::vector<PoolPart> parts = pool_parts(attrs, name);
    const std::size_t slots = static_cast<std::size_t>(pool.num_slots);
    const std::size_t row_bytes = pool.row_bytes();
    for (const PoolPart& part : parts) {
      std::vector<hsize_t> dims = pool_dims();
      dims[2] = static_cast<hsize_t>(part.width);
      std::vector<std::uint8_t> bytes(slots * part.slot_bytes);
      for (std::size_t s = 0; s < slots; ++s) {
        std::memcpy(bytes.data() + s * part.slot_bytes,
                    pool.bytes.data() + s * row_bytes + part.slot_offset, part.slot_bytes);
      }
      switch (part.type) {
        case PoolPartType::kBf16:
          KVAUDIT_TRY(write_dataset(parent, parent_path, part.name.c_str(), dims, H5T_STD_U16LE,
                                    H5T_STD_U16LE, bytes.data(), "bfloat16"));
          break;
        case PoolPartType::kScalesF32:
          KVAUDIT_TRY(write_dataset(parent, parent_path, part.name.c_str(), dims, H5T_IEEE_F32LE,
                                    H5T_IEEE_F32LE, bytes.data(), nullptr));
          break;
        default: {
          const char* dtype = part.type == PoolPartType::kE4m3         ? "float8_e4m3fn"
                              : part.type == PoolPartType::kScalesE8m0 ? "float8_e8m0fnu"
                                                                       : "flashmla_fp8";
          KVAUDIT_TRY(write_dataset(parent, parent_path, part.name.c_str(), dims, H5T_STD_U8LE,
                                    H5T_NATIVE_UINT8, bytes.data(), dtype));
        }
      }
    }
    return ok_status();
  }

  Status write_pool(hid_t parent, const std::string& parent_path, const char* name,
                    const KvPool& pool) const {
    const std::string path = parent_path + "/" + name;
    if (pool.dtype != attrs.kv_dtype) {
      return misuse(path, fmt::format("pool is {} but the dump's kv_dtype is {}",
                                      kv_dtype_name(pool.dtype), kv_dtype_name(attrs.kv_dtype)));
    }
    if (pool.num_slots != num_pages * attrs.page_size || pool.row_width != attrs.row_width() ||
        pool.bytes.size() != static_cast<std::size_t>(pool.num_slots) * pool.row_bytes()) {
      return misuse(path, fmt::format("pool of {} slots x {} does not match {}", pool.num_slots,
                                      pool.row_width, shape_text(pool_dims())));
    }
    if (pool.grouped()) return write_grouped_pool(parent, parent_path, name, pool);
    if (pool.dtype == KvDtype::kFloat8E4m3fn) {
      return write_dataset(parent, parent_path, name, pool_dims(), H5T_STD_U8LE, H5T_NATIVE_UINT8,
                           pool.bytes.data(), "float8_e4m3fn");
    }
    // The pool holds little-endian bf16 bits; H5T_STD_U16LE stores exactly those bytes.
    return write_dataset(parent, parent_path, name, pool_dims(), H5T_STD_U16LE, H5T_STD_U16LE,
                         pool.bytes.data(), "bfloat16");
  }
};

DumpWriter::DumpWriter(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DumpWriter::DumpWriter(DumpWriter&&) noexcept = default;
DumpWriter& DumpWriter::operator=(DumpWriter&&) noexcept = default;
DumpWriter::~DumpWriter() {
  // Without close(), the dump is abandoned: its temporary is removed, nothing is renamed.
  if (impl_ && impl_->file) impl_->file.reset();
}

namespace {

// The shapes and the scale kind version 1 can describe.
Status check_create_arguments(const std::string& file_text, const DumpAttributes& attrs,
                              std::int64_t num_pages) {
  if (attrs.num_heads < 1 || attrs.kv_lora_rank < 1 || attrs.qk_rope_head_dim < 0 ||
      attrs.page_size < 1 || num_pages < 0) {
    return internal_error(file_text,
                          "invalid shape: num_heads, kv_lora_rank and page_size must be >= 1, "
                          "qk_rope_head_dim and num_pages >= 0");
  }
  const bool grouped = attrs.kv_scale_kind == "per_token_group";
  if (!grouped && attrs.kv_scale_kind != "per_tensor") {
    return internal_error(file_text, fmt::format("kv_scale_kind \"{}\" is neither per_tensor nor "
                                                 "per_token_group",
                                                 attrs.kv_scale_kind));
  }
  if (grouped != attrs.per_token_group() ||
      (grouped && (attrs.kv_lora_rank % attrs.kv_scale_group_size != 0 ||
                   attrs.kv_dtype != KvDtype::kFloat8E4m3fn || attrs.format_minor_version < 1))) {
    return internal_error(file_text,
                          "per_token_group needs kv_scale_group_size dividing "
                          "kv_lora_rank, kv_dtype float8_e4m3fn and "
                          "format_minor_version 1");
  }
  if (grouped && attrs.kv_cache_layout == PoolLayout::kFlashMlaFp8 &&
      (attrs.kv_scale_format == GroupScaleFormat::kE8m0 ||
       attrs.kv_rope_dtype != KvDtype::kBfloat16)) {
    return internal_error(file_text,
                          "flashmla_fp8 needs float32 or power_of_two scales and a "
                          "bfloat16 RoPE part");
  }
  return ok_status();
}

}  // namespace

Status DumpWriter::Impl::set_up_property_lists(h5::PropertyList* fapl, h5::PropertyList* fcpl) {
  *fapl = h5::PropertyList(H5Pcreate(H5P_FILE_ACCESS));
  *fcpl = h5::PropertyList(H5Pcreate(H5P_FILE_CREATE));
  gcpl = h5::PropertyList(H5Pcreate(H5P_GROUP_CREATE));
  dcpl = h5::PropertyList(H5Pcreate(H5P_DATASET_CREATE));
  acpl = h5::PropertyList(H5Pcreate(H5P_ATTRIBUTE_CREATE));
  if (!*fapl || !*fcpl || !gcpl || !dcpl || !acpl ||
      H5Pset_libver_bounds(fapl->get(), H5F_LIBVER_V18, H5F_LIBVER_V18) < 0 ||
      // The file creation list also creates the root group: no timestamps there either.
      H5Pset_obj_track_times(fcpl->get(), false) < 0 ||
      H5Pset_obj_track_times(gcpl.get(), false) < 0 ||
      H5Pset_obj_track_times(dcpl.get(), false) < 0 ||
      H5Pset_layout(dcpl.get(), H5D_CONTIGUOUS) < 0 ||
      H5Pset_char_encoding(acpl.get(), H5T_CSET_UTF8) < 0) {
    return internal_error(file_text, with_hdf5_reason("cannot set up HDF5 property lists"));
  }
  H5Pset_file_locking(fapl->get(), false, true);
  return ok_status();
}

Status DumpWriter::Impl::write_root_attributes(hid_t root) const {
  const std::int32_t version = 1;
  KVAUDIT_TRY(write_string(root, "/", "format", "kvdump"));
  KVAUDIT_TRY(write_int(root, "/", "format_version", version));
  KVAUDIT_TRY(write_string(root, "/", "model", attrs.model));
  KVAUDIT_TRY(write_string(root, "/", "producer", attrs.producer));
  KVAUDIT_TRY(write_int(root, "/", "num_heads", attrs.num_heads));
  KVAUDIT_TRY(write_int(root, "/", "kv_lora_rank", attrs.kv_lora_rank));
  KVAUDIT_TRY(write_int(root, "/", "qk_rope_head_dim", attrs.qk_rope_head_dim));
  KVAUDIT_TRY(
      write_attribute(root, "/", "sm_scale", H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, &attrs.sm_scale));
  KVAUDIT_TRY(write_int(root, "/", "page_size", attrs.page_size));
  KVAUDIT_TRY(write_string(root, "/", "kv_dtype", kv_dtype_name(attrs.kv_dtype)));
  KVAUDIT_TRY(write_string(root, "/", "kv_scale_kind", attrs.kv_scale_kind));
  if (attrs.format_minor_version >= 1) {
    KVAUDIT_TRY(write_int(root, "/", "format_minor_version", attrs.format_minor_version));
  }
  if (attrs.per_token_group()) {
    KVAUDIT_TRY(write_int(root, "/", "kv_scale_group_size", attrs.kv_scale_group_size));
    KVAUDIT_TRY(
        write_string(root, "/", "kv_scale_format", group_scale_format_name(attrs.kv_scale_format)));
    KVAUDIT_TRY(write_string(root, "/", "kv_rope_dtype", kv_dtype_name(attrs.kv_rope_dtype)));
    KVAUDIT_TRY(
        write_string(root, "/", "kv_cache_layout", pool_layout_name(attrs.kv_cache_layout)));
  }
  const std::pair<const char*, const std::optional<double>*> rope[] = {
      {"rope_factor", &attrs.rope_factor}, {"rope_mscale_all_dim", &attrs.rope_mscale_all_dim}};
  for (const auto& [name, value] : rope) {
    if (!value->has_value()) continue;
    KVAUDIT_TRY(write_attribute(root, "/", name, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, &**value));
  }
  return ok_status();
}

Result<DumpWriter> DumpWriter::create(const std::filesystem::path& path,
                                      const DumpAttributes& attrs, std::int64_t num_pages) {
  h5::silence_hdf5_errors();
  auto impl = std::make_unique<Impl>();
  impl->file_path = path;
  impl->file_text = path.string();
  impl->attrs = attrs;
  impl->num_pages = num_pages;
  const std::string& f = impl->file_text;
  KVAUDIT_TRY(check_create_arguments(f, attrs, num_pages));
  h5::PropertyList fapl;
  h5::PropertyList fcpl;
  KVAUDIT_TRY(impl->set_up_property_lists(&fapl, &fcpl));
  KVAUDIT_ASSIGN_OR_RETURN(AtomicOutputFile output, AtomicOutputFile::create(path, ""));
  impl->output.emplace(std::move(output));
  const std::string temp = impl->output->temp_path().string();
  impl->file = h5::File(H5Fcreate(temp.c_str(), H5F_ACC_TRUNC, fcpl.get(), fapl.get()));
  if (!impl->file) return bad_input(f, with_hdf5_reason("cannot create the file"));
  h5::Group root(H5Gopen2(impl->file.get(), "/", H5P_DEFAULT));
  if (!root) return impl->fail("/", "cannot open the root group");
  KVAUDIT_TRY(impl->write_root_attributes(root.get()));
  KVAUDIT_TRY(impl->create_group(root.get(), "layers", "/layers"));
  KVAUDIT_TRY(impl->create_group(root.get(), "steps", "/steps"));
  return DumpWriter(std::move(impl));
}

Status DumpWriter::write_layer(const LayerMeta& layer, const KvPool& kv_cache,
                               const std::vector<float>* kv_source) {
  Impl& w = *impl_;
  if (!w.file) return internal_error(w.file_text, "write_layer after close");
  const std::string name = layer.group.empty() ? layer_group_name(layer.layer_id) : layer.group;
  const std::string path = "/layers/" + name;
  if (!w.steps.empty()) return w.misuse(path, "layers must be written before the first step");
  for (const LayerMeta& other : w.layers) {
    if (other.group == name) return w.misuse(path, "written twice");
  }
  h5::Group layers(H5Gopen2(w.file.get(), "/layers", H5P_DEFAULT));
  if (!layers) return w.fail("/layers", "cannot open");
  KVAUDIT_ASSIGN_OR_RETURN(const h5::Group group, w.create_group(layers.get(), name, path));
  const hid_t g = group.get();
  KVAUDIT_TRY(w.write_int(g, path, "layer_id", layer.layer_id));
  KVAUDIT_TRY(
      w.write_attribute(g, path, "kv_scale", H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, &layer.kv_scale));
  KVAUDIT_TRY(w.write_pool(g, path, "kv_cache", kv_cache));
  if (kv_source != nullptr) {
    KVAUDIT_TRY(w.write_bf16(g, path, "kv_source", w.pool_dims(), *kv_source));
  }
  LayerMeta written = layer;
  written.group = name;
  written.has_source = kv_source != nullptr;
  w.layers.push_back(std::move(written));
  return ok_status();
}

Status DumpWriter::write_step(const StepMeta& step) {
  Impl& w = *impl_;
  if (!w.file) return internal_error(w.file_text, "write_step after close");
  const std::string name =
      step.group.empty() ? step_group_name(static_cast<int>(w.steps.size())) : step.group;
  const std::string path = "/steps/" + name;
  for (const auto& other : w.steps) {
    if (other.group == name) return w.misuse(path, "written twice");
  }
  if (!w.last_step_complete()) return w.incomplete_last_step();
  // Refuse to write a step the reader would refuse.
  const Status indices =
      validate_step_indices(step, w.num_pages, w.attrs.page_size, w.file_text + ":" + path);
  if (!indices.ok()) {
    Error error = indices.error();
    error.kind = ErrorKind::kInternal;
    return error;
  }
  h5::Group steps(H5Gopen2(w.file.get(), "/steps", H5P_DEFAULT));
  if (!steps) return w.fail("/steps", "cannot open");
  KVAUDIT_ASSIGN_OR_RETURN(const h5::Group group, w.create_group(steps.get(), name, path));
  const hid_t g = group.get();
  KVAUDIT_TRY(w.write_string(g, path, "kind", step_kind_name(step.kind)));
  KVAUDIT_TRY(w.write_int32(g, path, "qo_indptr", step.qo_indptr));
  KVAUDIT_TRY(w.write_int32(g, path, "kv_indptr", step.kv_indptr));
  KVAUDIT_TRY(w.write_int32(g, path, "kv_indices", step.kv_indices));
  KVAUDIT_TRY(w.write_int32(g, path, "kv_last_page_len", step.kv_last_page_len));
  KVAUDIT_TRY(w.write_int32(g, path, "new_kv_slots", step.new_kv_slots));
  w.steps.push_back({name, {}});
  return ok_status();
}

Result<std::string> DumpWriter::Impl::next_step_layer(const StepMeta& step,
                                                      const LayerMeta& layer) const {
  const StepState& state = steps.back();
  if (!step.group.empty() && step.group != state.group) {
    return misuse(
        "/steps/" + step.group,
        fmt::format("write_step_layer for a step other than the last written ({})", state.group));
  }
  const std::string layer_name =
      layer.group.empty() ? layer_group_name(layer.layer_id) : layer.group;
  const std::string path = "/steps/" + state.group + "/" + layer_name;
  const bool known = std::any_of(layers.begin(), layers.end(),
                                 [&](const LayerMeta& l) { return l.group == layer_name; });
  if (!known) return misuse(path, "layer not written under /layers");
  if (state.layers_written.count(layer_name) != 0) return misuse(path, "written twice");
  return layer_name;
}

Status DumpWriter::Impl::write_step_tensors(hid_t group, const std::string& path, int rows,
                                            const StepLayerTensors& tensors) const {
  const hsize_t nq = static_cast<hsize_t>(rows);
  const hsize_t heads = static_cast<hsize_t>(attrs.num_heads);
  const hsize_t dc = static_cast<hsize_t>(attrs.kv_lora_rank);
  const hsize_t dr = static_cast<hsize_t>(attrs.qk_rope_head_dim);
  KVAUDIT_TRY(write_bf16(group, path, "q_nope", {nq, heads, dc}, tensors.q_nope));
  KVAUDIT_TRY(write_bf16(group, path, "q_pe", {nq, heads, dr}, tensors.q_pe));
  KVAUDIT_TRY(write_bf16(group, path, "new_kv", {nq, dc + dr}, tensors.new_kv));
  if (tensors.out) KVAUDIT_TRY(write_bf16(group, path, "out", {nq, heads, dc}, *tensors.out));
  if (tensors.lse) {
    if (tensors.lse->size() != nq * heads) {
      return misuse(path + "/lse", fmt::format("holds {} values; expected Nq * num_heads = {}",
                                               tensors.lse->size(), nq * heads));
    }
    KVAUDIT_TRY(write_dataset(group, path, "lse", {nq, heads}, H5T_IEEE_F32LE, H5T_NATIVE_FLOAT,
                              tensors.lse->data(), nullptr));
  }
  if (tensors.kv_cache_after) {
    KVAUDIT_TRY(write_pool(group, path, "kv_cache_after", *tensors.kv_cache_after));
  }
  if (tensors.sparse()) {
    if (attrs.format_minor_version < 1) {
      return misuse(path + "/topk_indices", "is kvdump v1.1: set format_minor_version 1");
    }
    KVAUDIT_TRY(write_dataset(group, path, "topk_indices", {nq, static_cast<hsize_t>(tensors.topk)},
                              H5T_STD_I32LE, H5T_NATIVE_INT32, tensors.topk_indices.data(),
                              nullptr));
  }
  return ok_status();
}

Status DumpWriter::write_step_layer(const StepMeta& step, const LayerMeta& layer,
                                    const StepLayerTensors& tensors) {
  Impl& w = *impl_;
  if (!w.file) return internal_error(w.file_text, "write_step_layer after close");
  if (w.steps.empty()) return internal_error(w.file_text, "write_step_layer before write_step");
  KVAUDIT_ASSIGN_OR_RETURN(const std::string layer_name, w.next_step_layer(step, layer));
  if (tensors.sparse()) {  // refuse indices the reader would refuse
    const Status topk = check_topk_indices(step, w.attrs.page_size, tensors.topk_indices,
                                           tensors.topk, w.file_text + ":topk_indices");
    if (!topk.ok()) {
      Error error = topk.error();
      error.kind = ErrorKind::kInternal;
      return error;
    }
  }
  Impl::StepState& state = w.steps.back();
  const std::string step_path = "/steps/" + state.group;
  const std::string path = step_path + "/" + layer_name;
  h5::Group step_group(H5Gopen2(w.file.get(), step_path.c_str(), H5P_DEFAULT));
  if (!step_group) return w.fail(step_path, "cannot open");
  KVAUDIT_ASSIGN_OR_RETURN(const h5::Group group,
                           w.create_group(step_group.get(), layer_name, path));
  KVAUDIT_TRY(w.write_step_tensors(group.get(), path, step.num_rows(), tensors));
  state.layers_written.insert(layer_name);
  return ok_status();
}

Status DumpWriter::close() {
  Impl& w = *impl_;
  if (!w.file) return ok_status();
  Status complete = ok_status();
  if (w.layers.empty()) {
    complete = w.misuse("/layers", "no layer was written");
  } else if (!w.last_step_complete()) {
    complete = w.incomplete_last_step();
  }
  w.gcpl.reset();
  w.dcpl.reset();
  w.acpl.reset();
  if (H5Fflush(w.file.get(), H5F_SCOPE_LOCAL) < 0 || w.file.reset() < 0) {
    w.output.reset();
    return w.fail("/", "cannot close the file");
  }
  if (!complete.ok()) {
    w.output.reset();  // an incomplete dump is not kept
    return complete;
  }
  const Status committed = w.output->commit();
  w.output.reset();
  return committed;
}

}  // namespace kvaudit
