// The CUDA backend of the training engine (ops/backend.h on one GPU): the device
// arena over one cudaMalloc region, one compute stream with one cuBLAS handle, the
// d2h/h2d copy streams of offload and prefetch, and a pinned host pool.
//
// Precision (ops/backend.h's contract): the views of one call share one dtype, f32
// (the fp32 engine) or bf16 (the bf16 engine); each op dispatches on it to the
// kernel instantiated for that type, which computes in fp32 and rounds each bf16
// output once, and a mix is an Error naming the op and every view's dtype (null
// views do not count). The float* arguments are fp32 in both. `cast` converts
// f32 <-> bf16. Attention keeps its fp32 logsumexp [B, H, S] in the head of `probs`
// and its fp32 workspace in `dprobs_ws` (raw memory of the call's dtype), so a bf16
// `probs` needs S >= 2. The z-loss, the aux loss and the spike injection run on the host on
// fp32 copies (small [n, E] arrays; bf16 widened in, rounded once on the way out,
// as the CPU backend does); every other op runs on the device.
//
// Memory outside the arena (so the memory program's exact accounting holds for
// what the model allocates): the cuBLAS workspace and grouped-GEMM pointer arrays
// (a small DeviceArena of their own) and a grow-only scratch buffer for the ops'
// workspaces and the host arrays a step copies in (token ids, targets). Both are
// reported by reserved_bytes().
//
// Ordering: every op and every memory operation is queued on the compute stream in
// call order, and the arena frees blocks immediately, which is safe because any
// later user of a block is queued behind the earlier ones on the same stream. The
// copy streams start each copy after the compute work queued so far (an event);
// the stash frees an offloaded block only after its copy's event completed, and
// reads a prefetched one only after waiting for its event. Host reads (losses,
// routing counts) synchronize the compute stream.
#pragma once
#include <memory>

#include "moeflex/ops/backend.h"

namespace moeflex::ops::cuda {

struct CudaContextOptions {
  int device = 0;
  /// Bytes of the arena region; kUnlimited takes the device's free memory minus
  /// `headroom` (rounded down to 2 MiB).
  Bytes budget = Arena::kUnlimited;
  Bytes headroom = Bytes(2) << 30;
  /// Capacity of the pinned host pool for offloads (allocated on first use); an
  /// offload that does not fit uses pageable host memory (slower copies).
  Bytes pinned_pool = Bytes(8) << 30;
};

/// Creates the CUDA backend and the arena over its region. Throws CudaError when
/// there is no device or the region cannot be allocated (naming the free memory).
DeviceContext make_cuda_context(const CudaContextOptions& options);

/// Bytes the backend holds outside the arena (cuBLAS workspace, scratch); 0 for a
/// non-CUDA backend.
Bytes reserved_bytes(const Backend& backend);

}  // namespace moeflex::ops::cuda
