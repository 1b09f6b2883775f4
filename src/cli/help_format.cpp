// Help text wrapped to the terminal (src/cli/cli.hpp): a CLI11 formatter whose descriptions,
// option lists and command list are wrapped to one width, commands listed by their one-sentence
// summary, and positionals shown by their name alone (DUMP, not DUMP TEXT).
#include <fmt/format.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "src/cli/cli.hpp"

namespace kvaudit {
namespace {

constexpr std::size_t kMinWidth = 40;
constexpr std::size_t kMaxWidth = 120;  // longer lines are hard to read, whatever the terminal
constexpr std::size_t kDefaultWidth = 80;

// The words of one paragraph packed into lines of at most `width` characters (a longer word, e.g.
// a path, gets a line of its own).
std::vector<std::string> pack_words(const std::string& paragraph, std::size_t width) {
  std::vector<std::string> lines;
  std::istringstream words(paragraph);
  std::string word;
  std::string line;
  while (words >> word) {
    if (!line.empty() && line.size() + 1 + word.size() > width) {
      lines.push_back(line);
      line.clear();
    }
    line += (line.empty() ? "" : " ") + word;
  }
  if (!line.empty() || lines.empty()) lines.push_back(line);
  return lines;
}

// The first paragraph of a command's description: its summary.
std::string summary_of(const std::string& description) {
  return description.substr(0, description.find('\n'));
}

class WrappingFormatter : public CLI::Formatter {
 public:
  explicit WrappingFormatter(std::size_t width) : width_(width) {
    column_width(std::clamp<std::size_t>(width / 3, 16, 30));
    label("SUBCOMMAND", "COMMAND");
  }

  // Paragraphs wrapped, a blank line between them.
  std::string make_description(const CLI::App* app) const override {
    const std::string description = app->get_description();
    if (description.empty()) return {};
    std::string text;
    std::istringstream paragraphs(description);
    std::string paragraph;
    while (std::getline(paragraphs, paragraph)) {
      if (!text.empty()) text += "\n";
      text += wrap_text(paragraph, width_) + "\n";
    }
    return text + "\n";
  }

  std::string make_footer(const CLI::App* app) const override {
    const std::string footer = app->get_footer();
    return footer.empty() ? std::string() : wrap_text(footer, width_) + "\n";
  }

  std::string make_subcommand(const CLI::App* sub) const override {
    return two_columns("  " + sub->get_display_name(true), summary_of(sub->get_description()));
  }

  std::string make_option(const CLI::Option* option, bool is_positional) const override {
    return two_columns("  " + make_option_name(option, is_positional) + make_option_opts(option),
                       make_option_desc(option));
  }

  // A positional's name is its placeholder already: no type after it.
  std::string make_option_opts(const CLI::Option* option) const override {
    if (option->get_positional()) return option->get_required() ? " (required)" : "";
    return CLI::Formatter::make_option_opts(option);
  }

 private:
  // `left` in the first column (on a line of its own when too wide), `right` wrapped beside it.
  std::string two_columns(const std::string& left, const std::string& right) const {
    const std::size_t column = get_column_width();
    const std::vector<std::string> lines = pack_words(right, width_ - column);
    std::string text = left;
    if (left.size() + 1 > column) {
      text += "\n" + std::string(column, ' ');
    } else {
      text += std::string(column - left.size(), ' ');
    }
    for (std::size_t i = 0; i < lines.size(); ++i) {
      if (i > 0) text += "\n" + std::string(column, ' ');
      text += lines[i];
    }
    // Trailing blanks of an empty description.
    text.erase(text.find_last_not_of(' ') + 1);
    return text + "\n";
  }

  std::size_t width_;
};

}  // namespace

std::size_t help_width() {
  std::size_t width = 0;
  if (const char* columns = std::getenv("COLUMNS"); columns != nullptr) {
    width = static_cast<std::size_t>(std::strtoul(columns, nullptr, 10));
  }
  winsize size{};
  if (width == 0 && isatty(STDOUT_FILENO) && ioctl(STDOUT_FILENO, TIOCGWINSZ, &size) == 0) {
    width = size.ws_col;
  }
  if (width == 0) width = kDefaultWidth;
  return std::clamp(width, kMinWidth, kMaxWidth);
}

void use_wrapping_help(CLI::App& app, std::size_t width) {
  app.formatter(std::make_shared<WrappingFormatter>(width));
}

std::string wrap_text(const std::string& text, std::size_t width, std::size_t first_indent,
                      std::size_t indent) {
  std::string wrapped;
  std::istringstream paragraphs(text);
  std::string paragraph;
  bool first_line = true;
  while (std::getline(paragraphs, paragraph)) {
    const std::size_t first_width = width - (first_line ? first_indent : indent);
    std::vector<std::string> lines = pack_words(paragraph, std::max<std::size_t>(first_width, 10));
    // Lines after the first of a paragraph are indented by `indent`: repack them to that width.
    if (lines.size() > 1 && first_width != width - indent) {
      std::string rest;
      for (std::size_t i = 1; i < lines.size(); ++i) rest += (i > 1 ? " " : "") + lines[i];
      std::vector<std::string> repacked =
          pack_words(rest, std::max<std::size_t>(width - indent, 10));
      lines.resize(1);
      lines.insert(lines.end(), repacked.begin(), repacked.end());
    }
    for (const std::string& line : lines) {
      if (!wrapped.empty()) wrapped += "\n";
      wrapped += std::string(first_line ? first_indent : indent, ' ') + line;
      first_line = false;
    }
  }
  return wrapped;
}

}  // namespace kvaudit
