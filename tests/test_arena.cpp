// The budgeted arena: best-fit placement, splitting, coalescing, exact per-category
// accounting, fragmentation measurement and the typed OOM error.
#include <gtest/gtest.h>

#include <sys/resource.h>

#include <cstring>
#include <memory>
#include <vector>

#include "moeflex/core/arena.h"
#include "moeflex/core/block_allocator.h"
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

// An unlimited arena keeps what a step frees (retain_freed_heap): a block freed and
// requested again, as a step's activations are every step, comes back without the
// OS faulting its pages in again. Without the retention glibc unmaps an 8 MiB block
// on free (its mapping threshold starts at 128 KiB): 2,048 faults to touch it again.
TEST(Arena, UnlimitedArenaReusesFreedMemoryWithoutFaultingItIn) {
  Arena a;  // unlimited
  EXPECT_TRUE(retain_freed_heap());
  const Bytes n = 8 * kMiB;
  auto minor_faults = [] {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return long(u.ru_minflt);
  };
  auto touch = [&](void* p) {
    std::memset(p, 1, std::size_t(n));
    return static_cast<unsigned char*>(p)[n - 1];
  };
  void* p = a.allocate(n, MemCategory::activations, "x");
  EXPECT_EQ(touch(p), 1);  // first use: its pages fault in
  a.deallocate(p, n, MemCategory::activations);
  const long before = minor_faults();
  void* q = a.allocate(n, MemCategory::activations, "x");
  EXPECT_EQ(touch(q), 1);
  const long faults = minor_faults() - before;
  a.deallocate(q, n, MemCategory::activations);
  EXPECT_LT(faults, n / 4096 / 8) << "touching a re-allocated " << n << "-byte block faulted " << faults
                                  << " pages in again";
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

// Compaction slides the movable blocks down to the nearest pinned block below them;
// the free bytes of each stretch gather in one block; accounting does not change.
TEST(BlockAllocator, CompactSlidesMovableBlocksDownToThePinnedOnes) {
  BlockAllocator b(1000 * 64, 64);
  std::vector<Bytes> off;
  for (int i = 0; i < 8; ++i) off.push_back(b.allocate(100 * 64, MemCategory::activations, "x"));
  // Holes at blocks 1, 3 and 6; block 4 is pinned.
  for (int i : {1, 3, 6}) b.deallocate(off[std::size_t(i)], 100 * 64, MemCategory::activations);
  const Bytes in_use = b.in_use();
  EXPECT_EQ(b.largest_free_block(), 200 * 64);  // the top, after block 7
  const auto moves = b.compact([&](Bytes o) { return o != off[4]; });
  // Block 2 moves into hole 1 (block 3's hole then lies under pinned block 4);
  // block 5 sits right on block 4 and stays; block 7 slides down into hole 6.
  ASSERT_EQ(moves.size(), 2u);
  EXPECT_EQ(moves[0].from, off[2]);
  EXPECT_EQ(moves[0].to, off[1]);
  EXPECT_EQ(moves[1].from, off[7]);
  EXPECT_EQ(moves[1].to, off[6]);
  EXPECT_EQ(b.in_use(), in_use);
  // Two free blocks: 200 lines under pinned block 4, and 100 + 200 on top.
  EXPECT_EQ(b.free_block_count(), 2u);
  EXPECT_EQ(b.largest_free_block(), 300 * 64);
  EXPECT_EQ(b.layout()[2].offset, off[2]);  // [0, 100) [100, 200) then the free [200, 400)
  EXPECT_TRUE(b.layout()[2].free);
  EXPECT_EQ(b.layout()[2].size, 200 * 64);
  // The layout is consistent: freeing every block coalesces the region into one.
  for (const auto& blk : b.layout())
    if (!blk.free) b.deallocate(blk.offset, blk.size, MemCategory::activations);
  EXPECT_EQ(b.free_block_count(), 1u);
  EXPECT_EQ(b.largest_free_block(), 1000 * 64);
}

namespace {
// A compaction source owning tensors of one arena; eviction frees a tensor and
// remembers its bytes.
struct TestSource {
  Arena& arena;
  std::vector<std::unique_ptr<Tensor>> tensors;
  std::vector<Bytes> evicted;
  int id = -1;
  explicit TestSource(Arena& a, bool can_evict, bool at_top = false) : arena(a) {
    id = arena.add_relocatable(
        [this, can_evict, at_top](std::vector<Arena::RelocatableTensor>& out) {
          for (auto& t : tensors)
            if (t->defined()) out.emplace_back(t.get(), can_evict, at_top);
        },
        can_evict ? Arena::EvictFn([this](Tensor* t) {
          evicted.push_back(t->nbytes());
          t->reset();
          return true;
        })
                  : Arena::EvictFn());
  }
  ~TestSource() { arena.remove_relocatable(id); }
  Tensor* add(std::int64_t floats, float value) {
    tensors.push_back(std::make_unique<Tensor>(arena, std::vector<std::int64_t>{floats}, MemCategory::activations, "m"));
    for (std::int64_t i = 0; i < floats; ++i) tensors.back()->f32()[i] = value + float(i);
    return tensors.back().get();
  }
};
}  // namespace

// A request larger than any hole, with enough bytes free: the arena moves the
// relocatable tensors (contents intact, pointers updated) and serves it.
TEST(Arena, CompactsOnFragmentationAndMovesTheContents) {
  Arena arena(64 * 1024);  // 16384 floats
  TestSource src(arena, false);
  std::vector<Tensor*> m;
  for (int i = 0; i < 8; ++i) m.push_back(src.add(2048, float(i * 10000)));
  for (int i : {0, 2, 4, 6}) m[std::size_t(i)]->reset();  // four holes of 8 KiB
  EXPECT_EQ(arena.largest_free_block(), 8 * 1024);
  Tensor big(arena, {4 * 2048}, MemCategory::activations, "big");  // 32 KiB: needs all four holes
  EXPECT_EQ(arena.compactions(), 1);
  EXPECT_EQ(arena.bytes_compacted(), 4 * 8 * 1024);  // every survivor moved down
  for (int i : {1, 3, 5, 7})
    for (std::int64_t j = 0; j < 2048; j += 511) EXPECT_EQ(m[std::size_t(i)]->f32()[j], float(i * 10000) + float(j));
  EXPECT_EQ(arena.evictions(), 0);
}

// Pinned blocks split the free bytes so that compaction is not enough: the arena
// evicts relocatable tensors of the stretch that can hold the request.
TEST(Arena, EvictsRelocatableTensorsWhenPinnedBlocksSplitTheFreeBytes) {
  Arena arena(64 * 1024);
  TestSource src(arena, true);
  // KiB: [m0 4][m1 4][p0 4][m2 4][p1 4][m3 16][m4 8][p2 4][p3 16]; p pinned (not the source's).
  Tensor* m0 = src.add(1024, 0);
  Tensor* m1 = src.add(1024, 1);
  Tensor p0(arena, {1024}, MemCategory::activations, "pinned0");
  Tensor* m2 = src.add(1024, 2);
  Tensor p1(arena, {1024}, MemCategory::activations, "pinned1");
  Tensor* m3 = src.add(4096, 3);
  Tensor* m4 = src.add(2048, 4);
  Tensor p2(arena, {1024}, MemCategory::activations, "pinned2");
  Tensor p3(arena, {4096}, MemCategory::activations, "pinned3");
  ASSERT_EQ(arena.in_use(), 64 * 1024);
  m1->reset();
  m2->reset();
  m4->reset();  // 16 KiB free in holes of 4, 4 and 8 KiB
  // 12 KiB: the stretch between p1 and p2 holds 8 KiB free plus m3's 16 KiB.
  Tensor big(arena, {3 * 1024}, MemCategory::activations, "big");
  EXPECT_EQ(arena.evictions(), 1);
  ASSERT_EQ(src.evicted.size(), 1u);
  EXPECT_EQ(src.evicted[0], 16 * 1024);  // m3, the only relocatable tensor of that stretch
  EXPECT_TRUE(m0->defined());
  EXPECT_EQ(m0->f32()[5], 5.0f);
  EXPECT_FALSE(m3->defined());
  // 20 KiB free now, but no stretch can hold 16 KiB (big is pinned): a typed OOM.
  EXPECT_EQ(arena.budget() - arena.in_use(), 20 * 1024);
  EXPECT_THROW(Tensor(arena, {4 * 1024}, MemCategory::activations, "huge"), OutOfMemoryError);
}

// Tensors a source can move but not evict (the zero-bubble W queue's: a host copy
// would free nothing while another owner holds them) slide in compaction: they
// neither split a stretch nor count as room. Only then can the evictable tensors
// around them make a block here.
TEST(Arena, MovableTensorsThatCannotBeEvictedDoNotSplitTheFreeBytes) {
  Arena arena(32 * 1024);
  TestSource evictable(arena, true), movable(arena, false);
  // KiB: [a0 8][b0 4][hole 4][p 4][b1 4][hole 8]; a evictable, b movable only, p pinned.
  Tensor* a0 = evictable.add(2048, 0);
  Tensor* b0 = movable.add(1024, 100);
  Tensor* h1 = movable.add(1024, 0);
  Tensor p(arena, {1024}, MemCategory::activations, "pinned");
  Tensor* b1 = movable.add(1024, 300);
  Tensor* h2 = movable.add(2048, 0);
  ASSERT_EQ(arena.in_use(), 32 * 1024);
  h1->reset();
  h2->reset();
  // 10 KiB of the 12 free: no stretch has a block that large, even compacted (4
  // under p, 8 on top); under p, the hole plus a0 (evicted) make 12 once b0 slides.
  Tensor big(arena, {2560}, MemCategory::activations, "big");
  EXPECT_EQ(arena.evictions(), 1);
  ASSERT_EQ(evictable.evicted.size(), 1u);
  EXPECT_FALSE(a0->defined());
  EXPECT_TRUE(movable.evicted.empty());
  EXPECT_EQ(b0->f32()[7], 107.0f);
  EXPECT_EQ(b1->f32()[1023], 1323.0f);
  EXPECT_EQ(arena.budget() - arena.in_use(), 10 * 1024);  // 12 free + 8 evicted - 10
}

// Hand-offs between actions (a source's `top` class) go to the top end in a
// compaction, in their order and with their contents; the rest slides down, so the
// free bytes between them are one block.
TEST(Arena, CompactionPlacesTheTopClassAtTheTopEnd) {
  Arena arena(64 * 1024);
  TestSource low(arena, false), handoff(arena, false, true);
  // KiB: [l0 8][h0 4][hole 8][l1 8][h1 4][hole 8][l2 8][hole 16]
  Tensor* l0 = low.add(2048, 0);
  Tensor* h0 = handoff.add(1024, 1000);
  Tensor* g0 = low.add(2048, 0);
  Tensor* l1 = low.add(2048, 2000);
  Tensor* h1 = handoff.add(1024, 3000);
  Tensor* g1 = low.add(2048, 0);
  Tensor* l2 = low.add(2048, 4000);
  g0->reset();
  g1->reset();
  EXPECT_GT(arena.defragment(false), 0);
  const char* base = static_cast<const char*>(l0->raw());
  EXPECT_EQ(static_cast<const char*>(l1->raw()) - base, 8 * 1024);
  EXPECT_EQ(static_cast<const char*>(l2->raw()) - base, 16 * 1024);
  EXPECT_EQ(static_cast<const char*>(h1->raw()) - base, 60 * 1024);  // the highest stays highest
  EXPECT_EQ(static_cast<const char*>(h0->raw()) - base, 56 * 1024);
  EXPECT_EQ(arena.largest_free_block(), 32 * 1024);
  EXPECT_EQ(h0->f32()[1023], 2023.0f);
  EXPECT_EQ(h1->f32()[5], 3005.0f);
  EXPECT_EQ(l2->f32()[7], 4007.0f);
  EXPECT_EQ(arena.in_use(), 32 * 1024);
  EXPECT_EQ(arena.defragment(false), 0);  // one free block: nothing to do
}

// While from_top is on, activations are served like workspace: from the top end of
// the highest free block that fits; the guard restores the setting.
TEST(Arena, FromTopServesActivationsFromTheTop) {
  Arena arena(16 * 1024);
  Tensor low(arena, {1024}, MemCategory::activations, "low");
  const char* base = static_cast<const char*>(low.raw());
  {
    Arena::FromTop guard(arena);
    Tensor t(arena, {1024}, MemCategory::activations, "t");
    EXPECT_EQ(static_cast<const char*>(t.raw()) - base, 12 * 1024);
  }
  EXPECT_FALSE(arena.from_top());
  Tensor next(arena, {1024}, MemCategory::activations, "next");
  EXPECT_EQ(static_cast<const char*>(next.raw()) - base, 4 * 1024);
}
