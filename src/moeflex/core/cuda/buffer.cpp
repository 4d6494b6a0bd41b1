#include "moeflex/core/cuda/buffer.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <fmt/format.h>

#include "moeflex/core/cuda/cuda_check.h"

namespace moeflex::cuda {

const char* to_string(BufferKind kind) { return kind == BufferKind::device ? "device" : "pinned_host"; }

namespace {

/// Restores the calling thread's current device on scope exit.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    MOEFLEX_CUDA_CHECK(cudaGetDevice(&old_));
    if (old_ != device) MOEFLEX_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() { cudaSetDevice(old_); }

 private:
  int old_ = 0;
};

}  // namespace

BufferArena::BufferArena(BufferKind kind, Bytes budget, int device)
    : kind_(kind), device_(device), blocks_(budget, kAlignment) {
  DeviceGuard guard(device);
  const auto bytes = static_cast<std::size_t>(blocks_.capacity());
  void* p = nullptr;
  const cudaError_t err =
      kind == BufferKind::device ? cudaMalloc(&p, bytes) : cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
  if (err != cudaSuccess) {
    cudaGetLastError();
    std::size_t free_b = 0, total_b = 0;
    const bool have_info = kind == BufferKind::device && cudaMemGetInfo(&free_b, &total_b) == cudaSuccess;
    throw CudaError(fmt::format("cannot reserve a {} region of {} on device {}: {} ({}){}", to_string(kind),
                                format_bytes(blocks_.capacity()), device, cudaGetErrorName(err),
                                cudaGetErrorString(err),
                                have_info ? fmt::format("; the device has {} free of {}", format_bytes(Bytes(free_b)),
                                                        format_bytes(Bytes(total_b)))
                                          : std::string()));
  }
  base_ = static_cast<char*>(p);
}

BufferArena::~BufferArena() {
  if (!base_) return;
  if (kind_ == BufferKind::device) cudaFree(base_);
  else cudaFreeHost(base_);
}

void* BufferArena::allocate(Bytes bytes, MemCategory category, std::string_view op) {
  return base_ + blocks_.allocate(bytes, category, op);
}

void BufferArena::deallocate(void* ptr, Bytes bytes, MemCategory category) {
  if (!ptr) return;
  if (!owns(ptr))
    throw Error(fmt::format("{} arena: free of {} B at {} outside the region", to_string(kind_), bytes, ptr));
  blocks_.deallocate(static_cast<char*>(ptr) - base_, bytes, category);
}

bool BufferArena::owns(const void* ptr) const {
  const auto a = reinterpret_cast<std::uintptr_t>(ptr), lo = reinterpret_cast<std::uintptr_t>(base_);
  return a >= lo && a < lo + static_cast<std::uintptr_t>(blocks_.capacity());
}

Buffer::Buffer(BufferArena& arena, Bytes bytes, MemCategory category, std::string_view op)
    : arena_(&arena), bytes_(bytes), category_(category) {
  ptr_ = arena.allocate(bytes, category, op);
}

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    reset();
    arena_ = std::exchange(o.arena_, nullptr);
    ptr_ = std::exchange(o.ptr_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
    category_ = o.category_;
  }
  return *this;
}

void Buffer::reset() {
  if (ptr_) arena_->deallocate(ptr_, bytes_, category_);
  ptr_ = nullptr;
  bytes_ = 0;
}

}  // namespace moeflex::cuda
