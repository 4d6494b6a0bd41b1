// Op cases of the dense layers (op_cases.h): linear, gemm, RMSNorm, RoPE, attention,
// SwiGLU, add_inplace, cast, embedding and cross-entropy, each at a small shape and
// a second, less regular one.
//
// Finite-difference steps (Gradients mode, fp32 forward). An op that is linear in the
// perturbed input (linear, gemm, RoPE, embedding) has no truncation error, so a unit
// step keeps fp32 rounding of the loss (~1e-7 relative) far below the tolerance of
// 1e-5. A smooth non-linear op has truncation error ~eps^2 and rounding error
// ~1e-7/eps: eps = 1e-2 (inputs of scale 1) gives errors of 1e-5 to 4e-5, and 5e-4
// leaves a margin of 10 while an error of 0.1% in a gradient still fails.
#include <cmath>

#include "op_cases.h"

namespace moeflex::test {
namespace {

constexpr Tolerance kLinearInInput{.fd_eps = 1.0, .fd = 1e-5, .why = "linear in each input: no truncation error"};
constexpr Tolerance kSmooth{.fd_eps = 1e-2, .fd = 5e-4, .why = "smooth: truncation ~eps^2 against rounding ~1e-7/eps"};

OpCase linear_case(std::string name, std::int64_t n, std::int64_t in, std::int64_t out, bool accumulate_dx) {
  OpCase c = new_case(std::move(name), shape_of({{"n", n}, {"in", in}, {"out", out}, {"acc_dx", accumulate_dx}}));
  c.build = [=] {
    return std::vector<TensorSpec>{
        input("x", Elem::act, n * in, 10), input("w", Elem::act, out * in, 11), output("y", Elem::act, n * out),
        seed("dy", "y", Elem::act, n * out, 12),
        accumulate_dx ? grad_acc("dx", "x", Elem::act, n * in, 13) : grad("dx", "x", Elem::act, n * in),
        grad_acc("dw", "w", Elem::f32, out * in, 14)};
  };
  c.forward = [=](ops::Backend& be, OpTensors& t) {
    be.linear_forward(t.c("x"), t.c("w"), t.v("y"), n, in, out);
    return 0.0;
  };
  c.backward = [=](ops::Backend& be, OpTensors& t) {
    be.linear_backward(t.c("dy"), t.c("x"), t.c("w"), t.v("dx"), t.f("dw"), n, in, out, accumulate_dx);
  };
  c.tol = kLinearInInput;
  c.forward_flops = 2.0 * double(n * in * out);
  c.backward_flops = 4.0 * double(n * in * out);
  return c;
}

/// C = alpha op(A) op(B) + beta C with padded leading dimensions. gemm has no
/// backward op: the case's backward is written with gemm itself (dA, dB "+=" with
/// beta 1, so the padding, which no product reads, stays untouched), so the
/// finite differences check every transpose combination through its adjoint.
OpCase gemm_case(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K) {
  constexpr float kAlpha = 0.75f, kBeta = 0.5f;
  const std::int64_t lda = (ta ? M : K) + 3, ldb = (tb ? K : N) + 2, ldc = N + 1;
  const std::int64_t a_size = (ta ? K : M) * lda, b_size = (tb ? N : K) * ldb, c_size = M * ldc;
  OpCase c = new_case(std::string("gemm_") + (ta ? "t" : "n") + (tb ? "t" : "n"),
                      shape_of({{"M", M}, {"N", N}, {"K", K}, {"lda", lda}, {"ldb", ldb}, {"ldc", ldc}}));
  c.build = [=] {
    return std::vector<TensorSpec>{input("A", Elem::act, a_size, 20),
                                   input("B", Elem::act, b_size, 21),
                                   in_place("C", Elem::act, c_size, 22),
                                   seed("dC", "C", Elem::act, c_size, 23),
                                   grad_acc("dA", "A", Elem::act, a_size, 24),
                                   grad_acc("dB", "B", Elem::act, b_size, 25)};
  };
  c.forward = [=](ops::Backend& be, OpTensors& t) {
    be.gemm(ta, tb, M, N, K, kAlpha, t.c("A"), lda, t.c("B"), ldb, kBeta, t.v("C"), ldc);
    return 0.0;
  };
  c.backward = [=](ops::Backend& be, OpTensors& t) {
    // With Â = op(A), B̂ = op(B): dÂ = alpha dC B̂^T, dB̂ = alpha Â^T dC, stored transposed when op transposes.
    if (!ta) be.gemm(false, !tb, M, K, N, kAlpha, t.c("dC"), ldc, t.c("B"), ldb, 1.0f, t.v("dA"), lda);
    else be.gemm(tb, true, K, M, N, kAlpha, t.c("B"), ldb, t.c("dC"), ldc, 1.0f, t.v("dA"), lda);
    if (!tb) be.gemm(!ta, false, K, N, M, kAlpha, t.c("A"), lda, t.c("dC"), ldc, 1.0f, t.v("dB"), ldb);
    else be.gemm(true, ta, N, K, M, kAlpha, t.c("dC"), ldc, t.c("A"), lda, 1.0f, t.v("dB"), ldb);
  };
  c.tol = kLinearInInput;
  c.forward_flops = 2.0 * double(M * N * K);
  c.backward_flops = 4.0 * double(M * N * K);
  return c;
}

OpCase rmsnorm_case(std::string name, std::int64_t n, std::int64_t d) {
  OpCase c = new_case(std::move(name), shape_of({{"n", n}, {"d", d}}));
  c.build = [=] {
    return std::vector<TensorSpec>{input("x", Elem::act, n * d, 30, 2.0), input("w", Elem::act, d, 31),
                                   output("y", Elem::act, n * d), saved("rstd", Elem::f32, n),
                                   seed("dy", "y", Elem::act, n * d, 32), grad("dx", "x", Elem::act, n * d),
                                   grad_acc("dw", "w", Elem::f32, d, 33)};
  };
  c.forward = [=](ops::Backend& be, OpTensors& t) {
    be.rmsnorm_forward(t.c("x"), t.c("w"), t.v("y"), t.f("rstd"), n, d, 1e-6f);
    return 0.0;
  };
  c.backward = [=](ops::Backend& be, OpTensors& t) {
    be.rmsnorm_backward(t.c("dy"), t.c("x"), t.c("w"), t.f("rstd"), t.v("dx"), t.f("dw"), n, d);
  };
  c.tol = kSmooth;
  c.forward_flops = 4.0 * double(n * d);
  c.backward_flops = 8.0 * double(n * d);
  return c;
}

/// RoPE runs in place: x is rotated by the forward, and the backward rotates its
/// seed back into the gradient of x.
OpCase rope_case(std::string name, std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t hd) {
  constexpr double kTheta = 10000.0;
  const std::int64_t N = B * S * H * hd;
  OpCase c = new_case(std::move(name), shape_of({{"B", B}, {"S", S}, {"H", H}, {"hd", hd}}));
  c.build = [=] {
    return std::vector<TensorSpec>{in_place("x", Elem::act, N, 40), seed_in_place("dx", "x", "x", Elem::act, N, 41)};
  };
  c.forward = [=](ops::Backend& be, OpTensors& t) {
    be.rope_forward(t.v("x"), B, S, H, hd, kTheta);
    return 0.0;
  };
  c.backward = [=](ops::Backend& be, OpTensors& t) { be.rope_backward(t.v("dx"), B, S, H, hd, kTheta); };
  c.tol = kLinearInInput;
  c.tol.why = "a rotation: linear in x";
  c.forward_flops = 3.0 * double(N);
  c.backward_flops = 3.0 * double(N);
  return c;
}

/// Causal attention of H query heads over Hkv key/value heads (GQA when Hkv < H).
OpCase attention_case(std::string name, std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t Hkv,
                      std::int64_t hd) {
  const std::int64_t N = B * S * H * hd, Nkv = B * S * Hkv * hd, P = B * H * S * S;
  OpCase c = new_case(std::move(name), shape_of({{"B", B}, {"S", S}, {"H", H}, {"Hkv", Hkv}, {"hd", hd}}));
  c.build = [=] {
    return std::vector<TensorSpec>{
        input("q", Elem::act, N, 50, 1.5), input("k", Elem::act, Nkv, 51, 1.5), input("v", Elem::act, Nkv, 52),
        output("out", Elem::act, N),
        // The CUDA flash kernels keep only the logsumexp in probs (ops/backend.h).
        saved("probs", Elem::act, P, false), scratch("dprobs_ws", Elem::act, P), seed("dout", "out", Elem::act, N, 53),
        grad("dq", "q", Elem::act, N), grad("dk", "k", Elem::act, Nkv), grad("dv", "v", Elem::act, Nkv)};
  };
  c.forward = [=](ops::Backend& be, OpTensors& t) {
    be.attention_forward(t.c("q"), t.c("k"), t.c("v"), t.v("out"), t.v("probs"), B, S, H, Hkv, hd);
    return 0.0;
  };
  c.backward = [=](ops::Backend& be, OpTensors& t) {
    be.attention_backward(t.c("dout"), t.c("q"), t.c("k"), t.c("v"), t.c("out"), t.c("probs"), t.v("dq"), t.v("dk"),
                          t.v("dv"), t.v("dprobs_ws"), B, S, H, Hkv, hd);
  };
  c.tol = kSmooth;
  c.forward_flops = 4.0 * double(B * H * S * S * hd);  // attention.h: the causal half is not skipped
  c.backward_flops = 8.0 * double(B * H * S * S * hd);
  return c;
}

OpCase swiglu_case(std::string name, std::int64_t n) {
  OpCase c = new_case(std::move(name), shape_of({{"n", n}}));
  c.build = [=] {
    return std::vector<TensorSpec>{input("gate", Elem::act, n, 60, 4.0), input("up", Elem::act, n, 61),
                                   output("out", Elem::act, n), seed("dout", "out", Elem::act, n, 62),
                                   grad("dgate", "gate", Elem::act, n), grad("dup", "up", Elem::act, n)};
  };
  c.forward = [=](ops::Backend& be, OpTensors& t) {
    be.swiglu_forward(t.c("gate"), t.c("up"), t.v("out"), n);
    return 0.0;
  };
  c.backward = [=](ops::Backend& be, OpTensors& t) {
    be.swiglu_backward(t.c("dout"), t.c("gate"), t.c("up"), t.v("dgate"), t.v("dup"), n);
  };
  c.tol = kSmooth;
  c.forward_flops = 5.0 * double(n);
  c.backward_flops = 10.0 * double(n);
  return c;
}

/// y += x: no backward op (the gradient is the identity).
OpCase add_inplace_case(std::int64_t n) {
  OpCase c = new_case("add_inplace", shape_of({{"n", n}}));
  c.build = [=] { return std::vector<TensorSpec>{in_place("y", Elem::act, n, 70), input("x", Elem::act, n, 71)}; };
  c.forward = [=](ops::Backend& be, OpTensors& t) {
    be.add_inplace(t.v("y"), t.c("x"), n);
    return 0.0;
  };
  c.forward_flops = double(n);
  return c;
}

/// dst = src converted (fp32 to the dtype under test, or back): exact on every
/// backend (round to nearest even), so both tolerances are 0. Values of scale 1e3
/// and a tie (1 + 2^-8 rounds to even).
OpCase cast_case(std::string name, Elem from, Elem to, std::int64_t n) {
  OpCase c = new_case(std::move(name), shape_of({{"n", n}}));
  c.build = [=] {
    TensorSpec src = input("src", from, n, 80, 1e3);
    src.init[0] = 1.0 + std::ldexp(1.0, -8);
    return std::vector<TensorSpec>{src, output("dst", to, n)};
  };
  c.forward = [=](ops::Backend& be, OpTensors& t) {
    be.cast(t.c("src"), t.v("dst"), n);
    return 0.0;
  };
  c.tol = {.f32 = 0, .bf16 = 0, .why = "a conversion: exact"};
  return c;
}

/// Token ids repeat (i * 7 mod 13), so the scatter-add of the backward sums rows.
OpCase embedding_case(std::int64_t V, std::int64_t d, std::int64_t n) {
  OpCase c = new_case("embedding", shape_of({{"V", V}, {"d", d}, {"n", n}}));
  c.build = [=] {
    std::vector<double> ids(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) ids[std::size_t(i)] = double((i * 7) % std::min<std::int64_t>(13, V));
    return std::vector<TensorSpec>{input_values("ids", Elem::host_i32, ids), input("table", Elem::act, V * d, 90),
                                   output("out", Elem::act, n * d), seed("dout", "out", Elem::act, n * d, 91),
                                   grad_acc("dtable", "table", Elem::f32, V * d, 92)};
  };
  c.forward = [=](ops::Backend& be, OpTensors& t) {
    be.embedding_forward(t.i("ids"), t.c("table"), t.v("out"), n, d);
    return 0.0;
  };
  c.backward = [=](ops::Backend& be, OpTensors& t) {
    be.embedding_backward(t.i("ids"), t.c("dout"), t.f("dtable"), n, d);
  };
  c.tol = kLinearInInput;
  c.tol.why = "a gather: linear in the table";
  c.backward_flops = double(n * d);
  return c;
}

/// The mean loss is the case's loss (the backward's scale is 1/n, d mean / d loss_i).
OpCase cross_entropy_case(std::string name, std::int64_t n, std::int64_t V) {
  OpCase c = new_case(std::move(name), shape_of({{"n", n}, {"V", V}}));
  c.build = [=] {
    std::vector<double> targets(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) targets[std::size_t(i)] = double((i * 37 + 5) % V);
    return std::vector<TensorSpec>{input("logits", Elem::act, n * V, 100, 4.0),
                                   input_values("targets", Elem::host_i32, targets), saved("probs", Elem::act, n * V),
                                   output("losses", Elem::f32, n), grad("dlogits", "logits", Elem::act, n * V)};
  };
  c.forward = [=](ops::Backend& be, OpTensors& t) {
    return be.cross_entropy_forward(t.c("logits"), t.i("targets"), t.v("probs"), t.f("losses"), n, V);
  };
  c.backward = [=](ops::Backend& be, OpTensors& t) {
    be.cross_entropy_backward(t.c("probs"), t.i("targets"), t.v("dlogits"), n, V, 1.0f / float(n));
  };
  c.tol = kSmooth;
  if (V > 100) {
    // Each entry of the gradient is p/n ~ 1e-4 at V = 300 while the loss rounds at
    // ~3e-8: a larger step and a looser tolerance (measured error 7e-4).
    c.tol.fd_eps = 5e-2;
    c.tol.fd = 5e-3;
    c.tol.why = "gradient entries ~p/n ~1e-4 against fp32 rounding of the loss";
  }
  c.forward_flops = 4.0 * double(n * V);
  c.backward_flops = 2.0 * double(n * V);
  return c;
}

}  // namespace

void add_dense_cases(std::vector<OpCase>& cases) {
  cases.push_back(linear_case("linear_small", 5, 7, 6, false));
  cases.push_back(linear_case("linear_accumulate_dx", 9, 16, 5, true));
  for (bool ta : {false, true})
    for (bool tb : {false, true}) cases.push_back(gemm_case(ta, tb, 5, 7, 4));
  cases.push_back(rmsnorm_case("rmsnorm_small", 5, 12));
  cases.push_back(rmsnorm_case("rmsnorm_wide", 3, 67));
  cases.push_back(rmsnorm_case("rmsnorm_qk_per_head", 2 * 7 * 4, 12));  // QK-norm: n x H rows of head_dim
  cases.push_back(rope_case("rope_small", 1, 3, 2, 4));
  cases.push_back(rope_case("rope_batched", 2, 5, 3, 8));
  cases.push_back(attention_case("attention_small", 1, 4, 2, 2, 4));
  cases.push_back(attention_case("attention_batched", 2, 7, 3, 3, 8));
  cases.push_back(attention_case("attention_gqa", 2, 7, 4, 2, 8));  // two query heads per kv head
  cases.push_back(attention_case("attention_mqa", 1, 5, 3, 1, 4));  // multi-query: one kv head
  cases.push_back(attention_case("attention_gqa_head_dim_12", 1, 6, 4, 2, 12));  // head_dim != hidden / heads
  cases.push_back(swiglu_case("swiglu", 41));
  cases.push_back(add_inplace_case(37));
  cases.push_back(cast_case("cast_f32_to_act", Elem::f32, Elem::act, 129));
  cases.push_back(cast_case("cast_act_to_f32", Elem::act, Elem::f32, 129));
  cases.push_back(embedding_case(11, 6, 9));
  cases.push_back(cross_entropy_case("cross_entropy_small", 6, 10));
  cases.push_back(cross_entropy_case("cross_entropy_vocab", 5, 300));
  // Training-like shapes for the timing figures.
  cases.push_back(at_timing_size(linear_case("linear_timing", 512, 512, 1024, false)));
  cases.push_back(at_timing_size(rmsnorm_case("rmsnorm_timing", 512, 1024)));
  cases.push_back(at_timing_size(attention_case("attention_timing", 1, 256, 4, 4, 64)));
  cases.push_back(at_timing_size(swiglu_case("swiglu_timing", 512 * 1024)));
  cases.push_back(at_timing_size(cross_entropy_case("cross_entropy_timing", 256, 8192)));
}

}  // namespace moeflex::test
