#include "moeflex/train/trainer.h"

#include <fmt/format.h>
#include <omp.h>
#include <strings.h>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <optional>
#include <nlohmann/json.hpp>
#include <csignal>
#include <sstream>
#include <thread>

#include "moeflex/comm/communicator.h"
#include "moeflex/comm/layout.h"
#include "moeflex/core/arena.h"
#include "moeflex/core/error.h"
#include "moeflex/model/model.h"
#include "moeflex/ops/backend.h"
#include "moeflex/ops/blas.h"
#ifdef MOEFLEX_HAVE_CUDA
#include "moeflex/ops/cuda/backend.h"
#endif
#include "moeflex/train/checkpoint.h"
#include "moeflex/train/dataset.h"
#include "moeflex/train/tokenizer.h"
#include "moeflex/train/distributed.h"
#include "moeflex/ops/imbalance.h"
#include "moeflex/model/memory_plan.h"
#include "moeflex/provision/planner.h"
#include "moeflex/profile/calibrate.h"
#include "moeflex/provision/policies.h"
#include "moeflex/train/optimizer.h"
#include "moeflex/train/replica.h"
#include "moeflex/train/safetensors.h"
#include "moeflex/train/trace.h"
#include "moeflex/profile/op_profiler.h"

extern "C" void openblas_set_num_threads(int);

namespace moeflex {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}




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


/// The progress line: a bar on a terminal, periodic log lines otherwise.
class Progress {
 public:
  Progress(bool enabled, std::int64_t total) : enabled_(enabled), total_(total), tty_(isatty(fileno(stderr))) {}
  /// `provisioned_steps`: steps of the run so far that recomputed or offloaded anything.
  /// `val`: the last validation loss, evaluated after step `val_step` (0: before training).
  void update(std::int64_t step, double loss, double val, std::int64_t val_step, double tps, Bytes peak, Bytes budget,
              double recomputed, double offloaded, std::int64_t provisioned_steps) {
    if (!enabled_) return;
    const int width = 24;
    const int filled = int(double(width) * double(step) / double(std::max<std::int64_t>(total_, 1)));
    std::string bar(std::size_t(filled), '=');
    bar.resize(std::size_t(width), ' ');
    std::string line = fmt::format(
        "step {:>5}/{} [{}] loss {:.4f} | val {} | {:.0f} tok/s | mem {} / {} | recomp {:.0f}% offl {:.0f}% "
        "(on {} step{} so far)",
        step, total_, bar, loss, std::isnan(val) ? std::string("-") : fmt::format("{:.4f} @{}", val, val_step), tps,
        format_bytes(peak), format_bytes(budget), 100.0 * recomputed, 100.0 * offloaded, provisioned_steps,
        provisioned_steps == 1 ? "" : "s");
    if (tty_) {
      fmt::print(stderr, "\r{}\x1b[K", line);
      if (step == total_) fmt::print(stderr, "\n");
    } else if (step == 1 || step == total_ || step % std::max<std::int64_t>(1, total_ / 20) == 0) {
      fmt::print(stderr, "{}\n", line);
    }
    std::fflush(stderr);
  }
  void note(const std::string& msg) {
    if (!enabled_) return;
    fmt::print(stderr, "{}{}\n", tty_ ? "\r\x1b[K" : "", msg);
  }

 private:
  bool enabled_;
  std::int64_t total_;
  bool tty_;
};

}  // namespace

fs::path default_corpus_path() { return fs::path("data") / "brown"; }

namespace {

// Bytes of model state per parameter: fp32 weights, gradient and two AdamW moments
// (16), plus the bf16 working copy (2) with model.bf16.
std::int64_t state_bytes_per_param(const ModelConfig& m) { return 16 + (m.bf16 ? 2 : 0); }

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

}  // namespace

namespace {

// SIGINT / SIGTERM ask the run to stop after the current step, with a checkpoint
// (a second signal ends the process at once).
volatile std::sig_atomic_t g_stop_requested = 0;

extern "C" void on_stop_signal(int sig) {
  if (g_stop_requested) {
    std::signal(sig, SIG_DFL);
    std::raise(sig);
  }
  g_stop_requested = 1;
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

// The checkpoint roots a run folder may hold: the folder itself (one process) and
// its rank folders (several).
std::vector<fs::path> checkpoint_roots(const fs::path& run_dir) {
  std::vector<fs::path> roots = {run_dir};
  std::error_code ec;
  if (fs::is_directory(run_dir, ec))
    for (const auto& e : fs::directory_iterator(run_dir, ec))
      if (e.is_directory() && train::is_rank_folder_name(e.path().filename().string())) roots.push_back(e.path());
  return roots;
}

// Whether a moeflex process is training in `run_dir` now: it holds the exclusive lock
// on RUN/.moeflex.lock (probed with a shared one, which probes do not contend for).
bool folder_in_use(const fs::path& run_dir) {
  const fs::path lock = run_dir / ".moeflex.lock";
  if (!fs::exists(lock)) return false;
  const int fd = ::open(lock.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool busy = ::flock(fd, LOCK_SH | LOCK_NB) != 0;
  ::close(fd);
  return busy;
}

// The refusal of a folder another process trains in (folder_in_use, or a lock not had).
std::string folder_in_use_message(const fs::path& run_dir, bool resume) {
  return fmt::format("another moeflex process is training in '{}' (it holds {}); wait for it to end{}",
                     run_dir.string(), (run_dir / ".moeflex.lock").string(), resume ? "" : " or use another --out");
}

// The refusal of a new run into a folder that holds one with a checkpoint.
std::string holds_a_run_message(const fs::path& run_dir) {
  return fmt::format("run directory '{}' already holds a run; use --resume {} or another --out", run_dir.string(),
                     run_dir.string());
}

// Whether `run_dir` holds a complete checkpoint, on any number of ranks.
bool holds_a_checkpoint(const fs::path& run_dir) {
  for (const fs::path& root : checkpoint_roots(run_dir))
    if (train::latest_checkpoint(root)) return true;
  return false;
}

// Whether any rank's checkpoints folder exists in `run_dir`, complete or not.
bool has_checkpoints_folder(const fs::path& run_dir) {
  for (const fs::path& root : checkpoint_roots(run_dir))
    if (fs::exists(root / "checkpoints")) return true;
  return false;
}

// Whether `run_dir` holds a run that trained (whatever its rank count): its metrics,
// summary or checkpoints. A folder with only config.toml and tokenizer.model is a
// run refused before its first step, which a new run may take over.
bool holds_a_run(const fs::path& run_dir) {
  return fs::exists(run_dir / "summary.json") || fs::exists(run_dir / "metrics.jsonl") ||
         has_checkpoints_folder(run_dir);
}

// The pieces of a tokenizer.model, or -1 when it cannot be read (the comparison of
// its bytes with the corpus's then names the problem).
std::int64_t tokenizer_pieces(const fs::path& model) {
  try {
    return Tokenizer::load(model.string()).vocab_size();
  } catch (const Error&) {
    return -1;
  }
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
                        "arena_compactions", "bytes_compacted", "bytes_evicted", "decisions", "predicted_peak_bytes"})
    check(k, false, "a non-negative integer", count);
  for (const char* k : {"last_val_loss", "last_train_loss", "train_seconds", "restart_seconds", "max_load_ratio"})
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

// What a new run in `run_dir` would overwrite that no earlier moeflex run left: a
// config.toml moeflex did not write (its header), or a tokenizer.model, trace.json,
// loads.jsonl or op_times.json beside no moeflex config.toml. "" when nothing.
std::string foreign_file_in(const fs::path& run_dir) {
  bool ours = false;
  if (std::ifstream in(run_dir / "config.toml"); in) {
    std::string first;
    std::getline(in, first);
    if (first != kRunConfigHeader) return (run_dir / "config.toml").string();
    ours = true;
  }
  if (ours) return "";
  for (const char* name : {"tokenizer.model", "trace.json", "loads.jsonl", "op_times.json"})
    if (fs::exists(run_dir / name)) return (run_dir / name).string();
  return "";
}

}  // namespace

TrainResult run_training(const TrainOptions& opts) {
  RunConfig cfg = opts.config;
  const fs::path run_dir = opts.resume ? *opts.resume : opts.out_dir;
  if (folder_in_use(run_dir))  // before any check that would misread a run still in progress
    throw ConfigError(folder_in_use_message(run_dir, bool(opts.resume)));
  std::optional<fs::path> ckpt;
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
  const TrainConfig& t = cfg.train;
  // An edited vocab_size, named before any corpus work (which would prepare a
  // tokenizer of that size, then blame the corpus for differing from the run's).
  if (opts.resume)
    if (const std::int64_t pieces = tokenizer_pieces(run_dir / "tokenizer.model");
        pieces >= 0 && pieces != cfg.model.vocab_size)
      throw ConfigError(fmt::format(
          "--resume: the run's config.toml says vocab_size = {}, but its tokenizer.model (the one the model was "
          "trained with) has {} pieces: the config was changed since the run began; restore vocab_size = {} in '{}'",
          cfg.model.vocab_size, pieces, pieces, (run_dir / "config.toml").string()));

  std::string progress_note_pending;
  // Ranks: the layout of DESIGN.md's comm/ (one rank without a launcher).
  std::unique_ptr<comm::Communicator> world = comm::make_world_communicator();
  const int rank = world->rank(), world_size = world->size();
  const bool rank0 = rank == 0;
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
  if (opts.resume) {
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
  const comm::ParallelLayout layout(spec);
  comm::ParallelGroups groups = comm::make_groups(*world, layout);
  const int dp = layout.dp(), dp_rank = groups.coords.dp_rank;
  // Each rank keeps its own checkpoints (expert shards differ across EP ranks).
  const fs::path ckpt_root = world_size > 1 ? run_dir / train::rank_folder_name(rank) : run_dir;
  if (opts.resume) {
    ckpt = train::latest_checkpoint(ckpt_root);
    if (world_size == 1 && !ckpt) throw no_checkpoint_error(ckpt_root);
    if (world_size > 1) {
      // Every check below ends alike on every rank (an all-reduce first): a rank that
      // threw alone would leave the others waiting in the next collective.
      double lacking = ckpt ? 0 : rank + 1;
      world->all_reduce_max(&lacking, 1);
      if (lacking > 0) throw no_checkpoint_error(run_dir / train::rank_folder_name(int(lacking) - 1));
      // Every rank must resume from the same step: the newest one all ranks completed
      // (a crash while checkpointing can leave some ranks one checkpoint ahead).
      const std::int64_t own = train::checkpoint_step(*ckpt);
      double step = -double(own);
      world->all_reduce_max(&step, 1);
      const std::int64_t common = std::int64_t(-step);
      // A rank without a usable checkpoint of that step (rotated away, or cut short by
      // a crash) leaves no step in common: every rank refuses, naming the last such rank.
      const fs::path older = train::checkpoint_dir(ckpt_root, common);
      double missing = common == own || train::checkpoint_complete(older, common) ? 0 : rank + 1;
      world->all_reduce_max(&missing, 1);
      if (missing > 0)
        throw DataError(fmt::format(
            "--resume: the newest step every rank completed is {}, but rank {} holds no complete checkpoint of it "
            "('{}' is missing or incomplete): the ranks hold no checkpoint in common to resume from",
            common, int(missing) - 1,
            train::checkpoint_dir(run_dir / train::rank_folder_name(int(missing) - 1), common).string()));
      if (common != own) {
        progress_note_pending = fmt::format("rank {}: resuming from step {}, the newest step every rank completed",
                                            rank, common);
        ckpt = older;
      }
    }
  }
  if (!opts.resume && holds_a_run(run_dir)) {
    // Every training run writes its config.toml first; a summary without one is
    // another command's output (`moeflex simulate --out`), not a run to resume.
    if (!fs::exists(run_dir / "config.toml") && !has_checkpoints_folder(run_dir))
      throw ConfigError(
          fmt::format("'{}' holds another command's output (a summary.json or metrics.jsonl without a "
                      "run's config.toml, e.g. `moeflex simulate --out`), not a training run: use "
                      "another --out",
                      run_dir.string()));
    if (!holds_a_checkpoint(run_dir))  // it ended before its first checkpoint: nothing to resume
      throw ConfigError(
          fmt::format("run directory '{}' holds a run that ended before its first complete checkpoint "
                      "(it has metrics, a summary or a checkpoints folder); it cannot be resumed: use "
                      "another --out, or delete it to start over there",
                      run_dir.string()));
    throw ConfigError(holds_a_run_message(run_dir));
  }
  // Before any corpus work: a new run would overwrite files no moeflex run wrote.
  if (!opts.resume)
    if (const std::string f = foreign_file_in(run_dir); !f.empty())
      throw ConfigError(
          fmt::format("--out '{}' holds '{}', which no moeflex run wrote and a new run would overwrite: "
                      "use another --out, or move it away",
                      run_dir.string(), f));
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
  Progress progress(opts.progress && rank0, t.steps);
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
  if (!progress_note_pending.empty()) fmt::print(stderr, "moeflex: {}\n", progress_note_pending);
  if (world_size > 1) progress.note(fmt::format("moeflex: {} ranks: {}", world_size, layout.describe()));
  // Device state (weights, grads, optimizer moments, then activations per step) lives
  // in the arena of the run's device; a device that cannot be had fails here, first.
  ops::DeviceContext device = make_device(cfg, world_size);
  Arena& arena = *device.arena;
  if (device.backend)
    progress.note(fmt::format("moeflex: device {}: arena {}", device.backend->describe(), format_bytes(arena.budget())));

  // Data: tokenize (or reuse) the corpus.
  const fs::path corpus = cfg.data.path.empty() ? default_corpus_path() : fs::path(cfg.data.path);
  if (cfg.data.path.empty() && !fs::exists(corpus))
    throw DataError(fmt::format("the default corpus '{}' is missing (a path relative to the current directory, {}): "
                                "run from the repository root after `make data`, or pass --data PATH",
                                corpus.string(), fs::current_path().string()));
  if (!fs::exists(corpus)) throw DataError(fmt::format("Corpus path '{}' does not exist.", corpus.string()));
  const fs::path data_dir =
      opts.data_cache / fmt::format("{}-v{}", fs::absolute(corpus).lexically_normal().filename().string(),
                                    cfg.model.vocab_size);
  DatasetInfo info;
  if (rank0)
    info = prepare_dataset(corpus, data_dir, int(cfg.model.vocab_size), cfg.data.val_fraction, 1234,
                           [&](const std::string& m) { progress.note(m); });
  world->barrier();  // the other ranks read what rank 0 prepared
  TokenDataset data = TokenDataset::open(data_dir);

  world->barrier();
  std::string folder_error;
  // One process trains in a run folder at a time: rank 0 holds an advisory lock on
  // RUN/.moeflex.lock for the whole run (released by the kernel when the process ends,
  // however it ends).
  struct RunLock {
    int fd = -1;
    ~RunLock() {
      if (fd >= 0) ::close(fd);
    }
  } run_lock;
  if (rank0) {
    fs::create_directories(run_dir);
    run_lock.fd = ::open((run_dir / ".moeflex.lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (run_lock.fd < 0 || ::flock(run_lock.fd, LOCK_EX | LOCK_NB) != 0)
      folder_error = folder_in_use_message(run_dir, bool(opts.resume));
    else if (!opts.resume && holds_a_run(run_dir))  // a run that began and ended since the check above
      folder_error = holds_a_run_message(run_dir);
    else  // the lock is ours: temporary files of an atomic write a killed process left are garbage
      for (const auto& e : fs::directory_iterator(run_dir))
        if (e.is_regular_file() && e.path().filename().string().find(".tmp-") != std::string::npos) fs::remove(e.path());
  }
  if (rank0 && folder_error.empty()) {
    if (!opts.resume) {
      // Both written to a temporary file and renamed: a symlink in their place is
      // replaced, never followed (its target stays as it was).
      write_file_atomically(run_dir / "config.toml", cfg.to_toml());
      const std::vector<char> tok = read_file_bytes(data_dir / "tokenizer.model");
      write_file_atomically(run_dir / "tokenizer.model", std::string_view(tok.data(), tok.size()));
    } else if (!fs::exists(run_dir / "tokenizer.model")) {
      folder_error = fmt::format(
          "--resume: the run '{}' has no tokenizer.model, so its corpus cannot be checked against the one at '{}' "
          "(a changed corpus would give the model token ids it never learned). Restore the run's tokenizer.model",
          run_dir.string(), corpus.string());
    } else if (read_file_bytes(run_dir / "tokenizer.model") != read_file_bytes(data_dir / "tokenizer.model")) {
      // The corpus changed since the run began (its tokenizer was retrained): the
      // model's embeddings belong to the run's own tokenizer, which stays as it is.
      folder_error = fmt::format(
          "--resume: the corpus '{}' has changed since the run began: its tokenizer now differs from the run's "
          "tokenizer.model, so its token ids would not mean what the model learned. Resume with the corpus the run "
          "was trained on", corpus.string());
    }
  }
  if (world_size > 1) {  // every rank refuses together
    double bad = folder_error.empty() ? 0.0 : 1.0;
    world->all_reduce_max(&bad, 1);
    if (bad > 0 && folder_error.empty()) folder_error = "the run folder was refused on rank 0 (see its message)";
  }
  if (!folder_error.empty()) throw DataError(folder_error);
  world->barrier();

  TrainResult res;
  const fs::path summary_path = run_dir / "summary.json";
  json history = json::array();
  json rank_peaks = json::array();
  Bytes my_run_peak = 0;
  fs::path summary_path_override;
  // --resume of a run already at its last step: nothing trains, and its summary.json
  // (the statistics of the steps that did) stays as it is.
  bool already_complete = false;
  auto write_summary = [&](double wall, bool any_rank = false) {
    if (!rank0 && !any_rank) return;
    if (already_complete) return;
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
    s["val_loss_history"] = history;
    s["world_size"] = world_size;
    s["device"] = cfg.device;
    s["blas_core"] = ops::blas_core_name();  // OpenBLAS's kernel set on the host (its GEMMs on the CPU)
    s["layout"] = {{"pp", layout.pp()}, {"dp", layout.dp()}, {"ep", layout.ep()}, {"vpp", layout.vpp()}};
    s["peak_device_bytes_per_rank"] = rank_peaks;
    s["wall_seconds"] = wall;
    json mem;
    for (int c = 0; c < int(MemCategory::count); ++c)
      mem[to_string(MemCategory(c))] = arena.stat(MemCategory(c)).peak;
    s["peak_device_bytes_by_category"] = mem;
    s["dataset"] = {{"dir", info.dir.string()}, {"train_tokens", info.train_tokens}, {"val_tokens", info.val_tokens}};
    write_file_atomically(summary_path_override.empty() ? summary_path : summary_path_override, s.dump(2) + "\n");
  };

  const auto t_start = Clock::now();
  g_stop_requested = 0;
  bool state_placed = false;  // weights, gradients and optimizer state are in the arena
  auto old_int = std::signal(SIGINT, on_stop_signal);
  auto old_term = std::signal(SIGTERM, on_stop_signal);
  struct RestoreSignals {
    decltype(old_int) i, t;
    ~RestoreSignals() {
      std::signal(SIGINT, i);
      std::signal(SIGTERM, t);
    }
  } restore{old_int, old_term};
  bool restart_limit_reached = false;  // on_oom = restart gave up: every rank throws at the same step
  std::int64_t running_step = -1;      // the step in progress (0-based), for an OOM's message
  try {
    const int B = int(t.micro_batch_size), S = int(t.seq_len);
    const std::int64_t M = t.grad_accum;
    // --profile-ops: every backend op of each step is timed and priced by the cost model
    // (profile/op_profiler.h). The profiler wraps the arena's backend and is handed out by
    // ops::backend_of() while the run lives, so the model and optimizer built below run
    // through it; without the flag nothing is wrapped.
    std::optional<CostModel> op_cost;
    std::unique_ptr<ProfilingBackend> op_profiler;
    std::optional<ScopedBackendOverride> op_override;
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
    Replica replica(cfg.model, pc.schedule, layout, groups, arena, M, B, S);
    replica.init_weights(t.seed);
    ops::ImbalanceSpec imbalance = ops::parse_imbalance(t.inject_imbalance);
    if (imbalance.ratio > 1) {
      const int groups = layout.ep() > 1 ? layout.ep() : int(cfg.model.num_experts);
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
    const fs::path trace_path = run_dir / "trace.json";
    const bool trace_on = t.trace_steps > 0 && !(opts.resume && fs::exists(trace_path));
    // (The writer names its process "rank <pid>" itself.)
    train::TraceWriter trace(world_size > 1 ? train::rank_trace_path(trace_path, rank) : trace_path, rank, trace_on);
    struct DetachTrace {  // the copy engines' observers point at `trace`: detached before it goes
      Replica& replica;
      ~DetachTrace() { replica.set_trace(nullptr); }
    } detach_trace{replica};
    bool trace_finished = false;
    // Provisioning: the adaptive planner (one per rank: it sees the rank's arena), or a static policy.
    std::unique_ptr<AdaptivePlanner> planner;
    if (t.policy == "adaptive") planner = std::make_unique<AdaptivePlanner>(arena);
    // The planner prices its choices with the machine's calibrated cost model when
    // `moeflex calibrate` has written one; otherwise it ranks them by op family.
    std::optional<CostModel> cost_model;
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
    for (MoEModel* c : replica.chunks()) {
      if (planner) {
        c->set_planner(planner.get());
        if (cost_model) c->set_cost_model(&*cost_model);
      } else {
        c->stash().set_policy(make_static_policy(t.policy));
      }
    }
    std::vector<double> all_decision_seconds;
    std::vector<std::unique_ptr<AdamW>> opts_;
    for (MoEModel* c : replica.chunks())
      opts_.push_back(std::make_unique<AdamW>(c->params(), arena, AdamWConfig{t.beta1, t.beta2, 1e-8, t.weight_decay}));
    state_placed = true;
    // Feasibility up front (DESIGN.md, the planner's invariant): the smallest budget
    // under which every step fits with every activation at its most memory-saving
    // choice and every MoE layer at its worst-case routing. A smaller one is refused.
    if (planner && !arena.unlimited()) {
      double need[2] = {double(minimum_budget(cfg.model, B, S, replica.step_program(), arena.in_use(), 0.0)),
                        double(arena.in_use())};
      if (world_size > 1) world->all_reduce_max(need, 2);
      if (double(arena.budget()) < need[0])
        throw ConfigError(fmt::format(
            "--device-memory {} ({} B{}) is below the smallest budget for which adaptive provisioning can guarantee "
            "no out-of-memory error: {} ({} B: {} of weights, gradients and optimizer state on the fullest rank, "
            "plus one step with every activation recomputed or offloaded and worst-case expert routing); use "
            "--device-memory {} or more ({:.0f}% more lets the planner keep a fragmentation margin)",
            format_bytes(arena.budget()), arena.budget(),
            arena.budget() != cfg.device_memory
                ? fmt::format(", {} B rounded down to the arena's {}-byte alignment", cfg.device_memory,
                              Arena::kAlignment)
                : std::string(),
            format_bytes(Bytes(need[0])), Bytes(need[0]), format_bytes(Bytes(need[1])),
            format_bytes(Bytes(std::ceil(need[0] / double(kMiB)) * double(kMiB))), 100 * kPlannerMarginFraction));
      progress.note(fmt::format("adaptive provisioning: budget {}, smallest feasible {}", format_bytes(arena.budget()),
                                format_bytes(Bytes(need[0]))));
    }
    auto model_bufs = [&] {
      std::vector<train::NamedBuffer> out;
      for (Param* p : replica.params())
        out.push_back({p->tied_copy ? p->name + ".tied_copy" : p->name, p->w.shape(), p->w.f32()});
      return out;
    };
    auto opt_bufs = [&] {
      std::vector<train::NamedBuffer> out;
      for (std::size_t c = 0; c < opts_.size(); ++c)
        for (auto& [name, tt] : opts_[c]->state())
          out.push_back({fmt::format("chunk{}.{}", c, name), tt->shape(), tt->f32()});
      return out;
    };
    std::vector<std::int32_t> in(static_cast<std::size_t>(B * S)), tg(static_cast<std::size_t>(B * S));
    auto evaluate = [&] {
      const std::int64_t nb = data.num_val_batches(B, S, t.eval_batches);
      double sum = 0;
      for (std::int64_t i = 0; i < nb; ++i) {
        data.val_batch(i, B, S, t.eval_batches, in.data(), tg.data());
        sum += replica.evaluate(in.data(), tg.data()).ce;
      }
      replica.clear_routing();
      return sum / double(std::max<std::int64_t>(nb, 1));
    };
    std::int64_t start_step = 0;
    double elapsed_before = 0;
    std::int64_t decisions_before = 0;  // the planner's decisions before a resume
    // The training state a checkpoint holds (weights, AdamW moments and step, tokens,
    // losses); shared by --resume and by the restart after an OOM. Returns its step.
    // On a device, checkpoint files are written from and read into host copies.
    std::vector<std::vector<float>> staging;
    auto stage = [&](std::vector<train::NamedBuffer> bufs, bool download) {
      if (!device.backend) return bufs;
      for (auto& b : bufs) {
        staging.emplace_back(std::size_t(shape_numel(b.shape)));
        if (download) device.backend->copy_to_host(staging.back().data(), b.data, Bytes(4) * shape_numel(b.shape));
        b.data = staging.back().data();
      }
      return bufs;
    };
    auto unstage = [&](const std::vector<train::NamedBuffer>& on_device, const std::vector<train::NamedBuffer>& host) {
      if (!device.backend) return;
      for (std::size_t i = 0; i < host.size(); ++i)
        device.backend->copy_from_host(on_device[i].data, host[i].data, Bytes(4) * shape_numel(host[i].shape));
      device.backend->synchronize();
    };
    auto restore_checkpoint = [&](const fs::path& dir) {
      const auto mb = model_bufs(), ob = opt_bufs();
      const auto host_mb = stage(mb, false), host_ob = stage(ob, false);
      check_trainer_state(train::read_checkpoint_manifest(dir)["trainer_state"], dir);
      json st = train::load_checkpoint(dir, host_mb, host_ob);
      unstage(mb, host_mb);
      unstage(ob, host_ob);
      staging.clear();
      for (MoEModel* c : replica.chunks()) c->sync_working_weights();  // the bf16 working copies follow
      for (auto& o : opts_) o->set_steps_taken(st.at("adam_steps").get<std::int64_t>());
      res.tokens = st.at("tokens").get<std::int64_t>();
      res.initial_val_loss = st.at("initial_val_loss").get<double>();
      res.final_val_loss = st.value("last_val_loss", res.initial_val_loss);
      res.final_train_loss = st.value("last_train_loss", 0.0);
      history = st.value("val_loss_history", json::array());
      res.final_val_step = history.empty() ? 0 : history.back().value("step", std::int64_t(0));
      return st;
    };
    if (ckpt) {
      json st = restore_checkpoint(*ckpt);
      start_step = st.at("step").get<std::int64_t>();
      res.peak_device_bytes = st.value("peak_device_bytes", std::int64_t(0));
      elapsed_before = st.value("train_seconds", 0.0);
      // What earlier restarts cost stays in the account of the resumed run.
      res.oom_count = st.value("oom_count", std::int64_t(0));
      res.restarts = st.value("restarts", std::int64_t(0));
      res.lost_steps = st.value("lost_steps", std::int64_t(0));
      res.steps_run = st.value("steps_run", start_step);
      res.restart_seconds = st.value("restart_seconds", 0.0);
      res.oom_peak_demand_bytes = st.value("oom_peak_demand_bytes", std::int64_t(0));
      res.first_oom = st.value("first_oom", std::string());
      res.bytes_recomputed = st.value("bytes_recomputed", std::int64_t(0));
      res.bytes_offloaded = st.value("bytes_offloaded", std::int64_t(0));
      res.provisioned_steps = st.value("provisioned_steps", std::int64_t(0));
      res.arena_compactions = st.value("arena_compactions", std::int64_t(0));
      res.bytes_compacted = st.value("bytes_compacted", std::int64_t(0));
      res.bytes_evicted = st.value("bytes_evicted", std::int64_t(0));
      decisions_before = st.value("decisions", std::int64_t(0));
      res.max_load_ratio = st.value("max_load_ratio", 1.0);
      res.predicted_peak_bytes = st.value("predicted_peak_bytes", std::int64_t(0));
      if (rank0) truncate_metrics(run_dir / "metrics.jsonl", start_step);
      if (rank0) truncate_metrics(run_dir / "loads.jsonl", start_step);
      if (start_step >= t.steps) {
        progress.note(start_step == t.steps
                          ? fmt::format("run {} is already complete at step {}; pass --steps N > {} to extend it",
                                        run_dir.string(), start_step, start_step)
                          : fmt::format("run {} is at step {}, past --steps {}; pass --steps N > {} to extend it",
                                        run_dir.string(), start_step, t.steps, start_step));
        already_complete = true;
        res.steps = start_step;
        if (fs::exists(summary_path)) {  // the figures of the run as it finished, for the final line
          try {
            const json prev = json::parse(std::ifstream(summary_path));
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
    } else {
      if (rank0) std::remove((run_dir / "metrics.jsonl").c_str());
      if (rank0) std::remove((run_dir / "loads.jsonl").c_str());
      progress.note(fmt::format(
          "moeflex: {:.2f} M params ({:.2f} M active), {}, {} train / {} val tokens, {} tokens per step, budget {}",
          double(cfg.model.num_params()) / 1e6, double(cfg.model.num_active_params()) / 1e6,
          cfg.model.bf16 ? "bf16 mixed precision" : "fp32", info.train_tokens, info.val_tokens, B * S * M * dp,
          format_bytes(arena.budget())));
      res.initial_val_loss = evaluate();
      res.final_val_loss = res.initial_val_loss;
      history.push_back({{"step", 0}, {"val_loss", res.initial_val_loss}});
    }
    // op_times.json: every rank's ops and steps, summarised by rank 0; the first step
    // of the run (cold caches, first-touch page faults) is left out when there are more.
    // Every rank calls it at the same point: after the last step, or when an
    // on-oom=restart run gives up (the steps that completed).
    auto finish_op_times = [&] {
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
    };
    std::ofstream metrics;
    if (rank0) metrics.open(run_dir / "metrics.jsonl", std::ios::app);
    std::ofstream loads_out;  // loads.jsonl (record_loads)
    if (rank0) loads_out.open(run_dir / "loads.jsonl", std::ios::app);
    double train_seconds = elapsed_before;
    auto save = [&](std::int64_t step) {
      json st = {{"step", step},
                 {"adam_steps", opts_.front()->steps_taken()},
                 {"tokens", res.tokens},
                 {"initial_val_loss", res.initial_val_loss},
                 {"last_val_loss", res.final_val_loss},
                 {"last_train_loss", res.final_train_loss},
                 {"peak_device_bytes", res.peak_device_bytes},
                 {"val_loss_history", history},
                 {"train_seconds", train_seconds},
                 {"oom_count", res.oom_count},
                 {"restarts", res.restarts},
                 {"lost_steps", res.lost_steps},
                 {"steps_run", res.steps_run},
                 {"restart_seconds", res.restart_seconds},
                 {"oom_peak_demand_bytes", res.oom_peak_demand_bytes},
                 {"first_oom", res.first_oom},
                 // The planner's and the arena's counters, so that a resumed run reports the whole run.
                 {"bytes_recomputed", res.bytes_recomputed},
                 {"bytes_offloaded", res.bytes_offloaded},
                 {"provisioned_steps", res.provisioned_steps},
                 {"arena_compactions", res.arena_compactions},
                 {"bytes_compacted", res.bytes_compacted},
                 {"bytes_evicted", res.bytes_evicted},
                 {"decisions", decisions_before + std::int64_t(all_decision_seconds.size())},
                 {"max_load_ratio", res.max_load_ratio},
                 {"predicted_peak_bytes", res.predicted_peak_bytes}};
      // Old checkpoints go once every rank holds the new one: a rank killed while
      // saving leaves every rank a step in common to resume from.
      train::save_checkpoint(ckpt_root, step, stage(model_bufs(), true), stage(opt_bufs(), true), st,
                             world_size > 1 ? 0 : int(t.keep_checkpoints));
      if (world_size > 1) {
        world->barrier();
        train::rotate_checkpoints(ckpt_root, step, int(t.keep_checkpoints));
      }
      staging.clear();
    };

    double last_val = res.final_val_loss;
    // --on-oom=restart. The arena serves what does not fit from the heap during the
    // step (overflow mode), so that every rank completes its collectives; then the
    // ranks agree whether any of them ran out of memory, and if so all drop the step
    // and go back to the newest checkpoint every rank holds (the initial state, with
    // the same seed, when there is none yet), as a crashed and relaunched job would.
    // The data order, the LR schedule and the injected spikes are functions of the
    // global step, so the redone steps are the same steps (and a recurring spike
    // recurs: after train.max_restarts restarts at one step the run gives up).
    const bool restart_on_oom = t.on_oom == "restart";
    struct OverflowScope {
      Arena& arena;
      OverflowScope(Arena& a, bool on) : arena(a) { arena.set_overflow(on); }
      ~OverflowScope() { arena.set_overflow(false); }
    };
    std::map<std::int64_t, std::int64_t> restarts_at;  // 1-based step -> restarts caused by it
    auto restore_initial_state = [&] {
      replica.init_weights(t.seed);
      for (auto& o : opts_) {
        for (auto& [name, tt] : o->state()) tt->zero();
        o->set_steps_taken(0);
      }
      res.tokens = 0;
      res.final_val_loss = res.initial_val_loss;
      res.final_train_loss = 0;
      history = json::array({{{"step", 0}, {"val_loss", res.initial_val_loss}}});
    };
    // Handles an OOM of step index `step` (0-based) seen first on `oom_rank`: records
    // it, gives up past the restart limit, else restores and returns the step to go on
    // from. Collective: every rank calls it at the same step.
    auto restart_after_oom = [&](std::int64_t step, int oom_rank, double step_seconds) -> std::int64_t {
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
                     {"injected_imbalance", ops::imbalance_active(imbalance, oom_step) ? imbalance.ratio : 0.0}};
        append_line(metrics, run_dir / "metrics.jsonl", line.dump());
      }
      if (tried >= t.max_restarts) {
        res.tokens_per_second_effective = double(res.tokens) / std::max(train_seconds + res.restart_seconds, 1e-9);
        finish_op_times();
        write_summary(seconds_since(t_start));
        world->barrier();  // rank 0's summary is on disk before any rank ends the job
        restart_limit_reached = true;
        throw OutOfMemoryError(
            oom, fmt::format("step {} ran out of device memory {} times (on-oom=restart, max-restarts {}; rank {}); "
                             "this policy cannot fit the step under the budget",
                             oom_step, tried + 1, t.max_restarts, oom_rank));
      }
      restarts_at[oom_step] = tried + 1;
      res.restarts += 1;
      const auto r0 = Clock::now();
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
    };
    // Arena fragmentation handling so far on this rank: compactions, bytes moved, bytes evicted.
    double defrag_seen[3] = {0, 0, 0};
    for (std::int64_t step = start_step; step < t.steps; ++step) {
      running_step = step;
      const auto t0 = Clock::now();
      const double cpu0 = process_cpu_seconds();
      my_run_peak = std::max(my_run_peak, arena.peak());  // this rank's peak over the run so far
      arena.reset_peaks();
      replica.zero_grads();
      replica.clear_routing();
      for (MoEModel* c : replica.chunks()) c->stash().reset_counters();
      const bool spike = ops::imbalance_active(imbalance, step + 1);
      const bool tracing = trace_on && !trace_finished && step - start_step < t.trace_steps;
      replica.set_trace(tracing ? &trace : nullptr);
      const double thread_cpu0 = op_profiler ? thread_cpu_seconds() : 0.0;
      if (op_profiler) op_profiler->begin_step(step + 1, tracing ? &trace : nullptr);
      for (MoEModel* c : replica.chunks()) c->set_router_skew(spike ? imbalance.ratio : 0.0);
      if (restart_on_oom) arena.clear_oom_events();
      const LossParts sum = [&] {
        OverflowScope overflow(arena, restart_on_oom);
        return replica.forward_backward([&](int mb, std::int32_t* ids, std::int32_t* targets) {
          data.sample_batch(Split::kTrain, t.seed, step, global_microbatch(dp_rank, M, mb), B, S, ids, targets);
        });
      }();
      res.steps_run += 1;
      for (MoEModel* c : replica.chunks()) c->set_router_skew(0.0);  // evaluation routes naturally
      json plan_line;
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
        double pred[3] = {double(planner->predicted_step_peak()), double(planner->last_projected_peak()),
                          double(planner->infeasible())};
        if (world_size > 1) world->all_reduce_max(pred, 3);
        const double predicted = pred[0];
        plan_line = {{"decisions", ds.size()},
                     {"decision_seconds_max", dmax},
                     {"decision_seconds_total", dsum},
                     {"predicted_peak_bytes", std::int64_t(pred[0])},
                     {"projected_bound_bytes", std::int64_t(pred[1])},
                     {"infeasible_decisions", std::int64_t(pred[2])}};  // the most on any rank
        res.predicted_peak_bytes = std::max(res.predicted_peak_bytes, std::int64_t(predicted));
        planner->end_step();
      }
      if (restart_on_oom) {
        // Did any rank run out of memory? The lowest such rank reports (world - rank > 0).
        double oom_rank = arena.oom_events() > 0 ? double(world_size - rank) : 0.0;
        if (world_size > 1) world->all_reduce_max(&oom_rank, 1);
        if (oom_rank > 0) {
          step = restart_after_oom(step, world_size - int(oom_rank), seconds_since(t0)) - 1;
          continue;
        }
      }
      op_context().phase = OpPhase::optimizer;  // clipping and AdamW, for the op profiler
      const double opt_us = tracing ? trace.now_us() : 0.0;
      const double gnorm = replica.clip_grad_norm(t.grad_clip);
      if (!std::isfinite(sum.total) || !std::isfinite(gnorm))
        throw Error(fmt::format("training diverged at step {}: loss {} and gradient norm {} (lower train.lr or "
                                "model.initializer_range; the last checkpoint is kept)", step + 1, sum.total, gnorm));
      // The forward/backward phase, for the bubble below: up to the optimizer step.
      const double fb_seconds = seconds_since(t0);
      const double lr = lr_at(step, t.warmup_steps, t.steps, t.lr, t.min_lr);
      for (auto& o : opts_) o->step(lr);
      op_context().phase = OpPhase::other;
      const double stats_us = tracing ? trace.now_us() : 0.0;
      if (tracing) trace.complete("compute", "optimizer", opt_us, stats_us - opt_us);
      // The step's statistics over the ranks (the trace's "step stats").
      double provisioned[2] = {0, 0};  // bytes saved, recomputed (this step, all ranks)
      for (MoEModel* c : replica.chunks()) {
        provisioned[0] += double(c->stash().counters().saved);
        provisioned[1] += double(c->stash().counters().recomputed);
      }
      if (world_size > 1) world->all_reduce_sum(provisioned, 2);
      res.bytes_recomputed += std::int64_t(provisioned[1]);
      double offl = 0;
      for (MoEModel* c : replica.chunks()) offl += double(c->stash().counters().offloaded);
      if (world_size > 1) world->all_reduce_sum(&offl, 1);
      res.bytes_offloaded += std::int64_t(offl);
      if (provisioned[1] > 0 || offl > 0) res.provisioned_steps += 1;
      const double defrag_now[3] = {double(arena.compactions()), double(arena.bytes_compacted()),
                                    double(arena.bytes_evicted())};
      double defrag[3];
      for (int i = 0; i < 3; ++i) defrag[i] = defrag_now[i] - defrag_seen[i], defrag_seen[i] = defrag_now[i];
      if (world_size > 1) world->all_reduce_sum(defrag, 3);  // this step, all ranks
      res.arena_compactions += std::int64_t(defrag[0]);
      res.bytes_compacted += std::int64_t(defrag[1]);
      res.bytes_evicted += std::int64_t(defrag[2]);
      double max_imbalance = 1.0;
      std::int64_t dropped = 0;
      std::map<int, std::int64_t> received_by_layer;  // rows this rank's experts received, summed over micro-batches
      for (const auto& r : replica.routing()) {
        max_imbalance = std::max(max_imbalance, r.imbalance);
        dropped += r.dropped;
        received_by_layer[r.layer] += r.received_rows;
      }
      std::vector<std::int64_t> received;
      for (auto& [l, v] : received_by_layer) received.push_back(v);
      res.max_load_ratio = std::max(res.max_load_ratio, max_imbalance);
      // EP: tokens each rank's experts received, per MoE layer; imbalance = max / mean.
      json ep_received = json::array();
      double ep_imbalance = 1.0;
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
          ep_received.push_back(row);
          if (total > 0) ep_imbalance = std::max(ep_imbalance, double(mx) * layout.ep() / double(total));
        }
      }
      // Pipeline bubble: the share of the forward/backward phase a rank spends not
      // computing (waiting for its peers), averaged over ranks.
      double bubble = fb_seconds > 0 ? std::max(0.0, 1.0 - replica.last_compute_seconds() / fb_seconds) : 0.0;
      if (world_size > 1) {
        world->all_reduce_sum(&bubble, 1);
        bubble /= world_size;
      }
      if (tracing) trace.complete("comm", "step stats", stats_us, trace.now_us() - stats_us);
      const double dt = seconds_since(t0);
      if (op_profiler) op_profiler->end_step(dt, thread_cpu_seconds() - thread_cpu0);
      const double step_cpu = process_cpu_seconds() - cpu0;
      // Before the evaluation below, which routes (and clears the routing records) too.
      record_loads(world.get(), replica.routing(), cfg.model, layout, dp_rank, M, step + 1, step_cpu,
                   rank0 ? &loads_out : nullptr, run_dir / "loads.jsonl");
      train_seconds += dt;
      const std::int64_t step_tokens = B * S * M * dp;
      res.tokens += step_tokens;
      res.steps = step + 1;
      res.final_train_loss = sum.ce;
      double peak = double(arena.peak());
      if (world_size > 1) world->all_reduce_max(&peak, 1);
      res.peak_device_bytes = std::max(res.peak_device_bytes, std::int64_t(peak));
      const bool do_eval = (t.eval_every > 0 && (step + 1) % t.eval_every == 0) || step + 1 == t.steps;
      json line = {{"step", step + 1},
                   {"loss", sum.ce},
                   {"total_loss", sum.total},
                   {"aux_loss", sum.aux},
                   {"z_loss", sum.z},
                   {"lr", lr},
                   {"grad_norm", gnorm},
                   {"tokens", res.tokens},
                   {"step_seconds", dt},
                   {"tokens_per_second", double(step_tokens) / dt},
                   {"peak_device_bytes", std::int64_t(peak)},
                   {"max_expert_imbalance", max_imbalance},
                   {"dropped_assignments", dropped},
                   {"bubble_fraction", bubble},
                   {"bytes_saved", std::int64_t(provisioned[0])},
                   {"bytes_recomputed", std::int64_t(provisioned[1])},
                   {"bytes_offloaded", std::int64_t(offl)},
                   {"arena_compactions", std::int64_t(defrag[0])},
                   {"bytes_evicted", std::int64_t(defrag[2])},
                   {"injected_imbalance", spike ? imbalance.ratio : 0.0},
                   {"oom", false}};
      for (auto& [k, v] : plan_line.items()) line[k] = v;
      if (layout.ep() > 1) {
        line["ep_received_tokens"] = ep_received;
        line["ep_imbalance"] = ep_imbalance;
      }
      if (do_eval) {
        last_val = evaluate();
        res.final_val_loss = last_val;
        res.final_val_step = step + 1;
        history.push_back({{"step", step + 1}, {"val_loss", last_val}});
        line["val_loss"] = last_val;
      }
      if (rank0) {
        append_line(metrics, run_dir / "metrics.jsonl", line.dump());
      }
      res.tokens_per_second = double(res.tokens) / std::max(train_seconds, 1e-9);
      res.tokens_per_second_effective = double(res.tokens) / std::max(train_seconds + res.restart_seconds, 1e-9);
      const double all_bytes = provisioned[0] + provisioned[1] + offl;
      if (tracing && (step - start_step + 1 == t.trace_steps || step + 1 == t.steps)) {
        trace.close();
        trace_finished = true;
        world->barrier();
        if (world_size > 1 && rank0) {
          std::vector<fs::path> parts;
          for (int r = 0; r < world_size; ++r) parts.push_back(train::rank_trace_path(trace_path, r));
          train::merge_traces(parts, trace_path);
          for (auto& part : parts) fs::remove(part);
        }
      }
      if (planner && !all_decision_seconds.empty()) {
        std::vector<double> sorted = all_decision_seconds;
        std::sort(sorted.begin(), sorted.end());
        res.decisions = decisions_before + std::int64_t(sorted.size());
        res.decision_seconds_p99 = sorted[std::min(sorted.size() - 1, std::size_t(0.99 * double(sorted.size())))];
      }
      progress.update(step + 1, sum.ce, last_val, res.final_val_step, double(step_tokens) / dt, std::int64_t(peak),
                      arena.budget(), all_bytes > 0 ? provisioned[1] / all_bytes : 0.0,
                      all_bytes > 0 ? offl / all_bytes : 0.0, res.provisioned_steps);
      // A stop request must be seen by every rank at the same step.
      double stop_flag = g_stop_requested ? 1.0 : 0.0;
      if (world_size > 1) world->all_reduce_max(&stop_flag, 1);
      const bool stop_now =
          ((opts.stop_after >= 0 && step + 1 >= opts.stop_after) || stop_flag > 0) && step + 1 < t.steps;
      if ((t.checkpoint_every > 0 && (step + 1) % t.checkpoint_every == 0) ||
          (step + 1 == t.steps && t.checkpoint_every >= 0) || stop_now)
        save(step + 1);
      if (stop_now) {
        progress.note(fmt::format("stopped after step {} (checkpoint saved); continue with --resume {}", step + 1,
                                  run_dir.string()));
        break;
      }
    }
    finish_op_times();
  } catch (const OutOfMemoryError& oom) {
    // A step that ran out says which (a restart that gave up already names it).
    const OutOfMemoryError e =
        running_step >= 0 && !restart_limit_reached
            ? OutOfMemoryError(oom, fmt::format("step {} of {} ran out of device memory", running_step + 1, t.steps))
            : oom;
    if (!state_placed)  // not a step that ran out: the budget cannot hold the model state at all
      throw ConfigError(fmt::format(
          "--device-memory {} cannot hold this rank's model state (weights{}, gradients and AdamW moments): it ran "
          "out placing '{}' with {} already placed. The whole model's state is {} ({:.2f} M parameters at {} "
          "bytes each); expert and pipeline parallelism (--ep, --pp) shard it",
          format_bytes(arena.budget()), cfg.model.bf16 ? " with their bf16 working copy" : "", e.op,
          format_bytes(e.budget - e.free), format_bytes(state_bytes_per_param(cfg.model) * cfg.model.num_params()),
          double(cfg.model.num_params()) / 1e6, state_bytes_per_param(cfg.model)));
    if (restart_limit_reached) throw;  // counted, summarised and agreed on by every rank already
    res.oom_count += 1;
    if (res.first_oom.empty()) res.first_oom = e.what();
    res.peak_device_bytes = std::max(res.peak_device_bytes, arena.peak());
    if (world_size > 1) {  // the other ranks are in collectives: record, then end the job with the reason
      if (!rank0) summary_path_override = run_dir / fmt::format("summary.rank{:05d}.json", rank);
      write_summary(seconds_since(t_start), true);
      if (!rank0 && !fs::exists(summary_path)) {  // rank 0 is stuck in a collective: the run's summary names this OOM
        summary_path_override.clear();
        write_summary(seconds_since(t_start), true);
      }
      comm::abort_job(e.what(), 3);
    }
    write_summary(seconds_since(t_start));
    if (running_step >= 0 && !restart_limit_reached) throw e;
    throw;
  } catch (const Error& e) {
    if (!opts.resume && res.steps_run == 0) {  // refused before its first step: no trace files are left behind
      std::error_code ec;
      fs::remove(world_size > 1 ? train::rank_trace_path(run_dir / "trace.json", rank) : run_dir / "trace.json", ec);
    }
    if (world_size > 1) comm::abort_job(e.what(), 2);
    throw;
  }
  if (world_size > 1) {
    std::vector<std::int64_t> peaks(static_cast<std::size_t>(world_size));
    std::int64_t mine = std::max(my_run_peak, arena.peak());
    world->all_gather_bytes(&mine, peaks.data(), sizeof(mine));
    for (auto p : peaks) rank_peaks.push_back(p);
  } else {
    rank_peaks.push_back(std::max(my_run_peak, arena.peak()));
  }
  write_summary(seconds_since(t_start));
  return res;
}

}  // namespace moeflex
