// Budgeted regions of CUDA memory (STYLE habit 6: backends split into buffer /
// stream / device; pinned host memory is just another buffer kind).
//
// A BufferArena is one region obtained up front (cudaMalloc for device memory,
// cudaHostAlloc for pinned host memory) with the BlockAllocator of
// core/block_allocator.h over it: the same best-fit placement, per-category Stat
// accounting, fragmentation measurement and typed OutOfMemoryError as the CPU Arena.
// The allocator works on offsets; this class adds the base pointer. The budget is
// the region's size, so an OOM here is a decision of ours, not the driver's.
//
// DeviceArena is the device kind, PinnedHostPool the pinned-host kind (page-locked
// memory the copy engines reach directly; the offload target). Buffer is the RAII
// handle of one block. Not thread-safe: use an arena from one host thread.
//
// Freeing is immediate bookkeeping. Work still queued on a stream may be using the
// block, so free a block only after the streams that use it are ordered before its
// next user (same stream, or an event wait), as with any stream-ordered allocator.
#pragma once
#include <string_view>
#include <utility>

#include "moeflex/core/block_allocator.h"

namespace moeflex::cuda {

/// Where a buffer's bytes live.
enum class BufferKind { device, pinned_host };

/// "device" or "pinned_host".
const char* to_string(BufferKind kind);

/// One budgeted region of one buffer kind (see the file comment).
class BufferArena {
 public:
  static constexpr Bytes kAlignment = 256;  ///< bytes; cudaMalloc's alignment, enough for 16-byte vector access

  /// Reserves `budget` bytes (> 0; rounded down to kAlignment) of `kind` on
  /// `device`. Throws CudaError when the driver cannot provide the region, naming the
  /// request and the device's free memory.
  BufferArena(BufferKind kind, Bytes budget, int device);
  ~BufferArena();
  BufferArena(const BufferArena&) = delete;
  BufferArena& operator=(const BufferArena&) = delete;

  /// `bytes` (rounded up to kAlignment) of kAlignment-aligned memory of this kind.
  /// Throws OutOfMemoryError when it does not fit; `op` names the requester.
  void* allocate(Bytes bytes, MemCategory category, std::string_view op);
  /// Returns a block from allocate(); `bytes` and `category` as given there.
  void deallocate(void* ptr, Bytes bytes, MemCategory category);

  BufferKind kind() const { return kind_; }
  int device() const { return device_; }
  /// The region's first byte (device or pinned host address).
  void* base() const { return base_; }
  Bytes budget() const { return blocks_.capacity(); }
  const Stat& stat(MemCategory c) const { return blocks_.stats().stat(c); }
  const Stat& total() const { return blocks_.stats().total(); }
  Bytes in_use() const { return total().current; }
  Bytes peak() const { return total().peak; }
  Bytes largest_free_block() const { return blocks_.largest_free_block(); }
  Bytes fragmentation_peak() const { return blocks_.fragmentation_peak(); }
  void reset_peaks() { blocks_.stats().reset_peaks(); }
  /// True when `ptr` lies inside this region.
  bool owns(const void* ptr) const;

 private:
  BufferKind kind_;
  int device_;
  char* base_ = nullptr;
  BlockAllocator blocks_;
};

/// The device-memory arena: one cudaMalloc region of `budget` bytes.
class DeviceArena : public BufferArena {
 public:
  explicit DeviceArena(Bytes budget, int device = 0) : BufferArena(BufferKind::device, budget, device) {}
};

/// The pinned host pool: one cudaHostAlloc region of `capacity` bytes, the target of
/// offloads and the source of prefetches.
class PinnedHostPool : public BufferArena {
 public:
  explicit PinnedHostPool(Bytes capacity, int device = 0)
      : BufferArena(BufferKind::pinned_host, capacity, device) {}
};

/// One block of a BufferArena, returned on destruction. Move-only; empty when
/// default-constructed or moved from.
class Buffer {
 public:
  Buffer() = default;
  /// Allocates `bytes` from `arena` (throws OutOfMemoryError).
  Buffer(BufferArena& arena, Bytes bytes, MemCategory category, std::string_view op);
  ~Buffer() { reset(); }
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  /// Frees the block (if any) and leaves the buffer empty.
  void reset();
  bool defined() const { return ptr_ != nullptr; }
  void* data() const { return ptr_; }
  /// The block as an array of T (device or pinned host address, per kind()).
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  Bytes bytes() const { return bytes_; }
  /// The kind of the arena it came from (device for an empty buffer).
  BufferKind kind() const { return arena_ ? arena_->kind() : BufferKind::device; }
  MemCategory category() const { return category_; }

 private:
  BufferArena* arena_ = nullptr;
  void* ptr_ = nullptr;
  Bytes bytes_ = 0;
  MemCategory category_ = MemCategory::workspace;
};

}  // namespace moeflex::cuda
