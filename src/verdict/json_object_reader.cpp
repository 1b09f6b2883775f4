// Typed reads of kvaudit's own JSON (see json_object_reader.hpp).
#include "src/verdict/json_object_reader.hpp"

#include <fmt/format.h>

#include <limits>

namespace kvaudit {
namespace {

const nlohmann::json& empty_object() {
  static const nlohmann::json value = nlohmann::json::object();
  return value;
}

const nlohmann::json& empty_array() {
  static const nlohmann::json value = nlohmann::json::array();
  return value;
}

const nlohmann::json& null_value() {
  static const nlohmann::json value;
  return value;
}

}  // namespace

void JsonReadErrors::fail(const std::string& pointer, const std::string& what) {
  if (!first) first = bad_input(where + ":" + (pointer.empty() ? "/" : pointer), what);
}

JsonObjectReader::JsonObjectReader(const nlohmann::json& node, std::string pointer,
                                   JsonReadErrors& errors)
    : node_(node.is_object() ? node : empty_object()),
      pointer_(std::move(pointer)),
      errors_(errors) {
  if (!node.is_object()) {
    errors_.fail(pointer_, fmt::format("expected an object, got {}", node.type_name()));
  }
}

const nlohmann::json* JsonObjectReader::find(const std::string& key) {
  read_.insert(key);
  const auto it = node_.find(key);
  if (it != node_.end()) return &*it;
  errors_.fail(pointer_.empty() ? "/" : pointer_, fmt::format("missing key {}", key));
  return nullptr;
}

void JsonObjectReader::wrong(const std::string& key, const char* expected,
                             const nlohmann::json& value) {
  errors_.fail(pointer(key), fmt::format("expected {}, got {}", expected, value.dump()));
}

const nlohmann::json& JsonObjectReader::raw(const std::string& key) {
  const nlohmann::json* value = find(key);
  return value ? *value : null_value();
}

double JsonObjectReader::number(const std::string& key) {
  const nlohmann::json* value = find(key);
  if (value == nullptr) return 0.0;
  if (value->is_number()) return value->get<double>();
  if (*value == "nan") return std::numeric_limits<double>::quiet_NaN();
  if (*value == "inf") return std::numeric_limits<double>::infinity();
  if (*value == "-inf") return -std::numeric_limits<double>::infinity();
  wrong(key, "a number (or \"nan\", \"inf\", \"-inf\")", *value);
  return 0.0;
}

std::int64_t JsonObjectReader::integer(const std::string& key) {
  const nlohmann::json* value = find(key);
  if (value == nullptr) return 0;
  if (value->is_number_integer()) return value->get<std::int64_t>();
  wrong(key, "an integer", *value);
  return 0;
}

int JsonObjectReader::int32(const std::string& key) {
  const std::int64_t value = integer(key);
  if (value < std::numeric_limits<int>::min() || value > std::numeric_limits<int>::max()) {
    errors_.fail(pointer(key), "expected a 32-bit integer");
    return 0;
  }
  return static_cast<int>(value);
}

std::size_t JsonObjectReader::count(const std::string& key) {
  const std::int64_t value = integer(key);
  if (value >= 0) return static_cast<std::size_t>(value);
  errors_.fail(pointer(key), "expected an integer >= 0");
  return 0;
}

int JsonObjectReader::int32_or_null(const std::string& key, int if_null) {
  const nlohmann::json* value = find(key);
  if (value == nullptr || value->is_null()) return if_null;
  return int32(key);
}

bool JsonObjectReader::boolean(const std::string& key) {
  const nlohmann::json* value = find(key);
  if (value == nullptr) return false;
  if (value->is_boolean()) return value->get<bool>();
  wrong(key, "true or false", *value);
  return false;
}

std::string JsonObjectReader::text(const std::string& key) {
  const nlohmann::json* value = find(key);
  if (value == nullptr) return "";
  if (value->is_string()) return value->get<std::string>();
  wrong(key, "a string", *value);
  return "";
}

std::vector<std::string> JsonObjectReader::texts(const std::string& key) {
  std::vector<std::string> values;
  const nlohmann::json& items = array(key);
  for (std::size_t i = 0; i < items.size(); ++i) {
    if (items[i].is_string()) {
      values.push_back(items[i].get<std::string>());
    } else {
      errors_.fail(fmt::format("{}/{}", pointer(key), i), "expected a string");
    }
  }
  return values;
}

namespace {

// The integers of an array, each checked to fit T.
template <typename T>
std::vector<T> integers_of(const nlohmann::json& items, const std::string& pointer,
                           JsonReadErrors& errors) {
  std::vector<T> values;
  for (std::size_t i = 0; i < items.size(); ++i) {
    const bool fits = items[i].is_number_integer() &&
                      items[i].get<std::int64_t>() >= std::numeric_limits<T>::min() &&
                      items[i].get<std::int64_t>() <= std::numeric_limits<T>::max();
    if (fits) {
      values.push_back(static_cast<T>(items[i].get<std::int64_t>()));
    } else {
      errors.fail(fmt::format("{}/{}", pointer, i), "expected an integer");
    }
  }
  return values;
}

}  // namespace

std::vector<int> JsonObjectReader::int32s(const std::string& key) {
  return integers_of<int>(array(key), pointer(key), errors_);
}

std::vector<std::int64_t> JsonObjectReader::int64s(const std::string& key) {
  return integers_of<std::int64_t>(array(key), pointer(key), errors_);
}

const nlohmann::json& JsonObjectReader::array(const std::string& key) {
  const nlohmann::json* value = find(key);
  if (value != nullptr && value->is_array()) return *value;
  if (value != nullptr) wrong(key, "an array", *value);
  return empty_array();
}

JsonObjectReader JsonObjectReader::object(const std::string& key) {
  return JsonObjectReader(raw(key), pointer(key), errors_);
}

JsonObjectReader JsonObjectReader::element(const nlohmann::json& array, const std::string& key,
                                           std::size_t i) {
  return JsonObjectReader(array[i], fmt::format("{}/{}", pointer(key), i), errors_);
}

void JsonObjectReader::finish() {
  for (const auto& item : node_.items()) {
    if (read_.count(item.key()) == 0) {
      errors_.fail(pointer(item.key()), "unknown key (this kvaudit does not write it)");
    }
  }
}

}  // namespace kvaudit
