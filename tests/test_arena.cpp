// The budgeted arena: best-fit placement, splitting, coalescing, exact per-category
// accounting, fragmentation measurement and the typed OOM error.
#include <gtest/gtest.h>

#include <cstring>

#include "moeflex/core/arena.h"
#include "moeflex/core/tensor.h"

using namespace moeflex;

TEST(Arena, AccountsPerCategoryWithPeaks) {
  Arena a(1 * kMiB);
  void* w = a.allocate(1000, MemCategory::weights, "w");
  void* x = a.allocate(64, MemCategory::activations, "x");
  EXPECT_EQ(a.stat(MemCategory::weights).current, 1024);  // rounded to 64 B
  EXPECT_EQ(a.stat(MemCategory::activations).current, 64);
  EXPECT_EQ(a.in_use(), 1088);
  a.deallocate(x, 64, MemCategory::activations);
  EXPECT_EQ(a.stat(MemCategory::activations).current, 0);
  EXPECT_EQ(a.stat(MemCategory::activations).peak, 64);
  EXPECT_EQ(a.stat(MemCategory::activations).allocated, 64);
  EXPECT_EQ(a.stat(MemCategory::activations).freed, 64);
  EXPECT_EQ(a.peak(), 1088);
  a.reset_peaks();
  EXPECT_EQ(a.peak(), 1024);
  a.deallocate(w, 1000, MemCategory::weights);
  EXPECT_EQ(a.in_use(), 0);
}

TEST(Arena, BestFitReusesTheSmallestHoleAndCoalesces) {
  Arena a(64 * 100);
  void* p1 = a.allocate(64 * 10, MemCategory::activations, "p1");
  void* p2 = a.allocate(64 * 5, MemCategory::activations, "p2");
  void* p3 = a.allocate(64 * 20, MemCategory::activations, "p3");
  void* p4 = a.allocate(64 * 3, MemCategory::activations, "p4");
  a.deallocate(p1, 64 * 10, MemCategory::activations);  // hole of 10 at the start
  a.deallocate(p3, 64 * 20, MemCategory::activations);  // hole of 20 in the middle
  // A request of 8 goes to the 10-block (best fit), not the 20-block.
  void* q = a.allocate(64 * 8, MemCategory::activations, "q");
  EXPECT_EQ(q, p1);
  // Fragmentation: the highest used block (p4) ends at 38 lines; 16 are in use.
  EXPECT_EQ(a.fragmentation_peak(), 64 * (38 - 16));
  a.deallocate(p2, 64 * 5, MemCategory::activations);  // 2+5+20 coalesce into one 27-block
  void* r = a.allocate(64 * 27, MemCategory::activations, "r");
  EXPECT_EQ(static_cast<char*>(r), static_cast<char*>(p1) + 64 * 8);
  a.deallocate(q, 64 * 8, MemCategory::activations);
  a.deallocate(r, 64 * 27, MemCategory::activations);
  a.deallocate(p4, 64 * 3, MemCategory::activations);
  EXPECT_EQ(a.largest_free_block(), 64 * 100);  // everything coalesced again
}

// Workspace comes from the top of the region, so transients between long-lived
// blocks leave no holes among them: the long-lived ones stay packed from below.
TEST(Arena, WorkspaceIsServedFromTheTop) {
  Arena a(64 * 100);
  void* w1 = a.allocate(64 * 10, MemCategory::workspace, "w1");
  EXPECT_EQ(static_cast<char*>(w1), static_cast<char*>(a.allocate(64, MemCategory::activations, "probe")) + 64 * 90);
  void* l1 = a.allocate(64 * 20, MemCategory::activations, "l1");
  void* w2 = a.allocate(64 * 5, MemCategory::workspace, "w2");
  EXPECT_EQ(static_cast<char*>(w2), static_cast<char*>(w1) - 64 * 5);  // just below the first
  a.deallocate(w1, 64 * 10, MemCategory::workspace);
  a.deallocate(w2, 64 * 5, MemCategory::workspace);
  void* l2 = a.allocate(64 * 20, MemCategory::activations, "l2");
  EXPECT_EQ(static_cast<char*>(l2), static_cast<char*>(l1) + 64 * 20);  // packed after l1
  // The free space is one block: 100 - 1 - 20 - 20 lines.
  EXPECT_EQ(a.largest_free_block(), 64 * 59);
}

TEST(Arena, FragmentedArenaThrowsTypedOOMWithNumbers) {
  Arena a(64 * 10);
  void* p[10];
  for (int i = 0; i < 10; ++i) p[i] = a.allocate(64, MemCategory::activations, "blk");
  for (int i = 0; i < 10; i += 2) a.deallocate(p[i], 64, MemCategory::activations);
  // 5 lines free but no 2 adjacent: a 2-line request fails.
  try {
    a.allocate(128, MemCategory::activations, "experts.gate_out");
    FAIL();
  } catch (const OutOfMemoryError& e) {
    EXPECT_EQ(e.requested, 128);
    EXPECT_EQ(e.free, 64 * 5);
    EXPECT_EQ(e.largest_free_block, 64);
    EXPECT_EQ(e.budget, 640);
    EXPECT_EQ(e.op, "experts.gate_out");
    EXPECT_NE(std::string(e.what()).find("experts.gate_out"), std::string::npos);
  }
  for (int i = 1; i < 10; i += 2) a.deallocate(p[i], 64, MemCategory::activations);
}

TEST(Arena, UnlimitedKeepsTheSameAccounting) {
  Arena a;
  EXPECT_TRUE(a.unlimited());
  {
    Tensor t(a, {3, 5}, MemCategory::grads, "g");
    EXPECT_EQ(t.nbytes(), 60);
    EXPECT_EQ(a.stat(MemCategory::grads).current, 64);
  }
  EXPECT_EQ(a.stat(MemCategory::grads).current, 0);
  EXPECT_EQ(a.stat(MemCategory::grads).peak, 64);
}

TEST(Arena, InvalidFreeIsDetected) {
  Arena a(64 * 4);
  void* p = a.allocate(64, MemCategory::workspace, "p");
  EXPECT_THROW(a.deallocate(p, 128, MemCategory::workspace), Error);
}

TEST(Arena, OverflowModeRecordsTheOOMAndServesFromTheHeap) {
  Arena a(64 * 10);
  void* p1 = a.allocate(64 * 6, MemCategory::activations, "p1");
  a.set_overflow(true);
  // 6 of 10 lines used: a request of 5 does not fit and goes to the heap.
  void* big = a.allocate(64 * 5, MemCategory::activations, "experts.fc1");
  ASSERT_NE(big, nullptr);
  std::memset(big, 7, 64 * 5);  // really usable memory
  EXPECT_EQ(a.oom_events(), 1);
  ASSERT_NE(a.first_oom(), nullptr);
  EXPECT_EQ(a.first_oom()->requested, 64 * 5);
  EXPECT_EQ(a.first_oom()->free, 64 * 4);
  EXPECT_EQ(a.first_oom()->budget, 64 * 10);
  EXPECT_EQ(a.first_oom()->op, "experts.fc1");
  EXPECT_EQ(a.overflow_in_use(), 64 * 5);
  EXPECT_EQ(a.in_use(), 64 * 11);  // the step's demand, over the budget
  EXPECT_EQ(a.peak(), 64 * 11);
  // What still fits is served from the region; a second miss keeps the first message.
  void* p2 = a.allocate(64 * 4, MemCategory::activations, "p2");
  EXPECT_EQ(a.overflow_in_use(), 64 * 5);
  void* p3 = a.allocate(64 * 2, MemCategory::workspace, "second");
  EXPECT_EQ(a.oom_events(), 2);
  EXPECT_EQ(a.first_oom()->op, "experts.fc1");
  EXPECT_EQ(a.overflow_in_use(), 64 * 7);
  a.deallocate(big, 64 * 5, MemCategory::activations);
  a.deallocate(p3, 64 * 2, MemCategory::workspace);
  EXPECT_EQ(a.overflow_in_use(), 0);
  EXPECT_EQ(a.in_use(), 64 * 10);
  a.deallocate(p2, 64 * 4, MemCategory::activations);
  a.deallocate(p1, 64 * 6, MemCategory::activations);
  EXPECT_EQ(a.in_use(), 0);
  EXPECT_EQ(a.largest_free_block(), 64 * 10);  // the region is whole again
  // Off again: the same miss throws the typed error.
  a.clear_oom_events();
  EXPECT_EQ(a.first_oom(), nullptr);
  a.set_overflow(false);
  void* q = a.allocate(64 * 9, MemCategory::activations, "q");
  EXPECT_THROW(a.allocate(64 * 2, MemCategory::activations, "r"), OutOfMemoryError);
  EXPECT_EQ(a.oom_events(), 0);
  a.deallocate(q, 64 * 9, MemCategory::activations);
  const OutOfMemoryError wrapped(OutOfMemoryError(128, 64, 64, 640, MemCategory::activations, "x"), "step 4");
  EXPECT_EQ(std::string(wrapped.what()).rfind("step 4: device out of memory: 'x' requested", 0), 0u) << wrapped.what();
  EXPECT_EQ(wrapped.requested, 128);
}
