// kvdump v1 reader (docs/kvdump-v1.md): opens a file, has src/format/kvdump_validator.cpp check
// the whole layout, then reads the bulk tensors one layer (pool, source) or one (step, layer) at a
// time.
//
// Shapes (H = num_heads, Dc = kv_lora_rank, Dr = qk_rope_head_dim, D = Dc + Dr, Nq = rows):
//   /layers/L###/kv_cache, kv_source, /steps/S###/L###/kv_cache_after : [num_pages, page_size, D]
//   /steps/S###/L###/q_nope, out : [Nq, H, Dc]   q_pe : [Nq, H, Dr]   new_kv : [Nq, D]
//   /steps/S###/L###/lse : [Nq, H]
//
// Element types (validated at open): bfloat16 tensors are u16 + dtype="bfloat16" or float32 (kept
// exactly as stored; a float32 value is not rounded to bf16, since the write rule quantizes
// fp32(value)); the fp8 pool is u8 + dtype="float8_e4m3fn"; lse is float32.
//
// HDF5 here is the serial (not thread-safe) build: use one DumpReader from one thread at a time.
// Damaged files: HDF5's metadata checksums (v2 superblock and object headers, as kvaudit's writer
// produces) and its end-of-file check make it refuse most damage with an error. One structure has
// no checksum in any HDF5 file format: the global heap holding variable-length strings (h5py's
// default for str attributes). HDF5 1.10 does not bounds-check it (H5HG_read), so a damaged
// global heap can crash or stall the process inside the library; no API reads such a string
// without going through it. kvaudit's own files use fixed-length strings and have no global heap.
#include <fmt/format.h>
#include <hdf5.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "src/core/hdf5_handles.hpp"
#include "src/core/huge_pages.hpp"
#include "src/format/hdf5_objects.hpp"
#include "src/format/kvdump.hpp"
#include "src/format/kvdump_validator.hpp"
#include "src/format/step_indices.hpp"

namespace kvaudit {

using h5::with_hdf5_reason;

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

// The file exists, is not a directory, is not empty and carries the HDF5 signature.
Status check_file(const std::filesystem::path& path, const std::string& file_text) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (ec || !std::filesystem::exists(status)) return bad_input(file_text, "no such file");
  if (std::filesystem::is_directory(status)) return bad_input(file_text, "is a directory");
  if (std::filesystem::is_regular_file(status) && std::filesystem::file_size(path, ec) == 0 &&
      !ec) {
    return bad_input(file_text, "is empty (0 bytes), not an HDF5 file");
  }
  if (H5Fis_hdf5(file_text.c_str()) <= 0) {
    return bad_input(file_text, with_hdf5_reason("is not an HDF5 file (no HDF5 signature)"));
  }
  return ok_status();
}

Result<h5::File> open_read_only(const std::string& file_text) {
  h5::PropertyList fapl(H5Pcreate(H5P_FILE_ACCESS));
  // A dump is only read: do not take a lock, which fails on read-only or network file systems.
  if (fapl) H5Pset_file_locking(fapl.get(), false, true);
  h5::File file(H5Fopen(file_text.c_str(), H5F_ACC_RDONLY, fapl.get()));
  if (!file) {
    return bad_input(file_text,
                     with_hdf5_reason("cannot be opened as HDF5 (truncated or damaged?)"));
  }
  return file;
}

}  // namespace

Result<DumpReader> DumpReader::open(const std::filesystem::path& path) {
  h5::silence_hdf5_errors();
  auto impl = std::make_unique<Impl>();
  impl->path = path;
  impl->file_text = path.string();
  KVAUDIT_TRY(check_file(path, impl->file_text));
  KVAUDIT_ASSIGN_OR_RETURN(impl->file, open_read_only(impl->file_text));
  KVAUDIT_ASSIGN_OR_RETURN(impl->layout, validate_dump_layout(impl->file.get(), impl->file_text));
  H5Eclear2(H5E_DEFAULT);
  return DumpReader(std::move(impl));
}

// ---- bulk reads ---------------------------------------------------------------------------------

namespace {

// Where a bulk read happens: the open file, named `file_text` in errors.
struct BulkSource {
  hid_t file;
  const std::string& file_text;

  std::string where(const std::string& path) const { return file_text + ":" + path; }
};

// Reads a whole dataset whose type and shape open() validated. `elements` is its element count.
// A vector that held as many elements before (a buffer a thread keeps) is not written twice: its
// old values stay until the read overwrites every one of them (or fails, and they go unused).
template <typename T, typename A>
Status read_all(const BulkSource& source, const std::string& path, hid_t memory_type,
                std::size_t elements, std::vector<T, A>* values) {
  try {
    reserve_on_huge_pages(*values, elements);
    values->resize(elements);
  } catch (const std::bad_alloc&) {
    return internal_error(source.where(path),
                          fmt::format("out of memory reading {} bytes", elements * sizeof(T)));
  }
  if (elements == 0) return ok_status();
  h5::Dataset dataset(H5Dopen2(source.file, path.c_str(), H5P_DEFAULT));
  if (!dataset ||
      H5Dread(dataset.get(), memory_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, values->data()) < 0) {
    return bad_input(source.where(path), with_hdf5_reason("cannot read"));
  }
  return ok_status();
}

// Element class of an existing dataset (validated at open).
Result<ElementClass> element_class(const BulkSource& source, const std::string& path) {
  h5::Dataset dataset(H5Dopen2(source.file, path.c_str(), H5P_DEFAULT));
  if (!dataset) return bad_input(source.where(path), with_hdf5_reason("cannot open"));
  h5::Type type(H5Dget_type(dataset.get()));
  if (!type) return bad_input(source.where(path), with_hdf5_reason("cannot read the type"));
  const H5T_class_t cls = H5Tget_class(type.get());
  const std::size_t size = H5Tget_size(type.get());
  if (cls == H5T_INTEGER && size == 1) return ElementClass::kU8;
  if (cls == H5T_INTEGER && size == 2) return ElementClass::kU16;
  if (cls == H5T_FLOAT && size == 4) return ElementClass::kFloat32;
  return bad_input(source.where(path), "element type changed since the file was opened");
}

// A bfloat16-or-float32 tensor as float, into a vector of type Floats (std::vector<float>, or
// CachedFloats for a layer's kv_source: 76 MB a GLM-5 layer, whose blocks the next layer reuses).
// The bf16 bits are read into a buffer each thread keeps (until it ends: the reader thread's lives
// for the check, 2 bytes per element of the largest tensor read, half the float copy's), and the
// floats go to a vector on huge pages (src/core/huge_pages.hpp): a prefill step's q_nope is tens
// of MB, and fresh 4 KiB pages every time cost more than the read.
template <class Floats>
Result<Floats> read_bf16_tensor(const BulkSource& source, const std::string& path,
                                std::size_t elements) {
  KVAUDIT_ASSIGN_OR_RETURN(const ElementClass cls, element_class(source, path));
  Floats values;
  if (cls == ElementClass::kFloat32) {
    KVAUDIT_TRY(read_all(source, path, H5T_NATIVE_FLOAT, elements, &values));
    return values;
  }
  thread_local std::vector<std::uint16_t> bits;
  KVAUDIT_TRY(read_all(source, path, H5T_NATIVE_UINT16, elements, &bits));
  try {
    reserve_on_huge_pages(values, elements);
    values.resize(elements);
  } catch (const std::bad_alloc&) {
    return internal_error(source.where(path),
                          fmt::format("out of memory reading {} bytes", elements * sizeof(float)));
  }
  for (std::size_t i = 0; i < elements; ++i) values[i] = bf16_to_float(bits[i]);
  return values;
}

// The bf16 bits of a bfloat16 pool stored as u16 bits or as float32 values, which must be bf16
// values (the pool stores bf16 bits, so any other float would be changed by reading it).
Result<std::vector<std::uint16_t>> read_bf16_pool_bits(const BulkSource& source,
                                                       const std::string& path,
                                                       std::size_t elements) {
  KVAUDIT_ASSIGN_OR_RETURN(const ElementClass cls, element_class(source, path));
  std::vector<std::uint16_t> bits;
  if (cls != ElementClass::kFloat32) {
    KVAUDIT_TRY(read_all(source, path, H5T_NATIVE_UINT16, elements, &bits));
    return bits;
  }
  std::vector<float> values;
  KVAUDIT_TRY(read_all(source, path, H5T_NATIVE_FLOAT, elements, &values));
  bits.resize(elements);
  for (std::size_t i = 0; i < elements; ++i) {
    bits[i] = bf16_from_float(values[i]);
    if (!std::isnan(values[i]) && bf16_to_float(bits[i]) != values[i]) {
      return bad_input(source.where(path), fmt::format("float32 element {} = {:f} is not a "
                                                       "bfloat16 value",
                                                       i, values[i]));
    }
  }
  return bits;
}

// The bytes of one pool part: e4m3 codes / e8m0 codes / packed bytes as stored, bf16 as
// little-endian bits, float32 scales as little-endian bits; `elements` = slots * part width.
Result<CachedBytes> read_part_bytes(const BulkSource& source, const std::string& path,
                                    PoolPartType type, std::size_t elements) {
  CachedBytes bytes;
  switch (type) {
    case PoolPartType::kE4m3:
    case PoolPartType::kScalesE8m0:
    case PoolPartType::kFlashMlaPacked:
      KVAUDIT_TRY(read_all(source, path, H5T_NATIVE_UINT8, elements, &bytes));
      return bytes;
    case PoolPartType::kBf16: {
      KVAUDIT_ASSIGN_OR_RETURN(const std::vector<std::uint16_t> bits,
                               read_bf16_pool_bits(source, path, elements));
      bytes.resize(2 * elements);
      std::memcpy(bytes.data(), bits.data(), bytes.size());  // little-endian hosts only (below)
      return bytes;
    }
    case PoolPartType::kScalesF32: {
      std::vector<float> scales;
      KVAUDIT_TRY(read_all(source, path, H5T_NATIVE_FLOAT, elements, &scales));
      bytes.resize(4 * elements);
      std::memcpy(bytes.data(), scales.data(), bytes.size());
      return bytes;
    }
  }
  return bytes;
}

// A per_token_group pool: the parts' bytes interleaved into the memory form, per slot
// [latent codes][scales][RoPE] (src/format/kvdump.hpp); the packed layout is that form already.
Result<KvPool> read_grouped_pool(const BulkSource& source, const std::string& group_path,
                                 const std::string& pool_name, const DumpLayout& layout) {
  static_assert(std::endian::native == std::endian::little, "pool bytes are little-endian");
  KvPool pool = KvPool::zeros_for(layout.attrs, 0);
  pool.num_slots = layout.num_slots();
  const std::size_t slots = static_cast<std::size_t>(pool.num_slots);
  const std::size_t row_bytes = pool.row_bytes();
  const std::vector<PoolPart> parts = pool_parts(layout.attrs, pool_name);
  if (parts.size() == 1) {  // flashmla_fp8: the memory form already
    KVAUDIT_ASSIGN_OR_RETURN(pool.bytes, read_part_bytes(source, group_path + parts[0].name,
                                                         parts[0].type, slots * row_bytes));
    return pool;
  }
  try {
    pool.bytes.assign(slots * row_bytes, 0);
  } catch (const std::bad_alloc&) {
    return internal_error(source.where(group_path + pool_name), "out of memory");
  }
  for (const PoolPart& part : parts) {
    KVAUDIT_ASSIGN_OR_RETURN(const CachedBytes bytes,
                             read_part_bytes(source, group_path + part.name, part.type,
                                             slots * static_cast<std::size_t>(part.width)));
    for (std::size_t s = 0; s < slots; ++s) {
      std::memcpy(pool.bytes.data() + s * row_bytes + part.slot_offset,
                  bytes.data() + s * part.slot_bytes, part.slot_bytes);
    }
  }
  return pool;
}

// topk_indices [Nq, K] of a (step, layer), checked by the v1.1 rules.
Result<std::vector<std::int32_t>> read_topk(const BulkSource& source, const std::string& path,
                                            const StepMeta& step, int page_size, int k) {
  std::vector<std::int64_t> wide;
  const std::size_t count = static_cast<std::size_t>(step.num_rows()) * k;
  KVAUDIT_TRY(read_all(source, path, H5T_NATIVE_INT64, count, &wide));
  std::vector<std::int32_t> topk(count);
  for (std::size_t i = 0; i < count; ++i) {
    if (wide[i] < -1 || wide[i] > std::numeric_limits<std::int32_t>::max()) {
      return bad_input(
          source.where(path),
          fmt::format("[{}, {}] = {} is neither -1 nor a token position", i / k, i % k, wide[i]));
    }
    topk[i] = static_cast<std::int32_t>(wide[i]);
  }
  KVAUDIT_TRY(check_topk_indices(step, page_size, topk, k, source.where(path)));
  return topk;
}

Result<KvPool> read_pool_dataset(const BulkSource& source, const std::string& path,
                                 const DumpLayout& layout) {
  if (layout.attrs.per_token_group()) {
    const std::size_t slash = path.rfind('/');
    return read_grouped_pool(source, path.substr(0, slash + 1), path.substr(slash + 1), layout);
  }
  KvPool pool;
  pool.dtype = layout.attrs.kv_dtype;
  pool.num_slots = layout.num_slots();
  pool.row_width = layout.attrs.row_width();
  const std::size_t elements = static_cast<std::size_t>(pool.num_slots) * pool.row_width;
  if (pool.dtype == KvDtype::kFloat8E4m3fn) {
    KVAUDIT_TRY(read_all(source, path, H5T_NATIVE_UINT8, elements, &pool.bytes));
    return pool;
  }
  KVAUDIT_ASSIGN_OR_RETURN(const std::vector<std::uint16_t> bits,
                           read_bf16_pool_bits(source, path, elements));
  try {
    pool.bytes.resize(2 * elements);
  } catch (const std::bad_alloc&) {
    return internal_error(source.where(path), "out of memory");
  }
  // The pool holds little-endian bf16 bits.
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
                          fmt::format("layer index {} out of range", layer_index));
  }
  return read_pool_dataset({impl_->file.get(), impl_->file_text},
                           "/layers/" + layout.layers[layer_index].group + "/kv_cache", layout);
}

Result<CachedFloats> DumpReader::read_source(std::size_t layer_index) const {
  const DumpLayout& layout = impl_->layout;
  if (layer_index >= layout.layers.size()) {
    return internal_error(impl_->file_text,
                          fmt::format("layer index {} out of range", layer_index));
  }
  const LayerMeta& layer = layout.layers[layer_index];
  const std::string path = "/layers/" + layer.group + "/kv_source";
  if (!layer.has_source) return bad_input(impl_->file_text + ":" + path, "missing dataset");
  return read_bf16_tensor<CachedFloats>(
      {impl_->file.get(), impl_->file_text}, path,
      static_cast<std::size_t>(layout.num_slots()) * layout.attrs.row_width());
}

Result<StepLayerTensors> DumpReader::read_step_layer(std::size_t step_index,
                                                     std::size_t layer_index) const {
  const DumpLayout& layout = impl_->layout;
  if (step_index >= layout.steps.size() || layer_index >= layout.layers.size()) {
    return internal_error(impl_->file_text,
                          fmt::format("step {} / layer {} out of range", step_index, layer_index));
  }
  const StepMeta& step = layout.steps[step_index];
  const std::string base = "/steps/" + step.group + "/" + layout.layers[layer_index].group + "/";
  const DumpAttributes& a = layout.attrs;
  const std::size_t nq = static_cast<std::size_t>(step.num_rows());
  const std::size_t heads = static_cast<std::size_t>(a.num_heads);
  const BulkSource source{impl_->file.get(), impl_->file_text};
  StepLayerTensors tensors;
  KVAUDIT_ASSIGN_OR_RETURN(
      tensors.q_nope,
      read_bf16_tensor<std::vector<float>>(source, base + "q_nope", nq * heads * a.kv_lora_rank));
  KVAUDIT_ASSIGN_OR_RETURN(
      tensors.q_pe,
      read_bf16_tensor<std::vector<float>>(source, base + "q_pe", nq * heads * a.qk_rope_head_dim));
  KVAUDIT_ASSIGN_OR_RETURN(tensors.new_kv, read_bf16_tensor<std::vector<float>>(
                                               source, base + "new_kv", nq * a.row_width()));
  if (step.has_out[layer_index]) {
    KVAUDIT_ASSIGN_OR_RETURN(tensors.out, read_bf16_tensor<std::vector<float>>(
                                              source, base + "out", nq * heads * a.kv_lora_rank));
    KVAUDIT_ASSIGN_OR_RETURN(const ElementClass out_class, element_class(source, base + "out"));
    tensors.out_storage =
        out_class == ElementClass::kFloat32 ? OutputStorage::kFloat32 : OutputStorage::kBfloat16;
  }
  if (step.has_lse[layer_index]) {
    std::vector<float> lse;
    KVAUDIT_TRY(read_all(source, base + "lse", H5T_NATIVE_FLOAT, nq * heads, &lse));
    tensors.lse = std::move(lse);
  }
  if (step.has_kv_cache_after[layer_index]) {
    KVAUDIT_ASSIGN_OR_RETURN(tensors.kv_cache_after,
                             read_pool_dataset(source, base + "kv_cache_after", layout));
  }
  if (layer_index < step.topk.size() && step.topk[layer_index] > 0) {
    tensors.topk = step.topk[layer_index];
    KVAUDIT_ASSIGN_OR_RETURN(tensors.topk_indices, read_topk_indices(step_index, layer_index));
  }
  return tensors;
}

Result<std::vector<std::int32_t>> DumpReader::read_topk_indices(std::size_t step_index,
                                                                std::size_t layer_index) const {
  const DumpLayout& layout = impl_->layout;
  if (step_index >= layout.steps.size() || layer_index >= layout.layers.size()) {
    return internal_error(impl_->file_text,
                          fmt::format("step {} / layer {} out of range", step_index, layer_index));
  }
  const StepMeta& step = layout.steps[step_index];
  if (layer_index >= step.topk.size() || step.topk[layer_index] == 0) {
    return std::vector<std::int32_t>{};
  }
  const std::string path =
      "/steps/" + step.group + "/" + layout.layers[layer_index].group + "/topk_indices";
  return read_topk(BulkSource{impl_->file.get(), impl_->file_text}, path, step,
                   layout.attrs.page_size, step.topk[layer_index]);
}

// ---- v1.2: the indexer's key cache --------------------------------------------------------------

namespace {

// The layer's indexer attributes, or bad input naming its group where it has none.
Result<IndexerMeta> indexer_of(const DumpLayout& layout, std::size_t layer_index,
                               const std::string& file_text) {
  const LayerMeta& layer = layout.layers[layer_index];
  if (!layer.indexer) {
    return bad_input(file_text + ":/layers/" + layer.group + "/indexer", "missing group");
  }
  return *layer.indexer;
}

}  // namespace

Result<IndexerCache> DumpReader::read_indexer_cache(std::size_t layer_index) const {
  const DumpLayout& layout = impl_->layout;
  if (layer_index >= layout.layers.size()) {
    return internal_error(impl_->file_text,
                          fmt::format("layer index {} out of range", layer_index));
  }
  KVAUDIT_ASSIGN_OR_RETURN(const IndexerMeta meta,
                           indexer_of(layout, layer_index, impl_->file_text));
  const std::string base = "/layers/" + layout.layers[layer_index].group + "/indexer/";
  const std::size_t slots = static_cast<std::size_t>(layout.num_slots());
  const BulkSource source{impl_->file.get(), impl_->file_text};
  IndexerCache cache;
  KVAUDIT_TRY(
      read_all(source, base + "k_cache", H5T_NATIVE_UINT8, slots * meta.head_dim, &cache.codes));
  KVAUDIT_TRY(read_all(source, base + "k_scales", H5T_NATIVE_FLOAT, slots * meta.num_blocks(),
                       &cache.scales));
  KVAUDIT_TRY(
      read_all(source, base + "k_source", H5T_NATIVE_FLOAT, slots * meta.head_dim, &cache.source));
  return cache;
}

Result<StepIndexerTensors> DumpReader::read_step_indexer(std::size_t step_index,
                                                         std::size_t layer_index) const {
  const DumpLayout& layout = impl_->layout;
  if (step_index >= layout.steps.size() || layer_index >= layout.layers.size()) {
    return internal_error(impl_->file_text,
                          fmt::format("step {} / layer {} out of range", step_index, layer_index));
  }
  KVAUDIT_ASSIGN_OR_RETURN(const IndexerMeta meta,
                           indexer_of(layout, layer_index, impl_->file_text));
  const StepMeta& step = layout.steps[step_index];
  const std::string base =
      "/steps/" + step.group + "/" + layout.layers[layer_index].group + "/indexer/";
  const std::size_t nq = static_cast<std::size_t>(step.num_rows());
  const std::size_t heads = static_cast<std::size_t>(meta.n_heads);
  const std::size_t width = static_cast<std::size_t>(meta.head_dim);
  const std::size_t slots = static_cast<std::size_t>(layout.num_slots());
  const BulkSource source{impl_->file.get(), impl_->file_text};
  StepIndexerTensors t;
  KVAUDIT_TRY(read_all(source, base + "q", H5T_NATIVE_FLOAT, nq * heads * width, &t.q));
  KVAUDIT_TRY(read_all(source, base + "weights", H5T_NATIVE_FLOAT, nq * heads, &t.weights));
  KVAUDIT_TRY(read_all(source, base + "new_k", H5T_NATIVE_FLOAT, nq * width, &t.new_k));
  KVAUDIT_TRY(read_all(source, base + "topk_indices", H5T_NATIVE_INT64,
                       nq * static_cast<std::size_t>(meta.topk), &t.topk_indices));
  if (layer_index < step.has_indexer_cache_after.size() &&
      step.has_indexer_cache_after[layer_index]) {
    std::vector<std::uint8_t> codes;
    std::vector<float> scales;
    KVAUDIT_TRY(read_all(source, base + "k_cache_after", H5T_NATIVE_UINT8, slots * width, &codes));
    KVAUDIT_TRY(read_all(source, base + "k_scales_after", H5T_NATIVE_FLOAT,
                         slots * meta.num_blocks(), &scales));
    t.codes_after = std::move(codes);
    t.scales_after = std::move(scales);
  }
  return t;
}

}  // namespace kvaudit
