// The per-run certification of the exact reference (src/replay/certification.hpp): the plan is a
// function of the dump's shape (the same sites for the whole check and for its shards), a site
// recomputed in 50 digits agrees with the double-double reference to 1e-15, and a reference that
// is off by more (a planted 1e-12 error in its out, or in its lse) is an internal error.
#include <catch2/catch.hpp>
#include <vector>

#include "references/mla_reference.hpp"
#include "src/replay/certification.hpp"
#include "tests/replay/check_dumps.hpp"

namespace kvaudit {
namespace {

using testing::make_tiny_dump;
using testing::TinyDump;
using testing::TinySpec;

DumpLayout layout_of(const TinyDump& dump) {
  DumpLayout layout;
  layout.attrs = dump.attrs;
  layout.num_pages = dump.num_pages;
  layout.layers = dump.layers;
  layout.steps = dump.steps;
  return layout;
}

// R8 of step `s`, layer 0, by the reference (double-double), as the replay computes it.
struct StepReference {
  KvPool pool;
  std::vector<double> out;
  std::vector<double> lse;
};

StepReference reference_of(const TinyDump& dump, std::size_t s) {
  StepReference r{dump.pool_after(s, 0), {}, {}};
  const StepMeta& step = dump.steps[s];
  const std::size_t pairs = static_cast<std::size_t>(step.num_rows()) * dump.attrs.num_heads;
  r.out.assign(pairs * dump.attrs.kv_lora_rank, 0.0);
  r.lse.assign(pairs, 0.0);
  const std::vector<std::int64_t> visible = visible_slots(step, dump.attrs.page_size);
  const KvRows rows = KvRows::from_pool_slots(r.pool, dump.layers[0].kv_scale, visible);
  const auto work = mla_reference_attention(dump.attrs, step, dump.tensors[s][0].q_nope,
                                            dump.tensors[s][0].q_pe, rows, r.out, r.lse, 1);
  REQUIRE(work.ok());
  return r;
}

}  // namespace

TEST_CASE("certification plan: N sites fixed by the shape, the same for a shard's scope",
          "[certification]") {
  TinySpec spec;
  spec.layer_ids = {0, 3, 7};
  const TinyDump dump = make_tiny_dump(spec);
  const DumpLayout layout = layout_of(dump);
  const std::vector<int> steps = {0, 1, 2};
  const CertificationPlan plan = plan_certification(layout, {0, 3, 7}, steps, 4);
  CHECK(plan.size() == 4);
  CHECK(plan == plan_certification(layout, {0, 3, 7}, steps, 4));  // deterministic
  for (const auto& [site, where] : plan) {
    const StepMeta& step = layout.steps[static_cast<std::size_t>(site.first)];
    CHECK(where.row >= 0);
    CHECK(where.row < step.num_rows());
    CHECK(where.head >= 0);
    CHECK(where.head < layout.attrs.num_heads);
  }
  // More samples than sites: every site once; none asked: none.
  CHECK(plan_certification(layout, {0, 3, 7}, steps, 100).size() == 9);
  CHECK(plan_certification(layout, {0, 3, 7}, steps, 0).empty());
}

TEST_CASE("certification: the reference agrees with 50 digits - a planted error is exit 3",
          "[certification]") {
  const TinyDump dump = make_tiny_dump(TinySpec{});
  const std::size_t s = 1;  // a prefill step: several rows, causal positions
  StepReference r = reference_of(dump, s);
  const StepMeta& step = dump.steps[s];
  const float kv_scale = dump.layers[0].kv_scale;
  for (int row = 0; row < step.num_rows(); ++row) {
    for (int head = 0; head < dump.attrs.num_heads; ++head) {
      INFO("row " << row << " head " << head);
      const auto sample = certify_site(dump.attrs, step, dump.tensors[s][0], r.pool, kv_scale,
                                       r.out, r.lse, 1, 0, CertificationSite{row, head});
      REQUIRE(sample.ok());
      CHECK(sample->out_relative <= kReferenceBound);
      CHECK(sample->lse_absolute <= kReferenceBound);
      CHECK(sample->row == row);
      CHECK(sample->head == head);
    }
  }
  // A reference off by 1e-12 in one out element, then in one lse, is caught.
  const int row = step.num_rows() - 1;
  const std::size_t pair = static_cast<std::size_t>(row) * dump.attrs.num_heads + 1;
  std::vector<double> bad_out = r.out;
  bad_out[pair * dump.attrs.kv_lora_rank + 3] *= 1.0 + 1e-12;
  const auto out_error = certify_site(dump.attrs, step, dump.tensors[s][0], r.pool, kv_scale,
                                      bad_out, r.lse, 1, 0, CertificationSite{row, 1});
  REQUIRE_FALSE(out_error.ok());
  CHECK(out_error.error().kind == ErrorKind::kInternal);
  CHECK_THAT(out_error.error().message(), Catch::Contains("50-digit recomputation"));
  std::vector<double> bad_lse = r.lse;
  bad_lse[pair] += 1e-13;
  const auto lse_error = certify_site(dump.attrs, step, dump.tensors[s][0], r.pool, kv_scale, r.out,
                                      bad_lse, 1, 0, CertificationSite{row, 1});
  REQUIRE_FALSE(lse_error.ok());
  CHECK(lse_error.error().kind == ErrorKind::kInternal);
}

}  // namespace kvaudit
