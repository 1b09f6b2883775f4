// Errors are values at library boundaries: an Error names where (file, HDF5 object path) and what
// is wrong; the CLI prints it on one line and exits 2 (bad input) or 3 (internal error).
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <variant>

namespace kvaudit {

enum class ErrorKind { kBadInput, kUnsupported, kInternal };

struct Error {
  std::string where;  // "file.h5:/steps/S001/L000/q_nope", or empty
  std::string what;   // "shape [4, 16, 512] disagrees with num_heads = 8"
  ErrorKind kind = ErrorKind::kBadInput;

  std::string message() const { return where.empty() ? what : where + ": " + what; }
};

struct Unit {};

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : state_(std::in_place_index<0>, std::move(value)) {}
  Result(Error error) : state_(std::in_place_index<1>, std::move(error)) {}

  bool ok() const { return state_.index() == 0; }
  explicit operator bool() const { return ok(); }

  T& value() & { return std::get<0>(state_); }
  const T& value() const& { return std::get<0>(state_); }
  T&& value() && { return std::get<0>(std::move(state_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

  const Error& error() const { return std::get<1>(state_); }

 private:
  std::variant<T, Error> state_;
};

using Status = Result<Unit>;
inline Status ok_status() { return Unit{}; }

inline Error bad_input(std::string where, std::string what) {
  return Error{std::move(where), std::move(what), ErrorKind::kBadInput};
}
inline Error unsupported(std::string where, std::string what) {
  return Error{std::move(where), std::move(what), ErrorKind::kUnsupported};
}
inline Error internal_error(std::string where, std::string what) {
  return Error{std::move(where), std::move(what), ErrorKind::kInternal};
}

// Propagate an error from an expression returning Result<...>.
#define KVAUDIT_TRY(expr)                                              \
  do {                                                                 \
    auto kvaudit_try_result_ = (expr);                                 \
    if (!kvaudit_try_result_.ok()) return kvaudit_try_result_.error(); \
  } while (0)

// Declare `lhs` from the value of an expression returning Result<...>, or propagate its error:
//   KVAUDIT_ASSIGN_OR_RETURN(KvPool pool, reader.read_pool(layer));
#define KVAUDIT_CONCAT_INNER(a, b) a##b
#define KVAUDIT_CONCAT(a, b) KVAUDIT_CONCAT_INNER(a, b)
#define KVAUDIT_ASSIGN_OR_RETURN(lhs, expr) \
  KVAUDIT_ASSIGN_OR_RETURN_IMPL(KVAUDIT_CONCAT(kvaudit_result_, __LINE__), lhs, expr)
#define KVAUDIT_ASSIGN_OR_RETURN_IMPL(result, lhs, expr) \
  auto result = (expr);                                  \
  if (!result.ok()) return result.error();               \
  lhs = std::move(result).value()

}  // namespace kvaudit
