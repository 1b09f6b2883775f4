// The program behind an exec backend and the signal-time cleanup (src/backend/exec_process.hpp).
#include "src/backend/exec_process.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <thread>

#include "src/core/signal_cleanup.hpp"

extern char** environ;

namespace kvaudit::exec {
namespace {

// ---- pipes --------------------------------------------------------------------------------------

// SIGPIPE blocked on this thread while it writes to the program, and a SIGPIPE that the write
// raised consumed afterwards, so a program that went away is an EPIPE error, not kvaudit's death.
class SigpipeBlock {
 public:
  SigpipeBlock() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    sigset_t pending;
    sigpending(&pending);
    was_pending_ = sigismember(&pending, SIGPIPE) == 1;
    pthread_sigmask(SIG_BLOCK, &pipe_, &previous_);
  }
  ~SigpipeBlock() {
    sigset_t pending;
    sigpending(&pending);
    if (!was_pending_ && sigismember(&pending, SIGPIPE) == 1) {
      const timespec zero{0, 0};
      sigtimedwait(&pipe_, nullptr, &zero);
    }
    pthread_sigmask(SIG_SETMASK, &previous_, nullptr);
  }
  SigpipeBlock(const SigpipeBlock&) = delete;
  SigpipeBlock& operator=(const SigpipeBlock&) = delete;

 private:
  sigset_t pipe_{};
  sigset_t previous_{};
  bool was_pending_ = false;
};

int milliseconds_until(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return static_cast<int>(std::clamp<std::int64_t>(left.count(), 0, INT_MAX));
}

// Waits for `events` on `fd` until the deadline; false on timeout.
bool wait_for(int fd, short events, Clock::time_point deadline) {
  while (true) {
    pollfd entry{fd, events, 0};
    const int ready = ::poll(&entry, 1, milliseconds_until(deadline));
    if (ready > 0) return true;
    if (ready == 0) return false;
    if (errno != EINTR) return true;  // let the read or write report the error
  }
}

void close_fd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

// The spawn attributes: a process group of its own, an empty signal mask, and the default
// disposition of the signals kvaudit may handle or block.
void init_spawn_attributes(posix_spawnattr_t& attributes) {
  posix_spawnattr_init(&attributes);
  posix_spawnattr_setflags(&attributes,
                           POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  posix_spawnattr_setpgroup(&attributes, 0);
  sigset_t none;
  sigemptyset(&none);
  posix_spawnattr_setsigmask(&attributes, &none);
  sigset_t defaults;
  sigemptyset(&defaults);
  for (const int signal_number : {SIGPIPE, SIGINT, SIGTERM, SIGHUP}) {
    sigaddset(&defaults, signal_number);
  }
  posix_spawnattr_setsigdefault(&attributes, &defaults);
}

}  // namespace

Result<ChildProcess> ChildProcess::start(const std::string& command) {
  int to_child[2] = {-1, -1};
  int from_child[2] = {-1, -1};
  if (::pipe2(to_child, O_CLOEXEC) != 0 || ::pipe2(from_child, O_CLOEXEC) != 0) {
    for (int fd : {to_child[0], to_child[1], from_child[0], from_child[1]}) close_fd(fd);
    return internal_error("exec", fmt::format("cannot create pipes: {}", std::strerror(errno)));
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, to_child[0], STDIN_FILENO);
  posix_spawn_file_actions_adddup2(&actions, from_child[1], STDOUT_FILENO);
  posix_spawnattr_t attributes;
  init_spawn_attributes(attributes);
  std::string shell_name = "sh", dash_c = "-c", text = command;
  char* argv[] = {shell_name.data(), dash_c.data(), text.data(), nullptr};
  ChildProcess child;
  const int spawned = posix_spawn(&child.pid_, "/bin/sh", &actions, &attributes, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attributes);
  close_fd(to_child[0]);
  close_fd(from_child[1]);
  if (spawned != 0) {
    close_fd(to_child[1]);
    close_fd(from_child[0]);
    child.pid_ = -1;
    return internal_error("exec", fmt::format("cannot start /bin/sh: {}", std::strerror(spawned)));
  }
  child.stdin_fd_ = to_child[1];
  child.stdout_fd_ = from_child[0];
  ::fcntl(child.stdin_fd_, F_SETFL, ::fcntl(child.stdin_fd_, F_GETFL) | O_NONBLOCK);
  ::fcntl(child.stdout_fd_, F_SETFL, ::fcntl(child.stdout_fd_, F_GETFL) | O_NONBLOCK);
  child.cleanup_slot_ = signal_cleanup::enroll_group(child.pid_);
  return child;
}

ChildProcess::ChildProcess(ChildProcess&& other) noexcept { *this = std::move(other); }

ChildProcess& ChildProcess::operator=(ChildProcess&& other) noexcept {
  if (this == &other) return *this;
  stop();
  pid_ = other.pid_;
  stdin_fd_ = other.stdin_fd_;
  stdout_fd_ = other.stdout_fd_;
  reaped_ = other.reaped_;
  wait_status_ = other.wait_status_;
  cleanup_slot_ = other.cleanup_slot_;
  buffer_ = std::move(other.buffer_);
  other.release();
  return *this;
}

ChildProcess::~ChildProcess() { stop(); }

void ChildProcess::release() {
  pid_ = -1;
  stdin_fd_ = -1;
  stdout_fd_ = -1;
  reaped_ = false;
  cleanup_slot_ = -1;
  buffer_.clear();
}

Status ChildProcess::write_line(std::string_view line, Clock::time_point deadline) {
  if (stdin_fd_ < 0) return bad_input("", "its standard input is already closed");
  std::string data(line);
  data.push_back('\n');
  const SigpipeBlock block;
  std::size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(stdin_fd_, data.data() + done, data.size() - done);
    if (n > 0) {
      done += static_cast<std::size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) {
      if (!wait_for(stdin_fd_, POLLOUT, deadline)) {
        return bad_input("", "it did not read its standard input in time");
      }
      continue;
    }
    if (errno == EPIPE) return bad_input("", "it closed its standard input");
    return bad_input("", fmt::format("writing to it failed: {}", std::strerror(errno)));
  }
  return ok_status();
}

LineOutcome ChildProcess::read_line(std::string& line, Clock::time_point deadline) {
  char chunk[1 << 16];
  while (true) {
    if (const auto newline = buffer_.find('\n'); newline != std::string::npos) {
      line = buffer_.substr(0, newline);
      buffer_.erase(0, newline + 1);
      return LineOutcome::kLine;
    }
    if (buffer_.size() > kMaxLineBytes) return LineOutcome::kTooLong;
    if (stdout_fd_ < 0) return LineOutcome::kClosed;
    const ssize_t n = ::read(stdout_fd_, chunk, sizeof chunk);
    if (n > 0) {
      buffer_.append(chunk, static_cast<std::size_t>(n));
    } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
      close_fd(stdout_fd_);
      return LineOutcome::kClosed;
    } else if (errno == EAGAIN && !wait_for(stdout_fd_, POLLIN, deadline)) {
      return LineOutcome::kTimeout;
    }
  }
}

bool ChildProcess::reap(bool block) {
  if (pid_ < 0 || reaped_) return reaped_;
  int status = 0;
  const pid_t done = ::waitpid(pid_, &status, block ? 0 : WNOHANG);
  if (done == pid_) {
    reaped_ = true;
    wait_status_ = status;
    signal_cleanup::withdraw_group(cleanup_slot_);
    cleanup_slot_ = -1;
  } else if (done < 0 && errno == ECHILD) {
    reaped_ = true;  // nothing left to wait for
  }
  return reaped_;
}

bool ChildProcess::close_and_wait(Clock::time_point deadline) {
  close_fd(stdin_fd_);
  auto pause = std::chrono::milliseconds(1);
  while (!reap(false)) {
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(50));
  }
  return true;
}

void ChildProcess::stop(std::chrono::milliseconds grace) {
  if (pid_ < 0) return;
  close_fd(stdin_fd_);
  close_fd(stdout_fd_);
  if (!reap(false)) {
    ::kill(-pid_, SIGTERM);
    if (!close_and_wait(Clock::now() + grace)) {
      ::kill(-pid_, SIGKILL);
      reap(true);
    }
  }
  signal_cleanup::withdraw_group(cleanup_slot_);
  cleanup_slot_ = -1;
  pid_ = -1;
}

std::string ChildProcess::exit_description(std::chrono::milliseconds wait) {
  if (!close_and_wait(Clock::now() + wait) && !reaped_) return "is still running";
  if (WIFEXITED(wait_status_))
    return fmt::format("exited with status {}", WEXITSTATUS(wait_status_));
  if (WIFSIGNALED(wait_status_)) {
    const int signal_number = WTERMSIG(wait_status_);
    return fmt::format("was killed by signal {} ({})", signal_number, strsignal(signal_number));
  }
  return "has ended";
}

std::optional<int> ChildProcess::exit_status() const {
  if (!reaped_ || !WIFEXITED(wait_status_)) return std::nullopt;
  return WEXITSTATUS(wait_status_);
}

}  // namespace kvaudit::exec
