#include "moeflex/provision/copy_engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "moeflex/core/error.h"

namespace moeflex {

bool CopyEngine::Ticket::done() const {
  if (event_) return event_->query();
  if (!state_) return true;
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->done;
}

void CopyEngine::Ticket::wait() const {
  if (event_) return event_->synchronize();
  if (!state_) return;
  std::unique_lock<std::mutex> lock(state_->mu);
  state_->cv.wait(lock, [&] { return state_->done; });
}

CopyEngine::CopyEngine() : worker_([this] { run(); }) {}

CopyEngine::~CopyEngine() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

CopyEngine::Ticket CopyEngine::copy(void* dst, const void* src, Bytes bytes, std::string label, bool to_host) {
  Ticket t;
  if (device_) {
    t.event_ = device_->copy_async(dst, src, bytes, to_host);
    std::lock_guard<std::mutex> lock(mu_);
    copied_ += bytes;
    return t;
  }
  t.state_ = std::make_shared<Ticket::State>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(Job{dst, src, bytes, std::move(label), t.state_});
  }
  cv_.notify_one();
  return t;
}

void* CopyEngine::host_alloc(Bytes bytes) {
  if (device_) return device_->host_alloc(bytes);
  void* p = std::aligned_alloc(64, std::size_t((std::max<Bytes>(bytes, 1) + 63) / 64 * 64));
  if (!p) throw Error(fmt::format("host pool: cannot allocate {} for an offload", format_bytes(bytes)));
  return p;
}

void CopyEngine::host_free(void* p, Bytes bytes) {
  if (!p) return;
  if (device_) device_->host_free(p, bytes);
  else std::free(p);
}

void CopyEngine::set_observer(Observer observer) {
  std::lock_guard<std::mutex> lock(observer_mu_);
  observer_ = std::move(observer);
}

Bytes CopyEngine::bytes_copied() const {
  std::lock_guard<std::mutex> lock(mu_);
  return copied_;
}

Seconds CopyEngine::busy_seconds() const {
  std::lock_guard<std::mutex> lock(mu_);
  return busy_;
}

void CopyEngine::run() {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stop_ and drained
      job = jobs_.front();
      jobs_.pop_front();
    }
    const auto t0 = std::chrono::steady_clock::now();
    std::memcpy(job.dst, job.src, static_cast<std::size_t>(job.bytes));
    const auto t1 = std::chrono::steady_clock::now();
    const double dt = std::chrono::duration<double>(t1 - t0).count();
    {
      std::lock_guard<std::mutex> lock(mu_);
      copied_ += job.bytes;
      busy_ += dt;
    }
    {
      // Told before the ticket completes: a copy whose ticket is done has been observed.
      std::lock_guard<std::mutex> lock(observer_mu_);
      if (observer_) observer_(CopyRecord{t0, t1, job.bytes, std::move(job.label)});
    }
    {
      std::lock_guard<std::mutex> lock(job.state->mu);
      job.state->done = true;
    }
    job.state->cv.notify_all();
  }
}

}  // namespace moeflex
