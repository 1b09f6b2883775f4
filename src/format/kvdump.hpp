// kvdump v1 (docs/kvdump-v1.md): the data model, a validating reader and a writer.
//
// Shapes (H = num_heads, Dc = kv_lora_rank, Dr = qk_rope_head_dim, D = Dc + Dr, Nq = rows of a
// step, S = num_pages * page_size slots):
//   kv_cache / kv_cache_after / kv_source : [num_pages, page_size, D]  (read as [S, D])
//   q_nope : [Nq, H, Dc]   q_pe : [Nq, H, Dr]   new_kv : [Nq, D]
//   out    : [Nq, H, Dc]   lse  : [Nq, H]
// bfloat16 tensors are held as float (exact widening); a float32 dataset is accepted in their
// place. Pools are held as raw storage bytes so that integrity checks see exactly what is stored.
//
// The reader (kvdump_reader.cpp) validates every rule of the format's Errors section when it opens
// a file (kvdump_validator.hpp: root attributes, every object's presence, type and shape;
// step_indices.hpp: indptr/indices/slots), without reading the bulk tensors; those are read one
// (layer) or one (step, layer) at a time, so a dump larger than memory can be replayed layer by
// layer. The writer (kvdump_writer.cpp) refuses a step the reader would refuse.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "src/core/fp8_e4m3.hpp"
#include "src/core/result.hpp"

namespace kvaudit {

enum class KvDtype : std::uint8_t { kFloat8E4m3fn, kBfloat16 };
enum class StepKind : std::uint8_t { kPrefill, kDecode };

const char* kv_dtype_name(KvDtype dtype);   // "float8_e4m3fn" | "bfloat16"
const char* step_kind_name(StepKind kind);  // "prefill" | "decode"

struct DumpAttributes {
  std::string model;
  std::string producer;
  int num_heads = 0;         // H
  int kv_lora_rank = 0;      // Dc
  int qk_rope_head_dim = 0;  // Dr
  double sm_scale = 0.0;
  int page_size = 1;
  KvDtype kv_dtype = KvDtype::kFloat8E4m3fn;
  std::string kv_scale_kind = "per_tensor";

  int row_width() const { return kv_lora_rank + qk_rope_head_dim; }  // D
};

struct LayerMeta {
  std::string group;  // "L000" (the name under /layers and /steps/S###)
  int layer_id = 0;
  float kv_scale = 1.0f;
  bool has_source = false;  // kv_source present
};

struct StepMeta {
  std::string group;  // "S000"
  StepKind kind = StepKind::kPrefill;
  std::vector<std::int32_t> qo_indptr;         // [B+1]
  std::vector<std::int32_t> kv_indptr;         // [B+1]
  std::vector<std::int32_t> kv_indices;        // [nnz_pages]
  std::vector<std::int32_t> kv_last_page_len;  // [B]
  std::vector<std::int32_t> new_kv_slots;      // [Nq]
  // Optional captures, per layer index (same order as DumpLayout::layers).
  std::vector<bool> has_out;
  std::vector<bool> has_lse;
  std::vector<bool> has_kv_cache_after;

  int batch_size() const { return static_cast<int>(kv_last_page_len.size()); }
  int num_rows() const { return qo_indptr.empty() ? 0 : qo_indptr.back(); }
  int rows_of(int request) const { return qo_indptr[request + 1] - qo_indptr[request]; }
  // Tokens of request b after this step's writes (0 when it has no page).
  std::int64_t kv_len(int request, int page_size) const;
  // Slot of token position `pos` of request b.
  std::int64_t slot_of(int request, std::int64_t pos, int page_size) const;
  // Request owning query row i.
  int request_of_row(int row) const;
  // Token position of query row i (causal: it sees positions 0..that position).
  std::int64_t position_of_row(int row, int page_size) const;
};

struct DumpLayout {
  int format_version = 1;
  DumpAttributes attrs;
  std::int64_t num_pages = 0;
  std::vector<LayerMeta> layers;  // in /layers order (by name)
  std::vector<StepMeta> steps;    // in numeric order

  std::int64_t num_slots() const { return num_pages * attrs.page_size; }
  int layer_index_of_id(int layer_id) const;  // -1 if absent
};

// A pool of S slots of D elements, as stored: one e4m3 code per element, or two little-endian
// bytes of bf16 bits per element.
struct KvPool {
  KvDtype dtype = KvDtype::kFloat8E4m3fn;
  std::int64_t num_slots = 0;
  int row_width = 0;
  std::vector<std::uint8_t> bytes;

  static KvPool zeros(KvDtype dtype, std::int64_t num_slots, int row_width);
  int bytes_per_element() const { return dtype == KvDtype::kBfloat16 ? 2 : 1; }
  std::size_t row_bytes() const {
    return static_cast<std::size_t>(row_width) * bytes_per_element();
  }
  std::uint8_t* row(std::int64_t slot) { return bytes.data() + slot * row_bytes(); }
  const std::uint8_t* row(std::int64_t slot) const { return bytes.data() + slot * row_bytes(); }
  // Decoded element, before the kv_scale multiplier (e4m3 value or bf16 value).
  float element(std::int64_t slot, int col) const;
  std::uint16_t bf16_bits(std::int64_t slot, int col) const;
  void set_bf16_bits(std::int64_t slot, int col, std::uint16_t bits);
  // kvdump write rule for one slot: fp8 pool -> kvdump_quantize(v, kv_scale) (or, with
  // reciprocal_scale, the named option kvdump_quantize_reciprocal: v * fp32(1 / kv_scale));
  // bf16 pool -> bits of v (v must be a bf16 value).
  void write_row(std::int64_t slot, const float* values, float kv_scale,
                 bool reciprocal_scale = false);
};

struct StepLayerTensors {
  std::vector<float> q_nope;              // [Nq, H, Dc]
  std::vector<float> q_pe;                // [Nq, H, Dr]
  std::vector<float> new_kv;              // [Nq, D]
  std::optional<std::vector<float>> out;  // [Nq, H, Dc], captured
  std::optional<std::vector<float>> lse;  // [Nq, H], captured, natural log
  std::optional<KvPool> kv_cache_after;   // captured pool after the step
};

class DumpReader {
 public:
  // Opens and validates the whole layout. Errors name the file and the HDF5 object.
  static Result<DumpReader> open(const std::filesystem::path& path);

  DumpReader(DumpReader&&) noexcept;
  DumpReader& operator=(DumpReader&&) noexcept;
  ~DumpReader();

  const DumpLayout& layout() const;
  const std::filesystem::path& path() const;

  Result<KvPool> read_pool(std::size_t layer_index) const;                // kv_cache
  Result<std::vector<float>> read_source(std::size_t layer_index) const;  // kv_source [S, D]
  Result<StepLayerTensors> read_step_layer(std::size_t step_index, std::size_t layer_index) const;

 private:
  struct Impl;
  explicit DumpReader(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Writes kvdump v1. Call create, then write_layer for each layer, then for each step write_step
// and write_step_layer for each layer. float tensors named bfloat16 by the format are stored as
// bf16 bits (the values must be bf16-representable; they are rounded to nearest-even otherwise).
class DumpWriter {
 public:
  static Result<DumpWriter> create(const std::filesystem::path& path, const DumpAttributes& attrs,
                                   std::int64_t num_pages);
  DumpWriter(DumpWriter&&) noexcept;
  DumpWriter& operator=(DumpWriter&&) noexcept;
  ~DumpWriter();

  Status write_layer(const LayerMeta& layer, const KvPool& kv_cache,
                     const std::vector<float>* kv_source);
  Status write_step(const StepMeta& step);  // indices; per-layer tensors follow
  Status write_step_layer(const StepMeta& step, const LayerMeta& layer,
                          const StepLayerTensors& tensors);
  Status close();

 private:
  struct Impl;
  explicit DumpWriter(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Group names: "L" + 3+ digits, "S" + 3+ digits.
std::string layer_group_name(int layer_id);
std::string step_group_name(int step_index);

}  // namespace kvaudit
