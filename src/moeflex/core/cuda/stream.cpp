#include "moeflex/core/cuda/stream.h"

#include <algorithm>
#include <fmt/format.h>

#include "moeflex/core/cuda/cuda_check.h"

namespace moeflex::cuda {

Stream::Stream(int device, int priority) : device_(device) {
  int old = 0;
  MOEFLEX_CUDA_CHECK(cudaGetDevice(&old));
  MOEFLEX_CUDA_CHECK(cudaSetDevice(device));
  int least = 0, greatest = 0;  // greatest is the most negative: the highest priority
  MOEFLEX_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  const int p = std::clamp(priority, greatest, least);
  const cudaError_t err = cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, p);
  cudaSetDevice(old);
  MOEFLEX_CUDA_CHECK(err);
}

Stream::~Stream() {
  if (stream_) cudaStreamDestroy(stream_);
}

Stream& Stream::operator=(Stream&& o) noexcept {
  if (this != &o) {
    if (stream_) cudaStreamDestroy(stream_);
    stream_ = std::exchange(o.stream_, nullptr);
    device_ = o.device_;
  }
  return *this;
}

void Stream::synchronize() const { MOEFLEX_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

void Stream::wait(const Event& event) const { MOEFLEX_CUDA_CHECK(cudaStreamWaitEvent(stream_, event.get(), 0)); }

Event::Event(bool timing) {
  MOEFLEX_CUDA_CHECK(cudaEventCreateWithFlags(&event_, timing ? cudaEventDefault : cudaEventDisableTiming));
}

Event::~Event() {
  if (event_) cudaEventDestroy(event_);
}

Event& Event::operator=(Event&& o) noexcept {
  if (this != &o) {
    if (event_) cudaEventDestroy(event_);
    event_ = std::exchange(o.event_, nullptr);
  }
  return *this;
}

void Event::record(const Stream& stream) { record(stream.get()); }

void Event::record(cudaStream_t stream) { MOEFLEX_CUDA_CHECK(cudaEventRecord(event_, stream)); }

void Event::synchronize() const { MOEFLEX_CUDA_CHECK(cudaEventSynchronize(event_)); }

bool Event::query() const {
  const cudaError_t err = cudaEventQuery(event_);
  if (err == cudaErrorNotReady) return false;
  MOEFLEX_CUDA_CHECK(err);
  return true;
}

float Event::elapsed_ms(const Event& start, const Event& end) {
  float ms = 0;
  MOEFLEX_CUDA_CHECK(cudaEventElapsedTime(&ms, start.get(), end.get()));
  return ms;
}

void copy_async(void* dst, const void* src, Bytes bytes, const Stream& stream) {
  if (bytes <= 0) return;
  MOEFLEX_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<std::size_t>(bytes), cudaMemcpyDefault, stream.get()));
}

TransferStreams::TransferStreams(int device) : d2h_(device), h2d_(device) {}

Event TransferStreams::copy(const Buffer& src, Buffer& dst, Bytes bytes, const Stream& after, Stream& on,
                            BufferKind from, BufferKind to, const char* what) {
  if (!src.defined() || !dst.defined() || src.kind() != from || dst.kind() != to)
    throw Error(fmt::format("{}: needs a {} source and a {} destination (got {} and {})", what, to_string(from),
                            to_string(to), src.defined() ? to_string(src.kind()) : "empty",
                            dst.defined() ? to_string(dst.kind()) : "empty"));
  if (bytes < 0 || bytes > src.bytes() || bytes > dst.bytes())
    throw Error(fmt::format("{}: {} B do not fit the source ({} B) and destination ({} B)", what, bytes, src.bytes(),
                            dst.bytes()));
  Event ready;
  ready.record(after);
  on.wait(ready);
  copy_async(dst.data(), src.data(), bytes, on);
  Event done;
  done.record(on);
  return done;
}

Event TransferStreams::offload(const Buffer& src, Buffer& dst, Bytes bytes, const Stream& producer) {
  return copy(src, dst, bytes, producer, d2h_, BufferKind::device, BufferKind::pinned_host, "offload");
}

Event TransferStreams::prefetch(const Buffer& src, Buffer& dst, Bytes bytes, const Stream& after) {
  return copy(src, dst, bytes, after, h2d_, BufferKind::pinned_host, BufferKind::device, "prefetch");
}

}  // namespace moeflex::cuda
