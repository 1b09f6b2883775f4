// Ed25519 through nettle (src/core/ed25519.hpp) against RFC 8032 section 7.1's test vectors 1
// (empty message) and 2 (one byte), and kvaudit's key files: a generated pair written and read
// back signs what its public key verifies, the private key file is mode 0600, an existing key
// is never overwritten, and a file that is no key is refused naming it.
#include <sys/stat.h>

#include <array>
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <string>

#include "src/core/ed25519.hpp"
#include "tests/test_paths.hpp"

namespace {

std::array<std::uint8_t, 32> seed_from_hex(const std::string& hex) {
  const kvaudit::Result<kvaudit::Ed25519PublicKey> bytes = kvaudit::public_key_from_hex(hex, "");
  REQUIRE(bytes.ok());
  return *bytes;
}

std::filesystem::path fresh_dir(const std::string& name) {
  const std::filesystem::path dir = kvaudit_test::test_tmpdir() / name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

}  // namespace

TEST_CASE("ed25519 signs as RFC 8032's test vectors 1 and 2", "[ed25519]") {
  struct Vector {
    const char* secret;
    const char* public_key;
    std::string message;
    const char* signature;
  };
  const Vector vectors[] = {
      {"9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60",
       "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a", "",
       "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555fb8821590a33bacc61e3970"
       "1cf9b46bd25bf5f0595bbe24655141438e7a100b"},
      {"4ccd089b28ff96da9db6c346ec114e0f5b8a319f35aba624da8cf6ed4fb8a6fb",
       "3d4017c3e843895a92b70aa74d1b7ebc9c982ccf2ec4968cc0cd55f12af4660c", "\x72",
       "92a009a9f0d4cab8720e820b5f642540a2b27b5416503f8fb3762223ebdb69da085ac1e43e15996e458f3613"
       "d0f11d8c387b2eaeb4302aeeb00d291612bb0c00"},
  };
  for (const Vector& v : vectors) {
    const kvaudit::Ed25519KeyPair key = kvaudit::ed25519_key_pair(seed_from_hex(v.secret));
    CHECK(kvaudit::bytes_hex(key.public_key) == v.public_key);
    const kvaudit::Ed25519Signature signature = kvaudit::ed25519_sign(key, v.message);
    CHECK(kvaudit::bytes_hex(signature) == v.signature);
    CHECK(kvaudit::ed25519_verify(key.public_key, v.message, signature));
    CHECK_FALSE(kvaudit::ed25519_verify(key.public_key, v.message + "x", signature));
  }
}

TEST_CASE("key files: generated, written, read back, never overwritten", "[ed25519]") {
  const std::filesystem::path dir = fresh_dir("ed25519_keys");
  const kvaudit::Result<kvaudit::Ed25519KeyPair> key = kvaudit::ed25519_generate();
  REQUIRE(key.ok());
  REQUIRE(kvaudit::write_key_files(*key, dir / "key", dir / "key.pub").ok());

  struct stat info {};
  REQUIRE(::stat((dir / "key").c_str(), &info) == 0);
  CHECK((info.st_mode & 0777) == 0600);

  const kvaudit::Result<kvaudit::Ed25519KeyPair> read = kvaudit::read_private_key_file(dir / "key");
  REQUIRE(read.ok());
  CHECK(read->public_key == key->public_key);
  const kvaudit::Result<kvaudit::Ed25519PublicKey> public_key =
      kvaudit::read_public_key((dir / "key.pub").string(), "--public-key");
  REQUIRE(public_key.ok());
  CHECK(*public_key == key->public_key);
  const kvaudit::Result<kvaudit::Ed25519PublicKey> from_hex =
      kvaudit::read_public_key(kvaudit::bytes_hex(key->public_key), "--public-key");
  REQUIRE(from_hex.ok());
  CHECK(*from_hex == key->public_key);
  CHECK(kvaudit::ed25519_verify(*public_key, "report", kvaudit::ed25519_sign(*read, "report")));

  // Another key: its signature does not verify under the first key.
  const kvaudit::Result<kvaudit::Ed25519KeyPair> other = kvaudit::ed25519_generate();
  REQUIRE(other.ok());
  CHECK(other->public_key != key->public_key);
  CHECK_FALSE(
      kvaudit::ed25519_verify(key->public_key, "report", kvaudit::ed25519_sign(*other, "report")));

  const kvaudit::Status again = kvaudit::write_key_files(*other, dir / "key", dir / "other.pub");
  REQUIRE_FALSE(again.ok());
  CHECK_THAT(again.error().message(), Catch::Contains("key: exists already"));
  CHECK_FALSE(std::filesystem::exists(dir / "other.pub"));
  CHECK(kvaudit::read_private_key_file(dir / "key")->public_key == key->public_key);

  std::ofstream(dir / "not_a_key") << "hello\n";
  const kvaudit::Result<kvaudit::Ed25519KeyPair> bad =
      kvaudit::read_private_key_file(dir / "not_a_key");
  REQUIRE_FALSE(bad.ok());
  CHECK_THAT(bad.error().message(), Catch::Contains("not_a_key: not a kvaudit key file"));
}
