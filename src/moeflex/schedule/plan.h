// The step plan: for each rank, the ordered actions of one training step
// (DESIGN.md "One plan, three consumers"). The executor (train/), the simulator
// (sim/) and the search all consume this table; the generators in generators.h
// produce it and validate.h checks it.
//
// Stages and ranks. The model is cut into `num_stages` stages (model chunks),
// numbered in data-flow order 0..num_stages-1; `stage_rank[s]` is the rank that
// holds stage s. A rank may hold several stages (interleaved 1F1B: stage
// chunk*p + rank; DualPipeV: stages r and 2p-1-r). A rank's k-th stage in
// ascending order is its chunk k.
//
// Messages. Stage s's forward output goes to stage s+1 and the gradient of
// stage s's input goes back to stage s-1. When both stages live on one rank the
// hand-off is local and no message exists. Otherwise the producing rank has a
// Send and the consuming rank a Recv carrying the same (kind, micro-batch,
// stage), where `stage` is always the *producing* stage (s for an activation
// s -> s+1, s for a gradient s -> s-1). That triple identifies the message; see
// message_tag().
//
// Communication semantics (what validate() assumes and the executor must give):
// a Send never blocks (MPI_Isend, buffers completed by the end of the step); a
// Recv blocks until its message has arrived. Between two ranks the messages of
// each direction are received in the order they were sent, so an executor may
// match them by tag (MPI) or by order (NCCL, untagged MPI) alike.
#pragma once
#include <string>
#include <vector>

#include "moeflex/core/error.h"

namespace moeflex {

/// A malformed, inconsistent or deadlocking step plan; the message names the
/// rank, the action and the rule.
class ScheduleError : public Error {
 public:
  using Error::Error;
};

/// What one entry of a rank's action list does.
enum class ActionKind {
  Forward,         ///< F: forward of one micro-batch through one stage
  Backward,        ///< B+W fused: input and weight gradients together
  BackwardInput,   ///< B: input gradient only (zero-bubble split); W follows later
  BackwardWeight,  ///< W: weight gradient of an earlier BackwardInput
  SendActivation,  ///< send F's output of (mb, stage) to the rank of stage+1
  RecvActivation,  ///< receive F's output of (mb, stage) from the rank of stage
  SendGrad,        ///< send the input gradient of (mb, stage) to the rank of stage-1
  RecvGrad,        ///< receive the input gradient of (mb, stage) from the rank of stage
};

/// One entry of a rank's action list.
struct Action {
  ActionKind kind = ActionKind::Forward;
  int microbatch = 0;  ///< micro-batch index within the step, 0..num_microbatches-1
  int stage = 0;       ///< global stage; for send/recv the stage that produced the tensor
  int peer_rank = -1;  ///< the other rank of a send/recv; -1 for compute actions
  /// DualPipe's overlapped F&B: this Forward runs overlapped with the next action
  /// of the list (a Backward or BackwardInput of another micro-batch and stage);
  /// the pair starts when both inputs are in and the sends of both follow it.
  bool overlapped_with_next = false;

  bool operator==(const Action&) const = default;
};

/// F, B, B-input or W.
bool is_compute(ActionKind kind);
/// Backward or BackwardInput: the action that produces the input gradient.
bool is_input_backward(ActionKind kind);
bool is_send(ActionKind kind);
bool is_recv(ActionKind kind);
/// SendGrad / RecvGrad (as opposed to the activation messages).
bool is_grad_message(ActionKind kind);

/// "F", "B", "Bi", "W", "sendA", "recvA", "sendG", "recvG".
std::string to_string(ActionKind kind);
/// e.g. "F(mb 3, stage 2)", "recvA(mb 3, stage 1, from rank 0)".
std::string to_string(const Action& action);

/// Per rank, the ordered actions of one training step.
struct StepPlan {
  std::string schedule;                     ///< generator name, e.g. "1f1b"
  int num_ranks = 0;                        ///< pipeline ranks (p)
  int num_microbatches = 0;                 ///< micro-batches per step (m)
  int num_stages = 0;                       ///< model chunks in data-flow order
  std::vector<int> stage_rank;              ///< stage -> rank that holds it
  std::vector<std::vector<Action>> actions; ///< per rank, in execution order

  /// The rank that holds `stage`.
  int rank_of(int stage) const;
  /// The stages held by `rank`, ascending (index = chunk id).
  std::vector<int> stages_of(int rank) const;
  /// The local chunk id of `stage` on its rank.
  int chunk_of(int stage) const;

  /// One line per rank of compute actions, DualPipe-figure style: "F3" is the
  /// forward of micro-batch 3; a chunk letter follows when a rank holds several
  /// stages ("F3a", "B3b"); "Bi"/"W" are the split backward; "F3a+B1b" is an
  /// overlapped pair. With `with_comm`, sends and receives are listed too.
  std::string format_table(bool with_comm = false) const;
  /// The whole plan as JSON (hand-written; no library).
  std::string to_json() const;
};

/// The message a send or receive carries, as a unique MPI tag:
/// (microbatch * num_stages + stage) * 2 + is_grad. It stays within the
/// standard's guaranteed MPI_TAG_UB (32767) while 2 * m * num_stages <= 32768.
int message_tag(const StepPlan& plan, const Action& send_or_recv);

/// The stage that consumes what a send/recv carries (stage+1 or stage-1).
int consumer_stage(const Action& send_or_recv);

/// Turns a compute-only plan (F/B/Bi/W per rank) into a complete one: a Recv
/// goes right before the compute action (or overlapped pair) that needs a tensor
/// from another rank, a Send right after the action (or pair) that produced it.
/// Then, where a receiver would take two messages of one channel in the other
/// order than they were sent, the later-needed Recv is hoisted to just before
/// the other, so every channel is FIFO. Hoisting never adds waiting: the
/// receiver was about to wait for a message sent after the hoisted one.
/// Throws ScheduleError if `plan` already holds communication actions.
void insert_communication(StepPlan& plan);

}  // namespace moeflex
