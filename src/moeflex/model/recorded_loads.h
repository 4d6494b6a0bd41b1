// A `moeflex train` run's loads.jsonl, parsed: every data-parallel rank's kept and
// received rows per step, micro-batch and MoE layer (the format is written by
// train/step_loop.cpp's record_loads). Read by the simulator (sim::LoadModel's
// per-rank replay) and by the trainer (`--inject-imbalance replay=PATH`), which are
// siblings: the one parser lives here, below both.
#pragma once
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace moeflex {

/// One rank's routing of one micro-batch through one MoE layer, as recorded.
struct RecordedRows {
  std::int64_t kept = 0;      ///< assignments the rank routed and kept (MoERows::permuted)
  std::int64_t received = 0;  ///< rows its local experts processed (MoERows::received)
};

/// The steps of a loads.jsonl; every line has the first line's layout.
struct RecordedLoads {
  int dp = 0;                   ///< data-parallel ranks (EP groups of `ep` consecutive ranks)
  int ep = 0;                   ///< expert-parallel size; rank q is EP rank q mod ep
  int microbatches = 0;         ///< micro-batches per step
  std::vector<int> moe_layers;  ///< the model layers that are MoE layers, in order
  /// Per step (in file order), [(MoE layer x microbatches + micro-batch) x dp + rank].
  std::vector<std::vector<RecordedRows>> steps;

  /// MoE layers per step.
  int layers() const { return int(moe_layers.size()); }
  /// Rows of rank `rank` in (step index, micro-batch, k-th MoE layer); no wrap-around.
  const RecordedRows& at(std::size_t step, int moe_layer, int microbatch, int rank) const {
    return steps[step][(std::size_t(moe_layer) * std::size_t(microbatches) + std::size_t(microbatch)) *
                           std::size_t(dp) +
                       std::size_t(rank)];
  }
};

/// Parses a loads.jsonl. Checks every line's layout (ep divides dp, the same layout
/// on every line), the tables' shapes, every count (an integer in [0, 2^48]) and that
/// no rank received more than its EP group kept. Throws DataError naming the file,
/// the line and the field; "no steps" for an empty file.
RecordedLoads read_recorded_loads(const std::filesystem::path& loads_jsonl);

/// Calls fn(record, "file:line") for every non-empty line of a JSON-lines file;
/// throws DataError naming the file (and line) when it cannot be read or parsed.
void for_each_json_line(const std::filesystem::path& path,
                        const std::function<void(const nlohmann::json&, const std::string&)>& fn);

}  // namespace moeflex
