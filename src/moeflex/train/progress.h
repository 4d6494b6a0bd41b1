// The progress line of a training run on stderr: a bar on a terminal, periodic log
// lines otherwise, and notes between them.
#pragma once
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>

#include "moeflex/core/units.h"

namespace moeflex::run {


/// The progress line: a bar on a terminal, periodic log lines otherwise.
class Progress {
 public:
  Progress(bool enabled, std::int64_t total) : enabled_(enabled), total_(total), tty_(isatty(fileno(stderr))) {}
  /// `provisioned_steps`: steps of the run so far that recomputed or offloaded anything.
  /// `val`: the last validation loss, evaluated after step `val_step` (0: before training).
  void update(std::int64_t step, double loss, double val, std::int64_t val_step, double tps, Bytes peak, Bytes budget,
              double recomputed, double offloaded, std::int64_t provisioned_steps) {
    if (!enabled_) return;
    const int width = 24;
    const int filled = int(double(width) * double(step) / double(std::max<std::int64_t>(total_, 1)));
    std::string bar(std::size_t(filled), '=');
    bar.resize(std::size_t(width), ' ');
    std::string line = fmt::format(
        "step {:>5}/{} [{}] loss {:.4f} | val {} | {:.0f} tok/s | mem {} / {} | recomp {:.0f}% offl {:.0f}% "
        "(on {} step{} so far)",
        step, total_, bar, loss, std::isnan(val) ? std::string("-") : fmt::format("{:.4f} @{}", val, val_step), tps,
        format_bytes(peak), format_bytes(budget), 100.0 * recomputed, 100.0 * offloaded, provisioned_steps,
        provisioned_steps == 1 ? "" : "s");
    if (tty_) {
      fmt::print(stderr, "\r{}\x1b[K", line);
      if (step == total_) fmt::print(stderr, "\n");
    } else if (step == 1 || step == total_ || step % std::max<std::int64_t>(1, total_ / 20) == 0) {
      fmt::print(stderr, "{}\n", line);
    }
    std::fflush(stderr);
  }
  void note(const std::string& msg) {
    if (!enabled_) return;
    fmt::print(stderr, "{}{}\n", tty_ ? "\r\x1b[K" : "", msg);
  }

 private:
  bool enabled_;
  std::int64_t total_;
  bool tty_;
};

}  // namespace moeflex::run
