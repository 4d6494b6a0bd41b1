// `moeflex run` (see run_command.h): its flags, help and the environment its command gets.
#include "moeflex/cli/run_command.h"

#include <unistd.h>

#include <string>
#include <vector>

#include "moeflex/cli/sim_commands.h"
#include "moeflex/train/supervisor.h"

namespace moeflex {

namespace {

/// This process's environment ("NAME=value"), for the supervised command (main starts
/// no MPI for `run`, so it holds nothing of a launcher's).
std::vector<std::string> environment() {
  std::vector<std::string> env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) env.emplace_back(*e);
  return env;
}

struct Flags {
  CLI::App* run = nullptr;
  int max_restarts = 3;
  double restart_delay = 1;
  std::vector<std::string> command;
};

Flags& flags() {
  static Flags f;
  return f;
}

constexpr const char* kDescription =
    "run a training command and relaunch it from its newest checkpoint when it fails: moeflex run [--max-restarts "
    "N] [--restart-delay S] -- [mpirun ...] moeflex train --out DIR ...";

constexpr const char* kFooter =
    "The command's train part needs --out DIR or --resume DIR. A relaunch continues the run with --out DIR "
    "rewritten to --resume DIR and --init-from dropped; if DIR holds no checkpoint yet it is moved aside to "
    "DIR.failed-N and the original command runs again.\n"
    "Exit codes of moeflex train: 0 done; 1 an unexpected error; 2 bad input (a flag, a config, a file, the run "
    "folder); 3 out of device memory (--on-oom fail, or its restarts spent); 4 a failed communication (a peer died). "
    "2 and 3 are not restarted (a relaunch "
    "would fail the same way); 0 ends the supervision; any other code (1, 4, what mpirun returns when a rank dies) "
    "or a death by a signal is restarted while restarts remain. SIGINT, SIGTERM and SIGHUP are forwarded to the command (a train run stops after its step with a "
    "checkpoint) and end the supervision with the command's exit code, without a restart.\n"
    "moeflex run exits 0 when the command finished, else with the last attempt's code (128 + N after signal N); "
    "2 for a command without a moeflex train run folder. The command's environment has "
    "MOEFLEX_SUPERVISOR_ATTEMPT=<n> (0 for the first attempt). Each attempt is recorded in DIR/supervisor.json "
    "(command, exit, steps lost, goodput = kept step seconds / wall seconds).";

}  // namespace

CLI::App* add_run_command(CLI::App& app) {
  Flags& f = flags();
  f.run = app.add_subcommand("run", kDescription);
  f.run->footer(kFooter);
  f.run->add_option("--max-restarts", f.max_restarts, "relaunches allowed after failures")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  f.run->add_option("--restart-delay", f.restart_delay, "seconds to wait before a relaunch")
      ->capture_default_str()
      ->check(finite_non_negative());
  // Everything after `--` is the command; the app's TakeLast default would keep only its last word.
  f.run->add_option("command", f.command, "the command to supervise, after --")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll)
      ->required();
  return f.run;
}

int run_run_command() {
  const Flags& f = flags();
  train::SupervisorOptions o;
  o.command = f.command;
  o.max_restarts = f.max_restarts;
  o.restart_delay = f.restart_delay;
  o.environment = environment();
  return train::supervise(o);
}

}  // namespace moeflex
