// `train --config config.json`: a Hugging Face config.json gives the model (with QK-norm
// implied by model_type), moeflex.toml beside it the run; what the engine does not run
// is refused by name; a small Qwen3-MoE-shaped config.json trains.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <fmt/format.h>
#include <string>

#include "moeflex/core/error.h"
#include "moeflex/train/train_config.h"
#include "moeflex/train/trainer.h"
#include "error_text.h"
#include "scratch_dir.h"

using namespace moeflex;
namespace fs = std::filesystem;

namespace {

const fs::path kSrc = MOEFLEX_SOURCE_DIR;

// A small Qwen3-MoE config.json, as transformers writes one (fields it ignores included).
nlohmann::json tiny_qwen3() {
  return nlohmann::json::parse(R"({
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "torch_dtype": "bfloat16",
    "vocab_size": 4096, "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "hidden_act": "silu", "max_position_embeddings": 4096,
    "rope_theta": 1000000.0, "rope_scaling": null, "rms_norm_eps": 1e-06, "attention_bias": false,
    "initializer_range": 0.006,
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128, "norm_topk_prob": true,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": 0.001,
    "tie_word_embeddings": false, "use_sliding_window": false, "sliding_window": null, "use_cache": true
  })");
}

fs::path write_json(const fs::path& dir, const nlohmann::json& j) {
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << j.dump(2);
  return dir / "config.json";
}

std::string config_error(const std::function<void()>& f) { return test::error_text<ConfigError>(f); }

}  // namespace

TEST(HfConfig, TheModelComesFromTheJsonAndTheRunFromTheTomlBesideIt) {
  const fs::path dir = test::scratch_dir("moeflex_hf_", "beside");
  const fs::path json = write_json(dir, tiny_qwen3());
  RunConfig c = RunConfig::from_file(json.string());
  EXPECT_EQ(c.model.hidden_size, 128);
  EXPECT_EQ(c.model.kv_heads(), 2);
  EXPECT_EQ(c.model.head_dim(), 32);
  EXPECT_EQ(c.model.qk_norm, "head") << "Qwen3-MoE norms q and k per head";
  EXPECT_FALSE(c.model.tie_word_embeddings);
  EXPECT_DOUBLE_EQ(c.model.router_aux_loss_coef, 0.001);
  EXPECT_EQ(c.train.steps, RunConfig::defaults().train.steps) << "no moeflex.toml: the default run";
  std::ofstream(dir / kHfRunToml) << "[model]\nbf16 = true\nexpert_chunk_rows = 512\n[train]\nsteps = 7\n"
                                     "seq_len = 64\n";
  c = RunConfig::from_file(json.string());
  EXPECT_EQ(c.train.steps, 7);
  EXPECT_EQ(c.train.seq_len, 64);
  EXPECT_TRUE(c.model.bf16);
  EXPECT_EQ(c.model.expert_chunk_rows, 512);
  EXPECT_EQ(c.model.hidden_size, 128) << "the shape is the JSON's";
  EXPECT_DOUBLE_EQ(c.model.initializer_range, 0.006) << "the JSON's, which the TOML does not name";
  c.validate();
  std::ofstream(dir / kHfRunToml) << "[model]\nhidden_size = 64\n";
  const std::string e = config_error([&] { RunConfig::from_file(json.string()); });
  EXPECT_NE(e.find("model.hidden_size is set by"), std::string::npos) << e;
  std::ofstream(json) << "{ not json";
  EXPECT_NE(config_error([&] { RunConfig::from_file(json.string()); }).find("not valid JSON"), std::string::npos);
}

TEST(HfConfig, OlmoeNormsTheWholeOfQAndK) {
  nlohmann::json j = tiny_qwen3();
  j["model_type"] = "olmoe";
  j.erase("head_dim");
  j["num_key_value_heads"] = 4;
  j["clip_qkv"] = nullptr;
  j["norm_topk_prob"] = false;
  const RunConfig c = RunConfig::from_file(write_json(test::scratch_dir("moeflex_hf_", "olmoe"), j).string());
  EXPECT_EQ(c.model.qk_norm, "full");
  EXPECT_FALSE(c.model.norm_topk_prob);
}

// Qwen's mlp_only_layers: read from config.json and TOML, written back by to_toml (a
// run's config.toml), checked against the layer count.
TEST(HfConfig, MlpOnlyLayersAreDenseWhateverTheStep) {
  nlohmann::json j = tiny_qwen3();
  j["num_hidden_layers"] = 4;
  j["mlp_only_layers"] = {1, 3};
  j["intermediate_size"] = 48;  // (the dense layers' width)
  const fs::path dir = test::scratch_dir("moeflex_hf_", "mlp_only");
  const RunConfig c = RunConfig::from_file(write_json(dir, j).string());
  std::vector<bool> moe;
  for (int l = 0; l < 4; ++l) moe.push_back(c.model.is_moe_layer(l));
  EXPECT_EQ(moe, (std::vector<bool>{true, false, true, false}));
  const ModelConfig back = RunConfig::from_toml_text(c.to_toml(), "config.toml").model;
  EXPECT_EQ(back.mlp_only_layers, (std::vector<std::int64_t>{1, 3}));
  ModelConfig bad = c.model;
  bad.mlp_only_layers = {4};
  EXPECT_NE(config_error([&] { bad.validate(); }).find("model.mlp_only_layers: 4 is not a layer"), std::string::npos);
  bad.mlp_only_layers = {1, 1};
  EXPECT_NE(config_error([&] { bad.validate(); }).find("lists layer 1 twice"), std::string::npos);
  j["mlp_only_layers"] = "1";
  EXPECT_NE(config_error([&] { RunConfig::from_file(write_json(dir, j).string()); }).find("a list of integers"),
            std::string::npos);
}

// DeepSeek-V3's routing fields are the engine's: read with their Hugging Face names.
TEST(HfConfig, DeepSeekRoutingFieldsAreRead) {
  nlohmann::json j = tiny_qwen3();
  j["num_experts"] = 8;
  j.update({{"scoring_func", "sigmoid"}, {"routed_scaling_factor", 2.5}, {"topk_method", "noaux_tc"},
            {"n_group", 4}, {"topk_group", 2}});
  const fs::path dir = test::scratch_dir("moeflex_hf_", "deepseek_routing");
  const RunConfig c = RunConfig::from_file(write_json(dir, j).string());
  EXPECT_EQ(c.model.scoring_func, "sigmoid");
  EXPECT_EQ(c.model.topk_method, "noaux_tc");
  EXPECT_DOUBLE_EQ(c.model.routed_scaling_factor, 2.5);
  EXPECT_TRUE(c.model.group_limited());
  EXPECT_TRUE(c.model.expert_bias());
  // Hugging Face's greedy top-k ignores the groups (DeepSeek-V2-Lite sets 1 and 1 anyway).
  j["topk_method"] = "greedy";
  const RunConfig g = RunConfig::from_file(write_json(dir, j).string());
  EXPECT_FALSE(g.model.group_limited());
  EXPECT_FALSE(g.model.expert_bias());
  j["scoring_func"] = "tanh";
  const std::string e = config_error([&] { RunConfig::from_file(write_json(dir, j).string()).validate(); });
  EXPECT_NE(e.find("model.scoring_func"), std::string::npos) << e;
}

TEST(HfConfig, WhatTheEngineDoesNotRunIsRefusedByName) {
  struct Case {
    const char* field;
    nlohmann::json value;
  };
  const Case cases[] = {{"attention_bias", true},       {"hidden_act", "gelu"},
                        {"rope_scaling", {{"type", "yarn"}, {"factor", 4.0}}},
                        {"use_sliding_window", true},   {"clip_qkv", 8.0},
                        {"kv_lora_rank", 512}};
  const fs::path dir = test::scratch_dir("moeflex_hf_", "refused");
  for (const Case& k : cases) {
    nlohmann::json j = tiny_qwen3();
    j[k.field] = k.value;
    const std::string e = config_error([&] { RunConfig::from_file(write_json(dir, j).string()); });
    EXPECT_NE(e.find(fmt::format("{} = {}", k.field, k.value.dump())), std::string::npos) << e;
    EXPECT_NE(e.find("is not in moeflex's training engine"), std::string::npos) << e;
  }
  // transformers 5 keeps RoPE in rope_parameters: its base is read, its scaling refused.
  nlohmann::json v5 = tiny_qwen3();
  v5.erase("rope_theta");
  v5.erase("rope_scaling");
  v5["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1000000.0}};
  EXPECT_DOUBLE_EQ(RunConfig::from_file(write_json(dir, v5).string()).model.rope_theta, 1e6);
  v5["rope_parameters"]["rope_type"] = "yarn";
  EXPECT_NE(config_error([&] { RunConfig::from_file(write_json(dir, v5).string()); }).find("rope_parameters"),
            std::string::npos);
  nlohmann::json other = tiny_qwen3();
  other["model_type"] = "qwen3_next";
  EXPECT_NE(config_error([&] { RunConfig::from_file(write_json(dir, other).string()); })
                .find("model_type = \"qwen3_next\""),
            std::string::npos);
  nlohmann::json mixtral = tiny_qwen3();
  mixtral["model_type"] = "mixtral";
  mixtral["sliding_window"] = 4096;
  EXPECT_NE(config_error([&] { RunConfig::from_file(write_json(dir, mixtral).string()); }).find("sliding_window"),
            std::string::npos);
  nlohmann::json qwen2 = tiny_qwen3();
  qwen2["model_type"] = "qwen2_moe";
  qwen2["shared_expert_intermediate_size"] = 256;
  EXPECT_NE(config_error([&] { RunConfig::from_file(write_json(dir, qwen2).string()); }).find("gated shared expert"),
            std::string::npos);
  qwen2.erase("shared_expert_intermediate_size");  // its q, k, v biases are on by default
  EXPECT_NE(config_error([&] { RunConfig::from_file(write_json(dir, qwen2).string()); }).find("biases in q, k"),
            std::string::npos);
  // The published configs: Qwen3-30B-A3B is a model the engine runs, DeepSeek-V3 is not.
  const RunConfig q = RunConfig::from_file((kSrc / "configs" / "models" / "qwen3-30b-a3b.json").string());
  EXPECT_EQ(q.model.qk_norm, "head");
  EXPECT_EQ(q.model.num_experts, 128);
  EXPECT_NE(config_error([&] { RunConfig::from_file((kSrc / "configs" / "models" / "deepseek-v3.json").string()); })
                .find("is not in moeflex's training engine"),
            std::string::npos);
}

TEST(HfConfig, ASmallQwen3MoeConfigJsonTrains) {
  ASSERT_TRUE(fs::exists(kSrc / "data" / "brown")) << "run `make data` first";
  const fs::path dir = test::scratch_dir("moeflex_hf_", "train");
  const fs::path json = write_json(dir, tiny_qwen3());
  std::ofstream(dir / kHfRunToml) << "[train]\nsteps = 12\nmicro_batch_size = 16\nseq_len = 64\nlr = 3e-3\n"
                                     "min_lr = 3e-4\nwarmup_steps = 10\neval_every = 0\neval_batches = 4\n"
                                     "checkpoint_every = 0\n";
  TrainOptions o;
  o.config = RunConfig::from_file(json.string());
  o.config.data.path = (kSrc / "data" / "brown").string();
  o.out_dir = dir / "run";
  o.data_cache = kSrc / "data" / "tokenized";
  o.progress = false;
  const TrainResult r = run_training(o);
  EXPECT_LT(r.final_val_loss, 0.95 * r.initial_val_loss) << r.initial_val_loss << " -> " << r.final_val_loss;
  // The run folder's config.toml holds the model as trained: it resumes without the JSON.
  const RunConfig saved = RunConfig::from_file((dir / "run" / "config.toml").string());
  EXPECT_EQ(saved.model.qk_norm, "head");
  EXPECT_EQ(saved.model.head_dim(), 32);
  fs::remove_all(dir);
}
