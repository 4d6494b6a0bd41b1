#include "moeflex/comm/single_process.h"

#include <algorithm>
#include <cstring>
#include <fmt/format.h>

namespace moeflex::comm {

class SingleProcessCommunicator::SelfRecv final : public detail::RequestState {
 public:
  SelfRecv(std::shared_ptr<PostedRecv> r, int tag) : r_(std::move(r)), tag_(tag) {}
  bool test() override {
    if (r_->done) check();
    return r_->done;
  }
  void wait() override {
    if (!r_->done)
      throw CommError(fmt::format("irecv of {} bytes from self with tag {} on a single-process communicator "
                                  "can never complete: no matching send was made before wait()",
                                  r_->bytes, tag_));
    check();
  }

 private:
  void check() const {
    if (r_->size_mismatch)
      throw CommError(fmt::format("irecv from self with tag {} expected {} bytes but the message has {}", tag_,
                                  r_->bytes, r_->got_bytes));
  }
  std::shared_ptr<PostedRecv> r_;
  int tag_;
};

SingleProcessCommunicator::SingleProcessCommunicator(std::string name) {
  name_ = std::move(name);
  timeout_ = 0;  // nothing here can block
}

SingleProcessCommunicator::~SingleProcessCommunicator() = default;

void SingleProcessCommunicator::all_reduce_sum(float*, std::int64_t n) { check_count(n, "all_reduce_sum"); }
void SingleProcessCommunicator::all_reduce_sum(double*, std::int64_t n) { check_count(n, "all_reduce_sum"); }
void SingleProcessCommunicator::all_reduce_sum(std::int64_t*, std::int64_t n) {
  check_count(n, "all_reduce_sum");
}
void SingleProcessCommunicator::all_reduce_max(double*, std::int64_t n) { check_count(n, "all_reduce_max"); }

void SingleProcessCommunicator::reduce_scatter_sum(const float* send, float* recv, std::int64_t recv_count) {
  check_count(recv_count, "reduce_scatter_sum");
  if (recv_count > 0 && send != recv) std::memmove(recv, send, sizeof(float) * std::size_t(recv_count));
}

void SingleProcessCommunicator::all_gather_bytes(const void* send, void* recv, std::int64_t bytes) {
  check_count(bytes, "all_gather");
  if (bytes > 0 && send != recv) std::memmove(recv, send, std::size_t(bytes));
}

void SingleProcessCommunicator::all_to_all_v(const void* send, const std::int64_t* send_counts,
                                             const std::int64_t* send_displs, void* recv,
                                             const std::int64_t* recv_counts, const std::int64_t* recv_displs,
                                             std::size_t elem_bytes) {
  check_count(send_counts[0], "all_to_all_v");
  check_count(recv_counts[0], "all_to_all_v");
  check_count(send_displs[0], "all_to_all_v");
  check_count(recv_displs[0], "all_to_all_v");
  if (send_counts[0] != recv_counts[0])
    throw CommError(fmt::format("all_to_all_v on single-process communicator '{}': sending {} elements to self "
                                "but expecting to receive {}",
                                name_, send_counts[0], recv_counts[0]));
  if (send_counts[0] == 0) return;
  std::memmove(static_cast<std::byte*>(recv) + recv_displs[0] * std::int64_t(elem_bytes),
               static_cast<const std::byte*>(send) + send_displs[0] * std::int64_t(elem_bytes),
               std::size_t(send_counts[0]) * elem_bytes);
}

void SingleProcessCommunicator::all_to_all(const std::int64_t* send, std::int64_t* recv, std::int64_t n) {
  check_count(n, "all_to_all");
  if (n > 0 && send != recv) std::memmove(recv, send, sizeof(std::int64_t) * std::size_t(n));
}

void SingleProcessCommunicator::all_to_all(const std::int32_t* send, std::int32_t* recv, std::int64_t n) {
  check_count(n, "all_to_all");
  if (n > 0 && send != recv) std::memmove(recv, send, sizeof(std::int32_t) * std::size_t(n));
}

void SingleProcessCommunicator::broadcast(void*, std::int64_t bytes, int root) {
  check_count(bytes, "broadcast");
  check_peer(root, "broadcast");
}

void SingleProcessCommunicator::deliver(PostedRecv& r, const std::vector<std::byte>& msg) const {
  r.done = true;
  r.got_bytes = std::int64_t(msg.size());
  if (r.got_bytes != r.bytes) {
    r.size_mismatch = true;
    return;
  }
  if (!msg.empty()) std::memcpy(r.data, msg.data(), msg.size());
}

void SingleProcessCommunicator::send(const void* data, std::int64_t bytes, int peer, int tag) {
  check_count(bytes, "send");
  check_peer(peer, "send");
  check_tag(tag, "send");
  std::vector<std::byte> msg(static_cast<std::size_t>(bytes));
  if (bytes > 0) std::memcpy(msg.data(), data, std::size_t(bytes));
  auto posted = posted_.find(tag);
  if (posted != posted_.end() && !posted->second.empty()) {
    // An irecv posted earlier matches first, as in MPI.
    std::shared_ptr<PostedRecv> r = posted->second.front();
    posted->second.pop_front();
    deliver(*r, msg);
    return;
  }
  queued_[tag].push_back(std::move(msg));
}

void SingleProcessCommunicator::recv(void* data, std::int64_t bytes, int peer, int tag) {
  check_count(bytes, "recv");
  check_peer(peer, "recv");
  check_tag(tag, "recv");
  auto q = queued_.find(tag);
  if (q == queued_.end() || q->second.empty())
    throw CommError(fmt::format("recv of {} bytes from self with tag {} on single-process communicator '{}' "
                                "would wait forever: no message with that tag was sent",
                                bytes, tag, name_));
  std::vector<std::byte> msg = std::move(q->second.front());
  q->second.pop_front();
  PostedRecv r{data, bytes};
  deliver(r, msg);
  if (r.size_mismatch)
    throw CommError(fmt::format("recv from self with tag {} on communicator '{}' expected {} bytes but the "
                                "message has {}",
                                tag, name_, bytes, r.got_bytes));
}

Request SingleProcessCommunicator::irecv(void* data, std::int64_t bytes, int peer, int tag) {
  check_count(bytes, "irecv");
  check_peer(peer, "irecv");
  check_tag(tag, "irecv");
  auto r = std::make_shared<PostedRecv>(PostedRecv{data, bytes});
  auto q = queued_.find(tag);
  if (q != queued_.end() && !q->second.empty()) {
    std::vector<std::byte> msg = std::move(q->second.front());
    q->second.pop_front();
    deliver(*r, msg);
  } else {
    posted_[tag].push_back(r);
  }
  return Request(std::make_unique<SelfRecv>(r, tag));
}

std::unique_ptr<Communicator> SingleProcessCommunicator::split(int color, int, const std::string& name) {
  if (color < 0) return nullptr;
  auto sub = std::make_unique<SingleProcessCommunicator>(name);
  sub->timeout_ = timeout_;
  return sub;
}

}  // namespace moeflex::comm
