#include "moeflex/core/arena.h"
#include "moeflex/core/block_allocator.h"
#include "moeflex/core/device.h"
#include "moeflex/core/tensor.h"

#include <malloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
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

namespace {
// Heap blocks of the unlimited arena and of overflow mode, aligned to kAlignment by
// hand: malloc(size + kAlignment + a pointer), the block's start kept just below
// the aligned address. Unlike aligned_alloc (glibc's memalign asks for size + alignment + a
// header and splits), a freed block of a size is exactly what the next request of
// that size asks for, so a step's activations come back from the heap unfaulted.
void* heap_allocate(Bytes size) {
  void* raw = std::malloc(static_cast<std::size_t>(size + Arena::kAlignment) + sizeof(void*));
  if (!raw) return nullptr;
  const auto a = (reinterpret_cast<std::uintptr_t>(raw) + sizeof(void*) + Arena::kAlignment - 1) &
                 ~std::uintptr_t(Arena::kAlignment - 1);
  reinterpret_cast<void**>(a)[-1] = raw;  // a - raw is in [8, 8 + kAlignment)
  return reinterpret_cast<void*>(a);
}

void heap_free(void* p) {
  if (p) std::free(static_cast<void**>(p)[-1]);
}
}  // namespace

bool retain_freed_heap() {
  static const bool ok = [] {
    // Setting either one ends glibc's dynamic adjustment of both (which raises the
    // thresholds as mapped blocks are freed, and trims at twice the mapping one).
    const bool mmap_ok = mallopt(M_MMAP_THRESHOLD, int(Arena::kRetainedBlockLimit)) == 1;
    const bool trim_ok = mallopt(M_TRIM_THRESHOLD, INT_MAX) == 1;
    return mmap_ok && trim_ok;
  }();
  return ok;
}

Arena::Arena(Bytes budget) : budget_(budget) {
  if (budget_ == 0) throw ConfigError("device memory budget must be positive (got 0 bytes)");
  if (budget_ < 0) retain_freed_heap();
  if (budget_ > 0) {
    if (budget_ < kAlignment)
      throw ConfigError(fmt::format("device memory budget must be at least {} B (got {} B)", kAlignment, budget_));
    budget_ = budget_ / kAlignment * kAlignment;
    page_ = std::max<Bytes>(kAlignment, sysconf(_SC_PAGESIZE));
    // A memory file behind the region, so that its pages can also be mapped
    // elsewhere (stitching); an anonymous mapping where the kernel has none.
    fd_ = memfd_create("moeflex-arena", MFD_CLOEXEC);
    if (fd_ >= 0 && ftruncate(fd_, off_t((budget_ + page_ - 1) / page_ * page_)) != 0) {
      close(fd_);
      fd_ = -1;
    }
    void* p = fd_ >= 0 ? mmap(nullptr, std::size_t(budget_), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd_, 0)
                       : mmap(nullptr, std::size_t(budget_), PROT_READ | PROT_WRITE,
                              MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
      throw Error(fmt::format("cannot reserve a device region of {}", format_bytes(budget_)));
    // A shared mapping would be shared with a forked child too (no copy on write):
    // children get none of it.
    if (fd_ >= 0) madvise(p, std::size_t(budget_), MADV_DONTFORK);
    base_ = static_cast<char*>(p);
    region_ = std::make_unique<BlockAllocator>(budget_, kAlignment);
  }
}

Arena::Arena(Bytes budget, void* region, Device* device) : budget_(budget), device_(device) {
  if (budget_ < kAlignment || !region)
    throw ConfigError(fmt::format("device arena: needs a region of at least {} B (got {} B at {})", kAlignment,
                                  budget_, fmt::ptr(region)));
  budget_ = budget_ / kAlignment * kAlignment;
  base_ = static_cast<char*>(region);
  region_ = std::make_unique<BlockAllocator>(budget_, kAlignment);
}

Arena::~Arena() {
  for (auto& [addr, st] : stitched_) munmap(reinterpret_cast<void*>(addr), std::size_t(st.length));
  if (base_ && !device_) munmap(base_, static_cast<std::size_t>(budget_));
  if (fd_ >= 0) close(fd_);
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

Bytes Arena::budget_with_reserve(Bytes bytes) {
  Bytes b = round_up(bytes + bytes / 127);
  while (b - placement_reserve(b) < bytes) b += kAlignment;
  while (b > kAlignment && b - kAlignment - placement_reserve(b - kAlignment) >= bytes) b -= kAlignment;
  return b;
}

Bytes Arena::largest_free_block() const { return region_ ? region_->largest_free_block() : -1; }

Bytes Arena::fragmentation_peak() const { return region_ ? region_->fragmentation_peak() : 0; }

void Arena::reset_peaks() { stats_.reset_peaks(); }

void* Arena::allocate(Bytes bytes, MemCategory category, std::string_view op) {
  const Bytes size = round_up(bytes < 1 ? 1 : bytes);
  if (unlimited()) {
    void* p = heap_allocate(size);
    if (!p) throw OutOfMemoryError(size, -1, -1, -1, category, std::string(op));
    stats_.account(category, size);
    return p;
  }
  const auto served = [&](void* p) {  // accounts a block handed out of the region (or stitched from it)
    stats_.account(category, size);
    window_peak_ = std::max(window_peak_, in_use());
    return p;
  };
  if (stress_ == Stress::stitch && size >= page_)
    if (void* p = stitch(size, category, /*page_by_page=*/true)) return served(p);
  if ((stress_ == Stress::compact || stress_ == Stress::evict) && !relocatable_.empty()) {
    if (stress_ == Stress::evict)
      for (const auto& [offset, r] : relocatable_by_offset())
        if (r.evictable) evict(r, offset);
    compact();
  }
  Bytes offset = 0;
  try {
    try {
      offset = region_->allocate(size, category, op, from_top_);
    } catch (const OutOfMemoryError&) {
      // Let offloads in flight land (they pin their blocks); then, with enough bytes
      // free but no block large enough, compact; when pinned blocks still split the
      // free bytes, stitch whole free pages, and evict if that is not enough.
      for (auto& [id, source] : relocatable_)
        if (source.settle) source.settle();
      const auto oom_now = [&] {
        return OutOfMemoryError(size, budget_ - region_->in_use(), region_->largest_free_block(), budget_, category,
                                std::string(op));
      };
      if (budget_ - region_->in_use() < size) throw oom_now();
      if (region_->largest_free_block() < size) compact();
      if (region_->largest_free_block() < size) {
        if (void* p = stitch(size, category)) return served(p);
        if (!make_room(size)) throw oom_now();
      }
      offset = region_->allocate(size, category, op, from_top_);
    }
  } catch (const OutOfMemoryError& oom) {
    if (!overflow_ || device_) throw;
    // Overflow mode: record the event and serve the request from the heap.
    void* p = heap_allocate(size);
    if (!p) throw Error(fmt::format("arena overflow: the host cannot provide {} for '{}'", format_bytes(size), op));
    if (oom_events_++ == 0) first_oom_ = oom;
    overflow_current_ += size;
    stats_.account(category, size);
    return p;
  }
  return served(base_ + offset);
}

void Arena::deallocate(void* ptr, Bytes bytes, MemCategory category) {
  if (!ptr) return;
  const Bytes size = round_up(bytes < 1 ? 1 : bytes);
  stats_.account(category, -size);
  if (unlimited()) {
    heap_free(ptr);
    return;
  }
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr), lo = reinterpret_cast<std::uintptr_t>(base_);
  if (auto it = stitched_.find(addr); it != stitched_.end()) {
    unstitch(it);
    return;
  }
  if (addr < lo || addr >= lo + static_cast<std::uintptr_t>(budget_)) {  // served from the heap in overflow mode
    overflow_current_ -= size;
    heap_free(ptr);
    return;
  }
  region_->deallocate(static_cast<Bytes>(addr - lo), size, category);
}

void* Arena::stitch(Bytes size, MemCategory category, bool page_by_page) {
  if (fd_ < 0 || device_) return nullptr;
  // The whole pages inside each free block, largest first, until they hold `size`
  // (page_by_page: each page its own extent, lowest first).
  const Bytes need = (size + page_ - 1) / page_ * page_;
  std::vector<std::pair<Bytes, Bytes>> pages;  // (bytes, offset)
  for (const auto& b : region_->layout()) {
    if (!b.free) continue;
    const Bytes lo = (b.offset + page_ - 1) / page_ * page_, hi = (b.offset + b.size) / page_ * page_;
    if (page_by_page)
      for (Bytes p = lo; p < hi; p += page_) pages.emplace_back(page_, p);
    else if (hi > lo)
      pages.emplace_back(hi - lo, lo);
  }
  if (!page_by_page)
    std::sort(pages.begin(), pages.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  Stitched st{need, {}, category};
  Bytes got = 0;
  for (std::size_t i = 0; i < pages.size() && got < need; ++i) {
    st.extents.emplace_back(pages[i].second, std::min(pages[i].first, need - got));
    got += st.extents.back().second;
  }
  if (got < need) return nullptr;
  // In address order, so that the range reads the holes bottom to top.
  std::sort(st.extents.begin(), st.extents.end());
  void* range = mmap(nullptr, std::size_t(need), PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (range == MAP_FAILED) return nullptr;
  char* at = static_cast<char*>(range);
  for (const auto& [offset, bytes] : st.extents) {
    void* mapped = mmap(at, std::size_t(bytes), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd_, off_t(offset));
    if (mapped == MAP_FAILED) {
      munmap(range, std::size_t(need));
      return nullptr;
    }
    at += bytes;
  }
  madvise(range, std::size_t(need), MADV_DONTFORK);  // (as the region: see the constructor)
  for (const auto& [offset, bytes] : st.extents) region_->allocate_at(offset, bytes, category);
  ++stitches_;
  stitched_extents_ += std::int64_t(st.extents.size());
  bytes_stitched_ += need;
  stitched_[reinterpret_cast<std::uintptr_t>(range)] = std::move(st);
  return range;
}

void Arena::unstitch(std::map<std::uintptr_t, Stitched>::iterator it) {
  for (const auto& [offset, bytes] : it->second.extents) region_->deallocate(offset, bytes, it->second.category);
  munmap(reinterpret_cast<void*>(it->first), std::size_t(it->second.length));
  stitched_.erase(it);
}

int Arena::add_relocatable(RelocatableSource source, EvictFn evict, SettleFn settle) {
  const int id = next_source_id_++;
  relocatable_[id] = {std::move(source), std::move(evict), std::move(settle)};
  return id;
}

// Called after a compaction when the largest free block is still smaller than
// `size`: free bytes now sit under pinned blocks, one hole per stretch between two
// pinned blocks (relocatable blocks, evictable or not, do not close a stretch: the
// next compaction slides them). Picks the stretch with the most free plus evictable
// bytes and evicts its evictable tensors (lowest first) until the stretch's free
// bytes reach `size`, then compacts again. True when a block of `size` is free
// afterwards.
bool Arena::make_room(Bytes size) {
  const std::map<Bytes, Relocatable> relocatable = relocatable_by_offset();
  struct Stretch {
    Bytes free = 0, evictable = 0;
    std::vector<Bytes> tensors;  // offsets of its evictable tensors
  };
  std::vector<Stretch> stretches(1);
  for (const auto& b : region_->layout()) {
    if (b.free) {
      stretches.back().free += b.size;
    } else if (auto it = relocatable.find(b.offset); it != relocatable.end()) {
      if (it->second.evictable) {
        stretches.back().evictable += b.size;
        stretches.back().tensors.push_back(b.offset);
      }
    } else {
      stretches.emplace_back();  // a pinned block closes the stretch
    }
  }
  const auto best = std::max_element(stretches.begin(), stretches.end(), [](const Stretch& a, const Stretch& b) {
    return a.free + a.evictable < b.free + b.evictable;
  });
  if (best->free + best->evictable < size) return false;
  Bytes room = best->free;
  for (Bytes offset : best->tensors) {
    if (room >= size) break;
    room += evict(relocatable.at(offset), offset);
  }
  compact();
  return region_->largest_free_block() >= size;
}

std::map<Bytes, Arena::Relocatable> Arena::relocatable_by_offset() {
  std::map<Bytes, Relocatable> out;
  std::vector<RelocatableTensor> tensors;
  const auto lo = reinterpret_cast<std::uintptr_t>(base_);
  for (auto& [id, source] : relocatable_) {
    tensors.clear();
    source.list(tensors);
    for (const RelocatableTensor& r : tensors) {
      Tensor* t = r.tensor;
      const auto addr = reinterpret_cast<std::uintptr_t>(t->raw());
      // Only this region's blocks (not another arena's, nor heap blocks of overflow mode).
      if (t->arena_ == this && addr >= lo && addr < lo + static_cast<std::uintptr_t>(budget_))
        out.insert_or_assign(static_cast<Bytes>(addr - lo),
                             Relocatable{t, &source, r.evictable && bool(source.evict), r.top});
    }
  }
  return out;
}

Bytes Arena::evict(const Relocatable& r, Bytes offset) {
  const Bytes bytes = region_->block_size(offset);
  if (!r.source->evict(r.tensor)) return 0;
  ++evictions_;
  bytes_evicted_ += bytes;
  return bytes;
}

void Arena::remove_relocatable(int id) { relocatable_.erase(id); }

// Moves `size` bytes from `src` down to `dst` (dst < src; the ranges may overlap).
// Host memory: memmove. Device memory: stream-ordered copies that never overlap
// (chunks no longer than the gap); when the gap is small, through a host buffer.
void Arena::move_bytes(char* dst, const char* src, Bytes size) {
  if (!device_) {
    std::memmove(dst, src, static_cast<std::size_t>(size));
    return;
  }
  const Bytes gap = src - dst;
  constexpr Bytes kMinChunk = Bytes(1) << 20;
  if (gap >= size || gap >= kMinChunk) {
    for (Bytes done = 0; done < size; done += gap)
      device_->copy(dst + done, src + done, std::min(gap, size - done));
    return;
  }
  std::vector<char> staging(static_cast<std::size_t>(size));
  device_->copy_to_host(staging.data(), src, size);
  device_->copy_from_host(dst, staging.data(), size);
}

Bytes Arena::defragment(bool settle) {
  if (unlimited()) return 0;
  if (settle)
    for (auto& [id, source] : relocatable_)
      if (source.settle) source.settle();
  return region_->free_block_count() <= 1 ? 0 : compact();
}

Bytes Arena::compact() {
  if (unlimited()) return 0;
  std::map<Bytes, Relocatable> by_offset = relocatable_by_offset();
  if (by_offset.empty()) return 0;
  std::vector<Staged> staged = stage_top_class(by_offset);
  const auto moves = region_->compact([&](Bytes offset) { return by_offset.count(offset) > 0; });
  Bytes moved = 0;
  for (const BlockMove& m : moves) {
    move_bytes(base_ + m.to, base_ + m.from, m.size);
    by_offset.at(m.from).tensor->data_ = base_ + m.to;
    moved += m.size;
  }
  for (const Staged& t : staged) moved += t.size;
  place_at_top(staged);
  ++compactions_;
  bytes_compacted_ += moved;
  return moved;
}

// Takes the top class out of by_offset and out of the region, each through a host
// copy; highest first, so that place_at_top keeps their order.
std::vector<Arena::Staged> Arena::stage_top_class(std::map<Bytes, Relocatable>& by_offset) {
  std::vector<Staged> staged;
  for (auto it = by_offset.rbegin(); it != by_offset.rend(); ++it) {
    if (!it->second.top) continue;
    Tensor* t = it->second.tensor;
    Staged s{t, region_->block_size(it->first), std::vector<char>(std::size_t(t->nbytes()))};
    if (device_) device_->copy_to_host(s.host.data(), t->raw(), t->nbytes());
    else std::memcpy(s.host.data(), t->raw(), std::size_t(t->nbytes()));
    region_->deallocate(it->first, s.size, t->category());
    staged.push_back(std::move(s));
  }
  for (const Staged& s : staged) by_offset.erase(static_cast<Bytes>(static_cast<char*>(s.tensor->raw()) - base_));
  return staged;
}

// Puts the staged tensors back, each at the top end of the highest free block that
// holds it. Each fits in the stretch it left or above (the stretches' free bytes
// only grew, and higher ones are placed first), so this cannot fail.
void Arena::place_at_top(std::vector<Staged>& staged) {
  for (Staged& s : staged) {
    const Bytes offset = region_->allocate(s.size, s.tensor->category(), "compaction", /*from_top=*/true);
    char* p = base_ + offset;
    if (device_) device_->copy_from_host(p, s.host.data(), s.tensor->nbytes());
    else std::memcpy(p, s.host.data(), std::size_t(s.tensor->nbytes()));
    s.tensor->data_ = p;
  }
}

}  // namespace moeflex
