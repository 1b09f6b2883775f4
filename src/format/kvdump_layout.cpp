// The in-memory kvdump model (src/format/kvdump.hpp): names of the enums and groups, the index
// arithmetic of docs/kvdump-v1.md "Semantics" and pool element access.
#include <fmt/format.h>

#include <algorithm>

#include "src/format/group_scales.hpp"
#include "src/format/kvdump.hpp"

namespace kvaudit {

const char* kv_dtype_name(KvDtype dtype) {
  return dtype == KvDtype::kBfloat16 ? "bfloat16" : "float8_e4m3fn";
}

const char* step_kind_name(StepKind kind) {
  return kind == StepKind::kDecode ? "decode" : "prefill";
}

const char* group_scale_format_name(GroupScaleFormat format) {
  switch (format) {
    case GroupScaleFormat::kPowerOfTwo:
      return "power_of_two";
    case GroupScaleFormat::kE8m0:
      return "e8m0";
    case GroupScaleFormat::kFloat32:
      break;
  }
  return "float32";
}

const char* pool_layout_name(PoolLayout layout) {
  return layout == PoolLayout::kFlashMlaFp8 ? "flashmla_fp8" : "split";
}

const char* index_scale_format_name(IndexScaleFormat format) {
  return format == IndexScaleFormat::kFloat32 ? "float32" : "power_of_two";
}

const char* index_rotation_name(IndexRotation rotation) {
  return rotation == IndexRotation::kNone ? "none" : "hadamard";
}

std::string layer_group_name(int layer_id) { return fmt::format("L{:03d}", layer_id); }

std::string step_group_name(int step_index) { return fmt::format("S{:03d}", step_index); }

// kv_len(b) = (pages - 1) * page_size + kv_last_page_len[b], 0 without pages.
std::int64_t StepMeta::kv_len(int request, int page_size) const {
  const std::int64_t pages = kv_indptr[request + 1] - kv_indptr[request];
  if (pages == 0) return 0;
  return (pages - 1) * page_size + kv_last_page_len[request];
}

std::int64_t StepMeta::slot_of(int request, std::int64_t pos, int page_size) const {
  const std::int64_t page = kv_indices[kv_indptr[request] + pos / page_size];
  return page * page_size + pos % page_size;
}

int StepMeta::request_of_row(int row) const {
  // First b with qo_indptr[b + 1] > row (requests with no rows are skipped over).
  const auto it = std::upper_bound(qo_indptr.begin(), qo_indptr.end(), row);
  return static_cast<int>(it - qo_indptr.begin()) - 1;
}

std::int64_t StepMeta::position_of_row(int row, int page_size) const {
  const int b = request_of_row(row);
  return kv_len(b, page_size) - rows_of(b) + (row - qo_indptr[b]);
}

int DumpLayout::layer_index_of_id(int layer_id) const {
  for (std::size_t i = 0; i < layers.size(); ++i) {
    if (layers[i].layer_id == layer_id) return static_cast<int>(i);
  }
  return -1;
}

KvPool KvPool::zeros(KvDtype dtype, std::int64_t num_slots, int row_width) {
  KvPool pool;
  pool.dtype = dtype;
  pool.num_slots = num_slots;
  pool.row_width = row_width;
  pool.bytes.assign(static_cast<std::size_t>(num_slots) * pool.row_bytes(), 0);
  return pool;
}

KvPool KvPool::zeros_for(const DumpAttributes& attrs, std::int64_t num_slots) {
  KvPool pool;
  pool.dtype = attrs.kv_dtype;
  pool.num_slots = num_slots;
  pool.row_width = attrs.row_width();
  if (attrs.per_token_group()) {
    pool.group_size = attrs.kv_scale_group_size;
    pool.latent_width = attrs.kv_lora_rank;
    pool.scale_format = attrs.kv_scale_format;
    pool.rope_dtype = attrs.kv_rope_dtype;
  }
  pool.bytes.assign(static_cast<std::size_t>(num_slots) * pool.row_bytes(), 0);
  return pool;
}

KvPool KvPool::zeros_like(std::int64_t new_num_slots) const {
  KvPool pool = *this;
  pool.bytes.clear();
  pool.num_slots = new_num_slots;
  pool.bytes.assign(static_cast<std::size_t>(new_num_slots) * pool.row_bytes(), 0);
  return pool;
}

// Byte offset of column col's element in a slot (grouped: the RoPE part follows the scales).
static std::size_t element_offset(const KvPool& pool, int col) {
  if (!pool.grouped()) return static_cast<std::size_t>(col) * pool.bytes_per_element();
  if (col < pool.latent_width) return static_cast<std::size_t>(col);
  const int rope_bytes = pool.rope_dtype == KvDtype::kBfloat16 ? 2 : 1;
  return pool.rope_offset() + static_cast<std::size_t>(col - pool.latent_width) * rope_bytes;
}

static bool element_is_bf16(const KvPool& pool, int col) {
  if (!pool.grouped()) return pool.dtype == KvDtype::kBfloat16;
  return col >= pool.latent_width && pool.rope_dtype == KvDtype::kBfloat16;
}

std::uint16_t KvPool::bf16_bits(std::int64_t slot, int col) const {
  const std::uint8_t* p = row(slot) + element_offset(*this, col);
  return static_cast<std::uint16_t>(p[0] | (p[1] << 8));
}

void KvPool::set_bf16_bits(std::int64_t slot, int col, std::uint16_t bits) {
  std::uint8_t* p = row(slot) + element_offset(*this, col);
  p[0] = static_cast<std::uint8_t>(bits & 0xFF);
  p[1] = static_cast<std::uint8_t>(bits >> 8);
}

float KvPool::element(std::int64_t slot, int col) const {
  if (element_is_bf16(*this, col)) return bf16_to_float(bf16_bits(slot, col));
  return e4m3_decode(row(slot)[element_offset(*this, col)]);
}

double KvPool::dequantized(std::int64_t slot, int col, float kv_scale) const {
  const double value = element(slot, col);
  if (element_is_bf16(*this, col)) return value;
  if (grouped() && col < latent_width) return value * group_scale(slot, col / group_size);
  return value * kv_scale;
}

void KvPool::write_row(std::int64_t slot, const float* values, float kv_scale,
                       bool reciprocal_scale) {
  if (grouped()) {
    write_grouped_row(*this, slot, values, kv_scale, reciprocal_scale);
  } else if (dtype == KvDtype::kBfloat16) {
    for (int c = 0; c < row_width; ++c) set_bf16_bits(slot, c, bf16_from_float(values[c]));
  } else if (reciprocal_scale) {
    std::uint8_t* dst = row(slot);
    for (int c = 0; c < row_width; ++c) dst[c] = kvdump_quantize_reciprocal(values[c], kv_scale);
  } else {
    std::uint8_t* dst = row(slot);
    for (int c = 0; c < row_width; ++c) dst[c] = kvdump_quantize(values[c], kv_scale);
  }
}

}  // namespace kvaudit
