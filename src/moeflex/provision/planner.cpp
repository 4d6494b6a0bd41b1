#include "moeflex/provision/planner.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>

namespace moeflex {

double recompute_cost_per_byte(const std::string& op) {
  // Arithmetic intensity of rebuilding one output byte (FLOP per byte, rough): a GEMM
  // output of [n, out] from [n, in] costs 2*in FLOP per element; elementwise ops ~1.
  if (op == "swiglu" || op == "rmsnorm" || op == "router" || op == "permute") return 1.0;
  if (op == "rope" || op == "linear" || op == "grouped_gemm") return 64.0;
  if (op == "attention") return 32.0;
  if (op == "cross_entropy") return 128.0;
  return 16.0;
}

void AdaptivePlanner::plan_layer(int mb, int layer, const std::vector<SaveCandidate>& entries, Bytes floor_after,
                                 std::int64_t tokens) {
  const auto t0 = std::chrono::steady_clock::now();
  ++decisions_;
  const Bytes budget = arena_.unlimited() ? -1 : arena_.budget();
  Bytes total = 0;
  for (auto& e : entries) total += Arena::round_up(e.bytes);
  // A working-set reserve: what earlier steps needed beyond the stash, and at least
  // this layer's own size (its backward re-materialises what is recomputed).
  // Fragmentation margin: free bytes that no single block can serve right now.
  const Bytes frag = arena_.unlimited() ? 0 : (budget - arena_.in_use()) - arena_.largest_free_block();
  // The backward of a layer holds its activations (rebuilt ones included) and their
  // gradients at once: about twice the layer.
  // Plus 2% of the budget against allocator fragmentation still to come.
  const Bytes reserve = std::max(transient_, 2 * total) + std::max<Bytes>(0, frag) + (budget > 0 ? budget / 50 : 0);
  // The layer's tensors are alive now: what stays held afterwards is the rest plus `keep`.
  const Bytes held = std::max<Bytes>(0, arena_.in_use() - total);
  std::map<std::string, Provision> choice;
  for (auto& e : entries) choice[e.name] = Provision::save;
  Bytes keep = total;
  auto projected = [&] { return held + keep + floor_after + reserve; };
  if (budget > 0 && projected() > budget) {
    // Cache by layer, token bucket (1/16 of the layer's size) and memory bucket.
    const Bytes unit = std::max<Bytes>(total / 16, Arena::kAlignment);
    const auto key = std::make_tuple(layer, tokens / std::max<std::int64_t>(1, tokens / 16 + 1),
                                     (budget - held - floor_after - reserve) / unit);
    if (auto it = cache_.find(key); it != cache_.end()) {
      ++cache_hits_;
      choice = it->second;
      keep = 0;
      for (auto& e : entries)
        if (choice[e.name] == Provision::save) keep += Arena::round_up(e.bytes);
    } else {
      // Drop the cheapest bytes to rebuild first; then offload what has no lineage.
      std::vector<const SaveCandidate*> order;
      for (auto& e : entries) order.push_back(&e);
      std::stable_sort(order.begin(), order.end(), [](const SaveCandidate* a, const SaveCandidate* b) {
        if (a->recomputable != b->recomputable) return a->recomputable;
        return recompute_cost_per_byte(a->op) < recompute_cost_per_byte(b->op);
      });
      for (const SaveCandidate* e : order) {
        if (projected() <= budget) break;
        choice[e->name] = e->recomputable ? Provision::recompute : Provision::offload;
        keep -= Arena::round_up(e->bytes);
      }
      cache_[key] = choice;
    }
  }
  projected_peak_ = std::max(projected_peak_, projected());
  if (std::getenv("MOEFLEX_PLANNER_DEBUG"))
    std::fprintf(stderr, "plan mb %d layer %d: held %.1f total %.1f keep %.1f floor %.1f reserve %.1f (frag %.1f) -> %.1f MiB\n",
                 mb, layer, held / 1048576.0, total / 1048576.0, keep / 1048576.0, floor_after / 1048576.0,
                 reserve / 1048576.0, frag / 1048576.0, projected() / 1048576.0);
  for (auto& [name, p] : choice) current_[{mb, layer, name}] = p;
  decision_seconds_.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

Provision AdaptivePlanner::decide(const LedgerEntry& e) const {
  auto it = current_.find({e.microbatch, e.layer, e.name});
  return it == current_.end() ? Provision::save : it->second;
}

void AdaptivePlanner::end_step(Bytes stash_peak) {
  // Transient = the arena's peak beyond persistent state and stashed activations.
  const Bytes persistent = arena_.stat(MemCategory::weights).current + arena_.stat(MemCategory::grads).current +
                           arena_.stat(MemCategory::optimizer).current;
  const Bytes transient = arena_.peak() - persistent - stash_peak;
  transient_ = std::max(transient_, transient);
  current_.clear();
  decision_seconds_.clear();
  projected_peak_ = 0;
}

}  // namespace moeflex
