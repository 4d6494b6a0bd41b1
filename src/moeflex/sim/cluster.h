// A cluster for the simulator: one kind of device, grouped into nodes, with a
// two-level network (NVLink-class inside a node, InfiniBand/RoCE-class between
// nodes), and the closed forms of the collectives moeflex runs over it.
//
// Devices are described by their public peak rates and an efficiency, from which a
// HardwareProfile (the engine's cost-model input) is derived, since nothing can be
// calibrated on such a device here (docs/simulator.md). The preset `this-machine`
// instead wraps the profile `moeflex calibrate` measured (data/hardware/).
//
// Collective times use the alpha-beta model (Hockney 1994): a message of b bytes
// over a link costs alpha + b / beta.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

#include "moeflex/core/units.h"
#include "moeflex/provision/cost_model.h"

namespace moeflex::sim {

/// One link class: latency and bandwidth per GPU and direction.
struct Link {
  Seconds latency = 0;           ///< alpha: fixed cost of one message
  BytesPerSecond bandwidth = 0;  ///< beta: bytes per second one GPU sends (and receives) at once
};

/// A cluster of identical devices. Read from JSON (configs/clusters/*.json).
struct ClusterSpec {
  std::string name;
  std::string description;
  int gpus_per_node = 8;             ///< devices sharing the intra-node link class
  Bytes device_memory = 0;           ///< bytes of device memory per device
  /// Bytes the framework and its libraries hold beyond moeflex's arena (CUDA
  /// context, NCCL buffers, allocator slack); subtracted from device_memory.
  Bytes reserved_memory = 0;
  Link intra_node;                   ///< NVLink-class
  Link inter_node;                   ///< InfiniBand/RoCE-class, per GPU (one NIC each)
  /// Bytes per element on the wire and of activations in memory (2 for bf16
  /// training; 4 for the fp32 engine). With 2 the simulator's memory walk replays
  /// the bf16 engine's program (model.bf16: fp32 rstd and router tensors).
  Bytes element_bytes = 4;
  /// Bytes per parameter held by every rank that holds it: weights and gradients
  /// (fp32 engine: 4 + 4; bf16 mixed precision: 2 + 4 with fp32 main grads).
  double param_bytes = 8;
  /// Bytes per parameter of optimizer state (AdamW m and v: 8; plus an fp32
  /// master copy in mixed precision: 12), divided by the data-parallel group
  /// when optimizer_sharded (Megatron's distributed optimizer, ZeRO-1).
  double optimizer_bytes = 8;
  bool optimizer_sharded = false;
  /// The framework's attention is a fused (flash) kernel: the [B, H, S, S]
  /// probabilities are never kept for backward but recomputed inside it. The
  /// simulator then treats attn.probs as recomputed under every policy (its
  /// transient forward allocation still counts, an overestimate of one layer's).
  bool flash_attention = false;
  /// > 0: the "devices" are processes sharing this many host cores (this-machine
  /// under mpirun --oversubscribe); with more ranks than cores every compute time
  /// stretches by ranks / cores (Open MPI's waiting ranks spin, so they compete too).
  int host_cores = 0;
  /// The data-parallel gradient reduction issues one all-reduce per parameter
  /// tensor (moeflex's CPU engine, train/distributed.cpp reduce_gradients), each
  /// paying its own latency; false: one all-reduce per gradient kind (dense,
  /// expert), as bucketing frameworks do. Read only with a calibrated "profile".
  bool per_tensor_gradient_reduce = false;
  /// Peak dense FLOP/s of one device at element_bytes precision; for MFU.
  FlopsPerSecond peak_flops = 0;
  /// The device's cost model input: derived from the fields below for GPU
  /// presets, or the calibrated profile for this-machine.
  HardwareProfile profile;

  /// Bytes usable by one rank: device_memory - reserved_memory.
  Bytes usable_memory() const { return device_memory - reserved_memory; }

  /// Parses and checks a cluster description; `source` starts every error
  /// (DataError naming the field). Either "profile" (a path to a calibrated
  /// HardwareProfile, relative to `base_dir`) or "device" (peak rates, see
  /// derive_profile) gives the cost model.
  static ClusterSpec from_json(const nlohmann::json& j, const std::string& source,
                               const std::filesystem::path& base_dir = ".");
  nlohmann::json to_json() const;
};

/// Rates of a device from its data sheet, and how much of them a kernel gets.
struct DeviceRates {
  FlopsPerSecond peak_flops = 0;          ///< dense peak at the training precision
  double gemm_efficiency = 0.7;           ///< fraction of peak a large GEMM reaches
  /// A GEMM of F FLOPs reaches gemm_efficiency * F / (F + gemm_half_flops) of peak:
  /// small GEMMs are latency-bound (half the large-GEMM rate at F = gemm_half_flops).
  double gemm_half_flops = 2e9;
  BytesPerSecond memory_bandwidth = 0;    ///< HBM peak
  double memory_efficiency = 0.8;         ///< fraction of it an elementwise kernel reaches
  Seconds launch_overhead = 5e-6;         ///< per kernel
  Link host_link;                         ///< PCIe-class host <-> device copies
};

/// A HardwareProfile with GEMM samples on a grid of shapes (M, N, K in 64..32768,
/// powers of 4) at the rates DeviceRates gives, elementwise work at
/// memory_bandwidth * memory_efficiency, and copies over the host link.
/// All FLOP/s here are per element of `element_bytes` precision: the cost model
/// works in fp32 bytes (kActivationBytes), so bandwidths are scaled by
/// 4 / element_bytes to keep a bf16 elementwise pass at its real speed.
HardwareProfile derive_profile(const std::string& name, const DeviceRates& rates, Bytes element_bytes);

/// Loads a cluster by preset name (configs/clusters/<name>.json, searched under
/// `preset_dir`) or by file path. `this-machine` without a file wraps
/// data/hardware/this-machine.json (under `root`). A non-empty `profile_override`
/// (a HardwareProfile file, relative to the working directory) prices the devices'
/// ops and host copies instead of the file's "profile" or "device" rates; a data-sheet
/// cluster (checked as it is first) keeps its links and its device's peak_flops for
/// MFU, a calibrated one takes the link a profile measured under mpirun. Throws DataError / ConfigError naming the
/// preset or file and the known presets, or the profile that does not load.
ClusterSpec load_cluster(const std::string& name_or_path, const std::filesystem::path& root,
                         const std::string& profile_override = "");

/// Where a group of ranks lives: how many ranks, and how many share a node.
struct GroupPlacement {
  int size = 1;            ///< ranks in the collective
  /// Members on the node of its worst-placed member (the fewest of the group on one
  /// node, 1..size; size when every group fits a node): that member's other
  /// rpn - 1 peers are on its node, the other size - rpn remote.
  int ranks_per_node = 1;
  /// Members on a node the group covers whole (gpus_per_node / stride, at most size).
  int full_node = 1;
};

/// Placement of a group whose consecutive members are `stride` ranks apart in a
/// world laid out node by node (gpus_per_node consecutive ranks per node), as the
/// groups of one kind tile the world (starts k size stride + j, j < stride: every
/// group of a tp-ep-dp-pp rank order). A group that straddles a node boundary
/// (ep 6 on 8-GPU nodes: ranks 6-11) counts by its worst member (2 on its node).
/// Exact for groups spanning up to kExactPlacementSpan ranks; wider ones count the
/// aligned case (gpus_per_node / stride a node), whose remote share is near 1 anyway.
GroupPlacement place_group(int size, int stride, int gpus_per_node);
/// Widest size x stride place_group enumerates member by member.
inline constexpr std::int64_t kExactPlacementSpan = 4096;

/// Ring all-reduce of `bytes` per rank (Patarasuk & Yuan 2009; NCCL's "bus
/// bandwidth" in nccl-tests/doc/PERFORMANCE.md): 2(n-1) steps, each moving
/// bytes/n over the slowest link of the ring: 2(n-1) alpha + 2(n-1)/n bytes / beta.
/// The ring crosses nodes when the group does, so beta is the inter-node link then.
Seconds all_reduce_time(const ClusterSpec& c, const GroupPlacement& g, Bytes bytes);

/// Ring all-gather or reduce-scatter whose full result is `bytes` per rank:
/// (n-1) alpha + (n-1)/n bytes / beta (half an all-reduce).
Seconds all_gather_time(const ClusterSpec& c, const GroupPlacement& g, Bytes bytes);

/// Pairwise all-to-all (every rank sends to every other; NCCL runs n-1 send/recv
/// pairs at once): a rank sends `send_bytes` and receives `recv_bytes` in total
/// (what stays on the rank excluded), spread evenly over the other n-1 ranks. The
/// share to ranks on other nodes, (n - ranks_per_node)/(n-1), goes over the
/// inter-node link, the rest over NVLink, both at once; the slower side and the
/// larger of send and receive decide: alpha + max(intra, inter) where
/// intra = b (rpn-1)/(n-1) / beta_intra and inter = b (n-rpn)/(n-1) / beta_inter.
Seconds all_to_all_time(const ClusterSpec& c, const GroupPlacement& g, Bytes send_bytes, Bytes recv_bytes);

/// What a node-deduplicating dispatch moves per token of the group's worst-placed
/// member (see GroupPlacement), E experts spread evenly over the group's ranks and
/// the token's top-k drawn uniformly without replacement: a remote node holding c of
/// the n members has E c / n experts and gets one copy unless it holds none of the
/// k, with probability miss = prod_{i<k} (E - E c/n - i) / (E - i);
///   copies   = sum over remote nodes of (1 - miss);
///   forwards = sum over remote nodes of (1 - miss) min(k c / n / (1 - miss), c) (c - 1) / c,
/// the NVLink hops from the receiving GPU to the other holders (experts expected on
/// the node given it holds one, at most one hop per GPU). Remote nodes: the n - rpn
/// remote members in nodes of full_node, the last one partial.
/// With group-limited routing (`groups` G equal groups of E / G experts, a token's
/// experts drawn from `groups_per_token` Gk of them chosen uniformly; DeepSeek-V3: 8
/// groups, 4 a token, so a token reaches at most 4 nodes when each node holds whole
/// groups), the miss chance of a node follows from which experts it holds: member i
/// holds experts [i E / n, (i + 1) E / n) (E / n whole experts a rank, else
/// ConfigError), members [0, rpn) share the worst-placed member's node and the remote
/// nodes hold the next full_node members each, the last the rest. A node touching m
/// groups with c_1..c_m of its experts misses with probability
///   sum over subsets A of its m groups of C(G - m, Gk - |A|) / C(G, Gk) x C(P - c_A, k) / C(P, k),
/// P = Gk E / G the experts of the chosen groups, c_A the node's experts in A (through
/// lgamma; subsets whose groups hold equal counts are summed together, and a node's
/// contiguous experts have at most 3 distinct counts, so any G is cheap). Every expert
/// is still chosen with probability k / E, so the rows a node receives are unchanged;
/// they come in fewer, fuller copies. When every node holds full_node members
/// (rpn = full_node), every member is worst-placed, and with group-limited routing
/// their nodes differ (4 experts a node in groups of 3: 3 + 1, 2 + 2, 1 + 3): the
/// result is the member that sends the most copies, whose node is hit least. Exact
/// under uniform routing for groups of consecutive ranks (EP groups; also strides
/// dividing gpus_per_node), nodes straddling group boundaries included: a stride-1
/// group's node runs are [a, gpus_per_node, ..., b], so a member with rpn < full_node
/// on its node sees the layout above or its mirror image, which maps groups onto
/// groups. Other strides, and groups wider than kExactPlacementSpan, take the same
/// layout as an approximation (as are the forwards, from the expected count above).
/// Until 2026-11-30 a node's experts were spread evenly over the groups it touches,
/// off by up to 8% in copies with DeepSeek-V3's 4 of 8 groups and 30% with 1 of 8 (EP 64
/// on 6-GPU nodes, 24 experts a node in groups of 32: 4.31 copies against the exact
/// 4.60, and 1.37 against 1.83).
/// `Cluster.GroupLimitedRoutingIsExactWhenNodesStraddleGroups` checks it against a
/// brute-force count over every choice of groups and experts.
struct RemoteNodeTraffic {
  double copies = 0;
  double forwards = 0;
};
/// ConfigError unless 1 <= k <= E, G divides E, 1 <= Gk <= G, k <= Gk E / G and, with
/// Gk < G, n divides E.
RemoteNodeTraffic remote_node_traffic(const GroupPlacement& g, std::int64_t E, std::int64_t k, std::int64_t groups = 1,
                                      std::int64_t groups_per_token = 1);

/// The dispatch or combine of a node-deduplicating dispatcher (DeepEP's internode
/// kernels, with which DeepSeek-V3 and Megatron-Core's "flex" dispatcher train): a
/// token crosses to each other node that holds one of its experts once, and that
/// node forwards it over NVLink to the GPUs holding them (combine: the reverse, with
/// a reduction within the node). `send_bytes` / `recv_bytes` are all_to_all_time's
/// (k rows a token, (ep - 1) / ep of them off the rank), so a token's row is
/// b n / ((n - 1) k). Inter-node bytes per rank: that x copies; intra-node:
/// all_to_all_time's share plus that x forwards (so with top-1 and NVLink the
/// bottleneck it costs more than all_to_all_time: the forwards are real traffic).
/// With the group in one node it is all_to_all_time. `groups`, `groups_per_token`:
/// the model's group-limited routing (remote_node_traffic).
Seconds dedup_all_to_all_time(const ClusterSpec& c, const GroupPlacement& g, Bytes send_bytes, Bytes recv_bytes,
                              std::int64_t num_experts, std::int64_t top_k, std::int64_t groups = 1,
                              std::int64_t groups_per_token = 1);

/// One point-to-point message between neighbouring pipeline stages:
/// alpha + bytes / beta over the intra- or inter-node link.
Seconds p2p_time(const ClusterSpec& c, bool same_node, Bytes bytes);

}  // namespace moeflex::sim
