// Op cases of the MoE path (op_cases.h): the router with its aux and z losses, the
// spike injection, the dispatch plan, permute / unpermute (whole and by row
// windows), the grouped expert GEMM and the optimizer's ops. Each routed op runs
// at a uniform shape and at a skewed one (STYLE habit 7: a hot expert taking most
// rows, experts that get none), with capacity drops where the op sees them.
//
// Finite-difference steps: permute, unpermute and the grouped GEMM are linear in
// each input (unit step, 1e-5, as op_cases_dense.cpp says); the router is smooth
// once the top-k selection is fixed, and separated_router_logits keeps every gap
// between a row's logits >= 0.25, so the step 1e-2 never changes it.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>

#include "moeflex/ops/moe_dispatch.h"
#include "op_cases.h"
#include "op_harness.h"

namespace moeflex::test {
namespace {

constexpr Tolerance kLinearInInput{.fd_eps = 1.0, .fd = 1e-5, .why = "linear in each input: no truncation error"};
constexpr double kRouterGap = 0.25;

std::vector<double> as_doubles(const std::vector<std::int32_t>& v) { return {v.begin(), v.end()}; }

/// The dispatch plan of skewed routing: slot_of [n*k] and offsets [E+1] (CPU reference op).
struct Plan {
  std::vector<std::int32_t> topk_idx, slot_of, offsets;
  std::int64_t rows() const { return offsets.back(); }
};
Plan skewed_plan(std::int64_t n, std::int64_t E, std::int64_t k, double capacity_factor) {
  Plan p;
  p.topk_idx = skewed_topk(n, E, k, std::int32_t(E / 2), 2, 300);
  std::vector<std::int32_t> counts(static_cast<std::size_t>(E));
  p.slot_of.resize(std::size_t(n * k));
  p.offsets.resize(std::size_t(E + 1));
  ops::moe_plan_dispatch(p.topk_idx.data(), n, E, k, ops::expert_capacity(capacity_factor, n, E, k), counts.data(),
                         p.offsets.data(), p.slot_of.data());
  return p;
}

std::string moe_shape(std::int64_t n, std::int64_t E, std::int64_t k, std::int64_t d, double cf) {
  char capacity[32] = ",dropless";
  if (cf > 0) std::snprintf(capacity, sizeof capacity, ",capacity=%g", cf);
  return shape_of({{"n", n}, {"E", E}, {"k", k}, {"d", d}}) + capacity;
}

/// Router logits [n, E] and an expert bias [E] (zero without `with_bias`) whose
/// choice scores (probs + bias) and group scores are all at least `gap` apart within
/// each row, so that finite-difference steps of the logits never change the
/// selection: rows of random logits in [-2, 2) are redrawn until they are.
std::pair<std::vector<double>, std::vector<double>> separated_routing(std::int64_t n, std::int64_t E,
                                                                       const ops::RouterOptions& opt, bool with_bias,
                                                                       double gap, std::uint64_t stream) {
  std::vector<double> bias = with_bias ? random_vec(std::size_t(E), stream, 0.1) : std::vector<double>(std::size_t(E));
  std::vector<double> logits(std::size_t(n * E));
  const std::int64_t groups = opt.group_limited() ? opt.n_group : 1, G = E / groups;
  auto separated = [gap](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    for (std::size_t i = 1; i < v.size(); ++i)
      if (v[i] - v[i - 1] < gap) return false;
    return true;
  };
  for (std::int64_t i = 0; i < n; ++i)
    for (std::uint64_t draw = 0;; ++draw) {
      const auto l = random_vec(std::size_t(E), stream + 1 + std::uint64_t(i) * 1000 + draw, 2.0);
      std::vector<double> p(static_cast<std::size_t>(E)), c(p), group(static_cast<std::size_t>(groups));
      double sum = 0;
      for (std::int64_t e = 0; e < E; ++e) sum += std::exp(l[std::size_t(e)]);
      for (std::int64_t e = 0; e < E; ++e) {
        const double x = l[std::size_t(e)];
        p[std::size_t(e)] = opt.score == ops::RouterScore::sigmoid ? 1 / (1 + std::exp(-x)) : std::exp(x) / sum;
        c[std::size_t(e)] = p[std::size_t(e)] + bias[std::size_t(e)];
      }
      for (std::int64_t g = 0; g < groups; ++g) {
        std::vector<double> in(c.begin() + g * G, c.begin() + (g + 1) * G);
        std::sort(in.rbegin(), in.rend());
        group[std::size_t(g)] = opt.group_score == ops::GroupScore::top2_sum && G >= 2 ? in[0] + in[1] : in[0];
      }
      if (separated(c) && (groups == 1 || separated(group))) {
        std::copy(l.begin(), l.end(), logits.begin() + i * E);
        break;
      }
    }
  return {logits, bias};
}

/// Scores, top-k, the load-balancing loss and the z-loss together, as a router
/// runs them: L = aux + z + <probs, dprobs> + <topk_w, dtopk_w>. The backward adds
/// the aux gradient onto a copy of the probs' seed, as the model does. The softmax
/// router without bias or groups takes skewed logits with `cold` experts; the others
/// (DeepSeek's rules) random logits whose selection the steps cannot change.
OpCase router_case(std::string name, std::int64_t n, std::int64_t E, std::int64_t k, ops::RouterOptions opt,
                   std::int64_t cold, bool with_bias = false) {
  constexpr double kAuxCoef = 0.1, kZCoef = 0.05;
  const bool deepseek = with_bias || opt.group_limited() || opt.score == ops::RouterScore::sigmoid;
  std::string shape =
      shape_of({{"n", n}, {"E", E}, {"k", k}, {"norm_topk", opt.norm_topk_prob}, {"cold_experts", cold}});
  if (deepseek)
    shape += "," + shape_of({{"sigmoid", opt.score == ops::RouterScore::sigmoid}, {"n_group", opt.n_group},
                             {"topk_group", opt.topk_group}, {"bias", with_bias}}) +
             fmt::format(",scaling={}", opt.routed_scaling_factor);
  OpCase c = new_case(std::move(name), std::move(shape));
  c.build = [=] {
    auto [logits, bias] = deepseek ? separated_routing(n, E, opt, with_bias, 0.02, 200)
                                   : std::pair{separated_router_logits(n, E, k, std::int32_t(E / 2), cold, kRouterGap, 200),
                                               std::vector<double>(std::size_t(E))};
    return std::vector<TensorSpec>{
        input_values("logits", Elem::act, logits), input_values("bias", Elem::f32, bias),
        saved("probs", Elem::f32, n * E), output("topk_idx", Elem::i32, n * k), output("topk_w", Elem::f32, n * k),
        seed("dprobs", "probs", Elem::f32, n * E, 201), seed("dtopk_w", "topk_w", Elem::f32, n * k, 202),
        scratch("dprobs_total", Elem::f32, n * E), grad("dlogits", "logits", Elem::act, n * E)};
  };
  auto rule = [=](OpTensors& t) {
    ops::RouterOptions o = opt;
    if (with_bias) o.bias = t.f("bias");
    return o;
  };
  c.forward = [=](ops::Backend& be, OpTensors& t) {
    be.router_forward(t.c("logits"), t.f("probs"), t.i("topk_idx"), t.f("topk_w"), n, E, k, rule(t));
    return be.aux_loss_forward(t.f("probs"), t.i("topk_idx"), n, E, k, kAuxCoef, opt.score) +
           be.z_loss_forward(t.c("logits"), n, E, kZCoef);
  };
  c.backward = [=](ops::Backend& be, OpTensors& t) {
    be.copy(t.f("dprobs_total"), t.f("dprobs"), Bytes(4) * n * E);
    be.aux_loss_backward(t.i("topk_idx"), t.f("probs"), t.f("dprobs_total"), n, E, k, kAuxCoef, opt.score);
    be.router_backward(t.f("dtopk_w"), t.f("dprobs_total"), t.f("probs"), t.i("topk_idx"), t.v("dlogits"), n, E, k,
                       rule(t));
    be.z_loss_backward(t.c("logits"), t.v("dlogits"), n, E, kZCoef);
  };
  c.tol = {.fd_eps = 1e-2, .fd = 5e-4, .why = "smooth for a fixed top-k; separated logits keep it fixed"};
  c.forward_flops = 8.0 * double(n * E);
  c.backward_flops = 8.0 * double(n * E);
  return c;
}

/// The spike injection (ops/imbalance.h), in place on the logits: forward only.
OpCase skew_router_logits_case(std::int64_t n, std::int64_t E, std::int64_t k) {
  OpCase c = new_case("skew_router_logits", shape_of({{"n", n}, {"E", E}, {"k", k}, {"groups", 2}}) + ",ratio=1.5");
  c.build = [=] { return std::vector<TensorSpec>{in_place("logits", Elem::act, n * E, 210, 3.0)}; };
  c.forward = [=](ops::Backend& be, OpTensors& t) {
    ops::RouterSkew skew;
    skew.groups = 2;
    skew.ratio = 1.5;
    be.skew_router_logits(t.v("logits"), n, E, k, skew);
    return 0.0;
  };
  return c;
}

/// The dispatch plan: integers, compared exactly; returns the dropped assignments.
OpCase moe_plan_case(std::string name, std::int64_t n, std::int64_t E, std::int64_t k, double cf) {
  OpCase c = new_case(std::move(name), moe_shape(n, E, k, 0, cf));
  c.build = [=] {
    return std::vector<TensorSpec>{
        input_values("topk_idx", Elem::i32, as_doubles(skewed_topk(n, E, k, std::int32_t(E / 2), 2, 300))),
        output("counts", Elem::i32, E), output("offsets", Elem::i32, E + 1), output("slot_of", Elem::i32, n * k),
        output("host_offsets", Elem::host_i32, E + 1)};
  };
  c.forward = [=](ops::Backend& be, OpTensors& t) {
    return double(be.moe_plan_dispatch(t.i("topk_idx"), n, E, k, ops::expert_capacity(cf, n, E, k), t.i("counts"),
                                       t.i("offsets"), t.i("slot_of"), t.i("host_offsets")));
  };
  return c;
}

OpCase permute_case(std::string name, std::int64_t n, std::int64_t E, std::int64_t k, std::int64_t d, double cf) {
  OpCase c = new_case(std::move(name), moe_shape(n, E, k, d, cf));
  c.build = [=] {
    const Plan p = skewed_plan(n, E, k, cf);
    return std::vector<TensorSpec>{input("x", Elem::act, n * d, 220),
                                   input_values("slot_of", Elem::i32, as_doubles(p.slot_of)),
                                   output("xp", Elem::act, p.rows() * d),
                                   seed("dxp", "xp", Elem::act, p.rows() * d, 221), grad("dx", "x", Elem::act, n * d)};
  };
  c.forward = [=](ops::Backend& be, OpTensors& t) {
    be.permute_forward(t.c("x"), t.i("slot_of"), t.v("xp"), n, k, d);
    return 0.0;
  };
  c.backward = [=](ops::Backend& be, OpTensors& t) {
    be.permute_backward(t.c("dxp"), t.i("slot_of"), t.v("dx"), n, k, d);
  };
  c.tol = kLinearInInput;
  c.backward_flops = double(n * k * d);
  return c;
}

/// The combine: y = sum_j topk_w[i,j] yp[slot]. With `window` > 0 the backward is
/// the model's chunked one: dyp from unpermute_backward without dtopk_w, then
/// combine_topk_grad over row windows (dtopk_w zeroed first: windows leave dropped
/// slots untouched).
OpCase unpermute_case(std::string name, std::int64_t n, std::int64_t E, std::int64_t k, std::int64_t d, double cf,
                      std::int64_t window) {
  OpCase c = new_case(std::move(name),
                      moe_shape(n, E, k, d, cf) + (window > 0 ? ",window=" + std::to_string(window) : ""));
  const std::int64_t rows = skewed_plan(n, E, k, cf).rows();
  c.build = [=] {
    const Plan p = skewed_plan(n, E, k, cf);
    return std::vector<TensorSpec>{input("yp", Elem::act, rows * d, 230), input("topk_w", Elem::f32, n * k, 231),
                                   input_values("slot_of", Elem::i32, as_doubles(p.slot_of)),
                                   output("y", Elem::act, n * d), seed("dy", "y", Elem::act, n * d, 232),
                                   grad("dyp", "yp", Elem::act, rows * d), grad("dtopk_w", "topk_w", Elem::f32, n * k)};
  };
  c.forward = [=](ops::Backend& be, OpTensors& t) {
    be.unpermute_forward(t.c("yp"), t.i("slot_of"), t.f("topk_w"), t.v("y"), n, k, d);
    return 0.0;
  };
  c.backward = [=](ops::Backend& be, OpTensors& t) {
    if (window <= 0) {
      be.unpermute_backward(t.c("dy"), t.c("yp"), t.i("slot_of"), t.f("topk_w"), t.v("dyp"), t.f("dtopk_w"), n, k, d);
      return;
    }
    be.unpermute_backward(t.c("dy"), CView(), t.i("slot_of"), t.f("topk_w"), t.v("dyp"), nullptr, n, k, d);
    be.zero(t.f("dtopk_w"), Bytes(4) * n * k);
    for (std::int64_t r0 = 0; r0 < rows; r0 += window)
      be.combine_topk_grad(t.c("dy"), t.c("yp") + r0 * d, t.i("slot_of"), t.f("dtopk_w"), n, k, d, r0,
                           std::min(window, rows - r0));
  };
  c.tol = kLinearInInput;
  c.forward_flops = 2.0 * double(n * k * d);
  c.backward_flops = 3.0 * double(n * k * d);
  return c;
}

/// The grouped expert GEMM over given per-expert row counts.
OpCase grouped_linear_case(std::string name, std::vector<std::int32_t> counts, std::int64_t in, std::int64_t out) {
  const std::int64_t E = std::int64_t(counts.size());
  std::vector<std::int32_t> offsets(counts.size() + 1, 0);
  std::partial_sum(counts.begin(), counts.end(), offsets.begin() + 1);
  const std::int64_t rows = offsets.back();
  OpCase c;
  c.name = std::move(name);
  std::string rows_of;
  if (E <= 8) {
    for (std::int32_t r : counts) {
      if (!rows_of.empty()) rows_of += '/';
      rows_of += std::to_string(r);
    }
  } else {
    const auto empty = std::count(counts.begin(), counts.end(), 0);
    rows_of = std::to_string(rows) + "(max " + std::to_string(*std::max_element(counts.begin(), counts.end())) +
              "," + std::to_string(empty) + " empty)";
  }
  c.shape = shape_of({{"E", E}, {"in", in}, {"out", out}}) + ",rows=" + rows_of;
  c.build = [=] {
    return std::vector<TensorSpec>{input("x", Elem::act, rows * in, 240), input("w", Elem::act, E * out * in, 241),
                                   input_values("offsets", Elem::host_i32, as_doubles(offsets)),
                                   output("y", Elem::act, rows * out), seed("dy", "y", Elem::act, rows * out, 242),
                                   grad("dx", "x", Elem::act, rows * in),
                                   grad_acc("dw", "w", Elem::f32, E * out * in, 243)};
  };
  c.forward = [=](ops::Backend& be, OpTensors& t) {
    be.grouped_linear_forward(t.c("x"), t.c("w"), t.v("y"), t.i("offsets"), E, in, out);
    return 0.0;
  };
  c.backward = [=](ops::Backend& be, OpTensors& t) {
    be.grouped_linear_backward(t.c("dy"), t.c("x"), t.c("w"), t.v("dx"), t.f("dw"), t.i("offsets"), E, in, out);
  };
  c.tol = kLinearInInput;
  c.forward_flops = 2.0 * double(rows * in * out);
  c.backward_flops = 4.0 * double(rows * in * out);
  return c;
}

/// The grouped GEMM's row counts of skewed routing (its dispatch plan).
std::vector<std::int32_t> skewed_counts(std::int64_t n, std::int64_t E, std::int64_t k) {
  const Plan p = skewed_plan(n, E, k, -1);
  std::vector<std::int32_t> counts(static_cast<std::size_t>(E));
  for (std::int64_t e = 0; e < E; ++e)
    counts[std::size_t(e)] = p.offsets[std::size_t(e + 1)] - p.offsets[std::size_t(e)];
  return counts;
}

/// The optimizer's ops in a step's order: the gradient norm (square_sum, the case's
/// scalar), clipping (scale) and AdamW, all fp32 in both runs.
OpCase optimizer_case(std::int64_t n) {
  OpCase c = new_case("optimizer_square_sum_scale_adamw", shape_of({{"n", n}}));
  c.build = [=] {
    TensorSpec v = in_place("v", Elem::f32, n, 253, 0.1);
    for (double& x : v.init) x *= x;  // a second moment is >= 0
    return std::vector<TensorSpec>{in_place("g", Elem::f32, n, 250), in_place("w", Elem::f32, n, 251),
                                   in_place("m", Elem::f32, n, 252, 0.1), v};
  };
  c.forward = [=](ops::Backend& be, OpTensors& t) {
    const double sq = be.square_sum(t.f("g"), n);
    be.scale(t.f("g"), n, 0.37f);
    be.adamw(t.f("w"), t.f("g"), t.f("m"), t.f("v"), n, 0.9f, 0.95f, 1e-8f, 0.999f, 1e-3f, 1.2f);
    return sq;
  };
  c.tol = {.f32 = 1e-5, .bf16 = 1e-5, .why = "fp32 tensors in both runs"};
  c.forward_flops = 14.0 * double(n);
  return c;
}

}  // namespace

void add_moe_cases(std::vector<OpCase>& cases) {
  cases.push_back(router_case("router_small", 12, 6, 2, {.norm_topk_prob = true}, 0));
  cases.push_back(router_case("router_skewed", 24, 8, 2, {.norm_topk_prob = false}, 2));
  // DeepSeek-V3 (sigmoid, bias, groups of best top-2 sum, scaled) and V2 (softmax, groups of best max).
  cases.push_back(router_case("router_noaux_tc", 24, 8, 3,
                              {.score = ops::RouterScore::sigmoid, .routed_scaling_factor = 2.5, .n_group = 4,
                               .topk_group = 2, .group_score = ops::GroupScore::top2_sum},
                              0, true));
  cases.push_back(router_case("router_group_limited", 24, 8, 3,
                              {.norm_topk_prob = false, .routed_scaling_factor = 1.5, .n_group = 4, .topk_group = 2},
                              0));
  cases.push_back(skew_router_logits_case(40, 8, 2));
  cases.push_back(moe_plan_case("moe_plan_skewed", 50, 8, 2, -1));
  cases.push_back(moe_plan_case("moe_plan_skewed_capacity", 50, 8, 2, 1.0));
  cases.push_back(permute_case("permute_skewed", 13, 6, 2, 5, -1));
  cases.push_back(permute_case("permute_skewed_capacity", 13, 6, 2, 5, 1.0));
  cases.push_back(unpermute_case("unpermute_skewed", 13, 6, 2, 5, -1, 0));
  cases.push_back(unpermute_case("unpermute_skewed_capacity", 13, 6, 2, 5, 1.0, 0));
  cases.push_back(unpermute_case("unpermute_skewed_capacity_windows", 13, 6, 2, 5, 1.0, 7));
  cases.push_back(grouped_linear_case("grouped_linear_uniform", {3, 2, 3}, 6, 5));
  // Experts 0, 3 and 5 empty (the first and the last among them), expert 2 with 14 of 17 rows.
  cases.push_back(grouped_linear_case("grouped_linear_skewed", {0, 1, 14, 0, 2, 0}, 6, 5));
  cases.push_back(grouped_linear_case("grouped_linear_skewed_routing", skewed_counts(20, 8, 2), 7, 4));
  cases.push_back(optimizer_case(1001));
  // Training-like shapes for the timing figures (64 experts, 8 of them cold).
  cases.push_back(at_timing_size(router_case("router_timing", 1024, 64, 6, {.norm_topk_prob = true}, 8)));
  cases.push_back(at_timing_size(permute_case("permute_timing", 1024, 64, 6, 256, -1)));
  cases.push_back(at_timing_size(unpermute_case("unpermute_timing", 1024, 64, 6, 256, -1, 0)));
  cases.push_back(at_timing_size(grouped_linear_case("grouped_linear_timing", skewed_counts(1024, 16, 2), 512, 256)));
}

}  // namespace moeflex::test
