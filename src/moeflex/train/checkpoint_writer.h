// Flash checkpoints (DLRover's flash checkpoint, PyTorch DCP's async_save): at a step
// boundary the training state is copied into a host snapshot that is kept and reused
// from one checkpoint to the next, and a background thread persists the snapshot with
// save_checkpoint (safetensors and a manifest with checksums, written to a temporary
// folder and renamed: a persist cut short leaves the previous checkpoint as it was),
// while training goes on. One persist is in flight at a time: a new checkpoint waits
// for it, or is skipped (WhenBusy::skip). The synchronous mode writes in the caller,
// as moeflex always did. The background thread does file I/O only (no MPI, no device).
#pragma once
#include <atomic>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <optional>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "moeflex/train/checkpoint.h"

namespace moeflex::train {

class CheckpointWriter {
 public:
  enum class Mode { sync, async };
  enum class WhenBusy { wait, skip };

  CheckpointWriter(Mode mode, WhenBusy when_busy) : mode_(mode), when_busy_(when_busy) {}
  /// Waits for the persist in flight: a run that ends, or fails, flushes its newest
  /// snapshot. Its error, if any, is dropped here (wait() reports it).
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  /// Checkpoint `step` of `model` and `optimizer` (host memory, read during the call
  /// only) with `state` under `root` (save_checkpoint's arguments). Sync: writes it
  /// here. Async: waits for the persist in flight (rethrowing its error), copies into
  /// the snapshot and starts its persist. Whether to skip a checkpoint while busy()
  /// is the caller's choice (when_busy()), as ranks must agree on it.
  void save(const std::filesystem::path& root, std::int64_t step, const std::vector<NamedBuffer>& model,
            const std::vector<NamedBuffer>& optimizer, const nlohmann::json& state, int keep_last);

  struct Persisted {
    std::int64_t step = 0;
    double seconds = 0;  ///< the background thread's time writing it
  };
  /// Waits for the persist in flight and returns it (nullopt when none was), or
  /// rethrows its error (DataError on I/O failure: the previous checkpoint stands).
  std::optional<Persisted> wait();
  /// True while a persist runs (async only).
  bool busy() const { return worker_.joinable() && !done_.load(); }
  Mode mode() const { return mode_; }
  WhenBusy when_busy() const { return when_busy_; }

 private:
  /// `bufs` copied into slots [first, first + bufs.size()) of the snapshot.
  std::vector<NamedBuffer> snapshot(const std::vector<NamedBuffer>& bufs, std::size_t first);

  Mode mode_;
  WhenBusy when_busy_;
  std::vector<std::vector<float>> snapshot_;  ///< reused from one checkpoint to the next
  std::thread worker_;
  std::atomic<bool> done_{false};
  std::exception_ptr error_;
  Persisted in_flight_;
};

}  // namespace moeflex::train
