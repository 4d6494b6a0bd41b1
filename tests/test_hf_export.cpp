// moeflex export-hf (hf_export.h): a trained run written in the Hugging Face layouts of
// Qwen3-MoE, OLMoE and Mixtral is read by an independent script with the published
// tensor names (tests/reference/hf_checkpoint.py), whose reference model gives
// moeflex's logits; its config.json reads back as the model; what no layout holds is
// refused, and nothing on disk is overwritten.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "moeflex/core/arena.h"
#include "moeflex/core/error.h"
#include "moeflex/model/model.h"
#include "moeflex/train/generate.h"
#include "moeflex/train/hf_export.h"
#include "moeflex/train/safetensors.h"
#include "moeflex/train/trainer.h"
#include "error_text.h"
#include "scratch_dir.h"
#include "model_fixtures.h"

using namespace moeflex;
namespace fs = std::filesystem;

namespace {

const fs::path kSrc = MOEFLEX_SOURCE_DIR;

// A tiny run of `model` (TOML [model] lines) trained 3 steps on the Brown corpus.
fs::path tiny_run(const fs::path& dir, const std::string& model) {
  RunConfig c = RunConfig::from_toml_text(fmt::format(R"(
[model]
vocab_size = 2048
hidden_size = 64
num_hidden_layers = 4
num_attention_heads = 4
num_experts = 4
num_experts_per_tok = 2
moe_intermediate_size = 32
intermediate_size = 96
max_position_embeddings = 64
{}
[train]
steps = 3
micro_batch_size = 4
seq_len = 32
eval_every = 0
eval_batches = 1
checkpoint_every = 0
)", model), "test config");
  c.data.path = (kSrc / "data" / "brown").string();
  TrainOptions o;
  o.config = c;
  o.out_dir = dir / "run";
  o.data_cache = kSrc / "data" / "tokenized";
  o.progress = false;
  run_training(o);
  return o.out_dir;
}

std::string config_error(const std::function<void()>& f) { return test::error_text<ConfigError>(f); }

// Exports `run`, has the reference compute the logits of fixed ids from the export, and
// compares them with moeflex's own on the run's weights.
void expect_reference_logits(const fs::path& run, const fs::path& out, const std::string& arch) {
  ASSERT_EQ(export_hf(run, out), arch);
  const RunConfig cfg = RunConfig::from_file((run / "config.toml").string());
  constexpr std::int64_t B = 2, S = 16;
  std::vector<std::int32_t> ids(B * S);
  for (std::int64_t i = 0; i < B * S; ++i) ids[std::size_t(i)] = std::int32_t((i * 733 + 11) % cfg.model.vocab_size);
  train::SafetensorsWriter w;
  w.add("input.ids", train::StDType::I32, {B, S}, ids.data());
  w.write(out.parent_path() / "ids.safetensors");
  const std::string cmd = fmt::format("/usr/bin/python3 '{}' logits '{}' '{}' '{}'",
                                      (kSrc / "tests" / "reference" / "hf_checkpoint.py").string(), out.string(),
                                      (out.parent_path() / "ids.safetensors").string(),
                                      (out.parent_path() / "logits.safetensors").string());
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  Arena arena;
  MoEModel model(cfg.model, arena);
  load_run_weights(run, cfg, model);
  const std::int64_t V = cfg.model.vocab_size;
  std::vector<float> last(std::size_t(B * V));
  model.forward_eval(ids.data(), nullptr, B, S, last.data());
  const auto ref = train::SafetensorsFile::open(out.parent_path() / "logits.safetensors");
  std::vector<double> logits(std::size_t(B * S * V));
  ref.read_f64("out.logits", logits.data(), B * S * V);
  for (std::int64_t b = 0; b < B; ++b)
    EXPECT_LT(test::rel_norm_err(last.data() + b * V, logits.data() + ((b + 1) * S - 1) * V, V), 1e-5)
        << arch << " sequence " << b;
  // The config.json reads back as the model that was trained.
  std::ifstream in(out / "config.json");
  const ModelConfig back = ModelConfig::from_hf_json(nlohmann::json::parse(in), "exported config.json");
  EXPECT_EQ(back.hidden_size, cfg.model.hidden_size);
  EXPECT_EQ(back.kv_heads(), cfg.model.kv_heads());
  EXPECT_EQ(back.head_dim(), cfg.model.head_dim());
  EXPECT_EQ(back.num_experts, cfg.model.num_experts);
  EXPECT_EQ(back.moe_intermediate_size, cfg.model.moe_intermediate_size);
  EXPECT_EQ(back.qk_norm, cfg.model.qk_norm);
  EXPECT_EQ(back.norm_topk_prob, cfg.model.norm_topk_prob);
  EXPECT_EQ(back.decoder_sparse_step, cfg.model.decoder_sparse_step);
  EXPECT_EQ(back.tie_word_embeddings, cfg.model.tie_word_embeddings);
  EXPECT_EQ(back.num_params(), cfg.model.num_params());
}

}  // namespace

TEST(HfExport, EachLayoutGivesTheReferenceMoeflexsLogits) {
  ASSERT_TRUE(fs::exists(kSrc / "data" / "brown")) << "run `make data` first";
  struct Case {
    const char* arch;
    const char* model;
  };
  const Case cases[] = {
      {"qwen3_moe", "qk_norm = \"head\"\nnum_key_value_heads = 2\nhead_dim = 24\ndecoder_sparse_step = 2\n"
                    "tie_word_embeddings = false"},
      {"olmoe", "qk_norm = \"full\"\nnorm_topk_prob = false\ntie_word_embeddings = false"},
      {"mixtral", "num_key_value_heads = 2\ntie_word_embeddings = true"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.arch);
    const fs::path dir = test::scratch_dir("moeflex_hf_export_", c.arch);
    const fs::path run = tiny_run(dir, c.model);
    expect_reference_logits(run, dir / "hf", c.arch);
    // Again into the same folder: refused, the files left as they were.
    const auto before = fs::file_size(dir / "hf" / "model.safetensors");
    EXPECT_NE(config_error([&] { export_hf(run, dir / "hf"); }).find("is not an empty folder"), std::string::npos);
    EXPECT_EQ(fs::file_size(dir / "hf" / "model.safetensors"), before);
    if (std::string(c.arch) == "mixtral") {
      // A trailing slash names the folder; a folder where the export would stage is
      // someone's: refused and kept.
      EXPECT_EQ(export_hf(run, (dir / "slash").string() + "/"), "mixtral");
      EXPECT_TRUE(fs::exists(dir / "slash" / "config.json"));
      const fs::path staging = dir / fmt::format(".busy.export-hf-{}", ::getpid());
      fs::create_directories(staging / "keep");
      EXPECT_NE(config_error([&] { export_hf(run, dir / "busy"); }).find("exists: remove it"), std::string::npos);
      EXPECT_TRUE(fs::exists(staging / "keep"));
      EXPECT_FALSE(fs::exists(dir / "busy"));
    }
    fs::remove_all(dir);
  }
}

TEST(HfExport, WhatNoLayoutHoldsIsRefusedByName) {
  const ModelConfig shared = test::small_moe_config(2, 0, 4, false);  // (one shared expert)
  EXPECT_NE(config_error([&] { hf_architecture(shared); }).find("a shared expert"), std::string::npos);
  ModelConfig plain = shared;
  plain.n_shared_experts = 0;
  EXPECT_EQ(hf_architecture(plain), "mixtral");
  ModelConfig cf = plain;
  cf.capacity_factor = 1.25;
  EXPECT_NE(config_error([&] { hf_architecture(cf); }).find("capacity_factor = 1.25"), std::string::npos);
  ModelConfig prefix = plain;
  prefix.first_k_dense_replace = 1;
  EXPECT_NE(config_error([&] { hf_architecture(prefix); }).find("first_k_dense_replace = 1"), std::string::npos);
  ModelConfig unnormed = plain;
  unnormed.norm_topk_prob = false;
  EXPECT_NE(config_error([&] { hf_architecture(unnormed); }).find("Mixtral always renormalises"), std::string::npos);
  EXPECT_NE(config_error([&] { export_hf(kSrc / "no-such-run", kSrc / "no-such-out"); }).find("not a run directory"),
            std::string::npos);
}
