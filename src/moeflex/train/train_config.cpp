#include "moeflex/train/train_config.h"

#include <array>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <nlohmann/json.hpp>
#include <toml++/toml.h>

#include "moeflex/core/error.h"
#include "moeflex/ops/imbalance.h"
#include "moeflex/provision/policies.h"
#include "moeflex/schedule/generators.h"
#include "moeflex/train/slow_rank.h"
#include "moeflex/train/default_config.h"

namespace moeflex {

namespace {

template <typename F>
void for_each_train_field(TrainConfig& c, F&& f) {
  f("steps", c.steps);
  f("micro_batch_size", c.micro_batch_size);
  f("seq_len", c.seq_len);
  f("grad_accum", c.grad_accum);
  f("lr", c.lr);
  f("min_lr", c.min_lr);
  f("warmup_steps", c.warmup_steps);
  f("weight_decay", c.weight_decay);
  f("beta1", c.beta1);
  f("beta2", c.beta2);
  f("grad_clip", c.grad_clip);
  f("seed", c.seed);
  f("eval_every", c.eval_every);
  f("eval_batches", c.eval_batches);
  f("checkpoint_every", c.checkpoint_every);
  f("keep_checkpoints", c.keep_checkpoints);
  f("trace_steps", c.trace_steps);
  f("max_restarts", c.max_restarts);
  f("restart_seconds", c.restart_seconds);
  f("slow_rank_every", c.slow_rank_every);
  f("slow_rank_threshold", c.slow_rank_threshold);
  f("slow_rank_level", c.slow_rank_level);
}

/// A string field of [train]: its key, where it lives, an example for errors.
struct TrainString {
  const char* key;
  std::string* field;
  const char* example;
};

/// The string fields of [train], read and written alike.
std::array<TrainString, 6> train_strings(TrainConfig& c) {
  return {{{"policy", &c.policy, "such as \"full\""},
           {"inject_imbalance", &c.inject_imbalance, "such as \"every=10:ratio=2.6\""},
           {"on_oom", &c.on_oom, "\"fail\" or \"restart\""},
           {"checkpoint_mode", &c.checkpoint_mode, "\"async\" or \"sync\""},
           {"checkpoint_when_busy", &c.checkpoint_when_busy, "\"wait\" or \"skip\""},
           {"inject_slowdown", &c.inject_slowdown, "such as \"rank=1:phase=forward:factor=1.3\""}}};
}

// Reads one scalar field of `section` into `field`, with a typed error naming it.
template <typename T>
void read_field(const toml::table& t, const char* section, const char* key, T& field) {
  const toml::node* n = t.get(key);
  if (!n) return;
  if constexpr (std::is_integral_v<T>) {
    if (!n->is_integer()) throw ConfigError(fmt::format("{}.{}: must be an integer", section, key));
    auto v = n->value<std::int64_t>();
    if constexpr (std::is_unsigned_v<T>) {
      if (*v < 0) throw ConfigError(fmt::format("{}.{}: must not be negative", section, key));
    } else {
      if (*v < std::numeric_limits<T>::min() || *v > std::numeric_limits<T>::max())
        throw ConfigError(fmt::format("{}.{}: {} is out of range", section, key, *v));
    }
    field = static_cast<T>(*v);
  } else {
    auto v = n->value<double>();
    if (!v) throw ConfigError(fmt::format("{}.{}: must be a number", section, key));
    field = *v;
  }
}

void reject_unknown(const toml::table& t, const char* section, const std::set<std::string>& known) {
  for (auto&& [k, v] : t)
    if (!known.count(std::string(k.str())))
      throw ConfigError(fmt::format("{}: unknown field '{}'", section, k.str()));
}

}  // namespace

void RunConfig::validate() const {
  model.validate();
  const auto& t = train;
  auto rule = [](bool ok, const std::string& msg) {
    if (!ok) throw ConfigError(msg);
  };
  rule(t.steps >= 1, fmt::format("train.steps: must be at least 1 (got {})", t.steps));
  for (auto [name, v] : {std::pair<const char*, double>{"lr", t.lr}, {"min_lr", t.min_lr}, {"weight_decay", t.weight_decay},
                         {"beta1", t.beta1}, {"beta2", t.beta2}, {"grad_clip", t.grad_clip}})
    rule(std::isfinite(v), fmt::format("train.{}: must be a finite number (got {})", name, v));
  rule(t.micro_batch_size >= 1 && t.micro_batch_size <= (1 << 20),
       fmt::format("train.micro_batch_size: must be in [1, 1048576] (got {})", t.micro_batch_size));
  rule(t.seq_len >= 2 && t.seq_len <= model.max_position_embeddings,
       fmt::format("train.seq_len: must be in [2, model.max_position_embeddings={}] (got {})",
                   model.max_position_embeddings, t.seq_len));
  rule(t.grad_accum >= 1 && t.grad_accum <= kMaxGradAccum,
       fmt::format("train.grad_accum: must be in [1, {}] (got {})", kMaxGradAccum, t.grad_accum));
  rule(t.lr > 0, "train.lr: must be positive");
  rule(t.min_lr >= 0 && t.min_lr <= t.lr, "train.min_lr: must be in [0, train.lr]");
  rule(t.warmup_steps >= 0, "train.warmup_steps: must not be negative");
  rule(t.weight_decay >= 0, "train.weight_decay: must not be negative");
  rule(t.beta1 >= 0 && t.beta1 < 1, "train.beta1: must be in [0, 1)");
  rule(t.beta2 >= 0 && t.beta2 < 1, "train.beta2: must be in [0, 1)");
  rule(t.grad_clip >= 0, "train.grad_clip: must not be negative");
  rule(t.eval_every >= 0, "train.eval_every: must not be negative");
  rule(t.eval_batches >= 1, "train.eval_batches: must be at least 1");
  rule(t.checkpoint_every >= -1, "train.checkpoint_every: must be >= 0, or -1 for no checkpoint at all");
  rule(t.keep_checkpoints >= 1, "train.keep_checkpoints: must be at least 1");
  rule(t.checkpoint_mode == "async" || t.checkpoint_mode == "sync",
       fmt::format("train.checkpoint_mode: must be \"async\" (flash checkpoints) or \"sync\" (got \"{}\")",
                   t.checkpoint_mode));
  rule(t.checkpoint_when_busy == "wait" || t.checkpoint_when_busy == "skip",
       fmt::format("train.checkpoint_when_busy: must be \"wait\" or \"skip\" (got \"{}\")", t.checkpoint_when_busy));
  if (t.policy != "adaptive" && t.policy != "auto") static_policy_recomputes(t.policy, "");  // throws ConfigError naming the policies
  ops::parse_imbalance(t.inject_imbalance);  // throws ConfigError naming the bad part
  rule(t.slow_rank_every >= 0, fmt::format("train.slow_rank_every: must not be negative (got {})", t.slow_rank_every));
  rule(std::isfinite(t.slow_rank_threshold) && t.slow_rank_threshold > 1,
       fmt::format("train.slow_rank_threshold: must be a finite number above 1 (got {})", t.slow_rank_threshold));
  rule(t.slow_rank_level == 0 || t.slow_rank_level == 2,
       t.slow_rank_level == 1
           ? std::string("train.slow_rank_level: level 1 (each op kind's times per rank) is what --profile-ops records "
                         "(op_times.json); use 0 or 2")
           : fmt::format("train.slow_rank_level: must be 0 (step phases) or 2 (also every communication call; got {})",
                         t.slow_rank_level));
  train::parse_slowdown(t.inject_slowdown);  // throws ConfigError naming the bad part
  rule(t.on_oom == "fail" || t.on_oom == "restart",
       fmt::format("train.on_oom: must be \"fail\" or \"restart\" (got \"{}\")", t.on_oom));
  rule(t.max_restarts >= 0, fmt::format("train.max_restarts: must not be negative (got {})", t.max_restarts));
  rule(std::isfinite(t.restart_seconds) && t.restart_seconds >= 0,
       fmt::format("train.restart_seconds: must be a finite number >= 0 (got {})", t.restart_seconds));
  rule(data.val_fraction > 0 && data.val_fraction < 0.5, "data.val_fraction: must be in (0, 0.5)");
  rule(data.eos_id >= -1 && data.eos_id < model.vocab_size, "data.eos_id: must be -1 (none) or a token id below vocab_size");
  rule(device_memory == -1 || device_memory > 0, "device.memory: must be positive or \"unlimited\"");
  rule(device == "cpu" || device == "cuda", fmt::format("device.kind: must be \"cpu\" or \"cuda\" (got \"{}\")", device));
  rule(parallel.pp >= 1, "parallel.pp: must be at least 1");
  rule(parallel.dp >= 0, "parallel.dp: must not be negative (0 = world size / pp)");
  rule(parallel.ep >= 1, "parallel.ep: must be at least 1");
  rule(parallel.vpp >= 1, "parallel.vpp: must be at least 1");
  // The schedules' own requirements on the micro-batches per step, named in the
  // config's terms (schedule/ names them num_microbatches).
  if (schedule_takes_vpp(parallel.schedule))  // interleaved, 1f1b-overlap
    rule(t.grad_accum % parallel.pp == 0,
         fmt::format("train.grad_accum (--grad-accum, micro-batches per step) = {}: the {} schedule needs a "
                     "multiple of parallel.pp = {}",
                     t.grad_accum, parallel.schedule, parallel.pp));
  if (parallel.schedule == "dualpipev")
    rule(t.grad_accum >= 2 * parallel.pp,
         fmt::format("train.grad_accum (--grad-accum, micro-batches per step) = {}: the dualpipev schedule needs at "
                     "least 2 x parallel.pp = {}", t.grad_accum, 2 * parallel.pp));
}

RunConfig RunConfig::defaults() { return from_toml_text("", "the embedded default config"); }

namespace {

toml::table parse_toml(const std::string& text, const std::string& origin) {
  try {
    return toml::parse(text, origin);
  } catch (const toml::parse_error& e) {
    // A model's JSON (a Hugging Face config.json, configs/models/) is not a run config.
    const bool json =
        text.find_first_not_of(" \t\r\n") != std::string::npos && text[text.find_first_not_of(" \t\r\n")] == '{';
    throw ConfigError(fmt::format("{}: TOML syntax error at line {}, column {}: {}{}", origin, e.source().begin.line,
                                  e.source().begin.column, e.description(),
                                  json ? " (this is JSON: a run config is TOML with [model] and [train] tables, "
                                         "like configs/default.toml; the simulator's --model takes model JSON)"
                                       : ""));
  }
}

}  // namespace

RunConfig RunConfig::from_toml_text(const std::string& text, const std::string& origin) {
  // The user's keys override the embedded defaults key by key.
  toml::table root = parse_toml(kDefaultConfigToml, "configs/default.toml");
  const toml::table user = parse_toml(text, origin);
  for (auto&& [k, v] : user) {
    auto* dst = root.get_as<toml::table>(k.str());
    if (dst && v.is_table()) {
      for (auto&& [kk, vv] : *v.as_table()) dst->insert_or_assign(kk.str(), vv);
    } else {
      root.insert_or_assign(k.str(), v);
    }
  }
  RunConfig c;
  try {
    for (auto&& [k, v] : root) {
      const std::string key(k.str());
      if (key != "model" && key != "train" && key != "data" && key != "device" && key != "parallel")
        throw ConfigError(
            fmt::format("unknown section or key '{}' (expected [model], [train], [data], [device], [parallel])", key));
      if (!v.is_table()) throw ConfigError(fmt::format("'{}' must be a table ([{}])", key, key));
    }
    if (auto* m = root["model"].as_table()) c.model = ModelConfig::from_toml(*m);
    if (auto* t = root["train"].as_table()) {
      std::set<std::string> known;
      for_each_train_field(c.train, [&](const char* key, auto& field) {
        known.insert(key);
        read_field(*t, "train", key, field);
      });
      for (const TrainString& f : train_strings(c.train)) {
        if (auto* node = t->get(f.key)) {
          auto v = node->value<std::string>();
          if (!v) throw ConfigError(std::string("train.") + f.key + ": must be a string, " + f.example);
          *f.field = *v;
        }
        known.insert(f.key);
      }
      reject_unknown(*t, "train", known);
    }
    if (auto* d = root["data"].as_table()) {
      if (auto* p = d->get("path")) {
        auto s = p->value<std::string>();
        if (!s) throw ConfigError("data.path: must be a string");
        c.data.path = *s;
      }
      read_field(*d, "data", "val_fraction", c.data.val_fraction);
      read_field(*d, "data", "eos_id", c.data.eos_id);
      reject_unknown(*d, "data", {"path", "val_fraction", "eos_id"});
    }
    if (auto* par = root["parallel"].as_table()) {
      read_field(*par, "parallel", "pp", c.parallel.pp);
      read_field(*par, "parallel", "dp", c.parallel.dp);
      read_field(*par, "parallel", "ep", c.parallel.ep);
      read_field(*par, "parallel", "vpp", c.parallel.vpp);
      if (auto* sc = par->get("schedule")) {
        auto v = sc->value<std::string>();
        if (!v) throw ConfigError("parallel.schedule: must be a string");
        c.parallel.schedule = *v;
      }
      if (auto* pl = par->get("pad_layers")) {
        auto v = pl->value_exact<bool>();
        if (!v) throw ConfigError("parallel.pad_layers: must be true or false");
        c.parallel.pad_layers = *v;
      }
      if (auto* sl = par->get("stage_layers")) {
        auto* arr = sl->as_array();
        if (!arr) throw ConfigError("parallel.stage_layers: must be an array of integers, e.g. [3, 5]");
        c.parallel.stage_layers.clear();
        for (auto&& e : *arr) {
          auto v = e.value<std::int64_t>();
          if (!v || !e.is_integer()) throw ConfigError("parallel.stage_layers: must be an array of integers");
          if (*v < 0 || *v > 4096)  // num_hidden_layers' bound: no stage holds more
            throw ConfigError(fmt::format("parallel.stage_layers: each entry must be in [0, 4096] (got {})", *v));
          c.parallel.stage_layers.push_back(int(*v));
        }
      }
      reject_unknown(*par, "parallel", {"pp", "dp", "ep", "vpp", "schedule", "pad_layers", "stage_layers"});
    }
    if (auto* dev = root["device"].as_table()) {
      if (auto* m = dev->get("memory")) {
        if (auto s = m->value<std::string>()) c.device_memory = parse_size(*s);
        else if (auto i = m->value<std::int64_t>(); i && m->is_integer()) c.device_memory = *i;
        else throw ConfigError("device.memory: must be a size such as \"512MiB\" or \"unlimited\"");
      }
      if (auto* k = dev->get("kind")) {
        if (auto s = k->value<std::string>()) c.device = *s;
        else throw ConfigError("device.kind: must be \"cpu\" or \"cuda\"");
      }
      reject_unknown(*dev, "device", {"memory", "kind"});
    }
  } catch (const ConfigError& e) {
    throw ConfigError(fmt::format("{}: {}", origin, e.what()));
  }
  return c;
}

namespace {

namespace fs = std::filesystem;

std::string read_config_text(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw ConfigError(fmt::format("cannot read config file '{}': no such file or not readable", path));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

/// A Hugging Face config.json: the model from it, the rest from kHfRunToml beside it
/// (or the defaults). That TOML's [model] may set only moeflex's own model keys.
RunConfig from_hf_config(const std::string& path) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_config_text(path));
  } catch (const nlohmann::json::parse_error& e) {
    throw ConfigError(fmt::format("{}: not valid JSON ({})", path, e.what()));
  }
  ModelConfig::refuse_engine_unsupported_hf(j, path);
  const fs::path beside = fs::path(path).parent_path() / kHfRunToml;
  RunConfig c = fs::exists(beside) ? RunConfig::from_file(beside.string()) : RunConfig::defaults();
  const ModelConfig own = c.model;
  c.model = ModelConfig::from_hf_json(j, path);
  c.model.expert_chunk_rows = own.expert_chunk_rows;  // moeflex's keys: the TOML's or the defaults'
  c.model.bf16 = own.bf16;
  c.model.capacity_factor = own.capacity_factor;
  if (fs::exists(beside)) {
    const toml::table t = toml::parse_file(beside.string());
    if (const toml::table* m = t["model"].as_table())
      for (auto&& [k, v] : *m) {
        if (k.str() == "initializer_range") {
          c.model.initializer_range = own.initializer_range;  // over the JSON's, since the TOML names it
        } else if (k.str() != "expert_chunk_rows" && k.str() != "bf16" && k.str() != "capacity_factor") {
          throw ConfigError(fmt::format("{}: model.{} is set by {}; beside a config.json the [model] table may set "
                                        "only expert_chunk_rows, bf16, capacity_factor and initializer_range",
                                        beside.string(), k.str(), path));
        }
      }
  }
  return c;
}

}  // namespace

RunConfig RunConfig::from_file(const std::string& path) {
  if (fs::path(path).extension() == ".json") return from_hf_config(path);
  return from_toml_text(read_config_text(path), path);
}

std::string RunConfig::to_toml() const {
  std::string s = std::string(kRunConfigHeader) + "\n\n[model]\n" + model.to_toml() + "\n[train]\n";
  auto t = train;
  for_each_train_field(t, [&](const char* key, auto& field) {
    using F = std::decay_t<decltype(field)>;
    if constexpr (std::is_integral_v<F>) s += fmt::format("{} = {}\n", key, field);
    else s += fmt::format("{} = {}\n", key, toml_float(field));
  });
  for (const TrainString& f : train_strings(t))
    if (!f.field->empty()) s += fmt::format("{} = {}\n", f.key, toml_string(*f.field));
  s += fmt::format("\n[data]\npath = {}\nval_fraction = {}\n", toml_string(data.path), toml_float(data.val_fraction));
  if (data.eos_id >= 0) s += fmt::format("eos_id = {}\n", data.eos_id);
  s += fmt::format("\n[parallel]\npp = {}\ndp = {}\nep = {}\nvpp = {}\nschedule = {}\npad_layers = {}\n",
                   parallel.pp, parallel.dp, parallel.ep, parallel.vpp, toml_string(parallel.schedule),
                   parallel.pad_layers ? "true" : "false");
  if (!parallel.stage_layers.empty())
    s += fmt::format("stage_layers = [{}]\n", fmt::join(parallel.stage_layers, ", "));
  s += fmt::format("\n[device]\nmemory = \"{}\"\n", device_memory < 0 ? std::string("unlimited") : fmt::format("{}B", device_memory));
  if (device != "cpu") s += fmt::format("kind = {}\n", toml_string(device));
  return s;
}

}  // namespace moeflex
