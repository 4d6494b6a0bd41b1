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
#include <vector>

namespace moeflex::ops {

/// A parsed `--inject-imbalance` value: which steps are skewed (mode) and how (shape).
struct ImbalanceSpec {
  /// Scoped: an unscoped enumerator `prob` would clash with the member `prob` below.
  enum class Mode { none, every, prob };
  Mode mode = Mode::none;
  int every_n = 0;          ///< Mode every: steps N, 2N, 3N, ... (1-based)
  double prob = 0.0;        ///< Mode prob: chance that a step is skewed, in (0, 1]
  double ratio = 1.0;       ///< shape hot: target imbalance of the hot group, >= 1
  std::uint64_t seed = 0;   ///< Mode prob: seed of the step set; shape dirichlet: of the draws
  /// What a skewed step looks like. hot: one group gets `ratio` x its mean load
  /// (the others keep their natural routing); zero: one group gets no assignment and
  /// the others share them evenly; zipf: group of rank r (1 = the hot one) gets a
  /// share proportional to 1 / r^s; dirichlet: shares drawn from a symmetric
  /// Dirichlet(a) per step and layer; balanced: every group the same share; replay:
  /// the shares another run's EP ranks received (replay_shares).
  enum class Shape { hot, zero, zipf, dirichlet, balanced, replay };
  Shape shape = Shape::hot;
  double shape_param = 0.0;  ///< zipf: the exponent s > 0; dirichlet: the concentration a > 0
  int hot = 0;               ///< the hot group (shape zero: the empty one); default 0
  int rotate = 0;            ///< > 0: the hot group moves to the next every `rotate` steps
  bool per_layer = false;    ///< the hot group moves to the next from one MoE layer to the next
  /// Groups are single experts (one hot expert) even under EP; else EP ranks' experts.
  bool expert_level = false;
  /// Shape replay: the loads.jsonl, or a run directory holding one, as given (replay=PATH).
  std::string replay_path;
  /// Shape replay: per recorded step, per model layer, each EP group's share (sum 1;
  /// empty for layers without MoE). Filled by the caller from replay_path
  /// (train/imbalance_replay.h), as ops/ reads no run files; skew_for refuses a replay
  /// without them. Recorded step ((s - 1) mod size) + 1 is replayed on step s.
  std::vector<std::vector<std::vector<double>>> replay_shares;
};

/// Parses "every=N:ratio=R", "prob=P:ratio=R:seed=S" (keys in any order), or "none"/""
/// (mode none), with optional shape keys: hot=G, rotate=N, per_layer=0|1,
/// level=rank|expert, and instead of ratio one of zero=G (group G gets nothing),
/// zipf=S, dirichlet=A (needs seed=S), balanced=1, replay=PATH (every step unless
/// every=N or prob=P is given; PATH holds no ':'). preset=NAME starts from a named
/// workload (kImbalancePresets) that the other keys then override. Rules: N >= 1
/// integer, 0 < P <= 1, R >= 1 finite, S a non-negative integer, G a non-negative
/// integer (checked against the group count by skew_for). Throws moeflex::ConfigError
/// naming the offending part otherwise.
ImbalanceSpec parse_imbalance(const std::string& text);

/// The named workloads of preset=NAME, as (name, the spec it stands for), after the
/// classes of Megatron-LM's MoE imbalance tests: balanced, one hot expert, a hot EP
/// rank, an EP rank with no tokens, a rotating hotspot, random bursts.
struct ImbalancePreset {
  const char* name;
  const char* spec;
};
extern const ImbalancePreset kImbalancePresets[6];

/// How one MoE layer's router is skewed on a skewed step (from skew_for).
struct RouterSkew {
  int groups = 0;              ///< expert groups (EP ranks, or experts)
  double ratio = 0.0;          ///< hot mode: target imbalance of group `hot`; <= 1 off
  int hot = 0;                 ///< hot mode: the hot group
  std::vector<double> shares;  ///< share mode: each group's share of the assignments (sum 1)
  bool active() const { return ratio > 1.0 || !shares.empty(); }
};

/// The skew of MoE layer `layer` on step `step` (1-based) for a skewed step:
/// groups = E with expert_level, else `groups` (the EP size, or E without EP); the
/// hot group is (hot + (step - 1) / rotate + layer if per_layer) mod groups. Shape
/// replay: the shares of spec.replay_shares for the step (wrapping around) and layer
/// (none for a layer without MoE). Throws ConfigError when hot is not below the group
/// count, shape zero has one group, or replay shares are missing or not `groups` long.
RouterSkew skew_for(const ImbalanceSpec& spec, std::int64_t step, int layer, std::int64_t E, int groups);

/// The imbalance a skewed step aims at (what metrics.jsonl reports as injected):
/// `ratio` for shape hot, else the largest group share times the group count, the
/// most over layers [0, layers) (skew_for's groups as for layer l).
double target_imbalance(const ImbalanceSpec& spec, std::int64_t step, int layers, std::int64_t E, int groups);

/// Skews router logits [n, E] in place as `skew` says: hot mode as
/// skew_router_logits(ratio) with group `hot` in the place of group 0; share mode by
/// skew_router_to_shares. Returns the imbalance reached (group_load_imbalance).
double skew_router_logits(float* logits, std::int64_t n, std::int64_t E, std::int64_t k, const RouterSkew& skew);

/// Skews router logits [n, E] in place so that group g (experts [g G, (g+1) G)) gets
/// round(shares[g] n k) of the n k assignments (capped at n min(k, G) each, the
/// excess going to the groups with room, largest share first). Method: tokens in
/// index order take their experts by decreasing probability from the groups whose
/// target is not yet met (a token short of k such experts takes its next most
/// probable ones); a token whose choice differs from its natural top-k gets its
/// chosen experts raised above all others by one constant, which keeps their order.
/// Deterministic. Returns the imbalance reached.
double skew_router_to_shares(float* logits, std::int64_t n, std::int64_t E, std::int64_t k,
                             const std::vector<double>& shares);

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
