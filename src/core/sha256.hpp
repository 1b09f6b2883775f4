// SHA-256 (FIPS 180-4, section 6.2), streaming, for the dump provenance in reports.
//
// The message is processed in 512-bit blocks; padding appends 0x80, zeros, and the message length
// in bits as a 64-bit big-endian integer so the padded length is a multiple of 512 bits.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>

#include "src/core/result.hpp"

namespace kvaudit {

class Sha256 {
 public:
  using Digest = std::array<std::uint8_t, 32>;

  Sha256();
  void update(std::span<const std::uint8_t> bytes);
  void update(std::string_view text);
  // Pads, processes the last block(s) and returns the digest. The object is reset afterwards.
  Digest finish();

 private:
  void process_block(const std::uint8_t* block);
  void reset();

  std::array<std::uint32_t, 8> state_{};
  std::array<std::uint8_t, 64> buffer_{};
  std::size_t buffered_ = 0;
  std::uint64_t total_bytes_ = 0;
};

std::string to_hex(const Sha256::Digest& digest);  // 64 lower-case hex digits
std::string sha256_hex(std::string_view text);
// Reads the file in chunks (a dump can be larger than memory). Errors name the file.
Result<std::string> sha256_file_hex(const std::filesystem::path& path);

}  // namespace kvaudit
