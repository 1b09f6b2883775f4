// What the machine can hold (src/core/memory_budget.hpp): KVAUDIT_MEMORY_BUDGET's syntax, the size
// wording of messages, and the refusal of a size above the budget with both sizes named.
#include <stdlib.h>

#include <catch2/catch.hpp>
#include <string>

#include "src/core/memory_budget.hpp"

namespace kvaudit {
namespace {

TEST_CASE("parse_byte_count reads bytes and K/M/G/T suffixes", "[memory]") {
  CHECK(parse_byte_count("123") == 123.0);
  CHECK(parse_byte_count("64K") == 65536.0);
  CHECK(parse_byte_count("512M") == 512.0 * 1048576.0);
  CHECK(parse_byte_count("1.5g") == 1.5 * 1073741824.0);
  CHECK(parse_byte_count("2T") == 2.0 * 1099511627776.0);
  CHECK_FALSE(parse_byte_count(""));
  CHECK_FALSE(parse_byte_count("G"));
  CHECK_FALSE(parse_byte_count("-1G"));
  CHECK_FALSE(parse_byte_count("12X"));
  CHECK_FALSE(parse_byte_count("inf"));
}

TEST_CASE("format_bytes names sizes in binary units", "[memory]") {
  CHECK(format_bytes(512) == "512 B");
  CHECK(format_bytes(1536) == "1.5 KiB");
  CHECK(format_bytes(6.3 * 1073741824.0) == "6.3 GiB");
  CHECK(format_bytes(3.0 * 1099511627776.0 * 1024.0) == "3.07e+03 TiB");
}

TEST_CASE("check_memory_fits refuses a size above KVAUDIT_MEMORY_BUDGET, naming both", "[memory]") {
  REQUIRE(setenv("KVAUDIT_MEMORY_BUDGET", "1G", 1) == 0);
  CHECK(available_memory_bytes() == 1073741824.0);
  CHECK(check_memory_fits(1000.0, "synth", "a pool").ok());
  const Status refused = check_memory_fits(6.3 * 1073741824.0, "synth", "a pool");
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.error().kind == ErrorKind::kBadInput);
  CHECK(refused.error().message() ==
        "synth: needs about 6.3 GiB of memory (a pool); 1 GiB is available");
  unsetenv("KVAUDIT_MEMORY_BUDGET");
  // Without the override: the machine's own figure, which is some positive amount.
  const auto machine = available_memory_bytes();
  REQUIRE(machine);
  CHECK(*machine > 0);
}

TEST_CASE("check_disk_fits refuses a file larger than the folder's free space", "[memory]") {
  CHECK(check_disk_fits(1.0, ".", "synth", "the dump").ok());
  const Status refused = check_disk_fits(1e30, ".", "synth", "the dump out.h5");
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.error().message().rfind("synth: needs about ", 0) == 0);
  CHECK(refused.error().message().find("of disk space (the dump out.h5)") != std::string::npos);
}

}  // namespace
}  // namespace kvaudit
