// The engine's device discipline, checked on the CPU: an emulated device whose
// arena region the host cannot touch (mprotect PROT_NONE) except inside its own
// Backend calls, which run the CPU ops. Any place where the model, stash, planner,
// optimizer or gradient clipping reads or writes tensor memory directly instead of
// through the backend (as a GPU requires) crashes this test; every offload goes
// through Device::copy_async and events, initial weights through copy_from_host.
// Because the ops are the CPU ones, results must equal the plain CPU run bit for
// bit, for saving everything, recompute policies, offloading everything and the
// adaptive planner (whose predicted peak must equal the device arena's).
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <cstring>
#include <vector>

#include "engine_fixtures.h"
#include "model_fixtures.h"
#include "moeflex/model/memory_plan.h"
#include "moeflex/model/model.h"
#include "moeflex/ops/backend.h"
#include "moeflex/provision/planner.h"
#include "moeflex/provision/policies.h"
#include "moeflex/train/optimizer.h"

namespace moeflex {
namespace {

/// A device on the host whose memory is out of the host's reach between calls.
class EmulatedDevice final : public ops::Backend {
 public:
  explicit EmulatedDevice(Bytes bytes) : bytes_(bytes) {
    void* p = mmap(nullptr, std::size_t(bytes), PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw Error("emulated device: mmap failed");
    region_ = static_cast<char*>(p);
  }
  ~EmulatedDevice() override { munmap(region_, std::size_t(bytes_)); }
  void* region() const { return region_; }
  std::int64_t async_copies = 0;

  DeviceKind kind() const override { return DeviceKind::cpu; }
  bool host_memory() const override { return false; }
  std::string describe() const override { return "emulated device (protected host memory)"; }

  /// Opens the region for the duration of one backend call.
  class Open {
   public:
    explicit Open(const EmulatedDevice& d) : d_(d) {
      if (d_.depth_++ == 0) mprotect(d_.region_, std::size_t(d_.bytes_), PROT_READ | PROT_WRITE);
    }
    ~Open() {
      if (--d_.depth_ == 0) mprotect(d_.region_, std::size_t(d_.bytes_), PROT_NONE);
    }

   private:
    const EmulatedDevice& d_;
  };
  ops::Backend& cpu() const { return ops::cpu_backend(); }

  void zero(void* dst, Bytes b) override { Open o(*this); cpu().zero(dst, b); }
  void copy(void* dst, const void* src, Bytes b) override { Open o(*this); cpu().copy(dst, src, b); }
  void copy_from_host(void* dst, const void* src, Bytes b) override { Open o(*this); cpu().copy(dst, src, b); }
  void copy_to_host(void* dst, const void* src, Bytes b) override { Open o(*this); cpu().copy(dst, src, b); }
  void synchronize() override {}
  struct Done : DeviceEvent {
    bool query() override { return true; }
    void synchronize() override {}
  };
  std::shared_ptr<DeviceEvent> copy_async(void* dst, const void* src, Bytes b, bool) override {
    Open o(*this);
    std::memcpy(dst, src, std::size_t(b));
    ++async_copies;
    return std::make_shared<Done>();
  }
  void* host_alloc(Bytes b) override { return cpu().host_alloc(b); }
  void host_free(void* p, Bytes b) override { cpu().host_free(p, b); }

#define FWD(ret, name, params, args) \
  ret name params override {         \
    Open open_(*this);               \
    return cpu().name args;          \
  }
  FWD(void, linear_forward, (CView x, CView w, View y, std::int64_t n, std::int64_t in, std::int64_t out), (x, w, y, n, in, out))
  FWD(void, linear_backward, (CView dy, CView x, CView w, View dx, float* dw, std::int64_t n, std::int64_t in, std::int64_t out, bool acc), (dy, x, w, dx, dw, n, in, out, acc))
  FWD(void, gemm, (bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, float al, CView A, std::int64_t lda, CView B, std::int64_t ldb, float be, View C, std::int64_t ldc), (ta, tb, M, N, K, al, A, lda, B, ldb, be, C, ldc))
  FWD(void, rmsnorm_forward, (CView x, CView w, View y, float* r, std::int64_t n, std::int64_t d, float eps), (x, w, y, r, n, d, eps))
  FWD(void, rmsnorm_backward, (CView dy, CView x, CView w, const float* r, View dx, float* dw, std::int64_t n, std::int64_t d), (dy, x, w, r, dx, dw, n, d))
  FWD(void, rope_forward, (View x, std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t hd, double th), (x, B, S, H, hd, th))
  FWD(void, rope_backward, (View x, std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t hd, double th), (x, B, S, H, hd, th))
  FWD(void, attention_forward, (CView q, CView k, CView v, View o, View p, std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t Hkv, std::int64_t hd), (q, k, v, o, p, B, S, H, Hkv, hd))
  FWD(void, attention_backward, (CView dout, CView q, CView k, CView v, CView o, CView p, View dq, View dk, View dv, View ws, std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t Hkv, std::int64_t hd), (dout, q, k, v, o, p, dq, dk, dv, ws, B, S, H, Hkv, hd))
  FWD(void, swiglu_forward, (CView g, CView u, View o, std::int64_t n), (g, u, o, n))
  FWD(void, swiglu_backward, (CView d, CView g, CView u, View dg, View du, std::int64_t n), (d, g, u, dg, du, n))
  FWD(void, add_inplace, (View y, CView x, std::int64_t n), (y, x, n))
  FWD(void, cast, (CView s, View d, std::int64_t n), (s, d, n))
  FWD(void, embedding_forward, (const std::int32_t* ids, CView t, View o, std::int64_t n, std::int64_t d), (ids, t, o, n, d))
  FWD(void, embedding_backward, (const std::int32_t* ids, CView d, float* dt, std::int64_t n, std::int64_t dd), (ids, d, dt, n, dd))
  FWD(double, cross_entropy_forward, (CView l, const std::int32_t* t, View p, float* ls, std::int64_t n, std::int64_t V), (l, t, p, ls, n, V))
  FWD(void, cross_entropy_backward, (CView p, const std::int32_t* t, View dl, std::int64_t n, std::int64_t V, float s), (p, t, dl, n, V, s))
  FWD(void, router_forward, (CView l, float* p, std::int32_t* ix, float* w, std::int64_t n, std::int64_t E, std::int64_t k, const ops::RouterOptions& o), (l, p, ix, w, n, E, k, o))
  FWD(void, router_backward, (const float* dw, const float* dp, const float* p, const std::int32_t* ix, View dl, std::int64_t n, std::int64_t E, std::int64_t k, const ops::RouterOptions& o), (dw, dp, p, ix, dl, n, E, k, o))
  FWD(double, aux_loss_forward, (const float* p, const std::int32_t* ix, std::int64_t n, std::int64_t E, std::int64_t k, double c, ops::RouterScore s), (p, ix, n, E, k, c, s))
  FWD(void, aux_loss_backward, (const std::int32_t* ix, const float* p, float* dp, std::int64_t n, std::int64_t E, std::int64_t k, double c, ops::RouterScore s), (ix, p, dp, n, E, k, c, s))
  FWD(double, z_loss_forward, (CView l, std::int64_t n, std::int64_t E, double c), (l, n, E, c))
  FWD(void, z_loss_backward, (CView l, View dl, std::int64_t n, std::int64_t E, double c), (l, dl, n, E, c))
  FWD(void, skew_router_logits, (View l, std::int64_t n, std::int64_t E, std::int64_t k, const ops::RouterSkew& s), (l, n, E, k, s))
  FWD(std::int64_t, moe_plan_dispatch, (const std::int32_t* ix, std::int64_t n, std::int64_t E, std::int64_t k, std::int64_t cap, std::int32_t* c, std::int32_t* off, std::int32_t* slot, std::int32_t* hoff), (ix, n, E, k, cap, c, off, slot, hoff))
  FWD(void, permute_forward, (CView x, const std::int32_t* s, View xp, std::int64_t n, std::int64_t k, std::int64_t d), (x, s, xp, n, k, d))
  FWD(void, permute_backward, (CView dxp, const std::int32_t* s, View dx, std::int64_t n, std::int64_t k, std::int64_t d), (dxp, s, dx, n, k, d))
  FWD(void, unpermute_forward, (CView yp, const std::int32_t* s, const float* w, View y, std::int64_t n, std::int64_t k, std::int64_t d), (yp, s, w, y, n, k, d))
  FWD(void, unpermute_backward, (CView dy, CView yp, const std::int32_t* s, const float* w, View dyp, float* dw, std::int64_t n, std::int64_t k, std::int64_t d), (dy, yp, s, w, dyp, dw, n, k, d))
  FWD(void, combine_topk_grad, (CView dy, CView yp, const std::int32_t* s, float* dw, std::int64_t n, std::int64_t k, std::int64_t d, std::int64_t r0, std::int64_t rows), (dy, yp, s, dw, n, k, d, r0, rows))
  FWD(void, grouped_linear_forward, (CView x, CView w, View y, const std::int32_t* off, std::int64_t E, std::int64_t in, std::int64_t out), (x, w, y, off, E, in, out))
  FWD(void, grouped_linear_backward, (CView dy, CView x, CView w, View dx, float* dw, const std::int32_t* off, std::int64_t E, std::int64_t in, std::int64_t out), (dy, x, w, dx, dw, off, E, in, out))
  FWD(double, square_sum, (const float* g, std::int64_t n), (g, n))
  FWD(void, scale, (float* g, std::int64_t n, float s), (g, n, s))
  FWD(void, adamw, (float* w, const float* g, float* m, float* v, std::int64_t n, float b1, float b2, float eps, float dec, float ss, float ib), (w, g, m, v, n, b1, b2, eps, dec, ss, ib))
#undef FWD

 private:
  Bytes bytes_;
  char* region_ = nullptr;
  mutable int depth_ = 0;
};

constexpr std::int64_t kB = 2, kS = 8;

struct Result {
  std::vector<double> losses;
  std::vector<std::vector<float>> grads, weights;
  Bytes peak = 0, predicted = 0;
  double grad_norm = 0;
};

/// Two steps of M = 2 micro-batches with `policy` (a static name, "offload" or
/// "adaptive") on `arena`'s backend, then the parameters read back to the host.
Result run(Arena& arena, const std::string& policy) {
  const ModelConfig cfg = test::small_moe_config(3, 1, 4, true);
  Result out;
  MoEModel model(cfg, arena);
  model.init_weights(3);
  model.set_router_skew(2.0);
  AdaptivePlanner planner(arena, kPlannerMarginFraction);  // the same margin on the host and the device arena
  test::apply_policy(model, planner, policy);
  AdamW opt(model.params(), arena, AdamWConfig{});
  const std::int64_t n = kB * kS;
  std::vector<std::int32_t> ids(static_cast<std::size_t>(n)), tg(static_cast<std::size_t>(n));
  for (int step = 0; step < 2; ++step) {
    arena.reset_peaks();
    model.zero_grads();
    double loss = 0;
    for (int mb = 0; mb < 2; ++mb) {
      test::skewed_batch(step * 10 + mb, n, cfg.vocab_size, ids.data(), tg.data());
      loss += model.forward_backward(ids.data(), tg.data(), kB, kS, mb, 0.5).total;
    }
    out.losses.push_back(loss);
    if (policy == "adaptive") {
      out.predicted = planner.predicted_step_peak();
      planner.end_step();
    }
    out.peak = std::max(out.peak, arena.peak());
    out.grad_norm = grad_square_sum(model.params(), false) + grad_square_sum(model.params(), true);
    scale_grads(model.params(), 0.5f);
    opt.step(1e-2);
  }
  ops::Backend& be = ops::backend_of(arena);
  for (auto& p : model.params()) {
    out.grads.emplace_back(std::size_t(p.g.numel()));
    be.copy_to_host(out.grads.back().data(), p.g.f32(), p.g.nbytes());
    out.weights.emplace_back(std::size_t(p.w.numel()));
    be.copy_to_host(out.weights.back().data(), p.w.f32(), p.w.nbytes());
  }
  return out;
}

void expect_same(const Result& dev, const Result& host, const std::string& what) {
  EXPECT_EQ(dev.losses, host.losses) << what;
  EXPECT_EQ(dev.grad_norm, host.grad_norm) << what;
  EXPECT_EQ(dev.grads, host.grads) << what;
  EXPECT_EQ(dev.weights, host.weights) << what;
  // A CPU offload frees its block when the worker thread's copy is seen done, so
  // the host's peak depends on timing there; the emulated device's copies are done
  // at once.
  if (what == "offload") EXPECT_LE(dev.peak, host.peak) << what;
  else EXPECT_EQ(dev.peak, host.peak) << what;
}

constexpr Bytes kRegion = Bytes(64) << 20;

TEST(DeviceEngine, EveryPolicyTouchesTensorsOnlyThroughTheBackend) {
  for (const std::string policy : {"none", "full", "selective", "moe-full", "offload"}) {
    Arena host;
    const Result h = run(host, policy);
    EmulatedDevice dev(kRegion);
    Arena arena(kRegion, dev.region(), &dev);
    const Result d = run(arena, policy);
    expect_same(d, h, policy);
    if (policy == "offload") {
      EXPECT_GT(dev.async_copies, 0) << "offloads and prefetches go through copy_async";
    }
  }
}

TEST(DeviceEngine, AdaptivePlannerPredictsTheDeviceArenaPeak) {
  Arena probe;
  const Result free_run = run(probe, "none");
  // A budget a third of the way from the planner's floor to saving everything.
  const ModelConfig cfg = test::small_moe_config(3, 1, 4, true);
  Arena state_probe;
  MoEModel m(cfg, state_probe);
  AdamW opt(m.params(), state_probe, AdamWConfig{});
  StepProgram program;
  program.stages = {StageSpec{0, int(cfg.num_hidden_layers), true, true, 1}};
  for (int mb = 0; mb < 2; ++mb) {
    program.actions.push_back({WalkAction::Kind::forward, mb, 0});
    program.actions.push_back({WalkAction::Kind::backward, mb, 0});
  }
  const Bytes minimum = minimum_budget(cfg, kB, kS, program, state_probe.in_use());
  // The walk's floor is the minimum less the placement reserve; a third of the way up from it.
  const Bytes floor = minimum - Arena::placement_reserve(minimum);
  ASSERT_LT(floor, free_run.peak);
  const Bytes budget = Arena::round_up(minimum + (free_run.peak - floor) / 3);
  Arena host(budget);
  const Result h = run(host, "adaptive");
  EmulatedDevice dev(budget);
  Arena arena(budget, dev.region(), &dev);
  const Result d = run(arena, "adaptive");
  expect_same(d, h, "adaptive");
  EXPECT_EQ(d.predicted, d.peak);
  EXPECT_LE(d.peak, budget);
}

}  // namespace
}  // namespace moeflex
