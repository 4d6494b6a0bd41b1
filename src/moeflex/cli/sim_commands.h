// `moeflex simulate` and `moeflex search`: their flags and what they run.
#pragma once
#include <CLI/CLI.hpp>

namespace moeflex {

/// A flag check: a finite number >= 0 (CLI::NonNegativeNumber lets nan and inf
/// through, which would print as nan throughput).
CLI::Validator finite_non_negative();

/// Registers the two subcommands on `app`; run_sim_commands() runs whichever was
/// given and returns true then (false when neither was). Errors are moeflex::Error.
void add_sim_commands(CLI::App& app);
bool run_sim_commands();

}  // namespace moeflex
