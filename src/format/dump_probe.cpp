// Opening a kvdump in a forked child first (src/format/dump_probe.hpp): the child's crash or
// timeout becomes an Error of the parent.
#include "src/format/dump_probe.hpp"

#include <fmt/format.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "src/format/kvdump.hpp"

namespace kvaudit {

namespace {

int open_timeout_seconds() {
  const char* text = std::getenv("KVAUDIT_OPEN_TIMEOUT");
  if (text != nullptr) {
    char* end = nullptr;
    const long seconds = std::strtol(text, &end, 10);
    if (end != text && *end == '\0' && seconds > 0 && seconds < 86400) {
      return static_cast<int>(seconds);
    }
  }
  return 60;
}

}  // namespace

Status probe_dump_in_child(const std::filesystem::path& path) {
  const int timeout_seconds = open_timeout_seconds();
  const pid_t child = fork();
  if (child < 0) return ok_status();  // no child to be had: open in-process as before
  if (child == 0) {
    const auto reader = DumpReader::open(path);
    _exit(reader.ok() ? 0 : 2);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_seconds);
  int status = 0;
  auto pause = std::chrono::milliseconds(1);
  while (true) {
    const pid_t done = waitpid(child, &status, WNOHANG);
    if (done == child) break;
    if (done < 0) return ok_status();
    if (std::chrono::steady_clock::now() >= deadline) {
      kill(child, SIGKILL);
      waitpid(child, &status, 0);
      return bad_input(path.string(),
                       fmt::format("reading the file's HDF5 metadata did not finish within {} s: "
                                   "the file is damaged",
                                   timeout_seconds));
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(50));
  }
  if (WIFSIGNALED(status)) {
    const int signal_number = WTERMSIG(status);
    return bad_input(path.string(),
                     fmt::format("the HDF5 library crashed reading the file (signal {}, {}): the "
                                 "file is damaged, e.g. its global heap",
                                 signal_number, strsignal(signal_number)));
  }
  return ok_status();
}

}  // namespace kvaudit
