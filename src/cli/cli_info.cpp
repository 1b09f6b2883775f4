// `kvaudit info DUMP [--json]`: validate a kvdump completely, then summarise it. Also
// report_error, the one place an Error becomes a line on stderr and an exit status.
#include <iostream>
#include <memory>
#include <string>

#include "src/cli/cli.hpp"
#include "src/format/dump_probe.hpp"
#include "src/format/kvdump.hpp"
#include "src/tools/info.hpp"

namespace kvaudit {

int report_error(const Error& error) {
  std::cerr << "kvaudit: " << error.message() << "\n";
  return error.kind == ErrorKind::kInternal ? kExitInternal : kExitBadInput;
}

namespace {

struct InfoOptions {
  std::string dump;
  bool json = false;
};

// The crash-safe probe, the validating open, then the summary; the first error stops it.
Result<nlohmann::json> summarise(const std::string& dump) {
  KVAUDIT_TRY(probe_dump_in_child(dump));
  KVAUDIT_ASSIGN_OR_RETURN(const DumpReader reader, DumpReader::open(dump));
  return dump_info(reader);
}

int run_info(const InfoOptions& options) {
  const Result<nlohmann::json> info = summarise(options.dump);
  if (!info) return report_error(info.error());
  if (options.json) {
    std::cout << info->dump(2) << "\n";
  } else {
    std::cout << format_dump_info(*info);
  }
  return kExitPass;
}

}  // namespace

void register_info_command(CLI::App& app, CommandRunner& runner) {
  auto options = std::make_shared<InfoOptions>();
  CLI::App* cmd = add_command(
      app, "info",
      {"Validate a kvdump v1 or v1.1 file completely and summarise it.",
       "Every rule of the format's Errors section is checked (docs/kvdump-v1.md), the values of "
       "every v1.1 topk_indices dataset included. The summary: "
       "model and producer; shapes (H, Dc, Dr, page_size, num_pages, slots, kv_dtype, "
       "sm_scale); per layer its layer_id, kv_scale, whether kv_source is present and how many "
       "NaN values it holds in which slots (Rs is NaN where a row reads one), and the NaN codes "
       "(0x7F/0xFF) and saturated codes (+-448: 0x7E/0xFE) in its initial pool (v1.1 "
       "per_token_group: and its NaN group scales, one per scale); per step "
       "its kind, requests, query rows, tokens (sum of kv_len), pages, and which captures (out, "
       "lse, kv_cache_after) it holds.",
       "0 valid, 2 malformed or unreadable file (one line on stderr naming the file and HDF5 "
       "object) or bad usage, 3 internal error"});
  add_input_file(*cmd, "DUMP", options->dump, "kvdump HDF5 file")->required();
  cmd->add_flag("--json", options->json,
                "Print the summary as JSON on stdout (keys: file, format_version, model, "
                "producer, shapes, layers, steps)");
  cmd->callback([options, &runner] { runner = [options] { return run_info(*options); }; });
}

}  // namespace kvaudit
