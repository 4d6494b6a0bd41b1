// The budgeted device arena.
//
// Policy (as in c10's caching allocator, simplified to one region):
// - With a budget, the arena owns one region of exactly `budget` bytes, reserved
//   up front (pages are committed lazily by the OS). Requests are rounded up to
//   kAlignment and served best-fit from a free list ordered by (size, offset);
//   a larger block is split and the remainder returned to the free list; a freed
//   block coalesces with free neighbours. Fragmentation therefore exists and is
//   measured (`fragmentation_peak()`), as on a GPU.
// - Workspace requests (short-lived) are served from the top instead: the highest
//   free block that fits, carved from its top end, so that transients do not leave
//   holes between the long-lived blocks growing from below.
// - Without a budget (unlimited) every request is its own aligned host
//   allocation; the accounting is identical, fragmentation is zero. The first
//   unlimited arena of the process has glibc keep what is freed (retain_freed_heap),
//   as a caching allocator keeps device memory: else every step faults its
//   activations in again.
// - Accounting is exact and per category: every byte handed out is counted in
//   one `Stat{current, peak, allocated, freed}`, changed in one place (`account`).
// - A request that does not fit throws OutOfMemoryError naming the request, the
//   free bytes, the largest free block, the budget and the operator.
// - Compaction: a request that fails although enough bytes are free (fragmentation)
//   makes the arena slide the relocatable tensors down (BlockAllocator::compact),
//   re-point them and try once more; those a source marks `top` (hand-offs between
//   actions) leave through a host copy first and come back at the top end. Relocatable tensors are those the registered
//   sources (the activation stashes) own alone with no copy in flight; everything
//   else is pinned. Bytes in use never change, so the planner's byte projection
//   stays exact; the cost is a memmove, counted in compactions()/bytes_compacted().
//   Before compacting, it lets the sources finish their offloads in flight, whose
//   device blocks are pinned until the copy lands (the planner counts them as gone
//   by the next decision point anyway).
//   When compaction is not enough (blocks pinned by the running operator split the
//   free bytes) and stitching (below) cannot serve the request, the arena evicts
//   relocatable tensors of the stretch between pinned blocks that can hold the
//   request (their sources copy them to the host and bring them back when next
//   needed), then compacts again: bytes in use only go down, so a plan that fits in
//   bytes never fails on fragmentation while relocatable tensors can make room.
//   Counted in evictions()/bytes_evicted(). A source may list a tensor as movable
//   but not evictable (e.g. one a queued weight-gradient GEMM will read: moving it
//   is safe, a host copy would free nothing); such a tensor slides in compaction
//   but neither splits a stretch nor counts as room.
// - Stitching (as CUDA's virtual memory management lets PyTorch's expandable
//   segments do): the host region is a memory file mapped once as the arena's view.
//   When compaction leaves the free bytes split by pinned blocks (those the running
//   operator holds), the arena first serves the request from several free holes at
//   once, before evicting anything (mapping pages costs no copy): it takes whole
//   pages out of them and maps those pages, in order, into one fresh virtual range,
//   which the tensor sees as contiguous. A hole loses less than a page at each end,
//   so a request fits whenever the free bytes exceed it by two pages per hole; the
//   placement reserve keeps that room (for 32 holes from a 32 MiB budget up), and
//   the planner and the printed minimum never plan into it. A stitched block is
//   pinned for its life (compaction and eviction leave it). Counted in stitches().
//   A forked child gets none of the region (MADV_DONTFORK: a shared mapping is not
//   copied on write). The CUDA arena (a cudaMalloc region) does not stitch.
// - Action-scoped placement: while from_top is on (the pipeline executor turns it
//   on for backward actions, whose recomputed activations and gradients live only
//   as long as the action), activations too are served from the top; the
//   long-lived saves stay below, so what a backward frees of them joins the one
//   free block between the two ends instead of opening holes under pinned blocks.
//   Between compute actions the executor calls defragment(), which compacts when
//   the free bytes are split, while nothing but relocatable tensors and persistent
//   state is held.
// - Overflow mode (set_overflow): a request that does not fit is recorded as an OOM
//   event (counted, the first one kept) and served from the heap instead, so a run
//   can go on and report its OOMs; heap blocks are told apart by address on free.
#pragma once
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "moeflex/core/error.h"
#include "moeflex/core/units.h"

namespace moeflex {

/// What a device allocation is for; the arena keeps one Stat per category.
enum class MemCategory : int { weights, grads, optimizer, activations, workspace, count };

/// "weights", "grads", ...
const char* to_string(MemCategory c);

/// Byte counters of one category (c10's Stat): in use now, high-water mark,
/// and cumulative bytes allocated and freed.
struct Stat {
  Bytes current = 0;
  Bytes peak = 0;
  Bytes allocated = 0;
  Bytes freed = 0;
};

/// Thrown when the arena cannot serve a request within its budget.
class OutOfMemoryError : public Error {
 public:
  OutOfMemoryError(Bytes requested, Bytes free, Bytes largest_free_block, Bytes budget,
                   MemCategory category, std::string op);
  /// The same error with `context` prefixed to its message ("context: ...").
  OutOfMemoryError(const OutOfMemoryError& cause, const std::string& context);
  Bytes requested;           ///< bytes asked for (after rounding)
  Bytes free;                ///< budget minus bytes in use
  Bytes largest_free_block;  ///< largest contiguous free block
  Bytes budget;              ///< arena capacity
  MemCategory category;
  std::string op;            ///< the operator or owner that asked
};

/// One budgeted region of device memory with exact per-category accounting.
/// Not thread-safe: one arena per device, used from the thread that runs the step.
/// Per-category and total byte counters; `account` is the only place they change.
class MemoryStats {
 public:
  /// Adds `delta` bytes (negative: a free) to category `c` and to the total.
  void account(MemCategory c, Bytes delta);
  const Stat& stat(MemCategory c) const { return stats_[static_cast<int>(c)]; }
  const Stat& total() const { return total_; }
  /// Resets every peak to the current value (call at step boundaries).
  void reset_peaks();

 private:
  std::array<Stat, static_cast<int>(MemCategory::count)> stats_{};
  Stat total_{};
};

class BlockAllocator;
class Tensor;
class Device;

/// Has glibc's malloc keep freed memory for reuse instead of handing it back to
/// the OS: no trimming of the heap's top (M_TRIM_THRESHOLD) and blocks up to
/// kRetainedBlockLimit from the heap rather than from mappings of their own that
/// free() unmaps (M_MMAP_THRESHOLD). An unlimited arena allocates and frees a
/// step's activations every step; without this each step page-faults them in again
/// (measured 2026-11-30 with `perf stat -e page-faults`, bench/sim_check.toml with
/// --ep 2 on 2 ranks: 7,400 faults, about 29 MiB, per rank and step; with it, and
/// the arena's blocks from malloc rather than aligned_alloc, 170; pp2-dp2-ep2 on
/// 2 cores 4-5% faster).
/// Resident memory then stays at the heap's high-water mark (the arena's peak and
/// whatever else the process allocated at that moment), as with a caching allocator;
/// malloc_trim (generate does) still returns it. Idempotent, process-wide; returns
/// false where glibc refused a setting (the run is only slower then).
bool retain_freed_heap();

class Arena {
 public:
  static constexpr Bytes kAlignment = 64;  ///< bytes; one AVX-512 cache line
  static constexpr Bytes kUnlimited = -1;
  /// Largest block retain_freed_heap() has malloc serve from its heap: glibc's
  /// ceiling for M_MMAP_THRESHOLD on 64-bit (HEAP_MAX_SIZE / 2). Larger blocks
  /// still get mappings of their own.
  static constexpr Bytes kRetainedBlockLimit = Bytes(32) << 20;
  /// The most bytes of a budget the planner and minimum_budget() leave free for
  /// placement: stitching loses less than one 4 KiB page at each end of a hole, and
  /// this is room for 32 holes (pinned blocks of a running operator number far fewer).
  static constexpr Bytes kPlacementReserve = Bytes(256) << 10;
  /// The placement reserve of a budget (bytes): 1/128 of it, at most
  /// kPlacementReserve (small budgets hold small tensors, whose holes are rarely
  /// whole pages), a multiple of kAlignment.
  static Bytes placement_reserve(Bytes budget) {
    return std::min(kPlacementReserve, budget / 128 / kAlignment * kAlignment);
  }
  /// The smallest budget (a multiple of kAlignment) whose bytes less its placement
  /// reserve hold `bytes`.
  static Bytes budget_with_reserve(Bytes bytes);

  /// budget: capacity in bytes, or kUnlimited (then calls retain_freed_heap()).
  explicit Arena(Bytes budget = kUnlimited);
  /// An arena over `budget` bytes of device memory at `region` (owned by the caller,
  /// e.g. one cudaMalloc), whose memory `device` touches for the engine. Same
  /// allocator and accounting as the host arena; overflow mode is off (a device
  /// cannot serve the excess from the heap), so requests that do not fit throw.
  Arena(Bytes budget, void* region, Device* device);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  /// Returns `bytes` (rounded up to kAlignment) of kAlignment-aligned memory.
  /// Throws OutOfMemoryError when it does not fit; `op` names the requester.
  void* allocate(Bytes bytes, MemCategory category, std::string_view op);
  /// Returns a block obtained from allocate(); `bytes` and `category` as given there.
  void deallocate(void* ptr, Bytes bytes, MemCategory category);

  /// Rounded size that allocate(bytes) accounts.
  static constexpr Bytes round_up(Bytes bytes) {
    return (bytes + kAlignment - 1) / kAlignment * kAlignment;
  }

  Bytes budget() const { return budget_; }
  bool unlimited() const { return budget_ < 0; }
  /// The device whose memory this arena hands out; null for host memory.
  Device* device() const { return device_; }
  const Stat& stat(MemCategory c) const { return stats_.stat(c); }
  const Stat& total() const { return stats_.total(); }
  Bytes in_use() const { return stats_.total().current; }
  Bytes peak() const { return stats_.total().peak; }
  /// Largest contiguous free block (budget - in_use when unlimited is meaningless: returns -1).
  Bytes largest_free_block() const;
  /// High-water mark of (region end of highest used block - bytes in use): the bytes
  /// lost to fragmentation at the worst moment so far. Zero when unlimited.
  Bytes fragmentation_peak() const;
  /// Resets every peak to the current value (call at step boundaries).
  void reset_peaks();

  /// Placement of the requests that follow (see the file comment): while on, every
  /// request is served from the top end of the highest free block that fits.
  void set_from_top(bool on) { from_top_ = on; }
  bool from_top() const { return from_top_; }
  /// Turns from_top on for its lifetime and restores the previous setting after.
  class FromTop {
   public:
    explicit FromTop(Arena& arena) : arena_(arena), was_(arena.from_top()) { arena_.set_from_top(true); }
    ~FromTop() { arena_.set_from_top(was_); }
    FromTop(const FromTop&) = delete;
    FromTop& operator=(const FromTop&) = delete;

   private:
    Arena& arena_;
    bool was_;
  };

  /// Overflow mode (see the file comment): while on, allocate() records a request
  /// that does not fit as an OOM event and serves it from the heap instead of
  /// throwing. No effect without a budget.
  void set_overflow(bool on) { overflow_ = on; }
  bool overflow() const { return overflow_; }
  /// OOM events recorded in overflow mode since clear_oom_events().
  std::int64_t oom_events() const { return oom_events_; }
  /// The first of them (what allocate() would have thrown); null when none.
  const OutOfMemoryError* first_oom() const { return first_oom_ ? &*first_oom_ : nullptr; }
  void clear_oom_events() {
    oom_events_ = 0;
    first_oom_.reset();
  }
  /// Bytes served from the heap outside the budget and not yet freed.
  Bytes overflow_in_use() const { return overflow_current_; }

  /// One tensor a source offers: movable now, and whether its source's EvictFn can
  /// take it off the device (false: it may only be moved).
  /// `top`: the tensor belongs at the top end of the region (a hand-off between
  /// actions, pinned by the next action that reads it): compaction places it there
  /// instead of sliding it down.
  struct RelocatableTensor {
    RelocatableTensor(Tensor* t, bool can_evict = true, bool at_top = false)  // NOLINT: implicit
        : tensor(t), evictable(can_evict), top(at_top) {}
    Tensor* tensor;
    bool evictable;
    bool top;
  };
  /// A source of relocatable tensors: appends the tensors of this arena that may be
  /// moved right now (held only by owners that read them through the Tensor, never
  /// through a raw pointer kept across an allocation, and no copy in flight).
  using RelocatableSource = std::function<void(std::vector<RelocatableTensor>&)>;
  /// Moves one of the source's relocatable tensors out of device memory (e.g. to a
  /// host copy it brings back when next needed) and frees its block; false when it
  /// cannot.
  using EvictFn = std::function<bool(Tensor*)>;
  /// Waits for the source's copies in flight (offloads) and frees the device blocks
  /// they release.
  using SettleFn = std::function<void()>;
  /// Registers a source for compaction (with `evict`, for eviction; with `settle`,
  /// for waiting on its offloads); returns its id for remove_relocatable().
  int add_relocatable(RelocatableSource source, EvictFn evict = {}, SettleFn settle = {});
  /// Unregisters a source (unknown ids are ignored).
  void remove_relocatable(int id);
  /// Defragments the region now (see the file comment): moves every relocatable
  /// tensor down and re-points it. Returns the bytes moved (0 when unlimited).
  Bytes compact();
  /// Compacts when the free bytes of the region are split over more than one block
  /// (a no-op otherwise, and when unlimited). With `settle`, the sources' offloads
  /// in flight land first (their blocks are freed); else those blocks stay where
  /// they are. Returns the bytes moved.
  Bytes defragment(bool settle);
  /// The most bytes in use since reset_window() (a high-water mark the caller
  /// scopes, e.g. to one pipeline action; the step's peak is unaffected).
  Bytes window_peak() const { return window_peak_; }
  void reset_window() { window_peak_ = in_use(); }
  /// Compactions since construction, and the bytes they moved.
  std::int64_t compactions() const { return compactions_; }
  /// Tensors evicted to make room (see the file comment), and their bytes.
  std::int64_t evictions() const { return evictions_; }
  /// Requests served by stitching free pages into one virtual range (see the file
  /// comment), their bytes, and the free-page extents they were made of.
  std::int64_t stitches() const { return stitches_; }
  /// Whether this arena stitches (a host region backed by a memory file).
  bool can_stitch() const { return fd_ >= 0 && !device_; }
  std::int64_t stitched_extents() const { return stitched_extents_; }
  Bytes bytes_stitched() const { return bytes_stitched_; }
  Bytes bytes_evicted() const { return bytes_evicted_; }
  /// Testing: before every allocation, compact (compact) or evict every
  /// relocatable tensor and compact (evict), so that a pointer into a relocatable
  /// tensor held across an allocation, or a wrong bring-back, shows up as wrong
  /// results; or (stitch) serve every request of a page or more by stitching,
  /// each page of it mapped on its own from the lowest free pages, so that a
  /// tensor spread over the region, or wrongly treated as a region block, shows
  /// up the same way.
  enum class Stress { off, compact, evict, stitch };
  void set_stress(Stress stress) { stress_ = stress; }
  Bytes bytes_compacted() const { return bytes_compacted_; }

 private:
  Bytes budget_;
  char* base_ = nullptr;
  Device* device_ = nullptr;  // null: host memory, mapped (and unmapped) here
  int fd_ = -1;               // the memory file behind a host region (-1: none, no stitching)
  Bytes page_ = 4096;         // the host's page size
  // Stitched blocks by address: their virtual range's length and physical extents.
  struct Stitched {
    Bytes length = 0;
    std::vector<std::pair<Bytes, Bytes>> extents;  // (offset, bytes) in the region
    MemCategory category = MemCategory::activations;
  };
  std::map<std::uintptr_t, Stitched> stitched_;
  std::int64_t stitches_ = 0, stitched_extents_ = 0;
  Bytes bytes_stitched_ = 0;
  // Serves `size` bytes from whole free pages (of the largest free blocks, or page by
  // page from the lowest) mapped into one range; null when the free pages are too
  // few (or the region has no memory file).
  void* stitch(Bytes size, MemCategory category, bool page_by_page = false);
  void unstitch(std::map<std::uintptr_t, Stitched>::iterator it);
  MemoryStats stats_;                      // everything handed out, overflow included
  std::unique_ptr<BlockAllocator> region_;  // bounded mode: the blocks of [base_, base_ + budget_)
  bool overflow_ = false;
  bool from_top_ = false;
  Bytes window_peak_ = 0;
  std::int64_t oom_events_ = 0;
  std::optional<OutOfMemoryError> first_oom_;
  Bytes overflow_current_ = 0;
  void move_bytes(char* dst, const char* src, Bytes size);
  bool make_room(Bytes size);
  struct Source {
    RelocatableSource list;
    EvictFn evict;
    SettleFn settle;
  };
  struct Relocatable {
    Tensor* tensor;
    Source* source;
    bool evictable;  // the source offered it for eviction (and has an EvictFn)
    bool top;        // placed at the top end by compaction
  };
  // Every source's relocatable tensors in this region, by block offset.
  std::map<Bytes, Relocatable> relocatable_by_offset();
  // Compaction's top class: copies of the tensors that go back at the top end.
  struct Staged {
    Tensor* tensor;
    Bytes size;
    std::vector<char> host;
  };
  std::vector<Staged> stage_top_class(std::map<Bytes, Relocatable>& by_offset);
  void place_at_top(std::vector<Staged>& staged);
  // Evicts one (counted); returns the bytes freed (0 when its source refuses).
  Bytes evict(const Relocatable& r, Bytes offset);
  std::map<int, Source> relocatable_;
  std::int64_t evictions_ = 0;
  Bytes bytes_evicted_ = 0;
  int next_source_id_ = 0;
  Stress stress_ = Stress::off;
  std::int64_t compactions_ = 0;
  Bytes bytes_compacted_ = 0;
};

}  // namespace moeflex
