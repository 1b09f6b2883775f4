// kvaudit's SHA-256 wrapper (nettle underneath) against the examples of FIPS 180-4 / NIST CSRC
// "SHA256.pdf" (one-block "abc", two-block 448-bit message) and the empty message; the file form
// against the same digest, and a missing file as bad input.
#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
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

TEST_CASE("sha256 of a file on its own thread: the same digest, and the same error", "[sha256]") {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / "kvaudit_test_sha256_async";
  std::filesystem::create_directories(dir);
  const std::filesystem::path file = dir / "two_block.bin";
  {
    std::ofstream out(file, std::ios::binary);
    out << kTwoBlockMessage;
  }
  std::future<kvaudit::Result<std::string>> digest = kvaudit::sha256_file_hex_async(file);
  // Started at once on a thread, not deferred until get().
  CHECK(digest.wait_for(std::chrono::seconds(0)) != std::future_status::deferred);
  const kvaudit::Result<std::string> got = digest.get();
  REQUIRE(got.ok());
  CHECK(*got == kTwoBlockDigest);

  const std::filesystem::path missing_file = dir / "does_not_exist.h5";
  const kvaudit::Result<std::string> missing = kvaudit::sha256_file_hex_async(missing_file).get();
  const kvaudit::Result<std::string> missing_now = kvaudit::sha256_file_hex(missing_file);
  REQUIRE_FALSE(missing.ok());
  REQUIRE_FALSE(missing_now.ok());
  CHECK(missing.error().kind == kvaudit::ErrorKind::kBadInput);
  CHECK(missing.error().where == missing_now.error().where);
  CHECK(missing.error().message() == missing_now.error().message());
  std::filesystem::remove_all(dir);
}
