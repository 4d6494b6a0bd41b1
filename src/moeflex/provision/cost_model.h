// The time cost model: what each op and copy of a step costs on one device, read
// from a HardwareProfile that `moeflex calibrate` measures on the machine.
//
// One model, three consumers (DESIGN.md): the planner ranks provisioning choices by
// it, the simulator (sim/) advances virtual time by it, the search scores plans by
// it. So this file knows shapes and bytes, never tensors: it includes only core/.
//
// How a time is formed:
// - GEMM: 2*M*N*K / rate(M, N, K, layout), the rate looked up in the profile's GEMM
//   table (see CostModel::gemm_rate), among the samples of the call's layout (which
//   operand is transposed) when the profile has them. The table's rates were measured
//   on whole calls, with the weight operand cold in the caches as in a real step, so
//   they already include the call overhead; nothing is added.
// - An op family with a measured table (rmsnorm, swiglu, router, permute, cross
//   entropy, the parts of rope and attention that are not GEMMs): piecewise-linear
//   interpolation in the bytes the op moves (op_bytes:: below), between (0 bytes,
//   launch_overhead) and the measured points, and at the last point's rate beyond.
// - Any other elementwise work: the op_names::kElementwise table (a streaming y += x,
//   whose speed steps down as its operands outgrow each cache level) when the profile
//   has one, else launch_overhead + bytes / memory_bandwidth.
// - Copies host <-> device: their table when measured (from (0 bytes, copy_latency)),
//   else copy_latency + bytes / bandwidth of that direction.
// Bytes are fp32 activations (kActivationBytes); a zero-sized op costs 0 (the
// kernels return before launching anything).
#pragma once
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "moeflex/core/units.h"

namespace moeflex {

/// Bytes per activation element: fp32 on every backend for now.
inline constexpr Bytes kActivationBytes = 4;

/// The profile file's format tag and version. Version 2 added the GEMM samples'
/// "layout"; version 1 files (no layouts) are still read, their samples as
/// GemmLayout::any.
inline constexpr const char* kHardwareProfileFormat = "moeflex-hardware-profile";
inline constexpr int kHardwareProfileVersion = 2;
inline constexpr int kHardwareProfileOldestVersion = 1;

/// Which operand of a row-major GEMM C = op(A) @ op(B) is transposed, as the kernels
/// call ops::gemm: nt = A @ B^T (linear forward, attention scores), nn = A @ B (input
/// gradients, attention's weighted sum), tn = A^T @ B (weight gradients). BLAS packs
/// the operands differently for each, so a profile may measure them apart. `any`:
/// a sample measured without a layout (version 1 files, derived profiles), or a
/// query that takes whatever sample fits best.
enum class GemmLayout { any, nt, nn, tn };

/// "any", "nt", "nn", "tn".
const char* to_string(GemmLayout layout);

/// The op families that may carry a measured table in HardwareProfile::op_tables.
namespace op_names {
inline constexpr const char* kRmsnormForward = "rmsnorm_forward";
inline constexpr const char* kRmsnormBackward = "rmsnorm_backward";
inline constexpr const char* kRope = "rope";                 ///< the rotation, beyond its tables; forward = backward
inline constexpr const char* kRopeTables = "rope_tables";    ///< building the cos/sin tables of one call
inline constexpr const char* kSwigluForward = "swiglu_forward";
inline constexpr const char* kSwigluBackward = "swiglu_backward";
inline constexpr const char* kRouterForward = "router_forward";
inline constexpr const char* kRouterBackward = "router_backward";
inline constexpr const char* kPermuteForward = "permute_forward";
inline constexpr const char* kPermuteBackward = "permute_backward";
inline constexpr const char* kUnpermuteForward = "unpermute_forward";
inline constexpr const char* kUnpermuteBackward = "unpermute_backward";
inline constexpr const char* kCrossEntropyForward = "cross_entropy_forward";
inline constexpr const char* kCrossEntropyBackward = "cross_entropy_backward";
/// Attention beyond its per-head GEMMs (the causal softmax and its backward); used
/// only without the whole-op tables below (profiles of version 1).
inline constexpr const char* kAttentionSoftmaxForward = "attention_softmax_forward";
inline constexpr const char* kAttentionSoftmaxBackward = "attention_softmax_backward";
/// Attention whole, per head (measured on a few sequences of the calibrated model's
/// heads and head_dim, divided by sequences x heads), x =
/// op_bytes::attention_softmax_forward(1, S, 1): the kernel runs B x H independent
/// heads, so a call costs B x H times the table's time.
inline constexpr const char* kAttentionForward = "attention_forward";
inline constexpr const char* kAttentionBackward = "attention_backward";
/// One rank's per-step parameter work in the trainer (zero_grads, the global norm's
/// square sums, the clip's scaling, AdamW::step), x = 4 x parameters (fp32 bytes of
/// the weights); measured by `moeflex calibrate`, read by the simulator.
inline constexpr const char* kOptimizerStep = "optimizer_step";
/// The optimizer's kernels, one call on one parameter tensor of n floats, x = 4 n
/// (fp32 bytes of the tensor): Backend::adamw, Backend::square_sum (the global
/// norm's partial sums) and Backend::scale (the clip). Compute-bound on CPUs (sqrt,
/// divide, a double sum), so they are timed rather than priced as streaming bytes.
inline constexpr const char* kAdamW = "adamw";
inline constexpr const char* kSquareSum = "square_sum";
inline constexpr const char* kScale = "scale";
/// Generic streaming work (residual adds, copies within the device, zero fills):
/// y += x measured over sizes, x = bytes read plus written.
inline constexpr const char* kElementwise = "elementwise";
/// Copies: memcpy speed depends on whether the block fits the caches, so a measured
/// table refines the scalar bandwidths when present.
inline constexpr const char* kCopyH2D = "copy_h2d";
inline constexpr const char* kCopyD2H = "copy_d2h";

/// Every name above: an op table of a profile is one of them.
inline constexpr const char* kAll[] = {kRmsnormForward,
                                       kRmsnormBackward,
                                       kRope,
                                       kRopeTables,
                                       kSwigluForward,
                                       kSwigluBackward,
                                       kRouterForward,
                                       kRouterBackward,
                                       kPermuteForward,
                                       kPermuteBackward,
                                       kUnpermuteForward,
                                       kUnpermuteBackward,
                                       kCrossEntropyForward,
                                       kCrossEntropyBackward,
                                       kAttentionSoftmaxForward,
                                       kAttentionSoftmaxBackward,
                                       kAttentionForward,
                                       kAttentionBackward,
                                       kOptimizerStep,
                                       kAdamW,
                                       kSquareSum,
                                       kScale,
                                       kElementwise,
                                       kCopyH2D,
                                       kCopyD2H};
}  // namespace op_names

/// Bytes each op family reads plus writes: the x axis of its op table. Calibration
/// and the cost model both use these, so a table means the same thing to both.
namespace op_bytes {
/// y += x over n elements: y read and written, x read.
Bytes add_inplace(std::int64_t n);
/// x, y: [n, d]; w: [d]; rstd: [n].
Bytes rmsnorm_forward(std::int64_t n, std::int64_t d);
/// dy, x, dx: [n, d]; w, dw: [d]; rstd: [n].
Bytes rmsnorm_backward(std::int64_t n, std::int64_t d);
/// x: [B, S, H, hd] read and written in place.
Bytes rope(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t hd);
/// The cos and sin tables, [S, hd/2] each.
Bytes rope_tables(std::int64_t S, std::int64_t hd);
/// gate, up, out: [n].
Bytes swiglu_forward(std::int64_t n);
/// dout, gate, up, dgate, dup: [n].
Bytes swiglu_backward(std::int64_t n);
/// logits, probs: [n, E]; topk_idx, topk_w: [n, k].
Bytes router_forward(std::int64_t n, std::int64_t E, std::int64_t k);
/// dtopk_w, topk_idx: [n, k]; probs, dlogits: [n, E].
Bytes router_backward(std::int64_t n, std::int64_t E, std::int64_t k);
/// x: [n, d] read once per kept slot; xp: [n*k, d]; slot_of: [n*k].
Bytes permute(std::int64_t n, std::int64_t k, std::int64_t d);
/// logits, probs: [n, V]; targets, losses: [n].
Bytes cross_entropy(std::int64_t n, std::int64_t V);
/// probs: [B, H, S, S], written then read by the second GEMM.
Bytes attention_softmax_forward(std::int64_t B, std::int64_t S, std::int64_t H);
/// probs read, dP written and rewritten: [B, H, S, S].
Bytes attention_softmax_backward(std::int64_t B, std::int64_t S, std::int64_t H);
}  // namespace op_bytes

/// One measured GEMM: C[M,N] = op(A)[M,K] @ op(B)[K,N] at `rate` FLOP/s (2*M*N*K
/// FLOPs), called with `layout`.
struct GemmSample {
  std::int64_t M = 0;
  std::int64_t N = 0;
  std::int64_t K = 0;
  FlopsPerSecond rate = 0;
  GemmLayout layout = GemmLayout::any;
};

/// One measured op invocation: it moved `bytes` (op_bytes::) in `seconds`.
struct OpSample {
  Bytes bytes = 0;
  Seconds seconds = 0;
};

/// The op kinds HardwareProfile::in_situ_ops may hold, timed at their exact shapes
/// (op_times.json's names; `moeflex calibrate --from-run` takes these kinds).
inline constexpr const char* kInSituExactKinds[] = {
    "linear_forward",     "linear_backward",       "linear_backward_dx",     "linear_backward_dw", "attention_forward",
    "attention_backward", "rmsnorm_forward",       "rmsnorm_backward",       "swiglu_forward",     "swiglu_backward",
    "router_forward",     "router_backward",       "permute_forward",        "permute_backward",   "unpermute_forward",
    "unpermute_backward", "cross_entropy_forward", "cross_entropy_backward", "rope_forward",       "rope_backward",
    "add_inplace",        "embedding_forward",     "embedding_backward",     "aux_loss_forward",   "aux_loss_backward",
    "z_loss_forward",     "z_loss_backward"};
/// The grouped kinds HardwareProfile::in_situ_scales may hold, one scale per weight
/// shape [in, out].
inline constexpr const char* kInSituScaledKinds[] = {"grouped_linear_forward", "grouped_linear_backward_dx",
                                                     "grouped_linear_backward_dw"};

/// The number of extents an exact in-situ kind's shape has, as the cost model looks
/// it up (linear_* [n, in, out], attention_* [B, S, H, hd], rmsnorm_* [n, d],
/// swiglu_* [n], router_* [n, E, k], (un)permute_* [n, k, d], cross_entropy_* [n, V],
/// rope_* [B, S, H, hd], add_inplace [n], embedding_* [n, d], aux_loss_* [n, E, k],
/// z_loss_* [n, E]);
/// 0 for a kind outside kInSituExactKinds.
std::size_t in_situ_shape_rank(const std::string& kind);

/// Bounds a profile's in-situ entries must respect (HardwareProfile::from_json
/// refuses others, `moeflex calibrate --from-run` refuses to write them): an op's
/// seconds in (0, kInSituMaxSeconds], a grouped scale in [kInSituMinScale, kInSituMaxScale].
inline constexpr double kInSituMaxSeconds = 3600;
inline constexpr double kInSituMinScale = 1e-3;
inline constexpr double kInSituMaxScale = 1e3;

/// One op timed inside real training steps (`moeflex calibrate --from-run`): the
/// median of its measured times at exactly this shape, the shape in the order
/// op_times.json lists it (the ops/ headers' arguments, e.g. linear [n, in, out]).
struct InSituOp {
  std::string kind;  ///< op_times.json's kind, e.g. "linear_backward_dw"
  std::vector<std::int64_t> shape;
  Seconds seconds = 0;
};

/// A grouped-GEMM kind's measured / modelled time in real training steps, for one
/// weight shape [in, out] (its rows per group vary with the routing, so a ratio
/// carries over where exact shapes would not).
struct InSituScale {
  std::string kind;  ///< grouped_linear_forward, grouped_linear_backward_dx or _dw
  std::int64_t in = 0;
  std::int64_t out = 0;
  double scale = 1;
};

/// What one device of this machine does, as measured by `moeflex calibrate` (or
/// written by hand for a machine we only simulate). Saved as JSON.
struct HardwareProfile {
  std::string name;                 ///< free text, e.g. the host and the backend
  /// The device the numbers were measured on: "cpu" (the CPU backend; `moeflex
  /// calibrate` writes this, and files without the field are read as it) or "cuda".
  /// The trainer does not price a run on one device with another's profile.
  std::string device = "cpu";
  /// The OpenBLAS kernel set a CPU profile was measured with ("SkylakeX", ...;
  /// ops::blas_core_name); "" when unknown (files before the field, GPU profiles).
  std::string blas_core;
  int threads = 1;                  ///< OpenMP/BLAS threads the numbers were measured with
  std::vector<GemmSample> gemm;     ///< GEMM throughput by shape (at least one sample)
  BytesPerSecond memory_bandwidth = 0;  ///< streaming elementwise ops (reads + writes)
  Seconds launch_overhead = 0;      ///< fixed cost of one op call (an OpenMP region, a kernel launch)
  BytesPerSecond h2d_bandwidth = 0;     ///< host -> device copies (CPU: memcpy host pool -> arena)
  BytesPerSecond d2h_bandwidth = 0;     ///< device -> host copies (CPU: memcpy arena -> host pool)
  Seconds copy_latency = 0;         ///< fixed cost of one copy
  /// Per-rank all-to-all bandwidth (bytes to each peer / time, pairwise exchange) and
  /// the fixed cost of one all-to-all, as `mpirun -np N moeflex calibrate` measures
  /// them between its ranks (profile/calibrate_system.cpp, measure_link); 0 = not measured (one process).
  BytesPerSecond all_to_all_bandwidth = 0;
  Seconds all_to_all_latency = 0;
  /// Throughput of single-threaded compute when twice as many processes as cores,
  /// free to migrate, share the host's cores (as `mpirun --oversubscribe` runs them),
  /// over the ideal equal split of the calibrated per-core rate: time slicing,
  /// migrations and the caches they cool cost the rest (profile/calibrate_system.cpp,
  /// measure_time_sharing; 0.955-0.988 on this 2-core VM). In (0, 1]; 1 = not measured.
  /// The simulator's CoreSharing applies it whenever processes outnumber cores.
  double time_sharing_efficiency = 1.0;
  /// What a rank napping through a wait (comm/wait_policy.h) costs a rank computing
  /// on the same core, per nap: core-seconds the computing rank loses (the nap's
  /// system call, two context switches, the caches it refills), and the wall time a
  /// nap lasts beyond the one asked for (timer slack and wake-up). Measured with
  /// both on one core (profile/calibrate_system.cpp, measure_nap_cost; here 22-28 us and 70 us
  /// for 100 us naps). 0 = not measured: the simulator's CoreSharing then counts
  /// a sleeping rank as free.
  Seconds nap_cost = 0;
  Seconds nap_overshoot = 0;
  /// Optional per-op-family tables (op_names::), points sorted by bytes. A family
  /// without a table is costed as generic elementwise work.
  std::map<std::string, std::vector<OpSample>> op_tables;
  /// Optional in-situ measurements (`moeflex calibrate --from-run RUN`): ops of a
  /// real step at their exact shapes, which the cost model answers before its
  /// tables, and grouped-GEMM scales; `in_situ_source` names the run.
  std::string in_situ_source;
  std::vector<InSituOp> in_situ_ops;
  std::vector<InSituScale> in_situ_scales;

  /// The JSON document (see HardwareProfile::from_json for the fields).
  nlohmann::json to_json() const;
  /// Parses and checks a profile; `source` (a file name) starts every error.
  /// Throws DataError naming the source and the field.
  static HardwareProfile from_json(const nlohmann::json& j, const std::string& source);

  /// Writes the JSON to `path`, creating its folder. Throws DataError on I/O failure.
  void save(const std::filesystem::path& path) const;
  /// Reads a profile written by save(). Throws DataError naming the file and the field.
  static HardwareProfile load(const std::filesystem::path& path);
};

/// Times of ops and copies on one device, from a HardwareProfile. Immutable after
/// construction, so concurrent readers need no lock.
class CostModel {
 public:
  /// Indexes the profile's GEMM table. Throws DataError (source "profile") when the
  /// profile has no GEMM samples or a non-positive rate or bandwidth.
  explicit CostModel(HardwareProfile profile);

  const HardwareProfile& profile() const { return profile_; }

  // ---- primitives ------------------------------------------------------------

  /// FLOP/s of a GEMM of this shape. Steps 1 and 2 look first among the samples of
  /// `layout` (unless it is `any`), then among all samples:
  /// 1. a sample of exactly this shape: its rate (samples of one shape: mean time;
  ///    a line's times made nondecreasing first, see make_nondecreasing);
  /// 2. samples that share two of the three extents with the query (a "line" along
  ///    the third): time is interpolated linearly in the free extent between the two
  ///    samples around it (GEMM time is close to affine between tile steps); outside
  ///    the line's range, the nearest end's rate is kept;
  /// 3. otherwise the four samples nearest in log2(M), log2(N), log2(K): an average
  ///    of log(rate) weighted by 1 / distance^2.
  FlopsPerSecond gemm_rate(std::int64_t M, std::int64_t N, std::int64_t K, GemmLayout layout = GemmLayout::any) const;

  /// One GEMM C[M,N] = op(A)[M,K] @ op(B)[K,N]: 2*M*N*K / gemm_rate. 0 when M or N
  /// is 0; an elementwise pass over C when K is 0.
  Seconds gemm(std::int64_t M, std::int64_t N, std::int64_t K, GemmLayout layout = GemmLayout::any) const;

  /// One GEMM per group of rows_per_group[g] rows against an [N, K] weight, as the
  /// grouped linear kernel runs them. Empty groups cost 0: the kernel skips them
  /// without calling BLAS, so no overhead is paid for an expert that got no token.
  Seconds grouped_gemm(const std::vector<std::int64_t>& rows_per_group, std::int64_t N, std::int64_t K,
                       GemmLayout layout = GemmLayout::any) const;

  /// Generic elementwise work: the op_names::kElementwise table when the profile has
  /// one, else launch_overhead + bytes / memory_bandwidth (0 for 0 bytes).
  Seconds elementwise(Bytes bytes_moved) const;

  /// Copy of `bytes` host -> device (prefetch) and device -> host (offload): the
  /// op_names::kCopyH2D / kCopyD2H table when the profile has one, else
  /// copy_latency + bytes / h2d_bandwidth (d2h_bandwidth).
  Seconds copy_h2d(Bytes bytes) const;
  Seconds copy_d2h(Bytes bytes) const;

  /// An op family's time for `bytes` (op_bytes::): its table when the profile has
  /// one, else elementwise(bytes).
  Seconds op(const std::string& name, Bytes bytes) const;

  // ---- the model's ops (shapes as in the ops/ headers) ------------------------

  Seconds rmsnorm_forward(std::int64_t n, std::int64_t d) const;
  Seconds rmsnorm_backward(std::int64_t n, std::int64_t d) const;
  /// x: [B, S, H, hd] rotated in place, from the op tables (forward and backward alike).
  Seconds rope(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t hd) const;
  /// rope() unless the profile holds the run's own time of rope_forward / rope_backward
  /// at [B, S, H, hd] (HardwareProfile::in_situ_ops).
  Seconds rope_forward(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t hd) const;
  Seconds rope_backward(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t hd) const;
  /// y += x over n elements: elementwise() of 3n words (reads y and x, writes y), or
  /// in situ at [n].
  Seconds add_inplace(std::int64_t n) const;
  /// The embedding's gather of n rows of d (reads and writes n x d) and its backward's
  /// scatter-add into the table (reads two, writes one n x d); in situ at [n, d].
  Seconds embedding_forward(std::int64_t n, std::int64_t d) const;
  Seconds embedding_backward(std::int64_t n, std::int64_t d) const;
  /// The router's load-balancing loss over probs [n, E] and top-k [n, k]: (E + k) n
  /// words each way; in situ at [n, E, k].
  Seconds aux_loss_forward(std::int64_t n, std::int64_t E, std::int64_t k) const;
  Seconds aux_loss_backward(std::int64_t n, std::int64_t E, std::int64_t k) const;
  /// The router's z-loss over logits [n, E] (ST-MoE): n E words read forward, and read
  /// and written backward; in situ at [n, E] (its exp and log make it slower than its
  /// bytes say, which only the in-situ time sees).
  Seconds z_loss_forward(std::int64_t n, std::int64_t E) const;
  Seconds z_loss_backward(std::int64_t n, std::int64_t E) const;
  /// B x H times the op_names::kAttentionForward table (per head) when the profile
  /// has it; else per head (b, h): S x S x hd scores GEMM (nt), softmax, S x hd x S
  /// output GEMM (nn).
  Seconds attention_forward(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t hd) const;
  /// Likewise from op_names::kAttentionBackward; else per head: four GEMMs (dV tn,
  /// dP nt, dQ nn, dK tn) and the softmax backward.
  Seconds attention_backward(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t hd) const;
  /// n elements of gate, up and out.
  Seconds swiglu_forward(std::int64_t n) const;
  Seconds swiglu_backward(std::int64_t n) const;
  /// Softmax and top-k over [n, E] logits (the router's GEMM is a linear_forward).
  Seconds router_forward(std::int64_t n, std::int64_t E, std::int64_t k) const;
  Seconds router_backward(std::int64_t n, std::int64_t E, std::int64_t k) const;
  /// Token permutation into expert order, [n, d] -> [n*k, d], and its inverse (combine).
  Seconds permute_forward(std::int64_t n, std::int64_t k, std::int64_t d) const;
  Seconds permute_backward(std::int64_t n, std::int64_t k, std::int64_t d) const;
  Seconds unpermute_forward(std::int64_t n, std::int64_t k, std::int64_t d) const;
  Seconds unpermute_backward(std::int64_t n, std::int64_t k, std::int64_t d) const;
  /// The top-k weights' gradient over one window of `rows` expert-output rows
  /// (ops::combine_topk_grad): reads those rows and their tokens' gradient rows, and
  /// scans the n*k slots; a streaming pass.
  Seconds combine_topk_grad(std::int64_t n, std::int64_t k, std::int64_t d, std::int64_t rows) const;
  Seconds cross_entropy_forward(std::int64_t n, std::int64_t V) const;
  Seconds cross_entropy_backward(std::int64_t n, std::int64_t V) const;
  /// y[n, out] = x[n, in] @ w[out, in]^T (nt).
  Seconds linear_forward(std::int64_t n, std::int64_t in, std::int64_t out) const;
  /// dx = dy @ w (nn, when want_dx) and dw += dy^T @ x (tn, when want_dw).
  Seconds linear_backward(std::int64_t n, std::int64_t in, std::int64_t out, bool want_dx = true,
                          bool want_dw = true) const;
  /// Grouped linear over experts: group g has rows_per_group[g] rows.
  Seconds grouped_linear_forward(const std::vector<std::int64_t>& rows_per_group, std::int64_t in,
                                 std::int64_t out) const;
  Seconds grouped_linear_backward(const std::vector<std::int64_t>& rows_per_group, std::int64_t in,
                                  std::int64_t out, bool want_dx = true, bool want_dw = true) const;

 private:
  /// The in-situ time of `kind` at exactly `shape`, or null (HardwareProfile::in_situ_ops).
  const Seconds* in_situ(const char* kind, std::initializer_list<std::int64_t> shape) const;
  /// The in-situ scale of a grouped kind with weight [in, out]; 1 without one.
  double in_situ_scale(const char* kind, std::int64_t in, std::int64_t out) const;

  /// A GEMM sample's extents with one axis left out, the key of a line along it.
  using LineKey = std::pair<std::int64_t, std::int64_t>;
  /// Points (free extent, seconds) of one line, sorted by the extent.
  using Line = std::vector<std::pair<std::int64_t, Seconds>>;
  /// The lines of one pool of samples: along M (key N,K), along N (key M,K), along K (key M,N).
  using Lines = std::map<LineKey, Line>[3];

  /// Steps 1 and 2 of gemm_rate on one pool; false when no line of it passes
  /// through the query.
  static bool line_rate(const Lines& lines, std::int64_t M, std::int64_t N, std::int64_t K, FlopsPerSecond* rate);

  /// Piecewise-linear time of `bytes` on a table, starting from (0 bytes, zero_time).
  static Seconds table_time(const std::vector<OpSample>& points, Bytes bytes, Seconds zero_time);

  HardwareProfile profile_;
  std::map<std::pair<std::string, std::vector<std::int64_t>>, Seconds> in_situ_ops_;
  std::map<std::tuple<std::string, std::int64_t, std::int64_t>, double> in_situ_scales_;
  Lines lines_[4];  ///< indexed by GemmLayout: [any] holds every sample, the others their layout's
};

/// Replaces `t` by the nondecreasing sequence closest to it in least squares (the
/// pool-adjacent-violators algorithm): runs that fall are replaced by their mean.
/// The cost model applies it to every GEMM line and op table, whose times cannot
/// fall as the work grows (a measured fall is noise), so interpolation never
/// predicts less time for more work.
void make_nondecreasing(std::vector<Seconds>& t);

/// The exposed part of `extra` work (an offload or a prefetch) that runs beside
/// `available` seconds of compute it can hide under: max(0, extra - available).
Seconds overlapped(Seconds extra, Seconds available);

}  // namespace moeflex
