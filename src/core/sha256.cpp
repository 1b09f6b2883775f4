// SHA-256 through nettle: a thin owner of its context (src/core/sha256.hpp).
#include "src/core/sha256.hpp"

#include <nettle/sha2.h>

#include <fstream>
#include <system_error>
#include <vector>

namespace kvaudit {

struct Sha256::State {
  sha256_ctx context;
};

Sha256::Sha256() : state_(std::make_unique<State>()) { sha256_init(&state_->context); }
Sha256::Sha256(Sha256&&) noexcept = default;
Sha256& Sha256::operator=(Sha256&&) noexcept = default;
Sha256::~Sha256() = default;

void Sha256::update(std::span<const std::uint8_t> bytes) {
  sha256_update(&state_->context, bytes.size(), bytes.data());
}

void Sha256::update(std::string_view text) {
  update(std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(text.data()),
                                       text.size()));
}

Sha256::Digest Sha256::finish() {
  Digest digest{};
  sha256_digest(&state_->context, digest.size(), digest.data());  // also re-initialises
  return digest;
}

std::string to_hex(const Sha256::Digest& digest) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string hex;
  hex.reserve(64);
  for (const std::uint8_t byte : digest) {
    hex.push_back(kDigits[byte >> 4]);
    hex.push_back(kDigits[byte & 0xF]);
  }
  return hex;
}

std::string sha256_hex(std::string_view text) {
  Sha256 hasher;
  hasher.update(text);
  return to_hex(hasher.finish());
}

Result<std::string> sha256_file_hex(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return bad_input(path.string(), "cannot open file to compute its SHA-256");
  Sha256 hasher;
  std::vector<char> chunk(1 << 20);
  while (in) {
    in.read(chunk.data(), static_cast<std::streamsize>(chunk.size()));
    const std::streamsize got = in.gcount();
    if (got > 0) {
      hasher.update(std::span<const std::uint8_t>(
          reinterpret_cast<const std::uint8_t*>(chunk.data()), static_cast<std::size_t>(got)));
    }
  }
  if (in.bad()) return bad_input(path.string(), "read error while computing its SHA-256");
  return to_hex(hasher.finish());
}

namespace {

Result<std::string> file_digest(const std::filesystem::path& path) { return sha256_file_hex(path); }

}  // namespace

std::future<Result<std::string>> sha256_file_hex_async(std::filesystem::path path) {
  try {
    return std::async(std::launch::async, file_digest, path);
  } catch (const std::system_error&) {  // no thread to be had: computed by get() instead
    return std::async(std::launch::deferred, file_digest, std::move(path));
  }
}

}  // namespace kvaudit
