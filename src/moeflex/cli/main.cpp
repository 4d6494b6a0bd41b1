// The `moeflex` command: train, generate, export-hf, calibrate (and the simulator's commands).
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cstdio>
#include <filesystem>
#include <iostream>
#include <optional>
#include <string_view>

#include "moeflex/comm/mpi_communicator.h"
#include "moeflex/core/arena.h"
#include "moeflex/core/error.h"
#include "moeflex/ops/blas.h"
#include "moeflex/cli/sim_commands.h"
#include "moeflex/cli/run_command.h"
#include "moeflex/profile/calibrate.h"
#include "moeflex/profile/calibrate_device.h"
#include "moeflex/train/calibrate_command.h"
#include "moeflex/train/generate.h"
#include "moeflex/train/hf_export.h"
#include "moeflex/train/trainer.h"

namespace fs = std::filesystem;
using namespace moeflex;

namespace {

std::string timestamp_dir() {
  std::time_t now = std::time(nullptr);
  char buf[64];
  std::strftime(buf, sizeof buf, "runs/%Y%m%d-%H%M%S", std::localtime(&now));
  return buf;
}

// Reports an error. Under MPI with other ranks, an error this rank alone may have
// seen ends the whole job (MPI_Abort) instead of leaving the others waiting.
int fail(const comm::MpiSession* mpi, const std::string& msg, int code) {
  if (comm::MpiSession::active() && mpi && mpi->world_size() > 1) comm::abort_job(msg, code);
  fmt::print(stderr, "\nmoeflex: {}\n", msg);
  return code;
}

/// "3 17, 42" -> {3, 17, 42}; ConfigError naming what is not a token id.
std::vector<std::int32_t> parse_token_ids(const std::string& text) {
  std::vector<std::int32_t> ids;
  std::string word;
  auto flush = [&] {
    if (word.empty()) return;
    std::size_t used = 0;
    long long v = -1;
    try {
      v = std::stoll(word, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != word.size() || v < 0 || v > std::numeric_limits<std::int32_t>::max())
      throw ConfigError(fmt::format("--prompt-ids: '{}' is not a token id (a non-negative integer)", word));
    ids.push_back(std::int32_t(v));
    word.clear();
  };
  for (char c : text) {
    if (c == ' ' || c == ',' || c == '\t') flush();
    else word += c;
  }
  flush();
  if (ids.empty()) throw ConfigError("--prompt-ids: no token ids given");
  return ids;
}

}  // namespace

int main(int argc, char** argv) {
  // OpenBLAS chose its kernels when it was loaded; a CPU model it does not know got its
  // SSE3 ones. The commands that compute on the CPU restart once with the kernels this
  // CPU runs (before MPI or any thread); simulate, search, --help and calibrate
  // --from-run (which times nothing) need no BLAS.
  if (argc > 1) {
    const std::string_view cmd = argv[1];
    bool computes = cmd == "train" || cmd == "generate" || cmd == "calibrate";
    for (int i = 2; i < argc && computes; ++i) {
      const std::string_view a = argv[i];
      if (a == "-h" || a == "--help" || (cmd == "calibrate" && a.starts_with("--from-run"))) computes = false;
    }
    if (computes) ops::restart_with_fast_blas_kernels(argv);
  }
  // Under mpirun / srun, MPI is initialised here and finalised at exit; `moeflex run`
  // launches such jobs and must not be an MPI process itself (an MPI singleton's
  // environment makes the mpirun it starts fail).
  std::optional<comm::MpiSession> session;
  if (!(argc > 1 && std::string_view(argv[1]) == "run")) session.emplace(&argc, &argv);
  const comm::MpiSession* mpi = session ? &*session : nullptr;
  CLI::App app{"moeflex: mixture-of-experts training with runtime-adaptive activation memory"};
  app.require_subcommand(1);
  // A flag given twice takes its last value, as `make train ARGS="--device-memory 215MiB"`
  // after the Makefile's own --device-memory expects.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);

  // --- train
  auto* train = app.add_subcommand("train", "train an MoE language model");
  std::string config_path, out_dir, device_memory, data_path, resume_dir, data_cache = "data/tokenized";
  std::int64_t steps = -1, stop_after = -1;
  std::int64_t seed = -1;
  int threads = 0;
  bool quiet = false;
  train->add_option("--config", config_path,
                    "run config (TOML), or a Hugging Face config.json (run fields from moeflex.toml beside it); "
                    "default: the embedded config")->check(CLI::ExistingFile);
  train->add_option("--steps", steps, "optimizer steps (overrides train.steps)");
  train->add_option("--out", out_dir, "run directory (default: runs/<date-time>)");
  train->add_option("--seed", seed, "seed for init and data order (overrides train.seed)")->check(CLI::NonNegativeNumber);
  train->add_option("--device-memory", device_memory, "device-memory budget, e.g. 512MiB, 2GiB (default unlimited)");
  std::string device;
  train->add_option("--device", device, "where to compute: cpu (default) or cuda (one GPU; device.kind)");
  train->add_option("--data", data_path,
                    "a UTF-8 text file or folder, a Megatron indexed dataset (PREFIX, PREFIX.idx or .bin) or a flat "
                    "token file (.u16, .u32); default: the Brown corpus from `make data`");
  std::int64_t data_eos_id = -2;
  train->add_option("--data-eos-id", data_eos_id, "a flat token file's end-of-document id (data.eos_id; -1 none)");
  train->add_option("--resume", resume_dir, "continue the run in this directory from its newest checkpoint");
  std::string init_from;
  train->add_option("--init-from", init_from,
                    "start from a Hugging Face checkpoint's weights (qwen3_moe, olmoe, mixtral; safetensors, sharded "
                    "or not); the model comes from its config.json unless --config is given")
      ->check(CLI::ExistingDirectory);
  train->add_option("--data-cache", data_cache, "where tokenized corpora are cached")->capture_default_str();
  train->add_option("--threads", threads,
                    "OpenMP/BLAS threads per rank (default: OMP_NUM_THREADS, else every core for one process and "
                    "the node's cores shared among its ranks under MPI)")
      ->check(CLI::NonNegativeNumber);
  train->add_option("--stop-after", stop_after, "stop after this step with a checkpoint, as if interrupted")
      ->check(CLI::PositiveNumber);
  train->add_flag("--quiet", quiet, "no progress output");
  bool profile_ops = false;
  std::string hardware_profile;
  train->add_flag("--profile-ops", profile_ops,
                  "time every op of each step against the cost model: op events in trace.json, op_times.json");
  train->add_option("--hardware-profile", hardware_profile,
                    "the profile that prices ops for --profile-ops and the adaptive planner (default "
                    "data/hardware/this-machine.json)");
  std::string policy, inject, inject_slowdown;
  train->add_option("--inject-slowdown", inject_slowdown,
                    "make one rank slower in one phase, for tests and demonstrations: rank=R:phase=P:factor=F[:from=S] "
                    "(P: data, forward, backward, experts, optimizer, all_to_all, all_reduce, send_recv; "
                    "train.inject_slowdown)");
  std::int64_t slow_rank_every = -1, slow_rank_level = -1;
  train->add_option("--slow-rank-level", slow_rank_level,
                    "what slow-rank detection records: 0 the step's phases, 2 also every communication call with its "
                    "bytes and peer (RUN/comm_calls[.rankR].jsonl) (train.slow_rank_level)");
  train->add_option("--slow-rank-every", slow_rank_every,
                    "steps between the ranks' exchanges of their phase times for slow-rank detection, 0 = off "
                    "(train.slow_rank_every)")
      ->check(CLI::NonNegativeNumber);
  train->add_option("--inject-imbalance", inject, "routing spikes: every=N:ratio=R, prob=P:ratio=R:seed=S or preset=NAME (balanced, hot-expert, hot-rank, zero-rank, rotating, bursts), with shape keys hot=G, rotate=N, per_layer=1, level=expert, zero=G, zipf=S, dirichlet=A, or replay=PATH (another run's loads.jsonl or run directory: its EP ranks' shares, step by step, on every step)");
  train->add_option("--policy", policy,
                    "activation provisioning: adaptive (the default with --device-memory), none (the default without), full, "
                    "selective, moe-light, moe-medium, moe-full, threshold[=R] (train.policy)");
  std::string on_oom;
  std::int64_t max_restarts = -1, checkpoint_every = -1;
  double restart_seconds = -1;
  train->add_option("--on-oom", on_oom, "a step out of device memory: fail (exit 3) or restart from the newest "
                                        "checkpoint (train.on_oom)")
      ->check(CLI::IsMember({"fail", "restart"}));
  train->add_option("--max-restarts", max_restarts, "on-oom=restart: restarts allowed at one step (train.max_restarts)")
      ->check(CLI::NonNegativeNumber);
  train
      ->add_option("--restart-seconds", restart_seconds,
                   "on-oom=restart: seconds charged per restart in tokens/s (train.restart_seconds)")
      ->check(finite_non_negative());
  train->add_option("--checkpoint-every", checkpoint_every, "steps between checkpoints, 0 = end only "
                                                            "(train.checkpoint_every)")
      ->check(CLI::NonNegativeNumber);
  int pp = 0, dp = -1, ep = 0, vpp = 0;
  std::string schedule;
  std::int64_t grad_accum = 0;
  train->add_option("--grad-accum", grad_accum, "micro-batches per optimizer step (train.grad_accum)")
      ->check(CLI::Range(std::int64_t(1), kMaxGradAccum));
  train->add_option("--pp", pp, "pipeline-parallel size (parallel.pp)");
  train->add_option("--dp", dp, "data-parallel size (parallel.dp; default world size / pp)");
  train->add_option("--ep", ep, "expert-parallel size, within dp (parallel.ep)");
  train->add_option("--vpp", vpp, "virtual pipeline stages per rank (parallel.vpp)");
  bool pad_layers = false;
  train->add_flag("--pad-layers", pad_layers, "pad with empty layers so pp x vpp divides the layer count");
  train->add_option("--schedule", schedule,
                    "pipeline schedule: gpipe, 1f1b, interleaved, 1f1b-overlap, zb-h1, dualpipev");
  std::int64_t expert_chunk_rows = -1;
  train->add_option("--expert-chunk-rows", expert_chunk_rows,
                    "received rows the routed experts process at a time, 0 = off (model.expert_chunk_rows)")
      ->check(CLI::NonNegativeNumber);
  bool bf16 = false;
  train->add_flag("--bf16", bf16,
                  "mixed precision: bf16 activations and working weights, fp32 master weights, gradients and "
                  "optimizer state (model.bf16; on the CPU an emulation for tests, slower than fp32)");

  // --- generate
  auto* gen = app.add_subcommand("generate", "sample text from a trained run");
  GenerateOptions gopts;
  std::int64_t gseed = 0;
  gen->add_option("--run", gopts.run_dir, "run directory")->required();
  std::string prompt_ids;
  auto* gen_prompt = gen->add_option("--prompt", gopts.prompt, "text to continue");
  auto* gen_ids = gen->add_option("--prompt-ids", prompt_ids,
                                  "token ids to continue, separated by spaces or commas, for a run without a tokenizer "
                                  "(pre-tokenized data, --init-from); prints token ids");
  gen_prompt->excludes(gen_ids);
  gen->add_option("--max-new-tokens", gopts.max_new_tokens, "tokens to sample")->capture_default_str();
  gen->add_option("--temperature", gopts.temperature, "sampling temperature (0 = greedy)")->capture_default_str();
  gen->add_option("--top-k", gopts.top_k, "sample among the k most likely tokens (0 = all)")->capture_default_str();
  gen->add_option("--seed", gseed, "sampling seed")->capture_default_str();

  // --- export-hf
  auto* exp = app.add_subcommand("export-hf", "write a trained run as a Hugging Face checkpoint (config.json, "
                                              "model.safetensors)");
  fs::path exp_run, exp_out;
  exp->add_option("--run", exp_run, "run directory")->required();
  exp->add_option("--out", exp_out, "new folder for the checkpoint (must not exist or be empty)")->required();

  // --- import-hf
  auto* imp = app.add_subcommand("import-hf", "make a run (step 0) of a Hugging Face checkpoint, for train --resume "
                                              "and generate");
  std::string imp_dir, imp_out, imp_config, imp_data;
  std::int64_t imp_eos = -2;
  imp->add_option("HF_DIR", imp_dir, "the checkpoint folder (config.json, safetensors)")
      ->required()
      ->check(CLI::ExistingDirectory);
  imp->add_option("--out", imp_out, "the new run directory")->required();
  imp->add_option("--config", imp_config, "run config (default: HF_DIR/config.json with HF_DIR/moeflex.toml)")
      ->check(CLI::ExistingFile);
  imp->add_option("--data", imp_data, "the run's pre-tokenized data (PREFIX of a Megatron dataset, or .u16/.u32)")
      ->required();
  imp->add_option("--data-eos-id", imp_eos, "a flat token file's end-of-document id (data.eos_id)");

  // --- calibrate
  auto* cal = app.add_subcommand("calibrate", "measure this machine's kernels and write a hardware profile");
  std::string cal_out = "data/hardware/this-machine.json";
  int cal_threads = 0;
  double cal_seconds = kDefaultCalibrationBudget;
  cal->add_option("--out", cal_out, "profile JSON to write")->capture_default_str();
  cal->add_option("--threads", cal_threads, "threads (default: all cores)");
  cal->add_option("--seconds", cal_seconds, "time budget")->capture_default_str();
  std::string cal_from_run, cal_base = kDefaultHardwareProfilePath;
  cal->add_option("--from-run", cal_from_run,
                  "no timing: add the ops of a run trained with --profile-ops (RUN/op_times.json) to --base, "
                  "written to --out (default: the base's name with -in-situ)");
  cal->add_option("--base", cal_base, "with --from-run: the profile to start from")->capture_default_str();
  std::string cal_device = "cpu", cal_config;
  cal->add_option("--device", cal_device,
                  "cpu (this machine's kernels) or cuda (the GPU's, through the CUDA backend, at the shapes of "
                  "--config's model; default --out data/hardware/cuda.json, --seconds 30; not yet run on a GPU)")
      ->capture_default_str();
  cal->add_option("--config", cal_config,
                  "with --device cuda: the run config (.toml) whose model and micro-batch are measured (default: the "
                  "built-in default)");

  // --- simulate, search (cli/sim_commands.cpp)
  add_sim_commands(app);

  // --- run (cli/run_command.cpp): supervised restart of a train command
  CLI::App* run_cmd = add_run_command(app);

  // A first word that names no command: CLI11 would only say that one is required.
  if (argc > 1 && argv[1][0] != '-') {
    const std::string_view cmd = argv[1];
    std::string names;
    bool known = false;
    for (const CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) {
      known = known || sub->get_name() == cmd;
      names += (names.empty() ? "" : ", ") + sub->get_name();
    }
    if (!known) {
      fmt::print(stderr, "moeflex: unknown command '{}' (commands: {}; see moeflex --help)\n", cmd, names);
      return 2;
    }
  }
  // A bad command line exits 2, as bad input does everywhere (CLI11's own codes are 100+).
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  try {
    if (*run_cmd) return run_run_command();
    if (*train) {
      TrainOptions o;
      if (!init_from.empty() && !resume_dir.empty())
        throw ConfigError("--init-from starts a new run from a checkpoint's weights; --resume continues a run "
                          "from its own: give one of them");
      if (config_path.empty() && !init_from.empty()) config_path = (fs::path(init_from) / "config.json").string();
      o.config = config_path.empty() ? RunConfig::defaults() : RunConfig::from_file(config_path);
      if (!init_from.empty()) o.init_from = fs::path(init_from);
      if (train->count("--steps") && steps < 1)
        throw ConfigError(fmt::format("--steps must be at least 1 (got {})", steps));
      if (steps >= 1) o.config.train.steps = steps;
      if (seed >= 0) o.config.train.seed = std::uint64_t(seed);
      if (!device_memory.empty()) o.config.device_memory = parse_size(device_memory);
      if (!device.empty()) o.config.device = device;
      if (!data_path.empty()) o.config.data.path = data_path;
      if (train->count("--data-eos-id")) o.config.data.eos_id = data_eos_id;
      if (!policy.empty()) o.config.train.policy = policy;
      if (!inject.empty()) o.config.train.inject_imbalance = inject;
      if (!inject_slowdown.empty()) o.config.train.inject_slowdown = inject_slowdown;
      if (slow_rank_every >= 0) o.config.train.slow_rank_every = slow_rank_every;
      if (train->count("--slow-rank-level")) o.config.train.slow_rank_level = slow_rank_level;
      if (!on_oom.empty()) o.config.train.on_oom = on_oom;
      if (max_restarts >= 0) o.config.train.max_restarts = max_restarts;
      if (restart_seconds >= 0) o.config.train.restart_seconds = restart_seconds;
      if (checkpoint_every >= 0) o.config.train.checkpoint_every = checkpoint_every;
      // Given values are applied as given, so that RunConfig::validate refuses a bad one.
      if (train->count("--pp")) o.config.parallel.pp = pp;
      if (train->count("--dp")) o.config.parallel.dp = dp;
      if (train->count("--ep")) o.config.parallel.ep = ep;
      if (train->count("--vpp")) o.config.parallel.vpp = vpp;
      if (grad_accum > 0) o.config.train.grad_accum = grad_accum;
      if (!schedule.empty()) o.config.parallel.schedule = schedule;
      if (pad_layers) o.config.parallel.pad_layers = true;
      if (expert_chunk_rows >= 0) o.config.model.expert_chunk_rows = expert_chunk_rows;
      if (train->count("--bf16")) o.config.model.bf16 = bf16;  // (--bf16=false turns a config's bf16 off)
      o.out_dir = out_dir.empty() ? fs::path(timestamp_dir()) : fs::path(out_dir);
      if (!resume_dir.empty()) {
        const bool others = !config_path.empty() || !device_memory.empty() || !data_path.empty() || !policy.empty() ||
                            train->count("--data-eos-id") ||
                            !inject.empty() || !inject_slowdown.empty() || slow_rank_every >= 0 || slow_rank_level >= 0 || pp > 0 || dp >= 0 || ep > 0 || vpp > 0 || !schedule.empty() ||
                            seed >= 0 || !on_oom.empty() || max_restarts >= 0 || restart_seconds >= 0 ||
                            checkpoint_every >= 0 || !device.empty() || expert_chunk_rows >= 0 || !out_dir.empty() ||
                            grad_accum > 0 || train->count("--bf16");
        if (others && (!comm::MpiSession::active() || mpi->world_rank() == 0))
          fmt::print(stderr,
                     "moeflex: --resume continues the run in its own folder with its own config.toml: the "
                     "config's flags (--config, --policy, --device-memory, ...) and --out are ignored; "
                     "--steps, --stop-after, --threads, --quiet, --data-cache, --profile-ops and "
                     "--hardware-profile apply\n");
        o.resume = fs::path(resume_dir);
        if (steps < 1) o.config.train.steps = -1;  // keep the run's own step count
      }
      o.data_cache = data_cache;
      o.threads = threads;
      o.stop_after = stop_after;
      o.progress = !quiet;
      o.profile_ops = profile_ops;
      o.hardware_profile = hardware_profile;
      TrainResult r = run_training(o);
      const fs::path run = o.resume ? *o.resume : o.out_dir;
      // The validation loss as evaluated: a run stopped between evaluations says when its last one was.
      const std::string val =
          r.final_val_step == 0 ? fmt::format("val loss {:.4f} (not evaluated since step 0)", r.initial_val_loss)
          : r.final_val_step == r.steps
              ? fmt::format("val loss {:.4f} -> {:.4f}", r.initial_val_loss, r.final_val_loss)
              : fmt::format("val loss {:.4f} -> {:.4f} (at step {})", r.initial_val_loss, r.final_val_loss,
                            r.final_val_step);
      // What the adaptive planner did (the progress bar shows it per step; here the run's total).
      const std::string planner =
          r.decisions > 0
              ? fmt::format("; adaptive planner: {} decisions (p99 {:.3f} ms), {} recomputed, {} offloaded, {} OOMs",
                            r.decisions, 1e3 * r.decision_seconds_p99, format_bytes(r.bytes_recomputed),
                            format_bytes(r.bytes_offloaded), r.oom_count)
          : r.oom_count > 0 ? fmt::format("; {} OOMs, {} restarts", r.oom_count, r.restarts)
                            : std::string();
      if (!comm::MpiSession::active() || mpi->world_rank() == 0)
        fmt::print("run {}: {} steps, {} tokens, {}, {:.0f} tokens/s, peak device memory {}{}\n", run.string(), r.steps,
                   r.tokens, val, r.tokens_per_second, format_bytes(r.peak_device_bytes), planner);
    } else if (run_sim_commands()) {
      return 0;
    } else if (*cal && cal_device != "cpu") {
      (void)parse_device_kind(cal_device);  // names an unknown device
      for (const char* flag : {"--from-run", "--base", "--threads"})
        if (cal->count(flag) > 0)
          throw ConfigError(
              fmt::format("calibrate {} is for --device cpu (--device {} measures the GPU through its "
                          "backend; add a run's ops with calibrate --from-run RUN --base PROFILE)",
                          flag, cal_device));
      return run_device_calibrate_command(cal_device, cal_config,
                                          cal->count("--out") > 0 ? cal_out : "data/hardware/" + cal_device + ".json",
                                          cal->count("--seconds") > 0 ? cal_seconds : kDefaultDeviceCalibrationBudget);
    } else if (*cal && cal->count("--config") > 0) {
      throw ConfigError(
          "calibrate --config is for --device cuda (the CPU calibration measures the default model's "
          "shapes and larger ones)");
    } else if (*cal && cal->count("--from-run") > 0 && cal_from_run.empty()) {
      throw ConfigError("calibrate --from-run '': give the folder of a run trained with --profile-ops (without "
                        "--from-run, calibrate times this machine)");
    } else if (*cal && cal->count("--base") > 0 && cal_from_run.empty()) {
      throw ConfigError(fmt::format("calibrate --base '{}' is used only with --from-run RUN (a full calibration "
                                    "starts from no profile)", cal_base));
    } else if (*cal && !cal_from_run.empty()) {
      for (const char* flag : {"--seconds", "--threads"})
        if (cal->count(flag) > 0)
          throw ConfigError(fmt::format("calibrate --from-run times nothing: {} does not apply to it", flag));
      std::string out = cal_out;
      if (cal->count("--out") == 0) {  // keep the base: name the result after it
        fs::path b(cal_base);
        out = (b.parent_path() / (b.stem().string() + "-in-situ" + b.extension().string())).string();
      }
      return run_in_situ_calibrate_command(cal_from_run, cal_base, out);
    } else if (*cal) {
      return run_calibrate_command(cal_out, cal_threads, cal_seconds,
                                   !comm::MpiSession::active() || mpi->world_rank() == 0);
    } else if (*gen) {
      gopts.seed = std::uint64_t(gseed);
      if (gen->count("--prompt-ids")) {
        std::string line;
        for (std::int32_t id : generate_ids(gopts, parse_token_ids(prompt_ids)))
          line += (line.empty() ? "" : " ") + std::to_string(id);
        fmt::print("{}\n", line);
      } else if (gen->count("--prompt")) {
        fmt::print("{}\n", generate_text(gopts));
      } else {
        throw ConfigError("generate: give --prompt TEXT, or --prompt-ids IDS for a run without a tokenizer");
      }
    } else if (*imp) {
      TrainOptions o;
      o.config = RunConfig::from_file(imp_config.empty() ? (fs::path(imp_dir) / "config.json").string() : imp_config);
      o.config.data.path = imp_data;
      if (imp->count("--data-eos-id")) o.config.data.eos_id = imp_eos;
      o.out_dir = imp_out;
      o.init_from = fs::path(imp_dir);
      o.stop_after = 0;
      const TrainResult r = run_training(o);
      fmt::print("import-hf: '{}' is the run '{}' at step 0 (val loss {:.4f}): continue with moeflex train --resume "
                 "{} --steps N, sample with moeflex generate --run {} --prompt-ids IDS\n",
                 imp_dir, imp_out, r.initial_val_loss, imp_out, imp_out);
    } else if (*exp) {
      const std::string arch = export_hf(exp_run, exp_out);
      fmt::print("export-hf: '{}' written as a Hugging Face {} checkpoint in '{}'\n", exp_run.string(), arch,
                 exp_out.string());
    }
  } catch (const OutOfMemoryError& e) {
    return fail(mpi, e.what(), 3);
  } catch (const comm::CommError& e) {  // a peer or the network failed: a relaunch may succeed
    return fail(mpi, fmt::format("error: {}", e.what()), 4);
  } catch (const Error& e) {
    return fail(mpi, fmt::format("error: {}", e.what()), 2);
  } catch (const std::filesystem::filesystem_error& e) {  // a path that cannot be created, read or written
    return fail(mpi, fmt::format("error: {}", e.what()), 2);
  } catch (const std::exception& e) {
    return fail(mpi, fmt::format("unexpected error: {}", e.what()), 1);
  }
  return 0;
}
