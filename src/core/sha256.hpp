// SHA-256 digests for provenance (the dump a report or golden file was made from), computed with
// nettle (Debian's nettle-dev); kvaudit only streams bytes into it and prints hex.
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <future>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "src/core/result.hpp"

namespace kvaudit {

class Sha256 {
 public:
  using Digest = std::array<std::uint8_t, 32>;

  Sha256();
  Sha256(Sha256&&) noexcept;
  Sha256& operator=(Sha256&&) noexcept;
  ~Sha256();

  void update(std::span<const std::uint8_t> bytes);
  void update(std::string_view text);
  // The digest of everything fed so far; the object starts over afterwards.
  Digest finish();

 private:
  struct State;  // nettle's sha256_ctx, kept out of this header
  std::unique_ptr<State> state_;
};

std::string to_hex(const Sha256::Digest& digest);  // 64 lower-case hex digits
std::string sha256_hex(std::string_view text);
// Reads the file in chunks (a dump can be larger than memory). Errors name the file.
Result<std::string> sha256_file_hex(const std::filesystem::path& path);
// sha256_file_hex on a thread of its own, started now: a large dump's digest (about 9 s for 8 GB)
// is computed while the caller goes on (plain file reads, no HDF5, so beside an HDF5 reader too).
// get() waits for it and gives what sha256_file_hex gives, its error included; the future's
// destructor waits for the thread.
std::future<Result<std::string>> sha256_file_hex_async(std::filesystem::path path);

}  // namespace kvaudit
