// kvaudit's side of one session of the external backend protocol (docs/backend-protocol.md): the
// session directory, the program (src/backend/exec_process.hpp), the hello, one request and its
// reply at a time, and the bye. Used by the exec backend (`check --backend exec:NAME`,
// src/backend/exec_backend.hpp) and by the bench's peer (`bench --peer exec:NAME`).
//
// The session directory is made under $KVAUDIT_EXCHANGE_DIR, else /dev/shm where it is a writable
// directory (a file there is memory), else the system's temporary directory, and removed when the
// session ends (ordinary exits, errors included; signals: src/backend/exec_process.hpp).
//
// Every failure of the program is an Error whose `where` is "exec:NAME" and whose text names the
// request and what it was for (step and layer), then what went wrong: the program exited or
// closed its standard output (with its exit status), sent a line that is not a JSON object with a
// "type", a reply of another type, an error reply (its kind and message), or no reply within
// $KVAUDIT_BACKEND_TIMEOUT seconds (default 900; it is then ended, SIGTERM then SIGKILL). The kind
// is unsupported for an `unsupported` error reply and bad input otherwise: kvaudit exits 2 for
// each, since the program under test, not kvaudit, failed.
#pragma once

#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

#include "src/backend/exec_process.hpp"
#include "src/core/result.hpp"

namespace kvaudit::exec {

inline constexpr double kDefaultTimeoutSeconds = 900.0;

// $KVAUDIT_BACKEND_TIMEOUT (seconds, a positive number), or the default; bad input otherwise.
Result<double> backend_timeout_seconds();

// The letters, digits, '-', '_' and '.' of NAME in exec:NAME; bad input (naming `option`)
// otherwise.
Status check_exec_name(std::string_view name, std::string_view option);
// The command run when none is given: `python3 -m kvdump.backends NAME`.
std::string default_exec_command(std::string_view name);

struct HelloReply {
  nlohmann::json describe = nlohmann::json::object();
  nlohmann::json capabilities = nlohmann::json::array();
  double seconds = 0.0;  // from starting the program to its hello reply
};

class ExecSession {
 public:
  // Makes the session directory and starts `command`. `label` ("exec:NAME") names the backend in
  // errors.
  static Result<std::unique_ptr<ExecSession>> start(std::string label, std::string command);
  ~ExecSession();  // finish(), then the directory is removed
  ExecSession(const ExecSession&) = delete;
  ExecSession& operator=(const ExecSession&) = delete;

  // The hello: `model` is the hello's model object, or null for a bench session (none is sent).
  // `name` is NAME of exec:NAME. A refused hello ends the session (the program exits; no bye).
  Result<HelloReply> hello(std::string_view name, const nlohmann::json& model,
                           bool reciprocal_scale);
  // Sends `request` and returns its reply, which must have type `expected`. `context` names what
  // the request is for in errors ("step 1 (S001), layer 0 (L000)"). An error reply comes back as
  // an Error; so does every failure of the program, after which the session is broken (every
  // later request fails at once, and the program is ended).
  Result<nlohmann::json> request(const nlohmann::json& request, std::string_view expected,
                                 std::string_view context);
  // Like request(), but an `unsupported` error reply comes back as a value, not an Error (the
  // bench records such cases): the reply object itself.
  Result<nlohmann::json> request_allowing_unsupported(const nlohmann::json& request,
                                                      std::string_view expected,
                                                      std::string_view context);
  // The bye, then the program's exit (ended after a grace period). A program that exits with a
  // status other than 0 after the bye gets a warning on stderr. Safe to call twice.
  void finish();

  const std::filesystem::path& directory() const { return directory_; }
  const std::string& label() const { return label_; }
  const std::string& command() const { return command_; }
  // Records a file name the program chose (a changed pool) for the signal-time cleanup.
  void note_program_file(std::string_view name) const;

 private:
  ExecSession(std::string label, std::string command, double timeout_seconds);
  Result<nlohmann::json> exchange(const nlohmann::json& request, std::string_view context);
  Error fail(std::string_view request_type, std::string_view context, const std::string& what);
  std::string describe_exit();

  std::string label_;
  std::string command_;
  double timeout_seconds_;
  std::filesystem::path directory_;
  int cleanup_handle_ = -1;
  std::optional<ChildProcess> process_;
  bool broken_ = false;
  bool finished_ = false;
};

}  // namespace kvaudit::exec
