// Output paths checked up front and written atomically (src/core/output_file.hpp).
//
// Temporaries are created with mkstemp / mkdtemp in the folder of the final path (a rename is
// atomic only within one file system), named ".<name>.kvaudit-XXXXXX" so that they are hidden and
// say who left them, and given the permissions a plain create would give (0666 / 0777 less the
// umask; mkstemp's 0600 would otherwise survive the rename).
#include "src/core/output_file.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "src/core/signal_cleanup.hpp"

namespace kvaudit {
namespace {

namespace fs = std::filesystem;

// The process's umask, read without changing it where Linux allows (/proc/self/status, 4.7+).
mode_t current_umask() {
  static const mode_t mask = [] {
    std::ifstream status("/proc/self/status");
    std::string line;
    while (std::getline(status, line)) {
      if (line.rfind("Umask:", 0) == 0)
        return static_cast<mode_t>(std::stoul(line.substr(6), 0, 8));
    }
    const mode_t old = umask(022);
    umask(old);
    return old;
  }();
  return mask;
}

std::string where_of(const fs::path& path, std::string_view option) {
  return option.empty() ? path.string() : fmt::format("{} {}", option, path.string());
}

std::string errno_text(int error) { return std::strerror(error); }

// The folder a path's entry lives in ("." for a bare name).
fs::path folder_of(const fs::path& path) {
  const fs::path parent = path.parent_path();
  return parent.empty() ? fs::path(".") : parent;
}

// ".<name>.kvaudit-XXXXXX" in `folder`; the name is shortened so the whole stays within NAME_MAX.
std::string temp_template(const fs::path& folder, const fs::path& final_path) {
  std::string name = final_path.filename().string();
  if (name.empty() || name == "." || name == "..") name = "output";
  if (name.size() > 200) name.resize(200);
  return (folder / fmt::format(".{}.kvaudit-XXXXXX", name)).string();
}

// Creates an empty temporary file for `final_path` in `folder`; its path, or errno.
Result<fs::path> create_temp_file(const fs::path& folder, const fs::path& final_path) {
  std::string name = temp_template(folder, final_path);
  std::vector<char> buffer(name.begin(), name.end());
  buffer.push_back('\0');
  const int fd = mkstemp(buffer.data());
  if (fd < 0) {
    const int error = errno;
    return bad_input(folder.string(), errno_text(error));
  }
  fchmod(fd, static_cast<mode_t>(0666) & ~current_umask());
  close(fd);
  return fs::path(buffer.data());
}

Result<fs::path> create_temp_directory(const fs::path& folder, const fs::path& final_path) {
  std::string name = temp_template(folder, final_path);
  std::vector<char> buffer(name.begin(), name.end());
  buffer.push_back('\0');
  if (mkdtemp(buffer.data()) == nullptr) {
    const int error = errno;
    return bad_input(folder.string(), errno_text(error));
  }
  chmod(buffer.data(), static_cast<mode_t>(0777) & ~current_umask());
  return fs::path(buffer.data());
}

// A file can be created in `folder`: tried by creating and removing a temporary.
Status check_writable_folder(const fs::path& folder, const fs::path& final_path,
                             const std::string& where) {
  std::error_code error;
  const fs::file_status status = fs::status(folder, error);
  if (!fs::exists(status))
    return bad_input(where, fmt::format("folder {} does not exist", folder.string()));
  if (!fs::is_directory(status))
    return bad_input(where, fmt::format("{} is not a folder", folder.string()));
  const Result<fs::path> probe = create_temp_file(folder, final_path);
  if (!probe) {
    return bad_input(
        where, fmt::format("cannot create files in {}: {}", folder.string(), probe.error().what));
  }
  fs::remove(*probe, error);
  return ok_status();
}

// The nearest folder on `path` that exists (the path itself included), or `path` itself when
// some component that exists is not a folder (the caller's check then says so).
fs::path nearest_existing(const fs::path& path) {
  fs::path current = path;
  std::error_code error;
  while (!current.empty() && !fs::exists(current, error)) current = current.parent_path();
  return current.empty() ? fs::path(".") : current;
}

// What an existing output of kind FILE resolves to: the file a symbolic link names.
fs::path resolved_file(const fs::path& path) {
  std::error_code error;
  if (fs::is_symlink(path, error)) {
    const fs::path target = fs::weakly_canonical(path, error);
    if (!error) return target;
  }
  return path;
}

// A target that exists but that a rename cannot replace meaningfully: a device or a FIFO.
bool written_in_place(const fs::path& path) {
  std::error_code error;
  const fs::file_status status = fs::status(path, error);
  return fs::exists(status) && !fs::is_regular_file(status) && !fs::is_directory(status);
}

Status validate_file(const fs::path& path, const std::string& where) {
  std::error_code error;
  const fs::path target = resolved_file(path);
  const fs::file_status status = fs::status(target, error);
  if (fs::is_directory(status)) return bad_input(where, "is a directory; expected a file");
  if (written_in_place(target)) return ok_status();
  return check_writable_folder(folder_of(target), target, where);
}

Status validate_directory(const fs::path& path, const std::string& where) {
  std::error_code error;
  const fs::file_status status = fs::status(path, error);
  if (fs::exists(status) && !fs::is_directory(status)) {
    return bad_input(where, "exists and is not a directory");
  }
  const fs::path existing = nearest_existing(path);
  return check_writable_folder(existing, path, where);
}

// Moves every entry of `from` into `to` (an existing directory): files replace their namesakes,
// a directory is merged into an existing directory of the same name.
Status move_entries(const fs::path& from, const fs::path& to, const std::string& where) {
  std::error_code listing;
  std::vector<fs::path> staged;
  for (const fs::directory_entry& entry : fs::directory_iterator(from, listing)) {
    staged.push_back(entry.path());
  }
  if (listing) {
    return bad_input(where, fmt::format("cannot read {}: {}", from.string(), listing.message()));
  }
  for (const fs::path& source : staged) {
    std::error_code ignored;
    const fs::path destination = to / source.filename();
    const bool target_is_directory = fs::is_directory(fs::symlink_status(destination, ignored));
    if (fs::is_directory(fs::symlink_status(source, ignored)) && target_is_directory) {
      KVAUDIT_TRY(move_entries(source, destination, where));
      continue;
    }
    if (target_is_directory) fs::remove_all(destination, ignored);
    if (std::rename(source.c_str(), destination.c_str()) != 0) {
      const int code = errno;
      return bad_input(where,
                       fmt::format("cannot write {}: {}", destination.string(), errno_text(code)));
    }
  }
  return ok_status();
}

}  // namespace

std::string_view output_kind_name(OutputKind kind) {
  return kind == OutputKind::kDirectory ? "DIR" : "FILE";
}

Status validate_output_path(const fs::path& path, OutputKind kind, std::string_view option) {
  const std::string where = where_of(path, option);
  if (path.empty()) {
    return bad_input(option.empty() ? std::string("output") : std::string(option),
                     fmt::format("the {} path is empty", output_kind_name(kind)));
  }
  return kind == OutputKind::kFile ? validate_file(path, where) : validate_directory(path, where);
}

// ---- AtomicOutputFile ---------------------------------------------------------------------------

AtomicOutputFile::AtomicOutputFile(fs::path path, fs::path temp, std::string option)
    : path_(std::move(path)), temp_(std::move(temp)), option_(std::move(option)) {
  pending_ = temp_ != path_;
  if (pending_) cleanup_ = signal_cleanup::enroll_file(temp_);
}

AtomicOutputFile::AtomicOutputFile(AtomicOutputFile&& other) noexcept
    : path_(std::move(other.path_)),
      temp_(std::move(other.temp_)),
      option_(std::move(other.option_)),
      pending_(std::exchange(other.pending_, false)),
      cleanup_(std::exchange(other.cleanup_, -1)) {}

AtomicOutputFile& AtomicOutputFile::operator=(AtomicOutputFile&& other) noexcept {
  if (this != &other) {
    discard();
    path_ = std::move(other.path_);
    temp_ = std::move(other.temp_);
    option_ = std::move(other.option_);
    pending_ = std::exchange(other.pending_, false);
    cleanup_ = std::exchange(other.cleanup_, -1);
  }
  return *this;
}

AtomicOutputFile::~AtomicOutputFile() { discard(); }

void AtomicOutputFile::discard() noexcept {
  if (!pending_) return;
  std::error_code ignored;
  fs::remove(temp_, ignored);
  signal_cleanup::withdraw_file(std::exchange(cleanup_, -1));
  pending_ = false;
}

Result<AtomicOutputFile> AtomicOutputFile::create(const fs::path& path, std::string_view option) {
  KVAUDIT_TRY(validate_output_path(path, OutputKind::kFile, option));
  const fs::path target = resolved_file(path);
  if (written_in_place(target)) return AtomicOutputFile(target, target, std::string(option));
  const Result<fs::path> temp = create_temp_file(folder_of(target), target);
  if (!temp) {
    return bad_input(where_of(path, option),
                     fmt::format("cannot create files in {}: {}", folder_of(target).string(),
                                 temp.error().what));
  }
  return AtomicOutputFile(target, *temp, std::string(option));
}

Status AtomicOutputFile::write(std::string_view text) const {
  std::ofstream out(temp_, std::ios::binary | std::ios::trunc);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  out.flush();
  if (!out) return bad_input(where_of(path_, option_), "cannot write the file");
  return ok_status();
}

Status AtomicOutputFile::commit() {
  if (!pending_) return ok_status();
  if (std::rename(temp_.c_str(), path_.c_str()) != 0) {
    const int error = errno;
    discard();
    return bad_input(where_of(path_, option_), fmt::format("cannot write: {}", errno_text(error)));
  }
  signal_cleanup::withdraw_file(std::exchange(cleanup_, -1));
  pending_ = false;
  return ok_status();
}

// ---- AtomicOutputDirectory ----------------------------------------------------------------------

AtomicOutputDirectory::AtomicOutputDirectory(fs::path path, fs::path staging, std::string option)
    : path_(std::move(path)),
      staging_(std::move(staging)),
      option_(std::move(option)),
      pending_(true),
      cleanup_(signal_cleanup::enroll_directory(staging_)) {}

AtomicOutputDirectory::AtomicOutputDirectory(AtomicOutputDirectory&& other) noexcept
    : path_(std::move(other.path_)),
      staging_(std::move(other.staging_)),
      option_(std::move(other.option_)),
      pending_(std::exchange(other.pending_, false)),
      cleanup_(std::exchange(other.cleanup_, -1)) {}

AtomicOutputDirectory& AtomicOutputDirectory::operator=(AtomicOutputDirectory&& other) noexcept {
  if (this != &other) {
    discard();
    path_ = std::move(other.path_);
    staging_ = std::move(other.staging_);
    option_ = std::move(other.option_);
    pending_ = std::exchange(other.pending_, false);
    cleanup_ = std::exchange(other.cleanup_, -1);
  }
  return *this;
}

AtomicOutputDirectory::~AtomicOutputDirectory() { discard(); }

void AtomicOutputDirectory::note_file(std::string_view name) const {
  signal_cleanup::note_file(cleanup_, name);
}

void AtomicOutputDirectory::discard() noexcept {
  if (!pending_) return;
  std::error_code ignored;
  fs::remove_all(staging_, ignored);
  signal_cleanup::withdraw_directory(std::exchange(cleanup_, -1));
  pending_ = false;
}

Result<AtomicOutputDirectory> AtomicOutputDirectory::create(const fs::path& path,
                                                            std::string_view option) {
  KVAUDIT_TRY(validate_output_path(path, OutputKind::kDirectory, option));
  // Staged beside the directory (in its nearest existing ancestor when its parents are missing),
  // on the same file system, so that commit() only renames.
  const fs::path folder = nearest_existing(folder_of(path));
  const Result<fs::path> staging = create_temp_directory(folder, path);
  if (!staging) {
    return bad_input(where_of(path, option), fmt::format("cannot create files in {}: {}",
                                                         folder.string(), staging.error().what));
  }
  return AtomicOutputDirectory(path, *staging, std::string(option));
}

Status AtomicOutputDirectory::commit() {
  if (!pending_) return ok_status();
  const std::string where = where_of(path_, option_);
  std::error_code error;
  Status moved = ok_status();
  if (!fs::exists(path_, error)) {
    if (!path_.parent_path().empty()) fs::create_directories(path_.parent_path(), error);
    if (std::rename(staging_.c_str(), path_.c_str()) != 0) {
      const int code = errno;
      moved = bad_input(where, fmt::format("cannot create the directory: {}", errno_text(code)));
    }
  } else {
    moved = move_entries(staging_, path_, where);
  }
  discard();  // the staging directory, or what a failed move left of it
  return moved;
}

}  // namespace kvaudit
