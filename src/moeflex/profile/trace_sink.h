// Where the op profiler (op_profiler.h) sends the op events of a traced step: the
// part of a Chrome-trace writer it uses. The run's writer (train/trace.h,
// TraceWriter) implements it, so that profile/ needs nothing of train/.
#pragma once
#include <chrono>
#include <string_view>

#include <nlohmann/json.hpp>

namespace moeflex {

class TraceSink {
 public:
  virtual ~TraceSink() = default;
  /// False when the sink records nothing (its other calls are then no-ops).
  virtual bool enabled() const = 0;
  /// A steady-clock time point in microseconds since the trace's origin.
  virtual double to_us(std::chrono::steady_clock::time_point t) const = 0;
  /// A complete ("X") event: `name` ran on `track` from start_us for dur_us, with
  /// `args` (a JSON object) shown in the viewer.
  virtual void complete(std::string_view track, std::string_view name, double start_us, double dur_us,
                        const nlohmann::json& args) = 0;
};

}  // namespace moeflex
