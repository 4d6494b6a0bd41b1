// The copy engine: a worker thread that moves bytes between device and host
// buffers while the main thread computes (on CUDA this is a copy stream; on the
// CPU backend a thread doing memcpy). Jobs run in submission order; each returns
// a ticket to wait on. Allocation and freeing stay on the main thread (the arena
// is not thread-safe): the engine only copies.
//
// Timing hook: an observer, if set, is told of every finished copy (start and end
// on the steady clock, bytes, the caller's label) on the worker thread, e.g. to
// draw the copies as a "copy" track of trace.json.
//
// Device mode (set_device): on a GPU the copies are the device's copy streams
// instead (Device::copy_async: after the compute work queued so far, so an offload
// reads a finished tensor and a prefetch overwrites a block nobody still reads);
// tickets then wait on the copy's event, and host buffers come from the device's
// pinned pool (host_alloc). Device copies are not reported to the observer.
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

#include "moeflex/core/device.h"
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
    std::shared_ptr<DeviceEvent> event_;  // device mode: the copy stream's event
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
  /// to_host: an offload (device -> host; only device mode needs to know).
  Ticket copy(void* dst, const void* src, Bytes bytes, std::string label = {}, bool to_host = false);
  /// Device mode (see the file comment); null returns to the worker thread's memcpy.
  void set_device(Device* device) { device_ = device; }
  /// Host memory for an offload of `bytes` (pinned in device mode); throws Error.
  void* host_alloc(Bytes bytes);
  /// Returns a block of host_alloc(bytes) once no copy uses it.
  void host_free(void* p, Bytes bytes);
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
  Device* device_ = nullptr;
  std::thread worker_;
};

}  // namespace moeflex
