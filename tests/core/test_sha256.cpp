// kvaudit's SHA-256 wrapper (nettle underneath) against the examples of FIPS 180-4 / NIST CSRC
// "SHA256.pdf" (one-block "abc", two-block 448-bit message) and the empty message; the file form
// against the same digest, and a missing file as bad input.
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include "src/core/sha256.hpp"

namespace {

constexpr const char* kEmptyDigest =
    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
constexpr const char* kAbcDigest =
    "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
constexpr const char* kTwoBlockMessage = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
constexpr const char* kTwoBlockDigest =
    "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1";

}  // namespace

TEST_CASE("sha256 of the standard short messages", "[sha256]") {
  CHECK(kvaudit::sha256_hex("") == kEmptyDigest);
  CHECK(kvaudit::sha256_hex("abc") == kAbcDigest);
  CHECK(kvaudit::sha256_hex(kTwoBlockMessage) == kTwoBlockDigest);
}

TEST_CASE("sha256 fed in pieces equals one piece - finish starts over", "[sha256]") {
  kvaudit::Sha256 hasher;
  hasher.update(std::string_view(kTwoBlockMessage).substr(0, 7));
  hasher.update(std::string_view(kTwoBlockMessage).substr(7));
  CHECK(kvaudit::to_hex(hasher.finish()) == kTwoBlockDigest);
  hasher.update("abc");
  CHECK(kvaudit::to_hex(hasher.finish()) == kAbcDigest);
}

TEST_CASE("sha256 of a file equals that of its bytes - a missing file is bad input", "[sha256]") {
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
