#include "moeflex/train/optimizer.h"

#include <cmath>
#include <numbers>

#include "moeflex/ops/backend.h"

namespace moeflex {

namespace {

/// The backend holding a parameter's tensors (their arena's device, or the CPU).
ops::Backend& backend_of(const Tensor& t) { return t.arena() ? ops::backend_of(*t.arena()) : ops::cpu_backend(); }

}  // namespace

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
    if (p.buffer) continue;  // moved by its own rule (the noaux_tc expert bias)
    const float decay = p.no_decay ? 1.0f : float(1.0 - lr * cfg_.weight_decay);
    ops::Backend& be = backend_of(p.w);
    be.adamw(p.w.f32(), p.g.f32(), m_[i].f32(), v_[i].f32(), p.w.numel(), b1, b2, eps, decay, step_size,
             inv_sqrt_bc2);
    if (p.wc.defined()) be.cast(p.w.view(), p.wc.view(), p.w.numel());  // the bf16 working copy follows
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

double square_sum(const Param& p) { return backend_of(p.g).square_sum(p.g.f32(), p.g.numel()); }

}  // namespace

double grad_square_sum(const Param& p) { return square_sum(p); }

void scale_grads(Param& p, float scale) { backend_of(p.g).scale(p.g.f32(), p.g.numel(), scale); }

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
