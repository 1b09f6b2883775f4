// The report's free-form JSON objects (the dump's summary, the backend's description: what the
// replay and the backend say about themselves, kept as written) laid out for people, once for
// report.md and report.html (src/report/report.hpp, report_html.hpp), which add only markup.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

namespace kvaudit {

// A value as a cell shows it: a string as itself, anything else as compact JSON (bytes that are
// not UTF-8 replaced).
std::string json_cell_text(const nlohmann::json& value);

// An array of objects as a table: one column per key (first-seen order), one row per object, ""
// where an object lacks a column's key.
struct JsonTable {
  std::string name;  // the key of the array
  std::vector<std::string> columns;
  std::vector<std::vector<std::string>> rows;
};

// Whether a non-empty array of objects gets a table of its own or stays a field.
enum class JsonListings { kAsFields, kAsTables };

// An object's members in order as (key, json_cell_text) fields; with kAsTables each non-empty
// array of objects becomes a table instead. Not an object: nothing.
struct JsonObjectLayout {
  std::vector<std::pair<std::string, std::string>> fields;
  std::vector<JsonTable> tables;
};
JsonObjectLayout json_object_layout(const nlohmann::json& object, JsonListings listings);

}  // namespace kvaudit
