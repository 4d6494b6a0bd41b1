#include "moeflex/core/arena.h"
#include "moeflex/core/block_allocator.h"

#include <sys/mman.h>

#include <cstdint>
#include <cstdlib>
#include <fmt/format.h>

namespace moeflex {

const char* to_string(MemCategory c) {
  switch (c) {
    case MemCategory::weights: return "weights";
    case MemCategory::grads: return "grads";
    case MemCategory::optimizer: return "optimizer";
    case MemCategory::activations: return "activations";
    case MemCategory::workspace: return "workspace";
    default: return "?";
  }
}

OutOfMemoryError::OutOfMemoryError(Bytes requested_, Bytes free_, Bytes largest_, Bytes budget_,
                                   MemCategory category_, std::string op_)
    : Error(fmt::format("device out of memory: '{}' requested {} ({} B) of {}, but only {} ({} B) of the "
                        "{} ({} B) budget is free (largest free block {})",
                        op_, format_bytes(requested_), requested_, to_string(category_),
                        format_bytes(free_), free_, format_bytes(budget_), budget_,
                        format_bytes(largest_))),
      requested(requested_), free(free_), largest_free_block(largest_), budget(budget_),
      category(category_), op(std::move(op_)) {}

OutOfMemoryError::OutOfMemoryError(const OutOfMemoryError& cause, const std::string& context)
    : Error(fmt::format("{}: {}", context, cause.what())), requested(cause.requested), free(cause.free),
      largest_free_block(cause.largest_free_block), budget(cause.budget), category(cause.category),
      op(cause.op) {}

Arena::Arena(Bytes budget) : budget_(budget) {
  if (budget_ == 0) throw ConfigError("device memory budget must be positive (got 0 bytes)");
  if (budget_ > 0) {
    if (budget_ < kAlignment)
      throw ConfigError(fmt::format("device memory budget must be at least {} B (got {} B)", kAlignment, budget_));
    budget_ = budget_ / kAlignment * kAlignment;
    void* p = mmap(nullptr, static_cast<std::size_t>(budget_), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
      throw Error(fmt::format("cannot reserve a device region of {}", format_bytes(budget_)));
    base_ = static_cast<char*>(p);
    region_ = std::make_unique<BlockAllocator>(budget_, kAlignment);
  }
}

Arena::~Arena() {
  if (base_) munmap(base_, static_cast<std::size_t>(budget_));
}

void MemoryStats::account(MemCategory c, Bytes delta) {
  for (Stat* s : {&stats_[static_cast<int>(c)], &total_}) {
    s->current += delta;
    if (delta > 0) s->allocated += delta;
    else s->freed -= delta;
    if (s->current > s->peak) s->peak = s->current;
  }
}

void MemoryStats::reset_peaks() {
  for (auto& s : stats_) s.peak = s.current;
  total_.peak = total_.current;
}

Bytes Arena::largest_free_block() const { return region_ ? region_->largest_free_block() : -1; }

Bytes Arena::fragmentation_peak() const { return region_ ? region_->fragmentation_peak() : 0; }

void Arena::reset_peaks() { stats_.reset_peaks(); }

void* Arena::allocate(Bytes bytes, MemCategory category, std::string_view op) {
  const Bytes size = round_up(bytes < 1 ? 1 : bytes);
  if (unlimited()) {
    void* p = std::aligned_alloc(kAlignment, static_cast<std::size_t>(size));
    if (!p) throw OutOfMemoryError(size, -1, -1, -1, category, std::string(op));
    stats_.account(category, size);
    return p;
  }
  Bytes offset = 0;
  try {
    offset = region_->allocate(size, category, op);
  } catch (const OutOfMemoryError& oom) {
    if (!overflow_) throw;
    // Overflow mode: record the event and serve the request from the heap.
    void* p = std::aligned_alloc(kAlignment, static_cast<std::size_t>(size));
    if (!p) throw Error(fmt::format("arena overflow: the host cannot provide {} for '{}'", format_bytes(size), op));
    if (oom_events_++ == 0) first_oom_ = oom;
    overflow_current_ += size;
    stats_.account(category, size);
    return p;
  }
  stats_.account(category, size);
  return base_ + offset;
}

void Arena::deallocate(void* ptr, Bytes bytes, MemCategory category) {
  if (!ptr) return;
  const Bytes size = round_up(bytes < 1 ? 1 : bytes);
  stats_.account(category, -size);
  if (unlimited()) {
    std::free(ptr);
    return;
  }
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr), lo = reinterpret_cast<std::uintptr_t>(base_);
  if (addr < lo || addr >= lo + static_cast<std::uintptr_t>(budget_)) {  // served from the heap in overflow mode
    overflow_current_ -= size;
    std::free(ptr);
    return;
  }
  region_->deallocate(static_cast<Bytes>(addr - lo), size, category);
}

}  // namespace moeflex
