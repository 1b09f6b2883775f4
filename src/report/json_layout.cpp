// Free-form JSON objects as fields and tables (see json_layout.hpp).
#include "src/report/json_layout.hpp"

#include <algorithm>

namespace kvaudit {
namespace {

bool is_array_of_objects(const nlohmann::json& value) {
  return value.is_array() && !value.empty() &&
         std::all_of(value.begin(), value.end(),
                     [](const nlohmann::json& item) { return item.is_object(); });
}

std::vector<std::string> table_columns(const nlohmann::json& array) {
  std::vector<std::string> columns;
  for (const nlohmann::json& item : array) {
    for (const auto& [key, value] : item.items()) {
      if (std::find(columns.begin(), columns.end(), key) == columns.end()) columns.push_back(key);
    }
  }
  return columns;
}

JsonTable json_table(const std::string& name, const nlohmann::json& array) {
  JsonTable table{name, table_columns(array), {}};
  for (const nlohmann::json& item : array) {
    std::vector<std::string>& row = table.rows.emplace_back();
    for (const std::string& column : table.columns) {
      row.push_back(item.contains(column) ? json_cell_text(item.at(column)) : std::string());
    }
  }
  return table;
}

}  // namespace

std::string json_cell_text(const nlohmann::json& value) {
  return value.is_string() ? value.get<std::string>()
                           : value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

JsonObjectLayout json_object_layout(const nlohmann::json& object, JsonListings listings) {
  JsonObjectLayout layout;
  if (!object.is_object()) return layout;
  for (const auto& [key, value] : object.items()) {
    if (listings == JsonListings::kAsTables && is_array_of_objects(value)) {
      layout.tables.push_back(json_table(key, value));
    } else {
      layout.fields.emplace_back(key, json_cell_text(value));
    }
  }
  return layout;
}

}  // namespace kvaudit
