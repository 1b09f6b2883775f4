// Ed25519 signatures (RFC 8032, "pure" Ed25519 over SHA-512) through nettle's libhogweed, and the
// key files `kvaudit keygen` writes and `check --signing-key` / `verify-report --public-key` read.
//
// The math is nettle's: a private key is a 32-byte seed s; the public key is A = a·B on the
// twisted Edwards curve edwards25519, a the clamped first half of SHA-512(s); a signature over a
// message M is (R, S), 64 bytes, that verifies when S·B = R + SHA-512(R ‖ A ‖ M)·A. Forging one
// without s is as hard as the discrete logarithm on that curve; kvaudit only moves bytes in and
// out, and prints them as lower-case hex.
//
// Key files are one line of text each:
//   private key:  "kvaudit-ed25519-private-key <64 hex digits: the seed>\n"   (mode 0600)
//   public key:   "kvaudit-ed25519-public-key <64 hex digits: A>\n"
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

#include "src/core/result.hpp"

namespace kvaudit {

inline constexpr const char* kSignatureAlgorithm = "ed25519";
inline constexpr const char* kPrivateKeyTag = "kvaudit-ed25519-private-key";
inline constexpr const char* kPublicKeyTag = "kvaudit-ed25519-public-key";

using Ed25519PublicKey = std::array<std::uint8_t, 32>;
using Ed25519Signature = std::array<std::uint8_t, 64>;

// A private key (the seed) and the public key it gives.
struct Ed25519KeyPair {
  std::array<std::uint8_t, 32> seed{};
  Ed25519PublicKey public_key{};
};

// The key pair of a seed; a fresh seed from getrandom(2).
Ed25519KeyPair ed25519_key_pair(const std::array<std::uint8_t, 32>& seed);
Result<Ed25519KeyPair> ed25519_generate();

Ed25519Signature ed25519_sign(const Ed25519KeyPair& key, std::string_view message);
bool ed25519_verify(const Ed25519PublicKey& key, std::string_view message,
                    const Ed25519Signature& signature);

// Lower-case hex, and its inverse (exactly 2·N hex digits, either case; an error names `where`).
std::string bytes_hex(const std::uint8_t* bytes, std::size_t size);
template <std::size_t N>
std::string bytes_hex(const std::array<std::uint8_t, N>& bytes) {
  return bytes_hex(bytes.data(), N);
}
Result<Ed25519PublicKey> public_key_from_hex(std::string_view hex, const std::string& where);
Result<Ed25519Signature> signature_from_hex(std::string_view hex, const std::string& where);

// Writes the private key file (mode 0600) and `public_path` (the public key, mode 0644). Refuses
// (bad input, naming the file) when either exists: a key is never overwritten.
Status write_key_files(const Ed25519KeyPair& key, const std::filesystem::path& private_path,
                       const std::filesystem::path& public_path);
// Reads a private key file; errors name the file and what is wrong with it.
Result<Ed25519KeyPair> read_private_key_file(const std::filesystem::path& path);
// A public key given on the command line: 64 hex digits, or a public key file (or a private key
// file, whose public key is taken). Errors name `where` and the file.
Result<Ed25519PublicKey> read_public_key(const std::string& key_or_file, const std::string& where);

}  // namespace kvaudit
