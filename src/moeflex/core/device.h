// The device side of a backend (STYLE habit 6: buffer / stream / device): what the
// engine needs to touch tensor memory that may not be host memory. An Arena over a
// device region carries its Device; host arenas carry none (plain memcpy/memset).
//
// Ordering model (CUDA's): a device has one compute stream; zero(), copy() and
// copy_from_host() are queued on it, in order with the kernels the compute backend
// launches there; copy_to_host() waits for everything queued before it. Offload and
// prefetch copies (copy_async) run on separate copy streams, after the compute work
// queued so far (so the source is written and the destination's previous readers
// are done), and return an event to poll or wait on.
#pragma once
#include <memory>
#include <string>
#include <string_view>

#include "moeflex/core/units.h"

namespace moeflex {

/// Where a run's tensors live.
enum class DeviceKind { cpu, cuda };

/// "cpu" or "cuda".
const char* to_string(DeviceKind kind);
/// Parses "cpu" / "cuda"; throws ConfigError naming the value otherwise.
DeviceKind parse_device_kind(std::string_view s);

/// Completion of one asynchronous copy.
class DeviceEvent {
 public:
  virtual ~DeviceEvent() = default;
  /// True once the copy has landed (never blocks).
  virtual bool query() = 0;
  /// Blocks the host until the copy has landed.
  virtual void synchronize() = 0;
};

/// Memory and stream operations of one device (see the file comment). Not thread-safe.
class Device {
 public:
  virtual ~Device() = default;
  virtual DeviceKind kind() const = 0;
  /// One line naming the device ("NVIDIA H200, cc 9.0, ...").
  virtual std::string describe() const = 0;
  /// Sets `bytes` at `dst` (device memory) to zero, in stream order.
  virtual void zero(void* dst, Bytes bytes) = 0;
  /// Device to device copy, in stream order.
  virtual void copy(void* dst, const void* src, Bytes bytes) = 0;
  /// Host to device copy in stream order; `src` may be reused when this returns.
  virtual void copy_from_host(void* dst, const void* src, Bytes bytes) = 0;
  /// Device to host copy; returns once the bytes are in `dst` (waits for the work
  /// queued before it).
  virtual void copy_to_host(void* dst, const void* src, Bytes bytes) = 0;
  /// Blocks the host until every queued operation of the device has run.
  virtual void synchronize() = 0;
  /// Blocks the host until the compute work queued so far has run, leaving copies
  /// on the copy streams running (--profile-ops times ops with it, so that an op's
  /// time is its kernels' and in-flight offloads still overlap). Default: synchronize().
  virtual void synchronize_compute() { synchronize(); }
  /// Offload (to_host) or prefetch copy on a copy stream, after the compute work
  /// queued so far; `host` must come from host_alloc() and stay valid until done.
  virtual std::shared_ptr<DeviceEvent> copy_async(void* dst, const void* src, Bytes bytes, bool to_host) = 0;
  /// Host memory for offloaded activations (pinned where the device has it); never
  /// null (throws Error). Freed with host_free(p, bytes) once no copy uses it.
  virtual void* host_alloc(Bytes bytes) = 0;
  virtual void host_free(void* p, Bytes bytes) = 0;
};

}  // namespace moeflex
