// The likely cause a report gives a failure (src/report/report_summary.hpp, failure_items) comes
// from what failed: the write path (an integrity check, the cache comparison, a captured pool that
// differs while captured_read passes), the read path (the kernel or captured comparison on an
// intact pool) or both; a misplaced row is named by request, token and slot; a NaN in the dump's
// source is the source's, not a kernel's. Faults are planted on both sides: in the backend
// (cpu-fp8 --inject) and in the server's captures (tests/replay/planted_kernel.hpp).
//
// The tiny dump (tests/replay/check_dumps.hpp, page size 1): request 0 has 6 prefix tokens in
// slots 0..5 and pages up to slot 10, request 1 starts at slot 11; S000 writes request 0's tokens
// 6, 7, 8 (rows 0..2, slots 6..8) and request 1's tokens 0..3 (rows 3..6, slots 11..14).
#include <fmt/format.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "src/backend/mla_attention_cpu.hpp"
#include "src/replay/replay.hpp"
#include "src/report/report_summary.hpp"
#include "src/tools/info.hpp"
#include "tests/replay/check_dumps.hpp"
#include "tests/replay/planted_kernel.hpp"
#include "tests/replay/replay_tiny.hpp"

namespace kvaudit {
namespace {

using testing::make_tiny_dump;
using testing::replay_tiny;
using testing::TinyDump;
using testing::TinySpec;

CheckRun replay_with_injection(const TinyDump& dump, const std::string& name,
                               const std::string& injection) {
  BackendOptions backend_options;
  backend_options.threads = 2;
  backend_options.injection = injection;
  auto backend = make_cpu_fp8_backend(backend_options);
  if (!backend.ok()) FAIL(backend.error().message());
  return replay_tiny(dump, name, backend->get());
}

// The failure item whose title starts with `prefix` ("kernel error", "cache integrity: ...").
const FailureItem* item_titled(const std::vector<FailureItem>& items, const std::string& prefix) {
  for (const FailureItem& item : items) {
    if (item.title.rfind(prefix, 0) == 0) return &item;
  }
  return nullptr;
}

std::string titles(const std::vector<FailureItem>& items) {
  std::string text;
  for (const FailureItem& item : items) text += item.title + " | " + item.likely_cause + "\n";
  return text;
}

// Request 1's prefix tokens: spec with a prefix for request 1 too, so that S000 reads it.
TinySpec server_spec() {
  TinySpec spec;
  spec.prefix = {6, 5};
  spec.prefill = {3, 0};  // request 1: no rows at S000, reads its prefix from S001 on
  spec.decode_steps = 2;
  return spec;
}

// The server's pool after every step with request 1's prefix token 2 (slot 13) sign-flipped,
// and captured outputs computed on that pool (under `planted`, a convention mismatch, or clean).
TinyDump damaged_server(std::optional<Hypothesis> planted) {
  TinyDump dump = make_tiny_dump(server_spec());
  for (std::size_t s = 0; s < dump.steps.size(); ++s) {
    KvPool server = dump.pool_after(s, 0);
    for (std::size_t c = 0; c < server.row_bytes(); ++c) server.row(13)[c] ^= 0x80;
    dump.tensors[s][0].kv_cache_after = server;
    testing::plant_captured(dump, s, 0, server, planted);
  }
  return dump;
}

}  // namespace

TEST_CASE("likely cause: a backend write fault names the write path and the misplaced rows",
          "[report][likely_cause]") {
  const TinyDump dump = make_tiny_dump(TinySpec{});
  const std::int64_t slot = dump.steps[0].new_kv_slots[0];  // request 0, token 6
  const CheckRun run = replay_with_injection(dump, "cause_neighbour_write", "neighbour-slot-write");
  const std::vector<FailureItem> items = failure_items(run);
  INFO(titles(items));
  // Row 0 (request 0, token 6) went to the next slot.
  const std::string misplaced =
      fmt::format("request 0 token 6's row, meant for slot {}, landed in slot {}", slot, slot + 1);
  const FailureItem* integrity = item_titled(items, "cache integrity: written_slots [wrong_slot]");
  REQUIRE(integrity != nullptr);
  CHECK_THAT(integrity->likely_cause, Catch::Contains(misplaced));
  // The later steps read the damaged slots: cache error, and its cause is the write, not a kernel.
  const FailureItem* cache = item_titled(items, "cache error");
  REQUIRE(cache != nullptr);
  CHECK_THAT(cache->likely_cause, Catch::Contains("write path") && Catch::Contains(misplaced));
  CHECK_THAT(cache->likely_cause, Catch::Contains("kernel comparison passes"));
  CHECK(item_titled(items, "kernel error") == nullptr);
}

TEST_CASE("likely cause: a backend read fault names the kernel, the pool being intact",
          "[report][likely_cause]") {
  const TinyDump dump = make_tiny_dump(TinySpec{});
  const CheckRun run = replay_with_injection(dump, "cause_scale_mismatch", "scale-mismatch");
  const std::vector<FailureItem> items = failure_items(run);
  INFO(titles(items));
  const FailureItem* kernel = item_titled(items, "kernel error");
  REQUIRE(kernel != nullptr);
  CHECK_THAT(kernel->likely_cause, Catch::Contains("kernel") && Catch::Contains("intact"));
  CHECK_THAT(kernel->likely_cause, !Catch::Contains("write path"));
  CHECK(item_titled(items, "cache integrity") == nullptr);
}

TEST_CASE("likely cause: a server whose reads pass but whose pool write is wrong",
          "[report][likely_cause]") {
  const CheckRun run = replay_tiny(damaged_server(std::nullopt), "cause_server_write", nullptr);
  const std::vector<FailureItem> items = failure_items(run);
  INFO(titles(items));
  const FailureItem* captured = item_titled(items, "captured error");
  REQUIRE(captured != nullptr);
  CHECK_THAT(captured->likely_cause,
             !Catch::Contains("kernel fault") && !Catch::Contains("convention mismatch"));
  CHECK_THAT(captured->likely_cause,
             Catch::Contains("write path") && Catch::Contains("captured_read passes"));
}

TEST_CASE("likely cause: a server wrong on both sides says both", "[report][likely_cause]") {
  const CheckRun run =
      replay_tiny(damaged_server(Hypothesis::kLseBase2), "cause_server_both", nullptr);
  const std::vector<FailureItem> items = failure_items(run);
  INFO(titles(items));
  const FailureItem* captured = item_titled(items, "captured error");
  REQUIRE(captured != nullptr);
  CHECK_THAT(captured->likely_cause, Catch::Contains("Both") && Catch::Contains("write path") &&
                                         Catch::Contains("captured_read fails"));
}

TEST_CASE("likely cause: a server's misplaced row is named by request, token and slot",
          "[report][likely_cause]") {
  TinyDump dump = make_tiny_dump(TinySpec{});
  // S000's row 3 (request 1, token 0, slot 11) also landed in slot 12 (request 1, token 1's),
  // and the server's kernel read that pool correctly.
  const std::int64_t meant = dump.steps[0].new_kv_slots[3];
  REQUIRE(dump.steps[0].new_kv_slots[4] == meant + 1);
  for (std::size_t s = 0; s < dump.steps.size(); ++s) {
    KvPool server = dump.pool_after(s, 0);
    std::copy(server.row(meant), server.row(meant) + server.row_bytes(), server.row(meant + 1));
    dump.tensors[s][0].kv_cache_after = server;
    testing::plant_captured(dump, s, 0, server, std::nullopt);
  }
  // Later steps rewrite nothing there, so the damage is carried from S000.
  const CheckRun run = replay_tiny(dump, "cause_server_misplaced", nullptr);
  const std::vector<FailureItem> items = failure_items(run);
  INFO(titles(items));
  const std::string misplaced = fmt::format(
      "request 1 token 0's row, meant for slot {}, landed in slot {}", meant, meant + 1);
  const FailureItem* integrity = item_titled(items, "cache integrity: captured_pool [wrong_slot]");
  REQUIRE(integrity != nullptr);
  CHECK_THAT(integrity->likely_cause, Catch::Contains(misplaced));
  const FailureItem* captured = item_titled(items, "captured error");
  REQUIRE(captured != nullptr);
  CHECK_THAT(captured->likely_cause, Catch::Contains("write path") && Catch::Contains(misplaced));
}

TEST_CASE("likely cause: NaN in kv_source is the source's, and info counts it",
          "[report][likely_cause][info]") {
  TinyDump dump = make_tiny_dump(TinySpec{});
  // Request 0's prefix token 2 (slot 2), which every row of request 0 reads, has one NaN source
  // value; its pool codes stay finite (the server quantized something else).
  const int width = dump.width();
  dump.sources[0][2 * width + 5] = std::numeric_limits<float>::quiet_NaN();
  const CheckRun run = replay_tiny(dump, "cause_source_nan", nullptr);
  const std::vector<FailureItem> items = failure_items(run);
  INFO(titles(items));
  const FailureItem* quantization = item_titled(items, "quantization error");
  REQUIRE(quantization != nullptr);
  CHECK_THAT(quantization->likely_cause, Catch::Contains("kv_source") && !Catch::Contains("masks"));
  CHECK_THAT(quantization->details.front(), Catch::Contains("where the reference is NaN"));

  auto reader = DumpReader::open(testing::test_tmp_path("cause_source_nan.h5"));
  REQUIRE(reader.ok());
  auto info = dump_info(*reader);
  REQUIRE(info.ok());
  const nlohmann::json& layer = (*info)["layers"][0];
  REQUIRE(layer.contains("kv_source_nan"));
  CHECK(layer["kv_source_nan"]["values"] == 1);
  CHECK(layer["kv_source_nan"]["slots"] == nlohmann::json::array({2}));
  CHECK_THAT(format_dump_info(*info), Catch::Contains("kv_source=yes (1 NaN value in slot 2)"));
}

}  // namespace kvaudit
