// Supervised restart (see supervisor.h): the command's train invocation, the restart
// decision and the accounting, then the child process and the loop of attempts.
#include "moeflex/train/supervisor.h"

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstring>
#include <ctime>
#include <fmt/format.h>
#include <fstream>
#include <map>
#include <thread>

#include "moeflex/core/error.h"
#include "moeflex/core/file_io.h"
#include "moeflex/train/checkpoint.h"
#include "moeflex/train/run_state.h"

namespace moeflex::train {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr const char* kRecordFileName = "supervisor.json";
constexpr const char* kRecordFormat = "moeflex-supervisor";
constexpr int kRecordVersion = 1;
// The train flags the rewriting works on, in their `--flag VALUE` and `--flag=VALUE` forms.
constexpr const char* kOutFlag = "--out";
constexpr const char* kResumeFlag = "--resume";
constexpr const char* kInitFromFlag = "--init-from";
// The signals forwarded to the child: each asks a train run to stop after its step.
constexpr int kForwardedSignals[] = {SIGINT, SIGTERM, SIGHUP};

// A train flag at command[i]: its value and how many words it spans (0: not this flag).
struct FlagAt {
  std::size_t words = 0;
  std::string value;
};

FlagAt flag_at(const std::vector<std::string>& command, std::size_t i, const std::string& flag) {
  const std::string& w = command[i];
  if (w.size() > flag.size() && w.starts_with(flag) && w[flag.size()] == '=') return {1, w.substr(flag.size() + 1)};
  if (w != flag) return {};
  if (i + 1 >= command.size() || command[i + 1].empty())
    throw ConfigError(fmt::format("run: the train command's {} has no value (give {} DIR)", flag, flag));
  return {2, command[i + 1]};
}

// The index of the word `train` after a moeflex executable; ConfigError when none.
std::size_t train_word(const std::vector<std::string>& command) {
  if (command.empty())
    throw ConfigError("run: no command given (moeflex run [options] -- mpirun ... moeflex train --out DIR ...)");
  const auto is_moeflex = [&](std::size_t i) { return fs::path(command[i]).filename().string().starts_with("moeflex"); };
  bool moeflex_seen = false;
  for (std::size_t i = 0; i < command.size(); ++i) {
    if (i > 0 && command[i] == "train" && is_moeflex(i - 1)) return i;
    moeflex_seen = moeflex_seen || is_moeflex(i);
  }
  throw ConfigError(fmt::format("run: the command runs {}: nothing to supervise (give -- [mpirun ...] build/moeflex "
                                "train --out DIR ...)",
                                moeflex_seen ? "moeflex, but not its `train` command" : "no moeflex train"));
}

std::string iso_time_now() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  localtime_r(&now, &tm);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%S%z", &tm);
  const std::string s = buf;  // ...+0100 -> ...+01:00 (ISO 8601 extended)
  return s.size() < 5 ? s : s.substr(0, s.size() - 2) + ":" + s.substr(s.size() - 2);
}

json optional_json(const std::optional<std::int64_t>& v) { return v ? json(*v) : json(nullptr); }

json attempt_json(const Attempt& a) {
  json j = {{"attempt", a.attempt},
            {"command", a.command},
            {"started", a.started},
            {"seconds", a.seconds},
            {"exit_code", a.end.signal > 0 ? json(nullptr) : json(a.end.code)},
            {"signal", a.end.signal > 0 ? json(a.end.signal) : json(nullptr)},
            {"resumed_from_step", optional_json(a.resumed_from_step)},
            {"last_step", a.last_step},
            {"lost_steps", optional_json(a.lost_steps)},
            {"lost_seconds", a.lost_seconds}};
  if (a.moved_aside) j["moved_aside"] = a.moved_aside->string();
  return j;
}

std::string plural(std::int64_t n, const char* word) { return fmt::format("{} {}{}", n, word, n == 1 ? "" : "s"); }

}  // namespace

// ------------------------------------------------------------ the command

TrainInvocation find_train_invocation(const std::vector<std::string>& command) {
  TrainInvocation inv;
  inv.train_arg = train_word(command);
  std::string out, resume;  // a flag given twice takes its last value, as train does
  for (std::size_t i = inv.train_arg + 1; i < command.size();) {
    if (FlagAt f = flag_at(command, i, kOutFlag); f.words > 0) {
      out = f.value;
      i += f.words;
    } else if (FlagAt r = flag_at(command, i, kResumeFlag); r.words > 0) {
      resume = r.value;
      i += r.words;
    } else {
      ++i;
    }
  }
  if (out.empty() && resume.empty())
    throw ConfigError("run: the train command has neither --out DIR nor --resume DIR: the supervisor needs "
                      "the run folder to resume from (give train --out DIR)");
  inv.resumes = !resume.empty();
  inv.run_dir = inv.resumes ? resume : out;
  return inv;
}

std::vector<std::string> resume_command(const std::vector<std::string>& command) {
  const TrainInvocation inv = find_train_invocation(command);
  std::vector<std::string> out(command.begin(), command.begin() + std::ptrdiff_t(inv.train_arg) + 1);
  std::size_t last_out = 0;  // where --resume DIR goes: at the last --out
  for (std::size_t i = inv.train_arg + 1; i < command.size();) {
    const FlagAt o = flag_at(command, i, kOutFlag), init = flag_at(command, i, kInitFromFlag);
    if (o.words > 0 && !inv.resumes) {
      last_out = out.size();
      i += o.words;
    } else if (init.words > 0) {
      i += init.words;
    } else {
      out.push_back(command[i++]);
    }
  }
  if (!inv.resumes) {
    out.insert(out.begin() + std::ptrdiff_t(last_out), inv.run_dir.string());
    out.insert(out.begin() + std::ptrdiff_t(last_out), kResumeFlag);
  }
  return out;
}

// ------------------------------------------------------------ the run folder

StepAccount account_steps(const fs::path& metrics_jsonl, std::int64_t after_step, std::int64_t up_to_step) {
  StepAccount acc;
  std::ifstream in(metrics_jsonl);
  std::map<std::int64_t, std::pair<bool, double>> last;  // step -> (an OOM line, step_seconds)
  std::string line;
  while (std::getline(in, line)) {
    json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || !j.contains("step") || !j["step"].is_number_integer()) continue;  // torn or foreign
    const std::int64_t step = j["step"].get<std::int64_t>();
    const bool oom = j.value("oom", false);
    const double seconds = j.contains("step_seconds") && j["step_seconds"].is_number() ? j["step_seconds"].get<double>()
                                                                                       : 0.0;
    if (!oom) acc.last_step = std::max(acc.last_step, step);
    last[step] = {oom, seconds};
  }
  for (const auto& [step, l] : last) {
    if (step <= after_step || step > up_to_step || l.first) continue;
    acc.kept_steps += 1;
    acc.kept_step_seconds += l.second;
  }
  return acc;
}

std::optional<std::int64_t> resumable_step(const fs::path& run_dir) {
  std::error_code ec;
  if (!fs::is_directory(run_dir, ec)) return std::nullopt;
  const auto newest = [](const fs::path& root) -> std::optional<std::int64_t> {
    const std::optional<fs::path> c = latest_checkpoint(root);
    if (!c) return std::nullopt;
    return checkpoint_step(*c);
  };
  int ranks = 0;
  try {
    ranks = run_rank_count(run_dir);
  } catch (const DataError&) {
    return std::nullopt;  // a rank folder is missing: no step all ranks hold
  }
  if (ranks == 0) return newest(run_dir);
  std::optional<std::int64_t> common;
  for (int r = 0; r < ranks; ++r) {
    const std::optional<std::int64_t> s = newest(run_dir / rank_folder_name(r));
    if (!s) return std::nullopt;
    common = common ? std::min(*common, *s) : *s;
  }
  return common;
}

fs::path move_run_aside(const fs::path& run_dir) {
  for (int n = 1;; ++n) {
    fs::path aside = run_dir;
    aside += fmt::format(".failed-{}", n);
    std::error_code ec;
    if (fs::exists(fs::symlink_status(aside, ec))) continue;
    fs::rename(run_dir, aside, ec);
    if (ec)
      throw DataError(fmt::format("run: cannot move the run folder '{}' aside to '{}': {}", run_dir.string(),
                                  aside.string(), ec.message()));
    return aside;
  }
}

// ------------------------------------------------------------ the decision and the record

ExitStatus decode_wait_status(int status) {
  if (WIFSIGNALED(status)) return {0, WTERMSIG(status)};
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 1, 0};
}

std::string describe_exit(const ExitStatus& e) {
  return e.signal > 0 ? fmt::format("signal {}", e.signal) : fmt::format("exit code {}", e.code);
}

Verdict decide(const ExitStatus& e, bool stop_requested, int restarts_done, int max_restarts) {
  if (stop_requested) return Verdict::stopped;
  if (e.signal == 0 && e.code == 0) return Verdict::done;
  if (e.signal == 0 && e.code == kExitBadInput) return Verdict::bad_input;
  if (e.signal == 0 && e.code == kExitOutOfMemory) return Verdict::out_of_memory;
  if (restarts_done >= max_restarts) return Verdict::no_restarts_left;
  return Verdict::restart;
}

SupervisorTotals supervisor_totals(const std::vector<Attempt>& attempts, double wall_seconds,
                                   const StepAccount& metrics) {
  SupervisorTotals t;
  for (const Attempt& a : attempts) {
    if (!a.lost_steps) continue;  // the last attempt: no restart followed it
    t.restarts += 1;
    t.lost_steps += *a.lost_steps;
    t.lost_seconds += a.lost_seconds;
  }
  t.wall_seconds = wall_seconds;
  t.kept_step_seconds = metrics.kept_step_seconds;
  return t;
}

json supervisor_record(const std::vector<std::string>& command, int max_restarts, double restart_delay,
                       const std::vector<Attempt>& attempts, const SupervisorTotals& totals,
                       const std::string& outcome) {
  json list = json::array();
  for (const Attempt& a : attempts) list.push_back(attempt_json(a));
  return {{"format", kRecordFormat},
          {"version", kRecordVersion},
          {"command", command},
          {"max_restarts", max_restarts},
          {"restart_delay_seconds", restart_delay},
          {"attempts", std::move(list)},
          {"restarts", totals.restarts},
          {"lost_steps", totals.lost_steps},
          {"lost_seconds", totals.lost_seconds},
          {"wall_seconds", totals.wall_seconds},
          {"kept_step_seconds", totals.kept_step_seconds},
          {"goodput", totals.goodput()},
          {"outcome", outcome}};
}

// ------------------------------------------------------------ the child process

namespace {

// The child being waited for (0: none) and the stop signal received (0: none), for
// the handler.
volatile std::sig_atomic_t g_child = 0;
volatile std::sig_atomic_t g_stop_signal = 0;

extern "C" void on_supervisor_signal(int sig) {
  g_stop_signal = sig;
  const pid_t child = pid_t(g_child);
  if (child > 0) ::kill(child, sig);  // async-signal-safe
}

// Installs on_supervisor_signal for the forwarded signals while the supervision
// lives; the previous handlers come back however it ends.
class ForwardSignals {
 public:
  ForwardSignals() {
    g_stop_signal = 0;
    struct sigaction sa {};
    sa.sa_handler = on_supervisor_signal;
    sigemptyset(&sa.sa_mask);
    for (std::size_t i = 0; i < std::size(kForwardedSignals); ++i) sigaction(kForwardedSignals[i], &sa, &old_[i]);
  }
  ForwardSignals(const ForwardSignals&) = delete;
  ForwardSignals& operator=(const ForwardSignals&) = delete;
  ~ForwardSignals() {
    for (std::size_t i = 0; i < std::size(kForwardedSignals); ++i) sigaction(kForwardedSignals[i], &old_[i], nullptr);
  }

 private:
  struct sigaction old_[std::size(kForwardedSignals)] {};
};

std::vector<char*> c_strings(std::vector<std::string>& words) {
  std::vector<char*> out;
  for (std::string& w : words) out.push_back(w.data());
  out.push_back(nullptr);
  return out;
}

// Runs `argv` with `env` and waits for it. The child has its own process group, so
// that a terminal's Ctrl-C reaches it once, forwarded by the handler (a second one
// stops a train run at once), and only stdin, stdout and stderr (no other descriptor
// of the supervisor leaks into the job). The forwarded signals are blocked until
// g_child is set.
ExitStatus run_child(std::vector<std::string> argv, std::vector<std::string> env) {
  sigset_t forwarded, before;
  sigemptyset(&forwarded);
  for (int s : kForwardedSignals) sigaddset(&forwarded, s);
  posix_spawnattr_t attr;
  posix_spawn_file_actions_t files;
  posix_spawnattr_init(&attr);
  posix_spawn_file_actions_init(&files);
  posix_spawn_file_actions_addclosefrom_np(&files, 3);
  sigprocmask(SIG_BLOCK, &forwarded, &before);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  posix_spawnattr_setpgroup(&attr, 0);
  posix_spawnattr_setsigmask(&attr, &before);
  posix_spawnattr_setsigdefault(&attr, &forwarded);
  pid_t pid = 0;
  const std::vector<char*> args = c_strings(argv), envp = c_strings(env);
  const int rc = posix_spawnp(&pid, args[0], &files, &attr, args.data(), envp.data());
  if (rc == 0) g_child = pid;
  sigprocmask(SIG_SETMASK, &before, nullptr);
  posix_spawn_file_actions_destroy(&files);
  posix_spawnattr_destroy(&attr);
  if (rc != 0) throw ConfigError(fmt::format("run: cannot run '{}': {}", argv[0], std::strerror(rc)));
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) {
      g_child = 0;
      throw Error(fmt::format("run: waiting for '{}' (pid {}) failed: {}", argv[0], pid, std::strerror(errno)));
    }
  }
  g_child = 0;
  // What the command left in its process group (the ranks of an mpirun that was
  // killed) must not go on training into the run folder the next attempt takes.
  ::kill(-pid, SIGKILL);
  return decode_wait_status(status);
}

// Waits up to `seconds` for the run folder's lock (train/run_folder.cpp) to be free:
// a rank of the previous attempt may still be ending. Returns whether it is free.
bool wait_for_folder(const fs::path& run_dir, double seconds) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (run::folder_in_use(run_dir)) {
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return true;
}

// Sleeps `seconds`, or less when a stop signal comes; returns whether one came.
bool wait_or_stop(double seconds) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (g_stop_signal == 0 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  return g_stop_signal != 0;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// "attempt 1 ended by signal 9 at step 7" (1-based, as people count attempts).
std::string ending(const Attempt& a) {
  return fmt::format("attempt {} ended {} {} at step {}", a.attempt + 1, a.end.signal > 0 ? "by" : "with",
                     describe_exit(a.end), a.last_step);
}

// Why a verdict ends the supervision, for its message and the record's outcome.
std::string verdict_reason(Verdict v, int max_restarts) {
  switch (v) {
    case Verdict::done: return "done";
    case Verdict::stopped:
      return fmt::format("stopped by signal {} (forwarded to the command): not restarted", int(g_stop_signal));
    case Verdict::bad_input:
      return "exit code 2 is bad input (a flag, a config, a file or the run folder): a restart would fail the same "
             "way, not restarted";
    case Verdict::out_of_memory:
      return "exit code 3 is out of device memory (after the run's own --on-oom handling): not restarted";
    case Verdict::no_restarts_left: return fmt::format("no restarts left (--max-restarts {})", max_restarts);
    case Verdict::restart: break;
  }
  return "restarting";
}

// The next attempt after the failed attempt `a`: its command and resume step, with
// a's lost steps and seconds filled in, and the run folder moved aside when no
// checkpoint can resume it. Returns false when nothing can continue the run (the
// command itself resumes, and the folder holds no checkpoint).
bool prepare_restart(const SupervisorOptions& o, const TrainInvocation& inv, Attempt& a,
                     std::vector<std::string>& next, std::optional<std::int64_t>& next_resume) {
  const std::optional<std::int64_t> from = resumable_step(inv.run_dir);
  if (!from && inv.resumes) return false;
  const fs::path metrics = inv.run_dir / "metrics.jsonl";
  const double kept = account_steps(metrics, a.resumed_from_step.value_or(0), from.value_or(0)).kept_step_seconds;
  a.lost_steps = std::max<std::int64_t>(0, a.last_step - from.value_or(0));
  a.lost_seconds = std::max(0.0, a.seconds - kept) + o.restart_delay;
  if (from) {
    next = resume_command(o.command);
  } else {
    std::error_code ec;
    if (fs::exists(inv.run_dir, ec)) a.moved_aside = move_run_aside(inv.run_dir);
    next = o.command;
  }
  next_resume = from;
  return true;
}

// The stderr line of a restart of `a` (restart `restart`, 1-based) from `from`.
void print_restart(const Attempt& a, const TrainInvocation& inv, int restart, int max_restarts,
                   const std::optional<std::int64_t>& from) {
  const std::string where =
      from ? fmt::format("from the checkpoint of step {}", *from)
      : a.moved_aside
          ? fmt::format("from the start ('{}' held no checkpoint: moved aside to '{}')", inv.run_dir.string(),
                        a.moved_aside->string())
          : fmt::format("from the start ('{}' was not created)", inv.run_dir.string());
  fmt::print(stderr, "moeflex run: {}; restart {} of {} {} ({} lost)\n", ending(a), restart, max_restarts, where,
             plural(a.lost_steps.value_or(0), "step"));
}

// The final stderr lines: why the last attempt ended the supervision, and the totals.
void print_summary(Verdict v, const std::string& outcome, std::size_t attempts, const SupervisorTotals& t,
                   const fs::path& record) {
  if (v != Verdict::done) fmt::print(stderr, "moeflex run: {}\n", outcome);
  fmt::print(stderr,
             "moeflex run: {} after {} ({}, {} and {:.1f} s lost); kept step time {:.1f} s of {:.1f} s wall, "
             "goodput {:.3f}; record in {}\n",
             v == Verdict::done ? "done" : v == Verdict::stopped ? "stopped" : "gave up",
             plural(std::int64_t(attempts), "attempt"), plural(t.restarts, "restart"), plural(t.lost_steps, "step"),
             t.lost_seconds, t.kept_step_seconds, t.wall_seconds, t.goodput(), record.string());
}

// Writes the record of the supervision so far.
SupervisorTotals write_record(const SupervisorOptions& o, const TrainInvocation& inv, const std::vector<Attempt>& attempts,
                              std::int64_t first_step, std::chrono::steady_clock::time_point t0,
                              const std::string& outcome, const json& earlier) {
  const StepAccount now = account_steps(inv.run_dir / "metrics.jsonl", first_step);
  const SupervisorTotals totals = supervisor_totals(attempts, seconds_since(t0), now);
  std::error_code ec;
  fs::create_directories(inv.run_dir, ec);  // (a command that failed before making it)
  json j = supervisor_record(o.command, o.max_restarts, o.restart_delay, attempts, totals, outcome);
  if (!earlier.empty()) j["earlier_sessions"] = earlier;
  write_file_atomically(inv.run_dir / kRecordFileName, j.dump(2) + "\n");
  return totals;
}

// The sessions an existing supervisor.json of `run_dir` records (its own earlier
// sessions, then itself), kept in the new record: nothing on disk is lost.
json earlier_sessions(const fs::path& run_dir) {
  const fs::path path = run_dir / kRecordFileName;
  json out = json::array();
  std::ifstream in(path);
  if (!in) return out;
  try {
    json prev = json::parse(in);
    if (prev.contains("earlier_sessions")) {
      out = prev["earlier_sessions"];
      prev.erase("earlier_sessions");
    }
    out.push_back(std::move(prev));
  } catch (const json::exception&) {
    out.push_back({{"unreadable", path.string()}});
  }
  return out;
}

// The child's environment for attempt n: o.environment with the attempt variable.
std::vector<std::string> attempt_environment(const SupervisorOptions& o, int n) {
  std::vector<std::string> env = o.environment;
  const std::string key = std::string(kAttemptEnvVar) + "=";
  std::erase_if(env, [&](const std::string& e) { return e.starts_with(key); });
  env.push_back(key + std::to_string(n));
  return env;
}

}  // namespace

int supervise(const SupervisorOptions& o) {
  const TrainInvocation inv = find_train_invocation(o.command);
  if (o.max_restarts < 0)
    throw ConfigError(fmt::format("run: --max-restarts must be >= 0 (got {})", o.max_restarts));
  if (!std::isfinite(o.restart_delay) || o.restart_delay < 0)
    throw ConfigError(fmt::format("run: --restart-delay must be a finite number >= 0 (got {})",
                                  o.restart_delay));
  const auto t0 = std::chrono::steady_clock::now();
  ForwardSignals signals;
  std::vector<Attempt> attempts;
  std::vector<std::string> next = o.command;
  std::optional<std::int64_t> next_resume = inv.resumes ? resumable_step(inv.run_dir) : std::nullopt;
  // The steps the folder held before the supervision are not its goodput.
  const std::int64_t first_step = account_steps(inv.run_dir / "metrics.jsonl").last_step;
  const json earlier = earlier_sessions(inv.run_dir);
  for (int n = 0;; ++n) {
    Attempt& a = attempts.emplace_back();
    a.attempt = n;
    a.command = next;
    a.resumed_from_step = next_resume;
    a.started = iso_time_now();
    const auto ta = std::chrono::steady_clock::now();
    a.end = run_child(a.command, attempt_environment(o, n));
    a.seconds = seconds_since(ta);
    if (!wait_for_folder(inv.run_dir, 30))
      fmt::print(stderr, "moeflex run: warning: '{}' is still held by another process 30 s after attempt {} ended\n",
                 inv.run_dir.string(), n + 1);
    a.last_step = account_steps(inv.run_dir / "metrics.jsonl").last_step;
    Verdict v = decide(a.end, g_stop_signal != 0, n, o.max_restarts);
    std::string reason = verdict_reason(v, o.max_restarts);
    if (v == Verdict::restart && !prepare_restart(o, inv, a, next, next_resume)) {
      v = Verdict::no_restarts_left;
      reason = fmt::format("'{}' holds no checkpoint to resume from", inv.run_dir.string());
    }
    if (v == Verdict::restart) {
      write_record(o, inv, attempts, first_step, t0, "running", earlier);
      print_restart(a, inv, n + 1, o.max_restarts, next_resume);
      if (!wait_or_stop(o.restart_delay)) continue;
      a.lost_steps.reset();  // no restart followed after all
      a.lost_seconds = 0;
      v = Verdict::stopped;
      reason = fmt::format("stopped by signal {} before restart {}: not restarted", int(g_stop_signal), n + 1);
    }
    const std::string outcome = v == Verdict::done ? reason : ending(a) + "; " + reason;
    const SupervisorTotals totals = write_record(o, inv, attempts, first_step, t0, outcome, earlier);
    print_summary(v, outcome, attempts.size(), totals, inv.run_dir / kRecordFileName);
    return v == Verdict::done ? 0 : a.end.shell_code();
  }
}

}  // namespace moeflex::train
