// `--inject-imbalance replay=PATH`: the shares of another run's loads.jsonl, handed
// to the router skew (ops/imbalance.h) as plain data in ImbalanceSpec::replay_shares.
//
// Step s of this run replays recorded step ((s - 1) mod recorded steps) + 1. In it,
// the k-th MoE layer's share of EP group g (this run's EP rank g's experts) is
//     received_g / sum_g' received_g',
// received_g = the rows recorded EP rank g received, summed over the recording's
// micro-batches and over its EP groups (data-parallel ranks q with q mod ep == g).
// The sum over micro-batches is what metrics.jsonl's ep_received_tokens reports;
// the shares are met per micro-batch and rank by skew_router_to_shares, so a replay
// of a recording whose micro-batches had the same shares reproduces its rows.
#pragma once
#include <string>
#include <vector>

#include "moeflex/model/config.h"
#include "moeflex/model/recorded_loads.h"
#include "moeflex/ops/imbalance.h"

namespace moeflex {

/// The replay shares of `rec` for a run of `model` with EP size `ep` (format of
/// ImbalanceSpec::replay_shares; a (step, layer) whose ranks received nothing gets
/// equal shares). ConfigError naming both sizes and `source` when this run's EP size
/// or MoE layer count is not the recording's, or when there is no EP (ep < 2).
std::vector<std::vector<std::vector<double>>> replay_shares(const RecordedLoads& rec, const ModelConfig& model,
                                                            int ep, const std::string& source);

/// The loads.jsonl that replay=PATH names: PATH itself, or PATH/loads.jsonl for a
/// directory. ConfigError when neither exists.
std::filesystem::path replay_loads_file(const std::string& path);

/// Fills spec.replay_shares from spec.replay_path for a run of `model` with EP size
/// `ep` (nothing for another shape). Throws ConfigError (a missing file, another
/// layout) and DataError naming the file and line (a malformed one).
void load_replay_shares(ops::ImbalanceSpec& spec, const ModelConfig& model, int ep);

}  // namespace moeflex
