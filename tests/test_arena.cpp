// The budgeted arena: best-fit placement, splitting, coalescing, exact per-category
// accounting, fragmentation measurement and the typed OOM error.
#include <gtest/gtest.h>

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
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

// allocate_at reserves exactly the range asked for inside one free block and keeps
// the rest of that block free; a range outside a free block, or misaligned, throws.
TEST(BlockAllocator, AllocateAtReservesAnExactRangeInsideAFreeBlock) {
  BlockAllocator b(100 * 64, 64);
  b.allocate_at(10 * 64, 20 * 64, MemCategory::activations);
  EXPECT_EQ(b.in_use(), 20 * 64);
  ASSERT_EQ(b.layout().size(), 3u);  // free [0, 10), used [10, 30), free [30, 100)
  EXPECT_TRUE(b.layout()[0].free);
  EXPECT_EQ(b.layout()[0].size, 10 * 64);
  EXPECT_FALSE(b.layout()[1].free);
  EXPECT_EQ(b.layout()[1].offset, 10 * 64);
  EXPECT_EQ(b.largest_free_block(), 70 * 64);
  EXPECT_THROW(b.allocate_at(25 * 64, 64, MemCategory::activations), Error);       // inside a used block
  EXPECT_THROW(b.allocate_at(95 * 64, 10 * 64, MemCategory::activations), Error);  // past the free block's end
  EXPECT_THROW(b.allocate_at(33, 64, MemCategory::activations), Error);            // misaligned
  EXPECT_EQ(b.in_use(), 20 * 64);
  b.allocate_at(0, 10 * 64, MemCategory::activations);  // the whole lower block
  EXPECT_EQ(b.free_block_count(), 1u);
  EXPECT_EQ(b.allocate(70 * 64, MemCategory::activations, "rest"), 30 * 64);
  b.deallocate(0, 10 * 64, MemCategory::activations);
  b.deallocate(10 * 64, 20 * 64, MemCategory::activations);
  b.deallocate(30 * 64, 70 * 64, MemCategory::activations);
  EXPECT_EQ(b.free_block_count(), 1u);
  EXPECT_EQ(b.largest_free_block(), 100 * 64);
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

// Pinned blocks split the free bytes so that compaction is not enough, and the holes
// hold no whole page to stitch (each is smaller than a page): the arena evicts
// relocatable tensors of the stretch that can hold the request.
TEST(Arena, EvictsRelocatableTensorsWhenPinnedBlocksSplitTheFreeBytes) {
  Arena arena(16 * 1024);
  TestSource src(arena, true);
  // KiB: [m0 1][m1 1][p0 1][m2 1][p1 1][m3 4][m4 2][p2 1][p3 4]; p pinned (not the source's).
  Tensor* m0 = src.add(256, 0);
  Tensor* m1 = src.add(256, 1);
  Tensor p0(arena, {256}, MemCategory::activations, "pinned0");
  Tensor* m2 = src.add(256, 2);
  Tensor p1(arena, {256}, MemCategory::activations, "pinned1");
  Tensor* m3 = src.add(1024, 3);
  Tensor* m4 = src.add(512, 4);
  Tensor p2(arena, {256}, MemCategory::activations, "pinned2");
  Tensor p3(arena, {1024}, MemCategory::activations, "pinned3");
  ASSERT_EQ(arena.in_use(), 16 * 1024);
  m1->reset();
  m2->reset();
  m4->reset();  // 4 KiB free in holes of 1, 1 and 2 KiB (none holds a whole 4 KiB page)
  // 3 KiB: the stretch between p1 and p2 holds 2 KiB free plus m3's 4 KiB.
  Tensor big(arena, {3 * 256}, MemCategory::activations, "big");
  EXPECT_EQ(arena.stitches(), 0);
  EXPECT_EQ(arena.evictions(), 1);
  ASSERT_EQ(src.evicted.size(), 1u);
  EXPECT_EQ(src.evicted[0], 4 * 1024);  // m3, the only relocatable tensor of that stretch
  EXPECT_TRUE(m0->defined());
  EXPECT_EQ(m0->f32()[5], 5.0f);
  EXPECT_FALSE(m3->defined());
  // 5 KiB free now, but no stretch can hold 4 KiB (big is pinned): a typed OOM.
  EXPECT_EQ(arena.budget() - arena.in_use(), 5 * 1024);
  EXPECT_THROW(Tensor(arena, {1024}, MemCategory::activations, "huge"), OutOfMemoryError);
}

// Tensors a source can move but not evict (the zero-bubble W queue's: a host copy
// would free nothing while another owner holds them) slide in compaction: they
// neither split a stretch nor count as room. Only then can the evictable tensors
// around them make a block here.
TEST(Arena, MovableTensorsThatCannotBeEvictedDoNotSplitTheFreeBytes) {
  Arena arena(8 * 1024);
  TestSource evictable(arena, true), movable(arena, false);
  // KiB: [a0 2][b0 1][hole 1][p 1][b1 1][hole 2]; a evictable, b movable only, p
  // pinned; the holes hold no whole page, so nothing can be stitched.
  Tensor* a0 = evictable.add(512, 0);
  Tensor* b0 = movable.add(256, 100);
  Tensor* h1 = movable.add(256, 0);
  Tensor p(arena, {256}, MemCategory::activations, "pinned");
  Tensor* b1 = movable.add(256, 300);
  Tensor* h2 = movable.add(512, 0);
  ASSERT_EQ(arena.in_use(), 8 * 1024);
  h1->reset();
  h2->reset();
  // 2.5 KiB of the 3 free: no stretch has a block that large, even compacted (1
  // under p, 2 on top); under p, the hole plus a0 (evicted) make 3 once b0 slides.
  Tensor big(arena, {640}, MemCategory::activations, "big");
  EXPECT_EQ(arena.evictions(), 1);
  ASSERT_EQ(evictable.evicted.size(), 1u);
  EXPECT_FALSE(a0->defined());
  EXPECT_TRUE(movable.evicted.empty());
  EXPECT_EQ(b0->f32()[7], 107.0f);
  EXPECT_EQ(b1->f32()[255], 555.0f);
  EXPECT_EQ(arena.budget() - arena.in_use(), 2560);  // 3 KiB free + 2 evicted - 2.5
}

// Pinned blocks split the free bytes into holes of whole pages: the arena maps those
// pages, in address order, into one range, without moving or evicting anything. The
// tensor reads and writes through it as one block; the bytes land in the holes; on
// release the holes are free again.
TEST(Arena, StitchesWholeFreePagesWhenPinnedBlocksSplitTheFreeBytes) {
  const Bytes page = sysconf(_SC_PAGESIZE);
  const std::int64_t floats = page / 4;  // one page of floats
  Arena arena(8 * page);
  TestSource src(arena, true);
  // Pages: [p0][h1][p1][h2 h2][p2][m][p3]; p pinned, m evictable, h freed below.
  std::vector<std::unique_ptr<Tensor>> pinned, holes;
  const auto pin = [&](std::int64_t n, std::vector<std::unique_ptr<Tensor>>& into) {
    into.push_back(std::make_unique<Tensor>(arena, std::vector<std::int64_t>{n}, MemCategory::activations, "p"));
  };
  pin(floats, pinned);
  pin(floats, holes);
  pin(floats, pinned);
  pin(2 * floats, holes);
  pin(floats, pinned);
  Tensor* m = src.add(floats, 7);
  pin(floats, pinned);
  ASSERT_EQ(arena.in_use(), 8 * page);
  const char* base = static_cast<const char*>(pinned[0]->raw());
  for (auto& h : holes) h->reset();  // 3 pages free in holes of 1 and 2 pages
  for (auto& t : pinned) std::fill_n(t->f32(), t->numel(), -1.0f);
  Tensor big(arena, {3 * floats}, MemCategory::activations, "big");
  EXPECT_EQ(arena.stitches(), 1);
  EXPECT_EQ(arena.bytes_stitched(), 3 * page);
  EXPECT_EQ(arena.evictions(), 0);
  EXPECT_TRUE(m->defined());
  EXPECT_EQ(arena.budget() - arena.in_use(), 0);
  const char* at = static_cast<const char*>(big.raw());
  EXPECT_TRUE(at < base || at >= base + 8 * page);  // a range of its own
  for (std::int64_t i = 0; i < big.numel(); ++i) big.f32()[i] = float(i);
  // Through the region's own view: page 1 holds big's first page, pages 3-4 the rest.
  const float* region = reinterpret_cast<const float*>(base);
  EXPECT_EQ(region[1 * floats + 3], 3.0f);
  EXPECT_EQ(region[3 * floats], float(floats));
  EXPECT_EQ(region[5 * floats - 1], float(3 * floats - 1));
  for (auto& t : pinned) EXPECT_EQ(t->f32()[t->numel() - 1], -1.0f);  // neighbours untouched
  EXPECT_EQ(m->f32()[1], 8.0f);
  big.reset();
  // The holes are free again (and distinct blocks: no block of 3 pages).
  EXPECT_EQ(arena.budget() - arena.in_use(), 3 * page);
  EXPECT_EQ(arena.largest_free_block(), 2 * page);
  Tensor again(arena, {2 * floats}, MemCategory::activations, "again");
  EXPECT_EQ(static_cast<const char*>(again.raw()), base + 3 * page);
  EXPECT_EQ(arena.stitches(), 1);
}

// A hole loses its partial pages: when the whole pages are too few, the arena falls
// back to eviction, and without relocatable tensors to an OOM naming the request.
TEST(Arena, StitchingNeedsWholePagesElseEvictsOrFails) {
  const Bytes page = sysconf(_SC_PAGESIZE);
  const std::int64_t floats = page / 4;
  Arena arena(4 * page);
  // [p0 half][h1 1.5 pages][p1 half][h2 1.5 pages]: 3 pages free, 2 of them whole.
  Tensor p0(arena, {floats / 2}, MemCategory::activations, "p0");
  Tensor h1(arena, {3 * floats / 2}, MemCategory::activations, "h1");
  Tensor p1(arena, {floats / 2}, MemCategory::activations, "p1");
  Tensor h2(arena, {3 * floats / 2}, MemCategory::activations, "h2");
  h1.reset();
  h2.reset();
  EXPECT_EQ(arena.budget() - arena.in_use(), 3 * page);
  {
    Tensor two(arena, {2 * floats}, MemCategory::activations, "two");  // the 2 whole pages
    EXPECT_EQ(arena.stitches(), 1);
    two.f32()[2 * floats - 1] = 1.0f;
  }
  try {
    Tensor three(arena, {3 * floats}, MemCategory::activations, "experts.fc1");  // 3 pages: 2 whole
    FAIL();
  } catch (const OutOfMemoryError& e) {
    EXPECT_EQ(e.requested, 3 * page);
    EXPECT_EQ(e.free, 3 * page);
    EXPECT_EQ(e.op, "experts.fc1");
  }
  EXPECT_EQ(arena.stitches(), 1);
  EXPECT_EQ(arena.budget() - arena.in_use(), 3 * page);
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

// The placement reserve is 1/128 of a budget, at most 256 KiB; budget_with_reserve
// is the smallest budget whose bytes less its reserve hold a peak.
TEST(Arena, PlacementReserveAndTheSmallestBudgetAroundIt) {
  EXPECT_EQ(Arena::placement_reserve(Bytes(128) << 20), Arena::kPlacementReserve);
  EXPECT_EQ(Arena::placement_reserve(Bytes(1) << 20), Bytes(8) << 10);
  EXPECT_EQ(Arena::budget_with_reserve(Bytes(40) << 20), (Bytes(40) << 20) + Arena::kPlacementReserve);
  for (const Bytes peak : {Bytes(1), Bytes(590976), Bytes(1) << 20, Bytes(32) << 20, Bytes(33554431)}) {
    const Bytes b = Arena::budget_with_reserve(peak);
    EXPECT_EQ(b % Arena::kAlignment, 0) << peak;
    EXPECT_GE(b - Arena::placement_reserve(b), peak) << peak;
    const Bytes less = b - Arena::kAlignment;
    EXPECT_LT(less - Arena::placement_reserve(less), peak) << peak;
  }
}

// The host region is a shared mapping (stitching maps its pages twice): a forked
// child must not share it (it would write into the parent's tensors), so it gets
// none of it.
TEST(ArenaDeathTest, AForkedChildGetsNoneOfTheRegion) {
  Arena arena(Bytes(1) << 20);
  if (!arena.can_stitch()) GTEST_SKIP() << "no memory file behind the region";
  Tensor t(arena, {1024}, MemCategory::activations, "t");
  t.f32()[0] = 1.0f;
  GTEST_FLAG_SET(death_test_style, "fast");  // fork, no exec: the child sees this process's mappings
  EXPECT_EXIT(
      {
        volatile float x = t.f32()[0];
        (void)x;
        std::_Exit(0);
      },
      ::testing::KilledBySignal(SIGSEGV), "");
  EXPECT_EQ(t.f32()[0], 1.0f);
}
