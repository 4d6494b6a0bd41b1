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
//   allocation; the accounting is identical, fragmentation is zero.
// - Accounting is exact and per category: every byte handed out is counted in
//   one `Stat{current, peak, allocated, freed}`, changed in one place (`account`).
// - A request that does not fit throws OutOfMemoryError naming the request, the
//   free bytes, the largest free block, the budget and the operator.
// - Overflow mode (set_overflow): a request that does not fit is recorded as an OOM
//   event (counted, the first one kept) and served from the heap instead, so a run
//   can go on and report its OOMs; heap blocks are told apart by address on free.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>

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

class Arena {
 public:
  static constexpr Bytes kAlignment = 64;  ///< bytes; one AVX-512 cache line
  static constexpr Bytes kUnlimited = -1;

  /// budget: capacity in bytes, or kUnlimited.
  explicit Arena(Bytes budget = kUnlimited);
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

 private:
  Bytes budget_;
  char* base_ = nullptr;
  MemoryStats stats_;                      // everything handed out, overflow included
  std::unique_ptr<BlockAllocator> region_;  // bounded mode: the blocks of [base_, base_ + budget_)
  bool overflow_ = false;
  std::int64_t oom_events_ = 0;
  std::optional<OutOfMemoryError> first_oom_;
  Bytes overflow_current_ = 0;
};

}  // namespace moeflex
