// Sanitizer reports of a kvaudit built with -DKVAUDIT_SANITIZE=address,undefined, for the mutation
// fuzz tests. Every run is given ASAN_OPTIONS / UBSAN_OPTIONS that write each report to a file in
// a folder (log_path=DIR/report: one file per process, the probe child's included), so that a
// report is seen even where its process's end is taken for a damaged file (exit 2). With a binary
// built without sanitizers the options are ignored and no report ever appears.
//
// A report is HDF5's own when the first frame of its stack outside the sanitizer runtime and the C
// and C++ runtime libraries is inside libhdf5: HDF5 1.10 reading a damaged global heap does an
// overlapping memcpy or a wild read by itself, which the probe child contains (the file is
// refused as damaged). Any other report is a fault of kvaudit's own code and fails the test.
#pragma once

#include <filesystem>
#include <fstream>
#include <iterator>
#include <regex>
#include <string>
#include <vector>

namespace kvaudit::testing {

// The environment prefix of a command whose sanitizer reports go to `dir`.
inline std::string sanitizer_environment(const std::filesystem::path& dir) {
  const std::string log = (dir / "report").string();
  return "ASAN_OPTIONS=log_path='" + log +
         "':detect_leaks=0:allocator_may_return_null=1 UBSAN_OPTIONS=log_path='" + log +
         "':print_stacktrace=1:halt_on_error=1 ";
}

// Whether a report's first frame of interest is in libhdf5.
inline bool is_hdf5_report(const std::string& report) {
  static const std::regex frame(R"(#\d+ 0x[0-9a-f]+ in (\S+) (\S+))");
  static const std::regex runtime(
      R"((libasan|libubsan|libc\.so|libc-|libstdc\+\+|libgcc_s|ld-linux|libpthread))");
  for (auto it = std::sregex_iterator(report.begin(), report.end(), frame);
       it != std::sregex_iterator(); ++it) {
    const std::string function = (*it)[1];
    const std::string location = (*it)[2];
    if (function.rfind("__asan", 0) == 0 || function.rfind("__interceptor", 0) == 0 ||
        function.rfind("__ubsan", 0) == 0 || function.rfind("__sanitizer", 0) == 0 ||
        std::regex_search(location, runtime)) {
      continue;
    }
    return location.find("libhdf5") != std::string::npos;
  }
  return false;  // no stack: not attributable to HDF5
}

struct SanitizerReports {
  int hdf5 = 0;                      // contained by the probe child
  std::vector<std::string> kvaudit;  // kvaudit's own: the text of each
};

// Reads and removes every report file in `dir`.
inline SanitizerReports collect_sanitizer_reports(const std::filesystem::path& dir) {
  SanitizerReports reports;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
    if (entry.path().filename().string().rfind("report", 0) != 0) continue;
    std::ifstream in(entry.path());
    const std::string text{std::istreambuf_iterator<char>(in), {}};
    if (is_hdf5_report(text)) {
      ++reports.hdf5;
    } else {
      reports.kvaudit.push_back(text);
    }
    std::filesystem::remove(entry.path(), error);
  }
  return reports;
}

}  // namespace kvaudit::testing
