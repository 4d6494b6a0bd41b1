// The step-plan IR: names, printing, message identity and the placement of
// sends and receives around a compute order.
#include "moeflex/schedule/plan.h"

#include <map>
#include <sstream>
#include <tuple>

namespace moeflex {

bool is_compute(ActionKind kind) {
  return kind == ActionKind::Forward || kind == ActionKind::Backward ||
         kind == ActionKind::BackwardInput || kind == ActionKind::BackwardWeight;
}

bool is_input_backward(ActionKind kind) {
  return kind == ActionKind::Backward || kind == ActionKind::BackwardInput;
}

bool is_send(ActionKind kind) {
  return kind == ActionKind::SendActivation || kind == ActionKind::SendGrad;
}

bool is_recv(ActionKind kind) {
  return kind == ActionKind::RecvActivation || kind == ActionKind::RecvGrad;
}

bool is_grad_message(ActionKind kind) {
  return kind == ActionKind::SendGrad || kind == ActionKind::RecvGrad;
}

std::string to_string(ActionKind kind) {
  switch (kind) {
    case ActionKind::Forward: return "F";
    case ActionKind::Backward: return "B";
    case ActionKind::BackwardInput: return "Bi";
    case ActionKind::BackwardWeight: return "W";
    case ActionKind::SendActivation: return "sendA";
    case ActionKind::RecvActivation: return "recvA";
    case ActionKind::SendGrad: return "sendG";
    case ActionKind::RecvGrad: return "recvG";
  }
  return "?";
}

std::string to_string(const Action& a) {
  std::ostringstream out;
  out << to_string(a.kind) << "(mb " << a.microbatch << ", stage " << a.stage;
  if (is_send(a.kind)) out << ", to rank " << a.peer_rank;
  if (is_recv(a.kind)) out << ", from rank " << a.peer_rank;
  if (a.overlapped_with_next) out << ", overlapped with next";
  out << ")";
  return out.str();
}

int StepPlan::rank_of(int stage) const {
  if (stage < 0 || stage >= static_cast<int>(stage_rank.size()))
    throw ScheduleError("stage " + std::to_string(stage) + " is outside 0.." +
                        std::to_string(static_cast<int>(stage_rank.size()) - 1));
  return stage_rank[stage];
}

std::vector<int> StepPlan::stages_of(int rank) const {
  std::vector<int> out;
  for (int s = 0; s < static_cast<int>(stage_rank.size()); ++s)
    if (stage_rank[s] == rank) out.push_back(s);
  return out;
}

int StepPlan::chunk_of(int stage) const {
  const int rank = rank_of(stage);
  int chunk = 0;
  for (int s = 0; s < stage; ++s) chunk += stage_rank[s] == rank ? 1 : 0;
  return chunk;
}

std::string StepPlan::format_table(bool with_comm) const {
  std::ostringstream out;
  out << schedule << ": " << num_ranks << " ranks, " << num_microbatches << " micro-batches, "
      << num_stages << " stages\n";
  for (int r = 0; r < static_cast<int>(actions.size()); ++r) {
    const bool chunked = stages_of(r).size() > 1;
    out << "rank " << r << " |";
    bool joined = false;  // the previous token was the first half of a pair
    for (const Action& a : actions[r]) {
      if (!is_compute(a.kind) && !with_comm) continue;
      out << (joined ? "+" : " ");
      joined = false;
      if (is_compute(a.kind)) {
        out << to_string(a.kind) << a.microbatch;
        if (chunked) out << static_cast<char>('a' + chunk_of(a.stage));
        joined = a.overlapped_with_next;
      } else {
        // sA3:2>1 = send the activation of micro-batch 3, stage 2, to rank 1.
        out << (is_send(a.kind) ? "s" : "r") << (is_grad_message(a.kind) ? "G" : "A") << a.microbatch
            << ":" << a.stage << (is_send(a.kind) ? ">" : "<") << a.peer_rank;
      }
    }
    out << "\n";
  }
  return out.str();
}

std::string StepPlan::to_json() const {
  std::ostringstream out;
  out << "{\"schedule\":\"" << schedule << "\",\"num_ranks\":" << num_ranks
      << ",\"num_microbatches\":" << num_microbatches << ",\"num_stages\":" << num_stages
      << ",\"stage_rank\":[";
  for (size_t s = 0; s < stage_rank.size(); ++s) out << (s ? "," : "") << stage_rank[s];
  out << "],\"actions\":[";
  for (size_t r = 0; r < actions.size(); ++r) {
    out << (r ? "," : "") << "[";
    for (size_t i = 0; i < actions[r].size(); ++i) {
      const Action& a = actions[r][i];
      out << (i ? "," : "") << "{\"kind\":\"" << to_string(a.kind) << "\",\"mb\":" << a.microbatch
          << ",\"stage\":" << a.stage;
      if (!is_compute(a.kind)) out << ",\"peer\":" << a.peer_rank;
      if (a.overlapped_with_next) out << ",\"overlapped_with_next\":true";
      out << "}";
    }
    out << "]";
  }
  out << "]}";
  return out.str();
}

int message_tag(const StepPlan& plan, const Action& a) {
  return (a.microbatch * plan.num_stages + a.stage) * 2 + (is_grad_message(a.kind) ? 1 : 0);
}

int consumer_stage(const Action& a) {
  return is_grad_message(a.kind) ? a.stage - 1 : a.stage + 1;
}

namespace {

using MessageKey = std::tuple<bool, int, int>;  // (is_grad, microbatch, producing stage)

MessageKey key_of(const Action& a) { return {is_grad_message(a.kind), a.microbatch, a.stage}; }

// Every receiving rank takes each channel's messages in send order (see the
// header): a Recv met before an earlier-sent message of its channel pulls that
// message's Recv up in front of itself.
void make_channels_fifo(StepPlan& plan) {
  const int p = plan.num_ranks;
  // send_order[src][dst]: the channel's messages in the order src sends them.
  std::vector<std::vector<std::vector<Action>>> send_order(p, std::vector<std::vector<Action>>(p));
  std::vector<std::vector<std::map<MessageKey, int>>> position(p, std::vector<std::map<MessageKey, int>>(p));
  for (int src = 0; src < p; ++src)
    for (const Action& a : plan.actions[src])
      if (is_send(a.kind)) {
        auto& seq = send_order[src][a.peer_rank];
        position[src][a.peer_rank][key_of(a)] = static_cast<int>(seq.size());
        seq.push_back(a);
      }
  for (int dst = 0; dst < p; ++dst) {
    std::vector<Action> out;
    std::vector<int> next(p, 0);  // per source: messages [0, next) already received
    for (const Action& a : plan.actions[dst]) {
      if (!is_recv(a.kind)) {
        out.push_back(a);
        continue;
      }
      const int src = a.peer_rank;
      const auto found = position[src][dst].find(key_of(a));
      if (found == position[src][dst].end()) {  // never sent: left for validate() to report
        out.push_back(a);
        continue;
      }
      const int pos = found->second;
      if (pos < next[src]) continue;  // hoisted earlier
      for (int j = next[src]; j < pos; ++j) {
        Action hoisted = send_order[src][dst][j];
        hoisted.kind = is_grad_message(hoisted.kind) ? ActionKind::RecvGrad : ActionKind::RecvActivation;
        hoisted.peer_rank = src;
        out.push_back(hoisted);
      }
      out.push_back(a);
      next[src] = pos + 1;
    }
    plan.actions[dst] = std::move(out);
  }
}

}  // namespace

void insert_communication(StepPlan& plan) {
  if (static_cast<int>(plan.actions.size()) != plan.num_ranks ||
      static_cast<int>(plan.stage_rank.size()) != plan.num_stages)
    throw ScheduleError("insert_communication: the plan has " + std::to_string(plan.actions.size()) +
                        " action lists for " + std::to_string(plan.num_ranks) + " ranks and " +
                        std::to_string(plan.stage_rank.size()) + " stage owners for " +
                        std::to_string(plan.num_stages) + " stages");
  for (int s = 0; s < plan.num_stages; ++s)
    if (plan.stage_rank[s] < 0 || plan.stage_rank[s] >= plan.num_ranks)
      throw ScheduleError("insert_communication: stage " + std::to_string(s) + " is held by rank " +
                          std::to_string(plan.stage_rank[s]) + ", outside 0.." +
                          std::to_string(plan.num_ranks - 1));
  const int last = plan.num_stages - 1;
  for (int r = 0; r < static_cast<int>(plan.actions.size()); ++r) {
    const std::vector<Action>& in = plan.actions[r];
    std::vector<Action> out;
    for (size_t i = 0; i < in.size();) {
      const size_t unit = in[i].overlapped_with_next && i + 1 < in.size() ? 2 : 1;
      for (size_t j = i; j < i + unit; ++j) {
        const Action& a = in[j];
        if (!is_compute(a.kind))
          throw ScheduleError("insert_communication: rank " + std::to_string(r) +
                              " already holds a communication action " + to_string(a));
        const int s = a.stage;
        if (a.kind == ActionKind::Forward && s > 0 && plan.rank_of(s - 1) != r)
          out.push_back({ActionKind::RecvActivation, a.microbatch, s - 1, plan.rank_of(s - 1)});
        if (is_input_backward(a.kind) && s < last && plan.rank_of(s + 1) != r)
          out.push_back({ActionKind::RecvGrad, a.microbatch, s + 1, plan.rank_of(s + 1)});
      }
      for (size_t j = i; j < i + unit; ++j) out.push_back(in[j]);
      for (size_t j = i; j < i + unit; ++j) {
        const Action& a = in[j];
        const int s = a.stage;
        if (a.kind == ActionKind::Forward && s < last && plan.rank_of(s + 1) != r)
          out.push_back({ActionKind::SendActivation, a.microbatch, s, plan.rank_of(s + 1)});
        if (is_input_backward(a.kind) && s > 0 && plan.rank_of(s - 1) != r)
          out.push_back({ActionKind::SendGrad, a.microbatch, s, plan.rank_of(s - 1)});
      }
      i += unit;
    }
    plan.actions[r] = std::move(out);
  }
  make_channels_fifo(plan);
}

}  // namespace moeflex
