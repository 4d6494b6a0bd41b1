// Slow-rank detection (train/slow_rank.h, core/phase_clock.h): the flag's parsing,
// the detector on synthetic step times (a slowed rank named by phase within a few
// steps, calm noise never, waiting blamed on the rank waited for, experts judged
// per received row, a rank without peers against its own history, recovery), and
// the phase clock's injected slowdown.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "error_text.h"
#include "moeflex/core/error.h"
#include "moeflex/core/phase_clock.h"
#include "moeflex/core/rng.h"
#include "moeflex/train/slow_rank.h"

namespace moeflex::train {
namespace {

TEST(SlowRank, ParsesTheInjectedSlowdownAndNamesBadParts) {
  const InjectedSlowdown a = parse_slowdown("rank=3:phase=all_to_all:factor=1.3:from=11");
  EXPECT_EQ(a.rank, 3);
  EXPECT_EQ(a.slowdown.phase, StepPhase::all_to_all);
  EXPECT_DOUBLE_EQ(a.slowdown.factor, 1.3);
  EXPECT_EQ(a.slowdown.from_step, 11);
  const InjectedSlowdown b = parse_slowdown(" rank=0 : phase=forward : factor=2 ");
  EXPECT_EQ(b.rank, 0);
  EXPECT_EQ(b.slowdown.from_step, 1);
  EXPECT_EQ(parse_slowdown("").rank, -1);
  EXPECT_EQ(parse_slowdown("none").rank, -1);
  auto refusal = [](const char* spec) { return test::error_text<ConfigError>([&] { parse_slowdown(spec); }); };
  EXPECT_NE(refusal("rank=1:phase=fwd:factor=2").find("unknown phase 'fwd'"), std::string::npos);
  EXPECT_NE(refusal("rank=1:phase=other:factor=2").find("unknown phase 'other'"), std::string::npos);
  EXPECT_NE(refusal("rank=1:phase=forward").find("factor are required"), std::string::npos);
  EXPECT_NE(refusal("rank=1:phase=forward:factor=0.5").find("factor must be"), std::string::npos);
  EXPECT_NE(refusal("rank=-1:phase=forward:factor=2").find("rank must be"), std::string::npos);
  EXPECT_NE(refusal("rank=1:rank=2:phase=forward:factor=2").find("'rank' is given twice"), std::string::npos);
  EXPECT_NE(refusal("rank=1:phase=forward:factor=2:speed=3").find("unknown key 'speed'"), std::string::npos);
}

/// A calm step of an EP group: every rank alike up to `noise` (relative, uniform),
/// forward 40 ms, backward 80, experts 30 (1000 rows), optimizer 10, data 1,
/// all-to-all 20 and all-reduce 8 (the transfers).
std::vector<RankStep> calm_step(int ranks, Rng& rng, double noise) {
  std::vector<RankStep> out(static_cast<std::size_t>(ranks));
  for (RankStep& s : out) {
    auto jitter = [&](double x) { return x * (1.0 + noise * (2.0 * rng.uniform() - 1.0)); };
    s.times[StepPhase::forward] = jitter(0.040);
    s.times[StepPhase::backward] = jitter(0.080);
    s.times[StepPhase::experts] = jitter(0.030);
    s.times[StepPhase::optimizer] = jitter(0.010);
    s.times[StepPhase::data] = jitter(0.001);
    s.times[StepPhase::all_to_all] = jitter(0.020);
    s.times[StepPhase::all_reduce] = jitter(0.008);
    s.expert_rows = 1000;
  }
  return out;
}

SlowRankDetector detector(int ranks, std::vector<int> groups = {}) {
  if (groups.empty()) groups.assign(std::size_t(ranks), 0);
  std::vector<std::string> hosts;
  for (int r = 0; r < ranks; ++r) hosts.push_back("node" + std::to_string(r / 2));
  return SlowRankDetector(SlowRankOptions{}, groups, hosts);
}

/// Runs `steps` steps through `d`, `change` altering each step's times; returns every report.
template <typename F>
std::vector<SlowRankReport> run(SlowRankDetector& d, int ranks, int steps, double noise, F change) {
  Rng rng(7, 1);
  std::vector<SlowRankReport> all;
  for (int step = 1; step <= steps; ++step) {
    std::vector<RankStep> s = calm_step(ranks, rng, noise);
    change(step, s);
    for (const SlowRankReport& r : d.observe(step, s)) all.push_back(r);
  }
  return all;
}

TEST(SlowRank, NamesTheSlowedRankAndPhaseWithinTenSteps) {
  for (const int ranks : {2, 4}) {
    SlowRankDetector d = detector(ranks);
    const auto reports = run(d, ranks, 40, 0.05, [&](int step, std::vector<RankStep>& s) {
      if (step >= 11) s[1].times[StepPhase::backward] *= 1.3;
    });
    ASSERT_EQ(reports.size(), 1u) << ranks << " ranks";
    EXPECT_EQ(reports[0].rank, 1);
    EXPECT_EQ(reports[0].phase, StepPhase::backward);
    EXPECT_EQ(reports[0].host, "node0");
    EXPECT_TRUE(reports[0].vs_peers);
    EXPECT_NEAR(reports[0].factor, 1.3, 0.08);
    EXPECT_GE(reports[0].first_step, 11);
    EXPECT_LE(reports[0].report_step, 20);
    ASSERT_EQ(d.active().size(), 1u);
    EXPECT_EQ(d.active()[0].rank, 1);
  }
}

TEST(SlowRank, TwoHundredCalmStepsReportNothing) {
  for (const int ranks : {2, 4, 8}) {
    SlowRankDetector d = detector(ranks);
    EXPECT_TRUE(run(d, ranks, 200, 0.10, [](int, std::vector<RankStep>&) {}).empty()) << ranks << " ranks";
  }
}

TEST(SlowRank, WaitingIsBlamedOnTheRankWaitedFor) {
  // The last rank's forward takes 15 ms longer; the others wait as long in the next
  // all-to-all (and it arrives last, so its own all-to-all is the bare transfer).
  for (const int ranks : {2, 4}) {
    SlowRankDetector d = detector(ranks);
    const auto reports = run(d, ranks, 30, 0.03, [&](int step, std::vector<RankStep>& s) {
      if (step < 5) return;
      s[std::size_t(ranks - 1)].times[StepPhase::forward] += 0.015;
      for (int q = 0; q + 1 < ranks; ++q) s[std::size_t(q)].times[StepPhase::all_to_all] += 0.015;
    });
    ASSERT_EQ(reports.size(), 1u) << ranks << " ranks";
    EXPECT_EQ(reports[0].rank, ranks - 1);
    EXPECT_EQ(reports[0].phase, StepPhase::forward);
  }
}

TEST(SlowRank, ASlowSenderIsNamedNotItsPeers) {
  // Rank 3 adds 6 ms of its own to each all-to-all's 20; its peers wait those 6 ms.
  SlowRankDetector d = detector(4);
  const auto reports = run(d, 4, 30, 0.03, [](int step, std::vector<RankStep>& s) {
    if (step < 5) return;
    s[3].times[StepPhase::all_to_all] += 0.006;
    s[3].times.comm_own[std::size_t(StepPhase::all_to_all)] = 0.006;
    for (int q : {0, 1, 2}) s[std::size_t(q)].times[StepPhase::all_to_all] += 0.006;
  });
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports[0].rank, 3);
  EXPECT_EQ(reports[0].phase, StepPhase::all_to_all);
  EXPECT_NEAR(reports[0].factor, 1.3, 0.08);
}

TEST(SlowRank, ExpertsAreJudgedPerReceivedRow) {
  // A hot rank with twice the rows and twice the expert time is not slow...
  SlowRankDetector hot = detector(2);
  EXPECT_TRUE(run(hot, 2, 30, 0.03, [](int, std::vector<RankStep>& s) {
                s[0].expert_rows = 2000;
                s[0].times[StepPhase::experts] *= 2.0;
              }).empty());
  // ...one with the same rows and 1.5x the time is.
  SlowRankDetector slow = detector(2);
  const auto reports = run(slow, 2, 30, 0.03, [](int, std::vector<RankStep>& s) { s[0].times[StepPhase::experts] *= 1.5; });
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports[0].rank, 0);
  EXPECT_EQ(reports[0].phase, StepPhase::experts);
}

TEST(SlowRank, ARankWithoutPeersIsComparedWithItsOwnFirstSteps) {
  // Two pipeline stages of one rank each: stage 1 does more work (no peer to compare
  // with), and turns 1.4x slower in backward from step 25.
  SlowRankDetector d = detector(2, {0, 1});
  const auto reports = run(d, 2, 45, 0.03, [](int step, std::vector<RankStep>& s) {
    s[1].times[StepPhase::backward] *= 1.5;  // its own normal
    if (step >= 25) s[1].times[StepPhase::backward] *= 1.4;
  });
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports[0].rank, 1);
  EXPECT_EQ(reports[0].phase, StepPhase::backward);
  EXPECT_FALSE(reports[0].vs_peers);
  EXPECT_GE(reports[0].first_step, 25);
  EXPECT_LE(reports[0].report_step, 34);
}

TEST(SlowRank, ARecoveredRankIsReportedAgainWhenItSlowsAgain) {
  SlowRankDetector d = detector(4);
  const auto reports = run(d, 4, 80, 0.03, [](int step, std::vector<RankStep>& s) {
    if ((step >= 10 && step < 30) || step >= 55) s[0].times[StepPhase::optimizer] *= 2.0;
  });
  ASSERT_EQ(reports.size(), 2u);
  EXPECT_EQ(reports[0].rank, 0);
  EXPECT_EQ(reports[1].rank, 0);
  EXPECT_GE(reports[1].first_step, 55);
  EXPECT_NEAR(reports[0].factor, 2.0, 0.15);
  // Round trip of a report (summary.json, trainer_state).
  const SlowRankReport back = SlowRankReport::from_json(reports[1].to_json());
  EXPECT_EQ(back.rank, reports[1].rank);
  EXPECT_EQ(back.phase, reports[1].phase);
  EXPECT_EQ(back.first_step, reports[1].first_step);
  EXPECT_DOUBLE_EQ(back.factor, reports[1].factor);
}

TEST(SlowRank, TinyPhasesAndSmallCostsAreNotReported) {
  // The data phase (1 ms of 190) tripled is noise, not a slow rank; an optimizer
  // 1.25x slower adds 2.5 ms (1.3% of the step), below min_impact; 1.5x adds 2.6%.
  SlowRankDetector a = detector(2);
  EXPECT_TRUE(run(a, 2, 30, 0.03, [](int, std::vector<RankStep>& s) { s[1].times[StepPhase::data] *= 3; }).empty());
  SlowRankDetector b = detector(2);
  EXPECT_TRUE(run(b, 2, 30, 0.01, [](int, std::vector<RankStep>& s) { s[1].times[StepPhase::optimizer] *= 1.25; }).empty());
  SlowRankDetector c = detector(2);
  EXPECT_EQ(run(c, 2, 30, 0.01, [](int, std::vector<RankStep>& s) { s[1].times[StepPhase::optimizer] *= 1.5; }).size(), 1u);
}

TEST(SlowRank, TheClockChargesPhasesAndItsInjectedDelay) {
  PhaseClock& clock = phase_clock();
  clock.set_slowdown(Slowdown{StepPhase::all_to_all, 3.0, 2});
  auto spin = [](double s) { delay_for(s); };
  for (const std::int64_t step : {1, 2}) {
    clock.begin_step(step);
    {
      const PhaseScope f(StepPhase::forward);
      spin(0.002);
      {
        const PhaseScope c(StepPhase::all_to_all);
        spin(0.001);
      }
      spin(0.001);
    }
    const PhaseTimes t = clock.times();
    EXPECT_GE(t[StepPhase::forward], 0.003);
    EXPECT_LT(t[StepPhase::forward], 0.003 + 0.05);  // the inner call is not forward's
    const double own = t.comm_own[std::size_t(StepPhase::all_to_all)];
    if (step == 1) {  // before `from`
      EXPECT_EQ(own, 0.0);
      EXPECT_GE(t[StepPhase::all_to_all], 0.001);
    } else {  // (3 - 1) x the call, its own part
      EXPECT_GE(own, 0.002);
      EXPECT_GE(t[StepPhase::all_to_all], 0.003);
    }
    EXPECT_NEAR(t.total(), t[StepPhase::forward] + t[StepPhase::all_to_all] + t[StepPhase::other], 1e-12);
  }
  clock.set_slowdown(Slowdown{StepPhase::other, 1.0, 1});
  EXPECT_EQ(parse_step_phase("send_recv"), StepPhase::send_recv);
  EXPECT_FALSE(parse_step_phase("bogus"));
}

}  // namespace
}  // namespace moeflex::train
