// Protocol version 2 (docs/backend-protocol.md "Version 2"): kvdump v1.1 per_token_group dumps
// behind the external backend protocol. The hello's model of a grouped dump carries
// kv_scale_group_size, kv_scale_format, kv_rope_dtype and slot_bytes, and kvaudit asks for
// version 2 (a per_tensor dump's hello stays version 1's, byte for byte); a grouped pool travels
// as its slots' bytes, uint8 [S, slot_bytes], and comes back in its form, through the pool file
// and through `kvaudit backend-serve cpu-fp8` (whose report and outputs equal cpu-fp8's in
// process on datasets/glm5_pertoken_fp8rope.h5); a sparse step travels with its topk_indices
// (datasets/glm5_dsa_flashmla.h5 through backend-serve equals cpu-fp8 in process).
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "src/backend/exec_backend.hpp"
#include "src/backend/exec_protocol.hpp"
#include "src/backend/exec_server.hpp"
#include "src/backend/exec_session.hpp"
#include "src/format/group_scales.hpp"
#include "tests/backend/exec_test_support.hpp"

namespace kvaudit {
namespace {

using exec::ArrayDescriptor;
using exec::ArrayDtype;
using exec_test::case_dir;
using exec_test::CommandRun;
using exec_test::kvaudit;
using exec_test::mla_attrs;
using exec_test::quoted;
using exec_test::run_shell;
using exec_test::serve_command;
using exec_test::shipped_dump;

// GLM-5's MLA with FlashInfer's per-token form: groups of 128, float32 scales, e4m3 RoPE.
DumpAttributes grouped_attrs(GroupScaleFormat format = GroupScaleFormat::kFloat32,
                             KvDtype rope = KvDtype::kFloat8E4m3fn) {
  DumpAttributes attrs = mla_attrs(0.07216878364870323, 16);
  attrs.kv_scale_kind = "per_token_group";
  attrs.format_minor_version = 1;
  attrs.kv_scale_group_size = 128;
  attrs.kv_scale_format = format;
  attrs.kv_rope_dtype = rope;
  return attrs;
}

// A grouped pool with rows written by the v1.1 rule into every other slot (the rest zero bytes).
KvPool written_pool(const DumpAttributes& attrs, std::int64_t slots, float kv_scale) {
  KvPool pool = KvPool::zeros_for(attrs, slots);
  std::vector<float> row(static_cast<std::size_t>(attrs.row_width()));
  for (std::int64_t slot = 0; slot < slots; slot += 2) {
    for (std::size_t j = 0; j < row.size(); ++j) {
      row[j] =
          std::ldexp(static_cast<float>((slot * 131 + static_cast<std::int64_t>(j) * 17) % 97 - 48),
                     static_cast<int>(j / 128) - 3);
    }
    pool.write_row(slot, row.data(), kv_scale);
  }
  return pool;
}

// A program that writes the hello line it gets into `file`, answers `hello_reply`, then `reply`.
std::string recording_program(const std::filesystem::path& file, const std::string& hello_reply,
                              const std::string& reply) {
  return "read -r line; printf '%s\\n' \"$line\" > " + quoted(file) + "; printf '%s\\n' '" +
         hello_reply + "'; while read -r line; do printf '%s\\n' '" + reply + "'; done";
}

// A backend for exec::serve_backend that records the pool it is handed, then writes one row with
// the v1.1 rule and returns zeros.
class RecordingBackend final : public Backend {
 public:
  explicit RecordingBackend(std::vector<KvPool>* seen) : seen_(seen) {}
  std::string name() const override { return "recording"; }
  nlohmann::json describe() const override { return {{"name", "recording"}}; }
  Result<AttentionOutput> run_step(const StepLayerInput& input, KvPool& pool) override {
    seen_->push_back(pool);
    const int width = input.attrs.row_width();
    for (int i = 0; i < input.step.num_rows(); ++i) {
      pool.write_row(input.step.new_kv_slots[i],
                     input.tensors.new_kv.data() + static_cast<std::size_t>(i) * width,
                     input.layer.kv_scale);
    }
    AttentionOutput output;
    const std::size_t rows = static_cast<std::size_t>(input.step.num_rows());
    output.out_bf16.assign(rows * input.attrs.num_heads * input.attrs.kv_lora_rank, 0);
    output.lse.assign(rows * input.attrs.num_heads, 0.0f);
    return output;
  }

 private:
  std::vector<KvPool>* seen_;
};

nlohmann::json first_line_json(std::FILE* file) {
  std::rewind(file);
  std::string line;
  for (int c = std::fgetc(file); c != EOF && c != '\n'; c = std::fgetc(file)) {
    line.push_back(static_cast<char>(c));
  }
  return nlohmann::json::parse(line, nullptr, false);
}

std::vector<nlohmann::json> all_lines_json(std::FILE* file) {
  std::rewind(file);
  std::vector<nlohmann::json> lines;
  std::string line;
  for (int c = std::fgetc(file); c != EOF; c = std::fgetc(file)) {
    if (c != '\n') {
      line.push_back(static_cast<char>(c));
      continue;
    }
    lines.push_back(nlohmann::json::parse(line, nullptr, false));
    line.clear();
  }
  return lines;
}

}  // namespace

TEST_CASE("exec protocol v2: a per_token_group model carries the group keys and slot_bytes",
          "[exec][protocol][grouped]") {
  const DumpAttributes attrs = grouped_attrs();
  const nlohmann::json model = exec::model_json(attrs, 288);
  CHECK(model.value("kv_scale_kind", "") == "per_token_group");
  CHECK(model.value("kv_scale_group_size", 0) == 128);
  CHECK(model.value("kv_scale_format", "") == "float32");
  CHECK(model.value("kv_rope_dtype", "") == "float8_e4m3fn");
  CHECK(model.value("slot_bytes", 0) == 512 + 4 * 4 + 64);  // 592
  CHECK(exec::hello_version(model) == 2);
  CHECK(exec::protocol_version_for(attrs) == 2);

  // Every form's slot size: e8m0 scales are one byte, a bf16 RoPE two per value.
  CHECK(exec::model_json(grouped_attrs(GroupScaleFormat::kE8m0, KvDtype::kBfloat16), 8)
            .value("slot_bytes", 0) == 512 + 4 + 128);
  CHECK(exec::model_json(grouped_attrs(GroupScaleFormat::kPowerOfTwo, KvDtype::kBfloat16), 8)
            .value("slot_bytes", 0) == 656);  // FlashMLA's packed slot

  // The model round-trips through its text exactly, in a version 2 hello.
  const auto parsed = exec::parse_model(nlohmann::json::parse(model.dump()), 2);
  REQUIRE(parsed.ok());
  CHECK(parsed->num_slots == 288);
  CHECK(parsed->attrs.per_token_group());
  CHECK(parsed->attrs.kv_scale_group_size == 128);
  CHECK(parsed->attrs.num_scale_groups() == 4);
  CHECK(parsed->attrs.kv_scale_format == GroupScaleFormat::kFloat32);
  CHECK(parsed->attrs.kv_rope_dtype == KvDtype::kFloat8E4m3fn);
  CHECK(parsed->attrs.sm_scale == attrs.sm_scale);
  for (const auto format :
       {GroupScaleFormat::kFloat32, GroupScaleFormat::kPowerOfTwo, GroupScaleFormat::kE8m0}) {
    for (const auto rope : {KvDtype::kFloat8E4m3fn, KvDtype::kBfloat16}) {
      const auto again = exec::parse_model(exec::model_json(grouped_attrs(format, rope), 16), 2);
      REQUIRE(again.ok());
      CHECK(again->attrs.kv_scale_format == format);
      CHECK(again->attrs.kv_rope_dtype == rope);
    }
  }

  // A version 1 hello cannot carry it.
  const auto v1 = exec::parse_model(model, 1);
  REQUIRE_FALSE(v1.ok());
  CHECK(v1.error().kind == ErrorKind::kUnsupported);
  CHECK_THAT(v1.error().message(), Catch::Contains("needs protocol version 2"));

  // What a version 2 model must hold.
  nlohmann::json wrong = model;
  wrong["slot_bytes"] = 576;
  CHECK_THAT(exec::parse_model(wrong, 2).error().message(),
             Catch::Contains("slot_bytes 576 is not the 592 bytes of a slot"));
  wrong = model;
  wrong["kv_scale_group_size"] = 100;
  CHECK_FALSE(exec::parse_model(wrong, 2).ok());
  wrong = model;
  wrong["kv_scale_format"] = "ue8m0";
  CHECK(exec::parse_model(wrong, 2).error().kind == ErrorKind::kUnsupported);
  wrong = model;
  wrong.erase("kv_rope_dtype");
  CHECK_THAT(exec::parse_model(wrong, 2).error().message(), Catch::Contains("kv_rope_dtype"));
  wrong = model;
  wrong["kv_dtype"] = "bfloat16";
  CHECK_FALSE(exec::parse_model(wrong, 2).ok());
}

TEST_CASE("exec protocol v2: a per_tensor model and hello stay version 1's, byte for byte",
          "[exec][protocol][grouped]") {
  DumpAttributes attrs = mla_attrs(0.25, 1);
  const nlohmann::json model = exec::model_json(attrs, 4096);
  CHECK(model.dump() ==
        R"({"kv_dtype":"float8_e4m3fn","kv_lora_rank":512,"kv_scale_kind":"per_tensor",)"
        R"("num_heads":16,"num_slots":4096,"page_size":1,"qk_rope_head_dim":64,)"
        R"("sm_scale":0.25})");
  CHECK(exec::hello_version(model) == 1);
  CHECK(exec::hello_version(nullptr) == 1);  // a bench session
  CHECK(exec::protocol_version_for(attrs) == 1);
  const KvPool form = exec::pool_form(attrs, 4096);
  const ArrayDescriptor pool = exec::pool_descriptor("pool.bin", form);
  CHECK(pool.dtype == ArrayDtype::kUint8);
  CHECK(pool.shape == std::vector<std::int64_t>{4096, 576});
  attrs.kv_dtype = KvDtype::kBfloat16;
  const ArrayDescriptor bf16 = exec::pool_descriptor("pool.bin", exec::pool_form(attrs, 8));
  CHECK(bf16.dtype == ArrayDtype::kBfloat16);
  CHECK(bf16.shape == std::vector<std::int64_t>{8, 576});
  // A per_tensor model parses in either version.
  CHECK(exec::parse_model(model, 1).ok());
  CHECK(exec::parse_model(model, 2).ok());
}

TEST_CASE("exec session v2: a grouped dump's hello asks for version 2 with the group keys",
          "[exec][protocol][grouped]") {
  const auto dir = case_dir("grouped_session");
  const nlohmann::json model = exec::model_json(grouped_attrs(), 32);
  {
    auto session = exec::ExecSession::start(
        "exec:g", recording_program(dir / "hello.json", R"({"type":"hello","version":2})",
                                    R"({"type":"bye"})"));
    REQUIRE(session.ok());
    REQUIRE((*session)->hello("g", model, false).ok());
  }
  const nlohmann::json hello = exec_test::load_json(dir / "hello.json");
  REQUIRE(hello.is_object());
  CHECK(hello.value("version", 0) == 2);
  CHECK(hello["model"] == model);
  CHECK(hello["model"].value("slot_bytes", 0) == 592);
  // A program that answers version 1 to it has not understood it.
  auto old = exec::ExecSession::start(
      "exec:old",
      recording_program(dir / "old.json", R"({"type":"hello","version":1})", R"({"type":"bye"})"));
  REQUIRE(old.ok());
  const auto refused = (*old)->hello("old", model, false);
  REQUIRE_FALSE(refused.ok());
  CHECK_THAT(refused.error().message(), Catch::Contains("protocol version 1; kvaudit asked for 2"));
}

TEST_CASE("exec protocol v2: a grouped pool travels as its slots' bytes and keeps its form",
          "[exec][protocol][grouped]") {
  for (const auto format :
       {GroupScaleFormat::kFloat32, GroupScaleFormat::kPowerOfTwo, GroupScaleFormat::kE8m0}) {
    for (const auto rope : {KvDtype::kFloat8E4m3fn, KvDtype::kBfloat16}) {
      const DumpAttributes attrs = grouped_attrs(format, rope);
      const float kv_scale = rope == KvDtype::kBfloat16 ? 1.0f : 0.232142851f;
      const KvPool pool = written_pool(attrs, 32, kv_scale);
      INFO(group_scale_format_name(format) << " " << kv_dtype_name(rope));
      const ArrayDescriptor descriptor = exec::pool_descriptor("pool.bin", pool);
      CHECK(descriptor.dtype == ArrayDtype::kUint8);
      CHECK(descriptor.shape ==
            std::vector<std::int64_t>{32, static_cast<std::int64_t>(pool.row_bytes())});
      CHECK(descriptor.bytes() == pool.bytes.size());
      CHECK(exec::is_pool_of_form(descriptor, exec::pool_form(attrs, 32)));
      // Not the form of a per_tensor pool of the same widths, nor of another slot.
      CHECK_FALSE(exec::is_pool_of_form(ArrayDescriptor{"pool.bin", ArrayDtype::kUint8, {32, 576}},
                                        exec::pool_form(attrs, 32)));

      const auto dir = case_dir("grouped_pool_file");
      REQUIRE(exec::write_array(dir, descriptor, pool.bytes).ok());
      const auto back = exec::read_array(dir, descriptor, "pool");
      REQUIRE(back.ok());
      CHECK(*back == pool.bytes);
      // The slot's bytes are [Dc codes][G scales][Dr RoPE]: slot 2's scale of group 1 sits at
      // byte Dc + 1 * scale_bytes of its row.
      KvPool read = exec::pool_form(attrs, 32);
      read.bytes.assign(back->begin(), back->end());
      CHECK(read.group_scale(2, 1) == pool.group_scale(2, 1));
      const std::size_t at = 2 * pool.row_bytes() + 512 + pool.scale_bytes();
      if (format == GroupScaleFormat::kE8m0) {
        CHECK(e8m0_decode((*back)[at]) == pool.group_scale(2, 1));
      } else {
        float scale = 0;
        std::memcpy(&scale, back->data() + at, 4);  // little-endian host
        CHECK(scale == pool.group_scale(2, 1));
      }
      for (int col : {0, 511, 512, 575}) CHECK(read.element(4, col) == pool.element(4, col));
    }
  }
}

TEST_CASE("exec server v2: a grouped layer's pool reaches the backend in its form and comes back",
          "[exec][protocol][grouped]") {
  const auto dir = case_dir("grouped_server");
  const DumpAttributes attrs = grouped_attrs();
  const float kv_scale = 0.232142851f;
  const std::int64_t slots = 32;  // two pages of 16
  const KvPool initial = written_pool(attrs, slots, kv_scale);
  const ArrayDescriptor pool_file = exec::pool_descriptor("pool.bin", initial);
  REQUIRE(exec::write_array(dir, pool_file, initial.bytes).ok());
  // One fresh request of 2 tokens in page 1 (slots 16 and 17).
  const std::vector<std::int32_t> qo = {0, 2}, kv = {0, 1}, pages = {1}, last = {2},
                                  slots_written = {16, 17};
  nlohmann::json inputs;
  const std::pair<const char*, const std::vector<std::int32_t>*> indices[] = {
      {"qo_indptr", &qo},
      {"kv_indptr", &kv},
      {"kv_indices", &pages},
      {"kv_last_page_len", &last},
      {"new_kv_slots", &slots_written}};
  for (const auto& [name, values] : indices) {
    const ArrayDescriptor d{std::string(name) + ".bin",
                            ArrayDtype::kInt32,
                            {static_cast<std::int64_t>(values->size())}};
    REQUIRE(exec::write_array(dir, d, exec::int32_bytes(*values)).ok());
    inputs[name] = exec::descriptor_json(d);
  }
  std::vector<float> new_kv(2 * 576);
  for (std::size_t j = 0; j < new_kv.size(); ++j) new_kv[j] = static_cast<float>(j % 29) - 14.0f;
  const std::pair<const char*, std::vector<std::int64_t>> tensors[] = {
      {"q_nope", {2, 16, 512}}, {"q_pe", {2, 16, 64}}, {"new_kv", {2, 576}}};
  for (const auto& [name, shape] : tensors) {
    std::int64_t count = 1;
    for (const std::int64_t n : shape) count *= n;
    const std::vector<float> values =
        std::string(name) == "new_kv" ? new_kv
                                      : std::vector<float>(static_cast<std::size_t>(count), 0.5f);
    const exec::EncodedTensor encoded = exec::encode_tensor(values);
    const ArrayDescriptor d{std::string(name) + ".bin", encoded.dtype, shape};
    REQUIRE(exec::write_array(dir, d, encoded.bytes).ok());
    inputs[name] = exec::descriptor_json(d);
  }
  LayerMeta layer;
  layer.group = "L003";
  layer.layer_id = 3;
  layer.kv_scale = kv_scale;
  const nlohmann::json requests_json[] = {
      {{"type", "hello"},
       {"protocol", "kvaudit-backend"},
       {"version", 2},
       {"name", "recording"},
       {"session_dir", dir.string()},
       {"model", exec::model_json(attrs, slots)},
       {"reciprocal_scale", false}},
      {{"type", "layer"},
       {"layer", exec::layer_json(layer)},
       {"pool", exec::descriptor_json(pool_file)}},
      {{"type", "step"},
       {"step", {{"index", 0}, {"group", "S000"}, {"kind", "prefill"}}},
       {"layer", exec::layer_json(layer)},
       {"pool_reloaded", false},
       {"inputs", inputs},
       {"outputs",
        {{"out", {{"file", "out.bin"}, {"dtype", "bfloat16"}, {"shape", {2, 16, 512}}}},
         {"lse", {{"file", "lse.bin"}, {"dtype", "float32"}, {"shape", {2, 16}}}}}}},
      {{"type", "bye"}}};
  std::string text;
  for (const nlohmann::json& request : requests_json) text += request.dump() + "\n";
  std::istringstream requests(text);
  std::FILE* replies = std::tmpfile();
  REQUIRE(replies != nullptr);
  std::vector<KvPool> seen;
  exec::ServerHooks hooks;
  hooks.make_backend = [&seen](const BackendOptions&) -> Result<std::unique_ptr<Backend>> {
    return std::unique_ptr<Backend>(std::make_unique<RecordingBackend>(&seen));
  };
  CHECK(exec::serve_backend(requests, replies, hooks) == 0);
  const std::vector<nlohmann::json> lines = all_lines_json(replies);
  std::fclose(replies);
  REQUIRE(lines.size() == 4);
  CHECK(lines[0].value("type", "") == "hello");
  CHECK(lines[0].value("version", 0) == 2);  // the version asked for
  CHECK(lines[1].value("type", "") == "ok");
  INFO(lines[2].dump());
  CHECK(lines[2].value("type", "") == "result");
  CHECK_FALSE(lines[2].contains("pool"));  // the storage stayed the layer's
  CHECK(lines[3].value("type", "") == "bye");
  // The backend got the grouped pool, in its form.
  REQUIRE(seen.size() == 1);
  CHECK(seen[0].grouped());
  CHECK(seen[0].num_groups() == 4);
  CHECK(seen[0].row_width == 576);
  CHECK(seen[0].bytes == initial.bytes);
  // The pool file holds its pool after the step: the two rows by the v1.1 rule.
  KvPool expected = initial;
  for (int i = 0; i < 2; ++i) expected.write_row(16 + i, new_kv.data() + i * 576, kv_scale);
  const auto after = exec::read_array(dir, pool_file, "pool");
  REQUIRE(after.ok());
  CHECK(*after == expected.bytes);
  CHECK(*after != initial.bytes);
}

TEST_CASE("exec server v2: a per_token_group model in a version 1 hello is refused",
          "[exec][protocol][grouped]") {
  const nlohmann::json hello = {{"type", "hello"},
                                {"protocol", "kvaudit-backend"},
                                {"version", 1},
                                {"session_dir", "/tmp"},
                                {"model", exec::model_json(grouped_attrs(), 32)}};
  std::istringstream requests(hello.dump() + "\n");
  std::FILE* replies = std::tmpfile();
  REQUIRE(replies != nullptr);
  exec::ServerHooks hooks;
  hooks.make_backend = [](const BackendOptions&) -> Result<std::unique_ptr<Backend>> {
    return internal_error("test", "not reached");
  };
  CHECK(exec::serve_backend(requests, replies, hooks) == 2);
  const nlohmann::json reply = first_line_json(replies);
  std::fclose(replies);
  CHECK(reply.value("kind", "") == "unsupported");
  CHECK_THAT(reply.value("message", ""), Catch::Contains("needs protocol version 2"));
}

// `kvaudit check DUMP` with cpu-fp8 in process and with exec:cpu-fp8 through `backend-serve`:
// both exit 0, with equal reports (but for the backend) and equal saved outputs. Returns the exec
// run's report.
nlohmann::json require_served_equals_in_process(const std::string& dump, const std::string& name) {
  const auto dir = case_dir(name);
  const std::string common = " check " + quoted(shipped_dump(dump)) + " --threads 2";
  const CommandRun in_process = run_shell(kvaudit() + common + " --backend cpu-fp8 --json " +
                                              quoted(dir / "in_process.json") + " --save-outputs " +
                                              quoted(dir / "in_process.h5"),
                                          dir, "in_process.log");
  const CommandRun exec =
      run_shell(kvaudit() + common + " --backend exec:cpu-fp8 --backend-command " +
                    exec_test::shell_word(serve_command()) + " --json " +
                    quoted(dir / "exec.json") + " --save-outputs " + quoted(dir / "exec.h5"),
                dir, "exec.log");
  INFO(in_process.command << "\n" << in_process.output);
  INFO(exec.command << "\n" << exec.output);
  CHECK(in_process.status == 0);
  CHECK(exec.status == 0);
  const nlohmann::json in_process_report = exec_test::load_json(dir / "in_process.json");
  const nlohmann::json exec_report = exec_test::load_json(dir / "exec.json");
  REQUIRE(in_process_report.is_object());
  REQUIRE(exec_report.is_object());
  CHECK(exec_report.value("backend", "") == "exec:cpu-fp8");
  CHECK(exec_test::without_backend(exec_report) == exec_test::without_backend(in_process_report));
  const auto exec_outputs = exec_test::dataset_bytes(dir / "exec.h5");
  CHECK_FALSE(exec_outputs.empty());
  CHECK(exec_outputs == exec_test::dataset_bytes(dir / "in_process.h5"));
  return exec_report;
}

TEST_CASE(
    "backend-serve v2: a sparse step crosses the protocol with its topk_indices, and "
    "exec:cpu-fp8 equals cpu-fp8",
    "[exec][serve][grouped]") {
  // glm5_dsa_flashmla.h5: packed slots, every layer sparse (top-64 of up to 316 tokens). A
  // program that ignored topk_indices would attend densely and its outputs would differ.
  require_served_equals_in_process("glm5_dsa_flashmla", "grouped_sparse_serve");
}

TEST_CASE("backend-serve v2: exec:cpu-fp8 equals cpu-fp8 on the per_token_group dump",
          "[exec][serve][grouped]") {
  const nlohmann::json exec_report =
      require_served_equals_in_process("glm5_pertoken_fp8rope", "grouped_serve");
  const nlohmann::json& description = exec_report["backend_description"];
  CHECK(description["exec"].value("protocol_version", 0) == 2);
  CHECK(exec_report["timing"]["backend_protocol"].value("protocol_version", 0) == 2);
}

TEST_CASE("backend-serve v2: grouped-pool injections give the same findings behind the protocol",
          "[exec][serve][grouped]") {
  // A fault of the grouped write and one of the grouped read, planted in the served backend: their
  // findings (the written slots' scale bytes, the outputs) must cross the protocol unchanged.
  for (const std::string injection : {"scale-one-write", "scale-read-as-pow2"}) {
    SECTION(injection) {
      const auto dir = case_dir("grouped_serve_" + injection);
      const std::string common =
          " check " + quoted(shipped_dump("glm5_pertoken_fp8rope")) + " --threads 2";
      const CommandRun in_process =
          run_shell(kvaudit() + common + " --backend cpu-fp8 --inject " + injection + " --json " +
                        quoted(dir / "in_process.json"),
                    dir, "in_process.log");
      const CommandRun exec =
          run_shell(kvaudit() + common + " --backend exec:cpu-fp8 --backend-command " +
                        exec_test::shell_word(serve_command("--inject " + injection)) + " --json " +
                        quoted(dir / "exec.json"),
                    dir, "exec.log");
      INFO(in_process.command << "\n" << in_process.output);
      INFO(exec.command << "\n" << exec.output);
      CHECK(exec.status == in_process.status);
      CHECK(exec.status == 1);
      CHECK(exec_test::without_backend(exec_test::load_json(dir / "exec.json")) ==
            exec_test::without_backend(exec_test::load_json(dir / "in_process.json")));
    }
  }
}

}  // namespace kvaudit
