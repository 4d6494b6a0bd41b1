// DualPipeV: DeepSeek's V-shaped, "cut-in-half" DualPipe (DeepSeek-V3 technical
// report, arXiv 2412.19437; the V form from Sea AI Lab's blog
// https://hackmd.io/@ufotalent/r1lVXsa9Jg), following the phase structure of
// https://github.com/deepseek-ai/DualPipe dualpipe/dualpipev.py (Steps 1..8).
//
// p ranks hold 2p stages in a V: rank r holds stage r ("phase 0", going down)
// and stage 2p-1-r ("phase 1", coming back up). A micro-batch enters on rank 0,
// runs down to rank p-1 (stage p-1, then stage p on the same rank: a local
// hand-off) and back up to rank 0, whose stage 2p-1 computes the loss.
//
// DualPipe overlaps the forward of one chunk with the backward of another
// ("F&B"); here such a pair is a Forward flagged overlapped_with_next followed by
// its Backward, and its outputs are sent after both, as dualpipev.py does. Some
// backwards are split zero-bubble style into B (BackwardInput) and a W that
// goes into a FIFO queue (dualpipev.py's WeightGradStore) and runs later.
#include <deque>
#include <utility>

#include "moeflex/schedule/generator_util.h"
#include "moeflex/schedule/generators.h"

namespace moeflex {

using schedule_detail::emit;
using schedule_detail::invariant;
using schedule_detail::require;

namespace {

// One rank's emitter: per phase (0 = stage r, 1 = stage 2p-1-r) the micro-batch
// of the next forward and backward, and the queue of deferred Ws.
class VRank {
 public:
  VRank(StepPlan& plan, int rank) : plan_(plan), rank_(rank) {
    stage_[0] = rank;
    stage_[1] = 2 * plan.num_ranks - 1 - rank;
  }

  void forward(int phase) { emit(plan_, rank_, ActionKind::Forward, next_f_[phase]++, stage_[phase]); }

  // A full backward, or with `zero_bubble` a B whose W is queued for weight().
  void backward(int phase, bool zero_bubble = false) {
    const int mb = next_b_[phase]++;
    if (zero_bubble) {
      emit(plan_, rank_, ActionKind::BackwardInput, mb, stage_[phase]);
      weights_.emplace_back(mb, stage_[phase]);
    } else {
      emit(plan_, rank_, ActionKind::Backward, mb, stage_[phase]);
    }
  }

  // The oldest queued W (FIFO, like WeightGradStore.pop()).
  void weight() {
    invariant(!weights_.empty(), "dualpipev", "rank " + std::to_string(rank_) + " pops a W from an empty queue");
    emit(plan_, rank_, ActionKind::BackwardWeight, weights_.front().first, weights_.front().second);
    weights_.pop_front();
  }

  // Overlapped F&B: the forward of `f_phase` with the backward of `b_phase`.
  void forward_backward(int f_phase, int b_phase) {
    emit(plan_, rank_, ActionKind::Forward, next_f_[f_phase]++, stage_[f_phase], /*overlapped_with_next=*/true);
    backward(b_phase);
  }

  // Closing invariant: every micro-batch through both stages, no W left behind.
  void finish(int m) const {
    invariant(weights_.empty(), "dualpipev", "rank " + std::to_string(rank_) + " leaves Ws in the queue");
    invariant(next_f_[0] == m && next_f_[1] == m && next_b_[0] == m && next_b_[1] == m, "dualpipev",
              "rank " + std::to_string(rank_) + " ran m forwards and m backwards on both stages");
  }

 private:
  StepPlan& plan_;
  int rank_;
  int stage_[2] = {0, 0};
  int next_f_[2] = {0, 0};
  int next_b_[2] = {0, 0};
  std::deque<std::pair<int, int>> weights_;  // (micro-batch, stage) of deferred Ws
};

}  // namespace

StepPlan dualpipev(int p, int m) {
  const std::string name = "dualpipev";
  require(p >= 1, name, "pp", p, "needs at least one pipeline rank");
  require(m >= 2 * p, name, "num_microbatches", m,
          "must be at least 2 * pp = " + std::to_string(2 * p) + " (dualpipev.py asserts num_chunks >= num_ranks * 2)");
  std::vector<int> stage_rank(2 * p);
  for (int s = 0; s < 2 * p; ++s) stage_rank[s] = s < p ? s : 2 * p - 1 - s;
  StepPlan plan = schedule_detail::empty_plan(name, p, m, std::move(stage_rank));

  for (int r = 0; r < p; ++r) {
    VRank v(plan, r);
    const bool last = r == p - 1;

    // Step 1: nF0 -- fill the down-going half.
    const int step1 = (p - r - 1) * 2;
    for (int i = 0; i < step1; ++i) v.forward(0);

    // Step 2: nF0F1 -- forwards of both stages alternate.
    const int step2 = r + 1;
    for (int i = 0; i < step2; ++i) {
      v.forward(0);
      v.forward(1);
    }

    // Step 3: nB1W1F1 -- zero-bubble B of stage 1, its W at once, then F1.
    const int step3 = p - r - 1;
    for (int i = 0; i < step3; ++i) {
      v.backward(1, /*zero_bubble=*/true);
      v.weight();
      v.forward(1);
    }

    // Step 4 (main): nF0B1F1B0 -- two overlapped F&B pairs per iteration. The
    // last rank runs its very first F0 and B1 apart (dualpipev.py: "We don't
    // overlap these two chunks to further reduce bubble size").
    const int step4 = m - 2 * p + r + 1;
    for (int i = 0; i < step4; ++i) {
      if (i == 0 && last) {
        v.forward(0);
        v.backward(1);
      } else {
        v.forward_backward(0, 1);
      }
      v.forward_backward(1, 0);
    }

    // Step 5: nB1F1B0 -- the down-going forwards are done.
    const int step5 = p - r - 1;
    for (int i = 0; i < step5; ++i) {
      v.backward(1);
      v.forward_backward(1, 0);
    }

    // Step 6: nB1B0 -- backwards only; the second half use zero bubble (odd
    // ranks switch before a B1, even ranks before a B0).
    const int step6 = r + 1;
    bool zero_bubble = false;
    for (int i = 0; i < step6; ++i) {
      if (i == step6 / 2 && r % 2 == 1) zero_bubble = true;
      v.backward(1, zero_bubble);
      if (i == step6 / 2 && r % 2 == 0) zero_bubble = true;
      v.backward(0, zero_bubble);
    }

    // Step 7: nWB0 -- a deferred W, then a zero-bubble B0.
    const int step7 = p - r - 1;
    for (int i = 0; i < step7; ++i) {
      v.weight();
      v.backward(0, /*zero_bubble=*/true);
    }

    // Step 8: nW -- drain the W queue.
    const int step8 = r + 1;
    for (int i = 0; i < step8; ++i) v.weight();
    v.finish(m);
  }
  insert_communication(plan);
  return plan;
}

}  // namespace moeflex
