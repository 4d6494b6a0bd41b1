// The set-up of a training run, before its first step: the config (a resume's own,
// checked), the ranks and their layout, threads, the device and its arena, the data;
// then the training phase's model: the op profiler, the replica and its chunks, the
// trace, the planner or static policy, the optimizers and the feasibility check.
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <fmt/format.h>
#include <strings.h>
#include <thread>

#include "moeflex/comm/communicator.h"
#include "moeflex/comm/timed_communicator.h"
#include "moeflex/core/phase_clock.h"
#include "moeflex/model/memory_plan.h"
#include "moeflex/ops/blas.h"
#include "moeflex/profile/calibrate.h"
#include "moeflex/provision/policies.h"
#ifdef MOEFLEX_HAVE_CUDA
#include "moeflex/ops/cuda/backend.h"
#endif
#include "moeflex/model/ledger.h"
#include "moeflex/train/imbalance_replay.h"
#include "moeflex/train/hf_export.h"
#include "moeflex/train/hf_import.h"
#include "moeflex/train/indexed_data.h"
#include "moeflex/train/run_state.h"

extern "C" void openblas_set_num_threads(int);

namespace moeflex::run {

namespace {

// The run's device and its arena (device.kind): host memory on the CPU, or one
// region of one GPU. The CUDA slice trains one rank; what it lacks is refused here.
ops::DeviceContext make_device(const RunConfig& cfg, int world_size) {
  if (cfg.device == "cpu") return ops::make_cpu_context(cfg.device_memory);
  if (world_size > 1)
    throw ConfigError(fmt::format("--device cuda trains on one GPU (one rank) for now: {} ranks need the NCCL "
                                  "gradient reduction and token dispatcher, which the training engine does not use "
                                  "yet; run without mpirun, or with --device cpu", world_size));
  if (cfg.train.on_oom == "restart")
    throw ConfigError("--on-oom restart is not available with --device cuda: it serves the overflow of an "
                      "out-of-memory step from host memory, which a GPU kernel cannot use");
#ifdef MOEFLEX_HAVE_CUDA
  ops::cuda::CudaContextOptions options;
  options.budget = cfg.device_memory;
  return ops::cuda::make_cuda_context(options);
#else
  throw ConfigError("--device cuda: this moeflex was built without the CUDA backend (configure with "
                    "-DMOEFLEX_CUDA=ON where nvcc is installed)");
#endif
}

// Ranks of this job on this node, from the launcher's environment (Open MPI, MPICH /
// Hydra, Slurm); 0 when none says.
int launcher_local_ranks() {
  for (const char* var : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"})
    if (const char* v = std::getenv(var)) {
      const int n = std::atoi(v);
      if (n >= 1) return n;
    }
  return 0;
}

// launcher_local_ranks, or `world_size` when the launcher does not say (one node assumed).
int ranks_on_this_node(int world_size) {
  const int n = launcher_local_ranks();
  return n >= 1 ? n : world_size;
}

}  // namespace

void resolve_config(RunContext& ctx) {
  const TrainOptions& opts = ctx.opts;
  RunConfig& cfg = ctx.cfg;
  ctx.run_dir = opts.resume ? *opts.resume : opts.out_dir;
  const fs::path& run_dir = ctx.run_dir;
  if (folder_in_use(run_dir))  // before any check that would misread a run still in progress
    throw ConfigError(folder_in_use_message(run_dir, bool(opts.resume)));
  if (opts.resume) {
    if (!fs::is_directory(run_dir))
      throw ConfigError(fmt::format("--resume: '{}' is not a run directory", run_dir.string()));
    cfg = RunConfig::from_file((run_dir / "config.toml").string());
    // An explicit --steps on resume changes the run's length (and its LR schedule).
    if (opts.config.train.steps > 0) cfg.train.steps = opts.config.train.steps;
  }
  // "auto": adaptive provisioning whenever a budget is set, else save everything.
  if (cfg.train.policy == "auto") cfg.train.policy = cfg.device_memory > 0 ? "adaptive" : "none";
  if (!opts.hardware_profile.empty() && !fs::is_regular_file(opts.hardware_profile))
    throw DataError(fmt::format("--hardware-profile '{}' is not a file (run `moeflex calibrate --out {}`?)",
                                opts.hardware_profile.string(), opts.hardware_profile.string()));
  // A profile asked for by name must load, whether or not this run prices with it
  // (only the adaptive planner and --profile-ops do): a bad one is refused up front.
  if (!opts.hardware_profile.empty()) HardwareProfile::load(opts.hardware_profile);
  cfg.validate();
  // An edited vocab_size, named before any corpus work (which would prepare a
  // tokenizer of that size, then blame the corpus for differing from the run's).
  if (opts.resume)
    if (const std::int64_t pieces = tokenizer_pieces(run_dir / "tokenizer.model");
        pieces >= 0 && pieces != cfg.model.vocab_size)
      throw ConfigError(fmt::format(
          "--resume: the run's config.toml says vocab_size = {}, but its tokenizer.model (the one the model was "
          "trained with) has {} pieces: the config was changed since the run began; restore vocab_size = {} in '{}'",
          cfg.model.vocab_size, pieces, pieces, (run_dir / "config.toml").string()));
}

void join_ranks(RunContext& ctx) {
  const TrainOptions& opts = ctx.opts;
  const RunConfig& cfg = ctx.cfg;
  // Ranks: the layout of DESIGN.md's comm/ (one rank without a launcher).
  // Timed by kind for slow-rank detection (train/slow_rank.h); its groups are too.
  ctx.world = std::make_unique<comm::TimedCommunicator>(comm::make_world_communicator());
  ctx.rank = ctx.world->rank(), ctx.world_size = ctx.world->size();
  ctx.rank0 = ctx.rank == 0;
  const int rank = ctx.rank, world_size = ctx.world_size;
  const ParallelConfig& pc = cfg.parallel;
  // The CPU engine's device memory is this machine's RAM: a model whose state alone
  // (16 bytes a parameter at the least: weights, gradients, AdamW's two moments) is
  // larger would be killed by the kernel partway through allocating it, without a word.
  // Checked when every rank runs here (the ranks' shards add up to the whole model).
  if (cfg.device == "cpu" && ranks_on_this_node(world_size) == world_size) {
    const double state = 16.0 * double(cfg.model.num_params());
    const double ram = double(::sysconf(_SC_PHYS_PAGES)) * double(::sysconf(_SC_PAGE_SIZE));
    if (ram > 0 && state > ram)
      throw ConfigError(fmt::format(
          "the model's {:.2f} B parameters need {} for their weights, gradients and AdamW moments alone (16 bytes "
          "each), more than this machine's {} of memory: choose a smaller model",
          double(cfg.model.num_params()) / 1e9, format_bytes(Bytes(std::min(state, 9e18))), format_bytes(Bytes(ram))));
  }
  if (opts.resume) check_resume_ranks(ctx);
  if (const int r = train::parse_slowdown(cfg.train.inject_slowdown).rank; r >= world_size)
    throw ConfigError(fmt::format("--inject-slowdown: rank {} does not exist ({} rank{})", r, world_size,
                                  world_size == 1 ? "" : "s"));
  if (pc.dp == 0 && world_size % pc.pp != 0)
    throw ConfigError(fmt::format("{} rank{} cannot be split into pipelines of pp = {}: the world size must be a "
                                  "multiple of pp (ranks = pp x dp)", world_size, world_size == 1 ? "" : "s", pc.pp));
  comm::LayoutSpec spec;
  spec.world_size = world_size;
  spec.pp = pc.pp;
  spec.dp = pc.dp > 0 ? pc.dp : world_size / pc.pp;
  spec.ep = pc.ep;
  spec.vpp = pc.schedule == "dualpipev" && pc.vpp == 1 ? 2 : pc.vpp;  // DualPipeV: two stages per rank
  spec.num_layers = int(cfg.model.num_hidden_layers);
  spec.num_experts = int(cfg.model.num_experts);
  spec.pad_layers = pc.pad_layers;
  spec.stage_layers = pc.stage_layers;
  ctx.layout.emplace(spec);
  ctx.groups = comm::make_groups(*ctx.world, *ctx.layout);
  ctx.dp = ctx.layout->dp(), ctx.dp_rank = ctx.groups.coords.dp_rank;
  // Each rank keeps its own checkpoints (expert shards differ across EP ranks).
  ctx.ckpt_root = world_size > 1 ? ctx.run_dir / train::rank_folder_name(rank) : ctx.run_dir;
}

void set_threads_and_progress(RunContext& ctx) {
  const TrainOptions& opts = ctx.opts;
  const int world_size = ctx.world_size;
  const bool rank0 = ctx.rank0;
  const comm::ParallelLayout& layout = *ctx.layout;
  const TrainConfig& t = ctx.cfg.train;
  // Threads: --threads, else OMP_NUM_THREADS, else the node's cores shared among its
  // ranks (every rank taking every core would make each OpenMP barrier wait for
  // threads the other ranks' threads have descheduled: several times slower).
  int threads = opts.threads;
  std::string threads_note;
  if (threads <= 0 && world_size > 1 && std::getenv("OMP_NUM_THREADS") == nullptr) {
    // The node's cores over its ranks, and no more than this rank may run on (a
    // launcher that binds ranks to cores narrows omp_get_num_procs already).
    const int local = ranks_on_this_node(world_size);
    const int cores = std::max(1, int(std::thread::hardware_concurrency()));
    threads = std::max(1, std::min(omp_get_num_procs(), cores / local));
    threads_note = fmt::format("moeflex: {} ranks on this node of {} cores: {} thread{} each (--threads N or "
                               "OMP_NUM_THREADS to choose)", local, cores, threads, threads == 1 ? "" : "s");
  }
  if (threads > 0) {
    omp_set_num_threads(threads);
    openblas_set_num_threads(threads);
  }
  // More threads on this node than cores: waiting ranks nap instead of yielding. Only
  // when the launcher says how many ranks share the node (a multi-node job without
  // that must not be taken for one node); cores as the host counts them (a cpuset
  // smaller than the host is not seen).
  const int node_threads = launcher_local_ranks() * omp_get_max_threads();
  const int node_cores = std::max(1, int(std::thread::hardware_concurrency()));
  comm::set_host_oversubscribed(world_size > 1 && node_threads > node_cores);
  // Ranks filling every core share them with the launcher and the system too: their
  // phases are timed in CPU time (core/phase_clock.h).
  phase_clock().set_cpu_time(world_size > 1 && node_threads >= node_cores);
  ctx.progress.emplace(opts.progress && rank0, t.steps);
  Progress& progress = *ctx.progress;
  if (!threads_note.empty()) progress.note(threads_note);
  if (comm::host_oversubscribed())
    progress.note(
        fmt::format("moeflex: {} threads on this node's {} cores (ranks x threads): waiting ranks sleep "
                    "rather than yield, leaving the cores to the ranks that compute",
                    node_threads, node_cores));
  if (const double load = load_average(); world_size == 1 && omp_get_max_threads() > 1 &&
                                          load > kBusyLoadPerCore * omp_get_num_procs())
    progress.note(fmt::format("moeflex: warning: the machine is busy (load average {:.1f} on {} cores): each of the "
                              "{} threads' kernels waits for threads other processes deschedule, which can make "
                              "steps several times slower; --threads 1 may be faster", load, omp_get_num_procs(),
                              omp_get_max_threads()));
  if (!ctx.progress_note_pending.empty()) fmt::print(stderr, "moeflex: {}\n", ctx.progress_note_pending);
  if (world_size > 1) progress.note(fmt::format("moeflex: {} ranks: {}", world_size, layout.describe()));
}

void open_device(RunContext& ctx) {
  const RunConfig& cfg = ctx.cfg;
  const int world_size = ctx.world_size;
  ops::DeviceContext& device = ctx.device;
  Progress& progress = *ctx.progress;
  // Device state (weights, grads, optimizer moments, then activations per step) lives
  // in the arena of the run's device; a device that cannot be had fails here, first.
  ctx.device = make_device(cfg, world_size);
  Arena& arena = *device.arena;
  if (device.backend)
    progress.note(fmt::format("moeflex: device {}: arena {}", device.backend->describe(), format_bytes(arena.budget())));
}

void open_data(RunContext& ctx) {
  const TrainOptions& opts = ctx.opts;
  const RunConfig& cfg = ctx.cfg;
  const std::unique_ptr<comm::Communicator>& world = ctx.world;
  const bool rank0 = ctx.rank0;
  Progress& progress = *ctx.progress;
  // Data: pre-tokenized as it is, or a text corpus tokenized (or reused).
  ctx.corpus = cfg.data.path.empty() ? default_corpus_path() : fs::path(cfg.data.path);
  const fs::path& corpus = ctx.corpus;
  // Pre-tokenized data (a flat token file or a Megatron indexed dataset) is used as it is.
  std::optional<TokenDataset> tokens;
  std::string what;
  if (!cfg.data.path.empty() && flat_token_code(corpus)) {
    tokens.emplace(TokenDataset::open_flat(corpus, int(cfg.model.vocab_size), cfg.data.val_fraction, 1234,
                                           cfg.data.eos_id));
    what = fmt::format("flat token file '{}'", corpus.string());
  } else if (const std::optional<fs::path> prefix = cfg.data.path.empty() ? std::nullopt : megatron_prefix(corpus)) {
    tokens.emplace(TokenDataset::open_megatron(*prefix, int(cfg.model.vocab_size), cfg.data.val_fraction, 1234));
    what = fmt::format("Megatron indexed dataset '{}'", prefix->string());
  }
  if (!tokens && opts.init_from && !opts.resume)
    throw ConfigError(fmt::format(
        "--init-from: the checkpoint's embeddings are indexed by its own tokenizer's ids, and a text corpus ('{}') "
        "would be tokenized by a tokenizer moeflex trains: give data tokenized with the checkpoint's tokenizer "
        "(--data PREFIX for a Megatron indexed dataset, or a flat .u16/.u32 token file)", corpus.string()));
  if (tokens) {
    const TokenDataset& ds = ctx.data.emplace(std::move(*tokens));
    ctx.info.dir = ds.dir();
    ctx.info.vocab_size = ds.vocab_size();
    ctx.info.train_tokens = ds.num_tokens(Split::kTrain);
    ctx.info.val_tokens = ds.num_tokens(Split::kVal);
    if (rank0)
      progress.note(fmt::format("data: {}: {} training and {} validation tokens", what, ctx.info.train_tokens,
                                ctx.info.val_tokens));
    return;
  }
  if (cfg.data.path.empty() && !fs::exists(corpus))
    throw DataError(fmt::format("the default corpus '{}' is missing (a path relative to the current directory, {}): "
                                "run from the repository root after `make data`, or pass --data PATH",
                                corpus.string(), fs::current_path().string()));
  if (!fs::exists(corpus)) throw DataError(fmt::format("Corpus path '{}' does not exist.", corpus.string()));
  ctx.data_dir =
      opts.data_cache / fmt::format("{}-v{}", fs::absolute(corpus).lexically_normal().filename().string(),
                                    cfg.model.vocab_size);
  const fs::path& data_dir = ctx.data_dir;
  DatasetInfo& info = ctx.info;
  if (rank0)
    info = prepare_dataset(corpus, data_dir, int(cfg.model.vocab_size), cfg.data.val_fraction, 1234,
                           [&](const std::string& m) { progress.note(m); });
  world->barrier();  // the other ranks read what rank 0 prepared
  ctx.data.emplace(TokenDataset::open(data_dir));

  world->barrier();
}

// ---- the training phase's model ----------------------------------------------------------

Training::Training(RunContext& ctx, RunRecord& rec)
    : ctx(ctx),
      rec(rec),
      res(rec.res),
      t(ctx.cfg.train),
      opts(ctx.opts),
      cfg(ctx.cfg),
      run_dir(ctx.run_dir),
      world(ctx.world),
      rank(ctx.rank),
      world_size(ctx.world_size),
      rank0(ctx.rank0),
      layout(*ctx.layout),
      groups(ctx.groups),
      dp(ctx.dp),
      dp_rank(ctx.dp_rank),
      ckpt_root(ctx.ckpt_root),
      progress(*ctx.progress),
      device(ctx.device),
      arena(*ctx.device.arena),
      info(ctx.info),
      data(*ctx.data),
      B(int(t.micro_batch_size)),
      S(int(t.seq_len)),
      M(t.grad_accum),
      in(static_cast<std::size_t>(B * S)),
      tg(static_cast<std::size_t>(B * S)),
      restart_on_oom(t.on_oom == "restart") {
  using W = train::CheckpointWriter;
  ckpt_writer = std::make_unique<W>(t.checkpoint_mode == "sync" ? W::Mode::sync : W::Mode::async,
                                    t.checkpoint_when_busy == "skip" ? W::WhenBusy::skip : W::WhenBusy::wait);
  start_op_profiling();
  build_replica();
  choose_provisioning();
  for (MoEModel* c : replica->chunks())
    opts_.push_back(std::make_unique<AdamW>(c->params(), arena, AdamWConfig{t.beta1, t.beta2, 1e-8, t.weight_decay}));
  rec.state_placed = true;
  check_feasibility();
  start_slow_rank_watch();
}

void Training::start_slow_rank_watch() {
  const train::InjectedSlowdown inj = train::parse_slowdown(t.inject_slowdown);  // (its rank checked by join_ranks)
  phase_clock().set_slowdown(inj.rank == rank ? inj.slowdown : Slowdown{StepPhase::other, 1.0, 1});
  phase_clock().set_call_log(t.slow_rank_level >= 2);
  if (t.slow_rank_level >= 2) {  // this rank's calls, one line per step (watch_ranks)
    comm_calls_path = run_dir / (world_size > 1 ? fmt::format("comm_calls.rank{}.jsonl", rank) : "comm_calls.jsonl");
    if (!opts.resume) fs::remove(comm_calls_path);
  }
  if (t.slow_rank_every <= 0) return;
  train::SlowRankOptions so;
  so.threshold = t.slow_rank_threshold;
  std::vector<int> stage_of(static_cast<std::size_t>(world_size));  // ranks of one stage do the same work
  for (int r = 0; r < world_size; ++r) stage_of[std::size_t(r)] = layout.coords(r).pp_rank;
  slow_ranks.emplace(*world, so, int(std::min<std::int64_t>(t.slow_rank_every, 1 << 20)), std::move(stage_of),
                     rank0 ? run_dir / "phases.jsonl" : fs::path());
}

void Training::start_op_profiling() {
  // --profile-ops: every backend op of each step is timed and priced by the cost model
  // (profile/op_profiler.h). The profiler wraps the arena's backend and is handed out by
  // ops::backend_of() while the run lives, so the model and optimizer built below run
  // through it; without the flag nothing is wrapped.
  if (opts.profile_ops) {
    const fs::path profile =
        opts.hardware_profile.empty() ? fs::path(kDefaultHardwareProfilePath) : opts.hardware_profile;
    if (!fs::exists(profile))
      throw ConfigError(fmt::format("--profile-ops prices ops with a hardware profile, and '{}' does not exist: run "
                                    "`moeflex calibrate` or pass --hardware-profile FILE", profile.string()));
    op_cost.emplace(HardwareProfile::load(profile));
    op_profiler = std::make_unique<ProfilingBackend>(ops::backend_of(arena), *op_cost, rank);
    op_override.emplace(op_profiler.get());
    if (rank0) progress.note(fmt::format("--profile-ops: ops priced with {}", profile.string()));
    if (rank0 && op_cost->profile().device != cfg.device)
      fmt::print(stderr,
                 "moeflex: warning: --profile-ops: {} was measured on {} and this run trains on {}: the op "
                 "times are this run's, the predictions beside them the {}'s\n",
                 profile.string(), op_cost->profile().device, cfg.device, op_cost->profile().device);
    else if (rank0 && op_cost->profile().threads != omp_get_max_threads())
      fmt::print(stderr,
                 "moeflex: warning: --profile-ops: {} was calibrated with {} thread(s) and this run uses {}: "
                 "the predictions are for the profile's threads (calibrate with --threads {} or train with "
                 "--threads {})\n",
                 profile.string(), op_cost->profile().threads, omp_get_max_threads(), omp_get_max_threads(),
                 op_cost->profile().threads);
    // (On its own: it adds to a thread-count mismatch, not hides it.)
    if (rank0 && !op_cost->profile().blas_core.empty() &&
        strcasecmp(op_cost->profile().blas_core.c_str(), ops::blas_core_name().c_str()) != 0)
      fmt::print(stderr,
                 "moeflex: warning: --profile-ops: {} was calibrated on OpenBLAS's {} kernels and this run has its "
                 "{} kernels: the predictions are for the profile's (run `moeflex calibrate` again)\n",
                 profile.string(), op_cost->profile().blas_core, ops::blas_core_name());
  }
}

void Training::initialize_weights() {
  replica->init_weights(t.seed);
  if (!opts.init_from || opts.resume) return;
  // A Hugging Face checkpoint's weights instead (fine-tuning).
  HfCheckpoint ckpt(*opts.init_from);
  const std::string arch = hf_architecture(cfg.model);
  check_hf_checkpoint(ckpt, cfg.model, arch);
  for (MoEModel* c : replica->chunks()) load_hf_weights(ckpt, arch, *c);
  if (rank0 && !weights_noted)
    progress.note(fmt::format("weights: the {} checkpoint '{}' ({} tensors)", arch, opts.init_from->string(),
                              ckpt.names().size()));
  weights_noted = true;
}

void Training::build_replica() {
  replica = std::make_unique<Replica>(cfg.model, cfg.parallel.schedule, layout, groups, arena, M, B, S);
  initialize_weights();
  // What the ledger says one micro-batch keeps, block by block (model/ledger.h).
  if (rank0) progress.note(ledger_report(cfg.model, B, S, layout.ep() > 1));
  imbalance = ops::parse_imbalance(t.inject_imbalance);
  load_replay_shares(imbalance, cfg.model, layout.ep());  // replay=PATH: the recorded shares
  const int ep_groups = layout.ep() > 1 ? layout.ep() : int(cfg.model.num_experts);
  // A hot or empty group that does not exist is refused before step 1.
  if (imbalance.mode != ops::ImbalanceSpec::Mode::none)
    ops::skew_for(imbalance, 1, 0, cfg.model.num_experts, ep_groups);
  if (imbalance.ratio > 1) {
    const int groups = imbalance.expert_level ? int(cfg.model.num_experts) : ep_groups;
    const double cap = ops::max_imbalance_ratio(cfg.model.num_experts, cfg.model.num_experts_per_tok, groups);
    if (imbalance.ratio > cap) {
      // Not what was asked: a warning even under --quiet.
      if (rank0)
        fmt::print(stderr,
                   "moeflex: warning: --inject-imbalance: ratio {} is above the most {} groups of experts allow "
                   "with top-{} ({}); injecting {}\n",
                   imbalance.ratio, groups, cfg.model.num_experts_per_tok, cap, cap);
      imbalance.ratio = cap;
    }
  }
  // trace.json: the first trace_steps steps of this run, one file per rank, merged by
  // rank 0. A resume keeps the trace the run already has (and a resume with nothing
  // left to train writes none).
  trace_path = run_dir / "trace.json";
  trace_on = t.trace_steps > 0 && !(opts.resume && fs::exists(trace_path));
  // (The writer names its process "rank <pid>" itself.)
  trace = std::make_unique<train::TraceWriter>(world_size > 1 ? train::rank_trace_path(trace_path, rank) : trace_path,
                                               rank, trace_on);
  detach_trace.emplace(*replica);
}

void Training::choose_provisioning() {
  // Provisioning: the adaptive planner (one per rank: it sees the rank's arena), or a static policy.
  if (t.policy == "adaptive") planner = std::make_unique<AdaptivePlanner>(arena);
  // The planner prices its choices with the machine's calibrated cost model when
  // `moeflex calibrate` has written one; otherwise it ranks them by op family.
  if (planner) {
    const fs::path profile =
        opts.hardware_profile.empty() ? fs::path(kDefaultHardwareProfilePath) : opts.hardware_profile;
    std::string note = fmt::format("no hardware profile at {} (run `moeflex calibrate`): the planner ranks "
                                   "choices by op family", profile.string());
    res.planner_cost_model = "op family";
    bool unusable = false;
    if (fs::exists(profile)) {
      try {
        cost_model.emplace(HardwareProfile::load(profile));
        note = fmt::format("the planner prices choices with {}", profile.string());
        res.planner_cost_model = profile.string();
      } catch (const Error& e) {
        if (!opts.hardware_profile.empty()) throw;  // asked for by name: its error is the run's
        note = fmt::format("the hardware profile {} is unusable ({}): the planner ranks choices by op family; "
                           "rerun `moeflex calibrate` to replace it", profile.string(), e.what());
        unusable = true;
      }
    }
    // Another device's times would rank recomputing against offloading wrongly (a
    // GPU computes ~100x faster than this CPU, but copies only a few times faster).
    if (cost_model && cost_model->profile().device != cfg.device) {
      note = fmt::format(
          "the hardware profile {} was measured on {} and this run trains on {}: the planner "
          "ranks choices by op family ({})",
          profile.string(), cost_model->profile().device, cfg.device,
          cfg.device == "cpu" ? "run `moeflex calibrate` for this machine's CPU"
                              : "`moeflex calibrate` measures the CPU backend only");
      res.planner_cost_model = "op family";
      cost_model.reset();
      unusable = true;
    }
    // An unusable profile is a warning even under --quiet: the run goes on, but priced worse.
    if (rank0 && unusable) fmt::print(stderr, "moeflex: warning: {}\n", note);
    else if (rank0) progress.note(note);
  }
  for (MoEModel* c : replica->chunks()) {
    if (planner) {
      c->set_planner(planner.get());
      if (cost_model) c->set_cost_model(&*cost_model);
    } else {
      c->stash().set_policy(make_static_policy(t.policy));
    }
  }
}

void Training::check_feasibility() {
  // Feasibility up front (DESIGN.md, the planner's invariant): the smallest budget
  // under which every step fits with every activation at its most memory-saving
  // choice and every MoE layer at its worst-case routing. A smaller one is refused.
  if (planner && !arena.unlimited()) {
    double need[2] = {double(minimum_budget(cfg.model, B, S, replica->step_program(), arena.in_use())),
                      double(arena.in_use())};
    if (world_size > 1) world->all_reduce_max(need, 2);
    if (double(arena.budget()) < need[0])
      throw ConfigError(fmt::format(
          "--device-memory {} ({} B{}) is below the smallest budget for which adaptive provisioning can guarantee "
          "no out-of-memory error: {} ({} B: {} of weights, gradients and optimizer state on the fullest rank, "
          "plus one step with every activation recomputed or offloaded and worst-case expert routing, plus {} kept "
          "free for placement); use --device-memory {} or more",
          format_bytes(arena.budget()), arena.budget(),
          arena.budget() != cfg.device_memory
              ? fmt::format(", {} B rounded down to the arena's {}-byte alignment", cfg.device_memory,
                            Arena::kAlignment)
              : std::string(),
          format_bytes(Bytes(need[0])), Bytes(need[0]), format_bytes(Bytes(need[1])),
          format_bytes(Arena::placement_reserve(Bytes(need[0]))),
          format_bytes(Bytes(std::ceil(need[0] / double(kMiB)) * double(kMiB)))));
    progress.note(fmt::format("adaptive provisioning: budget {}, smallest feasible {}", format_bytes(arena.budget()),
                              format_bytes(Bytes(need[0]))));
  }
}

}  // namespace moeflex::run
