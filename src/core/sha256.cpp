// SHA-256 after FIPS 180-4: constants K are the first 32 bits of the fractional parts of the cube
// roots of the first 64 primes (4.2.2), the initial hash the same for the square roots of the
// first 8 primes (5.3.3); the compression function is 6.2.2.
#include "src/core/sha256.hpp"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <vector>

namespace kvaudit {
namespace {

constexpr std::array<std::uint32_t, 64> kRoundConstants = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

constexpr std::array<std::uint32_t, 8> kInitialHash = {
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};

constexpr std::uint32_t rotate_right(std::uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }
// The six logical functions of 4.1.2.
constexpr std::uint32_t choose(std::uint32_t x, std::uint32_t y, std::uint32_t z) {
  return (x & y) ^ (~x & z);
}
constexpr std::uint32_t majority(std::uint32_t x, std::uint32_t y, std::uint32_t z) {
  return (x & y) ^ (x & z) ^ (y & z);
}
constexpr std::uint32_t big_sigma0(std::uint32_t x) {
  return rotate_right(x, 2) ^ rotate_right(x, 13) ^ rotate_right(x, 22);
}
constexpr std::uint32_t big_sigma1(std::uint32_t x) {
  return rotate_right(x, 6) ^ rotate_right(x, 11) ^ rotate_right(x, 25);
}
constexpr std::uint32_t small_sigma0(std::uint32_t x) {
  return rotate_right(x, 7) ^ rotate_right(x, 18) ^ (x >> 3);
}
constexpr std::uint32_t small_sigma1(std::uint32_t x) {
  return rotate_right(x, 17) ^ rotate_right(x, 19) ^ (x >> 10);
}

}  // namespace

Sha256::Sha256() { reset(); }

void Sha256::reset() {
  state_ = kInitialHash;
  buffered_ = 0;
  total_bytes_ = 0;
}

void Sha256::process_block(const std::uint8_t* block) {
  std::array<std::uint32_t, 64> schedule;  // W_t of 6.2.2 step 1
  for (int t = 0; t < 16; ++t) {
    schedule[t] = (static_cast<std::uint32_t>(block[4 * t]) << 24) |
                  (static_cast<std::uint32_t>(block[4 * t + 1]) << 16) |
                  (static_cast<std::uint32_t>(block[4 * t + 2]) << 8) |
                  static_cast<std::uint32_t>(block[4 * t + 3]);
  }
  for (int t = 16; t < 64; ++t) {
    schedule[t] = small_sigma1(schedule[t - 2]) + schedule[t - 7] + small_sigma0(schedule[t - 15]) +
                  schedule[t - 16];
  }
  std::uint32_t a = state_[0], b = state_[1], c = state_[2], d = state_[3];
  std::uint32_t e = state_[4], f = state_[5], g = state_[6], h = state_[7];
  for (int t = 0; t < 64; ++t) {
    const std::uint32_t t1 = h + big_sigma1(e) + choose(e, f, g) + kRoundConstants[t] + schedule[t];
    const std::uint32_t t2 = big_sigma0(a) + majority(a, b, c);
    h = g;
    g = f;
    f = e;
    e = d + t1;
    d = c;
    c = b;
    b = a;
    a = t1 + t2;
  }
  state_[0] += a;
  state_[1] += b;
  state_[2] += c;
  state_[3] += d;
  state_[4] += e;
  state_[5] += f;
  state_[6] += g;
  state_[7] += h;
}

void Sha256::update(std::span<const std::uint8_t> bytes) {
  total_bytes_ += bytes.size();
  std::size_t offset = 0;
  if (buffered_ > 0) {
    const std::size_t take = std::min(bytes.size(), buffer_.size() - buffered_);
    std::memcpy(buffer_.data() + buffered_, bytes.data(), take);
    buffered_ += take;
    offset = take;
    if (buffered_ < buffer_.size()) return;
    process_block(buffer_.data());
    buffered_ = 0;
  }
  for (; offset + 64 <= bytes.size(); offset += 64) process_block(bytes.data() + offset);
  const std::size_t rest = bytes.size() - offset;
  if (rest > 0) std::memcpy(buffer_.data(), bytes.data() + offset, rest);
  buffered_ = rest;
}

void Sha256::update(std::string_view text) {
  update(std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(text.data()),
                                       text.size()));
}

Sha256::Digest Sha256::finish() {
  // 5.1.1: append bit 1, then k zero bits with l + 1 + k = 448 mod 512, then l as 64 bits.
  const std::uint64_t length_bits = total_bytes_ * 8;
  std::array<std::uint8_t, 128> padding{};
  padding[0] = 0x80;
  const std::size_t zeros_end = buffered_ < 56 ? 56 - buffered_ : 120 - buffered_;
  for (int i = 0; i < 8; ++i) {
    padding[zeros_end + i] = static_cast<std::uint8_t>(length_bits >> (56 - 8 * i));
  }
  update(std::span<const std::uint8_t>(padding.data(), zeros_end + 8));
  Digest digest;
  for (int i = 0; i < 8; ++i) {
    digest[4 * i] = static_cast<std::uint8_t>(state_[i] >> 24);
    digest[4 * i + 1] = static_cast<std::uint8_t>(state_[i] >> 16);
    digest[4 * i + 2] = static_cast<std::uint8_t>(state_[i] >> 8);
    digest[4 * i + 3] = static_cast<std::uint8_t>(state_[i]);
  }
  reset();
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

}  // namespace kvaudit
