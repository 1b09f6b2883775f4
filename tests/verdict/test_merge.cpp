// merge_parts on hand-built parts (two layers, L000 and L003, two steps; tests/verdict/
// check_run_fixture.hpp): the parts in shard order whatever order they come in, the notes about
// the whole run once, timing summed, the first divergence found again from the merged results
// (here the second part's, at an earlier step than the first part's), and every refusal naming
// its part.
#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "src/verdict/merge.hpp"
#include "tests/verdict/check_run_fixture.hpp"

namespace kvaudit {
namespace {

using testing::make_comparison;

// A failing kernel comparison at (step, layer), located at (row, head) of request 0.
ComparisonResult failing_kernel(int step, int layer, int row, int head) {
  ComparisonResult result = make_comparison(step, layer, Comparison::kKernel, 0.03, false, true);
  result.judgement.reasons = {"rel_l2 0.03 > 0.00391 (kernel limit)"};
  result.divergence = DivergencePoint{0, row, head};
  return result;
}

Divergence divergence_at(const ComparisonResult& result) {
  return Divergence{result.step,
                    result.layer_id,
                    result.divergence->request,
                    result.divergence->row,
                    result.divergence->head,
                    result.comparison,
                    result.judgement.reasons.front()};
}

// Shard `index` of 2 over layers 0 and 3: layer 0 fails its kernel at step 1 (row 2, head 5),
// layer 3 at step 0 (row 4, head 1).
NamedPart part(int index) {
  const int layer = index == 0 ? 0 : 3;
  const int failing_step = index == 0 ? 1 : 0;
  CheckRun run = testing::make_failing_run();
  run.comparisons.clear();
  run.integrity.clear();
  for (int step = 0; step < 2; ++step) {
    run.comparisons.push_back(
        step == failing_step
            ? failing_kernel(step, layer, index == 0 ? 2 : 4, index == 0 ? 5 : 1)
            : make_comparison(step, layer, Comparison::kKernel, 0.002, true, true));
  }
  run.first_divergence = divergence_at(run.comparisons[failing_step]);
  run.notes = {"about the run", "about layer " + std::to_string(layer)};
  run.total_seconds = 1.5 + index;
  run.provenance.host = "node" + std::to_string(index);
  run.provenance.kvaudit_version = kvaudit_version();
  ShardInfo shard;
  shard.spec = {index, 2};
  shard.layers = {layer};
  shard.selected_layers = {0, 3};
  shard.run_notes = 1;
  return NamedPart{"part" + std::to_string(index) + ".json", ShardPart{run, shard}};
}

std::string refusal(std::vector<NamedPart> parts) {
  const Result<CheckRun> merged = merge_parts(std::move(parts));
  REQUIRE_FALSE(merged.ok());
  CHECK(merged.error().kind == ErrorKind::kBadInput);
  return merged.error().message();
}

}  // namespace

TEST_CASE("merge: shard order, notes once, timing summed, first divergence recomputed", "[merge]") {
  const Result<CheckRun> merged = merge_parts({part(1), part(0)});
  REQUIRE(merged.ok());
  REQUIRE(merged->comparisons.size() == 4);
  CHECK(merged->comparisons[0].layer_id == 0);
  CHECK(merged->comparisons[1].layer_id == 0);
  CHECK(merged->comparisons[2].layer_id == 3);
  CHECK(merged->notes ==
        std::vector<std::string>{"about the run", "about layer 0", "about layer 3"});
  CHECK(merged->total_seconds == 4.0);  // 1.5 + 2.5
  // Part 0 diverges first in shard order (layer 0) but at step 1; part 1 at step 0: the run's
  // first divergence is the earliest step's, at the row and head part 1 located.
  REQUIRE(merged->first_divergence);
  CHECK(merged->first_divergence->step == 0);
  CHECK(merged->first_divergence->layer_id == 3);
  CHECK(merged->first_divergence->row == 4);
  CHECK(merged->first_divergence->head == 1);
  REQUIRE(merged->provenance.merged_from.size() == 2);
  CHECK(merged->provenance.merged_from[0].file == "part0.json");
  CHECK(merged->provenance.merged_from[0].shard == "0/2");
  CHECK(merged->provenance.merged_from[1].host == "node1");
  CHECK_FALSE(merged->pass());
}

TEST_CASE("merge: refusals name the part", "[merge]") {
  CHECK_THAT(refusal({}), Catch::Contains("no parts"));
  NamedPart other = part(1);
  other.part.run.dump_sha256[0] = 'c';
  CHECK_THAT(refusal({part(0), other}),
             Catch::StartsWith("part1.json: differs from part0.json in the dump's SHA-256"));
  other = part(1);
  other.part.run.policy = signoff_policy();
  CHECK_THAT(refusal({part(0), other}), Catch::Contains("in the policy"));
  other = part(1);
  other.part.run.backend = "none";
  CHECK_THAT(refusal({part(0), other}), Catch::Contains("in the backend ("));
  other = part(1);
  other.part.shard.reciprocal_scale = true;
  CHECK_THAT(refusal({part(0), other}), Catch::Contains("--reciprocal-scale"));
  other = part(1);
  other.part.run.notes[0] = "another run";
  CHECK_THAT(refusal({part(0), other}), Catch::Contains("notes about the whole run"));
  other = part(1);
  other.part.run.provenance.kvaudit_version = "0.0.1";
  CHECK_THAT(refusal({part(0), other}), Catch::StartsWith("part1.json: written by kvaudit 0.0.1"));

  NamedPart twice = part(0);
  twice.file = "again.json";
  CHECK_THAT(refusal({part(0), twice}),
             Catch::StartsWith("again.json: is shard 0/2 as part0.json is"));
  CHECK_THAT(refusal({part(1)}), Catch::Contains("missing shard 0/2 (given: part1.json (1))"));

  other = part(1);
  other.part.shard.layers = {0};
  CHECK_THAT(refusal({part(0), other}), Catch::StartsWith("part1.json: holds layers [0]"));
  other = part(1);
  other.part.run.comparisons[1].layer_id = 0;
  CHECK_THAT(refusal({part(0), other}), Catch::Contains("result of layer 0"));
  other = part(1);
  other.part.run.comparisons[0].divergence.reset();
  CHECK_THAT(refusal({part(0), other}), Catch::Contains("gives no divergence point"));
  other = part(1);
  other.part.run.first_divergence->head = 0;  // not what its results give
  CHECK_THAT(refusal({part(0), other}), Catch::StartsWith("part1.json: its first_divergence"));
}

}  // namespace kvaudit
