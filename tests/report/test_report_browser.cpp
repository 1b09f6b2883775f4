// report.html as a person sees it: `kvaudit check --report` on a shipped dump, then
// tests/report/check_report_html.py validates the page (html5lib strict, tidy), checks it needs
// nothing outside itself, has Chromium (headless) build its DOM and count the charts' marks, and
// render it to a PNG that must not be blank. Skipped by name where Chromium is not installed
// (`scripts/setup.sh tests` installs chromium, tidy, python3-pil and python3-html5lib). Untimed: it
// asserts nothing about how long the browser takes.
#include <sys/wait.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "tests/test_paths.hpp"

namespace {

// chromium (Debian) or chromium-browser on PATH; empty when neither is.
std::string find_chromium() {
  const char* path = std::getenv("PATH");
  if (path == nullptr) return "";
  const std::string dirs = path;
  for (const char* name : {"chromium", "chromium-browser"}) {
    std::size_t start = 0;
    while (start <= dirs.size()) {
      const std::size_t end = std::min(dirs.find(':', start), dirs.size());
      const std::filesystem::path candidate =
          std::filesystem::path(dirs.substr(start, end - start)) / name;
      std::error_code error;
      if (!candidate.empty() && std::filesystem::exists(candidate, error)) return candidate;
      start = end + 1;
    }
  }
  return "";
}

int run(const std::string& command) {
  const int raw = std::system(command.c_str());
  return WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
}

}  // namespace

TEST_CASE("report.html renders in headless Chromium: valid, not blank, every chart mark drawn",
          "[report_html][browser]") {
  const std::string chromium = find_chromium();
  if (chromium.empty()) {
    WARN("SKIPPED " << Catch::getResultCapture().getCurrentTestName()
                    << ": chromium is not installed (scripts/setup.sh tests installs it)");
    return;
  }
  const std::filesystem::path source = kvaudit_test::source_dir();
  const std::filesystem::path dir = kvaudit_test::test_tmpdir() / "browser_report";
  std::filesystem::remove_all(dir);
  // glm5_page1: 3 layers x 4 steps, kv_source everywhere, a clean cpu-fp8 kernel.
  const std::string check = kvaudit_test::kvaudit_binary().string() + " check '" +
                            (source / "datasets/glm5_page1.h5").string() +
                            "' --threads 2 --report '" + dir.string() + "' > '" +
                            (dir.string() + ".stdout") + "' 2>&1";
  REQUIRE(run(check) == 0);
  // 48 heat cells (3 x 4 x 4); 12 timeline cells (3 layers x 4 steps, backend pool); per layer
  // kernel, quantization, total (9 marks) and across steps the same (12): at least 21 marks; the
  // kernel, quantization and total limits on both charts.
  const std::string checker =
      "/usr/bin/python3 '" + (source / "tests/report/check_report_html.py").string() + "' '" +
      (dir / "report.html").string() + "' --chromium '" + chromium +
      "' --heat-cells 48 --timeline-cells 12 --chart-marks 21 --limit-lines 6 --png '" +
      (dir / "report.png").string() + "'";
  INFO(checker);
  CHECK(run(checker) == 0);
}
