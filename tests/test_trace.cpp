// The Chrome trace writer: valid JSON with the right events and fields, tracks
// as distinct threads, counters, thread safety, atomic flushes, rank merging.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "model_fixtures.h"
#include "moeflex/comm/layout.h"
#include "moeflex/core/arena.h"
#include "moeflex/core/error.h"
#include "moeflex/train/replica.h"
#include "moeflex/train/trace.h"

namespace fs = std::filesystem;
using moeflex::train::merge_traces;
using moeflex::train::rank_trace_path;
using moeflex::train::TraceWriter;
using nlohmann::json;

namespace {

class TraceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("moeflex_trace_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

json read_json(const fs::path& p) {
  std::ifstream in(p);
  EXPECT_TRUE(in.good()) << p;
  std::stringstream ss;
  ss << in.rdbuf();
  return json::parse(ss.str());  // throws (fails the test) on invalid JSON
}

std::vector<json> events_with(const json& doc, const std::string& ph) {
  std::vector<json> out;
  for (const json& e : doc.at("traceEvents"))
    if (e.at("ph") == ph) out.push_back(e);
  return out;
}

/// track name -> tid from the thread_name metadata of `pid`.
std::map<std::string, int> track_tids(const json& doc, int pid) {
  std::map<std::string, int> out;
  for (const json& e : events_with(doc, "M"))
    if (e.at("name") == "thread_name" && e.at("pid") == pid) {
      auto [it, fresh] = out.emplace(e.at("args").at("name").get<std::string>(), e.at("tid").get<int>());
      EXPECT_TRUE(fresh) << "thread_name emitted twice for " << e.dump();
    }
  return out;
}

}  // namespace

TEST_F(TraceTest, WritesValidChromeTraceWithAllEventKinds) {
  fs::path path = dir_ / "trace.json";
  {
    TraceWriter trace(path, 3, true);
    trace.complete("compute", "F mb0 s0", 10.0, 5.5, {{"tokens", 128}});
    trace.complete("copy", "offload L1", 12.0, 3.0);
    trace.complete("compute", "B mb0 s0", 16.0, 7.25, {{"layer", 1}, {"policy", "recompute"}});
    trace.complete("comm", "all-to-all", 20.0, 1.0);
    trace.counter("device_memory", 11.0, {{"in_use", 1048576}, {"budget", 4194304}});
    trace.counter("device_memory", 17.0, {{"in_use", 2097152}, {"budget", 4194304}});
    trace.instant("compute", "decision", 15.0, {{"choice", "offload"}});
    trace.close();
  }
  json doc = read_json(path);
  ASSERT_TRUE(doc.at("traceEvents").is_array());
  EXPECT_EQ(doc.at("displayTimeUnit"), "ms");

  // Metadata: the process named after the rank; one thread_name per track.
  bool process_named = false;
  for (const json& e : events_with(doc, "M"))
    if (e.at("name") == "process_name") {
      EXPECT_EQ(e.at("pid"), 3);
      EXPECT_EQ(e.at("args").at("name"), "rank 3");
      process_named = true;
    }
  EXPECT_TRUE(process_named);
  std::map<std::string, int> tids = track_tids(doc, 3);
  ASSERT_EQ(tids.size(), 3u);
  std::set<int> distinct{tids["compute"], tids["copy"], tids["comm"]};
  EXPECT_EQ(distinct.size(), 3u) << "tracks must map to distinct tids";
  EXPECT_EQ(distinct.count(0), 0u) << "tid 0 is reserved for the process";

  // Complete events carry every field.
  std::vector<json> xs = events_with(doc, "X");
  ASSERT_EQ(xs.size(), 4u);
  for (const json& e : xs)
    for (const char* key : {"ph", "ts", "dur", "pid", "tid", "name", "args"}) EXPECT_TRUE(e.contains(key)) << key << " in " << e.dump();
  EXPECT_EQ(xs[0].at("name"), "F mb0 s0");
  EXPECT_DOUBLE_EQ(xs[0].at("ts").get<double>(), 10.0);
  EXPECT_DOUBLE_EQ(xs[0].at("dur").get<double>(), 5.5);
  EXPECT_EQ(xs[0].at("pid"), 3);
  EXPECT_EQ(xs[0].at("tid"), tids["compute"]);
  EXPECT_EQ(xs[0].at("args").at("tokens"), 128);
  EXPECT_EQ(xs[1].at("tid"), tids["copy"]);
  EXPECT_TRUE(xs[1].at("args").is_object());
  EXPECT_EQ(xs[2].at("tid"), tids["compute"]);
  EXPECT_EQ(xs[2].at("args").at("policy"), "recompute");
  EXPECT_EQ(xs[3].at("tid"), tids["comm"]);

  // Counters carry their series values.
  std::vector<json> cs = events_with(doc, "C");
  ASSERT_EQ(cs.size(), 2u);
  EXPECT_EQ(cs[0].at("name"), "device_memory");
  EXPECT_EQ(cs[0].at("pid"), 3);
  EXPECT_DOUBLE_EQ(cs[0].at("ts").get<double>(), 11.0);
  EXPECT_EQ(cs[0].at("args").at("in_use"), 1048576);
  EXPECT_EQ(cs[0].at("args").at("budget"), 4194304);
  EXPECT_EQ(cs[1].at("args").at("in_use"), 2097152);

  // Instants are thread-scoped on their track.
  std::vector<json> is = events_with(doc, "i");
  ASSERT_EQ(is.size(), 1u);
  EXPECT_EQ(is[0].at("s"), "t");
  EXPECT_EQ(is[0].at("tid"), tids["compute"]);
  EXPECT_EQ(is[0].at("args").at("choice"), "offload");
}

TEST_F(TraceTest, SpanRecordsItsDurationAndArgs) {
  fs::path path = dir_ / "trace.json";
  TraceWriter trace(path, 0, true);
  double before = trace.now_us();
  {
    auto s = trace.span("compute", "F mb3 s1");
    s.arg("tokens", 42);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  auto early = trace.span("copy", "prefetch");
  early.end();
  early.end();  // only the first end records
  double after = trace.now_us();
  trace.close();

  std::vector<json> xs = events_with(read_json(path), "X");
  ASSERT_EQ(xs.size(), 2u);
  EXPECT_EQ(xs[0].at("name"), "F mb3 s1");
  EXPECT_GE(xs[0].at("ts").get<double>(), before - 0.001);
  EXPECT_GE(xs[0].at("dur").get<double>(), 1900.0);  // slept 2 ms
  EXPECT_LE(xs[0].at("ts").get<double>() + xs[0].at("dur").get<double>(), after + 0.001);
  EXPECT_EQ(xs[0].at("args").at("tokens"), 42);
  EXPECT_EQ(xs[1].at("name"), "prefetch");
}

TEST_F(TraceTest, NowIsMonotonicAndResettable) {
  TraceWriter trace(dir_ / "t.json", 0, false);
  double a = trace.now_us();
  std::this_thread::sleep_for(std::chrono::milliseconds(1));
  double b = trace.now_us();
  EXPECT_GE(a, 0.0);
  EXPECT_GT(b, a);
  trace.reset_origin();
  EXPECT_LT(trace.now_us(), b);
}

TEST_F(TraceTest, DisabledWriterWritesNothing) {
  fs::path path = dir_ / "trace.json";
  {
    TraceWriter trace(path, 0, false, 1);
    trace.complete("compute", "x", 0, 1);
    trace.counter("device_memory", 0, {{"in_use", 1}});
    { auto s = trace.span("compute", "y"); EXPECT_FALSE(s.active()); }
    trace.flush();
    trace.close();
    EXPECT_EQ(trace.event_count(), 0u);
    EXPECT_EQ(trace.track_id("compute"), 0);
  }
  EXPECT_FALSE(fs::exists(path));
  EXPECT_TRUE(fs::is_empty(dir_));
}

TEST_F(TraceTest, RejectsBadCounterAndArgs) {
  TraceWriter trace(dir_ / "trace.json", 0, true);
  EXPECT_THROW(trace.counter("mem", 0, json::object()), moeflex::Error);
  EXPECT_THROW(trace.counter("mem", 0, {{"in_use", "lots"}}), moeflex::Error);
  EXPECT_THROW(trace.counter("mem", 0, json::array({1, 2})), moeflex::Error);
  EXPECT_THROW(trace.complete("compute", "x", 0, 1, json::array({1})), moeflex::Error);
  EXPECT_THROW(TraceWriter(fs::path(), 0, true), moeflex::ConfigError);
}

TEST_F(TraceTest, ConcurrentThreadsLoseNothing) {
  fs::path path = dir_ / "trace.json";
  constexpr int kThreads = 4;
  constexpr int kPerThread = 5000;
  {
    // A small flush interval so that automatic flushes race with the loggers.
    TraceWriter trace(path, 1, true, 777);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t)
      threads.emplace_back([&trace, t] {
        std::string track = t % 2 == 0 ? "compute" : "copy";
        for (int i = 0; i < kPerThread; ++i) {
          if (i % 10 == 0) {
            trace.counter("device_memory", trace.now_us(), {{"in_use", t * kPerThread + i}});
          } else {
            auto s = trace.span(track, "op");
            s.arg("thread", t).arg("i", i);
          }
        }
      });
    for (auto& th : threads) th.join();
  }  // the destructor flushes
  json doc = read_json(path);
  std::vector<json> xs = events_with(doc, "X");
  std::vector<json> cs = events_with(doc, "C");
  EXPECT_EQ(xs.size() + cs.size(), static_cast<std::size_t>(kThreads * kPerThread));
  EXPECT_EQ(cs.size(), static_cast<std::size_t>(kThreads * kPerThread / 10));
  std::set<std::pair<int, int>> seen;
  for (const json& e : xs) seen.emplace(e.at("args").at("thread").get<int>(), e.at("args").at("i").get<int>());
  EXPECT_EQ(seen.size(), xs.size()) << "every event is present exactly once";
  std::map<std::string, int> tids = track_tids(doc, 1);
  EXPECT_EQ(tids.size(), 2u);
  for (const json& e : xs) {
    int t = e.at("args").at("thread").get<int>();
    EXPECT_EQ(e.at("tid"), tids[t % 2 == 0 ? "compute" : "copy"]);
  }
}

TEST_F(TraceTest, PeriodicFlushLeavesValidJsonOnDisk) {
  fs::path path = dir_ / "trace.json";
  TraceWriter trace(path, 0, true, 10);
  // Before any flush nothing is on disk.
  trace.complete("compute", "a", 0, 1);
  EXPECT_FALSE(fs::exists(path));
  for (int i = 1; i < 30; ++i) trace.complete("compute", "a", i, 1);
  // Without close(), the file is the last complete flush: valid JSON, a prefix of the events.
  ASSERT_TRUE(fs::exists(path));
  json doc = read_json(path);
  std::size_t on_disk = events_with(doc, "X").size();
  EXPECT_GT(on_disk, 0u);
  EXPECT_LE(on_disk, 30u);
  for (const auto& entry : fs::directory_iterator(dir_))
    EXPECT_EQ(entry.path().filename(), "trace.json") << "no temporary file is left behind";
  trace.flush();
  EXPECT_EQ(events_with(read_json(path), "X").size(), 30u);
  trace.close();
  trace.complete("compute", "after close", 100, 1);  // dropped
  trace.close();
  EXPECT_EQ(events_with(read_json(path), "X").size(), 30u);
}

TEST_F(TraceTest, CreatesParentDirectories) {
  fs::path path = dir_ / "run" / "nested" / "trace.json";
  {
    TraceWriter trace(path, 0, true);
    trace.complete("compute", "a", 0, 1);
  }
  EXPECT_EQ(events_with(read_json(path), "X").size(), 1u);
}

TEST_F(TraceTest, RankTracePath) {
  EXPECT_EQ(rank_trace_path("run/trace.json", 3), fs::path("run/trace.rank3.json"));
  EXPECT_EQ(rank_trace_path("trace.json", 0), fs::path("trace.rank0.json"));
}

TEST_F(TraceTest, MergeKeepsAllEventsWithPids) {
  constexpr int kRanks = 3;
  std::vector<fs::path> inputs;
  std::size_t total = 0;
  for (int r = 0; r < kRanks; ++r) {
    fs::path p = rank_trace_path(dir_ / "trace.json", r);
    TraceWriter trace(p, r, true);
    for (int i = 0; i <= r; ++i) trace.complete("compute", "F mb" + std::to_string(i), 10.0 * i, 5.0, {{"rank", r}});
    trace.complete("copy", "offload", 1.0, 2.0, {{"rank", r}});
    trace.counter("device_memory", 1.0, {{"in_use", 1000 * (r + 1)}});
    trace.close();
    total += events_with(read_json(p), "M").size() + events_with(read_json(p), "X").size() +
             events_with(read_json(p), "C").size();
    inputs.push_back(p);
  }
  fs::path merged = dir_ / "trace.json";
  merge_traces(inputs, merged);
  json doc = read_json(merged);
  EXPECT_EQ(doc.at("displayTimeUnit"), "ms");
  EXPECT_EQ(doc.at("traceEvents").size(), total);
  std::map<int, int> x_per_pid;
  for (const json& e : events_with(doc, "X")) {
    EXPECT_EQ(e.at("pid"), e.at("args").at("rank"));
    ++x_per_pid[e.at("pid").get<int>()];
  }
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(x_per_pid[r], r + 2) << "rank " << r;
    EXPECT_EQ(track_tids(doc, r).size(), 2u);
  }
  std::vector<json> cs = events_with(doc, "C");
  ASSERT_EQ(cs.size(), static_cast<std::size_t>(kRanks));
  for (const json& c : cs) EXPECT_EQ(c.at("args").at("in_use"), 1000 * (c.at("pid").get<int>() + 1));
}

TEST_F(TraceTest, MergeAcceptsArrayFormAndAssignsMissingPids) {
  fs::path a = dir_ / "a.json", b = dir_ / "b.json";
  std::ofstream(a) << R"([{"ph":"X","name":"x","ts":0,"dur":1,"tid":1}])";
  std::ofstream(b) << R"({"traceEvents":[{"ph":"X","name":"y","ts":0,"dur":1,"tid":1,"pid":7}]})";
  merge_traces({a, b}, dir_ / "out.json");
  json doc = read_json(dir_ / "out.json");
  ASSERT_EQ(doc.at("traceEvents").size(), 2u);
  EXPECT_EQ(doc["traceEvents"][0]["pid"], 0);
  EXPECT_EQ(doc["traceEvents"][1]["pid"], 7);
}

TEST_F(TraceTest, MergeRejectsBadInputs) {
  fs::path good = dir_ / "good.json", dup = dir_ / "dup.json", bad = dir_ / "bad.json", notrace = dir_ / "no.json";
  {
    TraceWriter t1(good, 0, true);
    TraceWriter t2(dup, 0, true);
  }
  std::ofstream(bad) << "{\"traceEvents\":[";
  std::ofstream(notrace) << R"({"events":[]})";
  EXPECT_THROW(merge_traces({good, dup}, dir_ / "out.json"), moeflex::DataError);
  EXPECT_THROW(merge_traces({good, bad}, dir_ / "out.json"), moeflex::DataError);
  EXPECT_THROW(merge_traces({good, notrace}, dir_ / "out.json"), moeflex::DataError);
  EXPECT_THROW(merge_traces({good, dir_ / "missing.json"}, dir_ / "out.json"), moeflex::DataError);
  EXPECT_FALSE(fs::exists(dir_ / "out.json"));
}

// Every activation offloaded: the copy engine's copies (offloads to host memory,
// prefetches back) appear on their own "copy" track, with positive durations and
// the ledger's exact byte counts. Phase 1 is a step through the pipeline executor
// (as the trainer runs it): every offload is traced, inside the step's compute
// span; an activation read back before its offload landed needs no prefetch, so
// prefetches are at most one per offload. Phase 2 waits for the offloads to land
// between forward and backward (stash().sync()), so every activation must come
// back through exactly one prefetch.
TEST_F(TraceTest, OffloadCopiesFormACopyTrackWithTheirBytes) {
  using namespace moeflex;
  const ModelConfig cfg = test::small_moe_config(2, 0, 4, false);
  const std::int64_t M = 2, B = 2, S = 8, n = B * S;
  auto world = comm::make_world_communicator();
  comm::LayoutSpec spec;
  spec.num_layers = int(cfg.num_hidden_layers);
  spec.num_experts = int(cfg.num_experts);
  const comm::ParallelLayout layout(spec);
  comm::ParallelGroups groups = comm::make_groups(*world, layout);
  Arena arena;
  Replica replica(cfg, "1f1b", layout, groups, arena, M, B, S);
  replica.init_weights(5);
  ASSERT_EQ(replica.chunks().size(), 1u);
  MoEModel& model = *replica.chunks().front();
  std::map<std::string, Bytes> ledger;  // "L<layer> <name> mb<mb>" -> bytes, as the policy saw them
  model.stash().set_policy([&ledger](const LedgerEntry& e) {
    ledger[fmt::format("L{} {} mb{}", e.layer, e.name, e.microbatch)] = e.bytes;
    return Provision::offload;
  });
  const int kPhase2Microbatch = 7;
  const fs::path path = dir_ / "trace.json";
  Bytes offloaded_step = 0, offloaded_synced = 0;
  {
    TraceWriter trace(path, 0, true);
    replica.set_trace(&trace);
    replica.zero_grads();
    replica.forward_backward([&](int mb, std::int32_t* ids, std::int32_t* tg) {
      test::skewed_batch(mb, n, cfg.vocab_size, ids, tg);
    });
    offloaded_step = model.stash().counters().offloaded;
    model.stash().reset_counters();
    std::vector<std::int32_t> ids(static_cast<std::size_t>(n)), tg(static_cast<std::size_t>(n));
    test::skewed_batch(kPhase2Microbatch, n, cfg.vocab_size, ids.data(), tg.data());
    model.forward_train(ids.data(), tg.data(), B, S, kPhase2Microbatch);
    model.stash().sync();  // every offload has landed: the device copies are gone
    model.backward(ids.data(), tg.data(), B, S, kPhase2Microbatch, 1.0);
    offloaded_synced = model.stash().counters().offloaded;
    replica.set_trace(nullptr);
    trace.close();
  }
  ASSERT_GT(offloaded_step, 0);
  ASSERT_GT(offloaded_synced, 0);

  const json doc = read_json(path);
  const auto tids = track_tids(doc, 0);
  ASSERT_TRUE(tids.count("copy")) << "no copy track";
  ASSERT_TRUE(tids.count("compute"));
  EXPECT_NE(tids.at("copy"), tids.at("compute"));
  double compute_start = 1e300, compute_end = 0;
  for (const json& e : events_with(doc, "X"))
    if (e.at("tid") == tids.at("compute")) {
      compute_start = std::min(compute_start, e.at("ts").get<double>());
      compute_end = std::max(compute_end, e.at("ts").get<double>() + e.at("dur").get<double>());
    }
  struct Totals {
    Bytes d2h = 0, h2d = 0;
    std::map<std::string, int> offloads, prefetches;
  } step, synced;
  const std::string phase2 = fmt::format(" mb{}", kPhase2Microbatch);
  for (const json& e : events_with(doc, "X")) {
    if (e.at("tid") != tids.at("copy")) continue;
    const std::string name = e.at("name");
    const Bytes bytes = e.at("args").at("bytes");
    EXPECT_GT(e.at("dur").get<double>(), 0.0) << name;
    const bool off = name.rfind("offload ", 0) == 0, pre = name.rfind("prefetch ", 0) == 0;
    ASSERT_TRUE(off || pre) << name;
    const std::string key = name.substr(off ? 8 : 9);
    ASSERT_TRUE(ledger.count(key)) << name;
    EXPECT_EQ(bytes, ledger.at(key)) << name;  // the ledger's exact bytes
    const bool in_phase2 = key.size() > phase2.size() && key.compare(key.size() - phase2.size(), phase2.size(), phase2) == 0;
    Totals& t = in_phase2 ? synced : step;
    (off ? t.d2h : t.h2d) += bytes;
    ++(off ? t.offloads : t.prefetches)[key];
    if (!in_phase2) {  // copies of the executor's step happen inside its compute span
      EXPECT_GE(e.at("ts").get<double>(), compute_start) << name;
      EXPECT_LE(e.at("ts").get<double>() + e.at("dur").get<double>(), compute_end) << name;
    }
  }
  std::size_t phase2_entries = 0;
  for (auto& [key, bytes] : ledger) phase2_entries += key.find(phase2) != std::string::npos;
  // Phase 1: every offload traced once; prefetches only of offloaded keys, at most once.
  EXPECT_EQ(step.d2h, offloaded_step);
  EXPECT_EQ(step.offloads.size(), ledger.size() - phase2_entries);
  EXPECT_LE(step.h2d, step.d2h);
  for (auto& [key, k] : step.offloads) EXPECT_EQ(k, 1) << key;
  for (auto& [key, k] : step.prefetches) {
    EXPECT_EQ(k, 1) << key;
    EXPECT_TRUE(step.offloads.count(key)) << key;
  }
  // Phase 2: every activation went out and came back, once each.
  EXPECT_EQ(synced.d2h, offloaded_synced);
  EXPECT_EQ(synced.h2d, offloaded_synced);
  EXPECT_EQ(synced.offloads.size(), phase2_entries);
  for (auto& [key, k] : synced.offloads) {
    EXPECT_EQ(k, 1) << key;
    EXPECT_EQ(synced.prefetches[key], 1) << key;
  }
}
