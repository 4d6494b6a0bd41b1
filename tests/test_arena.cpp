// The budgeted arena: best-fit placement, splitting, coalescing, exact per-category
// accounting, fragmentation measurement and the typed OOM error.
#include <gtest/gtest.h>

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
  void* p1 = a.allocate(64 * 10, MemCategory::workspace, "p1");
  void* p2 = a.allocate(64 * 5, MemCategory::workspace, "p2");
  void* p3 = a.allocate(64 * 20, MemCategory::workspace, "p3");
  void* p4 = a.allocate(64 * 3, MemCategory::workspace, "p4");
  a.deallocate(p1, 64 * 10, MemCategory::workspace);  // hole of 10 at the start
  a.deallocate(p3, 64 * 20, MemCategory::workspace);  // hole of 20 in the middle
  // A request of 8 goes to the 10-block (best fit), not the 20-block.
  void* q = a.allocate(64 * 8, MemCategory::workspace, "q");
  EXPECT_EQ(q, p1);
  // Fragmentation: the highest used block (p4) ends at 38 lines; 16 are in use.
  EXPECT_EQ(a.fragmentation_peak(), 64 * (38 - 16));
  a.deallocate(p2, 64 * 5, MemCategory::workspace);  // 2+5+20 coalesce into one 27-block
  void* r = a.allocate(64 * 27, MemCategory::workspace, "r");
  EXPECT_EQ(static_cast<char*>(r), static_cast<char*>(p1) + 64 * 8);
  a.deallocate(q, 64 * 8, MemCategory::workspace);
  a.deallocate(r, 64 * 27, MemCategory::workspace);
  a.deallocate(p4, 64 * 3, MemCategory::workspace);
  EXPECT_EQ(a.largest_free_block(), 64 * 100);  // everything coalesced again
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
