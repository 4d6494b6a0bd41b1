#include "moeflex/train/generate.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#if __has_include(<malloc.h>)
#include <malloc.h>
#endif

#include <algorithm>
#include <map>
#include <cmath>
#include <numeric>

#include "moeflex/core/error.h"
#include "moeflex/core/rng.h"
#include "moeflex/model/model.h"
#include "moeflex/comm/layout.h"
#include "moeflex/train/checkpoint.h"
#include "moeflex/train/safetensors.h"
#include "moeflex/train/tokenizer.h"
#include "moeflex/train/train_config.h"

namespace moeflex {

namespace fs = std::filesystem;

namespace {

// A multi-rank run keeps one checkpoint per rank (rankNNNNN/checkpoints/...): pipeline
// stages hold different layers and EP ranks different expert slices. This gathers
// every parameter of the whole model from the ranks of data-parallel replica 0.
void load_sharded_weights(const fs::path& run, int world, const RunConfig& cfg, MoEModel& model) {
  comm::LayoutSpec spec;
  spec.world_size = world;
  spec.pp = cfg.parallel.pp;
  spec.dp = cfg.parallel.dp > 0 ? cfg.parallel.dp : world / cfg.parallel.pp;
  spec.ep = cfg.parallel.ep;
  spec.vpp = cfg.parallel.schedule == "dualpipev" && cfg.parallel.vpp == 1 ? 2 : cfg.parallel.vpp;
  spec.num_layers = int(cfg.model.num_hidden_layers);
  spec.num_experts = int(cfg.model.num_experts);
  spec.pad_layers = cfg.parallel.pad_layers;
  spec.stage_layers = cfg.parallel.stage_layers;
  const comm::ParallelLayout layout(spec);
  const std::int64_t El = cfg.model.num_experts / layout.ep();
  // The ranks read: those of replica 0 (replicas hold the same numbers). They may be
  // a checkpoint apart (a crash while saving): all are read at the newest step every
  // one of them holds, as --resume does, never a mix of steps.
  std::vector<int> readers;
  for (int r = 0; r < world; ++r)
    if (layout.coords(r).expert_dp_rank == 0) readers.push_back(r);
  auto rank_dir = [&](int r) { return run / train::rank_folder_name(r); };
  std::int64_t step = -1;
  for (int r : readers) {
    auto ckpt = train::latest_checkpoint(rank_dir(r));
    if (!ckpt) throw DataError(fmt::format("run '{}': rank {} has no complete checkpoint", run.string(), r));
    const std::int64_t s = train::checkpoint_step(*ckpt);
    step = step < 0 ? s : std::min(step, s);
  }
  std::map<std::string, int> filled;
  for (int r : readers) {
    const comm::RankCoords c = layout.coords(r);
    const fs::path ckpt = train::checkpoint_dir(rank_dir(r), step);
    if (!train::checkpoint_complete(ckpt, step))  // the check --resume makes
      throw DataError(
          fmt::format("run '{}': rank {} holds no complete checkpoint of step {} ('{}' is missing or incomplete), "
                      "the newest step every rank holds: its checkpoints have no step in common",
                      run.string(), r, step, ckpt.string()));
    const train::SafetensorsFile file = train::open_checkpoint_model(ckpt);  // size and SHA-256 checked
    for (auto& p : model.params()) {
      if (!file.contains(p.name)) continue;
      const bool expert = p.name.find(".mlp.experts.") != std::string::npos;
      // A shard's tensor: the whole parameter, or an expert parameter's El experts.
      std::vector<std::int64_t> want = p.w.shape();
      if (expert) want[0] = El;
      const std::vector<std::int64_t>& got = file.info(p.name).shape;
      if (got != want)
        throw DataError(
            fmt::format("run '{}': '{}' in rank {}'s checkpoint has shape [{}], the run's config expects "
                        "[{}]: the checkpoint belongs to another configuration",
                        run.string(), p.name, r, fmt::join(got, ", "), fmt::join(want, ", ")));
      if (!expert) {
        if (c.ep_rank == 0) file.read_f32(p.name, p.w.f32(), p.w.numel());
      } else {
        const std::int64_t slice = p.w.numel() / cfg.model.num_experts * El;
        file.read_f32(p.name, p.w.f32() + c.ep_rank * slice, slice);
      }
      ++filled[p.name];
    }
  }
  for (auto& p : model.params())
    if (!filled.count(p.name))
      throw DataError(fmt::format("run '{}': no rank's checkpoint holds '{}'", run.string(), p.name));
}

}  // namespace

void load_run_weights(const fs::path& run, const RunConfig& cfg, MoEModel& model) {
  if (const int world = train::run_rank_count(run); world > 0) {
    load_sharded_weights(run, world, cfg, model);
  } else {
    auto ckpt = train::latest_checkpoint(run);
    if (!ckpt) throw DataError(fmt::format("run '{}' has no complete checkpoint", run.string()));
    std::vector<train::NamedBuffer> bufs;
    for (auto& p : model.params()) bufs.push_back({p.name, p.w.shape(), p.w.f32()});
    train::load_model_weights(*ckpt, bufs);
  }
  model.sync_working_weights();  // a bf16 run's working copies, from the fp32 master weights
}

namespace {

/// The run's config, after the sampling options are checked.
RunConfig checked_run(const GenerateOptions& opts) {
  const fs::path& run = opts.run_dir;
  if (!fs::is_directory(run)) throw ConfigError(fmt::format("--run: '{}' is not a run directory", run.string()));
  if (!(opts.temperature >= 0) || !std::isfinite(opts.temperature))
    throw ConfigError(fmt::format("--temperature must be a finite number >= 0 (0 = greedy), got {}", opts.temperature));
  if (opts.top_k < 0) throw ConfigError(fmt::format("--top-k must be >= 0 (0 = the whole vocabulary), got {}", opts.top_k));
  if (opts.max_new_tokens < 0) throw ConfigError("--max-new-tokens must be >= 0");
  return RunConfig::from_file((run / "config.toml").string());
}

/// The run's newest weights continuing `ids` by opts.max_new_tokens sampled tokens (returned).
std::vector<std::int32_t> sample(const GenerateOptions& opts, const RunConfig& cfg, std::vector<std::int32_t> ids) {
  Arena arena;
  MoEModel model(cfg.model, arena);
  load_run_weights(opts.run_dir, cfg, model);
  if (ids.empty()) ids.push_back(0);
  const std::int64_t V = cfg.model.vocab_size, ctx = cfg.model.max_position_embeddings;
  std::vector<float> logits(static_cast<std::size_t>(V));
  Rng rng(opts.seed, 77);
  std::vector<std::int32_t> generated;
  for (int i = 0; i < opts.max_new_tokens; ++i) {
    const std::size_t start = ids.size() > std::size_t(ctx) ? ids.size() - std::size_t(ctx) : 0;
    std::vector<std::int32_t> window(ids.begin() + std::ptrdiff_t(start), ids.end());
    model.forward_eval(window.data(), nullptr, 1, std::int64_t(window.size()), logits.data());
#ifdef __GLIBC__
    // Each call's tensors change size (the window grows to the context; the routing
    // moves the expert rows), and glibc's heap kept what they freed: 1.3 GB of
    // resident memory after 512 tokens of the default model, 2.9 GB after 1024.
    // Returning the free pages every 32 tokens holds it near 250 MB (+4% time;
    // every call: 140 MB, +50%).
    if ((i + 1) % 32 == 0) malloc_trim(0);
#endif
    std::int32_t next = 0;
    if (opts.temperature <= 0) {
      next = std::int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    } else {
      std::vector<std::int32_t> order(static_cast<std::size_t>(V));
      std::iota(order.begin(), order.end(), 0);
      const std::size_t keep = opts.top_k > 0 ? std::min<std::size_t>(std::size_t(opts.top_k), order.size()) : order.size();
      std::partial_sort(order.begin(), order.begin() + std::ptrdiff_t(keep), order.end(),
                        [&](int a, int b) { return logits[std::size_t(a)] > logits[std::size_t(b)]; });
      std::vector<double> p(keep);
      const double mx = logits[std::size_t(order[0])];
      double z = 0;
      for (std::size_t j = 0; j < keep; ++j) z += p[j] = std::exp((logits[std::size_t(order[j])] - mx) / opts.temperature);
      double u = rng.uniform() * z;
      next = order[keep - 1];
      for (std::size_t j = 0; j < keep; ++j) {
        u -= p[j];
        if (u <= 0) {
          next = order[j];
          break;
        }
      }
    }
    ids.push_back(next);
    generated.push_back(next);
  }
  return generated;
}

}  // namespace

std::string generate_text(const GenerateOptions& opts) {
  const fs::path& run = opts.run_dir;
  const RunConfig cfg = checked_run(opts);
  if (!fs::exists(run / "tokenizer.model"))
    throw DataError(fmt::format("run '{}' has no tokenizer.model{}: give the prompt as token ids (--prompt-ids)",
                                run.string(),
                                fs::exists(run / "tokens.json") ? " (it was trained on pre-tokenized data, which "
                                                                  "comes without one)" : ""));
  Tokenizer tok = Tokenizer::load((run / "tokenizer.model").string());
  if (tok.vocab_size() != cfg.model.vocab_size)
    throw DataError(fmt::format("run '{}': its tokenizer.model has {} pieces but the model's vocab_size is {}: the "
                                "tokenizer is not the one the model was trained with", run.string(), tok.vocab_size(),
                                cfg.model.vocab_size));
  const std::vector<std::int32_t> generated = sample(opts, cfg, tok.encode(opts.prompt));
  // Decode prompt and continuation together: a piece's word-boundary marker only
  // becomes a space after what precedes it. The prompt is kept as typed.
  const std::vector<std::int32_t> prompt_ids = tok.encode(opts.prompt);
  std::vector<std::int32_t> all = prompt_ids;
  all.insert(all.end(), generated.begin(), generated.end());
  const std::string whole = tok.decode(all), head = tok.decode(prompt_ids);
  return opts.prompt + (whole.rfind(head, 0) == 0 ? whole.substr(head.size()) : tok.decode(generated));
}

std::vector<std::int32_t> generate_ids(const GenerateOptions& opts, const std::vector<std::int32_t>& prompt_ids) {
  const RunConfig cfg = checked_run(opts);
  for (std::int32_t id : prompt_ids)
    if (id < 0 || id >= cfg.model.vocab_size)
      throw ConfigError(fmt::format("--prompt-ids: {} is not a token id of the model (vocab_size {})", id,
                                    cfg.model.vocab_size));
  std::vector<std::int32_t> all = prompt_ids;
  const std::vector<std::int32_t> generated = sample(opts, cfg, prompt_ids);
  all.insert(all.end(), generated.begin(), generated.end());
  return all;
}

}  // namespace moeflex
