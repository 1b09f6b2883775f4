// Reading JSON objects that kvaudit wrote (report.json, shard parts) back into typed values:
// every read names its key, a missing key or a wrong type is recorded with the file and the JSON
// pointer ("part.json:/results/3/metrics/rms: expected a number ...", the first error wins) and
// reads as a default, so that a reader reads on like the writer it inverts and is checked once at
// the end; finish() refuses the keys nothing read. Numbers may be json_number's strings "nan",
// "inf", "-inf" (src/verdict/metrics.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "src/core/result.hpp"

namespace kvaudit {

// The first error met while reading one file.
struct JsonReadErrors {
  std::string where;  // the file
  std::optional<Error> first;
  void fail(const std::string& pointer, const std::string& what);
};

class JsonObjectReader {
 public:
  // `node` must outlive the reader. Not an object: an error, and it reads as an empty one.
  JsonObjectReader(const nlohmann::json& node, std::string pointer, JsonReadErrors& errors);

  bool has(const std::string& key) const { return node_.contains(key); }
  // A key the writer derives from the rest: not read, not refused.
  void skip(const std::string& key) { read_.insert(key); }

  const nlohmann::json& raw(const std::string& key);  // null when missing
  double number(const std::string& key);              // a number or "nan", "inf", "-inf"
  std::int64_t integer(const std::string& key);
  int int32(const std::string& key);
  std::size_t count(const std::string& key);               // an integer >= 0
  int int32_or_null(const std::string& key, int if_null);  // an integer, or null
  bool boolean(const std::string& key);
  std::string text(const std::string& key);
  std::vector<std::string> texts(const std::string& key);  // an array of strings
  std::vector<int> int32s(const std::string& key);         // an array of integers
  std::vector<std::int64_t> int64s(const std::string& key);
  const nlohmann::json& array(const std::string& key);  // empty when missing or no array
  JsonObjectReader object(const std::string& key);
  // The i-th element of `array` (read from `key`) as an object.
  JsonObjectReader element(const nlohmann::json& array, const std::string& key, std::size_t i);

  std::string pointer(const std::string& key) const { return pointer_ + "/" + key; }
  JsonReadErrors& errors() { return errors_; }
  // Records an unknown key (one nothing read) as the error, if there is none yet.
  void finish();

 private:
  const nlohmann::json* find(const std::string& key);
  void wrong(const std::string& key, const char* expected, const nlohmann::json& value);

  const nlohmann::json& node_;
  std::string pointer_;
  JsonReadErrors& errors_;
  std::set<std::string> read_;
};

}  // namespace kvaudit
