// Input handling of `moeflex simulate` / `moeflex search`: memory budgets that
// cannot work, OOM accounting when every iteration fails, Hugging Face configs
// with missing or mistyped fields, --trace-ranks, corrupt loads.jsonl values,
// cluster JSON keys and counts, and --out checked before the long work.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <fstream>
#include <iterator>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "model_fixtures.h"
#include "moeflex/core/error.h"
#include "moeflex/model/config.h"
#include "moeflex/search/search.h"
#include "moeflex/sim/cluster.h"
#include "moeflex/sim/loads.h"
#include "moeflex/sim/presets.h"
#include "moeflex/sim/simulator.h"
#include "sim_fixtures.h"

using namespace moeflex;
using namespace moeflex::sim;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

/// The message of the exception of type E that `fn` throws ("" when none).
template <typename E, typename F>
std::string error_of(F&& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  }
  return "";
}

SimOptions small_options(int pp) {
  SimOptions o;
  o.model = test::small_moe_config(4, 1, 8, true);
  o.cluster.name = "test";
  o.cluster.gpus_per_node = 8;
  o.cluster.device_memory = kGiB;
  o.cluster.intra_node = {1e-6, 100e9};
  o.cluster.inter_node = {5e-6, 10e9};
  o.cluster.peak_flops = test::kGemmOnlyRate;
  o.cluster.profile = test::gemm_only_profile();
  o.parallel.pp = pp;
  o.micro_batch_size = 2;
  o.seq_len = 16;
  o.global_batch = 2 * 4;
  o.loads.constant = 1.0;
  return o;
}

fs::path scratch(const std::string& tag) {
  const fs::path d = fs::path(MOEFLEX_BINARY_DIR) / "test_sim_inputs.d" / fmt::format("{}-{}", tag, ::getpid());
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

fs::path write(const fs::path& p, const std::string& text) {
  std::ofstream(p) << text;
  return p;
}

}  // namespace

// ---- 1. memory budgets and the OOM account ----------------------------------------

TEST(SimInputs, BudgetBelowARanksPersistentStateIsRefusedNamingTheRank) {
  SimOptions o = small_options(2);
  const SimReport fits = simulate(o);
  ASSERT_EQ(fits.ranks.size(), 2u);
  const Bytes p0 = fits.ranks[0].persistent_bytes, p1 = fits.ranks[1].persistent_bytes;
  ASSERT_NE(p0, p1);  // a dense layer on rank 0, MoE layers and the head on rank 1
  const int fat = p0 > p1 ? 0 : 1;
  const Bytes most = std::max(p0, p1);
  o.memory_limit = most - 1;  // the other rank fits: only `fat` is named
  const std::string msg = error_of<ConfigError>([&] { simulate(o); });
  EXPECT_NE(msg.find(fmt::format("pipeline rank {}'s persistent state", fat)), std::string::npos) << msg;
  EXPECT_NE(msg.find(fmt::format("{} B) of weights", most)), std::string::npos) << msg;
  EXPECT_NE(msg.find(fmt::format("({} B per device", most - 1)), std::string::npos) << msg;
  o.memory_limit = most;  // holds the state; the activations then do not fit
  EXPECT_NO_THROW(simulate(o));
}

TEST(SimInputs, AdaptiveBelowTheTrainersMinimumBudgetIsRefused) {
  SimOptions o = small_options(2);
  o.policy = "adaptive";
  o.parallel.dp = o.parallel.ep = 2;
  o.global_batch = 2 * 2 * 4;
  const Bytes need = adaptive_minimum_budget(o);
  o.memory_limit = kGiB;
  const SimReport free = simulate(o);
  Bytes persist = 0;
  for (const auto& r : free.ranks) persist = std::max(persist, r.persistent_bytes);
  EXPECT_GT(need, persist);  // the state plus a step's activations
  o.memory_limit = need - 1;
  const std::string msg = error_of<ConfigError>([&] { simulate(o); });
  EXPECT_NE(msg.find("smallest budget for which adaptive provisioning"), std::string::npos) << msg;
  EXPECT_NE(msg.find(fmt::format("{} B:", need)), std::string::npos) << msg;
  // Worst-case routing grows with the EP group: one rank may receive every rank's
  // rows, so the step's part of the minimum (beyond the state) is larger with ep 2.
  SimOptions one = o;
  one.parallel.ep = 1;
  EXPECT_LT(adaptive_minimum_budget(one) - max_persistent_bytes(one), need - max_persistent_bytes(o));
  // At the minimum the planner's guarantee holds: no iteration runs out of memory.
  o.memory_limit = need;
  o.iterations = 3;
  const SimReport r = simulate(o);
  EXPECT_EQ(r.ooms, 0);
  EXPECT_LE(r.peak_bytes, need);
}

TEST(SimInputs, EveryIterationOutOfMemoryMakesNoProgressAndRollsNothingBack) {
  SimOptions o = small_options(1);
  o.iterations = 10;
  o.checkpoint_interval = 50;
  o.restart_seconds = 100;
  const SimReport fits = simulate(o);
  o.memory_limit = fits.peak_bytes - 1;  // at constant loads every iteration is the same
  const SimReport r = simulate(o);
  EXPECT_EQ(r.ooms, 10);
  EXPECT_EQ(r.lost_iterations, 0);  // none completes, so none is rolled back
  EXPECT_LE(r.lost_iterations, o.iterations);
  EXPECT_EQ(r.effective_tgs, 0.0);
  EXPECT_EQ(r.effective_mfu, 0.0);
  EXPECT_GT(r.tgs, 0.0);
  EXPECT_NEAR(r.restart_time, 10 * (100 + r.step_time), 1e-9);  // each failed attempt and its restart
  EXPECT_NE(r.note.find("every iteration ran out of memory"), std::string::npos) << r.note;
  EXPECT_NE(r.format().find("every iteration ran out of memory"), std::string::npos);
  EXPECT_EQ(r.to_json().at("note"), r.note);
  EXPECT_TRUE(fits.note.empty());
}

// Some iterations fit: each OOM rolls back to the last checkpoint and the run goes on.
TEST(SimInputs, SpikeOomsRollBackToTheCheckpointAndTheRunProgresses) {
  SimOptions o = small_options(1);
  o.parallel.dp = o.parallel.ep = 2;
  o.global_batch = 2 * 2 * 4;
  o.iterations = 4;
  o.checkpoint_interval = 3;
  o.restart_seconds = 100;
  // A metrics.jsonl replay: iterations 0 and 2 hot (ratio 100 x 2 / 128), 1 and 3 balanced.
  const fs::path d = scratch("spikes");
  std::ofstream m(d / "metrics.jsonl");
  for (int s = 0; s < 2; ++s) {
    m << json{{"step", 2 * s + 1}, {"ep_received_tokens", {{100, 28}}}}.dump() << "\n";
    m << json{{"step", 2 * s + 2}, {"ep_received_tokens", {{64, 64}}}}.dump() << "\n";
  }
  m.close();
  o.loads = LoadModel::from_file(d / "metrics.jsonl");
  const SimReport free = simulate(o);
  const Bytes hot = free.peak_bytes, calm = free.ranks[0].peak_balanced_bytes;
  ASSERT_LT(calm, hot);
  o.memory_limit = calm;
  const SimReport r = simulate(o);
  EXPECT_EQ(r.ooms, 2);
  // OOM at 0: nothing since the checkpoint; at 2: iterations 0 and 1 (checkpoint every 3).
  EXPECT_EQ(r.lost_iterations, 2);
  EXPECT_TRUE(r.note.empty());
  EXPECT_GT(r.effective_tgs, 0);
  EXPECT_LT(r.effective_tgs, r.tgs);
}

// ---- 2. Hugging Face config.json ----------------------------------------------------

TEST(SimInputs, HfConfigNeedsItsShapeFieldsAndRefusesWrongTypes) {
  const fs::path root = MOEFLEX_SOURCE_DIR;
  const json mixtral = json::parse(std::ifstream(root / "configs/models/mixtral-8x7b.json"));
  const json deepseek = json::parse(std::ifstream(root / "configs/models/deepseek-v3.json"));
  const json qwen = json::parse(std::ifstream(root / "configs/models/qwen3-30b-a3b.json"));
  auto msg = [](const json& j) { return error_of<ConfigError>([&] { ModelConfig::from_hf_json(j, "m.json"); }); };

  EXPECT_NE(msg(json::object()).find("m.json: missing field 'vocab_size'"), std::string::npos) << msg(json::object());
  EXPECT_NE(msg(json::array()).find("must be a JSON object"), std::string::npos);
  json j = mixtral;
  j["hidden_size"] = "big";
  EXPECT_NE(msg(j).find("m.json: field 'hidden_size' must be an integer (got \"big\")"), std::string::npos) << msg(j);
  j["hidden_size"] = 4096.5;
  EXPECT_NE(msg(j).find("'hidden_size' must be an integer (got 4096.5)"), std::string::npos) << msg(j);
  j["hidden_size"] = 4096.0;  // a whole float reads as the integer
  EXPECT_EQ(ModelConfig::from_hf_json(j).hidden_size, 4096);
  j.erase("hidden_size");
  EXPECT_NE(msg(j).find("missing field 'hidden_size'"), std::string::npos) << msg(j);
  j = mixtral;
  j.erase("intermediate_size");  // Mixtral's experts' width
  EXPECT_NE(msg(j).find("missing field 'intermediate_size' (the experts' width)"), std::string::npos) << msg(j);
  j = mixtral;
  j["tie_word_embeddings"] = "no";
  EXPECT_NE(msg(j).find("'tie_word_embeddings' must be true or false (got \"no\")"), std::string::npos) << msg(j);
  j = mixtral;
  j["rope_theta"] = "1e6";
  EXPECT_NE(msg(j).find("'rope_theta' must be a number"), std::string::npos) << msg(j);
  j = mixtral;
  j["num_local_experts"] = 18446744073709551615ull;  // would wrap to -1
  EXPECT_NE(msg(j).find("'num_local_experts' must be an integer below 2^63"), std::string::npos) << msg(j);
  j = deepseek;
  j.erase("n_routed_experts");
  EXPECT_NE(msg(j).find("'num_experts' (or 'num_local_experts', 'n_routed_experts')"), std::string::npos) << msg(j);
  j = deepseek;
  j.erase("intermediate_size");  // its first 3 layers are dense
  EXPECT_NE(msg(j).find("'intermediate_size' (the dense layers' width)"), std::string::npos) << msg(j);
  j = qwen;
  j.erase("moe_intermediate_size");
  EXPECT_NE(msg(j).find("missing field 'moe_intermediate_size'"), std::string::npos) << msg(j);
  j = qwen;
  j.erase("num_experts_per_tok");
  EXPECT_NE(msg(j).find("missing field 'num_experts_per_tok'"), std::string::npos) << msg(j);
  // Defaults that are legitimate stay: no RoPE base or norm epsilon needed, null is absent.
  j = qwen;
  j.erase("rope_theta");
  j["rms_norm_eps"] = nullptr;
  const ModelConfig q = ModelConfig::from_hf_json(j);
  EXPECT_EQ(q.hidden_size, 2048);
  EXPECT_EQ(q.num_experts, 128);
  EXPECT_EQ(q.rope_theta, ModelConfig{}.rope_theta);

  // Through the loader: the file is named, and every shipped preset still loads.
  const fs::path d = scratch("hf");
  const fs::path empty = write(d / "empty.json", "{}");
  const std::string e = error_of<ConfigError>([&] { load_model(empty.string(), root); });
  EXPECT_NE(e.find(empty.string() + ": missing field 'vocab_size'"), std::string::npos) << e;
  for (const std::string& name : preset_names(root, "models")) EXPECT_NO_THROW(load_model(name, root)) << name;
  EXPECT_GE(preset_names(root, "models").size(), 6u);
}

// ---- 3. --trace-ranks ---------------------------------------------------------------

TEST(SimInputs, TraceRanksAreNonNegativeIntegers) {
  EXPECT_EQ(parse_trace_ranks("0,3"), (std::vector<int>{0, 3}));
  EXPECT_EQ(parse_trace_ranks(""), std::vector<int>{});
  EXPECT_EQ(parse_trace_ranks("2,,5"), (std::vector<int>{2, 5}));
  for (const std::string bad : {"abc", "1,x", "3a", "-1", "99999999999"}) {
    const std::string msg = error_of<ConfigError>([&] { parse_trace_ranks(bad); });
    EXPECT_NE(msg.find(fmt::format("--trace-ranks '{}'", bad)), std::string::npos) << msg;
  }
  EXPECT_NE(error_of<ConfigError>([] { parse_trace_ranks("1,x"); }).find("'x' is not a pipeline rank"),
            std::string::npos);
  // A rank outside the pipeline is refused before the simulation.
  SimOptions o = small_options(2);
  o.trace_ranks = {2};
  EXPECT_NE(error_of<ConfigError>([&] { simulate(o); }).find("pipeline rank 2 is not in [0, 2)"), std::string::npos);
}

// ---- 4. corrupt loads.jsonl ---------------------------------------------------------

TEST(SimInputs, LoadsValuesAreRangeCheckedBeforeNarrowing) {
  const fs::path good = test::write_loads_jsonl(64, "inputs-loads") / "loads.jsonl";
  const json line = json::parse(std::ifstream(good));
  ASSERT_NO_THROW(LoadModel::from_file(good));
  const fs::path d = scratch("loads");
  auto msg = [&](const json& j) {
    const fs::path p = write(d / "loads.jsonl", j.dump() + "\n");
    return error_of<DataError>([&] { LoadModel::from_file(p); });
  };
  json j = line;
  j["dp"] = 4294967298ull;  // 2 mod 2^32
  std::string m = msg(j);
  EXPECT_NE(m.find("loads.jsonl:1: dp must be an integer in [1, 16777216] (got 4294967298)"), std::string::npos) << m;
  j = line;
  j["ep"] = 4294967298ull;
  m = msg(j);
  EXPECT_NE(m.find("ep must be an integer in [1, 16777216] (got 4294967298)"), std::string::npos) << m;
  j = line;
  j["dp"] = 1e12;
  m = msg(j);
  EXPECT_NE(m.find("dp must be an integer"), std::string::npos) << m;
  EXPECT_EQ(m.find("-727379968"), std::string::npos) << m;
  j = line;
  j["microbatches"] = -3;
  EXPECT_NE(msg(j).find("microbatches must be an integer in [1, "), std::string::npos) << msg(j);
  j = line;
  j["received"][1][2][0] = 4294967424ull;  // 128 mod 2^32
  m = msg(j);
  EXPECT_NE(m.find("received[layer 1][micro-batch 2][rank 0] = 4294967424 is more than the 128 assignments"),
            std::string::npos)
      << m;
  j = line;
  j["kept"][0][1][1] = 18446744073709551615ull;  // -1 as int64
  m = msg(j);
  EXPECT_NE(m.find("kept[layer 0][micro-batch 1][rank 1] must be an integer in [0, "), std::string::npos) << m;
  j = line;
  j["received"][0][0][1] = 28.5;
  EXPECT_NE(msg(j).find("received[layer 0][micro-batch 0][rank 1] must be an integer"), std::string::npos) << msg(j);
  j = line;
  j["received"][0][0] = {1, 2, 3};  // three ranks of dp 2
  EXPECT_NE(msg(j).find("'received' must be 2 layers x 3 micro-batches x 2 ranks"), std::string::npos) << msg(j);
}

// ---- 6. cluster JSON ----------------------------------------------------------------

TEST(SimInputs, ClusterJsonRefusesUnknownKeysAndFractionalCounts) {
  const fs::path root = MOEFLEX_SOURCE_DIR;
  const json h100 = json::parse(std::ifstream(root / "configs/clusters/h100.json"));
  auto msg = [](const json& j) { return error_of<DataError>([&] { ClusterSpec::from_json(j, "c.json", "."); }); };
  ASSERT_EQ(msg(h100), "");
  json j = h100;
  j["reserved_memory_byte"] = 1;
  EXPECT_NE(msg(j).find("c.json: unknown field 'reserved_memory_byte' (did you mean 'reserved_memory_bytes'?)"),
            std::string::npos)
      << msg(j);
  j = h100;
  j["colour"] = "green";
  EXPECT_NE(msg(j).find("unknown field 'colour'"), std::string::npos) << msg(j);
  EXPECT_EQ(msg(j).find("did you mean"), std::string::npos) << msg(j);
  j = h100;
  j["device"]["peak_flop"] = 1e15;
  EXPECT_NE(msg(j).find("c.json: device: unknown field 'peak_flop' (did you mean 'peak_flops'?)"), std::string::npos)
      << msg(j);
  j = h100;
  j["intra_node"]["latency"] = 1e-6;
  EXPECT_NE(msg(j).find("c.json: intra_node: unknown field 'latency'"), std::string::npos) << msg(j);
  j = h100;
  j["gpus_per_node"] = 1.5;
  EXPECT_NE(msg(j).find("field 'gpus_per_node' must be a whole number (got 1.5)"), std::string::npos) << msg(j);
  j = h100;
  j["gpus_per_node"] = 1e12;
  EXPECT_NE(msg(j).find("'gpus_per_node' must be a whole number of at most"), std::string::npos) << msg(j);
  j = h100;
  j["device_memory_bytes"] = 85899345920.5;
  EXPECT_NE(msg(j).find("'device_memory_bytes' must be a whole number"), std::string::npos) << msg(j);
  j = h100;
  j["flash_attention"] = 1;
  EXPECT_NE(msg(j).find("'flash_attention' must be true or false"), std::string::npos) << msg(j);
  j = h100;
  j["gpus_per_node"] = 16.0;  // a whole float is a count
  EXPECT_EQ(ClusterSpec::from_json(j, "c.json", ".").gpus_per_node, 16);
  for (const std::string& name : preset_names(root, "clusters")) {
    if (name == "this-machine" && !fs::exists(root / "data/hardware/this-machine.json")) continue;  // needs calibrate
    EXPECT_NO_THROW(load_cluster(name, root)) << name;
  }
}

// --hardware-profile: a calibrated profile prices a preset's devices (a data-sheet
// cluster keeps its peak for MFU); one that does not exist is refused by name.
TEST(SimInputs, AHardwareProfileReplacesTheClustersPricing) {
  const fs::path root = MOEFLEX_SOURCE_DIR;
  const fs::path d = scratch("profile");
  HardwareProfile p = test::gemm_only_profile();
  p.name = "measured elsewhere";
  p.all_to_all_latency = 7e-6;
  p.all_to_all_bandwidth = 3e9;
  p.save(d / "p.json");
  const ClusterSpec plain = load_cluster("h100", root);
  const ClusterSpec priced = load_cluster("h100", root, (d / "p.json").string());
  EXPECT_NE(plain.profile.name, "measured elsewhere");
  EXPECT_EQ(priced.profile.name, "measured elsewhere");
  EXPECT_EQ(priced.peak_flops, plain.peak_flops);  // the data sheet's, not the profile's best GEMM
  EXPECT_EQ(priced.gpus_per_node, plain.gpus_per_node);
  // A data-sheet cluster keeps its links (NVLink, InfiniBand); a calibrated cluster
  // (this-machine) takes the link a profile measured under mpirun.
  EXPECT_EQ(priced.intra_node.bandwidth, plain.intra_node.bandwidth);
  EXPECT_EQ(priced.inter_node.latency, plain.inter_node.latency);
  write(d / "machine.json", R"({"name": "m", "gpus_per_node": 8, "device_memory_bytes": 1073741824,
                                "profile": "unused.json", "intra_node": {"latency_s": 2e-5, "bandwidth_Bps": 2e9},
                                "inter_node": {"latency_s": 2e-5, "bandwidth_Bps": 2e9}})");
  const ClusterSpec machine = load_cluster((d / "machine.json").string(), root, (d / "p.json").string());
  EXPECT_EQ(machine.intra_node.bandwidth, 3e9);
  EXPECT_EQ(machine.inter_node.latency, 7e-6);
  std::string msg = error_of<DataError>([&] { load_cluster("h100", root, (d / "none.json").string()); });
  EXPECT_NE(msg.find("hardware profile '" + (d / "none.json").string() + "' does not exist"), std::string::npos) << msg;
  msg = error_of<DataError>([&] { load_cluster("h100", root, d.string()); });
  EXPECT_NE(msg.find("hardware profile '" + d.string() + "' is not a file"), std::string::npos) << msg;
  // A data sheet is checked as it is, flag or not.
  json bad = json::parse(std::ifstream(root / "configs/clusters/h100.json"));
  bad["device"]["peek_flops"] = 1e15;
  write(d / "bad.json", bad.dump());
  msg = error_of<DataError>([&] { load_cluster((d / "bad.json").string(), root, (d / "p.json").string()); });
  EXPECT_NE(msg.find("unknown field 'peek_flops'"), std::string::npos) << msg;
  fs::remove_all(d);
}

// ---- 5. --out, checked before the work (through the binary) -------------------------

namespace {
/// Runs `bin args` from the source folder: its exit status and its stdout and stderr.
std::pair<int, std::string> run_moeflex(const fs::path& bin, const std::string& args) {
  const std::string cmd = fmt::format("cd {} && {} {} 2>&1", MOEFLEX_SOURCE_DIR, bin.string(), args);
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  std::array<char, 4096> buf{};
  while (std::size_t n = std::fread(buf.data(), 1, buf.size(), p)) out.append(buf.data(), n);
  const int status = pclose(p);
  return std::make_pair(WEXITSTATUS(status), out);
}
}  // namespace

TEST(SimInputs, OutIsCheckedBeforeTheWork) {
  const fs::path bin = fs::path(MOEFLEX_BINARY_DIR) / "moeflex";
  if (!fs::exists(bin)) GTEST_SKIP() << bin << " is not built";
  const fs::path d = scratch("out");
  const fs::path file = write(d / "a-file", "x");
  auto run = [&](const std::string& args) { return run_moeflex(bin, args); };
  // search writes one file: a directory is refused at once (not after the search).
  auto [rc, out] = run(fmt::format("search --gpus 8 --cluster h100 --out {}", d.string()));
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find(fmt::format("--out '{}' is a directory", d.string())), std::string::npos) << out;
  EXPECT_EQ(out.find("combinations"), std::string::npos) << out;  // the search did not run
  // simulate writes into a directory: a file in its place, or a parent that is a file.
  std::tie(rc, out) = run(fmt::format("simulate --cluster h100 --out {}", file.string()));
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find(fmt::format("{} exists and is not a directory", file.string())), std::string::npos) << out;
  std::tie(rc, out) = run(fmt::format("simulate --cluster h100 --out {}/sub", file.string()));
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find(fmt::format("--out '{}/sub': cannot create", file.string())), std::string::npos) << out;
  std::tie(rc, out) = run(fmt::format("search --gpus 8 --cluster h100 --out {}/sub/r.json", file.string()));
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("cannot create"), std::string::npos) << out;
  // The other flags: --trace-ranks and --memory.
  std::tie(rc, out) = run(fmt::format("simulate --cluster h100 --trace-ranks abc --out {}/ok", d.string()));
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("--trace-ranks 'abc': 'abc' is not a pipeline rank"), std::string::npos) << out;
  std::tie(rc, out) = run("simulate --cluster h100 --memory 0");
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("--memory '0': give a positive size"), std::string::npos) << out;
}

// A first word that names no command is named back with the commands there are (CLI11
// alone said "A subcommand is required"); a known one still parses.
TEST(SimInputs, AnUnknownCommandIsNamed) {
  const fs::path bin = fs::path(MOEFLEX_BINARY_DIR) / "moeflex";
  if (!fs::exists(bin)) GTEST_SKIP() << bin << " is not built";
  auto [rc, out] = run_moeflex(bin, "simulat --cluster h100");
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("unknown command 'simulat' (commands: train, generate, export-hf, import-hf, calibrate, simulate, search"),
            std::string::npos)
      << out;
  std::tie(rc, out) = run_moeflex(bin, "search --help");
  EXPECT_EQ(rc, 0) << out;
  EXPECT_EQ(out.find("unknown command"), std::string::npos) << out;
}

// A flag given twice takes its last value (`make train ARGS=...` adds to the
// Makefile's own flags), in every subcommand.
TEST(SimInputs, ARepeatedFlagTakesItsLastValue) {
  const fs::path bin = fs::path(MOEFLEX_BINARY_DIR) / "moeflex";
  if (!fs::exists(bin)) GTEST_SKIP() << bin << " is not built";
  const fs::path d = scratch("repeated");
  auto run = [&](const std::string& args) { return run_moeflex(bin, args); };
  auto [rc, out] = run(fmt::format("simulate --cluster h100 --memory 0 --memory 80GiB --out {}/a", d.string()));
  EXPECT_EQ(rc, 0) << out;
  std::tie(rc, out) = run(fmt::format("simulate --cluster h100 --memory 80GiB --memory 0 --out {}/b", d.string()));
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("--memory '0': give a positive size"), std::string::npos) << out;
  std::tie(rc, out) = run("train --policy none --policy bogus --steps 1 --out " + (d / "c").string());
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("bogus"), std::string::npos) << out;
  EXPECT_EQ(out.find("At Most 1"), std::string::npos) << out;
}

TEST(SimInputs, SearchTriesOnlyTheSchedulesAndPoliciesNamed) {
  const fs::path bin = fs::path(MOEFLEX_BINARY_DIR) / "moeflex";
  if (!fs::exists(bin)) GTEST_SKIP() << bin << " is not built";
  const fs::path d = scratch("search-filters");
  auto run = [&](const std::string& args) { return run_moeflex(bin, args); };
  auto [rc, out] =
      run(fmt::format("search --cluster h100 --gpus 8 --seq-len 128 --schedules 1f1b,zb-h1 --policies "
                      "none,full --top 1000 --out {}/s.json",
                      d.string()));
  ASSERT_EQ(rc, 0) << out;
  std::ifstream in(d / "s.json");
  const auto j = nlohmann::json::parse(in);
  ASSERT_FALSE(j["top"].empty());
  std::set<std::string> schedules, policies;
  for (const auto& c : j["top"]) schedules.insert(c["schedule"]), policies.insert(c["policy"]);
  for (const auto& s : schedules) EXPECT_TRUE(s == "1f1b" || s == "zb-h1") << s;
  for (const auto& p : policies) EXPECT_TRUE(p == "none" || p == "full") << p;
  EXPECT_EQ(policies.size(), 2u);
  std::tie(rc, out) = run("search --cluster h100 --gpus 4 --schedules 1f1b,pipedream");
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("'pipedream' is not one of gpipe, 1f1b, interleaved, 1f1b-overlap, zb-h1, dualpipev"),
            std::string::npos)
      << out;
  std::tie(rc, out) = run("search --cluster h100 --gpus 4 --policies ''");
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("--policies '': give at least one name"), std::string::npos) << out;
}

TEST(SimInputs, OutNeverOverwritesATrainingRunAndEmptyValuesAreRefused) {
  const fs::path bin = fs::path(MOEFLEX_BINARY_DIR) / "moeflex";
  if (!fs::exists(bin)) GTEST_SKIP() << bin << " is not built";
  const fs::path d = scratch("run-out");
  auto run = [&](const std::string& args) { return run_moeflex(bin, args); };
  // A training run's folder, by each of its marks: refused, its files untouched.
  fs::create_directories(d / "a");
  write(d / "a" / "metrics.jsonl", "{}\n");
  write(d / "a" / "summary.json", "run's own");
  fs::create_directories(d / "b" / "checkpoints");
  fs::create_directories(d / "c" / "rank1" / "checkpoints");
  const std::pair<const char*, const char*> runs[] = {{"a", "metrics.jsonl"}, {"b", "checkpoints/"},
                                                      {"c", "rank1/checkpoints/"}};
  for (const auto& [run_dir, mark] : runs) {
    const fs::path dir = d / run_dir;
    auto [rc, out] = run(fmt::format("simulate --cluster h100 --out {}", dir.string()));
    EXPECT_EQ(rc, 2) << out;
    EXPECT_NE(out.find(fmt::format("--out '{}' holds a `moeflex train` run ({} is there)", dir.string(),
                                   (dir / mark).string())),
              std::string::npos)
        << out;
  }
  std::ifstream kept(d / "a" / "summary.json");
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(kept), {}), "run's own");
  // A simulation without a trace removes the trace.json an earlier one left in --out.
  const fs::path sim = d / "sim";
  auto [rc, out] = run(fmt::format("simulate --cluster h100 --out {}", sim.string()));
  ASSERT_EQ(rc, 0) << out;
  ASSERT_TRUE(fs::exists(sim / "trace.json"));
  std::tie(rc, out) = run(fmt::format("simulate --cluster h100 --trace-ranks '' --out {}", sim.string()));
  ASSERT_EQ(rc, 0) << out;
  EXPECT_TRUE(fs::exists(sim / "summary.json"));
  EXPECT_FALSE(fs::exists(sim / "trace.json")) << out;
  // Given-but-empty values are refused, not read as "use the default".
  std::tie(rc, out) = run("simulate --cluster h100 --memory ''");
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("simulate --memory '': give a value"), std::string::npos) << out;
  std::tie(rc, out) = run("search --gpus 8 --cluster h100 --out ''");
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("search --out '': give a value"), std::string::npos) << out;
  EXPECT_EQ(out.find("combinations"), std::string::npos) << out;  // refused before the search
  // calibrate: an empty --from-run, or --base without --from-run, is refused before any timing.
  std::tie(rc, out) = run("calibrate --from-run ''");
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("calibrate --from-run '': give the folder of a run"), std::string::npos) << out;
  std::tie(rc, out) = run(fmt::format("calibrate --base {}/x.json --out {}/y.json", d.string(), d.string()));
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("is used only with --from-run"), std::string::npos) << out;
  // --from-run times nothing: the timing flags are refused, not ignored.
  std::tie(rc, out) = run(fmt::format("calibrate --from-run {} --seconds 5", d.string()));
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("calibrate --from-run times nothing: --seconds does not apply to it"), std::string::npos) << out;
}

// ---- 7. progress of a long search ---------------------------------------------------

TEST(SimInputs, SearchReportsProgressWithCandidatesDoneOfTotal) {
  search::SearchOptions o;
  o.model = test::small_moe_config(4, 0, 8, true);
  o.cluster = small_options(1).cluster;
  o.cluster.gpus_per_node = 4;
  o.gpus = 4;
  o.top = 5;
  o.seq_len = 16;
  o.global_batch = 16;
  o.threads = 2;
  std::vector<std::string> lines;
  o.progress = [&](const std::string& l) { lines.push_back(l); };  // under the search's lock
  o.progress_seconds = 0;                                            // every event
  const search::SearchResult r = search::search(o);
  std::int64_t enumerating = 0, timing = 0, walks = 0;
  for (const auto& l : lines) {
    EXPECT_EQ(l.rfind("search: ", 0), 0u) << l;
    enumerating += l.find("enumerating: ") != std::string::npos;
    timing += l.find("timing: ") != std::string::npos;
    walks += l.find("memory walks: ") != std::string::npos;
  }
  EXPECT_EQ(enumerating, r.enumerated);
  EXPECT_EQ(timing, r.simulations);
  EXPECT_LT(r.simulations, r.timed);  // the default policies include none and adaptive: one simulation
  EXPECT_GE(walks, r.walked);
  const std::string last_timing = fmt::format("timing: {}/{} simulations", r.simulations, r.simulations);
  EXPECT_TRUE(std::any_of(lines.begin(), lines.end(), [&](const std::string& l) {
    return l.find(last_timing) != std::string::npos;
  })) << last_timing;
  o.progress_seconds = 3600;  // throttled: nothing within the hour
  lines.clear();
  search::search(o);
  EXPECT_TRUE(lines.empty());
}

// ---- 6. Values that would overflow or turn into nan ------------------------------------

// --imbalance takes finite numbers only, whole, and an integer seed; a load ratio far
// past what EP allows is capped at the worst case (every row to one rank), not rounded
// through an overflow into a faster step.
TEST(SimInputs, ImbalanceValuesAreFiniteAndHugeRatiosAreCapped) {
  for (const char* bad :
       {"calm=nan", "calm=inf:spike=inf", "calm=1.5x", "calm=", "seed=-1", "seed=1.5", "seed=abc", "p=1e400"})
    EXPECT_THROW(sim::LoadModel::parse(bad), ConfigError) << bad;
  EXPECT_EQ(sim::LoadModel::parse("calm=1.1:spike=2:p=0.1:seed=7").seed, 7u);
  EXPECT_DOUBLE_EQ(sim::LoadModel::parse("constant=1.5").constant, 1.5);  // what search scores at
  EXPECT_THROW(sim::LoadModel::parse("constant=0.5"), ConfigError);
  SimOptions o = small_options(1);
  o.parallel.ep = 4;
  o.parallel.dp = 4;
  o.global_batch = 2 * 4 * 4;
  o.loads.constant = 4.0;  // ep: every row on one rank, the most there is
  const double worst = sim::simulate(o).step_time;
  o.loads.constant = 1e19;
  EXPECT_DOUBLE_EQ(sim::simulate(o).step_time, worst);
  o.loads.constant = 1.0;
  EXPECT_LT(sim::simulate(o).step_time, worst);
}

// The threshold policy's R is read by the one validating parser (a bare "threshold="
// was an uncaught std::stod error); a global batch of more micro-batches than the
// simulator takes is refused before any plan is built.
TEST(SimInputs, ThresholdRatiosAndMicroBatchCountsAreChecked) {
  SimOptions o = small_options(1);
  o.policy = "threshold=";
  EXPECT_NE(error_of<ConfigError>([&] { sim::simulate(o); }).find("expected threshold=R with R > 0"),
            std::string::npos);
  o.policy = "none";
  o.global_batch = o.micro_batch_size * (SimOptions::kMaxMicrobatches + 1);
  EXPECT_NE(error_of<ConfigError>([&] { o.num_microbatches(); }).find("more than the 16384 simulated"),
            std::string::npos);
  EXPECT_EQ(sim::parse_trace_ranks("0,3,0,3"), (std::vector<int>{0, 3}));
  // More stages than layers: a stage would be empty.
  const SimOptions empty_stage = small_options(8);  // 4 layers
  EXPECT_NE(error_of<ConfigError>([&] { sim::simulate(empty_stage); }).find("8 stages for 4 layers"),
            std::string::npos);
}

// Hugging Face layouts that alternate MoE and dense layers: decoder_sparse_step and
// mlp_only_layers are read (Qwen2/3-MoE: layer l is MoE when (l + 1) % step == 0 and l
// is not listed); DeepSeek's moe_layer_freq is refused by name (read as every layer
// MoE it would be another model, silently).
TEST(SimInputs, AlternatingMoeLayoutsAreReadOrRefused) {
  const fs::path root = MOEFLEX_SOURCE_DIR;
  const json qwen = json::parse(std::ifstream(root / "configs/models/qwen3-30b-a3b.json"));
  const ModelConfig every = ModelConfig::from_hf_json(qwen, "q.json");  // decoder_sparse_step 1, mlp_only_layers []
  json sparse = qwen;
  sparse["decoder_sparse_step"] = 2;
  const ModelConfig half = ModelConfig::from_hf_json(sparse, "q.json");
  EXPECT_FALSE(half.is_moe_layer(0));
  EXPECT_TRUE(half.is_moe_layer(1));
  EXPECT_FALSE(half.is_moe_layer(46));
  EXPECT_TRUE(half.is_moe_layer(47));
  EXPECT_TRUE(every.is_moe_layer(0));
  // 24 of 48 layers trade 128 experts of 768 (and a router) for a dense MLP of 6144.
  const std::int64_t d = 2048, swap = 128 * 3 * d * 768 + 128 * d - 3 * d * 6144;
  EXPECT_EQ(every.num_params() - half.num_params(), 24 * swap);
  // mlp_only_layers makes those layers dense whatever the step says.
  json dense = qwen;
  dense["mlp_only_layers"] = {0, 5};
  const ModelConfig two = ModelConfig::from_hf_json(dense, "q.json");
  EXPECT_FALSE(two.is_moe_layer(0));
  EXPECT_TRUE(two.is_moe_layer(1));
  EXPECT_FALSE(two.is_moe_layer(5));
  EXPECT_EQ(every.num_params() - two.num_params(), 2 * swap);
  json freq = json::parse(std::ifstream(root / "configs/models/deepseek-v3.json"));
  freq["moe_layer_freq"] = 3;
  EXPECT_THROW(ModelConfig::from_hf_json(freq, "d.json"), ConfigError);
}

// Cluster files and replayed metrics with values that wrapped or turned into inf/nan
// (or escaped as raw JSON errors) are refused by field; simulate --out writes its
// files whole or not at all.
TEST(SimInputs, ClusterBoundsReplayedCountsAndWholeOutputs) {
  const fs::path root = MOEFLEX_SOURCE_DIR;
  const fs::path d = scratch("bounds");
  const json h100 = json::parse(std::ifstream(root / "configs/clusters/h100.json"));
  auto refused = [&](const std::function<void(json&)>& edit) {
    json j = h100;
    edit(j);
    write(d / "c.json", j.dump());
    return error_of<DataError>([&] { load_cluster((d / "c.json").string(), root); });
  };
  EXPECT_NE(refused([](json& j) { j["param_bytes"] = 1e18; }).find("'param_bytes' is bytes per parameter, at most 64"),
            std::string::npos);
  EXPECT_NE(
      refused([](json& j) { j["inter_node"]["bandwidth_Bps"] = 1e-300; }).find("bandwidth_Bps must be at least 1000"),
      std::string::npos);
  EXPECT_NE(refused([](json& j) { j["device"]["peak_flops"] = 1e-300; }).find("peak_flops must be at least 1e6"),
            std::string::npos);
  EXPECT_NE(refused([](json& j) { j["profile"] = 5; }).find("field 'profile' must be the path of a hardware profile"),
            std::string::npos);
  // A replayed metrics.jsonl whose counts are not counts.
  write(d / "metrics.jsonl", "{\"step\": 1, \"ep_received_tokens\": [[5, \"x\"]]}\n");
  EXPECT_NE(
      error_of<DataError>([&] { LoadModel::from_file(d / "metrics.jsonl"); }).find("holds \"x\", not a token count"),
      std::string::npos);
  write(d / "metrics.jsonl", "{\"step\": 1, \"ep_received_tokens\": [[5, -4]]}\n");
  EXPECT_THROW(LoadModel::from_file(d / "metrics.jsonl"), DataError);
  // trace.json's place taken by a folder: nothing written, the earlier summary kept.
  SimOptions o = small_options(1);
  o.trace_ranks = {0};
  const SimReport r = sim::simulate(o);
  fs::create_directories(d / "out" / "trace.json");
  write(d / "out" / "summary.json", "earlier");
  EXPECT_NE(error_of<DataError>([&] { write_outputs(r, d / "out"); }).find("a directory is in its place"),
            std::string::npos);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(std::ifstream(d / "out" / "summary.json").rdbuf()), {}),
            "earlier");
  EXPECT_FALSE(fs::exists(d / "out" / "summary.json.tmp"));
  fs::remove_all(d / "out" / "trace.json");
  write_outputs(r, d / "out");
  EXPECT_TRUE(fs::is_regular_file(d / "out" / "trace.json"));
  fs::remove_all(d);
}
