// Tiny kvdumps for the replay and `kvaudit check` tests, built in memory (so a test can plant
// captured outputs and pools) and written with DumpWriter.
//
// Trace: request b has prefix[b] tokens before step 0; S000 (prefill) appends prefill[b] tokens
// to each; then decode_steps decode steps append one token to every request. Request b's pages are
// contiguous (first_page[b] ..), followed by two spare pages, so slot = first_page[b] * page_size
// + position. Values are bf16, uniform in (-amplitude, amplitude) from a fixed LCG; the outlier
// channel (if any) is scaled by outlier_gain.
// Shapes: pools [S, D], q_nope [Nq, H, Dc], q_pe [Nq, H, Dr], new_kv [Nq, D], D = Dc + Dr.
#pragma once

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "kvaudit_test_config.hpp"  // KVAUDIT_BINARY, KVAUDIT_SOURCE_DIR, KVAUDIT_TEST_TMPDIR
#include "src/core/fp8_e4m3.hpp"
#include "src/format/kvdump.hpp"

namespace kvaudit::testing {

struct TinySpec {
  int heads = 2;
  int dc = 32;
  int dr = 8;
  int page_size = 1;
  std::vector<int> layer_ids = {0};
  float kv_scale = 0.0029f;  // not a power of two; amplitude 1 / 448 = 0.00223 rounds below it
  std::vector<int> prefix = {6, 0};
  std::vector<int> prefill = {3, 4};
  int decode_steps = 2;
  bool with_source = true;
  float amplitude = 1.0f;
  int outlier_channel = -1;
  float outlier_gain = 1.0f;
  double sm_scale = 0.35;
  std::uint32_t seed = 12345;
  // Scores chosen instead of drawn: q_nope = 0 and q_pe = (1, 0, ...) for every row and head, so
  // s_t = sm_scale * kpe_t[0]; kpe_t[0] = 0 for position 0 and crafted_kpe otherwise, ckv values
  // 1 + amplitude/4 * u. Lets a test put every softmax weight where it wants it.
  bool crafted_scores = false;
  float crafted_kpe = -0.63488f;
  // The optional YaRN rope attributes (docs/kvdump-v1.md "Optional model attributes").
  std::optional<double> rope_factor;
  std::optional<double> rope_mscale_all_dim;
};

struct TinyDump {
  DumpAttributes attrs;
  std::int64_t num_pages = 0;
  std::vector<LayerMeta> layers;
  std::vector<KvPool> pools;                // per layer, before step 0
  std::vector<std::vector<float>> sources;  // per layer, [S, D]
  std::vector<StepMeta> steps;
  std::vector<std::vector<StepLayerTensors>> tensors;  // [step][layer]

  std::int64_t num_slots() const { return num_pages * attrs.page_size; }
  int width() const { return attrs.row_width(); }

  // The pool of layer `l` after step `s`'s writes (kvdump write rule, KvPool::write_row; or the
  // named reciprocal convention).
  KvPool pool_after(std::size_t s, std::size_t l, bool reciprocal_scale = false) const {
    KvPool pool = pools[l];
    for (std::size_t k = 0; k <= s; ++k) {
      for (int i = 0; i < steps[k].num_rows(); ++i) {
        pool.write_row(steps[k].new_kv_slots[i], tensors[k][l].new_kv.data() + i * width(),
                       layers[l].kv_scale, reciprocal_scale);
      }
    }
    return pool;
  }

  bool write(const std::filesystem::path& path, std::string* error) const {
    auto writer = DumpWriter::create(path, attrs, num_pages);
    if (!writer.ok()) return *error = writer.error().message(), false;
    for (std::size_t l = 0; l < layers.size(); ++l) {
      auto status =
          writer->write_layer(layers[l], pools[l], layers[l].has_source ? &sources[l] : nullptr);
      if (!status.ok()) return *error = status.error().message(), false;
    }
    for (std::size_t s = 0; s < steps.size(); ++s) {
      auto status = writer->write_step(steps[s]);
      if (!status.ok()) return *error = status.error().message(), false;
      for (std::size_t l = 0; l < layers.size(); ++l) {
        auto written = writer->write_step_layer(steps[s], layers[l], tensors[s][l]);
        if (!written.ok()) return *error = written.error().message(), false;
      }
    }
    auto closed = writer->close();
    if (!closed.ok()) return *error = closed.error().message(), false;
    return true;
  }
};

class Lcg {
 public:
  explicit Lcg(std::uint32_t seed) : state_(seed * 2654435761u + 1) {}
  // Uniform in (-1, 1), 24 random bits.
  float symmetric() {
    state_ = state_ * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<float>(static_cast<std::int64_t>(state_ >> 40) - (1 << 23)) /
           static_cast<float>(1 << 23);
  }

 private:
  std::uint64_t state_;
};

inline TinyDump make_tiny_dump(const TinySpec& spec) {
  TinyDump dump;
  dump.attrs.model = "tiny";
  dump.attrs.producer = "kvaudit tests (check_dumps.hpp)";
  dump.attrs.num_heads = spec.heads;
  dump.attrs.kv_lora_rank = spec.dc;
  dump.attrs.qk_rope_head_dim = spec.dr;
  dump.attrs.sm_scale = spec.sm_scale;
  dump.attrs.page_size = spec.page_size;
  dump.attrs.rope_factor = spec.rope_factor;
  dump.attrs.rope_mscale_all_dim = spec.rope_mscale_all_dim;
  const int width = spec.dc + spec.dr;
  const int requests = static_cast<int>(spec.prefix.size());
  const int page = spec.page_size;

  std::vector<int> first_page(requests);
  std::int64_t pages = 0;
  for (int b = 0; b < requests; ++b) {
    first_page[b] = static_cast<int>(pages);
    const int final_len = spec.prefix[b] + spec.prefill[b] + spec.decode_steps;
    pages += (final_len + page - 1) / page;
  }
  dump.num_pages = pages + 2;
  const std::int64_t slots = dump.num_slots();
  auto slot_of = [&](int b, int pos) { return std::int64_t{first_page[b]} * page + pos; };

  Lcg rng(spec.seed);
  auto token_row = [&](std::vector<float>& row, int position) {
    row.resize(width);
    for (int c = 0; c < width; ++c) {
      float v = spec.amplitude * rng.symmetric();
      if (c == spec.outlier_channel) v *= spec.outlier_gain;
      if (spec.crafted_scores && c < spec.dc) v = 1.0f + 0.25f * v;
      if (spec.crafted_scores && c == spec.dc) v = position == 0 ? 0.0f : spec.crafted_kpe;
      row[c] = bf16_round(v);
    }
  };

  // Steps' indices.
  std::vector<int> len(spec.prefix);
  auto make_step = [&](StepKind kind, const std::vector<int>& added) {
    StepMeta step;
    step.kind = kind;
    step.group = step_group_name(static_cast<int>(dump.steps.size()));
    step.qo_indptr = {0};
    step.kv_indptr = {0};
    for (int b = 0; b < requests; ++b) {
      const int old_len = len[b];
      len[b] += added[b];
      for (int j = 0; j < added[b]; ++j)
        step.new_kv_slots.push_back(static_cast<int>(slot_of(b, old_len + j)));
      step.qo_indptr.push_back(step.qo_indptr.back() + added[b]);
      const int used_pages = (len[b] + page - 1) / page;
      for (int p = 0; p < used_pages; ++p) step.kv_indices.push_back(first_page[b] + p);
      step.kv_indptr.push_back(static_cast<int>(step.kv_indices.size()));
      step.kv_last_page_len.push_back(len[b] == 0 ? 0 : len[b] - (used_pages - 1) * page);
    }
    dump.steps.push_back(step);
  };
  make_step(StepKind::kPrefill, spec.prefill);
  for (int d = 0; d < spec.decode_steps; ++d)
    make_step(StepKind::kDecode, std::vector<int>(requests, 1));

  std::vector<float> row;
  for (const int id : spec.layer_ids) {
    LayerMeta layer;
    layer.group = layer_group_name(id);
    layer.layer_id = id;
    layer.kv_scale = spec.kv_scale;
    layer.has_source = spec.with_source;
    KvPool pool = KvPool::zeros(KvDtype::kFloat8E4m3fn, slots, width);
    std::vector<float> source(static_cast<std::size_t>(slots) * width, 0.0f);
    for (int b = 0; b < requests; ++b) {
      for (int p = 0; p < spec.prefix[b]; ++p) {
        token_row(row, p);
        pool.write_row(slot_of(b, p), row.data(), layer.kv_scale);
        std::copy(row.begin(), row.end(), source.begin() + slot_of(b, p) * width);
      }
    }
    dump.layers.push_back(layer);
    dump.pools.push_back(std::move(pool));
    dump.sources.push_back(std::move(source));
  }

  for (const StepMeta& step : dump.steps) {
    std::vector<StepLayerTensors> per_layer;
    const int nq = step.num_rows();
    for (std::size_t l = 0; l < dump.layers.size(); ++l) {
      StepLayerTensors t;
      for (int i = 0; i < nq; ++i) {
        token_row(row, static_cast<int>(step.position_of_row(i, spec.page_size)));
        t.new_kv.insert(t.new_kv.end(), row.begin(), row.end());
      }
      t.q_nope.resize(static_cast<std::size_t>(nq) * spec.heads * spec.dc);
      t.q_pe.resize(static_cast<std::size_t>(nq) * spec.heads * spec.dr);
      for (float& v : t.q_nope) v = spec.crafted_scores ? 0.0f : bf16_round(rng.symmetric());
      for (std::size_t k = 0; k < t.q_pe.size(); ++k) {
        const bool first = k % spec.dr == 0;
        t.q_pe[k] = spec.crafted_scores ? (first ? 1.0f : 0.0f) : bf16_round(rng.symmetric());
      }
      per_layer.push_back(std::move(t));
    }
    dump.tensors.push_back(std::move(per_layer));
  }
  return dump;
}

// A kv_scale (from `from` up) and a bf16 value whose kvdump write (x / s) and reciprocal write
// (x * fp32(1 / s)) store different codes: rare, only where the quotient lands within an ulp of an
// e4m3 rounding midpoint, so found by search. {0, 0} if none is found below 1.5 * from.
struct ReciprocalDisagreement {
  float kv_scale = 0.0f;
  float value = 0.0f;
};
inline ReciprocalDisagreement find_reciprocal_disagreement(float from) {
  for (float s = from; s < 1.5f * from; s = std::nextafter(s, 1.0f)) {
    for (std::uint16_t bits = 1; bits < 0x7F80; ++bits) {
      const float v = bf16_to_float(bits);
      if (kvdump_quantize(v, s) != kvdump_quantize_reciprocal(v, s)) return {s, v};
    }
  }
  return {};
}

inline std::filesystem::path test_tmp_path(const std::string& name) {
  const std::filesystem::path dir = KVAUDIT_TEST_TMPDIR;
  std::filesystem::create_directories(dir);
  return dir / name;
}

}  // namespace kvaudit::testing
