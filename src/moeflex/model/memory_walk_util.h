// Helpers of the memory walk's two files (memory_plan.cpp, memory_walk_blocks.cpp):
// activation ids of literal names interned once per call site, and arena sizes.
#pragma once
#include <array>
#include <initializer_list>
#include <string_view>
#include <vector>

#include "moeflex/core/arena.h"
#include "moeflex/model/ledger.h"

namespace moeflex::walk {

/// The activation id of a literal name, interned once per call site.
#define ID(name) ([]() -> int { static const int id_ = activation_id(name); return id_; }())
/// The ids of literal names, interned once per call site.
#define IDS(...)                                                                    \
  ([]() -> const std::vector<int>& {                                                \
    static const std::vector<int> ids_ = [] {                                       \
      std::vector<int> v;                                                           \
      for (std::string_view n : std::initializer_list<std::string_view>{__VA_ARGS__}) \
        v.push_back(activation_id(n));                                              \
      return v;                                                                     \
    }();                                                                            \
    return ids_;                                                                    \
  }())

/// Arena bytes of a tensor of `numel` elements of `elem` bytes each (f32 and i32: 4;
/// activations: ModelConfig::activation_bytes(), 2 in the bf16 engine).
inline Bytes rounded(std::int64_t numel, Bytes elem) { return Arena::round_up(std::max<Bytes>(1, numel * elem)); }


/// The config's sizes the ledger's formulas read (LedgerDims::of), then `extra`: a
/// memo key for what a walk derives from a layer kind (its specs, its summary).
/// The config fields a config_key holds before `extra`.
inline constexpr std::size_t kConfigKeyFields = 16;

template <std::size_t N>
std::array<std::int64_t, kConfigKeyFields + N> config_key(const ModelConfig& cfg,
                                                          const std::array<std::int64_t, N>& extra) {
  const bool shared = cfg.n_shared_experts > 0 || cfg.shared_expert_intermediate_size > 0;
  const std::int64_t qk_norm = cfg.qk_norm == "head" ? 1 : cfg.qk_norm == "full" ? 2 : 0;
  std::array<std::int64_t, kConfigKeyFields + N> k{
      cfg.hidden_size,       cfg.num_attention_heads, cfg.q_width(),        cfg.k_width(),
      cfg.v_width(),         cfg.attn_out_width(),    cfg.num_experts,      cfg.num_experts_per_tok,
      cfg.moe_intermediate_size, cfg.intermediate_size, shared ? cfg.shared_width() : -1, cfg.vocab_size,
      cfg.q_lora_rank,       cfg.kv_lora_rank,        cfg.qk_rope_head_dim, qk_norm};
  for (std::size_t i = 0; i < N; ++i) k[kConfigKeyFields + i] = extra[i];
  return k;
}

}  // namespace moeflex::walk
