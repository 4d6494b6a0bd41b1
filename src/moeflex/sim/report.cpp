// The simulation's report (simulator.h): SimReport as JSON and as the human-readable
// table, the Chrome trace of the traced ranks (chrome_trace), and write_outputs
// (summary.json and trace.json, whole or not at all).
#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <map>

#include "moeflex/core/error.h"
#include "moeflex/sim/simulation.h"

namespace moeflex::sim {

using nlohmann::json;

json SimReport::to_json() const {
  json ranks_j = json::array();
  for (const auto& r : ranks)
    ranks_j.push_back({{"pp_rank", r.pp_rank}, {"persistent_bytes", r.persistent_bytes}, {"peak_bytes", r.peak_bytes},
                       {"peak_balanced_bytes", r.peak_balanced_bytes}, {"dp_rank_peak_bytes", r.dp_rank_peak_bytes},
                       {"busy_s", r.busy}, {"comm_s", r.comm}, {"idle_s", r.idle}});
  json j = {{"model_params", options.model.num_params()},
            {"model_active_params", options.model.num_active_params()},
            {"cluster", options.cluster.name},
            {"hardware_profile", options.cluster.profile.name},
            {"parallel", options.parallel.str()},
            {"world_size", options.parallel.world()},
            {"schedule", options.schedule},
            {"dispatcher", options.dispatcher},
            {"policy", options.policy},
            {"micro_batch_size", options.micro_batch_size},
            {"seq_len", options.seq_len},
            {"num_microbatches", num_microbatches},
            {"global_batch", std::int64_t(num_microbatches) * options.parallel.dp * options.micro_batch_size},
            {"iterations", options.iterations},
            {"loads", options.loads.describe()},
            {"stage_layers", stage_layers},
            {"step_time_s", step_time},
            {"step_time_max_s", step_time_max},
            {"dp_reduce_s", dp_reduce_time},
            {"optimizer_s", optimizer_time},
            {"bubble_fraction", bubble_fraction},
            {"exposed_comm_s", exposed_comm},
            {"recompute_s", recompute_time},
            {"mfu", mfu},
            {"tgs", tgs},
            {"ooms", ooms},
            {"lost_iterations", lost_iterations},
            {"restart_s", restart_time},
            {"restart_seconds_each", options.restart_seconds},
            {"checkpoint_interval", options.checkpoint_interval},
            {"effective_tgs", effective_tgs},
            {"effective_mfu", effective_mfu},
            {"memory_limit_bytes", memory_limit},
            {"peak_bytes", peak_bytes},
            {"spike_peak_bytes", spike_peak_bytes},
            {"note", note},
            {"ranks", ranks_j},
            {"simulation_wall_s", wall_seconds}};
  if (!ops.empty()) {
    json o = json::array();
    for (const auto& [key, t] : ops)
      o.push_back({{"phase", key.first}, {"kind", key.second}, {"count", t.count}, {"seconds", t.seconds}});
    j["ops"] = o;
  }
  if (!adaptive_level_histogram.empty()) {
    json h;
    for (std::size_t i = 0; i < adaptive_level_histogram.size(); ++i) h[adaptive_levels()[i]] = adaptive_level_histogram[i];
    j["adaptive_levels"] = h;
  }
  return j;
}

std::string SimReport::format() const {
  const double GiB = double(kGiB);
  std::string s = fmt::format(
      "{} params ({}, {} active) on {} x {} (priced by {}) [{}], schedule {}, policy {}\n"
      "micro-batch {} x {} tokens, {} micro-batches, {} iteration(s); loads {}\n\n",
      options.model.num_params(), format_count(double(options.model.num_params())),
      format_count(double(options.model.num_active_params())), options.parallel.world(), options.cluster.name,
      options.cluster.profile.name, options.parallel.str(), options.schedule, options.policy, options.micro_batch_size,
      options.seq_len, num_microbatches, options.iterations, options.loads.describe());
  s += fmt::format("{:>7} {:>10} {:>12} {:>14} {:>10} {:>10} {:>10}\n", "pp rank", "layers", "persist GiB",
                   "peak GiB (hot)", "balanced", "busy s", "comm s");
  for (const auto& r : ranks) {
    std::string layers;
    for (int st : options.schedule == "dualpipev" ? std::vector<int>{r.pp_rank, 2 * options.parallel.pp - 1 - r.pp_rank}
                                                   : std::vector<int>{})
      layers += fmt::format("{}{}", layers.empty() ? "" : "+", stage_layers[std::size_t(st)]);
    if (layers.empty())
      for (int c = 0; c < options.parallel.vpp; ++c)
        layers += fmt::format("{}{}", layers.empty() ? "" : "+",
                              stage_layers[std::size_t(c * options.parallel.pp + r.pp_rank)]);
    s += fmt::format("{:>7} {:>10} {:>12.2f} {:>14.2f} {:>10.2f} {:>10.3f} {:>10.3f}\n", r.pp_rank, layers,
                     r.persistent_bytes / GiB, r.peak_bytes / GiB, r.peak_balanced_bytes / GiB, r.busy, r.comm);
  }
  s += fmt::format(
      "\nstep time      {:.4f} s (max {:.4f}; dp all-reduce {:.4f}, optimizer {:.4f})\n"
      "MFU            {:.1f}%   TGS {:.1f} tokens/GPU/s\n"
      "bubble         {:.1f}%   exposed comm {:.4f} s/iteration   recompute {:.4f} s/iteration\n"
      "peak memory    {:.2f} GiB of {:.2f} GiB\n"
      "OOMs           {} (restart {:.0f} s each, {} iterations rolled back)\n"
      "effective      TGS {:.1f}, MFU {:.1f}% (restart losses included)\n",
      step_time, step_time_max, dp_reduce_time, optimizer_time, 100 * mfu, tgs, 100 * bubble_fraction, exposed_comm,
      recompute_time, peak_bytes / GiB, memory_limit / GiB, ooms, options.restart_seconds, lost_iterations,
      effective_tgs, 100 * effective_mfu);
  if (!note.empty()) s += fmt::format("note           {}\n", note);
  if (!adaptive_level_histogram.empty()) {
    s += "adaptive       ";
    for (std::size_t i = 0; i < adaptive_level_histogram.size(); ++i)
      s += fmt::format("{} {}  ", adaptive_levels()[i], adaptive_level_histogram[i]);
    s += "(rank-micro-batches per level)\n";
  }
  if (!ops.empty()) {
    // By kind (phases summed), then by phase: ms per step over the pipeline ranks.
    std::map<std::string, OpTally> kinds, phases;
    Seconds total = 0;
    for (const auto& [key, t] : ops) {
      for (OpTally* x : {&kinds[key.second], &phases[key.first]}) {
        x->count += t.count;
        x->seconds += t.seconds;
      }
      total += t.seconds;
    }
    std::vector<std::pair<std::string, OpTally>> by(kinds.begin(), kinds.end());
    std::stable_sort(by.begin(), by.end(), [](const auto& a, const auto& b) { return a.second.seconds > b.second.seconds; });
    s += fmt::format("\nops per step (all pipeline ranks): {:.2f} ms\n{:<28} {:>9} {:>10}\n", 1e3 * total, "op kind",
                     "calls", "ms");
    for (const auto& [k, t] : by) s += fmt::format("{:<28} {:>9.1f} {:>10.3f}\n", k, t.count, 1e3 * t.seconds);
    s += "by phase:";
    for (const auto& [p, t] : phases) s += fmt::format(" {} {:.3f} ms;", p, 1e3 * t.seconds);
    s += "\n";
  }
  s += fmt::format("simulated in {:.3f} s\n", wall_seconds);
  return s;
}

json chrome_trace(const Simulation& sim, const PlanTimeline& tl, const Policies& policy, const SimReport& rep,
                  Seconds msg_time) {
  json ev = json::array();
  for (int r : sim.o.trace_ranks) {
    ev.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", r}, {"args", {{"name", fmt::format("pp rank {}", r)}}}});
    ev.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", r}, {"tid", 0}, {"args", {{"name", "compute"}}}});
    ev.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", r}, {"tid", 1}, {"args", {{"name", "comm"}}}});
    const auto& acts = sim.plan.actions[std::size_t(r)];
    for (std::size_t i = 0; i < acts.size(); ++i) {
      const Action& a = acts[i];
      const Interval iv = tl.times[std::size_t(r)][i];
      if (is_send(a.kind)) {
        ev.push_back({{"name", to_string(a.kind)}, {"ph", "X"}, {"pid", r}, {"tid", 1}, {"ts", iv.start * 1e6},
                      {"dur", msg_time * 1e6}, {"args", {{"mb", a.microbatch}, {"stage", a.stage}}}});
      } else if (is_compute(a.kind)) {
        if (i > 0 && acts[i - 1].overlapped_with_next) continue;  // the pair is drawn once
        std::string name = fmt::format("{}{} s{}", to_string(a.kind), a.microbatch, a.stage);
        if (a.overlapped_with_next && i + 1 < acts.size())  // the pair's backward, named beside its forward
          name += fmt::format(" + {}{} s{}", to_string(acts[i + 1].kind), acts[i + 1].microbatch, acts[i + 1].stage);
        ev.push_back({{"name", name}, {"cat", "compute"}, {"ph", "X"}, {"pid", r}, {"tid", 0}, {"ts", iv.start * 1e6},
                      {"dur", (iv.end - iv.start) * 1e6},
                      {"args", {{"mb", a.microbatch}, {"stage", a.stage},
                                {"policy", policy[std::size_t(r)][std::size_t(a.microbatch)]}}}});
      }
    }
    ev.push_back({{"name", "dp all-reduce"}, {"ph", "X"}, {"pid", r}, {"tid", 1}, {"ts", tl.makespan * 1e6},
                  {"dur", rep.dp_reduce_time * 1e6}});
    ev.push_back({{"name", "optimizer"}, {"ph", "X"}, {"pid", r}, {"tid", 0},
                  {"ts", (tl.makespan + rep.dp_reduce_time) * 1e6}, {"dur", rep.optimizer_time * 1e6}});
  }
  return {{"traceEvents", ev}, {"displayTimeUnit", "ms"}};
}

void write_outputs(const SimReport& r, const std::filesystem::path& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw DataError(fmt::format("{}: cannot create the output directory ({})", dir.string(), ec.message()));
  // Both files are written beside their place and renamed over it once whole, and
  // only when both can be: a failure leaves the folder's earlier files as they were.
  std::vector<std::pair<std::filesystem::path, std::string>> files = {{dir / "summary.json", r.to_json().dump(2)}};
  if (!r.options.trace_ranks.empty()) files.push_back({dir / "trace.json", r.trace.dump()});
  for (const auto& [path, text] : files)
    if (std::filesystem::is_directory(path, ec))
      throw DataError(fmt::format("{}: cannot write, a directory is in its place", path.string()));
  std::vector<std::filesystem::path> written;
  auto discard = [&] {
    for (const auto& t : written) std::filesystem::remove(t, ec);
  };
  for (const auto& [path, text] : files) {
    std::filesystem::path tmp = path;
    tmp += ".tmp";
    std::ofstream f(tmp);
    f << text << "\n";
    f.close();
    if (!f) {
      written.push_back(tmp);
      discard();
      throw DataError(fmt::format("{}: cannot write", path.string()));
    }
    written.push_back(tmp);
  }
  for (std::size_t i = 0; i < files.size(); ++i) {
    std::filesystem::rename(written[i], files[i].first, ec);
    if (ec) {
      written.erase(written.begin(), written.begin() + std::ptrdiff_t(i));  // those renamed are in place
      discard();
      throw DataError(fmt::format("{}: cannot write ({})", files[i].first.string(), ec.message()));
    }
  }
}

}  // namespace moeflex::sim
