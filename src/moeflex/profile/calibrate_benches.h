// Internal to `moeflex calibrate`: the kernel calls the calibration's tables
// (calibrate_ops.cpp, calibrate_gemm.cpp) and the held-out checks (held_out.cpp)
// both time, on buffers that keep realistic contents however often they repeat:
// weights cold from a ring, activations warm, saved tensors valid outputs of their
// forward.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "moeflex/ops/attention.h"
#include "moeflex/ops/cross_entropy.h"
#include "moeflex/ops/moe_dispatch.h"
#include "moeflex/ops/rmsnorm.h"
#include "moeflex/ops/rope.h"
#include "moeflex/ops/router.h"
#include "moeflex/ops/swiglu.h"
#include "moeflex/profile/calibrate_internal.h"

namespace moeflex::calibration {

/// Weights and weight gradients are taken from this ring in consecutive slices, so
/// that each call's weight was last touched kColdRingBytes of weights ago: cold in
/// the caches, as in a training step, where all the other layers' weights pass
/// through between two uses of one. Activations stay warm, as after the op that
/// produced them.
class ColdRing {
 public:
  ColdRing() : data_(buffer(kColdRingBytes / kActivationBytes, 77)) {}
  /// The next n floats (n at most a quarter of the ring).
  float* next(std::int64_t n) {
    if (pos_ + n > std::int64_t(data_.size())) pos_ = 0;
    float* p = data_.data() + pos_;
    pos_ += (n + kSliceAlign - 1) / kSliceAlign * kSliceAlign;
    return p;
  }

 private:
  static constexpr std::int64_t kSliceAlign = 16;  ///< floats: slices start on 64-byte lines
  std::vector<float> data_;
  std::int64_t pos_ = 0;
};

/// A dropless dispatch plan (moe_plan_dispatch's outputs) for a routing.
struct Routing {
  std::vector<std::int32_t> topk_idx, counts, offsets, slot_of;
  std::vector<float> topk_w;
};

/// Token i goes to experts (i + j) % E for j < k: every expert gets n*k/E rows.
inline Routing uniform_routing(std::int64_t n, std::int64_t E, std::int64_t k) {
  Routing r;
  r.topk_idx.resize(std::size_t(n * k));
  r.topk_w.assign(std::size_t(n * k), 1.0f / float(k));
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t j = 0; j < k; ++j) r.topk_idx[std::size_t(i * k + j)] = std::int32_t((i + j) % E);
  r.counts.resize(std::size_t(E));
  r.offsets.resize(std::size_t(E + 1));
  r.slot_of.resize(std::size_t(n * k));
  ops::moe_plan_dispatch(r.topk_idx.data(), n, E, k, -1, r.counts.data(), r.offsets.data(), r.slot_of.data());
  return r;
}

/// Calls of the non-GEMM kernels on buffers that keep realistic contents however
/// often they are repeated: inputs are random and never written, saved tensors
/// (rstd, router probs and top-k) are valid outputs of their forward, outputs go
/// to scratch. Calibration and validation both time these very calls.
class OpBench {
 public:
  /// max_rows: tokens of the largest call; max_elems: elements of the largest flat
  /// operand ([n, d], [n*k, d], swiglu's [rows, f]); max_logits: n*V of the largest
  /// cross entropy.
  OpBench(std::int64_t max_rows, std::int64_t max_elems, std::int64_t max_logits)
      : in1_(buffer(max_elems, 101)),
        in2_(buffer(max_elems, 102)),
        out1_(buffer(max_elems, 103)),
        out2_(buffer(max_elems, 104)),
        w_(buffer(kHidden * 4, 105)),
        dw_(buffer(kHidden * 4, 106)),
        rstd_(buffer(max_rows, 107)),
        probs_(buffer(max_rows * kExperts, 108)),
        topk_w_(buffer(max_rows * kTopK, 109)),
        topk_idx_(std::size_t(max_rows * kTopK)),
        topk_scratch_(std::size_t(max_rows * kTopK)),
        logits_(buffer(max_logits, 110)),
        targets_(std::size_t(max_rows)) {
    for (std::size_t i = 0; i < targets_.size(); ++i) targets_[i] = std::int32_t((i * 2654435761u) % kVocab);
    ops::rmsnorm_forward(in1_.data(), w_.data(), out1_.data(), rstd_.data(), max_rows, kHidden, kRmsEps);
    ops::router_forward(in1_.data(), probs_.data(), topk_idx_.data(), topk_w_.data(), max_rows, kExperts, kTopK, true);
  }

  std::function<void()> rmsnorm_forward(std::int64_t n, std::int64_t d) {
    return [this, n, d] { ops::rmsnorm_forward(in1_.data(), w_.data(), out1_.data(), out2_.data(), n, d, kRmsEps); };
  }
  std::function<void()> rmsnorm_backward(std::int64_t n, std::int64_t d) {
    return [this, n, d] {
      ops::rmsnorm_backward(in2_.data(), in1_.data(), w_.data(), rstd_.data(), out1_.data(), dw_.data(), n, d);
    };
  }
  std::function<void()> swiglu_forward(std::int64_t n) {
    return [this, n] { ops::swiglu_forward(in1_.data(), in2_.data(), out1_.data(), n); };
  }
  std::function<void()> swiglu_backward(std::int64_t n) {
    return [this, n] { ops::swiglu_backward(in2_.data(), in1_.data(), in2_.data(), out1_.data(), out2_.data(), n); };
  }
  std::function<void()> router_forward(std::int64_t n) {
    return [this, n] {
      ops::router_forward(in1_.data(), out1_.data(), topk_scratch_.data(), out2_.data(), n, kExperts, kTopK, true);
    };
  }
  std::function<void()> router_backward(std::int64_t n) {
    return [this, n] {
      ops::router_backward<float>(in2_.data(), nullptr, probs_.data(), topk_idx_.data(), out1_.data(), n, kExperts,
                                  kTopK, true);
    };
  }
  /// which: 0 permute forward, 1 permute backward, 2 unpermute forward, 3 unpermute backward.
  std::function<void()> permutation(int which, std::int64_t n, std::int64_t d) {
    auto r = std::make_shared<Routing>(uniform_routing(n, kExperts, kTopK));
    return [this, r, which, n, d] {
      const std::int32_t* slot = r->slot_of.data();
      switch (which) {
        case 0: ops::permute_forward(in1_.data(), slot, out1_.data(), n, kTopK, d); break;
        case 1: ops::permute_backward(in1_.data(), slot, out1_.data(), n, kTopK, d); break;
        case 2: ops::unpermute_forward(in1_.data(), slot, r->topk_w.data(), out1_.data(), n, kTopK, d); break;
        default:
          ops::unpermute_backward(in2_.data(), in1_.data(), slot, r->topk_w.data(), out1_.data(), out2_.data(), n,
                                  kTopK, d);
      }
    };
  }
  /// In place (probs alias logits), as the model's head calls it.
  std::function<void()> cross_entropy_forward(std::int64_t n, std::int64_t V) {
    return [this, n, V] {
      ops::cross_entropy_forward(logits_.data(), targets_.data(), logits_.data(), out2_.data(), n, V);
    };
  }
  /// In place with scale 1: the model's 1/n would shrink the repeated in-place
  /// results into denormals, which the real single call never meets; the
  /// arithmetic is the same.
  std::function<void()> cross_entropy_backward(std::int64_t n, std::int64_t V) {
    return [this, n, V] {
      ops::cross_entropy_backward(logits_.data(), targets_.data(), logits_.data(), n, V, 1.0f);
    };
  }

 private:
  std::vector<float> in1_, in2_, out1_, out2_, w_, dw_, rstd_, probs_, topk_w_;
  std::vector<std::int32_t> topk_idx_, topk_scratch_;
  std::vector<float> logits_;
  std::vector<std::int32_t> targets_;
};

/// Calls of rope and attention with H = kHeads heads; each backward gets the
/// probabilities its own forward produced, computed when the call is made.
class AttentionBench {
 public:
  /// max_act: elements of the largest [B, S, H, hd] operand.
  explicit AttentionBench(std::int64_t max_act)
      : q_(buffer(max_act, 201)), k_(buffer(max_act, 202)), v_(buffer(max_act, 203)), dout_(buffer(max_act, 204)),
        o_(buffer(max_act, 205)), dq_(buffer(max_act, 206)), dk_(buffer(max_act, 207)), dv_(buffer(max_act, 208)),
        rot_(buffer(max_act, 209)) {}

  /// Rotates a buffer of its own (rotations keep it bounded).
  std::function<void()> rope(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t hd) {
    return [this, B, S, H, hd] { ops::rope_forward(rot_.data(), B, S, H, hd, kRopeTheta); };
  }
  std::function<void()> forward(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t hd) {
    auto probs = std::make_shared<std::vector<float>>(std::size_t(B * H * S * S));
    return [this, probs, B, S, H, hd] {
      ops::attention_forward(q_.data(), k_.data(), v_.data(), o_.data(), probs->data(), B, S, H, H, hd);
    };
  }
  std::function<void()> backward(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t hd) {
    auto probs = std::make_shared<std::vector<float>>(std::size_t(B * H * S * S));
    auto dprobs = std::make_shared<std::vector<float>>(std::size_t(B * H * S * S));
    ops::attention_forward(q_.data(), k_.data(), v_.data(), o_.data(), probs->data(), B, S, H, H, hd);
    return [this, probs, dprobs, B, S, H, hd] {
      ops::attention_backward(dout_.data(), q_.data(), k_.data(), v_.data(), probs->data(), dq_.data(), dk_.data(),
                              dv_.data(), dprobs->data(), B, S, H, H, hd);
    };
  }

 private:
  std::vector<float> q_, k_, v_, dout_, o_, dq_, dk_, dv_, rot_;
};

}  // namespace moeflex::calibration
