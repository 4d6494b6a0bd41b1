// The step-plan validator (see validate.h): static checks first, then a
// virtual-time run for deadlocks. Messages are checked before data flow so that
// a lost Recv is reported as the unmatched Send it leaves behind.
#include "moeflex/schedule/validate.h"

#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "moeflex/schedule/simulate.h"

namespace moeflex {

namespace {

using MessageKey = std::tuple<bool, int, int>;  // (is_grad, microbatch, producing stage)

MessageKey key_of(const Action& a) { return {is_grad_message(a.kind), a.microbatch, a.stage}; }

std::string str(int v) { return std::to_string(v); }

// "rank 1 action 4 F(mb 0, stage 1)"
std::string where(const StepPlan& plan, int rank, int index) {
  return "rank " + str(rank) + " action " + str(index) + " " + to_string(plan.actions[rank][index]);
}

[[noreturn]] void fail(const std::string& what) { throw ScheduleError("invalid " + what); }

struct Place {
  int rank = -1;
  int index = -1;
  bool found() const { return rank >= 0; }
};

class Validator {
 public:
  explicit Validator(const StepPlan& plan) : plan_(plan) {}

  void run() {
    check_layout();
    check_actions();
    check_completeness();
    check_messages();
    check_data_flow();
    check_fifo();
    simulate(plan_);  // throws "deadlock: ..." when some rank cannot finish
  }

 private:
  const StepPlan& plan_;
  int m_ = 0, stages_ = 0, ranks_ = 0;
  // Per (micro-batch, stage): where its F, its input backward (B or Bi) and its
  // weight gradient (B or W) run.
  std::vector<std::vector<Place>> forward_, input_backward_, weight_;
  std::map<MessageKey, Place> send_, recv_;

  std::string plan_name() const { return plan_.schedule.empty() ? "plan" : plan_.schedule + " plan"; }

  void check_layout() {
    ranks_ = plan_.num_ranks;
    m_ = plan_.num_microbatches;
    stages_ = plan_.num_stages;
    if (ranks_ < 1 || m_ < 1 || stages_ < 1)
      fail(plan_name() + ": needs at least one rank, micro-batch and stage (has " + str(ranks_) + ", " + str(m_) +
           ", " + str(stages_) + ")");
    if (static_cast<int>(plan_.stage_rank.size()) != stages_)
      fail(plan_name() + ": stage_rank has " + str(static_cast<int>(plan_.stage_rank.size())) + " entries for " +
           str(stages_) + " stages");
    if (static_cast<int>(plan_.actions.size()) != ranks_)
      fail(plan_name() + ": " + str(static_cast<int>(plan_.actions.size())) + " action lists for " + str(ranks_) +
           " ranks");
    for (int s = 0; s < stages_; ++s)
      if (plan_.stage_rank[s] < 0 || plan_.stage_rank[s] >= ranks_)
        fail(plan_name() + ": stage " + str(s) + " is held by rank " + str(plan_.stage_rank[s]) + ", outside 0.." +
             str(ranks_ - 1));
  }

  // Ranges, ownership, peers, pairs; records where every action is.
  void check_actions() {
    forward_.assign(m_, std::vector<Place>(stages_));
    input_backward_.assign(m_, std::vector<Place>(stages_));
    weight_.assign(m_, std::vector<Place>(stages_));
    for (int r = 0; r < ranks_; ++r) {
      const std::vector<Action>& list = plan_.actions[r];
      for (int i = 0; i < static_cast<int>(list.size()); ++i) {
        const Action& a = list[i];
        if (a.microbatch < 0 || a.microbatch >= m_ || a.stage < 0 || a.stage >= stages_)
          fail(where(plan_, r, i) + ": micro-batch must be in 0.." + str(m_ - 1) + " and stage in 0.." +
               str(stages_ - 1));
        if (is_compute(a.kind)) {
          if (plan_.stage_rank[a.stage] != r)
            fail(where(plan_, r, i) + ": stage " + str(a.stage) + " is held by rank " +
                 str(plan_.stage_rank[a.stage]) + ", so its compute must run there");
          if (a.peer_rank != -1) fail(where(plan_, r, i) + ": a compute action has peer_rank -1");
          record_compute(a, r, i);
        } else {
          if (a.peer_rank < 0 || a.peer_rank >= ranks_ || a.peer_rank == r)
            fail(where(plan_, r, i) + ": the peer must be another rank in 0.." + str(ranks_ - 1));
          record_message(a, r, i);
        }
        if (a.overlapped_with_next &&
            (a.kind != ActionKind::Forward || i + 1 >= static_cast<int>(list.size()) ||
             !is_input_backward(list[i + 1].kind)))
          fail(where(plan_, r, i) +
               ": only a Forward followed by a Backward or BackwardInput can form an overlapped F&B pair");
        // The two halves of a pair run at once, so the backward cannot consume the
        // forward it is paired with.
        if (a.overlapped_with_next && list[i + 1].microbatch == a.microbatch && list[i + 1].stage == a.stage)
          fail(where(plan_, r, i) +
               ": an overlapped F&B pair runs its halves at once, so its backward cannot be "
               "the same micro-batch and stage as its forward");
      }
    }
  }

  void record_compute(const Action& a, int r, int i) {
    auto put = [&](std::vector<std::vector<Place>>& table, const std::string& what) {
      Place& place = table[a.microbatch][a.stage];
      if (place.found())
        fail(where(plan_, r, i) + ": micro-batch " + str(a.microbatch) + " at stage " + str(a.stage) +
             " already has " + what + " at " + where(plan_, place.rank, place.index));
      place = {r, i};
    };
    switch (a.kind) {
      case ActionKind::Forward: put(forward_, "a forward"); break;
      case ActionKind::Backward:
        put(input_backward_, "a backward");
        put(weight_, "a weight gradient");
        break;
      case ActionKind::BackwardInput: put(input_backward_, "a backward"); break;
      case ActionKind::BackwardWeight: put(weight_, "a weight gradient"); break;
      default: break;
    }
  }

  void record_message(const Action& a, int r, int i) {
    std::map<MessageKey, Place>& table = is_send(a.kind) ? send_ : recv_;
    const auto [it, fresh] = table.emplace(key_of(a), Place{r, i});
    if (!fresh)
      fail(where(plan_, r, i) + ": the same message is already " + (is_send(a.kind) ? "sent" : "received") +
           " at " + where(plan_, it->second.rank, it->second.index));
  }

  void check_completeness() {
    for (int mb = 0; mb < m_; ++mb)
      for (int s = 0; s < stages_; ++s) {
        const std::string item = plan_name() + ": micro-batch " + str(mb) + " at stage " + str(s);
        if (!forward_[mb][s].found()) fail(item + " has no forward F");
        if (!input_backward_[mb][s].found())
          fail(item + " has no backward (needs one B, or one Bi and one W)" +
               (weight_[mb][s].found() ? ", only " + where(plan_, weight_[mb][s].rank, weight_[mb][s].index) : ""));
        if (!weight_[mb][s].found())
          fail(item + " has a BackwardInput at " +
               where(plan_, input_backward_[mb][s].rank, input_backward_[mb][s].index) +
               " but no BackwardWeight W");
      }
  }

  // Where the message `key` is received; fails unless it is on `rank` before `index`.
  void require_recv_before(const MessageKey& key, int rank, int index, const std::string& what) {
    const auto found = recv_.find(key);
    if (found == recv_.end() || found->second.rank != rank)
      fail(where(plan_, rank, index) + " needs " + what + ", but rank " + str(rank) + " never receives it");
    if (found->second.index > index)
      fail(where(plan_, rank, index) + " needs " + what + ", which arrives only later at " +
           where(plan_, rank, found->second.index));
  }

  void require_before(const Place& first, const Place& then, const std::string& rule) {
    if (first.index > then.index)
      fail(where(plan_, then.rank, then.index) + " runs before " + where(plan_, first.rank, first.index) + " (" +
           rule + ")");
  }

  // F before B before W on the owner; F after the previous stage's F, B after
  // the next stage's B, locally or through a preceding Recv.
  void check_data_flow() {
    const int last = stages_ - 1;
    for (int mb = 0; mb < m_; ++mb)
      for (int s = 0; s < stages_; ++s) {
        const Place f = forward_[mb][s], b = input_backward_[mb][s], w = weight_[mb][s];
        require_before(f, b, "F before B");
        if (w.index != b.index) require_before(b, w, "B before W");
        const int r = f.rank;
        if (s > 0) {
          if (plan_.stage_rank[s - 1] == r)
            require_before(forward_[mb][s - 1], f, "F of stage " + str(s) + " after F of stage " + str(s - 1));
          else
            require_recv_before({false, mb, s - 1}, r, f.index,
                                "the activation of stage " + str(s - 1) + " from rank " +
                                    str(plan_.stage_rank[s - 1]));
        }
        if (s < last) {
          if (plan_.stage_rank[s + 1] == r)
            require_before(input_backward_[mb][s + 1], b,
                           "B of stage " + str(s) + " after B of stage " + str(s + 1));
          else
            require_recv_before({true, mb, s + 1}, r, b.index,
                                "the gradient of stage " + str(s + 1) + " from rank " +
                                    str(plan_.stage_rank[s + 1]));
        }
      }
  }

  // Each Send after its producer, to the consumer's rank, with one Recv there.
  void check_messages() {
    const int last = stages_ - 1;
    for (const auto& [key, place] : send_) {
      const auto& [grad, mb, s] = key;
      const Action& a = plan_.actions[place.rank][place.index];
      const std::string at = where(plan_, place.rank, place.index);
      const int consumer = grad ? s - 1 : s + 1;
      if (consumer < 0 || consumer > last)
        fail(at + ": stage " + str(s) + " has no " + (grad ? "previous" : "next") + " stage to send to");
      if (plan_.stage_rank[s] != place.rank)
        fail(at + ": the tensor is produced on rank " + str(plan_.stage_rank[s]) + ", not here");
      if (plan_.stage_rank[consumer] == place.rank)
        fail(at + ": stages " + str(s) + " and " + str(consumer) + " are both on rank " + str(place.rank) +
             ", so the hand-off is local and takes no send");
      if (a.peer_rank != plan_.stage_rank[consumer])
        fail(at + ": stage " + str(consumer) + " is on rank " + str(plan_.stage_rank[consumer]) + ", not rank " +
             str(a.peer_rank));
      const Place producer = grad ? input_backward_[mb][s] : forward_[mb][s];
      if (producer.index > place.index)
        fail(at + " sends before its tensor is produced by " + where(plan_, producer.rank, producer.index));
      const auto recv = recv_.find(key);
      if (recv == recv_.end())
        fail(at + " has no matching " + to_string(grad ? ActionKind::RecvGrad : ActionKind::RecvActivation) +
             " on rank " + str(a.peer_rank));
    }
    for (const auto& [key, place] : recv_) {
      const auto& [grad, mb, s] = key;
      const Action& a = plan_.actions[place.rank][place.index];
      const std::string at = where(plan_, place.rank, place.index);
      const int consumer = grad ? s - 1 : s + 1;
      if (consumer < 0 || consumer > last)
        fail(at + ": stage " + str(s) + " sends nothing " + (grad ? "backward" : "forward"));
      if (plan_.stage_rank[consumer] != place.rank)
        fail(at + ": the consumer, stage " + str(consumer) + ", is on rank " + str(plan_.stage_rank[consumer]));
      if (a.peer_rank != plan_.stage_rank[s])
        fail(at + ": stage " + str(s) + " is on rank " + str(plan_.stage_rank[s]) + ", not rank " +
             str(a.peer_rank));
      if (send_.find(key) == send_.end())
        fail(at + " has no matching " + to_string(grad ? ActionKind::SendGrad : ActionKind::SendActivation) +
             " on rank " + str(a.peer_rank));
    }
  }

  // Per ordered pair of ranks, sends and receives in the same order.
  void check_fifo() {
    std::vector<std::vector<std::vector<int>>> sent(ranks_, std::vector<std::vector<int>>(ranks_));
    for (int src = 0; src < ranks_; ++src)
      for (int i = 0; i < static_cast<int>(plan_.actions[src].size()); ++i)
        if (is_send(plan_.actions[src][i].kind)) sent[src][plan_.actions[src][i].peer_rank].push_back(i);
    for (int dst = 0; dst < ranks_; ++dst) {
      std::vector<size_t> next(ranks_, 0);
      for (int i = 0; i < static_cast<int>(plan_.actions[dst].size()); ++i) {
        const Action& a = plan_.actions[dst][i];
        if (!is_recv(a.kind)) continue;
        const int src = a.peer_rank;
        const size_t n = next[src]++;
        const int expected = sent[src][dst][n];  // counts match: every message is sent and received once
        if (key_of(plan_.actions[src][expected]) != key_of(a))
          fail(plan_name() + ": rank " + str(src) + " -> rank " + str(dst) + " is not FIFO: message " + str(n) +
               " sent is " + where(plan_, src, expected) + " but message " + str(n) + " received is " +
               where(plan_, dst, i) + " (executors that match by order would mix them up)");
      }
    }
  }
};

}  // namespace

void validate(const StepPlan& plan) { Validator(plan).run(); }

}  // namespace moeflex
