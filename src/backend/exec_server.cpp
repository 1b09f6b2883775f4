// The program side of the external backend protocol for kvaudit's own backends
// (src/backend/exec_server.hpp), versions 1 and 2. Shapes per step: q_nope [Nq, H, Dc],
// q_pe [Nq, H, Dr], new_kv [Nq, D], out [Nq, H, Dc] bf16 bits, lse [Nq, H] fp32; pools [S, D] as
// stored, or [S, slot_bytes] uint8 per_token_group slots (version 2).
#include "src/backend/exec_server.hpp"

#include <fmt/format.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <string>

#include "src/backend/exec_protocol.hpp"
#include "src/format/step_indices.hpp"

namespace kvaudit::exec {
namespace {

// One layer the server holds: its metadata, its pool file and its pool.
struct ServedLayer {
  LayerMeta meta;
  std::size_t index = 0;  // order of its layer request
  ArrayDescriptor file;
  KvPool pool;
};

// A checked step request.
struct ServedStep {
  std::size_t index = 0;
  StepMeta meta;
  LayerMeta layer;
  bool pool_reloaded = false;
  StepLayerTensors tensors;
  ArrayDescriptor out;
  ArrayDescriptor lse;
};

ReplyErrorKind reply_kind(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kUnsupported:
      return ReplyErrorKind::kUnsupported;
    case ErrorKind::kBadInput:
      return ReplyErrorKind::kBadInput;
    case ErrorKind::kInternal:
      return ReplyErrorKind::kInternal;
  }
  return ReplyErrorKind::kInternal;
}

Status expect_shape(const ArrayDescriptor& descriptor, std::string_view what,
                    std::initializer_list<ArrayDtype> dtypes,
                    const std::vector<std::int64_t>& shape) {
  if (std::find(dtypes.begin(), dtypes.end(), descriptor.dtype) == dtypes.end() ||
      descriptor.shape != shape) {
    return bad_input(std::string(what), fmt::format("{} is not the expected [{}]",
                                                    descriptor.text(), fmt::join(shape, ", ")));
  }
  return ok_status();
}

// The layer's pool file: the dump's form (per_tensor [S, D], or the per_token_group slot bytes
// [S, slot_bytes] of version 2, src/backend/exec_protocol.hpp).
Result<KvPool> read_pool_file(const std::filesystem::path& dir, const ArrayDescriptor& file,
                              const ModelInfo& model) {
  KvPool pool = pool_form(model.attrs, model.num_slots);
  const ArrayDescriptor expected = pool_descriptor(file.file, pool);
  KVAUDIT_TRY(expect_shape(file, "pool", {expected.dtype}, expected.shape));
  KVAUDIT_ASSIGN_OR_RETURN(const std::vector<std::uint8_t> bytes, read_array(dir, file, "pool"));
  pool.bytes.assign(bytes.begin(), bytes.end());
  return pool;
}

class Server {
 public:
  Server(std::FILE* replies, const ServerHooks& hooks) : replies_(replies), hooks_(hooks) {}

  int run(std::istream& requests);

 private:
  void reply(const nlohmann::json& message);
  Result<nlohmann::json> hello(const nlohmann::json& request);
  Result<nlohmann::json> dispatch(const nlohmann::json& request);
  Result<nlohmann::json> layer(const nlohmann::json& request);
  Result<nlohmann::json> step(const nlohmann::json& request);
  Result<nlohmann::json> bench(const nlohmann::json& request);
  Status read_indices(const nlohmann::json& inputs, ServedStep& step) const;
  Status read_tensors(const nlohmann::json& inputs, ServedStep& step) const;
  Status read_topk_indices(const nlohmann::json& inputs, ServedStep& step) const;
  Result<ServedStep> parse_step(const nlohmann::json& request) const;
  Result<nlohmann::json> write_results(const ServedStep& step, const AttentionOutput& output,
                                       ServedLayer& layer);

  std::FILE* replies_;
  const ServerHooks& hooks_;
  std::filesystem::path directory_;
  int version_ = kFirstProtocolVersion;  // the hello's
  std::optional<ModelInfo> model_;       // none: a bench session
  std::unique_ptr<Backend> backend_;
  std::map<std::string, ServedLayer> layers_;
};

void Server::reply(const nlohmann::json& message) {
  const std::string line = message.dump() + "\n";
  std::fwrite(line.data(), 1, line.size(), replies_);
  std::fflush(replies_);
}

Result<nlohmann::json> Server::hello(const nlohmann::json& request) {
  if (string_or(request, "type", "") != "hello") {
    return bad_input("hello", "the first request is not a hello");
  }
  const auto asked = request.find("version");
  if (string_or(request, "protocol", "") != kProtocolName || asked == request.end() ||
      !asked->is_number_integer() || !speaks_protocol_version(asked->get<std::int64_t>())) {
    return unsupported("hello", fmt::format("this server speaks {} version 1 (per_tensor pools) "
                                            "and version 2 (per_token_group pools too)",
                                            kProtocolName));
  }
  version_ = static_cast<int>(asked->get<std::int64_t>());
  KVAUDIT_ASSIGN_OR_RETURN(const std::string dir, string_member(request, "session_dir", "hello"));
  if (!std::filesystem::is_directory(dir)) {
    return bad_input("hello", fmt::format("session_dir {} is not a directory", dir));
  }
  directory_ = dir;
  if (request.contains("model")) {
    KVAUDIT_ASSIGN_OR_RETURN(model_, parse_model(request["model"], version_));
  }
  BackendOptions options = hooks_.options;
  options.reciprocal_scale = bool_or(request, "reciprocal_scale", false);
  // A backend this machine cannot make (no CUDA device, a build without CUDA) cannot serve.
  Result<std::unique_ptr<Backend>> made = hooks_.make_backend(options);
  if (!made) return unsupported(made.error().where, made.error().what);
  backend_ = std::move(*made);
  nlohmann::json describe = backend_->describe();
  describe["served_by"] = "kvaudit backend-serve";
  nlohmann::json capabilities = {"check"};
  if (hooks_.bench) capabilities.push_back("bench");
  return nlohmann::json{{"type", "hello"},
                        {"version", version_},
                        {"capabilities", capabilities},
                        {"describe", describe}};
}

Result<nlohmann::json> Server::dispatch(const nlohmann::json& request) {
  const std::string type = string_or(request, "type", "");
  if ((type == "layer" || type == "step") && !model_) {
    return bad_input(type, "the hello had no model (a bench session has no dump)");
  }
  if (type == "layer") return layer(request);
  if (type == "step") return step(request);
  if (type == "bench") return bench(request);
  if (type == "hello") return bad_input("hello", "hello was already received");
  return bad_input("request", fmt::format("unknown request type '{}'", type));
}

Result<nlohmann::json> Server::layer(const nlohmann::json& request) {
  KVAUDIT_ASSIGN_OR_RETURN(const LayerMeta meta,
                           parse_layer(request.value("layer", nlohmann::json()), "layer"));
  KVAUDIT_ASSIGN_OR_RETURN(const ArrayDescriptor file,
                           parse_descriptor(request.value("pool", nlohmann::json()), "layer pool"));
  KVAUDIT_ASSIGN_OR_RETURN(KvPool pool, read_pool_file(directory_, file, *model_));
  const std::size_t index = layers_.count(meta.group) ? layers_[meta.group].index : layers_.size();
  layers_[meta.group] = ServedLayer{meta, index, file, std::move(pool)};
  return nlohmann::json{{"type", "ok"}};
}

Status Server::read_indices(const nlohmann::json& inputs, ServedStep& step) const {
  std::vector<std::int32_t>* arrays[] = {&step.meta.qo_indptr, &step.meta.kv_indptr,
                                         &step.meta.kv_indices, &step.meta.kv_last_page_len,
                                         &step.meta.new_kv_slots};
  const char* names[] = {"qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len",
                         "new_kv_slots"};
  for (std::size_t i = 0; i < std::size(names); ++i) {
    KVAUDIT_ASSIGN_OR_RETURN(const ArrayDescriptor file,
                             parse_descriptor(inputs.value(names[i], nlohmann::json()), names[i]));
    if (file.dtype != ArrayDtype::kInt32 || file.shape.size() != 1) {
      return bad_input(names[i], fmt::format("{} is not a 1-D int32 array", file.text()));
    }
    KVAUDIT_ASSIGN_OR_RETURN(const std::vector<std::uint8_t> bytes,
                             read_array(directory_, file, names[i]));
    *arrays[i] = int32_values(bytes);
  }
  return check_step_indices(step.meta, model_->attrs.page_size, model_->num_slots);
}

Status Server::read_tensors(const nlohmann::json& inputs, ServedStep& step) const {
  const DumpAttributes& attrs = model_->attrs;
  const std::int64_t rows = step.meta.num_rows();
  std::vector<float>* tensors[] = {&step.tensors.q_nope, &step.tensors.q_pe, &step.tensors.new_kv};
  const char* names[] = {"q_nope", "q_pe", "new_kv"};
  const std::vector<std::int64_t> shapes[] = {{rows, attrs.num_heads, attrs.kv_lora_rank},
                                              {rows, attrs.num_heads, attrs.qk_rope_head_dim},
                                              {rows, attrs.row_width()}};
  for (std::size_t i = 0; i < std::size(names); ++i) {
    KVAUDIT_ASSIGN_OR_RETURN(const ArrayDescriptor file,
                             parse_descriptor(inputs.value(names[i], nlohmann::json()), names[i]));
    KVAUDIT_TRY(
        expect_shape(file, names[i], {ArrayDtype::kBfloat16, ArrayDtype::kFloat32}, shapes[i]));
    KVAUDIT_ASSIGN_OR_RETURN(const std::vector<std::uint8_t> bytes,
                             read_array(directory_, file, names[i]));
    KVAUDIT_ASSIGN_OR_RETURN(*tensors[i], decode_tensor(file.dtype, bytes, names[i]));
  }
  return read_topk_indices(inputs, step);
}

// Version 2, a sparse step: topk_indices int32 [Nq, K], checked by the v1.1 rules.
Status Server::read_topk_indices(const nlohmann::json& inputs, ServedStep& step) const {
  if (!inputs.contains("topk_indices")) return ok_status();
  KVAUDIT_ASSIGN_OR_RETURN(const ArrayDescriptor file,
                           parse_descriptor(inputs.at("topk_indices"), "topk_indices"));
  if (file.dtype != ArrayDtype::kInt32 || file.shape.size() != 2 ||
      file.shape[0] != step.meta.num_rows() || file.shape[1] < 1) {
    return bad_input("topk_indices", fmt::format("{} is not int32 [Nq, K]", file.text()));
  }
  KVAUDIT_ASSIGN_OR_RETURN(const std::vector<std::uint8_t> bytes,
                           read_array(directory_, file, "topk_indices"));
  step.tensors.topk_indices = int32_values(bytes);
  step.tensors.topk = static_cast<int>(file.shape[1]);
  return check_topk_indices(step.meta, model_->attrs.page_size, step.tensors.topk_indices,
                            step.tensors.topk, "topk_indices");
}

Result<ServedStep> Server::parse_step(const nlohmann::json& request) const {
  ServedStep step;
  const nlohmann::json meta = request.value("step", nlohmann::json());
  if (!meta.is_object()) return bad_input("step", "step is missing or not an object");
  KVAUDIT_ASSIGN_OR_RETURN(const std::int64_t index, integer_member(meta, "index", "step"));
  KVAUDIT_ASSIGN_OR_RETURN(step.meta.group, string_member(meta, "group", "step"));
  KVAUDIT_ASSIGN_OR_RETURN(const std::string kind, string_member(meta, "kind", "step"));
  if (index < 0 || (kind != "prefill" && kind != "decode")) {
    return bad_input("step", "index must be >= 0 and kind prefill or decode");
  }
  step.index = static_cast<std::size_t>(index);
  step.meta.kind = kind == "prefill" ? StepKind::kPrefill : StepKind::kDecode;
  KVAUDIT_ASSIGN_OR_RETURN(step.layer,
                           parse_layer(request.value("layer", nlohmann::json()), "step layer"));
  step.pool_reloaded = bool_or(request, "pool_reloaded", false);
  const nlohmann::json inputs = request.value("inputs", nlohmann::json());
  const nlohmann::json outputs = request.value("outputs", nlohmann::json());
  if (!inputs.is_object() || !outputs.is_object()) {
    return bad_input("step", "inputs or outputs is missing or not an object");
  }
  KVAUDIT_TRY(read_indices(inputs, step));
  KVAUDIT_TRY(read_tensors(inputs, step));
  const DumpAttributes& attrs = model_->attrs;
  const std::int64_t rows = step.meta.num_rows();
  KVAUDIT_ASSIGN_OR_RETURN(step.out,
                           parse_descriptor(outputs.value("out", nlohmann::json()), "out"));
  KVAUDIT_ASSIGN_OR_RETURN(step.lse,
                           parse_descriptor(outputs.value("lse", nlohmann::json()), "lse"));
  KVAUDIT_TRY(expect_shape(step.out, "out", {ArrayDtype::kBfloat16},
                           {rows, attrs.num_heads, attrs.kv_lora_rank}));
  KVAUDIT_TRY(expect_shape(step.lse, "lse", {ArrayDtype::kFloat32}, {rows, attrs.num_heads}));
  return step;
}

// out and lse into their files; the whole pool into the layer's pool file (with a descriptor in
// the reply when its storage is no longer the layer's).
Result<nlohmann::json> Server::write_results(const ServedStep& step, const AttentionOutput& output,
                                             ServedLayer& layer) {
  std::vector<std::uint8_t> out(output.out_bf16.size() * 2);
  std::memcpy(out.data(), output.out_bf16.data(), out.size());  // little-endian host
  std::vector<std::uint8_t> lse(output.lse.size() * 4);
  std::memcpy(lse.data(), output.lse.data(), lse.size());
  if (out.size() != step.out.bytes() || lse.size() != step.lse.bytes()) {
    return internal_error("step", "the backend returned out/lse of the wrong size");
  }
  KVAUDIT_TRY(write_array(directory_, step.out, out));
  KVAUDIT_TRY(write_array(directory_, step.lse, lse));
  const ArrayDescriptor stored = pool_descriptor(layer.file.file, layer.pool);
  const KvPool& pool = layer.pool;
  KVAUDIT_TRY(write_array(directory_, stored, pool.bytes));
  nlohmann::json reply = {{"type", "result"}};
  if (stored.dtype != layer.file.dtype || stored.shape != layer.file.shape) {
    reply["pool"] = descriptor_json(stored);
  }
  return reply;
}

Result<nlohmann::json> Server::step(const nlohmann::json& request) {
  KVAUDIT_ASSIGN_OR_RETURN(const ServedStep step, parse_step(request));
  const auto found = layers_.find(step.layer.group);
  if (found == layers_.end()) {
    return bad_input("step", fmt::format("layer {} has had no layer request", step.layer.group));
  }
  ServedLayer& layer = found->second;
  if (step.pool_reloaded) {
    KVAUDIT_ASSIGN_OR_RETURN(layer.pool, read_pool_file(directory_, layer.file, *model_));
  }
  const auto start = std::chrono::steady_clock::now();
  const StepLayerInput input{model_->attrs, step.meta,  step.layer,
                             step.tensors,  step.index, layer.index};
  KVAUDIT_ASSIGN_OR_RETURN(const AttentionOutput output, backend_->run_step(input, layer.pool));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  KVAUDIT_ASSIGN_OR_RETURN(nlohmann::json reply, write_results(step, output, layer));
  reply["compute_seconds"] = seconds;
  return reply;
}

Result<nlohmann::json> Server::bench(const nlohmann::json& request) {
  if (!hooks_.bench) return unsupported("bench", fmt::format("{} has no bench", backend_->name()));
  KVAUDIT_ASSIGN_OR_RETURN(nlohmann::json timing, hooks_.bench(request));
  timing["type"] = "bench";
  return timing;
}

int Server::run(std::istream& requests) {
  std::string line;
  if (!std::getline(requests, line)) {
    fmt::print(stderr, "kvaudit backend-serve: no hello: standard input ended first\n");
    return 2;
  }
  const nlohmann::json first = nlohmann::json::parse(line, nullptr, false);
  const Result<nlohmann::json> greeted =
      first.is_object() ? hello(first) : Result<nlohmann::json>(bad_input("hello", "not JSON"));
  if (!greeted) {
    reply(error_reply(reply_kind(greeted.error().kind), greeted.error().message()));
    return 2;
  }
  reply(*greeted);
  while (std::getline(requests, line)) {
    const nlohmann::json request = nlohmann::json::parse(line, nullptr, false);
    if (!request.is_object()) {
      reply(error_reply(ReplyErrorKind::kBadInput, "a request is not a JSON object"));
      continue;
    }
    if (string_or(request, "type", "") == "bye") {
      reply({{"type", "bye"}});
      return 0;
    }
    const Result<nlohmann::json> answer = dispatch(request);
    reply(answer ? *answer
                 : error_reply(reply_kind(answer.error().kind), answer.error().message()));
  }
  return 0;
}

}  // namespace

int serve_backend(std::istream& requests, std::FILE* replies, const ServerHooks& hooks) {
  Server server(replies, hooks);
  return server.run(requests);
}

}  // namespace kvaudit::exec
