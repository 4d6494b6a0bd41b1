// Streams, events and the copy streams of offload and prefetch (STYLE habit 6;
// Megatron's OffloadTensorGroup with its d2h/h2d streams).
//
// Compute runs on one stream; offloads (device -> pinned host) run on a d2h stream
// and prefetches (pinned host -> device) on an h2d stream, so copies overlap
// compute on the GPU's copy engines. Ordering is by events only:
// - offload: the d2h stream waits for the producer stream's work so far (the tensor
//   is written), copies, and records the returned event; once that event completes
//   the device block may be reused (free it after event.synchronize(), or make the
//   next user's stream wait on the event).
// - prefetch: the h2d stream waits for `after` (e.g. the last reader of the
//   destination block), copies, and records the returned event; the consumer stream
//   waits on it (Stream::wait) before reading the tensor.
#pragma once
#include <cuda_runtime_api.h>

#include <utility>

#include "moeflex/core/cuda/buffer.h"

namespace moeflex::cuda {

class Event;

/// A non-blocking CUDA stream (does not synchronize with the legacy default
/// stream) on one device. Move-only RAII.
class Stream {
 public:
  /// priority: 0 normal; negative numbers are higher priority (clamped to the
  /// device's range). Throws CudaError.
  explicit Stream(int device = 0, int priority = 0);
  ~Stream();
  Stream(Stream&& o) noexcept : stream_(std::exchange(o.stream_, nullptr)), device_(o.device_) {}
  Stream& operator=(Stream&& o) noexcept;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  cudaStream_t get() const { return stream_; }
  int device() const { return device_; }
  /// Blocks the host until everything queued so far has run; throws CudaError
  /// (including errors of kernels that ran on it).
  void synchronize() const;
  /// Work queued on this stream after this call waits until `event` completed.
  void wait(const Event& event) const;

 private:
  cudaStream_t stream_ = nullptr;
  int device_ = 0;
};

/// A CUDA event. Move-only RAII. Timing events measure elapsed time; the others
/// (the default) are cheaper and only order work.
class Event {
 public:
  explicit Event(bool timing = false);
  ~Event();
  Event(Event&& o) noexcept : event_(std::exchange(o.event_, nullptr)) {}
  Event& operator=(Event&& o) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  cudaEvent_t get() const { return event_; }
  /// Captures the work queued on `stream` so far.
  void record(const Stream& stream);
  /// Captures the work queued on a raw stream so far.
  void record(cudaStream_t stream);
  /// Blocks the host until the captured work completed; throws CudaError.
  void synchronize() const;
  /// True when the captured work completed (never blocks); throws CudaError.
  bool query() const;
  /// Milliseconds between two recorded timing events (end after start).
  static float elapsed_ms(const Event& start, const Event& end);

 private:
  cudaEvent_t event_ = nullptr;
};

/// Copies `bytes` between any two buffers (device or pinned host: the runtime's
/// unified addressing tells them apart) on `stream`. Asynchronous for device and
/// pinned memory; a pageable host pointer makes the runtime stage the copy.
void copy_async(void* dst, const void* src, Bytes bytes, const Stream& stream);

/// The copy streams of offload and prefetch (see the file comment).
class TransferStreams {
 public:
  /// Creates the d2h and h2d streams on `device`. Throws CudaError.
  explicit TransferStreams(int device = 0);

  Stream& d2h() { return d2h_; }
  Stream& h2d() { return h2d_; }

  /// Copies `bytes` of the device buffer `src` to the pinned buffer `dst` on the d2h
  /// stream, after the work queued on `producer` so far. Returns the event that
  /// completes when the copy has landed. Throws Error when the kinds or sizes do
  /// not match (src device, dst pinned host, bytes <= both sizes).
  Event offload(const Buffer& src, Buffer& dst, Bytes bytes, const Stream& producer);
  /// Copies `bytes` of the pinned buffer `src` to the device buffer `dst` on the h2d
  /// stream, after the work queued on `after` so far. Returns the event the
  /// consumer stream must wait on. Throws Error as offload() does.
  Event prefetch(const Buffer& src, Buffer& dst, Bytes bytes, const Stream& after);

 private:
  Event copy(const Buffer& src, Buffer& dst, Bytes bytes, const Stream& after, Stream& on, BufferKind from,
             BufferKind to, const char* what);
  Stream d2h_;
  Stream h2d_;
};

}  // namespace moeflex::cuda
