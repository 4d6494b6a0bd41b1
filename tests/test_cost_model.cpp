// The time cost model: its profile's JSON (versions, layouts), GEMM lookup by layout
// and op tables on a hand-made profile with hand-computed times, grouped GEMMs,
// overlap, and a quick calibration of this machine: sane numbers, held-out shapes
// absent from its grids, and a held-out error within a loose bound.
#include <gtest/gtest.h>
#include <omp.h>

#include <fmt/format.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <thread>

#include "moeflex/comm/wait_policy.h"
#include "moeflex/core/error.h"
#include "moeflex/provision/cost_model.h"
#include "moeflex/profile/calibrate.h"

using namespace moeflex;

namespace {

/// A small profile whose times are easy to compute by hand.
HardwareProfile hand_profile() {
  HardwareProfile p;
  p.name = "hand-made";
  p.threads = 2;
  p.gemm = {
      {100, 200, 300, 1e10},  // 1.2e-3 s
      {200, 200, 300, 1.6e10},  // 1.5e-3 s: with the first, a line along M through (N, K) = (200, 300)
      {64, 64, 64, 1e10},
      {256, 256, 256, 4e10},
  };
  p.memory_bandwidth = 1e9;
  p.launch_overhead = 1e-6;
  p.h2d_bandwidth = 1e10;
  p.d2h_bandwidth = 5e9;
  p.copy_latency = 1e-5;
  p.op_tables[op_names::kRmsnormForward] = {{1000, 2e-6}, {3000, 4e-6}};
  return p;
}

std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const DataError& e) {
    return e.what();
  }
  return "(no DataError)";
}

}  // namespace

TEST(HardwareProfile, JsonRoundTrip) {
  const HardwareProfile p = hand_profile();
  const auto path = std::filesystem::path(MOEFLEX_BINARY_DIR) / "test_cost_model.d" / "profile.json";
  p.save(path);
  const HardwareProfile q = HardwareProfile::load(path);
  EXPECT_EQ(q.to_json(), p.to_json());
  EXPECT_EQ(q.name, "hand-made");
  EXPECT_EQ(q.threads, 2);
  ASSERT_EQ(q.gemm.size(), 4u);
  EXPECT_EQ(q.gemm[1].M, 200);
  EXPECT_EQ(q.gemm[1].rate, 1.6e10);
  EXPECT_EQ(q.copy_latency, 1e-5);
  EXPECT_EQ(q.op_tables.at(op_names::kRmsnormForward)[1].seconds, 4e-6);
}

TEST(HardwareProfile, DeviceRoundTripsReadsOldFilesAsACpusAndRefusesOthers) {
  HardwareProfile p = hand_profile();
  EXPECT_EQ(p.to_json().value("device", ""), "cpu");
  p.device = "cuda";
  EXPECT_EQ(HardwareProfile::from_json(p.to_json(), "hw.json").device, "cuda");
  nlohmann::json j = p.to_json();
  j.erase("device");  // a file written before the field
  EXPECT_EQ(HardwareProfile::from_json(j, "hw.json").device, "cpu");
  j["device"] = "tpu";
  const std::string msg = message_of([&] { HardwareProfile::from_json(j, "hw.json"); });
  EXPECT_NE(msg.find("hw.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'device'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("\"tpu\""), std::string::npos) << msg;
}

TEST(HardwareProfile, TimeSharingEfficiencyRoundTripsDefaultsToOneAndIsChecked) {
  HardwareProfile p = hand_profile();
  p.time_sharing_efficiency = 0.87;
  EXPECT_EQ(HardwareProfile::from_json(p.to_json(), "hw.json").time_sharing_efficiency, 0.87);
  nlohmann::json j = p.to_json();
  j.erase("time_sharing_efficiency");  // a file written before the field: not measured
  EXPECT_EQ(HardwareProfile::from_json(j, "hw.json").time_sharing_efficiency, 1.0);
  for (const double bad : {0.0, -0.5, 1.5}) {
    j["time_sharing_efficiency"] = bad;
    const std::string msg = message_of([&] { HardwareProfile::from_json(j, "hw.json"); });
    EXPECT_NE(msg.find("'time_sharing_efficiency'"), std::string::npos) << msg;
  }
}

TEST(HardwareProfile, NapCostRoundTripsDefaultsToNotMeasuredAndIsChecked) {
  HardwareProfile p = hand_profile();
  p.nap_cost = 24e-6;
  p.nap_overshoot = 70e-6;
  const HardwareProfile q = HardwareProfile::from_json(p.to_json(), "hw.json");
  EXPECT_EQ(q.nap_cost, 24e-6);
  EXPECT_EQ(q.nap_overshoot, 70e-6);
  nlohmann::json j = p.to_json();
  j.erase("nap_cost_s");  // a file written before the fields: not measured
  j.erase("nap_overshoot_s");
  EXPECT_EQ(HardwareProfile::from_json(j, "hw.json").nap_cost, 0.0);
  EXPECT_EQ(HardwareProfile::from_json(j, "hw.json").nap_overshoot, 0.0);
  for (const char* key : {"nap_cost_s", "nap_overshoot_s"}) {
    nlohmann::json k = p.to_json();
    k[key] = -1e-6;
    const std::string msg = message_of([&] { HardwareProfile::from_json(k, "hw.json"); });
    EXPECT_NE(msg.find(fmt::format("'{}'", key)), std::string::npos) << msg;
  }
}

// The BLAS kernels a CPU profile was measured with: kept, absent in older files and
// GPU profiles (unknown), and a string.
TEST(HardwareProfile, BlasCoreRoundTripsAndIsChecked) {
  HardwareProfile p = hand_profile();
  EXPECT_FALSE(p.to_json().contains("blas_core"));
  EXPECT_EQ(HardwareProfile::from_json(p.to_json(), "hw.json").blas_core, "");
  p.blas_core = "SkylakeX";
  EXPECT_EQ(HardwareProfile::from_json(p.to_json(), "hw.json").blas_core, "SkylakeX");
  nlohmann::json j = p.to_json();
  j["blas_core"] = 3;
  const std::string msg = message_of([&] { HardwareProfile::from_json(j, "hw.json"); });
  EXPECT_NE(msg.find("'blas_core'"), std::string::npos) << msg;
}

TEST(HardwareProfile, ErrorsNameTheFileAndTheField) {
  // A directory given for the file (e.g. calibrate's --out): a DataError naming it.
  const std::string dir = ::testing::TempDir();
  std::string dmsg = message_of([&] { HardwareProfile::load(dir); });
  EXPECT_NE(dmsg.find("is a directory"), std::string::npos) << dmsg;

  nlohmann::json j = hand_profile().to_json();
  j.erase("memory_bandwidth_Bps");
  std::string msg = message_of([&] { HardwareProfile::from_json(j, "hw.json"); });
  EXPECT_NE(msg.find("hw.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find("memory_bandwidth_Bps"), std::string::npos) << msg;

  j = hand_profile().to_json();
  j["gemm"][1]["flops_per_s"] = -3;
  msg = message_of([&] { HardwareProfile::from_json(j, "hw.json"); });
  EXPECT_NE(msg.find("gemm[1].flops_per_s"), std::string::npos) << msg;

  j = hand_profile().to_json();
  j["op_tables"]["rmsnorm_forward"][1]["bytes"] = 500;  // not sorted
  msg = message_of([&] { HardwareProfile::from_json(j, "hw.json"); });
  EXPECT_NE(msg.find("op_tables.rmsnorm_forward[1].bytes"), std::string::npos) << msg;

  // A misspelt table is named, not ignored (its op would be priced by the fallback).
  j = hand_profile().to_json();
  j["op_tables"]["optimiser_step"] = j["op_tables"]["rmsnorm_forward"];
  msg = message_of([&] { HardwareProfile::from_json(j, "hw.json"); });
  EXPECT_NE(msg.find("'optimiser_step' is not an op table (did you mean 'optimizer_step'?)"), std::string::npos) << msg;

  const auto bad = std::filesystem::path(MOEFLEX_BINARY_DIR) / "test_cost_model.d" / "bad.json";
  std::filesystem::create_directories(bad.parent_path());
  std::ofstream(bad) << "{ not json";
  msg = message_of([&] { HardwareProfile::load(bad); });
  EXPECT_NE(msg.find("bad.json"), std::string::npos) << msg;
  msg = message_of([&] { HardwareProfile::load(bad.parent_path() / "missing.json"); });
  EXPECT_NE(msg.find("missing.json"), std::string::npos) << msg;
}

TEST(HardwareProfile, LayoutsRoundTripAndVersionOneFilesStillRead) {
  HardwareProfile p = hand_profile();
  p.gemm[0].layout = GemmLayout::nt;
  p.gemm[1].layout = GemmLayout::nn;
  p.gemm[2].layout = GemmLayout::tn;
  const nlohmann::json j = p.to_json();
  EXPECT_EQ(j["version"], kHardwareProfileVersion);
  EXPECT_EQ(j["gemm"][0]["layout"], "nt");
  EXPECT_EQ(j["gemm"][1]["layout"], "nn");
  EXPECT_EQ(j["gemm"][2]["layout"], "tn");
  EXPECT_FALSE(j["gemm"][3].contains("layout"));  // `any` is written as no layout
  const HardwareProfile q = HardwareProfile::from_json(j, "v2.json");
  EXPECT_EQ(q.gemm[0].layout, GemmLayout::nt);
  EXPECT_EQ(q.gemm[1].layout, GemmLayout::nn);
  EXPECT_EQ(q.gemm[2].layout, GemmLayout::tn);
  EXPECT_EQ(q.gemm[3].layout, GemmLayout::any);
  EXPECT_EQ(q.to_json(), j);

  // A version 1 file (what calibrate wrote before layouts): read, every sample `any`.
  nlohmann::json v1 = hand_profile().to_json();
  v1["version"] = 1;
  const HardwareProfile r = HardwareProfile::from_json(v1, "v1.json");
  ASSERT_EQ(r.gemm.size(), 4u);
  for (const GemmSample& s : r.gemm) EXPECT_EQ(s.layout, GemmLayout::any);
  EXPECT_DOUBLE_EQ(CostModel(r).gemm(150, 200, 300, GemmLayout::nn), 1.35e-3);
}

TEST(HardwareProfile, UnknownVersionsAndLayoutsAreRefusedByName) {
  nlohmann::json j = hand_profile().to_json();
  j["version"] = kHardwareProfileVersion + 1;
  std::string msg = message_of([&] { HardwareProfile::from_json(j, "future.json"); });
  EXPECT_NE(msg.find("future.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'version'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("newer"), std::string::npos) << msg;
  j["version"] = 0;
  msg = message_of([&] { HardwareProfile::from_json(j, "old.json"); });
  EXPECT_NE(msg.find("moeflex calibrate"), std::string::npos) << msg;
  j["version"] = "2";
  msg = message_of([&] { HardwareProfile::from_json(j, "str.json"); });
  EXPECT_NE(msg.find("must be an integer"), std::string::npos) << msg;

  j = hand_profile().to_json();
  j["gemm"][2]["layout"] = "tt";
  msg = message_of([&] { HardwareProfile::from_json(j, "hw.json"); });
  EXPECT_NE(msg.find("gemm[2].layout"), std::string::npos) << msg;
  EXPECT_NE(msg.find("\"tt\""), std::string::npos) << msg;
}

TEST(CostModel, GemmLookupGivesHandComputedTimes) {
  const CostModel m(hand_profile());
  // Exact samples.
  EXPECT_DOUBLE_EQ(m.gemm(100, 200, 300), 1.2e-3);
  EXPECT_DOUBLE_EQ(m.gemm(200, 200, 300), 1.5e-3);
  // On the line along M: time linear between M = 100 and 200.
  EXPECT_DOUBLE_EQ(m.gemm(150, 200, 300), 1.35e-3);
  EXPECT_DOUBLE_EQ(m.gemm(125, 200, 300), 1.275e-3);
  // Past the line's end: the end's rate (1.6e10 FLOP/s).
  EXPECT_DOUBLE_EQ(m.gemm(400, 200, 300), 2.0 * 400 * 200 * 300 / 1.6e10);
  EXPECT_DOUBLE_EQ(m.gemm(50, 200, 300), 2.0 * 50 * 200 * 300 / 1e10);
  // No line: the nearest samples in log2 extents. (128,128,128) is at squared distance
  // 3 from both (64,64,64) and (256,256,256), farther from the rest: geometric mean of
  // 1e10 and 4e10 = 2e10 ... blended with the two (.., 200, 300) samples at larger
  // distance, so check the rate lies between and nearer the two cubes.
  const double r = m.gemm_rate(128, 128, 128);
  EXPECT_GT(r, 1e10);
  EXPECT_LT(r, 4e10);
  // Degenerate shapes.
  EXPECT_EQ(m.gemm(0, 200, 300), 0.0);
  EXPECT_DOUBLE_EQ(m.gemm(10, 100, 0), 1e-6 + 10 * 100 * 4 / 1e9);  // C = 0: an elementwise pass
}

TEST(CostModel, NearestNeighbourFallbackIsAWeightedGeometricMean) {
  HardwareProfile p = hand_profile();
  p.gemm = {{64, 64, 64, 1e10}, {256, 256, 256, 4e10}};
  const CostModel m(p);
  // Both at squared log2 distance 3: equal weights, geometric mean 2e10.
  EXPECT_NEAR(m.gemm_rate(128, 128, 128), 2e10, 1e-3);
  EXPECT_NEAR(m.gemm(128, 128, 128), 2.0 * 128 * 128 * 128 / 2e10, 1e-15);
}

/// Samples of the three layouts on one shape family: an nt line along M through
/// (N, K) = (200, 300) at 1e10 FLOP/s, an nn sample of (150, 200, 300) at 2e10 and a
/// far-away `any` sample.
HardwareProfile layout_profile() {
  HardwareProfile p = hand_profile();
  p.gemm = {{100, 200, 300, 1e10, GemmLayout::nt},
            {200, 200, 300, 1e10, GemmLayout::nt},
            {150, 200, 300, 2e10, GemmLayout::nn},
            {4096, 4096, 4096, 5e10, GemmLayout::any}};
  return p;
}

TEST(CostModel, GemmLookupPrefersTheCallsLayout) {
  const CostModel m(layout_profile());
  const double f = 2.0 * 150 * 200 * 300;  // 1.8e7 FLOPs
  // nt: interpolated on its own line (1.2e-3 .. 2.4e-3 s), not nn's exact sample.
  EXPECT_DOUBLE_EQ(m.gemm(150, 200, 300, GemmLayout::nt), 1.8e-3);
  // nn: its exact sample.
  EXPECT_DOUBLE_EQ(m.gemm(150, 200, 300, GemmLayout::nn), f / 2e10);
  // tn has no sample: the pool of all samples, whose line along M holds 1.2e-3 s
  // (nt, M = 100), 0.9e-3 s (nn, M = 150), 2.4e-3 s (nt, M = 200); made
  // nondecreasing, the first two become their mean.
  EXPECT_DOUBLE_EQ(m.gemm(150, 200, 300, GemmLayout::tn), 1.05e-3);
  EXPECT_DOUBLE_EQ(m.gemm(150, 200, 300), 1.05e-3);
  // nn off its only sample: no nn line through (120, 200, 300) other than the one
  // point, whose rate is kept (the nearest end of its line).
  EXPECT_DOUBLE_EQ(m.gemm_rate(120, 200, 300, GemmLayout::nn), 2e10);
  // The linear layers call their layouts: forward nt, dx nn, dw tn.
  EXPECT_DOUBLE_EQ(m.linear_forward(150, 300, 200), m.gemm(150, 200, 300, GemmLayout::nt));
  EXPECT_DOUBLE_EQ(m.linear_backward(150, 200, 300, true, false), m.gemm(150, 200, 300, GemmLayout::nn));
  EXPECT_DOUBLE_EQ(m.linear_backward(300, 200, 150, false, true), m.gemm(150, 200, 300, GemmLayout::tn));
  EXPECT_DOUBLE_EQ(m.grouped_linear_forward({150, 0, 150}, 300, 200), 2 * 1.8e-3);
  EXPECT_DOUBLE_EQ(m.grouped_linear_backward({150}, 200, 300, true, false), f / 2e10);
}

TEST(CostModel, GemmTimeHitsSamplesAndGrowsAlongALine) {
  // A line along M with an uneven rate: time must equal every sample exactly and
  // never fall as M grows, below, between and beyond the samples.
  HardwareProfile p = hand_profile();
  p.gemm.clear();
  const std::vector<std::pair<std::int64_t, double>> line = {{8, 2e9}, {32, 6e9}, {64, 1e10}, {96, 1.4e10},
                                                             {128, 1.6e10}, {512, 3e10}};
  for (auto [M, rate] : line) p.gemm.push_back({M, 256, 256, rate, GemmLayout::nt});
  const CostModel m(p);
  for (auto [M, rate] : line) EXPECT_DOUBLE_EQ(m.gemm(M, 256, 256, GemmLayout::nt), 2.0 * M * 256 * 256 / rate);
  double last = 0;
  for (std::int64_t M = 1; M <= 1024; ++M) {
    const double t = m.gemm(M, 256, 256, GemmLayout::nt);
    EXPECT_GE(t, last) << "M=" << M;
    last = t;
  }
}

TEST(CostModel, NoisyFallsAreSmoothedToTheirMean) {
  std::vector<Seconds> t = {1, 3, 2, 4, 6, 5, 5, 7};
  make_nondecreasing(t);
  EXPECT_EQ(t, (std::vector<Seconds>{1, 2.5, 2.5, 4, 16.0 / 3, 16.0 / 3, 16.0 / 3, 7}));
  std::vector<Seconds> sorted = {1, 2, 2, 3};
  make_nondecreasing(sorted);
  EXPECT_EQ(sorted, (std::vector<Seconds>{1, 2, 2, 3}));
  // On a GEMM line: M = 64 measured faster than M = 32 (noise); both get the mean time.
  HardwareProfile p = hand_profile();
  p.gemm = {{32, 100, 100, 2.0 * 32 * 100 * 100 / 4e-6, GemmLayout::nt},
            {64, 100, 100, 2.0 * 64 * 100 * 100 / 2e-6, GemmLayout::nt},
            {128, 100, 100, 2.0 * 128 * 100 * 100 / 9e-6, GemmLayout::nt}};
  const CostModel m(p);
  EXPECT_DOUBLE_EQ(m.gemm(32, 100, 100, GemmLayout::nt), 3e-6);
  EXPECT_DOUBLE_EQ(m.gemm(64, 100, 100, GemmLayout::nt), 3e-6);
  EXPECT_DOUBLE_EQ(m.gemm(128, 100, 100, GemmLayout::nt), 9e-6);
  // And on an op table.
  p.op_tables[op_names::kSwigluForward] = {{100, 5e-6}, {200, 3e-6}, {400, 8e-6}};
  EXPECT_DOUBLE_EQ(CostModel(p).op(op_names::kSwigluForward, 200), 4e-6);
}

TEST(CostModel, ElementwiseTableTakesPrecedence) {
  HardwareProfile p = hand_profile();
  p.op_tables[op_names::kElementwise] = {{3000, 2e-6}, {30000, 11e-6}};
  const CostModel m(p);
  // From (0 B, launch_overhead 1 us) to the first point, between points, then the last rate.
  EXPECT_DOUBLE_EQ(m.elementwise(1500), 1.5e-6);
  EXPECT_DOUBLE_EQ(m.elementwise(16500), 6.5e-6);
  EXPECT_DOUBLE_EQ(m.elementwise(60000), 22e-6);
  EXPECT_EQ(m.elementwise(0), 0.0);
  EXPECT_EQ(op_bytes::add_inplace(1000), 12000);
  // A family without a table of its own is generic elementwise work.
  EXPECT_DOUBLE_EQ(m.swiglu_forward(1000), m.elementwise(op_bytes::swiglu_forward(1000)));
  // One with a table keeps it.
  EXPECT_DOUBLE_EQ(m.op(op_names::kRmsnormForward, 2000), 3e-6);
}

TEST(CostModel, OpTablesElementwiseAndCopies) {
  const CostModel m(hand_profile());
  // rmsnorm_forward table: (0 B, 1 us) -> (1000 B, 2 us) -> (3000 B, 4 us), then 4 us per 3000 B.
  EXPECT_DOUBLE_EQ(m.op(op_names::kRmsnormForward, 500), 1.5e-6);
  EXPECT_DOUBLE_EQ(m.op(op_names::kRmsnormForward, 2000), 3e-6);
  EXPECT_DOUBLE_EQ(m.op(op_names::kRmsnormForward, 6000), 8e-6);
  // The helper prices the op's bytes: n=2, d=300 moves (2*2*300 + 300 + 2) * 4 = 6008 B.
  EXPECT_EQ(op_bytes::rmsnorm_forward(2, 300), 6008);
  EXPECT_DOUBLE_EQ(m.rmsnorm_forward(2, 300), 4e-6 * 6008 / 3000);
  // No table: launch overhead + bytes / memory bandwidth.
  EXPECT_DOUBLE_EQ(m.elementwise(1'000'000), 1e-6 + 1e-3);
  EXPECT_DOUBLE_EQ(m.swiglu_forward(1000), 1e-6 + 12000 / 1e9);
  EXPECT_EQ(m.elementwise(0), 0.0);
  EXPECT_EQ(m.swiglu_forward(0), 0.0);
  // Copies: latency + bytes / bandwidth of the direction.
  EXPECT_DOUBLE_EQ(m.copy_h2d(100'000'000), 1e-5 + 1e-2);
  EXPECT_DOUBLE_EQ(m.copy_d2h(100'000'000), 1e-5 + 2e-2);
  EXPECT_EQ(m.copy_h2d(0), 0.0);
  // A measured copy table takes precedence, starting from (0 bytes, copy_latency).
  HardwareProfile p = hand_profile();
  p.op_tables[op_names::kCopyH2D] = {{1'000'000, 1e-4}};
  const CostModel t(p);
  EXPECT_DOUBLE_EQ(t.copy_h2d(500'000), 1e-5 + 0.5 * (1e-4 - 1e-5));
  EXPECT_DOUBLE_EQ(t.copy_h2d(2'000'000), 2e-4);
  EXPECT_DOUBLE_EQ(t.copy_d2h(100'000'000), 1e-5 + 2e-2);  // no d2h table: the scalars
}

TEST(CostModel, GroupedGemmIsTheSumOverNonEmptyGroups) {
  const CostModel m(hand_profile());
  // Empty groups cost 0: the grouped kernel skips them without calling BLAS.
  EXPECT_DOUBLE_EQ(m.grouped_gemm({100, 0, 200, 0}, 200, 300), 1.2e-3 + 1.5e-3);
  EXPECT_EQ(m.grouped_gemm({0, 0, 0}, 200, 300), 0.0);
  EXPECT_EQ(m.grouped_gemm({}, 200, 300), 0.0);
  const std::vector<std::int64_t> rows = {150, 0, 125};
  EXPECT_DOUBLE_EQ(m.grouped_linear_forward(rows, 300, 200), m.gemm(150, 200, 300) + m.gemm(125, 200, 300));
  EXPECT_DOUBLE_EQ(m.grouped_linear_backward(rows, 300, 200),
                   m.gemm(150, 300, 200) + m.gemm(200, 300, 150) + m.gemm(125, 300, 200) + m.gemm(200, 300, 125));
  EXPECT_DOUBLE_EQ(m.grouped_linear_backward(rows, 300, 200, true, false), m.gemm(150, 300, 200) + m.gemm(125, 300, 200));
  // Linear layers are their GEMMs.
  EXPECT_DOUBLE_EQ(m.linear_forward(150, 300, 200), 1.35e-3);
  EXPECT_DOUBLE_EQ(m.linear_backward(150, 300, 200), m.gemm(150, 300, 200) + m.gemm(200, 300, 150));
  EXPECT_EQ(m.linear_backward(0, 300, 200), 0.0);
  // Attention without its whole-op tables: per-head GEMMs plus its softmax (no
  // table here: elementwise).
  const double per_head = m.gemm(128, 128, 64, GemmLayout::nt) + m.gemm(128, 64, 128, GemmLayout::nn);
  EXPECT_DOUBLE_EQ(m.attention_forward(2, 128, 4, 64),
                   8 * per_head + m.elementwise(op_bytes::attention_softmax_forward(2, 128, 4)));
  // With them: B x H heads at the per-head table's time for S (x = 8 S^2 bytes).
  HardwareProfile p = hand_profile();
  EXPECT_EQ(op_bytes::attention_softmax_forward(1, 128, 1), 8 * 128 * 128);
  p.op_tables[op_names::kAttentionForward] = {{8 * 64 * 64, 10e-6}, {8 * 128 * 128, 30e-6}};
  p.op_tables[op_names::kAttentionBackward] = {{8 * 128 * 128, 70e-6}};
  const CostModel a(p);
  EXPECT_DOUBLE_EQ(a.attention_forward(2, 128, 4, 64), 8 * 30e-6);
  EXPECT_DOUBLE_EQ(a.attention_forward(3, 64, 2, 64), 6 * 10e-6);
  EXPECT_DOUBLE_EQ(a.attention_backward(1, 128, 8, 64), 8 * 70e-6);
}

TEST(CostModel, InSituOpsAnswerTheirExactShapesAndScaleGroupedGemms) {
  HardwareProfile p = hand_profile();
  const CostModel base(p);
  p.in_situ_ops = {{"linear_forward", {100, 300, 200}, 7e-3},
                   {"linear_backward_dw", {100, 300, 200}, 2e-3},
                   {"rmsnorm_forward", {10, 50}, 9e-6}};
  p.in_situ_scales = {{"grouped_linear_backward_dw", 300, 200, 1.5}};
  p.in_situ_source = "/runs/a";
  const CostModel c(p);
  // linear_forward(n=100, in=300, out=200) is gemm(100, 200, 300): 1.2e-3 s from the
  // table, 7e-3 s measured in situ; another n falls back to the table.
  EXPECT_DOUBLE_EQ(base.linear_forward(100, 300, 200), 1.2e-3);
  EXPECT_DOUBLE_EQ(c.linear_forward(100, 300, 200), 7e-3);
  EXPECT_DOUBLE_EQ(c.linear_forward(200, 300, 200), base.linear_forward(200, 300, 200));
  // Backward: the measured dW plus the modelled dX (no in-situ dX at this shape).
  EXPECT_DOUBLE_EQ(c.linear_backward(100, 300, 200, true, true), 2e-3 + base.linear_backward(100, 300, 200, true, false));
  EXPECT_DOUBLE_EQ(c.linear_backward(100, 300, 200, false, true), 2e-3);
  EXPECT_DOUBLE_EQ(c.rmsnorm_forward(10, 50), 9e-6);
  EXPECT_DOUBLE_EQ(c.rmsnorm_forward(10, 100), base.rmsnorm_forward(10, 100));
  // Grouped: only the dW part of [in 300, out 200] is scaled.
  const std::vector<std::int64_t> rows = {100, 0, 200};
  EXPECT_DOUBLE_EQ(c.grouped_linear_backward(rows, 300, 200, false, true),
                   1.5 * base.grouped_linear_backward(rows, 300, 200, false, true));
  EXPECT_DOUBLE_EQ(c.grouped_linear_backward(rows, 300, 200, true, false),
                   base.grouped_linear_backward(rows, 300, 200, true, false));
  EXPECT_DOUBLE_EQ(c.grouped_linear_forward(rows, 300, 200), base.grouped_linear_forward(rows, 300, 200));
  // The JSON keeps them; a malformed entry is refused by name.
  const HardwareProfile q = HardwareProfile::from_json(p.to_json(), "q.json");
  EXPECT_EQ(q.to_json(), p.to_json());
  EXPECT_EQ(q.in_situ_source, "/runs/a");
  nlohmann::json bad = p.to_json();
  bad["in_situ"]["scales"][0]["scale"] = 0;
  EXPECT_NE(message_of([&] { HardwareProfile::from_json(bad, "b.json"); }).find("in_situ.scales[0].scale"),
            std::string::npos);
}

TEST(Calibrate, InSituProfileTakesARunsMediansAndGroupedRatios) {
  const auto dir = std::filesystem::path(MOEFLEX_BINARY_DIR) / "test_cost_model.d" / "run";
  std::filesystem::create_directories(dir);
  const HardwareProfile base = hand_profile();
  const CostModel model(base);
  const std::vector<std::int64_t> rows = {64, 0, 192};
  const double predicted_fwd = model.grouped_linear_forward(rows, 300, 200);
  nlohmann::json shapes = nlohmann::json::array();
  shapes.push_back({{"kind", "linear_forward"}, {"shape", {100, 300, 200}}, {"count", 4},
                    {"measured_median_s", 5e-3}, {"measured_total_s", 2.1e-2}});
  shapes.push_back({{"kind", "z_loss_backward"},
                    {"shape", {100, 8}},
                    {"count", 4},
                    {"measured_median_s", 6e-5},
                    {"measured_total_s", 2.5e-4}});
  shapes.push_back({{"kind", "moe_plan_dispatch"},
                    {"shape", {100, 2}},
                    {"count", 4},  // not taken
                    {"measured_median_s", 1e-5},
                    {"measured_total_s", 4e-5}});
  // Two row splits of one weight: 3 calls measured 2x the model in all.
  shapes.push_back({{"kind", "grouped_linear_forward"}, {"shape", {64, 0, 192, 300, 200}}, {"count", 3},
                    {"measured_median_s", 2 * predicted_fwd}, {"measured_total_s", 6 * predicted_fwd}});
  {
    std::ofstream out(dir / "op_times.json");
    out << nlohmann::json{{"shapes", shapes}}.dump();
  }
  const HardwareProfile p = in_situ_profile(base, dir);
  ASSERT_EQ(p.in_situ_ops.size(), 2u);
  EXPECT_EQ(p.in_situ_ops[0].kind, "linear_forward");
  EXPECT_DOUBLE_EQ(p.in_situ_ops[0].seconds, 5e-3);
  EXPECT_EQ(p.in_situ_ops[1].kind, "z_loss_backward");
  // The cost model answers with them at exactly their shapes, with the base elsewhere.
  EXPECT_DOUBLE_EQ(CostModel(p).linear_forward(100, 300, 200), 5e-3);
  EXPECT_DOUBLE_EQ(CostModel(p).z_loss_backward(100, 8), 6e-5);
  EXPECT_DOUBLE_EQ(CostModel(p).z_loss_backward(100, 16), model.z_loss_backward(100, 16));
  EXPECT_DOUBLE_EQ(CostModel(p).z_loss_forward(100, 8), model.z_loss_forward(100, 8));
  ASSERT_EQ(p.in_situ_scales.size(), 1u);
  EXPECT_DOUBLE_EQ(p.in_situ_scales[0].scale, 2.0);
  EXPECT_EQ(p.gemm.size(), base.gemm.size());  // the base's measurements are kept
  EXPECT_DOUBLE_EQ(CostModel(p).grouped_linear_forward({10, 20, 30}, 300, 200),
                   2.0 * model.grouped_linear_forward({10, 20, 30}, 300, 200));
  // Chained onto that in-situ profile, a run with the grouped GEMMs alone: its ratio
  // is taken against the tables (2, not 2 / 2), and the earlier run's ops are kept.
  {
    nlohmann::json grouped_only = nlohmann::json::array();
    for (const auto& e : shapes)
      if (e["kind"] == "grouped_linear_forward") grouped_only.push_back(e);
    ASSERT_EQ(grouped_only.size(), 1u);
    std::ofstream out(dir / "op_times.json");
    out << nlohmann::json{{"shapes", grouped_only}}.dump();
  }
  const HardwareProfile chained = in_situ_profile(p, dir);
  ASSERT_EQ(chained.in_situ_scales.size(), 1u);
  EXPECT_DOUBLE_EQ(chained.in_situ_scales[0].scale, 2.0);
  ASSERT_EQ(chained.in_situ_ops.size(), 2u);
  EXPECT_DOUBLE_EQ(CostModel(chained).linear_forward(100, 300, 200), 5e-3);
  EXPECT_NE(chained.in_situ_source.find("; "), std::string::npos) << chained.in_situ_source;
  // A run without op_times.json is refused by name.
  std::filesystem::remove(dir / "op_times.json");
  EXPECT_NE(message_of([&] { in_situ_profile(base, dir); }).find("--profile-ops"), std::string::npos);
}

namespace {

/// The message of the moeflex::Error `fn` throws, prefixed by its type ("" when none).
std::string typed_message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const ConfigError& e) {
    return std::string("ConfigError: ") + e.what();
  } catch (const DataError& e) {
    return std::string("DataError: ") + e.what();
  }
  return "";
}

/// A profile with in-situ entries, as JSON, for hand edits.
nlohmann::json in_situ_json() {
  HardwareProfile p = hand_profile();
  p.in_situ_ops = {{"linear_forward", {100, 300, 200}, 7e-3}, {"rmsnorm_forward", {10, 50}, 9e-6}};
  p.in_situ_scales = {{"grouped_linear_forward", 300, 200, 1.5}};
  p.in_situ_source = "/runs/a";
  return p.to_json();
}

}  // namespace

TEST(HardwareProfile, InSituSectionRefusesUnknownKindsKeysOutOfRangeValuesAndDuplicates) {
  const nlohmann::json good = in_situ_json();
  ASSERT_EQ(HardwareProfile::from_json(good, "g.json").in_situ_ops.size(), 2u);
  auto refused = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json j = good;
    edit(j);
    return message_of([&] { HardwareProfile::from_json(j, "h.json"); });
  };
  // Unknown kinds, with the closest known one suggested when near.
  std::string m = refused([](nlohmann::json& j) { j["in_situ"]["ops"][1]["kind"] = "linear_fwd_typo"; });
  EXPECT_NE(m.find("'h.json': field 'in_situ.ops[1].kind' 'linear_fwd_typo' is not an in-situ op kind"),
            std::string::npos) << m;
  m = refused([](nlohmann::json& j) { j["in_situ"]["ops"][0]["kind"] = "linear_froward"; });
  EXPECT_NE(m.find("did you mean 'linear_forward'?"), std::string::npos) << m;
  m = refused([](nlohmann::json& j) { j["in_situ"]["scales"][0]["kind"] = "linear_forward"; });  // not a scaled kind
  EXPECT_NE(m.find("in_situ.scales[0].kind' 'linear_forward' is not a scaled in-situ kind"), std::string::npos) << m;
  // Unknown keys: in in_situ, in its entries, and at the top level.
  m = refused([](nlohmann::json& j) { j["in_situ"]["opps"] = nlohmann::json::array(); });
  EXPECT_NE(m.find("field 'in_situ.opps' is not a known key (did you mean 'ops'?)"), std::string::npos) << m;
  m = refused([](nlohmann::json& j) { j["in_situ"]["ops"][0]["secs"] = 1; });
  EXPECT_NE(m.find("field 'in_situ.ops[0].secs' is not a known key"), std::string::npos) << m;
  m = refused([](nlohmann::json& j) { j["in_situ"]["scales"][0]["scael"] = 1; });
  EXPECT_NE(m.find("field 'in_situ.scales[0].scael' is not a known key (did you mean 'scale'?)"), std::string::npos)
      << m;
  m = refused([](nlohmann::json& j) { j["gemms"] = nlohmann::json::array(); });
  EXPECT_NE(m.find("field 'gemms' is not a known key (did you mean 'gemm'?)"), std::string::npos) << m;
  // Seconds in (0, 3600], scales in [1e-3, 1e3].
  for (const double bad : {0.0, -1e-3, 1e300, 3600.5}) {
    m = refused([&](nlohmann::json& j) { j["in_situ"]["ops"][1]["seconds"] = bad; });
    EXPECT_NE(m.find(fmt::format("field 'in_situ.ops[1].seconds' must be in (0, 3600] (got {})", bad)),
              std::string::npos) << m;
  }
  for (const double bad : {0.0, 5e-4, 1001.0, 1e300}) {
    m = refused([&](nlohmann::json& j) { j["in_situ"]["scales"][0]["scale"] = bad; });
    EXPECT_NE(m.find(fmt::format("field 'in_situ.scales[0].scale' must be in [0.001, 1000] (got {})", bad)),
              std::string::npos) << m;
  }
  // Shapes: positive integers, as many as the kind has.
  m = refused([](nlohmann::json& j) { j["in_situ"]["ops"][0]["shape"][1] = 0; });
  EXPECT_NE(m.find("field 'in_situ.ops[0].shape[1]' must be >= 1 (got 0)"), std::string::npos) << m;
  m = refused([](nlohmann::json& j) { j["in_situ"]["ops"][0]["shape"][2] = 18446744073709551615ull; });
  EXPECT_NE(m.find("field 'in_situ.ops[0].shape[2]' is out of range (got 18446744073709551615)"), std::string::npos)
      << m;
  m = refused([](nlohmann::json& j) { j["in_situ"]["ops"][1]["shape"] = {10, 50, 2}; });
  EXPECT_NE(m.find("field 'in_situ.ops[1].shape' must be an array of 2 integers for rmsnorm_forward"),
            std::string::npos) << m;
  m = refused([](nlohmann::json& j) { j["in_situ"]["scales"][0]["in"] = -300; });
  EXPECT_NE(m.find("field 'in_situ.scales[0].in' must be >= 1 (got -300)"), std::string::npos) << m;
  // Duplicates name both entries (last-wins would hide one measurement).
  m = refused([](nlohmann::json& j) {
    j["in_situ"]["ops"].push_back(j["in_situ"]["ops"][0]);
    j["in_situ"]["ops"].back()["seconds"] = 1e-3;
  });
  EXPECT_NE(m.find("field 'in_situ.ops[2]' repeats in_situ.ops[0] (linear_forward at [100,300,200])"),
            std::string::npos) << m;
  m = refused([](nlohmann::json& j) { j["in_situ"]["scales"].push_back(j["in_situ"]["scales"][0]); });
  EXPECT_NE(m.find("field 'in_situ.scales[1]' repeats in_situ.scales[0] (grouped_linear_forward [300, 200])"),
            std::string::npos) << m;
  // Every exact kind has a shape rank; the shipped profile still loads.
  for (const char* kind : kInSituExactKinds) EXPECT_GT(in_situ_shape_rank(kind), 0u) << kind;
  EXPECT_EQ(in_situ_shape_rank("grouped_linear_forward"), 0u);
  const auto shipped = std::filesystem::path(MOEFLEX_SOURCE_DIR) / "data" / "hardware" / "this-machine.json";
  if (std::filesystem::exists(shipped)) {
    EXPECT_NO_THROW(HardwareProfile::load(shipped));
  }
}

TEST(Calibrate, InSituProfileTakesFp32RunsOfTheBaseProfilesDeviceOnly) {
  const auto dir = std::filesystem::path(MOEFLEX_BINARY_DIR) / "test_cost_model.d" / "run-device";
  std::filesystem::create_directories(dir);
  const nlohmann::json shapes = nlohmann::json::array({{{"kind", "linear_forward"},
                                                        {"shape", {100, 300, 200}},
                                                        {"count", 4},
                                                        {"measured_median_s", 5e-3},
                                                        {"measured_total_s", 2.1e-2}}});
  auto run_with =
      [&](const HardwareProfile& base, const char* device, const char* precision) {
        std::ofstream(dir / "op_times.json")
            << nlohmann::json{{"shapes", shapes}, {"device", device}, {"precision", precision}}.dump();
        return message_of([&] { in_situ_profile(base, dir); });
      };
  HardwareProfile base = hand_profile();
  EXPECT_EQ(run_with(base, "cpu", "fp32"), "(no DataError)");
  std::string m = run_with(base, "cuda", "fp32");
  EXPECT_NE(m.find("was measured on cuda and the base profile on cpu"), std::string::npos) << m;
  m = run_with(base, "cpu", "bf16");
  EXPECT_NE(m.find("was measured on a bf16 run"), std::string::npos) << m;
  std::ofstream(dir / "op_times.json") << nlohmann::json{{"shapes", shapes}, {"device", 5}}.dump();
  m = message_of([&] { in_situ_profile(base, dir); });
  EXPECT_NE(m.find("\"device\" must be a string (got 5)"), std::string::npos) << m;
  base.device = "cuda";
  EXPECT_EQ(run_with(base, "cuda", "fp32"), "(no DataError)");
  std::filesystem::remove_all(dir);
}

TEST(Calibrate, InSituProfileRefusesBadShapeEntriesNamingIndexKindAndField) {
  const auto dir = std::filesystem::path(MOEFLEX_BINARY_DIR) / "test_cost_model.d" / "run-bad";
  std::filesystem::create_directories(dir);
  const HardwareProfile base = hand_profile();
  const double fwd = CostModel(base).grouped_linear_forward({64, 0, 192}, 300, 200);
  const nlohmann::json ok_exact = {{"kind", "linear_forward"}, {"shape", {100, 300, 200}}, {"count", 4},
                                   {"measured_median_s", 5e-3}, {"measured_total_s", 2.1e-2}};
  const nlohmann::json ok_grouped = {{"kind", "grouped_linear_forward"}, {"shape", {64, 0, 192, 300, 200}},
                                     {"count", 3}, {"measured_median_s", 2 * fwd}, {"measured_total_s", 6 * fwd}};
  // op_times.json with ok_exact, ok_grouped and `extra` after them (at index 2).
  auto run_with = [&](const nlohmann::json& extra) {
    nlohmann::json shapes = {ok_exact, ok_grouped};
    if (!extra.is_null()) shapes.push_back(extra);
    std::ofstream(dir / "op_times.json") << nlohmann::json{{"shapes", shapes}}.dump();
    return message_of([&] { in_situ_profile(base, dir); });
  };
  auto with = [](nlohmann::json e, const char* key, const nlohmann::json& v) {
    e[key] = v;
    return e;
  };
  EXPECT_EQ(run_with(nullptr), "(no DataError)");
  const std::string file = (dir / "op_times.json").string();
  const std::string at = fmt::format("'{}': shapes[2] (linear_forward): ", file);
  const std::string gat = fmt::format("'{}': shapes[2] (grouped_linear_forward): ", file);
  std::string m = run_with(with(ok_exact, "shape", {-5, 300, 200}));
  EXPECT_NE(m.find(at + "'shape[0]' must be >= 0 (got -5)"), std::string::npos) << m;
  m = run_with(with(ok_exact, "shape", {100, 1e30, 200}));
  EXPECT_NE(m.find(at + "'shape[1]' must be an integer (got 1e+30)"), std::string::npos) << m;
  m = run_with(with(ok_exact, "shape", {100, 300, 18446744073709551615ull}));
  EXPECT_NE(m.find(at + "'shape[2]' is out of range (got 18446744073709551615)"), std::string::npos) << m;
  m = run_with(with(ok_exact, "shape", {64.5, 300, 200}));
  EXPECT_NE(m.find(at + "'shape[0]' must be an integer (got 64.5)"), std::string::npos) << m;
  m = run_with(with(ok_exact, "shape", nlohmann::json::array()));
  EXPECT_NE(m.find(at + "'shape' must hold 3 extents (got [])"), std::string::npos) << m;
  m = run_with(with(ok_exact, "count", 0));
  EXPECT_NE(m.find(at + "'count' must be >= 1 (got 0)"), std::string::npos) << m;
  m = run_with(with(ok_exact, "count", 2.5));
  EXPECT_NE(m.find(at + "'count' must be an integer (got 2.5)"), std::string::npos) << m;
  m = run_with(with(ok_exact, "measured_median_s", 0));
  EXPECT_NE(m.find(at + "'measured_median_s' must be in (0, 3600] seconds (got 0)"), std::string::npos) << m;
  m = run_with(with(ok_exact, "measured_median_s", 1e300));
  EXPECT_NE(m.find(at + "'measured_median_s' must be in (0, 3600] seconds (got 1e+300)"), std::string::npos) << m;
  m = run_with(with(ok_exact, "shape", {100, 300, 200}));  // the same (kind, shape) as shapes[0]
  EXPECT_NE(m.find(at + "'shape' [100,300,200] repeats shapes[0]'s"), std::string::npos) << m;
  m = run_with(with(ok_grouped, "shape", {64, 0, -300, 200}));
  EXPECT_NE(m.find(gat + "'shape[-2] (in)' must be >= 1 (got -300)"), std::string::npos) << m;
  m = run_with(with(ok_grouped, "shape", {-1, 300, 200}));
  EXPECT_NE(m.find(gat + "'shape[0]' must be >= 0 (got -1)"), std::string::npos) << m;
  m = run_with(with(ok_grouped, "shape", {300, 200}));
  EXPECT_NE(m.find(gat + "'shape' must be [rows of each group..., in, out]"), std::string::npos) << m;
  m = run_with(with(ok_grouped, "measured_total_s", -1));
  EXPECT_NE(m.find(gat + "'measured_total_s' must be in (0, 10800] seconds (got -1)"), std::string::npos) << m;
  // Rows far beyond the measured time: a ratio no machine has, refused naming the weight.
  m = run_with(with(ok_grouped, "shape", {1000000000000, 0, 192, 300, 200}));
  EXPECT_NE(m.find(fmt::format("'{}': grouped_linear_forward with weight [in 300, out 200] measured", file)),
            std::string::npos) << m;
  EXPECT_NE(m.find("outside [0.001, 1000]"), std::string::npos) << m;
  m = run_with({{"kind", 7}});
  EXPECT_NE(m.find(fmt::format("'{}': shapes[2]: 'kind' must be a string (got 7)", file)), std::string::npos) << m;
  // A zero-sized call is left out (the model prices it 0), counted, and the result loads.
  run_with(with(ok_exact, "shape", {0, 300, 200}));
  std::size_t zero = 0;
  const HardwareProfile p = in_situ_profile(base, dir, &zero);
  EXPECT_EQ(zero, 1u);
  ASSERT_EQ(p.in_situ_ops.size(), 1u);
  EXPECT_EQ(p.in_situ_ops[0].shape, (std::vector<std::int64_t>{100, 300, 200}));
  EXPECT_EQ(HardwareProfile::from_json(p.to_json(), "p.json").to_json(), p.to_json());
}

TEST(Calibrate, InSituCommandRefusesEmptyPathsAndAnOutThatIsTheBase) {
  const auto dir = std::filesystem::path(MOEFLEX_BINARY_DIR) / "test_cost_model.d" / "run-cmd";
  std::filesystem::create_directories(dir / "sub");
  const std::string base = (dir / "base.json").string();
  hand_profile().save(base);
  std::ofstream(dir / "op_times.json") << R"({"shapes": []})";
  // The same file under other names: relative through a folder, and an absolute one.
  for (const std::string& out : {(dir / "sub" / ".." / "base.json").string(), base}) {
    const std::string m = typed_message_of([&] { run_in_situ_calibrate_command(dir.string(), base, out); });
    EXPECT_NE(m.find(fmt::format("ConfigError: calibrate --out '{}' is the base profile", out)), std::string::npos) << m;
    EXPECT_NE(m.find("would replace the base profile; choose another --out"), std::string::npos) << m;
  }
  EXPECT_EQ(HardwareProfile::load(base).to_json(), hand_profile().to_json());  // untouched
  EXPECT_NE(typed_message_of([&] { run_in_situ_calibrate_command("", base, (dir / "o.json").string()); })
                .find("ConfigError: calibrate --from-run ''"),
            std::string::npos);
  EXPECT_NE(typed_message_of([&] { run_in_situ_calibrate_command(dir.string(), "", (dir / "o.json").string()); })
                .find("ConfigError: calibrate --base ''"),
            std::string::npos);
  // Another --out is written and loads.
  EXPECT_EQ(run_in_situ_calibrate_command(dir.string(), base, (dir / "o.json").string()), 0);
  EXPECT_EQ(HardwareProfile::load(dir / "o.json").gemm.size(), hand_profile().gemm.size());
}

TEST(CostModel, OverlapCostsOnlyTheExposedPart) {
  EXPECT_DOUBLE_EQ(overlapped(3e-3, 1e-3), 2e-3);
  EXPECT_EQ(overlapped(1e-3, 3e-3), 0.0);
  EXPECT_EQ(overlapped(2e-3, 2e-3), 0.0);
  EXPECT_DOUBLE_EQ(overlapped(2e-3, 0.0), 2e-3);
}

TEST(CostModel, RejectsAnIncompleteProfile) {
  HardwareProfile p = hand_profile();
  p.gemm.clear();
  EXPECT_THROW(CostModel{p}, DataError);
  p = hand_profile();
  p.memory_bandwidth = 0;
  EXPECT_THROW(CostModel{p}, DataError);
}

// One thread: timings on a shared 2-core machine are far steadier single-threaded.
// The bound is loose on purpose (`moeflex calibrate` prints the real figure), and a
// burst of load from other processes can still spoil one ~2 s attempt, so up to
// three attempts are made; the numbers must be sane in every one.
// One process on a host of more cores than that: nothing to measure (phase 1 would not
// be the per-core rate), so 1, and the thread count is left as it was.
TEST(Calibrate, TimeSharingEfficiencyNeedsARankOnEveryCore) {
  if (std::thread::hardware_concurrency() < 2) GTEST_SKIP() << "one core: a single process fills it";
  omp_set_num_threads(2);
  EXPECT_EQ(measure_time_sharing(0.2), 1.0);
  EXPECT_EQ(omp_get_max_threads(), 2);
}

// A napping thread on the computing one's core costs it some of the core, less than
// the nap lasts; a nap lasts at least as long as asked. Timing on a shared machine:
// up to three attempts (a burst of other load can make one read 0).
TEST(Calibrate, NapCostIsSomeButLessThanTheNapsLength) {
  NapCost n;
  for (int attempt = 0; attempt < 3 && !(n.cost > 0); ++attempt) n = measure_nap_cost(0.1);
  EXPECT_GT(n.cost, 0.0);
  EXPECT_LT(n.cost, n.overshoot + comm::kMinPollSleepOversubscribed);
  EXPECT_GE(n.overshoot, 0.0);
  EXPECT_LT(n.overshoot, 0.01);  // a nap of 100 us does not last 10 ms
}

TEST(Calibrate, QuickCalibrationIsSaneAndKeepsTheHeldOutShapesOut) {
  constexpr int kAttempts = 3;
  constexpr double kLooseBound = 0.5;
  double best = 1e9;
  for (int attempt = 0; attempt < kAttempts && best >= kLooseBound; ++attempt) {
    const CalibrationResult r = calibrate_and_validate(1, 1.5);
    const HardwareProfile& p = r.profile;
    EXPECT_EQ(p.threads, 1);
    ASSERT_FALSE(p.gemm.empty());
    std::set<GemmLayout> layouts;
    for (const GemmSample& s : p.gemm) {
      EXPECT_TRUE(std::isfinite(s.rate) && s.rate > 0) << s.M << "x" << s.N << "x" << s.K;
      layouts.insert(s.layout);
    }
    EXPECT_EQ(layouts, (std::set<GemmLayout>{GemmLayout::nt, GemmLayout::nn, GemmLayout::tn}));
    for (double v : {p.memory_bandwidth, p.h2d_bandwidth, p.d2h_bandwidth}) EXPECT_TRUE(std::isfinite(v) && v > 0);
    EXPECT_GE(p.launch_overhead, 0.0);
    EXPECT_GE(p.copy_latency, 0.0);
    EXPECT_GT(p.time_sharing_efficiency, 0.0);  // measured with one thread
    EXPECT_LE(p.time_sharing_efficiency, 1.0);
    for (const char* op : {op_names::kRmsnormForward, op_names::kSwigluBackward, op_names::kRope,
                           op_names::kAttentionForward, op_names::kAttentionBackward,
                           op_names::kCrossEntropyForward, op_names::kCopyH2D,
                           op_names::kElementwise}) {
      ASSERT_TRUE(p.op_tables.count(op)) << op;
      for (const OpSample& s : p.op_tables.at(op)) EXPECT_TRUE(std::isfinite(s.seconds) && s.seconds >= 0) << op;
    }
    // The held-out set includes the default model's training shapes (a micro-batch
    // of 8 x 128 tokens, 256 rows per expert), and the calibration never ran them.
    const auto has_row = [&](const std::string& op, const std::string& shape_part) {
      for (const CalibrationRow& row : r.report.rows)
        if (row.op == op && row.shape.find(shape_part) != std::string::npos) return true;
      return false;
    };
    EXPECT_TRUE(has_row("linear_forward", "n=1024 in=256 out=256"));
    EXPECT_TRUE(has_row("grouped_linear_backward", "rows=[256,256,256,256,256,256,256,256]"));
    EXPECT_TRUE(has_row("attention_forward", "B=8 S=128"));
    EXPECT_TRUE(has_row("rmsnorm_forward", "n=1024 d=256"));
    for (const GemmSample& s : p.gemm) {
      const bool q_proj = s.N == 256 && s.K == 256 && s.M == 1024 && s.layout == GemmLayout::nt;
      const bool expert_up = s.M == 256 && s.N == 384 && s.K == 256 && s.layout == GemmLayout::nt;
      const bool expert_dw = s.M == 384 && s.N == 256 && s.K == 256 && s.layout == GemmLayout::tn;
      EXPECT_FALSE(q_proj || expert_up || expert_dw) << "held-out GEMM measured: " << s.M << "x" << s.N << "x" << s.K;
    }
    for (const OpSample& s : p.op_tables.at(op_names::kRmsnormForward))
      EXPECT_NE(s.bytes, op_bytes::rmsnorm_forward(1024, 256));
    for (const OpSample& s : p.op_tables.at(op_names::kElementwise))
      EXPECT_NE(s.bytes, op_bytes::add_inplace(1024 * 256));

    // It survives its own JSON.
    const HardwareProfile q = HardwareProfile::from_json(p.to_json(), "calibrated");
    EXPECT_EQ(q.to_json(), p.to_json());

    ASSERT_GT(r.report.rows.size(), 40u);
    for (const CalibrationRow& row : r.report.rows) {
      EXPECT_TRUE(std::isfinite(row.measured) && row.measured > 0) << row.op << " " << row.shape;
      EXPECT_TRUE(std::isfinite(row.predicted) && row.predicted > 0) << row.op << " " << row.shape;
      EXPECT_TRUE(std::isfinite(row.spread) && row.spread >= 0) << row.op << " " << row.shape;
    }
    std::printf("quick calibration, attempt %d: mean held-out error %.1f%% over %zu invocations (noise %.1f%%)\n",
                attempt + 1, 100.0 * r.report.mean_abs_relative_error, r.report.rows.size(),
                100.0 * r.report.mean_spread);
    best = std::min(best, r.report.mean_abs_relative_error);
  }
  EXPECT_LT(best, kLooseBound);
}

TEST(Calibrate, ValidateTimesTheSameHeldOutSetAgainstAGivenProfile) {
  // A profile 10x faster than any machine: every prediction ~10x too small.
  HardwareProfile p = hand_profile();
  p.gemm = {{256, 256, 256, 1e13}};
  p.memory_bandwidth = p.h2d_bandwidth = p.d2h_bandwidth = 1e13;
  p.launch_overhead = p.copy_latency = 0;
  p.op_tables.clear();
  const CalibrationReport r = validate(p, 1, 0.3);
  ASSERT_GT(r.rows.size(), 40u);
  EXPECT_GT(r.mean_abs_relative_error, 0.5);
  for (const CalibrationRow& row : r.rows) EXPECT_LT(row.predicted, row.measured) << row.op << " " << row.shape;
}
