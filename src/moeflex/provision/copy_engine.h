// The copy engine: a worker thread that moves bytes between device and host
// buffers while the main thread computes (on CUDA this is a copy stream; on the
// CPU backend a thread doing memcpy). Jobs run in submission order; each returns
// a ticket to wait on. Allocation and freeing stay on the main thread (the arena
// is not thread-safe): the engine only copies.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>

#include "moeflex/core/units.h"

namespace moeflex {

class CopyEngine {
 public:
  /// Completion of one copy; wait() blocks until the bytes are there.
  class Ticket {
   public:
    bool done() const;
    void wait() const;

   private:
    friend class CopyEngine;
    struct State {
      std::mutex mu;
      std::condition_variable cv;
      bool done = false;
    };
    std::shared_ptr<State> state_;
  };

  CopyEngine();
  ~CopyEngine();  ///< finishes every queued copy, then joins
  CopyEngine(const CopyEngine&) = delete;
  CopyEngine& operator=(const CopyEngine&) = delete;

  /// Queues memcpy(dst, src, bytes); both buffers must stay valid until done.
  Ticket copy(void* dst, const void* src, Bytes bytes);
  /// Bytes copied so far, and seconds the worker spent copying.
  Bytes bytes_copied() const;
  Seconds busy_seconds() const;

 private:
  struct Job {
    void* dst;
    const void* src;
    Bytes bytes;
    std::shared_ptr<Ticket::State> state;
  };
  void run();
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  bool stop_ = false;
  Bytes copied_ = 0;
  Seconds busy_ = 0;
  std::thread worker_;
};

}  // namespace moeflex
