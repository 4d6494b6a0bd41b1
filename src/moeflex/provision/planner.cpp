#include "moeflex/provision/planner.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "moeflex/provision/policies.h"

namespace moeflex {

namespace {

/// MOEFLEX_PLANNER_DEBUG set: every decision is printed to stderr (read once).
bool planner_debug() {
  static const bool on = std::getenv("MOEFLEX_PLANNER_DEBUG") != nullptr;
  return on;
}

/// Exposed seconds of not keeping `c`: its drop_seconds, or the op family's estimate.
double drop_cost(const SaveCandidate& c) {
  if (c.drop_seconds > 0) return c.drop_seconds;
  return (c.recomputable ? 1.0 : 4.0) * recompute_cost_per_byte(c.op) * 1e-12 * double(std::max<Bytes>(1, c.bytes));
}

double choice_cost(const std::vector<SaveCandidate>& candidates, const BlockChoice& choice) {
  double s = 0;
  for (const auto& c : candidates) {
    auto it = choice.find(c.name);
    if (it != choice.end() && it->second != Provision::save) s += drop_cost(c);
  }
  return s;
}

/// The block's part of each static policy that drops something here (policies.h):
/// what the policy recomputes among the candidates with a lineage, distinct choices.
std::vector<BlockChoice> static_levels(const std::vector<SaveCandidate>& candidates) {
  std::vector<BlockChoice> levels;
  for (const std::string& policy : static_policy_names()) {
    BlockChoice level;
    for (const auto& c : candidates)
      if (c.recomputable && static_policy_recomputes(policy, c.name)) level[c.name] = Provision::recompute;
    if (!level.empty() && std::find(levels.begin(), levels.end(), level) == levels.end()) levels.push_back(level);
  }
  return levels;
}

}  // namespace

Bytes AdaptivePlanner::margin() const {
  return arena_.unlimited() ? 0
                            : std::max(Bytes(double(arena_.budget()) * margin_fraction_),
                                       Arena::placement_reserve(arena_.budget()));
}

double recompute_cost_per_byte(const std::string& op) {
  // Arithmetic intensity of rebuilding one output byte (FLOP per byte, rough): a GEMM
  // output of [n, out] from [n, in] costs 2*in FLOP per element; elementwise ops ~1.
  if (op == "swiglu" || op == "rmsnorm" || op == "router" || op == "permute") return 1.0;
  if (op == "rope" || op == "linear" || op == "grouped_gemm") return 64.0;
  if (op == "attention") return 32.0;
  if (op == "cross_entropy") return 128.0;
  return 16.0;
}

Bytes BlockProjection::evaluate(const std::vector<SaveCandidate>& candidates, const BlockChoice& choice) const {
  Bytes dropped = 0, recomputed_first = 0, recomputed = 0, extra = 0, chunked = 0, chunks = 0;
  for (const auto& c : candidates) {
    auto it = choice.find(c.name);
    if (it == choice.end() || it->second == Provision::save) continue;
    const Bytes b = Arena::round_up(std::max<Bytes>(1, c.bytes));
    dropped += b;
    if (it->second == Provision::recompute) {
      recomputed += b;
      if (c.saved_first) recomputed_first += b;
      extra = std::max(extra, c.rebuild_extra);
      if (c.chunk_bytes > 0) {  // never allocated whole: one chunk of it while the experts run
        chunked += b;
        chunks += c.chunk_bytes;
      }
    }
  }
  // The experts' compute: kept whole, the chunked candidates are allocated before
  // any chunk runs, so every moment of it holds their bytes; dropped, a chunk's.
  const Bytes experts = compute > 0 ? compute - chunked + chunks : 0;
  return std::max({experts, tail - recomputed_first, landing - recomputed, held - dropped, prefetched - recomputed,
                   backward + extra, backward_rest, after});
}

Bytes BlockProjection::peak() const {
  return std::max({compute, tail, landing, held, prefetched, backward, backward_rest, after});
}

void AdaptivePlanner::plan_block(int mb, int layer, const std::vector<SaveCandidate>& candidates,
                                 const ProjectFn& project, const std::vector<std::int64_t>& cache_key) {
  const auto t0 = std::chrono::steady_clock::now();
  ++decisions_;
  BlockChoice choice;
  Bytes peak = 0, raw = 0;
  if (arena_.unlimited()) {
    peak = raw = project(nullptr).evaluate(candidates, choice);
  } else {
    // The margin is a soft target: the cheapest choice under budget - margin when
    // there is one, else the floor (the lowest peak, the most room left for
    // fragmentation), infeasible only when even that is over the budget less the
    // arena's placement reserve.
    const Bytes limit = arena_.budget() - margin();
    // The cache key adds the bytes in use, rounded up to 1/256 of the budget: a
    // cached choice was projected from the top of its bucket, so it still fits.
    const Bytes quantum = std::max<Bytes>(arena_.budget() / 256, Arena::kAlignment);
    std::vector<std::int64_t> key = cache_key;
    const Bytes bucket = (arena_.in_use() + margin() + quantum - 1) / quantum;
    key.push_back(bucket);
    const Bytes slack = bucket * quantum - (arena_.in_use() + margin());
    auto hit = cache_key.empty() ? cache_.end() : cache_.find(key);
    if (hit != cache_.end()) {
      ++cache_hits_;
      choice = hit->second.choice;
      peak = hit->second.peak;
      raw = hit->second.raw + (arena_.in_use() - hit->second.in_use);  // the same walk, shifted
    } else {
      const BlockProjection proj = project(nullptr);
      Bytes raw_exact = -1;
      bool cacheable = !cache_key.empty();
      auto projected = [&](const BlockChoice& c) { return proj.evaluate(candidates, c) + slack; };
      peak = projected(choice);
      if (peak > limit) {
        // Drop the cheapest exposed seconds per byte first; what has no lineage is offloaded.
        std::vector<const SaveCandidate*> order;
        for (const auto& c : candidates) order.push_back(&c);
        auto cost = [](const SaveCandidate* c) { return drop_cost(*c) / double(std::max<Bytes>(1, c->bytes)); };
        std::stable_sort(order.begin(), order.end(),
                         [&](const SaveCandidate* a, const SaveCandidate* b) { return cost(a) < cost(b); });
        BlockChoice most;
        for (const auto* c : order) most[c->name] = c->recomputable ? Provision::recompute : Provision::offload;
        Bytes floor = projected(most);
        if (floor > limit) {
          // The closed form is an upper bound: walk the floor exactly before giving up.
          // (Judged without the cache bucket's slack: such a decision is not cached.)
          const Bytes exact = project(&most).peak();
          choice = most;
          peak = exact;
          raw_exact = exact;
          cacheable = false;
          if (peak > arena_.budget() - Arena::placement_reserve(arena_.budget())) {
            ++infeasible_;
            if (planner_debug())
              std::fprintf(stderr, "infeasible mb %d layer %d: floor %.2f MiB > budget %.2f MiB\n", mb, layer,
                           peak / 1048576.0, arena_.budget() / 1048576.0);
          }
        } else {
          // Greedy in cost order, then put back what the budget still allows (a
          // large later drop can make smaller earlier ones unnecessary).
          std::size_t i = 0;
          for (; i < order.size() && peak > limit; ++i) {
            choice[order[i]->name] = most[order[i]->name];
            peak = projected(choice);
          }
          for (std::size_t j = i; j-- > 0;) {
            auto node = choice.extract(order[j]->name);  // try keeping it (no copy of the choice)
            const Bytes p = projected(choice);
            if (p <= limit) peak = p;
            else choice.insert(std::move(node));
          }
          // Greedy by cost per byte is not always the cheapest set (a knapsack): a
          // static policy's part of the block that fits for less exposed time wins.
          double best = choice_cost(candidates, choice);
          for (BlockChoice& level : static_levels(candidates)) {
            const Bytes p = projected(level);
            const double c = choice_cost(candidates, level);
            if (p <= limit && c < best) {
              best = c;
              peak = p;
              choice = std::move(level);
              ++static_level_choices_;
            }
          }
        }
      }
      // The prediction of the step's peak is exact: a choice other than keeping the
      // block whole (whose walk is exact) is walked once more as taken.
      raw = raw_exact >= 0 ? raw_exact : choice.empty() ? proj.evaluate(candidates, choice) : project(&choice).peak();
      if (cacheable) cache_[key] = {choice, peak, raw, arena_.in_use()};
    }
  }
  projected_peak_ = std::max(projected_peak_, peak);
  predicted_step_peak_ = std::max(arena_.peak(), raw);
  if (planner_debug()) {
    std::size_t dropped = choice.size();
    std::fprintf(stderr,
                 "plan mb %d layer %d: in use %.1f MiB (step peak so far %.1f), %zu of %zu dropped, projected peak "
                 "%.1f MiB\n",
                 mb, layer, arena_.in_use() / 1048576.0, arena_.peak() / 1048576.0, dropped, candidates.size(),
                 peak / 1048576.0);
  }
  for (const auto& c : candidates) {
    auto it = choice.find(c.name);
    current_[{mb, layer, c.name}] = it == choice.end() ? Provision::save : it->second;
  }
  decision_seconds_.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

Provision AdaptivePlanner::decide(const LedgerEntry& e) const {
  auto it = current_.find({e.microbatch, e.layer, e.name});
  return it == current_.end() ? Provision::save : it->second;
}

bool AdaptivePlanner::plan_weight_reads(const std::function<Bytes(bool offload)>& project) {
  ++weight_read_decisions_;
  Bytes raw = project(false);
  const bool offload = !arena_.unlimited() && raw > arena_.budget() - margin();
  if (offload) {
    raw = project(true);
    ++weight_read_offloads_;
    if (raw > arena_.budget() - Arena::placement_reserve(arena_.budget())) {
      ++infeasible_;
      if (planner_debug())
        std::fprintf(stderr, "infeasible W reads: floor %.2f MiB > budget %.2f MiB\n", raw / 1048576.0,
                     arena_.budget() / 1048576.0);
    }
  }
  projected_peak_ = std::max(projected_peak_, raw);
  predicted_step_peak_ = std::max(arena_.peak(), raw);
  return offload;
}

void AdaptivePlanner::end_step() {
  current_.clear();
  infeasible_ = 0;
  static_level_choices_ = 0;
  predicted_step_peak_ = 0;
  decision_seconds_.clear();
  projected_peak_ = 0;
}

}  // namespace moeflex
