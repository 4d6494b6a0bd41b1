// The Communicator: collectives and point-to-point messages between the ranks of
// one job, over one process (SingleProcessCommunicator) or MPI (MpiCommunicator).
//
// Conventions shared by every backend:
// - Every method is called by the host thread that owns the communicator, never
//   from OpenMP workers. A communicator is not thread-safe.
// - Collectives must be called by every rank of the communicator, in the same
//   order, with matching sizes; a rank that never arrives is caught by the
//   watchdog (see `timeout()`), which aborts the whole job naming the operation.
// - Counts are elements unless the parameter says bytes. Negative counts, ranks
//   out of range and size mismatches throw CommError before anything is sent.
// - Sums are deterministic: float and double sums are computed in rank order,
//   ((x_0 + x_1) + x_2) + ..., element by element, by exactly one rank per element,
//   and the result is copied to the others, so every rank ends with the same bits
//   and the result does not depend on the MPI implementation's algorithm. A
//   single-process run that adds per-rank contributions in rank order gets the
//   same bits. (See mpi_communicator.cpp for how.)
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moeflex/core/error.h"
#include "moeflex/core/units.h"

namespace moeflex::comm {

/// A failed communication: bad arguments, an MPI error (with MPI's own message),
/// a receive whose size does not match the message, a receive that can never be
/// satisfied in a single process. The message names the operation, the rank and
/// the peer.
class CommError : public Error {
 public:
  using Error::Error;
};

/// Default watchdog timeout when MOEFLEX_COMM_TIMEOUT is not set.
constexpr Seconds kDefaultCommTimeout = 600.0;

/// The watchdog timeout from the environment: MOEFLEX_COMM_TIMEOUT in seconds
/// (a positive number; 0 disables the watchdog), else kDefaultCommTimeout.
/// Throws ConfigError on an unparsable value.
Seconds comm_timeout_from_env();

/// Whether this node runs more compute threads than it has cores (ranks on the
/// node x threads per rank > cores). Process-wide; false until set. The trainer
/// sets it once it knows its thread count. A waiting rank polls (MpiCommunicator::
/// wait): it spins briefly, then, on a node with a core per thread, yields its core
/// for up to 2 ms (low latency, nobody else needs the core), then naps. When the
/// node is oversubscribed it naps right after the spin, since a yielding rank takes
/// CPU time from a rank that computes: 4 ranks on 2 cores (the dp4-ep4 run of
/// bench/sim_check.sh) took 1.37 s per step instead of 1.43 (medians of 2 pairs).
void set_host_oversubscribed(bool oversubscribed);
bool host_oversubscribed();

namespace detail {
/// Backend state of one non-blocking operation (see Request).
class RequestState {
 public:
  virtual ~RequestState() = default;
  /// True once the operation completed; throws CommError on failure.
  virtual bool test() = 0;
  /// Blocks until completion (under the watchdog); throws CommError on failure.
  virtual void wait() = 0;
};
}  // namespace detail

/// A pending non-blocking operation (today: a receive posted with irecv).
/// Move-only. Its buffer must stay alive until wait() returned or test() returned
/// true; the destructor therefore waits for a still-pending operation (and aborts
/// the job if that wait fails, since a destructor cannot throw). A Request must
/// not outlive the communicator that made it.
class Request {
 public:
  Request() = default;  ///< an empty, already complete request
  explicit Request(std::unique_ptr<detail::RequestState> state) : state_(std::move(state)) {}
  Request(Request&&) noexcept = default;
  Request& operator=(Request&& other) noexcept;
  ~Request();

  /// Blocks until the operation completed. Throws CommError on failure.
  void wait();
  /// True when complete (then the buffer may be used); never blocks.
  bool test();
  /// True when nothing is pending (empty, or completed through wait/test).
  bool done() const { return state_ == nullptr; }

 private:
  std::unique_ptr<detail::RequestState> state_;
};

/// Collectives and point-to-point messages among `size()` ranks. Abstract;
/// see SingleProcessCommunicator and MpiCommunicator.
class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  /// This process's rank in [0, size()).
  virtual int rank() const = 0;
  /// The number of ranks.
  virtual int size() const = 0;
  /// "single" or "mpi".
  virtual std::string backend() const = 0;
  /// A short name used in messages ("world", "pp", "dp", "ep", "expert_dp").
  const std::string& name() const { return name_; }
  /// This rank's rank in the world communicator (for messages and logs).
  virtual int world_rank() const = 0;
  /// The world rank of rank `r` of this communicator.
  virtual int world_rank_of(int r) const = 0;

  /// Watchdog timeout of blocking operations on this communicator, in seconds;
  /// 0 means wait forever. Sub-communicators from split() inherit it.
  Seconds timeout() const { return timeout_; }
  void set_timeout(Seconds seconds);

  // ---- reductions (deterministic; see the file comment) ----

  /// data[i] = sum over ranks r, in rank order, of rank r's data[i]; in place,
  /// `n` floats, the same n on every rank. Every rank ends with the same bits.
  virtual void all_reduce_sum(float* data, std::int64_t n) = 0;
  /// As above, for doubles (metrics).
  virtual void all_reduce_sum(double* data, std::int64_t n) = 0;
  /// Integer sum (exact, so order does not matter); token counts and OOM counts.
  virtual void all_reduce_sum(std::int64_t* data, std::int64_t n) = 0;
  /// data[i] = max over ranks of data[i]; in place, `n` doubles (metrics, peaks).
  virtual void all_reduce_max(double* data, std::int64_t n) = 0;
  /// `send` holds size() blocks of `recv_count` floats; block r is rank r's share.
  /// recv[0, recv_count) = sum over ranks q, in rank order, of rank q's block
  /// rank(). `send` and `recv` must not overlap.
  virtual void reduce_scatter_sum(const float* send, float* recv, std::int64_t recv_count) = 0;

  // ---- gathers and exchanges ----

  /// recv[r * n, (r + 1) * n) = rank r's send[0, n); `recv` holds size() * n floats.
  void all_gather(const float* send, float* recv, std::int64_t n) {
    all_gather_bytes(send, recv, n * static_cast<std::int64_t>(sizeof(float)));
  }
  /// The same for raw bytes: `bytes` per rank, recv holds size() * bytes.
  virtual void all_gather_bytes(const void* send, void* recv, std::int64_t bytes) = 0;

  /// Personalized exchange with per-peer counts (MoE dispatch and combine).
  /// Element r of each array is about peer r (size() entries each). Rank q's
  /// send[send_displs[r], + send_counts[r]) lands in rank r's
  /// recv[recv_displs[q], + recv_counts[q]). Counts and displacements are in
  /// elements of `elem_bytes` bytes; zero counts are fine. recv_counts[q] on rank
  /// r must equal send_counts[r] on rank q (exchange counts first with
  /// all_to_all): the single-process backend checks it; MPI throws CommError
  /// (truncation) only when more arrives than expected. Buffers must not overlap.
  virtual void all_to_all_v(const void* send, const std::int64_t* send_counts,
                            const std::int64_t* send_displs, void* recv,
                            const std::int64_t* recv_counts, const std::int64_t* recv_displs,
                            std::size_t elem_bytes) = 0;
  /// Equal-count exchange of `n` int64 per peer: recv[q * n, + n) = rank q's
  /// send[rank() * n, + n). Used to exchange token counts before all_to_all_v.
  virtual void all_to_all(const std::int64_t* send, std::int64_t* recv, std::int64_t n) = 0;
  /// As above, for int32.
  virtual void all_to_all(const std::int32_t* send, std::int32_t* recv, std::int64_t n) = 0;

  /// Copies root's data[0, bytes) to every rank.
  virtual void broadcast(void* data, std::int64_t bytes, int root) = 0;
  /// Returns once every rank has entered.
  virtual void barrier() = 0;

  // ---- point to point ----

  /// Buffered send of data[0, bytes) to `peer` with `tag` (>= 0): copies the data
  /// and returns at once, so `data` may be reused immediately, and two ranks that
  /// both send then receive never deadlock. Messages between one pair with one
  /// tag arrive in send order. Delivery completes in the background; flush_sends()
  /// (also run by the destructor) waits for all of them. barrier() does not
  /// flush: a peer may receive only after the barrier.
  virtual void send(const void* data, std::int64_t bytes, int peer, int tag) = 0;
  /// Blocking receive of exactly `bytes` bytes from `peer` with `tag`. Throws
  /// CommError if the message has another size.
  virtual void recv(void* data, std::int64_t bytes, int peer, int tag) = 0;
  /// Non-blocking receive; complete it with Request::wait() before using `data`.
  [[nodiscard]] virtual Request irecv(void* data, std::int64_t bytes, int peer, int tag) = 0;
  /// Waits until every buffered send of this rank has been delivered.
  virtual void flush_sends() = 0;

  // ---- groups ----

  /// Collective: splits into sub-communicators, one per distinct `color` (>= 0),
  /// ranks ordered by `key` then by rank. A negative color returns nullptr
  /// (the rank joins no group). `name` labels the result in messages.
  virtual std::unique_ptr<Communicator> split(int color, int key, const std::string& name) = 0;

 protected:
  std::string name_ = "world";
  Seconds timeout_ = kDefaultCommTimeout;

  // Argument checks shared by the backends; throw CommError naming `op`.
  void check_count(std::int64_t n, const char* op) const;
  void check_peer(int peer, const char* op) const;
  void check_tag(int tag, const char* op) const;
};

/// Prints "moeflex: rank R of N: fatal: <msg>" on stderr and ends the whole job:
/// MPI_Abort on MPI_COMM_WORLD when MPI is running (so the other ranks end instead
/// of hanging in their next collective), else _Exit(exit_code). Use it for errors
/// after which the ranks can no longer agree on what to do next.
[[noreturn]] void abort_job(const std::string& msg, int exit_code = 1);

/// The world communicator for this process: MPI's when MPI is initialized (an
/// MpiSession is alive), else a SingleProcessCommunicator. Timeout from the env.
std::unique_ptr<Communicator> make_world_communicator();

}  // namespace moeflex::comm
