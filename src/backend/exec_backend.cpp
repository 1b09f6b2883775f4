// The exec backend (src/backend/exec_backend.hpp): a Backend that speaks the external backend
// protocol to a program. Shapes per (step, layer): q_nope [Nq, H, Dc], q_pe [Nq, H, Dr],
// new_kv [Nq, D], out [Nq, H, Dc] bf16 bits, lse [Nq, H] fp32; pools [S, D] as stored, or
// per_token_group [S, slot_bytes] uint8 slots (protocol version 2).
#include "src/backend/exec_backend.hpp"

#include <fmt/format.h>

#include <chrono>
#include <cstring>
#include <optional>
#include <system_error>

#include "src/backend/exec_protocol.hpp"
#include "src/backend/exec_session.hpp"

namespace kvaudit {
namespace {

using exec::ArrayDescriptor;
using exec::ArrayDtype;
using exec::Clock;

constexpr const char* kPoolFile = "pool.bin";
constexpr const char* kOutFile = "out.bin";
constexpr const char* kLseFile = "lse.bin";
constexpr const char* kIndexInputs[] = {"qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len",
                                        "new_kv_slots"};
constexpr const char* kTensorInputs[] = {"q_nope", "q_pe", "new_kv"};

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::string file_of(std::string_view input) { return fmt::format("{}.bin", input); }

// What the protocol cost, summed over the run (docs/report-schema.md "timing").
struct ProtocolStatistics {
  double startup_seconds = 0;  // program start to hello reply
  int layer_requests = 0;
  double layer_seconds = 0;  // pool file written + layer round trip
  int steps = 0;
  double step_seconds = 0;     // every step's round trip, as kvaudit measures it
  int steps_with_compute = 0;  // steps whose reply gave compute_seconds
  double timed_step_seconds = 0;
  double compute_seconds = 0;

  double overhead_seconds() const { return timed_step_seconds - compute_seconds + layer_seconds; }
};

// The pool as the program last returned it, to tell whether the replay passes another one.
struct PoolSnapshot {
  std::optional<KvPool> pool;

  bool holds(const KvPool& other) const {
    return pool && pool->same_form(other) && pool->bytes == other.bytes;
  }
  void take(const KvPool& other) { pool = other; }
};

// `pool`'s form (every field but the bytes).
KvPool form_of(const KvPool& pool) {
  KvPool form = pool.zeros_like(0);
  form.num_slots = pool.num_slots;
  return form;
}

class ExecBackend final : public Backend {
 public:
  ExecBackend(std::string name, std::unique_ptr<exec::ExecSession> session, exec::HelloReply hello,
              int version)
      : name_(std::move(name)),
        session_(std::move(session)),
        hello_(std::move(hello)),
        version_(version) {
    statistics_.startup_seconds = hello_.seconds;
    for (const char* file : {kPoolFile, kOutFile, kLseFile}) session_->note_program_file(file);
    for (const char* input : kIndexInputs) session_->note_program_file(file_of(input));
    for (const char* input : kTensorInputs) session_->note_program_file(file_of(input));
  }

  std::string name() const override { return fmt::format("exec:{}", name_); }
  nlohmann::json describe() const override;
  nlohmann::json protocol_statistics() const override;
  // The program holds one layer's pool (a `layer` request per new layer): layers one at a time.
  BackendConcurrency concurrency() const override { return BackendConcurrency::kOneLayerAtATime; }
  Result<AttentionOutput> run_step(const StepLayerInput& input, KvPool& pool) override;

 private:
  std::string context_of(const StepLayerInput& input) const;
  Status refuse_sparse(const StepLayerInput& input, const std::string& context) const;
  Status load_layer(const StepLayerInput& input, const KvPool& pool);
  Result<bool> refresh_pool_file(const KvPool& pool);
  Result<nlohmann::json> write_inputs(const StepLayerInput& input);
  nlohmann::json step_request(const StepLayerInput& input, bool pool_reloaded,
                              nlohmann::json inputs) const;
  Result<AttentionOutput> read_outputs(const StepLayerInput& input, const std::string& context);
  Status read_pool(const nlohmann::json& reply, KvPool& pool, const std::string& context);
  void count_step(const nlohmann::json& reply, double seconds);
  Error failure(const std::string& context, const Error& error) const;

  std::string name_;
  std::unique_ptr<exec::ExecSession> session_;
  exec::HelloReply hello_;
  int version_;                             // the protocol version of the session
  std::optional<std::size_t> layer_index_;  // the layer the program holds
  ArrayDescriptor layer_pool_;              // pool.bin as the layer request gave it
  KvPool layer_form_;                       // the layer's pool form (no bytes)
  PoolSnapshot returned_;
  ProtocolStatistics statistics_;
};

nlohmann::json ExecBackend::describe() const {
  nlohmann::json description = hello_.describe;
  description["exec"] = {{"command", session_->command()},
                         {"protocol", exec::kProtocolName},
                         {"protocol_version", version_},
                         {"capabilities", hello_.capabilities}};
  return description;
}

nlohmann::json ExecBackend::protocol_statistics() const {
  const ProtocolStatistics& s = statistics_;
  const double overhead = s.overhead_seconds();
  return {{"protocol_version", version_},
          {"startup_seconds", s.startup_seconds},
          {"layer_requests", s.layer_requests},
          {"layer_seconds", s.layer_seconds},
          {"steps", s.steps},
          {"step_seconds", s.step_seconds},
          {"steps_with_compute_seconds", s.steps_with_compute},
          {"compute_seconds", s.compute_seconds},
          {"overhead_seconds", overhead},
          {"overhead_per_step_ms", s.steps_with_compute > 0
                                       ? nlohmann::json(1e3 * overhead / s.steps_with_compute)
                                       : nlohmann::json(nullptr)}};
}

std::string ExecBackend::context_of(const StepLayerInput& input) const {
  return fmt::format("step {} ({}), layer {} ({})", input.step_index, input.step.group,
                     input.layer.layer_id, input.layer.group);
}

// An error of this side of the step (a file the program left wrong), naming the step and layer.
Error ExecBackend::failure(const std::string& context, const Error& error) const {
  return bad_input(name(), fmt::format("step request for {}: {} (command: {})", context,
                                       error.message(), session_->command()));
}

// 0. A sparse step (v1.1 topk_indices) goes out as the step plus its topk_indices in a version-2
// session (a per_token_group dump); version 1 has no topk_indices, so there it is refused before
// anything is sent, and the program stays in the session (kvaudit then says bye).
Status ExecBackend::refuse_sparse(const StepLayerInput& input, const std::string& context) const {
  if (!input.tensors.sparse() || version_ >= 2) return ok_status();
  return unsupported(
      name(), fmt::format("step request for {}: the step is sparse (topk_indices, K = {}): "
                          "protocol version {} has no topk_indices (version 2, for "
                          "per_token_group dumps, does); check this dump with a built-in backend "
                          "(cpu-fp8, cuda-fp8) (command: {})",
                          context, input.tensors.topk, version_, session_->command()));
}

// 1. A new layer: its pool into pool.bin, then the layer request.
Status ExecBackend::load_layer(const StepLayerInput& input, const KvPool& pool) {
  const auto start = Clock::now();
  layer_form_ = form_of(pool);
  layer_pool_ = exec::pool_descriptor(kPoolFile, pool);
  KVAUDIT_TRY(exec::write_array(session_->directory(), layer_pool_, pool.bytes));
  const nlohmann::json request = {{"type", "layer"},
                                  {"layer", exec::layer_json(input.layer)},
                                  {"pool", exec::descriptor_json(layer_pool_)}};
  KVAUDIT_TRY(session_->request(
      request, "ok", fmt::format("layer {} ({})", input.layer.layer_id, input.layer.group)));
  layer_index_ = input.layer_index;
  returned_.take(pool);
  statistics_.layer_requests += 1;
  statistics_.layer_seconds += seconds_since(start);
  return ok_status();
}

// 1. The same layer: when the replay passes another pool than the program returned, pool.bin
// gets it (in the layer's storage) and the step says pool_reloaded.
Result<bool> ExecBackend::refresh_pool_file(const KvPool& pool) {
  if (returned_.holds(pool)) return false;
  layer_form_ = form_of(pool);
  layer_pool_ = exec::pool_descriptor(kPoolFile, pool);
  KVAUDIT_TRY(exec::write_array(session_->directory(), layer_pool_, pool.bytes));
  returned_.take(pool);
  return true;
}

// 2. The step's inputs as files; their descriptors.
Result<nlohmann::json> ExecBackend::write_inputs(const StepLayerInput& input) {
  const StepMeta& step = input.step;
  const DumpAttributes& attrs = input.attrs;
  const std::int64_t rows = step.num_rows();
  nlohmann::json inputs = nlohmann::json::object();
  const std::vector<std::int32_t>* indices[] = {&step.qo_indptr, &step.kv_indptr, &step.kv_indices,
                                                &step.kv_last_page_len, &step.new_kv_slots};
  for (std::size_t i = 0; i < std::size(kIndexInputs); ++i) {
    const ArrayDescriptor descriptor{file_of(kIndexInputs[i]),
                                     ArrayDtype::kInt32,
                                     {static_cast<std::int64_t>(indices[i]->size())}};
    KVAUDIT_TRY(
        exec::write_array(session_->directory(), descriptor, exec::int32_bytes(*indices[i])));
    inputs[kIndexInputs[i]] = exec::descriptor_json(descriptor);
  }
  const std::vector<float>* tensors[] = {&input.tensors.q_nope, &input.tensors.q_pe,
                                         &input.tensors.new_kv};
  const std::vector<std::int64_t> shapes[] = {{rows, attrs.num_heads, attrs.kv_lora_rank},
                                              {rows, attrs.num_heads, attrs.qk_rope_head_dim},
                                              {rows, attrs.row_width()}};
  for (std::size_t i = 0; i < std::size(kTensorInputs); ++i) {
    const exec::EncodedTensor encoded = exec::encode_tensor(*tensors[i]);
    const ArrayDescriptor descriptor{file_of(kTensorInputs[i]), encoded.dtype, shapes[i]};
    KVAUDIT_TRY(exec::write_array(session_->directory(), descriptor, encoded.bytes));
    inputs[kTensorInputs[i]] = exec::descriptor_json(descriptor);
  }
  if (input.tensors.sparse()) {  // version 2: [Nq, K] token positions of each row's request
    const ArrayDescriptor descriptor{"topk_indices.bin",
                                     ArrayDtype::kInt32,
                                     {rows, static_cast<std::int64_t>(input.tensors.topk)}};
    KVAUDIT_TRY(exec::write_array(session_->directory(), descriptor,
                                  exec::int32_bytes(input.tensors.topk_indices)));
    inputs["topk_indices"] = exec::descriptor_json(descriptor);
  }
  // Outputs are read back at their exact sizes: stale files of the last step must not pass.
  std::error_code ignored;
  std::filesystem::remove(session_->directory() / kOutFile, ignored);
  std::filesystem::remove(session_->directory() / kLseFile, ignored);
  return inputs;
}

nlohmann::json ExecBackend::step_request(const StepLayerInput& input, bool pool_reloaded,
                                         nlohmann::json inputs) const {
  const std::int64_t rows = input.step.num_rows();
  const int heads = input.attrs.num_heads;
  const ArrayDescriptor out{
      kOutFile, ArrayDtype::kBfloat16, {rows, heads, input.attrs.kv_lora_rank}};
  const ArrayDescriptor lse{kLseFile, ArrayDtype::kFloat32, {rows, heads}};
  return {{"type", "step"},
          {"step",
           {{"index", input.step_index},
            {"group", input.step.group},
            {"kind", step_kind_name(input.step.kind)}}},
          {"layer", exec::layer_json(input.layer)},
          {"pool_reloaded", pool_reloaded},
          {"inputs", std::move(inputs)},
          {"outputs", {{"out", exec::descriptor_json(out)}, {"lse", exec::descriptor_json(lse)}}}};
}

// 3. out and lse, at exactly the sizes the request gave.
Result<AttentionOutput> ExecBackend::read_outputs(const StepLayerInput& input,
                                                  const std::string& context) {
  const std::int64_t rows = input.step.num_rows();
  const int heads = input.attrs.num_heads;
  const ArrayDescriptor out{
      kOutFile, ArrayDtype::kBfloat16, {rows, heads, input.attrs.kv_lora_rank}};
  const ArrayDescriptor lse{kLseFile, ArrayDtype::kFloat32, {rows, heads}};
  Result<std::vector<std::uint8_t>> out_bytes = exec::read_array(session_->directory(), out, "out");
  if (!out_bytes) return failure(context, out_bytes.error());
  Result<std::vector<std::uint8_t>> lse_bytes = exec::read_array(session_->directory(), lse, "lse");
  if (!lse_bytes) return failure(context, lse_bytes.error());
  AttentionOutput output;
  output.out_bf16.resize(static_cast<std::size_t>(out.count()));
  std::memcpy(output.out_bf16.data(), out_bytes->data(), out_bytes->size());  // little-endian host
  KVAUDIT_ASSIGN_OR_RETURN(output.lse,
                           exec::decode_tensor(ArrayDtype::kFloat32, *lse_bytes, "lse"));
  return output;
}

// 3. The pool the program left: the reply's descriptor where it changed its storage (uint8 or
// bfloat16, [slots, width]), else pool.bin in the layer's form. A pool file of the layer's dtype
// and shape keeps the layer's form (a per_token_group slot stays one); another is a plain pool of
// its dtype, [slots, width] elements.
Status ExecBackend::read_pool(const nlohmann::json& reply, KvPool& pool,
                              const std::string& context) {
  ArrayDescriptor descriptor = layer_pool_;
  if (reply.contains("pool")) {
    Result<ArrayDescriptor> changed = exec::parse_descriptor(reply["pool"], "the reply's pool");
    if (!changed) return failure(context, changed.error());
    session_->note_program_file(changed->file);
    if ((changed->dtype != ArrayDtype::kUint8 && changed->dtype != ArrayDtype::kBfloat16) ||
        changed->shape.size() != 2) {
      return failure(context,
                     bad_input("the reply's pool", fmt::format("{} is not a pool: uint8 or "
                                                               "bfloat16 [slots, width]",
                                                               changed->text())));
    }
    descriptor = *changed;
  }
  Result<std::vector<std::uint8_t>> bytes =
      exec::read_array(session_->directory(), descriptor, "pool");
  if (!bytes) return failure(context, bytes.error());
  if (exec::is_pool_of_form(descriptor, layer_form_)) {
    pool = layer_form_;
  } else {
    pool = KvPool{};
    pool.dtype =
        descriptor.dtype == ArrayDtype::kBfloat16 ? KvDtype::kBfloat16 : KvDtype::kFloat8E4m3fn;
    pool.num_slots = descriptor.shape[0];
    pool.row_width = static_cast<int>(descriptor.shape[1]);
  }
  pool.bytes.assign(bytes->begin(), bytes->end());
  returned_.take(pool);
  return ok_status();
}

void ExecBackend::count_step(const nlohmann::json& reply, double seconds) {
  statistics_.steps += 1;
  statistics_.step_seconds += seconds;
  const auto compute = reply.find("compute_seconds");
  if (compute == reply.end() || !compute->is_number()) return;
  statistics_.steps_with_compute += 1;
  statistics_.timed_step_seconds += seconds;
  statistics_.compute_seconds += compute->get<double>();
}

Result<AttentionOutput> ExecBackend::run_step(const StepLayerInput& input, KvPool& pool) {
  const std::string context = context_of(input);
  KVAUDIT_TRY(refuse_sparse(input, context));
  if (!layer_index_ || *layer_index_ != input.layer_index) KVAUDIT_TRY(load_layer(input, pool));
  const auto start = Clock::now();
  KVAUDIT_ASSIGN_OR_RETURN(const bool pool_reloaded, refresh_pool_file(pool));
  KVAUDIT_ASSIGN_OR_RETURN(nlohmann::json inputs, write_inputs(input));
  KVAUDIT_ASSIGN_OR_RETURN(
      const nlohmann::json reply,
      session_->request(step_request(input, pool_reloaded, std::move(inputs)), "result", context));
  KVAUDIT_ASSIGN_OR_RETURN(AttentionOutput output, read_outputs(input, context));
  KVAUDIT_TRY(read_pool(reply, pool, context));
  count_step(reply, seconds_since(start));
  return output;
}

}  // namespace

Result<std::unique_ptr<Backend>> make_exec_backend(std::string_view name,
                                                   const BackendOptions& options) {
  const std::string label = fmt::format("exec:{}", name);
  if (options.dump == nullptr) {
    return internal_error(label, "an exec backend needs the dump it will replay");
  }
  const std::string command =
      options.exec_command.empty() ? exec::default_exec_command(name) : options.exec_command;
  KVAUDIT_ASSIGN_OR_RETURN(std::unique_ptr<exec::ExecSession> session,
                           exec::ExecSession::start(label, command));
  const DumpLayout& layout = *options.dump;
  KVAUDIT_ASSIGN_OR_RETURN(exec::HelloReply hello,
                           session->hello(name, exec::model_json(layout.attrs, layout.num_slots()),
                                          options.reciprocal_scale));
  return std::unique_ptr<Backend>(
      std::make_unique<ExecBackend>(std::string(name), std::move(session), std::move(hello),
                                    exec::protocol_version_for(layout.attrs)));
}

}  // namespace kvaudit
