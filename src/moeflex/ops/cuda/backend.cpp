// The CUDA backend (see backend.h for memory and ordering).
#include "moeflex/ops/cuda/backend.h"

#include <fmt/format.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <set>
#include <string>
#include <vector>

#include "moeflex/core/cuda/buffer.h"
#include "moeflex/core/cuda/cuda_check.h"
#include "moeflex/core/cuda/device.h"
#include "moeflex/core/cuda/stream.h"
#include "moeflex/ops/cuda/attention.h"
#include "moeflex/ops/cuda/blas.h"
#include "moeflex/ops/cuda/cross_entropy.h"
#include "moeflex/ops/cuda/embedding.h"
#include "moeflex/ops/cuda/grouped_linear.h"
#include "moeflex/ops/cuda/linear.h"
#include "moeflex/ops/cuda/moe_dispatch.h"
#include "moeflex/ops/cuda/optimizer.h"
#include "moeflex/ops/cuda/residual.h"
#include "moeflex/ops/cuda/rmsnorm.h"
#include "moeflex/ops/cuda/rope.h"
#include "moeflex/ops/cuda/router.h"
#include "moeflex/ops/cuda/swiglu.h"
#include "moeflex/ops/imbalance.h"
#include "moeflex/ops/router.h"

namespace moeflex::ops::cuda {

namespace mc = moeflex::cuda;

namespace {

constexpr Bytes kCublasWorkspace = Bytes(32) << 20;  // bytes; cuBLAS's recommendation for Hopper
constexpr Bytes kReserveArena = Bytes(64) << 20;     // bytes; cuBLAS workspace + grouped-GEMM pointers

class CudaEvent final : public DeviceEvent {
 public:
  explicit CudaEvent(mc::Event e) : event_(std::move(e)) {}
  bool query() override { return event_.query(); }
  void synchronize() override { event_.synchronize(); }

 private:
  mc::Event event_;
};

/// A device buffer that grows (never shrinks) on request; growing waits for the
/// stream, since queued work may still read the old buffer.
class Scratch {
 public:
  ~Scratch() {
    if (ptr_) cudaFree(ptr_);
  }
  void* get(Bytes bytes, const mc::Stream& stream) {
    if (bytes <= size_) return ptr_;
    stream.synchronize();
    if (ptr_) MOEFLEX_CUDA_CHECK(cudaFree(ptr_));
    ptr_ = nullptr;
    size_ = 0;
    const Bytes want = std::max<Bytes>(bytes, Bytes(1) << 20);
    MOEFLEX_CUDA_CHECK(cudaMalloc(&ptr_, static_cast<std::size_t>(want)));
    size_ = want;
    return ptr_;
  }
  Bytes size() const { return size_; }

 private:
  void* ptr_ = nullptr;
  Bytes size_ = 0;
};

/// One view argument of an op, named for errors. Null views (an output the caller
/// skips, an input only that output reads) take no part in the dtype dispatch.
struct Arg {
  const char* name;
  CView view;
};

/// Throws Error: the CUDA backend has no kernel for this op with these dtypes.
[[noreturn]] void no_kernel(const char* op, std::initializer_list<Arg> args, const char* supported) {
  std::string got;
  for (const Arg& a : args) {
    if (!a.view) continue;
    if (!got.empty()) got += ", ";
    got += fmt::format("{} {}", a.name, to_string(a.view.dtype));
  }
  throw Error(fmt::format("CUDA backend: {} has no kernel for {} (supported: {})", op, got, supported));
}

/// The dtype every non-null view of `args` has (f32 when all are null); throws Error
/// (no_kernel) when they differ (ops/backend.h: the views of one call share one
/// dtype) or it is neither f32 nor bf16.
DType uniform_dtype(const char* op, std::initializer_list<Arg> args) {
  bool seen = false, ok = true;
  DType t = DType::f32;
  for (const Arg& a : args) {
    if (!a.view) continue;
    if (a.view.dtype != DType::f32 && a.view.dtype != DType::bf16) ok = false;
    if (seen && a.view.dtype != t) ok = false;
    if (!seen) t = a.view.dtype, seen = true;
  }
  if (!ok) no_kernel(op, args, "every view f32, or every view bf16");
  return t;
}

/// Calls f(T()) with T = float for f32, bf16 for bf16 (t already checked).
template <class F>
decltype(auto) with_type(DType t, F&& f) {
  if (t == DType::bf16) return f(bf16{});
  return f(0.0f);
}

/// The view's data as T (its dtype already checked).
template <class T>
const T* ptr(CView v) {
  return static_cast<const T*>(v.data);
}
template <class T>
T* ptr(View v) {
  return static_cast<T*>(v.data);
}

bool float_aligned(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % alignof(float) == 0; }

/// Where the flash kernels keep the fp32 logsumexp [B, H, S]: the head of the probs
/// buffer (backend.h). Throws Error when the buffer is too small or misaligned for
/// it (a bf16 probs buffer holds it from S >= 2).
const void* lse_in(const char* op, CView probs, std::int64_t B, std::int64_t S, std::int64_t H) {
  const Bytes need = Bytes(sizeof(float)) * B * H * S;
  const Bytes have = probs ? dtype_size(probs.dtype) * B * H * S * S : 0;
  if (need > 0 && (have < need || !float_aligned(probs.data)))
    throw Error(fmt::format("CUDA backend: {}: the probs buffer ({}, {} bytes for [B={}, H={}, S={}, S={}]) cannot "
                            "hold the fp32 logsumexp [B, H, S] of {} bytes that the flash kernels keep in it{}",
                            op, to_string(probs.dtype), have, B, H, S, S, need,
                            float_aligned(probs.data) ? "" : " (not 4-byte aligned)"));
  return probs.data;
}

class CudaBackend final : public Backend {
 public:
  CudaBackend(const CudaContextOptions& opt, Bytes* region_bytes)
      : device_(opt.device), info_(init_device(opt.device)), compute_(opt.device), copies_(opt.device),
        reserve_(kReserveArena, opt.device), blas_(reserve_, compute_.get(), kCublasWorkspace),
        pinned_capacity_(opt.pinned_pool) {
    Bytes budget = opt.budget;
    std::size_t free = 0, total = 0;
    MOEFLEX_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    if (budget < 0) {
      budget = (Bytes(free) - opt.headroom) / (Bytes(2) << 20) * (Bytes(2) << 20);
      if (budget <= 0)
        throw mc::CudaError(fmt::format("{}: only {} of device memory free, less than the {} headroom",
                                        mc::describe(info_), format_bytes(Bytes(free)), format_bytes(opt.headroom)));
    }
    const cudaError_t err = cudaMalloc(&region_, static_cast<std::size_t>(budget));
    if (err != cudaSuccess) {
      cudaGetLastError();
      throw mc::CudaError(fmt::format("cannot allocate the device arena of {} on {}: {} ({} free of {})",
                                      format_bytes(budget), mc::describe(info_), cudaGetErrorString(err),
                                      format_bytes(Bytes(free)), format_bytes(Bytes(total))));
    }
    *region_bytes = budget;
  }
  ~CudaBackend() override {
    cudaDeviceSynchronize();  // nothing may still use the region or the pinned blocks
    for (void* p : pageable_) std::free(p);
    if (region_) cudaFree(region_);
  }
  void* region() const { return region_; }
  Bytes reserved() const { return reserve_.budget() + scratch_.size() + ids_scratch_.size(); }

  // --- Device ---------------------------------------------------------------------------
  DeviceKind kind() const override { return DeviceKind::cuda; }
  std::string describe() const override { return mc::describe(info_); }
  void zero(void* dst, Bytes bytes) override {
    if (bytes > 0) MOEFLEX_CUDA_CHECK(cudaMemsetAsync(dst, 0, std::size_t(bytes), stream()));
  }
  void copy(void* dst, const void* src, Bytes bytes) override {
    if (bytes > 0) MOEFLEX_CUDA_CHECK(cudaMemcpyAsync(dst, src, std::size_t(bytes), cudaMemcpyDeviceToDevice, stream()));
  }
  void copy_from_host(void* dst, const void* src, Bytes bytes) override {
    // From pageable memory the runtime stages the source before returning, so the
    // caller may reuse it at once; the copy stays in stream order.
    if (bytes > 0) MOEFLEX_CUDA_CHECK(cudaMemcpyAsync(dst, src, std::size_t(bytes), cudaMemcpyHostToDevice, stream()));
  }
  void copy_to_host(void* dst, const void* src, Bytes bytes) override {
    if (bytes <= 0) return;
    MOEFLEX_CUDA_CHECK(cudaMemcpyAsync(dst, src, std::size_t(bytes), cudaMemcpyDeviceToHost, stream()));
    compute_.synchronize();
  }
  void synchronize() override {
    compute_.synchronize();
    copies_.d2h().synchronize();
    copies_.h2d().synchronize();
  }
  void synchronize_compute() override { compute_.synchronize(); }
  std::shared_ptr<DeviceEvent> copy_async(void* dst, const void* src, Bytes bytes, bool to_host) override {
    mc::Stream& on = to_host ? copies_.d2h() : copies_.h2d();
    mc::Event after;
    after.record(compute_);  // the source is written / the destination's readers are done
    on.wait(after);
    mc::copy_async(dst, src, bytes, on);
    mc::Event done;
    done.record(on);
    return std::make_shared<CudaEvent>(std::move(done));
  }
  void* host_alloc(Bytes bytes) override {
    if (!pinned_ && pinned_capacity_ > 0) {
      try {
        pinned_ = std::make_unique<mc::PinnedHostPool>(pinned_capacity_, device_);
      } catch (const mc::CudaError&) {
        pinned_capacity_ = 0;  // the host cannot pin that much: pageable buffers from now on
      }
    }
    if (pinned_) {
      try {
        return pinned_->allocate(bytes, MemCategory::activations, "offload");
      } catch (const OutOfMemoryError&) {
        // Full: pageable memory below (correct, but its copies do not overlap compute).
      }
    }
    void* p = std::aligned_alloc(Arena::kAlignment, std::size_t(Arena::round_up(std::max<Bytes>(bytes, 1))));
    if (!p) throw Error(fmt::format("host memory: cannot allocate {} for an offload", format_bytes(bytes)));
    pageable_.insert(p);
    return p;
  }
  void host_free(void* p, Bytes bytes) override {
    if (!p) return;
    if (pageable_.erase(p)) {
      std::free(p);
      return;
    }
    pinned_->deallocate(p, bytes, MemCategory::activations);
  }

  // --- compute --------------------------------------------------------------------------
  // Each op checks that its views share one dtype (uniform_dtype, as the CPU backend
  // does) and calls the kernel instantiated for it; anything else is an Error naming
  // the op and every view's dtype. Weight gradients (float*) are fp32 in both.
  void linear_forward(CView x, CView w, View y, std::int64_t n, std::int64_t in, std::int64_t out) override {
    const DType t = uniform_dtype("linear_forward", {{"x", x}, {"w", w}, {"y", y}});
    with_type(t, [&](auto tag) {
      using T = decltype(tag);
      cuda::linear_forward<T>(blas_, ptr<T>(x), ptr<T>(w), ptr<T>(y), n, in, out);
    });
  }
  void linear_backward(CView dy, CView x, CView w, View dx, float* dw, std::int64_t n, std::int64_t in,
                       std::int64_t out, bool accumulate_dx) override {
    const DType t = uniform_dtype("linear_backward", {{"dy", dy}, {"x", x}, {"w", w}, {"dx", dx}});
    with_type(t, [&](auto tag) {
      using T = decltype(tag);
      cuda::linear_backward<T>(blas_, ptr<T>(dy), ptr<T>(x), ptr<T>(w), ptr<T>(dx), dw, n, in, out, accumulate_dx);
    });
  }
  void gemm(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, float alpha, CView A,
            std::int64_t lda, CView B, std::int64_t ldb, float beta, View C, std::int64_t ldc) override {
    with_type(uniform_dtype("gemm", {{"A", A}, {"B", B}, {"C", C}}), [&](auto tag) {
      using T = decltype(tag);
      cuda::gemm<T, T>(blas_, ta, tb, M, N, K, alpha, ptr<T>(A), lda, ptr<T>(B), ldb, beta, ptr<T>(C), ldc);
    });
  }
  void rmsnorm_forward(CView x, CView w, View y, float* rstd, std::int64_t n, std::int64_t d, float eps) override {
    const DType t = uniform_dtype("rmsnorm_forward", {{"x", x}, {"w", w}, {"y", y}});
    with_type(t, [&](auto tag) {
      using T = decltype(tag);
      cuda::rmsnorm_forward<T>(ptr<T>(x), ptr<T>(w), ptr<T>(y), rstd, n, d, eps, stream());
    });
  }
  void rmsnorm_backward(CView dy, CView x, CView w, const float* rstd, View dx, float* dw, std::int64_t n,
                        std::int64_t d) override {
    const DType t = uniform_dtype("rmsnorm_backward", {{"dy", dy}, {"x", x}, {"w", w}, {"dx", dx}});
    auto* ws = static_cast<float*>(scratch_.get(rmsnorm_backward_workspace_bytes(n, d), compute_));
    with_type(t, [&](auto tag) {
      using T = decltype(tag);
      cuda::rmsnorm_backward<T>(ptr<T>(dy), ptr<T>(x), ptr<T>(w), rstd, ptr<T>(dx), dw, ws, n, d, stream());
    });
  }
  void rope_forward(View x, std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t hd, double theta) override {
    with_type(uniform_dtype("rope_forward", {{"x", x}}), [&](auto tag) {
      using T = decltype(tag);
      cuda::rope_forward<T>(ptr<T>(x), B, S, H, hd, theta, stream());
    });
  }
  void rope_backward(View dx, std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t hd,
                     double theta) override {
    with_type(uniform_dtype("rope_backward", {{"dx", dx}}), [&](auto tag) {
      using T = decltype(tag);
      cuda::rope_backward<T>(ptr<T>(dx), B, S, H, hd, theta, stream());
    });
  }
  void attention_forward(CView q, CView k, CView v, View out, View probs, std::int64_t B, std::int64_t S,
                         std::int64_t H, std::int64_t Hkv, std::int64_t hd) override {
    check_kv_heads("attention_forward", H, Hkv);
    const DType t = uniform_dtype("attention_forward", {{"q", q}, {"k", k}, {"v", v}, {"out", out}, {"probs", probs}});
    // Flash attention: only the logsumexp [B, H, S] is kept, in the head of `probs`.
    float* lse = static_cast<float*>(const_cast<void*>(lse_in("attention_forward", probs, B, S, H)));
    with_type(t, [&](auto tag) {
      using T = decltype(tag);
      cuda::attention_forward<T>(ptr<T>(q), ptr<T>(k), ptr<T>(v), ptr<T>(out), lse, B, S, H, Hkv, hd, stream());
    });
  }
  void attention_backward(CView dout, CView q, CView k, CView v, CView out, CView probs, View dq, View dk, View dv,
                          View dprobs_ws, std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t Hkv,
                          std::int64_t hd) override {
    check_kv_heads("attention_backward", H, Hkv);
    const DType t = uniform_dtype("attention_backward", {{"dout", dout}, {"q", q}, {"k", k}, {"v", v}, {"out", out},
                                                         {"probs", probs}, {"dq", dq}, {"dk", dk}, {"dv", dv},
                                                         {"dprobs_ws", dprobs_ws}});
    const auto* lse = static_cast<const float*>(lse_in("attention_backward", probs, B, S, H));
    // The workspace (fp32 rows) goes in dprobs_ws when it fits there.
    const Bytes need = attention_backward_workspace_bytes(B, S, H);
    const Bytes have = dprobs_ws ? dtype_size(dprobs_ws.dtype) * B * H * S * S : 0;
    float* ws = have >= need && float_aligned(dprobs_ws.data) ? static_cast<float*>(dprobs_ws.data)
                                                              : static_cast<float*>(scratch_.get(need, compute_));
    with_type(t, [&](auto tag) {
      using T = decltype(tag);
      cuda::attention_backward<T>(ptr<T>(dout), ptr<T>(q), ptr<T>(k), ptr<T>(v), ptr<T>(out), lse, ptr<T>(dq),
                                  ptr<T>(dk), ptr<T>(dv), ws, B, S, H, Hkv, hd, stream());
    });
  }
  void swiglu_forward(CView gate, CView up, View out, std::int64_t n) override {
    const DType t = uniform_dtype("swiglu_forward", {{"gate", gate}, {"up", up}, {"out", out}});
    with_type(t, [&](auto tag) {
      using T = decltype(tag);
      cuda::swiglu_forward<T>(ptr<T>(gate), ptr<T>(up), ptr<T>(out), n, stream());
    });
  }
  void swiglu_backward(CView dout, CView gate, CView up, View dgate, View dup, std::int64_t n) override {
    const DType t = uniform_dtype("swiglu_backward",
                                  {{"dout", dout}, {"gate", gate}, {"up", up}, {"dgate", dgate}, {"dup", dup}});
    with_type(t, [&](auto tag) {
      using T = decltype(tag);
      cuda::swiglu_backward<T>(ptr<T>(dout), ptr<T>(gate), ptr<T>(up), ptr<T>(dgate), ptr<T>(dup), n, stream());
    });
  }
  void add_inplace(View y, CView x, std::int64_t n) override {
    const DType t = uniform_dtype("add_inplace", {{"y", y}, {"x", x}});
    with_type(t, [&](auto tag) {
      using T = decltype(tag);
      cuda::residual_add<T>(ptr<T>(y), ptr<T>(x), ptr<T>(y), n, stream());
    });
  }
  void cast(CView src, View dst, std::int64_t n) override {
    if (src.dtype == dst.dtype) {
      copy(dst.data, src.data, dtype_size(src.dtype) * n);
    } else if (src.dtype == DType::f32 && dst.dtype == DType::bf16) {
      cuda::cast(ptr<float>(src), ptr<bf16>(dst), n, stream());
    } else if (src.dtype == DType::bf16 && dst.dtype == DType::f32) {
      cuda::cast(ptr<bf16>(src), ptr<float>(dst), n, stream());
    } else {
      no_kernel("cast", {{"src", src}, {"dst", dst}}, "f32 <-> bf16, or equal dtypes");
    }
  }
  void embedding_forward(const std::int32_t* ids, CView table, View out, std::int64_t n, std::int64_t d) override {
    const DType t = uniform_dtype("embedding_forward", {{"table", table}, {"out", out}});
    const std::int32_t* dev_ids = upload_ids(ids, n);
    with_type(t, [&](auto tag) {
      using T = decltype(tag);
      cuda::embedding_forward<T>(dev_ids, ptr<T>(table), ptr<T>(out), n, d, stream());
    });
  }
  void embedding_backward(const std::int32_t* ids, CView dout, float* dtable, std::int64_t n,
                          std::int64_t d) override {
    const DType t = uniform_dtype("embedding_backward", {{"dout", dout}});
    const std::int32_t* dev_ids = upload_ids(ids, n);
    with_type(t, [&](auto tag) {
      using T = decltype(tag);
      cuda::embedding_backward<T>(dev_ids, ptr<T>(dout), dtable, n, d, stream());
    });
  }
  double cross_entropy_forward(CView logits, const std::int32_t* targets, View probs, float* losses, std::int64_t n,
                               std::int64_t V) override {
    const DType t = uniform_dtype("cross_entropy_forward", {{"logits", logits}, {"probs", probs}});
    check_targets(targets, n, V);
    const std::int32_t* dev_targets = upload_ids(targets, n);
    with_type(t, [&](auto tag) {
      using T = decltype(tag);
      cuda::cross_entropy_forward<T>(ptr<T>(logits), dev_targets, ptr<T>(probs), losses, n, V, stream());
    });
    std::vector<float> host = to_host_vector(static_cast<const float*>(losses), n);
    double total = 0;
    for (float x : host) total += double(x);  // token order, as the CPU op
    return n > 0 ? total / double(n) : 0.0;
  }
  void cross_entropy_backward(CView probs, const std::int32_t* targets, View dlogits, std::int64_t n, std::int64_t V,
                              float scale) override {
    const DType t = uniform_dtype("cross_entropy_backward", {{"probs", probs}, {"dlogits", dlogits}});
    check_targets(targets, n, V);
    const std::int32_t* dev_targets = upload_ids(targets, n);
    with_type(t, [&](auto tag) {
      using T = decltype(tag);
      cuda::cross_entropy_backward<T>(ptr<T>(probs), dev_targets, ptr<T>(dlogits), n, V, scale, stream());
    });
  }
  void router_forward(CView logits, float* probs, std::int32_t* idx, float* w, std::int64_t n, std::int64_t E,
                      std::int64_t k, const ops::RouterOptions& opt) override {
    with_type(uniform_dtype("router_forward", {{"logits", logits}}), [&](auto tag) {
      using T = decltype(tag);
      cuda::router_forward<T>(ptr<T>(logits), probs, idx, w, n, E, k, opt, stream());
    });
  }
  void router_backward(const float* dw, const float* dprobs, const float* probs, const std::int32_t* idx,
                       View dlogits, std::int64_t n, std::int64_t E, std::int64_t k,
                       const ops::RouterOptions& opt) override {
    with_type(uniform_dtype("router_backward", {{"dlogits", dlogits}}), [&](auto tag) {
      using T = decltype(tag);
      cuda::router_backward<T>(dw, dprobs, probs, idx, ptr<T>(dlogits), n, E, k, opt, stream());
    });
  }
  // The router losses and the spike injection work on [n, E] and [n, k] arrays that
  // are small next to the layer's activations: they run on the host, on fp32 copies
  // (bf16 views widened on the way in and rounded once on the way out, as the CPU
  // backend does).
  double aux_loss_forward(const float* probs, const std::int32_t* idx, std::int64_t n, std::int64_t E,
                          std::int64_t k, double coef, ops::RouterScore score) override {
    std::vector<float> p = to_host_vector(probs, n * E);
    std::vector<std::int32_t> ix = to_host_vector(idx, n * k);
    return ops::aux_loss_forward(p.data(), ix.data(), n, E, k, coef, score);
  }
  void aux_loss_backward(const std::int32_t* idx, const float* probs, float* dprobs, std::int64_t n, std::int64_t E,
                         std::int64_t k, double coef, ops::RouterScore score) override {
    std::vector<std::int32_t> ix = to_host_vector(idx, n * k);
    std::vector<float> dp = to_host_vector(static_cast<const float*>(dprobs), n * E);
    std::vector<float> p;
    if (score == ops::RouterScore::sigmoid) p = to_host_vector(probs, n * E);
    ops::aux_loss_backward(ix.data(), p.empty() ? nullptr : p.data(), dp.data(), n, E, k, coef, score);
    copy_from_host(dprobs, dp.data(), Bytes(sizeof(float)) * n * E);
  }
  double z_loss_forward(CView logits, std::int64_t n, std::int64_t E, double coef) override {
    uniform_dtype("z_loss_forward", {{"logits", logits}});
    std::vector<float> lg = to_host_floats(logits, n * E);
    return ops::z_loss_forward(lg.data(), n, E, coef);
  }
  void z_loss_backward(CView logits, View dlogits, std::int64_t n, std::int64_t E, double coef) override {
    uniform_dtype("z_loss_backward", {{"logits", logits}, {"dlogits", dlogits}});
    std::vector<float> lg = to_host_floats(logits, n * E);
    std::vector<float> dl = to_host_floats(dlogits, n * E);
    ops::z_loss_backward(lg.data(), dl.data(), n, E, coef);
    from_host_floats(dl, dlogits);
  }
  void skew_router_logits(View logits, std::int64_t n, std::int64_t E, std::int64_t k,
                          const ops::RouterSkew& skew) override {
    uniform_dtype("skew_router_logits", {{"logits", logits}});
    std::vector<float> lg = to_host_floats(logits, n * E);
    ops::skew_router_logits(lg.data(), n, E, k, skew);
    from_host_floats(lg, logits);
  }
  std::int64_t moe_plan_dispatch(const std::int32_t* idx, std::int64_t n, std::int64_t E, std::int64_t k,
                                 std::int64_t cap, std::int32_t* counts, std::int32_t* offsets, std::int32_t* slot_of,
                                 std::int32_t* host_offsets) override {
    void* ws = scratch_.get(moe_plan_workspace_bytes(), compute_);
    return cuda::moe_plan_dispatch(idx, n, E, k, cap, counts, offsets, slot_of, host_offsets, ws, stream());
  }
  void permute_forward(CView x, const std::int32_t* slot_of, View xp, std::int64_t n, std::int64_t k,
                       std::int64_t d) override {
    with_type(uniform_dtype("permute_forward", {{"x", x}, {"xp", xp}}), [&](auto tag) {
      using T = decltype(tag);
      cuda::permute_forward<T>(ptr<T>(x), slot_of, ptr<T>(xp), n, k, d, stream());
    });
  }
  void permute_backward(CView dxp, const std::int32_t* slot_of, View dx, std::int64_t n, std::int64_t k,
                        std::int64_t d) override {
    with_type(uniform_dtype("permute_backward", {{"dxp", dxp}, {"dx", dx}}), [&](auto tag) {
      using T = decltype(tag);
      cuda::permute_backward<T>(ptr<T>(dxp), slot_of, ptr<T>(dx), n, k, d, stream());
    });
  }
  void unpermute_forward(CView yp, const std::int32_t* slot_of, const float* w, View y, std::int64_t n,
                         std::int64_t k, std::int64_t d) override {
    with_type(uniform_dtype("unpermute_forward", {{"yp", yp}, {"y", y}}), [&](auto tag) {
      using T = decltype(tag);
      cuda::unpermute_forward<T>(ptr<T>(yp), slot_of, w, ptr<T>(y), n, k, d, stream());
    });
  }
  void unpermute_backward(CView dy, CView yp, const std::int32_t* slot_of, const float* w, View dyp, float* dw,
                          std::int64_t n, std::int64_t k, std::int64_t d) override {
    with_type(uniform_dtype("unpermute_backward", {{"dy", dy}, {"yp", yp}, {"dyp", dyp}}), [&](auto tag) {
      using T = decltype(tag);
      cuda::unpermute_backward<T>(ptr<T>(dy), ptr<T>(yp), slot_of, w, ptr<T>(dyp), dw, n, k, d, stream());
    });
  }
  void combine_topk_grad(CView dy, CView yp_rows, const std::int32_t* slot_of, float* dtopk_w, std::int64_t n,
                         std::int64_t k, std::int64_t d, std::int64_t r0, std::int64_t rows) override {
    with_type(uniform_dtype("combine_topk_grad", {{"dy", dy}, {"yp_rows", yp_rows}}), [&](auto tag) {
      using T = decltype(tag);
      cuda::combine_topk_grad<T>(ptr<T>(dy), ptr<T>(yp_rows), slot_of, dtopk_w, n, k, d, r0, rows, stream());
    });
  }
  void grouped_linear_forward(CView x, CView w, View y, const std::int32_t* offsets, std::int64_t E, std::int64_t in,
                              std::int64_t out) override {
    with_type(uniform_dtype("grouped_linear_forward", {{"x", x}, {"w", w}, {"y", y}}), [&](auto tag) {
      using T = decltype(tag);
      cuda::grouped_linear_forward<T>(blas_, ptr<T>(x), ptr<T>(w), ptr<T>(y), offsets, E, in, out);
    });
  }
  void grouped_linear_backward(CView dy, CView x, CView w, View dx, float* dw, const std::int32_t* offsets,
                               std::int64_t E, std::int64_t in, std::int64_t out) override {
    const DType t = uniform_dtype("grouped_linear_backward", {{"dy", dy}, {"x", x}, {"w", w}, {"dx", dx}});
    with_type(t, [&](auto tag) {
      using T = decltype(tag);
      cuda::grouped_linear_backward<T>(blas_, ptr<T>(dy), ptr<T>(x), ptr<T>(w), ptr<T>(dx), dw, offsets, E, in, out);
    });
  }
  double square_sum(const float* g, std::int64_t n) override {
    if (n <= 0) return 0.0;
    const std::int64_t chunks = (n + kSquareSumChunk - 1) / kSquareSumChunk;
    auto* partial = static_cast<double*>(scratch_.get(Bytes(sizeof(double)) * chunks, compute_));
    cuda::square_sum_partials(g, n, partial, stream());
    std::vector<double> host(static_cast<std::size_t>(chunks));
    copy_to_host(host.data(), partial, Bytes(sizeof(double)) * chunks);
    double total = 0;
    for (double s : host) total += s;  // chunk order, as the CPU code
    return total;
  }
  void scale(float* g, std::int64_t n, float s) override { cuda::scale(g, n, s, stream()); }
  void adamw(float* w, const float* g, float* m, float* v, std::int64_t n, float b1, float b2, float eps,
             float decay, float step_size, float inv_sqrt_bc2) override {
    cuda::adamw(w, g, m, v, n, b1, b2, eps, decay, step_size, inv_sqrt_bc2, stream());
  }

 private:
  static mc::DeviceInfo init_device(int device) {
    if (mc::device_count() == 0) throw mc::CudaError("--device cuda: no GPU: " + mc::no_device_reason());
    mc::set_device(device);
    return mc::device_info(device);
  }
  cudaStream_t stream() const { return compute_.get(); }
  /// Copies host ids/targets [n] into the ids scratch (stream order; waits for
  /// nothing: the runtime stages pageable sources before returning).
  const std::int32_t* upload_ids(const std::int32_t* host, std::int64_t n) {
    auto* dst = static_cast<std::int32_t*>(ids_scratch_.get(Bytes(sizeof(std::int32_t)) * n, compute_));
    copy_from_host(dst, host, Bytes(sizeof(std::int32_t)) * n);
    return dst;
  }
  template <typename T>
  std::vector<T> to_host_vector(const T* src, std::int64_t n) {
    std::vector<T> out(static_cast<std::size_t>(n));
    copy_to_host(out.data(), src, Bytes(sizeof(T)) * n);
    return out;
  }
  /// The n elements of `v` (f32 or bf16, checked) on the host as floats (bf16
  /// widened exactly).
  std::vector<float> to_host_floats(CView v, std::int64_t n) {
    if (v.dtype == DType::f32) return to_host_vector(static_cast<const float*>(v.data), n);
    const std::vector<bf16> b = to_host_vector(static_cast<const bf16*>(v.data), n);
    std::vector<float> out(b.size());
    for (std::size_t i = 0; i < b.size(); ++i) out[i] = to_float(b[i]);
    return out;
  }
  /// Writes `host` into `v` (rounded once to nearest even when bf16).
  void from_host_floats(const std::vector<float>& host, View v) {
    const auto n = static_cast<std::int64_t>(host.size());
    if (v.dtype == DType::f32) {
      copy_from_host(v.data, host.data(), Bytes(sizeof(float)) * n);
      return;
    }
    std::vector<bf16> b(host.size());
    for (std::size_t i = 0; i < host.size(); ++i) b[i] = to_bf16(host[i]);
    copy_from_host(v.data, b.data(), Bytes(sizeof(bf16)) * n);
  }
  static void check_targets(const std::int32_t* targets, std::int64_t n, std::int64_t V) {
    for (std::int64_t i = 0; i < n; ++i)
      if (targets[i] < 0 || targets[i] >= V)
        throw DataError(fmt::format("cross_entropy: target {} at position {} is outside [0, {})", targets[i], i, V));
  }

  int device_;
  mc::DeviceInfo info_;
  mc::Stream compute_;
  mc::TransferStreams copies_;
  mc::DeviceArena reserve_;  // cuBLAS workspace and pointer arrays
  Cublas blas_;
  Scratch scratch_;      // op workspaces (one op at a time, stream-ordered)
  Scratch ids_scratch_;  // token ids / targets of the op under way
  Bytes pinned_capacity_;
  std::unique_ptr<mc::PinnedHostPool> pinned_;
  std::set<void*> pageable_;  // offload buffers outside the pinned pool
  void* region_ = nullptr;
};

}  // namespace

DeviceContext make_cuda_context(const CudaContextOptions& options) {
  DeviceContext ctx;
  Bytes region_bytes = 0;
  auto backend = std::make_unique<CudaBackend>(options, &region_bytes);
  void* region = backend->region();
  ctx.arena = std::make_unique<Arena>(region_bytes, region, backend.get());
  ctx.backend = std::move(backend);
  return ctx;
}

Bytes reserved_bytes(const Backend& backend) {
  const auto* cuda = dynamic_cast<const CudaBackend*>(&backend);
  return cuda ? cuda->reserved() : 0;
}

}  // namespace moeflex::ops::cuda
