// The shared parts of the external backend protocol (src/backend/exec_protocol.hpp).
#include "src/backend/exec_protocol.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>

#include "src/core/fp8_e4m3.hpp"

namespace kvaudit::exec {
namespace {

constexpr ArrayDtype kArrayDtypes[] = {ArrayDtype::kUint8, ArrayDtype::kBfloat16,
                                       ArrayDtype::kFloat32, ArrayDtype::kInt32};

// A file name kvaudit accepts from a message: relative, no "..", no empty component.
bool is_session_relative(const std::string& file) {
  if (file.empty() || file.front() == '/') return false;
  const std::filesystem::path path(file);
  for (const std::filesystem::path& part : path) {
    if (part == ".." || part.empty()) return false;
  }
  return true;
}

Status write_all(int fd, std::span<const std::uint8_t> bytes, const std::string& where) {
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return internal_error(where, fmt::format("cannot write: {}", std::strerror(errno)));
    done += static_cast<std::size_t>(n);
  }
  return ok_status();
}

Status read_all(int fd, std::span<std::uint8_t> bytes, const std::string& where) {
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::read(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return bad_input(where, fmt::format("cannot read: {}", std::strerror(errno)));
    if (n == 0) return bad_input(where, "the file became shorter while it was read");
    done += static_cast<std::size_t>(n);
  }
  return ok_status();
}

Result<std::vector<std::int64_t>> parse_shape(const nlohmann::json& shape, std::string_view what) {
  if (!shape.is_array()) return bad_input(std::string(what), "shape is not a list");
  std::vector<std::int64_t> sizes;
  for (const nlohmann::json& size : shape) {
    if (!size.is_number_integer() || size.get<std::int64_t>() < 0) {
      return bad_input(
          std::string(what),
          fmt::format("shape {} is not a list of non-negative integers", shape.dump()));
    }
    sizes.push_back(size.get<std::int64_t>());
  }
  return sizes;
}

}  // namespace

int protocol_version_for(const DumpAttributes& attrs) {
  return attrs.per_token_group() ? 2 : kFirstProtocolVersion;
}

int hello_version(const nlohmann::json& model) {
  return string_or(model, "kv_scale_kind", "per_tensor") == "per_token_group"
             ? 2
             : kFirstProtocolVersion;
}

bool speaks_protocol_version(std::int64_t version) {
  return version >= kFirstProtocolVersion && version <= kProtocolVersion;
}

const char* array_dtype_name(ArrayDtype dtype) {
  switch (dtype) {
    case ArrayDtype::kUint8:
      return "uint8";
    case ArrayDtype::kBfloat16:
      return "bfloat16";
    case ArrayDtype::kFloat32:
      return "float32";
    case ArrayDtype::kInt32:
      return "int32";
  }
  return "?";
}

std::size_t array_dtype_bytes(ArrayDtype dtype) {
  switch (dtype) {
    case ArrayDtype::kUint8:
      return 1;
    case ArrayDtype::kBfloat16:
      return 2;
    case ArrayDtype::kFloat32:
    case ArrayDtype::kInt32:
      return 4;
  }
  return 1;
}

Result<ArrayDtype> parse_array_dtype(std::string_view name) {
  for (const ArrayDtype dtype : kArrayDtypes) {
    if (name == array_dtype_name(dtype)) return dtype;
  }
  return bad_input("dtype", fmt::format("'{}' is not uint8, bfloat16, float32 or int32", name));
}

ArrayDtype pool_array_dtype(KvDtype dtype) {
  return dtype == KvDtype::kBfloat16 ? ArrayDtype::kBfloat16 : ArrayDtype::kUint8;
}

std::int64_t ArrayDescriptor::count() const {
  std::int64_t n = 1;
  for (const std::int64_t size : shape) n *= size;
  return n;
}

std::string ArrayDescriptor::text() const {
  return fmt::format("{} [{}] in {}", array_dtype_name(dtype), fmt::join(shape, ", "), file);
}

nlohmann::json descriptor_json(const ArrayDescriptor& descriptor) {
  return {{"file", descriptor.file},
          {"dtype", array_dtype_name(descriptor.dtype)},
          {"shape", descriptor.shape}};
}

Result<ArrayDescriptor> parse_descriptor(const nlohmann::json& value, std::string_view what) {
  const std::string where(what);
  if (!value.is_object()) return bad_input(where, "the array descriptor is not an object");
  ArrayDescriptor descriptor;
  KVAUDIT_ASSIGN_OR_RETURN(descriptor.file, string_member(value, "file", what));
  if (!is_session_relative(descriptor.file)) {
    return bad_input(where, fmt::format("file '{}' is not a path inside the session directory",
                                        descriptor.file));
  }
  KVAUDIT_ASSIGN_OR_RETURN(const std::string dtype, string_member(value, "dtype", what));
  const Result<ArrayDtype> parsed = parse_array_dtype(dtype);
  if (!parsed) return bad_input(where, parsed.error().what);
  descriptor.dtype = *parsed;
  if (!value.contains("shape")) return bad_input(where, "the array descriptor has no shape");
  KVAUDIT_ASSIGN_OR_RETURN(descriptor.shape, parse_shape(value["shape"], what));
  return descriptor;
}

Status write_array(const std::filesystem::path& dir, const ArrayDescriptor& descriptor,
                   std::span<const std::uint8_t> bytes) {
  const std::string path = (dir / descriptor.file).string();
  if (bytes.size() != descriptor.bytes()) {
    return internal_error(path,
                          fmt::format("{} bytes given for {}", bytes.size(), descriptor.text()));
  }
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return internal_error(path, fmt::format("cannot create: {}", std::strerror(errno)));
  Status written = write_all(fd, bytes, path);
  if (written.ok() && ::ftruncate(fd, static_cast<off_t>(bytes.size())) != 0) {
    written = internal_error(path, fmt::format("cannot truncate: {}", std::strerror(errno)));
  }
  ::close(fd);
  return written;
}

Result<std::vector<std::uint8_t>> read_array(const std::filesystem::path& dir,
                                             const ArrayDescriptor& descriptor,
                                             std::string_view what) {
  const std::string path = (dir / descriptor.file).string();
  const std::string where = fmt::format("{} ({})", what, descriptor.text());
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return bad_input(where, errno == ENOENT
                                ? std::string("the file does not exist (it was not written)")
                                : fmt::format("cannot open {}: {}", path, std::strerror(errno)));
  }
  struct stat info {};
  if (::fstat(fd, &info) != 0 || static_cast<std::uint64_t>(info.st_size) != descriptor.bytes()) {
    const auto size = static_cast<long long>(info.st_size);
    ::close(fd);
    return bad_input(where, fmt::format("the file holds {} bytes, not the {} its shape needs", size,
                                        descriptor.bytes()));
  }
  std::vector<std::uint8_t> bytes(descriptor.bytes());
  const Status read = read_all(fd, bytes, where);
  ::close(fd);
  if (!read) return read.error();
  return bytes;
}

EncodedTensor encode_tensor(std::span<const float> values) {
  EncodedTensor encoded;
  bool bf16 = true;
  for (const float value : values) bf16 = bf16 && (float_bits(value) & 0xFFFFu) == 0;
  encoded.dtype = bf16 ? ArrayDtype::kBfloat16 : ArrayDtype::kFloat32;
  encoded.bytes.resize(values.size() * array_dtype_bytes(encoded.dtype));
  for (std::size_t i = 0; i < values.size(); ++i) {
    const std::uint32_t bits = float_bits(values[i]);
    if (bf16) {
      encoded.bytes[2 * i] = static_cast<std::uint8_t>((bits >> 16) & 0xFF);
      encoded.bytes[2 * i + 1] = static_cast<std::uint8_t>(bits >> 24);
    } else {
      for (int b = 0; b < 4; ++b)
        encoded.bytes[4 * i + b] = static_cast<std::uint8_t>(bits >> (8 * b));
    }
  }
  return encoded;
}

Result<std::vector<float>> decode_tensor(ArrayDtype dtype, std::span<const std::uint8_t> bytes,
                                         std::string_view what) {
  if (dtype != ArrayDtype::kBfloat16 && dtype != ArrayDtype::kFloat32) {
    return bad_input(std::string(what),
                     fmt::format("dtype {} is not bfloat16 or float32", array_dtype_name(dtype)));
  }
  const std::size_t width = array_dtype_bytes(dtype);
  std::vector<float> values(bytes.size() / width);
  for (std::size_t i = 0; i < values.size(); ++i) {
    std::uint32_t bits = 0;
    if (dtype == ArrayDtype::kBfloat16) {
      bits = (std::uint32_t{bytes[2 * i]} | std::uint32_t{bytes[2 * i + 1]} << 8) << 16;
    } else {
      for (int b = 0; b < 4; ++b) bits |= std::uint32_t{bytes[4 * i + b]} << (8 * b);
    }
    values[i] = float_from_bits(bits);
  }
  return values;
}

std::vector<std::uint8_t> int32_bytes(std::span<const std::int32_t> values) {
  std::vector<std::uint8_t> bytes(values.size() * 4);
  for (std::size_t i = 0; i < values.size(); ++i) {
    const auto bits = static_cast<std::uint32_t>(values[i]);
    for (int b = 0; b < 4; ++b) bytes[4 * i + b] = static_cast<std::uint8_t>(bits >> (8 * b));
  }
  return bytes;
}

std::vector<std::int32_t> int32_values(std::span<const std::uint8_t> bytes) {
  std::vector<std::int32_t> values(bytes.size() / 4);
  for (std::size_t i = 0; i < values.size(); ++i) {
    std::uint32_t bits = 0;
    for (int b = 0; b < 4; ++b) bits |= std::uint32_t{bytes[4 * i + b]} << (8 * b);
    values[i] = static_cast<std::int32_t>(bits);
  }
  return values;
}

nlohmann::json model_json(const DumpAttributes& attrs, std::int64_t num_slots) {
  nlohmann::json model = {{"num_heads", attrs.num_heads},
                          {"kv_lora_rank", attrs.kv_lora_rank},
                          {"qk_rope_head_dim", attrs.qk_rope_head_dim},
                          {"sm_scale", attrs.sm_scale},
                          {"page_size", attrs.page_size},
                          {"num_slots", num_slots},
                          {"kv_dtype", kv_dtype_name(attrs.kv_dtype)},
                          {"kv_scale_kind", attrs.kv_scale_kind}};
  if (attrs.per_token_group()) {  // version 2
    model["kv_scale_group_size"] = attrs.kv_scale_group_size;
    model["kv_scale_format"] = group_scale_format_name(attrs.kv_scale_format);
    model["kv_rope_dtype"] = kv_dtype_name(attrs.kv_rope_dtype);
    model["slot_bytes"] = pool_form(attrs, 0).row_bytes();
  }
  return model;
}

namespace {

Result<KvDtype> parse_kv_dtype(const std::string& name, std::string_view key) {
  if (name == kv_dtype_name(KvDtype::kFloat8E4m3fn)) return KvDtype::kFloat8E4m3fn;
  if (name == kv_dtype_name(KvDtype::kBfloat16)) return KvDtype::kBfloat16;
  return unsupported("hello model",
                     fmt::format("{} '{}' is not float8_e4m3fn or bfloat16", key, name));
}

// kv_scale_group_size, kv_scale_format, kv_rope_dtype and slot_bytes of a per_token_group model.
Status parse_group_scales(const nlohmann::json& model, int version, DumpAttributes& attrs) {
  constexpr std::string_view what = "hello model";
  if (version < 2) {
    return unsupported(std::string(what),
                       fmt::format("kv_scale_kind 'per_token_group' needs protocol version 2; "
                                   "this hello asked for version {}",
                                   version));
  }
  if (attrs.kv_dtype != KvDtype::kFloat8E4m3fn) {
    return bad_input(std::string(what),
                     "kv_scale_kind per_token_group needs kv_dtype float8_e4m3fn");
  }
  KVAUDIT_ASSIGN_OR_RETURN(const std::int64_t group,
                           integer_member(model, "kv_scale_group_size", what));
  if (group < 1 || group > attrs.kv_lora_rank || attrs.kv_lora_rank % group != 0) {
    return bad_input(std::string(what),
                     fmt::format("kv_scale_group_size {} does not divide kv_lora_rank {}", group,
                                 attrs.kv_lora_rank));
  }
  attrs.kv_scale_group_size = static_cast<int>(group);
  KVAUDIT_ASSIGN_OR_RETURN(const std::string format, string_member(model, "kv_scale_format", what));
  constexpr GroupScaleFormat kFormats[] = {GroupScaleFormat::kFloat32,
                                           GroupScaleFormat::kPowerOfTwo, GroupScaleFormat::kE8m0};
  const auto known =
      std::find_if(std::begin(kFormats), std::end(kFormats),
                   [&](GroupScaleFormat f) { return format == group_scale_format_name(f); });
  if (known == std::end(kFormats)) {
    return unsupported(
        std::string(what),
        fmt::format("kv_scale_format '{}' is not float32, power_of_two or e8m0", format));
  }
  attrs.kv_scale_format = *known;
  KVAUDIT_ASSIGN_OR_RETURN(const std::string rope, string_member(model, "kv_rope_dtype", what));
  KVAUDIT_ASSIGN_OR_RETURN(attrs.kv_rope_dtype, parse_kv_dtype(rope, "kv_rope_dtype"));
  attrs.format_minor_version = 1;
  const std::size_t slot_bytes = pool_form(attrs, 0).row_bytes();
  if (model.contains("slot_bytes")) {
    KVAUDIT_ASSIGN_OR_RETURN(const std::int64_t given, integer_member(model, "slot_bytes", what));
    if (given < 0 || static_cast<std::size_t>(given) != slot_bytes) {
      return bad_input(std::string(what),
                       fmt::format("slot_bytes {} is not the {} bytes of a slot [{} codes][{} "
                                   "{} scales][{} {} RoPE values]",
                                   given, slot_bytes, attrs.kv_lora_rank, attrs.num_scale_groups(),
                                   group_scale_format_name(attrs.kv_scale_format),
                                   attrs.qk_rope_head_dim, kv_dtype_name(attrs.kv_rope_dtype)));
    }
  }
  return ok_status();
}

}  // namespace

Result<ModelInfo> parse_model(const nlohmann::json& model, int version) {
  constexpr std::string_view what = "hello model";
  if (!model.is_object()) return bad_input("hello", "model is not an object");
  ModelInfo info;
  DumpAttributes& attrs = info.attrs;
  KVAUDIT_ASSIGN_OR_RETURN(const std::int64_t heads, integer_member(model, "num_heads", what));
  KVAUDIT_ASSIGN_OR_RETURN(const std::int64_t rank, integer_member(model, "kv_lora_rank", what));
  KVAUDIT_ASSIGN_OR_RETURN(const std::int64_t rope,
                           integer_member(model, "qk_rope_head_dim", what));
  KVAUDIT_ASSIGN_OR_RETURN(const std::int64_t page, integer_member(model, "page_size", what));
  KVAUDIT_ASSIGN_OR_RETURN(info.num_slots, integer_member(model, "num_slots", what));
  KVAUDIT_ASSIGN_OR_RETURN(attrs.sm_scale, number_member(model, "sm_scale", what));
  KVAUDIT_ASSIGN_OR_RETURN(const std::string kv_dtype, string_member(model, "kv_dtype", what));
  constexpr std::int64_t kLimit = 1 << 20;
  if (heads < 1 || rank < 1 || rope < 0 || page < 1 || heads > kLimit || rank > kLimit ||
      rope > kLimit || page > kLimit || info.num_slots < 0 || info.num_slots % page != 0) {
    return bad_input("hello model",
                     "num_heads, kv_lora_rank, page_size must be positive, "
                     "num_slots a multiple of page_size");
  }
  attrs.num_heads = static_cast<int>(heads);
  attrs.kv_lora_rank = static_cast<int>(rank);
  attrs.qk_rope_head_dim = static_cast<int>(rope);
  attrs.page_size = static_cast<int>(page);
  KVAUDIT_ASSIGN_OR_RETURN(attrs.kv_dtype, parse_kv_dtype(kv_dtype, "kv_dtype"));
  attrs.kv_scale_kind = string_or(model, "kv_scale_kind", "per_tensor");
  if (attrs.kv_scale_kind == "per_token_group") {
    KVAUDIT_TRY(parse_group_scales(model, version, attrs));
  } else if (attrs.kv_scale_kind != "per_tensor") {
    return unsupported("hello model",
                       fmt::format("kv_scale_kind '{}' is not per_tensor{}", attrs.kv_scale_kind,
                                   version >= 2 ? " or per_token_group" : ""));
  }
  return info;
}

KvPool pool_form(const DumpAttributes& attrs, std::int64_t num_slots) {
  KvPool pool = KvPool::zeros_for(attrs, 0);  // the form, without bytes
  pool.num_slots = num_slots;
  return pool;
}

ArrayDescriptor pool_descriptor(std::string file, const KvPool& pool) {
  if (pool.grouped()) {
    return ArrayDescriptor{std::move(file),
                           ArrayDtype::kUint8,
                           {pool.num_slots, static_cast<std::int64_t>(pool.row_bytes())}};
  }
  return ArrayDescriptor{
      std::move(file), pool_array_dtype(pool.dtype), {pool.num_slots, pool.row_width}};
}

bool is_pool_of_form(const ArrayDescriptor& descriptor, const KvPool& form) {
  const ArrayDescriptor expected = pool_descriptor(descriptor.file, form);
  return descriptor.dtype == expected.dtype && descriptor.shape == expected.shape;
}

nlohmann::json layer_json(const LayerMeta& layer) {
  return {{"group", layer.group}, {"layer_id", layer.layer_id}, {"kv_scale", layer.kv_scale}};
}

Result<LayerMeta> parse_layer(const nlohmann::json& layer, std::string_view what) {
  if (!layer.is_object()) return bad_input(std::string(what), "layer is not an object");
  LayerMeta meta;
  KVAUDIT_ASSIGN_OR_RETURN(meta.group, string_member(layer, "group", what));
  KVAUDIT_ASSIGN_OR_RETURN(const std::int64_t id, integer_member(layer, "layer_id", what));
  KVAUDIT_ASSIGN_OR_RETURN(const double scale, number_member(layer, "kv_scale", what));
  meta.layer_id = static_cast<int>(id);
  // kvdump-v1: the float32 value is the scale; a double that is one travels exactly.
  meta.kv_scale = static_cast<float>(scale);
  if (!(std::isfinite(meta.kv_scale) && meta.kv_scale > 0)) {
    return bad_input(std::string(what), fmt::format("kv_scale {} is not finite and > 0", scale));
  }
  return meta;
}

const char* reply_error_kind_name(ReplyErrorKind kind) {
  switch (kind) {
    case ReplyErrorKind::kUnsupported:
      return "unsupported";
    case ReplyErrorKind::kBadInput:
      return "bad_input";
    case ReplyErrorKind::kInternal:
      return "internal";
  }
  return "internal";
}

nlohmann::json error_reply(ReplyErrorKind kind, std::string_view message) {
  return {{"type", "error"}, {"kind", reply_error_kind_name(kind)}, {"message", message}};
}

Result<std::int64_t> integer_member(const nlohmann::json& object, std::string_view key,
                                    std::string_view what) {
  const auto it = object.find(key);
  if (it == object.end() || !it->is_number_integer()) {
    return bad_input(std::string(what), fmt::format("{} is missing or not an integer", key));
  }
  return it->get<std::int64_t>();
}

Result<double> number_member(const nlohmann::json& object, std::string_view key,
                             std::string_view what) {
  const auto it = object.find(key);
  if (it == object.end() || !it->is_number()) {
    return bad_input(std::string(what), fmt::format("{} is missing or not a number", key));
  }
  return it->get<double>();
}

Result<std::string> string_member(const nlohmann::json& object, std::string_view key,
                                  std::string_view what) {
  const auto it = object.find(key);
  if (it == object.end() || !it->is_string()) {
    return bad_input(std::string(what), fmt::format("{} is missing or not a string", key));
  }
  return it->get<std::string>();
}

std::string string_or(const nlohmann::json& object, std::string_view key, std::string fallback) {
  if (!object.is_object()) return fallback;
  const auto it = object.find(key);
  return it != object.end() && it->is_string() ? it->get<std::string>() : fallback;
}

bool bool_or(const nlohmann::json& object, std::string_view key, bool fallback) {
  if (!object.is_object()) return fallback;
  const auto it = object.find(key);
  return it != object.end() && it->is_boolean() ? it->get<bool>() : fallback;
}

}  // namespace kvaudit::exec
