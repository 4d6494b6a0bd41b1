// End-to-end training tests on the real corpus (prepared by `make data`): the
// validation loss must fall, and a resumed run must reproduce an uninterrupted
// one bit for bit.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include "moeflex/core/arena.h"
#include "moeflex/core/error.h"
#include "moeflex/provision/cost_model.h"
#include "moeflex/train/checkpoint.h"
#include "moeflex/train/dataset.h"
#include "moeflex/train/generate.h"
#include "moeflex/train/trainer.h"
#include "error_text.h"
#include "scratch_dir.h"

using namespace moeflex;
namespace fs = std::filesystem;

namespace {

const fs::path kSrc = MOEFLEX_SOURCE_DIR;

// A small model that learns quickly on 2 cores.
RunConfig small_run(std::int64_t steps) {
  RunConfig c = RunConfig::from_toml_text(R"(
[model]
hidden_size = 128
num_hidden_layers = 2
num_attention_heads = 4
num_experts = 8
num_experts_per_tok = 2
moe_intermediate_size = 256
[train]
micro_batch_size = 16
seq_len = 64
lr = 3e-3
min_lr = 3e-4
warmup_steps = 10
eval_every = 0
eval_batches = 4
checkpoint_every = 0
)", "test config");
  c.train.steps = steps;
  c.data.path = (kSrc / "data" / "brown").string();
  return c;
}

fs::path fresh_dir(const std::string& name) { return test::scratch_dir("moeflex_test_", name); }

std::vector<double> losses(const fs::path& run) {
  std::vector<double> out;
  std::ifstream in(run / "metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line).at("loss").get<double>());
  return out;
}

TrainOptions options(RunConfig cfg, const fs::path& out) {
  TrainOptions o;
  o.config = std::move(cfg);
  o.out_dir = out;
  o.data_cache = kSrc / "data" / "tokenized";
  o.progress = false;
  return o;
}

/// `cfg` run in `dir` in two parts: stopped after step `stop_after` (with its
/// checkpoint), then resumed to the end. Returns the resumed part's result.
TrainResult run_interrupted(const RunConfig& cfg, const fs::path& dir, std::int64_t stop_after) {
  TrainOptions first = options(cfg, dir);
  first.stop_after = stop_after;
  run_training(first);
  TrainOptions second = options(cfg, dir);
  second.resume = dir;
  return run_training(second);
}

}  // namespace

TEST(Train, ValidationLossFallsOnRealCorpus) {
  ASSERT_TRUE(fs::exists(kSrc / "data" / "brown")) << "run `make data` first";
  const fs::path out = fresh_dir("learn");
  TrainResult r = run_training(options(small_run(400), out));
  EXPECT_EQ(r.steps, 400);
  EXPECT_EQ(r.tokens, 400 * 16 * 64);
  EXPECT_LT(r.final_val_loss, 0.7 * r.initial_val_loss)
      << "initial " << r.initial_val_loss << " final " << r.final_val_loss;
  auto s = nlohmann::json::parse(std::ifstream(out / "summary.json"));
  for (const char* key : {"steps", "tokens", "initial_val_loss", "final_val_loss", "final_train_loss",
                          "tokens_per_second", "peak_device_bytes", "device_budget_bytes", "oom_count", "params",
                          "active_params"})
    EXPECT_TRUE(s.contains(key)) << key;
  EXPECT_TRUE(s["device_budget_bytes"].is_null());
  EXPECT_EQ(s["oom_count"], 0);
  EXPECT_EQ(losses(out).size(), 400u);
  EXPECT_TRUE(fs::exists(out / "config.toml"));
  fs::remove_all(out);
}

// The shipped Qwen3-MoE-shaped config (grouped-query attention, heads wider than
// hidden / heads, 16 experts top-4) learns, under a device budget below its unlimited
// peak that the adaptive planner must meet by recomputing or offloading.
TEST(Train, ShippedGqaConfigLearnsUnderABudget) {
  ASSERT_TRUE(fs::exists(kSrc / "data" / "brown")) << "run `make data` first";
  RunConfig cfg = RunConfig::from_file((kSrc / "configs" / "qwen3-moe-small.toml").string());
  ASSERT_EQ(cfg.model.kv_heads(), 2);
  ASSERT_EQ(cfg.model.q_width(), 512);
  cfg.train.steps = 40;
  cfg.train.eval_every = 0;
  cfg.train.eval_batches = 4;
  cfg.train.checkpoint_every = 0;
  cfg.data.path = (kSrc / "data" / "brown").string();
  cfg.device_memory = Bytes(240) << 20;  // unlimited, the run peaks at ~337 MiB
  const fs::path out = fresh_dir("gqa");
  TrainResult r = run_training(options(cfg, out));
  EXPECT_EQ(r.steps, 40);
  EXPECT_LT(r.final_val_loss, 0.9 * r.initial_val_loss)
      << "initial " << r.initial_val_loss << " final " << r.final_val_loss;
  auto s = nlohmann::json::parse(std::ifstream(out / "summary.json"));
  EXPECT_EQ(s["oom_count"], 0);
  EXPECT_LE(s["peak_device_bytes"].get<Bytes>(), cfg.device_memory);
  EXPECT_EQ(s["predicted_peak_bytes"], s["peak_device_bytes"]) << "the planner's peak is the arena's";
  EXPECT_GT(s["bytes_recomputed"].get<Bytes>() + s["bytes_offloaded"].get<Bytes>(), 0) << "the budget binds";
  fs::remove_all(out);
}

// The shipped DeepSeek-V3-routing config (sigmoid scores, the expert bias, 2 of 4
// groups, routed scaling) trains under a budget at an exactly predicted peak, and a
// resumed run reproduces the uninterrupted one bit for bit: the expert biases (moved
// fast here, so that they change the routing) come back from the checkpoint.
TEST(Train, ShippedDeepSeekRoutingConfigResumesBitForBitUnderABudget) {
  ASSERT_TRUE(fs::exists(kSrc / "data" / "brown")) << "run `make data` first";
  RunConfig cfg = RunConfig::from_file((kSrc / "configs" / "deepseek-v3-small.toml").string());
  ASSERT_TRUE(cfg.model.expert_bias());
  ASSERT_TRUE(cfg.model.group_limited());
  cfg.model.router_bias_update_rate = 0.02;
  cfg.train.steps = 8;
  cfg.train.eval_every = 0;
  cfg.train.eval_batches = 2;
  cfg.train.checkpoint_every = 0;
  cfg.data.path = (kSrc / "data" / "brown").string();
  cfg.device_memory = Bytes(200) << 20;  // unlimited, the run peaks at ~258 MiB
  const fs::path a = fresh_dir("deepseek_straight"), b = fresh_dir("deepseek_resumed");
  const TrainResult whole = run_training(options(cfg, a));
  auto s = nlohmann::json::parse(std::ifstream(a / "summary.json"));
  EXPECT_EQ(s["oom_count"], 0);
  EXPECT_EQ(s["predicted_peak_bytes"], s["peak_device_bytes"]) << "the planner's peak is the arena's";
  EXPECT_GT(s["bytes_recomputed"].get<Bytes>() + s["bytes_offloaded"].get<Bytes>(), 0) << "the budget binds";
  TrainOptions first = options(cfg, b);
  first.stop_after = 3;
  EXPECT_EQ(run_training(first).steps, 3);
  TrainOptions second = options(cfg, b);
  second.resume = b;
  EXPECT_EQ(run_training(second).final_val_loss, whole.final_val_loss);
  auto la = losses(a), lb = losses(b);
  ASSERT_EQ(la.size(), 8u);
  ASSERT_EQ(lb.size(), 8u);
  for (std::size_t i = 0; i < la.size(); ++i) EXPECT_EQ(la[i], lb[i]) << "step " << i + 1;
  fs::remove_all(a);
  fs::remove_all(b);
}

// Flash checkpoints: written by a background thread from a host snapshot, they hold
// the same tensors as synchronous ones, a run resumed from them reproduces the
// uninterrupted one bit for bit, and metrics.jsonl and summary.json say what each cost.
TEST(Train, AsyncCheckpointsMatchSyncOnesAndResumeBitForBit) {
  const fs::path a = fresh_dir("ckpt_sync"), b = fresh_dir("ckpt_async"), c = fresh_dir("ckpt_async_resumed");
  RunConfig sync = small_run(9), async = small_run(9);
  sync.train.checkpoint_every = async.train.checkpoint_every = 3;
  sync.train.keep_checkpoints = async.train.keep_checkpoints = 5;
  sync.train.checkpoint_mode = "sync";
  ASSERT_EQ(async.train.checkpoint_mode, "async");  // the default
  run_training(options(sync, a));
  run_training(options(async, b));
  run_interrupted(async, c, 4);
  EXPECT_EQ(losses(a), losses(b));
  EXPECT_EQ(losses(a), losses(c));
  for (std::int64_t step : {3, 6, 9}) {
    const auto fa = train::checkpoint_dir(a, step) / train::kModelFileName;
    const auto fb = train::checkpoint_dir(b, step) / train::kModelFileName;
    EXPECT_EQ(read_file_bytes(fa), read_file_bytes(fb)) << "step " << step;
    EXPECT_EQ(read_file_bytes(fa.parent_path() / train::kOptimizerFileName),
              read_file_bytes(fb.parent_path() / train::kOptimizerFileName)) << "step " << step;
  }
  // Each checkpoint's line says what it blocked; the next one's, what the persist took.
  std::vector<std::int64_t> taken, persisted;
  std::ifstream in(b / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("checkpoint_step")) taken.push_back(j["checkpoint_step"]);
    if (j.contains("persisted_step")) persisted.push_back(j["persisted_step"]);
  }
  EXPECT_EQ(taken, (std::vector<std::int64_t>{3, 6, 9}));
  EXPECT_EQ(persisted, (std::vector<std::int64_t>{3, 6}));  // step 9's, at the end: summary.json only
  for (const fs::path& run : {a, b}) {
    const auto s = nlohmann::json::parse(std::ifstream(run / "summary.json"));
    EXPECT_GT(s["checkpoint_blocking_seconds"].get<double>(), 0) << run;
    EXPECT_GT(s["checkpoint_persist_seconds"].get<double>(), 0) << run;
    EXPECT_EQ(s["checkpoints_skipped"], 0);
  }
  fs::remove_all(a);
  fs::remove_all(b);
  fs::remove_all(c);
}

// checkpoint_when_busy = "skip": a periodic checkpoint due while the previous one
// persists is skipped and counted; every other one is taken; the last is always taken.
TEST(Train, BusyCheckpointsAreSkippedAndCountedButNeverTheLast) {
  const fs::path a = fresh_dir("ckpt_skip");
  RunConfig cfg = small_run(10);
  cfg.train.checkpoint_every = 1;  // a step of this model is about as long as a persist
  cfg.train.keep_checkpoints = 20;
  cfg.train.checkpoint_when_busy = "skip";
  run_training(options(cfg, a));
  std::int64_t taken = 0;
  bool last = false;
  std::ifstream in(a / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    taken += j.contains("checkpoint_step");
    last = j.contains("checkpoint_step") && j["checkpoint_step"] == 10;
  }
  const auto s = nlohmann::json::parse(std::ifstream(a / "summary.json"));
  EXPECT_EQ(taken + s["checkpoints_skipped"].get<std::int64_t>(), 10);
  EXPECT_TRUE(last) << "the last checkpoint was skipped";
  EXPECT_TRUE(fs::exists(train::checkpoint_dir(a, 10) / train::kModelFileName));
  cfg.train.checkpoint_when_busy = "later";
  EXPECT_NE(test::error_text<ConfigError>([&] { cfg.validate(); }).find("train.checkpoint_when_busy"),
            std::string::npos);
  fs::remove_all(a);
}

TEST(Train, ResumeReproducesUninterruptedRun) {
  const fs::path a = fresh_dir("straight"), b = fresh_dir("resumed");
  const TrainResult whole = run_training(options(small_run(12), a));
  EXPECT_EQ(whole.final_val_step, 12);  // evaluated at the end
  TrainOptions first = options(small_run(12), b);
  first.stop_after = 5;
  TrainResult r1 = run_training(first);
  EXPECT_EQ(r1.steps, 5);
  EXPECT_EQ(r1.final_val_step, 0);  // stopped before any evaluation: the loss is the initial one
  EXPECT_EQ(r1.final_val_loss, r1.initial_val_loss);
  TrainOptions second = options(small_run(12), b);
  second.config.train.steps = -1;  // keep the run's own length
  second.resume = b;
  const TrainResult r2 = run_training(second);
  EXPECT_EQ(r2.final_val_step, 12);
  EXPECT_EQ(r2.final_val_loss, whole.final_val_loss);
  // Resuming the finished run trains nothing and leaves its summary as it was.
  const std::string summary = [&] {
    std::ifstream in(b / "summary.json");
    return std::string(std::istreambuf_iterator<char>(in), {});
  }();
  const TrainResult r3 = run_training(second);
  EXPECT_EQ(r3.steps, 12);
  EXPECT_EQ(r3.tokens_per_second, nlohmann::json::parse(summary).at("tokens_per_second").get<double>());
  std::ifstream in(b / "summary.json");
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), summary);
  auto la = losses(a), lb = losses(b);
  ASSERT_EQ(la.size(), 12u);
  ASSERT_EQ(lb.size(), 12u);
  for (std::size_t i = 0; i < la.size(); ++i) EXPECT_EQ(la[i], lb[i]) << "step " << i + 1;  // bit for bit
  fs::remove_all(a);
  fs::remove_all(b);
}

// A damaged newest checkpoint (truncated, or one byte flipped at the same size) is
// named with what is wrong, moved aside untouched, and the run resumes from the
// newest intact one, reproducing the uninterrupted run bit for bit; its own next save
// of that step does not write over the damaged one.
TEST(Train, ResumeFallsBackPastADamagedCheckpointAndKeepsIt) {
  RunConfig cfg = small_run(12);
  cfg.train.checkpoint_every = 4;
  cfg.train.keep_checkpoints = 3;
  const fs::path straight = fresh_dir("fallback-straight");
  const TrainResult whole = run_training(options(cfg, straight));
  for (const bool truncate : {true, false}) {
    const fs::path run = fresh_dir(truncate ? "fallback-truncated" : "fallback-flipped");
    TrainOptions first = options(cfg, run);
    first.stop_after = 8;
    run_training(first);
    const fs::path step8 = train::checkpoint_dir(run, 8), model = step8 / train::kModelFileName;
    ASSERT_TRUE(fs::exists(model));
    const auto size = fs::file_size(model);
    if (truncate) {
      fs::resize_file(model, size - 100);
    } else {
      std::fstream f(model, std::ios::in | std::ios::out | std::ios::binary);
      f.seekg(std::streamoff(size / 2));
      const char byte = char(f.get() ^ 0x5a);
      f.seekp(std::streamoff(size / 2));
      f.put(byte);
    }
    const auto damaged_size = fs::file_size(model);
    TrainOptions second = options(cfg, run);
    second.resume = run;
    testing::internal::CaptureStderr();
    const TrainResult r = run_training(second);
    const std::string said = testing::internal::GetCapturedStderr();
    const std::string what = truncate ? "truncated" : "corrupted";
    EXPECT_NE(said.find("checkpoint step 8"), std::string::npos) << said;
    EXPECT_NE(said.find(what), std::string::npos) << said;
    EXPECT_NE(said.find("resuming from step 4"), std::string::npos) << said;
    const fs::path aside = step8.string() + ".damaged";
    ASSERT_TRUE(fs::exists(aside / train::kModelFileName)) << what;
    EXPECT_EQ(fs::file_size(aside / train::kModelFileName), damaged_size) << what;  // kept as it was
    EXPECT_TRUE(fs::exists(step8 / train::kManifestFileName)) << "the resumed run saved step 8 anew";
    EXPECT_EQ(r.final_val_loss, whole.final_val_loss) << what;
    EXPECT_EQ(losses(run), losses(straight)) << what;  // bit for bit
    fs::remove_all(run);
  }
  fs::remove_all(straight);
}

// The bf16 engine through the trainer: a resumed run reproduces the uninterrupted
// one bit for bit (the checkpoint holds the fp32 master weights; the bf16 working
// copies are rebuilt from them), and its losses follow the fp32 run's.
TEST(Train, Bf16ResumesBitForBitAndFollowsFp32) {
  const fs::path f = fresh_dir("fp32"), a = fresh_dir("bf16_straight"), b = fresh_dir("bf16_resumed");
  RunConfig cfg = small_run(8);
  run_training(options(cfg, f));
  cfg.model.bf16 = true;
  run_training(options(cfg, a));
  run_interrupted(cfg, b, 3);
  const auto lf = losses(f), la = losses(a), lb = losses(b);
  ASSERT_EQ(la.size(), 8u);
  ASSERT_EQ(lb.size(), 8u);
  for (std::size_t i = 0; i < la.size(); ++i) {
    EXPECT_EQ(la[i], lb[i]) << "step " << i + 1;  // bit for bit
    EXPECT_NEAR(la[i], lf[i], 0.01 * lf[i]) << "step " << i + 1 << " against fp32";
  }
  EXPECT_NE(la, lf) << "the bf16 run computed exactly the fp32 numbers";
  const auto s = nlohmann::json::parse(std::ifstream(a / "summary.json"));
  EXPECT_EQ(s.at("precision"), "bf16");
  EXPECT_EQ(nlohmann::json::parse(std::ifstream(f / "summary.json")).at("precision"), "fp32");
  // Sampling from the bf16 run reads its trained weights (working copies rebuilt from
  // the checkpoint's master weights; empty ones give flat logits: the unknown piece).
  GenerateOptions g;
  g.run_dir = a;
  g.prompt = "The";
  g.max_new_tokens = 8;
  g.temperature = 0;
  const std::string text = generate_text(g);
  EXPECT_EQ(text.find("\u2047"), std::string::npos) << text;
  EXPECT_GT(text.size(), g.prompt.size()) << text;
  for (const auto& d : {f, a, b}) fs::remove_all(d);
}

TEST(Train, TinyBudgetFailsWithTypedOOMAndSummary) {
  // A budget under the model state itself is a configuration error naming it.
  RunConfig cfg = small_run(3);
  cfg.device_memory = 8 * kMiB;  // weights + grads + moments alone need more
  try {
    run_training(options(cfg, fresh_dir("oom-state")));
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("cannot hold this rank's model state"), std::string::npos) << e.what();
  }
  // In bf16 the state is 18 bytes a parameter (the bf16 working copy on top).
  {
    RunConfig b = cfg;
    b.model.bf16 = true;
    try {
      run_training(options(b, fresh_dir("oom-state-bf16")));
      FAIL();
    } catch (const ConfigError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("at 18 bytes each"), std::string::npos) << what;
      EXPECT_NE(what.find(format_bytes(18 * b.model.num_params())), std::string::npos) << what;
      EXPECT_NE(what.find("bf16 working copy"), std::string::npos) << what;
    }
  }
  // Booleans are booleans: an integer is refused, naming the key.
  for (const char* text : {"[model]\nbf16 = 1\n", "[model]\ntie_word_embeddings = 0\n", "[parallel]\npad_layers = 5\n"}) {
    try {
      RunConfig::from_toml_text(text, "test config");
      FAIL() << text;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("must be true or false"), std::string::npos) << e.what();
    }
  }
  // A budget that holds the state but not a step of a static policy: a typed OOM
  // in the step, counted in the summary.
  const fs::path out = fresh_dir("oom");
  cfg.train.policy = "none";
  cfg.device_memory = Arena::round_up(16 * cfg.model.num_params()) + 512 * kKiB;
  EXPECT_THROW(run_training(options(cfg, out)), OutOfMemoryError);
  auto s = nlohmann::json::parse(std::ifstream(out / "summary.json"));
  EXPECT_EQ(s["oom_count"], 1);
  EXPECT_EQ(s["device_budget_bytes"], cfg.device_memory);
  fs::remove_all(out);
}

TEST(Train, BadInputsGetClearErrors) {
  RunConfig cfg = small_run(3);
  cfg.data.path = "/nonexistent/corpus";
  try {
    run_training(options(cfg, fresh_dir("bad")));
    FAIL();
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/corpus"), std::string::npos) << e.what();
  }
  EXPECT_THROW(RunConfig::from_toml_text("[model]\nhidden_size = 30\nnum_attention_heads = 4\n", "x").validate(),
               ConfigError);
  try {
    RunConfig::from_toml_text("[train]\nstepz = 3\n", "cfg.toml");
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("stepz"), std::string::npos);
  }
  EXPECT_THROW(RunConfig::from_toml_text("[train]\nlr = inf\n", "x").validate(), ConfigError);
  // A model's JSON given as a run config: the error says what it is (and TOML errors do not).
  for (const auto& [text, json] :
       {std::pair<const char*, bool>{"\n  {\"hidden_size\": 4096}", true}, {"[train\n", false}}) {
    try {
      RunConfig::from_toml_text(text, "model.json");
      FAIL() << text;
    } catch (const ConfigError& e) {
      EXPECT_EQ(std::string(e.what()).find("this is JSON") != std::string::npos, json) << e.what();
    }
  }
  // A hardware profile named by --hardware-profile must load even where the run would
  // not price with it (no budget, no --profile-ops): refused, naming file and field,
  // and no run folder is written.
  {
    const fs::path dir = fresh_dir("badprofile");
    fs::create_directories(dir);
    HardwareProfile hp;
    hp.name = "test";
    hp.threads = 1;
    hp.gemm.push_back({64, 64, 64, 1e9, GemmLayout::any});
    hp.memory_bandwidth = hp.h2d_bandwidth = hp.d2h_bandwidth = 1e10;
    nlohmann::json j = hp.to_json();
    j["nap_cost_s"] = -1;
    const fs::path bad = dir / "hw.json";
    std::ofstream(bad) << j.dump();
    TrainOptions o = options(small_run(1), dir / "run");
    o.hardware_profile = bad;
    try {
      run_training(o);
      FAIL() << "a bad --hardware-profile was accepted";
    } catch (const DataError& e) {
      EXPECT_NE(std::string(e.what()).find("'nap_cost_s'"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(bad.string()), std::string::npos) << e.what();
    }
    EXPECT_FALSE(fs::exists(dir / "run"));
    fs::remove_all(dir);
  }
  EXPECT_THROW(RunConfig::from_toml_text("[model]\ncapacity_factor = nan\n", "x").validate(), ConfigError);
  EXPECT_THROW(RunConfig::from_toml_text("[parallel]\npp = 4294967297\n", "x"), ConfigError);
  // Strings with quotes and backslashes survive the resolved config.toml.
  RunConfig odd = RunConfig::defaults();
  odd.data.path = "/tmp/we\"ird\\dir\ttab";
  EXPECT_EQ(RunConfig::from_toml_text(odd.to_toml(), "resolved").data.path, odd.data.path);
  EXPECT_THROW(parse_size("12 parsecs"), ConfigError);
  EXPECT_EQ(parse_size("1.5GiB"), 1536 * kMiB);
  EXPECT_THROW(parse_size("0x10MiB"), ConfigError);            // no hexadecimal
  EXPECT_THROW(parse_size("1e3MiB"), ConfigError);             // no exponent
  EXPECT_THROW(parse_size("99999999999999GiB"), ConfigError);  // overflow, not "must be positive"
  EXPECT_THROW(parse_size("1.2.3MiB"), ConfigError);
  // A model whose state alone outgrows this machine's memory is refused up front (the
  // kernel would kill the process partway through allocating it).
  {
    RunConfig huge = small_run(1);
    huge.model.hidden_size = 65536;
    huge.model.num_hidden_layers = 4096;  // ~7e13 parameters, ~1 PB of state: beyond any host
    const double ram = double(::sysconf(_SC_PHYS_PAGES)) * double(::sysconf(_SC_PAGE_SIZE));
    if (16.0 * double(huge.model.num_params()) <= ram) GTEST_SKIP() << "this host holds a petabyte";
    const fs::path dir = fresh_dir("huge");
    try {
      run_training(options(huge, dir));
      ADD_FAILURE() << "a model larger than the machine's memory was accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("of memory: choose a smaller model"), std::string::npos) << e.what();
    }
    EXPECT_FALSE(fs::exists(dir / "config.toml"));
  }
  // Spaces around the size and before its unit, none within its number or unit.
  EXPECT_EQ(parse_size(" 10 MiB "), 10 * kMiB);
  EXPECT_THROW(parse_size("1 0 MiB"), ConfigError);
  EXPECT_THROW(parse_size("10 Mi B"), ConfigError);
  EXPECT_THROW(parse_size("1 0MiB"), ConfigError);
  EXPECT_THROW(parse_size("1 0"), ConfigError);
  EXPECT_THROW(parse_size("1 .5GiB"), ConfigError);
  EXPECT_EQ(parse_size("2 KiB"), 2 * kKiB);
  try {
    parse_size(" 10XB");
    ADD_FAILURE() << "unit XB accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("unknown unit 'XB'"), std::string::npos) << e.what();
  }
  // Numbers that would wrap on their way to an int are refused, not truncated.
  EXPECT_THROW(RunConfig::from_toml_text("[parallel]\nstage_layers = [4294967297, 3]\n", "x"), ConfigError);
  EXPECT_THROW(RunConfig::from_toml_text("[model]\nnum_experts = 4000000000\n", "x").validate(), ConfigError);
  EXPECT_THROW(RunConfig::from_toml_text("[train]\nmicro_batch_size = 100000000000\n", "x").validate(), ConfigError);
  EXPECT_THROW(RunConfig::from_toml_text("[model]\nmax_position_embeddings = 9223372036854775807\n", "x").validate(),
               ConfigError);
}

// The adaptive planner prices its choices with data/hardware/this-machine.json
// (relative to the working directory). An unusable profile is not fatal (the planner
// falls back to ranking by op family), and the summary says which one priced the run.
TEST(Train, SummaryNamesThePlannersCostModel) {
  const fs::path dir = fresh_dir("profile");
  fs::create_directories(dir / "data" / "hardware");
  const fs::path cwd = fs::current_path();
  fs::current_path(dir);
  struct Back {
    fs::path p;
    ~Back() { fs::current_path(p); }
  } back{cwd};
  std::ofstream(dir / "data" / "hardware" / "this-machine.json") << "{ \"version\": 2, \"gemm\": [";  // truncated
  RunConfig cfg = small_run(2);
  cfg.train.policy = "adaptive";
  cfg.device_memory = 256 * kMiB;
  run_training(options(cfg, dir / "corrupt"));
  auto s = nlohmann::json::parse(std::ifstream(dir / "corrupt" / "summary.json"));
  EXPECT_EQ(s.value("planner_cost_model", ""), "op family");
  fs::remove(dir / "data" / "hardware" / "this-machine.json");
  run_training(options(cfg, dir / "missing"));
  s = nlohmann::json::parse(std::ifstream(dir / "missing" / "summary.json"));
  EXPECT_EQ(s.value("planner_cost_model", ""), "op family");
  HardwareProfile p;  // a usable one: a few GEMM points and the bandwidths
  p.name = "test";
  p.threads = 1;
  p.gemm = {{64, 64, 64, 1e10}, {256, 256, 256, 4e10}};
  p.memory_bandwidth = 1e10;
  p.launch_overhead = 1e-6;
  p.h2d_bandwidth = p.d2h_bandwidth = 1e10;
  p.copy_latency = 1e-5;
  p.save(dir / "data" / "hardware" / "this-machine.json");
  run_training(options(cfg, dir / "priced"));
  s = nlohmann::json::parse(std::ifstream(dir / "priced" / "summary.json"));
  EXPECT_EQ(s.value("planner_cost_model", ""), "data/hardware/this-machine.json");
  // Another device's profile would misprice recomputing against offloading: not used.
  p.device = "cuda";
  p.save(dir / "data" / "hardware" / "this-machine.json");
  run_training(options(cfg, dir / "other-device"));
  s = nlohmann::json::parse(std::ifstream(dir / "other-device" / "summary.json"));
  EXPECT_EQ(s.value("planner_cost_model", ""), "op family");
  cfg.train.policy = "none";
  run_training(options(cfg, dir / "static"));
  s = nlohmann::json::parse(std::ifstream(dir / "static" / "summary.json"));
  EXPECT_FALSE(s.contains("planner_cost_model"));  // no planner
  fs::current_path(cwd);
  fs::remove_all(dir);
}

// What is on disk survives: a new run does not take over a folder that holds a run
// of any rank count, a resume does not touch the run's tokenizer, and --steps on
// resume is the run's new length.
TEST(Train, RunFoldersAreNeverTakenOverOrRewritten) {
  auto message_of = [](const std::function<void()>& fn) -> std::string {
    try {
      fn();
    } catch (const Error& e) {
      return e.what();
    }
    return "(no error)";
  };
  // A folder with another rank count's checkpoint folder, or with metrics only (a run
  // killed before its first checkpoint): refused, left as it was.
  const fs::path multi = fresh_dir("multi");
  fs::create_directories(multi / "rank00001" / "checkpoints");
  EXPECT_NE(message_of([&] { run_training(options(small_run(2), multi)); }).find("cannot be resumed: use another --out"),
            std::string::npos);
  EXPECT_TRUE(fs::is_directory(multi / "rank00001" / "checkpoints"));
  const fs::path killed = fresh_dir("killed");
  fs::create_directories(killed);
  std::ofstream(killed / "config.toml") << "# written first by every run\n";
  std::ofstream(killed / "metrics.jsonl") << "{\"step\": 1, \"loss\": 8.0}\n";
  EXPECT_NE(message_of([&] { run_training(options(small_run(2), killed)); }).find("before its first complete checkpoint"),
            std::string::npos);
  EXPECT_EQ(losses(killed).size(), 1u);
  // Another command's output (a `moeflex simulate --out` folder: a summary, no config.toml).
  const fs::path simulated = fresh_dir("simulated");
  fs::create_directories(simulated);
  std::ofstream(simulated / "summary.json") << "{\"step_time_s\": 1.0}\n";
  EXPECT_NE(message_of([&] { run_training(options(small_run(2), simulated)); })
                .find("holds another command's output (a summary.json or metrics.jsonl without a run's config.toml"),
            std::string::npos);
  EXPECT_EQ(nlohmann::json::parse(std::ifstream(simulated / "summary.json"))["step_time_s"], 1.0);
  // Files a new run would overwrite that no moeflex run wrote (a user's config.toml,
  // the very one given to --config; a trace.json beside no moeflex config): refused,
  // left as they were.
  const fs::path users = fresh_dir("users");
  fs::create_directories(users);
  std::ofstream(users / "config.toml") << "# my notes\n[train]\nsteps = 2\n";
  EXPECT_NE(message_of([&] { run_training(options(small_run(2), users)); })
                .find(fmt::format("--out '{}' holds '{}', which no moeflex run wrote", users.string(),
                                  (users / "config.toml").string())),
            std::string::npos);
  fs::remove(users / "config.toml");
  std::ofstream(users / "trace.json") << "mine";
  EXPECT_NE(message_of([&] { run_training(options(small_run(2), users)); }).find("trace.json', which no moeflex"),
            std::string::npos);
  std::ifstream users_trace(users / "trace.json");
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(users_trace), {}), "mine");
  EXPECT_FALSE(fs::exists(users / "config.toml"));
  // A folder a refused run left (its config.toml only) is taken over.
  const fs::path refused = fresh_dir("refused");
  fs::create_directories(refused);
  std::ofstream(refused / "config.toml") << kRunConfigHeader << "\n# left by a refused run\n";
  RunConfig cfg = small_run(4);
  cfg.train.checkpoint_every = 2;
  const TrainResult r = run_training(options(cfg, refused));
  EXPECT_EQ(r.steps, 4);
  // --steps on resume is saved: a later plain resume keeps it. Folders that only
  // begin like a rank's (rank00000, ...) do not count as ranks.
  fs::create_directories(refused / "rank_notes");
  fs::create_directories(refused / "rankings");
  TrainOptions more = options(small_run(6), refused);
  more.resume = refused;
  more.stop_after = 5;
  EXPECT_EQ(run_training(more).steps, 5);
  EXPECT_EQ(RunConfig::from_file((refused / "config.toml").string()).train.steps, 6);
  TrainOptions plain = options(small_run(1), refused);
  plain.config.train.steps = -1;
  plain.resume = refused;
  EXPECT_EQ(run_training(plain).steps, 6);
  // A damaged trainer_state in the newest checkpoint's manifest (no checksum covers
  // it) is refused naming the manifest and the field, before anything is restored.
  const fs::path manifest = refused / "checkpoints" / "step_00000006" / "manifest.json";
  const std::string manifest_text = [&] {
    std::ifstream in(manifest);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }();
  TrainOptions longer = options(small_run(1), refused);
  longer.config.train.steps = 8;
  longer.resume = refused;
  auto resume_with = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json m = nlohmann::json::parse(manifest_text);
    edit(m["trainer_state"]);
    std::ofstream(manifest) << m.dump(2);
    return message_of([&] { run_training(longer); });
  };
  std::string m = resume_with([](nlohmann::json& st) { st.erase("adam_steps"); });
  EXPECT_NE(m.find(fmt::format("Checkpoint manifest '{}': trainer_state has no 'adam_steps'", manifest.string())),
            std::string::npos)
      << m;
  m = resume_with([](nlohmann::json& st) { st["step"] = 5; });
  EXPECT_NE(m.find("trainer_state 'step' is 5, but the checkpoint is of step 6"), std::string::npos) << m;
  m = resume_with([](nlohmann::json& st) { st["tokens"] = "many"; });
  EXPECT_NE(m.find("'tokens' must be a non-negative integer (got \"many\")"), std::string::npos) << m;
  m = resume_with([](nlohmann::json& st) { st = nullptr; });
  EXPECT_NE(m.find("trainer_state must be an object (got null)"), std::string::npos) << m;
  std::ofstream(manifest) << manifest_text;
  // A run whose tokenizer differs from the corpus's (the corpus changed): refused,
  // and the run's tokenizer.model is not replaced.
  const std::string tok_bytes = [&] {
    std::ifstream in(refused / "tokenizer.model", std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }();
  std::ofstream(refused / "tokenizer.model", std::ios::binary) << "not the corpus's tokenizer";
  TrainOptions again = options(small_run(8), refused);
  again.resume = refused;
  EXPECT_NE(message_of([&] { run_training(again); }).find("has changed since the run began"), std::string::npos);
  std::ifstream tok(refused / "tokenizer.model");
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(tok), {}), "not the corpus's tokenizer");
  // A resume with nothing left to train leaves the run's trace.json as it was.
  std::ofstream(refused / "tokenizer.model", std::ios::binary) << tok_bytes;
  std::ofstream(refused / "trace.json") << "{\"traceEvents\": [\"kept\"]}";
  TrainOptions done = options(small_run(1), refused);
  done.config.train.steps = -1;
  done.resume = refused;
  EXPECT_EQ(run_training(done).steps, 6);
  std::ifstream trace_in(refused / "trace.json");
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(trace_in), {}), "{\"traceEvents\": [\"kept\"]}");
  // A config edited to another vocab_size is named as the cause (not the corpus), and
  // the run is left as it was.
  const std::string config_text = [&] {
    std::ifstream in(refused / "config.toml");
    return std::string(std::istreambuf_iterator<char>(in), {});
  }();
  const std::string vocab_line = fmt::format("vocab_size = {}\n", small_run(1).model.vocab_size);
  ASSERT_NE(config_text.find(vocab_line), std::string::npos);
  std::string edited = config_text;
  edited.replace(edited.find(vocab_line), vocab_line.size(), "vocab_size = 2048\n");
  std::ofstream(refused / "config.toml") << edited;
  TrainOptions vocab = options(small_run(1), refused);
  vocab.config.train.steps = 8;
  vocab.resume = refused;
  EXPECT_NE(message_of([&] { run_training(vocab); })
                .find(fmt::format("the run's config.toml says vocab_size = 2048, but its tokenizer.model (the one the "
                                  "model was trained with) has {} pieces",
                                  small_run(1).model.vocab_size)),
            std::string::npos);
  std::ofstream(refused / "config.toml") << config_text;
  // Without its tokenizer.model the corpus cannot be checked: refused.
  fs::remove(refused / "tokenizer.model");
  EXPECT_NE(message_of([&] { run_training(again); }).find("has no tokenizer.model"), std::string::npos);
  EXPECT_FALSE(fs::exists(refused / "tokenizer.model"));
  // One process at a time: while another holds the folder's lock, a run is refused.
  const fs::path locked = fresh_dir("locked");
  fs::create_directories(locked);
  const int fd = ::open((locked / ".moeflex.lock").c_str(), O_RDWR | O_CREAT, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);
  EXPECT_NE(message_of([&] { run_training(options(small_run(2), locked)); }).find("another moeflex process"),
            std::string::npos);
  EXPECT_FALSE(fs::exists(locked / "config.toml"));
  ::close(fd);
  fs::remove_all(locked);
  // The schedules' micro-batch requirements are named in the config's terms.
  RunConfig il = small_run(2);
  il.parallel.pp = 2;
  il.parallel.schedule = "interleaved";
  EXPECT_NE(message_of([&] { il.validate(); }).find("train.grad_accum"), std::string::npos);
  il.train.grad_accum = 2;
  EXPECT_NO_THROW(il.validate());
  il.model.capacity_factor = -1;
  EXPECT_NE(message_of([&] { il.validate(); }).find("capacity_factor"), std::string::npos);
  for (const fs::path& d : {multi, killed, refused}) fs::remove_all(d);
}

namespace {

// The first `n` training tokens of the Brown corpus prepared with a 2048-token
// vocabulary (documents closed by eos, id 2).
std::vector<std::int32_t> brown_tokens(std::size_t n) {
  const DatasetInfo info =
      prepare_dataset(kSrc / "data" / "brown", kSrc / "data" / "tokenized" / "brown-v2048", 2048, 0.05, 1234,
                      [](const std::string&) {});
  std::vector<std::int32_t> tokens(n);
  TokenDataset::open(info.dir).copy_tokens(Split::kTrain, 0, std::int64_t(n), tokens.data());
  return tokens;
}

// A resume of `run` (to 20 steps) whose pre-tokenized files were replaced: refused.
void expect_resume_refused_on_other_data(const RunConfig& cfg, const fs::path& run) {
  TrainOptions o = options(cfg, run);
  o.resume = run;
  o.config.train.steps = 20;
  const std::string e = test::error_text<Error>([&] { run_training(o); });
  EXPECT_NE(e.find("differs from the data the run began with"), std::string::npos) << e;
}

}  // namespace

// A flat uint16 token file of the Brown corpus (the prepared dataset's ids, whose
// documents end with eos): trains, records its identity, and a changed file is refused.
TEST(Train, FlatTokenFileTrainsAndAChangedFileIsRefused) {
  ASSERT_TRUE(fs::exists(kSrc / "data" / "brown")) << "run `make data` first";
  const fs::path dir = fresh_dir("flat");
  fs::create_directories(dir);
  const std::vector<std::int32_t> tokens = brown_tokens(200000);
  const std::vector<std::uint16_t> narrow(tokens.begin(), tokens.end());
  const auto write = [&](const std::vector<std::uint16_t>& t) {
    std::ofstream(dir / "brown.u16", std::ios::binary | std::ios::trunc)
        .write(reinterpret_cast<const char*>(t.data()), std::streamsize(t.size() * 2));
  };
  write(narrow);
  RunConfig cfg = small_run(12);
  cfg.data.path = (dir / "brown.u16").string();
  cfg.data.eos_id = 2;  // the prepared dataset's eos (tokenizer.h)
  const TrainResult r = run_training(options(cfg, dir / "run"));
  EXPECT_LT(r.final_val_loss, 0.95 * r.initial_val_loss) << "initial " << r.initial_val_loss << " final " << r.final_val_loss;
  std::vector<std::uint16_t> changed = narrow;
  changed[changed.size() - 1] = 5;  // the last token: inside the last sampled block
  write(changed);
  expect_resume_refused_on_other_data(cfg, dir / "run");
  fs::remove_all(dir);
}

// A Megatron indexed dataset (written by tests/reference/write_megatron.py from the
// prepared corpus's tokens, one document per eos) trains as it is: the loss falls, a
// resumed run reproduces an uninterrupted one bit for bit, a resume whose files were
// replaced is refused, and sampling (which needs a tokenizer) says why it cannot.
TEST(Train, MegatronIndexedDataTrainsAndResumes) {
  ASSERT_TRUE(fs::exists(kSrc / "data" / "brown")) << "run `make data` first";
  const fs::path dir = fresh_dir("megatron");
  fs::create_directories(dir);
  const std::vector<std::int32_t> tokens = brown_tokens(200000);
  std::ofstream(dir / "tokens.i32", std::ios::binary)
      .write(reinterpret_cast<const char*>(tokens.data()), std::streamsize(tokens.size() * 4));
  const auto write = [&](const std::string& args) {
    const std::string cmd = fmt::format("/usr/bin/python3 '{}' {}",
                                        (kSrc / "tests" / "reference" / "write_megatron.py").string(), args);
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  };
  write(fmt::format("'{}' uint16 tokens '{}' 2", (dir / "brown").string(), (dir / "tokens.i32").string()));
  RunConfig cfg = small_run(12);
  cfg.data.path = (dir / "brown.idx").string();
  const fs::path a = dir / "straight", b = dir / "resumed";
  const TrainResult whole = run_training(options(cfg, a));
  EXPECT_LT(whole.final_val_loss, 0.95 * whole.initial_val_loss)
      << "initial " << whole.initial_val_loss << " final " << whole.final_val_loss;
  EXPECT_TRUE(fs::exists(a / "tokens.json"));
  EXPECT_FALSE(fs::exists(a / "tokenizer.model"));
  TrainOptions first = options(cfg, b);
  first.stop_after = 5;
  run_training(first);
  TrainOptions second = options(cfg, b);
  second.config.train.steps = -1;
  second.resume = b;
  EXPECT_EQ(run_training(second).final_val_loss, whole.final_val_loss);
  EXPECT_EQ(losses(a), losses(b));
  GenerateOptions g;
  g.run_dir = a;
  g.prompt = "The";
  try {
    generate_text(g);
    ADD_FAILURE() << "sampled without a tokenizer";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("pre-tokenized"), std::string::npos) << e.what();
  }
  // Other documents under the run's file names: refused, and the run left as it was.
  write(fmt::format("'{}' uint16 random 4 40 1000", (dir / "brown").string()));
  expect_resume_refused_on_other_data(cfg, a);
  EXPECT_EQ(losses(a).size(), 12u);
  fs::remove_all(dir);
}
