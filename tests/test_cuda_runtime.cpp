// The CUDA backend's runtime pieces on a GPU: the device arena and pinned host pool
// (the shared BlockAllocator over cudaMalloc / cudaHostAlloc regions), streams and
// events, offload and prefetch on the copy streams (bytes round-trip exactly), and
// the NCCL communicator on one rank (every collective runs; the rank-order sum
// kernel is bit-identical to the host fold for several parts). Multi-rank NCCL
// needs several GPUs and is not run here. Without a GPU: "skipped: no GPU".
#include <cstdlib>
#include <cstring>

#include "cuda_harness.h"
#include "moeflex/comm/nccl/nccl_communicator.h"
#include "moeflex/comm/single_process.h"

namespace moeflex::test {
namespace {

using Vec = std::vector<double>;

TEST(CudaRuntime, DeviceArenaPlacesBestFitWithAccountingAndTypedOom) {
  MOEFLEX_REQUIRE_GPU();
  cu::DeviceArena arena(64 * cu::BufferArena::kAlignment + 100);
  EXPECT_EQ(arena.budget(), 64 * cu::BufferArena::kAlignment);
  const Bytes A = cu::BufferArena::kAlignment;
  void* p1 = arena.allocate(10 * A, MemCategory::weights, "w");
  void* p2 = arena.allocate(5 * A - 1, MemCategory::activations, "a");
  EXPECT_EQ(static_cast<char*>(p1), static_cast<char*>(arena.base()));
  EXPECT_EQ(static_cast<char*>(p2), static_cast<char*>(arena.base()) + 10 * A);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p2) % 256, 0u);
  EXPECT_EQ(arena.stat(MemCategory::activations).current, 5 * A);
  // The memory is real device memory: write and read it back.
  MOEFLEX_CUDA_CHECK(cudaMemset(p2, 0x5a, 5 * A - 1));
  std::vector<unsigned char> back(std::size_t(5 * A - 1));
  MOEFLEX_CUDA_CHECK(cudaMemcpy(back.data(), p2, back.size(), cudaMemcpyDeviceToHost));
  EXPECT_EQ(std::count(back.begin(), back.end(), 0x5a), std::ptrdiff_t(back.size()));
  try {
    arena.allocate(50 * A, MemCategory::activations, "experts.fc1_out");
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    EXPECT_EQ(e.requested, 50 * A);
    EXPECT_EQ(e.free, 49 * A);
    EXPECT_EQ(e.op, "experts.fc1_out");
  }
  arena.deallocate(p1, 10 * A, MemCategory::weights);
  {
    cu::Buffer b(arena, 8 * A, MemCategory::activations, "act2");
    EXPECT_EQ(b.data(), p1);  // best fit: the 10-block hole at the start
    cu::Buffer ws(arena, A, MemCategory::workspace, "scratch");
    EXPECT_EQ(static_cast<char*>(ws.data()), static_cast<char*>(arena.base()) + 63 * A);  // workspace: from the top
    EXPECT_EQ(b.kind(), cu::BufferKind::device);
    EXPECT_EQ(arena.in_use(), 14 * A);
  }
  EXPECT_EQ(arena.in_use(), 5 * A);  // the Buffer returned its block
  arena.deallocate(p2, 5 * A - 1, MemCategory::activations);
  EXPECT_EQ(arena.largest_free_block(), 64 * A);
  EXPECT_THROW(arena.deallocate(static_cast<char*>(arena.base()) - 4096, A, MemCategory::workspace), Error);
}

TEST(CudaRuntime, ADeviceRegionLargerThanTheCardIsACudaError) {
  MOEFLEX_REQUIRE_GPU();
  const Bytes total = cu::device_info(0).total_memory;
  EXPECT_THROW(cu::DeviceArena(total * 4), cu::CudaError);
}

TEST(CudaRuntime, OffloadAndPrefetchRoundTripBytesOnTheCopyStreams) {
  MOEFLEX_REQUIRE_GPU();
  auto& g = gpu();
  cu::PinnedHostPool pinned(64 * kMiB);
  cu::TransferStreams copies;
  const Bytes bytes = 8 * kMiB + 12345;
  cu::Buffer dev(g.arena, bytes, MemCategory::activations, "act");
  cu::Buffer host(pinned, bytes, MemCategory::activations, "act.offloaded");
  cu::Buffer back(g.arena, bytes, MemCategory::activations, "act.prefetched");
  EXPECT_EQ(host.kind(), cu::BufferKind::pinned_host);
  EXPECT_EQ(pinned.in_use(), pinned.stat(MemCategory::activations).current);
  // The producer writes the tensor on the compute stream; the offload must wait for it.
  std::vector<unsigned char> pattern(static_cast<std::size_t>(bytes));
  for (std::size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<unsigned char>((i * 131 + 7) % 251);
  MOEFLEX_CUDA_CHECK(cudaMemcpyAsync(dev.data(), pattern.data(), pattern.size(), cudaMemcpyHostToDevice, g.s()));
  cu::Event landed = copies.offload(dev, host, bytes, g.stream);
  landed.synchronize();
  EXPECT_EQ(std::memcmp(host.data(), pattern.data(), pattern.size()), 0) << "offload did not land the producer's bytes";
  // The device block is now free to reuse: scribble on it, then prefetch into another block.
  MOEFLEX_CUDA_CHECK(cudaMemsetAsync(dev.data(), 0, std::size_t(bytes), g.s()));
  cu::Event ready = copies.prefetch(host, back, bytes, g.stream);
  g.stream.wait(ready);
  std::vector<unsigned char> got(pattern.size());
  MOEFLEX_CUDA_CHECK(cudaMemcpyAsync(got.data(), back.data(), got.size(), cudaMemcpyDeviceToHost, g.s()));
  g.sync();
  EXPECT_EQ(got, pattern) << "prefetch did not bring the bytes back";
  // Kinds and sizes are checked.
  EXPECT_THROW(copies.offload(host, dev, bytes, g.stream), Error);
  EXPECT_THROW(copies.offload(dev, host, bytes + 1, g.stream), Error);

  // Bandwidth of the copy engines for the report (pinned memory, one direction each).
  const Bytes big = std::min<Bytes>(48 * kMiB, pinned.largest_free_block());
  cu::Buffer hb(pinned, big, MemCategory::workspace, "bw.host");
  cu::Buffer db(g.arena, big, MemCategory::workspace, "bw.dev");
  for (bool d2h : {true, false}) {
    OpRow r(d2h ? "copy_d2h" : "copy_h2d", "u8", shape_str({{"bytes", big}}));
    r.bytes = double(big);
    r.ms = time_ms([&] {
      cu::Event e = d2h ? copies.offload(db, hb, big, g.stream) : copies.prefetch(hb, db, big, g.stream);
      g.stream.wait(e);  // timed on the compute stream: the copy is inside the events
    });
    r.note = "pinned host pool <-> device arena on the copy streams";
    report(r);
    EXPECT_GT(r.bytes / (r.ms * 1e-3), 1e9) << r.op << " is slower than 1 GB/s: pinned memory not used?";
  }
}

TEST(CudaRuntime, EventsOrderStreamsAndTime) {
  MOEFLEX_REQUIRE_GPU();
  cu::Stream a(0), b(0, -1);
  DevArray<float> x(Vec(1 << 20, 1.0), "x");
  cu::Event start(true), stop(true), done;
  start.record(a);
  MOEFLEX_CUDA_CHECK(cudaMemsetAsync(x.get(), 0, 4u << 20, a.get()));
  stop.record(a);
  done.record(a);
  b.wait(done);
  b.synchronize();
  EXPECT_TRUE(done.query());
  EXPECT_GE(cu::Event::elapsed_ms(start, stop), 0.0f);
  EXPECT_EQ(x.download(), Vec(1 << 20, 0.0));
}

// ---------------------------------------------------------------------------------
// NCCL on one rank

template <typename T>
std::vector<T> fold_in_rank_order(const std::vector<T>& blocks, int parts, std::size_t len) {
  std::vector<T> out(len);
  for (std::size_t i = 0; i < len; ++i) {
    T s = blocks[i];
    for (int q = 1; q < parts; ++q) s += blocks[std::size_t(q) * len + i];
    out[i] = s;
  }
  return out;
}

TEST(CudaNccl, OrderedSumKernelIsTheRankOrderFoldBitForBit) {
  MOEFLEX_REQUIRE_GPU();
  for (int parts : {1, 2, 3, 7}) {
    const std::size_t len = 10007;
    std::vector<float> blocks(std::size_t(parts) * len);
    std::vector<double> dblocks(blocks.size());
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      // All mantissa bits busy and magnitudes spread, so the order of the sum shows.
      blocks[i] = float(std::ldexp(2 * uniform01(5, std::uint64_t(parts), i) - 1, int(i % 17) - 8));
      dblocks[i] = double(blocks[i]) * 1.0000001;
    }
    DevArray<float> dB(std::int64_t(blocks.size()), "blocks"), dO(std::int64_t(len), "out");
    dB.upload_raw(blocks);
    comm::detail::ordered_sum(dB.get(), dO.get(), parts, std::int64_t(len), gpu().s());
    EXPECT_TRUE(bit_equal(dO.download_raw(), fold_in_rank_order(blocks, parts, len))) << parts << " parts (float)";
    cu::Buffer db(gpu().arena, Bytes(dblocks.size() * 8), MemCategory::workspace, "dblocks");
    cu::Buffer dout(gpu().arena, Bytes(len * 8), MemCategory::workspace, "dout");
    MOEFLEX_CUDA_CHECK(cudaMemcpy(db.data(), dblocks.data(), dblocks.size() * 8, cudaMemcpyHostToDevice));
    MOEFLEX_CUDA_CHECK(cudaDeviceSynchronize());  // a pageable upload may return before it lands
    comm::detail::ordered_sum(db.as<double>(), dout.as<double>(), parts, std::int64_t(len), gpu().s());
    gpu().sync();
    std::vector<double> got(len);
    MOEFLEX_CUDA_CHECK(cudaMemcpy(got.data(), dout.data(), len * 8, cudaMemcpyDeviceToHost));
    EXPECT_TRUE(bit_equal(got, fold_in_rank_order(dblocks, parts, len))) << parts << " parts (double)";
  }
}

TEST(CudaNccl, OneRankCommunicatorRunsEveryCollective) {
  MOEFLEX_REQUIRE_GPU();
  // One process: NCCL's bootstrap socket can use the loopback interface (a GPU
  // machine without network may have no other). A value set by the caller wins.
  setenv("NCCL_SOCKET_IFNAME", "lo", 0);
  comm::SingleProcessCommunicator boot;
  auto nccl = comm::NcclCommunicator::create(boot, 0);
  ASSERT_EQ(nccl->size(), 1);
  EXPECT_EQ(nccl->rank(), 0);
  EXPECT_EQ(nccl->backend(), "nccl");
  const Vec v = random_vec(1000, 300);
  DevArray<float> x(v, "x"), y(1000, "y");
  nccl->all_reduce_sum(x.get(), 1000);
  EXPECT_EQ(x.download(), quantize<float>(v));  // one rank: the sum is the data
  nccl->reduce_scatter_sum(x.get(), y.get(), 1000);
  EXPECT_EQ(y.download(), quantize<float>(v));
  nccl->all_gather_bytes(x.get(), y.get(), 4000);
  EXPECT_EQ(y.download(), quantize<float>(v));
  nccl->broadcast(x.get(), 4000, 0);
  EXPECT_EQ(x.download(), quantize<float>(v));
  const std::int64_t sc[1] = {600}, sd[1] = {100}, rc[1] = {600}, rd[1] = {0};
  y.fill_nan();
  nccl->all_to_all_v(x.get(), sc, sd, y.get(), rc, rd, sizeof(float));
  const Vec yy = y.download();
  for (int i = 0; i < 600; ++i) ASSERT_EQ(yy[sz(i)], quantize<float>(v)[sz(100 + i)]);
  cu::Buffer i64(gpu().arena, 3 * 8, MemCategory::workspace, "i64"), i64b(gpu().arena, 3 * 8, MemCategory::workspace, "b");
  const std::int64_t h[3] = {5, -7, 1LL << 40};
  MOEFLEX_CUDA_CHECK(cudaMemcpy(i64.data(), h, sizeof(h), cudaMemcpyHostToDevice));
  MOEFLEX_CUDA_CHECK(cudaDeviceSynchronize());  // a pageable upload may return before it lands
  nccl->all_reduce_sum(i64.as<std::int64_t>(), 3);
  nccl->all_to_all(i64.as<std::int64_t>(), i64b.as<std::int64_t>(), 3);
  std::int64_t back[3] = {};
  MOEFLEX_CUDA_CHECK(cudaMemcpy(back, i64b.data(), sizeof(back), cudaMemcpyDeviceToHost));
  EXPECT_EQ(std::memcmp(back, h, sizeof(h)), 0);
  nccl->barrier();
  // Point to point with oneself: the send travels in the group of the receive.
  nccl->send(x.get(), 4000, 0, 3);
  y.fill_nan();
  nccl->recv(y.get(), 4000, 0, 3);
  EXPECT_EQ(y.download(), quantize<float>(v));
  EXPECT_THROW(nccl->send(x.get(), 4, 1, 0), comm::CommError);  // no rank 1
  auto sub = nccl->split(0, 0, "sub");
  ASSERT_NE(sub, nullptr);
  EXPECT_EQ(sub->size(), 1);
  EXPECT_EQ(sub->name(), "sub");
  sub->barrier();
}

}  // namespace
}  // namespace moeflex::test
