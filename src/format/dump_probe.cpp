// Opening a kvdump in a forked child first (src/format/dump_probe.hpp): the child's abnormal end or
// timeout becomes an Error of the parent.
//
// Protocol: the child runs the probe, writes one byte to a pipe and leaves with _exit(0) (no
// atexit handlers, no sanitizer leak check). The parent takes the file as healthy only when it
// reads that byte and the child exited with status 0: a signal, another status, or status 0
// without the byte (exit(0) called inside a library) all mean the file is damaged.
#include "src/format/dump_probe.hpp"

#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <optional>
#include <string>

#include "src/format/kvdump.hpp"

namespace kvaudit {

namespace {

constexpr char kVerdictByte = 'k';

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

// The child: run the probe, send the verdict byte, leave without running anything else.
[[noreturn]] void run_child(int verdict_fd, const std::function<void()>& probe) {
  probe();
  const char byte = kVerdictByte;
  const bool sent = write(verdict_fd, &byte, 1) == 1;
  _exit(sent ? 0 : 1);
}

// Waits until the child sends its verdict or closes the pipe by ending, at most `timeout_seconds`;
// then reaps it (killed first when the time ran out). Returns whether it ended in time; *status is
// its wait status (0 when it cannot be had, e.g. SIGCHLD ignored: the verdict byte decides) and
// *verdict whether the byte came.
bool wait_for_child(pid_t child, int verdict_fd, int timeout_seconds, int* status, bool* verdict) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_seconds);
  bool ready = false;
  while (!ready) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    pollfd poll_fd{verdict_fd, POLLIN, 0};
    const int polled = poll(&poll_fd, 1, static_cast<int>(std::min<long long>(left.count(), 1000)));
    ready = polled > 0;
    if (polled < 0 && errno != EINTR) ready = true;  // cannot wait on the pipe: reap the child
  }
  if (!ready) kill(child, SIGKILL);
  char byte = 0;
  *verdict = ready && read(verdict_fd, &byte, 1) == 1 && byte == kVerdictByte;
  *status = 0;
  while (waitpid(child, status, 0) < 0 && errno == EINTR) {
  }
  return ready;
}

// Why an ended child's end is abnormal, or nothing when it is the normal one.
std::optional<std::string> abnormal_end(int status, bool verdict_received) {
  if (WIFSIGNALED(status)) {
    const int signal_number = WTERMSIG(status);
    return fmt::format("the HDF5 library crashed reading the file (signal {}, {})", signal_number,
                       strsignal(signal_number));
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) != 0) {
    return fmt::format(
        "reading the file ended the process with exit status {} (a library or "
        "sanitizer stopped it)",
        WEXITSTATUS(status));
  }
  if (!verdict_received) return std::string("reading the file ended the process early");
  return std::nullopt;
}

}  // namespace

Status probe_in_child(const std::filesystem::path& path, const std::function<void()>& probe,
                      int timeout_seconds) {
  int pipe_fds[2];
  if (pipe(pipe_fds) != 0) return ok_status();  // no pipe: open in-process as before
  // Buffered output would be written twice, by the parent and by a child that calls exit().
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  const pid_t child = fork();
  if (child < 0) {
    close(pipe_fds[0]);
    close(pipe_fds[1]);
    return ok_status();  // no child to be had: open in-process as before
  }
  if (child == 0) {
    close(pipe_fds[0]);
    run_child(pipe_fds[1], probe);
  }
  close(pipe_fds[1]);
  int status = 0;
  bool verdict_received = false;
  const bool ended =
      wait_for_child(child, pipe_fds[0], timeout_seconds, &status, &verdict_received);
  close(pipe_fds[0]);
  if (!ended) {
    return bad_input(path.string(),
                     fmt::format("reading the file's HDF5 metadata did not finish within {} s: "
                                 "the file is damaged",
                                 timeout_seconds));
  }
  if (const std::optional<std::string> why = abnormal_end(status, verdict_received)) {
    return bad_input(path.string(),
                     fmt::format("{}: the file is damaged, e.g. its global heap", *why));
  }
  return ok_status();
}

Status probe_dump_in_child(const std::filesystem::path& path) {
  return probe_in_child(
      path, [&path] { (void)DumpReader::open(path); }, open_timeout_seconds());
}

}  // namespace kvaudit
