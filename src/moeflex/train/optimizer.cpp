#include "moeflex/train/optimizer.h"

#include <cmath>
#include <numbers>

namespace moeflex {

AdamW::AdamW(std::vector<Param>& params, Arena& arena, AdamWConfig cfg) : params_(params), cfg_(cfg) {
  for (auto& p : params_) {
    m_.emplace_back(arena, p.w.shape(), MemCategory::optimizer, p.name + ".exp_avg");
    v_.emplace_back(arena, p.w.shape(), MemCategory::optimizer, p.name + ".exp_avg_sq");
    m_.back().zero();
    v_.back().zero();
  }
}

void AdamW::step(double lr) {
  ++t_;
  const double bc1 = 1.0 - std::pow(cfg_.beta1, double(t_));
  const double bc2 = 1.0 - std::pow(cfg_.beta2, double(t_));
  const float b1 = float(cfg_.beta1), b2 = float(cfg_.beta2), eps = float(cfg_.eps);
  const float step_size = float(lr / bc1);
  const float inv_sqrt_bc2 = float(1.0 / std::sqrt(bc2));
  for (std::size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i];
    float* w = p.w.f32();
    const float* g = p.g.f32();
    float* m = m_[i].f32();
    float* v = v_[i].f32();
    const float decay = p.no_decay ? 1.0f : float(1.0 - lr * cfg_.weight_decay);
    const std::int64_t n = p.w.numel();
#pragma omp parallel for schedule(static)
    for (std::int64_t j = 0; j < n; ++j) {
      m[j] = b1 * m[j] + (1.0f - b1) * g[j];
      v[j] = b2 * v[j] + (1.0f - b2) * g[j] * g[j];
      w[j] = w[j] * decay - step_size * m[j] / (std::sqrt(v[j]) * inv_sqrt_bc2 + eps);
    }
  }
}

std::vector<std::pair<std::string, Tensor*>> AdamW::state() {
  std::vector<std::pair<std::string, Tensor*>> out;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    out.emplace_back(params_[i].name + ".exp_avg", &m_[i]);
    out.emplace_back(params_[i].name + ".exp_avg_sq", &v_[i]);
  }
  return out;
}

namespace {

double square_sum(const Param& p) {
  const float* g = p.g.f32();
  const std::int64_t n = p.g.numel();
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

}  // namespace

double grad_square_sum(const Param& p) { return square_sum(p); }

void scale_grads(Param& p, float scale) {
  float* g = p.g.f32();
  const std::int64_t n = p.g.numel();
#pragma omp parallel for schedule(static)
  for (std::int64_t j = 0; j < n; ++j) g[j] *= scale;
}

double grad_square_sum(const std::vector<Param>& params, bool expert) {
  double total = 0;
  for (auto& p : params)
    if (p.expert == expert && !p.tied_copy) total += square_sum(p);
  return total;
}

void scale_grads(std::vector<Param>& params, float scale) {
  for (auto& p : params) scale_grads(p, scale);
}

double lr_at(std::int64_t step, std::int64_t warmup, std::int64_t total, double lr_max, double lr_min) {
  if (warmup > 0 && step < warmup) return lr_max * double(step + 1) / double(warmup);
  if (total <= warmup) return lr_max;
  double progress = double(step - warmup) / double(total - warmup);
  progress = std::min(1.0, std::max(0.0, progress));
  return lr_min + 0.5 * (lr_max - lr_min) * (1.0 + std::cos(std::numbers::pi * progress));
}

}  // namespace moeflex
