// Pipeline schedules as an IR: every generator passes the
// validator over many (p, m, v); the validator names what is wrong with broken
// plans; in unit-cost virtual time each schedule's bubble equals its published
// closed form (under the cost assumptions where that form is exact) and its
// peak of micro-batches in flight equals the published count.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "moeflex/schedule/generators.h"
#include "moeflex/schedule/plan.h"
#include "moeflex/schedule/simulate.h"
#include "moeflex/schedule/validate.h"

using namespace moeflex;

namespace {

// The error message of `fn`, which must throw ScheduleError.
std::string schedule_error(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const ScheduleError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a ScheduleError";
  return "";
}

std::string validation_error(const StepPlan& plan) {
  return schedule_error([&] { validate(plan); });
}

// Index of the first action of `rank` equal to `a`, or -1.
int find(const StepPlan& plan, int rank, const Action& a) {
  const auto& list = plan.actions[rank];
  const auto it = std::find(list.begin(), list.end(), a);
  return it == list.end() ? -1 : static_cast<int>(it - list.begin());
}

Action act(ActionKind kind, int mb, int stage, int peer = -1) { return Action{kind, mb, stage, peer}; }

constexpr ActionKind F = ActionKind::Forward;
constexpr ActionKind B = ActionKind::Backward;
constexpr ActionKind Bi = ActionKind::BackwardInput;
constexpr ActionKind W = ActionKind::BackwardWeight;
constexpr ActionKind SendA = ActionKind::SendActivation;
constexpr ActionKind RecvA = ActionKind::RecvActivation;
constexpr ActionKind SendG = ActionKind::SendGrad;
constexpr ActionKind RecvG = ActionKind::RecvGrad;

// A hand-written two-rank plan, one stage per rank.
StepPlan two_rank_plan(int m, std::vector<Action> rank0, std::vector<Action> rank1) {
  StepPlan plan;
  plan.schedule = "hand";
  plan.num_ranks = 2;
  plan.num_microbatches = m;
  plan.num_stages = 2;
  plan.stage_rank = {0, 1};
  plan.actions = {std::move(rank0), std::move(rank1)};
  return plan;
}

constexpr double kExact = 1e-9;  // unit costs are small dyadic numbers: sums are exact

}  // namespace

// ---------------------------------------------------------------------------
// Every generator is valid over many shapes.

TEST(ScheduleValidate, AcceptsEveryGeneratorOverManyShapes) {
  int plans = 0;
  for (int p = 1; p <= 8; ++p) {
    for (int m = 1; m <= 4 * p; ++m) {
      SCOPED_TRACE("p=" + std::to_string(p) + " m=" + std::to_string(m));
      EXPECT_NO_THROW(validate(gpipe(p, m)));
      EXPECT_NO_THROW(validate(one_f_one_b(p, m)));
      EXPECT_NO_THROW(validate(zb_h1(p, m)));
      plans += 3;
      if (m % p == 0)
        for (int v = 1; v <= 4; ++v) {
          EXPECT_NO_THROW(validate(interleaved_1f1b(p, m, v))) << "v=" << v;
          EXPECT_NO_THROW(validate(combined_1f1b(p, m, v))) << "v=" << v;
          plans += 2;
        }
    }
    for (int m = 2 * p; m <= 4 * p + 1; ++m) {
      EXPECT_NO_THROW(validate(dualpipev(p, m))) << "p=" << p << " m=" << m;
      ++plans;
    }
  }
  EXPECT_EQ(plans, 776);
}

TEST(ScheduleValidate, GeneratorsHaveTheDocumentedShape) {
  const StepPlan inter = interleaved_1f1b(4, 8, 3);
  EXPECT_EQ(inter.num_stages, 12);
  EXPECT_EQ(inter.stages_of(1), (std::vector<int>{1, 5, 9}));  // stage = chunk * p + rank
  EXPECT_EQ(inter.chunk_of(9), 2);

  const StepPlan v = dualpipev(4, 10);
  EXPECT_EQ(v.num_stages, 8);
  EXPECT_EQ(v.stages_of(0), (std::vector<int>{0, 7}));  // rank r: stages r and 2p-1-r
  EXPECT_EQ(v.stages_of(3), (std::vector<int>{3, 4}));
  // Stage 3 -> 4 is a local hand-off on rank 3: no message carries it.
  for (const auto& list : v.actions)
    for (const Action& a : list) {
      if (!is_compute(a.kind)) {
        EXPECT_NE(a.stage, is_grad_message(a.kind) ? 4 : 3) << to_string(a);
      }
    }

  // 1F1B with p = 2, m = 3, sends and receives in place.
  EXPECT_EQ(one_f_one_b(2, 3).format_table(true),
            "1f1b: 2 ranks, 3 micro-batches, 2 stages\n"
            "rank 0 | F0 sA0:0>1 F1 sA1:0>1 rG0:1<1 B0 F2 sA2:0>1 rG1:1<1 B1 rG2:1<1 B2\n"
            "rank 1 | rA0:0<0 F0 B0 sG0:1>0 rA1:0<0 F1 B1 sG1:1>0 rA2:0<0 F2 B2 sG2:1>0\n");
}

TEST(ScheduleValidate, DualPipeVFollowsThePublishedFigure) {
  // deepseek-ai/DualPipe images/dualpipev.png: 4 ranks, 10 micro-batches; rank 0
  // ("Device 0") reads 0..6 forward, then 0 F1, B-input, W, ... (Steps 1-4).
  const StepPlan plan = dualpipev(4, 10);
  const std::string table = plan.format_table();
  EXPECT_NE(table.find("rank 0 | F0a F1a F2a F3a F4a F5a F6a F0b Bi0b W0b F1b Bi1b W1b F2b Bi2b W2b F3b "
                       "F7a+B3b F4b+B0a F8a+B4b F5b+B1a F9a+B5b F6b+B2a B6b F7b+B3a"),
            std::string::npos)
      << table;
  // The last rank runs its first F0 and B1 apart ("don't overlap").
  EXPECT_NE(table.find("rank 3 | F0a F0b F1a F1b F2a F2b F3a F3b F4a B0b F4b+B0a"), std::string::npos) << table;
  // With the figure's proportions (F = B-input = W = 1 cell, F&B = 3 cells) every
  // device has 6 idle cells, as counted on the figure.
  const SimResult sim = simulate(plan, Costs{1, 1, 1});
  EXPECT_DOUBLE_EQ(sim.makespan, 66);  // 10 micro-batches * 2 chunks * (F + B + W) + 6
  for (const RankStats& r : sim.ranks) EXPECT_DOUBLE_EQ(r.idle, 6);
}

// ---------------------------------------------------------------------------
// The validator rejects broken plans with the right message.

TEST(ScheduleValidate, RejectsAMissingBackward) {
  StepPlan plan = one_f_one_b(2, 2);
  auto& r0 = plan.actions[0];
  r0.erase(r0.begin() + find(plan, 0, act(B, 1, 0)));
  const std::string msg = validation_error(plan);
  EXPECT_NE(msg.find("micro-batch 1 at stage 0 has no backward"), std::string::npos) << msg;
}

TEST(ScheduleValidate, RejectsAWeightGradientBeforeItsBackward) {
  StepPlan plan = zb_h1(2, 2);  // rank 1: rA0 F0 Bi0 sG0 rA1 F1 Bi1 sG1 W0 W1
  auto& r1 = plan.actions[1];
  const int b = find(plan, 1, act(Bi, 0, 1));
  const int w = find(plan, 1, act(W, 0, 1));
  ASSERT_LT(b, w);
  r1.erase(r1.begin() + w);
  r1.insert(r1.begin() + b, act(W, 0, 1));  // W0 right before its Bi0
  const std::string msg = validation_error(plan);
  EXPECT_NE(msg.find("rank 1 action " + std::to_string(b) + " W(mb 0, stage 1) runs before rank 1 action " +
                     std::to_string(b + 1) + " Bi(mb 0, stage 1) (B before W)"),
            std::string::npos)
      << msg;
}

TEST(ScheduleValidate, RejectsABackwardBeforeItsForward) {
  StepPlan plan = gpipe(1, 2);
  std::swap(plan.actions[0][0], plan.actions[0][2]);  // B0 F1 F0 B1
  const std::string msg = validation_error(plan);
  EXPECT_NE(msg.find("B(mb 0, stage 0) runs before rank 0 action 2 F(mb 0, stage 0) (F before B)"), std::string::npos)
      << msg;
}

TEST(ScheduleValidate, RejectsASendWithoutItsRecv) {
  StepPlan plan = one_f_one_b(2, 2);
  auto& r1 = plan.actions[1];
  r1.erase(r1.begin() + find(plan, 1, act(RecvA, 1, 0, 0)));
  const std::string msg = validation_error(plan);
  EXPECT_NE(msg.find("sendA(mb 1, stage 0, to rank 1) has no matching recvA on rank 1"), std::string::npos) << msg;
}

TEST(ScheduleValidate, RejectsARecvWithoutItsSend) {
  StepPlan plan = one_f_one_b(2, 2);
  auto& r1 = plan.actions[1];
  r1.erase(r1.begin() + find(plan, 1, act(SendG, 0, 1, 0)));
  const std::string msg = validation_error(plan);
  EXPECT_NE(msg.find("recvG(mb 0, stage 1, from rank 1) has no matching sendG on rank 1"), std::string::npos) << msg;
}

TEST(ScheduleValidate, RejectsARecvAfterItsConsumer) {
  StepPlan plan = gpipe(2, 1);  // rank 1: rA0 F0 B0 sG0
  std::swap(plan.actions[1][0], plan.actions[1][1]);
  const std::string msg = validation_error(plan);
  EXPECT_NE(msg.find("rank 1 action 0 F(mb 0, stage 1) needs the activation of stage 0 from rank 0, which arrives "
                     "only later at rank 1 action 1"),
            std::string::npos)
      << msg;
}

TEST(ScheduleValidate, RejectsComputeOnTheWrongRankAndSendsToOneself) {
  StepPlan plan = gpipe(2, 1);
  plan.actions[0][0].stage = 1;
  std::string msg = validation_error(plan);
  EXPECT_NE(msg.find("stage 1 is held by rank 1, so its compute must run there"), std::string::npos) << msg;

  // DualPipeV's turn on the last rank (stage p-1 -> p) is local.
  plan = dualpipev(2, 4);
  plan.actions[1].insert(plan.actions[1].begin() + find(plan, 1, act(F, 0, 1)) + 1, act(SendA, 0, 1, 0));
  msg = validation_error(plan);
  EXPECT_NE(msg.find("stages 1 and 2 are both on rank 1, so the hand-off is local and takes no send"),
            std::string::npos)
      << msg;
}

TEST(ScheduleValidate, RejectsSwappedRecvsOnAChannel) {
  // GPipe, p = 2, m = 2, rank 1 receiving activation 1 before activation 0:
  // with tags this would run, but an executor matching by order would swap them.
  StepPlan plan = two_rank_plan(2,
                                {act(F, 0, 0), act(SendA, 0, 0, 1), act(F, 1, 0), act(SendA, 1, 0, 1),
                                 act(RecvG, 0, 1, 1), act(B, 0, 0), act(RecvG, 1, 1, 1), act(B, 1, 0)},
                                {act(RecvA, 1, 0, 0), act(RecvA, 0, 0, 0), act(F, 0, 1), act(F, 1, 1), act(B, 0, 1),
                                 act(SendG, 0, 1, 0), act(B, 1, 1), act(SendG, 1, 1, 0)});
  const std::string msg = validation_error(plan);
  EXPECT_NE(msg.find("rank 0 -> rank 1 is not FIFO: message 0 sent is rank 0 action 1 sendA(mb 0, stage 0, to "
                     "rank 1) but message 0 received is rank 1 action 0 recvA(mb 1, stage 0, from rank 0)"),
            std::string::npos)
      << msg;
}

TEST(ScheduleValidate, RejectsRecvsOrderedIntoADeadlock) {
  // Rank 0 sends activation 1 only after gradient 0 is back; rank 1 waits for
  // activation 1 before it computes (and sends) gradient 0.
  const std::vector<Action> rank0 = {act(F, 0, 0), act(SendA, 0, 0, 1), act(RecvG, 0, 1, 1), act(B, 0, 0),
                                     act(F, 1, 0), act(SendA, 1, 0, 1), act(RecvG, 1, 1, 1), act(B, 1, 0)};
  const std::vector<Action> ok1 = {act(RecvA, 0, 0, 0), act(F, 0, 1), act(B, 0, 1), act(SendG, 0, 1, 0),
                                   act(RecvA, 1, 0, 0), act(F, 1, 1), act(B, 1, 1), act(SendG, 1, 1, 0)};
  EXPECT_NO_THROW(validate(two_rank_plan(2, rank0, ok1)));

  const std::vector<Action> stuck1 = {act(RecvA, 0, 0, 0), act(RecvA, 1, 0, 0), act(F, 0, 1),
                                      act(B, 0, 1),        act(SendG, 0, 1, 0), act(F, 1, 1),
                                      act(B, 1, 1),        act(SendG, 1, 1, 0)};
  const std::string msg = validation_error(two_rank_plan(2, rank0, stuck1));
  EXPECT_EQ(msg,
            "deadlock: no rank can proceed; rank 0 waits at action 2 recvG(mb 0, stage 1, from rank 1), which rank 1 "
            "sends only at its action 4; rank 1 waits at action 1 recvA(mb 1, stage 0, from rank 0), which rank 0 "
            "sends only at its action 5.");
}

TEST(ScheduleValidate, RejectsARankWaitingForItsOwnGradient) {
  // Rank 0 waits for the gradient of a micro-batch it has not sent forward yet:
  // rank 1 and rank 2 wait for that forward in turn.
  StepPlan plan = one_f_one_b(3, 1);
  auto& r0 = plan.actions[0];  // F0 sA0 rG0 B0 -> rG0 F0 sA0 B0
  std::rotate(r0.begin(), r0.begin() + 2, r0.begin() + 3);
  const std::string msg = validation_error(plan);
  EXPECT_EQ(msg.rfind("deadlock: no rank can proceed; rank 0 waits at action 0 recvG(mb 0, stage 1, from rank 1)", 0),
            0u)
      << msg;
}

TEST(ScheduleValidate, RejectsAMisplacedOverlapFlag) {
  StepPlan plan = gpipe(1, 2);
  plan.actions[0][0].overlapped_with_next = true;  // F0 followed by F1
  const std::string msg = validation_error(plan);
  EXPECT_NE(msg.find("only a Forward followed by a Backward or BackwardInput can form an overlapped F&B pair"),
            std::string::npos)
      << msg;
}

TEST(ScheduleValidate, RejectsAPairWhoseBackwardNeedsItsForward) {
  StepPlan plan = one_f_one_b(1, 2);  // F0 B0 F1 B1
  plan.actions[0][0].overlapped_with_next = true;
  const std::string msg = validation_error(plan);
  EXPECT_NE(msg.find("its backward cannot be the same micro-batch and stage as its forward"), std::string::npos) << msg;
}

TEST(ScheduleValidate, CombinedOneFOneBPairsEverySteadyForwardWithAnotherMicroBatchsBackward) {
  // Megatron-Core's combined 1F1B without a pipeline: F0, (F1 B0), (F2 B1), B2.
  EXPECT_EQ(combined_1f1b(1, 3, 1).format_table(false),
            "1f1b-overlap: 1 ranks, 3 micro-batches, 1 stages\n"
            "rank 0 | F0 F1+B0 F2+B1 B2\n");
  for (int p = 1; p <= 6; ++p)
    for (int v = 1; v <= 3; ++v)
      for (int m = p; m <= 4 * p; m += p) {
        const StepPlan in = interleaved_1f1b(p, m, v), co = combined_1f1b(p, m, v);
        for (int r = 0; r < p; ++r) {
          // The same compute actions in the same order, but one forward earlier:
          // the k-th backward follows the (k + warm-up + 1)-th forward.
          std::vector<Action> fi, fc, bi, bc;
          int pairs = 0, warmup = -1, seen_f = 0;
          for (const Action& a : in.actions[r]) {
            if (a.kind == F) fi.push_back(a);
            if (a.kind == B) bi.push_back(a);
          }
          bool paired = false;  // the previous compute action opened a pair
          for (std::size_t i = 0; i < co.actions[r].size(); ++i) {
            Action a = co.actions[r][i];
            if (a.kind == B && warmup < 0) warmup = seen_f - (paired ? 1 : 0);  // forwards before the steady phase
            if (is_compute(a.kind)) paired = a.overlapped_with_next;
            if (a.kind == F) ++seen_f;
            pairs += a.overlapped_with_next ? 1 : 0;
            a.overlapped_with_next = false;
            if (a.kind == F) {
              fc.push_back(a);
            } else if (a.kind == B) {
              bc.push_back(a);
            }
          }
          EXPECT_EQ(fc, fi);
          EXPECT_EQ(bc, bi);
          const int total = m * v;
          const int expected_warmup = m == p ? total : std::min((p - r - 1) * 2 + (v - 1) * p + 1, total);
          EXPECT_EQ(warmup, expected_warmup) << "p=" << p << " v=" << v << " m=" << m << " r=" << r;
          EXPECT_EQ(pairs, total - expected_warmup) << "p=" << p << " v=" << v << " m=" << m << " r=" << r;
        }
      }
}

// ---------------------------------------------------------------------------
// Bubbles in unit-cost virtual time equal the closed forms.

TEST(ScheduleBubble, GPipeAndOneFOneBIdle_pMinus1_TimesFPlusBPlusW) {
  for (const Costs c : {Costs{1, 1, 1}, Costs{1, 2, 1}, Costs{2, 3, 1}, Costs{3, 1, 2}})
    for (int p = 1; p <= 8; ++p)
      for (int m = 1; m <= 4 * p; ++m) {
        const double expected = (p - 1) * (c.forward + c.backward_input + c.backward_weight);
        for (const StepPlan& plan : {gpipe(p, m), one_f_one_b(p, m)}) {
          const SimResult sim = simulate(plan, c);
          for (int r = 0; r < p; ++r)
            ASSERT_NEAR(sim.ranks[r].idle, expected, kExact) << plan.schedule << " p=" << p << " m=" << m << " r=" << r;
          ASSERT_NEAR(sim.makespan, (m + p - 1) * (c.forward + c.backward_input + c.backward_weight), kExact);
          ASSERT_NEAR(closed_form_bubble(plan.schedule, p, c), expected, kExact);
        }
      }
}

TEST(ScheduleBubble, InterleavedIdleIsOneFOneBsDividedByV) {
  // The same model: a rank's full stage costs (F, B, W); each of its v chunks
  // costs a v-th of that. Megatron: bubble (p-1)(F+B+W)/v.
  for (const Costs full : {Costs{12, 12, 12}, Costs{12, 24, 12}, Costs{6, 18, 6}})
    for (int v = 1; v <= 4; ++v) {
      const Costs chunk{full.forward / v, full.backward_input / v, full.backward_weight / v};
      const double expected = (full.forward + full.backward_input + full.backward_weight) / v;
      for (int p = 1; p <= 8; ++p)
        for (int m = p; m <= 4 * p; m += p) {
          const SimResult sim = simulate(interleaved_1f1b(p, m, v), chunk);
          for (int r = 0; r < p; ++r)
            ASSERT_NEAR(sim.ranks[r].idle, (p - 1) * expected, kExact) << "p=" << p << " m=" << m << " v=" << v;
          ASSERT_NEAR(closed_form_bubble("interleaved", p, chunk), (p - 1) * expected, kExact);
        }
    }
}

TEST(ScheduleBubble, CombinedOneFOneBKeepsInterleavedsBubbleAndHidesWhatItsPairsSave) {
  // Drawn at full cost (a pair takes F + B) and without message latency, the extra
  // warm-up forward costs no time: every rank idles as in interleaved. A pair that takes `saved` less
  // (its all-to-alls hidden under the other half's compute) shortens the step by
  // at least the pairs of the busiest rank times `saved`.
  for (const Costs c : {Costs{1, 2, 0}, Costs{2, 3, 1}, Costs{1, 1, 1}})
    for (int p = 1; p <= 6; ++p)
      for (int v = 1; v <= 3; ++v)
        for (int m = p; m <= 4 * p; m += p) {
          const SimResult in = simulate(interleaved_1f1b(p, m, v), c);
          const StepPlan plan = combined_1f1b(p, m, v);
          const SimResult co = simulate(plan, c);
          ASSERT_NEAR(co.makespan, in.makespan, kExact) << "p=" << p << " v=" << v << " m=" << m;
          for (int r = 0; r < p; ++r) ASSERT_NEAR(co.ranks[r].idle, in.ranks[r].idle, kExact);
          ASSERT_NEAR(closed_form_bubble("1f1b-overlap", p, c), co.ranks[0].idle, kExact);
          const double saved = 0.25 * (c.forward + c.backward_input + c.backward_weight);
          Costs hidden = c;
          hidden.overlapped_pair = c.forward + c.backward_input + c.backward_weight - saved;
          int most_pairs = 0;
          for (const auto& list : plan.actions) {
            int pairs = 0;
            for (const Action& a : list) pairs += a.overlapped_with_next ? 1 : 0;
            most_pairs = std::max(most_pairs, pairs);
          }
          EXPECT_LE(simulate(plan, hidden).makespan, in.makespan - most_pairs * saved + kExact)
              << "p=" << p << " v=" << v << " m=" << m;
          if (m > p) {
            EXPECT_GT(most_pairs, 0);
          }
        }
}

TEST(ScheduleBubble, ZbH1Idle_pMinus1_TimesFPlusBMinusW_WhenWIsTheSmallest) {
  // Qi et al. 2023: (p-1)(F+B-W), a third of 1F1B's when F = B = W. It is exact
  // when W <= min(F, B) (a deferred W must fit the gap it fills) and m >= p.
  for (const Costs c : {Costs{1, 1, 1}, Costs{2, 2, 1}, Costs{3, 2, 2}, Costs{2, 3, 1}, Costs{4, 1, 1}})
    for (int p = 1; p <= 8; ++p)
      for (int m = p; m <= 4 * p; ++m) {
        const SimResult sim = simulate(zb_h1(p, m), c);
        const double expected = (p - 1) * (c.forward + c.backward_input - c.backward_weight);
        for (int r = 0; r < p; ++r) ASSERT_NEAR(sim.ranks[r].idle, expected, kExact) << "p=" << p << " m=" << m;
        ASSERT_NEAR(closed_form_bubble("zb-h1", p, c), expected, kExact);
      }
  for (int p = 2; p <= 8; ++p) {
    const double one_f_one_b_idle = simulate(one_f_one_b(p, 2 * p)).ranks[0].idle;
    EXPECT_DOUBLE_EQ(simulate(zb_h1(p, 2 * p)).ranks[0].idle * 3, one_f_one_b_idle);
  }
  // Outside the condition the formula is only a lower bound: W = 2 > B = 1.
  for (int p = 2; p <= 8; ++p)
    EXPECT_GT(simulate(zb_h1(p, 3 * p), Costs{1, 1, 2}).ranks[0].idle, (p - 1) * (1 + 1 - 2) + kExact);
}

TEST(ScheduleBubble, DualPipeVIdleIsTheReadmeFormula) {
  // DualPipe README: (PP/2 - 1)(F&B + B - 3W) with PP = 2p stages, B a full
  // backward (our B + W) and F&B an overlapped pair, drawn as F + B + W. Exact
  // when F = B-input >= W (the README figure: 1 cell each).
  for (const Costs c : {Costs{1, 1, 1}, Costs{2, 2, 1}, Costs{3, 3, 2}, Costs{4, 4, 4}})
    for (int p = 1; p <= 8; ++p)
      for (int m = 2 * p; m <= 4 * p + 1; ++m) {
        const double full_b = c.backward_input + c.backward_weight;
        const double pair = c.forward + full_b;
        const double expected = (2 * p / 2 - 1) * (pair + full_b - 3 * c.backward_weight);
        const SimResult sim = simulate(dualpipev(p, m), c);
        for (int r = 0; r < p; ++r) ASSERT_NEAR(sim.ranks[r].idle, expected, kExact) << "p=" << p << " m=" << m;
        ASSERT_NEAR(closed_form_bubble("dualpipev", p, c), expected, kExact);
      }
  // With F = B = W the V's bubble is 2(p-1) against 1F1B's 3(2p-1) over the
  // same 2p stages on 2p ranks.
  EXPECT_DOUBLE_EQ(simulate(dualpipev(4, 16)).ranks[0].idle, 6);
  EXPECT_DOUBLE_EQ(simulate(one_f_one_b(8, 16)).ranks[0].idle, 21);
}

TEST(ScheduleBubble, CommLatencyAddsTwoHopsPerStageBoundary) {
  // GPipe with message latency c: the first forward and the last backward each
  // cross p-1 links, so each rank idles (p-1)(F+B+W+2c).
  for (int p = 1; p <= 6; ++p) {
    const SimResult sim = simulate(gpipe(p, 2 * p), Costs{1, 1, 1, 0.5});
    for (const RankStats& r : sim.ranks) EXPECT_NEAR(r.idle, (p - 1) * 4.0, kExact) << "p=" << p;
  }
}

TEST(ScheduleBubble, BubbleFractionIsIdleOverRanksTimesMakespan) {
  const SimResult sim = simulate(one_f_one_b(4, 8));  // idle 9 per rank, makespan 33
  EXPECT_DOUBLE_EQ(sim.makespan, 33);
  EXPECT_DOUBLE_EQ(sim.bubble_fraction, 9.0 / 33.0);
  EXPECT_DOUBLE_EQ(sim.ranks[2].busy, 24);
}

// ---------------------------------------------------------------------------
// Peak micro-batches in flight (F done, B not yet) equal the published counts.

TEST(ScheduleMemory, PeakInFlightMatchesThePublishedCounts) {
  for (int p = 1; p <= 8; ++p)
    for (int m = 1; m <= 4 * p; ++m) {
      SCOPED_TRACE("p=" + std::to_string(p) + " m=" + std::to_string(m));
      const SimResult g = simulate(gpipe(p, m)), one = simulate(one_f_one_b(p, m)), zb = simulate(zb_h1(p, m));
      for (int r = 0; r < p; ++r) {
        EXPECT_EQ(g.ranks[r].peak_activations, m);                         // GPipe: all m
        EXPECT_EQ(one.ranks[r].peak_activations, std::min(p - r, m));      // 1F1B: p - r
        EXPECT_EQ(zb.ranks[r].peak_activations, std::min(p - r, m));       // ZB-H1: as 1F1B
        EXPECT_EQ(zb.ranks[r].peak_weight_activations, std::min(p, m));    // ...and p until W
        EXPECT_EQ(one.ranks[r].peak_weight_activations, std::min(p - r, m));
      }
      if (m % p == 0)
        for (int v = 1; v <= 4; ++v) {
          // Megatron interleaved: warm-up (p-r-1)*2 + (v-1)p forwards, plus the
          // steady phase's first one; all m*v when m == p.
          const SimResult s = simulate(interleaved_1f1b(p, m, v));
          for (int r = 0; r < p; ++r)
            EXPECT_EQ(s.ranks[r].peak_activations, m == p ? m * v : std::min((p - r - 1) * 2 + (v - 1) * p + 1, m * v))
                << "v=" << v << " r=" << r;
        }
    }
  // Combined 1F1B: interleaved's count plus the extra warm-up forward.
  for (int p = 1; p <= 6; ++p)
    for (int v = 1; v <= 3; ++v)
      for (int m = p; m <= 4 * p; m += p) {
        const SimResult in = simulate(interleaved_1f1b(p, m, v)), co = simulate(combined_1f1b(p, m, v));
        for (int r = 0; r < p; ++r)
          EXPECT_EQ(co.ranks[r].peak_activations, std::min(in.ranks[r].peak_activations + 1, m * v))
              << "p=" << p << " v=" << v << " m=" << m << " r=" << r;
      }
  // DualPipeV (README table: PP + 1 with PP = 2p stages) on every rank.
  for (int p = 1; p <= 8; ++p)
    for (int m = 2 * p; m <= 4 * p + 1; ++m)
      for (const RankStats& r : simulate(dualpipev(p, m)).ranks) EXPECT_EQ(r.peak_activations, 2 * p + 1);
}

// ---------------------------------------------------------------------------
// Arguments, names, helpers.

TEST(ScheduleGenerators, RefuseBadArgumentsNamingTheRule) {
  try {
    interleaved_1f1b(4, 6, 2);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(),
                 "interleaved schedule: num_microbatches = 6: must be a multiple of pp = 4 (Megatron's interleaved "
                 "schedule)");
  }
  try {
    dualpipev(4, 7);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_STREQ(e.what(),
                 "dualpipev schedule: num_microbatches = 7: must be at least 2 * pp = 8 (dualpipev.py asserts "
                 "num_chunks >= num_ranks * 2)");
  }
  EXPECT_THROW(one_f_one_b(0, 4), ConfigError);
  EXPECT_THROW(gpipe(2, 0), ConfigError);
  EXPECT_THROW(make_schedule("1f1b", 2, 4, 2), ConfigError);
  try {
    make_schedule("chimera", 2, 4);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_STREQ(
        e.what(),
        "schedule: unknown name \"chimera\" (known: gpipe, 1f1b, interleaved, 1f1b-overlap, zb-h1, dualpipev)");
  }
  for (const std::string& name : schedule_names())
    EXPECT_EQ(make_schedule(name, 2, 4, schedule_takes_vpp(name) ? 2 : 1).schedule, name);
  // A misspelt name is named as unknown, not as a schedule that takes no --vpp.
  try {
    make_schedule("1F1B-overlap", 2, 4, 2);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()).rfind("schedule: unknown name \"1F1B-overlap\" (known: ", 0), 0u) << e.what();
  }
}

TEST(SchedulePlan, MessageTagsAreUniqueAndMatchBetweenSendAndRecv) {
  const StepPlan plan = interleaved_1f1b(4, 8, 2);
  std::multiset<int> sent, received;
  for (const auto& list : plan.actions)
    for (const Action& a : list) {
      if (is_send(a.kind)) sent.insert(message_tag(plan, a));
      if (is_recv(a.kind)) received.insert(message_tag(plan, a));
    }
  EXPECT_EQ(sent, received);
  EXPECT_EQ(std::set<int>(sent.begin(), sent.end()).size(), sent.size());
  EXPECT_EQ(sent.size(), 2u * 8 * (8 - 1));  // per micro-batch, 7 boundaries both ways
  EXPECT_EQ(consumer_stage(act(SendA, 0, 3, 1)), 4);
  EXPECT_EQ(consumer_stage(act(RecvG, 0, 3, 1)), 2);
}

TEST(SchedulePlan, CommunicationIsHoistedToKeepChannelsFifo) {
  // DualPipeV, p = 3: rank 0 sends the activation of micro-batch 4 (Step 1)
  // before the gradient of micro-batch 0 (Step 3); rank 1 needs the gradient
  // first, so the activation's receive moves up in front of it (dualpipev.py
  // likewise posts that receive early, before Step 2's loop).
  StepPlan plan = dualpipev(3, 6);
  int hoisted = 0;
  for (const auto& list : plan.actions)
    for (size_t i = 0; i < list.size(); ++i) {
      if (!is_recv(list[i].kind)) continue;
      size_t next = i + 1;  // the first compute action (or pair) after the receive
      while (!is_compute(list[next].kind)) ++next;
      auto feeds = [&](const Action& c) {
        return c.microbatch == list[i].microbatch && c.stage == consumer_stage(list[i]);
      };
      hoisted += feeds(list[next]) || (list[next].overlapped_with_next && feeds(list[next + 1])) ? 0 : 1;
    }
  EXPECT_EQ(hoisted, 1);
  const std::string table = plan.format_table(true);
  EXPECT_NE(table.find("rA4:0<0 rG0:5<0 Bi0b sG0:4>2 W0b"), std::string::npos) << table;
  EXPECT_NO_THROW(validate(plan));
  EXPECT_THROW(insert_communication(plan), ScheduleError);  // it already has messages
}

TEST(SchedulePlan, JsonAndGanttShowThePlan) {
  const StepPlan plan = one_f_one_b(2, 1);
  EXPECT_EQ(plan.to_json(),
            "{\"schedule\":\"1f1b\",\"num_ranks\":2,\"num_microbatches\":1,\"num_stages\":2,\"stage_rank\":[0,1],"
            "\"actions\":[[{\"kind\":\"F\",\"mb\":0,\"stage\":0},{\"kind\":\"sendA\",\"mb\":0,\"stage\":0,\"peer\":1},"
            "{\"kind\":\"recvG\",\"mb\":0,\"stage\":1,\"peer\":1},{\"kind\":\"B\",\"mb\":0,\"stage\":0}],"
            "[{\"kind\":\"recvA\",\"mb\":0,\"stage\":0,\"peer\":0},{\"kind\":\"F\",\"mb\":0,\"stage\":1},"
            "{\"kind\":\"B\",\"mb\":0,\"stage\":1},{\"kind\":\"sendG\",\"mb\":0,\"stage\":1,\"peer\":0}]]}");
  // F = 1, B + W = 2: rank 0 F at 0, B at 4..6; rank 1 F at 1, B at 2..4.
  EXPECT_EQ(format_gantt(plan, simulate(plan)),
            "rank 0 |   F0    .    .    .   B0   B0\n"
            "rank 1 |    .   F0   B0   B0    .    .\n");
}
