// `moeflex run`: supervised restart of a training command (train/supervisor.h).
#pragma once
#include <CLI/CLI.hpp>

namespace moeflex {

/// Registers the `run` subcommand (--max-restarts, --restart-delay, and the command
/// after `--`) on `app` and returns it, for main's dispatch.
CLI::App* add_run_command(CLI::App& app);

/// Runs the supervision of the parsed `run` command (train::supervise) and returns
/// its exit code. Errors are moeflex::Error (ConfigError: no moeflex train with a run
/// folder in the command, a command that cannot be started).
int run_run_command();

}  // namespace moeflex
