// Flash checkpoints (checkpoint_writer.h).
#include "moeflex/train/checkpoint_writer.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstring>

namespace moeflex::train {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::int64_t numel_of(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (std::int64_t d : shape) n *= d;
  return n;
}

}  // namespace

CheckpointWriter::~CheckpointWriter() {
  try {
    wait();
  } catch (...) {  // reported by wait() to a caller that asked; a destructor must not throw
  }
}

std::vector<NamedBuffer> CheckpointWriter::snapshot(const std::vector<NamedBuffer>& bufs, std::size_t first) {
  if (snapshot_.size() < first + bufs.size()) snapshot_.resize(first + bufs.size());
  std::vector<NamedBuffer> out = bufs;
  for (std::size_t i = 0; i < bufs.size(); ++i) {
    std::vector<float>& slot = snapshot_[first + i];
    const std::int64_t n = numel_of(bufs[i].shape);
    slot.resize(std::size_t(n));  // the same sizes every time: no reallocation after the first
    if (n > 0) std::memcpy(slot.data(), bufs[i].data, std::size_t(n) * sizeof(float));
    out[i].data = slot.data();
  }
  return out;
}

void CheckpointWriter::save(const std::filesystem::path& root, std::int64_t step, const std::vector<NamedBuffer>& model,
                            const std::vector<NamedBuffer>& optimizer, const nlohmann::json& state, int keep_last) {
  if (mode_ == Mode::sync) {
    save_checkpoint(root, step, model, optimizer, state, keep_last);
    return;
  }
  wait();  // one persist at a time; its error surfaces here
  std::vector<NamedBuffer> m = snapshot(model, 0), o = snapshot(optimizer, model.size());
  done_ = false;
  error_ = nullptr;
  in_flight_ = {step, 0.0};
  worker_ = std::thread([this, root, step, m = std::move(m), o = std::move(o), state, keep_last] {
    // Below the training threads: on a CPU the persist takes the cycles they leave.
    setpriority(PRIO_PROCESS, id_t(syscall(SYS_gettid)), 10);
    const Clock::time_point p0 = Clock::now();
    try {
      save_checkpoint(root, step, m, o, state, keep_last);
    } catch (...) {
      error_ = std::current_exception();
    }
    in_flight_.seconds = seconds_since(p0);
    done_ = true;
  });
}

std::optional<CheckpointWriter::Persisted> CheckpointWriter::wait() {
  if (!worker_.joinable()) return std::nullopt;
  worker_.join();
  if (error_) {
    std::exception_ptr e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
  return in_flight_;
}

}  // namespace moeflex::train
