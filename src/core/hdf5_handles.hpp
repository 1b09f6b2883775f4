// Small RAII owners for HDF5 C API identifiers (hid_t), error-stack handling and shape text.
//
// Every HDF5 object that kvaudit opens (the kvdump reader, validator and writer in src/format/,
// the saved outputs in src/report/) is held in one of these so that an early return on a
// malformed file never leaks an identifier (a leaked file id keeps the file open). HDF5 prints
// its error stack to stderr by default; kvaudit turns that off once (silence_hdf5_errors) and
// instead folds the innermost HDF5 message into its own one-line error (with_hdf5_reason).
#pragma once

#include <fmt/format.h>
#include <hdf5.h>

#include <string>
#include <utility>
#include <vector>

namespace kvaudit::h5 {

// Owns one identifier and closes it with `Close` (H5Fclose, H5Gclose, ...). Negative ids are
// HDF5's failure value and are never closed.
template <herr_t (*Close)(hid_t)>
class Handle {
 public:
  Handle() = default;
  explicit Handle(hid_t id) : id_(id) {}
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  Handle(Handle&& other) noexcept : id_(std::exchange(other.id_, H5I_INVALID_HID)) {}
  Handle& operator=(Handle&& other) noexcept {
    if (this != &other) {
      reset();
      id_ = std::exchange(other.id_, H5I_INVALID_HID);
    }
    return *this;
  }
  ~Handle() { reset(); }

  hid_t get() const { return id_; }
  bool valid() const { return id_ >= 0; }
  explicit operator bool() const { return valid(); }

  // Closes now; returns HDF5's status (a file close can fail when flushing).
  herr_t reset() {
    herr_t status = 0;
    if (id_ >= 0) status = Close(id_);
    id_ = H5I_INVALID_HID;
    return status;
  }

 private:
  hid_t id_ = H5I_INVALID_HID;
};

using File = Handle<H5Fclose>;
using Group = Handle<H5Gclose>;
using Dataset = Handle<H5Dclose>;
using Dataspace = Handle<H5Sclose>;
using Attribute = Handle<H5Aclose>;
using Type = Handle<H5Tclose>;
using PropertyList = Handle<H5Pclose>;
using Object = Handle<H5Oclose>;  // a group or dataset opened with H5Oopen

// Turns off HDF5's automatic error printing for the default error stack. Idempotent.
inline void silence_hdf5_errors() { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); }

// The most specific description on the current HDF5 error stack (the innermost entry, which names
// what went wrong, e.g. "truncated file: eof = 1024, ..."), then clears the stack. Empty when the
// stack holds nothing.
inline std::string hdf5_error_text() {
  std::string text;
  H5Ewalk2(
      H5E_DEFAULT, H5E_WALK_UPWARD,
      [](unsigned n, const H5E_error2_t* error, void* data) -> herr_t {
        // Walking upward, entry 0 is where the error was first raised.
        if (n == 0 && error != nullptr && error->desc != nullptr) {
          *static_cast<std::string*>(data) = error->desc;
        }
        return 0;
      },
      &text);
  H5Eclear2(H5E_DEFAULT);
  return text;
}

// `what` followed by the innermost HDF5 message, when the error stack holds one.
inline std::string with_hdf5_reason(std::string what) {
  const std::string reason = hdf5_error_text();
  if (reason.empty()) return what;
  return fmt::format("{} (HDF5: {})", what, reason);
}

// "[4, 16, 512]"
inline std::string shape_text(const std::vector<hsize_t>& dims) {
  return fmt::format("[{}]", fmt::join(dims, ", "));
}

}  // namespace kvaudit::h5
