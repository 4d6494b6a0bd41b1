// The bf16 engine (model.bf16, --bf16) on the CPU backend:
//   - each bf16 op is its fp32 reference on the widened inputs, rounded once per
//     output (ops/backend.h's contract, which the CUDA kernels are held to), and an
//     accumulating op reads its bf16 output, adds in fp32 and rounds the sum once;
//   - views of mixed dtypes are refused with the op's name;
//   - training in bf16 follows fp32 training closely, with fp32 master weights whose
//     bf16 working copies are their rounding after every optimizer step, and about
//     half the activation memory.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "model_fixtures.h"
#include "moeflex/core/bf16.h"
#include "moeflex/core/error.h"
#include "moeflex/core/rng.h"
#include "moeflex/model/model.h"
#include "moeflex/ops/backend.h"
#include "moeflex/ops/blas.h"
#include "moeflex/ops/cross_entropy.h"
#include "moeflex/ops/linear.h"
#include "moeflex/ops/rmsnorm.h"
#include "moeflex/ops/swiglu.h"
#include "moeflex/train/optimizer.h"

using namespace moeflex;

namespace {

/// n values of N(0, scale) from `seed`, already bf16-representable (so the fp32
/// reference and the bf16 op see the same inputs).
std::vector<float> bf16_exact(std::uint64_t seed, std::int64_t n, double scale = 1.0) {
  std::vector<float> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) v[std::size_t(i)] = to_float(to_bf16(float(scale * normal01(seed, 1, std::uint64_t(i)))));
  return v;
}

std::vector<bf16> narrow(const std::vector<float>& v) {
  std::vector<bf16> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = to_bf16(v[i]);
  return out;
}

/// Every element of `got` is the rounding of `want` (bit for bit).
void expect_rounding_of(const std::vector<bf16>& got, const std::vector<float>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  std::size_t bad = 0;
  for (std::size_t i = 0; i < want.size(); ++i)
    if (got[i].bits != to_bf16(want[i]).bits) ++bad;
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << want.size() << " elements are not the fp32 result rounded";
}

}  // namespace

TEST(Bf16Backend, OpsAreTheFp32ReferenceRoundedOnce) {
  ops::Backend& be = ops::cpu_backend();
  const std::int64_t n = 6, in = 8, out = 5;
  const auto x = bf16_exact(1, n * in), w = bf16_exact(2, out * in), dy = bf16_exact(3, n * out);
  auto xb = narrow(x), wb = narrow(w), dyb = narrow(dy);

  // linear forward
  std::vector<float> y(static_cast<std::size_t>(n * out));
  ops::linear_forward(x.data(), w.data(), y.data(), n, in, out);
  std::vector<bf16> yb(y.size());
  be.linear_forward(xb.data(), wb.data(), yb.data(), n, in, out);
  expect_rounding_of(yb, y, "linear_forward");

  // linear backward: dx accumulates into its bf16 values (read, add in fp32, one
  // rounding); dw is fp32 and accumulates exactly as the fp32 op's.
  const auto dx0 = bf16_exact(4, n * in);
  std::vector<float> dx = dx0, dw(std::size_t(out * in), 0.5f), dw_b = dw;
  ops::linear_backward(dy.data(), x.data(), w.data(), dx.data(), dw.data(), n, in, out, true);
  std::vector<bf16> dxb = narrow(dx0);
  be.linear_backward(dyb.data(), xb.data(), wb.data(), dxb.data(), dw_b.data(), n, in, out, true);
  expect_rounding_of(dxb, dx, "linear_backward dx (+=)");
  EXPECT_EQ(0, std::memcmp(dw.data(), dw_b.data(), dw.size() * sizeof(float))) << "linear_backward dw";

  // gemm with beta: C = A B^T + 1 * C
  std::vector<float> c = bf16_exact(5, n * out);
  std::vector<bf16> cb = narrow(c);
  ops::gemm<float>(false, true, n, out, in, 1.0f, x.data(), in, w.data(), in, 1.0f, c.data(), out);
  be.gemm(false, true, n, out, in, 1.0f, xb.data(), in, wb.data(), in, 1.0f, cb.data(), out);
  expect_rounding_of(cb, c, "gemm (beta 1)");

  // gemm into a C with padding columns (ldc > N), beta 0: the padding keeps its values
  {
    const std::int64_t ldc = out + 2;
    std::vector<bf16> cpad(static_cast<std::size_t>(n * ldc), to_bf16(-7.0f));
    be.gemm(false, true, n, out, in, 1.0f, xb.data(), in, wb.data(), in, 0.0f, cpad.data(), ldc);
    for (std::int64_t r = 0; r < n; ++r)
      for (std::int64_t c2 = out; c2 < ldc; ++c2) EXPECT_EQ(to_float(cpad[std::size_t(r * ldc + c2)]), -7.0f);
    for (std::int64_t r = 0; r < n; ++r)
      for (std::int64_t c2 = 0; c2 < out; ++c2)
        EXPECT_EQ(cpad[std::size_t(r * ldc + c2)].bits, yb[std::size_t(r * out + c2)].bits) << "gemm = linear_forward";
  }

  // rmsnorm: y bf16, rstd fp32 (the same bits as the fp32 op's)
  const auto g = bf16_exact(6, in, 0.5);
  auto gb = narrow(g);
  std::vector<float> ny(x.size()), rstd(static_cast<std::size_t>(n)), rstd_b(static_cast<std::size_t>(n));
  ops::rmsnorm_forward(x.data(), g.data(), ny.data(), rstd.data(), n, in, 1e-5f);
  std::vector<bf16> nyb(x.size());
  be.rmsnorm_forward(xb.data(), gb.data(), nyb.data(), rstd_b.data(), n, in, 1e-5f);
  expect_rounding_of(nyb, ny, "rmsnorm_forward");
  EXPECT_EQ(0, std::memcmp(rstd.data(), rstd_b.data(), rstd.size() * sizeof(float))) << "rmsnorm rstd";

  // swiglu, add_inplace
  std::vector<float> s(x.size());
  ops::swiglu_forward(x.data(), dx0.data(), s.data(), n * in);
  std::vector<bf16> sb(x.size()), dx0b = narrow(dx0);
  be.swiglu_forward(xb.data(), dx0b.data(), sb.data(), n * in);
  expect_rounding_of(sb, s, "swiglu_forward");
  std::vector<float> sum = x;
  for (std::size_t i = 0; i < sum.size(); ++i) sum[i] += dx0[i];
  std::vector<bf16> sumb = xb;
  be.add_inplace(sumb.data(), dx0b.data(), n * in);
  expect_rounding_of(sumb, sum, "add_inplace");

  // cross-entropy in place (probs alias the logits); the losses stay fp32
  const std::int64_t V = 7;
  const auto logits = bf16_exact(7, n * V, 2.0);
  std::vector<std::int32_t> tg(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) tg[std::size_t(i)] = std::int32_t((i * 3) % V);
  std::vector<float> probs = logits, losses(static_cast<std::size_t>(n)), losses_b(static_cast<std::size_t>(n));
  const double ce = ops::cross_entropy_forward(probs.data(), tg.data(), probs.data(), losses.data(), n, V);
  std::vector<bf16> pb = narrow(logits);
  const double ce_b = be.cross_entropy_forward(pb.data(), tg.data(), pb.data(), losses_b.data(), n, V);
  expect_rounding_of(pb, probs, "cross_entropy_forward (in place)");
  EXPECT_EQ(ce, ce_b);
}

TEST(Bf16Backend, CastRoundsToNearestEvenAndWidensExactly) {
  ops::Backend& be = ops::cpu_backend();
  // 1 + 2^-8 is halfway between bf16 1 and 1 + 2^-7: ties to even (1); 1 + 3 * 2^-8
  // is halfway between 1 + 2^-7 and 1 + 2^-6: ties to even (1 + 2^-6).
  const std::vector<float> f = {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, -2.5f, 1e-3f};
  std::vector<bf16> b(f.size());
  be.cast(f.data(), b.data(), std::int64_t(f.size()));
  EXPECT_EQ(to_float(b[0]), 1.0f);
  EXPECT_EQ(to_float(b[1]), 1.0f + 0x1p-6f);
  EXPECT_EQ(to_float(b[2]), -2.5f);
  EXPECT_NEAR(to_float(b[3]), 1e-3f, 1e-3f / 128);
  std::vector<float> back(f.size());
  be.cast(b.data(), back.data(), std::int64_t(f.size()));
  for (std::size_t i = 0; i < f.size(); ++i) EXPECT_EQ(back[i], to_float(b[i]));
}

TEST(Bf16Backend, MixedDtypesAreRefusedWithTheOpsName) {
  ops::Backend& be = ops::cpu_backend();
  std::vector<float> x(8, 1.0f), y(4);
  std::vector<bf16> w(8, to_bf16(1.0f));
  try {
    be.linear_forward(x.data(), w.data(), y.data(), 2, 4, 2);
    FAIL() << "a f32 input with bf16 weights was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("linear_forward"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("bf16"), std::string::npos) << e.what();
  }
  // A bf16 tensor read as f32 is refused too.
  Arena arena;
  Tensor t(arena, {4}, MemCategory::activations, "t", DType::bf16);
  EXPECT_THROW((void)t.f32(), Error);
  EXPECT_EQ(t.nbytes(), 8);
  EXPECT_EQ((t.view() + 3).data, static_cast<char*>(t.raw()) + 6) << "offsets count bf16 elements";
  EXPECT_FALSE(bool(View() + 5)) << "a null view stays null";
}

namespace {

struct Trained {
  std::vector<double> losses;
  std::vector<std::vector<float>> first_grads;  // after the first step's backward
  std::vector<std::string> names;
  Bytes activation_peak = 0;
};

/// `steps` AdamW steps of two micro-batches on the small MoE config.
Trained train(bool bf16, int steps) {
  ModelConfig cfg = test::small_moe_config(3, 1, 4, true);
  cfg.bf16 = bf16;
  Arena arena;
  auto model = std::make_unique<MoEModel>(cfg, arena);
  model->init_weights(31);
  AdamW opt(model->params(), arena, AdamWConfig{});
  const std::int64_t B = 2, S = 8, n = B * S;
  std::vector<std::int32_t> ids(static_cast<std::size_t>(n)), tg(static_cast<std::size_t>(n));
  Trained t;
  for (int step = 0; step < steps; ++step) {
    model->zero_grads();
    double loss = 0;
    for (int mb = 0; mb < 2; ++mb) {
      test::skewed_batch(step * 2 + mb, n, cfg.vocab_size, ids.data(), tg.data());
      arena.reset_peaks();
      loss += model->forward_backward(ids.data(), tg.data(), B, S, mb, 0.5).total / 2;
      t.activation_peak = std::max(t.activation_peak, arena.stat(MemCategory::activations).peak);
    }
    if (step == 0)
      for (auto& p : model->params()) {
        t.first_grads.emplace_back(p.g.f32(), p.g.f32() + p.g.numel());
        t.names.push_back(p.name);
      }
    opt.step(3e-3);
    t.losses.push_back(loss);
    if (bf16)  // the working copy is the master weights rounded, after every step
      for (auto& p : model->params()) {
        std::size_t bad = 0;
        for (std::int64_t i = 0; i < p.w.numel(); ++i)
          if (p.wc.bf()[i].bits != to_bf16(p.w.f32()[i]).bits) ++bad;
        EXPECT_EQ(bad, 0u) << p.name << " working copy after step " << step;
      }
  }
  if (bf16) {  // the master weights keep fp32 precision (updates below a bf16 ulp)
    std::size_t finer = 0;
    for (auto& p : model->params())
      for (std::int64_t i = 0; i < p.w.numel(); ++i) finer += to_float(to_bf16(p.w.f32()[i])) != p.w.f32()[i];
    EXPECT_GT(finer, 0u) << "master weights were rounded to bf16";
  }
  return t;
}

}  // namespace

TEST(Bf16Training, FollowsFp32WithHalfTheActivationMemory) {
  const int steps = 6;
  const Trained f = train(false, steps), b = train(true, steps);
  for (int s = 0; s < steps; ++s)
    EXPECT_NEAR(b.losses[std::size_t(s)], f.losses[std::size_t(s)], 0.01 * f.losses[std::size_t(s)]) << "step " << s + 1;
  EXPECT_LT(f.losses.back(), f.losses.front()) << "the run learns";
  EXPECT_LT(b.losses.back(), b.losses.front()) << "the bf16 run learns";
  ASSERT_EQ(f.first_grads.size(), b.first_grads.size());
  ASSERT_EQ(f.names.size(), f.first_grads.size());
  // A token whose top-2 experts nearly tie may route differently in bf16 (a discrete
  // change), which moves the gradients of that layer's router and experts by more
  // than rounding does, and of the norm feeding that router: those are held to the
  // whole gradient's error only.
  double worst_dense = 0, num = 0, den = 0;
  for (std::size_t i = 0; i < f.first_grads.size(); ++i) {
    const std::int64_t n = std::int64_t(f.first_grads[i].size());
    const double e = test::rel_norm_err(b.first_grads[i].data(), f.first_grads[i].data(), n);
    const std::string& name = f.names[i];
    const bool moe_norm = name.find("post_attention_layernorm") != std::string::npos &&
                          name.find("layers.0.") == std::string::npos;  // the norm that feeds an MoE layer's router
    const bool routed = name.find(".mlp.experts.") != std::string::npos ||
                        name.find(".mlp.gate.") != std::string::npos || moe_norm;
    if (!routed) worst_dense = std::max(worst_dense, e);
    for (std::int64_t j = 0; j < n; ++j) {
      const double d = double(b.first_grads[i][std::size_t(j)]) - f.first_grads[i][std::size_t(j)];
      num += d * d;
      den += double(f.first_grads[i][std::size_t(j)]) * f.first_grads[i][std::size_t(j)];
    }
  }
  EXPECT_LT(worst_dense, 7e-2) << "bf16 gradients (fp32 main grads) of unrouted weights against fp32";
  EXPECT_GT(worst_dense, 1e-3) << "bf16 changed almost nothing: is the engine still fp32?";
  EXPECT_LT(std::sqrt(num / den), 0.1) << "all gradients together";
  // Activations are 2 bytes instead of 4, except the fp32 rstd, router tensors and
  // losses, and arena rounding of small blocks.
  const double ratio = double(b.activation_peak) / double(f.activation_peak);
  EXPECT_GT(ratio, 0.45);
  EXPECT_LT(ratio, 0.65);
}
