// Replay shares from a recorded loads.jsonl (see imbalance_replay.h).
#include "moeflex/train/imbalance_replay.h"

#include <fmt/format.h>

#include "moeflex/core/error.h"

namespace moeflex {

std::vector<std::vector<std::vector<double>>> replay_shares(const RecordedLoads& rec, const ModelConfig& model,
                                                            int ep, const std::string& source) {
  if (ep < 2 || rec.ep != ep)
    throw ConfigError(fmt::format("--inject-imbalance replay={}: the recording has EP size {} and this run {}: a "
                                  "replay needs the same EP size, at least 2 (its EP ranks are the groups)",
                                  source, rec.ep, ep));
  std::vector<int> moe_layers;
  for (int l = 0; l < model.num_hidden_layers; ++l)
    if (model.is_moe_layer(l)) moe_layers.push_back(l);
  if (int(moe_layers.size()) != rec.layers())
    throw ConfigError(fmt::format("--inject-imbalance replay={}: the recording has {} MoE layers and this model {}: "
                                  "a replay needs the same count", source, rec.layers(), moe_layers.size()));
  std::vector<std::vector<std::vector<double>>> out(rec.steps.size());
  for (std::size_t s = 0; s < rec.steps.size(); ++s) {
    out[s].resize(std::size_t(model.num_hidden_layers));
    for (int k = 0; k < rec.layers(); ++k) {
      std::vector<double> received(std::size_t(ep), 0.0);
      double total = 0;
      for (int mb = 0; mb < rec.microbatches; ++mb)
        for (int q = 0; q < rec.dp; ++q) {
          const double v = double(rec.at(s, k, mb, q).received);
          received[std::size_t(q % ep)] += v;
          total += v;
        }
      for (double& x : received) x = total > 0 ? x / total : 1.0 / ep;
      out[s][std::size_t(moe_layers[std::size_t(k)])] = std::move(received);
    }
  }
  return out;
}

std::filesystem::path replay_loads_file(const std::string& path) {
  const std::filesystem::path p(path);
  if (std::filesystem::is_directory(p)) {
    if (std::filesystem::is_regular_file(p / "loads.jsonl")) return p / "loads.jsonl";
    throw ConfigError(fmt::format("--inject-imbalance replay={}: the directory holds no loads.jsonl (written by "
                                  "`moeflex train` into its run directory)", path));
  }
  if (!std::filesystem::exists(p))
    throw ConfigError(fmt::format("--inject-imbalance replay={}: no such file or directory", path));
  return p;
}

void load_replay_shares(ops::ImbalanceSpec& spec, const ModelConfig& model, int ep) {
  if (spec.shape != ops::ImbalanceSpec::Shape::replay) return;
  const std::filesystem::path file = replay_loads_file(spec.replay_path);
  RecordedLoads rec;
  try {
    rec = read_recorded_loads(file);
  } catch (const DataError& e) {
    throw DataError(fmt::format("--inject-imbalance replay: {}", e.what()));
  }
  spec.replay_shares = replay_shares(rec, model, ep, file.string());
}

}  // namespace moeflex
