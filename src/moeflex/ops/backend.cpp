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

class CpuBackend final : public Backend {
 public:
  DeviceKind kind() const override { return DeviceKind::cpu; }
  std::string describe() const override { return "CPU (OpenBLAS + OpenMP)"; }
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

  void linear_forward(const float* x, const float* w, float* y, std::int64_t n, std::int64_t in,
                      std::int64_t out) override {
    ops::linear_forward(x, w, y, n, in, out);
  }
  void linear_backward(const float* dy, const float* x, const float* w, float* dx, float* dw, std::int64_t n,
                       std::int64_t in, std::int64_t out, bool accumulate_dx) override {
    ops::linear_backward(dy, x, w, dx, dw, n, in, out, accumulate_dx);
  }
  void gemm(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, float alpha, const float* A,
            std::int64_t lda, const float* B, std::int64_t ldb, float beta, float* C, std::int64_t ldc) override {
    ops::gemm<float>(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  }
  void rmsnorm_forward(const float* x, const float* w, float* y, float* rstd, std::int64_t n, std::int64_t d,
                       float eps) override {
    ops::rmsnorm_forward(x, w, y, rstd, n, d, eps);
  }
  void rmsnorm_backward(const float* dy, const float* x, const float* w, const float* rstd, float* dx, float* dw,
                        std::int64_t n, std::int64_t d) override {
    ops::rmsnorm_backward(dy, x, w, rstd, dx, dw, n, d);
  }
  void rope_forward(float* x, std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t hd,
                    double theta) override {
    ops::rope_forward(x, B, S, H, hd, theta);
  }
  void rope_backward(float* dx, std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t hd,
                     double theta) override {
    ops::rope_backward(dx, B, S, H, hd, theta);
  }
  void attention_forward(const float* q, const float* k, const float* v, float* out, float* probs, std::int64_t B,
                         std::int64_t S, std::int64_t H, std::int64_t hd) override {
    ops::attention_forward(q, k, v, out, probs, B, S, H, hd);
  }
  void attention_backward(const float* dout, const float* q, const float* k, const float* v, const float*,
                          const float* probs, float* dq, float* dk, float* dv, float* dprobs_ws, std::int64_t B,
                          std::int64_t S, std::int64_t H, std::int64_t hd) override {
    ops::attention_backward(dout, q, k, v, probs, dq, dk, dv, dprobs_ws, B, S, H, hd);
  }
  void swiglu_forward(const float* gate, const float* up, float* out, std::int64_t n) override {
    ops::swiglu_forward(gate, up, out, n);
  }
  void swiglu_backward(const float* dout, const float* gate, const float* up, float* dgate, float* dup,
                       std::int64_t n) override {
    ops::swiglu_backward(dout, gate, up, dgate, dup, n);
  }
  void add_inplace(float* y, const float* x, std::int64_t n) override {
#pragma omp parallel for schedule(static)
    for (std::int64_t i = 0; i < n; ++i) y[i] += x[i];
  }
  void embedding_forward(const std::int32_t* ids, const float* table, float* out, std::int64_t n,
                         std::int64_t d) override {
    ops::embedding_forward(ids, table, out, n, d);
  }
  void embedding_backward(const std::int32_t* ids, const float* dout, float* dtable, std::int64_t n,
                          std::int64_t d) override {
    ops::embedding_backward(ids, dout, dtable, n, d);
  }
  double cross_entropy_forward(const float* logits, const std::int32_t* targets, float* probs, float* losses,
                               std::int64_t n, std::int64_t V) override {
    return ops::cross_entropy_forward(logits, targets, probs, losses, n, V);
  }
  void cross_entropy_backward(const float* probs, const std::int32_t* targets, float* dlogits, std::int64_t n,
                              std::int64_t V, float scale) override {
    ops::cross_entropy_backward(probs, targets, dlogits, n, V, scale);
  }
  void router_forward(const float* logits, float* probs, std::int32_t* idx, float* w, std::int64_t n,
                      std::int64_t E, std::int64_t k, bool norm) override {
    ops::router_forward(logits, probs, idx, w, n, E, k, norm);
  }
  void router_backward(const float* dw, const float* dprobs, const float* probs, const std::int32_t* idx,
                       float* dlogits, std::int64_t n, std::int64_t E, std::int64_t k, bool norm) override {
    ops::router_backward(dw, dprobs, probs, idx, dlogits, n, E, k, norm);
  }
  double aux_loss_forward(const float* probs, const std::int32_t* idx, std::int64_t n, std::int64_t E,
                          std::int64_t k, double coef) override {
    return ops::aux_loss_forward(probs, idx, n, E, k, coef);
  }
  void aux_loss_backward(const std::int32_t* idx, float* dprobs, std::int64_t n, std::int64_t E, std::int64_t k,
                         double coef) override {
    ops::aux_loss_backward(idx, dprobs, n, E, k, coef);
  }
  double z_loss_forward(const float* logits, std::int64_t n, std::int64_t E, double coef) override {
    return ops::z_loss_forward(logits, n, E, coef);
  }
  void z_loss_backward(const float* logits, float* dlogits, std::int64_t n, std::int64_t E, double coef) override {
    ops::z_loss_backward(logits, dlogits, n, E, coef);
  }
  void skew_router_logits(float* logits, std::int64_t n, std::int64_t E, std::int64_t k, int groups,
                          double ratio) override {
    ops::skew_router_logits(logits, n, E, k, groups, ratio);
  }
  std::int64_t moe_plan_dispatch(const std::int32_t* idx, std::int64_t n, std::int64_t E, std::int64_t k,
                                 std::int64_t cap, std::int32_t* counts, std::int32_t* offsets, std::int32_t* slot_of,
                                 std::int32_t* host_offsets) override {
    const std::int64_t dropped = ops::moe_plan_dispatch(idx, n, E, k, cap, counts, offsets, slot_of);
    std::memcpy(host_offsets, offsets, sizeof(std::int32_t) * std::size_t(E + 1));
    return dropped;
  }
  void permute_forward(const float* x, const std::int32_t* slot_of, float* xp, std::int64_t n, std::int64_t k,
                       std::int64_t d) override {
    ops::permute_forward(x, slot_of, xp, n, k, d);
  }
  void permute_backward(const float* dxp, const std::int32_t* slot_of, float* dx, std::int64_t n, std::int64_t k,
                        std::int64_t d) override {
    ops::permute_backward(dxp, slot_of, dx, n, k, d);
  }
  void unpermute_forward(const float* yp, const std::int32_t* slot_of, const float* w, float* y, std::int64_t n,
                         std::int64_t k, std::int64_t d) override {
    ops::unpermute_forward(yp, slot_of, w, y, n, k, d);
  }
  void unpermute_backward(const float* dy, const float* yp, const std::int32_t* slot_of, const float* w,
                          float* dyp, float* dw, std::int64_t n, std::int64_t k, std::int64_t d) override {
    ops::unpermute_backward(dy, yp, slot_of, w, dyp, dw, n, k, d);
  }
  void grouped_linear_forward(const float* x, const float* w, float* y, const std::int32_t* offsets, std::int64_t E,
                              std::int64_t in, std::int64_t out) override {
    ops::grouped_linear_forward(x, w, y, offsets, E, in, out);
  }
  void grouped_linear_backward(const float* dy, const float* x, const float* w, float* dx, float* dw,
                               const std::int32_t* offsets, std::int64_t E, std::int64_t in,
                               std::int64_t out) override {
    ops::grouped_linear_backward(dy, x, w, dx, dw, offsets, E, in, out);
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
