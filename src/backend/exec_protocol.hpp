// The external backend protocol, version 1 (docs/backend-protocol.md): what kvaudit's side (an
// exec backend, src/backend/exec_backend.hpp; a bench peer) and its own server (`kvaudit
// backend-serve`, src/backend/exec_server.hpp) share: the array descriptors that name the bulk
// files of a session directory, reading and writing those files, the hello's `model` object and
// the error kinds of a reply.
//
// An array descriptor {"file": "q_nope.bin", "dtype": "bfloat16", "shape": [Nq, H, Dc]} names a
// file relative to the session directory holding exactly prod(shape) elements, row-major,
// little-endian, nothing else. Element types: uint8 (e4m3fn codes), bfloat16 (raw bits), float32,
// int32. The bulk tensors kvaudit holds as float (q_nope [Nq, H, Dc], q_pe [Nq, H, Dr],
// new_kv [Nq, D]) travel as bfloat16 when every value is a bf16 value (a dump's are), as float32
// otherwise, so both directions are exact.
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "src/core/result.hpp"
#include "src/format/kvdump.hpp"

namespace kvaudit::exec {

inline constexpr const char* kProtocolName = "kvaudit-backend";
inline constexpr int kProtocolVersion = 1;

enum class ArrayDtype : std::uint8_t { kUint8, kBfloat16, kFloat32, kInt32 };

const char* array_dtype_name(ArrayDtype dtype);  // "uint8" | "bfloat16" | "float32" | "int32"
std::size_t array_dtype_bytes(ArrayDtype dtype);
Result<ArrayDtype> parse_array_dtype(std::string_view name);
// The element type of a pool of this storage: uint8 codes, or bfloat16 bits.
ArrayDtype pool_array_dtype(KvDtype dtype);

struct ArrayDescriptor {
  std::string file;  // relative to the session directory
  ArrayDtype dtype = ArrayDtype::kUint8;
  std::vector<std::int64_t> shape;

  std::int64_t count() const;  // prod(shape)
  std::uint64_t bytes() const {
    return static_cast<std::uint64_t>(count()) * array_dtype_bytes(dtype);
  }
  std::string text() const;  // "bfloat16 [12, 16, 512] in q_nope.bin", for messages
};

nlohmann::json descriptor_json(const ArrayDescriptor& descriptor);
// A descriptor of a message (`what` names it in errors): a relative path that stays inside the
// session directory (no "..", not absolute), a known dtype, a list of non-negative sizes.
Result<ArrayDescriptor> parse_descriptor(const nlohmann::json& value, std::string_view what);

// Writes `bytes` (exactly descriptor.bytes()) to the descriptor's file in `dir`, overwriting it in
// place (the same file stays, so a program that holds it mapped sees the new contents).
Status write_array(const std::filesystem::path& dir, const ArrayDescriptor& descriptor,
                   std::span<const std::uint8_t> bytes);
// The descriptor's file in `dir`, which must hold exactly descriptor.bytes() bytes. Errors say
// that it is missing or what size it has instead (`what`: which array).
Result<std::vector<std::uint8_t>> read_array(const std::filesystem::path& dir,
                                             const ArrayDescriptor& descriptor,
                                             std::string_view what);

// A float tensor as it travels: bf16 bits when every value is a bf16 value (its low 16 bits are
// zero, NaN and infinities included), float32 otherwise.
struct EncodedTensor {
  ArrayDtype dtype = ArrayDtype::kFloat32;
  std::vector<std::uint8_t> bytes;
};
EncodedTensor encode_tensor(std::span<const float> values);
// Bytes of `dtype` (bfloat16 or float32) back to floats (exact widening for bf16).
Result<std::vector<float>> decode_tensor(ArrayDtype dtype, std::span<const std::uint8_t> bytes,
                                         std::string_view what);
std::vector<std::uint8_t> int32_bytes(std::span<const std::int32_t> values);
std::vector<std::int32_t> int32_values(std::span<const std::uint8_t> bytes);

// The hello's `model` object: the dump's root attributes and the pool size in slots.
nlohmann::json model_json(const DumpAttributes& attrs, std::int64_t num_slots);
struct ModelInfo {
  DumpAttributes attrs;
  std::int64_t num_slots = 0;
};
Result<ModelInfo> parse_model(const nlohmann::json& model);

// The layer object of `layer` and `step` requests: {"group", "layer_id", "kv_scale"}.
nlohmann::json layer_json(const LayerMeta& layer);
Result<LayerMeta> parse_layer(const nlohmann::json& layer, std::string_view what);

// The `kind` of an error reply.
enum class ReplyErrorKind : std::uint8_t { kUnsupported, kBadInput, kInternal };
const char* reply_error_kind_name(ReplyErrorKind kind);  // "unsupported" | "bad_input" | "internal"
nlohmann::json error_reply(ReplyErrorKind kind, std::string_view message);

// A member of a message, of the JSON type asked for, or a bad-input error naming `what` and key.
Result<std::int64_t> integer_member(const nlohmann::json& object, std::string_view key,
                                    std::string_view what);
Result<double> number_member(const nlohmann::json& object, std::string_view key,
                             std::string_view what);
Result<std::string> string_member(const nlohmann::json& object, std::string_view key,
                                  std::string_view what);
// A member where it has the type, else `fallback` (never throws, whatever the message holds).
std::string string_or(const nlohmann::json& object, std::string_view key, std::string fallback);
bool bool_or(const nlohmann::json& object, std::string_view key, bool fallback);

}  // namespace kvaudit::exec
