// The NCCL backend of the Communicator (comm/communicator.h), for ranks that each
// drive one GPU. Built only with -DMOEFLEX_CUDA=ON (library moeflex_nccl, from this
// folder; a folder of its own so the CPU build's comm/*.cpp never sees it).
//
// Conventions beyond communicator.h:
// - Every data buffer is DEVICE memory of this rank's GPU (NCCL reads and writes it
//   directly); counts, displacements and the bootstrap stay on the host.
// - Calls are blocking, as in the other backends: each enqueues its NCCL work on the
//   communicator's own stream and waits for it under the watchdog (timeout(); on
//   expiry the NCCL communicator is aborted and the job ended with a message naming
//   the operation). Work the caller queued on other streams must be finished (or
//   waited on) before a call; the communicator does not order against them.
// - Float and double sums keep the contract of communicator.h: summed in rank order
//   by exactly one rank per element, so every rank gets the same bits, equal to the
//   MPI backend's. NCCL's own all-reduce does not promise that order, so the sum is
//   done as in MpiCommunicator: an all-to-all of blocks (ncclSend/ncclRecv in one
//   group), a rank-order left fold of each rank's block on the GPU, and an
//   all-gather of the blocks. int64 sums and double maxima are exact, so they use
//   ncclAllReduce directly.
// - Point to point: NCCL has no tags and no buffered sends. send() copies the data
//   into a staging buffer on the device and returns; the send is issued in one NCCL
//   group with this rank's next recv/irecv, or by flush_sends() or the next
//   collective. Messages between a pair arrive in send order and tags are not
//   matched. A rank must therefore post its sends before the receive they pair
//   with (send-then-recv on both sides is fine, as in the MPI backend; posting a
//   receive and sending only after waiting on it would deadlock). recv cannot check
//   the message size: a mismatch is undefined (NCCL reads or writes `bytes`).
// - Scratch buffers (reduction blocks, send staging) are cudaMalloc'ed by the
//   communicator, outside the DeviceArena.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "moeflex/comm/communicator.h"

struct ncclComm;  // nccl.h's ncclComm_t is ncclComm*

namespace moeflex::comm {

/// A Communicator over an NCCL communicator (see the file comment).
class NcclCommunicator final : public Communicator {
 public:
  /// Collective over `bootstrap` (MPI, or the single-process backend for one rank):
  /// rank 0 creates the ncclUniqueId, bootstrap.broadcast hands it to every rank, and
  /// each rank joins with its rank and size on CUDA device `device`. The result has
  /// bootstrap's ranks, size, world ranks and timeout. Makes `device` the calling
  /// thread's current device. Throws CommError / CudaError.
  static std::unique_ptr<NcclCommunicator> create(Communicator& bootstrap, int device,
                                                  const std::string& name = "world");

  /// Issues pending sends, waits for the stream, destroys the NCCL communicator.
  ~NcclCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "nccl"; }
  int world_rank() const override { return world_ranks_[std::size_t(rank_)]; }
  int world_rank_of(int r) const override { return world_ranks_.at(std::size_t(r)); }
  /// The CUDA device of this rank.
  int device() const { return device_; }
  /// The stream NCCL work runs on.
  cudaStream_t stream() const { return stream_; }

  void all_reduce_sum(float* data, std::int64_t n) override;
  void all_reduce_sum(double* data, std::int64_t n) override;
  void all_reduce_sum(std::int64_t* data, std::int64_t n) override;
  void all_reduce_max(double* data, std::int64_t n) override;
  void reduce_scatter_sum(const float* send, float* recv, std::int64_t recv_count) override;
  void all_gather_bytes(const void* send, void* recv, std::int64_t bytes) override;
  void all_to_all_v(const void* send, const std::int64_t* send_counts, const std::int64_t* send_displs,
                    void* recv, const std::int64_t* recv_counts, const std::int64_t* recv_displs,
                    std::size_t elem_bytes) override;
  void all_to_all(const std::int64_t* send, std::int64_t* recv, std::int64_t n) override;
  void all_to_all(const std::int32_t* send, std::int32_t* recv, std::int64_t n) override;
  void broadcast(void* data, std::int64_t bytes, int root) override;
  void barrier() override;

  void send(const void* data, std::int64_t bytes, int peer, int tag) override;
  void recv(void* data, std::int64_t bytes, int peer, int tag) override;
  Request irecv(void* data, std::int64_t bytes, int peer, int tag) override;
  void flush_sends() override;

  /// ncclCommSplit; ranks of a color ordered by key, then by rank (NCCL's rule).
  std::unique_ptr<Communicator> split(int color, int key, const std::string& name) override;

  /// Waits for the stream under the watchdog; `what` names the operation for
  /// messages. Throws CudaError / CommError; aborts the job on timeout.
  void wait_stream(const std::string& what);

 private:
  NcclCommunicator(ncclComm* comm, std::string name, int device, std::vector<int> world_ranks, Seconds timeout);
  template <class T>
  void ordered_all_reduce(T* data, std::int64_t n, int nccl_type, const char* op);
  void exchange_equal(const void* send, void* recv, std::int64_t bytes_per_peer, const char* op);
  /// Enqueues pending sends inside an already open NCCL group.
  void enqueue_pending_sends();
  void release_sent();
  void* scratch(std::size_t bytes);
  void check_nccl(int result, const std::string& what) const;
  std::string describe(const char* op) const;

  struct PendingSend {
    void* staging = nullptr;  // cudaMalloc'ed copy of the data
    std::int64_t bytes = 0;
    int peer = 0;
  };

  ncclComm* comm_ = nullptr;
  int rank_ = 0;
  int size_ = 1;
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  std::vector<int> world_ranks_;
  std::deque<PendingSend> pending_;   // copied, not yet issued
  std::vector<void*> in_flight_;      // issued; freed after the next stream wait
  void* scratch_ = nullptr;
  std::size_t scratch_bytes_ = 0;
};

namespace detail {
/// out[i] = blocks[0*len + i] + blocks[1*len + i] + ... + blocks[(parts-1)*len + i],
/// added left to right (the rank-order fold of the ordered sums), for i < len, on
/// `stream`. Device pointers; `out` must not overlap `blocks`. Exposed for tests.
template <class T>
void ordered_sum(const T* blocks, T* out, int parts, std::int64_t len, cudaStream_t stream);
}  // namespace detail

}  // namespace moeflex::comm
