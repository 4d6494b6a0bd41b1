// Every call of the wrapped communicator inside a PhaseScope of its kind, and, with
// the clock's call log on (slow-rank level 2), recorded with its bytes and peer.
#include "moeflex/comm/timed_communicator.h"

#include "moeflex/core/phase_clock.h"

namespace moeflex::comm {

namespace {

/// The scope of one call: its phase, and its record when the clock logs calls.
class Call {
 public:
  Call(StepPhase kind, const char* op, const Communicator& c, std::int64_t bytes, int peer = -1)
      : scope_(kind), clock_(phase_clock()) {
    if (!clock_.call_log()) return;
    rec_ = {kind, op, c.name(), bytes, peer, 0.0};
    t0_ = clock_.now();
  }
  ~Call() {
    if (!clock_.call_log()) return;
    rec_.seconds = clock_.now() - t0_;
    clock_.calls().push_back(std::move(rec_));
  }
  Call(const Call&) = delete;
  Call& operator=(const Call&) = delete;

 private:
  PhaseScope scope_;
  PhaseClock& clock_;
  CallRecord rec_;
  double t0_ = 0;
};

constexpr StepPhase kA2a = StepPhase::all_to_all, kReduce = StepPhase::all_reduce, kP2p = StepPhase::send_recv;

std::int64_t sum_of(const std::int64_t* counts, int n) {
  std::int64_t s = 0;
  for (int i = 0; i < n; ++i) s += counts[i];
  return s;
}

}  // namespace

TimedCommunicator::TimedCommunicator(std::unique_ptr<Communicator> inner) : inner_(std::move(inner)) {
  name_ = inner_->name();
  timeout_ = inner_->timeout();
}

void TimedCommunicator::all_reduce_sum(float* data, std::int64_t n) {
  Call c(kReduce, "all_reduce_sum", *this, n * std::int64_t(sizeof(float)));
  inner_->all_reduce_sum(data, n);
}
void TimedCommunicator::all_reduce_sum(double* data, std::int64_t n) {
  Call c(kReduce, "all_reduce_sum", *this, n * std::int64_t(sizeof(double)));
  inner_->all_reduce_sum(data, n);
}
void TimedCommunicator::all_reduce_sum(std::int64_t* data, std::int64_t n) {
  Call c(kReduce, "all_reduce_sum", *this, n * std::int64_t(sizeof(std::int64_t)));
  inner_->all_reduce_sum(data, n);
}
void TimedCommunicator::all_reduce_max(double* data, std::int64_t n) {
  Call c(kReduce, "all_reduce_max", *this, n * std::int64_t(sizeof(double)));
  inner_->all_reduce_max(data, n);
}
void TimedCommunicator::reduce_scatter_sum(const float* send, float* recv, std::int64_t recv_count) {
  Call c(kReduce, "reduce_scatter_sum", *this, recv_count * size() * std::int64_t(sizeof(float)));
  inner_->reduce_scatter_sum(send, recv, recv_count);
}
void TimedCommunicator::all_gather_bytes(const void* send, void* recv, std::int64_t bytes) {
  Call c(kReduce, "all_gather", *this, bytes);
  inner_->all_gather_bytes(send, recv, bytes);
}
void TimedCommunicator::all_to_all_v(const void* send, const std::int64_t* send_counts,
                                     const std::int64_t* send_displs, void* recv, const std::int64_t* recv_counts,
                                     const std::int64_t* recv_displs, std::size_t elem_bytes) {
  Call c(kA2a, "all_to_all_v", *this, sum_of(send_counts, size()) * std::int64_t(elem_bytes));
  inner_->all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs, elem_bytes);
}
void TimedCommunicator::all_to_all(const std::int64_t* send, std::int64_t* recv, std::int64_t n) {
  Call c(kA2a, "all_to_all", *this, n * size() * std::int64_t(sizeof(std::int64_t)));
  inner_->all_to_all(send, recv, n);
}
void TimedCommunicator::all_to_all(const std::int32_t* send, std::int32_t* recv, std::int64_t n) {
  Call c(kA2a, "all_to_all", *this, n * size() * std::int64_t(sizeof(std::int32_t)));
  inner_->all_to_all(send, recv, n);
}
void TimedCommunicator::broadcast(void* data, std::int64_t bytes, int root) {
  Call c(kReduce, "broadcast", *this, bytes, root);
  inner_->broadcast(data, bytes, root);
}
void TimedCommunicator::barrier() {
  Call c(kReduce, "barrier", *this, 0);
  inner_->barrier();
}
void TimedCommunicator::send(const void* data, std::int64_t bytes, int peer, int tag) {
  Call c(kP2p, "send", *this, bytes, peer);
  inner_->send(data, bytes, peer, tag);
}
void TimedCommunicator::recv(void* data, std::int64_t bytes, int peer, int tag) {
  Call c(kP2p, "recv", *this, bytes, peer);
  inner_->recv(data, bytes, peer, tag);
}
Request TimedCommunicator::irecv(void* data, std::int64_t bytes, int peer, int tag) {
  Call c(kP2p, "irecv", *this, bytes, peer);
  return inner_->irecv(data, bytes, peer, tag);
}
void TimedCommunicator::flush_sends() {
  Call c(kP2p, "flush_sends", *this, 0);
  inner_->flush_sends();
}

std::unique_ptr<Communicator> TimedCommunicator::split(int color, int key, const std::string& name) {
  std::unique_ptr<Communicator> part = inner_->split(color, key, name);
  if (!part) return nullptr;
  return std::make_unique<TimedCommunicator>(std::move(part));
}

}  // namespace moeflex::comm
