// Imbalance distributions and replayed loads (see loads.h).
#include "moeflex/sim/loads.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "moeflex/core/error.h"
#include "moeflex/core/rng.h"

namespace moeflex::sim {

LoadModel LoadModel::from_metrics(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) throw DataError(fmt::format("{}: cannot read", path.string()));
  LoadModel m;
  std::string line;
  int no = 0;
  while (std::getline(in, line)) {
    ++no;
    if (line.empty()) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      throw DataError(fmt::format("{}:{}: not valid JSON ({})", path.string(), no, e.what()));
    }
    std::vector<double> ratios;
    if (j.contains("ep_received_tokens") && j["ep_received_tokens"].is_array()) {
      for (const auto& row : j["ep_received_tokens"]) {
        double mx = 0, sum = 0;
        for (const auto& v : row) {
          mx = std::max(mx, v.get<double>());
          sum += v.get<double>();
        }
        ratios.push_back(sum > 0 ? std::max(1.0, mx * double(row.size()) / sum) : 1.0);
      }
    }
    if (ratios.empty()) ratios.push_back(1.0);
    m.trace_.push_back(std::move(ratios));
  }
  if (m.trace_.empty()) throw DataError(fmt::format("{}: no steps", path.string()));
  return m;
}

LoadModel LoadModel::parse(const std::string& spec) {
  LoadModel m;
  std::stringstream ss(spec);
  std::string part;
  while (std::getline(ss, part, ':')) {
    const auto eq = part.find('=');
    if (eq == std::string::npos) throw ConfigError(fmt::format("imbalance '{}': expected key=value in '{}'", spec, part));
    const std::string k = part.substr(0, eq);
    double v = 0;
    try {
      v = std::stod(part.substr(eq + 1));
    } catch (const std::exception&) {
      throw ConfigError(fmt::format("imbalance '{}': '{}' is not a number", spec, part.substr(eq + 1)));
    }
    if (k == "calm") m.calm_max = v;
    else if (k == "spike") m.spike_max = v;
    else if (k == "p") m.spike_probability = v;
    else if (k == "seed") m.seed = std::uint64_t(v);
    else throw ConfigError(fmt::format("imbalance '{}': unknown key '{}' (calm, spike, p, seed)", spec, k));
  }
  if (m.calm_max < 1 || m.spike_max < m.calm_max || m.spike_probability < 0 || m.spike_probability > 1)
    throw ConfigError(fmt::format("imbalance '{}': need 1 <= calm <= spike and 0 <= p <= 1", spec));
  return m;
}

double LoadModel::ratio(int iteration, int microbatch, int m, int moe_layer) const {
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
  if (trace_.empty()) return spike_probability > 0 ? spike_max : calm_max;
  double mx = 1;
  for (const auto& s : trace_)
    for (double r : s) mx = std::max(mx, r);
  return mx;
}

double LoadModel::probability_above(double r) const {
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
  if (!trace_.empty()) return fmt::format("replayed from metrics.jsonl ({} steps, max ratio {:.2f})", trace_.size(), max_ratio());
  return fmt::format("sampled: {:.1f}% of iterations in (1, {:.2f}], {:.1f}% spike in ({:.2f}, {:.2f}] (seed {})",
                     100 * (1 - spike_probability), calm_max, 100 * spike_probability, calm_max, spike_max, seed);
}

}  // namespace moeflex::sim
