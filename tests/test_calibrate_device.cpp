// The device calibration (profile/calibrate_device.h, train/calibrate_command.h), run on the CPU backend: the
// same code measures a GPU through the CUDA backend (scripts/gpu-check.sh).
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "moeflex/core/error.h"
#include "moeflex/provision/cost_model.h"
#include "moeflex/profile/calibrate_device.h"
#include "moeflex/train/calibrate_command.h"

using namespace moeflex;

namespace {

DeviceCalibrationShapes small_shapes() {
  DeviceCalibrationShapes s;
  s.model.vocab_size = 256;
  s.model.hidden_size = 64;
  s.model.num_hidden_layers = 2;
  s.model.num_attention_heads = 2;
  s.model.max_position_embeddings = 128;
  s.model.num_experts = 4;
  s.model.num_experts_per_tok = 2;
  s.model.moe_intermediate_size = 96;
  s.model.first_k_dense_replace = 1;
  s.model.intermediate_size = 160;
  s.micro_batch_size = 2;
  s.seq_len = 128;
  return s;
}

std::filesystem::path temp_dir(const char* name) {
  const auto d = std::filesystem::temp_directory_path() / fmt::format("moeflex-{}-{}", name, ::getpid());
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

}  // namespace

TEST(DeviceCalibration, MeasuresEveryLinearGemmLineAttentionPerHeadAndTheCopyTables) {
  const DeviceCalibrationShapes s = small_shapes();
  ops::DeviceContext ctx = ops::make_cpu_context(Arena::kUnlimited);
  const HardwareProfile p = calibrate_device(ctx, s, 0.5);
  EXPECT_EQ(p.device, "cpu");

  // Every weight [out, in] of the model (attention 64x64, dense MLP 160, experts 96,
  // router 4, head 256) gets its three GEMMs at every token count: 32..4 x 256 x 2.
  const std::set<std::pair<std::int64_t, std::int64_t>> weights = {{64, 64}, {160, 64}, {64, 160}, {96, 64},
                                                                   {64, 96}, {4, 64},   {256, 64}};
  const std::vector<std::int64_t> tokens = {32, 64, 128, 256, 512, 1024, 2048};
  std::set<std::tuple<GemmLayout, std::int64_t, std::int64_t, std::int64_t>> got;
  for (const GemmSample& g : p.gemm) {
    EXPECT_TRUE(std::isfinite(g.rate) && g.rate > 0) << g.M << "x" << g.N << "x" << g.K;
    got.insert({g.layout, g.M, g.N, g.K});
  }
  EXPECT_EQ(p.gemm.size(), weights.size() * tokens.size() * 3);
  for (auto [out, in] : weights)
    for (std::int64_t n : tokens) {
      EXPECT_TRUE(got.count({GemmLayout::nt, n, out, in})) << "y = x w^T, n " << n << " w " << out << "x" << in;
      EXPECT_TRUE(got.count({GemmLayout::nn, n, in, out})) << "dx = dy w, n " << n;
      EXPECT_TRUE(got.count({GemmLayout::tn, out, in, n})) << "dw = dy^T x, n " << n;
    }

  // The cost model reads the samples back at their shapes and layouts: a sample's
  // time, or where noise made a line's time fall with more tokens, the mean it is
  // smoothed to, within the line's range (y = x w^T along n for w 64 x 64).
  const CostModel m(p);
  double lo = 1e30, hi = 0;
  for (const GemmSample& g : p.gemm)
    if (g.layout == GemmLayout::nt && g.N == 64 && g.K == 64) {
      const double t = 2.0 * double(g.M) * 64 * 64 / g.rate;
      lo = std::min(lo, t), hi = std::max(hi, t);
    }
  ASSERT_GT(hi, 0);
  const double t256 = m.gemm(256, 64, 64, GemmLayout::nt);
  EXPECT_GE(t256, lo * (1 - 1e-9));
  EXPECT_LE(t256, hi * (1 + 1e-9));

  // Attention at 64 and 128 positions, per head: the cost model's B x H x table value
  // is the measured call again.
  const auto& af = m.profile().op_tables.at(op_names::kAttentionForward);  // as the model holds them
  const auto& ab = m.profile().op_tables.at(op_names::kAttentionBackward);
  ASSERT_EQ(af.size(), 2u);
  ASSERT_EQ(ab.size(), 2u);
  EXPECT_EQ(af[0].bytes, op_bytes::attention_softmax_forward(1, 64, 1));
  EXPECT_EQ(af[1].bytes, op_bytes::attention_softmax_forward(1, 128, 1));
  const std::int64_t B = s.micro_batch_size, H = s.model.num_attention_heads, hd = s.model.head_dim();
  EXPECT_NEAR(m.attention_forward(B, 128, H, hd), double(B * H) * af[1].seconds, 1e-9 * af[1].seconds * B * H);
  EXPECT_NEAR(m.attention_backward(B, 128, H, hd), double(B * H) * ab[1].seconds, 1e-9 * ab[1].seconds * B * H);

  // RMSNorm [n, 64] and SwiGLU over n x 96 (the experts' width) along the same token counts.
  for (const char* t :
       {op_names::kRmsnormForward, op_names::kRmsnormBackward, op_names::kSwigluForward, op_names::kSwigluBackward}) {
    const auto& tab = p.op_tables.at(t);
    ASSERT_EQ(tab.size(), tokens.size()) << t;
    for (std::size_t i = 1; i < tab.size(); ++i) EXPECT_GT(tab[i].bytes, tab[i - 1].bytes) << t;
  }
  EXPECT_EQ(p.op_tables.at(op_names::kRmsnormForward).front().bytes, op_bytes::rmsnorm_forward(32, 64));
  EXPECT_EQ(p.op_tables.at(op_names::kSwigluBackward).back().bytes, op_bytes::swiglu_backward(2048 * 96));
  // At a measured size the model reads that point, as the model holds it (a table is
  // made non-decreasing, so a noisy point can be pulled to its neighbours' mean).
  EXPECT_NEAR(m.rmsnorm_forward(256, 64), m.profile().op_tables.at(op_names::kRmsnormForward)[3].seconds, 1e-15);
  EXPECT_EQ(m.profile().op_tables.at(op_names::kRmsnormForward)[3].bytes, op_bytes::rmsnorm_forward(256, 64));

  // y += x from 1 Ki to 16 Mi elements, copies from 256 KiB to 256 MiB, 2x steps.
  const auto& ew = p.op_tables.at(op_names::kElementwise);
  ASSERT_EQ(ew.size(), 15u);
  EXPECT_EQ(ew.front().bytes, op_bytes::add_inplace(1 << 10));
  EXPECT_EQ(ew.back().bytes, op_bytes::add_inplace(1 << 24));
  EXPECT_EQ(p.launch_overhead, ew.front().seconds);
  for (const char* t : {op_names::kCopyH2D, op_names::kCopyD2H}) {
    const auto& c = p.op_tables.at(t);
    ASSERT_EQ(c.size(), 11u) << t;
    EXPECT_EQ(c.front().bytes, 256 * kKiB);
    EXPECT_EQ(c.back().bytes, 256 * kMiB);
    for (const OpSample& o : c) EXPECT_GT(o.seconds, 0) << t;
  }
  EXPECT_GT(p.memory_bandwidth, 0);
  EXPECT_GT(p.h2d_bandwidth, 0);
  EXPECT_GT(p.d2h_bandwidth, 0);

  // The file format keeps all of it.
  const HardwareProfile back = HardwareProfile::from_json(p.to_json(), "round trip");
  EXPECT_EQ(back.device, "cpu");
  EXPECT_EQ(back.gemm.size(), p.gemm.size());
  EXPECT_EQ(back.op_tables.size(), p.op_tables.size());
}

TEST(DeviceCalibration, RefusesABadBudgetAndShapesAndAnArenaTooSmall) {
  ops::DeviceContext ctx = ops::make_cpu_context(Arena::kUnlimited);
  EXPECT_THROW(calibrate_device(ctx, small_shapes(), 0.0), ConfigError);
  DeviceCalibrationShapes bad = small_shapes();
  bad.seq_len = 0;
  EXPECT_THROW(calibrate_device(ctx, bad, 0.1), ConfigError);
  ops::DeviceContext tiny = ops::make_cpu_context(64 * kKiB);
  EXPECT_THROW(calibrate_device(tiny, small_shapes(), 0.1), OutOfMemoryError);
}

TEST(DeviceCalibration, CommandWritesALoadableProfileAndRefusesBadOutAndDevice) {
  const auto dir = temp_dir("calibrate-device");
  const auto cfg = dir / "run.toml";
  std::ofstream(cfg) << "[model]\nvocab_size = 256\nhidden_size = 64\nnum_hidden_layers = 2\nnum_attention_heads = 2\n"
                        "max_position_embeddings = 128\nnum_experts = 4\nmoe_intermediate_size = 96\n"
                        "intermediate_size = 160\n[train]\nmicro_batch_size = 2\nseq_len = 64\n";
  const auto out = dir / "cpu-generic.json";
  ASSERT_EQ(run_device_calibrate_command("cpu", cfg.string(), out, 0.3), 0);
  const HardwareProfile p = HardwareProfile::load(out);
  EXPECT_EQ(p.device, "cpu");
  EXPECT_EQ(p.op_tables.at(op_names::kAttentionForward).size(), 1u);  // seq_len 64 only
  // A directory as --out, and an unknown device, are refused before measuring; the
  // profile already there stays.
  EXPECT_THROW(run_device_calibrate_command("cpu", cfg.string(), dir, 0.3), ConfigError);
  EXPECT_THROW(run_device_calibrate_command("tpu", cfg.string(), out, 0.3), ConfigError);
  EXPECT_EQ(HardwareProfile::load(out).gemm.size(), p.gemm.size());
  std::filesystem::remove_all(dir);
}
