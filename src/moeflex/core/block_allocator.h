// The allocator behind every budgeted region: the CPU Arena's, and the CUDA
// backend's (DeviceArena, the pinned host pool). It works on byte offsets inside [0, capacity) and never touches memory, so
// one bookkeeping serves any base pointer (mmap, cudaMalloc, cudaHostAlloc) and is
// tested without a GPU.
//
// Policy (as in c10's caching allocator, simplified to one region):
// - Requests are rounded up to the allocator's alignment and served best-fit from a
//   free list ordered by (size, offset); a larger block is split and the remainder
//   returned to the free list; a freed block coalesces with free neighbours.
//   Fragmentation therefore exists and is measured (`fragmentation_peak()`).
// - Workspace requests (short-lived) are served from the top instead: the top end of
//   the highest free block that fits, so transients do not leave holes between the
//   long-lived blocks growing from below. (The CPU Arena's rule; test_backend_host
//   replays random traces on both and requires the same placement and accounting.)
// - Accounting is exact and per category: every byte handed out is counted in one
//   `Stat{current, peak, allocated, freed}`, changed in one place
//   (MemoryStats::account).
// - A request that does not fit throws OutOfMemoryError naming the request, the free
//   bytes, the largest free block, the capacity and the operator.
#pragma once
#include <array>
#include <cstddef>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "moeflex/core/arena.h"  // MemCategory, Stat, MemoryStats, OutOfMemoryError
#include "moeflex/core/error.h"
#include "moeflex/core/units.h"

namespace moeflex {

/// One block move of a compaction: `size` bytes from offset `from` down to offset
/// `to` (to < from; the ranges may overlap).
struct BlockMove {
  Bytes from = 0;
  Bytes to = 0;
  Bytes size = 0;
};

/// Best-fit allocation of offsets in [0, capacity) with splitting, coalescing,
/// fragmentation measurement and exact per-category accounting. Not thread-safe.
class BlockAllocator {
 public:
  /// capacity: bytes (> 0), rounded down to a multiple of `alignment` (a power of
  /// two). Throws ConfigError when the rounded capacity is not positive.
  BlockAllocator(Bytes capacity, Bytes alignment);

  /// `bytes` (at least 1) rounded up to the alignment.
  Bytes round_up(Bytes bytes) const;
  /// Reserves round_up(bytes) and returns the block's offset (a multiple of the
  /// alignment). Throws OutOfMemoryError when no free block is large enough; `op`
  /// names the requester. Placement: best fit from below; workspace, or any
  /// category with `from_top`, the top end of the highest free block that fits.
  Bytes allocate(Bytes bytes, MemCategory category, std::string_view op, bool from_top = false);
  /// Reserves exactly [offset, offset + round_up(bytes)), which must lie inside one
  /// free block (offset a multiple of the alignment); the rest of that block stays
  /// free. For the Arena's stitched allocations. Throws Error otherwise.
  void allocate_at(Bytes offset, Bytes bytes, MemCategory category);
  /// Returns the block at `offset`; `bytes` and `category` as given to allocate().
  /// Throws Error for an offset that is not a live block of that size.
  void deallocate(Bytes offset, Bytes bytes, MemCategory category);

  Bytes capacity() const { return capacity_; }
  /// Size of the live or free block at `offset`; -1 when no block starts there.
  Bytes block_size(Bytes offset) const {
    auto it = blocks_.find(offset);
    return it == blocks_.end() ? -1 : it->second.first;
  }
  Bytes alignment() const { return alignment_; }
  const MemoryStats& stats() const { return stats_; }
  MemoryStats& stats() { return stats_; }
  Bytes in_use() const { return stats_.total().current; }
  /// Largest contiguous free block, in bytes.
  Bytes largest_free_block() const { return free_.empty() ? 0 : free_.rbegin()->first; }
  /// Number of free blocks (1 when nothing is allocated: everything coalesced).
  std::size_t free_block_count() const { return free_.size(); }
  /// High-water mark of (end of the highest used block - bytes in use): the bytes
  /// lost to fragmentation at the worst moment so far.
  Bytes fragmentation_peak() const { return frag_peak_; }

  /// Compaction (sliding, as in a mark-compact collector): every live block for
  /// which `movable(offset)` is true slides down to the lowest free offset above
  /// the nearest pinned (not movable) live block below it, so the free bytes of
  /// each stretch between pinned blocks gather into one block under the next
  /// pinned block (or at the top of the region). Accounting is unchanged.
  /// Returns the moves in increasing source order: each destination lies below its
  /// source and above every earlier move's destination end, so applying them in
  /// order with an overlap-safe copy (memmove) never overwrites a block not yet
  /// moved. The caller moves the bytes and re-points the owners.
  std::vector<BlockMove> compact(const std::function<bool(Bytes offset)>& movable);

  /// One block of the layout: [offset, offset + size), free or in use.
  struct Block {
    Bytes offset = 0;
    Bytes size = 0;
    bool free = false;
  };
  /// Every block in offset order (for compaction planning and diagnostics).
  std::vector<Block> layout() const;

 private:
  Bytes capacity_;
  Bytes alignment_;
  MemoryStats stats_;
  // All blocks by offset (value: size, free?) and free blocks by (size, offset).
  std::map<Bytes, std::pair<Bytes, bool>> blocks_;
  std::set<std::pair<Bytes, Bytes>> free_;
  Bytes frag_peak_ = 0;
  // Marks [offset, offset + size) of the free block at block_offset used (size
  // aligned, inside it), keeps the rest free, accounts and tracks fragmentation.
  void take(Bytes block_offset, Bytes offset, Bytes size, MemCategory category);
};

}  // namespace moeflex
