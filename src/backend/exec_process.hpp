// The program behind an exec backend (docs/backend-protocol.md "Transport"): started once by
// `/bin/sh -c COMMAND` in a process group of its own (so that a timeout or a signal reaches the
// program the shell started, not only the shell), with pipes on its standard input and output
// and kvaudit's standard error passed through. Lines go in and come out with a deadline; the
// program is ended with SIGTERM, then SIGKILL after a grace period.
//
// While a program or a session directory is alive it is enrolled for signal-time cleanup
// (src/core/signal_cleanup.hpp): on SIGINT, SIGTERM or SIGHUP kvaudit sends the program's group
// SIGTERM, removes the files it knows in the session directory and the directory, then dies of
// the signal as it would have. (A program's own extra files in the directory stay behind then; on
// every ordinary exit, error or not, the whole directory is removed.)
#pragma once

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>

#include "src/core/result.hpp"

namespace kvaudit::exec {

using Clock = std::chrono::steady_clock;

// What waiting for a line gave.
enum class LineOutcome : std::uint8_t {
  kLine,     // a complete line (without its newline)
  kClosed,   // the program closed its standard output (usually: it exited)
  kTimeout,  // nothing complete before the deadline
  kTooLong,  // a line longer than kMaxLineBytes
};

inline constexpr std::size_t kMaxLineBytes = std::size_t{64} << 20;

class ChildProcess {
 public:
  // Starts `/bin/sh -c command`. Fails only where the shell itself cannot be started.
  static Result<ChildProcess> start(const std::string& command);

  ChildProcess(ChildProcess&& other) noexcept;
  ChildProcess& operator=(ChildProcess&& other) noexcept;
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;
  ~ChildProcess();  // stop()

  // Writes `line` and a newline to the program's standard input. Fails (with the reason as the
  // error's text) when the program closed it or does not read before the deadline.
  Status write_line(std::string_view line, Clock::time_point deadline);
  LineOutcome read_line(std::string& line, Clock::time_point deadline);

  // Closes the program's standard input and waits until `deadline` for it to exit.
  bool close_and_wait(Clock::time_point deadline);
  // Ends the program: SIGTERM to its group, then SIGKILL after `grace`. Safe to call twice.
  void stop(std::chrono::milliseconds grace = std::chrono::seconds(5));
  // "exited with status 2", "was killed by signal 9 (Killed)", "is still running"; reaps the
  // program when it has exited, waiting at most `wait` for that.
  std::string exit_description(std::chrono::milliseconds wait = std::chrono::milliseconds(500));
  // The exit status once the program has exited normally.
  std::optional<int> exit_status() const;
  pid_t pid() const { return pid_; }

 private:
  ChildProcess() = default;
  bool reap(bool block);
  void release();

  pid_t pid_ = -1;
  int stdin_fd_ = -1;
  int stdout_fd_ = -1;
  bool reaped_ = false;
  int wait_status_ = 0;
  int cleanup_slot_ = -1;
  std::string buffer_;  // bytes read past the last complete line
};

}  // namespace kvaudit::exec
