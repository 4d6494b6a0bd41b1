// The compute backend the model runs on (STYLE habit 6's "device" part): every op
// the engine calls on tensor data, plus the device's memory operations
// (core/device.h). The CPU backend is the reference ops of ops/*.h called with the
// same arguments (so CPU results are those of calling the ops directly, bit for
// bit); the CUDA backend (ops/cuda/backend.h) runs ops/cuda/* on one compute stream
// with one cuBLAS handle.
//
// Precision. Activation and weight arguments are Views (core/tensor.h): f32 in the
// fp32 engine, bf16 in the mixed-precision one (--precision bf16), where weights are
// the bf16 working copy of the fp32 master weights. Arguments typed float* are
// fp32 in both: weight gradients (dw, dtable: the fp32 main gradients), RMSNorm's
// rstd, the router's probabilities and top-k weights and their gradients, the
// per-token losses and the optimizer's tensors. Every op computes and accumulates
// in fp32 and rounds each bf16 output once (round to nearest even); an op that
// accumulates into a bf16 output (accumulate_dx, gemm's beta, add_inplace,
// z_loss_backward) reads it, adds in fp32 and rounds the sum. On the CPU a bf16
// op widens its inputs, runs the fp32 reference and rounds its outputs, which is
// the reference the CUDA bf16 kernels are held to (1e-2 relative error in norm).
// The views of one call share one dtype (a mix is an Error naming the op: it is a
// caller's bug, such as a tensor allocated in the wrong dtype); `cast` converts.
//
// Pointers are the arena's (device memory on CUDA). Shapes and semantics are those
// of the CPU ops; the differences a caller must know:
//   - token ids / targets are HOST arrays (the data loader's), copied by the backend;
//   - grouped GEMM offsets are HOST arrays (moe_plan_dispatch returns them);
//   - attention: `probs` and `dprobs_ws` are [B, H, S, S] buffers as on the CPU; the
//     CUDA flash kernels keep only the logsumexp [B, H, S] in fp32 in the first
//     4*B*H*S bytes of `probs` (so a bf16 `probs` needs S >= 2) and use
//     `dprobs_ws` as scratch, and the backward reads `out`;
//   - functions returning a loss (double) wait for the device (they read it back).
#pragma once
#include <cstdint>
#include <memory>

#include "moeflex/core/arena.h"
#include "moeflex/core/device.h"
#include "moeflex/core/tensor.h"
#include "moeflex/ops/imbalance.h"
#include "moeflex/ops/router.h"

namespace moeflex::ops {

class Backend : public Device {
 public:
  /// True when the host may read and write tensor memory directly (the CPU
  /// backend); otherwise every touch goes through the Device operations.
  virtual bool host_memory() const { return kind() == DeviceKind::cpu; }

  // --- dense layers -------------------------------------------------------------------
  virtual void linear_forward(CView x, CView w, View y, std::int64_t n, std::int64_t in, std::int64_t out) = 0;
  /// dx (= or += with accumulate_dx) and dw (+=, fp32); either may be null.
  virtual void linear_backward(CView dy, CView x, CView w, View dx, float* dw, std::int64_t n, std::int64_t in,
                               std::int64_t out, bool accumulate_dx) = 0;
  /// Row-major C = alpha op(A) op(B) + beta C (ops/blas.h).
  virtual void gemm(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K, float alpha, CView A,
                    std::int64_t lda, CView B, std::int64_t ldb, float beta, View C, std::int64_t ldc) = 0;
  virtual void rmsnorm_forward(CView x, CView w, View y, float* rstd, std::int64_t n, std::int64_t d, float eps) = 0;
  virtual void rmsnorm_backward(CView dy, CView x, CView w, const float* rstd, View dx, float* dw, std::int64_t n,
                                std::int64_t d) = 0;
  virtual void rope_forward(View x, std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t hd,
                            double theta) = 0;
  virtual void rope_backward(View dx, std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t hd,
                             double theta) = 0;
  /// Causal attention (ops/attention.h): q, out [B, S, H, hd]; k, v [B, S, Hkv, hd]
  /// (grouped-query when Hkv < H, which it must divide, else Error).
  virtual void attention_forward(CView q, CView k, CView v, View out, View probs, std::int64_t B, std::int64_t S,
                                 std::int64_t H, std::int64_t Hkv, std::int64_t hd) = 0;
  virtual void attention_backward(CView dout, CView q, CView k, CView v, CView out, CView probs, View dq, View dk,
                                  View dv, View dprobs_ws, std::int64_t B, std::int64_t S, std::int64_t H,
                                  std::int64_t Hkv, std::int64_t hd) = 0;
  virtual void swiglu_forward(CView gate, CView up, View out, std::int64_t n) = 0;
  virtual void swiglu_backward(CView dout, CView gate, CView up, View dgate, View dup, std::int64_t n) = 0;
  /// y += x over n elements.
  virtual void add_inplace(View y, CView x, std::int64_t n) = 0;
  /// dst = src converted over n elements (f32 <-> bf16: the working copy of the
  /// master weights, round to nearest even; bf16 -> f32 is exact; same dtypes copy).
  virtual void cast(CView src, View dst, std::int64_t n) = 0;

  // --- embedding and loss (ids, targets: host) -----------------------------------------
  virtual void embedding_forward(const std::int32_t* host_ids, CView table, View out, std::int64_t n,
                                 std::int64_t d) = 0;
  /// dtable += scatter of dout (fp32 main gradient).
  virtual void embedding_backward(const std::int32_t* host_ids, CView dout, float* dtable, std::int64_t n,
                                  std::int64_t d) = 0;
  /// Mean loss (waits for the device); probs may alias logits.
  virtual double cross_entropy_forward(CView logits, const std::int32_t* host_targets, View probs, float* losses,
                                       std::int64_t n, std::int64_t V) = 0;
  /// dlogits may alias probs.
  virtual void cross_entropy_backward(CView probs, const std::int32_t* host_targets, View dlogits, std::int64_t n,
                                      std::int64_t V, float scale) = 0;

  // --- router and MoE dispatch ----------------------------------------------------------
  /// ops::router_forward / router_backward (ops/router.h); opt.bias is in this backend's memory.
  virtual void router_forward(CView logits, float* probs, std::int32_t* topk_idx, float* topk_w, std::int64_t n,
                              std::int64_t E, std::int64_t k, const ops::RouterOptions& opt) = 0;
  virtual void router_backward(const float* dtopk_w, const float* dprobs_extra, const float* probs,
                               const std::int32_t* topk_idx, View dlogits, std::int64_t n, std::int64_t E,
                               std::int64_t k, const ops::RouterOptions& opt) = 0;
  virtual double aux_loss_forward(const float* probs, const std::int32_t* topk_idx, std::int64_t n, std::int64_t E,
                                  std::int64_t k, double coef, ops::RouterScore score) = 0;
  /// dprobs += the aux loss's gradient (sigmoid scores: through the row normalisation, reading probs).
  virtual void aux_loss_backward(const std::int32_t* topk_idx, const float* probs, float* dprobs, std::int64_t n,
                                 std::int64_t E, std::int64_t k, double coef, ops::RouterScore score) = 0;
  virtual double z_loss_forward(CView logits, std::int64_t n, std::int64_t E, double coef) = 0;
  /// dlogits += the z-loss gradient.
  virtual void z_loss_backward(CView logits, View dlogits, std::int64_t n, std::int64_t E, double coef) = 0;
  /// ops::skew_router_logits on logits [n, E] (spike tests).
  virtual void skew_router_logits(View logits, std::int64_t n, std::int64_t E, std::int64_t k,
                                  const ops::RouterSkew& skew) = 0;
  /// counts, offsets, slot_of (=) as ops::moe_plan_dispatch, plus host_offsets [E+1]
  /// on the host; returns the dropped assignments (waits for the device).
  virtual std::int64_t moe_plan_dispatch(const std::int32_t* topk_idx, std::int64_t n, std::int64_t E,
                                         std::int64_t k, std::int64_t capacity, std::int32_t* counts,
                                         std::int32_t* offsets, std::int32_t* slot_of,
                                         std::int32_t* host_offsets) = 0;
  virtual void permute_forward(CView x, const std::int32_t* slot_of, View xp, std::int64_t n, std::int64_t k,
                               std::int64_t d) = 0;
  virtual void permute_backward(CView dxp, const std::int32_t* slot_of, View dx, std::int64_t n, std::int64_t k,
                                std::int64_t d) = 0;
  virtual void unpermute_forward(CView yp, const std::int32_t* slot_of, const float* topk_w, View y, std::int64_t n,
                                 std::int64_t k, std::int64_t d) = 0;
  /// dtopk_w may be null: then yp is not read (see combine_topk_grad).
  virtual void unpermute_backward(CView dy, CView yp, const std::int32_t* slot_of, const float* topk_w, View dyp,
                                  float* dtopk_w, std::int64_t n, std::int64_t k, std::int64_t d) = 0;
  /// The top-k weights' gradient for the expert-output rows [r0, r0 + rows) alone
  /// (ops::combine_topk_grad): yp_rows [rows, d]; entries of other slots untouched.
  virtual void combine_topk_grad(CView dy, CView yp_rows, const std::int32_t* slot_of, float* dtopk_w,
                                 std::int64_t n, std::int64_t k, std::int64_t d, std::int64_t r0,
                                 std::int64_t rows) = 0;
  /// Grouped expert GEMMs; host_offsets [E+1] on the host.
  virtual void grouped_linear_forward(CView x, CView w, View y, const std::int32_t* host_offsets, std::int64_t E,
                                      std::int64_t in, std::int64_t out) = 0;
  /// dx (=) and dw (+=, fp32); either may be null.
  virtual void grouped_linear_backward(CView dy, CView x, CView w, View dx, float* dw,
                                       const std::int32_t* host_offsets, std::int64_t E, std::int64_t in,
                                       std::int64_t out) = 0;

  // --- optimizer ------------------------------------------------------------------------
  /// Sum of squares of g [n] in double, over fixed chunks of 4096 summed in order
  /// (waits for the device).
  virtual double square_sum(const float* g, std::int64_t n) = 0;
  /// g *= scale.
  virtual void scale(float* g, std::int64_t n, float scale) = 0;
  /// One AdamW update of n elements (train/optimizer.h's formula with its float
  /// constants): m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
  /// w = w * decay - step_size * m / (sqrt(v) * inv_sqrt_bc2 + eps).
  virtual void adamw(float* w, const float* g, float* m, float* v, std::int64_t n, float b1, float b2, float eps,
                     float decay, float step_size, float inv_sqrt_bc2) = 0;
};

/// A backend with the arena over its memory: what a run allocates from and computes
/// on. For the CPU, `backend` is null (the CPU backend is a process-wide object) and
/// the arena is host memory; for a device, the arena's device is `backend`, which
/// owns the region (declared first, so it outlives the arena).
struct DeviceContext {
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Arena> arena;
  DeviceKind kind() const { return backend ? backend->kind() : DeviceKind::cpu; }
};

/// The CPU context: an Arena(budget) (kUnlimited or bytes) on the CPU backend.
DeviceContext make_cpu_context(Bytes budget);

/// Throws Error naming `op` unless 1 <= Hkv <= H and Hkv divides H (grouped-query
/// attention's key/value heads; the backends' attention ops check it).
void check_kv_heads(const char* op, std::int64_t H, std::int64_t Hkv);

/// The CPU backend (ops/*.h on host memory); one per process.
Backend& cpu_backend();

/// The backend whose memory `arena` hands out: its device when it has one, else the
/// CPU backend. Throws Error when the arena's device is not a Backend. While an
/// override is set (set_backend_override), the override.
Backend& backend_of(const Arena& arena);

/// Makes backend_of() return `backend` for every arena (null: no override) and
/// returns the previous override. For the op profiler (profile/op_profiler.h), a
/// Backend that wraps the run's own; set it before the model is built (MoEModel
/// binds its backend at construction). Not thread-safe: set it between runs.
Backend* set_backend_override(Backend* backend);

}  // namespace moeflex::ops
