// Imbalance distributions and replayed loads (see loads.h).
#include "moeflex/sim/loads.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <cmath>
#include <sstream>

#include <functional>
#include <nlohmann/json.hpp>

#include "moeflex/core/error.h"
#include "moeflex/core/rng.h"

namespace moeflex::sim {

LoadModel LoadModel::from_metrics(const std::filesystem::path& path) {
  LoadModel m;
  for_each_json_line(path, [&](const nlohmann::json& j, const std::string& where) {
    if (!j.is_object() || !j.contains("step"))
      throw DataError(fmt::format("{}: neither a metrics.jsonl step (no \"step\") nor a loads.jsonl record (no "
                                  "\"moe_layers\")", where));
    std::vector<double> ratios;
    if (j.contains("ep_received_tokens") && j["ep_received_tokens"].is_array()) {
      for (const auto& row : j["ep_received_tokens"]) {
        double mx = 0, sum = 0;
        if (!row.is_array())
          throw DataError(fmt::format("{}: \"ep_received_tokens\" must list one row of counts per MoE layer (got {})",
                                      where, row.dump()));
        for (const auto& v : row) {
          if (!v.is_number() || v.get<double>() < 0 || !std::isfinite(v.get<double>()))
            throw DataError(fmt::format("{}: \"ep_received_tokens\" holds {}, not a token count", where, v.dump()));
          mx = std::max(mx, v.get<double>());
          sum += v.get<double>();
        }
        ratios.push_back(sum > 0 ? std::max(1.0, mx * double(row.size()) / sum) : 1.0);
      }
    }
    if (ratios.empty()) ratios.push_back(1.0);
    m.trace_.push_back(std::move(ratios));
  });
  if (m.trace_.empty()) throw DataError(fmt::format("{}: no steps", path.string()));
  return m;
}

LoadModel LoadModel::from_loads(const std::filesystem::path& path) {
  RecordedLoads rec = read_recorded_loads(path);
  LoadModel m;
  m.rec_dp_ = rec.dp;
  m.rec_ep_ = rec.ep;
  m.rec_m_ = rec.microbatches;
  m.rec_layers_ = rec.layers();
  const int dp = rec.dp, ep = rec.ep;
  for (const auto& rows : rec.steps) {
    // Per micro-batch and layer: the hottest EP group's max / mean of received rows.
    std::vector<double> ratios(std::size_t(rec.layers()) * std::size_t(rec.microbatches), 1.0);
    for (std::size_t i = 0; i < ratios.size(); ++i)
      for (int g = 0; g < dp / ep; ++g) {
        double mx = 0, sum = 0;
        for (int q = g * ep; q < (g + 1) * ep; ++q) {
          const double v = double(rows[i * std::size_t(dp) + std::size_t(q)].received);
          mx = std::max(mx, v);
          sum += v;
        }
        if (sum > 0) ratios[i] = std::max(ratios[i], mx * double(ep) / sum);
      }
    m.mb_ratio_.push_back(std::move(ratios));
  }
  m.rows_ = std::move(rec.steps);
  return m;
}

LoadModel LoadModel::from_file(const std::filesystem::path& path) {
  if (std::filesystem::is_directory(path)) {
    if (std::filesystem::exists(path / "loads.jsonl")) return from_loads(path / "loads.jsonl");
    return from_metrics(path / "metrics.jsonl");
  }
  // A file: loads.jsonl records name their MoE layers; anything else must be a metrics.jsonl.
  bool loads_format = path.filename() == "loads.jsonl";
  if (!loads_format) {
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line) && line.empty()) {
    }
    const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    loads_format = j.is_object() && j.contains("moe_layers");
  }
  return loads_format ? from_loads(path) : from_metrics(path);
}

RecordedRows LoadModel::rows(int iteration, int microbatch, int moe_layer, int dp_rank) const {
  if (rows_.empty()) throw ConfigError("per-rank loads asked of a load model without a loads.jsonl replay");
  if (microbatch < 0 || microbatch >= rec_m_ || moe_layer < 0 || moe_layer >= rec_layers_ || dp_rank < 0 ||
      dp_rank >= rec_dp_)
    throw ConfigError(fmt::format("replayed loads: micro-batch {}, MoE layer {}, dp rank {} outside the recording's "
                                  "{} micro-batches, {} layers, dp {}", microbatch, moe_layer, dp_rank, rec_m_,
                                  rec_layers_, rec_dp_));
  const auto& step = rows_[std::size_t(std::max(iteration, 0)) % rows_.size()];
  return step[(std::size_t(moe_layer) * std::size_t(rec_m_) + std::size_t(microbatch)) * std::size_t(rec_dp_) +
              std::size_t(dp_rank)];
}

LoadModel LoadModel::parse(const std::string& spec) {
  LoadModel m;
  std::stringstream ss(spec);
  std::string part;
  while (std::getline(ss, part, ':')) {
    const auto eq = part.find('=');
    if (eq == std::string::npos) throw ConfigError(fmt::format("imbalance '{}': expected key=value in '{}'", spec, part));
    const std::string k = part.substr(0, eq), text = part.substr(eq + 1);
    if (k == "seed") {  // an integer in [0, 2^64)
      std::size_t pos = 0;
      try {
        if (!text.empty() && text[0] != '-') m.seed = std::stoull(text, &pos);
      } catch (const std::exception&) {
        pos = 0;
      }
      if (text.empty() || pos != text.size())
        throw ConfigError(fmt::format("imbalance '{}': seed '{}' is not a non-negative integer", spec, text));
      continue;
    }
    double v = 0;
    std::size_t pos = 0;
    try {
      v = std::stod(text, &pos);
    } catch (const std::exception&) {
      pos = 0;
    }
    if (text.empty() || pos != text.size() || !std::isfinite(v))
      throw ConfigError(fmt::format("imbalance '{}': '{}' is not a finite number", spec, text));
    if (k == "calm") m.calm_max = v;
    else if (k == "constant") {  // every MoE layer of every iteration at ratio v (what search scores at)
      if (v < 1) throw ConfigError(fmt::format("imbalance '{}': constant must be >= 1", spec));
      m.constant = v;
    } else if (k == "spike")
      m.spike_max = v;
    else if (k == "p") m.spike_probability = v;
    else
      throw ConfigError(fmt::format("imbalance '{}': unknown key '{}' (calm, spike, p, seed; or constant)", spec, k));
  }
  if (m.calm_max < 1 || m.spike_max < m.calm_max || m.spike_probability < 0 || m.spike_probability > 1)
    throw ConfigError(fmt::format("imbalance '{}': need 1 <= calm <= spike and 0 <= p <= 1", spec));
  return m;
}

LoadModel LoadModel::from_flags(const std::string& loads_path, const std::string& imbalance_spec) {
  if (!loads_path.empty() && !imbalance_spec.empty())
    throw ConfigError(fmt::format("--imbalance '{}' and --loads '{}' both give the expert loads: a replay takes the "
                                  "recorded run's own loads and would ignore the distribution; give one of them",
                                  imbalance_spec, loads_path));
  if (!loads_path.empty()) return from_file(loads_path);
  return imbalance_spec.empty() ? LoadModel{} : parse(imbalance_spec);
}

double LoadModel::ratio(int iteration, int microbatch, int m, int moe_layer) const {
  if (!mb_ratio_.empty()) {
    const auto& step = mb_ratio_[std::size_t(std::max(iteration, 0)) % mb_ratio_.size()];
    const std::size_t M = std::size_t(rec_m_);
    return step[(std::size_t(moe_layer) % std::size_t(rec_layers_)) * M + std::size_t(microbatch) % M];
  }
  if (!trace_.empty()) {
    const auto& step = trace_[std::size_t(iteration) % trace_.size()];
    return step[std::size_t(moe_layer) % step.size()];
  }
  if (constant > 0) return constant;
  const std::uint64_t it = std::uint64_t(iteration);
  const int spiking_mb = int(uniform01(seed, 1, it) * m) % std::max(m, 1);
  if (microbatch == spiking_mb && uniform01(seed, 2, it) < spike_probability)
    return calm_max + (spike_max - calm_max) * uniform01(seed, 3, it);
  return 1.0 + (calm_max - 1.0) * uniform01(seed, 4, it * 1000003ull + std::uint64_t(microbatch));
}

double LoadModel::max_ratio() const {
  if (constant > 0) return constant;
  if (trace_.empty() && mb_ratio_.empty()) return spike_probability > 0 ? spike_max : calm_max;
  double mx = 1;
  for (const auto& s : mb_ratio_)
    for (double r : s) mx = std::max(mx, r);
  for (const auto& s : trace_)
    for (double r : s) mx = std::max(mx, r);
  return mx;
}

double LoadModel::probability_above(double r) const {
  if (!mb_ratio_.empty()) {
    int above = 0;
    for (const auto& s : mb_ratio_)
      if (*std::max_element(s.begin(), s.end()) > r) ++above;
    return double(above) / double(mb_ratio_.size());
  }
  if (!trace_.empty()) {
    int above = 0;
    for (const auto& s : trace_)
      if (*std::max_element(s.begin(), s.end()) > r) ++above;
    return double(above) / double(trace_.size());
  }
  if (constant > 0) return constant > r ? 1.0 : 0.0;
  if (r >= spike_max) return 0;
  if (r < calm_max) return 1.0;  // some calm micro-batch of the iteration gets close to calm_max
  return spike_probability * (spike_max - r) / (spike_max - calm_max);
}

std::string LoadModel::describe() const {
  if (constant > 0) return fmt::format("constant ratio {:.2f}", constant);
  if (!rows_.empty())
    return fmt::format("replayed per rank from loads.jsonl ({} steps, dp {}, ep {}, max ratio {:.2f})", rows_.size(),
                       rec_dp_, rec_ep_, max_ratio());
  if (!trace_.empty()) return fmt::format("replayed from metrics.jsonl ({} steps, max ratio {:.2f})", trace_.size(), max_ratio());
  return fmt::format("sampled: {:.1f}% of iterations in (1, {:.2f}], {:.1f}% spike in ({:.2f}, {:.2f}] (seed {})",
                     100 * (1 - spike_probability), calm_max, 100 * spike_probability, calm_max, spike_max, seed);
}

}  // namespace moeflex::sim
