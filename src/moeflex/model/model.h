// The decoder-only MoE transformer of docs/model.md: parameters, and the forward
// and backward of one micro-batch written as sequences of ops that save what their
// backward needs into the ActivationStash.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "moeflex/core/tensor.h"
#include "moeflex/model/config.h"
#include "moeflex/model/ledger.h"
#include "moeflex/ops/router.h"
#include "moeflex/model/memory_plan.h"
#include "moeflex/provision/cost_model.h"
#include "moeflex/model/token_dispatcher.h"
#include "moeflex/ops/backend.h"
#include "moeflex/provision/planner.h"
#include "moeflex/provision/stash.h"

namespace moeflex {

/// One trainable tensor with its gradient (all in the arena).
struct Param {
  std::string name;   ///< safetensors key (docs/model.md)
  Tensor w;           ///< weights, fp32: the master weights the optimizer updates (category weights)
  Tensor g;           ///< fp32 gradient (main grad), accumulated over micro-batches (category grads)
  bool no_decay = false;  ///< excluded from weight decay (norm weights)
  bool expert = false;            ///< routed-expert weights: sharded over EP, reduced over expert-DP
  bool buffer = false;            ///< not trained (ParamSpec::buffer): fp32 only, no working copy
  std::int64_t init_offset = 0;   ///< element offset of this shard in the full tensor (for init)
  /// The last pipeline stage's copy of a tied embedding (the first stage holds the
  /// original): its gradient is summed with the original's and it is left out of norms.
  bool tied_copy = false;
  /// The bf16 working copy of `w` that the ops read in the bf16 engine (category
  /// weights; empty in the fp32 engine). MoEModel::sync_working_weights() refreshes it.
  Tensor wc;
  /// The weights the ops read: the working copy when there is one, else `w`.
  CView working() const { return wc.defined() ? wc.view() : w.view(); }
};

/// Which part of the model this rank holds, and its expert-parallel group.
struct ModelParallel {
  comm::Communicator* ep_group = nullptr;  ///< null: all experts local
  int first_layer = 0;                     ///< first transformer layer held
  int last_layer = -1;                     ///< one past the last layer held; -1 = all
  bool embedding = true;                   ///< holds the token embedding (first stage)
  bool head = true;                        ///< holds the final norm, LM head and loss (last stage)
};

/// Losses of one micro-batch (means over its tokens).
struct LossParts {
  double total = 0;  ///< ce + aux + z
  double ce = 0;
  double aux = 0;    ///< summed over MoE layers
  double z = 0;      ///< summed over MoE layers
};

/// Routing statistics of one MoE layer for one micro-batch.
struct RoutingStats {
  int layer = 0;
  std::vector<std::int32_t> tokens_per_expert;  ///< assignments kept per expert
  std::int64_t dropped = 0;                     ///< assignments over capacity
  std::int64_t received_rows = 0;               ///< rows this rank's experts received (after EP dispatch)
  /// max over experts / mean over experts of assigned tokens (before dropping).
  double imbalance = 1.0;
};

/// Which expert implementation runs the MoE FFN.
enum class ExpertImpl { grouped_gemm, sequential_reference };

class MoEModel {
 public:
  /// Allocates parameters and gradients from `arena`, and runs on its backend
  /// (ops::backend_of: the CPU, or the device the arena's memory belongs to). Throws
  /// OutOfMemoryError; ConfigError for expert parallelism on a device backend.
  MoEModel(const ModelConfig& cfg, Arena& arena, const ModelParallel& par = {});
  ~MoEModel();
  MoEModel(const MoEModel&) = delete;  // the arena and the stash hold `this` (compaction source)
  MoEModel& operator=(const MoEModel&) = delete;

  /// Deterministic init from `seed` (docs/model.md, "Initialisation").
  void init_weights(std::uint64_t seed);
  /// Rounds every parameter's fp32 master weights into its bf16 working copy (no-op
  /// in the fp32 engine). Call after anything writes the master weights: init_weights
  /// and the optimizer do; a checkpoint load must.
  void sync_working_weights();
  /// dtype of the activations and working weights (model.bf16: bf16, else f32).
  DType activation_dtype() const { return adt_; }
  void zero_grads();

  /// Forward and backward of one micro-batch: ids, targets [B, S]. Gradients are
  /// accumulated (+=) with the micro-batch loss scaled by `grad_scale` (1/M with M
  /// micro-batches). Activations go through `stash` under index `microbatch` and are
  /// released by the end. Returns the unscaled losses.
  LossParts forward_backward(const std::int32_t* ids, const std::int32_t* targets, std::int64_t B, std::int64_t S,
                             int microbatch, double grad_scale);

  /// The two halves of forward_backward, for pipeline schedules: forward_train keeps
  /// the activations of `microbatch` in the stash; backward consumes and frees them.
  LossParts forward_train(const std::int32_t* ids, const std::int32_t* targets, std::int64_t B, std::int64_t S,
                          int microbatch);
  void backward(const std::int32_t* ids, const std::int32_t* targets, std::int64_t B, std::int64_t S,
                int microbatch, double grad_scale);

  /// One pipeline stage's forward: the input is `ids` on the first stage, else the
  /// activations x_in [B*S, d] (of activation_dtype()) received from the previous stage. Returns the output
  /// activations [B*S, d] to send on, or an empty tensor on the last stage, whose
  /// losses go to `loss`. Activations of `microbatch` stay in the stash.
  /// With train = false nothing is kept (evaluation).
  Tensor forward_stage(const std::int32_t* ids, const std::int32_t* targets, CView x_in, std::int64_t B,
                       std::int64_t S, int microbatch, LossParts* loss, bool train = true);
  /// One pipeline stage's backward: dy [B*S, d] is the gradient of the stage's output
  /// (ignored on the last stage); dx_in [B*S, d] receives the gradient of its input
  /// (not written on the first stage). Parameter gradients accumulate.
  void backward_stage(const std::int32_t* ids, const std::int32_t* targets, CView dy, View dx_in,
                      std::int64_t B, std::int64_t S, int microbatch, double grad_scale);
  const ModelParallel& parallel() const { return par_; }
  /// Ranks of the expert-parallel group dispatching this chunk's tokens (1: none).
  int ep_size() const { return dispatcher_.active() ? dispatcher_.ep_size() : 1; }
  /// This chunk as the memory program describes it.
  StageSpec stage_spec() const {
    return {par_.first_layer, par_.last_layer, par_.embedding, par_.head, ep_size()};
  }

  /// Zero-bubble split (Qi et al. 2023): while set, backward_stage computes only
  /// input gradients (B) plus the cheap norm and embedding weight gradients, and
  /// queues the weight-gradient GEMMs of micro-batch `mb`, keeping what they read;
  /// backward_weight(mb) runs them (W). Gradients are the same either way.
  void set_defer_weight_grads(bool defer) { defer_wgrad_ = defer; }
  void backward_weight(int microbatch);
  /// Bytes held by queued weight-gradient work (the split's memory cost).
  std::size_t pending_weight_grads(int microbatch) const;
  /// Arena bytes (rounded) of the tensors queued weight-gradient work of
  /// `microbatch` reads: held on the device, or evicted and brought back before it runs.
  Bytes weight_grad_bytes(int microbatch) const;
  /// The same by layer group of the W, in its order (StepProgram::pending_weight_bytes).
  std::vector<Bytes> weight_grad_groups(int microbatch) const;
  /// Bytes of what queued weight-gradient work reads that the arena evicted to the
  /// host to defragment (Arena::make_room), since construction; they came back
  /// before their W ran.
  Bytes weight_grad_bytes_evicted() const { return wgrad_bytes_evicted_; }
  /// Bytes of what queued weight-gradient work reads that the adaptive planner
  /// offloaded at the end of a zero-bubble B (plan_weight_reads), since construction.
  Bytes weight_grad_bytes_offloaded() const { return wgrad_bytes_offloaded_; }

  /// Forward only (no activations kept): the loss if targets != null, and the
  /// logits of the last position of each sequence into `last_logits` [B, V] if non-null.
  LossParts forward_eval(const std::int32_t* ids, const std::int32_t* targets, std::int64_t B, std::int64_t S,
                         float* last_logits = nullptr);

  /// noaux_tc's aux-loss-free balancing (Wang et al. 2024; DeepSeek-V3 section 2.1.2):
  /// each MoE layer's expert bias moves by model.router_bias_update_rate toward
  /// balance, b_e += rate * sign(mean_e load - load_e), the load being the
  /// assignments kept per expert in the forwards since clear_routing(), summed over
  /// `replicas` (the ranks holding copies of this chunk's routers: data parallel,
  /// EP included; null: this rank alone), so that every copy moves alike. Call after
  /// the optimizer step, on every rank of `replicas`. Nothing without an expert bias.
  void update_expert_bias(comm::Communicator* replicas);

  const ModelConfig& config() const { return cfg_; }
  std::vector<Param>& params() { return params_; }
  Param& param(const std::string& name);
  ActivationStash& stash() { return stash_; }
  /// The copy engine that moves this chunk's offloaded activations (e.g. to observe its copies).
  CopyEngine& copy_engine() { return copy_engine_; }
  Arena& arena() { return arena_; }
  /// Routing statistics of every MoE-layer forward since clear_routing(), in order.
  const std::vector<RoutingStats>& routing() const { return routing_; }
  void clear_routing() { routing_.clear(); }
  void set_expert_impl(ExpertImpl impl) { expert_impl_ = impl; }
  /// Skews the router in the forwards that follow as `spec` says for step `step`
  /// (1-based): each MoE layer's skew is ops::skew_for(spec, step, layer, E, EP size
  /// or E without EP), applied by ops::skew_router_logits. Null turns it off. `spec`
  /// must outlive its use. For spike tests and benchmarks.
  void set_router_skew(const ops::ImbalanceSpec* spec, std::int64_t step) {
    router_skew_ = spec;
    skew_step_ = step;
  }
  /// The classic spike: group 0 (EP rank 0's experts, or expert 0 without EP) gets
  /// `ratio` x its mean load in every forward that follows; ratio <= 1 turns it off.
  void set_router_skew(double ratio) {
    own_skew_.mode = ops::ImbalanceSpec::Mode::every;
    own_skew_.every_n = 1;
    own_skew_.ratio = ratio;
    set_router_skew(ratio > 1 ? &own_skew_ : nullptr, 1);
  }
  /// The adaptive planner deciding this model's saves (null: the stash's policy alone).
  /// Prices the planner's choices by exposed seconds (recompute time, unhidden copy
  /// time) from this cost model (null: a ranking by op family).
  void set_cost_model(const CostModel* cost) { cost_model_ = cost; }
  void set_planner(AdaptivePlanner* planner) {
    planner_ = planner;
    stash_.set_policy(planner ? planner->policy() : ProvisionPolicy{});
  }
  /// The rank's step, for the planner's projections (owned by the executor, which
  /// keeps its `current` action up to date); null: the micro-batch's own backward
  /// follows its forward directly.
  void set_step_program(const StepProgram* program) { program_ = program; }

 private:
  using Shared = std::shared_ptr<Tensor>;
  struct LayerParams {
    Param *in_norm, *q, *k, *v, *o, *post_norm;
    Param *q_norm = nullptr, *k_norm = nullptr;                          // QK-norm (ModelConfig::qk_norm)
    Param *gate = nullptr, *w1 = nullptr, *w3 = nullptr, *w2 = nullptr;  // routed experts (stacked)
    Param* expert_bias = nullptr;                                        // noaux_tc's buffer [E]
    Param *s1 = nullptr, *s3 = nullptr, *s2 = nullptr;                   // shared expert or dense MLP
  };
  /// An activation / workspace tensor of the activation dtype, or of `dt`.
  Tensor act(std::vector<std::int64_t> shape, const char* name) { return act(std::move(shape), name, adt_); }
  Tensor act(std::vector<std::int64_t> shape, const char* name, DType dt);
  Tensor work(std::vector<std::int64_t> shape, const char* name) { return work(std::move(shape), name, adt_); }
  Tensor work(std::vector<std::int64_t> shape, const char* name, DType dt);
  LossParts forward(const std::int32_t* ids, const std::int32_t* targets, std::int64_t B, std::int64_t S, int mb,
                    bool train, float* last_logits);
  Tensor forward_impl(const std::int32_t* ids, const std::int32_t* targets, CView x_in, std::int64_t B,
                      std::int64_t S, int mb, bool train, LossParts& loss, float* last_logits);
  LayerParams& layer(int l) { return layers_[std::size_t(l - par_.first_layer)]; }
  void attention_forward(int l, Tensor& x, std::int64_t B, std::int64_t S, int mb, bool train);
  void attention_backward(int l, Tensor& dx, std::int64_t B, std::int64_t S, int mb);
  /// QK-norm's lineage of attn.q (`is_q`) or attn.k: the norm of the saved input, roped.
  RecomputeFn qk_norm_lineage(int mb, int l, bool is_q);
  /// QK-norm's backward: d of the norm's input [n, width of q or k] from `dy` (freed),
  /// accumulating the norm weight's gradient.
  Tensor qk_norm_backward(int mb, int l, bool is_q, Tensor dy);
  // The FFN block (moe_block.cpp): the dense MLP or the MoE layer.
  void ffn_forward(int l, Tensor& x, std::int64_t n, int mb, bool train, LossParts& loss);
  void ffn_backward(int l, Tensor& dx, std::int64_t n, int mb, double grad_scale);
  /// The router's rules for layer l (ModelConfig's routing fields, its expert bias).
  ops::RouterOptions router_options(int l);
  /// An MoE layer's routing of one micro-batch: the router's outputs and the dispatch plan.
  struct Routed {
    Tensor logits, probs;            ///< [n, E]: logits (activation dtype), probabilities (fp32)
    Tensor idx, w;                   ///< [n, k]: chosen experts (int32), their weights (fp32)
    Tensor counts, offsets, slot_of; ///< [E], [E + 1], [n k] int32: the dispatch plan on the device
    std::vector<std::int32_t> host_offsets, host_counts;  ///< the plan's offsets and counts on the host
    std::int64_t R = 0;              ///< assignments kept (rows of the permuted tensor)
    ops::RouterSkew skew;            ///< the injected router skew, replayed by the logits' lineage
  };
  /// Which of the experts' FC1 outputs and activation are held whole (saved or offloaded).
  struct ExpertsKept {
    bool gate = false, up = false, act = false;
  };
  /// The MoE FFN of layer l into `out` [n, d] (routed experts, then the shared expert
  /// +=): x, m and rstd are the block's input, normed input and rstd, for the saves.
  void moe_forward(int l, Tensor& x, Tensor& m, Tensor& rstd, Tensor& out, std::int64_t n, int mb, bool train,
                   LossParts& loss);
  /// Router, aux and z losses, and the dispatch plan of the normed input m [n, d].
  Routed route_forward(int l, const Tensor& m, std::int64_t n, LossParts& loss);
  /// The grouped-GEMM path: permute, dispatch, the planner's decision, the experts in
  /// chunks, combine and unpermute into out; with `train`, the experts' saves.
  void experts_forward(int l, Routed& r, Tensor& x, Tensor& m, Tensor& rstd, Tensor& out, std::int64_t n, int mb,
                       bool train);
  /// The permuted rows [R, d] of m, dispatched to this rank's experts: [Rr, d] (L: the layout).
  Tensor dispatch_forward(const Tensor& m, const Routed& r, DispatchLayout& L, std::int64_t n);
  /// The experts' SwiGLU FFN over xe [Rr, d] (per-expert offsets eoff) into ye [Rr, d],
  /// chunk by chunk; the FC1 outputs and activation into h1, h3, a where kept whole.
  void experts_ffn(int l, const Tensor& xe, const std::int32_t* eoff, std::int64_t Rr, ExpertsKept keep, Tensor& h1,
                   Tensor& h3, Tensor& a, Tensor& ye);
  /// The experts' outputs ye [Rr, d] back to their tokens' rank: [R, d] (ye itself without EP).
  Tensor combine_forward(const DispatchLayout& L, Tensor& ye, std::int64_t R);
  /// Saves the experts' entries of the ledger (with their lineages) and the layout.
  void save_experts(int l, int mb, std::int64_t n, std::int64_t R, const std::int32_t* eoff, std::int64_t Rr, Tensor& xe,
                    Tensor& h1, Tensor& h3, Tensor& a, Tensor& yp, DispatchLayout L);
  /// Saves the router's and the dispatch plan's entries of the ledger.
  void save_router(int l, int mb, Routed& r, std::int64_t n);
  /// The MoE layer's backward: dm [n, d] receives the gradient of its normed input.
  void moe_backward(int l, Tensor& dx, const Shared& dy, const Shared& m, Tensor& dm, std::int64_t n, int mb,
                    double grad_scale);
  /// Combine's backward (a dispatch), the experts' backward, dispatch's backward (a
  /// combine) and the permutation's into dm; dw [n, k] the top-k weights' gradient.
  void experts_backward(int l, int mb, Tensor& dx, const DispatchLayout& L, const Tensor& slot_of, const Tensor& w,
                        Tensor& dw, Tensor& dm, std::int64_t n, bool combine_by_chunk);
  /// The experts' output gradient [Rr, d] from the residual gradient dx.
  Shared combine_backward(const DispatchLayout& L, Tensor& dx, const Tensor& slot_of, const Tensor& w, Tensor& dw,
                          std::int64_t n, bool combine_by_chunk, int mb, int l);
  /// The experts' backward chunk by chunk: their input gradient into dxe (dye's rows, or
  /// dxe_own when W2's dW waits for dye), their weight gradients now or queued for W.
  void expert_chunks_backward(int l, int mb, Tensor& dx, const DispatchLayout& L, const Shared& dyes,
                              const Tensor& slot_of, Tensor& dw, std::int64_t n, bool combine_by_chunk,
                              Tensor& dxe_own, View& dxe);
  void swiglu_mlp_forward(CView m, Param* w1, Param* w3, Param* w2, View y, std::int64_t n, int l, int mb,
                          bool train, const char* prefix, bool accumulate);
  void swiglu_mlp_backward(const Shared& dy, const Shared& m, Param* w1, Param* w3, Param* w2, View dm,
                           std::int64_t n, int l, int mb, const char* prefix);

  /// Runs `fn` now, or queues it for backward_weight(mb) when deferring. `fn` reads
  /// the tensors of `reads` (which keep them alive until it has run) through their
  /// Tensor objects, never through pointers taken before: while queued they are
  /// relocatable (the arena may move them to defragment; see the constructor).
  void weight_grad(int mb, std::vector<Shared> reads, std::function<void()> fn);
  /// dx (= or +=) now; dW += dy^T x now or deferred. dy and x are kept alive until then.
  void linear_bw(int mb, const Shared& dy, const Shared& x, Param* w, View dx, std::int64_t n, std::int64_t in,
                 std::int64_t out, bool accumulate_dx);
  Shared share(Tensor t) { return std::make_shared<Tensor>(std::move(t)); }
  // Lineages: functions rebuilding a saved activation from earlier stash entries.
  RecomputeFn rmsnorm_lineage(int mb, int l, const char* input, const Param* w, bool want_rstd, std::int64_t n);
  RecomputeFn linear_lineage(int mb, int l, std::string input, const Param* w, std::int64_t n, std::int64_t in,
                             std::int64_t out, bool rope);
  RecomputeFn swiglu_lineage(int mb, int l, std::string gate, std::string up);
  /// A non-owning handle (aliasing constructor) for a tensor that outlives an immediate use.
  static Shared borrow(Tensor& t) { return Shared(Shared(), &t); }
  Shared copy_of(const Tensor& t, const char* name);

  ModelConfig cfg_;
  Arena& arena_;
  ops::Backend& be_;  // runs every op and every touch of tensor data (CPU or device)
  DType adt_ = DType::f32;  // activations and working weights (bf16 engine: bf16)
  ModelParallel par_;
  bool defer_wgrad_ = false;
  const ops::ImbalanceSpec* router_skew_ = nullptr;
  std::int64_t skew_step_ = 0;
  ops::ImbalanceSpec own_skew_;  // set_router_skew(ratio)
  AdaptivePlanner* planner_ = nullptr;
  const CostModel* cost_model_ = nullptr;
  const StepProgram* program_ = nullptr;
  std::int64_t batch_ = 1;  // B of the micro-batch under way (S is rope_seq_)
  /// A tensor of the block under decision, by its ledger name.
  struct Held {
    const char* name;
    const Tensor* t;
  };
  /// Every chunk's stash on this rank (the step program's), or this chunk's alone.
  std::vector<ActivationStash*> rank_stashes() {
    if (program_ && !program_->stashes.empty()) return program_->stashes;
    return {&stash_};
  }
  /// Asks the planner (if any) to decide a block's saves at `point` of layer l,
  /// projecting the rest of the step on the memory program; rows: the MoE layer's.
  /// The candidates are the ledger's entries of the point: those in `held` with
  /// their tensors' bytes, the others (computed after the decision) by the ledger's
  /// formula. Throws Error if `held` names a tensor that is not a candidate.
  void plan_saves(int mb, int l, SavePoint point, std::initializer_list<Held> held, const MoERows& rows = {});
  /// Saves `t` into the stash as ledger entry `name` of (mb, l) with its lineage,
  /// after checking its shape and dtype against the ledger's (Error if they differ
  /// or the ledger has no such entry).
  void save(int mb, int l, std::string_view name, Tensor t, RecomputeFn lineage = {});
  /// The stash's provision of chunked ledger entry `name` of (mb, l), reserved
  /// before the tensor exists (ActivationStash::reserve, sized by the ledger).
  Provision reserve(int mb, int l, std::string_view name);
  /// The ledger dims of the micro-batch under way and the MoE layer being saved.
  LedgerDims ledger_dims() const;
  MoERows saving_rows_;  // rows of the MoE layer whose saves are under way
  std::int64_t rope_seq_ = 1;  // sequence length of the current micro-batches (for RoPE in lineages)
  /// A queued weight-gradient GEMM (zero-bubble W) and the tensors it will read.
  struct PendingWeightGrad {
    std::vector<Shared> reads;
    std::function<void()> fn;
    int layer = 0;  ///< op_context().layer when queued: backward_weight runs the GEMMs by layer group
  };
  std::map<int, std::vector<PendingWeightGrad>> wgrad_queue_;
  /// Every tensor queued W work reads: its references held by the queue (and one
  /// to observe its other owners). Nothing else holding it = the queue lets the
  /// arena move it, or evict it: then its bytes wait on the host (`host`) and come
  /// back before the first queued GEMM reading it runs.
  struct QueuedReads {
    std::weak_ptr<Tensor> tensor;
    long holds = 0;
    std::shared_ptr<char> host;  // evicted: the bytes (returned to the copy engine when dropped)
    std::vector<std::int64_t> shape;
    DType dtype = DType::f32;
    MemCategory category = MemCategory::workspace;
  };
  std::unordered_map<const Tensor*, QueuedReads> wgrad_reads_;
  void count_reads(const std::vector<Shared>& reads, long sign);
  Bytes device_bytes(const Tensor& t) const;  // a queued read's bytes on this arena (evicted: when back)
  bool evict_queued_read(Tensor* t);  // Arena::EvictFn of the W queue's source
  void bring_back(Tensor* t);         // an evicted queued read, back on the device
  int relocatable_id_ = -1;  // the W queue's compaction source in arena_
  Bytes wgrad_bytes_evicted_ = 0, wgrad_bytes_offloaded_ = 0;
  /// At the start of a zero-bubble B of `mb` (with a planner and a step program):
  /// whether the planner offloads what its W will read (AdaptivePlanner::
  /// plan_weight_reads); then offload_queued_reads runs after each layer.
  bool plan_weight_reads(int mb);
  /// Offloads to the host every read of `mb`'s queued weight gradients still on the
  /// device (backward_weight brings them back). Throws Error for one held elsewhere.
  void offload_queued_reads(int mb);
  bool offload_w_reads_ = false;  // the B under way offloads its W reads layer by layer
  /// The planner's view of the rank now, for a decision at (mb, l, point): lets
  /// offloads in flight land, then takes the bytes in use and every chunk's ledger.
  BlockContext decision_context(int mb, int l, SavePoint point, const MoERows& rows);
  TokenDispatcher dispatcher_;
  std::map<std::pair<int, int>, DispatchLayout> dispatch_layouts_;  // (mb, layer) -> counts for backward
  std::vector<Param> params_;
  std::vector<LayerParams> layers_;
  Param *embed_ = nullptr, *final_norm_ = nullptr, *lm_head_ = nullptr;
  CopyEngine copy_engine_;  // declared before the stash: outlives its in-flight copies
  ActivationStash stash_;
  std::vector<RoutingStats> routing_;
  ExpertImpl expert_impl_ = ExpertImpl::grouped_gemm;
};

}  // namespace moeflex
