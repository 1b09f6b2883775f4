// The replay engine (see replay.hpp for the pipeline and the five comparisons).
//
// Shapes per (step, layer): q_nope [Nq, H, Dc], q_pe [Nq, H, Dr], new_kv [Nq, D], out [Nq, H, Dc],
// lse [Nq, H]; pools [S, D]. The reference (references/mla_reference.hpp) is exact to double
// precision (relative <= 1e-15), so every difference measured here is the candidate's: a bf16
// backend output carries at least bf16 rounding (2^-8 relative) and R8 - Rs the e4m3 storage
// rounding (2^-4 relative per element). Tolerances live in the policy, not here.
#include "src/replay/replay.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <future>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_map>

#include "references/mla_reference.hpp"
#include "references/mla_reference_cuda.hpp"
#include "src/core/huge_pages.hpp"
#include "src/core/memory_budget.hpp"
#include "src/core/parallel_for.hpp"
#include "src/format/pool_codes.hpp"
#include "src/replay/indexer_check.hpp"
#include "src/replay/integrity.hpp"
#include "src/verdict/divergence.hpp"
#include "src/verdict/run_judge.hpp"

namespace kvaudit {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// The time a check has spent so far in each stage, seconds (reading: the reader's own time, part
// of it hidden behind the computation by the read-ahead).
struct StageSeconds {
  double read = 0.0;
  double read_wait = 0.0;  // of it, what the replay waited for
  double reference = 0.0;
  double backend = 0.0;
  double compare = 0.0;
};

// Progress on stderr: "layer 2/3 step 1/4" at most five times per second while a layer runs, and
// one line per finished layer, always: "layer 2/78 (layer_id 5) done in 1.4 s (2 steps; so far
// read 0.3 s, waited 0.1 s for it, reference 1.9 s, backend 0.4 s, compare 0.2 s; layer 1.05 GiB);
// 2.9 s elapsed, about 1 min 46 s left" (the estimate is the mean time per finished layer times
// those left, the split is the run's time so far per stage, and the layer's bytes are what it
// held: read from the dump and computed).
//
// With several layers in flight, the running line follows the earliest layer not yet done (the one
// the run waits for; update is called from every layer's thread), and the per-layer line comes
// when the layer is merged, in layer order; it adds "up to N layers in flight" to the bytes.
class Progress {
 public:
  Progress(bool enabled, int in_flight)
      : enabled_(enabled), in_flight_(in_flight), start_(Clock::now()) {}

  // The layer (its order among the selected ones) whose steps the running line follows.
  void follow(std::size_t layer) {
    const std::lock_guard<std::mutex> lock(mutex_);
    followed_ = layer;
  }

  void update(std::size_t layer, std::size_t layers, std::size_t step, std::size_t steps) {
    if (!enabled_) return;
    const std::lock_guard<std::mutex> lock(mutex_);
    if (layer != followed_) return;
    const auto now = Clock::now();
    if (printed_ && now - last_ < std::chrono::milliseconds(200)) return;
    printed_ = true;
    last_ = now;
    fmt::print(stderr, "kvaudit: layer {}/{} step {}/{}\n", layer + 1, layers, step + 1, steps);
  }

  struct LayerDone {
    std::size_t order = 0;  // among the selected layers
    std::size_t layers = 0;
    int layer_id = 0;
    std::size_t steps = 0;
    double seconds = 0.0;
    StageSeconds split;  // the run's so far
    double layer_bytes = 0.0;
  };

  void layer_done(const LayerDone& done_layer) {
    if (!enabled_) return;
    const double elapsed = seconds_since(start_);
    const std::size_t done = done_layer.order + 1;
    const std::size_t layers = done_layer.layers;
    const double left = elapsed / static_cast<double>(done) * static_cast<double>(layers - done);
    const StageSeconds& split = done_layer.split;
    fmt::print(stderr,
               "kvaudit: layer {}/{} (layer_id {}) done in {:.1f} s ({} steps; so far read {:.1f} "
               "s, waited {:.1f} s for it, reference {:.1f} s, backend {:.1f} s, compare {:.1f} "
               "s; layer {}{}); {} elapsed{}\n",
               done, layers, done_layer.layer_id, done_layer.seconds, done_layer.steps, split.read,
               split.read_wait, split.reference, split.backend, split.compare,
               format_bytes(done_layer.layer_bytes),
               in_flight_ > 1 ? fmt::format(", up to {} layers in flight", in_flight_) : "",
               duration_text(elapsed),
               done < layers ? ", about " + duration_text(left) + " left" : std::string());
  }

 private:
  static std::string duration_text(double seconds) {
    if (seconds < 60.0) return fmt::format("{:.1f} s", seconds);
    const auto whole = static_cast<long long>(seconds + 0.5);
    if (whole < 3600) return fmt::format("{} min {} s", whole / 60, whole % 60);
    return fmt::format("{} h {} min", whole / 3600, whole % 3600 / 60);
  }

  bool enabled_;
  int in_flight_;
  std::mutex mutex_;  // update comes from every layer's thread
  std::size_t followed_ = 0;
  bool printed_ = false;
  Clock::time_point start_;
  Clock::time_point last_;
};

// Bytes held by what is read of a step.
double tensor_bytes(const StepLayerTensors& tensors) {
  double bytes = 4.0 * static_cast<double>(tensors.q_nope.size() + tensors.q_pe.size() +
                                           tensors.new_kv.size()) +
                 4.0 * static_cast<double>(tensors.topk_indices.size());
  if (tensors.out) bytes += 4.0 * static_cast<double>(tensors.out->size());
  if (tensors.lse) bytes += 4.0 * static_cast<double>(tensors.lse->size());
  if (tensors.kv_cache_after) bytes += static_cast<double>(tensors.kv_cache_after->bytes.size());
  return bytes;
}

// One layer as read from the dump: its pool, its kv_source where it has one, and every step's
// tensors in step order. Each read's result is kept for the replay to meet where it needs it, so
// that a read error stops the check at the same point as a read in place would; after a failed
// read nothing more of the layer is read.
struct LayerData {
  std::optional<Result<KvPool>> pool;
  std::optional<Result<CachedFloats>> source;
  std::vector<Result<StepLayerTensors>> steps;
  // Read in place (no reader thread): the steps are read one at a time when replayed, as each
  // step's tensors (a captured kv_cache_after is a whole pool) need not all be held at once.
  bool steps_deferred = false;
  double read_seconds = 0.0;
  double bytes = 0.0;  // held by the successful reads

  bool failed() const {
    if (pool && !pool->ok()) return true;
    if (source && !source->ok()) return true;
    return !steps.empty() && !steps.back().ok();
  }
};

LayerData read_layer(const DumpReader& reader, std::size_t layer_index, bool steps_up_front) {
  LayerData data;
  data.steps_deferred = !steps_up_front;
  const auto start = Clock::now();
  data.pool = reader.read_pool(layer_index);
  if (!data.pool->ok()) return data;
  data.bytes += static_cast<double>((*data.pool)->bytes.size());
  if (reader.layout().layers[layer_index].has_source) {
    data.source = reader.read_source(layer_index);
    if (!data.source->ok()) return data;
    data.bytes += 4.0 * static_cast<double>((*data.source)->size());
  }
  const std::size_t steps = steps_up_front ? reader.layout().steps.size() : 0;
  for (std::size_t step = 0; step < steps; ++step) {
    data.steps.push_back(reader.read_step_layer(step, layer_index));
    if (!data.steps.back().ok()) break;
    data.bytes += tensor_bytes(*data.steps.back());
  }
  data.read_seconds = seconds_since(start);
  return data;
}

// The layers' reads, in replay order, on one reader thread: it reads layer L+1 while the replay
// computes layer L, and waits until L+1 is taken before reading L+2 (one layer in flight, so about
// two layers' bytes resident). HDF5 as Debian builds it is not thread-safe: this thread is the only
// one that calls HDF5 while the replay runs, so `ahead` must be false while anything else does
// (an observer writing --save-outputs or golden files): the layers are then read on the calling
// thread, in place, as before.
class LayerReader {
 public:
  LayerReader(const DumpReader& reader, std::vector<std::size_t> layers, bool ahead)
      : reader_(reader), layers_(std::move(layers)) {
    if (ahead && !layers_.empty()) thread_ = std::thread([this] { read_ahead(); });
  }
  ~LayerReader() {
    if (!thread_.joinable()) return;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    changed_.notify_all();
    thread_.join();  // waits for the read in flight, if any
  }
  LayerReader(const LayerReader&) = delete;
  LayerReader& operator=(const LayerReader&) = delete;

  // The next layer in replay order; the time spent waiting for it goes into `waited_seconds`.
  LayerData next(double& waited_seconds) {
    const std::size_t order = taken_++;
    if (!thread_.joinable()) return read_layer(reader_, layers_.at(order), false);
    const auto start = Clock::now();
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [this] { return ready_.has_value(); });
    LayerData data = std::move(*ready_);
    ready_.reset();
    lock.unlock();
    changed_.notify_all();
    waited_seconds += seconds_since(start);
    return data;
  }

 private:
  // The reader thread: each layer in turn, handed over once the one before was taken.
  void read_ahead() {
    for (const std::size_t layer_index : layers_) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        changed_.wait(lock, [this] { return stop_ || !ready_.has_value(); });
        if (stop_) return;
      }
      LayerData data = read_layer_or_error(layer_index);
      const bool failed = data.failed();
      {
        const std::lock_guard<std::mutex> lock(mutex_);
        ready_ = std::move(data);
      }
      changed_.notify_all();
      if (failed) return;  // the replay stops at this layer's error
    }
  }

  // read_layer on the reader thread: an exception there (bulk reads turn bad_alloc into a
  // Status already; a container's length_error or an allocation outside them) would end the
  // process from a thread with no handler, so it becomes the layer's failed read instead.
  LayerData read_layer_or_error(std::size_t layer_index) {
    try {
      return read_layer(reader_, layer_index, true);
    } catch (const std::exception& e) {
      LayerData failed;
      failed.pool = Result<KvPool>(internal_error(
          reader_.layout().layers[layer_index].group,
          fmt::format("reading the layer ahead on the reader thread failed: {}", e.what())));
      return failed;
    }
  }

  const DumpReader& reader_;
  std::vector<std::size_t> layers_;
  std::size_t taken_ = 0;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::optional<LayerData> ready_;
  bool stop_ = false;
  std::thread thread_;  // last: started once the members it uses are
};

// Each value exactly in binary64, in parallel over fixed chunks (a prefill step's out is 134M
// values; each element's result is its own, so the thread count changes nothing).
template <class T, class Convert>
void widen_each_into(std::span<const T> values, int threads, Convert convert,
                     std::vector<double>& wide) {
  constexpr std::size_t kChunk = std::size_t{1} << 16;
  wide.resize(values.size());
  parallel_for((values.size() + kChunk - 1) / kChunk, threads, [&] {
    return [&](std::size_t chunk) {
      const std::size_t end = std::min(values.size(), (chunk + 1) * kChunk);
      for (std::size_t i = chunk * kChunk; i < end; ++i) wide[i] = convert(values[i]);
    };
  });
}

std::vector<double> widen(std::span<const float> values, int threads) {
  std::vector<double> wide;
  widen_each_into(
      values, threads, [](float value) { return static_cast<double>(value); }, wide);
  return wide;
}

// Into `wide` (resized to bits.size()).
void widen_bf16_into(std::span<const std::uint16_t> bits, int threads, std::vector<double>& wide) {
  widen_each_into(
      bits, threads, [](std::uint16_t value) { return static_cast<double>(bf16_to_float(value)); },
      wide);
}

// The large double arrays of a step's outputs (out [Nq, H, Dc]: 268 MB for a GLM-5 prefill step),
// kept from one step and layer to the next. A fresh one is mapped and zeroed page by page by one
// thread each time; a kept one is already mapped and is refilled on every thread. take() hands
// out `size` zeros, exactly what a fresh vector holds; give_back() keeps up to kKept arrays.
class ArrayRecycler {
 public:
  // Two per layer of the default 4 in flight (R8 and the backend's binary64 copy of a prefill
  // step); what is kept stays resident between steps, so at most 8 of the largest out arrays
  // (2.1 GB for the 16-head bench's prefill step) beyond those in use.
  static constexpr std::size_t kKept = 8;
  static constexpr std::size_t kMinElements = std::size_t{1} << 17;  // 1 MiB: below, not kept

  std::vector<double> take(std::size_t size, int threads) {
    std::vector<double> array;
    bool kept = false;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      const auto best = smallest_fitting(size);
      if (best != kept_.end()) {
        array = std::move(*best);
        kept_.erase(best);
        kept = true;
      }
    }
    if (!kept) {  // a fresh one, on huge pages where it is large
      reserve_on_huge_pages(array, size);
      array.resize(size);
      return array;
    }
    array.resize(size);  // within the capacity: no reallocation, pages already mapped
    parallel_for((size + kChunk - 1) / kChunk, threads, [&] {
      return [&](std::size_t chunk) {
        const std::size_t end = std::min(size, (chunk + 1) * kChunk);
        std::fill(array.begin() + chunk * kChunk, array.begin() + end, 0.0);
      };
    });
    return array;
  }

  void give_back(std::vector<double>& array) {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (array.capacity() >= kMinElements && kept_.size() < kKept) {
      kept_.push_back(std::move(array));
    }
    array = std::vector<double>();
  }

 private:
  static constexpr std::size_t kChunk = std::size_t{1} << 16;

  std::vector<std::vector<double>>::iterator smallest_fitting(std::size_t size) {
    auto best = kept_.end();
    for (auto it = kept_.begin(); it != kept_.end(); ++it) {
      if (it->capacity() >= size && (best == kept_.end() || it->capacity() < best->capacity())) {
        best = it;
      }
    }
    return best;
  }

  std::mutex mutex_;
  std::vector<std::vector<double>> kept_;
};

// The unquantized value of each slot, where known: the dump's kv_source (dense, every slot), or
// without it only the rows the replay wrote (sparse: such a dump may hold a pool far larger than
// the tokens its steps write, and a dense [S, D] copy would double the layer's memory).
class SourceRows {
 public:
  SourceRows(std::int64_t num_slots, int width)
      : width_(width), known_(static_cast<std::size_t>(num_slots), 0) {}

  void set_dense(CachedFloats values) {
    dense_ = std::move(values);
    std::fill(known_.begin(), known_.end(), 1);
  }

  void write(std::int64_t slot, const float* values) {
    if (!dense_.empty()) {
      std::copy(values, values + width_, dense_.begin() + slot * width_);
    } else {
      sparse_[slot].assign(values, values + width_);
    }
    known_[slot] = 1;
  }

  // How many of the tokens the step's rows see have no known source value (Rs needs none).
  std::int64_t count_unknown(const std::vector<std::int64_t>& visible) const {
    return std::count_if(visible.begin(), visible.end(),
                         [&](std::int64_t slot) { return known_[slot] == 0; });
  }
  bool covers(const std::vector<std::int64_t>& visible) const {
    return count_unknown(visible) == 0;
  }
  // The slot's row, nullptr where unknown.
  const float* row(std::int64_t slot) const {
    if (slot < 0 || slot >= static_cast<std::int64_t>(known_.size()) || known_[slot] == 0) {
      return nullptr;
    }
    if (!dense_.empty()) return dense_.data() + slot * width_;
    const auto found = sparse_.find(slot);
    return found == sparse_.end() ? nullptr : found->second.data();
  }

  // Rs for the step (the step must be covered). Sparse rows are gathered into the pages the step
  // uses, renumbered 0..P'-1 in a copy of the step, so memory follows the step.
  Result<std::int64_t> attention(const DumpAttributes& attrs, const StepMeta& step,
                                 const StepLayerTensors& tensors, std::span<double> out,
                                 std::span<double> lse, ReferenceDevice device, int threads) const {
    if (!dense_.empty()) {
      const KvRows rows = KvRows::from_values(dense_, width_, 1.0, {}, threads);
      return exact_reference_attention(device, attrs, step, tensors.q_nope, tensors.q_pe, rows, out,
                                       lse, threads);
    }
    const int page = attrs.page_size;
    std::vector<std::int32_t> pages(step.kv_indices.begin(), step.kv_indices.end());
    std::sort(pages.begin(), pages.end());
    pages.erase(std::unique(pages.begin(), pages.end()), pages.end());
    std::unordered_map<std::int32_t, std::int32_t> compact_page;
    for (std::size_t i = 0; i < pages.size(); ++i) {
      compact_page[pages[i]] = static_cast<std::int32_t>(i);
    }
    StepMeta compact = step;
    for (std::int32_t& p : compact.kv_indices) p = compact_page.at(p);
    for (std::int32_t& slot : compact.new_kv_slots) {
      slot = compact_page.at(slot / page) * page + slot % page;
    }
    std::vector<float> values(pages.size() * page * width_, 0.0f);
    for (std::size_t i = 0; i < pages.size(); ++i) {
      for (int offset = 0; offset < page; ++offset) {
        const auto it = sparse_.find(std::int64_t{pages[i]} * page + offset);
        if (it == sparse_.end()) continue;  // a slot no row sees (covers() held)
        std::copy(it->second.begin(), it->second.end(),
                  values.begin() + (i * page + offset) * width_);
      }
    }
    const KvRows rows = KvRows::from_values(values, width_, 1.0, {}, threads);
    return exact_reference_attention(device, attrs, compact, tensors.q_nope, tensors.q_pe, rows,
                                     out, lse, threads);
  }

 private:
  int width_;
  std::vector<char> known_;
  CachedFloats dense_;
  std::unordered_map<std::int64_t, std::vector<float>> sparse_;
};

// The certification recomputations, run on their own threads beside the replay (a 50-digit
// recomputation of one long row takes seconds; the replay need not wait for it), at most
// `max_in_flight` at once. Jobs come from every layer in flight, each with its place in replay
// order (layer order, then step); the samples go into the run in that order.
class CertificationQueue {
 public:
  using Place = std::pair<std::size_t, std::size_t>;  // (layer order, step index)

  explicit CertificationQueue(std::size_t max_in_flight)
      : max_in_flight_(std::max<std::size_t>(max_in_flight, 1)) {}

  Status submit(Place place, CertificationJob job) {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (pending_.size() - collected_ >= max_in_flight_) KVAUDIT_TRY(collect_one());
    pending_.push_back({place, std::async(std::launch::async, [job = std::move(job)] {
                          const auto start = Clock::now();
                          Result<CertificationSample> sample = run_certification(job);
                          return TimedSample{std::move(sample), seconds_since(start)};
                        })});
    return ok_status();
  }

  // Waits for every job; the samples in replay order, their time summed into the run.
  Status finish(CheckRun& run) {
    const std::lock_guard<std::mutex> lock(mutex_);
    while (collected_ < pending_.size()) KVAUDIT_TRY(collect_one());
    std::stable_sort(samples_.begin(), samples_.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    for (const auto& [place, sample] : samples_) run.certification.push_back(sample);
    run.certification_seconds += seconds_;
    return ok_status();
  }

 private:
  struct TimedSample {
    Result<CertificationSample> sample;
    double seconds = 0.0;
  };

  Status collect_one() {
    auto& [place, job] = pending_[collected_++];
    TimedSample done = job.get();
    seconds_ += done.seconds;
    if (!done.sample.ok()) return done.sample.error();
    samples_.emplace_back(place, *done.sample);
    return ok_status();
  }

  std::size_t max_in_flight_;
  std::mutex mutex_;  // submit comes from every layer's thread
  std::vector<std::pair<Place, std::future<TimedSample>>> pending_;
  std::size_t collected_ = 0;
  std::vector<std::pair<Place, CertificationSample>> samples_;
  double seconds_ = 0.0;
};

// What the replay of every layer shares, read from every layer's thread.
struct ReplayContext {
  const DumpReader& reader;
  const ReplayOptions& options;
  Backend* backend;  // null: --backend none
  Progress& progress;
  // The diagnoses of the layers merged so far (diagnosis_mutex): a layer skips the diagnosis of a
  // site this budget can no longer admit (DiagnosisBudget::could_admit).
  DiagnosisBudget& diagnosis;
  const CertificationPlan& certification;
  std::size_t num_layers = 0;    // selected
  std::set<int> reported_steps;  // empty: every step
  CertificationQueue* certification_queue = nullptr;
  // The slots any request of any step of the dump holds (sorted): a slot outside them holds no
  // token the dump ever reads, so a change there is classed unused_slot (integrity.hpp).
  std::vector<std::int64_t> held_slots = {};
  std::mutex diagnosis_mutex{};
  std::mutex backend_mutex{};  // run_step of a backend that is not BackendConcurrency::kConcurrent
  std::atomic<bool> stopping{false};  // an earlier layer failed: the run's error is known
  ArrayRecycler* arrays = nullptr;    // the steps' out arrays, kept between steps

  bool is_reported(std::size_t step) const {
    return reported_steps.empty() || reported_steps.count(static_cast<int>(step)) != 0;
  }
  // Whether the diagnosis of the failing site can still be kept, given the layers merged so far.
  bool may_diagnose(int step, std::size_t layer_order) {
    const std::lock_guard<std::mutex> lock(diagnosis_mutex);
    return diagnosis.could_admit(step, layer_order);
  }
};

// What one layer's replay adds to the run, kept apart from the other layers in flight and merged
// into the run in layer order (merge_layer): its comparisons (judged, with their divergence
// points), integrity findings, notes, coverage and stage times in `run`; its failing sites and
// diagnoses; and the error that stopped it, if any.
struct LayerOutcome {
  LayerOutcome(const Policy& policy, int diagnose) : judge(run), diagnosis(diagnose) {
    run.policy = policy;
  }
  LayerOutcome(const LayerOutcome&) = delete;
  LayerOutcome& operator=(const LayerOutcome&) = delete;

  CheckRun run;
  RunJudge judge;  // judges into `run` (its first divergence is this layer's alone)
  DiagnosisBudget diagnosis;
  Status status = ok_status();
  double seconds = 0.0;     // the layer's own wall time
  double held_bytes = 0.0;  // LayerReplay::held_bytes
};

// One step of one layer, as the phases below read it.
struct StepInput {
  std::size_t index = 0;  // S### number
  const StepMeta& meta;   // the step as stored: its rows, their writes and positions
  const StepLayerTensors& tensors;
  // What the attention runs on: `meta` itself, or with topk_indices (v1.1) one request per row
  // over its listed tokens (src/format/step_indices.hpp attention_view).
  AttentionView view;
  bool reported = false;
  std::vector<std::int64_t> visible;  // the slots the step's rows read (reported steps only)
  TensorShape3 shape;                 // out: [Nq, H, Dc]
  std::string where;                  // the dump's own groups, "S001 L000"
};

// What one (step, layer) computed: out [Nq, H, Dc], lse [Nq, H], in double.
struct StepResults {
  std::vector<double> r8_out;  // R8: the reference pool after the step's writes
  std::vector<double> r8_lse;
  std::vector<double> rs_out;  // Rs: the source rows, when every visible token has one
  std::vector<double> rs_lse;
  bool has_source_reference = false;
  std::vector<double> read_out;  // R8': the backend's pool, where it differs from R8's
  std::vector<double> read_lse;
  bool read_differs = false;
  std::optional<AttentionOutput> backend;  // null without a backend
  // The backend's pool as it left it, kept only when it changed the storage (the replay then goes
  // on with the reference pool, and observers must still see what the backend wrote).
  std::optional<KvPool> changed_storage_pool;
  std::vector<double> server_out;  // R8s: the server's pool, where it differs from R8's
  std::vector<double> server_lse;
  bool server_tracked = false;  // a captured pool of the layer has differed from the replay
  bool server_differs = false;

  OutputView r8() const { return {r8_out, r8_lse}; }
  // R8 on the pool the backend read: R8 itself while the slots the step reads hold the
  // reference's bytes (the reference is deterministic).
  OutputView read() const { return read_differs ? OutputView{read_out, read_lse} : r8(); }
  // R8 on the server's pool, likewise.
  OutputView server() const { return server_differs ? OutputView{server_out, server_lse} : r8(); }
};

// The replay of one layer over every step: the reference replay's own pool, the backend's copy,
// the source rows, and what carries from step to step (captured damage, NaN codes).
class LayerReplay {
 public:
  LayerReplay(ReplayContext& context, LayerOutcome& outcome, std::size_t layer_index,
              std::size_t order)
      : context_(context),
        outcome_(outcome),
        attrs_(context.reader.layout().attrs),
        layer_(context.reader.layout().layers[layer_index]),
        layer_index_(layer_index),
        order_(order),
        source_(context.reader.layout().num_slots(), attrs_.row_width()) {}

  // Takes the layer as read (pool, kv_source, step tensors), meeting its read errors in order.
  Status load_state(LayerData data);
  Status replay_step(std::size_t step_index);
  // What the layer held at most: what was read, the pools' working copies, and the largest step's
  // reference and backend outputs (the --progress line states it).
  double held_bytes() const;
  // After the last step: one note naming the steps whose quantization and total error could not
  // be measured (no source value for some token they read), if any.
  void note_unmeasured_steps();

 private:
  StepInput step_input(std::size_t step_index, const StepLayerTensors& tensors) const;
  StepLayerWrites write_reference(const StepInput& step);
  Status compute_references(const StepInput& step, StepResults& results);
  Status certify(const StepInput& step, const StepResults& results);
  void record_coverage(const StepInput& step);
  Status run_backend(const StepInput& step, const StepLayerWrites& writes, StepResults& results);
  Status reference_on_read_pool(const StepInput& step, StepResults& results);
  void update_server_pool(const StepInput& step);
  Status reference_on_server_pool(const StepInput& step, StepResults& results);
  void record(std::vector<IntegrityFinding> findings, bool reported);
  Status compare(const StepInput& step, const StepResults& results);
  Status compare_backend(const ComparisonSite& site, const StepInput& step,
                         const StepResults& results, const OutputView& backend);
  Status compare_captured(const ComparisonSite& site, const StepInput& step,
                          const StepResults& results);
  // The diagnosis of a failing comparison whose candidate read `pool` (when the budget admits
  // its (step, layer)).
  Status diagnose_failure(const StepInput& step, const ComparisonResult& failed,
                          const TensorShape3& shape, const ComparisonOperands& operands,
                          const KvPool& pool);
  Status observe(const StepInput& step, const StepResults& results) const;
  Status reference_on_pool(const KvPool& pool, const StepInput& step, std::vector<double>& out,
                           std::vector<double>& lse);
  double output_bytes(const StepInput& step, const StepResults& results) const;

  ReplayContext& context_;
  LayerOutcome& outcome_;
  const DumpAttributes& attrs_;
  const LayerMeta& layer_;
  std::size_t layer_index_;
  std::size_t order_;  // position among the selected layers, in dump order
  KvPool reference_pool_;
  KvPool backend_pool_;
  PoolDamageHistory captured_damage_;  // slots of kv_cache_after that differ, step to step
  // What the server's attention read, once a captured pool differed from the replay (until then
  // the reference pool): the captured pool, carried with the reference's writes.
  std::optional<KvPool> server_pool_;
  PoolNanCodes reference_nan_codes_;  // NaN codes of reference_pool_ (data), kept per write
  SourceRows source_;
  LayerData data_;
  double largest_step_bytes_ = 0.0;            // outputs of the step that computed the most
  std::vector<StepLayerCoverage> unmeasured_;  // reported steps whose tokens lack a source value
  std::size_t reported_steps_ = 0;
};

Status LayerReplay::load_state(LayerData data) {
  const DumpReader& reader = context_.reader;
  data_ = std::move(data);
  outcome_.run.read_seconds += data_.read_seconds;
  if (!data_.pool->ok()) return data_.pool->error();
  reference_pool_ = std::move(**data_.pool);
  backend_pool_ = reference_pool_;
  reference_nan_codes_.scan(reference_pool_);
  if (!layer_.has_source) return ok_status();
  if (!data_.source->ok()) return data_.source->error();
  CachedFloats source = std::move(**data_.source);
  if (source.size() != static_cast<std::size_t>(reader.layout().num_slots()) * attrs_.row_width()) {
    return internal_error(
        fmt::format("{}:/layers/{}/kv_source", reader.path().string(), layer_.group),
        "source has an unexpected size");
  }
  source_.set_dense(std::move(source));
  return ok_status();
}

Status LayerReplay::replay_step(std::size_t step_index) {
  const std::size_t num_steps = context_.reader.layout().steps.size();
  context_.progress.update(order_, context_.num_layers, step_index, num_steps);
  std::optional<Result<StepLayerTensors>> read_now;
  if (data_.steps_deferred) {  // read in place, this step only
    const auto read_start = Clock::now();
    read_now.emplace(context_.reader.read_step_layer(step_index, layer_index_));
    outcome_.run.read_seconds += seconds_since(read_start);
  } else if (step_index >= data_.steps.size()) {
    return internal_error(layer_.group,
                          fmt::format("step {} of the layer was not read", step_index));
  }
  Result<StepLayerTensors>& read = read_now ? *read_now : data_.steps[step_index];
  if (!read.ok()) return read.error();
  // Moved out: the step's tensors are freed once it is replayed.
  const StepLayerTensors tensors = std::move(*read);
  const StepInput step = step_input(step_index, tensors);
  const StepLayerWrites writes = write_reference(step);
  StepResults results;
  if (step.reported) KVAUDIT_TRY(compute_references(step, results));
  if (context_.backend != nullptr) KVAUDIT_TRY(run_backend(step, writes, results));
  if (tensors.kv_cache_after) {
    record(check_captured_pool(writes, *tensors.kv_cache_after, reference_pool_, &captured_damage_),
           step.reported);
  }
  update_server_pool(step);
  if (!step.reported) return ok_status();
  if (server_pool_) KVAUDIT_TRY(reference_on_server_pool(step, results));
  // NaN codes in the reference pool: data (unused slots may hold them), reported per step.
  if (auto nan_codes =
          reference_nan_codes_.report(writes, reference_pool_.num_slots, step.visible)) {
    outcome_.run.integrity.push_back(std::move(*nan_codes));
  }
  const auto judge_start = Clock::now();
  KVAUDIT_TRY(compare(step, results));
  outcome_.run.judge_seconds += seconds_since(judge_start);
  largest_step_bytes_ = std::max(largest_step_bytes_, output_bytes(step, results));
  KVAUDIT_TRY(observe(step, results));
  for (std::vector<double>* out :
       {&results.r8_out, &results.rs_out, &results.read_out, &results.server_out}) {
    context_.arrays->give_back(*out);
  }
  return ok_status();
}

// The outputs one step holds: R8, Rs, R8' and R8s where computed (double), the backend's (bf16 out,
// float lse) and their binary64 copies for the comparisons, and the captured outputs' copies.
double LayerReplay::output_bytes(const StepInput& step, const StepResults& results) const {
  auto doubles = [](const std::vector<double>& values) {
    return 8.0 * static_cast<double>(values.size());
  };
  double bytes = doubles(results.r8_out) + doubles(results.r8_lse) + doubles(results.rs_out) +
                 doubles(results.rs_lse) + doubles(results.read_out) + doubles(results.read_lse) +
                 doubles(results.server_out) + doubles(results.server_lse);
  if (results.backend) {
    const double elements = static_cast<double>(results.backend->out_bf16.size());
    const double rows_heads = static_cast<double>(results.backend->lse.size());
    bytes += 2.0 * elements + 4.0 * rows_heads + 8.0 * (elements + rows_heads);
  }
  if (step.tensors.out) bytes += 8.0 * static_cast<double>(step.tensors.out->size());
  if (step.tensors.lse) bytes += 8.0 * static_cast<double>(step.tensors.lse->size());
  return bytes;
}

double LayerReplay::held_bytes() const {
  // data_.bytes counts the pool once (it became reference_pool_); the backend's copy and its
  // before-image (run_backend), and the server's pool once tracked, come on top.
  const double pool = static_cast<double>(reference_pool_.bytes.size());
  const double server = server_pool_ ? static_cast<double>(server_pool_->bytes.size()) : 0.0;
  return data_.bytes + (context_.backend != nullptr ? 2.0 * pool : 0.0) + server +
         largest_step_bytes_;
}

StepInput LayerReplay::step_input(std::size_t step_index, const StepLayerTensors& tensors) const {
  const StepMeta& meta = context_.reader.layout().steps[step_index];
  const bool reported = context_.is_reported(step_index);
  AttentionView view = attention_view(attrs_, meta, tensors);
  std::vector<std::int64_t> visible =
      reported ? visible_slots(view.step, view.attrs.page_size) : std::vector<std::int64_t>{};
  return StepInput{
      step_index,
      meta,
      tensors,
      std::move(view),
      reported,
      std::move(visible),
      TensorShape3{meta.num_rows(), attrs_.num_heads, attrs_.kv_lora_rank},
      // Messages name the dump's own groups (a dump may start at S001, or name layer 5 L000).
      meta.group + " " + layer_.group,
  };
}

// 1. The reference replay's own writes (kvdump write rule) and the source of each new row.
StepLayerWrites LayerReplay::write_reference(const StepInput& step) {
  const int width = attrs_.row_width();
  const bool reciprocal = context_.options.reciprocal_scale;
  for (int i = 0; i < step.meta.num_rows(); ++i) {
    const std::int64_t slot = step.meta.new_kv_slots[i];
    const float* values = step.tensors.new_kv.data() + static_cast<std::size_t>(i) * width;
    reference_pool_.write_row(slot, values, layer_.kv_scale, reciprocal);
    source_.write(slot, values);
  }
  reference_nan_codes_.update(reference_pool_, step.meta.new_kv_slots);
  StepLayerWrites writes{static_cast<int>(step.index), layer_.layer_id, step.meta.new_kv_slots,
                         step.tensors.new_kv,          layer_.kv_scale, step.where};
  writes.attrs = &attrs_;
  writes.held_slots = context_.held_slots;
  writes.meta = &step.meta;  // names a misplaced row's request and token
  writes.page_size = attrs_.page_size;
  if (reciprocal) writes.rule = "e4m3_rne_satfinite(new_kv * fp32(1 / kv_scale))";
  if (attrs_.per_token_group()) {  // kvdump v1.1 (src/format/group_scales.hpp)
    writes.rule = reciprocal ? "the v1.1 group rule with reciprocal scales, "
                               "e4m3_rne_satfinite(new_kv * fp32(1 / group scale))"
                             : "the v1.1 group rule, e4m3_rne_satfinite(new_kv / group scale)";
  }
  return writes;
}

// R8 on `pool`: the exact attention on the visible slots, dequantized with kv_scale.
Status LayerReplay::reference_on_pool(const KvPool& pool, const StepInput& step,
                                      std::vector<double>& out, std::vector<double>& lse) {
  out = context_.arrays->take(step.shape.size(), context_.options.threads);
  lse.assign(static_cast<std::size_t>(step.shape.rows) * step.shape.heads, 0.0);
  const KvRows dequantized =
      KvRows::from_pool_slots(pool, layer_.kv_scale, step.visible, context_.options.threads);
  KVAUDIT_ASSIGN_OR_RETURN(
      const std::int64_t work,
      exact_reference_attention(context_.options.reference, step.view.attrs, step.view.step,
                                step.tensors.q_nope, step.tensors.q_pe, dequantized, out, lse,
                                context_.options.threads));
  outcome_.run.reference_rows_heads_tokens += static_cast<double>(work);
  return ok_status();
}

// 2. References: R8 on the dequantized pool, Rs on the source rows.
Status LayerReplay::compute_references(const StepInput& step, StepResults& results) {
  const auto start = Clock::now();
  KVAUDIT_TRY(reference_on_pool(reference_pool_, step, results.r8_out, results.r8_lse));
  if (source_.covers(step.visible)) {
    results.rs_out = context_.arrays->take(step.shape.size(), context_.options.threads);
    results.rs_lse.assign(results.r8_lse.size(), 0.0);
    KVAUDIT_ASSIGN_OR_RETURN(
        const std::int64_t work,
        source_.attention(step.view.attrs, step.view.step, step.tensors, results.rs_out,
                          results.rs_lse, context_.options.reference, context_.options.threads));
    outcome_.run.reference_rows_heads_tokens += static_cast<double>(work);
    results.has_source_reference = true;
  }
  outcome_.run.reference_seconds += seconds_since(start);
  record_coverage(step);
  return certify(step, results);
}

// 2b. Certification of R8 at a planned site: one (row, head) again in 50 digits, on its own thread
// (the job copies what it reads).
Status LayerReplay::certify(const StepInput& step, const StepResults& results) {
  const auto site = context_.certification.find({static_cast<int>(step.index), layer_.layer_id});
  if (site == context_.certification.end()) return ok_status();
  return context_.certification_queue->submit(
      {order_, step.index},
      prepare_certification(step.view.attrs, step.view.step, step.tensors, reference_pool_,
                            layer_.kv_scale, results.r8_out, results.r8_lse,
                            static_cast<int>(step.index), layer_.layer_id, site->second));
}

// What the step read: tokens, those without a source value, saturated codes among them (in the
// reference pool after the step's writes: what R8 read).
void LayerReplay::record_coverage(const StepInput& step) {
  StepLayerCoverage site;
  site.step = static_cast<int>(step.index);
  site.layer_id = layer_.layer_id;
  site.tokens_read = static_cast<std::int64_t>(step.visible.size());
  site.tokens_without_source = source_.count_unknown(step.visible);
  site.codes_read = site.tokens_read * attrs_.row_width();
  if (reference_pool_.dtype == KvDtype::kFloat8E4m3fn) {
    site.saturated_codes = count_pool_codes(reference_pool_, step.visible).saturated;
  }
  ++reported_steps_;
  if (site.tokens_without_source > 0) unmeasured_.push_back(site);
  outcome_.run.coverage.push_back(site);
}

void LayerReplay::note_unmeasured_steps() {
  if (unmeasured_.empty()) return;
  std::vector<int> steps;
  for (const StepLayerCoverage& site : unmeasured_) steps.push_back(site.step);
  const StepLayerCoverage& first = unmeasured_.front();
  const std::string which =
      unmeasured_.size() == reported_steps_
          ? fmt::format("any of the {} reported steps", reported_steps_)
          : fmt::format("steps {} ({} of {} reported)", fmt::join(steps, ", "), steps.size(),
                        reported_steps_);
  outcome_.run.notes.push_back(fmt::format(
      "{}: quantization and total error not measured at {}: they read tokens with no source "
      "value ({}; only the new_kv rows the dump's steps write have one); at step {}, {} of the "
      "{} tokens read have none",
      layer_.group, which,
      layer_.has_source ? "kv_source does not cover them" : "the layer has no kv_source",
      first.step, first.tokens_without_source, first.tokens_read));
}

// 3. The backend under test, on its own pool, then the integrity of that pool and R8'.
Status LayerReplay::run_backend(const StepInput& step, const StepLayerWrites& writes,
                                StepResults& results) {
  Backend& backend = *context_.backend;
  const KvPool before = backend_pool_;
  const StepLayerInput input{attrs_, step.meta, layer_, step.tensors, step.index, layer_index_};
  // One call at a time unless the backend allows more (layers in flight); the time is the call's.
  std::unique_lock<std::mutex> one_call(context_.backend_mutex, std::defer_lock);
  if (backend.concurrency() != BackendConcurrency::kConcurrent) one_call.lock();
  const auto start = Clock::now();
  KVAUDIT_ASSIGN_OR_RETURN(results.backend, backend.run_step(input, backend_pool_));
  outcome_.run.backend_seconds += seconds_since(start);
  if (one_call.owns_lock()) one_call.unlock();
  if (results.backend->out_bf16.size() != step.shape.size() ||
      results.backend->lse.size() != static_cast<std::size_t>(step.shape.rows) * step.shape.heads) {
    return internal_error(
        step.where, fmt::format("backend {} returned out/lse of the wrong size", backend.name()));
  }
  record(check_backend_pool(writes, before, backend_pool_, reference_pool_), step.reported);
  // A backend that changed its storage cannot be replayed further on its own pool: give it the
  // reference pool so later steps measure the kernel, while this step's findings stand.
  const bool same_storage = backend_pool_.bytes.size() == reference_pool_.bytes.size() &&
                            backend_pool_.dtype == reference_pool_.dtype;
  if (step.reported && same_storage) KVAUDIT_TRY(reference_on_read_pool(step, results));
  if (!same_storage) {
    results.changed_storage_pool = std::move(backend_pool_);
    backend_pool_ = reference_pool_;
  }
  return ok_status();
}

// R8' (docs/design.md "Numerics"): R8 on the pool the backend read, its own pool after its writes,
// computed only where the slots the step reads differ from the reference pool's.
Status LayerReplay::reference_on_read_pool(const StepInput& step, StepResults& results) {
  results.read_differs =
      std::any_of(step.visible.begin(), step.visible.end(), [&](std::int64_t slot) {
        return std::memcmp(backend_pool_.row(slot), reference_pool_.row(slot),
                           reference_pool_.row_bytes()) != 0;
      });
  if (!results.read_differs) return ok_status();
  const auto start = Clock::now();
  KVAUDIT_TRY(reference_on_pool(backend_pool_, step, results.read_out, results.read_lse));
  outcome_.run.reference_seconds += seconds_since(start);
  return ok_status();
}

// 5. The server's pool after the step (what its attention read; the hook writes before attention,
// docs/sglang-capture.md): the captured kv_cache_after where the step has one, else the previous
// server pool with the reference's writes of the step. Materialised only once a captured pool
// differs from the reference pool: until then it is the reference pool.
void LayerReplay::update_server_pool(const StepInput& step) {
  const std::optional<KvPool>& captured = step.tensors.kv_cache_after;
  if (captured) {
    if (server_pool_ || captured->bytes != reference_pool_.bytes) server_pool_ = *captured;
    return;
  }
  if (!server_pool_) return;
  for (const std::int32_t slot : step.meta.new_kv_slots) {
    std::memcpy(server_pool_->row(slot), reference_pool_.row(slot), reference_pool_.row_bytes());
  }
}

// R8s: R8 on the server's pool, computed only where the slots the step reads differ from the
// reference pool's (R8s = R8 exactly otherwise).
Status LayerReplay::reference_on_server_pool(const StepInput& step, StepResults& results) {
  results.server_tracked = true;
  const KvPool& server = *server_pool_;
  results.server_differs =
      std::any_of(step.visible.begin(), step.visible.end(), [&](std::int64_t slot) {
        return std::memcmp(server.row(slot), reference_pool_.row(slot),
                           reference_pool_.row_bytes()) != 0;
      });
  if (!results.server_differs) return ok_status();
  const auto start = Clock::now();
  KVAUDIT_TRY(reference_on_pool(server, step, results.server_out, results.server_lse));
  outcome_.run.reference_seconds += seconds_since(start);
  return ok_status();
}

// The findings of a reported step go into the run; a failure at a step that is not reported
// becomes a note, so that it is not lost.
void LayerReplay::record(std::vector<IntegrityFinding> findings, bool reported) {
  for (IntegrityFinding& finding : findings) {
    if (reported) {
      outcome_.run.integrity.push_back(std::move(finding));
    } else if (!finding.pass) {
      outcome_.run.notes.push_back("(step not reported) " + finding.detail);
    }
  }
}

// 4. Comparisons, handed to the run judge.
Status LayerReplay::compare(const StepInput& step, const StepResults& results) {
  const ComparisonSite site{step.meta, static_cast<int>(step.index), layer_.layer_id, order_};
  std::vector<double> backend_out;
  std::vector<double> backend_lse;
  if (results.backend) {
    backend_out = context_.arrays->take(results.backend->out_bf16.size(), context_.options.threads);
    widen_bf16_into(results.backend->out_bf16, context_.options.threads, backend_out);
    backend_lse = widen(results.backend->lse, context_.options.threads);
    KVAUDIT_TRY(compare_backend(site, step, results, {backend_out, backend_lse}));
  }
  if (results.has_source_reference) {
    const OutputView rs{results.rs_out, results.rs_lse};
    outcome_.judge.compare(site, Comparison::kQuantization, step.shape, {rs, results.r8()});
    if (results.backend) {
      outcome_.judge.compare(site, Comparison::kTotal, step.shape,
                             {rs, {backend_out, backend_lse}});
    }
  }
  if (step.tensors.out || step.tensors.lse) KVAUDIT_TRY(compare_captured(site, step, results));
  if (results.server_tracked) {
    outcome_.judge.compare(site, Comparison::kCapturedCache, step.shape,
                           {results.r8(), results.server()});
  }
  context_.arrays->give_back(backend_out);
  return ok_status();
}

// kernel (the backend against what it read; the verdict chooses between R8' and R8) and cache
// (what the pool it read costs).
Status LayerReplay::compare_backend(const ComparisonSite& site, const StepInput& step,
                                    const StepResults& results, const OutputView& backend) {
  const OutputView r8 = results.r8();
  const OutputView read = results.read();
  const KernelReferenceChoice choice =
      results.read_differs ? choose_kernel_reference(context_.options.policy, step.shape, backend,
                                                     read, r8, step.where)
                           : KernelReferenceChoice{};
  if (!choice.note.empty()) outcome_.run.notes.push_back(choice.note);
  const bool on_reference_pool = choice.reference == KernelReference::kReferencePool;
  const OutputView& kernel_reference = on_reference_pool ? r8 : read;
  const ComparisonResult kernel =
      outcome_.judge.compare(site, Comparison::kKernel, step.shape, {kernel_reference, backend});
  outcome_.judge.compare(site, Comparison::kCache, step.shape, {r8, read});
  if (kernel.judgement.pass) return ok_status();
  return diagnose_failure(step, kernel, step.shape, {kernel_reference, backend},
                          on_reference_pool ? reference_pool_ : backend_pool_);
}

// The dump's own out/lse against R8, and against R8s once the server's pool is tracked. They are
// captured independently: an lse-only capture is compared on lse alone (an out shape with no
// dims). The failing one judged on what the server read is diagnosed: captured_read where the
// server's pool differs on the slots the step reads, else captured.
Status LayerReplay::compare_captured(const ComparisonSite& site, const StepInput& step,
                                     const StepResults& results) {
  const StepLayerTensors& tensors = step.tensors;
  const std::vector<double> captured_out =
      tensors.out ? widen(*tensors.out, context_.options.threads) : std::vector<double>{};
  const std::vector<double> captured_lse =
      tensors.lse ? widen(*tensors.lse, context_.options.threads) : std::vector<double>{};
  const OutputView candidate{captured_out, captured_lse};
  const TensorShape3 shape{step.shape.rows, step.shape.heads, tensors.out ? step.shape.dims : 0};
  auto as_captured = [&](const OutputView& full) {
    return OutputView{tensors.out ? full.out : std::span<const double>(),
                      tensors.lse ? full.lse : std::span<const double>()};
  };
  const OutputView r8 = as_captured(results.r8());
  const ComparisonResult captured =
      outcome_.judge.compare(site, Comparison::kCaptured, shape, {r8, candidate});
  if (!results.server_tracked) {
    if (captured.judgement.pass) return ok_status();
    return diagnose_failure(step, captured, shape, {r8, candidate}, reference_pool_);
  }
  const OutputView server = as_captured(results.server());
  const ComparisonResult read =
      outcome_.judge.compare(site, Comparison::kCapturedRead, shape, {server, candidate});
  const ComparisonResult& failed = results.server_differs ? read : captured;
  if (failed.judgement.pass) return ok_status();
  return diagnose_failure(step, failed, shape, {results.server_differs ? server : r8, candidate},
                          results.server_differs ? *server_pool_ : reference_pool_);
}

// How the candidate of a failing comparison stored its out: a backend returns bf16 bits
// (AttentionOutput::out_bf16, src/backend/backend.hpp), a captured out is as its dataset held it.
namespace {
OutputStorage candidate_out_storage(Comparison comparison, const StepLayerTensors& tensors) {
  return comparison == Comparison::kKernel ? OutputStorage::kBfloat16 : tensors.out_storage;
}
}  // namespace

// 6. The diagnosis of a failing comparison (src/replay/diagnosis.hpp), within the run's budget.
Status LayerReplay::diagnose_failure(const StepInput& step, const ComparisonResult& failed,
                                     const TensorShape3& shape, const ComparisonOperands& operands,
                                     const KvPool& pool) {
  // The hypotheses are per-tensor conventions over dense steps (src/replay/diagnosis.hpp).
  if (attrs_.per_token_group() || step.tensors.sparse()) return ok_status();
  if (!outcome_.diagnosis.admit(static_cast<int>(step.index), order_)) return ok_status();
  if (!context_.may_diagnose(static_cast<int>(step.index), order_)) return ok_status();
  const auto start = Clock::now();
  const DiagnosisInput input{attrs_,
                             step.meta,
                             step.tensors,
                             layer_.kv_scale,
                             pool,
                             step.visible,
                             failed,
                             shape,
                             operands.reference,
                             operands.candidate,
                             context_.options.policy,
                             context_.options.threads,
                             [this](std::int64_t slot) { return source_.row(slot); },
                             context_.options.diagnose_tiles,
                             candidate_out_storage(failed.comparison, step.tensors)};
  KVAUDIT_ASSIGN_OR_RETURN(DiagnosisFinding finding, diagnose(input));
  outcome_.diagnosis.add(static_cast<int>(step.index), order_, std::move(finding));
  outcome_.run.diagnosis_seconds += seconds_since(start);
  return ok_status();
}

Status LayerReplay::observe(const StepInput& step, const StepResults& results) const {
  if (!context_.options.observer) return ok_status();
  StepLayerOutputs outputs;
  outputs.step = static_cast<int>(step.index);
  outputs.layer_id = layer_.layer_id;
  outputs.shape = step.shape;
  outputs.reference_out = results.r8_out;
  outputs.reference_lse = results.r8_lse;
  if (results.has_source_reference) {
    outputs.reference_source_out = results.rs_out;
    outputs.reference_source_lse = results.rs_lse;
  }
  outputs.backend = results.backend ? &*results.backend : nullptr;
  if (results.backend) {
    outputs.backend_pool =
        results.changed_storage_pool ? &*results.changed_storage_pool : &backend_pool_;
  }
  outputs.written_slots = step.meta.new_kv_slots;
  return context_.options.observer(outputs);
}

// The layers to replay, as indices into layout.layers, in dump order.
std::vector<std::size_t> selected_layers(const DumpLayout& layout, const ReplayOptions& options) {
  std::vector<std::size_t> indices;
  for (std::size_t li = 0; li < layout.layers.size(); ++li) {
    const int id = layout.layers[li].layer_id;
    if (options.layer_ids.empty() || std::find(options.layer_ids.begin(), options.layer_ids.end(),
                                               id) != options.layer_ids.end()) {
      indices.push_back(li);
    }
  }
  return indices;
}

// The certification sites of this run: over certification_layer_ids (or the replayed layers) and
// the reported steps.
CertificationPlan certification_plan(const DumpLayout& layout, const ReplayOptions& options,
                                     const std::vector<std::size_t>& layers) {
  std::vector<int> layer_ids = options.certification_layer_ids;
  if (layer_ids.empty()) {
    for (const std::size_t li : layers) layer_ids.push_back(layout.layers[li].layer_id);
  }
  std::vector<int> steps = options.step_indices;
  if (steps.empty()) {
    for (std::size_t s = 0; s < layout.steps.size(); ++s) steps.push_back(static_cast<int>(s));
  }
  std::sort(steps.begin(), steps.end());
  steps.erase(std::unique(steps.begin(), steps.end()), steps.end());
  return plan_certification(layout, layer_ids, steps, options.certify);
}

}  // namespace

CheckRun begin_run(const DumpReader& reader, const Backend* backend, const ReplayOptions& options) {
  CheckRun run;
  run.dump_path = reader.path().string();
  run.backend = backend ? backend->name() : "none";
  run.backend_description = backend ? backend->describe() : nlohmann::json::object();
  run.policy = options.policy;
  run.dump_summary = summarize_dump(reader.layout());
  run.diagnose_limit = options.diagnose;
  run.reference_device = std::string(reference_device_name(options.reference));
  if (options.reciprocal_scale) {
    run.notes.push_back(
        "--reciprocal-scale: pools were written (and captured pools judged) with "
        "e4m3_rne_satfinite(x * fp32(1 / kv_scale)), not kvdump-v1's x / kv_scale");
  }
  return run;
}

Status check_selection(const DumpLayout& layout, const ReplayOptions& options) {
  for (const int id : options.layer_ids) {
    if (layout.layer_index_of_id(id) >= 0) continue;
    std::vector<int> known;
    for (const LayerMeta& layer : layout.layers) known.push_back(layer.layer_id);
    return bad_input("--layers", fmt::format("layer id {} is not in the dump (it holds {})", id,
                                             fmt::join(known, ", ")));
  }
  for (const int step : options.step_indices) {
    if (step < 0 || static_cast<std::size_t>(step) >= layout.steps.size()) {
      return bad_input("--steps", fmt::format("step {} is not in the dump (it holds {} steps)",
                                              step, layout.steps.size()));
    }
  }
  return ok_status();
}

bool reads_ahead(const DumpLayout& layout, const ReplayOptions& options) {
  if (!options.read_ahead || options.observer) return false;
  return std::none_of(layout.steps.begin(), layout.steps.end(), [](const StepMeta& step) {
    return std::find(step.has_kv_cache_after.begin(), step.has_kv_cache_after.end(), true) !=
           step.has_kv_cache_after.end();
  });
}

LayerBytes estimate_layer_bytes(const DumpLayout& layout, std::size_t layer_index,
                                bool with_backend, bool steps_up_front) {
  const DumpAttributes& attrs = layout.attrs;
  const double slots = static_cast<double>(layout.num_slots());
  const double width = attrs.row_width();
  const double element = attrs.kv_dtype == KvDtype::kBfloat16 ? 2.0 : 1.0;
  const double pool = slots * (width * element + 4.0 * attrs.num_scale_groups());
  const double heads = attrs.num_heads;
  const double latent = attrs.kv_lora_rank;
  LayerBytes bytes;
  bytes.read = pool + (layout.layers[layer_index].has_source ? 4.0 * slots * width : 0.0);
  double largest_outputs = 0.0;
  double largest_step_read = 0.0;
  double most_visible = 0.0;  // slots the reference decodes for one step, at most
  for (const StepMeta& step : layout.steps) {
    const double rows = step.num_rows();
    const auto captured = [&](const std::vector<bool>& has) {
      return layer_index < has.size() && has[layer_index];
    };
    const bool has_out = captured(step.has_out);
    const bool has_lse = captured(step.has_lse);
    const double topk = layer_index < step.topk.size() ? step.topk[layer_index] : 0;
    const double step_read = 4.0 * rows * (heads * width + width + topk) +
                             (has_out ? 4.0 * rows * heads * latent : 0.0) +
                             (has_lse ? 4.0 * rows * heads : 0.0) +
                             (captured(step.has_kv_cache_after) ? pool : 0.0);
    if (steps_up_front) bytes.read += step_read;
    largest_step_read = std::max(largest_step_read, step_read);
    most_visible = std::max(most_visible, static_cast<double>(step.kv_indices.size()) *
                                              static_cast<double>(attrs.page_size));
    // R8 and Rs in binary64; the backend's bf16 out, float lse and their binary64 copies; the
    // captured outputs' binary64 copies.
    const double out = rows * heads * latent;
    const double lse = rows * heads;
    double outputs = 2.0 * 8.0 * (out + lse);
    if (with_backend) outputs += 2.0 * out + 4.0 * lse + 8.0 * (out + lse);
    if (has_out) outputs += 8.0 * out;
    if (has_lse) outputs += 8.0 * lse;
    largest_outputs = std::max(largest_outputs, outputs);
  }
  if (!steps_up_front) bytes.read += largest_step_read;  // one step at a time
  // The replay's copy of the pool for the backend (made with or without one) and, with one, its
  // before-image; the reference's rows decoded as floats for the slots a step reads (KvRows:
  // 4 bytes per element, twice with per_token_group residuals, and 8 bytes per slot of index).
  const double decoded =
      std::min(most_visible, slots) * 4.0 * width * (attrs.per_token_group() ? 2.0 : 1.0) +
      8.0 * slots;
  bytes.computed = (with_backend ? 2.0 : 1.0) * pool + decoded + largest_outputs;
  return bytes;
}

Status check_replay_fits(const DumpLayout& layout, const ReplayOptions& options, bool with_backend,
                         const Backend* backend) {
  const std::vector<std::size_t> layers = selected_layers(layout, options);
  const bool ahead = reads_ahead(layout, options) && layers.size() > 1;
  const int in_flight = layers_in_flight(layout, options, backend).count;
  double largest_read = 0.0;
  for (const std::size_t li : layers) {
    largest_read =
        std::max(largest_read, estimate_layer_bytes(layout, li, with_backend, ahead).read);
  }
  std::optional<std::size_t> worst;
  double worst_bytes = 0.0;
  for (const std::size_t li : layers) {
    const LayerBytes bytes = estimate_layer_bytes(layout, li, with_backend, ahead);
    const double resident =
        in_flight * (bytes.read + bytes.computed) + (ahead ? largest_read : 0.0);
    if (!worst || resident > worst_bytes) {
      worst = li;
      worst_bytes = resident;
    }
  }
  if (!worst) return ok_status();
  const LayerBytes bytes = estimate_layer_bytes(layout, *worst, with_backend, ahead);
  return check_memory_fits(
      worst_bytes, "check",
      fmt::format(
          "layer {} (layer_id {}): {} read from the dump and {} computed{}{}",
          layout.layers[*worst].group, layout.layers[*worst].layer_id, format_bytes(bytes.read),
          format_bytes(bytes.computed),
          in_flight > 1 ? fmt::format(", times {} layers in flight", in_flight) : std::string(),
          ahead ? fmt::format(", with the next layer's {} read ahead", format_bytes(largest_read))
                : std::string()));
}

nlohmann::json summarize_dump(const DumpLayout& layout) {
  const DumpAttributes& attrs = layout.attrs;
  nlohmann::json layers = nlohmann::json::array();
  for (const LayerMeta& layer : layout.layers) {
    layers.push_back({{"group", layer.group},
                      {"layer_id", layer.layer_id},
                      {"kv_scale", layer.kv_scale},
                      {"has_source", layer.has_source}});
  }
  nlohmann::json steps = nlohmann::json::array();
  for (const StepMeta& step : layout.steps) {
    steps.push_back({{"group", step.group},
                     {"kind", step_kind_name(step.kind)},
                     {"requests", step.batch_size()},
                     {"rows", step.num_rows()}});
  }
  return {{"format_version", layout.format_version},
          {"model", attrs.model},
          {"producer", attrs.producer},
          {"num_heads", attrs.num_heads},
          {"kv_lora_rank", attrs.kv_lora_rank},
          {"qk_rope_head_dim", attrs.qk_rope_head_dim},
          {"sm_scale", attrs.sm_scale},
          {"page_size", attrs.page_size},
          {"kv_dtype", kv_dtype_name(attrs.kv_dtype)},
          {"kv_scale_kind", attrs.kv_scale_kind},
          {"num_pages", layout.num_pages},
          {"layers", layers},
          {"steps", steps}};
}

namespace {

std::vector<std::int64_t> slots_held_by_any_step(const DumpLayout& layout) {
  std::vector<std::int64_t> slots;
  for (const StepMeta& step : layout.steps) {
    const std::vector<std::int64_t> held = held_slots(step, layout.attrs.page_size);
    slots.insert(slots.end(), held.begin(), held.end());
  }
  std::sort(slots.begin(), slots.end());
  slots.erase(std::unique(slots.begin(), slots.end()), slots.end());
  return slots;
}

// The indexer cache checks (kvdump v1.2, src/replay/indexer_check.hpp) of each replayed layer,
// after that layer's own findings (layer_ends[order]: where they end), so that a run's integrity
// findings are in layer order as a merge of shards puts them. Run after the replay, when no other
// thread reads the dump.
Status add_indexer_findings(const DumpReader& reader, const ReplayOptions& options,
                            const std::vector<std::size_t>& layers,
                            const std::vector<std::size_t>& layer_ends, CheckRun& run) {
  const auto start = Clock::now();
  const std::set<int> steps(options.step_indices.begin(), options.step_indices.end());
  for (std::size_t order = layers.size(); order-- > 0;) {
    KVAUDIT_ASSIGN_OR_RETURN(std::vector<IntegrityFinding> findings,
                             check_indexer_layer(reader, layers[order], steps, options.threads));
    run.integrity.insert(run.integrity.begin() + static_cast<std::ptrdiff_t>(layer_ends[order]),
                         std::make_move_iterator(findings.begin()),
                         std::make_move_iterator(findings.end()));
  }
  run.judge_seconds += seconds_since(start);
  return ok_status();
}

// One layer's replay, on the thread that calls it, into its own outcome; the layer's pools and
// outputs are freed when it returns. Stops at the layer's first error (kept in the outcome), or
// before a step once context.stopping says an earlier layer's error ends the run.
std::unique_ptr<LayerOutcome> replay_layer(ReplayContext& context, std::size_t layer_index,
                                           std::size_t order, LayerData data) {
  auto outcome = std::make_unique<LayerOutcome>(context.options.policy, context.options.diagnose);
  const auto start = Clock::now();
  outcome->status = [&]() -> Status {
    LayerReplay layer(context, *outcome, layer_index, order);
    KVAUDIT_TRY(layer.load_state(std::move(data)));
    const std::size_t num_steps = context.reader.layout().steps.size();
    for (std::size_t step = 0; step < num_steps; ++step) {
      if (context.stopping) {
        return internal_error(context.reader.layout().layers[layer_index].group,
                              "stopped: an earlier layer failed");
      }
      KVAUDIT_TRY(layer.replay_step(step));
    }
    layer.note_unmeasured_steps();
    outcome->held_bytes = layer.held_bytes();
    return ok_status();
  }();
  outcome->seconds = seconds_since(start);
  return outcome;
}

// The run the layers merge into, in layer order, on the calling thread.
struct RunMerge {
  CheckRun& run;
  Progress& progress;
  ReplayContext& context;
  const std::vector<std::size_t>& layers;
  DivergenceTracker divergence = {};
  double read_wait_seconds = 0.0;
  std::vector<std::size_t> layer_ends = {};  // run.integrity's size after each layer
};

// Layer `order`'s outcome into the run, as the sequential replay would have recorded it: its
// comparisons (the first divergence followed over them), findings, notes, coverage, diagnoses
// and stage times; then its progress line. Its error ends the run.
Status merge_layer(RunMerge& merge, std::size_t order, LayerOutcome& layer) {
  KVAUDIT_TRY(layer.status);
  CheckRun& run = merge.run;
  for (ComparisonResult& result : layer.run.comparisons) {
    merge.divergence.consider(order, result);
    run.comparisons.push_back(std::move(result));
  }
  if (merge.divergence.first()) run.first_divergence = merge.divergence.first();
  auto append = [](auto& into, auto& from) {
    into.insert(into.end(), std::make_move_iterator(from.begin()),
                std::make_move_iterator(from.end()));
  };
  append(run.integrity, layer.run.integrity);
  append(run.notes, layer.run.notes);
  append(run.coverage, layer.run.coverage);
  run.read_seconds += layer.run.read_seconds;
  run.reference_seconds += layer.run.reference_seconds;
  run.reference_rows_heads_tokens += layer.run.reference_rows_heads_tokens;
  run.backend_seconds += layer.run.backend_seconds;
  run.judge_seconds += layer.run.judge_seconds;
  run.diagnosis_seconds += layer.run.diagnosis_seconds;
  {
    const std::lock_guard<std::mutex> lock(merge.context.diagnosis_mutex);
    merge.context.diagnosis.absorb(std::move(layer.diagnosis));
  }
  merge.layer_ends.push_back(run.integrity.size());
  const DumpLayout& layout = merge.context.reader.layout();
  merge.progress.layer_done(
      {order, merge.layers.size(), layout.layers[merge.layers[order]].layer_id, layout.steps.size(),
       layer.seconds,
       StageSeconds{run.read_seconds, merge.read_wait_seconds, run.reference_seconds,
                    run.backend_seconds, run.judge_seconds},
       layer.held_bytes});
  merge.progress.follow(order + 1);
  return ok_status();
}

// The layers in flight, on their own threads, oldest first. Going out of scope (an error, or an
// exception of a layer's thread) it tells the layers still running to stop and waits for them.
class LayersRunning {
 public:
  explicit LayersRunning(ReplayContext& context) : context_(context) {}
  ~LayersRunning() {
    context_.stopping = true;
    for (auto& layer : running_) {
      if (layer.valid()) layer.wait();
    }
  }
  LayersRunning(const LayersRunning&) = delete;
  LayersRunning& operator=(const LayersRunning&) = delete;

  std::size_t size() const { return running_.size(); }
  void start(std::size_t layer_index, std::size_t order, LayerData data) {
    running_.push_back(std::async(
        std::launch::async, [this, layer_index, order, data = std::move(data)]() mutable {
          return replay_layer(context_, layer_index, order, std::move(data));
        }));
  }
  // The oldest layer's outcome, once it is done (an exception of its thread comes out here).
  std::unique_ptr<LayerOutcome> finish_oldest() {
    std::unique_ptr<LayerOutcome> outcome = running_.front().get();
    running_.pop_front();
    return outcome;
  }

 private:
  ReplayContext& context_;
  std::deque<std::future<std::unique_ptr<LayerOutcome>>> running_;
};

// The GPU's split of the run's reference and backend time, where either ran on one.
void record_device_seconds(const DeviceSeconds& reference, const Backend* backend, CheckRun& run) {
  if (reference.calls > 0) run.reference_device_seconds = reference;
  if (backend == nullptr) return;
  const std::optional<DeviceSeconds> backend_seconds = backend->device_seconds();
  if (backend_seconds && backend_seconds->calls > 0) run.backend_device_seconds = backend_seconds;
}

}  // namespace

LayersInFlight layers_in_flight(const DumpLayout& layout, const ReplayOptions& options,
                                const Backend* backend) {
  if (options.layers_in_flight <= 1) return {};
  if (!reads_ahead(layout, options)) {
    std::string why =
        "the dump holds captured pools (kv_cache_after), read from the dump step by "
        "step while a layer runs, and HDF5 allows one thread at a time";
    if (options.observer) {
      why =
          "an observer (--save-outputs, golden outputs) sees each (step, layer) in order and "
          "may write HDF5 while the layer runs";
    } else if (!options.read_ahead) {
      why = "the layers are read in place (no read-ahead)";
    }
    return {1, "1 layer in flight, not " + std::to_string(options.layers_in_flight) + ": " + why};
  }
  if (backend != nullptr && backend->concurrency() == BackendConcurrency::kOneLayerAtATime) {
    return {1, fmt::format("1 layer in flight, not {}: backend {} holds one layer at a time",
                           options.layers_in_flight, backend->name())};
  }
  const std::size_t selected = std::max<std::size_t>(1, selected_layers(layout, options).size());
  return {static_cast<int>(std::min<std::size_t>(options.layers_in_flight, selected)), ""};
}

Result<CheckRun> replay_dump(const DumpReader& reader, Backend* backend,
                             const ReplayOptions& options) {
  const auto total_start = Clock::now();
  const DeviceSeconds gpu_reference_before = gpu_reference_seconds();
  KVAUDIT_TRY(check_selection(reader.layout(), options));
  CheckRun run = begin_run(reader, backend, options);
  const LayersInFlight in_flight = layers_in_flight(reader.layout(), options, backend);
  run.layers_in_flight = in_flight.count;
  run.layers_in_flight_note = in_flight.reason;
  Progress progress(options.progress, in_flight.count);
  DiagnosisBudget diagnosis(options.diagnose);
  const std::vector<std::size_t> layers = selected_layers(reader.layout(), options);
  const CertificationPlan certification = certification_plan(reader.layout(), options, layers);
  ReplayContext context{
      reader,        options,
      backend,       progress,
      diagnosis,     certification,
      layers.size(), std::set<int>(options.step_indices.begin(), options.step_indices.end())};
  CertificationQueue certification_queue(std::max(1u, std::thread::hardware_concurrency() / 4));
  context.certification_queue = &certification_queue;
  ArrayRecycler arrays;
  context.arrays = &arrays;
  context.held_slots = slots_held_by_any_step(reader.layout());
  RunMerge merge{run, progress, context, layers};
  // Read ahead on one reader thread, unless an observer writes HDF5 during the replay or the dump
  // holds captured pools (reads_ahead).
  auto layer_reader =
      std::make_unique<LayerReader>(reader, layers, reads_ahead(reader.layout(), options));
  {
    // One layer in flight: each layer on this thread, merged when done (an observer is called
    // from here). More: each on its own thread, merged in layer order while later ones run.
    LayersRunning running(context);
    std::size_t merged = 0;
    for (std::size_t order = 0; order < layers.size(); ++order) {
      if (running.size() >= static_cast<std::size_t>(in_flight.count)) {
        KVAUDIT_TRY(merge_layer(merge, merged++, *running.finish_oldest()));
      }
      LayerData data = layer_reader->next(merge.read_wait_seconds);
      // The reader stops after a failed read: this layer's replay meets the error, and no layer
      // after it is taken (the run ends there, or at an earlier layer's error).
      const bool read_failed = data.failed();
      if (in_flight.count == 1) {
        KVAUDIT_TRY(merge_layer(merge, merged++,
                                *replay_layer(context, layers[order], order, std::move(data))));
      } else {
        running.start(layers[order], order, std::move(data));
      }
      if (read_failed) break;
    }
    while (running.size() > 0) KVAUDIT_TRY(merge_layer(merge, merged++, *running.finish_oldest()));
  }
  layer_reader.reset();  // its thread joined: this thread may read the dump again
  KVAUDIT_TRY(add_indexer_findings(reader, options, layers, merge.layer_ends, run));
  KVAUDIT_TRY(certification_queue.finish(run));
  if (backend != nullptr) run.backend_protocol = backend->protocol_statistics();
  record_device_seconds(gpu_reference_seconds() - gpu_reference_before, backend, run);
  run.diagnosis = diagnosis.findings();
  run.diagnose_limit = diagnosis.limit();
  run.diagnosis_failing_sites = diagnosis.failing_sites();
  if (const std::optional<std::string> note = diagnosis_budget_note(
          diagnosis.diagnosed_sites(), diagnosis.failing_sites(), diagnosis.limit())) {
    run.notes.push_back(*note);
  }
  run.total_seconds = seconds_since(total_start);
  return run;
}

}  // namespace kvaudit
