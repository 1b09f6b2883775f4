// Every file or directory a kvaudit command writes goes through this header, so that all commands
// behave alike:
//   - validate_output_path() checks a path before any work (a command that would fail to write
//     its output at the end fails at once instead, with the same message whatever the option);
//   - AtomicOutputFile / AtomicOutputDirectory write under a temporary name in the same folder and
//     rename onto the final name only when the command has succeeded (commit()); otherwise the
//     temporary is removed, so a failed or interrupted command leaves no partial output behind and
//     an existing file of that name unchanged.
//
// Rules (the same for every option):
//   FILE  not empty; not an existing directory; its folder exists, is a folder, and a file can be
//         created in it (tried: a temporary file is created and removed). An existing file is
//         replaced. A symbolic link is followed (the file it names is replaced). An existing
//         target that is not a regular file (a character device such as /dev/stdout or /dev/null,
//         a FIFO) cannot be replaced by a rename: it is written in place, without the temporary.
//   DIR   not empty; not an existing non-directory; the nearest existing folder on its path (the
//         directory itself when it exists) is a folder in which a file can be created. Missing
//         parent folders are created at commit(). An existing directory keeps files the command
//         does not write; each file written replaces its namesake whole.
#pragma once

#include <filesystem>
#include <string>
#include <string_view>

#include "src/core/result.hpp"

namespace kvaudit {

enum class OutputKind { kFile, kDirectory };

// "FILE" or "DIR": how --help shows the option's value, and how messages name it.
std::string_view output_kind_name(OutputKind kind);

// Checks `path` as an output of `kind` given by `option` ("--json"). The error is bad input whose
// `where` is "<option> <path>" and whose `what` says what is wrong, e.g.
//   --json /nonexistent/dir/r.json: folder /nonexistent/dir does not exist
Status validate_output_path(const std::filesystem::path& path, OutputKind kind,
                            std::string_view option);

// One output file. Write the content to temp_path() (by name, e.g. with HDF5 or an ofstream, or
// with write()), then commit(). Destroyed without a successful commit(), it removes the temporary.
class AtomicOutputFile {
 public:
  // Validates `path` (validate_output_path) and creates the temporary next to it.
  static Result<AtomicOutputFile> create(const std::filesystem::path& path,
                                         std::string_view option);
  AtomicOutputFile(AtomicOutputFile&& other) noexcept;
  AtomicOutputFile& operator=(AtomicOutputFile&& other) noexcept;
  AtomicOutputFile(const AtomicOutputFile&) = delete;
  AtomicOutputFile& operator=(const AtomicOutputFile&) = delete;
  ~AtomicOutputFile();

  const std::filesystem::path& path() const { return path_; }
  // Where to write until commit(); the final path itself for a device or FIFO.
  const std::filesystem::path& temp_path() const { return temp_; }
  // Replaces the temporary's content with `text`.
  Status write(std::string_view text) const;
  // Renames the temporary onto path(). After an error the temporary is gone too.
  Status commit();

 private:
  AtomicOutputFile(std::filesystem::path path, std::filesystem::path temp, std::string option);
  void discard() noexcept;

  std::filesystem::path path_;
  std::filesystem::path temp_;
  std::string option_;
  bool pending_ = false;  // a temporary exists and is ours to rename or remove
  int cleanup_ = -1;      // its signal-time cleanup (src/core/signal_cleanup.hpp)
};

// One output directory: files are written into staging_path(), then commit() moves them into
// path(). Destroyed without a successful commit(), it removes the staging directory.
class AtomicOutputDirectory {
 public:
  static Result<AtomicOutputDirectory> create(const std::filesystem::path& path,
                                              std::string_view option);
  AtomicOutputDirectory(AtomicOutputDirectory&& other) noexcept;
  AtomicOutputDirectory& operator=(AtomicOutputDirectory&& other) noexcept;
  AtomicOutputDirectory(const AtomicOutputDirectory&) = delete;
  AtomicOutputDirectory& operator=(const AtomicOutputDirectory&) = delete;
  ~AtomicOutputDirectory();

  const std::filesystem::path& path() const { return path_; }
  const std::filesystem::path& staging_path() const { return staging_; }
  // A file name the command will write into staging_path(): removed with the staging directory
  // if a signal ends kvaudit before commit() (src/core/signal_cleanup.hpp).
  void note_file(std::string_view name) const;
  // A missing path() becomes the staging directory by one rename; an existing one receives each
  // staged file by rename (replacing its namesake). The staging directory is then gone.
  Status commit();

 private:
  AtomicOutputDirectory(std::filesystem::path path, std::filesystem::path staging,
                        std::string option);
  void discard() noexcept;

  std::filesystem::path path_;
  std::filesystem::path staging_;
  std::string option_;
  bool pending_ = false;
  int cleanup_ = -1;  // the staging directory's signal-time cleanup
};

}  // namespace kvaudit
