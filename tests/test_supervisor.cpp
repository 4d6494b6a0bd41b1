// Supervised restart (train/supervisor.h): the command's train invocation and its
// rewriting to a resume, the refusals, the step and goodput accounting of a
// metrics.jsonl with repeated steps and an OOM line, the resume step of one- and
// multi-rank folders, and the loop itself around a stand-in `moeflex` shell script.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "error_text.h"
#include "moeflex/core/error.h"
#include "moeflex/train/checkpoint.h"
#include "moeflex/train/supervisor.h"
#include "scratch_dir.h"

namespace fs = std::filesystem;
using namespace moeflex::train;
using moeflex::ConfigError;
using moeflex::test::error_text;
using Words = std::vector<std::string>;

namespace {

const Words kMpi = {"mpirun", "--allow-run-as-root", "-np", "2", "-x", "OMP_NUM_THREADS=1", "build/moeflex"};

Words with_mpi(const Words& train_words) {
  Words w = kMpi;
  w.insert(w.end(), train_words.begin(), train_words.end());
  return w;
}

fs::path scratch(const std::string& tag) {
  const fs::path d = moeflex::test::scratch_dir("moeflex_supervisor_", tag);
  fs::create_directories(d);
  return d;
}

void write_text(const fs::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out << text;
}

nlohmann::json read_json(const fs::path& p) {
  std::ifstream in(p);
  return nlohmann::json::parse(in);
}

// A complete checkpoint of `step` under `root` (a run folder or a rank folder).
void save_step(const fs::path& root, std::int64_t step) {
  std::vector<float> w(6, 0.5f), m(6, 0.25f);
  save_checkpoint(root, step, {{"w", {2, 3}, w.data()}}, {{"m", {2, 3}, m.data()}}, {{"step", step}}, 0);
}

}  // namespace

// ---------------------------------------------------------------- the command

TEST(SupervisorCommand, FindsTheRunFolderOfOutAndResume) {
  TrainInvocation inv = find_train_invocation(with_mpi({"train", "--ep", "2", "--out", "runs/x", "--steps", "40"}));
  EXPECT_EQ(inv.train_arg, kMpi.size());
  EXPECT_EQ(inv.run_dir, fs::path("runs/x"));
  EXPECT_FALSE(inv.resumes);
  inv = find_train_invocation({"./build/moeflex", "train", "--out=runs/y"});
  EXPECT_EQ(inv.train_arg, 1u);
  EXPECT_EQ(inv.run_dir, fs::path("runs/y"));
  inv = find_train_invocation({"moeflex", "train", "--out", "a", "--resume=runs/z"});
  EXPECT_EQ(inv.run_dir, fs::path("runs/z"));  // --resume wins: train ignores --out then
  EXPECT_TRUE(inv.resumes);
  inv = find_train_invocation({"moeflex", "train", "--out", "a", "--out", "b"});
  EXPECT_EQ(inv.run_dir, fs::path("b"));  // the last one, as train's TakeLast
  // `train` as another program's argument, and flags before `train`, are not the train part.
  inv = find_train_invocation({"env", "--out", "q", "train", "moeflex", "train", "--out", "r"});
  EXPECT_EQ(inv.train_arg, 5u);
  EXPECT_EQ(inv.run_dir, fs::path("r"));
}

TEST(SupervisorCommand, RewritesOutToResumeAndDropsInitFrom) {
  EXPECT_EQ(resume_command(with_mpi({"train", "--ep", "2", "--out", "runs/x", "--steps", "40"})),
            with_mpi({"train", "--ep", "2", "--resume", "runs/x", "--steps", "40"}));
  EXPECT_EQ(resume_command({"moeflex", "train", "--out=runs/x", "--seed", "3"}),
            Words({"moeflex", "train", "--resume", "runs/x", "--seed", "3"}));
  EXPECT_EQ(resume_command({"moeflex", "train", "--init-from", "hf/q", "--out", "r", "--init-from=hf/p", "--quiet"}),
            Words({"moeflex", "train", "--resume", "r", "--quiet"}));
  // Two --out: one --resume, at the last.
  EXPECT_EQ(resume_command({"moeflex", "train", "--out", "a", "--steps", "4", "--out", "b"}),
            Words({"moeflex", "train", "--steps", "4", "--resume", "b"}));
  // A command that resumes already keeps its words (train ignores its --out).
  EXPECT_EQ(resume_command({"moeflex", "train", "--resume", "r", "--steps", "9"}),
            Words({"moeflex", "train", "--resume", "r", "--steps", "9"}));
  // The words before `train` stay, even ones that look like train's flags.
  EXPECT_EQ(resume_command({"env", "--out", "q", "moeflex", "train", "--out", "r"}),
            Words({"env", "--out", "q", "moeflex", "train", "--resume", "r"}));
}

TEST(SupervisorCommand, RefusesCommandsWithoutATrainRunFolder) {
  const auto text = [](const Words& w) { return error_text<ConfigError>([&] { find_train_invocation(w); }); };
  EXPECT_NE(text({}).find("no command given"), std::string::npos) << text({});
  EXPECT_NE(text({"python3", "train.py", "--out", "x"}).find("runs no moeflex train"), std::string::npos);
  EXPECT_NE(text({"moeflex", "generate", "--run", "x"}).find("not its `train` command"), std::string::npos);
  const std::string none = text(with_mpi({"train", "--steps", "4"}));
  EXPECT_NE(none.find("neither --out DIR nor --resume DIR"), std::string::npos) << none;
  const std::string bare = text({"moeflex", "train", "--out"});
  EXPECT_NE(bare.find("--out has no value"), std::string::npos) << bare;
  EXPECT_NE(error_text<ConfigError>([] { resume_command({"moeflex", "train"}); }).find("neither"), std::string::npos);
}

// ---------------------------------------------------------------- the accounting

TEST(SupervisorAccount, LastLineOfEachStepCountsAndOomLinesAreNotSteps) {
  const fs::path dir = scratch("account");
  // Steps 1-4, an OOM at 5 (the run reloads step 3's checkpoint), 4 and 5 again, an
  // OOM at 6 that the run gave up on, and a line torn by a kill.
  write_text(dir / "metrics.jsonl",
             "{\"step\": 1, \"loss\": 9.0, \"step_seconds\": 0.5, \"oom\": false}\n"
             "{\"step\": 2, \"loss\": 8.0, \"step_seconds\": 0.25, \"oom\": false}\n"
             "{\"step\": 3, \"loss\": 7.0, \"step_seconds\": 0.25, \"oom\": false}\n"
             "{\"step\": 4, \"loss\": 6.0, \"step_seconds\": 4.0, \"oom\": false}\n"
             "{\"step\": 5, \"oom\": true, \"step_seconds\": 8.0}\n"
             "{\"step\": 4, \"loss\": 6.0, \"step_seconds\": 1.0, \"oom\": false}\n"
             "{\"step\": 5, \"loss\": 5.0, \"step_seconds\": 2.0, \"oom\": false, \"val_loss\": 5.5}\n"
             "{\"step\": 6, \"oom\": true, \"step_seconds\": 16.0}\n"
             "{\"step\": 7, \"loss\": 4.");
  const StepAccount all = account_steps(dir / "metrics.jsonl");
  EXPECT_EQ(all.last_step, 5);
  EXPECT_EQ(all.kept_steps, 5);
  EXPECT_DOUBLE_EQ(all.kept_step_seconds, 0.5 + 0.25 + 0.25 + 1.0 + 2.0);  // not 4.0, 8.0 or 16.0
  const StepAccount mid = account_steps(dir / "metrics.jsonl", 2, 4);  // steps 3 and 4
  EXPECT_EQ(mid.kept_steps, 2);
  EXPECT_DOUBLE_EQ(mid.kept_step_seconds, 1.25);
  EXPECT_EQ(mid.last_step, 5);  // over the whole file
  const StepAccount none = account_steps(dir / "absent.jsonl");
  EXPECT_EQ(none.last_step, 0);
  EXPECT_EQ(none.kept_step_seconds, 0.0);
}

TEST(SupervisorAccount, TotalsAndGoodput) {
  Attempt killed, resumed;
  killed.attempt = 0;
  killed.end = {0, 9};
  killed.last_step = 7;
  killed.lost_steps = 2;
  killed.lost_seconds = 3.5;
  resumed.attempt = 1;
  resumed.resumed_from_step = 5;
  resumed.last_step = 12;
  StepAccount metrics;
  metrics.kept_step_seconds = 6.0;
  const SupervisorTotals t = supervisor_totals({killed, resumed}, 8.0, metrics);
  EXPECT_EQ(t.restarts, 1);
  EXPECT_EQ(t.lost_steps, 2);
  EXPECT_DOUBLE_EQ(t.lost_seconds, 3.5);
  EXPECT_DOUBLE_EQ(t.goodput(), 0.75);
  const nlohmann::json j = supervisor_record({"moeflex", "train", "--out", "r"}, 2, 1.0, {killed, resumed}, t, "done");
  EXPECT_EQ(j["format"], "moeflex-supervisor");
  EXPECT_EQ(j["attempts"].size(), 2u);
  EXPECT_TRUE(j["attempts"][0]["exit_code"].is_null());
  EXPECT_EQ(j["attempts"][0]["signal"], 9);
  EXPECT_TRUE(j["attempts"][0]["resumed_from_step"].is_null());
  EXPECT_EQ(j["attempts"][1]["resumed_from_step"], 5);
  EXPECT_TRUE(j["attempts"][1]["lost_steps"].is_null());
  EXPECT_EQ(j["restarts"], 1);
  EXPECT_DOUBLE_EQ(j["goodput"].get<double>(), 0.75);
}

TEST(SupervisorAccount, ExitStatusAndVerdict) {
  EXPECT_EQ(decode_wait_status(W_EXITCODE(137, 0)).code, 137);
  EXPECT_EQ(decode_wait_status(W_EXITCODE(0, SIGKILL)).signal, SIGKILL);
  EXPECT_EQ(decode_wait_status(W_EXITCODE(0, SIGKILL)).shell_code(), 137);
  EXPECT_EQ(describe_exit({0, 9}), "signal 9");
  EXPECT_EQ(describe_exit({134, 0}), "exit code 134");
  EXPECT_EQ(decide({0, 0}, false, 0, 3), Verdict::done);
  EXPECT_EQ(decide({1, 0}, false, 0, 3), Verdict::restart);
  EXPECT_EQ(decide({0, 9}, false, 2, 3), Verdict::restart);
  EXPECT_EQ(decide({0, 9}, false, 3, 3), Verdict::no_restarts_left);
  EXPECT_EQ(decide({kExitBadInput, 0}, false, 0, 3), Verdict::bad_input);
  EXPECT_EQ(decide({kExitOutOfMemory, 0}, false, 0, 3), Verdict::out_of_memory);
  EXPECT_EQ(decide({1, 0}, true, 0, 3), Verdict::stopped);
  EXPECT_EQ(decide({0, 0}, true, 0, 3), Verdict::stopped);
}

// ---------------------------------------------------------------- the run folder

TEST(SupervisorRunFolder, ResumeStepOfOneAndSeveralRanks) {
  const fs::path one = scratch("one");
  EXPECT_EQ(resumable_step(one / "absent"), std::nullopt);
  EXPECT_EQ(resumable_step(one), std::nullopt);
  save_step(one, 2);
  save_step(one, 4);
  fs::create_directories(one / "checkpoints" / "step_00000006.tmp");  // a write cut short
  EXPECT_EQ(resumable_step(one), 4);
  // Ranks: the newest step every rank holds.
  const fs::path two = scratch("two");
  save_step(two / rank_folder_name(0), 4);
  save_step(two / rank_folder_name(0), 6);
  save_step(two / rank_folder_name(1), 4);
  EXPECT_EQ(resumable_step(two), 4);
  fs::create_directories(two / rank_folder_name(2) / "checkpoints");  // a rank with none
  EXPECT_EQ(resumable_step(two), std::nullopt);
}

TEST(SupervisorRunFolder, MovesAsideWithoutDeleting) {
  const fs::path d = scratch("aside") / "run";
  fs::create_directories(d);
  write_text(d / "metrics.jsonl", "{}\n");
  EXPECT_EQ(move_run_aside(d), fs::path(d.string() + ".failed-1"));
  fs::create_directories(d);
  EXPECT_EQ(move_run_aside(d), fs::path(d.string() + ".failed-2"));
  EXPECT_TRUE(fs::exists(d.string() + ".failed-1/metrics.jsonl"));
  EXPECT_FALSE(fs::exists(d));
}

// ---------------------------------------------------------------- the loop

namespace {

// A stand-in `moeflex` that logs its attempt and arguments to `log` and then runs
// the attempt's line of `script` (shell), for supervise() without a real training.
fs::path fake_moeflex(const fs::path& dir, const std::vector<std::string>& attempts) {
  std::string text = "#!/bin/sh\necho \"$MOEFLEX_SUPERVISOR_ATTEMPT $*\" >> " + (dir / "log").string() +
                     "\ncase $MOEFLEX_SUPERVISOR_ATTEMPT in\n";
  for (std::size_t i = 0; i < attempts.size(); ++i) text += std::to_string(i) + ") " + attempts[i] + " ;;\n";
  text += "esac\n";
  const fs::path bin = dir / "moeflex";
  write_text(bin, text);
  fs::permissions(bin, fs::perms::owner_all);
  return bin;
}

SupervisorOptions options_for(const Words& command, int max_restarts) {
  SupervisorOptions o;
  o.command = command;
  o.max_restarts = max_restarts;
  o.restart_delay = 0;
  for (char** e = environ; *e != nullptr; ++e) o.environment.emplace_back(*e);
  return o;
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

}  // namespace

TEST(SupervisorLoop, ResumesFromTheCheckpointAfterAKill) {
  const fs::path dir = scratch("loop_resume"), run = dir / "run";
  save_step(run, 2);
  const std::string steps = "printf '{\"step\": 1, \"step_seconds\": 0.5}\\n{\"step\": 2, \"step_seconds\": 0.5}\\n"
                            "{\"step\": 3, \"step_seconds\": 0.5}\\n' > " + (run / "metrics.jsonl").string();
  const fs::path bin = fake_moeflex(dir, {steps + "; kill -9 $$", "exit 0"});
  const int rc = supervise(options_for({bin.string(), "train", "--init-from", "hf", "--out", run.string()}, 2));
  EXPECT_EQ(rc, 0);
  EXPECT_EQ(read_text(dir / "log"), "0 train --init-from hf --out " + run.string() + "\n1 train --resume " +
                                        run.string() + "\n");
  const nlohmann::json j = read_json(run / "supervisor.json");
  ASSERT_EQ(j["attempts"].size(), 2u);
  EXPECT_EQ(j["attempts"][0]["signal"], 9);
  EXPECT_EQ(j["attempts"][0]["last_step"], 3);
  EXPECT_EQ(j["attempts"][0]["lost_steps"], 1);
  EXPECT_EQ(j["attempts"][1]["resumed_from_step"], 2);
  EXPECT_EQ(j["attempts"][1]["exit_code"], 0);
  EXPECT_EQ(j["restarts"], 1);
  EXPECT_EQ(j["outcome"], "done");
  EXPECT_DOUBLE_EQ(j["kept_step_seconds"].get<double>(), 1.5);  // the second attempt wrote no lines
  EXPECT_GT(j["goodput"].get<double>(), 0.0);
}

TEST(SupervisorLoop, MovesAFolderWithoutCheckpointAsideAndStartsAgain) {
  const fs::path dir = scratch("loop_aside"), run = dir / "run";
  const fs::path bin = fake_moeflex(dir, {"mkdir -p " + run.string() + "; exit 1", "exit 0"});
  EXPECT_EQ(supervise(options_for({bin.string(), "train", "--out", run.string()}, 1)), 0);
  EXPECT_TRUE(fs::is_directory(run.string() + ".failed-1"));
  EXPECT_EQ(read_text(dir / "log"), "0 train --out " + run.string() + "\n1 train --out " + run.string() + "\n");
  const nlohmann::json j = read_json(run / "supervisor.json");
  EXPECT_EQ(j["attempts"][0]["moved_aside"], run.string() + ".failed-1");
  EXPECT_TRUE(j["attempts"][1]["resumed_from_step"].is_null());
}

TEST(SupervisorLoop, DoesNotRestartBadInputOrOutOfMemoryAndStopsAfterMaxRestarts) {
  for (int code : {kExitBadInput, kExitOutOfMemory}) {
    const fs::path dir = scratch("loop_code" + std::to_string(code)), run = dir / "run";
    const fs::path bin = fake_moeflex(dir, {"exit " + std::to_string(code), "exit 0"});
    EXPECT_EQ(supervise(options_for({bin.string(), "train", "--out", run.string()}, 3)), code);
    EXPECT_EQ(read_text(dir / "log"), "0 train --out " + run.string() + "\n");
    EXPECT_EQ(read_json(run / "supervisor.json")["restarts"], 0);
  }
  const fs::path dir = scratch("loop_spent"), run = dir / "run";
  const fs::path bin = fake_moeflex(dir, {"exit 1", "exit 1", "exit 0"});
  EXPECT_EQ(supervise(options_for({bin.string(), "train", "--out", run.string()}, 1)), 1);
  const nlohmann::json j = read_json(run / "supervisor.json");
  EXPECT_EQ(j["restarts"], 1);
  EXPECT_EQ(j["attempts"].size(), 2u);
  EXPECT_NE(j["outcome"].get<std::string>().find("no restarts left"), std::string::npos) << j["outcome"];
}

TEST(SupervisorLoop, ForwardsATermAndDoesNotRestart) {
  const fs::path dir = scratch("loop_term"), run = dir / "run";
  // The child signals its supervisor (its parent) and exits as a stopped train run does.
  const fs::path bin = fake_moeflex(dir, {"trap 'exit 0' TERM; kill -TERM $PPID; while :; do sleep 0.01; done", "exit 1"});
  EXPECT_EQ(supervise(options_for({bin.string(), "train", "--out", run.string()}, 3)), 0);
  EXPECT_EQ(read_text(dir / "log"), "0 train --out " + run.string() + "\n");
  EXPECT_NE(read_json(run / "supervisor.json")["outcome"].get<std::string>().find("stopped by signal 15"),
            std::string::npos);
}

TEST(SupervisorLoop, KeepsAnEarlierSessionsRecordAndCountsOnlyItsOwnSteps) {
  // A second supervision of a finished run (its command refused: exit 2) keeps the
  // first one's record, and the steps it found are not its goodput.
  const fs::path dir = scratch("loop_sessions"), run = dir / "run";
  save_step(run, 2);
  write_text(run / "metrics.jsonl", "{\"step\": 1, \"step_seconds\": 0.5}\n{\"step\": 2, \"step_seconds\": 0.5}\n");
  const fs::path bin = fake_moeflex(dir, {"exit 0"});
  ASSERT_EQ(supervise(options_for({bin.string(), "train", "--resume", run.string()}, 1)), 0);
  const fs::path again = fake_moeflex(dir, {"exit 2"});
  EXPECT_EQ(supervise(options_for({again.string(), "train", "--out", run.string()}, 1)), 2);
  const nlohmann::json rec = read_json(run / "supervisor.json");
  ASSERT_EQ(rec.at("earlier_sessions").size(), 1u);
  EXPECT_EQ(rec["earlier_sessions"][0].at("attempts").size(), 1u);
  EXPECT_EQ(rec["earlier_sessions"][0].at("outcome"), "done");
  EXPECT_DOUBLE_EQ(rec.at("kept_step_seconds").get<double>(), 0.0);
  EXPECT_LE(rec.at("goodput").get<double>(), 1.0);
}

TEST(SupervisorLoop, WhatTheCommandLeftRunningIsEnded) {
  // The command exits leaving a process of its group behind (as a killed mpirun
  // leaves its ranks): the supervisor ends it before going on.
  const fs::path dir = scratch("loop_orphan"), run = dir / "run";
  const fs::path pidfile = dir / "orphan.pid";
  const fs::path bin = fake_moeflex(dir, {"mkdir -p " + run.string() + "; sleep 30 & echo $! > " + pidfile.string() +
                                          "; exit 0"});
  ASSERT_EQ(supervise(options_for({bin.string(), "train", "--out", run.string()}, 0)), 0);
  const pid_t orphan = pid_t(std::stol(read_text(pidfile)));
  auto alive = [&] {  // (a zombie waiting for its reaper is not running)
    if (::kill(orphan, 0) != 0) return false;
    const std::string stat = read_text("/proc/" + std::to_string(orphan) + "/stat");
    const std::size_t paren = stat.rfind(')');
    return paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] != 'Z';
  };
  for (int i = 0; i < 100 && alive(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(alive()) << "the orphan " << orphan << " still runs";
}
