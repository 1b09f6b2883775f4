// Plain SVG charts (see svg_chart.hpp for what each draws and why SVG).
#include "src/report/svg_chart.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <iterator>
#include <limits>
#include <utility>

namespace kvaudit {
namespace {

using Svg = fmt::memory_buffer;

template <typename... Args>
void put(Svg& svg, fmt::format_string<Args...> format, Args&&... args) {
  fmt::format_to(std::back_inserter(svg), format, std::forward<Args>(args)...);
}

// The length of the UTF-8 sequence starting with `lead`, 0 if it cannot start one.
int utf8_length(unsigned char lead) {
  if (lead < 0x80) return 1;
  if (lead >= 0xC2 && lead <= 0xDF) return 2;
  if (lead >= 0xE0 && lead <= 0xEF) return 3;
  if (lead >= 0xF0 && lead <= 0xF4) return 4;
  return 0;
}

bool valid_utf8_at(std::string_view text, std::size_t i, int length) {
  if (length == 0 || i + length > text.size()) return false;
  for (int k = 1; k < length; ++k) {
    if ((static_cast<unsigned char>(text[i + k]) & 0xC0) != 0x80) return false;
  }
  return true;
}

// Linear interpolation between two #rrggbb colours, t in [0, 1].
std::string mix(const std::array<int, 3>& a, const std::array<int, 3>& b, double t) {
  t = std::clamp(t, 0.0, 1.0);
  auto channel = [&](int i) { return static_cast<int>(std::lround(a[i] + (b[i] - a[i]) * t)); };
  return fmt::format("#{:02x}{:02x}{:02x}", channel(0), channel(1), channel(2));
}

std::string number_label(double value) {
  if (value == 0.0) return "0";
  if (!std::isfinite(value)) return std::isnan(value) ? "nan" : "inf";
  return fmt::format("{:.2g}", value);
}

// A marker of `shape` centred at (x, y), radius r.
void marker(Svg& svg, int shape, double x, double y, double r, const std::string& colour,
            bool hollow) {
  const std::string paint =
      hollow ? fmt::format("fill=\"#ffffff\" stroke=\"{}\" stroke-width=\"2\"", colour)
             : fmt::format("fill=\"{}\" stroke=\"#222\" stroke-width=\"0.6\"", colour);
  switch (shape % 4) {
    case 0:
      put(svg, "<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"{:.1f}\" {}/>", x, y, r, paint);
      return;
    case 1:
      put(svg, "<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" {}/>", x - r,
          y - r, 2 * r, 2 * r, paint);
      return;
    case 2:
      put(svg, "<path d=\"M{:.1f},{:.1f} L{:.1f},{:.1f} L{:.1f},{:.1f} Z\" {}/>", x, y - r * 1.2,
          x + r * 1.1, y + r * 0.8, x - r * 1.1, y + r * 0.8, paint);
      return;
    default:
      put(svg, "<path d=\"M{:.1f},{:.1f} L{:.1f},{:.1f} L{:.1f},{:.1f} L{:.1f},{:.1f} Z\" {}/>", x,
          y - r * 1.3, x + r * 1.3, y, x, y + r * 1.3, x - r * 1.3, y, paint);
      return;
  }
}

constexpr const char* kFont = "font-family=\"sans-serif\"";

}  // namespace

std::string xml_escape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (std::size_t i = 0; i < text.size();) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    const int length = utf8_length(c);
    if (length > 1) {
      if (valid_utf8_at(text, i, length)) {
        out.append(text.substr(i, length));
        i += length;
      } else {
        out += "\xEF\xBF\xBD";  // U+FFFD
        ++i;
      }
      continue;
    }
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&#39;";
        break;
      case '\t':
      case '\n':
        out += static_cast<char>(c);
        break;
      default:
        if (length == 0) {
          out += "\xEF\xBF\xBD";
        } else {
          out += c < 0x20 || c == 0x7F ? ' ' : static_cast<char>(c);
        }
    }
    ++i;
  }
  return out;
}

double LogAxis::pixel(double value) const {
  if (!(value > 0.0)) return pixel_low;
  const double exp = std::clamp(std::log10(value), double(low_exp), double(high_exp));
  return pixel_low + (exp - low_exp) / double(high_exp - low_exp) * (pixel_high - pixel_low);
}

LogAxis LogAxis::fitting(const std::vector<double>& values, double pixel_low, double pixel_high) {
  double low = std::numeric_limits<double>::infinity();
  double high = 0.0;
  for (const double v : values) {
    if (!(v > 0.0) || !std::isfinite(v)) continue;
    low = std::min(low, v);
    high = std::max(high, v);
  }
  LogAxis axis{-4, 0, pixel_low, pixel_high};
  if (high > 0.0) {
    axis.low_exp = static_cast<int>(std::floor(std::log10(low)));
    axis.high_exp = static_cast<int>(std::ceil(std::log10(high)));
    if (axis.high_exp <= axis.low_exp) axis.high_exp = axis.low_exp + 1;
  }
  return axis;
}

std::string decade_label(int exp) { return exp == 0 ? "1" : fmt::format("1e{}", exp); }

std::string heat_colour(double value, std::optional<double> limit) {
  if (std::isnan(value)) return "#cb181d";
  if (value == 0.0) return "#ffffff";
  const std::array<int, 3> pale{0xef, 0xf3, 0xff};
  const std::array<int, 3> deep{0x08, 0x51, 0x9c};
  if (!limit) return mix(pale, deep, (std::log10(value) + 6.0) / 6.0);
  if (*limit <= 0.0 || value >= *limit) return "#cb181d";
  // Linear in value / limit: the share of the limit used, so a cell at half the limit is half as
  // deep and the headroom reads off the colour (a log scale put every clean kernel near the top).
  return mix(pale, deep, value / *limit);
}

// ---- heatmap -----------------------------------------------------------------------------------

namespace {

struct HeatLayout {
  double left = 44, top = 28, cell_w = 40, cell_h = 20;
  bool labels = true;  // values written in cells
};

HeatLayout heat_layout(const Heatmap& map) {
  HeatLayout layout;
  const double columns = std::max<std::size_t>(map.column_labels.size(), 1);
  const double rows = std::max<std::size_t>(map.row_labels.size(), 1);
  layout.cell_w = std::clamp(230.0 / columns, 6.0, 60.0);
  layout.cell_h = std::clamp(360.0 / rows, 5.0, 30.0);
  layout.labels = layout.cell_w >= 40 && layout.cell_h >= 16;
  return layout;
}

void heat_cell(Svg& svg, const Heatmap& map, const HeatLayout& l, std::size_t r, std::size_t c) {
  const HeatCell& cell = map.cells[r][c];
  const double x = l.left + c * l.cell_w;
  const double y = l.top + r * l.cell_h;
  const std::string fill = cell.measured ? heat_colour(cell.value, map.limit)
                                         : fmt::format("url(#hatch-{})", xml_escape(map.id));
  put(svg,
      "<rect class=\"heat-cell{}\" x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" "
      "fill=\"{}\" stroke=\"{}\" stroke-width=\"{}\"><title>{}</title></rect>",
      cell.measured ? "" : " unmeasured", x, y, l.cell_w, l.cell_h, fill,
      cell.fail ? "#000" : "#bbb", cell.fail ? 2 : 0.5, xml_escape(cell.tooltip));
  if (!l.labels || !cell.measured) return;
  const bool dark = cell.fail || (map.limit && *map.limit > 0 && cell.value / *map.limit > 0.5);
  put(svg,
      "<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"9\" text-anchor=\"middle\" {} fill=\"{}\">{}"
      "</text>",
      x + l.cell_w / 2, y + l.cell_h / 2 + 3, kFont, dark ? "#fff" : "#222",
      number_label(cell.value));
}

void heat_axes(Svg& svg, const Heatmap& map, const HeatLayout& l) {
  const std::size_t rows = map.row_labels.size();
  const std::size_t every_row = std::max<std::size_t>(1, static_cast<std::size_t>(10 / l.cell_h));
  for (std::size_t r = 0; r < rows; r += every_row) {
    put(svg, "<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"10\" text-anchor=\"end\" {}>{}</text>",
        l.left - 4, l.top + r * l.cell_h + l.cell_h / 2 + 3, kFont, xml_escape(map.row_labels[r]));
  }
  const std::size_t every_column =
      std::max<std::size_t>(1, static_cast<std::size_t>(22 / l.cell_w));
  const double bottom = l.top + rows * l.cell_h;
  for (std::size_t c = 0; c < map.column_labels.size(); c += every_column) {
    put(svg, "<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"10\" text-anchor=\"middle\" {}>{}</text>",
        l.left + c * l.cell_w + l.cell_w / 2, bottom + 12, kFont, xml_escape(map.column_labels[c]));
  }
  put(svg, "<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"10\" text-anchor=\"middle\" {}>step</text>",
      l.left + map.column_labels.size() * l.cell_w / 2, bottom + 25, kFont);
  put(svg, "<text x=\"4\" y=\"{:.1f}\" font-size=\"10\" {}>layer</text>", l.top - 6, kFont);
}

}  // namespace

std::string heatmap_svg(const Heatmap& map) {
  const HeatLayout l = heat_layout(map);
  const double width = l.left + map.column_labels.size() * l.cell_w + 10;
  const double height = l.top + map.row_labels.size() * l.cell_h + 32;
  Svg svg;
  put(svg,
      "<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"chart heatmap\" data-comparison=\"{}\" "
      "width=\"{:.0f}\" height=\"{:.0f}\" viewBox=\"0 0 {:.0f} {:.0f}\" role=\"img\" "
      "aria-label=\"{}\">",
      xml_escape(map.id), std::max(width, 160.0), height, std::max(width, 160.0), height,
      xml_escape(map.title));
  put(svg,
      "<defs><pattern id=\"hatch-{}\" width=\"6\" height=\"6\" patternUnits=\"userSpaceOnUse\" "
      "patternTransform=\"rotate(45)\"><rect width=\"6\" height=\"6\" fill=\"#e6e6e6\"/>"
      "<line x1=\"0\" y1=\"0\" x2=\"0\" y2=\"6\" stroke=\"#aaa\" stroke-width=\"2\"/></pattern>"
      "</defs>",
      xml_escape(map.id));
  put(svg, "<text x=\"4\" y=\"14\" font-size=\"12\" font-weight=\"bold\" {}>{}</text>", kFont,
      xml_escape(map.title));
  for (std::size_t r = 0; r < map.row_labels.size(); ++r) {
    for (std::size_t c = 0; c < map.column_labels.size(); ++c) heat_cell(svg, map, l, r, c);
  }
  heat_axes(svg, map, l);
  put(svg, "</svg>");
  return fmt::to_string(svg);
}

// ---- log chart ---------------------------------------------------------------------------------

namespace {

struct ChartFrame {
  double left = 64, right = 190, top = 30, bottom = 46, width = 760, height = 300;
  double plot_w() const { return width - left - right; }
  double plot_h() const { return height - top - bottom; }
  double x_of(std::size_t i, std::size_t n) const {
    return left + (n <= 1 ? plot_w() / 2 : plot_w() * (i + 0.5) / n);
  }
};

LogAxis chart_axis(const LogChart& chart, const ChartFrame& f) {
  std::vector<double> values;
  for (const Series& s : chart.series) {
    for (const auto& v : s.values) {
      if (v) values.push_back(*v);
    }
  }
  for (const LimitLine& limit : chart.limits) values.push_back(limit.value);
  return LogAxis::fitting(values, f.top + f.plot_h(), f.top);
}

void chart_grid(Svg& svg, const LogChart& chart, const ChartFrame& f, const LogAxis& axis) {
  const std::size_t n = chart.x_labels.size();
  for (std::size_t i = 0; i < chart.shaded.size() && i < n; ++i) {
    if (!chart.shaded[i]) continue;
    const double w = f.plot_w() / std::max<std::size_t>(n, 1);
    put(svg,
        "<rect class=\"shaded-column\" x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" "
        "height=\"{:.1f}\" fill=\"#fff3c4\"/>",
        f.x_of(i, n) - w / 2, f.top, w, f.plot_h());
  }
  for (int e = axis.low_exp; e <= axis.high_exp; ++e) {
    const double y = axis.pixel(std::pow(10.0, e));
    put(svg,
        "<line x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#ddd\"/>"
        "<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"10\" text-anchor=\"end\" {}>{}</text>",
        f.left, y, f.left + f.plot_w(), y, f.left - 4, y + 3, kFont, decade_label(e));
  }
  const std::size_t every = std::max<std::size_t>(1, n / 24 + (n % 24 != 0 ? 1 : 0));
  for (std::size_t i = 0; i < n; i += every) {
    put(svg, "<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"10\" text-anchor=\"middle\" {}>{}</text>",
        f.x_of(i, n), f.top + f.plot_h() + 14, kFont, xml_escape(chart.x_labels[i]));
  }
  put(svg,
      "<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" fill=\"none\" "
      "stroke=\"#888\"/>",
      f.left, f.top, f.plot_w(), f.plot_h());
  put(svg,
      "<text x=\"14\" y=\"{:.1f}\" font-size=\"11\" transform=\"rotate(-90 14 {:.1f})\" "
      "text-anchor=\"middle\" {}>{}</text>",
      f.top + f.plot_h() / 2, f.top + f.plot_h() / 2, kFont, xml_escape(chart.y_label));
}

// Limit lines, their labels pushed apart (12 px at least) where limits are close.
void chart_limits(Svg& svg, const LogChart& chart, const ChartFrame& f, const LogAxis& axis) {
  std::vector<LimitLine> limits = chart.limits;
  std::sort(limits.begin(), limits.end(),
            [](const LimitLine& a, const LimitLine& b) { return a.value > b.value; });
  double last_label = -1e9;
  for (const LimitLine& limit : limits) {
    const double y = axis.pixel(limit.value);
    const double label_y = std::max(y + 3, last_label + 12);
    last_label = label_y;
    put(svg,
        "<line class=\"limit-line\" x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" "
        "stroke=\"{}\" stroke-width=\"1.5\" stroke-dasharray=\"6 4\"><title>{}</title></line>"
        "<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"10\" fill=\"{}\" {}>{}</text>",
        f.left, y, f.left + f.plot_w(), y, limit.colour, xml_escape(limit.label),
        f.left + f.plot_w() + 4, label_y, limit.colour, kFont, xml_escape(limit.label));
  }
}

// Each series a few pixels to the side of the category's centre, so that equal values (total =
// quantization when the kernel adds little) stay visible side by side.
void chart_series(Svg& svg, const LogChart& chart, const ChartFrame& f, const LogAxis& axis) {
  const std::size_t n = chart.x_labels.size();
  const double spread = std::min(8.0, f.plot_w() / std::max<std::size_t>(n, 1) / 6.0);
  for (std::size_t k = 0; k < chart.series.size(); ++k) {
    const Series& s = chart.series[k];
    const double dx = (k - (chart.series.size() - 1) / 2.0) * spread;
    if (chart.join) {
      std::string points;
      for (std::size_t i = 0; i < s.values.size() && i < n; ++i) {
        if (s.values[i]) {
          points += fmt::format("{:.1f},{:.1f} ", f.x_of(i, n) + dx, axis.pixel(*s.values[i]));
        }
      }
      put(svg, "<polyline points=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"1.5\"/>", points,
          s.colour);
    }
    for (std::size_t i = 0; i < s.values.size() && i < n; ++i) {
      if (!s.values[i]) continue;
      const double v = *s.values[i];
      put(svg, "<g class=\"chart-mark\" data-series=\"{}\">", xml_escape(s.name));
      marker(svg, s.shape, f.x_of(i, n) + dx, axis.pixel(v), 4.5, s.colour, !(v > 0.0));
      const std::string tip = i < s.tooltips.size() ? s.tooltips[i] : s.name;
      put(svg, "<title>{}</title></g>", xml_escape(tip));
    }
  }
}

void chart_legend(Svg& svg, const LogChart& chart, const ChartFrame& f) {
  double y = f.top + f.plot_h() + 34;
  double x = f.left;
  for (const Series& s : chart.series) {
    marker(svg, s.shape, x + 5, y - 4, 4.5, s.colour, false);
    put(svg, "<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"11\" {}>{}</text>", x + 14, y, kFont,
        xml_escape(s.name));
    x += 24 + 7.0 * s.name.size();
  }
  if (!chart.shaded_legend.empty()) {
    put(svg,
        "<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"12\" height=\"10\" fill=\"#fff3c4\" "
        "stroke=\"#ccc\"/><text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"11\" {}>{}</text>",
        x, y - 9, x + 16, y, kFont, xml_escape(chart.shaded_legend));
  }
}

}  // namespace

std::string log_chart_svg(const LogChart& chart) {
  const ChartFrame f;
  const LogAxis axis = chart_axis(chart, f);
  Svg svg;
  put(svg,
      "<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"chart log-chart\" data-chart=\"{}\" "
      "width=\"{:.0f}\" height=\"{:.0f}\" viewBox=\"0 0 {:.0f} {:.0f}\" role=\"img\" "
      "aria-label=\"{}\">",
      xml_escape(chart.id), f.width, f.height, f.width, f.height, xml_escape(chart.title));
  put(svg, "<text x=\"{:.1f}\" y=\"16\" font-size=\"12\" font-weight=\"bold\" {}>{}</text>", f.left,
      kFont, xml_escape(chart.title));
  chart_grid(svg, chart, f, axis);
  chart_limits(svg, chart, f, axis);
  chart_series(svg, chart, f, axis);
  chart_legend(svg, chart, f);
  put(svg, "</svg>");
  return fmt::to_string(svg);
}

// ---- timeline ----------------------------------------------------------------------------------

namespace {

const char* timeline_fill(TimelineState state) {
  switch (state) {
    case TimelineState::kNotChecked:
      return "#f0f0f0";
    case TimelineState::kIntact:
      return "#a1d99b";
    case TimelineState::kDamagedNew:
      return "#de2d26";
    case TimelineState::kDamagedCarried:
      return "#fd8d3c";
  }
  return "#f0f0f0";
}

void timeline_legend(Svg& svg, double y) {
  const std::array<std::pair<TimelineState, const char*>, 4> states{{
      {TimelineState::kIntact, "intact"},
      {TimelineState::kDamagedNew, "damaged at this step"},
      {TimelineState::kDamagedCarried, "damage carried from an earlier step"},
      {TimelineState::kNotChecked, "not checked"},
  }};
  double x = 8;
  for (const auto& [state, text] : states) {
    put(svg,
        "<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"12\" height=\"10\" fill=\"{}\" stroke=\"#999\"/>"
        "<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"11\" {}>{}</text>",
        x, y - 9, timeline_fill(state), x + 16, y, kFont, text);
    x += 30 + 6.2 * std::string_view(text).size();
  }
}

}  // namespace

std::string timeline_svg(const Timeline& timeline) {
  const double left = 150, top = 26;
  const double columns = std::max<std::size_t>(timeline.column_labels.size(), 1);
  const double rows = std::max<std::size_t>(timeline.row_labels.size(), 1);
  const double cell_w = std::clamp(560.0 / columns, 6.0, 56.0);
  const double cell_h = std::clamp(420.0 / rows, 5.0, 20.0);
  const double width = std::max(left + columns * cell_w + 10, 620.0);
  const double height = top + rows * cell_h + 46;
  Svg svg;
  put(svg,
      "<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"chart timeline\" width=\"{:.0f}\" "
      "height=\"{:.0f}\" viewBox=\"0 0 {:.0f} {:.0f}\" role=\"img\" aria-label=\"{}\">",
      width, height, width, height, xml_escape(timeline.title));
  put(svg, "<text x=\"4\" y=\"14\" font-size=\"12\" font-weight=\"bold\" {}>{}</text>", kFont,
      xml_escape(timeline.title));
  for (std::size_t r = 0; r < timeline.row_labels.size(); ++r) {
    const double y = top + r * cell_h;
    if (cell_h >= 9) {
      put(svg, "<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"10\" text-anchor=\"end\" {}>{}</text>",
          left - 4, y + cell_h / 2 + 3, kFont, xml_escape(timeline.row_labels[r]));
    }
    for (std::size_t c = 0; c < timeline.column_labels.size(); ++c) {
      const TimelineCell& cell = timeline.cells[r][c];
      const double x = left + c * cell_w;
      put(svg,
          "<rect class=\"timeline-cell\" x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" "
          "height=\"{:.1f}\" fill=\"{}\" stroke=\"#fff\"><title>{}</title></rect>",
          x, y, cell_w, cell_h, timeline_fill(cell.state), xml_escape(cell.tooltip));
      if (!cell.label.empty() && cell_w >= 30 && cell_h >= 14) {
        put(svg,
            "<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"9\" text-anchor=\"middle\" {}>{}</text>",
            x + cell_w / 2, y + cell_h / 2 + 3, kFont, xml_escape(cell.label));
      }
    }
  }
  const std::size_t every = std::max<std::size_t>(1, static_cast<std::size_t>(22 / cell_w));
  for (std::size_t c = 0; c < timeline.column_labels.size(); c += every) {
    put(svg, "<text x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"10\" text-anchor=\"middle\" {}>{}</text>",
        left + c * cell_w + cell_w / 2, top + rows * cell_h + 12, kFont,
        xml_escape(timeline.column_labels[c]));
  }
  timeline_legend(svg, top + rows * cell_h + 36);
  put(svg, "</svg>");
  return fmt::to_string(svg);
}

}  // namespace kvaudit
