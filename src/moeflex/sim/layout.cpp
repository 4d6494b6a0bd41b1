// The parallel layout (simulator.h): parsing --parallel and --trace-ranks, the
// options' micro-batch count, the layout's rules against the model and cluster
// (Simulation::setup: the plans, the stages, the groups' placements) and where the
// expert groups live.
#include <fmt/format.h>

#include <algorithm>
#include <set>
#include <sstream>

#include "moeflex/comm/layout.h"
#include "moeflex/core/error.h"
#include "moeflex/schedule/generators.h"
#include "moeflex/sim/simulation.h"

namespace moeflex::sim {

ParallelSpec ParallelSpec::parse(const std::string& s) {
  ParallelSpec p;
  std::stringstream ss(s);
  std::string part;
  std::set<std::string> seen;
  while (std::getline(ss, part, ',')) {
    if (part.empty()) continue;
    const auto eq = part.find('=');
    int v = 0;
    try {
      if (eq == std::string::npos) throw std::invalid_argument("no =");
      std::size_t used = 0;
      const std::string num = part.substr(eq + 1);
      v = std::stoi(num, &used);
      if (used != num.size()) throw std::invalid_argument("trailing characters");
    } catch (const std::exception&) {
      throw ConfigError(fmt::format("--parallel '{}': expected key=integer in '{}'", s, part));
    }
    const std::string k = part.substr(0, eq);
    if (!seen.insert(k).second) throw ConfigError(fmt::format("--parallel '{}': {} is given twice", s, k));
    if (v < 1) throw ConfigError(fmt::format("--parallel '{}': {} must be at least 1 (got {})", s, k, v));
    if (k == "tp") p.tp = v;
    else if (k == "pp") p.pp = v;
    else if (k == "vpp") p.vpp = v;
    else if (k == "ep") p.ep = v;
    else if (k == "dp") p.dp = v;
    else
      throw ConfigError(
          fmt::format("--parallel '{}': unknown key '{}' (tp, pp, vpp, ep, dp; expert tensor parallelism "
                      "is 1 and there is no context parallelism)",
                      s, k));
  }
  // tp x pp x dp devices (ep divides the tp x dp ranks of a stage): refuse what overflows.
  const double world = double(p.tp) * double(p.pp) * double(p.dp);
  if (world > double(kMaxSimulatedDevices))
    throw ConfigError(fmt::format("--parallel '{}': tp x pp x dp = {:.0f} devices, more than the {} this simulator takes",
                                  s, world, kMaxSimulatedDevices));
  return p;
}

std::vector<int> parse_trace_ranks(const std::string& s) {
  std::vector<int> v;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, ',');) {
    if (x.empty()) continue;
    std::size_t used = 0;
    int r = -1;
    try {
      r = std::stoi(x, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != x.size() || r < 0)
      throw ConfigError(fmt::format("--trace-ranks '{}': '{}' is not a pipeline rank (a non-negative integer, as in "
                                    "--trace-ranks 0,3)", s, x));
    if (std::find(v.begin(), v.end(), r) == v.end()) v.push_back(r);  // a rank named twice is traced once
  }
  return v;
}

std::string ParallelSpec::str() const { return fmt::format("tp={},pp={},vpp={},ep={},dp={}", tp, pp, vpp, ep, dp); }

const std::vector<std::string>& adaptive_levels() {
  static const std::vector<std::string> v = {"none", "moe-light", "moe-medium", "moe-full", "full"};
  return v;
}

int SimOptions::num_microbatches() const {
  const std::int64_t per = std::int64_t(parallel.dp) * micro_batch_size;
  // A per-rank replay defaults to the recorded run's micro-batches per step (its grad_accum).
  const std::int64_t dflt = loads.per_rank() ? per * loads.recorded_microbatches() : per * 4 * parallel.pp;
  const std::int64_t g = global_batch > 0 ? global_batch : dflt;
  if (g % per != 0)
    throw ConfigError(fmt::format("global batch {} sequences is not a multiple of dp {} x micro-batch size {}", g,
                                  parallel.dp, micro_batch_size));
  if (g / per > kMaxMicrobatches)
    throw ConfigError(
        fmt::format("global batch {} sequences makes {} micro-batches per iteration (dp {} x micro-batch "
                    "size {} a micro-batch), more than the {} simulated: use a smaller --global-batch or "
                    "a larger --micro-batch-size",
                    g, g / per, parallel.dp, micro_batch_size, kMaxMicrobatches));
  return int(g / per);
}

int expert_data_parallel(const ParallelSpec& par) { return par.tp * par.dp / par.ep; }

GroupPlacement expert_parallel_placement(const ParallelSpec& par, int gpus_per_node) {
  return place_group(par.ep, 1, gpus_per_node);
}

GroupPlacement expert_data_parallel_placement(const ParallelSpec& par, int gpus_per_node) {
  return place_group(expert_data_parallel(par), par.ep, gpus_per_node);
}

void Simulation::setup() {
  const ParallelSpec& p = o.parallel;
  cfg.validate();
  m = o.num_microbatches();
  P = p.pp;
  check_layout();
  comm::LayoutSpec ls;
  ls.world_size = p.pp * p.tp * p.dp;
  ls.pp = p.pp;
  ls.dp = p.tp * p.dp;
  ls.ep = p.ep;
  ls.vpp = chunks_per_rank();
  ls.num_layers = int(cfg.num_hidden_layers);
  ls.num_experts = int(cfg.num_experts);
  ls.pad_layers = true;
  const comm::ParallelLayout layout(ls);
  ep_group = expert_parallel_placement(p, o.cluster.gpus_per_node);
  tp_group = place_group(p.tp, 1, o.cluster.gpus_per_node);
  make_plans();
  split = o.schedule == "zb-h1";
  n_rank = o.micro_batch_size * o.seq_len / p.tp;
  place_stages(layout.stage_layers());
}

int Simulation::chunks_per_rank() const { return o.schedule == "dualpipev" ? 2 : o.parallel.vpp; }

void Simulation::check_layout() const {
  const ParallelSpec& p = o.parallel;
  if (p.tp > 1) {
    if (cfg.num_attention_heads % p.tp != 0)
      throw ConfigError(fmt::format("tp {} does not divide num_attention_heads {}", p.tp, cfg.num_attention_heads));
    // Megatron-Core splits the key/value heads (query groups) over tp as it does the heads.
    if (cfg.kv_heads() % p.tp != 0)
      throw ConfigError(
          fmt::format("tp {} does not divide num_key_value_heads {} (Megatron-Core splits the query "
                      "groups over tp)",
                      p.tp, cfg.kv_heads()));
    if (p.tp > o.cluster.gpus_per_node)
      throw ConfigError(fmt::format("tp {} spans nodes of {} GPUs", p.tp, o.cluster.gpus_per_node));
    if ((o.micro_batch_size * o.seq_len) % p.tp != 0)
      throw ConfigError(fmt::format("tp {} does not divide the micro-batch's {} tokens", p.tp,
                                    o.micro_batch_size * o.seq_len));
  }
  if (o.dispatcher != "alltoall" && o.dispatcher != "deepep")
    throw ConfigError(fmt::format("--dispatcher '{}': alltoall or deepep", o.dispatcher));
  require_known_schedule(o.schedule);
  if (!schedule_takes_vpp(o.schedule) && p.vpp != 1)
    throw ConfigError(
        fmt::format("vpp {} needs --schedule interleaved or 1f1b-overlap (dualpipev holds 2 chunks by "
                    "itself)",
                    p.vpp));
  const int v = chunks_per_rank();
  // The layout's own checks on the expert layers' view of a stage (MoE parallel
  // folding, expert tensor parallelism 1): its tp x dp ranks are ep x expert_dp, so
  // ep divides tp x dp and the experts; the layers fit the stages.
  if ((p.tp * p.dp) % p.ep != 0)
    throw ConfigError(
        fmt::format("ep {} does not divide tp {} x dp {} = {}: the expert layers' ep x expert_dp ranks "
                    "are the tp x dp ranks of a stage (MoE parallel folding, expert tensor parallelism 1)",
                    p.ep, p.tp, p.dp, p.tp * p.dp));
  // Uneven stages are padded (Megatron-Core's account_for_embedding/loss), but a
  // stage without any layer is no layout anyone runs (search drops them too).
  if (std::int64_t(p.pp) * v > cfg.num_hidden_layers)
    throw ConfigError(
        fmt::format("pp {} x {} stage{} a rank = {} stages for {} layers: a stage would hold no layer; "
                    "lower pp or vpp",
                    p.pp, v, v == 1 ? "" : "s", std::int64_t(p.pp) * v, cfg.num_hidden_layers));
}

void Simulation::make_plans() {
  const ParallelSpec& p = o.parallel;
  const bool dualv = o.schedule == "dualpipev";
  const int v = chunks_per_rank();
  plan = make_schedule(o.schedule, p.pp, m, dualv ? 1 : p.vpp);
  // Memory walks replay a shorter step when the schedule's steady phase repeats:
  // every schedule but GPipe holds at most ~2 pp x chunks micro-batches at once, so
  // a step of mw >= that many reaches the same peak (test_sim checks it).
  int mw = m;
  if (o.schedule != "gpipe") {
    mw = std::min(m, 2 * p.pp * v + 2);
    if (schedule_takes_vpp(o.schedule)) mw = std::min(m, (mw + p.pp - 1) / p.pp * p.pp);
  }
  if (o.loads.per_rank()) {
    // A per-rank replay walks every recorded micro-batch in its own place.
    check_replay();
    mw = m;
  }
  memory_plan = mw == m ? plan : make_schedule(o.schedule, p.pp, mw, dualv ? 1 : p.vpp);
}

void Simulation::check_replay() const {
  const ParallelSpec& p = o.parallel;
  int moe_layers = 0;
  for (int l = 0; l < cfg.num_hidden_layers; ++l) moe_layers += cfg.is_moe_layer(l) ? 1 : 0;
  const LoadModel& L = o.loads;
  if (L.recorded_dp() != p.dp || L.recorded_ep() != p.ep || L.recorded_microbatches() != m ||
      L.recorded_moe_layers() != moe_layers)
    throw ConfigError(fmt::format(
        "--loads: the recorded run has dp {}, ep {}, {} micro-batches and {} MoE layers; this simulation has dp "
        "{}, ep {}, {} micro-batches (global batch {} / (dp {} x micro-batch size {})) and {} MoE layers "
        "(per-rank replay needs the run's own layout; without --global-batch it takes the run's micro-batches)",
        L.recorded_dp(), L.recorded_ep(), L.recorded_microbatches(), L.recorded_moe_layers(), p.dp, p.ep, m,
        std::int64_t(m) * p.dp * o.micro_batch_size, p.dp, o.micro_batch_size, moe_layers));
  // Dropless routing keeps tokens x top-k assignments per rank and micro-batch:
  // the recording's tell the run's micro-batch tokens (B x S).
  const std::int64_t want = o.micro_batch_size * o.seq_len / p.tp * cfg.num_experts_per_tok;
  const std::int64_t kept = L.rows(0, 0, 0, 0).kept;
  if (cfg.capacity_factor <= 0 && moe_layers > 0 && kept != want)
    throw ConfigError(fmt::format(
        "--loads: the recorded run kept {} expert assignments per rank and micro-batch; this simulation's "
        "micro-batch of {} x {} tokens (tp {}) with top-{} keeps {} (give the run's micro_batch_size and seq_len: "
        "--model RUN/config.toml, or --micro-batch-size and --seq-len)",
        kept, o.micro_batch_size, o.seq_len, p.tp, cfg.num_experts_per_tok, want));
}

void Simulation::place_stages(const std::vector<int>& stage_layers) {
  const ParallelSpec& p = o.parallel;
  int first = 0;
  for (int s = 0; s < int(stage_layers.size()); ++s) {
    StageInfo si;
    si.first_layer = std::min(first, int(cfg.num_hidden_layers));
    si.last_layer = std::min(first + stage_layers[std::size_t(s)], int(cfg.num_hidden_layers));
    si.embedding = s == 0;
    si.head = s == int(stage_layers.size()) - 1;
    first += stage_layers[std::size_t(s)];
    stages.push_back(si);
  }
  int k = 0;
  for (int l = 0; l < cfg.num_hidden_layers; ++l) moe_index.push_back(cfg.is_moe_layer(l) ? k++ : -1);
  limit = o.memory_limit > 0 ? o.memory_limit : o.cluster.usable_memory();
  LayerWork w{o.micro_batch_size, o.seq_len, {}, p.ep, p.tp, split, elem};
  w.breakdown = o.breakdown;
  head = head_cost(cost, cfg, w);
  embed = embedding_cost(cost, cfg, w);
  for (const StageInfo& si : stages) stage_copies.push_back(stage_copy_cost(cost, cfg, w, si.embedding, si.head));
}
}  // namespace moeflex::sim
