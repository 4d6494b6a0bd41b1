// GPipe, Megatron's 1F1B and Megatron's interleaved 1F1B: fused backward (B+W),
// written as warm-up / steady / cool-down with closed-form counts.
#include <algorithm>
#include <numeric>

#include "moeflex/schedule/generator_util.h"
#include "moeflex/schedule/generators.h"

namespace moeflex {

using schedule_detail::emit;
using schedule_detail::invariant;
using schedule_detail::require;

namespace {

// One stage per rank: stage s on rank s.
std::vector<int> one_stage_per_rank(int p) {
  std::vector<int> stage_rank(p);
  std::iota(stage_rank.begin(), stage_rank.end(), 0);
  return stage_rank;
}

void require_pm(const std::string& name, int p, int m) {
  require(p >= 1, name, "pp", p, "needs at least one pipeline rank");
  require(m >= 1, name, "num_microbatches", m, "needs at least one micro-batch");
}

}  // namespace

StepPlan gpipe(int p, int m) {
  require_pm("gpipe", p, m);
  StepPlan plan = schedule_detail::empty_plan("gpipe", p, m, one_stage_per_rank(p));
  for (int r = 0; r < p; ++r) {
    // Phase 1: all m forwards. Phase 2: all m backwards.
    for (int i = 0; i < m; ++i) emit(plan, r, ActionKind::Forward, i, r);
    for (int i = 0; i < m; ++i) emit(plan, r, ActionKind::Backward, i, r);
    invariant(plan.actions[r].size() == static_cast<size_t>(2 * m), "gpipe", "2m actions per rank");
  }
  insert_communication(plan);
  return plan;
}

StepPlan one_f_one_b(int p, int m) {
  require_pm("1f1b", p, m);
  StepPlan plan = schedule_detail::empty_plan("1f1b", p, m, one_stage_per_rank(p));
  for (int r = 0; r < p; ++r) {
    const int warmup = std::min(p - r - 1, m);  // forwards before the first backward
    const int steady = m - warmup;             // (F, B) pairs
    const int cooldown = warmup;               // backwards left after the last forward
    int next_f = 0, next_b = 0;
    for (int i = 0; i < warmup; ++i) emit(plan, r, ActionKind::Forward, next_f++, r);
    for (int i = 0; i < steady; ++i) {
      emit(plan, r, ActionKind::Forward, next_f++, r);
      emit(plan, r, ActionKind::Backward, next_b++, r);
    }
    for (int i = 0; i < cooldown; ++i) emit(plan, r, ActionKind::Backward, next_b++, r);
    invariant(next_f == m && next_b == m, "1f1b", "rank " + std::to_string(r) + " ran m forwards and m backwards");
  }
  insert_communication(plan);
  return plan;
}

namespace {

// Megatron's interleaved 1F1B; with `overlap`, Megatron-Core's combined 1F1B
// (--overlap-moe-expert-parallel-comm): one more warm-up forward, and every
// steady-state forward runs as an overlapped pair with the backward after it.
// The extra forward is what makes the pair possible: without it the steady
// phase's backward would need the forward it is paired with (on the last rank,
// B(k) consumes the output of the F just before it).
StepPlan interleaved_plan(const std::string& name, int p, int m, int v, bool overlap) {
  require_pm(name, p, m);
  require(v >= 1, name, "vpp", v, "needs at least one model chunk per rank");
  require(m % p == 0, name, "num_microbatches", m,
          "must be a multiple of pp = " + std::to_string(p) + " (Megatron's interleaved schedule)");
  std::vector<int> stage_rank(p * v);
  for (int s = 0; s < p * v; ++s) stage_rank[s] = s % p;  // stage = chunk * p + rank
  StepPlan plan = schedule_detail::empty_plan(name, p, m, std::move(stage_rank));

  const int total = m * v;  // (micro-batch, chunk) forwards per rank
  for (int r = 0; r < p; ++r) {
    // Megatron walks micro-batches in groups of p: the k-th forward of a rank is
    // micro-batch (k / (p v)) * p + k % p of chunk (k % (p v)) / p; the k-th
    // backward is the same micro-batch of the mirrored chunk v-1-chunk.
    auto microbatch = [&](int k) { return (k / (p * v)) * p + k % p; };
    auto forward_stage = [&](int k) { return ((k % (p * v)) / p) * p + r; };
    auto backward_stage = [&](int k) { return (v - 1 - (k % (p * v)) / p) * p + r; };

    const int warmup = m == p ? total : std::min((p - r - 1) * 2 + (v - 1) * p + (overlap ? 1 : 0), total);
    const int steady = total - warmup;
    const int cooldown = warmup;
    int next_f = 0, next_b = 0;
    for (int i = 0; i < warmup; ++i, ++next_f)
      emit(plan, r, ActionKind::Forward, microbatch(next_f), forward_stage(next_f));
    for (int i = 0; i < steady; ++i, ++next_f, ++next_b) {
      emit(plan, r, ActionKind::Forward, microbatch(next_f), forward_stage(next_f), /*overlapped_with_next=*/overlap);
      emit(plan, r, ActionKind::Backward, microbatch(next_b), backward_stage(next_b));
    }
    for (int i = 0; i < cooldown; ++i, ++next_b)
      emit(plan, r, ActionKind::Backward, microbatch(next_b), backward_stage(next_b));
    invariant(next_f == total && next_b == total, name,
              "rank " + std::to_string(r) + " ran m*v forwards and m*v backwards");
  }
  insert_communication(plan);
  return plan;
}

}  // namespace

StepPlan interleaved_1f1b(int p, int m, int v) { return interleaved_plan("interleaved", p, m, v, false); }

StepPlan combined_1f1b(int p, int m, int v) { return interleaved_plan("1f1b-overlap", p, m, v, true); }

}  // namespace moeflex
