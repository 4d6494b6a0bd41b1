// The model's parameter tensors, layer by layer: the one list the engine allocates
// (MoEModel's constructor) and the simulator counts (sim/params.cpp), with the
// safetensors names of docs/model.md.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "moeflex/model/config.h"

namespace moeflex {

/// How tensor parallelism (Megatron-Core, with sequence parallelism) divides a
/// parameter over tp ranks: not at all (norms, the router, MLA's down projections),
/// evenly (attention heads, MLP widths, the vocabulary), or by whole key/value heads
/// (at least one a rank: ModelConfig::kv_heads_per_rank).
enum class TpSplit : std::uint8_t { none, even, kv_heads };

/// One parameter tensor.
struct ParamSpec {
  std::string name;                 ///< safetensors key
  std::vector<std::int64_t> shape;  ///< the whole tensor's ([out, in]; experts: [local experts, out, in])
  bool no_decay = false;            ///< excluded from weight decay (norm weights)
  bool expert = false;              ///< routed-expert weights: sharded over EP
  TpSplit split = TpSplit::none;
  /// A buffer, not trained: initialised to zero and moved by its own rule (the
  /// noaux_tc expert bias). No gradient reaches it (its gradient stays zero) and
  /// AdamW skips it; it is saved and restored with the weights.
  bool buffer = false;

  /// Elements one of `tp` tensor-parallel ranks holds (double: the simulator's unit).
  double numel_per_rank(const ModelConfig& cfg, int tp) const;
};

/// The parameters of transformer layer `layer`, in the order the engine allocates
/// them: input norm, attention (q, k, v, o and QK-norm's weights; MLA's down and up projections and latent
/// norms), post-attention norm, then the router (and its noaux_tc bias), the `local_experts` routed experts
/// (stacked) and the shared expert, or the dense MLP.
std::vector<ParamSpec> layer_parameters(const ModelConfig& cfg, int layer, std::int64_t local_experts);

/// The token embedding [V, d].
ParamSpec embedding_parameter(const ModelConfig& cfg);
/// The final norm [d].
ParamSpec final_norm_parameter(const ModelConfig& cfg);
/// The LM head [V, d] (untied; a tied head reuses the embedding).
ParamSpec lm_head_parameter(const ModelConfig& cfg);

}  // namespace moeflex
