// A writer for the Chrome trace event format (JSON object form), which opens in
// Perfetto (ui.perfetto.dev) and chrome://tracing.
//
// One TraceWriter per process (MPI rank); its events carry pid = rank. Named
// tracks ("compute", "copy", "comm", ...) become threads of that process: each
// gets a tid, numbered 1, 2, ... in order of first use, announced once by
// "thread_name" / "thread_sort_index" metadata ("M") events. The file is
//
//   {"traceEvents":[
//   {"ph":"M","name":"process_name","pid":0,"tid":0,"args":{"name":"rank 0"}},
//   {"ph":"M","name":"thread_name","pid":0,"tid":1,"args":{"name":"compute"}},
//   {"ph":"X","name":"F mb3 s1","pid":0,"tid":1,"ts":12.5,"dur":80.25,"args":{}},
//   {"ph":"C","name":"device_memory","pid":0,"tid":0,"ts":13.0,"args":{"in_use":1048576,"budget":4194304}},
//   ...
//   ],"displayTimeUnit":"ms"}
//
// Times are microseconds (doubles, rounded to the nanosecond). now_us() reads a
// steady clock relative to the writer's origin (its construction, or the last
// reset_origin(), e.g. right after a barrier so that ranks line up).
//
// Events are buffered in memory. Every `flush_every` events, and at flush(),
// close() and destruction, the whole trace is rewritten to <path>.tmp, fsynced
// and renamed over <path>: the file on disk is always complete, valid JSON, and a
// crash leaves the last complete flush. All methods are thread-safe (one mutex),
// so a copy-engine worker thread may log alongside the compute thread. A
// disabled writer records nothing and never touches the disk; its calls are
// cheap no-ops (now_us() still works).
#pragma once
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "moeflex/profile/trace_sink.h"

namespace moeflex::train {

/// (A TraceSink, so that the op profiler can write its op events here.)
class TraceWriter : public TraceSink {
 public:
  /// Default number of buffered events between two flushes to disk.
  static constexpr std::size_t kDefaultFlushEvery = 8192;

  /// `pid` is the MPI rank. Nothing is written until the first flush. Throws
  /// ConfigError if enabled with an empty path or flush_every == 0.
  TraceWriter(std::filesystem::path path, int pid, bool enabled, std::size_t flush_every = kDefaultFlushEvery);
  /// Closes (final flush); an I/O error here is swallowed, call close() to see it.
  ~TraceWriter() override;
  TraceWriter(const TraceWriter&) = delete;
  TraceWriter& operator=(const TraceWriter&) = delete;

  bool enabled() const override { return enabled_; }
  int pid() const { return pid_; }
  const std::filesystem::path& path() const { return path_; }

  /// Microseconds since the origin (steady clock).
  double now_us() const;
  /// Moves the origin to now; later timestamps from now_us() start again at 0.
  void reset_origin();
  /// A steady-clock time point in microseconds since the origin (the time base of
  /// now_us()), e.g. for events timed on another thread such as the copy engine's.
  double to_us(std::chrono::steady_clock::time_point t) const override;

  /// A complete ("X") event: `name` ran on `track` from start_us for dur_us.
  /// `args` must be a JSON object or null (shown in the viewer's details pane).
  void complete(std::string_view track, std::string_view name, double start_us, double dur_us,
                const nlohmann::json& args = nlohmann::json::object()) override;
  /// An instant ("i") event on `track`, thread-scoped.
  void instant(std::string_view track, std::string_view name, double ts_us,
               const nlohmann::json& args = nlohmann::json::object());
  /// A counter ("C") sample: one track named `name` in the process, one series
  /// per key of `series`, e.g. counter("device_memory", t, {{"in_use", b}, {"budget", B}}).
  /// `series` must be a non-empty JSON object of numbers; throws Error otherwise.
  void counter(std::string_view name, double ts_us, const nlohmann::json& series);
  /// Renames this process in the viewer (default "rank <pid>").
  void set_process_name(std::string_view name);

  /// The tid of `track`, assigning one (and queueing its metadata) on first use.
  /// Returns 0 when disabled.
  int track_id(std::string_view track);

  /// RAII timer: records a complete event on `track` from its construction to
  /// end() or its destruction, whichever comes first. Movable, not copyable.
  class Span {
   public:
    Span() = default;
    Span(Span&& other) noexcept;
    Span& operator=(Span&& other) noexcept;
    Span(const Span&) = delete;
    Span& operator=(const Span&) = delete;
    ~Span();
    /// Adds an argument shown with the event (no-op on an inactive span).
    Span& arg(const std::string& key, nlohmann::json value);
    /// Ends the span now (only the first call records).
    void end() noexcept;
    bool active() const { return writer_ != nullptr; }

   private:
    friend class TraceWriter;
    Span(TraceWriter* writer, std::string track, std::string name, nlohmann::json args);
    TraceWriter* writer_ = nullptr;
    std::string track_;
    std::string name_;
    nlohmann::json args_;
    double start_us_ = 0;
  };
  /// Starts a Span; inactive (records nothing) when the writer is disabled.
  [[nodiscard]] Span span(std::string_view track, std::string_view name,
                          nlohmann::json args = nlohmann::json::object());

  /// Writes everything recorded so far to disk atomically (see file comment).
  /// Throws DataError on I/O failure. (The automatic flushes never throw from
  /// the recording calls: on failure the events stay buffered for the next
  /// flush.) No-op when disabled.
  void flush();
  /// Final flush; later events are dropped. Idempotent.
  void close();

  /// Events recorded so far, metadata included (0 when disabled).
  std::size_t event_count() const;

 private:
  using Clock = std::chrono::steady_clock;
  int track_id_locked(std::string_view track);
  void push_locked(const nlohmann::json& event);
  void flush_locked();

  std::filesystem::path path_;
  int pid_;
  bool enabled_;
  std::size_t flush_every_;
  std::atomic<Clock::rep> origin_;  ///< steady-clock ticks of the origin

  mutable std::mutex mu_;
  bool closed_ = false;
  std::map<std::string, int, std::less<>> tracks_;
  std::string flushed_;               ///< serialized events already on disk, ",\n"-joined
  std::vector<std::string> pending_;  ///< serialized events not yet on disk
  std::size_t count_ = 0;
};

/// <dir>/<stem>.rank<R><ext>: the per-rank file for a trace path, e.g.
/// run/trace.json -> run/trace.rank3.json.
std::filesystem::path rank_trace_path(const std::filesystem::path& trace_path, int rank);

/// Merges per-rank trace files into one trace at `out` (written atomically):
/// every event of every input is kept with its pid (the rank). Inputs may be in
/// the object form ({"traceEvents": [...]}) or the bare array form; an event
/// without a pid gets the input's index. Throws DataError naming the file if an
/// input is missing or not a trace, or if two inputs use the same pid.
void merge_traces(const std::vector<std::filesystem::path>& inputs, const std::filesystem::path& out);

}  // namespace moeflex::train
