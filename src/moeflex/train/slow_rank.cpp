// Slow-rank detection's scores and reports (slow_rank.h).
#include "moeflex/train/slow_rank.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>

#include <unistd.h>

#include "moeflex/core/error.h"
#include "moeflex/core/key_values.h"

namespace moeflex::train {

double median_of(std::vector<double> v) {
  if (v.empty()) return 0.0;
  const std::size_t h = v.size() / 2;
  std::nth_element(v.begin(), v.begin() + std::ptrdiff_t(h), v.end());
  if (v.size() % 2) return v[h];
  const double hi = v[h];
  return 0.5 * (hi + *std::max_element(v.begin(), v.begin() + std::ptrdiff_t(h)));
}

InjectedSlowdown parse_slowdown(const std::string& text) {
  InjectedSlowdown out;
  const std::string s = trim(text);
  if (s.empty() || s == "none") return out;
  auto refuse = [&](const std::string& why) {
    throw ConfigError(fmt::format("--inject-slowdown '{}': {} (expected 'rank=R:phase=P:factor=F[:from=S]', P one "
                                  "of data, forward, backward, experts, optimizer, all_to_all, all_reduce, "
                                  "send_recv)", text, why));
  };
  std::string why;
  const auto parts = split_key_values(s, why);
  if (!parts) refuse(why);
  bool has_rank = false, has_phase = false, has_factor = false;
  for (const auto& [key, val] : *parts) {
    std::uint64_t n = 0;
    if (key == "rank") {
      if (!parse_u64(val, n) || n > 1u << 24) refuse(fmt::format("rank must be a rank number, got '{}'", val));
      out.rank = int(n), has_rank = true;
    } else if (key == "phase") {
      const auto p = parse_step_phase(val);
      if (!p || *p == StepPhase::other) refuse(fmt::format("unknown phase '{}'", val));
      out.slowdown.phase = *p, has_phase = true;
    } else if (key == "factor") {
      if (!parse_double(val, out.slowdown.factor) || out.slowdown.factor < 1.0 || out.slowdown.factor > 100.0)
        refuse(fmt::format("factor must be a number in [1, 100], got '{}'", val));
      has_factor = true;
    } else if (key == "from") {
      if (!parse_u64(val, n) || n < 1) refuse(fmt::format("from must be a step >= 1, got '{}'", val));
      out.slowdown.from_step = std::int64_t(n);
    } else {
      refuse(fmt::format("unknown key '{}'", key));
    }
  }
  if (!has_rank || !has_phase || !has_factor) refuse("rank, phase and factor are required");
  return out;
}

nlohmann::json SlowRankReport::to_json() const {
  return {{"rank", rank},
          {"host", host},
          {"phase", to_string(phase)},
          {"factor", factor},
          {"first_step", first_step},
          {"report_step", report_step},
          {"compared_with", vs_peers ? "peers" : "own history"}};
}

SlowRankReport SlowRankReport::from_json(const nlohmann::json& j) {
  SlowRankReport r;
  r.rank = j.at("rank").get<int>();
  r.host = j.at("host").get<std::string>();
  const auto p = parse_step_phase(j.at("phase").get<std::string>());
  if (!p) throw DataError(fmt::format("slow-rank report: unknown phase '{}'", j.at("phase").get<std::string>()));
  r.phase = *p;
  r.factor = j.at("factor").get<double>();
  r.first_step = j.at("first_step").get<std::int64_t>();
  r.report_step = j.value("report_step", r.first_step);
  r.vs_peers = j.value("compared_with", std::string("peers")) == "peers";
  return r;
}

SlowRankDetector::SlowRankDetector(SlowRankOptions opts, std::vector<int> peer_group, std::vector<std::string> hosts)
    : opts_(opts), group_(std::move(peer_group)), hosts_(std::move(hosts)) {
  if (group_.size() != hosts_.size())
    throw Error(fmt::format("slow-rank detector: {} peer groups for {} hosts", group_.size(), hosts_.size()));
  if (opts_.window < 1 || opts_.persist < 1 || opts_.threshold <= 1.0)
    throw ConfigError(fmt::format("slow-rank detection needs window >= 1, persist >= 1 and threshold > 1 (got {}, "
                                  "{}, {})", opts_.window, opts_.persist, opts_.threshold));
}

std::vector<PhaseTimes> SlowRankDetector::own_times(const std::vector<RankStep>& ranks) const {
  const std::size_t n = ranks.size();
  std::vector<PhaseTimes> own(n);
  // A call lasts, on the rank that arrived last, as long as the transfer itself: the
  // least any rank spent in the kind (beyond its own part) is its cost to everyone.
  std::array<double, kStepPhases> transfer{};
  transfer.fill(std::numeric_limits<double>::infinity());
  for (const RankStep& s : ranks)
    for (int p = 0; p < kStepPhases; ++p) transfer[p] = std::min(transfer[p], s.times.seconds[p] - s.times.comm_own[p]);
  for (std::size_t r = 0; r < n; ++r) {
    const PhaseTimes& t = ranks[r].times;
    double rows = 0;  // the mean expert rows of r's peers (r included)
    int peers = 0;
    for (std::size_t q = 0; q < n; ++q)
      if (group_[q] == group_[r]) rows += ranks[q].expert_rows, ++peers;
    rows /= std::max(peers, 1);
    for (int p = 0; p < kStepPhases; ++p) {
      const StepPhase ph = StepPhase(p);
      double x = t.seconds[p];
      if (is_comm(ph)) x = t.comm_own[p] + std::max(0.0, transfer[p]);
      if (ph == StepPhase::experts && ranks[r].expert_rows > 0) x *= rows / ranks[r].expert_rows;
      own[r].seconds[p] = x;
      own[r].comm_own[p] = t.comm_own[p];
    }
  }
  return own;
}

std::pair<double, double> SlowRankDetector::factor_of(int r, StepPhase p, const std::vector<PhaseTimes>& own,
                                                     Track& tr) const {
  constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
  const double mine = own[std::size_t(r)][p];
  std::vector<double> peers, totals;
  for (std::size_t q = 0; q < own.size(); ++q) {
    if (group_[q] != group_[std::size_t(r)]) continue;
    totals.push_back(own[q].total());
    if (int(q) != r) peers.push_back(own[q][p]);
  }
  double ref = 0;
  tr.vs_peers = !peers.empty();
  if (!peers.empty()) {
    ref = median_of(peers);
  } else {
    if (int(tr.history.size()) < opts_.baseline) {
      tr.history.push_back(mine);
      return {kNaN, 0.0};  // not scored until the baseline is complete
    }
    ref = median_of(tr.history);
  }
  const double step = median_of(totals);
  if (ref < opts_.min_seconds || ref < opts_.min_share * step) return {kNaN, 0.0};
  return {mine / ref, (mine - ref) / step};
}

void SlowRankDetector::update(std::int64_t step, int r, StepPhase p, std::pair<double, double> score,
                              std::vector<SlowRankReport>& made) {
  Track& tr = tracks_[{r, int(p)}];
  tr.scores.push_back({step, score.first, score.second});
  while (int(tr.scores.size()) > opts_.window) tr.scores.pop_front();
  std::vector<double> f, e;
  for (const Track::Score& s : tr.scores) f.push_back(s.factor), e.push_back(s.excess);
  tr.current = median_of(f);
  if (int(tr.scores.size()) < opts_.window || tr.current < opts_.threshold || median_of(e) < opts_.min_impact) {
    tr.above = 0;
    if (tr.reported && tr.current < 1.0 + 0.5 * (opts_.threshold - 1.0)) tr.reported = false;  // recovered
    return;
  }
  if (++tr.above < opts_.persist || tr.reported) return;
  tr.reported = true;
  SlowRankReport rep;
  rep.rank = r;
  rep.host = hosts_[std::size_t(r)];
  rep.phase = p;
  rep.factor = tr.current;
  rep.report_step = step;
  rep.first_step = step;
  rep.vs_peers = tr.vs_peers;
  for (const Track::Score& s : tr.scores)
    if (s.factor >= opts_.threshold) {
      rep.first_step = s.step;
      break;
    }
  reports_.push_back(rep);
  made.push_back(rep);
}

std::vector<SlowRankReport> SlowRankDetector::observe(std::int64_t step, const std::vector<RankStep>& ranks) {
  if (ranks.size() != group_.size())
    throw Error(fmt::format("slow-rank detector: {} ranks' times for {} ranks", ranks.size(), group_.size()));
  std::vector<SlowRankReport> made;
  own_ = own_times(ranks);
  if (++observed_ <= opts_.warmup) return made;
  for (int r = 0; r < int(ranks.size()); ++r)
    for (int p = 0; p < kStepPhases; ++p) {
      if (StepPhase(p) == StepPhase::other) continue;  // statistics and checkpoints: not a rank's speed
      Track& tr = tracks_[{r, p}];
      const auto score = factor_of(r, StepPhase(p), own_, tr);
      if (!std::isnan(score.first)) update(step, r, StepPhase(p), score, made);
    }
  return made;
}

std::vector<SlowRankReport> SlowRankDetector::active() const {
  std::vector<SlowRankReport> out;
  for (const auto& [key, tr] : tracks_) {
    if (!tr.reported) continue;
    SlowRankReport r;
    r.rank = key.first;
    r.host = hosts_[std::size_t(key.first)];
    r.phase = StepPhase(key.second);
    r.factor = tr.current;
    r.vs_peers = tr.vs_peers;
    for (auto it = reports_.rbegin(); it != reports_.rend(); ++it)
      if (it->rank == r.rank && it->phase == r.phase) {
        r.first_step = it->first_step;
        r.report_step = it->report_step;
        break;
      }
    out.push_back(r);
  }
  return out;
}

}  // namespace moeflex::train

namespace moeflex::train {

std::vector<std::string> gather_host_names(comm::Communicator& world) {
  constexpr std::size_t kLen = 64;
  char mine[kLen] = {};
  if (::gethostname(mine, kLen - 1) != 0) std::snprintf(mine, kLen, "unknown");
  std::vector<char> all(kLen * std::size_t(world.size()));
  world.all_gather_bytes(mine, all.data(), std::int64_t(kLen));
  std::vector<std::string> hosts;
  for (int r = 0; r < world.size(); ++r) hosts.emplace_back(all.data() + std::size_t(r) * kLen);
  return hosts;
}

SlowRankMonitor::SlowRankMonitor(comm::Communicator& world, SlowRankOptions opts, int every,
                                 std::vector<int> peer_group, std::filesystem::path phases_path)
    : world_(world),
      every_(std::max(every, 1)),
      detector_(opts, std::move(peer_group), gather_host_names(world)),
      phases_path_(std::move(phases_path)) {}

std::vector<SlowRankReport> SlowRankMonitor::add(std::int64_t step, const RankStep& mine, bool flush) {
  pending_.emplace_back(step, mine);
  if (int(pending_.size()) < every_ && !flush) return {};
  return this->flush();
}

std::vector<SlowRankReport> SlowRankMonitor::flush() {
  if (pending_.empty()) return {};
  // One record per step: the step, then seconds, comm_own and the expert rows.
  constexpr std::size_t kRecord = 2 + 2 * kStepPhases;
  const std::size_t n = pending_.size(), ranks = std::size_t(world_.size());
  std::vector<double> send(n * kRecord), recv(n * kRecord * ranks);
  for (std::size_t i = 0; i < n; ++i) {
    double* r = send.data() + i * kRecord;
    const RankStep& s = pending_[i].second;
    r[0] = double(pending_[i].first);
    r[1] = s.expert_rows;
    std::copy(s.times.seconds.begin(), s.times.seconds.end(), r + 2);
    std::copy(s.times.comm_own.begin(), s.times.comm_own.end(), r + 2 + kStepPhases);
  }
  world_.all_gather_bytes(send.data(), recv.data(), std::int64_t(send.size() * sizeof(double)));
  std::vector<SlowRankReport> made;
  for (std::size_t i = 0; i < n; ++i) {
    std::vector<RankStep> all(ranks);
    for (std::size_t q = 0; q < ranks; ++q) {
      const double* r = recv.data() + (q * n + i) * kRecord;
      all[q].expert_rows = r[1];
      std::copy(r + 2, r + 2 + kStepPhases, all[q].times.seconds.begin());
      std::copy(r + 2 + kStepPhases, r + kRecord, all[q].times.comm_own.begin());
    }
    for (SlowRankReport& rep : detector_.observe(pending_[i].first, all)) made.push_back(rep);
    if (!phases_path_.empty()) write_phases(pending_[i].first, all);
  }
  pending_.clear();
  return made;
}

void SlowRankMonitor::write_phases(std::int64_t step, const std::vector<RankStep>& ranks) {
  nlohmann::json line = {{"step", step}}, seconds = nlohmann::json::object(), own = nlohmann::json::object();
  for (int p = 0; p < kStepPhases; ++p) {
    nlohmann::json a = nlohmann::json::array(), b = nlohmann::json::array();
    for (std::size_t q = 0; q < ranks.size(); ++q) {
      a.push_back(ranks[q].times.seconds[std::size_t(p)]);
      b.push_back(detector_.last_own()[q].seconds[std::size_t(p)]);
    }
    seconds[to_string(StepPhase(p))] = std::move(a);
    own[to_string(StepPhase(p))] = std::move(b);
  }
  nlohmann::json rows = nlohmann::json::array();
  for (const RankStep& r : ranks) rows.push_back(r.expert_rows);
  line["seconds"] = std::move(seconds);
  line["own_seconds"] = std::move(own);
  line["expert_rows"] = std::move(rows);
  std::ofstream out(phases_path_, std::ios::app);
  out << line.dump() << '\n';
  if (!out) throw Error(fmt::format("cannot append to '{}'", phases_path_.string()));
}

}  // namespace moeflex::train
