// Signal-time cleanup: what kvaudit leaves behind if SIGINT, SIGTERM or SIGHUP ends it.
//
// Ordinary exits, errors included, clean up through destructors (an AtomicOutputFile removes its
// temporary, an exec session its directory). A signal skips them, so the things that must not
// outlive kvaudit are enrolled here: temporary output files (unlinked), directories with the
// file names kvaudit knows in them (those unlinked, then the directory removed; other files keep
// it), and child process groups (sent SIGTERM). The handler then restores the signal's previous
// disposition and raises it again, so that kvaudit dies of it as it would have.
//
// The handler reads fixed tables only (async-signal-safe: unlink, rmdir, kill, sigaction, raise
// and plain stores); a slot is filled first and marked used last. It is installed on the first
// enrollment, for each signal whose disposition is the default one (an ignored SIGHUP, under
// nohup, stays ignored). A full table returns handle -1: that item is then cleaned up on ordinary
// exits only.
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <string_view>

namespace kvaudit::signal_cleanup {

int enroll_file(const std::filesystem::path& path);
void withdraw_file(int handle);

int enroll_directory(const std::filesystem::path& directory);
// Records a file name in an enrolled directory for the handler to unlink.
void note_file(int handle, std::string_view name);
void withdraw_directory(int handle);

int enroll_group(pid_t group);
void withdraw_group(int handle);

}  // namespace kvaudit::signal_cleanup
