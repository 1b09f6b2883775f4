// The pieces of the external backend protocol, in process: array descriptors and their files
// (src/backend/exec_protocol.hpp), a session against tiny shell programs
// (src/backend/exec_session.hpp: hello, replies of the wrong kind, the session directory, the
// timeout variable) and the server's refusals (src/backend/exec_server.hpp).
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <sstream>
#include <string>

#include "src/backend/exec_protocol.hpp"
#include "src/backend/exec_server.hpp"
#include "src/backend/exec_session.hpp"
#include "tests/backend/exec_test_support.hpp"

namespace kvaudit {
namespace {

using exec::ArrayDescriptor;
using exec::ArrayDtype;

// Sets an environment variable for the scope of a test and restores it afterwards.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    if (const char* old = std::getenv(name)) previous_ = old;
    had_ = std::getenv(name) != nullptr;
    setenv(name, value.c_str(), 1);
  }
  ~ScopedEnv() {
    if (had_) {
      setenv(name_, previous_.c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::string previous_;
  bool had_ = false;
};

// A program that answers hello with `hello_reply`, then every request with `reply`.
std::string scripted_program(const std::string& hello_reply, const std::string& reply) {
  return "read -r line; printf '%s\\n' '" + hello_reply +
         "'; while read -r line; do printf '%s\\n' '" + reply + "'; done";
}

}  // namespace

TEST_CASE("exec protocol: float tensors travel as bf16 when exact, else float32, both exactly",
          "[exec][protocol]") {
  const std::vector<float> bf16_values = {
      1.0f, -2.5f, 0.0f, -0.0f, std::numeric_limits<float>::infinity(), 448.0f};
  const exec::EncodedTensor bf16 = exec::encode_tensor(bf16_values);
  CHECK(bf16.dtype == ArrayDtype::kBfloat16);
  REQUIRE(bf16.bytes.size() == 2 * bf16_values.size());
  CHECK(bf16.bytes[0] == 0x80);  // 1.0 = 0x3F80, little-endian
  CHECK(bf16.bytes[1] == 0x3F);
  const auto back = exec::decode_tensor(bf16.dtype, bf16.bytes, "t");
  REQUIRE(back.ok());
  for (std::size_t i = 0; i < bf16_values.size(); ++i) {
    CHECK(std::signbit((*back)[i]) == std::signbit(bf16_values[i]));
    CHECK((*back)[i] == bf16_values[i]);
  }
  const std::vector<float> fp32_values = {1.0f, 1.0f + 1.0f / 1024.0f};  // not a bf16 value
  const exec::EncodedTensor fp32 = exec::encode_tensor(fp32_values);
  CHECK(fp32.dtype == ArrayDtype::kFloat32);
  const auto fp32_back = exec::decode_tensor(fp32.dtype, fp32.bytes, "t");
  REQUIRE(fp32_back.ok());
  CHECK(*fp32_back == fp32_values);
  CHECK(exec::int32_values(exec::int32_bytes(std::vector<std::int32_t>{-1, 0, 70000})) ==
        std::vector<std::int32_t>{-1, 0, 70000});
}

TEST_CASE("exec protocol: descriptors stay inside the session directory and name real types",
          "[exec][protocol]") {
  const auto good = exec::parse_descriptor(
      nlohmann::json{{"file", "a/q.bin"}, {"dtype", "bfloat16"}, {"shape", {2, 3}}}, "q");
  REQUIRE(good.ok());
  CHECK(good->bytes() == 12);
  CHECK(good->text() == "bfloat16 [2, 3] in a/q.bin");
  const nlohmann::json bad[] = {
      {{"file", "../q.bin"}, {"dtype", "uint8"}, {"shape", {1}}},
      {{"file", "/tmp/q.bin"}, {"dtype", "uint8"}, {"shape", {1}}},
      {{"file", "q.bin"}, {"dtype", "float64"}, {"shape", {1}}},
      {{"file", "q.bin"}, {"dtype", "uint8"}, {"shape", {-1}}},
      {{"file", "q.bin"}, {"dtype", "uint8"}},
      {{"dtype", "uint8"}, {"shape", {1}}},
  };
  for (const nlohmann::json& descriptor : bad) {
    INFO(descriptor.dump());
    CHECK_FALSE(exec::parse_descriptor(descriptor, "q").ok());
  }
}

TEST_CASE("exec protocol: an array file must exist and hold exactly its shape's bytes",
          "[exec][protocol]") {
  const auto dir = exec_test::case_dir("protocol_files");
  const ArrayDescriptor descriptor{"x.bin", ArrayDtype::kInt32, {3}};
  const auto missing = exec::read_array(dir, descriptor, "x");
  REQUIRE_FALSE(missing.ok());
  CHECK_THAT(missing.error().message(), Catch::Contains("does not exist"));
  const std::vector<std::uint8_t> bytes = exec::int32_bytes(std::vector<std::int32_t>{1, 2, 3});
  REQUIRE(exec::write_array(dir, descriptor, bytes).ok());
  const auto read = exec::read_array(dir, descriptor, "x");
  REQUIRE(read.ok());
  CHECK(*read == bytes);
  const ArrayDescriptor longer{"x.bin", ArrayDtype::kInt32, {4}};
  const auto wrong = exec::read_array(dir, longer, "x");
  REQUIRE_FALSE(wrong.ok());
  CHECK_THAT(wrong.error().message(), Catch::Contains("holds 12 bytes, not the 16"));
  // Rewriting in place keeps the file (a program may hold it mapped) and trims it to size.
  REQUIRE(exec::write_array(dir, ArrayDescriptor{"x.bin", ArrayDtype::kUint8, {2}},
                            std::vector<std::uint8_t>{7, 8})
              .ok());
  CHECK(std::filesystem::file_size(dir / "x.bin") == 2);
}

TEST_CASE("exec protocol: the hello's model and the layer object round-trip exactly",
          "[exec][protocol]") {
  const DumpAttributes attrs = exec_test::mla_attrs(0.07216878364870323, 64);
  const auto model = exec::parse_model(nlohmann::json::parse(exec::model_json(attrs, 128).dump()));
  REQUIRE(model.ok());
  CHECK(model->num_slots == 128);
  CHECK(model->attrs.sm_scale == attrs.sm_scale);
  CHECK(model->attrs.row_width() == 576);
  CHECK(model->attrs.kv_dtype == KvDtype::kFloat8E4m3fn);
  LayerMeta layer;
  layer.group = "L077";
  layer.layer_id = 77;
  layer.kv_scale = 0.0602678582f;
  const auto parsed = exec::parse_layer(nlohmann::json::parse(exec::layer_json(layer).dump()), "l");
  REQUIRE(parsed.ok());
  CHECK(parsed->kv_scale == layer.kv_scale);  // the float32 scale, bit for bit
  CHECK(parsed->layer_id == 77);
  nlohmann::json odd = exec::model_json(attrs, 100);  // not a multiple of page_size
  CHECK_FALSE(exec::parse_model(odd).ok());
}

TEST_CASE("exec session: hello, replies of the wrong type and version, the session directory",
          "[exec][protocol]") {
  const auto parent = exec_test::case_dir("session_exchange");
  const ScopedEnv exchange("KVAUDIT_EXCHANGE_DIR", parent.string());
  std::filesystem::path directory;
  {
    auto session = exec::ExecSession::start(
        "exec:s", scripted_program(R"({"type":"hello","version":1,"describe":{"gpu":"none"}})",
                                   R"({"type":"bye"})"));
    REQUIRE(session.ok());
    directory = (*session)->directory();
    CHECK(directory.parent_path() == parent);
    CHECK(std::filesystem::is_directory(directory));
    const auto hello = (*session)->hello("s", nullptr, false);
    REQUIRE(hello.ok());
    CHECK(hello->describe.value("gpu", "") == "none");
    // The next reply is a bye where a result was due.
    const auto wrong = (*session)->request({{"type", "step"}}, "result", "step 0 (S000)");
    REQUIRE_FALSE(wrong.ok());
    CHECK_THAT(wrong.error().message(),
               Catch::Contains("exec:s: step request for step 0 (S000): it replied with type "
                               "'bye', not 'result'"));
  }
  CHECK_FALSE(std::filesystem::exists(directory));
  auto versioned = exec::ExecSession::start(
      "exec:v", scripted_program(R"({"type":"hello","version":2})", R"({"type":"bye"})"));
  REQUIRE(versioned.ok());
  const auto hello = (*versioned)->hello("v", nullptr, false);
  REQUIRE_FALSE(hello.ok());
  CHECK_THAT(hello.error().message(), Catch::Contains("protocol version 2; kvaudit asked for 1"));
}

TEST_CASE("exec session: KVAUDIT_BACKEND_TIMEOUT and exec:NAME are checked", "[exec][protocol]") {
  {
    const ScopedEnv timeout("KVAUDIT_BACKEND_TIMEOUT", "2.5");
    REQUIRE(exec::backend_timeout_seconds().ok());
    CHECK(*exec::backend_timeout_seconds() == 2.5);
  }
  for (const char* bad : {"0", "-1", "ten", "5s"}) {
    const ScopedEnv timeout("KVAUDIT_BACKEND_TIMEOUT", bad);
    CHECK_FALSE(exec::backend_timeout_seconds().ok());
  }
  CHECK(exec::check_exec_name("flashinfer-fp8", "--backend").ok());
  CHECK(exec::check_exec_name("torch_v1.2", "--backend").ok());
  CHECK_FALSE(exec::check_exec_name("", "--backend").ok());
  CHECK_FALSE(exec::check_exec_name("a b", "--backend").ok());
  CHECK_FALSE(exec::check_exec_name("a;rm", "--backend").ok());
  CHECK(exec::default_exec_command("torch") == "python3 -m kvdump.backends torch");
}

TEST_CASE("exec server: a hello of another protocol version is refused as unsupported",
          "[exec][protocol]") {
  std::istringstream requests(
      R"({"type":"hello","protocol":"kvaudit-backend","version":7,"session_dir":"/tmp"})"
      "\n");
  std::FILE* replies = std::tmpfile();
  REQUIRE(replies != nullptr);
  exec::ServerHooks hooks;
  hooks.make_backend = [](const BackendOptions&) -> Result<std::unique_ptr<Backend>> {
    return internal_error("test", "not reached");
  };
  CHECK(exec::serve_backend(requests, replies, hooks) == 2);
  std::rewind(replies);
  char line[512] = {};
  REQUIRE(std::fgets(line, sizeof line, replies) != nullptr);
  std::fclose(replies);
  const nlohmann::json reply = nlohmann::json::parse(line);
  CHECK(reply.value("type", "") == "error");
  CHECK(reply.value("kind", "") == "unsupported");
  CHECK_THAT(reply.value("message", ""), Catch::Contains("version 1"));
}

}  // namespace kvaudit
