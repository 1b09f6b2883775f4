// `kvaudit keygen --out FILE`: make an Ed25519 key pair for signing sign-off reports
// (src/core/ed25519.hpp): the private key in FILE (mode 0600), the public key in FILE.pub, and
// the public key printed. Neither file is ever overwritten. Randomness from getrandom(2).
// Exit status: 0 written, 2 bad input (a file exists, a folder that cannot be written), 3 internal
// error.
#include <fmt/format.h>
#include <fmt/ostream.h>

#include <iostream>
#include <memory>
#include <string>

#include "src/cli/cli.hpp"
#include "src/core/ed25519.hpp"

namespace kvaudit {
namespace {

Result<int> keygen(const std::string& out) {
  const std::string public_path = out + ".pub";
  KVAUDIT_ASSIGN_OR_RETURN(const Ed25519KeyPair key, ed25519_generate());
  KVAUDIT_TRY(write_key_files(key, out, public_path));
  fmt::print(std::cout,
             "private key: {} (mode 0600: keep it to yourself; kvaudit check --signoff "
             "--signing-key {})\npublic key:  {} (give it to whoever verifies: kvaudit "
             "verify-report DIR --public-key {})\n{} {}\n",
             out, out, public_path, public_path, kSignatureAlgorithm, bytes_hex(key.public_key));
  return kExitPass;
}

}  // namespace

void register_keygen_command(CLI::App& app, CommandRunner& runner) {
  auto out = std::make_shared<std::string>();
  CLI::App* cmd = add_command(
      app, "keygen",
      {"Make an Ed25519 key pair for signing sign-off reports.",
       "Writes the private key to FILE (mode 0600) and the public key to FILE.pub, one line of "
       "hex each, and prints the public key. Neither file is overwritten. Sign with kvaudit check "
       "--signoff --signing-key FILE (or kvaudit merge --signing-key FILE); whoever checks a "
       "report runs kvaudit verify-report DIR --public-key FILE.pub.",
       "0 written, 2 bad input (a key file exists, a folder that cannot be written), 3 internal "
       "error"});
  add_output_path(*cmd, "--out", *out, OutputKind::kFile,
                  "The private key file to write (FILE.pub gets the public key)")
      ->required();
  cmd->callback([out, &runner] {
    runner = [out] {
      const Result<int> status = keygen(*out);
      return status.ok() ? *status : report_error(status.error());
    };
  });
}

}  // namespace kvaudit
