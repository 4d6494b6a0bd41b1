// AdamW (Loshchilov & Hutter 2019: decoupled weight decay) with fp32 moments,
// global-norm gradient clipping, and the warm-up + cosine learning-rate schedule.
#pragma once
#include <cstdint>
#include <vector>

#include "moeflex/core/tensor.h"
#include "moeflex/model/model.h"

namespace moeflex {

struct AdamWConfig {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;  ///< decoupled; not applied to norm weights
};

class AdamW {
 public:
  /// Allocates the two moments of every parameter (category optimizer).
  AdamW(std::vector<Param>& params, Arena& arena, AdamWConfig cfg);
  /// One update with learning rate `lr`: m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
  /// w -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * w), bias-corrected at step t (1-based),
  /// on the fp32 master weights, which are then rounded into the bf16 working copy
  /// (Param::wc) when there is one.
  void step(double lr);
  std::int64_t steps_taken() const { return t_; }
  void set_steps_taken(std::int64_t t) { t_ = t; }
  /// The moment tensors, named "<param>.exp_avg" / "<param>.exp_avg_sq", for checkpoints.
  std::vector<std::pair<std::string, Tensor*>> state();

 private:
  std::vector<Param>& params_;
  AdamWConfig cfg_;
  std::vector<Tensor> m_, v_;
  std::int64_t t_ = 0;
};

/// Sum of squared gradients of the expert (or non-expert) parameters, in double,
/// in parameter order with fixed-size chunks (the same for any thread count).
double grad_square_sum(const std::vector<Param>& params, bool expert);
/// The same for one parameter.
double grad_square_sum(const Param& p);
/// g *= scale for every parameter.
void scale_grads(std::vector<Param>& params, float scale);
void scale_grads(Param& p, float scale);

/// Linear warm-up over `warmup` steps from 0 to lr_max, then cosine decay to lr_min
/// at `total` steps (Loshchilov & Hutter 2017, SGDR without restarts). step is 0-based.
double lr_at(std::int64_t step, std::int64_t warmup, std::int64_t total, double lr_max, double lr_min);

}  // namespace moeflex
