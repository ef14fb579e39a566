// The kvbridge command-line tool: builds, checks and explains layouts.
// `kvbridge --help` lists the subcommands; each has its own --help.

#include <cstdio>
#include <string>
#include <vector>

#include "cli.h"

int main(int argc, char** argv) {
  using namespace kvbridge::cli;
  CLI::App app{"kvbridge: move LLM KV caches between inference workers"};
  app.require_subcommand(1);
  app.set_version_flag("--version", [] { return version_text(); });
  const std::vector<Command> commands = {
      add_layout_command(app), add_presets_command(app), add_validate_command(app),  add_identity_command(app),
      add_plan_command(app),   add_readers_command(app), add_demo_command(app),      add_bench_command(app),
      add_store_command(app),  add_sim_command(app),     add_discovery_command(app),
  };
  // CLI11 would say only that a subcommand is required.
  if (argc > 1 && argv[1][0] != '-') {
    std::string names;
    bool known = false;
    for (const Command& c : commands) {
      known = known || c.app->get_name() == argv[1];
      names += (names.empty() ? "" : ", ") + c.app->get_name();
    }
    if (!known) {
      std::fprintf(stderr, "kvbridge: unknown command '%s' (commands: %s)\nRun with --help for more information.\n",
                   argv[1], names.c_str());
      return kExitUsage;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // exit() prints help (to stdout, code 0) or the error (to stderr).
    return app.exit(e) == 0 ? 0 : kExitUsage;
  }
  for (const Command& c : commands) {
    if (c.app->parsed()) return c.run();
  }
  return kExitUsage;
}
