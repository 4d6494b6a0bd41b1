// The copy engine: a worker thread that moves bytes between device and host
// buffers while the main thread computes (on CUDA this is a copy stream; on the
// CPU backend a thread doing memcpy). Jobs run in submission order; each returns
// a ticket to wait on. Allocation and freeing stay on the main thread (the arena
// is not thread-safe): the engine only copies.
//
// Timing hook: an observer, if set, is told of every finished copy (start and end
// on the steady clock, bytes, the caller's label) on the worker thread, e.g. to
// draw the copies as a "copy" track of trace.json.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
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

  /// One finished copy as the worker ran it.
  struct CopyRecord {
    std::chrono::steady_clock::time_point start, end;  ///< around the memcpy
    Bytes bytes = 0;
    std::string label;  ///< what the caller named the copy (may be empty)
  };
  /// Called on the worker thread after each copy; must not throw.
  using Observer = std::function<void(const CopyRecord&)>;

  CopyEngine();
  ~CopyEngine();  ///< finishes every queued copy, then joins
  CopyEngine(const CopyEngine&) = delete;
  CopyEngine& operator=(const CopyEngine&) = delete;

  /// Queues memcpy(dst, src, bytes); both buffers must stay valid until done.
  /// `label` names the copy for the observer (e.g. "offload L2 attn.q mb0").
  Ticket copy(void* dst, const void* src, Bytes bytes, std::string label = {});
  /// Sets (or, with an empty function, removes) the observer. Returns only once no
  /// call of the previous observer is running, so what it captured may then go.
  void set_observer(Observer observer);
  /// Bytes copied so far, and seconds the worker spent copying.
  Bytes bytes_copied() const;
  Seconds busy_seconds() const;

 private:
  struct Job {
    void* dst;
    const void* src;
    Bytes bytes;
    std::string label;
    std::shared_ptr<Ticket::State> state;
  };
  void run();
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  bool stop_ = false;
  Bytes copied_ = 0;
  Seconds busy_ = 0;
  std::mutex observer_mu_;  // held while the observer runs and while it is replaced
  Observer observer_;
  std::thread worker_;
};

}  // namespace moeflex
