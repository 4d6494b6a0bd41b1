// The discrete-event simulator (DESIGN.md "One plan, three consumers"): it runs
// the step plan the engine executes (schedule/, the same generators) in virtual
// time, pricing every action with the engine's cost model (layer_cost over a
// CostModel), the network with the topology's collective formulas (cluster.h),
// and device memory with the engine's own allocation replay (MemoryWalk).
//
// Resources per simulated rank: a compute stream, which also runs the blocking
// collectives inside a layer (the expert-parallel all-to-alls and TP collectives,
// as the executor does: they are on the critical path); a send queue on the
// network for the pipeline's point-to-point messages (non-blocking sends, a Recv
// waits for its message); the data-parallel gradient reduction after the last
// backward; the optimizer step.
//
// Symmetry: all ranks of one pipeline stage run the same actions; the expert
// all-to-alls make every rank of an EP group wait for the most loaded one, so one
// representative per pipeline rank carries the time, at the hottest rank's load.
// Memory differs by load, so each pipeline rank is walked twice: at the hottest
// EP rank's loads (the same rank taking every micro-batch's maximum: an upper
// bound) and at balanced loads. A replay of a run's loads.jsonl instead walks
// every data-parallel rank at its own recorded rows (each rank's peak exact, as
// the run's arena saw it); time still follows the hottest rank, since the
// all-to-alls make the EP group wait for it. One iteration of any cluster is pp
// ranks' work (times dp walks in a per-rank replay).
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <memory>
#include <tuple>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "moeflex/core/units.h"
#include "moeflex/model/config.h"
#include "moeflex/model/layer_cost.h"
#include "moeflex/schedule/plan.h"
#include "moeflex/sim/cluster.h"
#include "moeflex/sim/loads.h"

namespace moeflex::sim {

/// The most devices a simulated layout may have (well beyond any cluster; keeps
/// every rank count and product of sizes inside 32-bit integers).
inline constexpr std::int64_t kMaxSimulatedDevices = 1 << 24;

/// The parallel layout: world = tp x pp x dp, vpp chunks per rank. The expert layers
/// see a stage's tp x dp ranks as ep x expert_dp (Megatron-Core's MoE parallel
/// folding with expert tensor parallelism 1: the routed experts are whole on every
/// rank, each rank dispatches its own n / tp tokens), so ep divides tp x dp, and may
/// exceed dp. Rank order tp-ep-dp-pp for the expert layers: an EP group is ep
/// consecutive ranks, an expert-data-parallel group strides by ep.
struct ParallelSpec {
  int tp = 1, pp = 1, vpp = 1, ep = 1, dp = 1;
  int world() const { return tp * pp * dp; }
  /// Parses "tp=1,pp=4,vpp=2,ep=8,dp=16" (any subset over the defaults); ConfigError otherwise.
  static ParallelSpec parse(const std::string& s);
  std::string str() const;
};

/// Where the expert-parallel group (the dispatch/combine all-to-all) lives: ep
/// consecutive ranks.
GroupPlacement expert_parallel_placement(const ParallelSpec& par, int gpus_per_node);

/// Where the expert-data-parallel group (the routed experts' gradient all-reduce and
/// optimizer sharding) lives: tp x dp / ep ranks, ep apart.
GroupPlacement expert_data_parallel_placement(const ParallelSpec& par, int gpus_per_node);

/// Parses --trace-ranks "0,3" (empty items skipped) into pipeline ranks; ConfigError
/// naming the flag and the item that is not a non-negative integer.
std::vector<int> parse_trace_ranks(const std::string& s);

/// The provisioning levels the simulated adaptive policy climbs, cheapest first.
const std::vector<std::string>& adaptive_levels();

/// State that may be shared by many simulations of one model on one cluster (the
/// search): the cost model, built once, and layer times by shape.
struct SimCache {
  explicit SimCache(const HardwareProfile& profile) : cost(profile) {}
  CostModel cost;
  std::mutex mu;  ///< guards `layers` (the search's timing pass shares one cache between threads)
  /// (tp, B, S, ep, split backward, layer is MoE, rows received, with a breakdown) -> times.
  std::map<std::tuple<int, std::int64_t, std::int64_t, int, bool, bool, std::int64_t, bool>, LayerCost> layers;
};

struct SimOptions {
  ModelConfig model;
  ClusterSpec cluster;
  ParallelSpec parallel;
  std::string schedule = "1f1b";
  std::string policy = "none";       ///< a static policy name, threshold[=R], or adaptive
  std::int64_t micro_batch_size = 1; ///< B, sequences per micro-batch
  std::int64_t seq_len = 4096;       ///< S
  /// Sequences per iteration; 0: dp x B x the recorded micro-batches of a per-rank
  /// replay (loads.jsonl: the run's grad_accum), else dp x B x 4 pp.
  std::int64_t global_batch = 0;
  int iterations = 1;
  LoadModel loads;
  Seconds restart_seconds = 284;     ///< one cold restart after an OOM (BaGuaLu-2)
  int checkpoint_interval = 50;      ///< iterations between checkpoints: an OOM loses the ones since
  Bytes memory_limit = 0;            ///< per-rank bytes; 0: the cluster's usable memory
  /// Pipeline ranks whose timeline goes into the trace (empty: none).
  std::vector<int> trace_ranks;
  /// The token dispatcher the expert all-to-alls are priced as: "alltoall" (every
  /// row sent to its expert's rank, all_to_all_time) or "deepep" (each token once per
  /// node, then NVLink: dedup_all_to_all_time). ConfigError otherwise.
  std::string dispatcher = "alltoall";
  /// true: the executor overlaps an overlapped F&B pair's all-to-alls with the
  /// other half's compute (DualPipe on GPUs); the CPU engine does not.
  bool overlap_pair_comm = false;
  /// false: skip the memory walks (times only; adaptive then runs at level none).
  bool walk_memory = true;
  /// > 0: also walk each rank with micro-batch 0 at this ratio and the others at
  /// the iteration's loads, into SimReport::spike_peak_bytes (the search's OOM check);
  /// adaptive gives micro-batch 0 the cheapest level from its calm one up that fits
  /// (the most-saving one when none does), as it provisions a spike.
  double spike_check = 0;
  /// Shared cost model and layer times (the search); null: the simulation builds its own.
  std::shared_ptr<SimCache> cache;
  /// Also fill SimReport::ops: the priced op stream by phase and kind.
  bool breakdown = false;

  /// Micro-batches per iteration: global_batch / (dp x B); ConfigError when it does not
  /// divide, or when it exceeds kMaxMicrobatches.
  int num_microbatches() const;
  /// The most micro-batches per iteration simulated: far beyond real runs (DeepSeek-V3's
  /// 15,360 sequences over dp 32 are 480), and each costs the plan's memory and time.
  static constexpr std::int64_t kMaxMicrobatches = 16384;
};

/// One simulated pipeline rank.
struct RankReport {
  int pp_rank = 0;
  Bytes persistent_bytes = 0;  ///< weights, gradients, optimizer state
  /// At the hottest EP rank's loads of every micro-batch (an upper bound), max over
  /// iterations; with a per-rank replay (loads.jsonl), the max of dp_rank_peak_bytes (exact).
  Bytes peak_bytes = 0;
  /// Per-rank replays only: each data-parallel rank's peak at its own recorded loads.
  std::vector<Bytes> dp_rank_peak_bytes;
  Bytes peak_balanced_bytes = 0;  ///< at balanced loads
  Seconds busy = 0;            ///< compute (incl. blocking collectives) in the last iteration
  Seconds comm = 0;            ///< of which blocking collectives
  Seconds idle = 0;            ///< waiting on the pipeline in the last iteration
};

struct SimReport {
  SimOptions options;
  int num_microbatches = 0;
  std::vector<int> stage_layers;      ///< layers per global stage (padding layers included)
  Seconds step_time = 0;              ///< mean over iterations, without restarts
  Seconds step_time_max = 0;
  Seconds dp_reduce_time = 0;         ///< gradient all-reduce after the last backward
  Seconds optimizer_time = 0;
  double bubble_fraction = 0;         ///< pipeline idle / (ranks x forward-backward span)
  Seconds exposed_comm = 0;           ///< blocking collectives on the critical rank + dp reduce, per iteration
  double model_flops_per_iteration = 0;
  double mfu = 0;                     ///< model FLOPs / (step_time x world x peak); recompute not counted
  double tgs = 0;                     ///< tokens per GPU per second
  int ooms = 0;                       ///< iterations whose walk exceeded the memory limit
  /// Completed iterations rolled back to the last checkpoint, summed over the OOMs
  /// (each OOM's restart redoes the iterations since the checkpoint, then retries the
  /// failed one, as `moeflex train --on-oom restart` counts lost_steps); 0 when every
  /// iteration runs out of memory, since none completes.
  int lost_iterations = 0;
  Seconds restart_time = 0;           ///< restarts plus redone iterations
  /// Including restart losses; 0 when every iteration runs out of memory (see note).
  double effective_tgs = 0;
  double effective_mfu = 0;
  Seconds recompute_time = 0;         ///< mean per iteration on the critical rank
  Bytes memory_limit = 0;
  Bytes peak_bytes = 0;               ///< max over ranks
  Bytes spike_peak_bytes = 0;         ///< max over ranks with SimOptions::spike_check's spike
  std::vector<RankReport> ranks;
  std::vector<int> adaptive_level_histogram;  ///< micro-batch stages per adaptive level (adaptive only)
  std::string note;                   ///< a remark on the result (e.g. every iteration ran out of memory); may be empty
  /// SimOptions::breakdown only: the ops one process of each pipeline rank runs in a
  /// step, by (phase, op kind) as the op profiler names them (LayerCost::ops; phase
  /// "optimizer" for the optimizer), summed over the pipeline ranks, mean over
  /// iterations. An MoE layer's ops are the mean over the data-parallel ranks at
  /// their own rows (the op profiler's mean over ranks), while the step time follows
  /// the hottest rank. Blocking collectives, the gradient reduction and waits are not ops.
  OpBreakdown ops;
  nlohmann::json trace;               ///< Chrome trace events of the trace ranks (last iteration)
  Seconds wall_seconds = 0;           ///< host time the simulation took

  nlohmann::json to_json() const;
  /// The human-readable table and summary.
  std::string format() const;
};

/// Simulates `o.iterations` iterations. Throws ConfigError for layouts that do not
/// validate (the message names the rule), for an unknown schedule or policy, and
/// (with memory walks) for a memory limit that cannot hold some pipeline rank's
/// persistent state, or, for the adaptive policy, is below adaptive_minimum_budget().
SimReport simulate(const SimOptions& o);

/// The largest over pipeline ranks of the smallest budget for which adaptive
/// provisioning can guarantee no OOM, as `moeflex train` computes and enforces it
/// (minimum_budget in model/memory_plan.h: persistent state plus one step with every
/// decided activation recomputed or offloaded at worst-case routing), in the
/// cluster's element bytes. Validates like simulate().
Bytes adaptive_minimum_budget(const SimOptions& o);

/// The largest persistent footprint (weights, gradients, optimizer state) of any
/// pipeline rank: a lower bound of its peak that needs no walk. Validates like simulate().
Bytes max_persistent_bytes(const SimOptions& o);

/// Writes summary.json and (when trace ranks were chosen) trace.json into `dir`.
void write_outputs(const SimReport& r, const std::filesystem::path& dir);

// ---- the plan executor (exposed for tests) ------------------------------------

/// The cost of one compute action: its compute time and the blocking
/// collectives inside it (both on the compute stream, back to back).
struct ActionCost {
  Seconds compute = 0;
  Seconds comm = 0;
  /// Core-seconds the action takes summed over the processes that run it at once
  /// (the data-parallel replicas of a pipeline rank, each at its own expert load);
  /// only read under CoreSharing. 0: (compute + comm) x CoreSharing::processes_per_rank.
  Seconds demand = 0;
  /// One stretch between two synchronisations of the processes (an expert all-to-all
  /// makes every rank of the group wait for the slowest): its critical time and demand,
  /// and when the processes' work differs (the expert rows), each one's, ascending.
  struct Segment {
    Seconds T = 0, D = 0;
    std::vector<Seconds> each;  ///< per process, sorted; empty: all alike (D spread evenly)
  };
  /// Under CoreSharing, the action as segments run one after the other, each at
  /// 1 / segment_time(segment, cores of the group) (sum of T: compute + comm; of D:
  /// demand). Empty: one segment {compute + comm, demand}.
  std::vector<Segment> segments;
  /// The part of `comm` an overlapped F&B pair can hide under the other half's
  /// compute (the expert all-to-alls, run on their own stream; the tensor-parallel
  /// collectives stay exposed): see pair_exposed_comm.
  Seconds overlappable = 0;
};

/// The exposed comm of an overlapped F&B pair (DualPipe's F&B, Megatron-Core's
/// combined 1F1B): without `overlap`, both halves' comm. With it, each half's
/// all-to-alls (ActionCost::overlappable) hide under the *other* half's compute,
/// cross-wise as in DeepSeek-V3's overlap (arXiv 2412.19437, section 3.2.1: the
/// forward's dispatch and combine under the backward's compute and vice versa), and
/// what they cannot hide, and the rest of the comm, stays exposed:
///   (f.comm - f.overlappable) + (b.comm - b.overlappable)
///   + max(0, f.overlappable - b.compute) + max(0, b.overlappable - f.compute).
Seconds pair_exposed_comm(const ActionCost& f, const ActionCost& b, bool overlap);

/// Ranks that are processes time-sharing fewer host cores (this-machine under
/// `mpirun --oversubscribe`). Each pipeline rank of the plan stands for
/// processes_per_rank processes (its data-parallel replicas, in lock step through
/// their collectives). Generalized processor sharing (Kleinrock 1967; Linux CFS
/// approximates it): while N processes compute, each gets min(1, cores / N) of a
/// core; a process waiting for a message naps (moeflex's communicator on an
/// oversubscribed node, comm::host_oversubscribed) and does not count in N after its
/// first poll_seconds. An action of
/// critical time T = compute + comm (its slowest process with a core of its own)
/// and demand D (ActionCost::demand) then progresses at the rate
/// 1 / max(T, D / (p x min(1, cores / N))) of itself per second (cores / N times the
/// efficiency when the computing and polling processes alone outnumber the cores),
/// p = processes_per_rank:
/// the group's share of the cores bounds it, and so does its slowest process. An
/// action given as segments (one per synchronisation, ActionCost::segments) runs
/// them in turn, each at its own rate, 1 / segment_time (processor sharing among the
/// group's processes when their work differs). Waiting processes count in N during their
/// first poll_seconds of polling. After that it naps (comm/wait_policy.h), and each
/// nap takes nap_cost of a core from the computing processes: a waiting process
/// counts in N as nap_share() of a process.
struct CoreSharing {
  int cores = 0;               ///< host cores; <= 0: no sharing (every process has a core)
  int processes_per_rank = 1;  ///< processes behind each pipeline rank
  /// A process that starts waiting (for a message, or at the end of its plan for the
  /// step's collectives) polls this long before it sleeps, competing for the cores
  /// meanwhile (counted in N).
  Seconds poll_seconds = 0;
  /// While processes outnumber the cores, the share each gets is scaled by this
  /// (HardwareProfile::time_sharing_efficiency: time slicing and migrations cost the
  /// rest); 1 with a core for each.
  double efficiency = 1.0;
  /// Core-seconds each nap of a waiting process takes from the computing ones, and
  /// the wall time a nap lasts beyond the one asked for (HardwareProfile::nap_cost,
  /// nap_overshoot); 0: a napping process is free.
  Seconds nap_cost = 0;
  Seconds nap_overshoot = 0;
};

/// The share of a core a process that has waited `waited` seconds takes from the
/// computing ones under `sh` (CoreSharing): nap_cost / (nap + nap_overshoot), nap
/// as an oversubscribed node's communicator takes it (comm::poll_nap_seconds). The
/// nap grows with the wait, so the share is held constant over pieces of the wait
/// for the event loop: below the wait at which the shortest nap starts growing
/// (2 ms), the shortest nap's; then pieces that double up to the wait at which the
/// nap stops growing (20 ms), each at the nap of its geometric middle; then the
/// longest nap's. Sets `piece_end` to the wait at which the current piece ends
/// (infinity in the last). 0 when nap_cost is 0.
double nap_share(const CoreSharing& sh, Seconds waited, Seconds* piece_end);

/// How long a Segment takes when its group of n processes gets `cores` cores' worth
/// of time throughout (`cores` = processes_per_rank x min(1, cores / N), CoreSharing).
/// Processes that do alike (`each` empty): max(T, D / cores). Otherwise processor
/// sharing among the group (Kleinrock 1967; CFS shares a core's time equally among
/// its runnable processes): with x_1 <= ... <= x_n, while n - k + 1 of them still
/// work each runs at min(1, cores / (n - k + 1)), so the segment ends after
/// sum_k (x_k - x_(k-1)) / min(1, cores / (n - k + 1)). On 2 cores, 4 processes of
/// 1, 1, 1 and 2 ms take 3 ms (all at half speed for 2 ms, then the last alone),
/// where max(T, D / cores) gives 2.5 ms: only a scheduler that ran the longest first
/// could reach that. run_plan follows the same sharing event by event, so a group
/// whose cores change partway (another pipeline rank starts or ends) is exact too.
/// Throws Error for cores <= 0 or an unsorted `each`.
Seconds segment_time(const ActionCost::Segment& g, double cores);

/// The communicator's polling phase on an oversubscribed node (CoreSharing::
/// poll_seconds): 200 MPI_Tests (3.3 us measured with Open MPI here), then naps
/// (comm/mpi_communicator.cpp; the 2 ms of yielding that follow on a node with a
/// core per thread are skipped there, comm::host_oversubscribed).
inline constexpr Seconds kCommPollSeconds = 5e-6;

/// One action's interval on its rank.
struct Interval {
  Seconds start = 0, end = 0;
};

struct PlanTimeline {
  Seconds makespan = 0;
  std::vector<Seconds> busy, comm, idle, finish;  ///< per rank
  std::vector<std::vector<Interval>> times;       ///< per rank, per action
};

/// Runs `plan` in virtual time: ranks run their actions in order; a compute action
/// takes cost(rank, action); an overlapped F&B pair takes both halves' compute and
/// pair_exposed_comm(F, B, overlap_pair_comm) of their comm; a Send never blocks and its message arrives
/// message_time(send) later; a Recv waits for it. Throws ScheduleError on deadlock.
/// With `sharing` (cores < the plan's ranks x processes_per_rank), compute actions
/// stretch as CoreSharing describes, in a global event loop; otherwise (and then
/// with identical results) each rank runs at full speed.
PlanTimeline run_plan(const StepPlan& plan, const std::function<ActionCost(int, const Action&)>& cost,
                      const std::function<Seconds(const Action&)>& message_time, bool overlap_pair_comm = false,
                      const CoreSharing& sharing = {});

/// The local reduction of the CPU engine's deterministic all-reduce
/// (MpiCommunicator::ordered_all_reduce) of `bytes` over n ranks: each rank sums its
/// block of every rank's copy in rank order between the two exchanges, an
/// elementwise pass over (3n - 1) / n x bytes (0 for n <= 1).
Seconds ordered_sum_time(const CostModel& cost, int n, Bytes bytes);

/// The name of the optional op table (HardwareProfile::op_tables) of one rank's
/// per-step parameter work in the trainer, against the fp32 bytes of its
/// parameters (4 x numel): zero_grads, the global-norm square sum, the clip's
/// scaling, and AdamW::step.
inline constexpr const char* kOptimizerStepOp = op_names::kOptimizerStep;

/// Seconds of one rank's per-step parameter work for `params` parameters of which
/// it updates `sharded_params` (fewer under a sharded optimizer): the
/// kOptimizerStepOp table when the profile has one, else streaming passes at the
/// elementwise rate: zero_grads writes g (4 B/param), the norm reads it (4), the
/// clip reads and writes it (8), AdamW reads w, g, m, v and writes w, m, v
/// (28 B per updated parameter): elementwise(16 params) + elementwise(28 sharded).
Seconds optimizer_step_time(const CostModel& cost, double params, double sharded_params);

/// Persistent bytes of one pipeline rank holding `stages` (layers [first, last) and
/// the ends), for a cluster's per-parameter byte counts and the layout.
Bytes persistent_bytes(const ModelConfig& cfg, const ClusterSpec& cluster, const ParallelSpec& par,
                       const std::vector<std::pair<int, int>>& layer_ranges, bool embedding, bool head);

}  // namespace moeflex::sim
