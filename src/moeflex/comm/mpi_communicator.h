// The MPI backend (Open MPI on the CPU) and the RAII MpiSession that starts and
// ends MPI for the process.
//
// Failure handling:
// - Errors: every communicator gets MPI_ERRORS_RETURN and every MPI call's return
//   code is checked; a failure throws CommError carrying MPI_Error_string's text,
//   the operation, the rank and the peer. (A custom handler that throws would have
//   to unwind through MPI's C frames, which is undefined behaviour.)
// - Hangs: every blocking operation is issued non-blocking (MPI_Isend/Irecv,
//   MPI_Ibarrier, MPI_Iallgatherv, MPI_Ialltoallv, ...) and completed by polling
//   MPI_Test. If it is still incomplete after timeout() seconds, the watchdog calls
//   abort_job with a message naming the operation, the communicator, the peer
//   (world rank) and the bytes, so the job ends instead of hanging. Polling spins
//   briefly, then yields (not on an oversubscribed node: host_oversubscribed()),
//   then sleeps up to kMaxPollSleep, so oversubscribed ranks (more ranks than
//   cores) leave the cores to the ranks doing work.
// - Crashes: a rank that dies makes mpirun (or srun --kill-on-bad-exit) end the
//   others; an error that only one rank sees must go through abort_job, not a
//   normal return from main (MPI_Finalize would wait for the others forever).
#pragma once
#include <mpi.h>

#include <deque>
#include <vector>

#include "moeflex/comm/communicator.h"

namespace moeflex::comm {

/// Starts MPI (MPI_Init_thread, asking for MPI_THREAD_FUNNELED: only the host
/// thread calls MPI) unless it is already running, sets MPI_ERRORS_RETURN on
/// MPI_COMM_WORLD, and finalizes it on destruction if it started it. Create one
/// in main before any communicator, and destroy every MpiCommunicator first.
/// Destroyed while an exception propagates, it aborts the job rather than
/// finalizing (the other ranks would wait for this one forever).
class MpiSession {
 public:
  MpiSession() : MpiSession(nullptr, nullptr) {}
  MpiSession(int* argc, char*** argv);
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;

  /// True when this process was started by an MPI launcher: mpirun/mpiexec
  /// (OMPI_COMM_WORLD_SIZE, PMI_SIZE, PMIX_RANK) or Slurm's srun (SLURM_NTASKS with
  /// SLURM_STEP_ID). MOEFLEX_MPI=1 forces true, MOEFLEX_MPI=0 forces false.
  static bool launched_by_mpi();
  /// True between MPI_Init and MPI_Finalize, whoever called them.
  static bool active();

  /// World size and rank (valid while active()).
  int world_size() const;
  int world_rank() const;
  /// The thread support level MPI granted.
  int thread_level() const { return thread_level_; }

 private:
  bool owns_ = false;
  int thread_level_ = 0;
};

/// A Communicator over an MPI communicator. See the file comment for failures and
/// communicator.h for the semantics of each method.
class MpiCommunicator final : public Communicator {
 public:
  /// A duplicate of MPI_COMM_WORLD (collective over the world), named "world",
  /// with the timeout from MOEFLEX_COMM_TIMEOUT. Needs an active MPI session.
  static std::unique_ptr<MpiCommunicator> world();

  /// Takes ownership of `comm` (freed by the destructor).
  MpiCommunicator(MPI_Comm comm, std::string name, Seconds timeout);
  /// Delivers pending buffered sends (under the watchdog), then frees the MPI
  /// communicator. Must run before MPI_Finalize.
  ~MpiCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "mpi"; }
  int world_rank() const override { return world_ranks_[std::size_t(rank_)]; }
  int world_rank_of(int r) const override { return world_ranks_.at(std::size_t(r)); }
  /// The wrapped MPI communicator (for libraries that need it; keep ownership here).
  MPI_Comm mpi_comm() const { return comm_; }

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

  /// MPI_Comm_split, preceded by a barrier under the watchdog (MPI has no
  /// non-blocking split, so the barrier is what catches a missing rank).
  std::unique_ptr<Communicator> split(int color, int key, const std::string& name) override;

  /// Polls `req` to completion under the watchdog; `what` describes the operation
  /// for messages ("recv of 64 bytes from rank 1 (world rank 3), tag 2"). Throws
  /// CommError on MPI errors; aborts the job on timeout.
  void wait(MPI_Request& req, MPI_Status* status, const std::string& what);
  /// Throws CommError for a failed MPI call, with MPI's message.
  void check(int rc, const std::string& what) const;

 private:
  template <class T>
  void ordered_all_reduce(T* data, std::int64_t n, MPI_Datatype type, const char* op);
  template <class T>
  void ordered_reduce_scatter(const T* send, T* recv, std::int64_t recv_count, MPI_Datatype type,
                              const char* op);
  void exchange_equal(const void* send, void* recv, std::int64_t n, MPI_Datatype type, const char* op);
  void progress_sends();
  std::string describe(const char* op) const;
  std::string describe_peer(const char* op, int peer, int tag, std::int64_t bytes) const;

  struct BufferedSend {
    std::vector<std::byte> data;
    MPI_Request req = MPI_REQUEST_NULL;
    int peer = 0;
    int tag = 0;
  };

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  std::vector<int> world_ranks_;           // world rank of each rank of this communicator
  std::deque<BufferedSend> pending_sends_;  // in send order
  std::vector<unsigned char> scratch_;      // receive blocks of the ordered reductions
};

}  // namespace moeflex::comm
