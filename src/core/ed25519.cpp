// Ed25519 through nettle, and kvaudit's key files (see ed25519.hpp).
#include "src/core/ed25519.hpp"

#include <fcntl.h>
#include <nettle/eddsa.h>
#include <sys/random.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>

namespace kvaudit {
namespace {

static_assert(ED25519_KEY_SIZE == 32 && ED25519_SIGNATURE_SIZE == 64);

const std::uint8_t* message_bytes(std::string_view message) {
  return reinterpret_cast<const std::uint8_t*>(message.data());
}

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

template <std::size_t N>
Result<std::array<std::uint8_t, N>> array_from_hex(std::string_view hex, const std::string& where,
                                                   const char* what) {
  if (hex.size() != 2 * N) {
    return bad_input(where, std::string(what) + ": expected " + std::to_string(2 * N) +
                                " hex digits, found " + std::to_string(hex.size()) + " characters");
  }
  std::array<std::uint8_t, N> bytes{};
  for (std::size_t i = 0; i < N; ++i) {
    const int high = hex_digit(hex[2 * i]);
    const int low = hex_digit(hex[2 * i + 1]);
    if (high < 0 || low < 0) return bad_input(where, std::string(what) + ": not hex digits");
    bytes[i] = static_cast<std::uint8_t>(high * 16 + low);
  }
  return bytes;
}

Result<std::string> read_small_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return bad_input(path.string(), "cannot open the key file");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (text.size() > 4096) return bad_input(path.string(), "not a kvaudit key file (too long)");
  return text;
}

// "TAG HEX\n" -> HEX, or an error naming the file and the tag expected.
Result<std::string> tagged_hex(const std::string& text, const char* tag,
                               const std::filesystem::path& path) {
  std::string line = text;
  while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.pop_back();
  const std::string prefix = std::string(tag) + " ";
  if (line.rfind(prefix, 0) != 0 || line.find('\n') != std::string::npos) {
    return bad_input(path.string(), std::string("not a kvaudit key file: expected one line \"") +
                                        tag + " HEX\" (kvaudit keygen writes it)");
  }
  return line.substr(prefix.size());
}

// Creates `path` exclusively with `mode` and writes `text`; an existing file is refused.
Status write_new_file(const std::filesystem::path& path, const std::string& text, mode_t mode) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
  if (fd < 0) {
    return bad_input(path.string(), errno == EEXIST
                                        ? "exists already (a key is never overwritten)"
                                        : std::string("cannot create: ") + std::strerror(errno));
  }
  const bool written = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  const bool closed = ::close(fd) == 0;
  if (!written || !closed) {
    std::filesystem::remove(path);
    return bad_input(path.string(), "cannot write the key file");
  }
  return ok_status();
}

}  // namespace

Ed25519KeyPair ed25519_key_pair(const std::array<std::uint8_t, 32>& seed) {
  Ed25519KeyPair key;
  key.seed = seed;
  ed25519_sha512_public_key(key.public_key.data(), key.seed.data());
  return key;
}

Result<Ed25519KeyPair> ed25519_generate() {
  std::array<std::uint8_t, 32> seed{};
  std::size_t filled = 0;
  while (filled < seed.size()) {
    const ssize_t got = ::getrandom(seed.data() + filled, seed.size() - filled, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return internal_error("getrandom", std::strerror(errno));
    filled += static_cast<std::size_t>(got);
  }
  return ed25519_key_pair(seed);
}

Ed25519Signature ed25519_sign(const Ed25519KeyPair& key, std::string_view message) {
  Ed25519Signature signature{};
  ed25519_sha512_sign(key.public_key.data(), key.seed.data(), message.size(),
                      message_bytes(message), signature.data());
  return signature;
}

bool ed25519_verify(const Ed25519PublicKey& key, std::string_view message,
                    const Ed25519Signature& signature) {
  return ed25519_sha512_verify(key.data(), message.size(), message_bytes(message),
                               signature.data()) == 1;
}

std::string bytes_hex(const std::uint8_t* bytes, std::size_t size) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string hex;
  hex.reserve(2 * size);
  for (std::size_t i = 0; i < size; ++i) {
    hex.push_back(kDigits[bytes[i] >> 4]);
    hex.push_back(kDigits[bytes[i] & 15]);
  }
  return hex;
}

Result<Ed25519PublicKey> public_key_from_hex(std::string_view hex, const std::string& where) {
  return array_from_hex<32>(hex, where, "an Ed25519 public key");
}

Result<Ed25519Signature> signature_from_hex(std::string_view hex, const std::string& where) {
  return array_from_hex<64>(hex, where, "an Ed25519 signature");
}

Status write_key_files(const Ed25519KeyPair& key, const std::filesystem::path& private_path,
                       const std::filesystem::path& public_path) {
  for (const std::filesystem::path& path : {private_path, public_path}) {
    std::error_code error;
    const auto status = std::filesystem::symlink_status(path, error);
    if (std::filesystem::exists(status)) {
      return bad_input(path.string(), "exists already (a key is never overwritten)");
    }
    if (error && error != std::errc::no_such_file_or_directory) {
      return bad_input(path.string(), "cannot be checked: " + error.message());
    }
  }
  KVAUDIT_TRY(write_new_file(private_path,
                             std::string(kPrivateKeyTag) + " " + bytes_hex(key.seed) + "\n", 0600));
  const Status wrote_public = write_new_file(
      public_path, std::string(kPublicKeyTag) + " " + bytes_hex(key.public_key) + "\n", 0644);
  if (!wrote_public.ok()) std::filesystem::remove(private_path);
  return wrote_public;
}

Result<Ed25519KeyPair> read_private_key_file(const std::filesystem::path& path) {
  KVAUDIT_ASSIGN_OR_RETURN(const std::string text, read_small_file(path));
  KVAUDIT_ASSIGN_OR_RETURN(const std::string hex, tagged_hex(text, kPrivateKeyTag, path));
  KVAUDIT_ASSIGN_OR_RETURN(const auto seed,
                           (array_from_hex<32>(hex, path.string(), "an Ed25519 private key")));
  return ed25519_key_pair(seed);
}

Result<Ed25519PublicKey> read_public_key(const std::string& key_or_file, const std::string& where) {
  std::error_code error;  // a path that cannot be looked at is no file: the hex test decides
  const bool is_file = std::filesystem::exists(key_or_file, error);
  if (!is_file) {
    if (key_or_file.size() == 64) return public_key_from_hex(key_or_file, where);
    return bad_input(where, "'" + key_or_file +
                                "' is neither a key file nor 64 hex digits of an Ed25519 "
                                "public key");
  }
  KVAUDIT_ASSIGN_OR_RETURN(const std::string text, read_small_file(key_or_file));
  if (text.rfind(kPrivateKeyTag, 0) == 0) {
    KVAUDIT_ASSIGN_OR_RETURN(const Ed25519KeyPair pair, read_private_key_file(key_or_file));
    return pair.public_key;
  }
  KVAUDIT_ASSIGN_OR_RETURN(const std::string hex, tagged_hex(text, kPublicKeyTag, key_or_file));
  return public_key_from_hex(hex, key_or_file);
}

}  // namespace kvaudit
