// Training-size timings of the CUDA ops (MOEFLEX_OP_BENCH=1; skipped otherwise), at
// the shapes of a ~1B-parameter MoE on one GPU, and the card's cuBLAS bf16 GEMM
// rate. No CPU reference here (test_cuda_ops.cpp checks every op at smaller
// shapes): the rows carry no error. bench/gpu_torch_ops.py times the same ops and
// shapes in PyTorch from these report rows. Without a GPU: "skipped: no GPU".
#include <array>

#include "cuda_harness.h"
#include "moeflex/ops/cuda/attention.h"
#include "moeflex/ops/cuda/grouped_linear.h"
#include "moeflex/ops/cuda/linear.h"
#include "moeflex/ops/cuda/moe_dispatch.h"
#include "moeflex/ops/cuda/residual.h"
#include "moeflex/ops/cuda/rmsnorm.h"
#include "moeflex/ops/cuda/rope.h"
#include "moeflex/ops/cuda/router.h"
#include "moeflex/ops/cuda/swiglu.h"

namespace moeflex::test {
namespace {

namespace gops = moeflex::ops::cuda;

/// Expert row counts of the benchmark's grouped GEMM: every 8th expert gets 3x the
/// load of the others; integer arithmetic, mirrored by bench/gpu_torch_ops.py.
std::vector<std::int32_t> bench_offsets(std::int64_t rows, std::int64_t E) {
  std::int64_t units = 0;
  for (std::int64_t e = 0; e < E; ++e) units += e % 8 == 0 ? 3 : 1;
  std::vector<std::int32_t> off(sz(E + 1), 0);
  std::int64_t given = 0;
  for (std::int64_t e = 0; e < E; ++e) {
    const std::int64_t c = rows * (e % 8 == 0 ? 3 : 1) / units;
    off[sz(e + 1)] = std::int32_t(off[sz(e)] + c);
    given += c;
  }
  for (std::int64_t e = 1; e <= E; ++e) off[sz(e)] += std::int32_t(rows - given);  // remainder to expert 0
  return off;
}

TEST(CudaBench, TrainingSizeTimings) {
  MOEFLEX_REQUIRE_GPU();
  if (!bench_mode()) GTEST_SKIP() << "skipped: set MOEFLEX_OP_BENCH=1 for the training-size timings";
  auto& g = gpu();
  const cudaStream_t s = g.s();
  auto random_dev = [](auto& arr, std::uint64_t stream) { fill_random(arr, stream); };
  {  // The card's bf16 matmul rate: 8192^3 through cuBLAS.
    const std::int64_t n = 8192;
    DevArray<bf16> A(n * n, "A"), B(n * n, "B"), C(n * n, "C");
    random_dev(A, 1);
    random_dev(B, 2);
    OpRow r{"gemm_rate", "bf16", shape_str({{"M", n}, {"N", n}, {"K", n}})};
    r.flops = 2.0 * n * n * n;
    r.note = "cuBLAS bf16 GEMM rate on random data";
    r.ms = time_ms([&] { gops::gemm<bf16, bf16>(g.blas, false, false, n, n, n, 1.0f, A.get(), n, B.get(), n, 0.0f, C.get(), n); });
    report(r);
  }
  {  // Dense linear of a ~1B model: 8192 tokens, hidden 2048 -> 5632.
    const std::int64_t n = 8192, in = 2048, out = 5632;
    DevArray<bf16> x(n * in, "x"), w(out * in, "w"), y(n * out, "y"), dy(n * out, "dy"), dx(n * in, "dx");
    DevArray<float> dw(out * in, "dw");
    random_dev(x, 3), random_dev(w, 4), random_dev(dy, 5);
    const std::string shape = shape_str({{"n", n}, {"in", in}, {"out", out}});
    OpRow f{"linear_fwd", "bf16", shape}, b{"linear_bwd", "bf16", shape};
    f.flops = 2.0 * n * in * out, b.flops = 2 * f.flops;
    f.ms = time_ms([&] { gops::linear_forward(g.blas, x.get(), w.get(), y.get(), n, in, out); });
    b.ms = time_ms([&] { gops::linear_backward(g.blas, dy.get(), x.get(), w.get(), dx.get(), dw.get(), n, in, out); });
    report(f), report(b);
  }
  // MoE experts, both paths of the automatic choice, at three group sizes: 16384 tokens
  // x top-4 over 64 experts (hidden 2048, expert width 1408; ~1000 rows a group),
  // configs/moe-1b.toml's step (4096 tokens x top-2 over 16 experts at hidden 1024), and
  // 256 small groups (~32 rows each, DeepSeek-V3's expert count).
  for (auto [E, rows, in, out] : {std::array<std::int64_t, 4>{64, 16384 * 4, 2048, 1408},
                                  {16, 4096 * 2, 1024, 1408},
                                  {256, 8192, 2048, 1408}}) {
    const auto off = bench_offsets(rows, E);
    DevArray<bf16> x(rows * in, "x"), w(E * out * in, "w"), y(rows * out, "y"), dy(rows * out, "dy"), dx(rows * in, "dx");
    DevArray<float> dw(E * out * in, "dw");
    random_dev(x, 6), random_dev(w, 7), random_dev(dy, 8);
    const std::string shape = shape_str({{"E", E}, {"rows", rows}, {"in", in}, {"out", out}});
    for (auto path : {gops::GroupedGemmPath::automatic, gops::GroupedGemmPath::loop}) {
      OpRow f{"grouped_linear_fwd", "bf16", shape}, b{"grouped_linear_bwd", "bf16", shape};
      f.flops = 2.0 * rows * in * out, b.flops = 2 * f.flops;
      f.ms = time_ms([&] { gops::grouped_linear_forward(g.blas, x.get(), w.get(), y.get(), off.data(), E, in, out, path); });
      f.note = std::string("path ") + gops::to_string(path) + " (ran " + gops::to_string(g.blas.last_grouped_path()) + ")";
      b.ms = time_ms([&] {
        gops::grouped_linear_backward(g.blas, dy.get(), x.get(), w.get(), dx.get(), dw.get(), off.data(), E, in, out, path);
      });
      b.note = std::string("path ") + gops::to_string(path) + " (dw ran " + gops::to_string(g.blas.last_grouped_path()) + ")";
      report(f), report(b);
    }
  }
  {  // Norm, RoPE, SwiGLU, residual at 16384 tokens.
    const std::int64_t n = 16384, d = 2048;
    DevArray<bf16> x(n * d, "x"), w(d, "w"), y(n * d, "y"), dy(n * d, "dy"), dx(n * d, "dx");
    DevArray<float> r(n, "rstd"), dw(d, "dw"), ws(gops::rmsnorm_backward_workspace_bytes(n, d) / 4 + 1, "ws");
    random_dev(x, 9), random_dev(w, 10), random_dev(dy, 11);
    const std::string shape = shape_str({{"n", n}, {"d", d}});
    OpRow f{"rmsnorm_fwd", "bf16", shape}, b{"rmsnorm_bwd", "bf16", shape};
    f.bytes = 4.0 * n * d, b.bytes = 6.0 * n * d;
    f.ms = time_ms([&] { gops::rmsnorm_forward(x.get(), w.get(), y.get(), r.get(), n, d, 1e-6f, s); });
    b.ms = time_ms([&] { gops::rmsnorm_backward(dy.get(), x.get(), w.get(), r.get(), dx.get(), dw.get(), ws.get(), n, d, s); });
    report(f), report(b);
    OpRow a{"residual_add", "bf16", shape_str({{"n", n * d}})};
    a.bytes = 6.0 * n * d;
    a.ms = time_ms([&] { gops::residual_add(x.get(), dy.get(), y.get(), n * d, s); });
    report(a);
    const std::int64_t Bq = 8, S = 2048, H = 16, hd = 128;
    DevArray<bf16> q(Bq * S * H * hd, "q");
    random_dev(q, 12);
    const std::string rs = shape_str({{"B", Bq}, {"S", S}, {"H", H}, {"hd", hd}});
    OpRow rf{"rope_fwd", "bf16", rs}, rb{"rope_bwd", "bf16", rs};
    rf.bytes = rb.bytes = 4.0 * Bq * S * H * hd;
    rf.ms = time_ms([&] { gops::rope_forward(q.get(), Bq, S, H, hd, 10000.0, s); });
    rb.ms = time_ms([&] { gops::rope_backward(q.get(), Bq, S, H, hd, 10000.0, s); });
    report(rf), report(rb);
    const std::int64_t m = 16384 * 4 * 1408;
    DevArray<bf16> ga(m, "gate"), up(m, "up"), o(m, "o"), go(m, "dout"), dg(m, "dg"), du(m, "du");
    random_dev(ga, 13), random_dev(up, 14), random_dev(go, 15);
    OpRow sf{"swiglu_fwd", "bf16", shape_str({{"n", m}})}, sb{"swiglu_bwd", "bf16", shape_str({{"n", m}})};
    sf.bytes = 6.0 * m, sb.bytes = 10.0 * m;
    sf.ms = time_ms([&] { gops::swiglu_forward(ga.get(), up.get(), o.get(), m, s); });
    sb.ms = time_ms([&] { gops::swiglu_backward(go.get(), ga.get(), up.get(), dg.get(), du.get(), m, s); });
    report(sf), report(sb);
  }
  {  // Router and dispatch: 16384 tokens, 64 experts, top-4, hidden 2048.
    const std::int64_t n = 16384, E = 64, k = 4, d = 2048;
    DevArray<float> logits(n * E, "logits"), probs(n * E, "probs"), tw(n * k, "topk_w"), dtw(n * k, "dtopk_w"),
        dl(n * E, "dlogits");
    DevInts idx(n * k, "topk_idx"), counts(E, "counts"), offsets(E + 1, "offsets"), slot(n * k, "slot"), ws(4, "ws");
    random_dev(logits, 16), random_dev(dtw, 17);
    const std::string rs = shape_str({{"n", n}, {"E", E}, {"k", k}, {"norm", 1}, {"extra", 0}});
    OpRow rf{"router_fwd", "f32", rs}, rb{"router_bwd", "f32", rs};
    rf.bytes = 8.0 * n * E, rb.bytes = 12.0 * n * E;
    rf.ms = time_ms([&] { gops::router_forward(logits.get(), probs.get(), idx.get(), tw.get(), n, E, k, true, s); });
    rb.ms = time_ms([&] { gops::router_backward(dtw.get(), nullptr, probs.get(), idx.get(), dl.get(), n, E, k, true, s); });
    report(rf), report(rb);
    std::vector<std::int32_t> host_off(sz(E + 1));
    OpRow pr{"moe_plan", "i32", shape_str({{"n", n}, {"E", E}, {"k", k}})};
    pr.ms = time_ms([&] {
      gops::moe_plan_dispatch(idx.get(), n, E, k, -1, counts.get(), offsets.get(), slot.get(), host_off.data(), ws.get(), s);
    });
    pr.note = "includes the host copy of the offsets";
    report(pr);
    const std::int64_t rows = host_off.back();
    DevArray<bf16> x(n * d, "x"), xp(rows * d, "xp"), y(n * d, "y"), dyp(rows * d, "dyp");
    random_dev(x, 18);
    const std::string ps = shape_str({{"n", n}, {"E", E}, {"k", k}, {"d", d}, {"rows", rows}});
    OpRow pf{"permute_fwd", "bf16", ps}, pb{"permute_bwd", "bf16", ps}, uf{"unpermute_fwd", "bf16", ps},
        ub{"unpermute_bwd", "bf16", ps};
    pf.bytes = pb.bytes = uf.bytes = 4.0 * rows * d;
    ub.bytes = 6.0 * rows * d;
    pf.ms = time_ms([&] { gops::permute_forward(x.get(), slot.get(), xp.get(), n, k, d, s); });
    pb.ms = time_ms([&] { gops::permute_backward(xp.get(), slot.get(), y.get(), n, k, d, s); });
    uf.ms = time_ms([&] { gops::unpermute_forward(xp.get(), slot.get(), tw.get(), y.get(), n, k, d, s); });
    ub.ms = time_ms([&] { gops::unpermute_backward(y.get(), xp.get(), slot.get(), tw.get(), dyp.get(), dtw.get(), n, k, d, s); });
    report(pf), report(pb), report(uf), report(ub);
  }
  {  // Attention of a ~1B model: batch 4 x 2048 tokens, 16 heads of 128.
    const std::int64_t B = 4, S = 2048, H = 16, hd = 128, N = B * S * H * hd;
    DevArray<bf16> q(N, "q"), k(N, "k"), v(N, "v"), o(N, "o"), dout(N, "dout"), dq(N, "dq"), dk(N, "dk"), dv(N, "dv");
    DevArray<float> lse(B * H * S, "lse"), ws(gops::attention_backward_workspace_bytes(B, S, H) / 4 + 1, "ws");
    random_dev(q, 19), random_dev(k, 20), random_dev(v, 21), random_dev(dout, 22);
    const std::string shape = shape_str({{"B", B}, {"S", S}, {"H", H}, {"hd", hd}});
    OpRow f{"attention_fwd", "bf16", shape}, b{"attention_bwd", "bf16", shape};
    f.flops = 2.0 * B * H * double(S) * double(S) * hd, b.flops = 2.5 * f.flops;
    f.ms = time_ms([&] { gops::attention_forward(q.get(), k.get(), v.get(), o.get(), lse.get(), B, S, H, H, hd, s); }, 5);
    b.ms = time_ms([&] {
      gops::attention_backward(dout.get(), q.get(), k.get(), v.get(), o.get(), lse.get(), dq.get(), dk.get(), dv.get(),
                               ws.get(), B, S, H, H, hd, s);
    }, 5);
    report(f), report(b);
  }
}

}  // namespace
}  // namespace moeflex::test
