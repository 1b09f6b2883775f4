// Test support: compare two kvdumps by content (layout and every tensor bit for bit, HDF5
// metadata and timestamps ignored), and run `kvaudit synth` in-process through its CLI
// definition.
#pragma once

#include <CLI/CLI.hpp>
#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "kvaudit_test_config.hpp"  // KVAUDIT_BINARY, KVAUDIT_SOURCE_DIR, KVAUDIT_TEST_TMPDIR
#include "src/cli/cli.hpp"
#include "src/format/kvdump.hpp"

namespace kvaudit::testing {

// Parses `args` (without the program name and the subcommand) as `kvaudit synth ARGS` and runs
// it. Returns the exit status, kExitBadInput for a parse error.
inline int run_synth_cli(const std::vector<std::string>& args) {
  CLI::App app{"kvaudit", "kvaudit"};
  app.require_subcommand(1);
  CommandRunner runner;
  register_synth_command(app, runner);
  std::vector<std::string> storage = {"kvaudit", "synth"};
  storage.insert(storage.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& arg : storage) argv.push_back(arg.data());
  try {
    app.parse(static_cast<int>(argv.size()), argv.data());
  } catch (const CLI::ParseError&) {
    return kExitBadInput;
  }
  return runner ? runner() : kExitBadInput;
}

inline bool same_bits(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

inline void require_same_step_meta(const StepMeta& a, const StepMeta& b) {
  INFO("step " << a.group);
  REQUIRE(a.group == b.group);
  REQUIRE(a.kind == b.kind);
  REQUIRE(a.qo_indptr == b.qo_indptr);
  REQUIRE(a.kv_indptr == b.kv_indptr);
  REQUIRE(a.kv_indices == b.kv_indices);
  REQUIRE(a.kv_last_page_len == b.kv_last_page_len);
  REQUIRE(a.new_kv_slots == b.new_kv_slots);
  REQUIRE(a.has_out == b.has_out);
  REQUIRE(a.has_lse == b.has_lse);
  REQUIRE(a.has_kv_cache_after == b.has_kv_cache_after);
}

// REQUIREs that the two dumps hold the same layout and the same bits in every tensor.
inline void require_same_dump(const DumpReader& a, const DumpReader& b) {
  const DumpLayout& la = a.layout();
  const DumpLayout& lb = b.layout();
  REQUIRE(la.format_version == lb.format_version);
  REQUIRE(la.attrs.model == lb.attrs.model);
  REQUIRE(la.attrs.producer == lb.attrs.producer);
  REQUIRE(la.attrs.num_heads == lb.attrs.num_heads);
  REQUIRE(la.attrs.kv_lora_rank == lb.attrs.kv_lora_rank);
  REQUIRE(la.attrs.qk_rope_head_dim == lb.attrs.qk_rope_head_dim);
  REQUIRE(std::memcmp(&la.attrs.sm_scale, &lb.attrs.sm_scale, sizeof(double)) == 0);
  REQUIRE(la.attrs.page_size == lb.attrs.page_size);
  REQUIRE(la.attrs.kv_dtype == lb.attrs.kv_dtype);
  REQUIRE(la.attrs.kv_scale_kind == lb.attrs.kv_scale_kind);
  REQUIRE(la.format_minor_version == lb.format_minor_version);
  REQUIRE(la.attrs.kv_scale_group_size == lb.attrs.kv_scale_group_size);
  REQUIRE(la.attrs.kv_scale_format == lb.attrs.kv_scale_format);
  REQUIRE(la.attrs.kv_rope_dtype == lb.attrs.kv_rope_dtype);
  REQUIRE(la.attrs.kv_cache_layout == lb.attrs.kv_cache_layout);
  REQUIRE(la.num_pages == lb.num_pages);
  REQUIRE(la.layers.size() == lb.layers.size());
  REQUIRE(la.steps.size() == lb.steps.size());
  for (std::size_t l = 0; l < la.layers.size(); ++l) {
    INFO("layer " << la.layers[l].group);
    REQUIRE(la.layers[l].group == lb.layers[l].group);
    REQUIRE(la.layers[l].layer_id == lb.layers[l].layer_id);
    REQUIRE(std::memcmp(&la.layers[l].kv_scale, &lb.layers[l].kv_scale, sizeof(float)) == 0);
    REQUIRE(la.layers[l].has_source == lb.layers[l].has_source);
    auto pool_a = a.read_pool(l);
    auto pool_b = b.read_pool(l);
    REQUIRE(pool_a.ok());
    REQUIRE(pool_b.ok());
    REQUIRE(pool_a->dtype == pool_b->dtype);
    REQUIRE(pool_a->bytes == pool_b->bytes);
    if (la.layers[l].has_source) {
      auto source_a = a.read_source(l);
      auto source_b = b.read_source(l);
      REQUIRE(source_a.ok());
      REQUIRE(source_b.ok());
      REQUIRE(same_bits(*source_a, *source_b));
    }
  }
  for (std::size_t s = 0; s < la.steps.size(); ++s) {
    require_same_step_meta(la.steps[s], lb.steps[s]);
    for (std::size_t l = 0; l < la.layers.size(); ++l) {
      INFO("step " << la.steps[s].group << " layer " << la.layers[l].group);
      auto ta = a.read_step_layer(s, l);
      auto tb = b.read_step_layer(s, l);
      REQUIRE(ta.ok());
      REQUIRE(tb.ok());
      REQUIRE(same_bits(ta->q_nope, tb->q_nope));
      REQUIRE(same_bits(ta->q_pe, tb->q_pe));
      REQUIRE(same_bits(ta->new_kv, tb->new_kv));
      REQUIRE(ta->out.has_value() == tb->out.has_value());
      if (ta->out) REQUIRE(same_bits(*ta->out, *tb->out));
      REQUIRE(ta->lse.has_value() == tb->lse.has_value());
      if (ta->lse) REQUIRE(same_bits(*ta->lse, *tb->lse));
      REQUIRE(ta->kv_cache_after.has_value() == tb->kv_cache_after.has_value());
      if (ta->kv_cache_after) REQUIRE(ta->kv_cache_after->bytes == tb->kv_cache_after->bytes);
      REQUIRE(ta->topk == tb->topk);
      REQUIRE(ta->topk_indices == tb->topk_indices);
    }
  }
}

inline std::filesystem::path test_tmp_dir(const std::string& name) {
  const std::filesystem::path dir = std::filesystem::path(KVAUDIT_TEST_TMPDIR) / name;
  std::filesystem::create_directories(dir);
  return dir;
}

}  // namespace kvaudit::testing
