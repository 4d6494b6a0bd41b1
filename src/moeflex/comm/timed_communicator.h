// A Communicator that times every call of the one it wraps into the calling
// thread's PhaseClock (core/phase_clock.h), by kind: all-to-all, reductions and
// gathers, point-to-point. The trainer wraps its world communicator in one, so
// that every group split from it is timed too; the calls themselves are the
// wrapped communicator's, unchanged.
#pragma once
#include <memory>

#include "moeflex/comm/communicator.h"

namespace moeflex::comm {

/// Times `inner`'s calls (see the file comment); rank, size, name and timeout are
/// `inner`'s. split() returns a TimedCommunicator around the split of `inner`.
class TimedCommunicator final : public Communicator {
 public:
  explicit TimedCommunicator(std::unique_ptr<Communicator> inner);

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string backend() const override { return inner_->backend(); }
  int world_rank() const override { return inner_->world_rank(); }
  int world_rank_of(int r) const override { return inner_->world_rank_of(r); }

  void all_reduce_sum(float* data, std::int64_t n) override;
  void all_reduce_sum(double* data, std::int64_t n) override;
  void all_reduce_sum(std::int64_t* data, std::int64_t n) override;
  void all_reduce_max(double* data, std::int64_t n) override;
  void reduce_scatter_sum(const float* send, float* recv, std::int64_t recv_count) override;
  void all_gather_bytes(const void* send, void* recv, std::int64_t bytes) override;
  void all_to_all_v(const void* send, const std::int64_t* send_counts, const std::int64_t* send_displs, void* recv,
                    const std::int64_t* recv_counts, const std::int64_t* recv_displs, std::size_t elem_bytes) override;
  void all_to_all(const std::int64_t* send, std::int64_t* recv, std::int64_t n) override;
  void all_to_all(const std::int32_t* send, std::int32_t* recv, std::int64_t n) override;
  void broadcast(void* data, std::int64_t bytes, int root) override;
  void barrier() override;
  void send(const void* data, std::int64_t bytes, int peer, int tag) override;
  void recv(void* data, std::int64_t bytes, int peer, int tag) override;
  Request irecv(void* data, std::int64_t bytes, int peer, int tag) override;
  void flush_sends() override;
  std::unique_ptr<Communicator> split(int color, int key, const std::string& name) override;

 private:
  std::unique_ptr<Communicator> inner_;
};

}  // namespace moeflex::comm
