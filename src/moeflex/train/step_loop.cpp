// The training loop: each step's forward and backward (with --on-oom=restart, the
// agreement whether any rank ran out of memory and the restart from the newest
// checkpoint), the optimizer step, the step's statistics over the ranks,
// metrics.jsonl and loads.jsonl, the trace, the progress line, and the checkpoint or
// stop that ends a step. Every rank runs the same collectives in the same order.
#include <time.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fmt/format.h>

#include "moeflex/core/op_context.h"
#include "moeflex/core/phase_clock.h"
#include "moeflex/train/distributed.h"
#include "moeflex/train/run_state.h"

namespace moeflex::run {

namespace {

/// CPU seconds this process has used (all its threads): a step's CPU time is its
/// work without the time it waited for a core (other jobs on the machine).
double process_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

/// One line of loads.jsonl, the expert loads `moeflex simulate --loads` replays
/// (docs/simulator.md): {"step": s, "dp": dp, "ep": ep, "microbatches": M,
/// "moe_layers": [global layer index, ...], "received": [layer][mb][dp rank],
/// "kept": [layer][mb][dp rank], "step_cpu_seconds": [world rank]}. "received" is
/// the rows a rank's local experts processed after the expert-parallel dispatch
/// (MoERows::received), "kept" the assignments it routed and kept (MoERows::permuted);
/// the EP group of dp rank q is the ep consecutive dp ranks around it. A chunk runs its
/// micro-batches' forwards in order, so the k-th routing record of a layer is micro-batch k.
/// Collective over `world` (one all-reduce of the int64 table, one of the CPU times);
/// rank 0 passes `out`, the file at `out_path`. Writes nothing for a model without MoE layers.
void record_loads(comm::Communicator* world, const std::vector<RoutingStats>& routing, const ModelConfig& model,
                  const comm::ParallelLayout& layout, int dp_rank, std::int64_t M, std::int64_t step, double step_cpu,
                  std::ofstream* out, const fs::path& out_path) {
  std::vector<int> moe_layers, index(std::size_t(model.num_hidden_layers), -1);
  for (int l = 0; l < model.num_hidden_layers; ++l)
    if (model.is_moe_layer(l)) {
      index[std::size_t(l)] = int(moe_layers.size());
      moe_layers.push_back(l);
    }
  if (moe_layers.empty()) return;
  const std::size_t L = moe_layers.size(), dp = std::size_t(layout.dp()), m = std::size_t(M);
  auto at = [&](std::size_t which, std::size_t k, std::size_t mb, std::size_t q) {
    return ((which * L + k) * m + mb) * dp + q;
  };
  std::vector<std::int64_t> table(2 * L * m * dp, 0);
  std::vector<std::size_t> seen(L, 0);  // forwards of each layer so far: the micro-batch index
  for (const auto& r : routing) {
    const int k = r.layer >= 0 && r.layer < model.num_hidden_layers ? index[std::size_t(r.layer)] : -1;
    if (k < 0 || seen[std::size_t(k)] >= m) continue;
    const std::size_t mb = seen[std::size_t(k)]++;
    std::int64_t kept = 0;
    for (auto c : r.tokens_per_expert) kept += c;
    table[at(0, std::size_t(k), mb, std::size_t(dp_rank))] = r.received_rows;
    table[at(1, std::size_t(k), mb, std::size_t(dp_rank))] = kept;
  }
  std::vector<double> cpu(std::size_t(world->size()), 0.0);
  cpu[std::size_t(world->rank())] = step_cpu;
  if (world->size() > 1) {
    world->all_reduce_sum(table.data(), std::int64_t(table.size()));
    world->all_reduce_sum(cpu.data(), std::int64_t(cpu.size()));
  }
  if (!out) return;
  json rec = json::array(), kep = json::array();
  for (std::size_t k = 0; k < L; ++k) {
    json rk = json::array(), kk = json::array();
    for (std::size_t mb = 0; mb < m; ++mb) {
      json rr = json::array(), kr = json::array();
      for (std::size_t q = 0; q < dp; ++q) {
        rr.push_back(table[at(0, k, mb, q)]);
        kr.push_back(table[at(1, k, mb, q)]);
      }
      rk.push_back(rr);
      kk.push_back(kr);
    }
    rec.push_back(rk);
    kep.push_back(kk);
  }
  json line = {{"step", step}, {"dp", layout.dp()}, {"ep", layout.ep()}, {"microbatches", M},
               {"moe_layers", moe_layers}, {"received", rec}, {"kept", kep}, {"step_cpu_seconds", cpu}};
  append_line(*out, out_path, line.dump());
}

struct OverflowScope {
  Arena& arena;
  OverflowScope(Arena& a, bool on) : arena(a) { arena.set_overflow(on); }
  ~OverflowScope() { arena.set_overflow(false); }
};

/// Appends step `step`'s communication calls to `path` (slow_rank_level 2): one line
/// {"step", "calls": [{"op", "group", "bytes", "peer", "seconds"}, ...]}.
void write_comm_calls(const fs::path& path, std::int64_t step, const std::vector<CallRecord>& calls) {
  json list = json::array();
  for (const CallRecord& c : calls)
    list.push_back({{"op", c.op}, {"group", c.group}, {"bytes", c.bytes}, {"peer", c.peer}, {"seconds", c.seconds}});
  std::ofstream out(path, std::ios::app);
  out << json{{"step", step}, {"calls", std::move(list)}}.dump() << '\n';
  if (!out) throw DataError(fmt::format("cannot append to '{}' (is the disk full?)", path.string()));
}

}  // namespace

double Training::injected_imbalance(std::int64_t step) const {
  return ops::target_imbalance(imbalance, step, int(cfg.model.num_hidden_layers), cfg.model.num_experts,
                               layout.ep() > 1 ? layout.ep() : int(cfg.model.num_experts));
}

struct Training::StepRecord {
  Clock::time_point t0;    ///< the step's start
  double cpu0 = 0;         ///< the process's CPU seconds at the start
  bool spike = false;      ///< an injected routing spike
  bool tracing = false;    ///< the step goes to trace.json
  double thread_cpu0 = 0;  ///< the thread's CPU seconds at the start (--profile-ops)
  json line;               ///< the step's metrics.jsonl line, written after its checkpoint
  LossParts sum;           ///< the step's losses
  json plan_line;          ///< the planner's part of the metrics line
  double opt_us = 0, stats_us = 0;  ///< trace times of the optimizer and the statistics
  double gnorm = 0, fb_seconds = 0, lr = 0;  ///< gradient norm, forward/backward seconds, learning rate
  double provisioned[2] = {0, 0};  ///< bytes saved, recomputed (this step, all ranks)
  double offl = 0;                 ///< bytes offloaded (this step, all ranks)
  double defrag[4] = {0, 0, 0, 0};  ///< compactions, bytes compacted, evicted, stitched (this step, all ranks)
  double max_imbalance = 1.0;
  std::int64_t dropped = 0;
  json ep_received = json::array();
  double ep_imbalance = 1.0;
  double bubble = 0;
  double dt = 0;  ///< the step's seconds
  double peak = 0;
  std::int64_t step_tokens = 0;
  train::RankStep phases;  ///< the step's phase times on this rank (slow-rank detection)
  std::vector<CallRecord> calls;  ///< its communication calls (slow_rank_level 2)
};

double Training::evaluate() {
  const std::int64_t nb = data.num_val_batches(B, S, t.eval_batches);
  double sum = 0;
  for (std::int64_t i = 0; i < nb; ++i) {
    data.val_batch(i, B, S, t.eval_batches, in.data(), tg.data());
    sum += replica->evaluate(in.data(), tg.data()).ce;
  }
  replica->clear_routing();
  return sum / double(std::max<std::int64_t>(nb, 1));
}

void Training::run_steps() {
  if (opts.stop_after == 0 && start_step == 0) {  // the initial state alone (moeflex import-hf)
    save(0);
    progress.note(fmt::format("stopped before step 1 (checkpoint of the initial state saved); continue with "
                              "--resume {}", run_dir.string()));
    return;
  }
  for (std::int64_t step = start_step; step < t.steps; ++step) {
    StepRecord s;
    begin_step(step, s);
    if (restarted_after_oom(step, s)) continue;
    optimizer_step(step, s);
    gather_step_stats(s);
    record_step(step, s);
    watch_ranks(step, s);
    finish_trace(step, s);
    report_progress(step, s);
    if (checkpoint_or_stop(step, s)) break;
  }
  finish_persist();  // the newest checkpoint is on disk before the run reports
  finish_op_times();
}

void Training::begin_step(std::int64_t step, StepRecord& s) {
  rec.running_step = step;
  phase_clock().begin_step(step + 1);
  s.t0 = Clock::now();
  s.cpu0 = process_cpu_seconds();
  rec.my_run_peak = std::max(rec.my_run_peak, arena.peak());  // this rank's peak over the run so far
  arena.reset_peaks();
  replica->zero_grads();
  replica->clear_routing();
  for (MoEModel* c : replica->chunks()) c->stash().reset_counters();
  s.spike = ops::imbalance_active(imbalance, step + 1);
  s.tracing = trace_on && !trace_finished && step - start_step < t.trace_steps;
  replica->set_trace(s.tracing ? trace.get() : nullptr);
  s.thread_cpu0 = op_profiler ? thread_cpu_seconds() : 0.0;
  if (op_profiler) op_profiler->begin_step(step + 1, s.tracing ? trace.get() : nullptr);
  for (MoEModel* c : replica->chunks()) c->set_router_skew(s.spike ? &imbalance : nullptr, step + 1);
  if (restart_on_oom) arena.clear_oom_events();
  s.sum = [&] {
    OverflowScope overflow(arena, restart_on_oom);
    return replica->forward_backward([&](int mb, std::int32_t* ids, std::int32_t* targets) {
      const PhaseScope step_phase(StepPhase::data);
      data.sample_batch(Split::kTrain, t.seed, step, global_microbatch(dp_rank, M, mb), B, S, ids, targets);
    });
  }();
  res.steps_run += 1;
  for (MoEModel* c : replica->chunks()) c->set_router_skew(nullptr, 0);  // evaluation routes naturally
  if (planner) {
    const auto& ds = planner->decision_seconds();
    double dmax = 0, dsum = 0;
    for (double x : ds) {
      dmax = std::max(dmax, x);
      dsum += x;
      all_decision_seconds.push_back(x);
    }
    // The step's peak as predicted at its last decision (max over ranks), and the
    // bound the decisions kept under (each projected later blocks at their floor).
    double pred[4] = {double(planner->predicted_step_peak()), double(planner->last_projected_peak()),
                      double(planner->infeasible()), double(planner->static_level_choices())};
    if (world_size > 1) world->all_reduce_max(pred, 4);
    const double predicted = pred[0];
    s.plan_line = {{"decisions", ds.size()},
                   {"decision_seconds_max", dmax},
                   {"decision_seconds_total", dsum},
                   {"predicted_peak_bytes", std::int64_t(pred[0])},
                   {"projected_bound_bytes", std::int64_t(pred[1])},
                   {"infeasible_decisions", std::int64_t(pred[2])},  // the most on any rank
                   {"static_level_choices", std::int64_t(pred[3])}};
    res.predicted_peak_bytes = std::max(res.predicted_peak_bytes, std::int64_t(predicted));
    planner->end_step();
  }
}

bool Training::restarted_after_oom(std::int64_t& step, const StepRecord& s) {
  if (restart_on_oom) {
    // Did any rank run out of memory? The lowest such rank reports (world - rank > 0).
    double oom_rank = arena.oom_events() > 0 ? double(world_size - rank) : 0.0;
    if (world_size > 1) world->all_reduce_max(&oom_rank, 1);
    if (oom_rank > 0) {
      step = restart_after_oom(step, world_size - int(oom_rank), seconds_since(s.t0)) - 1;
      return true;
    }
  }
  return false;
}

// Handles an OOM of step index `step` (0-based) seen first on `oom_rank`: records
// it, gives up past the restart limit, else restores and returns the step to go on
// from. Collective: every rank calls it at the same step.
std::int64_t Training::restart_after_oom(std::int64_t step, int oom_rank, double step_seconds) {
  struct OomInfo {  // the first OOM of the lowest rank that had one, sent to every rank
    std::int64_t requested, free, largest, budget, category;
    char op[256];
  } info{};
  if (const OutOfMemoryError* e = arena.first_oom(); e && rank == oom_rank) {
    info = {e->requested, e->free, e->largest_free_block, e->budget, std::int64_t(e->category), {}};
    std::snprintf(info.op, sizeof info.op, "%s", e->op.c_str());
  }
  if (world_size > 1) world->broadcast(&info, sizeof info, oom_rank);
  const OutOfMemoryError oom(info.requested, info.free, info.largest, info.budget, MemCategory(info.category),
                             info.op);
  const std::int64_t oom_step = step + 1;
  double demand = double(arena.peak());
  if (world_size > 1) world->all_reduce_max(&demand, 1);
  res.oom_count += 1;
  res.oom_peak_demand_bytes = std::max(res.oom_peak_demand_bytes, std::int64_t(demand));
  if (res.first_oom.empty()) res.first_oom = fmt::format("step {}, rank {}: {}", oom_step, oom_rank, oom.what());
  train_seconds += step_seconds;
  const std::int64_t tried = restarts_at[oom_step];
  if (rank0) {
    json line = {{"step", oom_step},
                 {"oom", true},
                 {"oom_rank", oom_rank},
                 {"oom_message", oom.what()},
                 {"step_seconds", step_seconds},
                 {"peak_device_bytes", std::int64_t(demand)},
                 {"injected_imbalance", ops::imbalance_active(imbalance, oom_step) ? injected_imbalance(oom_step) : 0.0}};
    append_line(metrics, run_dir / "metrics.jsonl", line.dump());
  }
  if (tried >= t.max_restarts) {
    res.tokens_per_second_effective = double(res.tokens) / std::max(train_seconds + res.restart_seconds, 1e-9);
    finish_op_times();
    write_summary(ctx, rec, seconds_since(rec.t_start));
    world->barrier();  // rank 0's summary is on disk before any rank ends the job
    rec.restart_limit_reached = true;
    throw OutOfMemoryError(
        oom, fmt::format("step {} ran out of device memory {} times (on-oom=restart, max-restarts {}; rank {}); "
                         "this policy cannot fit the step under the budget",
                         oom_step, tried + 1, t.max_restarts, oom_rank));
  }
  restarts_at[oom_step] = tried + 1;
  res.restarts += 1;
  const auto r0 = Clock::now();
  finish_persist();  // a checkpoint still being written is the newest
  // The newest checkpoint every rank holds (one rank may have died while writing).
  std::optional<fs::path> newest = train::latest_checkpoint(ckpt_root);
  double back_neg = -double(newest ? train::checkpoint_step(*newest) : 0);
  if (world_size > 1) world->all_reduce_max(&back_neg, 1);
  const std::int64_t back = std::int64_t(-back_neg);
  if (back > 0) {
    const fs::path dir = newest && train::checkpoint_step(*newest) == back ? *newest
                                                                           : train::checkpoint_dir(ckpt_root, back);
    if (restore_checkpoint(dir).at("step").get<std::int64_t>() != back)
      throw DataError(fmt::format("checkpoint '{}' does not hold step {}", dir.string(), back));
  } else {
    restore_initial_state();
  }
  last_val = res.final_val_loss;
  res.steps = back;
  res.lost_steps += step - back;
  res.restart_seconds += seconds_since(r0) + t.restart_seconds;
  progress.note(fmt::format("moeflex: step {} ran out of device memory on rank {}: restart {} of {} from {} ({} "
                            "steps lost): {}", oom_step, oom_rank, tried + 1, t.max_restarts,
                            back > 0 ? fmt::format("the checkpoint of step {}", back) : "the initial state",
                            step - back, oom.what()));
  return back;
}

void Training::optimizer_step(std::int64_t step, StepRecord& s) {
  op_context().phase = OpPhase::optimizer;  // clipping and AdamW, for the op profiler
  phase_clock().enter(StepPhase::optimizer);
  s.opt_us = s.tracing ? trace->now_us() : 0.0;
  s.gnorm = replica->clip_grad_norm(t.grad_clip);
  if (!std::isfinite(s.sum.total) || !std::isfinite(s.gnorm))
    throw Error(fmt::format("training diverged at step {}: loss {} and gradient norm {} (lower train.lr or "
                            "model.initializer_range; the last checkpoint is kept)", step + 1, s.sum.total, s.gnorm));
  // The forward/backward phase, for the bubble below: up to the optimizer step.
  s.fb_seconds = seconds_since(s.t0);
  s.lr = lr_at(step, t.warmup_steps, t.steps, t.lr, t.min_lr);
  for (auto& o : opts_) o->step(s.lr);
  replica->update_expert_bias();  // noaux_tc's balancing, from this step's loads
  op_context().phase = OpPhase::other;
  phase_clock().enter(StepPhase::other);
  s.stats_us = s.tracing ? trace->now_us() : 0.0;
  if (s.tracing) trace->complete("compute", "optimizer", s.opt_us, s.stats_us - s.opt_us);
}

void Training::gather_step_stats(StepRecord& s) {
  // The step's statistics over the ranks (the trace's "step stats").
  for (MoEModel* c : replica->chunks()) {
    s.provisioned[0] += double(c->stash().counters().saved);
    s.provisioned[1] += double(c->stash().counters().recomputed);
  }
  if (world_size > 1) world->all_reduce_sum(s.provisioned, 2);
  res.bytes_recomputed += std::int64_t(s.provisioned[1]);
  for (MoEModel* c : replica->chunks()) s.offl += double(c->stash().counters().offloaded);
  double w_reads = 0;  // zero-bubble W reads offloaded until their W (all chunks, so far)
  for (MoEModel* c : replica->chunks()) w_reads += double(c->weight_grad_bytes_offloaded());
  s.offl += w_reads >= weight_reads_offloaded_seen ? w_reads - weight_reads_offloaded_seen : w_reads;  // (rebuilt)
  weight_reads_offloaded_seen = w_reads;
  if (world_size > 1) world->all_reduce_sum(&s.offl, 1);
  res.bytes_offloaded += std::int64_t(s.offl);
  if (s.provisioned[1] > 0 || s.offl > 0) res.provisioned_steps += 1;
  const double defrag_now[4] = {double(arena.compactions()), double(arena.bytes_compacted()),
                                double(arena.bytes_evicted()), double(arena.bytes_stitched())};
  for (int i = 0; i < 4; ++i) s.defrag[i] = defrag_now[i] - defrag_seen[i], defrag_seen[i] = defrag_now[i];
  if (world_size > 1) world->all_reduce_sum(s.defrag, 4);  // this step, all ranks
  res.arena_compactions += std::int64_t(s.defrag[0]);
  res.bytes_compacted += std::int64_t(s.defrag[1]);
  res.bytes_evicted += std::int64_t(s.defrag[2]);
  res.bytes_stitched += std::int64_t(s.defrag[3]);
  std::map<int, std::int64_t> received_by_layer;  // rows this rank's experts received, summed over micro-batches
  for (const auto& r : replica->routing()) {
    s.max_imbalance = std::max(s.max_imbalance, r.imbalance);
    s.dropped += r.dropped;
    received_by_layer[r.layer] += r.received_rows;
  }
  std::vector<std::int64_t> received;
  for (auto& [l, v] : received_by_layer) received.push_back(v);
  res.max_load_ratio = std::max(res.max_load_ratio, s.max_imbalance);
  // EP: tokens each rank's experts received, per MoE layer; imbalance = max / mean.
  if (layout.ep() > 1 && !received.empty()) {
    std::vector<std::int64_t> all(received.size() * std::size_t(layout.ep()));
    groups.expert_parallel->all_gather_bytes(received.data(), all.data(),
                                             std::int64_t(received.size() * sizeof(std::int64_t)));
    for (std::size_t li = 0; li < received.size(); ++li) {
      json row = json::array();
      std::int64_t mx = 0, total = 0;
      for (int q = 0; q < layout.ep(); ++q) {
        const std::int64_t v = all[std::size_t(q) * received.size() + li];
        row.push_back(v);
        mx = std::max(mx, v);
        total += v;
      }
      s.ep_received.push_back(row);
      if (total > 0) s.ep_imbalance = std::max(s.ep_imbalance, double(mx) * layout.ep() / double(total));
    }
  }
  // Pipeline bubble: the share of the forward/backward phase a rank spends not
  // computing (waiting for its peers), averaged over ranks.
  s.bubble = s.fb_seconds > 0 ? std::max(0.0, 1.0 - replica->last_compute_seconds() / s.fb_seconds) : 0.0;
  if (world_size > 1) {
    world->all_reduce_sum(&s.bubble, 1);
    s.bubble /= world_size;
  }
  if (s.tracing) trace->complete("comm", "step stats", s.stats_us, trace->now_us() - s.stats_us);
}

void Training::record_step(std::int64_t step, StepRecord& s) {
  s.dt = seconds_since(s.t0);
  s.phases.times = phase_clock().times();  // the step up to here (its evaluation is not a rank's speed)
  s.calls = std::move(phase_clock().calls());
  phase_clock().calls().clear();
  for (const auto& r : replica->routing()) s.phases.expert_rows += double(r.received_rows);
  if (op_profiler) op_profiler->end_step(s.dt, thread_cpu_seconds() - s.thread_cpu0);
  const double step_cpu = process_cpu_seconds() - s.cpu0;
  // Before the evaluation below, which routes (and clears the routing records) too.
  record_loads(world.get(), replica->routing(), cfg.model, layout, dp_rank, M, step + 1, step_cpu,
               rank0 ? &loads_out : nullptr, run_dir / "loads.jsonl");
  train_seconds += s.dt;
  s.step_tokens = B * S * M * dp;
  res.tokens += s.step_tokens;
  res.steps = step + 1;
  res.final_train_loss = s.sum.ce;
  s.peak = double(arena.peak());
  if (world_size > 1) world->all_reduce_max(&s.peak, 1);
  res.peak_device_bytes = std::max(res.peak_device_bytes, std::int64_t(s.peak));
  const bool do_eval = (t.eval_every > 0 && (step + 1) % t.eval_every == 0) || step + 1 == t.steps;
  json line = {{"step", step + 1},
               {"loss", s.sum.ce},
               {"total_loss", s.sum.total},
               {"aux_loss", s.sum.aux},
               {"z_loss", s.sum.z},
               {"lr", s.lr},
               {"grad_norm", s.gnorm},
               {"tokens", res.tokens},
               {"step_seconds", s.dt},
               {"tokens_per_second", double(s.step_tokens) / s.dt},
               {"peak_device_bytes", std::int64_t(s.peak)},
               {"max_expert_imbalance", s.max_imbalance},
               {"dropped_assignments", s.dropped},
               {"bubble_fraction", s.bubble},
               {"bytes_saved", std::int64_t(s.provisioned[0])},
               {"bytes_recomputed", std::int64_t(s.provisioned[1])},
               {"bytes_offloaded", std::int64_t(s.offl)},
               {"arena_compactions", std::int64_t(s.defrag[0])},
               {"bytes_evicted", std::int64_t(s.defrag[2])},
               {"bytes_stitched", std::int64_t(s.defrag[3])},
               {"injected_imbalance", s.spike ? injected_imbalance(step + 1) : 0.0},
               {"oom", false}};
  for (auto& [k, v] : s.plan_line.items()) line[k] = v;
  if (layout.ep() > 1) {
    line["ep_received_tokens"] = s.ep_received;
    line["ep_imbalance"] = s.ep_imbalance;
  }
  if (do_eval) {
    last_val = evaluate();
    res.final_val_loss = last_val;
    res.final_val_step = step + 1;
    rec.history.push_back({{"step", step + 1}, {"val_loss", last_val}});
    line["val_loss"] = last_val;
  }
  s.line = std::move(line);  // written once the step's checkpoint, if any, is taken
  res.tokens_per_second = double(res.tokens) / std::max(train_seconds, 1e-9);
  res.tokens_per_second_effective = double(res.tokens) / std::max(train_seconds + res.restart_seconds, 1e-9);
}

void Training::finish_trace(std::int64_t step, const StepRecord& s) {
  if (s.tracing && (step - start_step + 1 == t.trace_steps || step + 1 == t.steps)) {
    trace->close();
    trace_finished = true;
    world->barrier();
    if (world_size > 1 && rank0) {
      std::vector<fs::path> parts;
      for (int r = 0; r < world_size; ++r) parts.push_back(train::rank_trace_path(trace_path, r));
      train::merge_traces(parts, trace_path);
      for (auto& part : parts) fs::remove(part);
    }
  }
}

void Training::note_slow_ranks(const std::vector<train::SlowRankReport>& made) {
  for (const train::SlowRankReport& r : made) {
    rec.slow_ranks.push_back(r.to_json());
    const std::string msg =
        fmt::format("moeflex: slow rank {} (host {}): {} {:.2f}x {} since step {}", r.rank, r.host, to_string(r.phase),
                    r.factor, r.vs_peers ? "its peers'" : "its own first steps'", r.first_step);
    if (opts.progress) progress.note(msg);
    else if (rank0) fmt::print(stderr, "{}\n", msg);  // a warning, even under --quiet
  }
}

void Training::watch_ranks(std::int64_t step, StepRecord& s) {
  if (!comm_calls_path.empty()) write_comm_calls(comm_calls_path, step + 1, s.calls);
  if (!slow_ranks) return;
  note_slow_ranks(slow_ranks->add(step + 1, s.phases, step + 1 == t.steps));
  json active = json::array();
  for (const train::SlowRankReport& r : slow_ranks->detector().active())
    active.push_back({{"rank", r.rank}, {"phase", to_string(r.phase)}, {"factor", r.factor}});
  if (!active.empty()) s.line["slow_ranks"] = std::move(active);
}

void Training::report_progress(std::int64_t step, const StepRecord& s) {
  const double all_bytes = s.provisioned[0] + s.provisioned[1] + s.offl;
  if (planner && !all_decision_seconds.empty()) {
    std::vector<double> sorted = all_decision_seconds;
    std::sort(sorted.begin(), sorted.end());
    res.decisions = decisions_before + std::int64_t(sorted.size());
    res.decision_seconds_p99 = sorted[std::min(sorted.size() - 1, std::size_t(0.99 * double(sorted.size())))];
  }
  progress.update(step + 1, s.sum.ce, last_val, res.final_val_step, double(s.step_tokens) / s.dt, std::int64_t(s.peak),
                  arena.budget(), all_bytes > 0 ? s.provisioned[1] / all_bytes : 0.0,
                  all_bytes > 0 ? s.offl / all_bytes : 0.0, res.provisioned_steps);
}

bool Training::checkpoint_or_stop(std::int64_t step, StepRecord& s) {
  // A stop request must be seen by every rank at the same step.
  double stop_flag = stop_requested() ? 1.0 : 0.0;
  if (world_size > 1) world->all_reduce_max(&stop_flag, 1);
  const bool stop_now =
      ((opts.stop_after >= 0 && step + 1 >= opts.stop_after) || stop_flag > 0) && step + 1 < t.steps;
  const bool last = (step + 1 == t.steps && t.checkpoint_every >= 0) || stop_now;
  // A stop scores the steps not yet exchanged (phases.jsonl then holds every step
  // run), before the checkpoint that records the reports.
  if (stop_now && slow_ranks) note_slow_ranks(slow_ranks->flush());
  if (last || (t.checkpoint_every > 0 && (step + 1) % t.checkpoint_every == 0)) save(step + 1, !last);
  if (rank0) {
    for (auto& [k, v] : last_checkpoint.items()) s.line[k] = v;
    append_line(metrics, run_dir / "metrics.jsonl", s.line.dump());
  }
  last_checkpoint = json::object();
  if (stop_now) {
    progress.note(fmt::format("stopped after step {} (checkpoint saved); continue with --resume {}", step + 1,
                              run_dir.string()));
    return true;
  }
  return false;
}

}  // namespace moeflex::run
