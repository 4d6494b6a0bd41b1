// Routing-spike injection (`--inject-imbalance`): a schedule of steps on which the
// router is skewed, and the skew itself.
//
// Imbalance of a set of top-k assignments, over `groups` contiguous expert groups of
// G = E/groups experts each (groups = the EP size, or E when EP is 1):
//     imbalance = max_g load_g / mean_g load_g,   load_g = assignments to experts of g,
// so mean_g load_g = n*k/groups. A token can send at most b = min(k, G) of its k
// assignments to one group, hence imbalance <= groups*b/k (max_imbalance_ratio).
//
// skew_router_logits method (pure function of its inputs, no randomness):
//   1. Route the logits as they are with router_forward (softmax, top-k, ties to the
//      lower expert index) and count c_i, the assignments of token i to group 0
//      (experts [0, G)); these are token i's top c_i experts of group 0.
//   2. Target load of group 0: L* = min(round(ratio*n*k/groups), n*b). If ratio <= 1 or
//      the natural load sum_i c_i already reaches L*, the logits are left unchanged.
//   3. Otherwise the missing D = L* - sum_i c_i assignments are taken greedily from the
//      first tokens: token i (in index order) gets m_i = c_i + min(b - c_i, remaining)
//      group-0 assignments, so the last touched token may be raised only partly and the
//      group-0 load hits L* exactly (up to float ties, see below).
//   4. Raising token i to m_i: its top m_i group-0 experts (by probability, ties to the
//      lower index, i.e. a superset of the c_i it already used) get the same constant
//      C_i = max(other logits of the row) - min(their logits) + 1 added, which puts them
//      strictly above every other expert of the row and keeps their relative order. The
//      remaining k - m_i slots keep the token's natural order among the other experts,
//      which starts with its naturally chosen experts outside group 0, so exactly m_i of
//      its assignments land in group 0. Tokens not raised are not touched.
//   5. The skewed logits are routed again and the imbalance actually reached is returned
//      (another group may already exceed the target on its own; a float rounding tie in
//      the softmax could also move one assignment).
// Only the logits used for dispatch are meant to be skewed: the caller keeps the
// original logits for the router losses if it wishes.
#pragma once
#include <cstdint>
#include <string>

namespace moeflex::ops {

/// A parsed `--inject-imbalance` value.
struct ImbalanceSpec {
  /// Scoped: an unscoped enumerator `prob` would clash with the member `prob` below.
  enum class Mode { none, every, prob };
  Mode mode = Mode::none;
  int every_n = 0;          ///< Mode every: steps N, 2N, 3N, ... (1-based)
  double prob = 0.0;        ///< Mode prob: chance that a step is skewed, in (0, 1]
  double ratio = 1.0;       ///< target imbalance, >= 1
  std::uint64_t seed = 0;   ///< Mode prob: seed of the step set
};

/// Parses "every=N:ratio=R", "prob=P:ratio=R:seed=S" (keys in any order), or "none"/""
/// (mode none). Rules: N >= 1 integer, 0 < P <= 1, R >= 1 finite, S a non-negative
/// integer. Throws moeflex::ConfigError naming the offending part otherwise.
ImbalanceSpec parse_imbalance(const std::string& text);

/// Inverse of parse_imbalance (canonical key order), e.g. "every=10:ratio=2.6".
std::string format_imbalance(const ImbalanceSpec& spec);

/// Whether `step` (1-based) is skewed: mode every on steps N, 2N, ...; mode prob when
/// uniform01(seed, stream, step) < P (deterministic in (seed, step)); never for mode
/// none or step < 1.
bool imbalance_active(const ImbalanceSpec& spec, std::int64_t step);

/// The largest reachable imbalance: groups * min(k, E/groups) / k.
double max_imbalance_ratio(std::int64_t E, std::int64_t k, int groups);

/// Imbalance (max group load / mean group load) of top-k assignments topk_idx [n, k].
/// Returns 1 when n*k == 0.
double group_load_imbalance(const std::int32_t* topk_idx, std::int64_t n, std::int64_t E, std::int64_t k,
                            int groups);

/// Skews router logits [n, E] in place so that routing them gives the imbalance `ratio`
/// (capped at max_imbalance_ratio) with group 0 as the hot group; see the method above.
/// Requires 1 <= groups, E % groups == 0, 1 <= k <= E. Returns the imbalance reached
/// (that of routing the skewed logits, computed with group_load_imbalance).
double skew_router_logits(float* logits, std::int64_t n, std::int64_t E, std::int64_t k, int groups,
                          double ratio);

}  // namespace moeflex::ops
