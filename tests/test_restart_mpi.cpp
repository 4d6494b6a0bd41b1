// --on-oom=restart end to end, in process (run_training on every rank). Under
// mpirun -np 2 (ctest: mpi_restart_np2) the experts are split over the two ranks
// (--ep 2), so an injected routing spike really grows one rank's activations and
// a static policy runs out of memory on it; with all experts on one rank the bytes
// do not depend on the routing, so started alone only the world-size-independent
// case runs. Every figure is checked against an unbudgeted run of the same steps:
// the budget is chosen from its measured peaks, the OOM step's demand must equal
// its peak, redone steps must repeat its losses bit for bit, and after the restarts
// a relaunch with enough memory must end on its final weights and moments, byte
// for byte.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "model_fixtures.h"
#include "moeflex/core/arena.h"
#include "moeflex/train/trainer.h"
#include "scratch_dir.h"

using namespace moeflex;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

comm::Communicator* g_world = nullptr;
const fs::path kSrc = MOEFLEX_SOURCE_DIR;

// A tiny model (0.7 M parameters): a step takes milliseconds.
RunConfig tiny_run(std::int64_t steps, int ep) {
  RunConfig c = RunConfig::from_toml_text(R"(
[model]
hidden_size = 64
num_hidden_layers = 2
num_attention_heads = 4
num_experts = 8
num_experts_per_tok = 2
moe_intermediate_size = 128
[train]
micro_batch_size = 8
seq_len = 32
eval_every = 0
eval_batches = 2
trace_steps = 0
keep_checkpoints = 10
)", "restart test config");
  c.train.steps = steps;
  c.train.policy = "none";  // a static policy (with a budget the default would be adaptive)
  c.parallel.ep = ep;
  c.data.path = (kSrc / "data" / "brown").string();
  return c;
}

// The same fresh directory on every rank (rank 0's pid).
fs::path shared_dir(const std::string& name) {
  std::int64_t pid = ::getpid();
  g_world->broadcast(&pid, sizeof pid, 0);
  const fs::path d = fs::temp_directory_path() / ("moeflex_restart_" + name + "_" + std::to_string(pid));
  if (g_world->rank() == 0) {  // rank 0 empties it, and removes it at exit
    fs::remove_all(d);
    test::ScratchRegistry::instance().add(d);
  }
  g_world->barrier();
  return d;
}

TrainOptions options(RunConfig cfg, const fs::path& out) {
  TrainOptions o;
  o.config = std::move(cfg);
  o.out_dir = out;
  o.data_cache = kSrc / "data" / "tokenized";
  o.progress = false;
  o.threads = 1;
  return o;
}

std::vector<json> metrics(const fs::path& run) {
  std::vector<json> out;
  std::ifstream in(run / "metrics.jsonl");
  std::string line;
  while (std::getline(in, line))
    if (!line.empty()) out.push_back(json::parse(line));
  return out;
}

json summary(const fs::path& run) { return json::parse(std::ifstream(run / "summary.json")); }

std::string file_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  EXPECT_TRUE(in.good()) << p;
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// This rank's checkpoint folder of `step` in a run directory.
fs::path checkpoint_of(const fs::path& run, std::int64_t step) {
  const fs::path root = g_world->size() > 1 ? run / fmt::format("rank{:05d}", g_world->rank()) : run;
  return root / "checkpoints" / fmt::format("step_{:08d}", step);
}

void expect_same_checkpoint(const fs::path& a, const fs::path& b) {
  for (const char* f : {"model.safetensors", "optimizer.safetensors"})
    EXPECT_TRUE(file_bytes(a / f) == file_bytes(b / f)) << f << " of " << a << " and " << b << " differ";
}

// The losses of the kept (oom = false) lines for `step`, in order.
std::vector<double> kept_losses(const std::vector<json>& m, std::int64_t step) {
  std::vector<double> out;
  for (const json& l : m)
    if (l.at("step") == step && !l.at("oom").get<bool>()) out.push_back(l.at("loss").get<double>());
  return out;
}

std::int64_t count_oom_lines(const std::vector<json>& m, std::int64_t step) {
  std::int64_t n = 0;
  for (const json& l : m) n += l.at("step") == step && l.at("oom").get<bool>();
  return n;
}

// Unbudgeted reference: 8 steps, a 2x spike on step 5 (every=5), checkpoints every 3.
struct Reference {
  fs::path dir;
  std::vector<json> lines;
  std::int64_t calm_peak = 0, spike_peak = 0;
};

const Reference& reference() {
  static Reference ref = [] {
    Reference r;
    r.dir = shared_dir("reference");
    RunConfig cfg = tiny_run(8, g_world->size());
    cfg.train.inject_imbalance = "every=5:ratio=2";
    cfg.train.checkpoint_every = 3;
    run_training(options(cfg, r.dir));
    r.lines = metrics(r.dir);
    for (const json& l : r.lines) {
      const std::int64_t p = l.at("peak_device_bytes");
      if (l.at("injected_imbalance").get<double>() > 0) r.spike_peak = std::max(r.spike_peak, p);
      else r.calm_peak = std::max(r.calm_peak, p);
    }
    return r;
  }();
  return ref;
}

// A budget the calm steps fit and the spike does not: 64 KiB under the spike's peak.
Bytes spike_budget(const Reference& ref) { return ref.spike_peak - 64 * kKiB; }

void expect_give_up(const TrainOptions& o, std::int64_t oom_step, std::int64_t times) {
  try {
    run_training(o);
    ADD_FAILURE() << "expected the run to give up at step " << oom_step;
  } catch (const OutOfMemoryError& e) {
    EXPECT_NE(std::string(e.what()).find(fmt::format("step {} ran out of device memory {} times", oom_step, times)),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("requested"), std::string::npos) << e.what();  // the arena's numbers
  }
  g_world->barrier();
}

}  // namespace

// A budget under what every step needs: step 1 fails, the run goes back to the
// initial state (no checkpoint yet), fails again and gives up after max_restarts.
TEST(RestartOnOOM, BudgetBelowEveryStepGivesUpAtStepOne) {
  const fs::path out = shared_dir("floor");
  RunConfig cfg = tiny_run(3, 1);
  cfg.train.on_oom = "restart";
  cfg.train.max_restarts = 1;
  cfg.train.restart_seconds = 30;
  // Weights, gradients and two AdamW moments (16 B per parameter) fit, and so does
  // the evaluation (its largest transient is the 4 MiB of LM-head logits; evaluation
  // is not protected by the restart); a training step's ~7.5 MiB of activations do not.
  const Bytes budget = 16 * cfg.model.num_params() + 6 * kMiB;
  cfg.device_memory = budget;
  expect_give_up(options(cfg, out), 1, 2);
  if (g_world->rank() == 0) {
    const json s = summary(out);
    EXPECT_EQ(s["restarts"], 1);
    EXPECT_EQ(s["oom_count"], 2);
    EXPECT_EQ(s["lost_steps"], 0);
    EXPECT_EQ(s["steps_run"], 2);
    EXPECT_EQ(s["steps"], 0);
    EXPECT_EQ(s["tokens"], 0);
    EXPECT_GE(s["restart_seconds"].get<double>(), 30.0);  // the charged penalty, plus the reload
    EXPECT_EQ(s["tokens_per_second_effective"], 0.0);
    EXPECT_GT(s["oom_peak_demand_bytes"].get<std::int64_t>(), budget);
    EXPECT_NE(s["first_oom"].get<std::string>().find("step 1"), std::string::npos);
    const auto m = metrics(out);
    EXPECT_EQ(m.size(), 2u);
    EXPECT_EQ(count_oom_lines(m, 1), 2);
  }
  g_world->barrier();
  if (g_world->rank() == 0) fs::remove_all(out);
}

// The spike on step 5 recurs after every restart from the step-3 checkpoint: step
// 4 is lost and redone each time (with the reference's loss), and after 2 restarts
// the run gives up naming step 5. Relaunched with enough memory (--resume after
// raising the budget), it ends on the reference's weights and moments, bit for bit.
TEST(RestartOnOOM, RecurringSpikeRestartsFromCheckpointThenGivesUp) {
  if (g_world->size() != 2) GTEST_SKIP() << "needs mpirun -np 2 (a spike grows one EP rank's activations)";
  const Reference& ref = reference();
  ASSERT_GT(ref.spike_peak - ref.calm_peak, 512 * kKiB) << "the spike must need clearly more memory";
  const fs::path out = shared_dir("spike");
  RunConfig cfg = tiny_run(8, 2);
  cfg.train.inject_imbalance = "every=5:ratio=2";
  cfg.train.checkpoint_every = 3;
  cfg.train.on_oom = "restart";
  cfg.train.max_restarts = 2;
  cfg.device_memory = spike_budget(ref);
  expect_give_up(options(cfg, out), 5, 3);
  // Independent counts: 3 OOMs of step 5; 2 restarts from step 3, each losing step 4.
  const std::int64_t oom_step = 5, ckpt = 3, restarts = 2, lost = restarts * (oom_step - 1 - ckpt);
  if (g_world->rank() == 0) {
    const json s = summary(out);
    EXPECT_EQ(s["restarts"], restarts);
    EXPECT_EQ(s["oom_count"], restarts + 1);
    EXPECT_EQ(s["lost_steps"], lost);
    EXPECT_EQ(s["steps_run"], (oom_step - 1) + (restarts + 1) + lost);
    EXPECT_EQ(s["steps"], oom_step - 1);
    EXPECT_LE(s["peak_device_bytes"].get<std::int64_t>(), cfg.device_memory);
    // The overflow served exactly what the unbudgeted spike step used.
    EXPECT_EQ(s["oom_peak_demand_bytes"], ref.spike_peak);
    const auto m = metrics(out);
    EXPECT_EQ(count_oom_lines(m, oom_step), restarts + 1);
    for (std::int64_t st = 1; st < oom_step; ++st) {
      const double want = ref.lines[std::size_t(st - 1)].at("loss").get<double>();
      const auto got = kept_losses(m, st);
      ASSERT_EQ(got.size(), std::size_t(st > ckpt ? restarts + 1 : 1)) << "step " << st;
      for (double x : got) EXPECT_EQ(x, want) << "step " << st;  // bit for bit
    }
  }
  expect_same_checkpoint(checkpoint_of(out, ckpt), checkpoint_of(ref.dir, ckpt));
  // The operator's fix: more memory, relaunch from the newest checkpoint.
  if (g_world->rank() == 0) {
    std::string text = file_bytes(out / "config.toml");
    const std::string old = fmt::format("memory = \"{}B\"", cfg.device_memory);
    ASSERT_NE(text.find(old), std::string::npos) << text;
    text.replace(text.find(old), old.size(), "memory = \"unlimited\"");
    std::ofstream(out / "config.toml") << text;
  }
  g_world->barrier();
  TrainOptions again = options(tiny_run(8, 2), out);
  again.config.train.steps = -1;
  again.resume = out;
  const TrainResult r = run_training(again);
  EXPECT_EQ(r.steps, 8);
  EXPECT_EQ(r.restarts, 0);  // the step-3 checkpoint predates the restarts
  expect_same_checkpoint(checkpoint_of(out, 8), checkpoint_of(ref.dir, 8));
  g_world->barrier();
  if (g_world->rank() == 0) fs::remove_all(out);
}

// No checkpoint before the spike (checkpoint_every = 0): each restart goes back to
// the initial state, re-initialised from the seed, and redoes steps 1 and 2 with
// the reference's losses (AdamW's moments and step are reset with the weights).
TEST(RestartOnOOM, SpikeBeforeAnyCheckpointRestartsFromTheInitialState) {
  if (g_world->size() != 2) GTEST_SKIP() << "needs mpirun -np 2 (a spike grows one EP rank's activations)";
  const Reference& ref = reference();
  const fs::path out = shared_dir("initial");
  RunConfig cfg = tiny_run(4, 2);
  cfg.train.inject_imbalance = "every=3:ratio=2";
  cfg.train.checkpoint_every = 0;
  cfg.train.on_oom = "restart";
  cfg.train.max_restarts = 1;
  cfg.train.restart_seconds = 0;
  cfg.device_memory = spike_budget(ref);
  expect_give_up(options(cfg, out), 3, 2);
  if (g_world->rank() == 0) {
    const json s = summary(out);
    EXPECT_EQ(s["restarts"], 1);
    EXPECT_EQ(s["oom_count"], 2);
    EXPECT_EQ(s["lost_steps"], 2);
    EXPECT_EQ(s["steps_run"], 2 + 2 + 2);
    // Kept tokens over all the time spent, restarts included: under the plain rate.
    EXPECT_LT(s["tokens_per_second_effective"].get<double>(), s["tokens_per_second"].get<double>());
    const auto m = metrics(out);
    for (std::int64_t st = 1; st <= 2; ++st) {
      const auto got = kept_losses(m, st);
      ASSERT_EQ(got.size(), 2u) << "step " << st;
      for (double x : got) EXPECT_EQ(x, ref.lines[std::size_t(st - 1)].at("loss").get<double>()) << "step " << st;
    }
  }
  g_world->barrier();
  if (g_world->rank() == 0) fs::remove_all(out);
}

// Multi-rank rotation still keeps keep_checkpoints steps (it runs after a barrier,
// once every rank holds the new one; that ordering is not exercised here), and a
// resume whose ranks hold no complete step in common is refused alike on every rank
// (none left waiting in a collective), naming the rank and step.
TEST(ResumeMpi, RotationKeepsItsCountAndNoCommonStepIsRefusedAlikeByName) {
  if (g_world->size() != 2) GTEST_SKIP() << "needs mpirun -np 2";
  const int rank = g_world->rank();
  const fs::path out = shared_dir("rotate");
  RunConfig cfg = tiny_run(4, 2);
  cfg.train.checkpoint_every = 2;
  cfg.train.keep_checkpoints = 1;
  run_training(options(cfg, out));
  const fs::path mine = out / fmt::format("rank{:05d}", rank) / "checkpoints";
  EXPECT_TRUE(fs::exists(mine / "step_00000004"));
  EXPECT_FALSE(fs::exists(mine / "step_00000002"));
  g_world->barrier();
  // Both steps kept, then rank 0 without a complete step 2 and rank 1 without step 4:
  // the newest common step would be 2, which rank 0 cannot resume from.
  const fs::path out2 = shared_dir("no-common");
  cfg.train.keep_checkpoints = 2;
  run_training(options(cfg, out2));
  const fs::path mine2 = out2 / fmt::format("rank{:05d}", rank) / "checkpoints";
  // Rank 0's step 2 cut short (its folder there, a file gone), rank 1's step 4 gone.
  if (rank == 0)
    fs::remove(mine2 / "step_00000002" / "model.safetensors");
  else
    fs::remove_all(mine2 / "step_00000004");
  g_world->barrier();
  TrainOptions again = options(cfg, out2);
  again.config.train.steps = 6;
  again.resume = out2;
  try {
    run_training(again);
    ADD_FAILURE() << "resumed without a step in common";
  } catch (const DataError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("the newest step every rank completed is 2, but rank 0 holds no intact checkpoint of it"),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("rank00000/checkpoints/step_00000002"), std::string::npos) << m;
  }
  g_world->barrier();
  EXPECT_TRUE(fs::exists(mine2 / (rank == 0 ? "step_00000004" : "step_00000002")));  // nothing deleted
}

// One rank's newest checkpoint damaged at its full size (a flipped byte): that rank
// names it and moves it aside, every rank resumes from the newest step all hold
// intact, and the run ends as the uninterrupted one does.
TEST(ResumeMpi, ADamagedCheckpointOnOneRankFallsBackOnEvery) {
  if (g_world->size() != 2) GTEST_SKIP() << "needs mpirun -np 2";
  const int rank = g_world->rank();
  RunConfig cfg = tiny_run(6, 2);
  cfg.train.checkpoint_every = 2;
  cfg.train.keep_checkpoints = 2;
  const TrainResult whole = run_training(options(cfg, shared_dir("damaged-straight")));
  const fs::path out = shared_dir("damaged");
  TrainOptions first = options(cfg, out);
  first.stop_after = 4;
  run_training(first);
  const fs::path step4 = out / fmt::format("rank{:05d}", rank) / "checkpoints" / "step_00000004";
  if (rank == 1) {
    std::fstream f(step4 / "model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(200);
    const char byte = char(f.get() ^ 0x01);
    f.seekp(200);
    f.put(byte);
  }
  g_world->barrier();
  TrainOptions again = options(cfg, out);
  again.resume = out;
  const TrainResult r = run_training(again);
  EXPECT_EQ(r.steps, 6);
  EXPECT_EQ(r.final_val_loss, whole.final_val_loss);  // resumed from step 2 on both ranks, bit for bit
  EXPECT_EQ(fs::exists(step4.string() + ".damaged"), rank == 1);
  g_world->barrier();
}

TEST(RestartOnOOM, ConfigIsValidatedAndRoundTrips) {
  auto expect_error = [](const std::string& toml, const std::string& field) {
    try {
      RunConfig::from_toml_text(toml, "x").validate();
      ADD_FAILURE() << toml;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  expect_error("[train]\non_oom = \"retry\"\n", "train.on_oom");
  expect_error("[train]\nmax_restarts = -1\n", "train.max_restarts");
  expect_error("[train]\nrestart_seconds = -5.0\n", "train.restart_seconds");
  RunConfig c = RunConfig::from_toml_text("[train]\non_oom = \"restart\"\nmax_restarts = 7\nrestart_seconds = 90\n", "x");
  c.validate();
  const RunConfig back = RunConfig::from_toml_text(c.to_toml(), "resolved");
  EXPECT_EQ(back.train.on_oom, "restart");
  EXPECT_EQ(back.train.max_restarts, 7);
  EXPECT_EQ(back.train.restart_seconds, 90.0);
  EXPECT_EQ(RunConfig::defaults().train.on_oom, "fail");
}

int main(int argc, char** argv) {
  const int rc = test::run_mpi_tests(argc, argv, g_world);
  return rc;
}
