// Signal-time cleanup (see signal_cleanup.hpp): fixed tables and the handler that reads them.
#include "src/core/signal_cleanup.hpp"

#include <signal.h>
#include <unistd.h>

#include <climits>
#include <cstring>
#include <iterator>
#include <string>

namespace kvaudit::signal_cleanup {
namespace {

constexpr int kSlots = 16;
constexpr int kMaxFiles = 48;
constexpr std::size_t kMaxNameBytes = 128;
constexpr int kCleanupSignals[] = {SIGINT, SIGTERM, SIGHUP};

struct FileSlot {
  volatile sig_atomic_t used = 0;
  char path[PATH_MAX] = {};
};

struct DirectorySlot {
  volatile sig_atomic_t used = 0;
  char path[PATH_MAX] = {};
  char files[kMaxFiles][kMaxNameBytes] = {};
  volatile sig_atomic_t file_count = 0;
};

struct GroupSlot {
  volatile sig_atomic_t used = 0;
  volatile pid_t group = 0;
};

FileSlot g_files[kSlots];
DirectorySlot g_directories[kSlots];
GroupSlot g_groups[kSlots];
struct sigaction g_previous[std::size(kCleanupSignals)];
bool g_handlers_installed = false;

void unlink_in(const char* directory, const char* name) {
  char path[PATH_MAX + kMaxNameBytes + 2];
  std::size_t n = 0;
  for (const char* c = directory; *c != '\0'; ++c) path[n++] = *c;
  path[n++] = '/';
  for (const char* c = name; *c != '\0'; ++c) path[n++] = *c;
  path[n] = '\0';
  unlink(path);
}

// Async-signal-safe: kill, unlink, rmdir, sigaction, raise and plain stores only.
extern "C" void cleanup_on_signal(int signal_number) {
  for (GroupSlot& slot : g_groups) {
    if (slot.used) kill(-slot.group, SIGTERM);
  }
  for (FileSlot& slot : g_files) {
    if (slot.used) unlink(slot.path);
  }
  for (DirectorySlot& slot : g_directories) {
    if (!slot.used) continue;
    for (int f = 0; f < slot.file_count; ++f) unlink_in(slot.path, slot.files[f]);
    rmdir(slot.path);
  }
  for (std::size_t i = 0; i < std::size(kCleanupSignals); ++i) {
    if (kCleanupSignals[i] == signal_number) sigaction(signal_number, &g_previous[i], nullptr);
  }
  raise(signal_number);
}

void install_handlers() {
  if (g_handlers_installed) return;
  g_handlers_installed = true;
  for (std::size_t i = 0; i < std::size(kCleanupSignals); ++i) {
    sigaction(kCleanupSignals[i], nullptr, &g_previous[i]);
    if (g_previous[i].sa_handler != SIG_DFL) continue;
    struct sigaction action {};
    action.sa_handler = cleanup_on_signal;
    sigemptyset(&action.sa_mask);
    sigaction(kCleanupSignals[i], &action, nullptr);
  }
}

// A free slot of `table` with `path` copied in (not yet marked used), or -1.
template <class Slot>
int fill_path_slot(Slot (&table)[kSlots], const std::filesystem::path& path) {
  const std::string text = path.string();
  if (text.size() >= PATH_MAX) return -1;
  for (int i = 0; i < kSlots; ++i) {
    if (table[i].used) continue;
    std::memcpy(table[i].path, text.c_str(), text.size() + 1);
    return i;
  }
  return -1;
}

}  // namespace

int enroll_file(const std::filesystem::path& path) {
  install_handlers();
  const int handle = fill_path_slot(g_files, path);
  if (handle >= 0) g_files[handle].used = 1;
  return handle;
}

void withdraw_file(int handle) {
  if (handle >= 0 && handle < kSlots) g_files[handle].used = 0;
}

int enroll_directory(const std::filesystem::path& directory) {
  install_handlers();
  const int handle = fill_path_slot(g_directories, directory);
  if (handle < 0) return -1;
  g_directories[handle].file_count = 0;
  g_directories[handle].used = 1;
  return handle;
}

void note_file(int handle, std::string_view name) {
  if (handle < 0 || handle >= kSlots || name.size() >= kMaxNameBytes) return;
  DirectorySlot& slot = g_directories[handle];
  for (int f = 0; f < slot.file_count; ++f) {
    if (name == slot.files[f]) return;
  }
  if (slot.file_count >= kMaxFiles) return;
  std::memcpy(slot.files[slot.file_count], name.data(), name.size());
  slot.files[slot.file_count][name.size()] = '\0';
  slot.file_count = slot.file_count + 1;  // the name is complete before the handler may read it
}

void withdraw_directory(int handle) {
  if (handle >= 0 && handle < kSlots) g_directories[handle].used = 0;
}

int enroll_group(pid_t group) {
  install_handlers();
  for (int i = 0; i < kSlots; ++i) {
    if (g_groups[i].used) continue;
    g_groups[i].group = group;
    g_groups[i].used = 1;
    return i;
  }
  return -1;
}

void withdraw_group(int handle) {
  if (handle >= 0 && handle < kSlots) g_groups[handle].used = 0;
}

}  // namespace kvaudit::signal_cleanup
