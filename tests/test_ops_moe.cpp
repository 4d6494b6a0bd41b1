// MoE operator tests: router (softmax, top-k, aux and z losses), dispatch plan,
// permute / unpermute, grouped linear, and the composed expert path against the
// sequential-experts reference. Double precision, finite differences at 1e-6;
// routing is skewed on purpose (one hot expert, idle experts, capacity drops).
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "moeflex/core/error.h"
#include "moeflex/ops/grouped_linear.h"
#include "moeflex/ops/moe_dispatch.h"
#include "moeflex/ops/router.h"
#include "op_harness.h"

namespace moeflex::test {
namespace {

using namespace moeflex::ops;
using I32 = std::vector<std::int32_t>;

// ---------------------------------------------------------------------------
// Router

struct RouterOut {
  std::vector<double> probs, topk_w;
  I32 topk_idx;
};

RouterOut run_router(const std::vector<double>& logits, std::int64_t n, std::int64_t E, std::int64_t k, bool norm) {
  RouterOut r{std::vector<double>(n * E), std::vector<double>(n * k), I32(n * k)};
  router_forward(logits.data(), r.probs.data(), r.topk_idx.data(), r.topk_w.data(), n, E, k, norm);
  return r;
}

TEST(Router, ForwardMatchesNaiveSoftmaxAndSort) {
  const std::int64_t n = 9, E = 6, k = 3;
  auto logits = random_vec(n * E, 1, 3.0);
  for (bool norm : {false, true}) {
    auto r = run_router(logits, n, E, k, norm);
    for (std::int64_t i = 0; i < n; ++i) {
      double m = -1e300, s = 0;
      for (std::int64_t e = 0; e < E; ++e) m = std::max(m, logits[i * E + e]);
      std::vector<double> p(E);
      for (std::int64_t e = 0; e < E; ++e) s += p[e] = std::exp(logits[i * E + e] - m);
      for (std::int64_t e = 0; e < E; ++e) EXPECT_NEAR(r.probs[i * E + e], p[e] / s, 1e-15);
      std::vector<int> order(E);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p[a] > p[b]; });
      double sel = 0;
      for (std::int64_t j = 0; j < k; ++j) sel += p[order[j]] / s;
      for (std::int64_t j = 0; j < k; ++j) {
        EXPECT_EQ(r.topk_idx[i * k + j], order[j]) << "row " << i << " slot " << j;
        const double want = p[order[j]] / s / (norm ? sel : 1.0);
        EXPECT_NEAR(r.topk_w[i * k + j], want, 1e-15);
      }
      if (norm) {
        double sw = 0;
        for (std::int64_t j = 0; j < k; ++j) sw += r.topk_w[i * k + j];
        EXPECT_NEAR(sw, 1.0, 1e-15);
      }
    }
  }
}

TEST(Router, TiesGoToTheLowerExpertIndex) {
  const std::int64_t n = 4, E = 5, k = 3;
  const std::vector<double> logits = {
      1, 1, 1, 1, 1,   // all equal: 0, 1, 2
      0, 2, 0, 2, 2,   // three-way tie at the top: 1, 3, 4
      3, 0, 1, 1, 0,   // 0 first, then the tie 2/3
      0, 0, 5, 0, 0,   // 2 first, then the tie 0/1 (lowest indices)
  };
  auto r = run_router(logits, n, E, k, false);
  const I32 want = {0, 1, 2, 1, 3, 4, 0, 2, 3, 2, 0, 1};
  EXPECT_EQ(r.topk_idx, want);
  EXPECT_EQ(r.topk_w[0], r.topk_w[1]);
  EXPECT_NEAR(r.topk_w[0], 0.2, 1e-15);
}

// Probe loss L = <topk_w, a> + <probs, b>: backward gets dtopk_w = a, dprobs_extra = b.
void check_router_backward(bool norm, bool with_dprobs) {
  const std::int64_t n = 7, E = 6, k = 2;
  auto logits = random_vec(n * E, 2, 2.0);
  const auto a = random_vec(n * k, 3);
  const auto b = random_vec(n * E, 4);
  auto loss = [&] {
    auto r = run_router(logits, n, E, k, norm);
    return dot(r.topk_w, a) + (with_dprobs ? dot(r.probs, b) : 0.0);
  };
  auto r = run_router(logits, n, E, k, norm);
  std::vector<double> dlogits(n * E, 123.0);  // (=): the junk must be overwritten
  router_backward(a.data(), with_dprobs ? b.data() : nullptr, r.probs.data(), r.topk_idx.data(), dlogits.data(), n,
                  E, k, norm);
  expect_grad_close("router logits", dlogits, logits, loss);
}

TEST(Router, BackwardMatchesFiniteDifferences) {
  check_router_backward(false, false);
  check_router_backward(true, false);
  check_router_backward(false, true);
  check_router_backward(true, true);
}

double naive_aux(const std::vector<double>& probs, const I32& idx, std::int64_t n, std::int64_t E, std::int64_t k,
                 double coef) {
  double loss = 0;
  for (std::int64_t e = 0; e < E; ++e) {
    double f = 0, P = 0;
    for (std::int64_t a = 0; a < n * k; ++a) f += idx[a] == e;
    for (std::int64_t i = 0; i < n; ++i) P += probs[i * E + e];
    loss += (f / double(n * k)) * (P / double(n));
  }
  return coef * double(E) * loss;
}

TEST(Router, AuxLossValueAndGradient) {
  const std::int64_t n = 300, E = 5, k = 2;  // n > one reduction chunk
  const double coef = 0.37;
  auto logits = random_vec(n * E, 5, 2.0);
  auto r = run_router(logits, n, E, k, true);
  const double got = aux_loss_forward(r.probs.data(), r.topk_idx.data(), n, E, k, coef);
  EXPECT_NEAR(got, naive_aux(r.probs, r.topk_idx, n, E, k, coef), 1e-14);
  // Balanced routing with uniform probs gives exactly coef (the loss's minimum scale).
  {
    const std::int64_t nb = 10, Eb = 5, kb = 1;
    std::vector<double> pu(nb * Eb, 1.0 / Eb);
    I32 idx(nb);
    for (std::int64_t i = 0; i < nb; ++i) idx[i] = std::int32_t(i % Eb);
    EXPECT_NEAR(aux_loss_forward(pu.data(), idx.data(), nb, Eb, kb, coef), coef, 1e-15);
  }

  // Gradient w.r.t. probs with the assignment counts held fixed; (+=) onto a prior value.
  const auto prior = random_vec(n * E, 6);
  auto dprobs = prior;
  aux_loss_backward(r.topk_idx.data(), dprobs.data(), n, E, k, coef);
  std::vector<double> added(n * E);
  for (std::int64_t i = 0; i < n * E; ++i) added[i] = dprobs[i] - prior[i];
  auto probs = r.probs;
  expect_grad_close("aux probs", added, probs,
                    [&] { return aux_loss_forward(probs.data(), r.topk_idx.data(), n, E, k, coef); });
}

// DeepSeek's rules on one row of sigmoid scores p = (0.9, 0.1, 0.6, 0.55), groups
// {0, 1} and {2, 3}, one group kept: by its best score (V2) group 0 wins, by its top-2
// sum (V3: 1.0 against 1.15) group 1. A bias on expert 3 reorders the choice, but the
// weights stay the unbiased scores, times the scaling.
TEST(Router, GroupScoresBiasAndScalingChooseAndWeighAsDeepSeekDoes) {
  const std::int64_t E = 4, k = 2;
  std::vector<double> logits;
  for (double p : {0.9, 0.1, 0.6, 0.55}) logits.push_back(std::log(p / (1 - p)));
  RouterOptions opt{.score = RouterScore::sigmoid, .norm_topk_prob = false, .routed_scaling_factor = 2.0,
                    .n_group = 2, .topk_group = 1};
  std::vector<double> probs(E), w(k);
  I32 idx(k);
  router_forward(logits.data(), probs.data(), idx.data(), w.data(), 1, E, k, opt);
  EXPECT_NEAR(probs[2], 0.6, 1e-12);
  EXPECT_EQ(idx, (I32{0, 1}));
  EXPECT_NEAR(w[0], 1.8, 1e-12);
  EXPECT_NEAR(w[1], 0.2, 1e-12);
  opt.group_score = GroupScore::top2_sum;
  router_forward(logits.data(), probs.data(), idx.data(), w.data(), 1, E, k, opt);
  EXPECT_EQ(idx, (I32{2, 3}));
  const float bias[E] = {0, 0, 0, 0.1f};
  opt.bias = bias;
  opt.norm_topk_prob = true;
  router_forward(logits.data(), probs.data(), idx.data(), w.data(), 1, E, k, opt);
  EXPECT_EQ(idx, (I32{3, 2}));  // 0.55 + 0.1 before 0.6
  EXPECT_NEAR(w[0], 2.0 * 0.55 / 1.15, 1e-7);
  EXPECT_NEAR(w[1], 2.0 * 0.6 / 1.15, 1e-7);
  opt.topk_group = 3;  // 3 of 2 groups: not a limit, so all experts compete
  EXPECT_FALSE(opt.group_limited());
  router_forward(logits.data(), probs.data(), idx.data(), w.data(), 1, E, k, opt);
  EXPECT_EQ(idx, (I32{0, 3}));
  opt.topk_group = 1;
  EXPECT_THROW(router_forward(logits.data(), probs.data(), idx.data(), w.data(), 1, E, 3, opt), Error);
}

// The sigmoid router's aux loss normalises each row's scores; its gradient through
// that normalisation against central differences.
TEST(Router, SigmoidAuxLossNormalisesScores) {
  const std::int64_t n = 6, E = 5, k = 2;
  const double coef = 0.3;
  auto probs = random_vec(n * E, 41, 0.4);
  for (double& p : probs) p += 0.5;  // sigmoid-like scores in (0.1, 0.9)
  I32 idx(n * k);
  for (std::int64_t i = 0; i < n * k; ++i) idx[i] = std::int32_t((i * 3 + i / k) % E);
  const double got = aux_loss_forward(probs.data(), idx.data(), n, E, k, coef, RouterScore::sigmoid);
  std::vector<double> counts(E, 0.0);
  for (auto e : idx) counts[std::size_t(e)] += 1;
  double want = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    double S = 0;
    for (std::int64_t e = 0; e < E; ++e) S += probs[std::size_t(i * E + e)];
    for (std::int64_t e = 0; e < E; ++e)
      want += coef * double(E) * counts[std::size_t(e)] / double(n * k) * probs[std::size_t(i * E + e)] / S / double(n);
  }
  EXPECT_NEAR(got, want, 1e-12);
  EXPECT_GT(std::abs(got - aux_loss_forward(probs.data(), idx.data(), n, E, k, coef)), 1e-3);  // softmax's differs
  std::vector<double> dprobs(n * E, 0.0);
  aux_loss_backward(idx.data(), probs.data(), dprobs.data(), n, E, k, coef, RouterScore::sigmoid);
  expect_grad_close("sigmoid aux probs", dprobs, probs,
                    [&] { return aux_loss_forward(probs.data(), idx.data(), n, E, k, coef, RouterScore::sigmoid); });
}

TEST(Router, ZLossValueAndGradient) {
  const std::int64_t n = 270, E = 4;
  const double coef = 0.013;
  auto logits = random_vec(n * E, 7, 4.0);
  double naive = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    double s = 0;
    for (std::int64_t e = 0; e < E; ++e) s += std::exp(logits[i * E + e]);
    naive += std::log(s) * std::log(s);
  }
  naive *= coef / double(n);
  EXPECT_NEAR(z_loss_forward(logits.data(), n, E, coef), naive, 1e-14 * naive);

  const auto prior = random_vec(n * E, 8);
  auto dlogits = prior;
  z_loss_backward(logits.data(), dlogits.data(), n, E, coef);
  std::vector<double> added(n * E);
  for (std::int64_t i = 0; i < n * E; ++i) added[i] = dlogits[i] - prior[i];
  expect_grad_close("z-loss logits", added, logits, [&] { return z_loss_forward(logits.data(), n, E, coef); });
}

// The router's whole backward as the model uses it: top-k weights, aux loss through
// probs (f constant) and z-loss on the logits, all checked together.
TEST(Router, ComposedLossGradient) {
  const std::int64_t n = 8, E = 4, k = 2;
  const double aux_coef = 0.5, z_coef = 0.1;
  auto logits = random_vec(n * E, 9, 2.0);
  const auto a = random_vec(n * k, 10);
  const auto r0 = run_router(logits, n, E, k, true);
  auto loss = [&] {
    auto r = run_router(logits, n, E, k, true);
    // f comes from the unperturbed routing (a constant), as the kernels assume.
    return dot(r.topk_w, a) + aux_loss_forward(r.probs.data(), r0.topk_idx.data(), n, E, k, aux_coef) +
           z_loss_forward(logits.data(), n, E, z_coef);
  };
  std::vector<double> dprobs(n * E, 0.0), dlogits(n * E);
  aux_loss_backward(r0.topk_idx.data(), dprobs.data(), n, E, k, aux_coef);
  router_backward(a.data(), dprobs.data(), r0.probs.data(), r0.topk_idx.data(), dlogits.data(), n, E, k, true);
  z_loss_backward(logits.data(), dlogits.data(), n, E, z_coef);
  expect_grad_close("router composed", dlogits, logits, loss);
}

// ---------------------------------------------------------------------------
// Dispatch plan

TEST(Dispatch, ExpertCapacity) {
  EXPECT_EQ(expert_capacity(0.0, 8, 4, 2), -1);
  EXPECT_EQ(expert_capacity(-1.0, 8, 4, 2), -1);
  EXPECT_EQ(expert_capacity(1.0, 8, 4, 2), 4);
  EXPECT_EQ(expert_capacity(1.25, 10, 4, 2), 7);  // ceil(6.25)
  EXPECT_EQ(expert_capacity(0.5, 6, 4, 2), 2);    // ceil(1.5)
  EXPECT_EQ(expert_capacity(0.25, 3, 8, 1), 1);   // ceil(0.09375)
  for (double cf : {0.3, 0.75, 1.0, 1.1, 2.0})
    for (std::int64_t n : {1, 7, 64, 1000})
      EXPECT_EQ(expert_capacity(cf, n, 6, 2), std::int64_t(std::ceil(cf * n * 2 / 6)));
}

TEST(Dispatch, PlanByHand) {
  const std::int64_t n = 4, E = 3, k = 2;
  const I32 idx = {0, 1, 1, 0, 0, 2, 0, 1};
  I32 counts(E), offsets(E + 1), slot(n * k);
  EXPECT_EQ(moe_plan_dispatch(idx.data(), n, E, k, -1, counts.data(), offsets.data(), slot.data()), 0);
  EXPECT_EQ(counts, (I32{4, 3, 1}));
  EXPECT_EQ(offsets, (I32{0, 4, 7, 8}));
  EXPECT_EQ(slot, (I32{0, 4, 5, 1, 2, 7, 3, 6}));

  EXPECT_EQ(moe_plan_dispatch(idx.data(), n, E, k, 2, counts.data(), offsets.data(), slot.data()), 3);
  EXPECT_EQ(counts, (I32{2, 2, 1}));
  EXPECT_EQ(offsets, (I32{0, 2, 4, 5}));
  EXPECT_EQ(slot, (I32{0, 2, 3, 1, -1, 4, -1, -1}));

  EXPECT_EQ(moe_plan_dispatch(idx.data(), n, E, k, 0, counts.data(), offsets.data(), slot.data()), 8);
  EXPECT_EQ(offsets, (I32{0, 0, 0, 0}));
  EXPECT_EQ(slot, I32(8, -1));
}

// ---------------------------------------------------------------------------
// Permute / unpermute

struct Plan {
  I32 counts, offsets, slot;
  std::int64_t dropped = 0;
  std::int64_t rows() const { return offsets.back(); }
};

Plan make_plan(const I32& idx, std::int64_t n, std::int64_t E, std::int64_t k, std::int64_t capacity) {
  Plan p{I32(E), I32(E + 1), I32(n * k)};
  p.dropped = moe_plan_dispatch(idx.data(), n, E, k, capacity, p.counts.data(), p.offsets.data(), p.slot.data());
  return p;
}

I32 random_routing(std::int64_t n, std::int64_t E, std::int64_t k, std::uint64_t stream) {
  auto logits = random_vec(n * E, stream);
  std::vector<double> probs(n * E), w(n * k);
  I32 idx(n * k);
  router_forward(logits.data(), probs.data(), idx.data(), w.data(), n, E, k, false);
  return idx;
}

TEST(Dispatch, PermuteForwardAndBackward) {
  const std::int64_t n = 9, E = 4, k = 2, d = 3;
  const auto idx = random_routing(n, E, k, 11);
  for (std::int64_t cap : {std::int64_t(-1), std::int64_t(3)}) {
    const auto plan = make_plan(idx, n, E, k, cap);
    if (cap > 0) {
      EXPECT_GT(plan.dropped, 0);
    }
    auto x = random_vec(n * d, 12);
    std::vector<double> xp(plan.rows() * d);
    permute_forward(x.data(), plan.slot.data(), xp.data(), n, k, d);
    // Rows of expert e are its kept tokens in (token, slot) order.
    for (std::int64_t e = 0, row = 0; e < E; ++e)
      for (std::int64_t a = 0; a < n * k; ++a)
        if (idx[a] == e && plan.slot[a] >= 0) {
          EXPECT_EQ(plan.slot[a], row);
          for (std::int64_t c = 0; c < d; ++c) EXPECT_EQ(xp[row * d + c], x[(a / k) * d + c]);
          ++row;
        }
    const auto probe = random_vec(plan.rows() * d, 13);
    std::vector<double> dx(n * d, 55.0);
    permute_backward(probe.data(), plan.slot.data(), dx.data(), n, k, d);
    expect_grad_close("permute x", dx, x, [&] {
      std::vector<double> out(plan.rows() * d);
      permute_forward(x.data(), plan.slot.data(), out.data(), n, k, d);
      return dot(out, probe);
    });
  }
}

TEST(Dispatch, UnpermuteForwardAndBackward) {
  const std::int64_t n = 9, E = 4, k = 2, d = 3;
  const auto idx = random_routing(n, E, k, 14);
  for (std::int64_t cap : {std::int64_t(-1), std::int64_t(3)}) {
    const auto plan = make_plan(idx, n, E, k, cap);
    auto yp = random_vec(plan.rows() * d, 15);
    auto w = random_vec(n * k, 16);
    const auto probe = random_vec(n * d, 17);
    auto loss = [&] {
      std::vector<double> y(n * d);
      unpermute_forward(yp.data(), plan.slot.data(), w.data(), y.data(), n, k, d);
      return dot(y, probe);
    };
    // Forward against a naive sum.
    std::vector<double> y(n * d, 9.0);
    unpermute_forward(yp.data(), plan.slot.data(), w.data(), y.data(), n, k, d);
    for (std::int64_t i = 0; i < n; ++i)
      for (std::int64_t c = 0; c < d; ++c) {
        double s = 0;
        for (std::int64_t j = 0; j < k; ++j)
          if (plan.slot[i * k + j] >= 0) s += w[i * k + j] * yp[plan.slot[i * k + j] * d + c];
        EXPECT_NEAR(y[i * d + c], s, 1e-15);
      }
    std::vector<double> dyp(plan.rows() * d, 77.0), dw(n * k, 88.0);
    unpermute_backward(probe.data(), yp.data(), plan.slot.data(), w.data(), dyp.data(), dw.data(), n, k, d);
    for (std::int64_t a = 0; a < n * k; ++a)
      if (plan.slot[a] < 0) {
        EXPECT_EQ(dw[a], 0.0) << "dropped assignment " << a;
      }
    expect_grad_close("unpermute yp", dyp, yp, loss);
    expect_grad_close("unpermute topk_w", dw, w, loss);
  }
}

// The top-k gradient window by window (the backward's expert chunks, when the
// combine's input was not kept): the whole backward's dtopk_w bit for bit in float,
// dyp unchanged without it, other slots untouched by each window.
TEST(Dispatch, CombineTopkGradByWindowsEqualsTheWholeBackward) {
  const std::int64_t n = 13, E = 4, k = 2, d = 5;
  const auto idx = random_routing(n, E, k, 24);
  for (std::int64_t cap : {std::int64_t(-1), std::int64_t(4)}) {
    const auto plan = make_plan(idx, n, E, k, cap);
    const std::int64_t rows = plan.rows();
    std::vector<float> yp(rows * d), w(n * k), dy(n * d);
    for (auto* v : {&yp, &w, &dy})
      for (std::size_t i = 0; i < v->size(); ++i) (*v)[i] = float(std::sin(1.7 * double(i) + double(v->size())));
    std::vector<float> dyp(rows * d, 5.0f), dw(n * k, 7.0f);
    unpermute_backward(dy.data(), yp.data(), plan.slot.data(), w.data(), dyp.data(), dw.data(), n, k, d);
    std::vector<float> dyp2(rows * d, 5.0f), dw2(n * k, -3.0f);
    unpermute_backward(dy.data(), static_cast<const float*>(nullptr), plan.slot.data(), w.data(), dyp2.data(),
                       static_cast<float*>(nullptr), n, k, d);
    EXPECT_EQ(dyp2, dyp) << "dyp does not depend on the top-k gradient";
    for (std::int64_t r0 = 0; r0 < rows; r0 += 3) {
      const std::int64_t win = std::min<std::int64_t>(3, rows - r0);
      combine_topk_grad(dy.data(), yp.data() + r0 * d, plan.slot.data(), dw2.data(), n, k, d, r0, win);
    }
    for (std::int64_t a = 0; a < n * k; ++a) {
      if (plan.slot[a] < 0) EXPECT_EQ(dw2[a], -3.0f) << "dropped assignment " << a << " is left untouched";
      else EXPECT_EQ(std::memcmp(&dw2[a], &dw[a], sizeof(float)), 0) << "assignment " << a;
    }
  }
}

// ---------------------------------------------------------------------------
// Grouped linear

TEST(GroupedLinear, ForwardMatchesNaiveWithEmptyGroups) {
  const std::int64_t E = 5, in = 4, out = 3;
  const I32 offsets = {0, 3, 3, 8, 8, 9};  // experts 1 and 3 are empty
  const std::int64_t rows = offsets.back();
  const auto x = random_vec(rows * in, 20);
  const auto w = random_vec(E * out * in, 21);
  std::vector<double> y(rows * out, 1e9);
  grouped_linear_forward(x.data(), w.data(), y.data(), offsets.data(), E, in, out);
  for (std::int64_t e = 0; e < E; ++e)
    for (std::int64_t r = offsets[e]; r < offsets[e + 1]; ++r)
      for (std::int64_t o = 0; o < out; ++o) {
        double s = 0;
        for (std::int64_t c = 0; c < in; ++c) s += x[r * in + c] * w[(e * out + o) * in + c];
        EXPECT_NEAR(y[r * out + o], s, 1e-14);
      }
}

TEST(GroupedLinear, BackwardMatchesFiniteDifferences) {
  const std::int64_t E = 4, in = 5, out = 3;
  const I32 offsets = {0, 0, 4, 4, 7};
  const std::int64_t rows = offsets.back();
  auto x = random_vec(rows * in, 22);
  auto w = random_vec(E * out * in, 23);
  const auto probe = random_vec(rows * out, 24);
  auto loss = [&] {
    std::vector<double> y(rows * out);
    grouped_linear_forward(x.data(), w.data(), y.data(), offsets.data(), E, in, out);
    return dot(y, probe);
  };
  const auto prior = random_vec(E * out * in, 25);
  std::vector<double> dx(rows * in, 3.0), dw = prior;
  grouped_linear_backward(probe.data(), x.data(), w.data(), dx.data(), dw.data(), offsets.data(), E, in, out);
  std::vector<double> added(dw.size());
  for (std::size_t i = 0; i < dw.size(); ++i) added[i] = dw[i] - prior[i];
  // Empty experts' dw stays exactly the prior.
  for (std::int64_t e : {0, 2})
    for (std::int64_t i = 0; i < out * in; ++i) EXPECT_EQ(dw[e * out * in + i], prior[e * out * in + i]);
  expect_grad_close("grouped x", dx, x, loss);
  expect_grad_close("grouped w", added, w, loss);

  // Null dx or dw computes the other one alone, to the same bits.
  std::vector<double> dx_only(rows * in), dw_only = prior;
  grouped_linear_backward(probe.data(), x.data(), w.data(), dx_only.data(), static_cast<double*>(nullptr),
                          offsets.data(), E, in, out);
  grouped_linear_backward(probe.data(), x.data(), w.data(), static_cast<double*>(nullptr), dw_only.data(),
                          offsets.data(), E, in, out);
  EXPECT_EQ(dx_only, dx);
  EXPECT_EQ(dw_only, dw);
}

TEST(GroupedLinear, ZeroRows) {
  const std::int64_t E = 3, in = 4, out = 2;
  const I32 offsets = {0, 0, 0, 0};
  const auto w = random_vec(E * out * in, 26);
  auto dw = random_vec(E * out * in, 27);
  const auto before = dw;
  grouped_linear_forward<double>(nullptr, w.data(), nullptr, offsets.data(), E, in, out);
  grouped_linear_backward<double>(nullptr, nullptr, w.data(), nullptr, dw.data(), offsets.data(), E, in, out);
  EXPECT_EQ(dw, before);
}

// ---------------------------------------------------------------------------
// The composed expert path: plan -> permute -> grouped gate/up -> silu*up -> grouped down -> unpermute.

template <typename T>
struct ExpertWeights {
  std::int64_t E, d, f;
  std::vector<T> w1, w3, w2;  // [E, f, d], [E, f, d], [E, d, f]
};

template <typename T>
std::vector<T> to(const std::vector<double>& v) {
  return std::vector<T>(v.begin(), v.end());
}

template <typename T>
ExpertWeights<T> make_experts(std::int64_t E, std::int64_t d, std::int64_t f, std::uint64_t stream) {
  return {E, d, f, to<T>(random_vec(E * f * d, stream, 0.5)), to<T>(random_vec(E * f * d, stream + 1, 0.5)),
          to<T>(random_vec(E * d * f, stream + 2, 0.5))};
}

/// Everything the composed path saves for its backward.
template <typename T>
struct ExpertPath {
  std::vector<T> xp, g, u, h, yp, y;
};

template <typename T>
ExpertPath<T> expert_path_forward(const std::vector<T>& x, const ExpertWeights<T>& W, const Plan& plan,
                                  const std::vector<T>& topk_w, std::int64_t n, std::int64_t k) {
  const std::int64_t R = plan.rows(), d = W.d, f = W.f, E = W.E;
  ExpertPath<T> s{std::vector<T>(R * d), std::vector<T>(R * f), std::vector<T>(R * f), std::vector<T>(R * f),
                  std::vector<T>(R * d), std::vector<T>(n * d)};
  permute_forward(x.data(), plan.slot.data(), s.xp.data(), n, k, d);
  grouped_linear_forward(s.xp.data(), W.w1.data(), s.g.data(), plan.offsets.data(), E, d, f);
  grouped_linear_forward(s.xp.data(), W.w3.data(), s.u.data(), plan.offsets.data(), E, d, f);
  for (std::int64_t i = 0; i < R * f; ++i) s.h[i] = s.g[i] / (T(1) + std::exp(-s.g[i])) * s.u[i];
  grouped_linear_forward(s.h.data(), W.w2.data(), s.yp.data(), plan.offsets.data(), E, f, d);
  unpermute_forward(s.yp.data(), plan.slot.data(), topk_w.data(), s.y.data(), n, k, d);
  return s;
}

std::vector<double> reference_y(const std::vector<double>& x, const ExpertWeights<double>& W, const I32& idx,
                                const Plan& plan, const std::vector<double>& topk_w, std::int64_t n, std::int64_t k) {
  std::vector<double> y(n * W.d, 5.0);
  moe_experts_reference(x.data(), idx.data(), topk_w.data(), plan.slot.data(), W.w1.data(), W.w3.data(),
                        W.w2.data(), y.data(), n, W.d, W.f, k);
  return y;
}

TEST(ExpertPath, MatchesSequentialReference) {
  const std::int64_t n = 20, E = 4, k = 2, d = 6, f = 5;
  const auto W = make_experts<double>(E, d, f, 30);
  auto logits = random_vec(n * E, 33, 2.0);
  auto r = run_router(logits, n, E, k, true);
  const auto x = random_vec(n * d, 34);
  for (double cf : {0.0, 1.0, 0.6}) {
    const auto plan = make_plan(r.topk_idx, n, E, k, expert_capacity(cf, n, E, k));
    const auto path = expert_path_forward(x, W, plan, r.topk_w, n, k);
    const auto ref = reference_y(x, W, r.topk_idx, plan, r.topk_w, n, k);
    EXPECT_LT(rel_err(path.y, ref), 1e-13) << "capacity_factor " << cf;
  }
}

TEST(ExpertPath, FloatMatchesReference) {
  const std::int64_t n = 33, E = 5, k = 2, d = 16, f = 12;
  const auto W = make_experts<float>(E, d, f, 40);
  const auto idx = random_routing(n, E, k, 43);
  const auto w = to<float>(random_vec(n * k, 44));
  const auto x = to<float>(random_vec(n * d, 45));
  const auto plan = make_plan(idx, n, E, k, -1);
  const auto path = expert_path_forward(x, W, plan, w, n, k);
  std::vector<float> ref(n * d);
  moe_experts_reference(x.data(), idx.data(), w.data(), plan.slot.data(), W.w1.data(), W.w3.data(), W.w2.data(),
                        ref.data(), n, d, f, k);
  EXPECT_LT(rel_err(std::vector<double>(path.y.begin(), path.y.end()), std::vector<double>(ref.begin(), ref.end())),
            1e-5);
}

TEST(ExpertPath, AllTokensToOneExpert) {
  const std::int64_t n = 12, E = 4, k = 1, d = 5, f = 4;
  const auto W = make_experts<double>(E, d, f, 50);
  const I32 idx(n, 2);
  const auto w = random_vec(n * k, 53);
  const auto x = random_vec(n * d, 54);
  const auto plan = make_plan(idx, n, E, k, -1);
  EXPECT_EQ(plan.counts, (I32{0, 0, 12, 0}));
  EXPECT_EQ(plan.offsets, (I32{0, 0, 0, 12, 12}));
  EXPECT_EQ(plan.dropped, 0);
  const auto path = expert_path_forward(x, W, plan, w, n, k);
  EXPECT_LT(rel_err(path.y, reference_y(x, W, idx, plan, w, n, k)), 1e-13);

  // Capacity factor 0.5: capacity ceil(0.5*12*1/4) = 2, so tokens 2.. are dropped entirely.
  const std::int64_t cap = expert_capacity(0.5, n, E, k);
  EXPECT_EQ(cap, 2);
  const auto capped = make_plan(idx, n, E, k, cap);
  EXPECT_EQ(capped.counts, (I32{0, 0, 2, 0}));
  EXPECT_EQ(capped.dropped, n - 2);
  const auto cpath = expert_path_forward(x, W, capped, w, n, k);
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t c = 0; c < d; ++c) {
      if (i < 2)
        EXPECT_EQ(cpath.y[i * d + c], path.y[i * d + c]);
      else
        EXPECT_EQ(cpath.y[i * d + c], 0.0) << "dropped token " << i;
    }
}

TEST(ExpertPath, IdleExperts) {
  const std::int64_t n = 10, E = 6, k = 2, d = 4, f = 3;
  const auto W = make_experts<double>(E, d, f, 60);
  I32 idx(n * k);
  for (std::int64_t i = 0; i < n; ++i) {  // only experts 1 and 4 ever receive tokens
    idx[i * k] = i % 2 ? 1 : 4;
    idx[i * k + 1] = i % 2 ? 4 : 1;
  }
  const auto w = random_vec(n * k, 63);
  const auto x = random_vec(n * d, 64);
  const auto plan = make_plan(idx, n, E, k, -1);
  EXPECT_EQ(plan.counts, (I32{0, 10, 0, 0, 10, 0}));
  const auto path = expert_path_forward(x, W, plan, w, n, k);
  EXPECT_LT(rel_err(path.y, reference_y(x, W, idx, plan, w, n, k)), 1e-13);
}

// Capacity < 1 with a hot expert: a dropped assignment must contribute exactly what a
// zero routing weight would, and nothing else changes.
TEST(ExpertPath, CapacityDropsAreZeroContributions) {
  const std::int64_t n = 16, E = 4, k = 2, d = 5, f = 4;
  const auto W = make_experts<double>(E, d, f, 70);
  I32 idx(n * k);
  for (std::int64_t i = 0; i < n; ++i) {
    idx[i * k] = 0;                                   // every token's first choice is expert 0
    idx[i * k + 1] = std::int32_t(1 + i % (E - 1));  // the second spreads over 1..3
  }
  const auto w = random_vec(n * k, 73);
  const auto x = random_vec(n * d, 74);
  const double cf = 0.75;
  const std::int64_t cap = expert_capacity(cf, n, E, k);
  EXPECT_EQ(cap, 6);  // ceil(0.75 * 16 * 2 / 4)
  const auto plan = make_plan(idx, n, E, k, cap);
  EXPECT_EQ(plan.counts, (I32{6, 6, 5, 5}));
  EXPECT_EQ(plan.dropped, 10);  // all from expert 0; expert 1 gets exactly its 6
  std::int64_t dropped = 0;
  for (std::int64_t a = 0; a < n * k; ++a) dropped += plan.slot[a] < 0;
  EXPECT_EQ(dropped, plan.dropped);

  auto w_zeroed = w;
  for (std::int64_t a = 0; a < n * k; ++a)
    if (plan.slot[a] < 0) w_zeroed[a] = 0;
  const auto dropless = make_plan(idx, n, E, k, -1);
  const auto full = expert_path_forward(x, W, dropless, w_zeroed, n, k);
  const auto capped = expert_path_forward(x, W, plan, w, n, k);
  EXPECT_LT(rel_err(capped.y, full.y), 1e-14);
  EXPECT_LT(rel_err(capped.y, reference_y(x, W, idx, plan, w, n, k)), 1e-13);
}

// Backward through the whole composed path (silu*up backward written here) against
// finite differences, with drops, for x, all three expert weights and the routing weights.
TEST(ExpertPath, BackwardMatchesFiniteDifferences) {
  const std::int64_t n = 8, E = 3, k = 2, d = 4, f = 3;
  auto W = make_experts<double>(E, d, f, 80);
  I32 idx(n * k);
  for (std::int64_t i = 0; i < n; ++i) {
    idx[i * k] = std::int32_t(i % 2);  // experts 0/1 take slot 0
    idx[i * k + 1] = 2;                 // expert 2 is hot and overflows
  }
  auto w = random_vec(n * k, 83);
  auto x = random_vec(n * d, 84);
  const auto plan = make_plan(idx, n, E, k, 5);
  EXPECT_EQ(plan.dropped, 3);
  const auto probe = random_vec(n * d, 85);
  auto loss = [&] { return dot(expert_path_forward(x, W, plan, w, n, k).y, probe); };

  const auto s = expert_path_forward(x, W, plan, w, n, k);
  const std::int64_t R = plan.rows();
  std::vector<double> dyp(R * d), dw(n * k), dh(R * f), dg(R * f), du(R * f), dxp_g(R * d), dxp_u(R * d),
      dxp(R * d), dx(n * d);
  std::vector<double> dw1(E * f * d, 0.0), dw3(E * f * d, 0.0), dw2(E * d * f, 0.0);
  unpermute_backward(probe.data(), s.yp.data(), plan.slot.data(), w.data(), dyp.data(), dw.data(), n, k, d);
  grouped_linear_backward(dyp.data(), s.h.data(), W.w2.data(), dh.data(), dw2.data(), plan.offsets.data(), E, f, d);
  for (std::int64_t i = 0; i < R * f; ++i) {
    const double sg = 1.0 / (1.0 + std::exp(-s.g[i]));
    du[i] = dh[i] * s.g[i] * sg;
    dg[i] = dh[i] * s.u[i] * sg * (1.0 + s.g[i] * (1.0 - sg));
  }
  grouped_linear_backward(dg.data(), s.xp.data(), W.w1.data(), dxp_g.data(), dw1.data(), plan.offsets.data(), E, d,
                          f);
  grouped_linear_backward(du.data(), s.xp.data(), W.w3.data(), dxp_u.data(), dw3.data(), plan.offsets.data(), E, d,
                          f);
  for (std::int64_t i = 0; i < R * d; ++i) dxp[i] = dxp_g[i] + dxp_u[i];
  permute_backward(dxp.data(), plan.slot.data(), dx.data(), n, k, d);

  expect_grad_close("path x", dx, x, loss);
  expect_grad_close("path topk_w", dw, w, loss);
  expect_grad_close("path w1", dw1, W.w1, loss);
  expect_grad_close("path w3", dw3, W.w3, loss);
  expect_grad_close("path w2", dw2, W.w2, loss);
}

// ---------------------------------------------------------------------------
// Determinism: same inputs, same bits; the router and dispatch kernels also give the
// same bits for any thread count (per-token work, chunked reductions).

template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

struct MoeRun {
  std::vector<float> probs, topk_w, dlogits, y, dx, dyp, dtopk_w, dh, dw2;
  I32 idx, slot;
  double aux = 0, z = 0;
};

MoeRun run_everything(int threads) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(threads);
  const std::int64_t n = 600, E = 8, k = 2, d = 32, f = 24;
  MoeRun r;
  const auto logits = to<float>(random_vec(n * E, 90, 3.0));
  r.probs.resize(n * E);
  r.topk_w.resize(n * k);
  r.idx.resize(n * k);
  router_forward(logits.data(), r.probs.data(), r.idx.data(), r.topk_w.data(), n, E, k, true);
  r.aux = aux_loss_forward(r.probs.data(), r.idx.data(), n, E, k, 0.01);
  r.z = z_loss_forward(logits.data(), n, E, 0.001);
  std::vector<float> dprobs(n * E, 0.0f);
  aux_loss_backward(r.idx.data(), dprobs.data(), n, E, k, 0.01);
  const auto dtw = to<float>(random_vec(n * k, 91));
  r.dlogits.resize(n * E);
  router_backward(dtw.data(), dprobs.data(), r.probs.data(), r.idx.data(), r.dlogits.data(), n, E, k, true);
  z_loss_backward(logits.data(), r.dlogits.data(), n, E, 0.001);

  const auto plan = make_plan(r.idx, n, E, k, expert_capacity(0.8, n, E, k));
  r.slot = plan.slot;
  const auto W = make_experts<float>(E, d, f, 92);
  const auto x = to<float>(random_vec(n * d, 95));
  const auto s = expert_path_forward(x, W, plan, r.topk_w, n, k);
  r.y = s.y;
  const auto dy = to<float>(random_vec(n * d, 96));
  r.dyp.assign(plan.rows() * d, 0.0f);
  r.dtopk_w.resize(n * k);
  unpermute_backward(dy.data(), s.yp.data(), plan.slot.data(), r.topk_w.data(), r.dyp.data(), r.dtopk_w.data(), n, k,
                     d);
  r.dh.resize(plan.rows() * f);
  r.dw2.assign(E * d * f, 0.0f);
  grouped_linear_backward(r.dyp.data(), s.h.data(), W.w2.data(), r.dh.data(), r.dw2.data(), plan.offsets.data(), E,
                          f, d);
  r.dx.resize(n * d);
  permute_backward(r.dyp.data(), plan.slot.data(), r.dx.data(), n, k, d);
  omp_set_num_threads(saved);
  return r;
}

TEST(Determinism, RunTwiceGivesTheSameBits) {
  const auto a = run_everything(2), b = run_everything(2);
  EXPECT_TRUE(same_bits(a.probs, b.probs));
  EXPECT_TRUE(same_bits(a.topk_w, b.topk_w));
  EXPECT_EQ(a.idx, b.idx);
  EXPECT_EQ(a.slot, b.slot);
  EXPECT_TRUE(same_bits(a.dlogits, b.dlogits));
  EXPECT_TRUE(same_bits(a.y, b.y));
  EXPECT_TRUE(same_bits(a.dyp, b.dyp));
  EXPECT_TRUE(same_bits(a.dtopk_w, b.dtopk_w));
  EXPECT_TRUE(same_bits(a.dh, b.dh));
  EXPECT_TRUE(same_bits(a.dw2, b.dw2));
  EXPECT_TRUE(same_bits(a.dx, b.dx));
  EXPECT_EQ(std::memcmp(&a.aux, &b.aux, sizeof(double)), 0);
  EXPECT_EQ(std::memcmp(&a.z, &b.z, sizeof(double)), 0);
}

TEST(Determinism, RouterAndDispatchIndependentOfThreadCount) {
  const auto a = run_everything(1), b = run_everything(2);
  EXPECT_TRUE(same_bits(a.probs, b.probs));
  EXPECT_TRUE(same_bits(a.topk_w, b.topk_w));
  EXPECT_EQ(a.idx, b.idx);
  EXPECT_EQ(a.slot, b.slot);
  EXPECT_TRUE(same_bits(a.dlogits, b.dlogits));
  EXPECT_EQ(std::memcmp(&a.aux, &b.aux, sizeof(double)), 0);
  EXPECT_EQ(std::memcmp(&a.z, &b.z, sizeof(double)), 0);
}

}  // namespace
}  // namespace moeflex::test
