// The canonical bytes of a report and their SHA-256 (see report_digest.hpp).
#include "src/verdict/report_digest.hpp"

#include "src/core/sha256.hpp"

namespace kvaudit {

std::string canonical_report_bytes(const nlohmann::json& report) {
  nlohmann::json covered = report;
  if (covered.is_object()) {
    covered.erase("timing");
    covered.erase("checksum");
    if (covered.contains("signoff") && covered["signoff"].is_object()) {
      covered["signoff"].erase("digest");
    }
  }
  // nlohmann::json's objects are std::maps: dump() writes their keys in sorted order.
  return covered.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string report_digest(const nlohmann::json& report) {
  return sha256_hex(canonical_report_bytes(report));
}

}  // namespace kvaudit
