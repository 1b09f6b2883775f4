// The kvdump v1 validation rules (what is checked: src/format/kvdump_validator.hpp).
//
// The file is walked root, /layers, /steps, in that order and in name (layers) or number (steps)
// order, and the first rule broken is the error, so the same file always gives the same message.
#include "src/format/kvdump_validator.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <utility>
#include <vector>

#include "src/core/hdf5_handles.hpp"
#include "src/format/hdf5_objects.hpp"
#include "src/format/step_indices.hpp"

namespace kvaudit {
namespace {

using h5::shape_text;
using h5::with_hdf5_reason;

constexpr const char* kDtypeBf16 = "bfloat16";
constexpr const char* kDtypeFp8 = "float8_e4m3fn";
constexpr const char* kDtypeF32 = "float32";

// Upper bounds on the root integers. They are far above any real MLA model (Dc = 512, Dr = 64,
// H <= 128) and keep every product of shapes below in int64.
constexpr std::int64_t kMaxDim = 1 << 20;
// An index dataset longer than this (1 GiB of int32) is refused rather than read at open.
constexpr hsize_t kMaxIndexLength = hsize_t{1} << 28;

// ---- element types and shapes ------------------------------------------------------------------

// " (dtype=\"...\")" when the dataset has a dtype attribute, for messages.
std::string dtype_suffix(const DatasetDesc& desc) {
  return desc.dtype ? fmt::format(" (dtype=\"{}\")", *desc.dtype) : std::string();
}

Status expect_shape(const ObjectReader& r, const DatasetDesc& desc,
                    const std::vector<hsize_t>& expected, const std::string& meaning) {
  if (desc.dims == expected) return ok_status();
  return r.bad(desc.path, fmt::format("shape {} disagrees with {} = {}", shape_text(desc.dims),
                                      meaning, shape_text(expected)));
}

// u8 or u16 raw bits need a dtype attribute saying what they encode.
Error missing_dtype(const ObjectReader& r, const DatasetDesc& desc, const char* wanted) {
  return r.bad(desc.path,
               fmt::format("{} dataset without a dtype attribute (raw bits need dtype=\"{}\")",
                           desc.type_text, wanted));
}

// A tensor the format names bfloat16: u16 + dtype "bfloat16", or float32.
Status expect_bf16(const ObjectReader& r, const DatasetDesc& desc) {
  switch (desc.element) {
    case ElementClass::kU16:
      if (!desc.dtype) return missing_dtype(r, desc, kDtypeBf16);
      if (*desc.dtype != kDtypeBf16) {
        return r.bad(desc.path, fmt::format("u16 dataset with dtype=\"{}\"; expected "
                                            "dtype=\"bfloat16\"",
                                            *desc.dtype));
      }
      return ok_status();
    case ElementClass::kFloat32:
      if (desc.dtype && *desc.dtype != kDtypeF32 && *desc.dtype != kDtypeBf16) {
        return r.bad(desc.path, fmt::format("float32 dataset with dtype=\"{}\"", *desc.dtype));
      }
      return ok_status();
    case ElementClass::kU8:
      if (!desc.dtype) return missing_dtype(r, desc, kDtypeBf16);
      [[fallthrough]];
    default:
      return r.bad(desc.path, fmt::format("element type {}{}; expected bfloat16 (u16 with "
                                          "dtype=\"bfloat16\") or float32",
                                          desc.type_text, dtype_suffix(desc)));
  }
}

// A pool tensor: the fp8 codes, or bfloat16 for a bf16 baseline pool.
Status expect_pool_type(const ObjectReader& r, const DatasetDesc& desc, KvDtype kv_dtype) {
  if (kv_dtype == KvDtype::kBfloat16) return expect_bf16(r, desc);
  if (desc.element == ElementClass::kU8) {
    if (!desc.dtype) return missing_dtype(r, desc, kDtypeFp8);
    if (*desc.dtype != kDtypeFp8) {
      return r.bad(desc.path,
                   fmt::format("u8 dataset with dtype=\"{}\"; expected dtype=\"float8_e4m3fn\"",
                               *desc.dtype));
    }
    return ok_status();
  }
  if (desc.element == ElementClass::kU16 && !desc.dtype) return missing_dtype(r, desc, kDtypeFp8);
  return r.bad(desc.path, fmt::format("element type {}{}; kv_dtype is float8_e4m3fn, so expected "
                                      "u8 with dtype=\"float8_e4m3fn\"",
                                      desc.type_text, dtype_suffix(desc)));
}

Status expect_float32(const ObjectReader& r, const DatasetDesc& desc);

// A u8 dataset whose dtype attribute must be `wanted`.
Status expect_u8_dtype(const ObjectReader& r, const DatasetDesc& desc, const char* wanted) {
  if (desc.element == ElementClass::kU8 && desc.dtype && *desc.dtype == wanted) {
    return ok_status();
  }
  if (desc.element == ElementClass::kU8 && !desc.dtype) return missing_dtype(r, desc, wanted);
  return r.bad(desc.path, fmt::format("element type {}{}; expected u8 with dtype=\"{}\"",
                                      desc.type_text, dtype_suffix(desc), wanted));
}

Status expect_pool_part_type(const ObjectReader& r, const DatasetDesc& desc, const PoolPart& part) {
  switch (part.type) {
    case PoolPartType::kE4m3:
      return expect_pool_type(r, desc, KvDtype::kFloat8E4m3fn);
    case PoolPartType::kBf16:
      return expect_pool_type(r, desc, KvDtype::kBfloat16);
    case PoolPartType::kScalesF32:
      return expect_float32(r, desc);
    case PoolPartType::kScalesE8m0:
      return expect_u8_dtype(r, desc, "float8_e8m0fnu");
    case PoolPartType::kFlashMlaPacked:
      return expect_u8_dtype(r, desc, "flashmla_fp8");
  }
  return ok_status();
}

Status expect_float32(const ObjectReader& r, const DatasetDesc& desc) {
  if (desc.element == ElementClass::kFloat32 && (!desc.dtype || *desc.dtype == kDtypeF32)) {
    return ok_status();
  }
  if ((desc.element == ElementClass::kU8 || desc.element == ElementClass::kU16) && !desc.dtype) {
    return missing_dtype(r, desc, kDtypeF32);
  }
  return r.bad(desc.path, fmt::format("element type {}{}; expected float32", desc.type_text,
                                      dtype_suffix(desc)));
}

// How a tensor's element type is checked.
enum class TensorType { kBfloat16, kFloat32, kPool };

// One tensor of a (step, layer) group: name, element type, shape and the shape's meaning.
struct TensorRule {
  const char* name;
  TensorType type;
  std::vector<hsize_t> shape;
  const char* meaning;
};

Status check_tensor(const ObjectReader& r, hid_t group, const std::string& path,
                    const TensorRule& rule, KvDtype kv_dtype) {
  KVAUDIT_ASSIGN_OR_RETURN(const DatasetDesc desc, r.describe(group, path, rule.name));
  switch (rule.type) {
    case TensorType::kBfloat16:
      KVAUDIT_TRY(expect_bf16(r, desc));
      break;
    case TensorType::kFloat32:
      KVAUDIT_TRY(expect_float32(r, desc));
      break;
    case TensorType::kPool:
      KVAUDIT_TRY(expect_pool_type(r, desc, kv_dtype));
      break;
  }
  return expect_shape(r, desc, rule.shape, rule.meaning);
}

// A capture the format makes optional: checked when present. Returns whether it is.
Result<bool> check_optional_tensor(const ObjectReader& r, hid_t group, const std::string& path,
                                   const TensorRule& rule, KvDtype kv_dtype) {
  KVAUDIT_ASSIGN_OR_RETURN(const bool present, r.has_link(group, path, rule.name));
  if (present) KVAUDIT_TRY(check_tensor(r, group, path, rule, kv_dtype));
  return present;
}

// ---- index datasets ----------------------------------------------------------------------------

// Indices are integers of 32 or 64 bits, signed or not (int64 from PyTorch is common; the format
// says int32). u8/u16 are the raw-bits types of the format and never indices; int8/int16 are
// refused too: they cannot address a real pool, and an int16 dataset is more likely bf16 bits
// viewed as int16 (torch's view(torch.int16)) than indices. Indices are one-dimensional and not
// huge.
Status expect_index_dataset(const ObjectReader& r, const DatasetDesc& desc) {
  if (desc.element != ElementClass::kOtherInteger) {
    if ((desc.element == ElementClass::kU8 || desc.element == ElementClass::kU16) && !desc.dtype) {
      return r.bad(desc.path,
                   desc.type_text + " dataset without a dtype attribute; indices must be int32");
    }
    return r.bad(desc.path, fmt::format("element type {}{}; expected int32 (indices are 32- or "
                                        "64-bit integers)",
                                        desc.type_text, dtype_suffix(desc)));
  }
  if (desc.dims.size() != 1) {
    return r.bad(desc.path, fmt::format("shape {} is not one-dimensional", shape_text(desc.dims)));
  }
  if (desc.dims[0] > kMaxIndexLength) {
    return r.bad(desc.path, fmt::format("length {} exceeds {}", desc.dims[0], kMaxIndexLength));
  }
  return ok_status();
}

// A rank-1 integer dataset read whole, values in int32.
Result<std::vector<std::int32_t>> read_index(const ObjectReader& r, hid_t group,
                                             const std::string& group_path,
                                             const std::string& name) {
  KVAUDIT_ASSIGN_OR_RETURN(const DatasetDesc desc, r.describe(group, group_path, name));
  KVAUDIT_TRY(expect_index_dataset(r, desc));
  std::vector<std::int64_t> wide(static_cast<std::size_t>(desc.dims[0]));
  if (!wide.empty()) {
    h5::Dataset dataset(H5Dopen2(group, name.c_str(), H5P_DEFAULT));
    if (!dataset ||
        H5Dread(dataset.get(), H5T_NATIVE_INT64, H5S_ALL, H5S_ALL, H5P_DEFAULT, wide.data()) < 0) {
      return r.bad(desc.path, with_hdf5_reason("cannot read"));
    }
  }
  std::vector<std::int32_t> values(wide.size());
  for (std::size_t i = 0; i < wide.size(); ++i) {
    if (wide[i] < std::numeric_limits<std::int32_t>::min() ||
        wide[i] > std::numeric_limits<std::int32_t>::max()) {
      return r.bad(desc.path, fmt::format("[{}] = {} does not fit in int32", i, wide[i]));
    }
    values[i] = static_cast<std::int32_t>(wide[i]);
  }
  return values;
}

// ---- numbered groups ---------------------------------------------------------------------------

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

std::string misnamed_group_text(char prefix) {
  return fmt::format("name does not match {} followed by three or more digits", prefix);
}

// (number, name) of the member groups of /layers or /steps.
using NumberedGroups = std::vector<std::pair<std::int64_t, std::string>>;

// Every member of `group` must be a group named prefix + digits; sorted by number (then name).
Result<NumberedGroups> numbered_groups(const ObjectReader& r, hid_t group, const std::string& path,
                                       char prefix) {
  KVAUDIT_ASSIGN_OR_RETURN(const std::vector<std::string> names, r.link_names(group, path));
  NumberedGroups groups;
  for (const std::string& name : names) {
    const std::string member = join_path(path, name);
    const auto number = group_number(name, prefix);
    if (!number) return r.bad(member, misnamed_group_text(prefix));
    h5::Object object(H5Oopen(group, name.c_str(), H5P_DEFAULT));
    if (!object) return r.bad(member, with_hdf5_reason("cannot open"));
    if (H5Iget_type(object.get()) != H5I_GROUP) return r.bad(member, "is not a group");
    groups.emplace_back(*number, name);
  }
  std::sort(groups.begin(), groups.end());
  return groups;
}

// ---- root --------------------------------------------------------------------------------------

// The root attribute `attribute` (kv_dtype, or v1.1's kv_rope_dtype) naming an element type.
Result<KvDtype> parse_kv_dtype(const ObjectReader& r, const char* attribute,
                               const std::string& text) {
  if (text == kDtypeFp8) return KvDtype::kFloat8E4m3fn;
  if (text == kDtypeBf16) return KvDtype::kBfloat16;
  return r.unsupported_at("/", fmt::format("{} \"{}\" is unknown; expected float8_e4m3fn or "
                                           "bfloat16",
                                           attribute, text));
}

// format and format_version: what this reader can read at all.
Status check_format(const ObjectReader& r, hid_t root) {
  KVAUDIT_ASSIGN_OR_RETURN(const std::string format, r.read_string(root, "/", "format"));
  if (format != "kvdump") {
    return r.bad("/", fmt::format("attribute format is \"{}\", not \"kvdump\"", format));
  }
  KVAUDIT_ASSIGN_OR_RETURN(const std::int64_t version, r.read_int(root, "/", "format_version"));
  if (version != 1) {
    return r.unsupported_at(
        "/", fmt::format("format_version {} is unknown; this reader reads version 1", version));
  }
  return ok_status();
}

// format_minor_version: absent = 0 (v1), 1 = v1.1, 2 = v1.2.
Result<int> read_minor_version(const ObjectReader& r, hid_t root) {
  if (H5Aexists(root, "format_minor_version") <= 0) return 0;
  KVAUDIT_ASSIGN_OR_RETURN(const std::int64_t minor, r.read_int(root, "/", "format_minor_version"));
  if (minor < 0 || minor > 2) {
    return r.unsupported_at("/", fmt::format("format_minor_version {} is unknown; this reader "
                                             "reads 1.0, 1.1 and 1.2",
                                             minor));
  }
  return static_cast<int>(minor);
}

Status needs_v1_1(const ObjectReader& r, const DumpAttributes& attrs, const std::string& path,
                  const std::string& what) {
  if (attrs.format_minor_version >= 1) return ok_status();
  return r.bad(path, what + " is kvdump v1.1: the root needs format_minor_version = 1");
}

Status needs_v1_2(const ObjectReader& r, const DumpAttributes& attrs, const std::string& path,
                  const std::string& what) {
  if (attrs.format_minor_version >= 2) return ok_status();
  return r.bad(path, what + " is kvdump v1.2: the root needs format_minor_version = 2");
}

Result<GroupScaleFormat> parse_scale_format(const ObjectReader& r, const std::string& text) {
  if (text == "float32") return GroupScaleFormat::kFloat32;
  if (text == "power_of_two") return GroupScaleFormat::kPowerOfTwo;
  if (text == "e8m0") return GroupScaleFormat::kE8m0;
  return r.unsupported_at("/", fmt::format("kv_scale_format \"{}\" is unknown; expected float32, "
                                           "power_of_two or e8m0",
                                           text));
}

// kv_scale_group_size, kv_scale_format, kv_rope_dtype and kv_cache_layout of a per_token_group
// dump (v1.1).
Status read_group_scale_attributes(const ObjectReader& r, hid_t root, DumpAttributes* attrs) {
  KVAUDIT_TRY(needs_v1_1(r, *attrs, "/", "kv_scale_kind \"per_token_group\""));
  if (attrs->kv_dtype != KvDtype::kFloat8E4m3fn) {
    return r.bad("/", "kv_scale_kind per_token_group needs kv_dtype float8_e4m3fn");
  }
  KVAUDIT_ASSIGN_OR_RETURN(attrs->kv_scale_group_size,
                           r.read_int_in(root, "/", "kv_scale_group_size", 1, attrs->kv_lora_rank));
  if (attrs->kv_lora_rank % attrs->kv_scale_group_size != 0) {
    return r.bad("/", fmt::format("kv_scale_group_size {} does not divide kv_lora_rank {}",
                                  attrs->kv_scale_group_size, attrs->kv_lora_rank));
  }
  KVAUDIT_ASSIGN_OR_RETURN(const std::string format, r.read_string(root, "/", "kv_scale_format"));
  KVAUDIT_ASSIGN_OR_RETURN(attrs->kv_scale_format, parse_scale_format(r, format));
  KVAUDIT_ASSIGN_OR_RETURN(const std::string rope, r.read_string(root, "/", "kv_rope_dtype"));
  KVAUDIT_ASSIGN_OR_RETURN(attrs->kv_rope_dtype, parse_kv_dtype(r, "kv_rope_dtype", rope));
  if (H5Aexists(root, "kv_cache_layout") > 0) {
    KVAUDIT_ASSIGN_OR_RETURN(const std::string layout, r.read_string(root, "/", "kv_cache_layout"));
    if (layout == "flashmla_fp8") {
      attrs->kv_cache_layout = PoolLayout::kFlashMlaFp8;
    } else if (layout != "split") {
      return r.unsupported_at("/", fmt::format("kv_cache_layout \"{}\" is unknown; expected "
                                               "split or flashmla_fp8",
                                               layout));
    }
  }
  if (attrs->kv_cache_layout == PoolLayout::kFlashMlaFp8 &&
      (attrs->kv_scale_format == GroupScaleFormat::kE8m0 ||
       attrs->kv_rope_dtype != KvDtype::kBfloat16)) {
    return r.bad("/",
                 "kv_cache_layout flashmla_fp8 holds float32 scales and a bfloat16 RoPE "
                 "part: it needs kv_scale_format float32 or power_of_two and kv_rope_dtype "
                 "bfloat16");
  }
  return ok_status();
}

// An optional float root attribute (docs/kvdump-v1.md "Optional model attributes"): finite when
// present.
Result<std::optional<double>> read_optional_float(const ObjectReader& r, hid_t root,
                                                  const char* name) {
  if (H5Aexists(root, name) <= 0) return std::optional<double>();
  KVAUDIT_ASSIGN_OR_RETURN(const double value, r.read_float(root, "/", name));
  if (!std::isfinite(value)) return r.bad("/", fmt::format("attribute {} is not finite", name));
  return std::optional<double>(value);
}

Result<DumpAttributes> read_root_attributes(const ObjectReader& r, hid_t root) {
  KVAUDIT_TRY(check_format(r, root));
  DumpAttributes attrs;
  KVAUDIT_ASSIGN_OR_RETURN(attrs.model, r.read_string(root, "/", "model"));
  KVAUDIT_ASSIGN_OR_RETURN(attrs.producer, r.read_string(root, "/", "producer"));
  KVAUDIT_ASSIGN_OR_RETURN(attrs.num_heads, r.read_int_in(root, "/", "num_heads", 1, kMaxDim));
  KVAUDIT_ASSIGN_OR_RETURN(attrs.kv_lora_rank,
                           r.read_int_in(root, "/", "kv_lora_rank", 1, kMaxDim));
  KVAUDIT_ASSIGN_OR_RETURN(attrs.qk_rope_head_dim,
                           r.read_int_in(root, "/", "qk_rope_head_dim", 0, kMaxDim));
  KVAUDIT_ASSIGN_OR_RETURN(attrs.sm_scale, r.read_float(root, "/", "sm_scale"));
  if (!std::isfinite(attrs.sm_scale)) return r.bad("/", "attribute sm_scale is not finite");
  KVAUDIT_ASSIGN_OR_RETURN(attrs.page_size, r.read_int_in(root, "/", "page_size", 1, kMaxDim));
  KVAUDIT_ASSIGN_OR_RETURN(const std::string kv_dtype, r.read_string(root, "/", "kv_dtype"));
  KVAUDIT_ASSIGN_OR_RETURN(attrs.kv_dtype, parse_kv_dtype(r, "kv_dtype", kv_dtype));
  KVAUDIT_ASSIGN_OR_RETURN(attrs.format_minor_version, read_minor_version(r, root));
  KVAUDIT_ASSIGN_OR_RETURN(attrs.kv_scale_kind, r.read_string(root, "/", "kv_scale_kind"));
  if (attrs.kv_scale_kind == "per_token_group") {
    KVAUDIT_TRY(read_group_scale_attributes(r, root, &attrs));
  } else if (attrs.kv_scale_kind != "per_tensor") {
    return r.unsupported_at("/", fmt::format("kv_scale_kind \"{}\" is unknown; expected "
                                             "per_tensor or per_token_group (v1.1)",
                                             attrs.kv_scale_kind));
  }
  KVAUDIT_ASSIGN_OR_RETURN(attrs.rope_factor, read_optional_float(r, root, "rope_factor"));
  KVAUDIT_ASSIGN_OR_RETURN(attrs.rope_mscale_all_dim,
                           read_optional_float(r, root, "rope_mscale_all_dim"));
  return attrs;
}

// ---- layers ------------------------------------------------------------------------------------

// layer_id, and kv_scale: finite and positive in float32 (the write rule divides by
// fp32(kv_scale)), exactly 1 for a bfloat16 pool.
Status read_layer_attributes(const ObjectReader& r, hid_t group, const std::string& path,
                             const DumpAttributes& attrs, LayerMeta* meta) {
  KVAUDIT_ASSIGN_OR_RETURN(meta->layer_id, r.read_int_in(group, path, "layer_id", 0,
                                                         std::numeric_limits<std::int32_t>::max()));
  KVAUDIT_ASSIGN_OR_RETURN(const double scale, r.read_float(group, path, "kv_scale"));
  const float kv_scale = static_cast<float>(scale);
  if (!std::isfinite(scale) || !std::isfinite(kv_scale)) {
    return r.bad(path, "attribute kv_scale is not finite in float32");
  }
  if (!(kv_scale > 0.0f)) {
    return r.bad(path, fmt::format("attribute kv_scale = {:f} is not positive", scale));
  }
  if (attrs.kv_dtype == KvDtype::kBfloat16 && kv_scale != 1.0f) {
    return r.bad(path, fmt::format("attribute kv_scale = {:f} but a bfloat16 pool requires "
                                   "kv_scale = 1",
                                   scale));
  }
  if (attrs.per_token_group() && attrs.kv_rope_dtype == KvDtype::kBfloat16 && kv_scale != 1.0f) {
    return r.bad(path, fmt::format("attribute kv_scale = {:f} but a bfloat16 RoPE part requires "
                                   "kv_scale = 1 (it scales an e4m3 RoPE part only)",
                                   scale));
  }
  meta->kv_scale = kv_scale;
  return ok_status();
}

// kv_cache: the pool type, shape [num_pages, page_size, D]. The first layer (num_pages < 0) fixes
// num_pages, the others must agree. Returns num_pages.
Result<std::int64_t> check_layer_pool(const ObjectReader& r, hid_t group, const std::string& path,
                                      const DumpAttributes& attrs, std::int64_t num_pages) {
  KVAUDIT_ASSIGN_OR_RETURN(const DatasetDesc cache, r.describe(group, path, "kv_cache"));
  const PoolPart latent = pool_parts(attrs, "kv_cache").front();
  KVAUDIT_TRY(expect_pool_part_type(r, cache, latent));
  const auto& dims = cache.dims;
  if (dims.size() != 3 || dims[1] != static_cast<hsize_t>(attrs.page_size) ||
      dims[2] != static_cast<hsize_t>(latent.width)) {
    return r.bad(cache.path,
                 fmt::format("shape {} disagrees with [num_pages, page_size, {}] = "
                             "[num_pages, {}, {}]",
                             shape_text(dims), latent.meaning, attrs.page_size, latent.width));
  }
  if (num_pages >= 0) {
    if (static_cast<std::int64_t>(dims[0]) == num_pages) return num_pages;
    return r.bad(cache.path, fmt::format("num_pages = {} disagrees with the first layer's {}",
                                         dims[0], num_pages));
  }
  // Keep num_pages * page_size * D (bytes of one pool) inside int64.
  const long double slots = static_cast<long double>(dims[0]) * attrs.page_size;
  if (slots * attrs.row_width() * 2 > static_cast<long double>(std::int64_t{1} << 62)) {
    return r.bad(cache.path, fmt::format("num_pages = {} is implausibly large", dims[0]));
  }
  return static_cast<std::int64_t>(dims[0]);
}

std::vector<hsize_t> pool_shape(const DumpAttributes& attrs, std::int64_t num_pages) {
  return {static_cast<hsize_t>(num_pages), static_cast<hsize_t>(attrs.page_size),
          static_cast<hsize_t>(attrs.row_width())};
}

// The parts of a stored pool (kv_cache, or kv_cache_after with suffix "_after"): v1 and the packed
// layout have one dataset, the v1.1 split layout three.
std::vector<hsize_t> part_shape(const DumpAttributes& attrs, std::int64_t num_pages,
                                const PoolPart& part) {
  return {static_cast<hsize_t>(num_pages), static_cast<hsize_t>(attrs.page_size),
          static_cast<hsize_t>(part.width)};
}

// Every part after the first (kv_rope, kv_scales) of a split per_token_group pool.
Status check_pool_companions(const ObjectReader& r, hid_t group, const std::string& path,
                             const DumpAttributes& attrs, std::int64_t num_pages,
                             const std::string& pool_name) {
  const std::vector<PoolPart> parts = pool_parts(attrs, pool_name);
  for (std::size_t i = 1; i < parts.size(); ++i) {
    KVAUDIT_ASSIGN_OR_RETURN(const DatasetDesc desc, r.describe(group, path, parts[i].name));
    KVAUDIT_TRY(expect_pool_part_type(r, desc, parts[i]));
    KVAUDIT_TRY(expect_shape(r, desc, part_shape(attrs, num_pages, parts[i]),
                             std::string("[num_pages, page_size, ") + parts[i].meaning + "]"));
  }
  return ok_status();
}

// The names of the split layout's companion datasets of `pool_name` ("kv_cache" or
// "kv_cache_after"): kv_rope and kv_scales, with the same suffix.
std::vector<std::string> companion_names(const std::string& pool_name) {
  const std::string suffix = pool_name == "kv_cache_after" ? "_after" : "";
  return {"kv_rope" + suffix, "kv_scales" + suffix};
}

// What the file's pool is made of, for messages: "a per_tensor pool", "a flashmla_fp8 pool".
std::string pool_form_text(const DumpAttributes& attrs) {
  if (!attrs.per_token_group()) return "kv_scale_kind is per_tensor (one kv_cache dataset)";
  return "kv_cache_layout is flashmla_fp8 (scales and RoPE packed into kv_cache)";
}

// A companion name (kv_rope, kv_scales and their _after forms) is reserved: where the file's pool
// does not use it, a dataset of that name is refused rather than ignored, since it says that the
// producer and the root attributes disagree about the pool's layout.
Status check_unused_companions(const ObjectReader& r, hid_t group, const std::string& path,
                               const DumpAttributes& attrs, const std::string& pool_name) {
  const std::vector<PoolPart> parts = pool_parts(attrs, pool_name);
  for (const std::string& name : companion_names(pool_name)) {
    const bool used = std::any_of(parts.begin(), parts.end(),
                                  [&](const PoolPart& part) { return part.name == name; });
    if (used) continue;
    KVAUDIT_ASSIGN_OR_RETURN(const bool present, r.has_link(group, path, name));
    if (present) {
      return r.bad(join_path(path, name),
                   fmt::format("is a dataset of the v1.1 split layout, but {}: refused rather "
                               "than ignored",
                               pool_form_text(attrs)));
    }
  }
  return ok_status();
}

// kv_rope_after and kv_scales_after come with kv_cache_after only (all three or none).
Status check_companions_without_pool(const ObjectReader& r, hid_t group, const std::string& path) {
  for (const std::string& name : companion_names("kv_cache_after")) {
    KVAUDIT_ASSIGN_OR_RETURN(const bool present, r.has_link(group, path, name));
    if (present) {
      return r.bad(join_path(path, name),
                   "present without kv_cache_after: a captured pool is kv_cache_after, "
                   "kv_rope_after and kv_scales_after together, or none of them");
    }
  }
  return ok_status();
}

// ---- v1.2: the indexer's key cache -------------------------------------------------------------

Result<IndexScaleFormat> parse_index_scale_format(const ObjectReader& r, const std::string& path,
                                                  const std::string& text) {
  if (text == "power_of_two") return IndexScaleFormat::kPowerOfTwo;
  if (text == "float32") return IndexScaleFormat::kFloat32;
  return r.unsupported_at(path, fmt::format("index_scale_format \"{}\" is unknown; expected "
                                            "power_of_two or float32",
                                            text));
}

Result<IndexRotation> parse_index_rotation(const ObjectReader& r, const std::string& path,
                                           const std::string& text) {
  if (text == "hadamard") return IndexRotation::kHadamard;
  if (text == "none") return IndexRotation::kNone;
  return r.unsupported_at(path, fmt::format("index_rotation \"{}\" is unknown; expected "
                                            "hadamard or none",
                                            text));
}

// The attributes of /layers/L###/indexer.
Result<IndexerMeta> read_indexer_attributes(const ObjectReader& r, hid_t group,
                                            const std::string& path) {
  IndexerMeta meta;
  KVAUDIT_ASSIGN_OR_RETURN(meta.n_heads, r.read_int_in(group, path, "index_n_heads", 1, kMaxDim));
  KVAUDIT_ASSIGN_OR_RETURN(meta.head_dim, r.read_int_in(group, path, "index_head_dim", 1, kMaxDim));
  KVAUDIT_ASSIGN_OR_RETURN(meta.block_size,
                           r.read_int_in(group, path, "index_block_size", 1, meta.head_dim));
  if (meta.head_dim % meta.block_size != 0) {
    return r.bad(path, fmt::format("index_block_size {} does not divide index_head_dim {}",
                                   meta.block_size, meta.head_dim));
  }
  KVAUDIT_ASSIGN_OR_RETURN(meta.topk, r.read_int_in(group, path, "index_topk", 1, kMaxDim));
  KVAUDIT_ASSIGN_OR_RETURN(const std::string format,
                           r.read_string(group, path, "index_scale_format"));
  KVAUDIT_ASSIGN_OR_RETURN(meta.scale_format, parse_index_scale_format(r, path, format));
  KVAUDIT_ASSIGN_OR_RETURN(const std::string rotation,
                           r.read_string(group, path, "index_rotation"));
  KVAUDIT_ASSIGN_OR_RETURN(meta.rotation, parse_index_rotation(r, path, rotation));
  if (meta.rotation == IndexRotation::kHadamard &&
      !std::has_single_bit(static_cast<unsigned>(meta.head_dim))) {
    return r.bad(path, fmt::format("index_rotation \"hadamard\" needs index_head_dim a power of "
                                   "two (Sylvester's Hadamard matrix); it is {}",
                                   meta.head_dim));
  }
  KVAUDIT_ASSIGN_OR_RETURN(meta.softmax_scale, r.read_float(group, path, "index_softmax_scale"));
  if (!std::isfinite(meta.softmax_scale) || !(meta.softmax_scale > 0.0)) {
    return r.bad(path, "attribute index_softmax_scale is not finite and positive");
  }
  return meta;
}

// One dataset of an indexer group: u8 e4m3 codes or float32 (kIndices: an integer index), of
// the given shape.
enum class IndexerTensor { kCodes, kFloat32, kIndices };
struct IndexerRule {
  const char* name;
  IndexerTensor type;
  std::vector<hsize_t> shape;
  const char* meaning;
};

Status check_indexer_tensor(const ObjectReader& r, hid_t group, const std::string& path,
                            const IndexerRule& rule) {
  KVAUDIT_ASSIGN_OR_RETURN(const DatasetDesc desc, r.describe(group, path, rule.name));
  if (rule.type == IndexerTensor::kCodes) KVAUDIT_TRY(expect_u8_dtype(r, desc, kDtypeFp8));
  if (rule.type == IndexerTensor::kFloat32) KVAUDIT_TRY(expect_float32(r, desc));
  if (rule.type == IndexerTensor::kIndices && desc.element != ElementClass::kOtherInteger) {
    return r.bad(desc.path, fmt::format("element type {}{}; expected int32 token positions",
                                        desc.type_text, dtype_suffix(desc)));
  }
  return expect_shape(r, desc, rule.shape, rule.meaning);
}

// /layers/L###/indexer (v1.2, optional): its attributes, k_cache, k_scales and k_source.
Result<std::optional<IndexerMeta>> validate_layer_indexer(const ObjectReader& r, hid_t layer,
                                                          const std::string& layer_path,
                                                          const DumpAttributes& attrs,
                                                          std::int64_t num_pages) {
  KVAUDIT_ASSIGN_OR_RETURN(const bool present, r.has_link(layer, layer_path, "indexer"));
  if (!present) return std::optional<IndexerMeta>();
  const std::string path = join_path(layer_path, "indexer");
  KVAUDIT_TRY(needs_v1_2(r, attrs, path, "the indexer key cache"));
  KVAUDIT_ASSIGN_OR_RETURN(const h5::Group group, r.open_group(layer, path, "missing group"));
  KVAUDIT_ASSIGN_OR_RETURN(const IndexerMeta meta, read_indexer_attributes(r, group.get(), path));
  const hsize_t pages = static_cast<hsize_t>(num_pages);
  const hsize_t p = static_cast<hsize_t>(attrs.page_size);
  const hsize_t d = static_cast<hsize_t>(meta.head_dim);
  const hsize_t g = static_cast<hsize_t>(meta.num_blocks());
  using enum IndexerTensor;
  const IndexerRule rules[] = {
      {"k_cache", kCodes, {pages, p, d}, "[num_pages, page_size, index_head_dim]"},
      {"k_scales", kFloat32, {pages, p, g}, "[num_pages, page_size, index_head_dim / block]"},
      {"k_source", kFloat32, {pages, p, d}, "[num_pages, page_size, index_head_dim]"},
  };
  for (const IndexerRule& rule : rules) {
    KVAUDIT_TRY(check_indexer_tensor(r, group.get(), path, rule));
  }
  return std::optional<IndexerMeta>(meta);
}

// /steps/S###/L###/indexer (v1.2): present exactly where the layer has an indexer; q, weights,
// new_k, topk_indices, and k_cache_after with k_scales_after (both or neither). Returns whether
// the cache after the step is there.
Result<bool> validate_step_indexer(const ObjectReader& r, hid_t step_layer, const std::string& sl,
                                   const LayerMeta& layer, const DumpLayout& layout, hsize_t rows) {
  KVAUDIT_ASSIGN_OR_RETURN(const bool present, r.has_link(step_layer, sl, "indexer"));
  const std::string path = join_path(sl, "indexer");
  if (!layer.indexer) {
    if (!present) return false;
    return r.bad(path, fmt::format("present, but /layers/{} has no indexer group", layer.group));
  }
  KVAUDIT_ASSIGN_OR_RETURN(
      const h5::Group group,
      r.open_group(step_layer, path, "missing group: the layer has an indexer key cache"));
  const IndexerMeta& m = *layer.indexer;
  const hsize_t heads = static_cast<hsize_t>(m.n_heads);
  const hsize_t d = static_cast<hsize_t>(m.head_dim);
  const hsize_t pages = static_cast<hsize_t>(layout.num_pages);
  const hsize_t p = static_cast<hsize_t>(layout.attrs.page_size);
  using enum IndexerTensor;
  const IndexerRule rules[] = {
      {"q", kFloat32, {rows, heads, d}, "[Nq, index_n_heads, index_head_dim]"},
      {"weights", kFloat32, {rows, heads}, "[Nq, index_n_heads]"},
      {"new_k", kFloat32, {rows, d}, "[Nq, index_head_dim]"},
      {"topk_indices", kIndices, {rows, static_cast<hsize_t>(m.topk)}, "[Nq, index_topk]"},
  };
  for (const IndexerRule& rule : rules) {
    KVAUDIT_TRY(check_indexer_tensor(r, group.get(), path, rule));
  }
  KVAUDIT_ASSIGN_OR_RETURN(const bool codes, r.has_link(group.get(), path, "k_cache_after"));
  KVAUDIT_ASSIGN_OR_RETURN(const bool scales, r.has_link(group.get(), path, "k_scales_after"));
  if (codes != scales) {
    return r.bad(join_path(path, codes ? "k_cache_after" : "k_scales_after"),
                 "present without its companion: the indexer cache after the step is "
                 "k_cache_after and k_scales_after together, or neither");
  }
  if (!codes) return false;
  const IndexerRule after[] = {
      {"k_cache_after", kCodes, {pages, p, d}, "[num_pages, page_size, index_head_dim]"},
      {"k_scales_after",
       kFloat32,
       {pages, p, static_cast<hsize_t>(m.num_blocks())},
       "[num_pages, page_size, index_head_dim / block]"},
  };
  for (const IndexerRule& rule : after)
    KVAUDIT_TRY(check_indexer_tensor(r, group.get(), path, rule));
  return true;
}

// /layers/<name>. `num_pages` is -1 for the first layer, which sets it.
Result<LayerMeta> validate_layer(const ObjectReader& r, hid_t layers, const std::string& name,
                                 const DumpAttributes& attrs, std::int64_t* num_pages) {
  const std::string path = "/layers/" + name;
  h5::Group group(H5Gopen2(layers, name.c_str(), H5P_DEFAULT));
  if (!group) return r.bad(path, with_hdf5_reason("cannot open"));
  LayerMeta meta;
  meta.group = name;
  KVAUDIT_TRY(read_layer_attributes(r, group.get(), path, attrs, &meta));
  KVAUDIT_ASSIGN_OR_RETURN(*num_pages, check_layer_pool(r, group.get(), path, attrs, *num_pages));
  KVAUDIT_TRY(check_pool_companions(r, group.get(), path, attrs, *num_pages, "kv_cache"));
  KVAUDIT_TRY(check_unused_companions(r, group.get(), path, attrs, "kv_cache"));
  const TensorRule source{"kv_source", TensorType::kBfloat16, pool_shape(attrs, *num_pages),
                          "kv_cache's shape"};
  KVAUDIT_ASSIGN_OR_RETURN(meta.has_source,
                           check_optional_tensor(r, group.get(), path, source, attrs.kv_dtype));
  KVAUDIT_ASSIGN_OR_RETURN(meta.indexer,
                           validate_layer_indexer(r, group.get(), path, attrs, *num_pages));
  return meta;
}

// /layers: at least one layer, layer ids unique; sets layout->layers and layout->num_pages.
Status validate_layers(const ObjectReader& r, hid_t root, DumpLayout* layout) {
  KVAUDIT_ASSIGN_OR_RETURN(const h5::Group layers, r.open_group(root, "/layers", "missing group"));
  KVAUDIT_ASSIGN_OR_RETURN(const NumberedGroups names,
                           numbered_groups(r, layers.get(), "/layers", 'L'));
  if (names.empty()) return r.bad("/layers", "holds no layer group");
  std::int64_t num_pages = -1;
  std::map<int, std::string> group_of_id;
  for (const auto& [number, name] : names) {
    KVAUDIT_ASSIGN_OR_RETURN(LayerMeta meta,
                             validate_layer(r, layers.get(), name, layout->attrs, &num_pages));
    const auto [it, inserted] = group_of_id.emplace(meta.layer_id, name);
    if (!inserted) {
      return r.bad("/layers/" + name, fmt::format("layer_id {} is also the layer_id of /layers/{}",
                                                  meta.layer_id, it->second));
    }
    layout->layers.push_back(std::move(meta));
  }
  layout->num_pages = num_pages;
  return ok_status();
}

// ---- steps -------------------------------------------------------------------------------------

// The optional captures of one (step, layer) group.
struct Captures {
  bool out = false;
  bool lse = false;
  bool kv_cache_after = false;
  int topk = 0;                      // K of topk_indices [Nq, K]; 0 without
  bool indexer_cache_after = false;  // v1.2: indexer/k_cache_after
};

// topk_indices (v1.1): an integer dataset [Nq, K], K >= 1; its values are checked when read
// (check_topk_indices).
Result<int> check_topk_dataset(const ObjectReader& r, hid_t group, const std::string& path,
                               const DumpAttributes& attrs, hsize_t rows) {
  KVAUDIT_ASSIGN_OR_RETURN(const bool present, r.has_link(group, path, "topk_indices"));
  if (!present) return 0;
  KVAUDIT_ASSIGN_OR_RETURN(const DatasetDesc desc, r.describe(group, path, "topk_indices"));
  KVAUDIT_TRY(needs_v1_1(r, attrs, desc.path, "topk_indices"));
  if (desc.element != ElementClass::kOtherInteger) {
    return r.bad(desc.path, fmt::format("element type {}{}; expected int32 token positions",
                                        desc.type_text, dtype_suffix(desc)));
  }
  if (desc.dims.size() != 2 || desc.dims[0] != rows || desc.dims[1] < 1 ||
      desc.dims[1] > static_cast<hsize_t>(kMaxDim)) {
    return r.bad(desc.path, fmt::format("shape {} disagrees with [Nq, K] = [{}, K >= 1]",
                                        shape_text(desc.dims), rows));
  }
  return static_cast<int>(desc.dims[1]);
}

// /steps/S###/L###: the required tensors, then the captures that are present.
Result<Captures> validate_step_layer(const ObjectReader& r, hid_t step_group,
                                     const std::string& step_path, const LayerMeta& layer,
                                     const DumpLayout& layout, int rows) {
  const std::string path = step_path + "/" + layer.group;
  KVAUDIT_ASSIGN_OR_RETURN(
      const h5::Group group,
      r.open_group(step_group, path, "missing group: every step needs one per layer"));
  const hid_t g = group.get();
  const DumpAttributes& a = layout.attrs;
  const hsize_t nq = static_cast<hsize_t>(rows);
  const hsize_t heads = static_cast<hsize_t>(a.num_heads);
  const hsize_t dc = static_cast<hsize_t>(a.kv_lora_rank);
  const hsize_t dr = static_cast<hsize_t>(a.qk_rope_head_dim);
  using enum TensorType;
  const TensorRule required[] = {
      {"q_nope", kBfloat16, {nq, heads, dc}, "[Nq, num_heads, kv_lora_rank]"},
      {"q_pe", kBfloat16, {nq, heads, dr}, "[Nq, num_heads, qk_rope_head_dim]"},
      {"new_kv", kBfloat16, {nq, dc + dr}, "[Nq, kv_lora_rank + qk_rope_head_dim]"},
  };
  for (const TensorRule& rule : required) KVAUDIT_TRY(check_tensor(r, g, path, rule, a.kv_dtype));
  const TensorRule out{"out", kBfloat16, {nq, heads, dc}, "[Nq, num_heads, kv_lora_rank]"};
  const TensorRule lse{"lse", kFloat32, {nq, heads}, "[Nq, num_heads]"};
  Captures captures;
  KVAUDIT_ASSIGN_OR_RETURN(captures.out, check_optional_tensor(r, g, path, out, a.kv_dtype));
  KVAUDIT_ASSIGN_OR_RETURN(captures.lse, check_optional_tensor(r, g, path, lse, a.kv_dtype));
  KVAUDIT_ASSIGN_OR_RETURN(captures.kv_cache_after, r.has_link(g, path, "kv_cache_after"));
  if (captures.kv_cache_after) {
    const PoolPart latent = pool_parts(a, "kv_cache_after").front();
    KVAUDIT_ASSIGN_OR_RETURN(const DatasetDesc desc, r.describe(g, path, "kv_cache_after"));
    KVAUDIT_TRY(expect_pool_part_type(r, desc, latent));
    KVAUDIT_TRY(expect_shape(r, desc, part_shape(a, layout.num_pages, latent),
                             std::string("[num_pages, page_size, ") + latent.meaning + "]"));
    KVAUDIT_TRY(check_pool_companions(r, g, path, a, layout.num_pages, "kv_cache_after"));
    KVAUDIT_TRY(check_unused_companions(r, g, path, a, "kv_cache_after"));
  } else {
    KVAUDIT_TRY(check_companions_without_pool(r, g, path));
  }
  KVAUDIT_ASSIGN_OR_RETURN(captures.topk, check_topk_dataset(r, g, path, a, nq));
  KVAUDIT_ASSIGN_OR_RETURN(captures.indexer_cache_after,
                           validate_step_indexer(r, g, path, layer, layout, nq));
  return captures;
}

Result<StepKind> read_step_kind(const ObjectReader& r, hid_t group, const std::string& path) {
  KVAUDIT_ASSIGN_OR_RETURN(const std::string kind, r.read_string(group, path, "kind"));
  if (kind == "prefill") return StepKind::kPrefill;
  if (kind == "decode") return StepKind::kDecode;
  return r.bad(path,
               fmt::format("attribute kind = \"{}\" is unknown; expected prefill or decode", kind));
}

// The index datasets, read whole (their rules are checked by validate_step_indices).
Status read_step_indices(const ObjectReader& r, hid_t group, const std::string& path,
                         StepMeta* step) {
  KVAUDIT_ASSIGN_OR_RETURN(step->qo_indptr, read_index(r, group, path, "qo_indptr"));
  KVAUDIT_ASSIGN_OR_RETURN(step->kv_indptr, read_index(r, group, path, "kv_indptr"));
  KVAUDIT_ASSIGN_OR_RETURN(step->kv_indices, read_index(r, group, path, "kv_indices"));
  KVAUDIT_ASSIGN_OR_RETURN(step->kv_last_page_len, read_index(r, group, path, "kv_last_page_len"));
  KVAUDIT_ASSIGN_OR_RETURN(step->new_kv_slots, read_index(r, group, path, "new_kv_slots"));
  return ok_status();
}

// Every member group of a step must be one of the layers under /layers (datasets are the indices).
Status check_step_members(const ObjectReader& r, hid_t group, const std::string& path,
                          const std::vector<LayerMeta>& layers) {
  KVAUDIT_ASSIGN_OR_RETURN(const std::vector<std::string> names, r.link_names(group, path));
  for (const std::string& member : names) {
    const std::string member_path = path + "/" + member;
    h5::Object object(H5Oopen(group, member.c_str(), H5P_DEFAULT));
    if (!object) return r.bad(member_path, with_hdf5_reason("cannot open"));
    if (H5Iget_type(object.get()) != H5I_GROUP) continue;
    if (!group_number(member, 'L')) return r.bad(member_path, misnamed_group_text('L'));
    const bool known = std::any_of(layers.begin(), layers.end(),
                                   [&](const LayerMeta& l) { return l.group == member; });
    if (!known) return r.bad(member_path, "is not a layer under /layers");
  }
  return ok_status();
}

// /steps/<name>: kind, indices, member groups, then one (step, layer) group per layer.
Result<StepMeta> validate_step(const ObjectReader& r, hid_t steps, const std::string& name,
                               const DumpLayout& layout) {
  const std::string path = "/steps/" + name;
  h5::Group group(H5Gopen2(steps, name.c_str(), H5P_DEFAULT));
  if (!group) return r.bad(path, with_hdf5_reason("cannot open"));
  StepMeta step;
  step.group = name;
  KVAUDIT_ASSIGN_OR_RETURN(step.kind, read_step_kind(r, group.get(), path));
  KVAUDIT_TRY(read_step_indices(r, group.get(), path, &step));
  KVAUDIT_TRY(
      validate_step_indices(step, layout.num_pages, layout.attrs.page_size, r.file() + ":" + path));
  KVAUDIT_TRY(check_step_members(r, group.get(), path, layout.layers));
  for (const LayerMeta& layer : layout.layers) {
    KVAUDIT_ASSIGN_OR_RETURN(
        const Captures captures,
        validate_step_layer(r, group.get(), path, layer, layout, step.num_rows()));
    step.has_out.push_back(captures.out);
    step.has_lse.push_back(captures.lse);
    step.has_kv_cache_after.push_back(captures.kv_cache_after);
    step.topk.push_back(captures.topk);
    step.has_indexer_cache_after.push_back(captures.indexer_cache_after);
  }
  return step;
}

// Two groups with one number (S001 and S0001) would leave the replay order undefined.
Status check_distinct_step_numbers(const ObjectReader& r, const NumberedGroups& steps) {
  for (std::size_t i = 1; i < steps.size(); ++i) {
    if (steps[i].first == steps[i - 1].first) {
      return r.bad("/steps/" + steps[i].second,
                   fmt::format("has the same step number as /steps/{}: the replay order is "
                               "ambiguous",
                               steps[i - 1].second));
    }
  }
  return ok_status();
}

// /steps, in step-number order; sets layout->steps.
Status validate_steps(const ObjectReader& r, hid_t root, DumpLayout* layout) {
  KVAUDIT_ASSIGN_OR_RETURN(const h5::Group steps, r.open_group(root, "/steps", "missing group"));
  KVAUDIT_ASSIGN_OR_RETURN(const NumberedGroups names,
                           numbered_groups(r, steps.get(), "/steps", 'S'));
  KVAUDIT_TRY(check_distinct_step_numbers(r, names));
  for (const auto& [number, name] : names) {
    KVAUDIT_ASSIGN_OR_RETURN(StepMeta step, validate_step(r, steps.get(), name, *layout));
    layout->steps.push_back(std::move(step));
  }
  return ok_status();
}

}  // namespace

// v1: kv_cache [.., D] of kv_dtype. v1.1 split: kv_cache [.., Dc] e4m3, kv_rope [.., Dr],
// kv_scales [.., G]. flashmla_fp8: kv_cache [.., Dc + 4 G + 2 Dr] bytes. `pool_name` is
// "kv_cache" or "kv_cache_after"; the companions get the same suffix.
std::vector<PoolPart> pool_parts(const DumpAttributes& attrs, const std::string& pool_name) {
  const KvPool form = KvPool::zeros_for(attrs, 0);  // the slot's byte layout
  const std::size_t row_bytes = form.row_bytes();
  if (!attrs.per_token_group()) {
    const PoolPartType type =
        attrs.kv_dtype == KvDtype::kBfloat16 ? PoolPartType::kBf16 : PoolPartType::kE4m3;
    return {{pool_name, type, attrs.row_width(), "kv_lora_rank + qk_rope_head_dim", 0, row_bytes}};
  }
  const int groups = attrs.num_scale_groups();
  if (attrs.kv_cache_layout == PoolLayout::kFlashMlaFp8) {  // the memory form, as it is
    return {{pool_name, PoolPartType::kFlashMlaPacked, static_cast<int>(row_bytes),
             "kv_lora_rank + 4 * groups + 2 * qk_rope_head_dim bytes", 0, row_bytes}};
  }
  const std::string suffix = pool_name == "kv_cache_after" ? "_after" : "";
  const PoolPartType rope =
      attrs.kv_rope_dtype == KvDtype::kBfloat16 ? PoolPartType::kBf16 : PoolPartType::kE4m3;
  const PoolPartType scales = attrs.kv_scale_format == GroupScaleFormat::kE8m0
                                  ? PoolPartType::kScalesE8m0
                                  : PoolPartType::kScalesF32;
  return {
      {pool_name, PoolPartType::kE4m3, attrs.kv_lora_rank, "kv_lora_rank", 0, form.scales_offset()},
      {"kv_rope" + suffix, rope, attrs.qk_rope_head_dim, "qk_rope_head_dim", form.rope_offset(),
       row_bytes - form.rope_offset()},
      {"kv_scales" + suffix, scales, groups, "kv_lora_rank / kv_scale_group_size",
       form.scales_offset(), form.rope_offset() - form.scales_offset()}};
}

namespace {

// The element type of a part, as messages name it, and its bytes per element.
const char* part_element_name(PoolPartType type) {
  switch (type) {
    case PoolPartType::kBf16:
      return "bf16";
    case PoolPartType::kScalesF32:
      return "float32";
    case PoolPartType::kE4m3:
    case PoolPartType::kScalesE8m0:
    case PoolPartType::kFlashMlaPacked:
      break;
  }
  return "byte";
}

std::size_t part_element_bytes(PoolPartType type) {
  if (type == PoolPartType::kBf16) return 2;
  return type == PoolPartType::kScalesF32 ? 4 : 1;
}

// What byte `offset` of a packed flashmla_fp8 slot holds: "latent code 17", "the float32 scale of
// group 0, byte 1", "RoPE element 3, byte 0 of its bf16".
std::string packed_byte_meaning(const KvPool& form, std::size_t offset) {
  if (offset < form.scales_offset()) return fmt::format("latent code {}", offset);
  if (offset < form.rope_offset()) {
    const std::size_t in_scales = offset - form.scales_offset();
    return fmt::format("the float32 scale of group {}, byte {}", in_scales / 4, in_scales % 4);
  }
  const std::size_t in_rope = offset - form.rope_offset();
  return fmt::format("RoPE element {}, byte {} of its bf16", in_rope / 2, in_rope % 2);
}

}  // namespace

std::string locate_pool_byte(const DumpAttributes& attrs, const std::string& pool_name,
                             std::int64_t slot, std::size_t byte) {
  const std::int64_t page = slot / attrs.page_size;
  const std::int64_t in_page = slot % attrs.page_size;
  for (const PoolPart& part : pool_parts(attrs, pool_name)) {
    if (byte < part.slot_offset || byte >= part.slot_offset + part.slot_bytes) continue;
    const std::size_t offset = byte - part.slot_offset;
    const std::size_t element_bytes = part_element_bytes(part.type);
    const std::string index =
        fmt::format("{}[{}, {}, {}]", part.name, page, in_page, offset / element_bytes);
    if (part.type == PoolPartType::kFlashMlaPacked) {
      return fmt::format("{} ({})", index,
                         packed_byte_meaning(KvPool::zeros_for(attrs, 0), offset));
    }
    if (element_bytes == 1) return index;
    return fmt::format("{}, byte {} of its {}", index, offset % element_bytes,
                       part_element_name(part.type));
  }
  return fmt::format("byte {} of slot {}", byte, slot);  // past the slot: not reached
}

Result<DumpLayout> validate_dump_layout(hid_t file, const std::string& file_text) {
  const ObjectReader r(file_text);
  h5::Group root(H5Gopen2(file, "/", H5P_DEFAULT));
  if (!root) return r.bad("/", with_hdf5_reason("cannot open the root group"));
  DumpLayout layout;
  KVAUDIT_ASSIGN_OR_RETURN(layout.attrs, read_root_attributes(r, root.get()));
  layout.format_version = 1;
  layout.format_minor_version = layout.attrs.format_minor_version;
  KVAUDIT_TRY(validate_layers(r, root.get(), &layout));
  KVAUDIT_TRY(validate_steps(r, root.get(), &layout));
  return layout;
}

}  // namespace kvaudit
