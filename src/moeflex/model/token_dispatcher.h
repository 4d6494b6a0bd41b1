// Expert-parallel token dispatch and combine with all-to-all-v (Megatron's
// AlltoAll token dispatcher, reduced to what moeflex needs).
//
// EP ranks hold contiguous slices of E / ep experts. Each rank permutes its
// tokens' assignments into global-expert order (so rows for EP rank r are one
// contiguous block), exchanges per-expert row counts, and sends every block to
// its expert rank. Received rows arrive source-major ([src][local expert]); the
// grouped GEMM wants expert-major ([local expert][src]), so dispatch reorders
// them, and combine does the inverse and sends the rows back.
// The backward of dispatch is combine and vice versa (same data movement).
#pragma once
#include <cstdint>
#include <vector>

#include "moeflex/comm/communicator.h"
#include "moeflex/core/tensor.h"

namespace moeflex {

/// Row counts of one (micro-batch, layer) dispatch; kept for the backward.
struct DispatchLayout {
  std::vector<std::int64_t> send_rows;     ///< [ep] rows sent to each EP rank
  std::vector<std::int64_t> recv_rows;     ///< [ep] rows received from each EP rank
  std::vector<std::int64_t> recv_counts;   ///< [ep * E_local] rows from src q for local expert le
  std::vector<std::int32_t> local_offsets; ///< [E_local + 1] expert-major offsets of received rows
  std::int64_t rows_sent = 0;              ///< R_send
  std::int64_t rows_received = 0;          ///< R_recv
};

class TokenDispatcher {
 public:
  /// ep_group: the expert-parallel group (null or size 1: no communication).
  /// num_experts: E, divisible by the group size.
  TokenDispatcher(comm::Communicator* ep_group, std::int64_t num_experts);

  bool active() const { return ep_size_ > 1; }
  int ep_size() const { return ep_size_; }
  int ep_rank() const { return ep_rank_; }
  std::int64_t local_experts() const { return e_local_; }
  std::int64_t first_expert() const { return std::int64_t(ep_rank_) * e_local_; }

  /// Exchanges counts. counts: [E] rows kept per global expert on this rank.
  DispatchLayout plan(const std::int32_t* counts) const;
  /// xp [rows_sent, d] in global-expert order -> xe [rows_received, d] expert-major.
  /// scratch: [rows_received, d]. Host memory; all three of one dtype (f32 or bf16:
  /// rows travel as they are), else Error.
  void dispatch(const DispatchLayout& L, CView xp, View xe, std::int64_t d, View scratch) const;
  /// ye [rows_received, d] expert-major -> yp [rows_sent, d] in global-expert order.
  /// scratch: [rows_received, d]; dtypes as for dispatch.
  void combine(const DispatchLayout& L, CView ye, View yp, std::int64_t d, View scratch) const;

 private:
  comm::Communicator* group_;
  int ep_size_ = 1, ep_rank_ = 0;
  std::int64_t e_local_;
};

}  // namespace moeflex
