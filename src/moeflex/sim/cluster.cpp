// Cluster descriptions and collective times (see cluster.h).
#include "moeflex/sim/cluster.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <fstream>
#include <initializer_list>
#include <numeric>
#include <utility>
#include <vector>

#include "moeflex/core/error.h"

namespace moeflex::sim {

namespace {

using nlohmann::json;

double number(const json& j, const char* key, const std::string& source, double fallback, bool required) {
  if (!j.contains(key)) {
    if (required) throw DataError(fmt::format("{}: missing field '{}'", source, key));
    return fallback;
  }
  if (!j[key].is_number()) throw DataError(fmt::format("{}: field '{}' must be a number", source, key));
  const double v = j[key].get<double>();
  if (!std::isfinite(v) || v < 0) throw DataError(fmt::format("{}: field '{}' must be a finite non-negative number (got {})", source, key, v));
  return v;
}

/// A count or a byte size: a number() that must also be a whole number of at most `max`.
std::int64_t integer(const json& j, const char* key, const std::string& source, std::int64_t fallback, bool required,
                     double max = 1 << 24) {
  const double v = number(j, key, source, double(fallback), required);
  if (v != std::floor(v) || v > max)
    throw DataError(fmt::format("{}: field '{}' must be a whole number{} (got {})", source, key,
                                v > max ? fmt::format(" of at most {:.0f}", max) : "", j[key].dump()));
  return std::int64_t(v);
}

/// Refuses a key of object `j` that is not in `known`, naming it and the closest known key.
void refuse_unknown_keys(const json& j, std::initializer_list<const char*> known, const std::string& source) {
  for (const auto& [key, value] : j.items()) {
    if (std::find_if(known.begin(), known.end(), [&](const char* k) { return key == k; }) != known.end()) continue;
    throw DataError(fmt::format("{}: unknown field '{}'{}", source, key,
                                did_you_mean(key, std::vector<std::string>(known.begin(), known.end()))));
  }
}

Link read_link(const json& j, const char* key, const std::string& source) {
  if (!j.contains(key) || !j[key].is_object()) throw DataError(fmt::format("{}: missing object '{}'", source, key));
  const std::string s = fmt::format("{}: {}", source, key);
  refuse_unknown_keys(j[key], {"latency_s", "bandwidth_Bps"}, s);
  Link l{number(j[key], "latency_s", s, 0, true), number(j[key], "bandwidth_Bps", s, 0, true)};
  if (l.bandwidth < 1e3)  // below it, step times overflow into inf
    throw DataError(fmt::format("{}: bandwidth_Bps must be at least 1000 (got {})", s, l.bandwidth));
  if (l.latency > 3600) throw DataError(fmt::format("{}: latency_s must be at most 3600 (got {})", s, l.latency));
  return l;
}

/// The link a group's ring or all-to-all is bound by.
const Link& slowest(const ClusterSpec& c, const GroupPlacement& g) {
  return g.ranks_per_node < g.size ? c.inter_node : c.intra_node;
}

}  // namespace

HardwareProfile derive_profile(const std::string& name, const DeviceRates& r, Bytes element_bytes) {
  if (r.peak_flops <= 0 || r.memory_bandwidth <= 0 || r.host_link.bandwidth <= 0)
    throw DataError(fmt::format("device '{}': peak_flops, memory_bandwidth and host_link bandwidth must be positive", name));
  HardwareProfile p;
  p.name = fmt::format("{} (derived from peak rates: GEMM {:.0f}% of {:.0f} TFLOP/s, memory {:.0f}% of {:.0f} GB/s)",
                       name, 100 * r.gemm_efficiency, r.peak_flops / 1e12, 100 * r.memory_efficiency,
                       r.memory_bandwidth / 1e9);
  p.threads = 1;
  for (std::int64_t M = 64; M <= 65536; M *= 4)
    for (std::int64_t N = 64; N <= 65536; N *= 4)
      for (std::int64_t K = 64; K <= 65536; K *= 4) {
        const double F = 2.0 * double(M) * double(N) * double(K);
        p.gemm.push_back({M, N, K, r.peak_flops * r.gemm_efficiency * F / (F + r.gemm_half_flops)});
      }
  // The cost model counts fp32 bytes; a pass over bf16 data moves half of them.
  const double scale = double(kActivationBytes) / double(element_bytes);
  p.memory_bandwidth = r.memory_bandwidth * r.memory_efficiency * scale;
  p.launch_overhead = r.launch_overhead;
  p.h2d_bandwidth = p.d2h_bandwidth = r.host_link.bandwidth * scale;
  p.copy_latency = r.host_link.latency;
  return p;
}

ClusterSpec ClusterSpec::from_json(const json& j, const std::string& source, const std::filesystem::path& base_dir) {
  if (!j.is_object()) throw DataError(fmt::format("{}: a cluster description must be a JSON object", source));
  refuse_unknown_keys(j,
                     {"name", "description", "gpus_per_node", "device_memory_bytes", "reserved_memory_bytes",
                      "element_bytes", "param_bytes", "optimizer_bytes", "optimizer_sharded", "flash_attention",
                      "host_cores", "profile", "per_tensor_gradient_reduce", "peak_flops", "device", "intra_node",
                      "inter_node"},
                     source);
  for (const char* k : {"name", "description", "profile"})
    if (j.contains(k) && !j[k].is_string()) throw DataError(fmt::format("{}: field '{}' must be a string", source, k));
  for (const char* k : {"optimizer_sharded", "flash_attention", "per_tensor_gradient_reduce"})
    if (j.contains(k) && !j[k].is_boolean()) throw DataError(fmt::format("{}: field '{}' must be true or false", source, k));
  ClusterSpec c;
  c.name = j.value("name", std::string("unnamed"));
  c.description = j.value("description", std::string());
  c.gpus_per_node = int(integer(j, "gpus_per_node", source, 1, true));
  if (c.gpus_per_node < 1) throw DataError(fmt::format("{}: gpus_per_node must be at least 1", source));
  c.device_memory = integer(j, "device_memory_bytes", source, 0, true, 0x1p62);
  c.reserved_memory = integer(j, "reserved_memory_bytes", source, 0, false, 0x1p62);
  if (c.usable_memory() <= 0)
    throw DataError(fmt::format("{}: device_memory_bytes {} leaves nothing after reserved_memory_bytes {}", source,
                                c.device_memory, c.reserved_memory));
  c.intra_node = read_link(j, "intra_node", source);
  c.inter_node = read_link(j, "inter_node", source);
  c.element_bytes = integer(j, "element_bytes", source, 4, false);
  if (c.element_bytes != 2 && c.element_bytes != 4)
    throw DataError(fmt::format("{}: element_bytes must be 2 or 4 (got {})", source, c.element_bytes));
  c.param_bytes = number(j, "param_bytes", source, 8, false);
  c.optimizer_bytes = number(j, "optimizer_bytes", source, 8, false);
  for (const auto& [k, v] : {std::pair{"param_bytes", c.param_bytes}, std::pair{"optimizer_bytes", c.optimizer_bytes}})
    if (v > 64)  // bytes per parameter: fp32 weights and gradient are 8, Adam's moments 8 more
      throw DataError(fmt::format("{}: field '{}' is bytes per parameter, at most 64 (got {})", source, k, v));
  c.optimizer_sharded = j.value("optimizer_sharded", false);
  c.flash_attention = j.value("flash_attention", false);
  c.host_cores = int(integer(j, "host_cores", source, 0, false));
  if (j.contains("profile")) {
    const std::filesystem::path p = base_dir / j["profile"].get<std::string>();
    c.profile = HardwareProfile::load(p);
    // A profile calibrated under mpirun measured the link between the ranks (the
    // communicator's all-to-all): it replaces the file's assumed links.
    if (c.profile.all_to_all_bandwidth > 0)
      c.intra_node = c.inter_node = Link{c.profile.all_to_all_latency, c.profile.all_to_all_bandwidth};
    c.per_tensor_gradient_reduce = j.value("per_tensor_gradient_reduce", false);
    c.peak_flops = number(j, "peak_flops", source, 0, false);
    if (c.peak_flops <= 0) {  // a CPU: its best measured GEMM rate stands for the peak
      for (const auto& g : c.profile.gemm) c.peak_flops = std::max(c.peak_flops, g.rate);
    }
  } else if (j.contains("device") && j["device"].is_object()) {
    const json& d = j["device"];
    const std::string s = source + ": device";
    refuse_unknown_keys(d,
                        {"peak_flops", "gemm_efficiency", "gemm_half_flops", "memory_bandwidth_Bps",
                         "memory_efficiency", "launch_overhead_s", "host_link"},
                        s);
    DeviceRates r;
    r.peak_flops = number(d, "peak_flops", s, 0, true);
    if (r.peak_flops < 1e6)
      throw DataError(fmt::format("{}: peak_flops must be at least 1e6 (got {})", s, r.peak_flops));
    r.gemm_efficiency = number(d, "gemm_efficiency", s, r.gemm_efficiency, false);
    r.gemm_half_flops = number(d, "gemm_half_flops", s, r.gemm_half_flops, false);
    r.memory_bandwidth = number(d, "memory_bandwidth_Bps", s, 0, true);
    if (r.memory_bandwidth < 1e3)
      throw DataError(fmt::format("{}: memory_bandwidth_Bps must be at least 1000 (got {})", s, r.memory_bandwidth));
    r.memory_efficiency = number(d, "memory_efficiency", s, r.memory_efficiency, false);
    r.launch_overhead = number(d, "launch_overhead_s", s, r.launch_overhead, false);
    r.host_link = read_link(d, "host_link", s);
    if (r.gemm_efficiency <= 0 || r.gemm_efficiency > 1 || r.memory_efficiency <= 0 || r.memory_efficiency > 1)
      throw DataError(fmt::format("{}: efficiencies must be in (0, 1]", s));
    c.profile = derive_profile(c.name, r, c.element_bytes);
    c.peak_flops = r.peak_flops;
  } else {
    throw DataError(fmt::format("{}: needs either \"profile\" (a calibrated hardware profile) or \"device\" (peak rates)", source));
  }
  return c;
}

json ClusterSpec::to_json() const {
  return {{"name", name},
          {"description", description},
          {"gpus_per_node", gpus_per_node},
          {"device_memory_bytes", device_memory},
          {"reserved_memory_bytes", reserved_memory},
          {"element_bytes", element_bytes},
          {"param_bytes", param_bytes},
          {"optimizer_bytes", optimizer_bytes},
          {"optimizer_sharded", optimizer_sharded},
          {"flash_attention", flash_attention},
          {"host_cores", host_cores},
          {"per_tensor_gradient_reduce", per_tensor_gradient_reduce},
          {"peak_flops", peak_flops},
          {"intra_node", {{"latency_s", intra_node.latency}, {"bandwidth_Bps", intra_node.bandwidth}}},
          {"inter_node", {{"latency_s", inter_node.latency}, {"bandwidth_Bps", inter_node.bandwidth}}},
          {"profile_name", profile.name}};
}

ClusterSpec load_cluster(const std::string& name_or_path, const std::filesystem::path& root,
                         const std::string& profile_override) {
  namespace fs = std::filesystem;
  fs::path path = name_or_path;
  const fs::path preset = root / "configs" / "clusters" / (name_or_path + ".json");
  if (!fs::exists(path) || fs::is_directory(path)) {
    if (!fs::exists(preset)) {
      std::string known;
      if (fs::exists(root / "configs" / "clusters"))
        for (const auto& e : fs::directory_iterator(root / "configs" / "clusters"))
          if (e.path().extension() == ".json") known += (known.empty() ? "" : ", ") + e.path().stem().string();
      throw ConfigError(fmt::format("cluster '{}' is neither a file nor a preset (known presets: {})", name_or_path,
                                    known.empty() ? "none found under " + (root / "configs/clusters").string() : known));
    }
    path = preset;
  }
  std::ifstream in(path);
  if (!in) throw DataError(fmt::format("{}: cannot read", path.string()));
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception& e) {
    throw DataError(fmt::format("{}: not valid JSON ({})", path.string(), e.what()));
  }
  if (!profile_override.empty()) {
    if (!fs::exists(profile_override))
      throw DataError(fmt::format("hardware profile '{}' does not exist (give a file `moeflex calibrate` wrote)",
                                  profile_override));
    if (!fs::is_regular_file(profile_override))
      throw DataError(
          fmt::format("hardware profile '{}' is not a file (give a file `moeflex calibrate` wrote)", profile_override));
    // A data sheet, checked as it is, keeps all it says (its links: a profile's
    // all-to-all link, measured between one node's ranks, would stand for both tiers;
    // its peak, the MFU denominator); only the profile prices the ops.
    if (!j.contains("profile") && j.contains("device")) {
      ClusterSpec c = ClusterSpec::from_json(j, path.string(), path.parent_path());
      c.profile = HardwareProfile::load(profile_override);
      return c;
    }
    j["profile"] = fs::absolute(profile_override).string();
  }
  if (j.contains("profile") && !j["profile"].is_string())
    throw DataError(fmt::format("{}: field 'profile' must be the path of a hardware profile (got {})", path.string(),
                                j["profile"].dump()));
  // A calibrated profile's path is relative to the repository root (where
  // `moeflex calibrate` writes it), other paths to the file's folder.
  const fs::path base = j.contains("profile") ? root : path.parent_path();
  if (j.contains("profile") && !fs::exists(base / j["profile"].get<std::string>()))
    throw DataError(fmt::format("{}: profile {} does not exist; run `moeflex calibrate` first", path.string(),
                                (base / j["profile"].get<std::string>()).string()));
  return ClusterSpec::from_json(j, path.string(), base);
}

GroupPlacement place_group(int size, int stride, int gpus_per_node) {
  GroupPlacement g;
  g.size = std::max(size, 1);
  stride = std::max(stride, 1);
  const int gpn = std::max(gpus_per_node, 1);
  if (stride >= gpn) return g;  // one member a node
  g.full_node = std::min(g.size, gpn / stride);
  const std::int64_t span = std::int64_t(g.size) * stride;
  if (span > kExactPlacementSpan) {
    g.ranks_per_node = g.full_node;
    return g;
  }
  // Group starts k span + j (j < stride); their offsets within a node repeat after
  // gpn / gcd(span, gpn) values of k.
  const std::int64_t period = gpn / std::gcd(span, std::int64_t(gpn));
  int worst = g.size;
  for (std::int64_t k = 0; k < period; ++k) {
    for (int j = 0; j < stride; ++j) {
      const std::int64_t r0 = k * span + j;
      int run = 0;
      std::int64_t node = r0 / gpn;
      for (int i = 0; i < g.size; ++i) {
        const std::int64_t n_i = (r0 + std::int64_t(i) * stride) / gpn;
        if (n_i != node) worst = std::min(worst, run), run = 0, node = n_i;
        ++run;
      }
      worst = std::min(worst, run);
    }
  }
  g.ranks_per_node = worst;
  return g;
}

Seconds all_reduce_time(const ClusterSpec& c, const GroupPlacement& g, Bytes bytes) {
  if (g.size <= 1 || bytes <= 0) return 0;
  const Link& l = slowest(c, g);
  const double n = g.size;
  return 2 * (n - 1) * l.latency + 2 * (n - 1) / n * double(bytes) / l.bandwidth;
}

Seconds all_gather_time(const ClusterSpec& c, const GroupPlacement& g, Bytes bytes) {
  if (g.size <= 1 || bytes <= 0) return 0;
  const Link& l = slowest(c, g);
  const double n = g.size;
  return (n - 1) * l.latency + (n - 1) / n * double(bytes) / l.bandwidth;
}

Seconds all_to_all_time(const ClusterSpec& c, const GroupPlacement& g, Bytes send_bytes, Bytes recv_bytes) {
  if (g.size <= 1) return 0;
  const double b = double(std::max(send_bytes, recv_bytes));
  const double n = g.size, rpn = g.ranks_per_node;
  const double intra = b * (rpn - 1) / (n - 1) / c.intra_node.bandwidth;
  const double inter = b * (n - rpn) / (n - 1) / c.inter_node.bandwidth;
  const Seconds alpha = rpn < n ? c.inter_node.latency : c.intra_node.latency;
  return alpha + std::max(intra, inter);
}

namespace {
// log(n choose r) (-inf outside 0 <= r <= n): through lgamma, finite for any group count.
double log_choose(std::int64_t n, std::int64_t r) {
  if (r < 0 || r > n) return -std::numeric_limits<double>::infinity();
  return std::lgamma(double(n) + 1) - std::lgamma(double(r) + 1) - std::lgamma(double(n - r) + 1);
}
// The chance that none of k experts drawn uniformly without replacement from `pool`
// falls among `held` of them (held may be fractional: an expected count).
double none_among(double pool, double held, std::int64_t k) {
  double miss = 1;
  for (std::int64_t i = 0; i < k; ++i) miss *= std::max(0.0, (pool - held - double(i)) / (pool - double(i)));
  return miss;
}
// Group-limited routing: the chance that a node holding experts [lo, hi) gets none of a
// token's k experts, drawn from `chosen` of `groups` groups of `per_group` experts (the
// groups uniformly, then the experts uniformly among theirs). The node touches m groups
// with c_1..c_m of its experts; with A the touched groups among the chosen ones,
//   P(miss) = sum_A C(groups - m, chosen - |A|) / C(groups, chosen) C(P - c_A, k) / C(P, k),
// P = chosen x per_group, c_A the node's experts in A. Subsets with the same counts
// are summed together: (count v, n_v groups with it), j_v of them chosen in
// C(n_v, j_v) ways; a contiguous range has at most 3 counts (a partial group, whole
// groups, a partial group), so this is exact and cheap for any number of groups.
double grouped_miss(std::int64_t lo, std::int64_t hi, std::int64_t groups, std::int64_t per_group, std::int64_t chosen,
                    std::int64_t k) {
  struct Count {
    std::int64_t experts, groups;
  };
  std::vector<Count> counts;
  auto add = [&](std::int64_t experts, std::int64_t n) {
    if (n <= 0) return;
    for (Count& c : counts)
      if (c.experts == experts) {
        c.groups += n;
        return;
      }
    counts.push_back({experts, n});
  };
  const std::int64_t g_lo = lo / per_group, g_hi = (hi - 1) / per_group;
  if (g_lo == g_hi) {
    add(hi - lo, 1);
  } else {
    add((g_lo + 1) * per_group - lo, 1);
    add(per_group, g_hi - g_lo - 1);
    add(hi - g_hi * per_group, 1);
  }
  const std::int64_t touched = g_hi - g_lo + 1;
  const double pool = double(chosen * per_group), all = log_choose(groups, chosen);
  double miss = 0;
  // Choose j of counts[i]'s groups, then recurse; J groups and `held` experts so far.
  auto sum = [&](auto& self, std::size_t i, std::int64_t J, std::int64_t held, double log_ways) -> void {
    if (i == counts.size()) {
      const double w = log_ways + log_choose(groups - touched, chosen - J) - all;
      if (std::isfinite(w)) miss += std::exp(w) * none_among(pool, double(held), k);
      return;
    }
    for (std::int64_t j = 0; j <= std::min(counts[i].groups, chosen - J); ++j)
      self(self, i + 1, J + j, held + j * counts[i].experts, log_ways + log_choose(counts[i].groups, j));
  };
  sum(sum, 0, 0, 0, 0.0);
  return miss;
}
}  // namespace

RemoteNodeTraffic remote_node_traffic(const GroupPlacement& g, std::int64_t E, std::int64_t k, std::int64_t groups,
                                      std::int64_t groups_per_token) {
  check_config(k >= 1 && k <= E, fmt::format("remote_node_traffic: top-{} of {} experts", k, E));
  check_config(
      groups >= 1 && E % groups == 0 && groups_per_token >= 1 && groups_per_token <= groups &&
          k <= groups_per_token * (E / groups),
      fmt::format("remote_node_traffic: top-{} of {} experts from {} of {} groups", k, E, groups_per_token, groups));
  const bool limited = groups_per_token < groups;
  check_config(!limited || E % g.size == 0,
               fmt::format("remote_node_traffic: group-limited routing needs whole experts a rank ({} experts over "
                           "{} ranks)",
                           E, g.size));
  const double n = g.size;
  // One node's share of a token's traffic: members [first, first + members), member i
  // holding experts [i E / n, (i + 1) E / n).
  auto node = [&](int first, int members) {
    const double c = members;
    double miss = 0;
    if (!limited) {
      miss = none_among(double(E), double(E) * c / n, k);
    } else {
      const std::int64_t per_rank = E / g.size;
      miss = grouped_miss(first * per_rank, (first + members) * per_rank, groups, E / groups, groups_per_token, k);
    }
    RemoteNodeTraffic t;
    const double hit = 1 - miss;
    if (hit <= 0) return t;
    t.copies = hit;
    t.forwards = hit * std::min(double(k) * c / n / hit, c) * (c - 1) / c;
    return t;
  };
  // Node runs in member order: the worst-placed member's node first, [0, rpn), then
  // full_node members a node, the last the rest (cluster.h: the real layout, or its
  // mirror image, for a member with rpn < full_node on its node).
  const int remote = g.size - g.ranks_per_node, full = std::max(g.full_node, 1);
  std::vector<std::pair<int, int>> runs = {{0, g.ranks_per_node}};
  for (int first = g.ranks_per_node; first < g.size; first += full)
    runs.push_back({first, std::min(full, g.size - first)});
  // Aligned (every node holds full_node members): every member is worst-placed, and with
  // group-limited routing the nodes differ; the one whose node is hit least sends the most.
  std::vector<std::size_t> locals = {0};
  if (limited && remote > 0 && g.ranks_per_node == full && g.size % full == 0)
    for (std::size_t j = 1; j < runs.size(); ++j) locals.push_back(j);
  std::vector<RemoteNodeTraffic> per(runs.size());
  for (std::size_t i = 0; i < runs.size(); ++i)
    if (locals.size() > 1 || i > 0) per[i] = node(runs[i].first, runs[i].second);
  std::size_t local = 0;
  for (std::size_t j : locals)
    if (per[j].copies < per[local].copies) local = j;
  RemoteNodeTraffic t;
  for (std::size_t i = 0; i < runs.size(); ++i)
    if (i != local) t.copies += per[i].copies, t.forwards += per[i].forwards;
  return t;
}

Seconds dedup_all_to_all_time(const ClusterSpec& c, const GroupPlacement& g, Bytes send_bytes, Bytes recv_bytes,
                              std::int64_t num_experts, std::int64_t top_k, std::int64_t groups,
                              std::int64_t groups_per_token) {
  if (g.size <= 1) return 0;
  if (g.ranks_per_node >= g.size) return all_to_all_time(c, g, send_bytes, recv_bytes);
  const double b = double(std::max(send_bytes, recv_bytes));
  const double n = g.size, rpn = g.ranks_per_node;
  const double row = b * n / ((n - 1) * double(top_k));  // one token's row
  const RemoteNodeTraffic t = remote_node_traffic(g, num_experts, top_k, groups, groups_per_token);
  const double intra = (b * (rpn - 1) / (n - 1) + row * t.forwards) / c.intra_node.bandwidth;
  const double inter = row * t.copies / c.inter_node.bandwidth;
  return c.inter_node.latency + std::max(intra, inter);
}

Seconds p2p_time(const ClusterSpec& c, bool same_node, Bytes bytes) {
  const Link& l = same_node ? c.intra_node : c.inter_node;
  return l.latency + double(std::max<Bytes>(bytes, 0)) / l.bandwidth;
}

}  // namespace moeflex::sim
