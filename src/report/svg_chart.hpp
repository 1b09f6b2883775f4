// Plain SVG charts for report.html (src/report/report_html.cpp): a heatmap, a chart on a log10
// axis (points per category, optionally joined, with limit lines and shaded columns) and a status
// timeline. Each returns one <svg> element as text.
//
// Why plain SVG written here rather than a charting library inlined into the page (Debian's
// libjs-vega or libjs-chart.js): the page must open anywhere with no network and stay readable
// for years, printed or archived with a sign-off. SVG needs no script to draw (it shows with
// JavaScript off, in a mail client's preview, in a PDF printed from the browser), adds ~0 bytes
// of library to each report instead of 300-800 kB, has no library version to track, and is
// testable as text: every mark is an element with a class (heat-cell, chart-mark, limit-line,
// timeline-cell), so a test counts them in the file and in the DOM a browser built from it.
//
// Layout is in CSS pixels in the SVG's own viewBox; colours carry meaning together with a label
// or shape (never colour alone): failing heat cells have a thick outline and their value, series
// have distinct marker shapes.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kvaudit {

// Text for XML/HTML content and attribute values: & < > " ' escaped; bytes that are not valid
// UTF-8 and control characters other than tab/newline replaced (U+FFFD / space), so that any
// string from a dump (model, producer) yields a well-formed page.
std::string xml_escape(std::string_view text);

// A log10 axis over whole decades [10^low_exp, 10^high_exp], mapped onto pixels [pixel_low,
// pixel_high] (pixel_high < pixel_low for a y axis growing upwards).
struct LogAxis {
  int low_exp = -6;
  int high_exp = 0;
  double pixel_low = 0.0;
  double pixel_high = 1.0;
  // Values outside are clamped to the ends; values <= 0 (or NaN) go to pixel_low.
  double pixel(double value) const;
  // The decades that hold every positive finite value of `values` (at least one decade; a
  // default of 1e-4..1 when there is none).
  static LogAxis fitting(const std::vector<double>& values, double pixel_low, double pixel_high);
};

// "1e-3" style label of 10^exp.
std::string decade_label(int exp);

// The fill of a heat cell: `value` against `limit`. Below the limit a sequential blue, linear in
// value / limit from the palest at 0 to the deepest at the limit (so the colour shows the headroom
// left); at or above it red. Without a limit, a log scale over value from 10^-6 to 1. 0 (exact) is
// white.
std::string heat_colour(double value, std::optional<double> limit);

struct HeatCell {
  bool measured = false;
  double value = 0.0;
  bool fail = false;
  std::string tooltip;  // plain text, shown on hover (<title>)
};

struct Heatmap {
  std::string title;  // "kernel (backend vs R8')"
  std::string id;     // data-comparison attribute: "kernel"
  std::optional<double> limit;
  std::vector<std::string> row_labels;       // layers, top to bottom
  std::vector<std::string> column_labels;    // steps, left to right
  std::vector<std::vector<HeatCell>> cells;  // [row][column]
};
// One <rect class="heat-cell"> per cell (rows x columns), not measured cells hatched grey.
std::string heatmap_svg(const Heatmap& map);

struct Series {
  std::string name;
  std::string colour;                         // CSS colour
  int shape = 0;                              // 0 circle, 1 square, 2 triangle, 3 diamond
  std::vector<std::optional<double>> values;  // per category; nullopt: no point
  std::vector<std::string> tooltips;          // per category (may be empty)
};

struct LimitLine {
  std::string label;  // "kernel limit 0.003906"
  double value = 0.0;
  std::string colour;
};

struct LogChart {
  std::string title;
  std::string id;  // data-chart attribute
  std::string y_label;
  std::vector<std::string> x_labels;  // categories
  std::vector<Series> series;
  std::vector<LimitLine> limits;
  bool join = false;          // join a series' consecutive points with a line
  std::vector<bool> shaded;   // per category: a shaded column (e.g. prefill steps)
  std::string shaded_legend;  // what the shading means
};
// One <g class="chart-mark"> per drawn point, one <line class="limit-line"> per limit.
std::string log_chart_svg(const LogChart& chart);

enum class TimelineState { kNotChecked, kIntact, kDamagedNew, kDamagedCarried };

struct TimelineCell {
  TimelineState state = TimelineState::kNotChecked;
  std::string label;    // shown in the cell when it fits (e.g. a slot count)
  std::string tooltip;  // plain text
};

struct Timeline {
  std::string title;
  std::vector<std::string> row_labels;
  std::vector<std::string> column_labels;
  std::vector<std::vector<TimelineCell>> cells;  // [row][column]
};
// One <rect class="timeline-cell"> per cell, with a legend of the states.
std::string timeline_svg(const Timeline& timeline);

}  // namespace kvaudit
