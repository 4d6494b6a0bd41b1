#include "moeflex/comm/mpi_communicator.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fmt/format.h>
#include <thread>

#include "moeflex/comm/single_process.h"
#include "moeflex/comm/wait_policy.h"

namespace moeflex::comm {

namespace {

// Watchdog polling (see the file comment of the header): comm/wait_policy.h.

// The ordered all-reduce works on pieces of at most this many elements, so every
// count and displacement handed to MPI fits its `int`.
constexpr std::int64_t kMaxReducePiece = std::int64_t(1) << 28;
// Broadcasts go in pieces of at most this many bytes, for the same reason.
constexpr std::int64_t kMaxBroadcastPiece = std::int64_t(1) << 30;

bool env_set(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0';
}

std::string mpi_error_text(int rc) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, buf, &len) != MPI_SUCCESS) return fmt::format("MPI error code {}", rc);
  return std::string(buf, std::size_t(len));
}

// Frees a derived datatype on every path out of a scope.
struct TypeGuard {
  MPI_Datatype type = MPI_DATATYPE_NULL;
  ~TypeGuard() {
    if (type != MPI_DATATYPE_NULL) MPI_Type_free(&type);
  }
};

// The block of rank r when n elements are split over p ranks, the first n % p
// blocks one element longer.
std::int64_t block_count(std::int64_t n, int p, int r) { return n / p + (r < n % p ? 1 : 0); }
std::int64_t block_offset(std::int64_t n, int p, int r) { return r * (n / p) + std::min<std::int64_t>(r, n % p); }

}  // namespace

// ---------------------------------------------------------------- MpiSession

MpiSession::MpiSession(int* argc, char*** argv) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int rc = MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &thread_level_);
    if (rc != MPI_SUCCESS) throw CommError("MPI_Init_thread failed: " + mpi_error_text(rc));
    owns_ = true;
  } else {
    MPI_Query_thread(&thread_level_);
  }
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
}

MpiSession::~MpiSession() {
  if (!owns_) return;
  if (std::uncaught_exceptions() > 0)
    abort_job("leaving MPI because of an exception; ending every rank instead of finalizing");
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

bool MpiSession::launched_by_mpi() {
  if (const char* force = std::getenv("MOEFLEX_MPI"); force != nullptr && *force != '\0')
    return std::strcmp(force, "0") != 0;
  if (env_set("OMPI_COMM_WORLD_SIZE") || env_set("PMI_SIZE") || env_set("PMIX_RANK")) return true;
  const char* ntasks = std::getenv("SLURM_NTASKS");
  return ntasks != nullptr && std::atoi(ntasks) > 1;
}

bool MpiSession::active() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized && !finalized;
}

int MpiSession::world_size() const {
  int s = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &s);
  return s;
}

int MpiSession::world_rank() const {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

// ---------------------------------------------------------------- free functions

void abort_job(const std::string& msg, int exit_code) {
  int rank = 0, size = 1;
  bool mpi = MpiSession::active();
  if (mpi) {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
  }
  std::fflush(stdout);
  // An error every rank meets (a config check, a budget under the minimum) would be
  // printed once per rank. The other ranks give rank 0 a moment: if it fails too, its
  // MPI_Abort usually ends them before they print (not always: Open MPI 4 may take
  // longer to kill them); an error of this rank alone still prints.
  if (mpi && rank != 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  std::fprintf(stderr, "moeflex: rank %d of %d: fatal: %s\n", rank, size, msg.c_str());
  std::fflush(stderr);
  if (mpi) MPI_Abort(MPI_COMM_WORLD, exit_code);
  std::_Exit(exit_code);
}

std::unique_ptr<Communicator> make_world_communicator() {
  if (MpiSession::active()) return MpiCommunicator::world();
  auto c = std::make_unique<SingleProcessCommunicator>("world");
  c->set_timeout(comm_timeout_from_env());
  return c;
}

// ---------------------------------------------------------------- MpiCommunicator

namespace {

class MpiRecv final : public detail::RequestState {
 public:
  MpiRecv(MpiCommunicator* comm, MPI_Request req, std::int64_t bytes, std::string what)
      : comm_(comm), req_(req), bytes_(bytes), what_(std::move(what)) {}
  bool test() override {
    int flag = 0;
    MPI_Status status;
    comm_->check(MPI_Test(&req_, &flag, &status), what_);
    if (flag) check_size(status);
    return flag != 0;
  }
  void wait() override {
    MPI_Status status;
    comm_->wait(req_, &status, what_);
    check_size(status);
  }

 private:
  void check_size(const MPI_Status& status) const {
    int got = 0;
    MPI_Get_count(&status, MPI_BYTE, &got);
    if (got != bytes_)
      throw CommError(fmt::format("{}: expected {} bytes but the message has {}", what_, bytes_, got));
  }
  MpiCommunicator* comm_;
  MPI_Request req_;
  std::int64_t bytes_;
  std::string what_;
};

}  // namespace

std::unique_ptr<MpiCommunicator> MpiCommunicator::world() {
  if (!MpiSession::active())
    throw CommError("MpiCommunicator::world() needs MPI to be running: create an MpiSession first");
  MPI_Comm dup = MPI_COMM_NULL;
  int rc = MPI_Comm_dup(MPI_COMM_WORLD, &dup);
  if (rc != MPI_SUCCESS) throw CommError("MPI_Comm_dup(MPI_COMM_WORLD) failed: " + mpi_error_text(rc));
  return std::make_unique<MpiCommunicator>(dup, "world", comm_timeout_from_env());
}

MpiCommunicator::MpiCommunicator(MPI_Comm comm, std::string name, Seconds timeout) : comm_(comm) {
  name_ = std::move(name);
  set_timeout(timeout);
  check(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
  check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
  MPI_Group mine, world;
  check(MPI_Comm_group(comm_, &mine), "MPI_Comm_group");
  check(MPI_Comm_group(MPI_COMM_WORLD, &world), "MPI_Comm_group");
  std::vector<int> local(static_cast<std::size_t>(size_));
  for (int r = 0; r < size_; ++r) local[std::size_t(r)] = r;
  world_ranks_.resize(static_cast<std::size_t>(size_));
  check(MPI_Group_translate_ranks(mine, size_, local.data(), world, world_ranks_.data()),
        "MPI_Group_translate_ranks");
  MPI_Group_free(&mine);
  MPI_Group_free(&world);
}

MpiCommunicator::~MpiCommunicator() {
  if (!MpiSession::active()) return;  // MPI already finalized: nothing left to free
  try {
    flush_sends();
  } catch (const std::exception& e) {
    abort_job(fmt::format("delivering the last sends of communicator '{}' failed: {}", name_, e.what()));
  }
  if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
}

void MpiCommunicator::check(int rc, const std::string& what) const {
  if (rc == MPI_SUCCESS) return;
  throw CommError(fmt::format("{} failed on rank {} of {} (world rank {}): {}", what, rank_, size_,
                              world_rank(), mpi_error_text(rc)));
}

std::string MpiCommunicator::describe(const char* op) const {
  std::string members;
  for (int r = 0; r < size_ && r < 16; ++r) members += fmt::format("{}{}", r ? ", " : "", world_ranks_[std::size_t(r)]);
  if (size_ > 16) members += ", ...";
  return fmt::format("{} on communicator '{}' (rank {} of {}; world ranks [{}])", op, name_, rank_, size_, members);
}

std::string MpiCommunicator::describe_peer(const char* op, int peer, int tag, std::int64_t bytes) const {
  return fmt::format("{} of {} bytes {} rank {} (world rank {}) with tag {} on communicator '{}' (rank {} of {})",
                     op, bytes, std::strcmp(op, "send") == 0 ? "to" : "from", peer,
                     world_ranks_[std::size_t(peer)], tag, name_, rank_, size_);
}

void MpiCommunicator::wait(MPI_Request& req, MPI_Status* status, const std::string& what) {
  using clock = std::chrono::steady_clock;
  const clock::time_point start = clock::now();
  for (long polls = 0;; ++polls) {
    int flag = 0;
    check(MPI_Test(&req, &flag, status), what);
    if (flag) return;
    if (polls < kSpinPolls) continue;
    const Seconds waited = std::chrono::duration<double>(clock::now() - start).count();
    if (timeout_ > 0 && waited > timeout_)
      abort_job(fmt::format("communication watchdog: {} did not complete within {} s (the communication "
                            "timeout, MOEFLEX_COMM_TIMEOUT); a peer has died, hangs, or is waiting in a "
                            "different operation. Ending the job.",
                            what, timeout_));
    const bool shared = host_oversubscribed();
    if (waited < kYieldPhase && !shared) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::duration<double>(poll_nap_seconds(waited, shared)));
    }
  }
}

namespace {
int to_int(std::int64_t v, const char* what, const std::string& op) {
  if (v > INT_MAX)
    throw CommError(fmt::format("{}: {} {} exceeds MPI's int limit {}; split the transfer", op, what, v, INT_MAX));
  return int(v);
}
}  // namespace

// Deterministic sum, bit-identical on every rank. Reduce-scatter then all-gather,
// both done by exchanges: rank r owns block r of the buffer; an all-to-all-v hands
// it every rank's copy of that block; it adds them in rank order (block of rank
// 0, then += rank 1's, ...); an all-gather-v copies each owner's result to all.
// Every element is thus summed exactly once, in a fixed order independent of the
// MPI library's collective algorithm, and the traffic per rank is that of a ring
// all-reduce (2 (p-1)/p n), unlike gathering every buffer on every rank.
template <class T>
void MpiCommunicator::ordered_all_reduce(T* data, std::int64_t n, MPI_Datatype type, const char* op) {
  check_count(n, op);
  progress_sends();
  if (size_ == 1) return;
  const int p = size_;
  const std::size_t np = static_cast<std::size_t>(p);
  std::vector<int> send_counts(np), send_displs(np), recv_counts(np),
      recv_displs(np);
  for (std::int64_t start = 0; start < n; start += kMaxReducePiece) {
    const std::int64_t len = std::min(kMaxReducePiece, n - start);
    T* piece = data + start;
    const std::int64_t mine = block_count(len, p, rank_);
    for (int r = 0; r < p; ++r) {
      send_counts[std::size_t(r)] = int(block_count(len, p, r));
      send_displs[std::size_t(r)] = int(block_offset(len, p, r));
      recv_counts[std::size_t(r)] = int(mine);
      recv_displs[std::size_t(r)] = int(r * mine);
    }
    scratch_.resize(static_cast<std::size_t>(p * mine) * sizeof(T));
    T* blocks = reinterpret_cast<T*>(scratch_.data());
    const std::string what = describe(op) + fmt::format(" [{} elements, reduce phase]", len);
    MPI_Request req;
    check(MPI_Ialltoallv(piece, send_counts.data(), send_displs.data(), type, blocks, recv_counts.data(),
                         recv_displs.data(), type, comm_, &req),
          what);
    wait(req, MPI_STATUS_IGNORE, what);
    T* out = piece + block_offset(len, p, rank_);
    std::copy(blocks, blocks + mine, out);
    for (int q = 1; q < p; ++q) {
      const T* b = blocks + q * mine;
      for (std::int64_t i = 0; i < mine; ++i) out[i] += b[i];
    }
    const std::string what2 = describe(op) + fmt::format(" [{} elements, gather phase]", len);
    check(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, piece, send_counts.data(), send_displs.data(), type,
                          comm_, &req),
          what2);
    wait(req, MPI_STATUS_IGNORE, what2);
  }
}

template <class T>
void MpiCommunicator::ordered_reduce_scatter(const T* send, T* recv, std::int64_t recv_count, MPI_Datatype type,
                                             const char* op) {
  check_count(recv_count, op);
  progress_sends();
  if (size_ == 1) {
    if (recv_count > 0 && send != recv) std::memmove(recv, send, sizeof(T) * std::size_t(recv_count));
    return;
  }
  const std::string what = describe(op) + fmt::format(" [{} elements per rank]", recv_count);
  const int count = to_int(recv_count, "count", what);
  to_int(recv_count * size_, "total count", what);
  scratch_.resize(static_cast<std::size_t>(recv_count * size_) * sizeof(T));
  T* blocks = reinterpret_cast<T*>(scratch_.data());
  MPI_Request req;
  check(MPI_Ialltoall(send, count, type, blocks, count, type, comm_, &req), what);
  wait(req, MPI_STATUS_IGNORE, what);
  std::copy(blocks, blocks + recv_count, recv);
  for (int q = 1; q < size_; ++q) {
    const T* b = blocks + q * recv_count;
    for (std::int64_t i = 0; i < recv_count; ++i) recv[i] += b[i];
  }
}

void MpiCommunicator::all_reduce_sum(float* data, std::int64_t n) {
  ordered_all_reduce(data, n, MPI_FLOAT, "all_reduce_sum(float)");
}

void MpiCommunicator::all_reduce_sum(double* data, std::int64_t n) {
  ordered_all_reduce(data, n, MPI_DOUBLE, "all_reduce_sum(double)");
}

void MpiCommunicator::all_reduce_sum(std::int64_t* data, std::int64_t n) {
  check_count(n, "all_reduce_sum(int64)");
  progress_sends();
  const std::string what = describe("all_reduce_sum(int64)") + fmt::format(" [{} elements]", n);
  MPI_Request req;
  check(MPI_Iallreduce(MPI_IN_PLACE, data, to_int(n, "count", what), MPI_INT64_T, MPI_SUM, comm_, &req), what);
  wait(req, MPI_STATUS_IGNORE, what);
}

void MpiCommunicator::all_reduce_max(double* data, std::int64_t n) {
  check_count(n, "all_reduce_max");
  progress_sends();
  const std::string what = describe("all_reduce_max(double)") + fmt::format(" [{} elements]", n);
  MPI_Request req;
  check(MPI_Iallreduce(MPI_IN_PLACE, data, to_int(n, "count", what), MPI_DOUBLE, MPI_MAX, comm_, &req), what);
  wait(req, MPI_STATUS_IGNORE, what);
}

void MpiCommunicator::reduce_scatter_sum(const float* send, float* recv, std::int64_t recv_count) {
  ordered_reduce_scatter(send, recv, recv_count, MPI_FLOAT, "reduce_scatter_sum");
}

void MpiCommunicator::all_gather_bytes(const void* send, void* recv, std::int64_t bytes) {
  check_count(bytes, "all_gather");
  progress_sends();
  const std::string what = describe("all_gather") + fmt::format(" [{} bytes per rank]", bytes);
  const int count = to_int(bytes, "bytes", what);
  MPI_Request req;
  check(MPI_Iallgather(send, count, MPI_BYTE, recv, count, MPI_BYTE, comm_, &req), what);
  wait(req, MPI_STATUS_IGNORE, what);
}

void MpiCommunicator::all_to_all_v(const void* send, const std::int64_t* send_counts,
                                   const std::int64_t* send_displs, void* recv, const std::int64_t* recv_counts,
                                   const std::int64_t* recv_displs, std::size_t elem_bytes) {
  progress_sends();
  const std::string what = describe("all_to_all_v") + fmt::format(" [elements of {} bytes]", elem_bytes);
  if (elem_bytes == 0 || elem_bytes > std::size_t(INT_MAX))
    throw CommError(fmt::format("{}: element size {} bytes is out of range", what, elem_bytes));
  const std::size_t p = std::size_t(size_);
  std::vector<int> sc(p), sd(p), rc(p), rd(p);
  for (std::size_t r = 0; r < p; ++r) {
    for (std::int64_t v : {send_counts[r], send_displs[r], recv_counts[r], recv_displs[r]})
      if (v < 0) throw CommError(fmt::format("{}: negative count or displacement {} for peer {}", what, v, r));
    sc[r] = to_int(send_counts[r], "send count", what);
    sd[r] = to_int(send_displs[r], "send displacement", what);
    rc[r] = to_int(recv_counts[r], "recv count", what);
    rd[r] = to_int(recv_displs[r], "recv displacement", what);
  }
  TypeGuard elem;
  check(MPI_Type_contiguous(int(elem_bytes), MPI_BYTE, &elem.type), what);
  check(MPI_Type_commit(&elem.type), what);
  MPI_Request req;
  check(MPI_Ialltoallv(send, sc.data(), sd.data(), elem.type, recv, rc.data(), rd.data(), elem.type, comm_, &req),
        what);
  wait(req, MPI_STATUS_IGNORE, what);
}

void MpiCommunicator::exchange_equal(const void* send, void* recv, std::int64_t n, MPI_Datatype type,
                                     const char* op) {
  check_count(n, op);
  progress_sends();
  const std::string what = describe(op) + fmt::format(" [{} elements per peer]", n);
  const int count = to_int(n, "count", what);
  to_int(n * size_, "total count", what);
  if (send == recv) throw CommError(what + ": send and recv buffers must differ");
  MPI_Request req;
  check(MPI_Ialltoall(send, count, type, recv, count, type, comm_, &req), what);
  wait(req, MPI_STATUS_IGNORE, what);
}

void MpiCommunicator::all_to_all(const std::int64_t* send, std::int64_t* recv, std::int64_t n) {
  exchange_equal(send, recv, n, MPI_INT64_T, "all_to_all(int64)");
}

void MpiCommunicator::all_to_all(const std::int32_t* send, std::int32_t* recv, std::int64_t n) {
  exchange_equal(send, recv, n, MPI_INT32_T, "all_to_all(int32)");
}

void MpiCommunicator::broadcast(void* data, std::int64_t bytes, int root) {
  check_count(bytes, "broadcast");
  check_peer(root, "broadcast");
  progress_sends();
  for (std::int64_t start = 0; start < bytes; start += kMaxBroadcastPiece) {
    const std::int64_t len = std::min(kMaxBroadcastPiece, bytes - start);
    const std::string what = describe("broadcast") + fmt::format(" [{} bytes from rank {}]", len, root);
    MPI_Request req;
    check(MPI_Ibcast(static_cast<std::byte*>(data) + start, int(len), MPI_BYTE, root, comm_, &req), what);
    wait(req, MPI_STATUS_IGNORE, what);
  }
}

void MpiCommunicator::barrier() {
  progress_sends();
  const std::string what = describe("barrier");
  MPI_Request req;
  check(MPI_Ibarrier(comm_, &req), what);
  wait(req, MPI_STATUS_IGNORE, what);
}

void MpiCommunicator::progress_sends() {
  for (auto it = pending_sends_.begin(); it != pending_sends_.end();) {
    int flag = 0;
    check(MPI_Test(&it->req, &flag, MPI_STATUS_IGNORE),
          describe_peer("send", it->peer, it->tag, std::int64_t(it->data.size())));
    it = flag ? pending_sends_.erase(it) : std::next(it);
  }
}

void MpiCommunicator::send(const void* data, std::int64_t bytes, int peer, int tag) {
  check_count(bytes, "send");
  check_peer(peer, "send");
  check_tag(tag, "send");
  progress_sends();
  const std::string what = describe_peer("send", peer, tag, bytes);
  const int count = to_int(bytes, "bytes", what);
  BufferedSend& s = pending_sends_.emplace_back();
  s.data.resize(static_cast<std::size_t>(bytes));
  if (bytes > 0) std::memcpy(s.data.data(), data, std::size_t(bytes));
  s.peer = peer;
  s.tag = tag;
  int rc = MPI_Isend(s.data.data(), count, MPI_BYTE, peer, tag, comm_, &s.req);
  if (rc != MPI_SUCCESS) {
    pending_sends_.pop_back();
    check(rc, what);
  }
}

void MpiCommunicator::recv(void* data, std::int64_t bytes, int peer, int tag) {
  Request r = irecv(data, bytes, peer, tag);
  r.wait();
}

Request MpiCommunicator::irecv(void* data, std::int64_t bytes, int peer, int tag) {
  check_count(bytes, "recv");
  check_peer(peer, "recv");
  check_tag(tag, "recv");
  progress_sends();
  std::string what = describe_peer("recv", peer, tag, bytes);
  const int count = to_int(bytes, "bytes", what);
  MPI_Request req;
  check(MPI_Irecv(data, count, MPI_BYTE, peer, tag, comm_, &req), what);
  return Request(std::make_unique<MpiRecv>(this, req, bytes, std::move(what)));
}

void MpiCommunicator::flush_sends() {
  while (!pending_sends_.empty()) {
    BufferedSend& s = pending_sends_.front();
    wait(s.req, MPI_STATUS_IGNORE, describe_peer("send", s.peer, s.tag, std::int64_t(s.data.size())));
    pending_sends_.pop_front();
  }
}

std::unique_ptr<Communicator> MpiCommunicator::split(int color, int key, const std::string& name) {
  barrier();
  MPI_Comm sub = MPI_COMM_NULL;
  check(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &sub),
        describe("split") + fmt::format(" [color {}, key {}]", color, key));
  if (sub == MPI_COMM_NULL) return nullptr;
  return std::make_unique<MpiCommunicator>(sub, name, timeout_);
}

}  // namespace moeflex::comm
