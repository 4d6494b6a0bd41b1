// The CPU backend: each method calls the reference op of ops/*.h with the same
// arguments, so the engine's CPU results do not depend on going through it.
#include "moeflex/ops/backend.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "moeflex/core/error.h"
#include "moeflex/ops/attention.h"
#include "moeflex/ops/blas.h"
#include "moeflex/ops/cross_entropy.h"
#include "moeflex/ops/embedding.h"
#include "moeflex/ops/grouped_linear.h"
#include "moeflex/ops/imbalance.h"
#include "moeflex/ops/linear.h"
#include "moeflex/ops/moe_dispatch.h"
#include "moeflex/ops/rmsnorm.h"
#include "moeflex/ops/rope.h"
#include "moeflex/ops/router.h"
#include "moeflex/ops/swiglu.h"

namespace moeflex::ops {

namespace {

// bf16 on the CPU: an op's bf16 inputs are widened into fp32 temporaries, the fp32
// reference op runs, and its bf16 outputs are rounded once (backend.h). f32 views
// pass straight through, so the fp32 engine calls the reference ops unchanged.

/// An input of `n` elements as const float* (null view: null).
class In {
 public:
  In(CView v, std::int64_t n) {
    if (v.dtype != DType::bf16 || !v.data) {
      p = v.f32();
      return;
    }
    tmp_.reset(new float[std::size_t(std::max<std::int64_t>(n, 1))]);
    const bf16* src = v.bf();
    float* dst = tmp_.get();
#pragma omp parallel for schedule(static)
    for (std::int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
    p = dst;
  }
  const float* p = nullptr;

 private:
  std::unique_ptr<float[]> tmp_;
};

/// An output of `n` elements as float*; a bf16 output is computed in an fp32
/// temporary (holding the current values when `read`: accumulating and in-place
/// ops) and rounded into the view when the Out goes out of scope.
class Out {
 public:
  Out(View v, std::int64_t n, bool read = false) : view_(v), n_(n) {
    if (v.dtype != DType::bf16 || !v.data) {
      p = v.f32();
      return;
    }
    tmp_.reset(new float[std::size_t(std::max<std::int64_t>(n, 1))]);
    p = tmp_.get();
    if (read) {
      const bf16* src = v.bf();
      float* dst = p;
#pragma omp parallel for schedule(static)
      for (std::int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
    }
  }
  ~Out() {
    if (!tmp_) return;
    bf16* dst = static_cast<bf16*>(view_.data);
    const float* src = p;
#pragma omp parallel for schedule(static)
    for (std::int64_t i = 0; i < n_; ++i) dst[i] = to_bf16(src[i]);
  }
  Out(const Out&) = delete;
  Out& operator=(const Out&) = delete;
  float* p = nullptr;

 private:
  View view_;
  std::int64_t n_;
  std::unique_ptr<float[]> tmp_;
};

/// The views of one op share one dtype (ops/backend.h); null views do not count.
/// Returns it (f32 when every view is null).
DType same_dtype(const char* op, std::initializer_list<CView> views) {
  const CView* first = nullptr;
  for (const CView& v : views) {
    if (!v) continue;
    if (!first)
      first = &v;
    else if (v.dtype != first->dtype)
      throw Error(fmt::format("{}: tensors of mixed dtypes ({} and {}); an op's activations and weights share one", op,
                              to_string(first->dtype), to_string(v.dtype)));
  }
  return first ? first->dtype : DType::f32;
}

/// Rows of a permuted [R, d] tensor: one past the largest slot of slot_of [nk]; only
/// bf16 needs it (to size its temporaries: In and Out ignore sizes for f32).
std::int64_t permuted_rows(DType t, const std::int32_t* slot_of, std::int64_t nk) {
  if (t != DType::bf16) return 0;
  std::int64_t r = 0;
  for (std::int64_t i = 0; i < nk; ++i) r = std::max<std::int64_t>(r, std::int64_t(slot_of[i]) + 1);
  return r;
}

class CpuBackend final : public Backend {
 public:
  DeviceKind kind() const override { return DeviceKind::cpu; }
  std::string describe() const override { return fmt::format("CPU (OpenBLAS {} + OpenMP)", blas_core_name()); }
  void zero(void* dst, Bytes bytes) override { std::memset(dst, 0, std::size_t(bytes)); }
  void copy(void* dst, const void* src, Bytes bytes) override { std::memcpy(dst, src, std::size_t(bytes)); }
  void copy_from_host(void* dst, const void* src, Bytes bytes) override { std::memcpy(dst, src, std::size_t(bytes)); }
  void copy_to_host(void* dst, const void* src, Bytes bytes) override { std::memcpy(dst, src, std::size_t(bytes)); }
  void synchronize() override {}
  std::shared_ptr<DeviceEvent> copy_async(void*, const void*, Bytes, bool) override {
    throw Error("the CPU backend copies offloads with the CopyEngine's worker thread, not copy_async");
  }
  void* host_alloc(Bytes bytes) override {
    void* p = std::aligned_alloc(Arena::kAlignment, std::size_t(Arena::round_up(std::max<Bytes>(bytes, 1))));
    if (!p) throw Error(fmt::format("host memory: cannot allocate {}", format_bytes(bytes)));
    return p;
  }
  void host_free(void* p, Bytes) override { std::free(p); }

  void linear_forward(CView x, CView w, View y, std::int64_t n, std::int64_t in, std::int64_t out) override {
    same_dtype("linear_forward", {x, w, y});
    In X(x, n * in), W(w, out * in);
    Out Y(y, n * out);
    ops::linear_forward(X.p, W.p, Y.p, n, in, out);
  }
  void linear_backward(CView dy, CView x, CView w, View dx, float* dw, std::int64_t n, std::int64_t in,
                       std::int64_t out, bool accumulate_dx) override {
    same_dtype("linear_backward", {dy, x, w, dx});
    In DY(dy, n * out), X(dw ? x : CView(), n * in), W(dx ? w : CView(), out * in);
    Out DX(dx, n * in, accumulate_dx);
    ops::linear_backward(DY.p, X.p, W.p, DX.p, dw, n, in, out, accumulate_dx);
  }
  void gemm(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, float alpha, CView A, std::int64_t lda,
            CView B, std::int64_t ldb, float beta, View C, std::int64_t ldc) override {
    same_dtype("gemm", {A, B, C});
    // Elements spanned by a row-major [rows, cols] operand with leading dimension ld.
    auto span = [](std::int64_t rows, std::int64_t cols, std::int64_t ld) {
      return rows > 0 ? (rows - 1) * ld + cols : 0;
    };
    In a(A, ta ? span(K, M, lda) : span(M, K, lda)), b(B, tb ? span(N, K, ldb) : span(K, N, ldb));
    // C's padding columns (ldc > N) keep their values: the temporary reads them too.
    Out c(C, span(M, N, ldc), beta != 0.0f || ldc > N);
    ops::gemm<float>(ta, tb, M, N, K, alpha, a.p, lda, b.p, ldb, beta, c.p, ldc);
  }
  void rmsnorm_forward(CView x, CView w, View y, float* rstd, std::int64_t n, std::int64_t d, float eps) override {
    same_dtype("rmsnorm_forward", {x, w, y});
    In X(x, n * d), W(w, d);
    Out Y(y, n * d);
    ops::rmsnorm_forward(X.p, W.p, Y.p, rstd, n, d, eps);
  }
  void rmsnorm_backward(CView dy, CView x, CView w, const float* rstd, View dx, float* dw, std::int64_t n,
                        std::int64_t d) override {
    same_dtype("rmsnorm_backward", {dy, x, w, dx});
    In DY(dy, n * d), X(x, n * d), W(w, d);
    Out DX(dx, n * d);
    ops::rmsnorm_backward(DY.p, X.p, W.p, rstd, DX.p, dw, n, d);
  }
  void rope_forward(View x, std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t hd, double theta) override {
    Out X(x, B * S * H * hd, true);
    ops::rope_forward(X.p, B, S, H, hd, theta);
  }
  void rope_backward(View dx, std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t hd, double theta) override {
    Out DX(dx, B * S * H * hd, true);
    ops::rope_backward(DX.p, B, S, H, hd, theta);
  }
  void attention_forward(CView q, CView k, CView v, View out, View probs, std::int64_t B, std::int64_t S,
                         std::int64_t H, std::int64_t Hkv, std::int64_t hd) override {
    same_dtype("attention_forward", {q, k, v, out, probs});
    check_kv_heads("attention_forward", H, Hkv);
    const std::int64_t t = B * S * H * hd, tkv = B * S * Hkv * hd;
    In Q(q, t), K(k, tkv), V(v, tkv);
    Out O(out, t), P(probs, B * H * S * S);
    ops::attention_forward(Q.p, K.p, V.p, O.p, P.p, B, S, H, Hkv, hd);
  }
  void attention_backward(CView dout, CView q, CView k, CView v, CView out, CView probs, View dq, View dk, View dv,
                          View dprobs_ws, std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t Hkv,
                          std::int64_t hd) override {
    same_dtype("attention_backward", {dout, q, k, v, out, probs, dq, dk, dv, dprobs_ws});  // (out: read on CUDA)
    check_kv_heads("attention_backward", H, Hkv);
    const std::int64_t t = B * S * H * hd, tkv = B * S * Hkv * hd;
    In DO(dout, t), Q(q, t), K(k, tkv), V(v, tkv), P(probs, B * H * S * S);
    Out DQ(dq, t), DK(dk, tkv), DV(dv, tkv), WS(dprobs_ws, B * H * S * S);
    ops::attention_backward(DO.p, Q.p, K.p, V.p, P.p, DQ.p, DK.p, DV.p, WS.p, B, S, H, Hkv, hd);
  }
  void swiglu_forward(CView gate, CView up, View out, std::int64_t n) override {
    same_dtype("swiglu_forward", {gate, up, out});
    In G(gate, n), U(up, n);
    Out O(out, n);
    ops::swiglu_forward(G.p, U.p, O.p, n);
  }
  void swiglu_backward(CView dout, CView gate, CView up, View dgate, View dup, std::int64_t n) override {
    same_dtype("swiglu_backward", {dout, gate, up, dgate, dup});
    In DO(dout, n), G(gate, n), U(up, n);
    Out DG(dgate, n), DU(dup, n);
    ops::swiglu_backward(DO.p, G.p, U.p, DG.p, DU.p, n);
  }
  void add_inplace(View y, CView x, std::int64_t n) override {
    same_dtype("add_inplace", {y, x});
    In X(x, n);
    Out Y(y, n, true);
    float* yp = Y.p;
    const float* xp = X.p;
#pragma omp parallel for schedule(static)
    for (std::int64_t i = 0; i < n; ++i) yp[i] += xp[i];
  }
  void cast(CView src, View dst, std::int64_t n) override {
    if (src.dtype == dst.dtype) {
      std::memcpy(dst.data, src.data, std::size_t(n * dtype_size(src.dtype)));
      return;
    }
    In S(src, n);
    Out D(dst, n);
    std::memcpy(D.p, S.p, sizeof(float) * std::size_t(n));
  }
  void embedding_forward(const std::int32_t* ids, CView table, View out, std::int64_t n, std::int64_t d) override {
    same_dtype("embedding_forward", {table, out});
    if (table.dtype == DType::f32) return ops::embedding_forward(ids, table.f32(), out.f32(), n, d);
    // bf16: a gather of whole rows, exact.
    const Bytes row = d * dtype_size(out.dtype);
    const char* src = static_cast<const char*>(table.data);
    char* dst = static_cast<char*>(out.data);
#pragma omp parallel for schedule(static)
    for (std::int64_t i = 0; i < n; ++i) std::memcpy(dst + i * row, src + std::int64_t(ids[i]) * row, std::size_t(row));
  }
  void embedding_backward(const std::int32_t* ids, CView dout, float* dtable, std::int64_t n, std::int64_t d) override {
    In DO(dout, n * d);
    ops::embedding_backward(ids, DO.p, dtable, n, d);
  }
  double cross_entropy_forward(CView logits, const std::int32_t* targets, View probs, float* losses, std::int64_t n,
                               std::int64_t V) override {
    same_dtype("cross_entropy_forward", {logits, probs});
    In L(logits, n * V);
    Out P(probs, n * V);
    return ops::cross_entropy_forward(L.p, targets, P.p, losses, n, V);
  }
  void cross_entropy_backward(CView probs, const std::int32_t* targets, View dlogits, std::int64_t n, std::int64_t V,
                              float scale) override {
    same_dtype("cross_entropy_backward", {probs, dlogits});
    In P(probs, n * V);
    Out D(dlogits, n * V);
    ops::cross_entropy_backward(P.p, targets, D.p, n, V, scale);
  }
  void router_forward(CView logits, float* probs, std::int32_t* idx, float* w, std::int64_t n, std::int64_t E,
                      std::int64_t k, const ops::RouterOptions& opt) override {
    In L(logits, n * E);
    ops::router_forward(L.p, probs, idx, w, n, E, k, opt);
  }
  void router_backward(const float* dw, const float* dprobs, const float* probs, const std::int32_t* idx, View dlogits,
                       std::int64_t n, std::int64_t E, std::int64_t k, const ops::RouterOptions& opt) override {
    Out D(dlogits, n * E);
    ops::router_backward(dw, dprobs, probs, idx, D.p, n, E, k, opt);
  }
  double aux_loss_forward(const float* probs, const std::int32_t* idx, std::int64_t n, std::int64_t E,
                          std::int64_t k, double coef, ops::RouterScore score) override {
    return ops::aux_loss_forward(probs, idx, n, E, k, coef, score);
  }
  void aux_loss_backward(const std::int32_t* idx, const float* probs, float* dprobs, std::int64_t n, std::int64_t E,
                         std::int64_t k, double coef, ops::RouterScore score) override {
    ops::aux_loss_backward(idx, probs, dprobs, n, E, k, coef, score);
  }
  double z_loss_forward(CView logits, std::int64_t n, std::int64_t E, double coef) override {
    In L(logits, n * E);
    return ops::z_loss_forward(L.p, n, E, coef);
  }
  void z_loss_backward(CView logits, View dlogits, std::int64_t n, std::int64_t E, double coef) override {
    same_dtype("z_loss_backward", {logits, dlogits});
    In L(logits, n * E);
    Out D(dlogits, n * E, true);
    ops::z_loss_backward(L.p, D.p, n, E, coef);
  }
  void skew_router_logits(View logits, std::int64_t n, std::int64_t E, std::int64_t k,
                          const ops::RouterSkew& skew) override {
    Out L(logits, n * E, true);
    ops::skew_router_logits(L.p, n, E, k, skew);
  }
  std::int64_t moe_plan_dispatch(const std::int32_t* idx, std::int64_t n, std::int64_t E, std::int64_t k,
                                 std::int64_t cap, std::int32_t* counts, std::int32_t* offsets, std::int32_t* slot_of,
                                 std::int32_t* host_offsets) override {
    const std::int64_t dropped = ops::moe_plan_dispatch(idx, n, E, k, cap, counts, offsets, slot_of);
    std::memcpy(host_offsets, offsets, sizeof(std::int32_t) * std::size_t(E + 1));
    return dropped;
  }
  void permute_forward(CView x, const std::int32_t* slot_of, View xp, std::int64_t n, std::int64_t k,
                       std::int64_t d) override {
    const DType t = same_dtype("permute_forward", {x, xp});
    In X(x, n * d);
    Out XP(xp, permuted_rows(t, slot_of, n * k) * d);
    ops::permute_forward(X.p, slot_of, XP.p, n, k, d);
  }
  void permute_backward(CView dxp, const std::int32_t* slot_of, View dx, std::int64_t n, std::int64_t k,
                        std::int64_t d) override {
    const DType t = same_dtype("permute_backward", {dxp, dx});
    In DXP(dxp, permuted_rows(t, slot_of, n * k) * d);
    Out DX(dx, n * d);
    ops::permute_backward(DXP.p, slot_of, DX.p, n, k, d);
  }
  void unpermute_forward(CView yp, const std::int32_t* slot_of, const float* w, View y, std::int64_t n, std::int64_t k,
                         std::int64_t d) override {
    const DType t = same_dtype("unpermute_forward", {yp, y});
    In YP(yp, permuted_rows(t, slot_of, n * k) * d);
    Out Y(y, n * d);
    ops::unpermute_forward(YP.p, slot_of, w, Y.p, n, k, d);
  }
  void unpermute_backward(CView dy, CView yp, const std::int32_t* slot_of, const float* w, View dyp, float* dw,
                          std::int64_t n, std::int64_t k, std::int64_t d) override {
    const std::int64_t R = permuted_rows(same_dtype("unpermute_backward", {dy, yp, dyp}), slot_of, n * k);
    In DY(dy, n * d), YP(yp, R * d);
    Out DYP(dyp, R * d);
    ops::unpermute_backward(DY.p, YP.p, slot_of, w, DYP.p, dw, n, k, d);
  }
  void combine_topk_grad(CView dy, CView yp_rows, const std::int32_t* slot_of, float* dtopk_w, std::int64_t n,
                         std::int64_t k, std::int64_t d, std::int64_t r0, std::int64_t rows) override {
    same_dtype("combine_topk_grad", {dy, yp_rows});
    In DY(dy, n * d), YP(yp_rows, rows * d);
    ops::combine_topk_grad(DY.p, YP.p, slot_of, dtopk_w, n, k, d, r0, rows);
  }
  void grouped_linear_forward(CView x, CView w, View y, const std::int32_t* offsets, std::int64_t E, std::int64_t in,
                              std::int64_t out) override {
    same_dtype("grouped_linear_forward", {x, w, y});
    const std::int64_t rows = offsets[E];
    In X(x, rows * in), W(w, E * out * in);
    Out Y(y, rows * out);
    ops::grouped_linear_forward(X.p, W.p, Y.p, offsets, E, in, out);
  }
  void grouped_linear_backward(CView dy, CView x, CView w, View dx, float* dw, const std::int32_t* offsets,
                               std::int64_t E, std::int64_t in, std::int64_t out) override {
    same_dtype("grouped_linear_backward", {dy, x, w, dx});
    const std::int64_t rows = offsets[E];
    In DY(dy, rows * out), X(dw ? x : CView(), rows * in), W(dx ? w : CView(), E * out * in);
    Out DX(dx, rows * in);
    ops::grouped_linear_backward(DY.p, X.p, W.p, DX.p, dw, offsets, E, in, out);
  }

  double square_sum(const float* g, std::int64_t n) override {
    // Fixed-size chunks summed in order: the same result for any thread count.
    constexpr std::int64_t kChunk = 4096;
    const std::int64_t nchunks = (n + kChunk - 1) / kChunk;
    std::vector<double> partial(std::size_t(nchunks), 0.0);
#pragma omp parallel for schedule(static)
    for (std::int64_t c = 0; c < nchunks; ++c) {
      double s = 0;
      for (std::int64_t j = c * kChunk; j < std::min(n, (c + 1) * kChunk); ++j) s += double(g[j]) * g[j];
      partial[std::size_t(c)] = s;
    }
    double total = 0;
    for (double s : partial) total += s;
    return total;
  }
  void scale(float* g, std::int64_t n, float scale) override {
#pragma omp parallel for schedule(static)
    for (std::int64_t j = 0; j < n; ++j) g[j] *= scale;
  }
  void adamw(float* w, const float* g, float* m, float* v, std::int64_t n, float b1, float b2, float eps,
             float decay, float step_size, float inv_sqrt_bc2) override {
#pragma omp parallel for schedule(static)
    for (std::int64_t j = 0; j < n; ++j) {
      m[j] = b1 * m[j] + (1.0f - b1) * g[j];
      v[j] = b2 * v[j] + (1.0f - b2) * g[j] * g[j];
      w[j] = w[j] * decay - step_size * m[j] / (std::sqrt(v[j]) * inv_sqrt_bc2 + eps);
    }
  }
};

}  // namespace

void check_kv_heads(const char* op, std::int64_t H, std::int64_t Hkv) {
  if (Hkv < 1 || Hkv > H || H % Hkv != 0)
    throw Error(fmt::format("{}: {} key/value heads must divide {} query heads", op, Hkv, H));
}

Backend& cpu_backend() {
  static CpuBackend backend;
  return backend;
}

DeviceContext make_cpu_context(Bytes budget) {
  DeviceContext ctx;
  ctx.arena = std::make_unique<Arena>(budget);
  return ctx;
}

namespace {
Backend* g_backend_override = nullptr;
}  // namespace

Backend* set_backend_override(Backend* backend) {
  Backend* previous = g_backend_override;
  g_backend_override = backend;
  return previous;
}

Backend& backend_of(const Arena& arena) {
  if (g_backend_override) return *g_backend_override;
  Device* dev = arena.device();
  if (!dev) return cpu_backend();
  auto* be = dynamic_cast<Backend*>(dev);
  if (!be) throw Error(fmt::format("arena's device ({}) has no compute backend", dev->describe()));
  return *be;
}

}  // namespace moeflex::ops
