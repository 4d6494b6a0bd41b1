// A host emulation of the little of CUDA that the tensor-core attention kernels
// (src/moeflex/ops/cuda/attention_tc.cuh) use, so that CI, which has no GPU, runs
// their indexing, masking, synchronisation and exact-zero logic:
//   - each CUDA thread of a block is a host thread (threadIdx, blockIdx are
//     thread-local), __syncthreads is a barrier over the block's threads and
//     __syncwarp one over the warp's 32; blocks run one after another;
//   - the dynamic shared memory is a per-block buffer filled with NaN bytes, so
//     that a read of something never written shows up;
//   - nvcuda::wmma's 16x16x16 fragments: every lane holds the whole tile (the real
//     layout spreads it over the lanes; the kernels never depend on it), mma_sync
//     sums the 16 products of each element in fp32 in index order (the tensor core's
//     order differs in the last bits), and each lane stores only its share of the
//     tile, so that, as on the GPU, only the kernel's __syncwarp makes a stored tile
//     visible to the other lanes.
// Not emulated: alignment rules, bank conflicts, speed.
#pragma once

#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "moeflex/core/bf16.h"

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define MOEFLEX_TC_SMEM(name) unsigned char* name = ::moeflex::emu::block_smem()
#define MOEFLEX_TC_UNROLL

namespace moeflex::emu {

struct Idx {
  unsigned x = 0, y = 0, z = 0;
};

/// bf16 storage, as __nv_bfloat16.
struct bfr {
  std::uint16_t bits = 0;
};
inline bfr float_to_bfr(float f) { return bfr{float_to_bf16_bits(f)}; }
inline float bfr_to_float(bfr b) { return bf16_bits_to_float(b.bits); }

struct ThreadState {
  unsigned char* smem = nullptr;
  std::barrier<>* block = nullptr;
  std::barrier<>* warp = nullptr;
};
inline thread_local ThreadState tls;
inline unsigned char* block_smem() { return tls.smem; }

}  // namespace moeflex::emu

inline thread_local moeflex::emu::Idx threadIdx, blockIdx;
inline void __syncthreads() { moeflex::emu::tls.block->arrive_and_wait(); }
inline void __syncwarp() { moeflex::emu::tls.warp->arrive_and_wait(); }
inline float __fmul_rn(float a, float b) { return a * b; }

namespace moeflex::emu {

/// Runs kernel() on a grid of gx x gy blocks of `threads` threads (a multiple of 32)
/// with `smem_bytes` of shared memory per block.
template <class Kernel>
void launch(unsigned gx, unsigned gy, int threads, std::size_t smem_bytes, Kernel&& kernel) {
  std::vector<unsigned char> smem(smem_bytes + 128);
  unsigned char* base = smem.data() + (128 - reinterpret_cast<std::uintptr_t>(smem.data()) % 128) % 128;
  for (unsigned by = 0; by < gy; ++by) {
    for (unsigned bx = 0; bx < gx; ++bx) {
      std::memset(base, 0xff, smem_bytes);  // NaN in every float, and a NaN-like bf16
      std::barrier<> block(threads);
      std::vector<std::unique_ptr<std::barrier<>>> warps;
      for (int w = 0; w < threads / 32; ++w) warps.push_back(std::make_unique<std::barrier<>>(32));
      std::vector<std::thread> pool;
      pool.reserve(static_cast<std::size_t>(threads));
      for (int t = 0; t < threads; ++t) {
        pool.emplace_back([&, t] {
          threadIdx = Idx{static_cast<unsigned>(t), 0, 0};
          blockIdx = Idx{bx, by, 0};
          tls = ThreadState{base, &block, warps[static_cast<std::size_t>(t / 32)].get()};
          kernel();
        });
      }
      for (auto& th : pool) th.join();
    }
  }
}

namespace wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

/// The whole 16x16 tile, element (r, c) at v[r * 16 + c].
template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
  float v[256];
};

template <class Use, class T, class L>
void fill_fragment(fragment<Use, 16, 16, 16, T, L>& f, float x) {
  for (float& e : f.v) e = x;
}
// No barrier in loads or stores: as on the GPU, only the kernel's __syncwarp orders
// one lane's writes before another lane's reads (a missing one shows up here as a
// lane reading stale data, made likelier by the store's yield below).
inline void load_matrix_sync(fragment<matrix_a, 16, 16, 16, bfr, row_major>& f, const bfr* p, unsigned ldm) {
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c) f.v[r * 16 + c] = bfr_to_float(p[r * ldm + c]);
}
inline void load_matrix_sync(fragment<matrix_b, 16, 16, 16, bfr, row_major>& f, const bfr* p, unsigned ldm) {
  for (int k = 0; k < 16; ++k)
    for (int n = 0; n < 16; ++n) f.v[k * 16 + n] = bfr_to_float(p[k * ldm + n]);
}
inline void load_matrix_sync(fragment<matrix_b, 16, 16, 16, bfr, col_major>& f, const bfr* p, unsigned ldm) {
  for (int k = 0; k < 16; ++k)
    for (int n = 0; n < 16; ++n) f.v[k * 16 + n] = bfr_to_float(p[n * ldm + k]);
}
inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p, unsigned ldm, layout_t l) {
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c) f.v[r * 16 + c] = l == mem_row_major ? p[r * ldm + c] : p[c * ldm + r];
}
template <class LA, class LB>
void mma_sync(fragment<accumulator, 16, 16, 16, float>& d, const fragment<matrix_a, 16, 16, 16, bfr, LA>& a,
              const fragment<matrix_b, 16, 16, 16, bfr, LB>& b, const fragment<accumulator, 16, 16, 16, float>& c) {
  float out[256];
  for (int r = 0; r < 16; ++r) {
    for (int n = 0; n < 16; ++n) {
      float s = 0.0f;
      for (int k = 0; k < 16; ++k) s += a.v[r * 16 + k] * b.v[k * 16 + n];
      out[r * 16 + n] = c.v[r * 16 + n] + s;
    }
  }
  std::memcpy(d.v, out, sizeof out);
}
inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f, unsigned ldm, layout_t l) {
  // Each lane writes the 8 elements it owns (element e by lane e % 32), as each lane
  // of a real fragment writes its own part; a lane's fragment is right at the
  // elements it owns even when it loaded others' after their owners stored (mma's
  // element (r, n) reads only c's element (r, n)). The yield widens the window in
  // which a reader without __syncwarp sees the old values.
  std::this_thread::yield();
  const int lane = static_cast<int>(threadIdx.x % 32);
  for (int e = lane; e < 256; e += 32) {
    const int r = e / 16, c = e % 16;
    (l == mem_row_major ? p[r * ldm + c] : p[c * ldm + r]) = f.v[e];
  }
}
}  // namespace wmma

}  // namespace moeflex::emu
