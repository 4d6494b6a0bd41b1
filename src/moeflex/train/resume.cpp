// Resuming a training run: which checkpoint (the newest step every rank completed,
// on as many ranks as the run trained on), the checks of its trainer_state before
// anything is restored, and the training state a checkpoint holds: saved, restored
// on --resume or after an OOM, or reset to the initial state.
#include <cstdio>
#include <fmt/format.h>
#include <fstream>

#include "moeflex/train/tokenizer.h"
#include "moeflex/train/run_state.h"

namespace moeflex::run {

namespace {

// Lists why each checkpoint directory of `root` is unusable (for the resume error).
std::string describe_checkpoints(const fs::path& root) {
  std::string out;
  const fs::path dir = root / "checkpoints";
  if (!fs::is_directory(dir)) return " (no checkpoints/ folder)";
  for (auto& e : fs::directory_iterator(dir)) {
    try {
      train::read_checkpoint_manifest(e.path());
      out += fmt::format("\n  {}: manifest ok but files do not match it (truncated?)", e.path().string());
    } catch (const std::exception& ex) {
      out += fmt::format("\n  {}: {}", e.path().string(), ex.what());
    }
  }
  return out.empty() ? " (checkpoints/ is empty)" : out;
}

// The refusal of a --resume of `root` (a run folder or a rank's) without a complete checkpoint.
DataError no_checkpoint_error(const fs::path& root) {
  return DataError(fmt::format("--resume: '{}' holds no complete checkpoint to resume from:{} (a run that ended before "
                               "its first checkpoint cannot be resumed: start it again with another --out, or delete "
                               "the folder)", root.string(), describe_checkpoints(root)));
}

// A checkpoint's trainer_state (its manifest's, which no checksum covers), checked
// field by field before anything is restored: a damaged or hand-edited one is refused
// naming the manifest and the field.
void check_trainer_state(const json& st, const fs::path& ckpt) {
  const std::string where = (ckpt / train::kManifestFileName).string();
  auto bad = [&](const std::string& what) {
    return DataError(
        fmt::format("Checkpoint manifest '{}': trainer_state {}; the checkpoint cannot be resumed from", where, what));
  };
  if (!st.is_object()) throw bad(fmt::format("must be an object (got {})", st.dump()));
  auto check = [&](const char* key, bool required, const char* kind, auto ok) {
    if (!st.contains(key)) {
      if (required) throw bad(fmt::format("has no '{}'", key));
      return;
    }
    if (!ok(st[key])) throw bad(fmt::format("'{}' must be {} (got {})", key, kind, st[key].dump()));
  };
  const auto count = [](const json& v) { return v.is_number_integer() && v.get<std::int64_t>() >= 0; };
  const auto number = [](const json& v) { return v.is_number(); };
  for (const char* k : {"step", "adam_steps", "tokens"}) check(k, true, "a non-negative integer", count);
  check("initial_val_loss", true, "a number", number);
  for (const char* k : {"peak_device_bytes", "oom_count", "restarts", "lost_steps", "steps_run",
                        "oom_peak_demand_bytes", "bytes_recomputed", "bytes_offloaded", "provisioned_steps",
                        "arena_compactions", "bytes_compacted", "bytes_evicted", "bytes_stitched", "decisions",
                        "predicted_peak_bytes"})
    check(k, false, "a non-negative integer", count);
  for (const char* k : {"last_val_loss", "last_train_loss", "train_seconds", "restart_seconds", "max_load_ratio",
                        "checkpoint_blocking_seconds", "checkpoint_persist_seconds"})
    check(k, false, "a number", number);
  check("first_oom", false, "a string", [](const json& v) { return v.is_string(); });
  check("val_loss_history", false, "a list of {step, val_loss}", [](const json& v) {
    if (!v.is_array()) return false;
    for (const json& e : v)
      if (!e.is_object() || !e.contains("step") || !e["step"].is_number_integer()) return false;
    return true;
  });
  if (const std::int64_t step = st["step"].get<std::int64_t>(), own = train::checkpoint_step(ckpt); step != own)
    throw bad(fmt::format("'step' is {}, but the checkpoint is of step {}", step, own));
}

// Keeps only the metrics lines of steps <= `step` (a resumed run rewrites the rest).
void truncate_metrics(const fs::path& path, std::int64_t step) {
  std::ifstream in(path);
  if (!in) return;
  std::string line, kept;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    try {
      if (json::parse(line).value("step", std::int64_t(0)) <= step) kept += line + "\n";
    } catch (...) {
      // A torn last line from a crash: drop it.
    }
  }
  write_file_atomically(path, kept);
}

}  // namespace

// The pieces of a tokenizer.model, or -1 when it cannot be read (the comparison of
// its bytes with the corpus's then names the problem).
std::int64_t tokenizer_pieces(const fs::path& model) {
  try {
    return Tokenizer::load(model.string()).vocab_size();
  } catch (const Error&) {
    return -1;
  }
}

void check_resume_ranks(const RunContext& ctx) {
  const fs::path& run_dir = ctx.run_dir;
  const int world_size = ctx.world_size;
  // A run resumes on as many ranks as it trained on: one checkpoint folder per rank
  // (rank00000, ...), or the checkpoints at the top for a single-process run.
  const int ranks = train::run_rank_count(run_dir);  // its rank folders
  // Rank folders appear with the first checkpoint: without them and without a
  // checkpoint of a single process, the rank count is unknown and nothing resumes.
  if (ranks == 0 && !train::latest_checkpoint(run_dir))
    throw no_checkpoint_error(run_dir);
  const int trained_on = std::max(ranks, 1);
  if (trained_on != world_size)
    throw ConfigError(fmt::format("--resume: the run in '{}' trained on {} rank{}, not {}; resume it with {}",
                                  run_dir.string(), trained_on, trained_on == 1 ? "" : "s", world_size,
                                  trained_on == 1 ? std::string("a single process (no mpirun)")
                                                  : fmt::format("mpirun -np {}", trained_on)));
}

void find_resume_checkpoint(RunContext& ctx) {
  const fs::path& run_dir = ctx.run_dir;
  const std::unique_ptr<comm::Communicator>& world = ctx.world;
  const int rank = ctx.rank;
  const int world_size = ctx.world_size;
  const fs::path& ckpt_root = ctx.ckpt_root;
  // The newest checkpoint intact (every file's size and SHA-256), and the damaged
  // ones newer than it: named, and moved aside once the ranks agree.
  std::vector<train::DamagedCheckpoint> damaged;
  ctx.ckpt = train::newest_intact_checkpoint(ckpt_root, damaged);
  if (world_size == 1 && !ctx.ckpt) {
    if (damaged.empty()) throw no_checkpoint_error(ckpt_root);
    throw DataError(fmt::format("--resume: no intact checkpoint in '{}': the oldest, step {} ('{}'), is damaged: {}",
                                ckpt_root.string(), damaged.back().step, damaged.back().dir.string(),
                                damaged.back().why));
  }
  if (world_size > 1) {
    // Every check below ends alike on every rank (an all-reduce first): a rank that
    // threw alone would leave the others waiting in the next collective.
    double lacking = ctx.ckpt ? 0 : rank + 1;
    world->all_reduce_max(&lacking, 1);
    if (lacking > 0) throw no_checkpoint_error(run_dir / train::rank_folder_name(int(lacking) - 1));
    // Every rank must resume from the same step: the newest one all ranks completed
    // (a crash while checkpointing can leave some ranks one checkpoint ahead).
    const std::int64_t own = train::checkpoint_step(*ctx.ckpt);
    double step = -double(own);
    world->all_reduce_max(&step, 1);
    const std::int64_t common = std::int64_t(-step);
    // A rank without a usable checkpoint of that step (rotated away, or cut short by
    // a crash) leaves no step in common: every rank refuses, naming the last such rank.
    const fs::path older = train::checkpoint_dir(ckpt_root, common);
    double missing = common == own || train::checkpoint_damage(older, common).empty() ? 0 : rank + 1;
    world->all_reduce_max(&missing, 1);
    if (missing > 0)
      throw DataError(fmt::format(
          "--resume: the newest step every rank completed is {}, but rank {} holds no intact checkpoint of it "
          "('{}' is missing, incomplete or damaged): the ranks hold no checkpoint in common to resume from",
          common, int(missing) - 1,
          train::checkpoint_dir(run_dir / train::rank_folder_name(int(missing) - 1), common).string()));
    if (common != own) {
      ctx.progress_note_pending = fmt::format("rank {}: resuming from step {}, the newest step every rank completed",
                                          rank, common);
      ctx.ckpt = older;
    }
  }
  // Every damaged checkpoint is newer than the one resumed from: it goes aside, so
  // that the run's next save of that step cannot write over it.
  for (const train::DamagedCheckpoint& d : damaged) {
    const fs::path aside = train::move_checkpoint_aside(d.dir);
    std::string note =
        fmt::format("{}checkpoint step {} ('{}') is damaged: {} Moved aside to '{}'; resuming from step {}",
                    world_size > 1 ? fmt::format("rank {}: ", rank) : std::string(), d.step, d.dir.string(), d.why,
                    aside.string(), train::checkpoint_step(*ctx.ckpt));
    ctx.progress_note_pending += (ctx.progress_note_pending.empty() ? "" : "\nmoeflex: ") + note;
  }
}

std::vector<train::NamedBuffer> Training::model_bufs() {
  std::vector<train::NamedBuffer> out;
  for (Param* p : replica->params())
    out.push_back({p->tied_copy ? p->name + ".tied_copy" : p->name, p->w.shape(), p->w.f32()});
  return out;
}

std::vector<train::NamedBuffer> Training::opt_bufs() {
  std::vector<train::NamedBuffer> out;
  for (std::size_t c = 0; c < opts_.size(); ++c)
    for (auto& [name, tt] : opts_[c]->state())
      out.push_back({fmt::format("chunk{}.{}", c, name), tt->shape(), tt->f32()});
  return out;
}

std::vector<train::NamedBuffer> Training::stage(std::vector<train::NamedBuffer> bufs, bool download) {
  if (!device.backend) return bufs;
  for (auto& b : bufs) {
    staging.emplace_back(std::size_t(shape_numel(b.shape)));
    if (download) device.backend->copy_to_host(staging.back().data(), b.data, Bytes(4) * shape_numel(b.shape));
    b.data = staging.back().data();
  }
  return bufs;
}

void Training::unstage(const std::vector<train::NamedBuffer>& on_device, const std::vector<train::NamedBuffer>& host) {
  if (!device.backend) return;
  for (std::size_t i = 0; i < host.size(); ++i)
    device.backend->copy_from_host(on_device[i].data, host[i].data, Bytes(4) * shape_numel(host[i].shape));
  device.backend->synchronize();
}

json Training::restore_checkpoint(const fs::path& dir) {
  const auto mb = model_bufs(), ob = opt_bufs();
  const auto host_mb = stage(mb, false), host_ob = stage(ob, false);
  check_trainer_state(train::read_checkpoint_manifest(dir)["trainer_state"], dir);
  json st = train::load_checkpoint(dir, host_mb, host_ob);
  unstage(mb, host_mb);
  unstage(ob, host_ob);
  staging.clear();
  for (MoEModel* c : replica->chunks()) c->sync_working_weights();  // the bf16 working copies follow
  for (auto& o : opts_) o->set_steps_taken(st.at("adam_steps").get<std::int64_t>());
  res.tokens = st.at("tokens").get<std::int64_t>();
  res.initial_val_loss = st.at("initial_val_loss").get<double>();
  res.final_val_loss = st.value("last_val_loss", res.initial_val_loss);
  res.final_train_loss = st.value("last_train_loss", 0.0);
  rec.history = st.value("val_loss_history", json::array());
  res.final_val_step = rec.history.empty() ? 0 : rec.history.back().value("step", std::int64_t(0));
  return st;
}

void Training::resume_from(const fs::path& dir) {
  json st = restore_checkpoint(dir);
  start_step = st.at("step").get<std::int64_t>();
  res.peak_device_bytes = st.value("peak_device_bytes", std::int64_t(0));
  elapsed_before = st.value("train_seconds", 0.0);
  // What earlier restarts cost stays in the account of the resumed run.
  res.oom_count = st.value("oom_count", std::int64_t(0));
  res.restarts = st.value("restarts", std::int64_t(0));
  res.lost_steps = st.value("lost_steps", std::int64_t(0));
  res.steps_run = st.value("steps_run", start_step);
  res.restart_seconds = st.value("restart_seconds", 0.0);
  res.checkpoint_blocking_seconds = st.value("checkpoint_blocking_seconds", 0.0);
  res.checkpoint_persist_seconds = st.value("checkpoint_persist_seconds", 0.0);
  res.oom_peak_demand_bytes = st.value("oom_peak_demand_bytes", std::int64_t(0));
  res.first_oom = st.value("first_oom", std::string());
  res.bytes_recomputed = st.value("bytes_recomputed", std::int64_t(0));
  res.bytes_offloaded = st.value("bytes_offloaded", std::int64_t(0));
  res.provisioned_steps = st.value("provisioned_steps", std::int64_t(0));
  res.arena_compactions = st.value("arena_compactions", std::int64_t(0));
  res.bytes_compacted = st.value("bytes_compacted", std::int64_t(0));
  res.bytes_evicted = st.value("bytes_evicted", std::int64_t(0));
  res.bytes_stitched = st.value("bytes_stitched", std::int64_t(0));
  decisions_before = st.value("decisions", std::int64_t(0));
  res.max_load_ratio = st.value("max_load_ratio", 1.0);
  if (st.contains("slow_ranks") && st["slow_ranks"].is_array()) {  // the reports up to the checkpoint
    rec.slow_ranks = json::array();
    for (const json& r : st["slow_ranks"])
      if (r.value("first_step", std::int64_t(0)) <= start_step) rec.slow_ranks.push_back(r);
  }
  res.predicted_peak_bytes = st.value("predicted_peak_bytes", std::int64_t(0));
  if (rank0) truncate_metrics(run_dir / "metrics.jsonl", start_step);
  if (rank0) truncate_metrics(run_dir / "loads.jsonl", start_step);
  if (rank0) truncate_metrics(run_dir / "phases.jsonl", start_step);
  if (!comm_calls_path.empty()) truncate_metrics(comm_calls_path, start_step);
  if (start_step >= t.steps) {
    progress.note(start_step == t.steps
                      ? fmt::format("run {} is already complete at step {}; pass --steps N > {} to extend it",
                                    run_dir.string(), start_step, start_step)
                      : fmt::format("run {} is at step {}, past --steps {}; pass --steps N > {} to extend it",
                                    run_dir.string(), start_step, t.steps, start_step));
    rec.already_complete = true;
    res.steps = start_step;
    if (fs::exists(rec.summary_path)) {  // the figures of the run as it finished, for the final line
      try {
        const json prev = json::parse(std::ifstream(rec.summary_path));
        res.tokens_per_second = prev.value("tokens_per_second", 0.0);
        res.peak_device_bytes = prev.value("peak_device_bytes", Bytes(0));
      } catch (const json::exception&) {
      }
    }
  } else {
    progress.note(fmt::format("resuming {} from step {}", run_dir.string(), start_step));
    // --steps sets the run's length from now on: a later plain --resume keeps it.
    if (rank0 && opts.config.train.steps > 0) write_file_atomically(run_dir / "config.toml", cfg.to_toml());
  }
}

void Training::start() {
  if (ctx.ckpt) {
    resume_from(*ctx.ckpt);
  } else {
    if (rank0) std::remove((run_dir / "metrics.jsonl").c_str());
    if (rank0) std::remove((run_dir / "loads.jsonl").c_str());
    if (rank0) std::remove((run_dir / "phases.jsonl").c_str());
    progress.note(fmt::format(
        "moeflex: {:.2f} M params ({:.2f} M active), {}, {} train / {} val tokens, {} tokens per step, budget {}",
        double(cfg.model.num_params()) / 1e6, double(cfg.model.num_active_params()) / 1e6,
        cfg.model.bf16 ? "bf16 mixed precision" : "fp32", info.train_tokens, info.val_tokens, B * S * M * dp,
        format_bytes(arena.budget())));
    res.initial_val_loss = evaluate();
    res.final_val_loss = res.initial_val_loss;
    rec.history.push_back({{"step", 0}, {"val_loss", res.initial_val_loss}});
  }
  if (rank0) metrics.open(run_dir / "metrics.jsonl", std::ios::app);
  if (rank0) loads_out.open(run_dir / "loads.jsonl", std::ios::app);
  train_seconds = elapsed_before;
  last_val = res.final_val_loss;
}

void Training::save(std::int64_t step, bool may_skip) {
  json st = {{"step", step},
             {"adam_steps", opts_.front()->steps_taken()},
             {"tokens", res.tokens},
             {"initial_val_loss", res.initial_val_loss},
             {"last_val_loss", res.final_val_loss},
             {"last_train_loss", res.final_train_loss},
             {"peak_device_bytes", res.peak_device_bytes},
             {"val_loss_history", rec.history},
             {"train_seconds", train_seconds},
             {"oom_count", res.oom_count},
             {"restarts", res.restarts},
             {"lost_steps", res.lost_steps},
             {"steps_run", res.steps_run},
             {"restart_seconds", res.restart_seconds},
             {"checkpoint_blocking_seconds", res.checkpoint_blocking_seconds},
             {"checkpoint_persist_seconds", res.checkpoint_persist_seconds},
             {"oom_peak_demand_bytes", res.oom_peak_demand_bytes},
             {"first_oom", res.first_oom},
             // The planner's and the arena's counters, so that a resumed run reports the whole run.
             {"bytes_recomputed", res.bytes_recomputed},
             {"bytes_offloaded", res.bytes_offloaded},
             {"provisioned_steps", res.provisioned_steps},
             {"arena_compactions", res.arena_compactions},
             {"bytes_compacted", res.bytes_compacted},
             {"bytes_evicted", res.bytes_evicted},
             {"bytes_stitched", res.bytes_stitched},
             {"decisions", decisions_before + std::int64_t(all_decision_seconds.size())},
             {"max_load_ratio", res.max_load_ratio},
             {"predicted_peak_bytes", res.predicted_peak_bytes},
             {"slow_ranks", rec.slow_ranks}};
  // A rank whose persist still runs makes every rank skip, so that all keep the same steps.
  const bool skipping = may_skip && ckpt_writer->when_busy() == train::CheckpointWriter::WhenBusy::skip;
  double busy = skipping && ckpt_writer->busy() ? 1.0 : 0.0;
  if (world_size > 1 && skipping) world->all_reduce_max(&busy, 1);
  if (busy > 0) {
    ++res.checkpoints_skipped;
    progress.note(fmt::format("checkpoint of step {} skipped: the previous one is still being written", step));
    return;
  }
  const Clock::time_point t0 = Clock::now();
  finish_persist();  // one persist at a time (its rotation on every rank at the same step)
  // Old checkpoints go once every rank holds the new one: a rank killed while
  // saving leaves every rank a step in common to resume from.
  ckpt_writer->save(ckpt_root, step, stage(model_bufs(), true), stage(opt_bufs(), true), st,
                    world_size > 1 ? 0 : int(t.keep_checkpoints));
  staging.clear();
  const double blocking = seconds_since(t0);
  res.checkpoint_blocking_seconds += blocking;
  last_checkpoint["checkpoint_step"] = step;
  last_checkpoint["checkpoint_blocking_seconds"] = blocking;
  if (ckpt_writer->mode() == train::CheckpointWriter::Mode::sync) {
    res.checkpoint_persist_seconds += blocking;
    if (world_size > 1) {
      world->barrier();
      train::rotate_checkpoints(ckpt_root, step, int(t.keep_checkpoints));
    }
  }
}

void Training::finish_persist() {
  const std::optional<train::CheckpointWriter::Persisted> p = ckpt_writer->wait();
  if (!p) return;
  res.checkpoint_persist_seconds += p->seconds;
  last_checkpoint["persisted_step"] = p->step;
  last_checkpoint["checkpoint_persist_seconds"] = p->seconds;
  if (world_size > 1) {
    world->barrier();
    train::rotate_checkpoints(ckpt_root, p->step, int(t.keep_checkpoints));
  }
}

void Training::restore_initial_state() {
  initialize_weights();  // the seed's, or the --init-from checkpoint's
  for (auto& o : opts_) {
    for (auto& [name, tt] : o->state()) tt->zero();
    o->set_steps_taken(0);
  }
  res.tokens = 0;
  res.final_val_loss = res.initial_val_loss;
  res.final_train_loss = 0;
  rec.history = json::array({{{"step", 0}, {"val_loss", res.initial_val_loss}}});
}

}  // namespace moeflex::run
