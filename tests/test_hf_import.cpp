// Hugging Face checkpoints in (hf_import.h): an export imports back bit for bit and a
// run started from it (`train --init-from`) begins where the exported run ended;
// checkpoints written by an independent script with the published names (single file
// or sharded, F32 or BF16) give the reference model's logits; what does not fit is
// refused by name.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "moeflex/core/arena.h"
#include "moeflex/core/error.h"
#include "moeflex/model/model.h"
#include "moeflex/train/generate.h"
#include "moeflex/train/hf_export.h"
#include "moeflex/train/hf_import.h"
#include "moeflex/train/safetensors.h"
#include "moeflex/train/trainer.h"
#include "error_text.h"
#include "model_fixtures.h"
#include "scratch_dir.h"

using namespace moeflex;
namespace fs = std::filesystem;

namespace {

const fs::path kSrc = MOEFLEX_SOURCE_DIR;
const fs::path kMegatron = kSrc / "tests" / "reference" / "megatron_uint16";  // ids < 1000

/// A Qwen3-MoE-shaped run on the Megatron test data (pre-tokenized, as --init-from needs).
RunConfig qwen3_run(std::int64_t steps) {
  RunConfig c = RunConfig::from_file((kSrc / "tests" / "configs" / "qwen3-tiny.toml").string());
  c.train.steps = steps;
  c.train.checkpoint_every = 0;
  c.data.path = kMegatron.string();
  return c;
}

TrainResult run(const RunConfig& c, const fs::path& out, const std::optional<fs::path>& init_from = {}) {
  TrainOptions o;
  o.config = c;
  o.out_dir = out;
  o.progress = false;
  o.init_from = init_from;
  return run_training(o);
}

/// What `f` throws as E, or "" (test::error_text).
template <typename E>
std::string error_of(const std::function<void()>& f) { return test::error_text<E>(f); }

}  // namespace

TEST(HfImport, AnExportImportsBitForBitAndARunStartsWhereItEnded) {
  const fs::path dir = test::scratch_dir("moeflex_hf_import_", "roundtrip");
  const RunConfig cfg = qwen3_run(8);
  const TrainResult a = run(cfg, dir / "a");
  ASSERT_EQ(export_hf(dir / "a", dir / "hf"), "qwen3_moe");
  Arena arena_a, arena_b;
  MoEModel from_run(cfg.model, arena_a), from_hf(cfg.model, arena_b);
  load_run_weights(dir / "a", cfg, from_run);
  HfCheckpoint ckpt(dir / "hf");
  check_hf_checkpoint(ckpt, cfg.model, "qwen3_moe");
  load_hf_weights(ckpt, "qwen3_moe", from_hf);
  for (Param& p : from_run.params())
    EXPECT_EQ(0, std::memcmp(p.w.f32(), from_hf.param(p.name).w.f32(), std::size_t(p.w.nbytes()))) << p.name;
  // A run from the export evaluates, before its first step, what the exported run did after its last.
  RunConfig next = cfg;
  next.train.steps = 1;
  const TrainResult b = run(next, dir / "b", dir / "hf");
  EXPECT_EQ(b.initial_val_loss, a.final_val_loss);
  const TrainResult fresh = run(next, dir / "c");
  EXPECT_GT(std::abs(fresh.initial_val_loss - a.final_val_loss), 1e-2);  // (a random init evaluates otherwise)
  // moeflex import-hf: a run at step 0 whose export has the files' tensors, bit for bit.
  TrainOptions imp;
  imp.config = cfg;
  imp.out_dir = dir / "imported";
  imp.progress = false;
  imp.init_from = dir / "hf";
  imp.stop_after = 0;
  EXPECT_EQ(run_training(imp).steps, 0);
  ASSERT_EQ(export_hf(dir / "imported", dir / "hf2"), "qwen3_moe");
  const auto f1 = train::SafetensorsFile::open(dir / "hf" / "model.safetensors");
  const auto f2 = train::SafetensorsFile::open(dir / "hf2" / "model.safetensors");
  ASSERT_EQ(f1.names(), f2.names());
  for (const std::string& name : f1.names()) {
    const std::int64_t n = f1.info(name).numel();
    std::vector<float> x(static_cast<std::size_t>(n)), y(x);
    f1.read_f32(name, x.data(), n);
    f2.read_f32(name, y.data(), n);
    EXPECT_EQ(0, std::memcmp(x.data(), y.data(), x.size() * sizeof(float))) << name;
  }
  // It resumes into the run the checkpoint starts (as --init-from does), and samples token ids.
  TrainOptions resume;
  resume.config = cfg;
  resume.config.train.steps = 1;
  resume.resume = dir / "imported";
  resume.progress = false;
  EXPECT_EQ(run_training(resume).initial_val_loss, b.initial_val_loss);
  GenerateOptions g;
  g.run_dir = dir / "imported";
  g.max_new_tokens = 4;
  g.temperature = 0;
  const std::vector<std::int32_t> ids = generate_ids(g, {5, 17, 300});
  ASSERT_EQ(ids.size(), 7u);
  EXPECT_EQ(ids[0], 5);
  for (std::int32_t id : ids) EXPECT_LT(id, cfg.model.vocab_size);
  EXPECT_NE(error_of<DataError>([&] { g.prompt = "text"; generate_text(g); }).find("--prompt-ids"), std::string::npos);
  fs::remove_all(dir);
}

TEST(HfImport, WhatDoesNotFitIsRefusedByName) {
  const fs::path dir = test::scratch_dir("moeflex_hf_import_", "refused");
  const RunConfig cfg = qwen3_run(1);
  run(cfg, dir / "a");
  ASSERT_EQ(export_hf(dir / "a", dir / "hf"), "qwen3_moe");
  // The run's model differs from the checkpoint's config.json: the field is named.
  ModelConfig wider = cfg.model;
  wider.moe_intermediate_size = 48;
  HfCheckpoint ckpt(dir / "hf");
  EXPECT_NE(error_of<ConfigError>([&] { check_hf_checkpoint(ckpt, wider, "qwen3_moe"); })
                .find("moe_intermediate_size = 32 but the run's model has 48"),
            std::string::npos);
  // A sharded copy whose index drops one tensor, or names a missing file.
  const auto shapes = hf_tensor_shapes(cfg.model, "qwen3_moe");
  nlohmann::json index = {{"metadata", nlohmann::json::object()}, {"weight_map", nlohmann::json::object()}};
  for (const auto& [name, shape] : shapes) index["weight_map"][name] = "model.safetensors";
  const std::string dropped = "model.layers.1.mlp.experts.3.down_proj.weight";
  index["weight_map"].erase(dropped);
  fs::create_directories(dir / "sharded");
  fs::copy_file(dir / "hf" / "config.json", dir / "sharded" / "config.json");
  fs::copy_file(dir / "hf" / "model.safetensors", dir / "sharded" / "model.safetensors");
  std::ofstream(dir / "sharded" / "model.safetensors.index.json") << index.dump();
  HfCheckpoint partial(dir / "sharded");
  EXPECT_NE(error_of<DataError>([&] { check_hf_checkpoint(partial, cfg.model, "qwen3_moe"); })
                .find("has no tensor '" + dropped + "'"),
            std::string::npos);
  index["weight_map"][dropped] = "model-00002-of-00002.safetensors";
  std::ofstream(dir / "sharded" / "model.safetensors.index.json") << index.dump();
  EXPECT_NE(error_of<DataError>([&] { HfCheckpoint(dir / "sharded"); }).find("which is missing"), std::string::npos);
  // A tensor the layout does not have (Qwen2's attention bias).
  index["weight_map"][dropped] = "model.safetensors";
  index["weight_map"]["model.layers.0.self_attn.q_proj.bias"] = "model.safetensors";
  std::ofstream(dir / "sharded" / "model.safetensors.index.json") << index.dump();
  HfCheckpoint extra(dir / "sharded");
  EXPECT_NE(error_of<DataError>([&] { check_hf_checkpoint(extra, cfg.model, "qwen3_moe"); })
                .find("holds tensor 'model.layers.0.self_attn.q_proj.bias'"),
            std::string::npos);
  // A text corpus would be tokenized by another tokenizer than the checkpoint's.
  RunConfig text = cfg;
  text.data.path = (kSrc / "data" / "brown").string();
  EXPECT_NE(error_of<ConfigError>([&] { run(text, dir / "text", dir / "hf"); }).find("--init-from: the checkpoint's "
                                                                                       "embeddings"),
            std::string::npos);
  fs::remove_all(dir);
}

// Checkpoints written by an independent script with the published names and layouts
// (tests/reference/hf_checkpoint.py write): one F32 file, or BF16 over 3 shards through
// the index; imported, they give the reference model's logits of the same files.
TEST(HfImport, IndependentCheckpointsGiveTheReferenceLogits) {
  const fs::path dir = test::scratch_dir("moeflex_hf_import_", "independent");
  fs::create_directories(dir);
  const std::string script = (kSrc / "tests" / "reference" / "hf_checkpoint.py").string();
  constexpr std::int64_t B = 2, S = 8;
  std::vector<std::int32_t> ids(B * S);
  for (std::int64_t i = 0; i < B * S; ++i) ids[std::size_t(i)] = std::int32_t((i * 37 + 5) % 96);
  train::SafetensorsWriter w;
  w.add("input.ids", train::StDType::I32, {B, S}, ids.data());
  w.write(dir / "ids.safetensors");
  for (const char* arch : {"qwen3_moe", "olmoe", "mixtral"})
    for (const auto& [dtype, shards] : {std::pair<const char*, int>{"f32", 1}, {"bf16", 3}}) {
      SCOPED_TRACE(fmt::format("{} {} x {}", arch, dtype, shards));
      const fs::path hf = dir / fmt::format("{}-{}", arch, dtype), out = dir / fmt::format("{}-{}.st", arch, dtype);
      const std::string write = fmt::format("/usr/bin/python3 '{}' write '{}' {} 1234 --shards {} --dtype {}", script,
                                            hf.string(), arch, shards, dtype);
      ASSERT_EQ(std::system(write.c_str()), 0) << write;
      EXPECT_EQ(fs::exists(hf / "model.safetensors.index.json"), shards > 1);
      const std::string logits = fmt::format("/usr/bin/python3 '{}' logits '{}' '{}' '{}'", script, hf.string(),
                                             (dir / "ids.safetensors").string(), out.string());
      ASSERT_EQ(std::system(logits.c_str()), 0) << logits;
      std::ifstream in(hf / "config.json");
      const ModelConfig cfg = ModelConfig::from_hf_json(nlohmann::json::parse(in), "config.json");
      Arena arena;
      MoEModel model(cfg, arena);
      HfCheckpoint ckpt(hf);
      check_hf_checkpoint(ckpt, cfg, arch);
      load_hf_weights(ckpt, arch, model);
      const std::int64_t V = cfg.vocab_size;
      std::vector<float> last(std::size_t(B * V));
      model.forward_eval(ids.data(), nullptr, B, S, last.data());
      const auto ref = train::SafetensorsFile::open(out);
      std::vector<double> want(std::size_t(B * S * V));
      ref.read_f64("out.logits", want.data(), B * S * V);
      for (std::int64_t b = 0; b < B; ++b)
        EXPECT_LT(test::rel_norm_err(last.data() + b * V, want.data() + ((b + 1) * S - 1) * V, V), 1e-5)
            << "sequence " << b;
    }
  fs::remove_all(dir);
}

