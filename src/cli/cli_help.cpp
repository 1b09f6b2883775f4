// `kvaudit help [COMMAND]`: the help of the program, or of one command (the same text as
// `kvaudit COMMAND --help`), wrapped to the terminal.
#include <iostream>
#include <memory>
#include <string>

#include "src/cli/cli.hpp"

namespace kvaudit {
namespace {

int print_help(const CLI::App& app, const std::string& topic) {
  // Through the formatter: App::help() would describe the command being run, `help` itself.
  if (topic.empty()) {
    std::cout << app.get_formatter()->make_help(&app, app.get_name(), CLI::AppFormatMode::Normal);
    return kExitPass;
  }
  for (const CLI::App* sub : app.get_subcommands({})) {
    if (sub->get_name() == topic) {
      std::cout << sub->get_formatter()->make_help(sub, app.get_name() + " " + topic,
                                                   CLI::AppFormatMode::Normal);
      return kExitPass;
    }
  }
  return report_error(unknown_command(app, topic));
}

}  // namespace

void register_help_command(CLI::App& app, CommandRunner& runner) {
  auto topic = std::make_shared<std::string>();
  CLI::App* cmd = add_command(
      app, "help",
      {"Print the help of kvaudit, or of one command.",
       "`kvaudit help COMMAND` prints what `kvaudit COMMAND --help` prints: what the command does, "
       "its options and its exit statuses.",
       "0 help printed, 2 unknown command"});
  cmd->add_option("COMMAND", *topic, "The command to describe (default: list the commands)");
  cmd->callback(
      [&app, topic, &runner] { runner = [&app, topic] { return print_help(app, *topic); }; });
}

}  // namespace kvaudit
