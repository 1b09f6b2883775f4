// `kvaudit help [COMMAND]`: the help of the program, or of one command (the same text as
// `kvaudit COMMAND --help`), wrapped to the terminal.
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "src/cli/cli.hpp"

namespace kvaudit {
namespace {

// `topic`: the words naming a command ("golden record"); empty for the program.
int print_help(const CLI::App& app, const std::vector<std::string>& topic) {
  // Through the formatter: App::help() would describe the command being run, `help` itself.
  const CLI::App* page = &app;
  std::string name = app.get_name();
  for (const std::string& word : topic) {
    const CLI::App* next = nullptr;
    for (const CLI::App* sub : page->get_subcommands({})) {
      if (sub->get_name() == word) next = sub;
    }
    if (next == nullptr) return report_error(unknown_command(*page, word));
    page = next;
    name += " " + word;
  }
  std::cout << page->get_formatter()->make_help(page, name, CLI::AppFormatMode::Normal);
  return kExitPass;
}

}  // namespace

void register_help_command(CLI::App& app, CommandRunner& runner) {
  auto topic = std::make_shared<std::vector<std::string>>();
  CLI::App* cmd = add_command(
      app, "help",
      {"Print the help of kvaudit, or of one command.",
       "`kvaudit help COMMAND` prints what `kvaudit COMMAND --help` prints: what the command does, "
       "its options and its exit statuses (`kvaudit help golden record` for a command of a "
       "command).",
       "0 help printed, 2 unknown command"});
  cmd->add_option("COMMAND", *topic, "The command to describe (default: list the commands)");
  cmd->callback(
      [&app, topic, &runner] { runner = [&app, topic] { return print_help(app, *topic); }; });
}

}  // namespace kvaudit
