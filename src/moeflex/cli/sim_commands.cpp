// `moeflex simulate` and `moeflex search` (see sim_commands.h).
#include "moeflex/cli/sim_commands.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "moeflex/core/error.h"
#include "moeflex/schedule/generators.h"
#include "moeflex/search/search.h"
#include "moeflex/sim/presets.h"
#include "moeflex/sim/simulator.h"
#include "moeflex/train/train_config.h"

namespace moeflex {

namespace {

namespace fs = std::filesystem;

struct Flags {
  CLI::App* simulate = nullptr;
  CLI::App* search = nullptr;
  std::string model = "default", cluster = "this-machine", parallel, schedule, policy = "none", out, loads, imbalance,
              trace_ranks = "0", objective = "tgs", memory, dispatcher = "alltoall", schedules, policies,
              hardware_profile;
  std::int64_t micro_batch_size = 0, seq_len = 0, global_batch = 0;
  int iterations = 1, gpus = 8, top = 10, checkpoint_interval = 50, search_threads = 0;
  double restart_seconds = 284;
  bool breakdown = false;
};

Flags& flags() {
  static Flags f;
  return f;
}

/// A model from a preset, an HF config.json, "default" (the embedded run config)
/// or a run config TOML; the last two also give B and S.
ModelConfig model_of(const std::string& m, std::int64_t& B, std::int64_t& S, const fs::path& root) {
  if (m == "default" || (fs::is_regular_file(m) && fs::path(m).extension() == ".toml")) {
    const RunConfig rc = m == "default" ? RunConfig::defaults() : RunConfig::from_file(m);
    if (B <= 0) B = rc.train.micro_batch_size;
    if (S <= 0) S = rc.train.seq_len;
    return rc.model;
  }
  return sim::load_model(m, root);
}

Bytes size_of(const std::string& s) {
  Bytes b = 0;
  try {
    b = parse_size(s);  // the same sizes --device-memory takes
  } catch (const Error& e) {
    throw ConfigError(fmt::format("--memory: {}", e.what()));
  }
  if (b <= 0)
    throw ConfigError(fmt::format("--memory '{}': give a positive size such as 250MiB (without --memory, the "
                                  "cluster's usable memory)", s));
  return b;
}

/// Refuses an --out folder of `moeflex simulate` that holds a training run (its
/// metrics.jsonl, checkpoints/ or rankN/checkpoints/), whose summary.json and
/// trace.json the simulation would overwrite: ConfigError naming the folder and what
/// marks it as a run.
void check_not_a_run_dir(const fs::path& dir, const std::string& given) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return;
  std::string found;
  if (fs::exists(dir / "metrics.jsonl", ec)) found = "metrics.jsonl";
  else if (fs::is_directory(dir / "checkpoints", ec)) found = "checkpoints/";
  else
    for (const auto& entry : fs::directory_iterator(dir, ec)) {
      const std::string name = entry.path().filename().string();
      if (name.rfind("rank", 0) == 0 && fs::is_directory(entry.path() / "checkpoints", ec)) {
        found = name + "/checkpoints/";
        break;
      }
    }
  if (!found.empty())
    throw ConfigError(fmt::format("--out '{}' holds a `moeflex train` run ({} is there): the simulation would "
                                  "overwrite its files; choose another --out",
                                  given, (dir / found).string()));
}

}  // namespace

CLI::Validator finite_non_negative() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        double v = 0;
        std::size_t used = 0;
        try {
          v = std::stod(text, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        if (used == 0 || used != text.size() || !std::isfinite(v) || v < 0)
          return fmt::format("'{}' is not a finite number >= 0", text);
        return "";
      },
      "FINITE >= 0");
}

void add_sim_commands(CLI::App& app) {
  Flags& f = flags();
  f.simulate = app.add_subcommand("simulate", "simulate training on a cluster in virtual time");
  f.search = app.add_subcommand("search", "search parallel layouts, schedules and policies by simulation");
  for (CLI::App* c : {f.simulate, f.search}) {
    c->add_option("--model", f.model, "preset name (configs/models), HF config.json, run config .toml, or 'default'")
        ->capture_default_str();
    c->add_option("--cluster", f.cluster, "preset name (configs/clusters) or cluster JSON")->capture_default_str();
    c->add_option("--hardware-profile", f.hardware_profile,
                  "a profile `moeflex calibrate` wrote (CPU, or --device cuda) that prices the cluster's devices "
                  "instead of the cluster's own profile or data-sheet rates");
    c->add_option("--seq-len", f.seq_len, "tokens per sequence (default: 4096, or the run config's)")
        ->check(CLI::Range(std::int64_t(1), std::int64_t(1) << 24));
    c->add_option("--global-batch", f.global_batch,
                  "sequences per iteration (default: simulate, a --loads run's own batch, else dp x B x 4 pp; "
                  "search, 2 x --gpus)")
        ->check(CLI::Range(std::int64_t(1), std::int64_t(1) << 30));
    c->add_option("--imbalance", f.imbalance,
                  "load distribution calm=1.2:spike=2.6:p=0.029[:seed=S], or constant=R (every layer at ratio R: "
                  "what search scores times at)");
    c->add_option("--restart-seconds", f.restart_seconds, "cold restart after an OOM")
        ->capture_default_str()
        ->check(finite_non_negative());
    c->add_option("--checkpoint-interval", f.checkpoint_interval, "iterations between checkpoints")
        ->capture_default_str()
        ->check(CLI::PositiveNumber);
    c->add_option("--memory", f.memory, "per-device memory limit, e.g. 250MiB (default: the cluster's)");
    c->add_option("--dispatcher", f.dispatcher,
                  "expert all-to-alls: alltoall (every row to its expert's rank) or deepep (each token once per "
                  "node, then NVLink)")
        ->capture_default_str()
        ->check(CLI::IsMember({"alltoall", "deepep"}));
  }
  auto* s = f.simulate;
  s->add_option("--parallel", f.parallel,
                "tp=..,pp=..,vpp=..,ep=..,dp=.. (default all 1); world = tp x pp x dp. The expert layers fold EP over "
                "tp x dp (Megatron-Core's MoE parallel folding with expert tensor parallelism 1): ep divides tp x dp "
                "and num_experts and may exceed dp; expert-DP = tp x dp / ep. tp > 1 means sequence parallelism (n / "
                "tp tokens a rank). No context parallelism");
  s->add_option("--schedule", f.schedule,
                "gpipe, 1f1b, interleaved, 1f1b-overlap (Megatron-Core's EP A2A overlap), zb-h1, dualpipev (default "
                "1f1b; interleaved when vpp > 1)");
  s->add_option("--policy", f.policy, "none, full, selective, moe-light, moe-medium, moe-full, threshold[=R], adaptive")
      ->capture_default_str();
  s->add_option("--micro-batch-size", f.micro_batch_size, "sequences per micro-batch (default 1, or the run config's)")
      ->check(CLI::Range(std::int64_t(1), std::int64_t(1) << 20));
  s->add_option("--iterations", f.iterations, "iterations to simulate (default 1; with --loads, the recorded steps)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000000));
  s->add_option("--loads", f.loads, "replay expert loads of a `moeflex train` run: its loads.jsonl (every rank's rows: exact "
                "per-rank memory), its directory, or an older run's metrics.jsonl");
  s->add_option("--out", f.out, "write summary.json and trace.json here");
  s->add_option("--trace-ranks", f.trace_ranks, "pipeline ranks in trace.json, e.g. 0,3 (empty: none)")
      ->capture_default_str();
  s->add_flag("--breakdown", f.breakdown,
              "also print (and write to summary.json) the priced ops of one step by kind and phase, as "
              "`train --profile-ops` names them in op_times.json");
  auto* q = f.search;
  q->add_option("--gpus", f.gpus, "devices")->required()->check(CLI::Range(1, int(sim::kMaxSimulatedDevices)));
  q->add_option("--top", f.top, "layouts to print")->capture_default_str()->check(CLI::Range(1, 100000));
  q->add_option("--objective", f.objective, "tgs or memory")->capture_default_str();
  q->add_option("--threads", f.search_threads, "threads for the timing pass (0: every core)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1024));
  q->add_option("--out", f.out, "write the result as JSON");
  q->add_option("--schedules", f.schedules,
                "comma-separated schedules to try, e.g. 1f1b,interleaved (default all: gpipe, 1f1b, interleaved, "
                "1f1b-overlap (with ep > 1), zb-h1, dualpipev)");
  q->add_option("--policies", f.policies,
                "comma-separated provisioning policies to try (default none, selective, moe-full, full, adaptive)");
}

/// The items of a comma-separated flag value, each one of `known`; ConfigError naming
/// the flag and the item otherwise (empty items are refused too).
std::vector<std::string> list_of(const std::string& flag, const std::string& value,
                                 const std::vector<std::string>& known) {
  std::vector<std::string> out;
  std::stringstream ss(value);
  for (std::string x; std::getline(ss, x, ',');) {
    if (std::find(known.begin(), known.end(), x) == known.end()) {
      std::string names;
      for (const auto& k : known) names += (names.empty() ? "" : ", ") + k;
      throw ConfigError(fmt::format("search {} '{}': '{}' is not one of {}", flag, value, x, names));
    }
    if (std::find(out.begin(), out.end(), x) == out.end()) out.push_back(x);
  }
  if (out.empty()) throw ConfigError(fmt::format("search {} '': give at least one name", flag));
  return out;
}

bool run_sim_commands() {
  Flags& f = flags();
  if (!*f.simulate && !*f.search) return false;
  const fs::path root = sim::preset_root();
  std::int64_t B = f.micro_batch_size, S = f.seq_len;
  const ModelConfig model = model_of(f.model, B, S, root);
  if (S <= 0) S = 4096;
  if (B <= 0) B = 1;
  CLI::App* const cmd = *f.simulate ? f.simulate : f.search;
  // Given but empty: a mistake (an unset shell variable), not "use the default".
  for (const auto& [flag, value] : {std::pair<const char*, const std::string*>{"--memory", &f.memory},
                                    {"--out", &f.out},
                                    {"--hardware-profile", &f.hardware_profile}})
    if (cmd->count(flag) > 0 && value->empty())
      throw ConfigError(fmt::format("{} {} '': give a value, or leave the flag out", cmd->get_name(), flag));
  sim::ClusterSpec cluster = sim::load_cluster(f.cluster, root, f.hardware_profile);
  if (!f.memory.empty()) {
    const Bytes limit = size_of(f.memory);
    if (limit > cluster.device_memory)
      throw ConfigError(fmt::format("--memory {} is more than the {} device's {}", format_bytes(limit), cluster.name,
                                    format_bytes(cluster.device_memory)));
    cluster.reserved_memory = cluster.device_memory - limit;
  }
  if (*f.simulate) {
    sim::SimOptions o;
    o.model = model;
    o.cluster = cluster;
    o.parallel = sim::ParallelSpec::parse(f.parallel);
    if (!f.schedule.empty()) o.schedule = f.schedule;
    else if (o.parallel.vpp > 1) o.schedule = "interleaved";
    o.policy = f.policy;
    o.micro_batch_size = B;
    o.seq_len = S;
    o.global_batch = f.global_batch;
    o.iterations = f.iterations;
    o.loads = sim::LoadModel::from_flags(f.loads, f.imbalance);  // refuses both at once
    if (o.loads.replay() && f.simulate->count("--iterations") == 0)  // a replay covers the run it replays
      o.iterations = int(std::min<std::size_t>(o.loads.recorded_steps(), 1000000));
    o.restart_seconds = f.restart_seconds;
    o.checkpoint_interval = f.checkpoint_interval;
    o.overlap_pair_comm = cluster.element_bytes < 4;
    o.dispatcher = f.dispatcher;
    o.breakdown = f.breakdown;
    o.trace_ranks = sim::parse_trace_ranks(f.trace_ranks);
    if (f.out.empty()) o.trace_ranks.clear();
    else {  // before the simulation, not after it
      check_not_a_run_dir(f.out, f.out);
      check_writable_dir(f.out, "--out", f.out);
    }
    const sim::SimReport r = sim::simulate(o);
    fmt::print("{}", r.format());
    if (!f.out.empty()) {
      sim::write_outputs(r, f.out);
      if (o.trace_ranks.empty()) {  // an earlier simulation's trace would read as this one's
        std::error_code ec;
        if (fs::remove(fs::path(f.out) / "trace.json", ec)) fmt::print("removed the earlier {}/trace.json\n", f.out);
      }
      fmt::print("wrote {}/summary.json{}\n", f.out, o.trace_ranks.empty() ? "" : " and trace.json");
    }
  } else {
    search::SearchOptions o;
    o.model = model;
    o.cluster = cluster;
    o.gpus = f.gpus;
    o.top = f.top;
    o.objective = f.objective;
    o.seq_len = S;
    o.global_batch = f.global_batch;
    o.loads = f.imbalance.empty() ? sim::LoadModel{} : sim::LoadModel::parse(f.imbalance);
    o.restart_seconds = f.restart_seconds;
    o.checkpoint_interval = f.checkpoint_interval;
    o.threads = f.search_threads;
    o.dispatcher = f.dispatcher;
    if (f.search->count("--schedules") > 0) o.schedules = list_of("--schedules", f.schedules, schedule_names());
    if (f.search->count("--policies") > 0)
      o.policies = list_of("--policies", f.policies,
                           {"none", "selective", "moe-light", "moe-medium", "moe-full", "full", "adaptive"});
    o.progress = [](const std::string& line) { fmt::print(stderr, "{}\n", line); };
    if (!f.out.empty()) {  // one JSON file: checked before the search, not after it
      if (fs::is_directory(f.out))
        throw ConfigError(fmt::format("--out '{}' is a directory; search writes one JSON file (e.g. --out {})", f.out,
                                      (fs::path(f.out) / "search.json").string()));
      const fs::path parent = fs::path(f.out).has_parent_path() ? fs::path(f.out).parent_path() : fs::path(".");
      check_writable_dir(parent, "--out", f.out);
    }
    const search::SearchResult r = search::search(o);
    fmt::print("{}", r.format(o));
    if (!f.out.empty()) {
      std::ofstream out(f.out);
      if (!out) throw DataError(fmt::format("{}: cannot write", f.out));
      out << r.to_json(o).dump(2) << "\n";
      fmt::print("wrote {}\n", f.out);
    }
  }
  return true;
}

}  // namespace moeflex
