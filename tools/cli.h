// tools/cli.h: what the subcommands of the `kvbridge` tool share.
//
// Each subcommand lives in its own file and is added by an add_*_command()
// function, which registers the subcommand and its options on the root app and
// returns how to run it once the command line has parsed. main() (kvbridge.cc)
// lists them; a new subcommand (plan, demo) is one more file and one more line
// there. The tool uses the public headers (include/kvbridge/) only.
//
// Exit codes: 0 success, 1 an error reported by kvbridge (message on stderr),
// 2 a usage error (CLI11's message on stderr).
#pragma once

#include <functional>
#include <string>

#include <CLI/CLI.hpp>

#include "kvbridge/status.h"

namespace kvbridge::cli {

inline constexpr int kExitError = 1;
inline constexpr int kExitUsage = 2;

struct Command {
  CLI::App* app = nullptr;   // the subcommand, owned by the root app
  std::function<int()> run;  // runs it; returns the exit code
};

Command add_layout_command(CLI::App& root);
Command add_presets_command(CLI::App& root);
Command add_validate_command(CLI::App& root);
Command add_identity_command(CLI::App& root);
Command add_plan_command(CLI::App& root);
Command add_demo_command(CLI::App& root);
Command add_bench_command(CLI::App& root);
Command add_store_command(CLI::App& root);

// The whole of a file, or of stdin for "-". kIoError names the path.
Result<std::string> read_input(const std::string& path);

// Prints "kvbridge: <code>: <message>" to stderr and returns kExitError.
int fail(const Status& status);

}  // namespace kvbridge::cli
