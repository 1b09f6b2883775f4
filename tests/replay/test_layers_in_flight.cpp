// replay_dump with several layers in flight (ReplayOptions::layers_in_flight): the run must be the
// sequential one, in everything report.json holds and in order, and the layers must really overlap.
#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "src/backend/backend.hpp"
#include "src/cli/backend_registry.hpp"
#include "src/format/kvdump.hpp"
#include "src/replay/diagnosis.hpp"
#include "src/replay/replay.hpp"
#include "src/verdict/check_result.hpp"
#include "tests/test_paths.hpp"

namespace kvaudit {
namespace {

// Every dump in datasets/ (README.md there lists them).
const char* const kShippedDumps[] = {
    "glm5_page1.h5",        "glm5_outliers_calibrated.h5", "glm5_outliers_scale1.h5",
    "glm5_dsa_flashmla.h5", "glm5_pertoken_fp8rope.h5",    "page64_nan.h5",
    "saturated_page16.h5",
};

DumpReader open_shipped(const std::string& name) {
  Result<DumpReader> reader = DumpReader::open(kvaudit_test::source_dir() / "datasets" / name);
  if (!reader.ok()) FAIL(reader.error().message());
  return std::move(*reader);
}

std::unique_ptr<Backend> cpu_fp8(const std::string& injection = "") {
  BackendOptions options;
  options.threads = 2;
  options.injection = injection;
  auto backend = make_backend("cpu-fp8", options);
  if (!backend.ok()) FAIL(backend.error().message());
  return std::move(backend.value());
}

// report.json of a run without what differs from run to run (scripts/same_report.py's "same").
std::string comparable_report(const CheckRun& run) {
  nlohmann::json report = to_json(run);
  report.erase("timing");
  report.erase("provenance");
  return report.dump();
}

CheckRun replay_with(const DumpReader& reader, Backend* backend, ReplayOptions options,
                     int layers_in_flight) {
  options.layers_in_flight = layers_in_flight;
  Result<CheckRun> run = replay_dump(reader, backend, options);
  if (!run.ok()) FAIL(run.error().message());
  return std::move(*run);
}

// The sequential run and the run with 3 layers in flight of one dump and backend: equal reports.
// Returns how many layers the second run had in flight.
int check_same_report(const std::string& dump, const std::string& injection,
                      ReplayOptions options) {
  INFO(dump << " injection '" << injection << "' diagnose " << options.diagnose << " certify "
            << options.certify);
  const DumpReader reader = open_shipped(dump);
  auto backend_1 = cpu_fp8(injection);
  const CheckRun sequential = replay_with(reader, backend_1.get(), options, 1);
  auto backend_3 = cpu_fp8(injection);
  const CheckRun in_flight = replay_with(reader, backend_3.get(), options, 3);
  CHECK(sequential.layers_in_flight == 1);
  CHECK(!sequential.comparisons.empty());
  CHECK(comparable_report(in_flight) == comparable_report(sequential));
  // The parts of the run report.json derives its sections from, compared on their own too.
  CHECK(in_flight.notes == sequential.notes);
  CHECK(in_flight.comparisons.size() == sequential.comparisons.size());
  CHECK(in_flight.integrity.size() == sequential.integrity.size());
  CHECK(in_flight.diagnosis.size() == sequential.diagnosis.size());
  CHECK(in_flight.diagnosis_failing_sites == sequential.diagnosis_failing_sites);
  CHECK(in_flight.certification.size() == sequential.certification.size());
  const std::size_t layers = reader.layout().layers.size();
  if (layers > 1 && in_flight.layers_in_flight == 1) {
    CHECK(!in_flight.layers_in_flight_note.empty());  // a fallback says why
  } else {
    CHECK(in_flight.layers_in_flight == static_cast<int>(std::min<std::size_t>(3, layers)));
  }
  return in_flight.layers_in_flight;
}

}  // namespace

TEST_CASE("layers in flight give the sequential report for every shipped dump",
          "[replay][layers-in-flight]") {
  ReplayOptions options;
  options.threads = 2;
  options.certify = 0;
  int overlapped = 0;
  for (const char* dump : kShippedDumps) overlapped += check_same_report(dump, "", options) > 1;
  // Most shipped dumps have several layers and no captured pools: they did run concurrently.
  CHECK(overlapped >= 4);
}

TEST_CASE("layers in flight give the sequential report of a failing, diagnosed and certified run",
          "[replay][layers-in-flight]") {
  ReplayOptions options;
  options.threads = 2;
  options.certify = 0;
  // bf16-writeback fails the integrity checks, and the kernel and cache comparisons, of every
  // layer; scale-mismatch fails the kernel comparison and is diagnosed. The diagnosis budget is
  // shared by the layers (the earliest failing sites over all of them): 1, the default 4 and more
  // than fail.
  for (const int diagnose : {1, 4, 50}) {
    options.diagnose = diagnose;
    CHECK(check_same_report("glm5_page1.h5", "bf16-writeback", options) > 1);
    CHECK(check_same_report("glm5_page1.h5", "scale-mismatch", options) > 1);
  }
  // Certification jobs are submitted at the merge, in the plan's order.
  options.diagnose = 4;
  options.certify = 3;
  CHECK(check_same_report("glm5_outliers_calibrated.h5", "", options) > 1);
}

TEST_CASE("an observer sees every (step, layer) in order: the run falls back to one layer",
          "[replay][layers-in-flight]") {
  const DumpReader reader = open_shipped("glm5_page1.h5");
  REQUIRE(reader.layout().layers.size() > 1);
  auto observe = [](std::vector<std::pair<int, int>>& seen) {
    return [&seen](const StepLayerOutputs& outputs) {
      seen.emplace_back(outputs.layer_id, outputs.step);
      return ok_status();
    };
  };
  ReplayOptions options;
  options.threads = 2;
  options.certify = 0;
  std::vector<std::pair<int, int>> sequential_calls;
  options.observer = observe(sequential_calls);
  auto backend_1 = cpu_fp8();
  const CheckRun sequential = replay_with(reader, backend_1.get(), options, 1);
  std::vector<std::pair<int, int>> in_flight_calls;
  options.observer = observe(in_flight_calls);
  auto backend_3 = cpu_fp8();
  const CheckRun in_flight = replay_with(reader, backend_3.get(), options, 3);
  CHECK(in_flight_calls == sequential_calls);
  CHECK(in_flight.layers_in_flight == 1);
  CHECK(in_flight.layers_in_flight_note.find("observer") != std::string::npos);
  CHECK(comparable_report(in_flight) == comparable_report(sequential));
}

namespace {

// cpu-fp8 with a record of its calls: which layers were inside run_step at once, and the most
// calls at once. `hold_layer`'s last step waits (at most `hold`) until another layer has called.
class RecordingBackend final : public Backend {
 public:
  RecordingBackend(BackendConcurrency concurrency, std::size_t hold_layer,
                   std::chrono::milliseconds hold)
      : inner_(cpu_fp8()), concurrency_(concurrency), hold_layer_(hold_layer), hold_(hold) {}

  std::string name() const override { return "recording"; }
  nlohmann::json describe() const override { return inner_->describe(); }
  BackendConcurrency concurrency() const override { return concurrency_; }

  Result<AttentionOutput> run_step(const StepLayerInput& input, KvPool& pool) override {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      ++inside_;
      most_inside_ = std::max(most_inside_, inside_);
      layers_called_.insert(input.layer_index);
      threads_.insert(std::this_thread::get_id());
      changed_.notify_all();
      const bool last_step = input.step_index + 1 == steps_;
      if (input.layer_index == hold_layer_ && last_step) {
        other_layer_seen_ =
            changed_.wait_for(lock, hold_, [&] { return layers_called_.size() > 1; });
      }
    }
    // Slow enough for calls of different layers to meet when nothing keeps them apart.
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    Result<AttentionOutput> out = inner_->run_step(input, pool);
    const std::lock_guard<std::mutex> lock(mutex_);
    --inside_;
    return out;
  }

  void set_steps(std::size_t steps) { steps_ = steps; }
  bool other_layer_seen() const { return other_layer_seen_; }
  int most_inside() const { return most_inside_; }
  std::size_t threads() const { return threads_.size(); }

 private:
  std::unique_ptr<Backend> inner_;
  BackendConcurrency concurrency_;
  std::size_t hold_layer_;
  std::chrono::milliseconds hold_;
  std::size_t steps_ = 0;  // the dump's
  std::mutex mutex_;
  std::condition_variable changed_;
  int inside_ = 0;
  int most_inside_ = 0;
  std::set<std::size_t> layers_called_;
  std::set<std::thread::id> threads_;
  bool other_layer_seen_ = false;
};

}  // namespace

TEST_CASE("captured pools, an observer or no read-ahead make the run sequential, saying why",
          "[replay][layers-in-flight]") {
  const DumpReader reader = open_shipped("glm5_page1.h5");
  DumpLayout layout = reader.layout();
  ReplayOptions options;
  options.layers_in_flight = 3;
  CHECK(layers_in_flight(layout, options, nullptr).count == 3);
  options.layers_in_flight = 8;  // at most the selected layers
  CHECK(layers_in_flight(layout, options, nullptr).count == 3);
  options.layer_ids = {0, 77};
  CHECK(layers_in_flight(layout, options, nullptr).count == 2);
  options.layer_ids.clear();
  options.read_ahead = false;
  CHECK(layers_in_flight(layout, options, nullptr).count == 1);
  CHECK(layers_in_flight(layout, options, nullptr).reason.find("in place") != std::string::npos);
  options.read_ahead = true;
  // A captured pool is read step by step from the dump while its layer runs: HDF5 on a layer's
  // thread, beside the reader thread.
  for (StepMeta& step : layout.steps) step.has_kv_cache_after.assign(layout.layers.size(), true);
  const LayersInFlight captured = layers_in_flight(layout, options, nullptr);
  CHECK(captured.count == 1);
  CHECK(captured.reason.find("captured pools") != std::string::npos);
}

TEST_CASE("with two layers in flight the second layer's backend runs before the first is done",
          "[replay][layers-in-flight]") {
  const DumpReader reader = open_shipped("glm5_page1.h5");
  REQUIRE(reader.layout().layers.size() > 1);
  ReplayOptions options;
  options.threads = 2;
  options.certify = 0;
  // The first layer's last backend call waits for a call of another layer: sequentially that
  // never comes (it times out after 5 s); with two layers in flight it comes at once.
  RecordingBackend backend(BackendConcurrency::kConcurrent, 0, std::chrono::seconds(5));
  backend.set_steps(reader.layout().steps.size());
  const auto start = std::chrono::steady_clock::now();
  const CheckRun run = replay_with(reader, &backend, options, 2);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  CHECK(run.layers_in_flight == 2);
  CHECK(backend.other_layer_seen());
  CHECK(backend.threads() >= 2);  // each layer on its own thread
  CHECK(seconds < 5.0);
}

TEST_CASE("a backend that takes one call at a time gets one call at a time from layers in flight",
          "[replay][layers-in-flight]") {
  const DumpReader reader = open_shipped("glm5_page1.h5");
  ReplayOptions options;
  options.threads = 2;
  options.certify = 0;
  RecordingBackend one_call(BackendConcurrency::kOneCallAtATime, 99, std::chrono::seconds(0));
  const CheckRun run = replay_with(reader, &one_call, options, 3);
  CHECK(run.layers_in_flight > 1);
  CHECK(one_call.most_inside() == 1);
  // One that holds a layer at a time (an exec program) makes the run sequential, and says so.
  RecordingBackend one_layer(BackendConcurrency::kOneLayerAtATime, 99, std::chrono::seconds(0));
  const CheckRun sequential = replay_with(reader, &one_layer, options, 3);
  CHECK(sequential.layers_in_flight == 1);
  CHECK(sequential.layers_in_flight_note.find("one layer at a time") != std::string::npos);
  CHECK(one_layer.threads() == 1);
}

namespace {

// cpu-fp8 that fails at the listed (layer index, step index)s, naming them.
class FailingBackend final : public Backend {
 public:
  explicit FailingBackend(std::vector<std::pair<std::size_t, std::size_t>> failures)
      : inner_(cpu_fp8()), failures_(std::move(failures)) {}
  std::string name() const override { return "failing"; }
  nlohmann::json describe() const override { return inner_->describe(); }
  BackendConcurrency concurrency() const override { return BackendConcurrency::kConcurrent; }
  Result<AttentionOutput> run_step(const StepLayerInput& input, KvPool& pool) override {
    for (const auto& [layer, step] : failures_) {
      if (input.layer_index == layer && input.step_index == step) {
        return bad_input("failing", "planted failure at layer index " + std::to_string(layer) +
                                        " step " + std::to_string(step));
      }
    }
    return inner_->run_step(input, pool);
  }

 private:
  std::unique_ptr<Backend> inner_;
  std::vector<std::pair<std::size_t, std::size_t>> failures_;
};

}  // namespace

TEST_CASE("layers in flight stop at the error of the earliest failing layer, as sequentially",
          "[replay][layers-in-flight]") {
  const DumpReader reader = open_shipped("glm5_page1.h5");
  REQUIRE(reader.layout().layers.size() >= 3);
  REQUIRE(reader.layout().steps.size() >= 2);
  ReplayOptions options;
  options.threads = 2;
  options.certify = 0;
  for (const int in_flight : {1, 3}) {
    INFO("layers in flight " << in_flight);
    // Layer 2 fails at its first step, well before layer 1 fails at its last.
    FailingBackend backend({{2, 0}, {1, reader.layout().steps.size() - 1}});
    options.layers_in_flight = in_flight;
    const Result<CheckRun> run = replay_dump(reader, &backend, options);
    REQUIRE_FALSE(run.ok());
    CHECK(run.error().message().find("layer index 1 step") != std::string::npos);
  }
}

TEST_CASE("the memory guard counts every layer in flight", "[replay][layers-in-flight]") {
  const DumpReader reader = open_shipped("glm5_page1.h5");
  const DumpLayout& layout = reader.layout();
  REQUIRE(layout.layers.size() >= 3);
  ReplayOptions options;
  // One layer (with the next read ahead) needs about read + computed + read; three in flight about
  // 3 x (read + computed) + read. A budget between the two lets one through and not three.
  double one_layer = 0.0;
  double largest_read = 0.0;
  for (std::size_t li = 0; li < layout.layers.size(); ++li) {
    const LayerBytes bytes = estimate_layer_bytes(layout, li, true, true);
    one_layer = std::max(one_layer, bytes.read + bytes.computed);
    largest_read = std::max(largest_read, bytes.read);
  }
  const double budget = 2.0 * one_layer + largest_read;
  REQUIRE(setenv("KVAUDIT_MEMORY_BUDGET", std::to_string(static_cast<long long>(budget)).c_str(),
                 1) == 0);
  options.layers_in_flight = 1;
  const Status sequential = check_replay_fits(layout, options, true);
  options.layers_in_flight = 3;
  const Status three = check_replay_fits(layout, options, true);
  unsetenv("KVAUDIT_MEMORY_BUDGET");
  CHECK(sequential.ok());
  REQUIRE_FALSE(three.ok());
  CHECK(three.error().message().find("times 3 layers in flight") != std::string::npos);
}

}  // namespace kvaudit

namespace kvaudit {
namespace {

DiagnosisFinding finding_at(int step, int layer_id, Comparison comparison) {
  DiagnosisFinding finding;
  finding.step = step;
  finding.layer_id = layer_id;
  finding.comparison = comparison;
  return finding;
}

// A layer's own budget over its failing steps (kernel then captured at each), as a layer in flight
// keeps it, skipping what `merged` can no longer admit.
DiagnosisBudget layer_budget(int limit, std::size_t order, const std::vector<int>& failing_steps,
                             const DiagnosisBudget& merged, int& diagnosed) {
  DiagnosisBudget budget(limit);
  for (const int step : failing_steps) {
    for (const Comparison comparison : {Comparison::kKernel, Comparison::kCaptured}) {
      if (!budget.admit(step, order) || !merged.could_admit(step, order)) continue;
      ++diagnosed;
      budget.add(step, order, finding_at(step, static_cast<int>(order), comparison));
    }
  }
  return budget;
}

}  // namespace

TEST_CASE("diagnosis budgets of layers replayed apart merge into the earliest failing sites",
          "[replay][layers-in-flight][diagnosis]") {
  // Layer 0 fails at steps 2 and 3, layer 1 at 0, 1 and 3, layer 2 at 1. With 2 sites the run
  // keeps the earliest by (step, layer): (0, layer 1) and (1, layer 1); with 3 also (1, layer 2).
  const std::vector<std::vector<int>> failing = {{2, 3}, {0, 1, 3}, {1}};
  for (const int limit : {2, 3}) {
    INFO("limit " << limit);
    DiagnosisBudget merged(limit);
    int diagnosed = 0;
    for (std::size_t order = 0; order < failing.size(); ++order) {
      merged.absorb(layer_budget(limit, order, failing[order], merged, diagnosed));
    }
    std::vector<std::pair<int, int>> kept;  // (step, layer) of each finding, in report order
    for (const DiagnosisFinding& finding : merged.findings()) {
      kept.emplace_back(finding.step, finding.layer_id);
    }
    std::vector<std::pair<int, int>> expected = {{0, 1}, {0, 1}, {1, 1}, {1, 1}};
    if (limit == 3) expected.insert(expected.end(), {{1, 2}, {1, 2}});
    CHECK(kept == expected);
    CHECK(merged.failing_sites() == 6);
    CHECK(merged.diagnosed_sites() == static_cast<std::size_t>(limit));
    // With 2, layer 1's step 3 is beyond its own two earliest sites and layer 2's step 1 is later
    // than the merged (1, layer 1): neither is diagnosed. With 3 every site is, when reached.
    CHECK(diagnosed == (limit == 2 ? 8 : 12));
  }
  // could_admit: room left, or earlier than the latest site kept.
  DiagnosisBudget budget(1);
  CHECK(budget.could_admit(5, 0));
  REQUIRE(budget.admit(2, 1));
  CHECK(budget.could_admit(2, 0));
  CHECK(budget.could_admit(1, 7));
  CHECK_FALSE(budget.could_admit(2, 2));
  CHECK_FALSE(budget.could_admit(3, 0));
  CHECK_FALSE(DiagnosisBudget(0).could_admit(0, 0));
}

}  // namespace kvaudit
