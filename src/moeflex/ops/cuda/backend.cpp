// The CUDA backend (see backend.h for memory and ordering).
#include "moeflex/ops/cuda/backend.h"

#include <fmt/format.h>

#include <cstdlib>
#include <cstring>
#include <set>
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
  void linear_forward(const float* x, const float* w, float* y, std::int64_t n, std::int64_t in,
                      std::int64_t out) override {
    cuda::linear_forward<float>(blas_, x, w, y, n, in, out);
  }
  void linear_backward(const float* dy, const float* x, const float* w, float* dx, float* dw, std::int64_t n,
                       std::int64_t in, std::int64_t out, bool accumulate_dx) override {
    cuda::linear_backward<float>(blas_, dy, x, w, dx, dw, n, in, out, accumulate_dx);
  }
  void gemm(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, float alpha, const float* A,
            std::int64_t lda, const float* B, std::int64_t ldb, float beta, float* C, std::int64_t ldc) override {
    cuda::gemm<float, float>(blas_, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  }
  void rmsnorm_forward(const float* x, const float* w, float* y, float* rstd, std::int64_t n, std::int64_t d,
                       float eps) override {
    cuda::rmsnorm_forward<float>(x, w, y, rstd, n, d, eps, stream());
  }
  void rmsnorm_backward(const float* dy, const float* x, const float* w, const float* rstd, float* dx, float* dw,
                        std::int64_t n, std::int64_t d) override {
    auto* ws = static_cast<float*>(scratch_.get(rmsnorm_backward_workspace_bytes(n, d), compute_));
    cuda::rmsnorm_backward<float>(dy, x, w, rstd, dx, dw, ws, n, d, stream());
  }
  void rope_forward(float* x, std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t hd,
                    double theta) override {
    cuda::rope_forward<float>(x, B, S, H, hd, theta, stream());
  }
  void rope_backward(float* dx, std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t hd,
                     double theta) override {
    cuda::rope_backward<float>(dx, B, S, H, hd, theta, stream());
  }
  void attention_forward(const float* q, const float* k, const float* v, float* out, float* probs, std::int64_t B,
                         std::int64_t S, std::int64_t H, std::int64_t hd) override {
    // Flash attention: only the logsumexp [B, H, S] is kept, in the head of `probs`.
    cuda::attention_forward<float>(q, k, v, out, probs, B, S, H, hd, stream());
  }
  void attention_backward(const float* dout, const float* q, const float* k, const float* v, const float* out,
                          const float* probs, float* dq, float* dk, float* dv, float* dprobs_ws, std::int64_t B,
                          std::int64_t S, std::int64_t H, std::int64_t hd) override {
    const Bytes need = attention_backward_workspace_bytes(B, S, H);
    float* ws = need <= Bytes(sizeof(float)) * B * H * S * S ? dprobs_ws
                                                              : static_cast<float*>(scratch_.get(need, compute_));
    cuda::attention_backward<float>(dout, q, k, v, out, probs, dq, dk, dv, ws, B, S, H, hd, stream());
  }
  void swiglu_forward(const float* gate, const float* up, float* out, std::int64_t n) override {
    cuda::swiglu_forward<float>(gate, up, out, n, stream());
  }
  void swiglu_backward(const float* dout, const float* gate, const float* up, float* dgate, float* dup,
                       std::int64_t n) override {
    cuda::swiglu_backward<float>(dout, gate, up, dgate, dup, n, stream());
  }
  void add_inplace(float* y, const float* x, std::int64_t n) override {
    cuda::residual_add<float>(y, x, y, n, stream());
  }
  void embedding_forward(const std::int32_t* ids, const float* table, float* out, std::int64_t n,
                         std::int64_t d) override {
    cuda::embedding_forward(upload_ids(ids, n), table, out, n, d, stream());
  }
  void embedding_backward(const std::int32_t* ids, const float* dout, float* dtable, std::int64_t n,
                          std::int64_t d) override {
    cuda::embedding_backward(upload_ids(ids, n), dout, dtable, n, d, stream());
  }
  double cross_entropy_forward(const float* logits, const std::int32_t* targets, float* probs, float* losses,
                               std::int64_t n, std::int64_t V) override {
    check_targets(targets, n, V);
    cuda::cross_entropy_forward(logits, upload_ids(targets, n), probs, losses, n, V, stream());
    std::vector<float> host(static_cast<std::size_t>(n));
    copy_to_host(host.data(), losses, Bytes(sizeof(float)) * n);
    double total = 0;
    for (float x : host) total += double(x);  // token order, as the CPU op
    return n > 0 ? total / double(n) : 0.0;
  }
  void cross_entropy_backward(const float* probs, const std::int32_t* targets, float* dlogits, std::int64_t n,
                              std::int64_t V, float scale) override {
    check_targets(targets, n, V);
    cuda::cross_entropy_backward(probs, upload_ids(targets, n), dlogits, n, V, scale, stream());
  }
  void router_forward(const float* logits, float* probs, std::int32_t* idx, float* w, std::int64_t n,
                      std::int64_t E, std::int64_t k, bool norm) override {
    cuda::router_forward(logits, probs, idx, w, n, E, k, norm, stream());
  }
  void router_backward(const float* dw, const float* dprobs, const float* probs, const std::int32_t* idx,
                       float* dlogits, std::int64_t n, std::int64_t E, std::int64_t k, bool norm) override {
    cuda::router_backward(dw, dprobs, probs, idx, dlogits, n, E, k, norm, stream());
  }
  // The router losses and the spike injection work on [n, E] and [n, k] arrays that
  // are small next to the layer's activations: they run on the host, on copies.
  double aux_loss_forward(const float* probs, const std::int32_t* idx, std::int64_t n, std::int64_t E,
                          std::int64_t k, double coef) override {
    std::vector<float> p = to_host_vector(probs, n * E);
    std::vector<std::int32_t> ix = to_host_vector(idx, n * k);
    return ops::aux_loss_forward(p.data(), ix.data(), n, E, k, coef);
  }
  void aux_loss_backward(const std::int32_t* idx, float* dprobs, std::int64_t n, std::int64_t E, std::int64_t k,
                         double coef) override {
    std::vector<std::int32_t> ix = to_host_vector(idx, n * k);
    std::vector<float> dp = to_host_vector(static_cast<const float*>(dprobs), n * E);
    ops::aux_loss_backward(ix.data(), dp.data(), n, E, k, coef);
    copy_from_host(dprobs, dp.data(), Bytes(sizeof(float)) * n * E);
  }
  double z_loss_forward(const float* logits, std::int64_t n, std::int64_t E, double coef) override {
    std::vector<float> lg = to_host_vector(logits, n * E);
    return ops::z_loss_forward(lg.data(), n, E, coef);
  }
  void z_loss_backward(const float* logits, float* dlogits, std::int64_t n, std::int64_t E, double coef) override {
    std::vector<float> lg = to_host_vector(logits, n * E);
    std::vector<float> dl = to_host_vector(static_cast<const float*>(dlogits), n * E);
    ops::z_loss_backward(lg.data(), dl.data(), n, E, coef);
    copy_from_host(dlogits, dl.data(), Bytes(sizeof(float)) * n * E);
  }
  void skew_router_logits(float* logits, std::int64_t n, std::int64_t E, std::int64_t k, int groups,
                          double ratio) override {
    std::vector<float> lg = to_host_vector(static_cast<const float*>(logits), n * E);
    ops::skew_router_logits(lg.data(), n, E, k, groups, ratio);
    copy_from_host(logits, lg.data(), Bytes(sizeof(float)) * n * E);
  }
  std::int64_t moe_plan_dispatch(const std::int32_t* idx, std::int64_t n, std::int64_t E, std::int64_t k,
                                 std::int64_t cap, std::int32_t* counts, std::int32_t* offsets, std::int32_t* slot_of,
                                 std::int32_t* host_offsets) override {
    void* ws = scratch_.get(moe_plan_workspace_bytes(), compute_);
    return cuda::moe_plan_dispatch(idx, n, E, k, cap, counts, offsets, slot_of, host_offsets, ws, stream());
  }
  void permute_forward(const float* x, const std::int32_t* slot_of, float* xp, std::int64_t n, std::int64_t k,
                       std::int64_t d) override {
    cuda::permute_forward<float>(x, slot_of, xp, n, k, d, stream());
  }
  void permute_backward(const float* dxp, const std::int32_t* slot_of, float* dx, std::int64_t n, std::int64_t k,
                        std::int64_t d) override {
    cuda::permute_backward<float>(dxp, slot_of, dx, n, k, d, stream());
  }
  void unpermute_forward(const float* yp, const std::int32_t* slot_of, const float* w, float* y, std::int64_t n,
                         std::int64_t k, std::int64_t d) override {
    cuda::unpermute_forward<float>(yp, slot_of, w, y, n, k, d, stream());
  }
  void unpermute_backward(const float* dy, const float* yp, const std::int32_t* slot_of, const float* w,
                          float* dyp, float* dw, std::int64_t n, std::int64_t k, std::int64_t d) override {
    cuda::unpermute_backward<float>(dy, yp, slot_of, w, dyp, dw, n, k, d, stream());
  }
  void grouped_linear_forward(const float* x, const float* w, float* y, const std::int32_t* offsets, std::int64_t E,
                              std::int64_t in, std::int64_t out) override {
    cuda::grouped_linear_forward<float>(blas_, x, w, y, offsets, E, in, out);
  }
  void grouped_linear_backward(const float* dy, const float* x, const float* w, float* dx, float* dw,
                               const std::int32_t* offsets, std::int64_t E, std::int64_t in,
                               std::int64_t out) override {
    cuda::grouped_linear_backward<float>(blas_, dy, x, w, dx, dw, offsets, E, in, out);
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
