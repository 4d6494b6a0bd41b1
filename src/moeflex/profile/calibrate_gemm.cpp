// The calibration's GEMM phase: the grid of GEMM shapes (every linear layer's three
// GEMMs along the token count for the default model's weights and larger ones, and
// attention's per-head GEMMs), less the held-out ones, timed into the profile's GEMM
// lines.
#include <algorithm>
#include <cstdint>
#include <map>
#include <set>
#include <tuple>
#include <vector>

#include "moeflex/ops/blas.h"
#include "moeflex/profile/calibrate_benches.h"
#include "moeflex/profile/calibrate_internal.h"

namespace moeflex::calibration {
namespace {

std::vector<GemmShape> gemm_grid(bool full) {
  const std::vector<std::int64_t> xs =
      full ? std::vector<std::int64_t>{8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096}
           : std::vector<std::int64_t>{16, 64, 256, 512, 1024, 2048};
  // Weight shapes [out, in] of the default model: every linear layer's three GEMMs
  // along the token count (M of y and dx, K of dw), the other two extents fixed.
  std::vector<std::pair<std::int64_t, std::int64_t>> weights = {
      {kHidden, kHidden}, {kExpertFfn, kHidden}, {kHidden, kExpertFfn}, {kDenseFfn, kHidden},
      {kHidden, kDenseFfn}, {kVocab, kHidden}, {kExperts, kHidden}};
  if (full) {  // larger models
    weights.push_back({512, 512});
    weights.push_back({1024, 1024});
  }
  const std::set<GemmKey> held = held_out_gemms();
  std::vector<GemmShape> grid;
  const auto add = [&](const GemmShape& g) {
    if (!held.count(key_of(g))) grid.push_back(g);
  };
  for (auto [out, in] : weights) {
    for (std::int64_t n : xs) {
      add(linear_forward_gemm(n, in, out));
      add(linear_dx_gemm(n, in, out));
      add(linear_dw_gemm(n, in, out));
    }
  }
  // Attention, per head, with the strides of [B, S, H, hd] activations: scores =
  // q k^T (nt), out = P v (nn), dV = P^T dO (tn).
  // (Per-head shapes vary in two extents at once, so they have no lines: sqrt(2)
  // steps in S keep the nearest-sample lookup close.)
  const std::vector<std::int64_t> seqs = full ? std::vector<std::int64_t>{32, 48, 64, 96, 128, 192, 256, 384, 512}
                                              : std::vector<std::int64_t>{64, 128, 256};
  const std::vector<std::int64_t> hds = full ? std::vector<std::int64_t>{32, 64, 128} : std::vector<std::int64_t>{64};
  for (std::int64_t S : seqs) {
    for (std::int64_t hd : hds) {
      const std::int64_t ld = kHeads * hd;
      add({S, S, hd, false, true, ld, ld, S, 0.0f, 0});
      add({S, hd, S, false, false, S, ld, ld, 0.0f, 0});
      add({S, hd, S, true, false, S, ld, ld, 0.0f, 0});
    }
  }
  return grid;
}

}  // namespace

void measure_gemms(HardwareProfile& p, bool full, Seconds budget, std::vector<Job>* extra) {
  const std::vector<GemmShape> grid = gemm_grid(full);
  std::int64_t a_len = 0, b_len = 0, c_len = 0;
  for (const GemmShape& g : grid) {
    a_len = std::max(a_len, (g.ta ? g.K : g.M) * g.lda);
    b_len = std::max(b_len, (g.tb ? g.N : g.K) * g.ldb);
    c_len = std::max(c_len, g.M * g.ldc);
  }
  std::vector<float> A = buffer(a_len, 1), B = buffer(b_len, 2), C = buffer(c_len, 3);
  // Weights (B of y and dx) and weight gradients (C of dw) come cold from the ring;
  // attention's operands are all activations.
  ColdRing ring;
  std::vector<Job> jobs;
  for (const GemmShape& g : grid) {
    jobs.push_back({[&A, &B, &C, &ring, g] {
      const float* b = g.weight == 'b' ? ring.next((g.tb ? g.N : g.K) * g.ldb) : B.data();
      float* c = g.weight == 'c' ? ring.next(g.M * g.ldc) : C.data();
      ops::gemm<float>(g.ta, g.tb, g.M, g.N, g.K, 1.0f, A.data(), g.lda, b, g.ldb, g.beta, c, g.ldc);
    }});
  }
  // Series: each linear layer's lines along its token count; attention's shapes stand alone.
  std::map<std::tuple<GemmLayout, std::int64_t, std::int64_t>, Series> lines;
  for (std::size_t i = 0; i < grid.size(); ++i) {
    const GemmShape& g = grid[i];
    if (!g.weight) continue;
    const double f = 2.0 * double(g.M * g.N * g.K);
    if (g.layout() == GemmLayout::tn) lines[{g.layout(), g.M, g.N}].emplace_back(f, i);
    else lines[{g.layout(), g.N, g.K}].emplace_back(f, i);
  }
  std::vector<Series> series;
  for (auto& [key, line] : lines) series.push_back(std::move(line));
  const std::size_t at = add_extra(jobs, extra);
  run_series(jobs, series, budget);
  take_extra(jobs, at, extra);
  for (std::size_t i = 0; i < grid.size(); ++i)
    p.gemm.push_back({grid[i].M, grid[i].N, grid[i].K, 2.0 * double(grid[i].M * grid[i].N * grid[i].K) / jobs[i].time,
                      grid[i].layout()});
}

}  // namespace moeflex::calibration
