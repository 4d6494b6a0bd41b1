// The size-1 communicator: collectives are identities or copies, and messages to
// self go through an in-process queue with MPI's matching rules (per tag, in send
// order; a posted irecv is matched before the queue grows).
#pragma once
#include <deque>
#include <map>

#include "moeflex/comm/communicator.h"

namespace moeflex::comm {

class SingleProcessCommunicator final : public Communicator {
 public:
  explicit SingleProcessCommunicator(std::string name = "world");
  ~SingleProcessCommunicator() override;

  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string backend() const override { return "single"; }
  int world_rank() const override { return 0; }
  int world_rank_of(int r) const override { return r; }

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
  void barrier() override {}

  /// Queues a copy; throws CommError if peer != 0.
  void send(const void* data, std::int64_t bytes, int peer, int tag) override;
  /// Takes the oldest queued message with `tag`; throws CommError when there is
  /// none (in one process it could never arrive) or its size differs.
  void recv(void* data, std::int64_t bytes, int peer, int tag) override;
  /// Matches a queued message now, or the next send() with `tag`; wait() throws
  /// CommError if neither happened.
  Request irecv(void* data, std::int64_t bytes, int peer, int tag) override;
  void flush_sends() override {}

  std::unique_ptr<Communicator> split(int color, int key, const std::string& name) override;

 private:
  struct PostedRecv {
    void* data;
    std::int64_t bytes;
    bool done = false;
    bool size_mismatch = false;
    std::int64_t got_bytes = 0;
  };
  class SelfRecv;

  void deliver(PostedRecv& r, const std::vector<std::byte>& msg) const;

  std::map<int, std::deque<std::vector<std::byte>>> queued_;          // tag -> messages
  std::map<int, std::deque<std::shared_ptr<PostedRecv>>> posted_;     // tag -> irecvs
};

}  // namespace moeflex::comm
