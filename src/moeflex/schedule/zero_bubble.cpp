// ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 3.1,
// https://arxiv.org/abs/2401.10241): 1F1B's F/B order with the backward split
// into B (input gradient, on the critical path) and W (weight gradient, free to
// move). Rank r defers its Ws by r micro-batches: the Bs reach the first ranks
// sooner, and the r held-back Ws fill rank r's cool-down bubble. Every rank then
// holds min(p, m) micro-batches between F and W, the first rank's 1F1B peak.
#include <algorithm>
#include <deque>
#include <numeric>

#include "moeflex/schedule/generator_util.h"
#include "moeflex/schedule/generators.h"

namespace moeflex {

using schedule_detail::emit;
using schedule_detail::invariant;
using schedule_detail::require;

StepPlan zb_h1(int p, int m) {
  const std::string name = "zb-h1";
  require(p >= 1, name, "pp", p, "needs at least one pipeline rank");
  require(m >= 1, name, "num_microbatches", m, "needs at least one micro-batch");
  std::vector<int> stage_rank(p);
  std::iota(stage_rank.begin(), stage_rank.end(), 0);
  StepPlan plan = schedule_detail::empty_plan(name, p, m, std::move(stage_rank));

  for (int r = 0; r < p; ++r) {
    const int warmup = std::min(p - r - 1, m);  // as 1F1B
    const int steady = m - warmup;             // (F, B, W?) triples
    const int cooldown = warmup;               // (B, W?) pairs
    const int deferred = r;                    // Ws held back behind their B
    int next_f = 0, next_b = 0;
    std::deque<int> pending_w;  // micro-batches whose B ran and whose W has not
    auto backward_input = [&] {
      emit(plan, r, ActionKind::BackwardInput, next_b, r);
      pending_w.push_back(next_b++);
      if (static_cast<int>(pending_w.size()) > deferred) {
        emit(plan, r, ActionKind::BackwardWeight, pending_w.front(), r);
        pending_w.pop_front();
      }
    };
    // Warm-up: forwards only.
    for (int i = 0; i < warmup; ++i) emit(plan, r, ActionKind::Forward, next_f++, r);
    // Steady: F, B, and the W of the micro-batch `deferred` places back.
    for (int i = 0; i < steady; ++i) {
      emit(plan, r, ActionKind::Forward, next_f++, r);
      backward_input();
    }
    // Cool-down: the remaining Bs, each followed by a held-back W.
    for (int i = 0; i < cooldown; ++i) backward_input();
    // Flush: the Ws still held back.
    const int flush = static_cast<int>(pending_w.size());
    invariant(flush == std::min(deferred, m), name,
              "rank " + std::to_string(r) + " ends with min(r, m) deferred Ws");
    for (int mb : pending_w) emit(plan, r, ActionKind::BackwardWeight, mb, r);
    invariant(next_f == m && next_b == m && plan.actions[r].size() == static_cast<size_t>(3 * m), name,
              "rank " + std::to_string(r) + " ran m F, m B and m W");
  }
  insert_communication(plan);
  return plan;
}

}  // namespace moeflex
