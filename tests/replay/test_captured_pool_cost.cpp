// Captured pools read by later steps (src/replay/replay.hpp step 5): once a captured
// kv_cache_after differs from the replay, the captured outputs are also compared with R8 on the
// server's pool (captured_read) and that R8 with the reference's (captured_cache: what the
// server's corruption costs), and the step where the cost first shows is named.
//
// The dumps: request 1 has no query rows at S000 (prefill 0), so it does not read its prefix
// then; from S001 on (decode) it does. A damaged prefix slot of request 1 in S000's captured pool
// therefore costs nothing at S000 and shows from S001; a damaged spare slot (past every request)
// is never read. Captured outputs are the clean kernel model's on the pool the server read
// (tests/replay/planted_kernel.hpp), so the server's kernel is right on what it read.
#include <algorithm>
#include <catch2/catch.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "src/replay/replay.hpp"
#include "src/report/report.hpp"
#include "tests/replay/check_dumps.hpp"
#include "tests/replay/planted_kernel.hpp"
#include "tests/replay/replay_tiny.hpp"

namespace kvaudit {
namespace {

using testing::make_tiny_dump;
using testing::replay_tiny;
using testing::TinyDump;
using testing::TinySpec;

TinySpec server_spec() {
  TinySpec spec;
  spec.layer_ids = {2};
  spec.prefix = {6, 5};
  spec.prefill = {3, 0};  // request 1: no rows at S000
  spec.decode_steps = 2;
  return spec;
}

// The pool after step s with `slot`'s codes sign-flipped: what a server that damaged it at S000
// (and wrote every later step correctly) holds.
KvPool damaged_pool(const TinyDump& dump, std::size_t s, std::int64_t slot) {
  KvPool pool = dump.pool_after(s, 0);
  for (std::size_t c = 0; c < pool.row_bytes(); ++c) pool.row(slot)[c] ^= 0x80;
  return pool;
}

enum class Capture { kFirstStepOnly, kEveryStep };

// The dump with S000's (or every step's) kv_cache_after damaged at `slot`, and captured outputs
// as a server committing `planted` computed them on its pool.
TinyDump server_dump(std::int64_t slot, Capture capture, std::optional<Hypothesis> planted) {
  TinyDump dump = make_tiny_dump(server_spec());
  for (std::size_t s = 0; s < dump.steps.size(); ++s) {
    const KvPool server = damaged_pool(dump, s, slot);
    if (s == 0 || capture == Capture::kEveryStep) dump.tensors[s][0].kv_cache_after = server;
    testing::plant_captured(dump, s, 0, server, planted);
  }
  return dump;
}

const ComparisonResult* find(const CheckRun& run, int step, Comparison kind) {
  for (const ComparisonResult& c : run.comparisons) {
    if (c.step == step && c.comparison == kind) return &c;
  }
  return nullptr;
}

std::string printed(const CheckRun& run) {
  std::ostringstream out;
  print_check_table(out, run);
  return out.str();
}

// Request 1's prefix position 2, and a slot of the spare pages past every request.
constexpr std::int64_t kReadLater = 11 + 2;  // request 0 holds slots 0..10
constexpr std::int64_t kNeverRead = 19;

}  // namespace

TEST_CASE("captured pool: damage a later step reads costs from that step, named", "[replay]") {
  const Capture capture = GENERATE(Capture::kFirstStepOnly, Capture::kEveryStep);
  INFO((capture == Capture::kFirstStepOnly ? "kv_cache_after at S000 only, carried"
                                           : "kv_cache_after at every step"));
  const TinyDump dump = server_dump(kReadLater, capture, std::nullopt);
  const CheckRun run = replay_tiny(
      dump, capture == Capture::kFirstStepOnly ? "server_read_later" : "server_read_later_all");

  // The corruption fails the run through the captured-pool check, at S000 where it appears.
  CHECK_FALSE(run.pass());
  const auto first_failing = std::find_if(run.integrity.begin(), run.integrity.end(),
                                          [](const IntegrityFinding& f) { return !f.pass; });
  REQUIRE(first_failing != run.integrity.end());
  CHECK(first_failing->step == 0);
  CHECK(first_failing->check == IntegrityCheck::kCapturedPool);

  for (int s = 0; s < static_cast<int>(dump.steps.size()); ++s) {
    INFO("step " << s);
    const ComparisonResult* cost = find(run, s, Comparison::kCapturedCache);
    const ComparisonResult* read = find(run, s, Comparison::kCapturedRead);
    REQUIRE(cost != nullptr);
    REQUIRE(read != nullptr);
    // The server's kernel is right on what it read; the comparisons are report-only.
    CHECK(read->judgement.pass);
    CHECK_FALSE(read->sets_exit);
    CHECK_FALSE(cost->sets_exit);
    if (s == 0) {
      // Request 1 has no rows at S000: nothing reads the damaged slot yet.
      CHECK(cost->judgement.pass);
      CHECK(cost->metrics.max_abs == 0.0);
    } else {
      CHECK_FALSE(cost->judgement.pass);
      CHECK(cost->metrics.rel_l2 > 0.01);
      CHECK(cost->worst_request == 1);
    }
  }
  const std::optional<CapturedPoolCost> cost = captured_pool_cost(run);
  REQUIRE(cost.has_value());
  CHECK(cost->shows);
  CHECK(cost->step == 1);
  CHECK(cost->layer_id == 2);
  CHECK(cost->damaged_since_step == 0);
  const nlohmann::json j = to_json(run);
  CHECK(j.at("captured_pool_cost").at("step") == 1);
  CHECK(j.at("captured_pool_cost").at("layer") == 2);
  CHECK(j.at("captured_pool_cost").at("damaged_since_step") == 0);
  CHECK_THAT(printed(run),
             Catch::Contains("captured pool cost first shows at step 1 layer 2 (damaged from "
                             "step 0)"));
  // The captured failures are the cache's, not a convention's: captured_read passes, so there is
  // nothing to diagnose.
  CHECK(run.diagnosis.empty());
}

TEST_CASE("captured pool: the captured comparison stays what it was without captured pools",
          "[replay]") {
  const TinyDump with_pools = server_dump(kReadLater, Capture::kFirstStepOnly, std::nullopt);
  TinyDump without_pools = with_pools;
  for (auto& per_layer : without_pools.tensors) per_layer[0].kv_cache_after.reset();
  const CheckRun a = replay_tiny(with_pools, "server_captured_with_pools");
  const CheckRun b = replay_tiny(without_pools, "server_captured_without_pools");
  // Without captured pools nothing of the server's pool is known: no new comparisons.
  CHECK(std::none_of(b.comparisons.begin(), b.comparisons.end(), [](const ComparisonResult& c) {
    return c.comparison == Comparison::kCapturedRead || c.comparison == Comparison::kCapturedCache;
  }));
  CHECK_FALSE(captured_pool_cost(b).has_value());
  CHECK(to_json(b).at("captured_pool_cost").is_null());
  for (int s = 0; s < static_cast<int>(with_pools.steps.size()); ++s) {
    const ComparisonResult* x = find(a, s, Comparison::kCaptured);
    const ComparisonResult* y = find(b, s, Comparison::kCaptured);
    REQUIRE(x != nullptr);
    REQUIRE(y != nullptr);
    CHECK(x->metrics.rel_l2 == y->metrics.rel_l2);
    CHECK(x->metrics.lse_max_abs == y->metrics.lse_max_abs);
    CHECK(x->judgement.pass == y->judgement.pass);
    CHECK(x->sets_exit);
  }
}

TEST_CASE("captured pool: damage no step reads costs nothing, and the report says so", "[replay]") {
  const TinyDump dump = server_dump(kNeverRead, Capture::kFirstStepOnly, std::nullopt);
  const CheckRun run = replay_tiny(dump, "server_never_read");
  CHECK_FALSE(run.pass());  // the captured pool is still wrong
  for (const ComparisonResult& c : run.comparisons) {
    INFO("step " << c.step << " " << comparison_name(c.comparison));
    CHECK(c.judgement.pass);
    if (c.comparison == Comparison::kCapturedCache) CHECK(c.metrics.max_abs == 0.0);
  }
  const std::optional<CapturedPoolCost> cost = captured_pool_cost(run);
  REQUIRE(cost.has_value());
  CHECK_FALSE(cost->shows);
  CHECK(cost->damaged_since_step == 0);
  const nlohmann::json j = to_json(run);
  CHECK(j.at("captured_pool_cost").at("shows") == false);
  CHECK(j.at("captured_pool_cost").at("step").is_null());
  CHECK_THAT(printed(run), Catch::Contains("captured pool cost: zero"));
}

TEST_CASE("captured pool: a server's convention mismatch is diagnosed on the pool it read",
          "[replay][diagnosis]") {
  const TinyDump dump = server_dump(kReadLater, Capture::kFirstStepOnly, Hypothesis::kLseBase2);
  const CheckRun run = replay_tiny(dump, "server_lse_base_2");
  REQUIRE(run.diagnosis.size() == dump.steps.size());
  for (const DiagnosisFinding& finding : run.diagnosis) {
    INFO("step " << finding.step << ": " << diagnosis_summary(finding));
    // S000 reads no damaged slot: captured itself; later steps: captured_read, on the server's
    // pool (against R8 the damage would hide the convention).
    CHECK(finding.comparison ==
          (finding.step == 0 ? Comparison::kCaptured : Comparison::kCapturedRead));
    REQUIRE(finding.explained_by.size() == 1);
    CHECK(finding.explained_by[0].hypothesis == "lse-base-2");
  }
}

}  // namespace kvaudit
