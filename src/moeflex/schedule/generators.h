// Pipeline schedule generators (STYLE habit 9): each is written as explicit
// phases with closed-form counts (warm-up / steady / cool-down, or DualPipe's
// Steps 1..8) and ends with a closing invariant. Each returns a complete plan
// (compute order plus the sends and receives of insert_communication()) that
// passes validate(). docs/schedules.md has the table of schedules, bubbles and
// sources.
//
// p = pipeline ranks, m = micro-batches per step, v = model chunks per rank.
// Bad arguments throw ConfigError naming the argument and the rule.
#pragma once
#include <string>
#include <vector>

#include "moeflex/schedule/plan.h"

namespace moeflex {

/// GPipe (Huang et al. 2019): every rank runs all forwards, then all backwards
/// (fused B+W), both in micro-batch order. One stage per rank.
StepPlan gpipe(int p, int m);

/// Megatron's non-interleaved 1F1B (Narayanan et al. 2021, PipeDream-Flush):
/// rank r runs min(p-r-1, m) warm-up forwards, then one-forward-one-backward,
/// then the remaining backwards. At most p-r micro-batches in flight on rank r.
StepPlan one_f_one_b(int p, int m);

/// Megatron's interleaved 1F1B (Narayanan et al. 2021, section 2.2): rank r
/// holds stages r, r+p, ..., r+(v-1)p. Forwards walk (micro-batch group of p,
/// chunk) in Megatron's order; warm-up is (p-r-1)*2 + (v-1)*p forwards (all of
/// them when m == p). Requires m % p == 0, as Megatron does.
StepPlan interleaved_1f1b(int p, int m, int v);

/// Megatron-Core's combined 1F1B, "1F1B A2A overlap"
/// (--overlap-moe-expert-parallel-comm; megatron/core/pipeline_parallel/
/// combined_1f1b.py), registered as "1f1b-overlap": the interleaved order above
/// with one more warm-up forward per rank, and each steady-state forward flagged
/// overlapped_with_next with the backward of another micro-batch that follows
/// it, so that one's expert all-to-alls can hide under the other's compute (the
/// simulator's overlap_pair_comm; the engine runs the pair back to back). With
/// p = 1 it is Megatron's combined_1f1b_schedule_for_no_pipelining: F0, then
/// (F(i+1), B(i)) pairs, then the last B. Up to one more micro-batch in flight
/// than interleaved. Requires m % p == 0.
StepPlan combined_1f1b(int p, int m, int v);

/// ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 3.1): the
/// F/B order of 1F1B with the backward split into B (input gradient) and W
/// (weight gradient); rank r defers its W by r micro-batches so that the
/// deferred Ws fill the cool-down bubble. Micro-batches between F and B stay
/// those of 1F1B (p-r on rank r); between F and W every rank holds min(p, m),
/// the first rank's 1F1B peak.
StepPlan zb_h1(int p, int m);

/// DualPipeV (DeepSeek's "cut-in-half" DualPipe, deepseek-ai/DualPipe
/// dualpipev.py): p ranks hold 2p stages in a V, rank r holding stages r and
/// 2p-1-r; rank 0 computes the loss on stage 2p-1. Steps 1..8 of dualpipev.py
/// with their counts; an overlapped F&B chunk is a Forward flagged
/// overlapped_with_next followed by its Backward. Requires m >= 2p.
StepPlan dualpipev(int p, int m);

/// The names `--schedule` accepts: gpipe, 1f1b, interleaved, 1f1b-overlap, zb-h1,
/// dualpipev.
const std::vector<std::string>& schedule_names();

/// Throws ConfigError unless `name` is one of schedule_names(), listing them.
void require_known_schedule(const std::string& name);

/// Whether `name` holds --vpp model chunks per rank (interleaved, 1f1b-overlap);
/// the others hold one (DualPipeV's two are implied).
bool schedule_takes_vpp(const std::string& name);

/// The generator named `name`; `v` (chunks per rank) is used by "interleaved"
/// and "1f1b-overlap" and must be 1 for the others (DualPipeV's two chunks per rank are implied).
/// Throws ConfigError on an unknown name, listing the known ones.
StepPlan make_schedule(const std::string& name, int p, int m, int v = 1);

}  // namespace moeflex
