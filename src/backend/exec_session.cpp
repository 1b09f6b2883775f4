// One session of the external backend protocol, kvaudit's side (src/backend/exec_session.hpp).
#include "src/backend/exec_session.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <system_error>

#include "src/backend/exec_protocol.hpp"
#include "src/core/signal_cleanup.hpp"

namespace kvaudit::exec {
namespace {

constexpr auto kExitGrace = std::chrono::seconds(5);
constexpr double kByeTimeoutSeconds = 60.0;
constexpr std::size_t kQuotedLineBytes = 200;

Clock::time_point deadline_after(double seconds) {
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// The parent of session directories (see the header).
Result<std::filesystem::path> exchange_parent() {
  if (const char* chosen = std::getenv("KVAUDIT_EXCHANGE_DIR"); chosen != nullptr && *chosen) {
    std::error_code error;
    if (!std::filesystem::is_directory(chosen, error)) {
      return bad_input("KVAUDIT_EXCHANGE_DIR", fmt::format("{} is not a directory", chosen));
    }
    return std::filesystem::path(chosen);
  }
  std::error_code error;
  if (std::filesystem::is_directory("/dev/shm", error) && ::access("/dev/shm", W_OK | X_OK) == 0) {
    return std::filesystem::path("/dev/shm");
  }
  const std::filesystem::path temporary = std::filesystem::temp_directory_path(error);
  if (error) return internal_error("exec", "no temporary directory for the session");
  return temporary;
}

Result<std::filesystem::path> make_session_directory() {
  KVAUDIT_ASSIGN_OR_RETURN(const std::filesystem::path parent, exchange_parent());
  std::string path = (parent / "kvaudit-exchange-XXXXXX").string();
  if (::mkdtemp(path.data()) == nullptr) {
    return bad_input(parent.string(),
                     fmt::format("cannot create the session directory: {}", std::strerror(errno)));
  }
  return std::filesystem::path(path);
}

// The start of a line, for a message about it.
std::string quoted_line(const std::string& line) {
  if (line.size() <= kQuotedLineBytes) return fmt::format("'{}'", line);
  return fmt::format("'{}...' ({} bytes)", line.substr(0, kQuotedLineBytes), line.size());
}

// An error reply as an Error: `unsupported` keeps its kind, the others are bad input (exit 2).
Error error_from_reply(const nlohmann::json& reply, const std::string& where,
                       const std::string& request) {
  const std::string kind = string_or(reply, "kind", "internal");
  const std::string message = reply.contains("message") && reply["message"].is_string()
                                  ? reply["message"].get<std::string>()
                                  : std::string("(the error reply has no message)");
  if (kind == "unsupported") return unsupported(where, fmt::format("{}: {}", request, message));
  if (kind == "bad_input") {
    return bad_input(where, fmt::format("{}: the backend refused the request as bad input: {}",
                                        request, message));
  }
  return bad_input(
      where, fmt::format("{}: the backend failed ({} error of the program under test, "
                         "not of kvaudit): {}",
                         request, kind == "internal" ? "an internal" : "an unknown", message));
}

}  // namespace

Result<double> backend_timeout_seconds() {
  const char* text = std::getenv("KVAUDIT_BACKEND_TIMEOUT");
  if (text == nullptr || *text == '\0') return kDefaultTimeoutSeconds;
  char* end = nullptr;
  const double seconds = std::strtod(text, &end);
  if (end == text || *end != '\0' || !(seconds > 0) || seconds > 1e7) {
    return bad_input("KVAUDIT_BACKEND_TIMEOUT",
                     fmt::format("'{}' is not a positive number of seconds", text));
  }
  return seconds;
}

Status check_exec_name(std::string_view name, std::string_view option) {
  const bool valid = !name.empty() && std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
           c == '_' || c == '.';
  });
  if (valid) return ok_status();
  return bad_input(std::string(option),
                   fmt::format("exec:{}: NAME must be letters, digits, '-', '_' or '.' (e.g. "
                               "exec:torch)",
                               name));
}

std::string default_exec_command(std::string_view name) {
  return fmt::format("python3 -m kvdump.backends {}", name);
}

ExecSession::ExecSession(std::string label, std::string command, double timeout_seconds)
    : label_(std::move(label)), command_(std::move(command)), timeout_seconds_(timeout_seconds) {}

Result<std::unique_ptr<ExecSession>> ExecSession::start(std::string label, std::string command) {
  KVAUDIT_ASSIGN_OR_RETURN(const double timeout, backend_timeout_seconds());
  std::unique_ptr<ExecSession> session(
      new ExecSession(std::move(label), std::move(command), timeout));
  KVAUDIT_ASSIGN_OR_RETURN(session->directory_, make_session_directory());
  session->cleanup_handle_ = signal_cleanup::enroll_directory(session->directory_);
  Result<ChildProcess> process = ChildProcess::start(session->command_);
  if (!process) return Error{session->label_, process.error().what, process.error().kind};
  session->process_.emplace(std::move(*process));
  return session;
}

ExecSession::~ExecSession() {
  finish();
  if (!directory_.empty()) {
    std::error_code ignored;
    std::filesystem::remove_all(directory_, ignored);
  }
  signal_cleanup::withdraw_directory(cleanup_handle_);
}

void ExecSession::note_program_file(std::string_view name) const {
  signal_cleanup::note_file(cleanup_handle_, name);
}

Result<HelloReply> ExecSession::hello(std::string_view name, const nlohmann::json& model,
                                      bool reciprocal_scale) {
  const auto start = Clock::now();
  // The lowest version that describes the dump: 1 (per_tensor, a bench session), 2
  // (per_token_group).
  const int version = hello_version(model);
  nlohmann::json request = {{"type", "hello"},
                            {"protocol", kProtocolName},
                            {"version", version},
                            {"name", name},
                            {"session_dir", directory_.string()}};
  if (!model.is_null()) request["model"] = model;
  request["reciprocal_scale"] = reciprocal_scale;
  const Result<nlohmann::json> answered = this->request(request, "hello", "");
  if (!answered) {
    broken_ = true;  // a program that refuses the hello exits: no bye
    return answered.error();
  }
  const nlohmann::json& reply = *answered;
  if (reply.contains("version") && reply["version"] != version) {
    return fail("hello", "",
                fmt::format("it replied with protocol version {}; kvaudit asked for {}",
                            reply["version"].dump(), version));
  }
  HelloReply hello;
  if (reply.contains("describe")) {
    if (!reply["describe"].is_object()) {
      return fail("hello", "", "its describe is not a JSON object");
    }
    hello.describe = reply["describe"];
  }
  if (reply.contains("capabilities")) hello.capabilities = reply["capabilities"];
  hello.seconds = seconds_since(start);
  return hello;
}

Result<nlohmann::json> ExecSession::request(const nlohmann::json& request,
                                            std::string_view expected, std::string_view context) {
  KVAUDIT_ASSIGN_OR_RETURN(nlohmann::json reply,
                           request_allowing_unsupported(request, expected, context));
  if (reply["type"] != "error") return reply;
  const std::string type = request.value("type", std::string("?"));
  return error_from_reply(reply, label_,
                          context.empty() ? fmt::format("{} request", type)
                                          : fmt::format("{} request for {}", type, context));
}

Result<nlohmann::json> ExecSession::request_allowing_unsupported(const nlohmann::json& request,
                                                                 std::string_view expected,
                                                                 std::string_view context) {
  const std::string type = request.value("type", std::string("?"));
  KVAUDIT_ASSIGN_OR_RETURN(nlohmann::json reply, exchange(request, context));
  const std::string reply_type = reply["type"].get<std::string>();
  if (reply_type == "error" && string_or(reply, "kind", "") == "unsupported") return reply;
  if (reply_type == "error") {
    return error_from_reply(reply, label_,
                            context.empty() ? fmt::format("{} request", type)
                                            : fmt::format("{} request for {}", type, context));
  }
  if (reply_type != expected) {
    return fail(type, context,
                fmt::format("it replied with type '{}', not '{}'", reply_type, expected));
  }
  return reply;
}

Result<nlohmann::json> ExecSession::exchange(const nlohmann::json& request,
                                             std::string_view context) {
  const std::string type = request.value("type", std::string("?"));
  if (broken_ || !process_) return fail(type, context, "the session already failed");
  const Clock::time_point deadline = deadline_after(timeout_seconds_);
  if (const Status sent = process_->write_line(request.dump(), deadline); !sent) {
    return fail(type, context,
                fmt::format("kvaudit could not send it: {}; the program {}", sent.error().what,
                            describe_exit()));
  }
  std::string line;
  switch (process_->read_line(line, deadline)) {
    case LineOutcome::kLine:
      break;
    case LineOutcome::kClosed:
      return fail(type, context,
                  fmt::format("the program closed its standard output without replying; it {}",
                              describe_exit()));
    case LineOutcome::kTimeout:
      process_->stop(kExitGrace);
      return fail(type, context,
                  fmt::format("no reply within {:g} s (KVAUDIT_BACKEND_TIMEOUT); the program was "
                              "ended",
                              timeout_seconds_));
    case LineOutcome::kTooLong:
      return fail(type, context, "the program sent a line longer than 64 MiB");
  }
  nlohmann::json reply = nlohmann::json::parse(line, nullptr, false);
  if (reply.is_discarded() || !reply.is_object() || !reply.contains("type") ||
      !reply["type"].is_string()) {
    return fail(type, context,
                fmt::format("the program sent a line that is not a reply (a JSON object with a "
                            "\"type\"; log to standard error instead): {}",
                            quoted_line(line)));
  }
  return reply;
}

std::string ExecSession::describe_exit() {
  return process_ ? process_->exit_description() : std::string("is not running");
}

Error ExecSession::fail(std::string_view request_type, std::string_view context,
                        const std::string& what) {
  broken_ = true;
  if (process_) process_->stop(kExitGrace);
  const std::string request = context.empty()
                                  ? fmt::format("{} request", request_type)
                                  : fmt::format("{} request for {}", request_type, context);
  return bad_input(label_, fmt::format("{}: {} (command: {})", request, what, command_));
}

void ExecSession::finish() {
  if (finished_ || !process_) return;
  finished_ = true;
  if (!broken_) {
    const double previous = timeout_seconds_;
    timeout_seconds_ = std::min(timeout_seconds_, kByeTimeoutSeconds);
    const Result<nlohmann::json> bye = request({{"type", "bye"}}, "bye", "");
    timeout_seconds_ = previous;
    if (!bye) {
      fmt::print(stderr, "kvaudit: warning: {}\n", bye.error().message());
    } else if (process_->close_and_wait(Clock::now() + kExitGrace) &&
               process_->exit_status().value_or(0) != 0) {
      fmt::print(stderr, "kvaudit: warning: {}: the program {} after bye\n", label_,
                 process_->exit_description());
    }
  }
  process_->stop(kExitGrace);
}

}  // namespace kvaudit::exec
