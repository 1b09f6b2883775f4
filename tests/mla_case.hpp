// Synthetic MLA steps built in memory: the one test-case vocabulary of the reference, format,
// cpu-fp8 and CUDA kernel tests (small widths on the CPU, the model's 512 + 64 on the GPU).
//
// A case is a value: its spec, a name built from it (used in test output), and the step's data in
// the shapes a dump holds (attrs, step, layer, tensors):
//   pool       : [num_pages * page_size, Dc + Dr]  the pool *before* the step's writes
//   pool_after : the pool after the step's writes by the host write rule (KvPool::write_row)
//   q_nope : [Nq, H, Dc], q_pe : [Nq, H, Dr], new_kv : [Nq, Dc + Dr]   (bf16 values as float)
// Pages of the requests are a random permutation of the pool's pages (scattered); the step's own
// rows are written at new_kv_slots by the kvdump write rule. Slots no request uses (spare pages,
// the tail of each request's last page, and, before the write, the new rows' slots) hold NaN codes
// of both signs when nan_unused is set, so that a kernel reading anything it should not gives NaN.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "src/core/fp8_e4m3.hpp"
#include "src/format/kvdump.hpp"

namespace kvaudit::testing {

struct RequestShape {
  int kv_len = 1;  // tokens after the step's writes (0: no page)
  int rows = 1;    // query rows this step (the last `rows` positions)
};

struct MlaCaseSpec {
  StepKind kind = StepKind::kPrefill;
  int heads = 2;
  int dc = 16;
  int dr = 8;
  int page_size = 1;
  double sm_scale = 0.125;
  float kv_scale = 1.0f;
  KvDtype kv_dtype = KvDtype::kFloat8E4m3fn;
  std::vector<RequestShape> requests = {{9, 3}, {5, 1}};
  int spare_pages = 3;
  float kv_range = 4.0f;  // |KV values| up to this (before quantization), uniform
  float kv_sigma = 0.0f;  // > 0: KV values ~ N(0, kv_sigma) instead (before quantization)
  float q_range = 1.0f;   // |q| up to this
  std::uint32_t seed = 1;
  bool nan_unused = true;
  bool zero_kv = false;          // every KV value (cached and new_kv) is zero
  float new_kv_magnitude = 0.f;  // > 0: new_kv element i is +-magnitude * (1 + i % 7) (saturation)

  std::string name() const {
    std::ostringstream s;
    s << step_kind_name(kind) << "(H=" << heads << ",Dc=" << dc << ",Dr=" << dr
      << ",page=" << page_size << ",scale=" << kv_scale << ",sm=" << sm_scale
      << ",kv=" << kv_dtype_name(kv_dtype) << ",req=[";
    for (std::size_t b = 0; b < requests.size(); ++b) {
      s << (b ? "," : "") << requests[b].kv_len << "x" << requests[b].rows;
    }
    s << "]";
    if (spare_pages != 3) s << ",spare=" << spare_pages;
    if (kv_sigma > 0) s << ",sigma=" << kv_sigma;
    if (zero_kv) s << ",zero";
    if (new_kv_magnitude > 0) s << ",new_kv=" << new_kv_magnitude;
    if (!nan_unused) s << ",no-nan";
    s << ",seed=" << seed << ")";
    return s.str();
  }
};

struct MlaCase {
  MlaCaseSpec spec;
  DumpAttributes attrs;
  StepMeta step;
  LayerMeta layer;
  StepLayerTensors tensors;
  KvPool pool;        // before the step's writes
  KvPool pool_after;  // after them (written_pool() when built)

  std::string name() const { return spec.name(); }
  // The pool after the step's writes, by KvPool::write_row (the kvdump write rule), from `pool`
  // and new_kv as they are now (a test that edits them sets pool_after = written_pool()).
  KvPool written_pool() const {
    KvPool p = pool;
    const int width = attrs.row_width();
    for (int i = 0; i < step.num_rows(); ++i) {
      p.write_row(step.new_kv_slots[i], tensors.new_kv.data() + static_cast<std::size_t>(i) * width,
                  layer.kv_scale);
    }
    return p;
  }
};

inline float random_bf16(std::mt19937& rng, float range) {
  std::uniform_real_distribution<float> dist(-range, range);
  return bf16_round(dist(rng));
}

inline float random_normal_bf16(std::mt19937& rng, float sigma) {
  std::normal_distribution<float> dist(0.f, 1.f);
  return bf16_round(dist(rng) * sigma);
}

// A KV value before quantization, as the spec draws them.
inline float random_kv_value(std::mt19937& rng, const MlaCaseSpec& spec) {
  if (spec.zero_kv) return 0.f;
  return spec.kv_sigma > 0 ? random_normal_bf16(rng, spec.kv_sigma)
                           : random_bf16(rng, spec.kv_range);
}

inline MlaCase make_mla_case(const MlaCaseSpec& spec) {
  MlaCase c;
  c.spec = spec;
  std::mt19937 rng(spec.seed);
  c.attrs.model = "synthetic";
  c.attrs.producer = "tests";
  c.attrs.num_heads = spec.heads;
  c.attrs.kv_lora_rank = spec.dc;
  c.attrs.qk_rope_head_dim = spec.dr;
  c.attrs.sm_scale = spec.sm_scale;
  c.attrs.page_size = spec.page_size;
  c.attrs.kv_dtype = spec.kv_dtype;
  c.layer.group = "L000";
  c.layer.kv_scale = spec.kv_dtype == KvDtype::kBfloat16 ? 1.0f : spec.kv_scale;

  const int ps = spec.page_size;
  const int width = spec.dc + spec.dr;
  int used_pages = 0;
  for (const auto& r : spec.requests) used_pages += (r.kv_len + ps - 1) / ps;
  const int num_pages = used_pages + spec.spare_pages;
  std::vector<int> page_ids(num_pages);
  std::iota(page_ids.begin(), page_ids.end(), 0);
  std::shuffle(page_ids.begin(), page_ids.end(), rng);

  StepMeta& step = c.step;
  step.group = "S000";
  step.kind = spec.kind;
  step.qo_indptr = {0};
  step.kv_indptr = {0};
  int next_page = 0;
  for (const auto& r : spec.requests) {
    const int pages = (r.kv_len + ps - 1) / ps;
    for (int p = 0; p < pages; ++p) step.kv_indices.push_back(page_ids[next_page++]);
    step.kv_indptr.push_back(static_cast<std::int32_t>(step.kv_indices.size()));
    step.qo_indptr.push_back(step.qo_indptr.back() + r.rows);
    step.kv_last_page_len.push_back(pages == 0 ? 0 : r.kv_len - (pages - 1) * ps);
  }
  const int nq = step.num_rows();
  for (int i = 0; i < nq; ++i) {
    const int b = step.request_of_row(i);
    step.new_kv_slots.push_back(
        static_cast<std::int32_t>(step.slot_of(b, step.position_of_row(i, ps), ps)));
  }
  step.has_out = {false};
  step.has_lse = {false};
  step.has_kv_cache_after = {false};

  // Pool: NaN (or zero) everywhere, then random values in the requests' earlier tokens.
  c.pool = KvPool::zeros(spec.kv_dtype, static_cast<std::int64_t>(num_pages) * ps, width);
  if (spec.nan_unused) {
    for (std::int64_t s = 0; s < c.pool.num_slots; ++s) {
      for (int j = 0; j < width; ++j) {
        if (spec.kv_dtype == KvDtype::kBfloat16) {
          c.pool.set_bf16_bits(s, j, (j & 1) ? 0xFFC0 : 0x7FC0);
        } else {
          c.pool.row(s)[j] = (j & 1) ? 0xFF : kE4m3NanCode;
        }
      }
    }
  }
  std::vector<float> values(width);
  for (int b = 0; b < static_cast<int>(spec.requests.size()); ++b) {
    const auto& r = spec.requests[b];
    for (int p = 0; p < r.kv_len - r.rows; ++p) {
      for (auto& v : values) v = random_kv_value(rng, spec);
      c.pool.write_row(step.slot_of(b, p, ps), values.data(), c.layer.kv_scale);
    }
  }

  c.tensors.q_nope.resize(static_cast<std::size_t>(nq) * spec.heads * spec.dc);
  c.tensors.q_pe.resize(static_cast<std::size_t>(nq) * spec.heads * spec.dr);
  c.tensors.new_kv.resize(static_cast<std::size_t>(nq) * width);
  for (auto& v : c.tensors.q_nope) v = random_bf16(rng, spec.q_range);
  for (auto& v : c.tensors.q_pe) v = random_bf16(rng, spec.q_range);
  for (std::size_t i = 0; i < c.tensors.new_kv.size(); ++i) {
    c.tensors.new_kv[i] = random_kv_value(rng, spec);
    if (spec.new_kv_magnitude > 0) {
      c.tensors.new_kv[i] =
          bf16_round((i % 2 ? -1.f : 1.f) * spec.new_kv_magnitude * static_cast<float>(1 + i % 7));
    }
  }
  c.pool_after = c.written_pool();
  return c;
}

}  // namespace kvaudit::testing
