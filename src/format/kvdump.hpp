// kvdump v1 and v1.1 (docs/kvdump-v1.md): the data model, a validating reader and a writer.
//
// Shapes (H = num_heads, Dc = kv_lora_rank, Dr = qk_rope_head_dim, D = Dc + Dr, Nq = rows of a
// step, S = num_pages * page_size slots):
//   kv_cache / kv_cache_after / kv_source : [num_pages, page_size, D]  (read as [S, D])
//   q_nope : [Nq, H, Dc]   q_pe : [Nq, H, Dr]   new_kv : [Nq, D]
//   out    : [Nq, H, Dc]   lse  : [Nq, H]
// bfloat16 tensors are held as float (exact widening); a float32 dataset is accepted in their
// place. Pools are held as raw storage bytes so that integrity checks see exactly what is stored.
// v1.1 (per_token_group scales, G = Dc / group_size): a slot's bytes are FlashMLA's order,
//   [Dc e4m3 latent codes][G scales: fp32 little-endian, or e8m0 bytes][Dr RoPE: bf16 or e4m3],
// whichever layout the file used (split datasets or the packed flashmla_fp8 slot), so every
// bytewise check covers the scales too. topk_indices : [Nq, K] token positions, -1 padding.
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

#include "src/core/buffer_cache.hpp"
#include "src/core/fp8_e4m3.hpp"
#include "src/core/result.hpp"

namespace kvaudit {

enum class KvDtype : std::uint8_t { kFloat8E4m3fn, kBfloat16 };
enum class StepKind : std::uint8_t { kPrefill, kDecode };
// v1.1: how a per_token_group scale is stored (and chosen by the write rule).
enum class GroupScaleFormat : std::uint8_t { kFloat32, kPowerOfTwo, kE8m0 };
// v1.1: how a per_token_group pool is laid out in the file (the memory form is one, see above).
enum class PoolLayout : std::uint8_t { kSplit, kFlashMlaFp8 };

const char* kv_dtype_name(KvDtype dtype);   // "float8_e4m3fn" | "bfloat16"
const char* step_kind_name(StepKind kind);  // "prefill" | "decode"
const char* group_scale_format_name(
    GroupScaleFormat format);                     // "float32" | "power_of_two" | "e8m0"
const char* pool_layout_name(PoolLayout layout);  // "split" | "flashmla_fp8"

struct DumpAttributes {
  std::string model;
  std::string producer;
  int num_heads = 0;         // H
  int kv_lora_rank = 0;      // Dc
  int qk_rope_head_dim = 0;  // Dr
  double sm_scale = 0.0;
  int page_size = 1;
  KvDtype kv_dtype = KvDtype::kFloat8E4m3fn;
  std::string kv_scale_kind = "per_tensor";  // or "per_token_group" (v1.1)
  // v1.1 (format_minor_version 1); meaningful with kv_scale_kind "per_token_group" only.
  int format_minor_version = 0;
  int kv_scale_group_size = 0;  // channels of the latent per scale; 0 with per_tensor
  GroupScaleFormat kv_scale_format = GroupScaleFormat::kFloat32;
  KvDtype kv_rope_dtype = KvDtype::kFloat8E4m3fn;
  PoolLayout kv_cache_layout = PoolLayout::kSplit;
  // Optional model attributes (docs/kvdump-v1.md): YaRN's rope_factor and rope_mscale_all_dim
  // where the producer recorded them (finite when present). Only the diagnosis of a dropped or
  // doubled mscale^2 reads them; sm_scale stays what the replay uses.
  std::optional<double> rope_factor;
  std::optional<double> rope_mscale_all_dim;

  int row_width() const { return kv_lora_rank + qk_rope_head_dim; }  // D
  bool per_token_group() const { return kv_scale_group_size > 0; }
  int num_scale_groups() const {  // G
    return per_token_group() ? kv_lora_rank / kv_scale_group_size : 0;
  }
};

// v1.2: the DSA indexer's FP8 key cache of a layer (/layers/L###/indexer, docs/kvdump-v1.md
// "Version 1.2"): e4m3 codes [num_pages, P, head_dim] with one float32 scale per block of
// block_size values, its float32 source rows, and per step the indexer's query [Nq, n_heads,
// head_dim], head weights [Nq, n_heads], new key rows [Nq, head_dim] and deployed top-k [Nq, topk].
enum class IndexScaleFormat { kPowerOfTwo, kFloat32 };
enum class IndexRotation { kHadamard, kNone };
const char* index_scale_format_name(IndexScaleFormat format);  // "power_of_two" | "float32"
const char* index_rotation_name(IndexRotation rotation);       // "hadamard" | "none"

struct IndexerMeta {
  int n_heads = 0;     // index_n_heads
  int head_dim = 0;    // index_head_dim
  int block_size = 0;  // index_block_size: values per scale, divides head_dim
  int topk = 0;        // index_topk: K of the steps' indexer topk_indices
  IndexScaleFormat scale_format = IndexScaleFormat::kPowerOfTwo;
  IndexRotation rotation = IndexRotation::kHadamard;
  double softmax_scale = 0.0;
  int num_blocks() const { return head_dim / block_size; }
};

struct LayerMeta {
  std::string group;  // "L000" (the name under /layers and /steps/S###)
  int layer_id = 0;
  float kv_scale = 1.0f;
  bool has_source = false;             // kv_source present
  std::optional<IndexerMeta> indexer;  // v1.2: /layers/L###/indexer present
};

struct StepMeta {
  std::string group;  // "S000"
  StepKind kind = StepKind::kPrefill;
  std::vector<std::int32_t> qo_indptr;         // [B+1]
  std::vector<std::int32_t> kv_indptr;         // [B+1]
  std::vector<std::int32_t> kv_indices;        // [nnz_pages]
  std::vector<std::int32_t> kv_last_page_len;  // [B]
  std::vector<std::int32_t> new_kv_slots;      // [Nq]
  // A step built for attention only (sparse_attention_step): its rows write nothing, so the
  // new_kv_slots rules are not applied to it.
  bool attention_only = false;
  // Optional captures, per layer index (same order as DumpLayout::layers).
  std::vector<bool> has_out;
  std::vector<bool> has_lse;
  std::vector<bool> has_kv_cache_after;
  std::vector<int> topk;                      // K of the layer's topk_indices (v1.1), 0: dense
  std::vector<bool> has_indexer_cache_after;  // v1.2: indexer/k_cache_after present

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
  int format_minor_version = 0;  // 1: v1.1, 2: v1.2
  DumpAttributes attrs;
  std::int64_t num_pages = 0;
  std::vector<LayerMeta> layers;  // in /layers order (by name)
  std::vector<StepMeta> steps;    // in numeric order

  std::int64_t num_slots() const { return num_pages * attrs.page_size; }
  int layer_index_of_id(int layer_id) const;  // -1 if absent
};

// A pool of S slots of D elements, as stored: one e4m3 code per element, or two little-endian
// bytes of bf16 bits per element. A per_token_group pool (group_size > 0, v1.1) stores each slot
// as [latent_width e4m3 codes][G scales][row_width - latent_width RoPE elements of rope_dtype].
struct KvPool {
  KvDtype dtype = KvDtype::kFloat8E4m3fn;
  std::int64_t num_slots = 0;
  int row_width = 0;
  CachedBytes bytes;  // src/core/buffer_cache.hpp: a layer's blocks reuse the last layer's pages
  // per_token_group only (group_size 0: the whole row is `dtype`, one scale per tensor).
  int group_size = 0;
  int latent_width = 0;  // Dc
  GroupScaleFormat scale_format = GroupScaleFormat::kFloat32;
  KvDtype rope_dtype = KvDtype::kFloat8E4m3fn;

  static KvPool zeros(KvDtype dtype, std::int64_t num_slots, int row_width);
  // An all-zero-bytes pool in the dump's form (per_tensor or per_token_group).
  static KvPool zeros_for(const DumpAttributes& attrs, std::int64_t num_slots);
  // An all-zero-bytes pool of num_slots slots in the same form as this one.
  KvPool zeros_like(std::int64_t new_num_slots) const;
  // Whether `other` has this pool's form: every field but the bytes.
  bool same_form(const KvPool& other) const {
    return dtype == other.dtype && num_slots == other.num_slots && row_width == other.row_width &&
           group_size == other.group_size && latent_width == other.latent_width &&
           scale_format == other.scale_format && rope_dtype == other.rope_dtype;
  }
  bool grouped() const { return group_size > 0; }
  int num_groups() const { return grouped() ? latent_width / group_size : 0; }
  int scale_bytes() const { return scale_format == GroupScaleFormat::kE8m0 ? 1 : 4; }
  int rope_width() const { return row_width - latent_width; }
  // Byte offsets inside a grouped slot.
  std::size_t scales_offset() const { return static_cast<std::size_t>(latent_width); }
  std::size_t rope_offset() const {
    return scales_offset() + static_cast<std::size_t>(num_groups()) * scale_bytes();
  }
  int bytes_per_element() const { return dtype == KvDtype::kBfloat16 ? 2 : 1; }
  std::size_t row_bytes() const {
    if (grouped()) {
      return rope_offset() +
             static_cast<std::size_t>(rope_width()) * (rope_dtype == KvDtype::kBfloat16 ? 2 : 1);
    }
    return static_cast<std::size_t>(row_width) * bytes_per_element();
  }
  std::uint8_t* row(std::int64_t slot) { return bytes.data() + slot * row_bytes(); }
  const std::uint8_t* row(std::int64_t slot) const { return bytes.data() + slot * row_bytes(); }
  // Decoded element, before any scale (e4m3 value or bf16 value); in a grouped pool, latent
  // elements are the codes' values (without their group's scale) and RoPE elements likewise.
  float element(std::int64_t slot, int col) const;
  // A grouped pool's scale of group g of a slot, decoded (e8m0: 2^(code - 127), 0xFF NaN).
  float group_scale(std::int64_t slot, int group) const;
  void set_group_scale(std::int64_t slot, int group, float scale);  // e8m0: scale a power of 2
  // The real value the format defines for element (slot, col), exactly: code * group scale or
  // code * kv_scale (e4m3; a product of 4 and 24 significant bits, exact in double), bf16 value.
  double dequantized(std::int64_t slot, int col, float kv_scale) const;
  std::uint16_t bf16_bits(std::int64_t slot, int col) const;
  void set_bf16_bits(std::int64_t slot, int col, std::uint16_t bits);
  // kvdump write rule for one slot: fp8 pool -> kvdump_quantize(v, kv_scale) (or, with
  // reciprocal_scale, the named option kvdump_quantize_reciprocal: v * fp32(1 / kv_scale));
  // bf16 pool -> bits of v (v must be a bf16 value); grouped pool -> the v1.1 rule
  // (write_grouped_row in src/format/group_scales.hpp).
  void write_row(std::int64_t slot, const float* values, float kv_scale,
                 bool reciprocal_scale = false);
};

// How an attention output was stored: bfloat16 (a backend's `out`, kvdump's `out` dataset), or
// float32 (a `out` dataset of float32 values, kvdump-v1.md "float32 for a bfloat16 tensor").
enum class OutputStorage : std::uint8_t { kBfloat16, kFloat32 };

struct StepLayerTensors {
  std::vector<float> q_nope;              // [Nq, H, Dc]
  std::vector<float> q_pe;                // [Nq, H, Dr]
  std::vector<float> new_kv;              // [Nq, D]
  std::optional<std::vector<float>> out;  // [Nq, H, Dc], captured
  // How the captured out's dataset held it.
  OutputStorage out_storage = OutputStorage::kBfloat16;
  std::optional<std::vector<float>> lse;  // [Nq, H], captured, natural log
  std::optional<KvPool> kv_cache_after;   // captured pool after the step
  // v1.1 sparse attention: [Nq, topk] token positions of the row's request, -1 padding (validated
  // when read: causal, distinct, at least one per row). Empty: dense (every visible token).
  std::vector<std::int32_t> topk_indices;
  int topk = 0;
  bool sparse() const { return topk > 0; }
};

// v1.2: a layer's indexer key cache before the first step (S = num_slots, Di = head_dim,
// Gi = num_blocks): codes [S, Di] e4m3 as stored, scales [S, Gi] float32 (bits as stored),
// source [S, Di] float32.
struct IndexerCache {
  std::vector<std::uint8_t> codes;
  std::vector<float> scales;
  std::vector<float> source;
};

// v1.2: one (step, layer)'s indexer objects: q [Nq, Hi, Di], weights [Nq, Hi], new_k [Nq, Di]
// (float32), topk_indices [Nq, K] as stored (int64: not checked against the step, since whether
// they are a valid top-k is what the indexer check judges), and the cache after the step where
// captured (codes_after [S, Di], scales_after [S, Gi]).
struct StepIndexerTensors {
  std::vector<float> q;
  std::vector<float> weights;
  std::vector<float> new_k;
  std::vector<std::int64_t> topk_indices;
  std::optional<std::vector<std::uint8_t>> codes_after;
  std::optional<std::vector<float>> scales_after;
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

  Result<KvPool> read_pool(std::size_t layer_index) const;  // kv_cache
  // kv_source [S, D], in a CachedFloats (src/core/buffer_cache.hpp): a layer's source is tens of
  // MB, and the next layer's read reuses the block once this one is freed.
  Result<CachedFloats> read_source(std::size_t layer_index) const;
  Result<StepLayerTensors> read_step_layer(std::size_t step_index, std::size_t layer_index) const;
  // topk_indices of a sparse (step, layer) [Nq, K], checked by the v1.1 rules (check_topk_indices);
  // empty for a dense one. read_step_layer reads them too; `kvaudit info` reads only these.
  Result<std::vector<std::int32_t>> read_topk_indices(std::size_t step_index,
                                                      std::size_t layer_index) const;
  // v1.2: the layer's indexer cache and one (step, layer)'s indexer objects (bad input naming the
  // object where the layer has no indexer).
  Result<IndexerCache> read_indexer_cache(std::size_t layer_index) const;
  Result<StepIndexerTensors> read_step_indexer(std::size_t step_index,
                                               std::size_t layer_index) const;

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
