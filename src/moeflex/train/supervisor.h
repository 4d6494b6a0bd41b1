// Supervised restart (`moeflex run -- COMMAND...`): a training job whose rank dies or
// that aborts is relaunched from the newest checkpoint every rank of its run folder
// holds, with the train part of its command rewritten to `--resume DIR`.
//
// The pieces without processes (finding and rewriting the train invocation, the
// restart decision, the step and goodput accounting from a metrics.jsonl, the
// supervisor.json record) are separate functions, tested one by one; supervise()
// joins them around a child process (posix_spawn, signal forwarding, waitpid).
//
// Accounting (seconds are wall-clock):
//   kept step seconds  the step_seconds of the last metrics.jsonl line of every
//                      step number, OOM lines ("oom": true) not counted as steps;
//   lost steps         an attempt's last step minus the step the next one resumes from;
//   lost seconds       a restarted attempt's seconds that went into no kept step
//                      (start-up, the lost steps, a step cut short) plus the delay
//                      before the next attempt;
//   goodput            kept step seconds / the supervisor's wall seconds.
#pragma once
#include <cstdint>
#include <filesystem>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace moeflex::train {

/// The exit codes of `moeflex train` (cli/main.cpp) that a restart cannot fix.
inline constexpr int kExitBadInput = 2;     ///< a bad flag, config, input file or run folder
inline constexpr int kExitOutOfMemory = 3;  ///< out of device memory (--on-oom fail, or its restarts spent)

/// The environment variable that tells a supervised command its attempt (0-based).
inline constexpr const char* kAttemptEnvVar = "MOEFLEX_SUPERVISOR_ATTEMPT";

/// Where the moeflex train invocation of a supervised command is.
struct TrainInvocation {
  std::size_t train_arg = 0;      ///< index of the word `train` in the command
  std::filesystem::path run_dir;  ///< DIR of `--resume DIR` if given, else of `--out DIR`
  bool resumes = false;           ///< the command itself continues a run (`--resume`)
};

/// Finds the train invocation in `command` (an argv): the word `train` right after a
/// word whose file name starts with "moeflex" (`build/moeflex`, under mpirun or not),
/// and its `--out DIR`, `--out=DIR`, `--resume DIR` or `--resume=DIR`. Throws
/// ConfigError naming what is missing (an empty command, no moeflex train, no run
/// folder, a flag without its value).
TrainInvocation find_train_invocation(const std::vector<std::string>& command);

/// `command` rewritten to continue its run: `--out DIR` (or `--out=DIR`) becomes
/// `--resume DIR` in place, `--init-from X` (or `--init-from=X`, which --resume
/// refuses) is dropped, a `--resume` stays as it is; the words before `train` (mpirun
/// and its flags) are kept. Throws ConfigError as find_train_invocation.
std::vector<std::string> resume_command(const std::vector<std::string>& command);

/// What a metrics.jsonl says about the steps in (after_step, up_to_step].
struct StepAccount {
  std::int64_t last_step = 0;      ///< the highest step of a non-OOM line (over the whole file); 0 if none
  std::int64_t kept_steps = 0;     ///< step numbers in range whose last line is not an OOM line
  double kept_step_seconds = 0;    ///< the sum of those last lines' step_seconds
};

/// Reads a run's metrics.jsonl (see the file comment): for every step number, its last
/// line counts. A missing file gives zeros; lines that do not parse (a line torn by a
/// kill) are skipped.
StepAccount account_steps(const std::filesystem::path& metrics_jsonl, std::int64_t after_step = 0,
                          std::int64_t up_to_step = std::numeric_limits<std::int64_t>::max());

/// The step a `train --resume run_dir` would continue from: the newest complete
/// checkpoint (train::latest_checkpoint) of a single-process run, or the oldest of
/// the newest of every rank folder (the newest step all ranks hold); nullopt when
/// there is none (or a rank folder holds none, or rank folders are missing).
std::optional<std::int64_t> resumable_step(const std::filesystem::path& run_dir);

/// Renames `run_dir` to `<run_dir>.failed-N`, N the first from 1 naming nothing yet,
/// and returns the new path (nothing is deleted). Throws DataError naming both paths
/// when the rename fails.
std::filesystem::path move_run_aside(const std::filesystem::path& run_dir);

/// How a child process ended: an exit code, or the signal that ended it.
struct ExitStatus {
  int code = 0;    ///< the exit code (when signal == 0)
  int signal = 0;  ///< > 0: ended by this signal
  /// The code a shell would report: `code`, or 128 + signal.
  int shell_code() const { return signal > 0 ? 128 + signal : code; }
};

/// A waitpid status as an ExitStatus.
ExitStatus decode_wait_status(int status);

/// "exit code 137", "signal 9".
std::string describe_exit(const ExitStatus& e);

/// What the supervisor does after an attempt.
enum class Verdict {
  done,              ///< exit code 0: finished
  stopped,           ///< the supervisor was asked to stop (SIGINT, SIGTERM, SIGHUP forwarded)
  bad_input,         ///< exit code 2: a restart would fail the same way
  out_of_memory,     ///< exit code 3: the run's own OOM handling gave up
  no_restarts_left,  ///< another failure, with --max-restarts spent
  restart,           ///< another failure: relaunch
};

/// The verdict on an attempt that ended as `e`, with `restarts_done` of `max_restarts`
/// spent and `stop_requested` when a stop signal was forwarded.
Verdict decide(const ExitStatus& e, bool stop_requested, int restarts_done, int max_restarts);

/// One run of the command, as supervisor.json records it.
struct Attempt {
  int attempt = 0;                                   ///< 0-based
  std::vector<std::string> command;                  ///< the argv actually run
  std::string started;                               ///< ISO 8601 local time with offset
  double seconds = 0;                                ///< wall seconds of the child
  ExitStatus end;                                    ///< how it ended
  std::optional<std::int64_t> resumed_from_step;     ///< nullopt for a fresh start
  std::int64_t last_step = 0;                        ///< the highest step in metrics.jsonl when it ended
  std::optional<std::int64_t> lost_steps;            ///< last_step - the next attempt's resume step (none after the last)
  double lost_seconds = 0;                           ///< see the file comment; 0 unless restarted
  std::optional<std::filesystem::path> moved_aside;  ///< where the run folder went when no checkpoint could resume it
};

/// The totals of supervisor.json.
struct SupervisorTotals {
  int restarts = 0;
  std::int64_t lost_steps = 0;
  double lost_seconds = 0;
  double wall_seconds = 0;       ///< from the supervisor's start to now
  double kept_step_seconds = 0;  ///< over the run folder's metrics.jsonl now
  /// kept_step_seconds / wall_seconds (0 before any wall time).
  double goodput() const { return wall_seconds > 0 ? kept_step_seconds / wall_seconds : 0; }
};

/// The totals over `attempts`, with the wall time and the current metrics account.
SupervisorTotals supervisor_totals(const std::vector<Attempt>& attempts, double wall_seconds,
                                   const StepAccount& metrics);

/// The supervisor.json document: format, version, the original command, the
/// settings, every attempt, the totals and `outcome` ("running" until the end).
nlohmann::json supervisor_record(const std::vector<std::string>& command, int max_restarts, double restart_delay,
                                 const std::vector<Attempt>& attempts, const SupervisorTotals& totals,
                                 const std::string& outcome);

/// The settings of one supervision.
struct SupervisorOptions {
  std::vector<std::string> command;       ///< the original command (argv)
  int max_restarts = 3;                   ///< relaunches allowed after failures
  double restart_delay = 1;               ///< seconds between a failure and the relaunch
  std::vector<std::string> environment;   ///< the child's environment ("NAME=value"), before the attempt variable
};

/// Runs `o.command` as a child process (stdout and stderr shared, in its own process
/// group), forwarding SIGINT, SIGTERM and SIGHUP to it, and relaunches it as the
/// Verdict says: from the newest checkpoint of its run folder, or, with none there,
/// from the start with the folder moved aside (a command that itself resumes is not
/// relaunched then). Writes `<run_dir>/supervisor.json` atomically after each attempt,
/// prints a line on stderr per restart and a summary. Returns the exit code: 0, the
/// last attempt's (128 + signal after a signal). Throws ConfigError for a command
/// without a moeflex train run folder or one that cannot be started, DataError when
/// the record cannot be written.
int supervise(const SupervisorOptions& o);

}  // namespace moeflex::train
