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
Command add_readers_command(CLI::App& root);
Command add_demo_command(CLI::App& root);
Command add_bench_command(CLI::App& root);
Command add_store_command(CLI::App& root);
Command add_discovery_command(CLI::App& root);
Command add_sim_command(CLI::App& root);

// The whole of a file, or of stdin for "-", of at most `max_bytes` (the
// bound of kvbridge's JSON documents by default), enforced while reading.
// kIoError names the path; kResourceExhausted past the bound.
// What `kvbridge --version` prints: the version, whether CUDA is compiled
// in, and what the process's device says (a count, or why there is none).
std::string version_text();

Result<std::string> read_input(const std::string& path, size_t max_bytes = size_t{64} << 20);

// The shared secret: the contents of `file` (a trailing newline dropped) when
// one is given, else $KVBRIDGE_SECRET, else empty (none). Never from the
// command line, where every process of the user (and `ps`) can read it.
Result<std::string> read_secret(const std::string& file);

// Prints "kvbridge: <code>: <message>" to stderr and returns kExitError.
int fail(const Status& status);

// Option checks for whole numbers: at least 1, or not negative. (CLI11 2.1's
// PositiveNumber and NonNegativeNumber print a double's range up to DBL_MAX.)
CLI::Validator positive();
CLI::Validator non_negative();

}  // namespace kvbridge::cli
