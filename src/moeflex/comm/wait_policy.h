// How a rank waits for a message (MpiCommunicator::wait), shared with the
// simulator, which prices what the waiting costs the ranks that compute
// (sim::CoreSharing).
//
// A wait first spins kSpinPolls MPI_Test calls (small messages arrive within
// them). Then, with a core for each process, it yields the core until it has
// waited kYieldPhase, and sleeps after that: naps of a fiftieth of the time
// waited so far, in [20 us, 1 ms]. On an oversubscribed node
// (comm::host_oversubscribed: more processes than cores) it skips the yield phase,
// which would keep it runnable, and naps longer, a twentieth of the time waited
// in [100 us, 1 ms]: every nap costs a core 20-30 us here (its system call, two
// context switches and the caches the computing rank refills; the hardware
// profile's nap_cost_s, HardwareProfile::nap_cost), taken from a rank that computes. dp4-ep4 of
// bench/sim_check.sh on 2 cores: 1.33 -> 1.31 s per step with these naps instead
// of the others (medians of 3 pairs; 2-8% in an earlier set with 200 us).
#pragma once
#include <algorithm>

#include "moeflex/core/units.h"

namespace moeflex::comm {

/// MPI_Test calls before a wait first yields or sleeps.
inline constexpr int kSpinPolls = 200;
/// With a core per process: how long a wait yields the core before it sleeps.
inline constexpr Seconds kYieldPhase = 2e-3;
inline constexpr Seconds kMaxPollSleep = 1e-3;
inline constexpr Seconds kMinPollSleep = 20e-6;
inline constexpr double kPollSleepDivisor = 50;
inline constexpr Seconds kMinPollSleepOversubscribed = 100e-6;
inline constexpr double kPollSleepDivisorOversubscribed = 20;

/// The nap a wait takes after `waited` seconds (past its spin and yield phases):
/// waited / divisor clamped to [min, kMaxPollSleep], with the oversubscribed
/// node's divisor and minimum when `oversubscribed`.
inline Seconds poll_nap_seconds(Seconds waited, bool oversubscribed) {
  return oversubscribed
             ? std::clamp(waited / kPollSleepDivisorOversubscribed, kMinPollSleepOversubscribed, kMaxPollSleep)
             : std::clamp(waited / kPollSleepDivisor, kMinPollSleep, kMaxPollSleep);
}

}  // namespace moeflex::comm
