#include "moeflex/train/trace.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fmt/format.h>
#include <map>
#include <set>
#include <utility>

#include "moeflex/core/error.h"
#include "moeflex/train/safetensors.h"

namespace moeflex::train {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr std::string_view kHeader = "{\"traceEvents\":[\n";
constexpr std::string_view kFooter = "\n],\"displayTimeUnit\":\"ms\"}\n";
constexpr std::string_view kSeparator = ",\n";

/// Microseconds rounded to the nanosecond, so the JSON stays short.
double round_us(double us) { return std::round(us * 1000.0) / 1000.0; }

std::string errno_text() { return std::strerror(errno); }

/// Writes the concatenation of `parts` to `path` atomically: a temporary file in
/// the same directory, fsync, rename over `path`, fsync of the directory.
void write_parts_atomically(const fs::path& path, std::initializer_list<std::string_view> parts) {
  static std::atomic<unsigned> counter{0};
  fs::path dir = path.parent_path();
  if (!dir.empty()) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) throw DataError(fmt::format("Cannot create directory '{}' for '{}': {}.", dir.string(), path.string(), ec.message()));
  }
  fs::path tmp = path;
  tmp += fmt::format(".tmp-{}-{}", ::getpid(), counter++);
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw DataError(fmt::format("Cannot create '{}' to write '{}': {}.", tmp.string(), path.string(), errno_text()));
  auto fail = [&](const std::string& what) {
    std::string why = errno_text();
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    throw DataError(fmt::format("{} '{}' failed: {}.", what, tmp.string(), why));
  };
  for (std::string_view part : parts) {
    const char* p = part.data();
    std::size_t left = part.size();
    while (left > 0) {
      ssize_t n = ::write(fd, p, left);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) fail("Writing");
      p += n;
      left -= static_cast<std::size_t>(n);
    }
  }
  if (::fsync(fd) != 0) fail("fsync of");
  int rc = ::close(fd);
  fd = -1;
  if (rc != 0) fail("Closing");
  if (::rename(tmp.c_str(), path.c_str()) != 0) fail(fmt::format("Renaming to '{}' of", path.string()));
  fsync_directory(dir.empty() ? fs::path(".") : dir);
}

}  // namespace

// ---- TraceWriter ----

TraceWriter::TraceWriter(fs::path path, int pid, bool enabled, std::size_t flush_every)
    : path_(std::move(path)), pid_(pid), enabled_(enabled), flush_every_(flush_every), origin_(Clock::now().time_since_epoch().count()) {
  if (!enabled_) return;
  check_config(!path_.empty(), "The trace is enabled but its path is empty.");
  check_config(flush_every_ > 0, "The trace's flush interval must be at least 1 event.");
  std::lock_guard lock(mu_);
  push_locked(json{{"ph", "M"}, {"name", "process_name"}, {"pid", pid_}, {"tid", 0},
                   {"args", {{"name", fmt::format("rank {}", pid_)}}}});
  push_locked(json{{"ph", "M"}, {"name", "process_sort_index"}, {"pid", pid_}, {"tid", 0},
                   {"args", {{"sort_index", pid_}}}});
}

TraceWriter::~TraceWriter() {
  try {
    close();
  } catch (...) {
    // A destructor must not throw; close() explicitly to see I/O errors.
  }
}

double TraceWriter::now_us() const {
  Clock::duration d = Clock::now().time_since_epoch() - Clock::duration(origin_.load(std::memory_order_relaxed));
  return std::chrono::duration<double, std::micro>(d).count();
}

double TraceWriter::to_us(std::chrono::steady_clock::time_point t) const {
  Clock::duration d = t.time_since_epoch() - Clock::duration(origin_.load(std::memory_order_relaxed));
  return std::chrono::duration<double, std::micro>(d).count();
}

void TraceWriter::reset_origin() {
  origin_.store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
}

int TraceWriter::track_id(std::string_view track) {
  if (!enabled_) return 0;
  std::lock_guard lock(mu_);
  return track_id_locked(track);
}

int TraceWriter::track_id_locked(std::string_view track) {
  auto it = tracks_.find(track);
  if (it != tracks_.end()) return it->second;
  int tid = static_cast<int>(tracks_.size()) + 1;  // tid 0 is the process itself (counters, metadata)
  tracks_.emplace(std::string(track), tid);
  push_locked(json{{"ph", "M"}, {"name", "thread_name"}, {"pid", pid_}, {"tid", tid}, {"args", {{"name", track}}}});
  push_locked(json{{"ph", "M"}, {"name", "thread_sort_index"}, {"pid", pid_}, {"tid", tid}, {"args", {{"sort_index", tid}}}});
  return tid;
}

void TraceWriter::push_locked(const json& event) {
  if (closed_) return;
  pending_.push_back(event.dump());
  ++count_;
  if (pending_.size() >= flush_every_) {
    // Recording calls must not throw on a disk problem (a copy-engine thread
    // logs too): the events stay buffered, and the next flush()/close() writes
    // them or reports the error.
    try {
      flush_locked();
    } catch (const std::exception&) {
    }
  }
}

void TraceWriter::complete(std::string_view track, std::string_view name, double start_us, double dur_us,
                           const json& args) {
  if (!enabled_) return;
  if (!args.is_null() && !args.is_object())
    throw Error(fmt::format("Trace event '{}': args must be a JSON object, not {}.", name, args.dump()));
  json event{{"ph", "X"}, {"name", name}, {"pid", pid_}, {"tid", 0}, {"ts", round_us(start_us)},
             {"dur", round_us(std::max(0.0, dur_us))}, {"args", args.is_null() ? json::object() : args}};
  std::lock_guard lock(mu_);
  if (closed_) return;
  event["tid"] = track_id_locked(track);
  push_locked(event);
}

void TraceWriter::instant(std::string_view track, std::string_view name, double ts_us, const json& args) {
  if (!enabled_) return;
  if (!args.is_null() && !args.is_object())
    throw Error(fmt::format("Trace event '{}': args must be a JSON object, not {}.", name, args.dump()));
  json event{{"ph", "i"}, {"s", "t"}, {"name", name}, {"pid", pid_}, {"tid", 0}, {"ts", round_us(ts_us)},
             {"args", args.is_null() ? json::object() : args}};
  std::lock_guard lock(mu_);
  if (closed_) return;
  event["tid"] = track_id_locked(track);
  push_locked(event);
}

void TraceWriter::counter(std::string_view name, double ts_us, const json& series) {
  if (!enabled_) return;
  if (!series.is_object() || series.empty())
    throw Error(fmt::format("Trace counter '{}': series must be a non-empty JSON object, not {}.", name,
                            series.dump()));
  for (const auto& [key, value] : series.items())
    if (!value.is_number())
      throw Error(fmt::format("Trace counter '{}': series '{}' must be a number, not {}.", name, key, value.dump()));
  json event{{"ph", "C"}, {"name", name}, {"pid", pid_}, {"tid", 0}, {"ts", round_us(ts_us)}, {"args", series}};
  std::lock_guard lock(mu_);
  push_locked(event);
}

void TraceWriter::set_process_name(std::string_view name) {
  if (!enabled_) return;
  std::lock_guard lock(mu_);
  push_locked(json{{"ph", "M"}, {"name", "process_name"}, {"pid", pid_}, {"tid", 0}, {"args", {{"name", name}}}});
}

TraceWriter::Span TraceWriter::span(std::string_view track, std::string_view name, json args) {
  if (!enabled_) return Span();
  return Span(this, std::string(track), std::string(name), std::move(args));
}

void TraceWriter::flush() {
  if (!enabled_) return;
  std::lock_guard lock(mu_);
  flush_locked();
}

void TraceWriter::flush_locked() {
  // The body on disk only ever grows, so it is kept serialized and the new
  // events are appended to it; the file is then rewritten whole.
  for (std::string& e : pending_) {
    if (!flushed_.empty()) flushed_ += kSeparator;
    flushed_ += e;
  }
  pending_.clear();
  write_parts_atomically(path_, {kHeader, flushed_, kFooter});
}

void TraceWriter::close() {
  if (!enabled_) return;
  std::lock_guard lock(mu_);
  if (closed_) return;
  closed_ = true;
  flush_locked();
  std::string().swap(flushed_);
}

std::size_t TraceWriter::event_count() const {
  std::lock_guard lock(mu_);
  return count_;
}

// ---- Span ----

TraceWriter::Span::Span(TraceWriter* writer, std::string track, std::string name, json args)
    : writer_(writer), track_(std::move(track)), name_(std::move(name)), args_(std::move(args)),
      start_us_(writer->now_us()) {}

TraceWriter::Span::Span(Span&& other) noexcept
    : writer_(std::exchange(other.writer_, nullptr)), track_(std::move(other.track_)), name_(std::move(other.name_)),
      args_(std::move(other.args_)), start_us_(other.start_us_) {}

TraceWriter::Span& TraceWriter::Span::operator=(Span&& other) noexcept {
  if (this != &other) {
    end();
    writer_ = std::exchange(other.writer_, nullptr);
    track_ = std::move(other.track_);
    name_ = std::move(other.name_);
    args_ = std::move(other.args_);
    start_us_ = other.start_us_;
  }
  return *this;
}

TraceWriter::Span::~Span() { end(); }

TraceWriter::Span& TraceWriter::Span::arg(const std::string& key, json value) {
  if (writer_) {
    if (!args_.is_object()) args_ = json::object();
    args_[key] = std::move(value);
  }
  return *this;
}

void TraceWriter::Span::end() noexcept {
  TraceWriter* w = std::exchange(writer_, nullptr);
  if (!w) return;
  try {
    double stop = w->now_us();
    w->complete(track_, name_, start_us_, stop - start_us_, args_);
  } catch (...) {
    // Tracing must never take the run down (e.g. from a destructor during unwinding).
  }
}

// ---- Files ----

fs::path rank_trace_path(const fs::path& trace_path, int rank) {
  fs::path out = trace_path.parent_path();
  out /= fmt::format("{}.rank{}{}", trace_path.stem().string(), rank, trace_path.extension().string());
  return out;
}

void merge_traces(const std::vector<fs::path>& inputs, const fs::path& out) {
  std::string body;
  std::map<std::int64_t, fs::path> pid_owner;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const fs::path& in = inputs[i];
    std::vector<char> bytes = read_file_bytes(in);
    json doc = json::parse(bytes.begin(), bytes.end(), nullptr, /*allow_exceptions=*/false);
    if (doc.is_discarded())
      throw DataError(fmt::format("Trace '{}' is not valid JSON.", in.string()));
    const json* events = nullptr;
    if (doc.is_array()) {
      events = &doc;
    } else if (doc.is_object() && doc.contains("traceEvents") && doc["traceEvents"].is_array()) {
      events = &doc["traceEvents"];
    } else {
      throw DataError(fmt::format("'{}' is not a Chrome trace: expected an object with a \"traceEvents\" array, or an array.",
                                  in.string()));
    }
    std::set<std::int64_t> pids;
    for (const json& e : *events) {
      if (!e.is_object())
        throw DataError(fmt::format("Trace '{}' holds an event that is not a JSON object: {}.", in.string(), e.dump()));
      if (e.contains("pid") && e["pid"].is_number_integer()) {
        pids.insert(e["pid"].get<std::int64_t>());
      } else {
        pids.insert(static_cast<std::int64_t>(i));
      }
    }
    for (std::int64_t pid : pids) {
      auto [it, fresh] = pid_owner.emplace(pid, in);
      if (!fresh)
        throw DataError(fmt::format("Traces '{}' and '{}' both use pid {}: each rank must write its own pid.",
                                    it->second.string(), in.string(), pid));
    }
    for (const json& e : *events) {
      if (!body.empty()) body += kSeparator;
      if (e.contains("pid") && e["pid"].is_number_integer()) {
        body += e.dump();
      } else {
        json copy = e;
        copy["pid"] = static_cast<std::int64_t>(i);
        body += copy.dump();
      }
    }
  }
  write_parts_atomically(out, {kHeader, body, kFooter});
}

}  // namespace moeflex::train
