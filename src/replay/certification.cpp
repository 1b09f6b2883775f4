// Per-run certification of the exact reference (see certification.hpp). Phases per site: the
// one-row, one-head problem (prepare: the row's visible KV rows copied and renumbered 0..n-1, its
// q, the run's out and lse there), R8 of it in 50 digits, the deviation from the run's reference.
#include "src/replay/certification.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "references/mla_reference.hpp"

namespace kvaudit {
namespace {

// splitmix64: a fixed, well-mixed hash of (step, layer id) (Steele, Lea, Flood 2014).
std::uint64_t site_hash(int step, int layer_id) {
  std::uint64_t z = (static_cast<std::uint64_t>(static_cast<std::uint32_t>(step)) << 32) |
                    static_cast<std::uint32_t>(layer_id);
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// max_j |a_j - b_j| / max_j |b_j|: 0 where both are equal (NaNs included), infinity where one is
// NaN and the other not, or where b is all zero and a is not.
double relative_deviation(std::span<const double> a, std::span<const double> b) {
  double scale = 0.0;
  double largest = 0.0;
  for (std::size_t j = 0; j < a.size(); ++j) {
    if (std::isnan(a[j]) != std::isnan(b[j])) return std::numeric_limits<double>::infinity();
    if (std::isnan(a[j])) continue;
    scale = std::max(scale, std::abs(b[j]));
    largest = std::max(largest, std::abs(a[j] - b[j]));
  }
  if (largest == 0.0) return 0.0;
  return scale > 0.0 ? largest / scale : std::numeric_limits<double>::infinity();
}

double absolute_deviation(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) {
    return std::isnan(a) == std::isnan(b) ? 0.0 : std::numeric_limits<double>::infinity();
  }
  if (a == b) return 0.0;  // equal infinities included
  return std::abs(a - b);
}

}  // namespace

CertificationPlan plan_certification(const DumpLayout& layout, const std::vector<int>& layer_ids,
                                     const std::vector<int>& steps, int samples) {
  std::vector<std::pair<std::uint64_t, std::pair<int, int>>> candidates;
  for (const int step : steps) {
    if (layout.steps[static_cast<std::size_t>(step)].num_rows() == 0) continue;
    for (const int layer_id : layer_ids) {
      candidates.push_back({site_hash(step, layer_id), {step, layer_id}});
    }
  }
  const std::size_t kept = std::min<std::size_t>(candidates.size(), std::max(samples, 0));
  std::partial_sort(candidates.begin(), candidates.begin() + static_cast<std::ptrdiff_t>(kept),
                    candidates.end());
  CertificationPlan plan;
  for (std::size_t i = 0; i < kept; ++i) {
    const auto& [hash, site] = candidates[i];
    const StepMeta& step = layout.steps[static_cast<std::size_t>(site.first)];
    plan[site] = CertificationSite{static_cast<int>((hash >> 32) % step.num_rows()),
                                   static_cast<int>((hash & 0xFFFFFFFFu) % layout.attrs.num_heads)};
  }
  return plan;
}

namespace {

// Row `row` of `step` alone, over the slots it sees (filled in `slots`, in position order)
// renumbered 0..n-1 with page size 1, so that a job holds only the rows it reads.
StepMeta compact_single_row_step(const StepMeta& step, int row, int page_size,
                                 std::vector<std::int64_t>& slots) {
  const int request = step.request_of_row(row);
  const auto visible = static_cast<std::int32_t>(step.position_of_row(row, page_size) + 1);
  slots.resize(static_cast<std::size_t>(visible));
  for (std::int32_t p = 0; p < visible; ++p) slots[p] = step.slot_of(request, p, page_size);
  StepMeta compact;
  compact.group = step.group;
  compact.kind = step.kind;
  compact.qo_indptr = {0, 1};
  compact.kv_indptr = {0, visible};
  compact.kv_indices.resize(static_cast<std::size_t>(visible));
  std::iota(compact.kv_indices.begin(), compact.kv_indices.end(), 0);
  compact.kv_last_page_len = {1};
  compact.new_kv_slots = {visible - 1};
  return compact;
}

}  // namespace

CertificationJob prepare_certification(const DumpAttributes& attrs, const StepMeta& step,
                                       const StepLayerTensors& tensors, const KvPool& pool,
                                       float kv_scale, std::span<const double> out,
                                       std::span<const double> lse, int step_index, int layer_id,
                                       const CertificationSite& site) {
  const int dc = attrs.kv_lora_rank;
  const int dr = attrs.qk_rope_head_dim;
  const std::size_t pair = static_cast<std::size_t>(site.row) * attrs.num_heads + site.head;
  CertificationJob job;
  job.attrs = attrs;
  job.attrs.num_heads = 1;
  job.attrs.page_size = 1;
  std::vector<std::int64_t> slots;
  job.step = compact_single_row_step(step, site.row, attrs.page_size, slots);
  const KvRows rows = KvRows::from_pool_slots(pool, kv_scale, slots);
  const int width = attrs.row_width();
  job.kv_values.resize(slots.size() * static_cast<std::size_t>(width));
  if (rows.has_residual()) job.kv_values_lo.resize(job.kv_values.size());
  for (std::size_t i = 0; i < slots.size(); ++i) {
    std::copy_n(rows.row(slots[i]), width, job.kv_values.begin() + i * width);
    if (rows.has_residual()) {
      std::copy_n(rows.row_lo(slots[i]), width, job.kv_values_lo.begin() + i * width);
    }
  }
  job.kv_scale = rows.scale();  // 1 for a per_token_group pool
  const auto q_nope = tensors.q_nope.begin() + pair * dc;
  const auto q_pe = tensors.q_pe.begin() + pair * dr;
  job.q_nope.assign(q_nope, q_nope + dc);
  job.q_pe.assign(q_pe, q_pe + dr);
  job.out.assign(out.begin() + pair * dc, out.begin() + (pair + 1) * dc);
  job.lse = lse[pair];
  job.sample = CertificationSample{step_index, layer_id, site.row, site.head};
  return job;
}

Result<CertificationSample> run_certification(const CertificationJob& job) {
  const KvRows rows =
      KvRows::from_values(job.kv_values, job.attrs.row_width(), job.kv_scale, job.kv_values_lo);
  std::vector<double> out50(job.out.size());
  std::vector<double> lse50(1);
  KVAUDIT_TRY(mla_reference_attention<Float50>(job.attrs, job.step, job.q_nope, job.q_pe, rows,
                                               out50, lse50, 1));
  CertificationSample sample = job.sample;
  sample.out_relative = relative_deviation(job.out, out50);
  sample.lse_absolute = absolute_deviation(job.lse, lse50[0]);
  if (!(sample.out_relative <= kReferenceBound) || !(sample.lse_absolute <= kReferenceBound)) {
    return internal_error(
        fmt::format("reference certification, step {} layer {} row {} head {}", sample.step,
                    sample.layer_id, sample.row, sample.head),
        fmt::format("the exact reference deviates from its 50-digit recomputation by {:.3g} "
                    "(out, relative) and {:.3g} (lse, absolute), above the bound {:.0e}",
                    sample.out_relative, sample.lse_absolute, kReferenceBound));
  }
  return sample;
}

Result<CertificationSample> certify_site(const DumpAttributes& attrs, const StepMeta& step,
                                         const StepLayerTensors& tensors, const KvPool& pool,
                                         float kv_scale, std::span<const double> out,
                                         std::span<const double> lse, int step_index, int layer_id,
                                         const CertificationSite& site) {
  return run_certification(prepare_certification(attrs, step, tensors, pool, kv_scale, out, lse,
                                                 step_index, layer_id, site));
}

}  // namespace kvaudit
