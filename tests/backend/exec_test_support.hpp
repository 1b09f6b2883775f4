// What the exec-backend tests share: running kvaudit (or any shell command) with its output
// captured, the shipped dumps and the fake backends (tests/backend/fakes/), reports compared
// without the fields that name the backend, and the datasets of two --save-outputs files compared
// byte for byte.
#pragma once

#include <hdf5.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "src/format/kvdump.hpp"
#include "tests/test_paths.hpp"

namespace kvaudit::exec_test {

// One word for /bin/sh: the text in single quotes (a quote inside closed, escaped, reopened).
inline std::string shell_word(const std::string& text) {
  std::string word = "'";
  for (const char c : text) word += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return word + "'";
}

inline std::string quoted(const std::filesystem::path& path) { return shell_word(path.string()); }

inline std::string read_text(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// A fresh scratch folder of this name.
inline std::filesystem::path case_dir(const std::string& name) {
  const std::filesystem::path dir = kvaudit_test::test_tmpdir() / "exec_backend" / name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

struct CommandRun {
  std::string command;
  int status = -1;     // exit status; -1 when it did not exit normally
  std::string output;  // stdout and stderr
};

// `command` through /bin/sh, its stdout and stderr into dir/log.
inline CommandRun run_shell(const std::string& command, const std::filesystem::path& dir,
                            const std::string& log = "log") {
  CommandRun run;
  run.command = command;
  const std::filesystem::path log_path = dir / log;
  const int raw = std::system((command + " > " + quoted(log_path) + " 2>&1").c_str());
  run.status = raw != -1 && WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  run.output = read_text(log_path);
  return run;
}

inline std::string kvaudit() { return quoted(kvaudit_test::kvaudit_binary()); }

// A per_tensor dump's attributes with GLM-5's MLA widths (16 heads, 512 + 64), the hello's model.
inline DumpAttributes mla_attrs(double sm_scale, int page_size) {
  DumpAttributes attrs;
  attrs.num_heads = 16;
  attrs.kv_lora_rank = 512;
  attrs.qk_rope_head_dim = 64;
  attrs.sm_scale = sm_scale;
  attrs.page_size = page_size;
  return attrs;
}

inline std::filesystem::path shipped_dump(const std::string& name) {
  return kvaudit_test::source_dir() / "datasets" / (name + ".h5");
}

// `python3 fake_backend.py MODE KVAUDIT`: the proxy of tests/backend/fakes/ in front of
// `kvaudit backend-serve cpu-fp8`.
inline std::string fake_command(const std::string& mode, const std::string& extra = "") {
  const std::filesystem::path script =
      kvaudit_test::source_dir() / "tests" / "backend" / "fakes" / "fake_backend.py";
  return "python3 " + script.string() + " " + mode + " " + kvaudit_test::kvaudit_binary().string() +
         (extra.empty() ? "" : " " + extra);
}

inline std::string serve_command(const std::string& options = "") {
  return kvaudit_test::kvaudit_binary().string() + " backend-serve cpu-fp8 --threads 1" +
         (options.empty() ? "" : " " + options);
}

inline nlohmann::json load_json(const std::filesystem::path& path) {
  return nlohmann::json::parse(read_text(path), nullptr, false);
}

// A report.json without what names or times the backend: equal for the same backend in process
// and behind the protocol.
inline nlohmann::json without_backend(nlohmann::json report) {
  // The checksum covers the backend's name and the provenance too, so it differs with them.
  for (const char* key : {"backend", "backend_description", "timing", "provenance", "checksum"}) {
    report.erase(key);
  }
  if (report.contains("dump")) report["dump"].erase("path");
  return report;
}

// Every dataset of an HDF5 file as raw bytes in its own type, by path.
inline std::map<std::string, std::vector<char>> dataset_bytes(const std::filesystem::path& path) {
  std::map<std::string, std::vector<char>> datasets;
  const hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  if (file < 0) return datasets;
  auto visit = [](hid_t object, const char* name, const H5O_info_t* info, void* data) -> herr_t {
    if (info->type != H5O_TYPE_DATASET) return 0;
    const hid_t dataset = H5Dopen2(object, name, H5P_DEFAULT);
    const hid_t type = H5Dget_type(dataset);
    const hid_t space = H5Dget_space(dataset);
    const hssize_t count = H5Sget_simple_extent_npoints(space);
    std::vector<char> bytes(static_cast<std::size_t>(count) * H5Tget_size(type));
    if (!bytes.empty()) H5Dread(dataset, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, bytes.data());
    (*static_cast<std::map<std::string, std::vector<char>>*>(data))[name] = std::move(bytes);
    H5Sclose(space);
    H5Tclose(type);
    H5Dclose(dataset);
    return 0;
  };
  H5Ovisit(file, H5_INDEX_NAME, H5_ITER_NATIVE, visit, &datasets);
  H5Fclose(file);
  return datasets;
}

// Whether a process is gone (or a zombie nobody has reaped yet: it runs no more).
inline bool process_gone(const std::string& pid) {
  const std::string status = read_text("/proc/" + pid + "/status");
  return status.empty() || status.find("State:\tZ") != std::string::npos;
}

// Whether the process is gone within 5 s: an ended program leaves /proc a moment after its
// parent returns, later still under a loaded parallel test run.
inline bool process_gone_soon(const std::string& pid) {
  for (int i = 0; i < 50; ++i) {
    if (process_gone(pid)) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return process_gone(pid);
}

}  // namespace kvaudit::exec_test
