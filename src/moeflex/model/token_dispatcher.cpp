#include "moeflex/model/token_dispatcher.h"

#include <fmt/format.h>

#include <cstring>

#include "moeflex/core/error.h"

namespace moeflex {

TokenDispatcher::TokenDispatcher(comm::Communicator* ep_group, std::int64_t num_experts)
    : group_(ep_group), e_local_(num_experts) {
  if (group_) {
    ep_size_ = group_->size();
    ep_rank_ = group_->rank();
  }
  if (num_experts % ep_size_ != 0)
    throw ConfigError(fmt::format("model.num_experts = {} is not divisible by expert parallelism {}", num_experts,
                                  ep_size_));
  e_local_ = num_experts / ep_size_;
}

DispatchLayout TokenDispatcher::plan(const std::int32_t* counts) const {
  const int P = ep_size_;
  DispatchLayout L;
  std::vector<std::int64_t> send(std::size_t(P * e_local_));
  for (std::int64_t e = 0; e < P * e_local_; ++e) send[std::size_t(e)] = counts[e];
  L.recv_counts.assign(std::size_t(P * e_local_), 0);
  if (active()) group_->all_to_all(send.data(), L.recv_counts.data(), e_local_);
  else L.recv_counts = send;
  L.send_rows.assign(std::size_t(P), 0);
  L.recv_rows.assign(std::size_t(P), 0);
  L.local_offsets.assign(std::size_t(e_local_ + 1), 0);
  for (int q = 0; q < P; ++q)
    for (std::int64_t le = 0; le < e_local_; ++le) {
      L.send_rows[std::size_t(q)] += send[std::size_t(q * e_local_ + le)];
      L.recv_rows[std::size_t(q)] += L.recv_counts[std::size_t(q * e_local_ + le)];
      L.local_offsets[std::size_t(le + 1)] += std::int32_t(L.recv_counts[std::size_t(q * e_local_ + le)]);
    }
  for (std::int64_t le = 0; le < e_local_; ++le) L.local_offsets[std::size_t(le + 1)] += L.local_offsets[std::size_t(le)];
  for (int q = 0; q < P; ++q) {
    L.rows_sent += L.send_rows[std::size_t(q)];
    L.rows_received += L.recv_rows[std::size_t(q)];
  }
  return L;
}

namespace {

// Moves row blocks between source-major ([q][le]) and expert-major ([le][q]) order.
// Rows are `row` bytes. The blocks of source `self` (this rank's rows for its own
// experts, which never cross the network) are read from `self_src` (to expert-major)
// or written to `self_dst` (to source-major) instead, where they lie in the same [le]
// order: the exchange leaves them out, so they are copied once, here, not also by MPI.
void reorder(const DispatchLayout& L, int P, std::int64_t E_local, const void* in_rows, void* out_rows, Bytes row,
             bool to_expert_major, int self, const void* self_src, void* self_dst) {
  const char* in = static_cast<const char*>(in_rows);
  char* out = static_cast<char*>(out_rows);
  const char* own_src = static_cast<const char*>(self_src);
  char* own_dst = static_cast<char*>(self_dst);
  std::vector<std::int64_t> src_off(std::size_t(P * E_local)), exp_off(std::size_t(P * E_local));
  std::int64_t o = 0;
  for (int q = 0; q < P; ++q)
    for (std::int64_t le = 0; le < E_local; ++le) {
      src_off[std::size_t(q * E_local + le)] = o;
      o += L.recv_counts[std::size_t(q * E_local + le)];
    }
  o = 0;
  for (std::int64_t le = 0; le < E_local; ++le)
    for (int q = 0; q < P; ++q) {
      exp_off[std::size_t(q * E_local + le)] = o;
      o += L.recv_counts[std::size_t(q * E_local + le)];
    }
  const std::int64_t self_first = src_off[std::size_t(self * E_local)];
  const std::int64_t blocks = P * E_local;
#pragma omp parallel for schedule(static)
  for (std::int64_t b = 0; b < blocks; ++b) {
    const std::int64_t rows = L.recv_counts[std::size_t(b)];
    const bool mine = b / E_local == self;
    const std::int64_t src = mine ? src_off[std::size_t(b)] - self_first : src_off[std::size_t(b)];
    if (to_expert_major)
      std::memcpy(out + exp_off[std::size_t(b)] * row, (mine ? own_src : in) + src * row, std::size_t(rows * row));
    else
      std::memcpy((mine ? own_dst : out) + src * row, in + exp_off[std::size_t(b)] * row, std::size_t(rows * row));
  }
}

std::vector<std::int64_t> displs(const std::vector<std::int64_t>& counts) {
  std::vector<std::int64_t> d(counts.size(), 0);
  for (std::size_t i = 1; i < counts.size(); ++i) d[i] = d[i - 1] + counts[i - 1];
  return d;
}

}  // namespace

/// The common element type of a dispatch's or combine's tensors (their element size).
static Bytes element_size(CView in, View out, View scratch) {
  if (in.dtype != out.dtype || (scratch && scratch.dtype != in.dtype))
    throw Error(fmt::format("token dispatcher: tensors of mixed dtypes ({}, {}, {})", to_string(in.dtype),
                            to_string(out.dtype), to_string(scratch.dtype)));
  return dtype_size(in.dtype);
}

void TokenDispatcher::dispatch(const DispatchLayout& L, CView xp, View xe, std::int64_t d, View scratch) const {
  const Bytes es = element_size(xp, xe, scratch);
  if (!active()) {
    std::memcpy(xe.data, xp.data, std::size_t(es * L.rows_sent * d));
    return;
  }
  std::vector<std::int64_t> sc(L.send_rows), rc(L.recv_rows);
  for (auto& c : sc) c *= d;
  for (auto& c : rc) c *= d;
  const auto sd = displs(sc), rd = displs(rc);
  // This rank's rows for its own experts stay out of the exchange: reorder takes them from xp.
  const std::size_t self = std::size_t(ep_rank_);
  sc[self] = rc[self] = 0;
  group_->all_to_all_v(xp.data, sc.data(), sd.data(), scratch.data, rc.data(), rd.data(), std::size_t(es));
  reorder(L, ep_size_, e_local_, scratch.data, xe.data, es * d, /*to_expert_major=*/true, ep_rank_,
          static_cast<const char*>(xp.data) + sd[self] * es, nullptr);
}

void TokenDispatcher::combine(const DispatchLayout& L, CView ye, View yp, std::int64_t d, View scratch) const {
  const Bytes es = element_size(ye, yp, scratch);
  if (!active()) {
    std::memcpy(yp.data, ye.data, std::size_t(es * L.rows_received * d));
    return;
  }
  std::vector<std::int64_t> sc(L.recv_rows), rc(L.send_rows);
  for (auto& c : sc) c *= d;
  for (auto& c : rc) c *= d;
  const auto sd = displs(sc), rd = displs(rc);
  // This rank's own experts' rows go straight to their place in yp, not through the exchange.
  const std::size_t self = std::size_t(ep_rank_);
  reorder(L, ep_size_, e_local_, ye.data, scratch.data, es * d, /*to_expert_major=*/false, ep_rank_, nullptr,
          static_cast<char*>(yp.data) + rd[self] * es);
  sc[self] = rc[self] = 0;
  group_->all_to_all_v(scratch.data, sc.data(), sd.data(), yp.data, rc.data(), rd.data(), std::size_t(es));
}

}  // namespace moeflex
