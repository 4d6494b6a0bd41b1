// Decision latency of the adaptive planner: the time of one
// block's projection (a walk of the rest of the rank's step on the memory program)
// and of a whole decision (projection, closed-form search over the block's
// choices, and the exact walks the planner adds under pressure), for a layer
// description of the size of DeepSeek-V3 (256 routed experts, 61 layers) and for
// the default model. Prints medians and p99 over many decisions. A decision also
// computes the block's cache key (block_cache_key, a digest of the ledger), as the
// model does before each (the key is then made fresh, so nothing is cached).
// Wall-clock p99 on a shared machine is mostly the scheduler's time slices; the
// last column is the p99 of the thread's CPU time (CLOCK_THREAD_CPUTIME_ID),
// which leaves those out.
//
//   build/planner_latency [configs/models/deepseek-v3.json]
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <fstream>
#include <vector>

#include <nlohmann/json.hpp>

#include "moeflex/model/config.h"
#include "moeflex/model/memory_plan.h"
#include "moeflex/provision/planner.h"
#include "moeflex/schedule/generators.h"
#include "moeflex/schedule/plan.h"

using namespace moeflex;
using Clock = std::chrono::steady_clock;

namespace {

struct Scenario {
  std::string name;
  ModelConfig cfg;
  int pp = 1, rank = 0, microbatches = 1, ep = 1;
  std::int64_t B = 1, S = 1;
};

/// One rank's decision at the MoE block of its chunk's middle layer, for the last
/// micro-batch of its 1F1B warm-up (the most activations in flight), with the
/// earlier in-flight micro-batches' activations in the ledger at their floor.
BlockContext make_context(const Scenario& sc, StepProgram& program) {
  const ModelConfig& cfg = sc.cfg;
  const StepPlan plan = make_schedule("1f1b", sc.pp, sc.microbatches);
  std::vector<std::size_t> walk_at;
  program.actions = walk_actions(plan, sc.rank, &walk_at);
  const int L = int(cfg.num_hidden_layers), per = (L + sc.pp - 1) / sc.pp;
  const int first = std::min(L, sc.rank * per), last = std::min(L, first + per);
  StageSpec stage{first, last, sc.rank == 0, sc.rank == sc.pp - 1, sc.ep};
  program.stages = {stage};
  // The forward of the last warm-up micro-batch: p - rank micro-batches in flight.
  const int in_flight = std::min(sc.microbatches, sc.pp - sc.rank);
  const int mb = in_flight - 1;
  std::size_t ai = 0;
  for (std::size_t i = 0; i < plan.actions[std::size_t(sc.rank)].size(); ++i) {
    const Action& a = plan.actions[std::size_t(sc.rank)][i];
    if (a.kind == ActionKind::Forward && a.microbatch == mb) ai = i;
  }
  program.current = walk_at[ai];
  BlockContext ctx;
  ctx.microbatch = mb;
  ctx.layer = std::max(first, std::min(last - 1, (first + last) / 2));
  if (!cfg.is_moe_layer(ctx.layer)) ctx.layer = last - 1;
  ctx.point = SavePoint::moe;
  ctx.B = sc.B;
  ctx.S = sc.S;
  ctx.stage = stage;
  ctx.rows = MoERows::balanced(cfg, sc.B * sc.S);
  ctx.rows.received = ctx.rows.received * 3 / 2;  // a spike on this rank
  ctx.program = &program;
  const MoERows calm = MoERows::balanced(cfg, sc.B * sc.S);
  auto add_layer = [&](int m, int l, bool partial) {
    for (const ActivationSpec& a : layer_activations(cfg, l, sc.B, sc.S, calm, sc.ep > 1)) {
      if (partial && !a.name.starts_with("attn")) continue;  // the block under decision is not saved yet
      LedgerEntry e{a.name, a.op, l, m, a.bytes, a.recomputable, Provision::save, 0, 0};
      e.provision = most_memory_saving(cfg, e);
      ctx.ledger.push_back({e, e.provision == Provision::save});
    }
  };
  for (int m = 0; m < mb; ++m)
    for (int l = first; l < last; ++l) add_layer(m, l, false);
  for (int l = first; l < ctx.layer; ++l) add_layer(mb, l, false);
  add_layer(mb, ctx.layer, true);
  for (const ActivationSpec& a : layer_activations(cfg, ctx.layer, sc.B, sc.S, ctx.rows, sc.ep > 1))
    if (!a.name.starts_with("attn") && !a.name.starts_with("shared.")) ctx.candidates.push_back(a.name);
  return ctx;
}

double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

double percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, std::size_t(q * double(v.size())))];
}

void run(const Scenario& sc) {
  StepProgram program;
  BlockContext ctx = make_context(sc, program);
  std::vector<SaveCandidate> cands;
  for (const ActivationSpec& a : layer_activations(sc.cfg, ctx.layer, sc.B, sc.S, ctx.rows, sc.ep > 1))
    if (std::find(ctx.candidates.begin(), ctx.candidates.end(), a.name) != ctx.candidates.end())
      cands.push_back({a.name, a.op, a.bytes, a.recomputable, 0, rebuild_extra_bytes(sc.cfg, sc.B, sc.S, a.name),
                       a.name.starts_with("experts.") || a.name == "moe.combined"});
  // The budget: a little under what keeping the block whole needs, so the planner
  // searches and walks its floor (the expensive path). The arena only lends the
  // planner its budget and use; its region is reserved, not touched.
  const BlockProjection whole = project_block(sc.cfg, ctx, nullptr);
  Bytes kept = 0;
  for (auto& c : cands) kept += c.bytes;
  const Bytes budget = whole.peak() - kept / 2;
  std::vector<double> walk_s, decision_s, decision_cpu_s;
  const int reps = 1000;
  for (int i = 0; i < reps; ++i) {
    auto t0 = Clock::now();
    (void)project_block(sc.cfg, ctx, nullptr);
    walk_s.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  // Whole decisions through the planner, uncached (a fresh key each time).
  Arena arena(std::min<Bytes>(budget, Bytes(1) << 36));
  AdaptivePlanner planner(arena);
  const double scale = double(budget) / double(arena.budget());  // the arena stands in at a smaller size
  for (int i = 0; i < reps; ++i) {
    auto t0 = Clock::now();
    const double c0 = thread_cpu_seconds();
    std::vector<std::int64_t> key = block_cache_key(ctx);
    key.push_back(i);
    planner.plan_block(ctx.microbatch, ctx.layer, cands,
                       [&](const BlockChoice* c) {
                         BlockProjection p = project_block(sc.cfg, ctx, c);
                         for (Bytes* b : {&p.tail, &p.landing, &p.held, &p.prefetched, &p.backward, &p.backward_rest,
                                          &p.after})
                           *b = Bytes(double(*b) / scale);
                         return p;
                       },
                       key);
    decision_s.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    decision_cpu_s.push_back(thread_cpu_seconds() - c0);
  }
  std::int64_t entries = std::int64_t(ctx.ledger.size());
  fmt::print("{:<40} {:>7} {:>7} {:>8.3f} {:>8.3f} {:>10.3f} {:>10.3f} {:>10.3f}\n", sc.name,
             program.actions.size() - program.current, entries, percentile(walk_s, 0.5) * 1e3,
             percentile(walk_s, 0.99) * 1e3, percentile(decision_s, 0.5) * 1e3, percentile(decision_s, 0.99) * 1e3,
             percentile(decision_cpu_s, 0.99) * 1e3);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string path = argc > 1 ? argv[1] : "configs/models/deepseek-v3.json";
  std::ifstream f(path);
  if (!f) {
    fmt::print(stderr, "planner_latency: cannot open {}\n", path);
    return 1;
  }
  const ModelConfig ds = ModelConfig::from_hf_json(nlohmann::json::parse(f));
  ModelConfig small;  // the default model's shape (configs/default.toml)
  small.moe_intermediate_size = 384;
  fmt::print("{:<40} {:>7} {:>7} {:>8} {:>8} {:>10} {:>10} {:>10}\n", "scenario (1F1B), times in ms", "actions",
             "entries", "walk p50", "walk p99", "decide p50", "decide p99", "p99 (cpu)");
  run({"default model, 1 rank, EP 2", small, 1, 0, 1, 2, 8, 128});
  run({"DeepSeek-V3, 1 rank (61 layers), EP 64", ds, 1, 0, 1, 64, 1, 4096});
  run({"DeepSeek-V3, PP 16 rank 0, M 32, EP 64", ds, 16, 0, 32, 64, 1, 4096});
  run({"DeepSeek-V3, PP 16 rank 8, M 32, EP 64", ds, 16, 8, 32, 64, 1, 4096});
  return 0;
}
