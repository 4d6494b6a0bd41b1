// Enumerate, prune, simulate, rank (see search.h).
#include "moeflex/search/search.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <exception>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>

#include "moeflex/comm/layout.h"
#include "moeflex/schedule/generators.h"
#include "moeflex/core/error.h"

namespace moeflex::search {

namespace {

// The one load ratio every candidate's times are scored at: the top of the calm range,
// or the ratio of --imbalance constant=R.
double scored_ratio(const sim::LoadModel& l) { return l.constant > 0 ? l.constant : std::max(1.0, l.calm_max); }

}  // namespace

namespace {

using nlohmann::json;

std::vector<int> divisors(int n) {
  std::vector<int> v;
  for (int i = 1; i <= n; ++i)
    if (n % i == 0) v.push_back(i);
  return v;
}

/// Expected effective TGS of a static policy whose spike does not fit: each
/// spiking iteration costs a restart and, on average, half a checkpoint interval.
double expected_effective(double tgs, Seconds step, double p_oom, const SearchOptions& o) {
  const Seconds loss = p_oom * (o.restart_seconds + step * (0.5 * o.checkpoint_interval + 1));
  return tgs * step / (step + loss);
}

/// Whether two walked candidates differ at most in their policy: the same layout,
/// schedule and micro-batches, and bit for bit the same simulated result (step time,
/// recompute time, bubble, calm and spike peaks, OOM risk). Close is not the same.
/// The same layout, schedule and micro-batches: two candidates that differ at most in
/// their policy.
bool siblings(const Candidate& a, const Candidate& b) {
  const sim::ParallelSpec &x = a.parallel, &y = b.parallel;
  return x.tp == y.tp && x.pp == y.pp && x.vpp == y.vpp && x.ep == y.ep && x.dp == y.dp && a.schedule == b.schedule &&
         a.micro_batch_size == b.micro_batch_size && a.num_microbatches == b.num_microbatches;
}

bool same_result(const Candidate& a, const Candidate& b) {
  return siblings(a, b) && a.step_time == b.step_time && a.recompute_time == b.recompute_time && a.tgs == b.tgs &&
         a.effective_tgs == b.effective_tgs && a.mfu == b.mfu && a.bubble == b.bubble && a.peak_bytes == b.peak_bytes &&
         a.spike_peak_bytes == b.spike_peak_bytes && a.oom_probability == b.oom_probability;
}

/// Adds `policy` to `row`'s equivalent policies, kept in the order of `order` (the
/// search's policies); the first of them becomes the row's policy.
void join_policy(Candidate& row, const std::string& policy, const std::vector<std::string>& order) {
  row.equivalent_policies.push_back(policy);
  auto rank = [&](const std::string& p) { return std::find(order.begin(), order.end(), p) - order.begin(); };
  std::stable_sort(row.equivalent_policies.begin(), row.equivalent_policies.end(),
                   [&](const std::string& x, const std::string& y) { return rank(x) < rank(y); });
  row.policy = row.equivalent_policies.front();
}

}  // namespace

std::string Candidate::policy_label() const {
  if (equivalent_policies.size() <= 1) return policy;
  std::string s;
  for (const auto& p : equivalent_policies) s += (s.empty() ? "" : "=") + p;
  return s;
}

json Candidate::to_json() const {
  return {
      {"parallel", parallel.str()},
      {"schedule", schedule},
      {"policy", policy},
      {"micro_batch_size", micro_batch_size},
      {"num_microbatches", num_microbatches},
      {"step_time_s", step_time},
      {"tgs", tgs},
      {"effective_tgs", effective_tgs},
      {"mfu", mfu},
      {"bubble_fraction", bubble},
      {"peak_bytes", peak_bytes},
      {"spike_peak_bytes", spike_peak_bytes},
      {"oom_probability", oom_probability},
      {"recompute_s", recompute_time},
      {"equivalent_policies", equivalent_policies.empty() ? std::vector<std::string>{policy} : equivalent_policies}};
}

SearchResult search(const SearchOptions& o) {
  const auto t0 = std::chrono::steady_clock::now();
  SearchResult res;
  const ModelConfig& cfg = o.model;
  const int L = int(cfg.num_hidden_layers), E = int(cfg.num_experts);
  const std::int64_t G = o.global_batch_or_default();
  const Bytes limit = o.cluster.usable_memory();
  std::vector<Candidate> timed;
  Bytes smallest_persistent = -1;
  auto cache = std::make_shared<sim::SimCache>(o.cluster.profile);
  // A progress line at most every progress_seconds (any thread may call it).
  std::mutex progress_mu;
  auto last_progress = std::chrono::steady_clock::now();
  auto report = [&](const auto& line_of) {
    if (!o.progress) return;
    std::lock_guard lk(progress_mu);
    const auto now = std::chrono::steady_clock::now();
    if (std::chrono::duration<double>(now - last_progress).count() < o.progress_seconds) return;
    last_progress = now;
    o.progress(fmt::format("search: {} ({:.0f} s)", line_of(), std::chrono::duration<double>(now - t0).count()));
  };
  sim::LoadModel calm = o.loads;
  calm.constant = scored_ratio(o.loads);
  // The simulation options of a candidate: times at the calm load, with or without the memory walks.
  auto options_for = [&](const Candidate& c, bool walk) {
    sim::SimOptions so;
    so.model = cfg;
    so.cluster = o.cluster;
    so.parallel = c.parallel;
    so.schedule = c.schedule;
    so.policy = c.policy;
    so.micro_batch_size = c.micro_batch_size;
    so.seq_len = o.seq_len;
    so.global_batch = G;
    so.loads = calm;
    so.walk_memory = walk;
    if (walk) so.spike_check = o.loads.max_ratio();
    so.overlap_pair_comm = o.cluster.element_bytes < 4;
    so.dispatcher = o.dispatcher;
    so.cache = cache;
    return so;
  };
  // The CPU engine (a cluster of processes, this-machine) has no tensor parallelism:
  // only layouts `moeflex train` can run there.
  const std::vector<int> tps = o.cluster.per_tensor_gradient_reduce ? std::vector<int>{1} : o.tps;
  for (int tp : tps) {
    if (o.gpus % tp != 0) continue;
    for (int pp : divisors(o.gpus / tp)) {
      if (pp > L) continue;
      const int dp = o.gpus / (tp * pp);
      for (int ep : divisors(tp * dp)) {  // MoE parallel folding: ep x expert_dp = tp x dp
        for (const auto& sched : o.schedules) {
          std::vector<int> vpps = {1};
          if (sched == "interleaved") vpps = o.vpps;
          // Megatron-Core's EP overlap: with virtual pipelining when pp > 1, alone without.
          if (sched == "1f1b-overlap" && pp > 1) vpps = o.vpps;
          for (int vpp : vpps) {
            for (int mbs : o.micro_batch_sizes) {
              for (const auto& pol : o.policies) {
                ++res.enumerated;
                report([&] {
                  return fmt::format("enumerating: {} combinations, {} invalid, {} do not fit (tp {}, pp {}, ep {})",
                                     res.enumerated, res.invalid, res.no_fit, tp, pp, ep);
                });
                Candidate c;
                c.parallel = {tp, pp, vpp, ep, dp};
                c.schedule = sched;
                c.policy = pol;
                c.micro_batch_size = mbs;
                // 1. arithmetic rules
                const std::int64_t per = std::int64_t(dp) * mbs;
                const bool dualv = sched == "dualpipev";
                const int stages = pp * (dualv ? 2 : vpp);
                bool ok = G % per == 0 && E % ep == 0 && cfg.num_attention_heads % tp == 0 &&
                          cfg.kv_heads() % tp == 0 && tp <= o.cluster.gpus_per_node && (mbs * o.seq_len) % tp == 0 &&
                          stages <= L &&
                          // without a pipeline, 1f1b suffices (and 1f1b-overlap, whose pairs hide comm)
                          !(pp == 1 && ((sched != "1f1b" && sched != "1f1b-overlap") || vpp != 1));
                const int m = ok ? int(G / per) : 0;
                if (ok && sched == "interleaved") ok = m % pp == 0 && pp > 1;
                // Megatron-Core's EP overlap hides expert all-to-alls: none without EP, none on
                // a cluster whose pairs hide nothing (fp32 processes: overlap_pair_comm), and
                // no pair at all when m == pp (all forwards first): interleaved's plan with more
                // memory, never better.
                if (ok && sched == "1f1b-overlap") ok = m % pp == 0 && m > pp && ep > 1 && o.cluster.element_bytes < 4;
                if (ok && dualv) ok = m >= 2 * pp;
                if (ok && m > 4096) ok = false;
                if (!ok) {
                  ++res.invalid;
                  continue;
                }
                c.num_microbatches = m;
                // 2. memory lower bound: the persistent bytes alone
                Bytes persist = 0;
                try {
                  persist = sim::max_persistent_bytes(options_for(c, false));
                } catch (const ConfigError&) {
                  ++res.invalid;
                  continue;
                }
                if (smallest_persistent < 0 || persist < smallest_persistent) smallest_persistent = persist;
                if (persist > limit) {
                  ++res.no_fit;
                  continue;
                }
                c.peak_bytes = persist;
                timed.push_back(c);
              }
            }
          }
        }
      }
    }
  }
  // 3. times at the calm load, no walks: independent simulations, spread over threads
  // (the shared layer-cost cache is locked; each result goes to its own slot).
  // Without its memory walk an adaptive candidate saves everything (the simulator
  // times it as `none`), so a layout's adaptive and none candidates take one
  // simulation: `unique` lists the candidates simulated, `source[i]` the one whose
  // times candidate i takes.
  std::vector<std::size_t> unique, source(timed.size());
  {
    std::map<std::tuple<std::string, std::string, std::string, std::int64_t>, std::size_t> first;
    for (std::size_t i = 0; i < timed.size(); ++i) {
      const Candidate& c = timed[i];
      const auto key = std::make_tuple(c.parallel.str(), c.schedule, c.policy == "adaptive" ? "none" : c.policy,
                                       std::int64_t(c.micro_batch_size));
      const auto [at, fresh] = first.emplace(key, i);
      source[i] = at->second;
      if (fresh) unique.push_back(i);
    }
  }
  {
    const int threads = std::max(
        1, std::min<int>(o.threads > 0 ? o.threads : int(std::thread::hardware_concurrency()), int(unique.size())));
    std::atomic<std::size_t> next{0}, done{0};
    std::exception_ptr failure;
    std::mutex failure_mu;
    auto work = [&] {
      for (std::size_t u; (u = next.fetch_add(1)) < unique.size();) {
        const std::size_t i = unique[u];
        try {
          Candidate& c = timed[i];
          const sim::SimReport r = sim::simulate(options_for(c, false));
          c.step_time = r.step_time;
          c.tgs = c.effective_tgs = r.tgs;
          c.mfu = r.mfu;
          c.bubble = r.bubble_fraction;
          ++done;
          report([&] { return fmt::format("timing: {}/{} simulations", done.load(), unique.size()); });
        } catch (const ConfigError& e) {  // a layout the rules of step 1 let through: name it
          const Candidate& c = timed[i];
          std::lock_guard lk(failure_mu);
          if (!failure)
            failure = std::make_exception_ptr(
                ConfigError(fmt::format("search: simulating {} {} {} mbs {}: {}", c.parallel.str(), c.schedule,
                                        c.policy, c.micro_batch_size, e.what())));
          next = unique.size();
        } catch (...) {
          std::lock_guard lk(failure_mu);
          if (!failure) failure = std::current_exception();
          next = unique.size();
        }
      }
    };
    std::vector<std::thread> pool;
    for (int t = 1; t < threads; ++t) pool.emplace_back(work);
    work();
    for (auto& t : pool) t.join();
    if (failure) std::rethrow_exception(failure);
    for (std::size_t i = 0; i < timed.size(); ++i) {
      if (source[i] == i) continue;
      const Candidate& s = timed[source[i]];
      Candidate& c = timed[i];
      c.step_time = s.step_time;
      c.tgs = c.effective_tgs = s.tgs;
      c.mfu = s.mfu;
      c.bubble = s.bubble;
    }
    res.timed = std::int64_t(timed.size());
    res.simulations = std::int64_t(unique.size());
  }
  // 4. memory walks in order of the bound, branch and bound on the objective.
  const bool by_memory = o.objective == "memory";
  if (!by_memory && o.objective != "tgs")
    throw ConfigError(fmt::format("--objective '{}': expected tgs or memory", o.objective));
  // Ties broken by layout, schedule, micro-batch size and the order of the policies, so
  // that the walks, and which of two equal rows is kept, do not depend on the sort.
  auto policy_rank = [&](const std::string& p) {
    return std::find(o.policies.begin(), o.policies.end(), p) - o.policies.begin();
  };
  std::sort(timed.begin(), timed.end(), [&](const Candidate& a, const Candidate& b) {
    const double ka = by_memory ? -double(a.peak_bytes) : a.tgs, kb = by_memory ? -double(b.peak_bytes) : b.tgs;
    if (ka != kb) return ka > kb;
    const sim::ParallelSpec &x = a.parallel, &y = b.parallel;
    const auto la = std::make_tuple(x.tp, x.pp, x.vpp, x.ep, x.dp, a.schedule, a.micro_batch_size);
    const auto lb = std::make_tuple(y.tp, y.pp, y.vpp, y.ep, y.dp, b.schedule, b.micro_batch_size);
    if (la != lb) return la < lb;
    return policy_rank(a.policy) < policy_rank(b.policy);
  });
  std::vector<Candidate> best;
  std::vector<Candidate> below;  // walked, fit, and pushed out of the top
  auto worst_kept = [&]() { return best.size() < std::size_t(o.top) ? -1.0 : by_memory ? -double(best.back().peak_bytes) : best.back().effective_tgs; };
  for (Candidate& c : timed) {
    const double bound = by_memory ? -double(c.peak_bytes) : c.tgs;
    if (best.size() >= std::size_t(o.top)) {
      const double worst = worst_kept();
      if (bound < worst) break;
      // At the bound of the last row kept, only a sibling of a kept row is walked: it may
      // join that row (adaptive timed as none has none's bound); anything else ties at
      // best and would not displace it.
      if (bound == worst && std::none_of(best.begin(), best.end(), [&](const Candidate& b) { return siblings(b, c); }))
        continue;
    }
    report([&] { return fmt::format("memory walks: {} walked of {} candidates, {} kept", res.walked, timed.size(), best.size()); });
    // Adaptive provisioning below the trainer's minimum budget would be refused by `moeflex train`.
    if (c.policy == "adaptive" && sim::adaptive_minimum_budget(options_for(c, true)) > limit) {
      ++res.no_fit;
      continue;
    }
    const sim::SimReport r = sim::simulate(options_for(c, true));
    ++res.walked;
    if (r.peak_bytes > limit) {
      ++res.no_fit;
      continue;
    }
    c.walked = true;
    c.step_time = r.step_time;
    c.tgs = r.tgs;
    c.mfu = r.mfu;
    c.bubble = r.bubble_fraction;
    c.recompute_time = r.recompute_time;
    c.peak_bytes = r.peak_bytes;
    c.spike_peak_bytes = r.spike_peak_bytes;
    c.oom_probability = r.spike_peak_bytes > limit ? o.loads.probability_above(o.loads.calm_max) : 0.0;
    c.effective_tgs = expected_effective(c.tgs, c.step_time, c.oom_probability, o);
    c.equivalent_policies = {c.policy};
    // The same result as a row kept (or pushed out) under another policy: one row for
    // both (adaptive whose budget lets it save everything is `none`).
    Candidate* twin = nullptr;
    for (auto* rows : {&best, &below})
      for (Candidate& b : *rows)
        if (!twin && same_result(b, c)) twin = &b;
    if (twin) {
      join_policy(*twin, c.policy, o.policies);
      ++res.merged;
      continue;
    }
    best.push_back(c);
    std::sort(best.begin(), best.end(), [&](const Candidate& a, const Candidate& b) {
      return by_memory ? a.peak_bytes < b.peak_bytes : a.effective_tgs > b.effective_tgs;
    });
    if (best.size() > std::size_t(o.top)) {
      below.push_back(std::move(best.back()));
      best.pop_back();
    }
  }
  if (best.empty()) {
    if (smallest_persistent < 0)  // nothing passed the layout and schedule rules
      throw ConfigError(fmt::format(
          "no layout of {} for the {}-parameter model on {} GPUs passes the layout and schedule rules ({} "
          "combinations, all invalid): tp "
          "divides the heads and fits a node, ep divides tp x dp and the experts, the global batch {} splits into dp "
          "x micro-batch size, interleaved and 1f1b-overlap need m % pp == 0 (1f1b-overlap also ep > 1, m > pp and a "
          "bf16 cluster), dualpipev m >= 2 pp",
          o.cluster.name, format_count(double(cfg.num_params())), o.gpus, res.enumerated, G));
    throw ConfigError(
        fmt::format("no layout of {} for the {}-parameter model on {} GPUs fits {:.2f} GiB per device "
                    "(smallest persistent "
                    "footprint seen: {:.2f} GiB; {} combinations, {} invalid)",
                    o.cluster.name, format_count(double(cfg.num_params())), o.gpus, double(limit) / double(kGiB),
                    double(smallest_persistent) / double(kGiB), res.enumerated, res.invalid));
  }
  res.top = std::move(best);
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return res;
}

json SearchResult::to_json(const SearchOptions& o) const {
  json top_j = json::array();
  for (const auto& c : top) top_j.push_back(c.to_json());
  return {{"model_params", o.model.num_params()},
          {"cluster", o.cluster.name},
          {"hardware_profile", o.cluster.profile.name},
          {"gpus", o.gpus},
          {"objective", o.objective},
          {"global_batch", o.global_batch_or_default()},
          {"seq_len", o.seq_len},
          {"enumerated", enumerated},
          {"invalid", invalid},
          {"no_fit", no_fit},
          {"timed", timed},
          {"simulations", simulations},
          {"walked", walked},
          {"merged", merged},
          {"seconds", seconds},
          // Times are scored at one constant ratio (simulate --imbalance constant=R reproduces
          // a row's); the distribution prices OOM risk and the spike peak.
          {"loads", fmt::format("times at constant ratio {} (simulate --imbalance constant={}); memory and OOM "
                                "risk from {}",
                                scored_ratio(o.loads), scored_ratio(o.loads), o.loads.describe())},
          {"dispatcher", o.dispatcher},
          {"top", top_j}};
}

std::string SearchResult::format(const SearchOptions& o) const {
  std::string s = fmt::format(
      "{}-parameter model on {} x {}, global batch {} x {} tokens, {} dispatcher: {} combinations, {} invalid, {} do "
      "not fit, {} timed ({} simulations), {} walked, {} merged into a row of another policy with the same result, "
      "{:.1f} s\n\n",
      format_count(double(o.model.num_params())), o.gpus, o.cluster.name, o.global_batch_or_default(), o.seq_len,
      o.dispatcher, enumerated, invalid, no_fit, timed, simulations, walked, merged, seconds);
  // A merged row's policy lists its equivalent policies: none=adaptive.
  std::size_t w = 10;
  for (const auto& c : top) w = std::max(w, c.policy_label().size());
  s += fmt::format("{:>3} {:<30} {:<12} {:<{}} {:>3} {:>4} {:>9} {:>9} {:>6} {:>7} {:>9} {:>9} {:>6}\n", "#", "layout",
                   "schedule", "policy", w, "mbs", "m", "TGS", "eff. TGS", "MFU", "bubble", "peak GiB", "spike GiB",
                   "P(oom)");
  int i = 0;
  for (const auto& c : top)
    s += fmt::format(
        "{:>3} {:<30} {:<12} {:<{}} {:>3} {:>4} {:>9.1f} {:>9.1f} {:>5.1f}% {:>6.1f}% {:>9.2f} {:>9.2f} {:>6.3f}\n",
        ++i, c.parallel.str(), c.schedule, c.policy_label(), w, c.micro_batch_size, c.num_microbatches, c.tgs,
        c.effective_tgs, 100 * c.mfu, 100 * c.bubble, double(c.peak_bytes) / double(kGiB),
        double(c.spike_peak_bytes) / double(kGiB), c.oom_probability);
  return s;
}

}  // namespace moeflex::search
