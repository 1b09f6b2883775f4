// The external backend protocol, versions 1 and 2 (docs/backend-protocol.md): what kvaudit's side
// (an exec backend, src/backend/exec_backend.hpp; a bench peer) and its own server (`kvaudit
// backend-serve`, src/backend/exec_server.hpp) share: the protocol versions, the array descriptors
// that name the bulk files of a session directory, reading and writing those files, the hello's
// `model` object, the pool file's form and the error kinds of a reply.
//
// An array descriptor {"file": "q_nope.bin", "dtype": "bfloat16", "shape": [Nq, H, Dc]} names a
// file relative to the session directory holding exactly prod(shape) elements, row-major,
// little-endian, nothing else. Element types: uint8 (e4m3fn codes), bfloat16 (raw bits), float32,
// int32. The bulk tensors kvaudit holds as float (q_nope [Nq, H, Dc], q_pe [Nq, H, Dr],
// new_kv [Nq, D]) travel as bfloat16 when every value is a bf16 value (a dump's are), as float32
// otherwise, so both directions are exact.
//
// Versions: kvaudit asks for the lowest version that describes the dump, so a per_tensor dump's
// session is version 1's byte for byte. Version 2 adds per_token_group dumps (kvdump v1.1): the
// model carries kv_scale_group_size, kv_scale_format, kv_rope_dtype and slot_bytes, and a pool
// file is uint8 [num_slots, slot_bytes], each slot's bytes as KvPool holds them:
//   [Dc e4m3 codes][G scales: float32 little-endian, or one e8m0 byte each][Dr RoPE: bf16
//   little-endian or e4m3 codes],  G = Dc / kv_scale_group_size.
// Steps stay dense in both versions (a sparse step, topk_indices, is not sent).
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
inline constexpr int kFirstProtocolVersion = 1;  // per_tensor pools
inline constexpr int kProtocolVersion = 2;       // the newest: per_token_group pools too

// The version kvaudit asks for: 2 for a per_token_group dump, else 1 (a per_tensor dump; a bench
// session, whose hello has no model). hello_version reads it off the hello's model object (null
// for a bench session).
int protocol_version_for(const DumpAttributes& attrs);
int hello_version(const nlohmann::json& model);
bool speaks_protocol_version(std::int64_t version);  // 1 or 2

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

// The hello's `model` object: the dump's root attributes and the pool size in slots; with
// per_token_group (version 2) also kv_scale_group_size, kv_scale_format, kv_rope_dtype and
// slot_bytes (the bytes of one slot of the pool file). A per_tensor model is version 1's object.
nlohmann::json model_json(const DumpAttributes& attrs, std::int64_t num_slots);
struct ModelInfo {
  DumpAttributes attrs;
  std::int64_t num_slots = 0;
};
// The model of a hello of `version`: a per_token_group model needs version 2 (unsupported in a
// version 1 hello), and its slot_bytes, where present, must be the grouped slot's size.
Result<ModelInfo> parse_model(const nlohmann::json& model, int version = kProtocolVersion);

// A pool of the dump's form without its bytes (KvPool::zeros_for's fields): per_tensor, or the
// per_token_group slot [Dc codes][G scales][Dr RoPE].
KvPool pool_form(const DumpAttributes& attrs, std::int64_t num_slots);
// The pool file's descriptor for a pool of that form: uint8 [S, D] e4m3 codes or bfloat16
// [S, D] bits (per_tensor), uint8 [S, row_bytes()] (per_token_group).
ArrayDescriptor pool_descriptor(std::string file, const KvPool& pool);
// Whether `descriptor` has the dtype and shape of pool_descriptor(.., form).
bool is_pool_of_form(const ArrayDescriptor& descriptor, const KvPool& form);

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
