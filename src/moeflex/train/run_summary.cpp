// The end of a training run: summary.json (also written when an OOM ends the run),
// the ranks' peaks, op_times.json for --profile-ops, and what an error that ends the
// run leaves behind on every rank.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <fmt/format.h>
#include <system_error>

#include "moeflex/ops/blas.h"
#include "moeflex/train/run_state.h"

namespace moeflex::run {

namespace {

// Bytes of model state per parameter: fp32 weights, gradient and two AdamW moments
// (16), plus the bf16 working copy (2) with model.bf16.
std::int64_t state_bytes_per_param(const ModelConfig& m) { return 16 + (m.bf16 ? 2 : 0); }

}  // namespace

void write_summary(const RunContext& ctx, const RunRecord& rec, double wall, bool any_rank) {
  const RunConfig& cfg = ctx.cfg;
  const int world_size = ctx.world_size;
  const bool rank0 = ctx.rank0;
  const comm::ParallelLayout& layout = *ctx.layout;
  Arena& arena = ctx.arena();
  const DatasetInfo& info = ctx.info;
  const TrainResult& res = rec.res;
  if (!rank0 && !any_rank) return;
  if (rec.already_complete) return;
  json s;
  s["steps"] = res.steps;
  s["tokens"] = res.tokens;
  s["initial_val_loss"] = std::isnan(res.initial_val_loss) ? json(nullptr) : json(res.initial_val_loss);
  s["final_val_loss"] = std::isnan(res.final_val_loss) ? json(nullptr) : json(res.final_val_loss);
  s["final_train_loss"] = res.final_train_loss;
  s["tokens_per_second"] = res.tokens_per_second;
  s["peak_device_bytes"] = res.peak_device_bytes;
  s["device_budget_bytes"] = arena.unlimited() ? json(nullptr) : json(arena.budget());
  s["oom_count"] = res.oom_count;
  s["policy"] = cfg.train.policy;
  s["precision"] = cfg.model.bf16 ? "bf16" : "fp32";
  if (!res.planner_cost_model.empty()) s["planner_cost_model"] = res.planner_cost_model;
  s["bytes_recomputed"] = res.bytes_recomputed;
  s["bytes_offloaded"] = res.bytes_offloaded;
  s["arena_compactions"] = res.arena_compactions;
  s["bytes_compacted"] = res.bytes_compacted;
  s["bytes_evicted"] = res.bytes_evicted;
  s["bytes_stitched"] = res.bytes_stitched;
  s["decisions"] = res.decisions;
  s["provisioned_steps"] = res.provisioned_steps;
  s["decision_seconds_p99"] = res.decision_seconds_p99;
  s["max_load_ratio"] = res.max_load_ratio;
  s["predicted_peak_bytes"] = res.predicted_peak_bytes;
  s["on_oom"] = cfg.train.on_oom;
  s["restarts"] = res.restarts;
  s["lost_steps"] = res.lost_steps;
  s["steps_run"] = res.steps_run;
  s["restart_seconds"] = res.restart_seconds;
  s["checkpoint_mode"] = cfg.train.checkpoint_mode;
  s["checkpoint_blocking_seconds"] = res.checkpoint_blocking_seconds;
  s["checkpoint_persist_seconds"] = res.checkpoint_persist_seconds;
  s["checkpoints_skipped"] = res.checkpoints_skipped;
  s["slow_ranks"] = rec.slow_ranks;
  s["tokens_per_second_effective"] = res.tokens_per_second_effective;
  s["oom_peak_demand_bytes"] = res.oom_peak_demand_bytes;
  s["first_oom"] = res.first_oom.empty() ? json(nullptr) : json(res.first_oom);
  if (!std::isnan(res.time_model_op_error)) {  // --profile-ops (op_times.json holds the detail)
    s["time_model_op_error"] = res.time_model_op_error;
    s["time_model_op_median_error"] = res.time_model_op_median_error;
    s["time_model_op_noise_floor"] = res.time_model_op_noise_floor;
    s["time_model_step_error"] = res.time_model_step_error;
  }
  s["params"] = cfg.model.num_params();
  s["active_params"] = cfg.model.num_active_params();
  s["val_loss_history"] = rec.history;
  s["world_size"] = world_size;
  s["device"] = cfg.device;
  s["blas_core"] = ops::blas_core_name();  // OpenBLAS's kernel set on the host (its GEMMs on the CPU)
  s["layout"] = {{"pp", layout.pp()}, {"dp", layout.dp()}, {"ep", layout.ep()}, {"vpp", layout.vpp()}};
  s["peak_device_bytes_per_rank"] = rec.rank_peaks;
  s["wall_seconds"] = wall;
  json mem;
  for (int c = 0; c < int(MemCategory::count); ++c)
    mem[to_string(MemCategory(c))] = arena.stat(MemCategory(c)).peak;
  s["peak_device_bytes_by_category"] = mem;
  s["dataset"] = {{"dir", info.dir.string()}, {"train_tokens", info.train_tokens}, {"val_tokens", info.val_tokens}};
  write_file_atomically(rec.summary_path_override.empty() ? rec.summary_path : rec.summary_path_override, s.dump(2) + "\n");
}

void gather_rank_peaks(const RunContext& ctx, RunRecord& rec) {
  const std::unique_ptr<comm::Communicator>& world = ctx.world;
  const int world_size = ctx.world_size;
  Arena& arena = ctx.arena();
  if (world_size > 1) {
    std::vector<std::int64_t> peaks(static_cast<std::size_t>(world_size));
    std::int64_t mine = std::max(rec.my_run_peak, arena.peak());
    world->all_gather_bytes(&mine, peaks.data(), sizeof(mine));
    for (auto p : peaks) rec.rank_peaks.push_back(p);
  } else {
    rec.rank_peaks.push_back(std::max(rec.my_run_peak, arena.peak()));
  }
}

void report_out_of_memory(const RunContext& ctx, RunRecord& rec, const OutOfMemoryError& oom) {
  const RunConfig& cfg = ctx.cfg;
  const fs::path& run_dir = ctx.run_dir;
  const int rank = ctx.rank;
  const int world_size = ctx.world_size;
  const bool rank0 = ctx.rank0;
  Arena& arena = ctx.arena();
  const TrainConfig& t = ctx.cfg.train;
  TrainResult& res = rec.res;
  // A step that ran out says which (a restart that gave up already names it).
  const OutOfMemoryError e =
      rec.running_step >= 0 && !rec.restart_limit_reached
          ? OutOfMemoryError(oom, fmt::format("step {} of {} ran out of device memory", rec.running_step + 1, t.steps))
          : oom;
  if (!rec.state_placed)  // not a step that ran out: the budget cannot hold the model state at all
    throw ConfigError(fmt::format(
        "--device-memory {} cannot hold this rank's model state (weights{}, gradients and AdamW moments): it ran "
        "out placing '{}' with {} already placed. The whole model's state is {} ({:.2f} M parameters at {} "
        "bytes each); expert and pipeline parallelism (--ep, --pp) shard it",
        format_bytes(arena.budget()), cfg.model.bf16 ? " with their bf16 working copy" : "", e.op,
        format_bytes(e.budget - e.free), format_bytes(state_bytes_per_param(cfg.model) * cfg.model.num_params()),
        double(cfg.model.num_params()) / 1e6, state_bytes_per_param(cfg.model)));
  if (rec.restart_limit_reached) throw;  // counted, summarised and agreed on by every rank already
  res.oom_count += 1;
  if (res.first_oom.empty()) res.first_oom = e.what();
  res.peak_device_bytes = std::max(res.peak_device_bytes, arena.peak());
  if (world_size > 1) {  // the other ranks are in collectives: record, then end the job with the reason
    if (!rank0) rec.summary_path_override = run_dir / fmt::format("summary.rank{:05d}.json", rank);
    write_summary(ctx, rec, seconds_since(rec.t_start), true);
    if (!rank0 && !fs::exists(rec.summary_path)) {  // rank 0 is stuck in a collective: the run's summary names this OOM
      rec.summary_path_override.clear();
      write_summary(ctx, rec, seconds_since(rec.t_start), true);
    }
    comm::abort_job(e.what(), 3);
  }
  write_summary(ctx, rec, seconds_since(rec.t_start));
  if (rec.running_step >= 0 && !rec.restart_limit_reached) throw e;
  throw;
}

void report_error(const RunContext& ctx, const RunRecord& rec, const Error& e) {
  const TrainOptions& opts = ctx.opts;
  const fs::path& run_dir = ctx.run_dir;
  const int rank = ctx.rank;
  const int world_size = ctx.world_size;
  const TrainResult& res = rec.res;
  if (!opts.resume && res.steps_run == 0) {  // refused before its first step: no trace files are left behind
    std::error_code ec;
    fs::remove(world_size > 1 ? train::rank_trace_path(run_dir / "trace.json", rank) : run_dir / "trace.json", ec);
  }
  // Exit 4 for a failed communication (a peer died, the network failed), which a
  // relaunch may get past; 2 for the rest (moeflex run restarts 4, not 2).
  if (world_size > 1) comm::abort_job(e.what(), dynamic_cast<const comm::CommError*>(&e) ? 4 : 2);
  throw;
}

// op_times.json: every rank's ops and steps, summarised by rank 0; the first step
// of the run (cold caches, first-touch page faults) is left out when there are more.
// Every rank calls it at the same point: after the last step, or when an
// on-oom=restart run gives up (the steps that completed).
void Training::finish_op_times() {
  if (!op_profiler || res.steps <= start_step) return;  // no step completed: nothing to report
  write_op_times_part(op_times_part_path(run_dir, rank), op_profiler->records(), op_profiler->steps());
  world->barrier();
  if (rank0) {
    std::vector<fs::path> parts;
    for (int r = 0; r < world_size; ++r) parts.push_back(op_times_part_path(run_dir, r));
    const std::int64_t first = res.steps - start_step > 1 ? start_step + 2 : start_step + 1;
    // One thread on the CPU: its thread CPU clock; a device's kernels: the wall clock.
    json doc = summarize_op_time_parts(parts, first, omp_get_max_threads() == 1 && cfg.device == "cpu");
    doc["precision"] = cfg.model.bf16 ? "bf16" : "fp32";  // calibrate --from-run takes fp32 runs only
    doc["device"] = cfg.device;                           // ... onto a profile of the same device
    write_file_atomically(run_dir / "op_times.json", doc.dump(2) + "\n");
    for (auto& p : parts) fs::remove(p);
    res.time_model_op_error = doc.at("op_error").get<double>();
    res.time_model_step_error = doc.at("step_error").get<double>();
    res.time_model_op_median_error = doc.at("op_median_error").get<double>();
    res.time_model_op_noise_floor = doc.at("op_noise_floor").get<double>();
    progress.note(fmt::format(
        "time model ({} clock): op error {:.2f}% (noise floor {:.2f}%), by shape medians {:.2f}%, step error "
        "{:.2f}% (wall clock: {:.2f}%); op_times.json",
        doc.at("clock").get<std::string>(), 100 * res.time_model_op_error, 100 * res.time_model_op_noise_floor,
        100 * res.time_model_op_median_error, 100 * res.time_model_step_error,
        100 * doc.at("step_error_wall").get<double>()));
  }
  world->barrier();
}

}  // namespace moeflex::run
