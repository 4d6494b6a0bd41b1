// The NCCL Communicator (host side; the rank-order fold kernel is ordered_sum.cu).
// Semantics and limits: nccl_communicator.h.
#include "moeflex/comm/nccl/nccl_communicator.h"

#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fmt/format.h>
#include <numeric>
#include <thread>

#include "moeflex/core/cuda/cuda_check.h"

namespace moeflex::comm {
namespace {

using moeflex::cuda::CudaError;

/// Poll interval of the watchdog once a wait is no longer short.
constexpr std::chrono::microseconds kMaxPollSleep{200};
/// Spins before the watchdog starts yielding and sleeping.
constexpr int kSpinPolls = 1000;

/// The block partition of the ordered sums: block r of n elements over p ranks.
std::int64_t block_count(std::int64_t n, int p, int r) { return n / p + (r < n % p ? 1 : 0); }
std::int64_t block_offset(std::int64_t n, int p, int r) { return r * (n / p) + std::min<std::int64_t>(r, n % p); }

/// Waits for a recorded event under the communicator's watchdog.
class NcclRecvState final : public detail::RequestState {
 public:
  NcclRecvState(NcclCommunicator* comm, std::string what) : comm_(comm), what_(std::move(what)) {
    MOEFLEX_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
    MOEFLEX_CUDA_CHECK(cudaEventRecord(event_, comm->stream()));
  }
  ~NcclRecvState() override { cudaEventDestroy(event_); }
  bool test() override {
    const cudaError_t err = cudaEventQuery(event_);
    if (err == cudaErrorNotReady) return false;
    MOEFLEX_CUDA_CHECK(err);
    return true;
  }
  void wait() override {
    // The receive was issued in stream order; waiting for the whole stream is the
    // watchdog-guarded way to wait for it (and for anything queued before it).
    comm_->wait_stream(what_);
  }

 private:
  NcclCommunicator* comm_;
  std::string what_;
  cudaEvent_t event_ = nullptr;
};

}  // namespace

std::unique_ptr<NcclCommunicator> NcclCommunicator::create(Communicator& bootstrap, int device,
                                                           const std::string& name) {
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  if (bootstrap.rank() == 0) {
    const ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess)
      throw CommError(fmt::format("ncclGetUniqueId failed: {}", ncclGetErrorString(r)));
  }
  bootstrap.broadcast(&id, sizeof(id), 0);
  std::vector<int> world(std::size_t(bootstrap.size()));
  const int mine = bootstrap.world_rank();
  bootstrap.all_gather_bytes(&mine, world.data(), sizeof(int));
  MOEFLEX_CUDA_CHECK(cudaSetDevice(device));
  ncclComm_t comm = nullptr;
  const ncclResult_t r = ncclCommInitRank(&comm, bootstrap.size(), id, bootstrap.rank());
  if (r != ncclSuccess)
    throw CommError(fmt::format("ncclCommInitRank on communicator '{}' (rank {} of {}, device {}) failed: {} {}",
                                name, bootstrap.rank(), bootstrap.size(), device, ncclGetErrorString(r),
                                ncclGetLastError(nullptr)));
  return std::unique_ptr<NcclCommunicator>(
      new NcclCommunicator(comm, name, device, std::move(world), bootstrap.timeout()));
}

NcclCommunicator::NcclCommunicator(ncclComm* comm, std::string name, int device, std::vector<int> world_ranks,
                                   Seconds timeout)
    : comm_(comm), device_(device), world_ranks_(std::move(world_ranks)) {
  name_ = std::move(name);
  timeout_ = timeout;
  check_nccl(ncclCommCount(comm_, &size_), "ncclCommCount");
  check_nccl(ncclCommUserRank(comm_, &rank_), "ncclCommUserRank");
  MOEFLEX_CUDA_CHECK(cudaSetDevice(device_));
  MOEFLEX_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
}

NcclCommunicator::~NcclCommunicator() {
  try {
    flush_sends();
  } catch (const std::exception& e) {
    abort_job(fmt::format("delivering the last sends of NCCL communicator '{}' failed: {}", name_, e.what()));
  }
  if (comm_) ncclCommDestroy(comm_);
  for (void* p : in_flight_) cudaFree(p);
  if (scratch_) cudaFree(scratch_);
  if (stream_) cudaStreamDestroy(stream_);
}

std::string NcclCommunicator::describe(const char* op) const {
  return fmt::format("{} on NCCL communicator '{}' (rank {} of {}, world rank {}, device {})", op, name_, rank_,
                     size_, world_rank(), device_);
}

void NcclCommunicator::check_nccl(int result, const std::string& what) const {
  const auto r = static_cast<ncclResult_t>(result);
  if (r != ncclSuccess && r != ncclInProgress)
    throw CommError(fmt::format("{}: NCCL error {} ({})", what, ncclGetErrorString(r), ncclGetLastError(comm_)));
}

void NcclCommunicator::wait_stream(const std::string& what) {
  const auto start = std::chrono::steady_clock::now();
  for (int polls = 0;; ++polls) {
    const cudaError_t err = cudaStreamQuery(stream_);
    if (err == cudaSuccess) break;
    if (err != cudaErrorNotReady)
      throw CudaError(fmt::format("{}: CUDA error {} ({})", what, cudaGetErrorName(err), cudaGetErrorString(err)));
    ncclResult_t async = ncclSuccess;
    ncclCommGetAsyncError(comm_, &async);
    if (async != ncclSuccess && async != ncclInProgress)
      throw CommError(fmt::format("{}: NCCL error {} ({})", what, ncclGetErrorString(async), ncclGetLastError(comm_)));
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (timeout_ > 0 && waited > timeout_) {
      ncclCommAbort(comm_);
      comm_ = nullptr;
      abort_job(fmt::format("communication watchdog: {} did not complete within {} s (the NCCL communicator was "
                            "aborted; raise MOEFLEX_COMM_TIMEOUT if the job is just slow)",
                            what, timeout_));
    }
    if (polls > kSpinPolls) std::this_thread::sleep_for(std::min(kMaxPollSleep, std::chrono::microseconds(polls)));
    else std::this_thread::yield();
  }
  release_sent();
}

void NcclCommunicator::release_sent() {
  for (void* p : in_flight_) cudaFree(p);
  in_flight_.clear();
}

void* NcclCommunicator::scratch(std::size_t bytes) {
  if (bytes > scratch_bytes_) {
    if (scratch_) MOEFLEX_CUDA_CHECK(cudaFree(scratch_));
    scratch_ = nullptr;
    scratch_bytes_ = 0;
    MOEFLEX_CUDA_CHECK(cudaMalloc(&scratch_, bytes));
    scratch_bytes_ = bytes;
  }
  return scratch_;
}

void NcclCommunicator::enqueue_pending_sends() {
  for (const PendingSend& s : pending_) {
    in_flight_.push_back(s.staging);
    if (s.bytes == 0) continue;  // an empty message: the matching recv posts nothing either
    check_nccl(ncclSend(s.staging, static_cast<std::size_t>(s.bytes), ncclUint8, s.peer, comm_, stream_),
               describe("send") + fmt::format(" [{} bytes to rank {}]", s.bytes, s.peer));
  }
  pending_.clear();
}

void NcclCommunicator::flush_sends() {
  if (pending_.empty() || !comm_) return;
  check_nccl(ncclGroupStart(), describe("flush_sends"));
  enqueue_pending_sends();
  check_nccl(ncclGroupEnd(), describe("flush_sends"));
  wait_stream(describe("flush_sends"));
}

template <class T>
void NcclCommunicator::ordered_all_reduce(T* data, std::int64_t n, int nccl_type, const char* op) {
  check_count(n, op);
  flush_sends();
  if (size_ == 1 || n == 0) return;
  const auto type = static_cast<ncclDataType_t>(nccl_type);
  const std::int64_t mine = block_count(n, size_, rank_);
  T* blocks = static_cast<T*>(scratch(std::size_t(std::max<std::int64_t>(1, size_ * mine)) * sizeof(T)));
  const std::string what = describe(op) + fmt::format(" [{} elements]", n);
  // Reduce phase: block r of every rank goes to rank r.
  check_nccl(ncclGroupStart(), what);
  for (int r = 0; r < size_; ++r) {
    const std::int64_t cnt = block_count(n, size_, r);
    if (cnt > 0) check_nccl(ncclSend(data + block_offset(n, size_, r), std::size_t(cnt), type, r, comm_, stream_), what);
    if (mine > 0) check_nccl(ncclRecv(blocks + r * mine, std::size_t(mine), type, r, comm_, stream_), what);
  }
  check_nccl(ncclGroupEnd(), what);
  T* out = data + block_offset(n, size_, rank_);
  detail::ordered_sum(blocks, out, size_, mine, stream_);
  // Gather phase: every rank's summed block to every other rank.
  check_nccl(ncclGroupStart(), what);
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    const std::int64_t cnt = block_count(n, size_, r);
    if (mine > 0) check_nccl(ncclSend(out, std::size_t(mine), type, r, comm_, stream_), what);
    if (cnt > 0) check_nccl(ncclRecv(data + block_offset(n, size_, r), std::size_t(cnt), type, r, comm_, stream_), what);
  }
  check_nccl(ncclGroupEnd(), what);
  wait_stream(what);
}

void NcclCommunicator::all_reduce_sum(float* data, std::int64_t n) {
  ordered_all_reduce(data, n, ncclFloat32, "all_reduce_sum(float)");
}

void NcclCommunicator::all_reduce_sum(double* data, std::int64_t n) {
  ordered_all_reduce(data, n, ncclFloat64, "all_reduce_sum(double)");
}

void NcclCommunicator::all_reduce_sum(std::int64_t* data, std::int64_t n) {
  check_count(n, "all_reduce_sum(int64)");
  flush_sends();
  if (n == 0) return;
  const std::string what = describe("all_reduce_sum(int64)");
  check_nccl(ncclAllReduce(data, data, std::size_t(n), ncclInt64, ncclSum, comm_, stream_), what);
  wait_stream(what);
}

void NcclCommunicator::all_reduce_max(double* data, std::int64_t n) {
  check_count(n, "all_reduce_max");
  flush_sends();
  if (n == 0) return;
  const std::string what = describe("all_reduce_max");
  check_nccl(ncclAllReduce(data, data, std::size_t(n), ncclFloat64, ncclMax, comm_, stream_), what);
  wait_stream(what);
}

void NcclCommunicator::reduce_scatter_sum(const float* send, float* recv, std::int64_t recv_count) {
  check_count(recv_count, "reduce_scatter_sum");
  flush_sends();
  if (recv_count == 0) return;
  const std::string what = describe("reduce_scatter_sum") + fmt::format(" [{} elements per rank]", recv_count);
  if (size_ == 1) {
    if (send != recv)
      MOEFLEX_CUDA_CHECK(cudaMemcpyAsync(recv, send, sizeof(float) * std::size_t(recv_count),
                                         cudaMemcpyDeviceToDevice, stream_));
    wait_stream(what);
    return;
  }
  float* blocks = static_cast<float*>(scratch(std::size_t(size_ * recv_count) * sizeof(float)));
  check_nccl(ncclGroupStart(), what);
  for (int r = 0; r < size_; ++r) {
    check_nccl(ncclSend(send + r * recv_count, std::size_t(recv_count), ncclFloat32, r, comm_, stream_), what);
    check_nccl(ncclRecv(blocks + r * recv_count, std::size_t(recv_count), ncclFloat32, r, comm_, stream_), what);
  }
  check_nccl(ncclGroupEnd(), what);
  detail::ordered_sum(blocks, recv, size_, recv_count, stream_);
  wait_stream(what);
}

void NcclCommunicator::all_gather_bytes(const void* send, void* recv, std::int64_t bytes) {
  check_count(bytes, "all_gather");
  flush_sends();
  if (bytes == 0) return;
  const std::string what = describe("all_gather") + fmt::format(" [{} bytes per rank]", bytes);
  check_nccl(ncclAllGather(send, recv, std::size_t(bytes), ncclUint8, comm_, stream_), what);
  wait_stream(what);
}

void NcclCommunicator::all_to_all_v(const void* send, const std::int64_t* send_counts,
                                    const std::int64_t* send_displs, void* recv, const std::int64_t* recv_counts,
                                    const std::int64_t* recv_displs, std::size_t elem_bytes) {
  flush_sends();
  const std::string what = describe("all_to_all_v") + fmt::format(" [elements of {} bytes]", elem_bytes);
  if (elem_bytes == 0) throw CommError(what + ": element size is 0 bytes");
  for (int r = 0; r < size_; ++r)
    for (std::int64_t v : {send_counts[r], send_displs[r], recv_counts[r], recv_displs[r]})
      if (v < 0) throw CommError(fmt::format("{}: negative count or displacement {} for peer {}", what, v, r));
  const auto* s = static_cast<const char*>(send);
  auto* d = static_cast<char*>(recv);
  const auto eb = static_cast<std::int64_t>(elem_bytes);
  check_nccl(ncclGroupStart(), what);
  for (int r = 0; r < size_; ++r) {
    if (send_counts[r] > 0)
      check_nccl(ncclSend(s + send_displs[r] * eb, std::size_t(send_counts[r] * eb), ncclUint8, r, comm_, stream_),
                 what);
    if (recv_counts[r] > 0)
      check_nccl(ncclRecv(d + recv_displs[r] * eb, std::size_t(recv_counts[r] * eb), ncclUint8, r, comm_, stream_),
                 what);
  }
  check_nccl(ncclGroupEnd(), what);
  wait_stream(what);
}

void NcclCommunicator::exchange_equal(const void* send, void* recv, std::int64_t bytes_per_peer, const char* op) {
  flush_sends();
  if (bytes_per_peer == 0) return;
  const std::string what = describe(op) + fmt::format(" [{} bytes per peer]", bytes_per_peer);
  const auto* s = static_cast<const char*>(send);
  auto* d = static_cast<char*>(recv);
  check_nccl(ncclGroupStart(), what);
  for (int r = 0; r < size_; ++r) {
    check_nccl(ncclSend(s + r * bytes_per_peer, std::size_t(bytes_per_peer), ncclUint8, r, comm_, stream_), what);
    check_nccl(ncclRecv(d + r * bytes_per_peer, std::size_t(bytes_per_peer), ncclUint8, r, comm_, stream_), what);
  }
  check_nccl(ncclGroupEnd(), what);
  wait_stream(what);
}

void NcclCommunicator::all_to_all(const std::int64_t* send, std::int64_t* recv, std::int64_t n) {
  check_count(n, "all_to_all(int64)");
  exchange_equal(send, recv, n * std::int64_t(sizeof(std::int64_t)), "all_to_all(int64)");
}

void NcclCommunicator::all_to_all(const std::int32_t* send, std::int32_t* recv, std::int64_t n) {
  check_count(n, "all_to_all(int32)");
  exchange_equal(send, recv, n * std::int64_t(sizeof(std::int32_t)), "all_to_all(int32)");
}

void NcclCommunicator::broadcast(void* data, std::int64_t bytes, int root) {
  check_count(bytes, "broadcast");
  check_peer(root, "broadcast");
  flush_sends();
  if (bytes == 0) return;
  const std::string what = describe("broadcast") + fmt::format(" [{} bytes from rank {}]", bytes, root);
  check_nccl(ncclBroadcast(data, data, std::size_t(bytes), ncclUint8, root, comm_, stream_), what);
  wait_stream(what);
}

void NcclCommunicator::barrier() {
  flush_sends();
  const std::string what = describe("barrier");
  auto* token = static_cast<float*>(scratch(sizeof(float)));
  MOEFLEX_CUDA_CHECK(cudaMemsetAsync(token, 0, sizeof(float), stream_));
  check_nccl(ncclAllReduce(token, token, 1, ncclFloat32, ncclSum, comm_, stream_), what);
  wait_stream(what);
}

void NcclCommunicator::send(const void* data, std::int64_t bytes, int peer, int tag) {
  check_count(bytes, "send");
  check_peer(peer, "send");
  check_tag(tag, "send");
  PendingSend s;
  s.bytes = bytes;
  s.peer = peer;
  MOEFLEX_CUDA_CHECK(cudaMalloc(&s.staging, std::size_t(std::max<std::int64_t>(bytes, 1))));
  if (bytes > 0) {
    const cudaError_t err = cudaMemcpyAsync(s.staging, data, std::size_t(bytes), cudaMemcpyDefault, stream_);
    if (err != cudaSuccess) {
      cudaFree(s.staging);
      MOEFLEX_CUDA_CHECK(err);
    }
  }
  pending_.push_back(s);
}

void NcclCommunicator::recv(void* data, std::int64_t bytes, int peer, int tag) {
  Request r = irecv(data, bytes, peer, tag);
  r.wait();
}

Request NcclCommunicator::irecv(void* data, std::int64_t bytes, int peer, int tag) {
  check_count(bytes, "recv");
  check_peer(peer, "recv");
  check_tag(tag, "recv");
  const std::string what = describe("recv") + fmt::format(" [{} bytes from rank {}, tag {}]", bytes, peer, tag);
  check_nccl(ncclGroupStart(), what);
  enqueue_pending_sends();
  if (bytes > 0) check_nccl(ncclRecv(data, std::size_t(bytes), ncclUint8, peer, comm_, stream_), what);
  check_nccl(ncclGroupEnd(), what);
  return Request(std::make_unique<NcclRecvState>(this, what));
}

std::unique_ptr<Communicator> NcclCommunicator::split(int color, int key, const std::string& name) {
  flush_sends();
  const std::string what = describe("split") + fmt::format(" [color {}, key {}]", color, key);
  // Every rank's (color, key) so this rank can name its new group's world ranks.
  const int mine[2] = {color, key};
  auto* dev = static_cast<int*>(scratch(sizeof(int) * 2 * std::size_t(size_ + 1)));
  MOEFLEX_CUDA_CHECK(cudaMemcpyAsync(dev, mine, sizeof(mine), cudaMemcpyHostToDevice, stream_));
  check_nccl(ncclAllGather(dev, dev + 2, 2, ncclInt32, comm_, stream_), what);
  std::vector<int> all(2 * std::size_t(size_));
  MOEFLEX_CUDA_CHECK(cudaMemcpyAsync(all.data(), dev + 2, sizeof(int) * all.size(), cudaMemcpyDeviceToHost, stream_));
  wait_stream(what);
  ncclComm_t sub = nullptr;
  check_nccl(ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &sub, nullptr), what);
  if (color < 0) return nullptr;
  std::vector<int> members;
  for (int r = 0; r < size_; ++r)
    if (all[2 * std::size_t(r)] == color) members.push_back(r);
  std::stable_sort(members.begin(), members.end(),
                   [&](int a, int b) { return all[2 * std::size_t(a) + 1] < all[2 * std::size_t(b) + 1]; });
  std::vector<int> world;
  for (int r : members) world.push_back(world_ranks_[std::size_t(r)]);
  return std::unique_ptr<Communicator>(new NcclCommunicator(sub, name, device_, std::move(world), timeout_));
}

}  // namespace moeflex::comm
