// SHA-256 against the examples of FIPS 180-4 / NIST CSRC "SHA256.pdf" (one-block "abc", two-block
// 448-bit message) and the long-message vector (one million 'a'), plus the empty message.
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <string>

#include "src/core/sha256.hpp"

namespace {

constexpr const char* kEmptyDigest =
    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
constexpr const char* kAbcDigest =
    "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
constexpr const char* kTwoBlockMessage = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
constexpr const char* kTwoBlockDigest =
    "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1";
constexpr const char* kMillionADigest =
    "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0";

}  // namespace

TEST_CASE("sha256 of the standard short messages", "[sha256]") {
  CHECK(kvaudit::sha256_hex("") == kEmptyDigest);
  CHECK(kvaudit::sha256_hex("abc") == kAbcDigest);
  CHECK(kvaudit::sha256_hex(kTwoBlockMessage) == kTwoBlockDigest);
}

TEST_CASE("sha256 of one million 'a' fed in uneven pieces", "[sha256]") {
  // Pieces of 1, 63, 64, 65, ... bytes cross every buffering case of update().
  const std::string million(1000000, 'a');
  kvaudit::Sha256 hasher;
  std::size_t offset = 0;
  std::size_t piece = 1;
  while (offset < million.size()) {
    const std::size_t take = std::min(piece, million.size() - offset);
    hasher.update(std::string_view(million).substr(offset, take));
    offset += take;
    piece = piece == 1 ? 63 : piece + 1;
  }
  CHECK(kvaudit::to_hex(hasher.finish()) == kMillionADigest);
  CHECK(kvaudit::sha256_hex(million) == kMillionADigest);
}

TEST_CASE("sha256 padding boundaries: 55, 56 and 64 byte messages", "[sha256]") {
  // 55 bytes is the longest message whose padding fits one block; 56 needs a second block.
  // Expected digests computed independently with coreutils sha256sum.
  CHECK(kvaudit::sha256_hex(std::string(55, 'a')) ==
        "9f4390f8d30c2dd92ec9f095b65e2b9ae9b0a925a5258e241c9f1e910f734318");
  CHECK(kvaudit::sha256_hex(std::string(56, 'a')) ==
        "b35439a4ac6f0948b6d6f9e3c6af0f5f590ce20f1bde7090ef7970686ec6738a");
  CHECK(kvaudit::sha256_hex(std::string(64, 'a')) ==
        "ffe054fe7ae0cb6dc65c3af9b61d5209f439851db43d0ba5997337df154668eb");
}

TEST_CASE("sha256 of a file equals that of its bytes; a missing file is bad input", "[sha256]") {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "kvaudit_test_sha256";
  std::filesystem::create_directories(dir);
  const std::filesystem::path file = dir / "abc.bin";
  {
    std::ofstream out(file, std::ios::binary);
    out << "abc";
  }
  const auto digest = kvaudit::sha256_file_hex(file);
  REQUIRE(digest.ok());
  CHECK(*digest == kAbcDigest);

  const auto missing = kvaudit::sha256_file_hex(dir / "does_not_exist.h5");
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.error().kind == kvaudit::ErrorKind::kBadInput);
  CHECK(missing.error().where.find("does_not_exist.h5") != std::string::npos);
  std::filesystem::remove_all(dir);
}
