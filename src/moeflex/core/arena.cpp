#include "moeflex/core/arena.h"

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
    budget_ = budget_ / kAlignment * kAlignment;
    void* p = mmap(nullptr, static_cast<std::size_t>(budget_), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
      throw Error(fmt::format("cannot reserve a device region of {}", format_bytes(budget_)));
    base_ = static_cast<char*>(p);
    blocks_[0] = {budget_, true};
    free_.insert({budget_, 0});
  }
}

Arena::~Arena() {
  if (base_) munmap(base_, static_cast<std::size_t>(budget_));
}

void Arena::account(MemCategory c, Bytes delta) {
  for (Stat* s : {&stats_[static_cast<int>(c)], &total_}) {
    s->current += delta;
    if (delta > 0) s->allocated += delta;
    else s->freed -= delta;
    if (s->current > s->peak) s->peak = s->current;
  }
}

Bytes Arena::largest_free_block() const {
  if (unlimited()) return -1;
  return free_.empty() ? 0 : free_.rbegin()->first;
}

void Arena::reset_peaks() {
  for (auto& s : stats_) s.peak = s.current;
  total_.peak = total_.current;
}

void* Arena::allocate(Bytes bytes, MemCategory category, std::string_view op) {
  const Bytes size = round_up(bytes < 1 ? 1 : bytes);
  if (unlimited()) {
    void* p = std::aligned_alloc(kAlignment, static_cast<std::size_t>(size));
    if (!p) throw OutOfMemoryError(size, -1, -1, -1, category, std::string(op));
    account(category, size);
    return p;
  }
  auto it = free_.lower_bound({size, 0});
  if (it == free_.end()) {
    OutOfMemoryError oom(size, budget_ - (total_.current - overflow_current_), largest_free_block(), budget_,
                         category, std::string(op));
    if (!overflow_) throw oom;
    // Overflow mode: record the event and serve the request from the heap.
    void* p = std::aligned_alloc(kAlignment, static_cast<std::size_t>(size));
    if (!p) throw Error(fmt::format("arena overflow: the host cannot provide {} for '{}'", format_bytes(size), op));
    if (oom_events_++ == 0) first_oom_ = std::move(oom);
    overflow_current_ += size;
    account(category, size);
    return p;
  }
  Bytes offset = 0;
  if (category == MemCategory::workspace) {
    // Short-lived workspace comes from the top of the region, carved from the top
    // end of the highest free block that fits, so that it does not leave holes
    // between the long-lived blocks (weights, saved activations) growing from below.
    auto top = blocks_.rbegin();
    while (top != blocks_.rend() && !(top->second.second && top->second.first >= size)) ++top;
    const Bytes block_offset = top->first, block_size = top->second.first;  // exists: `it` fits somewhere
    free_.erase({block_size, block_offset});
    offset = block_offset + block_size - size;
    blocks_[offset] = {size, false};
    if (block_size > size) {
      blocks_[block_offset] = {block_size - size, true};
      free_.insert({block_size - size, block_offset});
    } else {
      blocks_[block_offset] = {size, false};
    }
  } else {
    const auto [block_size, block_offset] = *it;
    offset = block_offset;
    free_.erase(it);
    blocks_[offset] = {size, false};
    if (block_size > size) {
      blocks_[offset + size] = {block_size - size, true};
      free_.insert({block_size - size, offset + size});
    }
  }
  account(category, size);
  // Fragmentation: bytes free below the highest used block's end.
  auto last_used = blocks_.rbegin();
  while (last_used != blocks_.rend() && last_used->second.second) ++last_used;
  if (last_used != blocks_.rend()) {
    const Bytes end = last_used->first + last_used->second.first;
    frag_peak_ = std::max(frag_peak_, end - (total_.current - overflow_current_));
  }
  return base_ + offset;
}

void Arena::deallocate(void* ptr, Bytes bytes, MemCategory category) {
  if (!ptr) return;
  const Bytes size = round_up(bytes < 1 ? 1 : bytes);
  account(category, -size);
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
  Bytes offset = static_cast<Bytes>(addr - lo);
  auto it = blocks_.find(offset);
  if (it == blocks_.end() || it->second.second || it->second.first != size)
    throw Error(fmt::format("arena: invalid free of {} B at offset {}", size, offset));
  it->second.second = true;
  Bytes bsize = size;
  // Coalesce with the next block.
  auto next = std::next(it);
  if (next != blocks_.end() && next->second.second) {
    free_.erase({next->second.first, next->first});
    bsize += next->second.first;
    blocks_.erase(next);
  }
  // Coalesce with the previous block.
  if (it != blocks_.begin()) {
    auto prev = std::prev(it);
    if (prev->second.second) {
      free_.erase({prev->second.first, prev->first});
      bsize += prev->second.first;
      blocks_.erase(it);
      it = prev;
      offset = prev->first;
    }
  }
  it->second = {bsize, true};
  free_.insert({bsize, offset});
}

}  // namespace moeflex
