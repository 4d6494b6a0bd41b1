// In-situ profiles (`moeflex calibrate --from-run`): a base profile plus the op times
// a run trained with --profile-ops measured (its op_times.json), every entry checked
// before it is taken; and the command that writes the result.
#include "moeflex/profile/calibrate.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "moeflex/core/error.h"

namespace moeflex {
namespace {

/// Refuses op_times.json's shapes[index] (of `kind`), naming the file, the entry and the field.
[[noreturn]] void bad_shape_entry(const std::filesystem::path& path, std::size_t index, const std::string& kind,
                                  const std::string& field, const std::string& rule) {
  throw DataError(fmt::format("'{}': shapes[{}]{}: '{}' {}", path.string(), index,
                              kind.empty() ? std::string() : fmt::format(" ({})", kind), field, rule));
}

const nlohmann::json& shape_member(const nlohmann::json& e, const char* key, const std::filesystem::path& path,
                                   std::size_t index, const std::string& kind) {
  auto it = e.find(key);
  if (it == e.end()) bad_shape_entry(path, index, kind, key, "is missing");
  return *it;
}

/// An entry's time field: a finite number in (0, kInSituMaxSeconds] (the profile's own bound).
Seconds shape_seconds(const nlohmann::json& e, const char* key, const std::filesystem::path& path, std::size_t index,
                      const std::string& kind, Seconds max = kInSituMaxSeconds) {
  const nlohmann::json& v = shape_member(e, key, path, index, kind);
  if (!v.is_number()) bad_shape_entry(path, index, kind, key, fmt::format("must be a number (got {})", v.dump()));
  const double x = v.get<double>();
  if (!std::isfinite(x) || !(x > 0) || x > max)
    bad_shape_entry(path, index, kind, key, fmt::format("must be in (0, {}] seconds (got {})", max, v.dump()));
  return x;
}

/// An integer field within int64 and >= `min`.
std::int64_t shape_integer(const nlohmann::json& v, std::int64_t min, const std::filesystem::path& path,
                           std::size_t index, const std::string& kind, const std::string& field) {
  if (!v.is_number_integer())
    bad_shape_entry(path, index, kind, field, fmt::format("must be an integer (got {})", v.dump()));
  if (v.is_number_unsigned() && v.get<std::uint64_t>() > std::uint64_t(std::numeric_limits<std::int64_t>::max()))
    bad_shape_entry(path, index, kind, field, fmt::format("is out of range (got {})", v.dump()));
  const std::int64_t x = v.get<std::int64_t>();
  if (x < min) bad_shape_entry(path, index, kind, field, fmt::format("must be >= {} (got {})", min, x));
  return x;
}

}  // namespace

HardwareProfile in_situ_profile(HardwareProfile base, const std::filesystem::path& run_dir,
                                std::size_t* zero_sized) {
  const std::filesystem::path path = run_dir / "op_times.json";
  std::ifstream in(path);
  if (!in)
    throw DataError(fmt::format("'{}' cannot be opened: --from-run needs a run trained with --profile-ops",
                                path.string()));
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw DataError(fmt::format("'{}' is not valid JSON: {}", path.string(), e.what()));
  }
  if (!doc.is_object() || !doc.contains("shapes") || !doc["shapes"].is_array())
    throw DataError(fmt::format("'{}' has no \"shapes\" list (written by an older moeflex?)", path.string()));
  // A profile's op times are fp32 ops' (the cost model's unit); a bf16 run's would
  // price every later fp32 plan with another precision's times.
  for (const char* field : {"precision", "device"})
    if (doc.contains(field) && !doc[field].is_string())
      throw DataError(fmt::format("'{}': \"{}\" must be a string (got {})", path.string(), field, doc[field].dump()));
  if (doc.value("precision", std::string("fp32")) != "fp32")
    throw DataError(fmt::format("'{}' was measured on a {} run: an in-situ profile takes the op times of an fp32 "
                                "run (train it without --bf16, with --profile-ops)",
                                path.string(), doc.value("precision", std::string())));
  // ... and of the base profile's device (files before the field are a CPU's).
  if (const std::string device = doc.value("device", std::string("cpu")); device != base.device)
    throw DataError(
        fmt::format("'{}' was measured on {} and the base profile on {}: an in-situ profile adds a "
                    "run's op times to a profile of the same device",
                    path.string(), device, base.device));
  // A base that is itself in situ keeps its entries where this run has none; the
  // grouped ratios are taken against its tables alone (not against an earlier run's
  // scales, which this run's would otherwise multiply).
  const std::vector<InSituOp> earlier_ops = std::move(base.in_situ_ops);
  const std::vector<InSituScale> earlier_scales = std::move(base.in_situ_scales);
  const std::string earlier_source = base.in_situ_source;
  base.in_situ_ops.clear();
  base.in_situ_scales.clear();
  const CostModel cost(base);  // the base's own predictions, for the grouped ratios
  const std::set<std::string> exact(std::begin(kInSituExactKinds), std::end(kInSituExactKinds));
  const std::set<std::string> scaled(std::begin(kInSituScaledKinds), std::end(kInSituScaledKinds));
  if (zero_sized) *zero_sized = 0;
  std::map<std::pair<std::string, std::vector<std::int64_t>>, std::size_t> seen;  // exact (kind, shape) -> index
  std::map<std::tuple<std::string, std::int64_t, std::int64_t>, std::pair<double, double>> ratio;  // measured, predicted
  const nlohmann::json& shapes = doc["shapes"];
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    const nlohmann::json& e = shapes[i];
    if (!e.is_object()) bad_shape_entry(path, i, "", "(entry)", "must be an object {kind, shape, count, ...}");
    const nlohmann::json& k = shape_member(e, "kind", path, i, "");
    if (!k.is_string()) bad_shape_entry(path, i, "", "kind", fmt::format("must be a string (got {})", k.dump()));
    const std::string kind = k.get<std::string>();
    const bool is_exact = exact.count(kind) > 0, is_scaled = scaled.count(kind) > 0;
    if (!is_exact && !is_scaled) continue;  // a kind the cost model does not answer in situ
    const nlohmann::json& sh = shape_member(e, "shape", path, i, kind);
    if (!sh.is_array()) bad_shape_entry(path, i, kind, "shape", fmt::format("must be an array (got {})", sh.dump()));
    const std::int64_t count = shape_integer(shape_member(e, "count", path, i, kind), 1, path, i, kind, "count");
    if (is_exact) {
      const std::size_t rank = in_situ_shape_rank(kind);
      if (sh.size() != rank)
        bad_shape_entry(path, i, kind, "shape", fmt::format("must hold {} extents (got {})", rank, sh.dump()));
      std::vector<std::int64_t> shape;
      for (std::size_t d = 0; d < sh.size(); ++d)
        shape.push_back(shape_integer(sh[d], 0, path, i, kind, fmt::format("shape[{}]", d)));
      const Seconds median = shape_seconds(e, "measured_median_s", path, i, kind);
      // A zero-sized call (an expert chunk that got no rows) ran no kernel: the cost
      // model prices it at 0 without asking the profile, so it is not kept.
      if (std::find(shape.begin(), shape.end(), 0) != shape.end()) {
        if (zero_sized) ++*zero_sized;
        continue;
      }
      const auto [at, fresh] = seen.emplace(std::make_pair(kind, shape), i);
      if (!fresh)
        bad_shape_entry(path, i, kind, "shape",
                        fmt::format("{} repeats shapes[{}]'s; each (kind, shape) is listed once", sh.dump(),
                                    at->second));
      base.in_situ_ops.push_back({kind, shape, median});
    } else {
      // [rows of each group..., in, out]
      if (sh.size() < 3)
        bad_shape_entry(path, i, kind, "shape",
                        fmt::format("must be [rows of each group..., in, out] with at least one group (got {})",
                                    sh.dump()));
      std::vector<std::int64_t> rows;
      for (std::size_t d = 0; d + 2 < sh.size(); ++d)
        rows.push_back(shape_integer(sh[d], 0, path, i, kind, fmt::format("shape[{}]", d)));
      const std::int64_t in_f = shape_integer(sh[sh.size() - 2], 1, path, i, kind, "shape[-2] (in)");
      const std::int64_t out_f = shape_integer(sh.back(), 1, path, i, kind, "shape[-1] (out)");
      // The total of `count` calls: up to an hour per call, as the profile's own bound.
      const Seconds total = shape_seconds(e, "measured_total_s", path, i, kind, kInSituMaxSeconds * double(count));
      const Seconds one = kind == "grouped_linear_forward"
                              ? cost.grouped_linear_forward(rows, in_f, out_f)
                              : cost.grouped_linear_backward(rows, in_f, out_f, kind == "grouped_linear_backward_dx",
                                                             kind == "grouped_linear_backward_dw");
      auto& [m, p] = ratio[{kind, in_f, out_f}];
      m += total;
      p += double(count) * one;
    }
  }
  for (const auto& [key, mp] : ratio) {
    const auto& [kind, in_f, out_f] = key;
    if (!(mp.second > 0)) continue;  // every group empty: nothing the model prices, nothing to scale
    const double scale = mp.first / mp.second;
    if (!(scale >= kInSituMinScale && scale <= kInSituMaxScale))
      throw DataError(fmt::format("'{}': {} with weight [in {}, out {}] measured {:.6g} s where the base profile "
                                  "predicts {:.6g} s: a ratio of {:.6g}, outside [{}, {}] (wrong shapes or times in "
                                  "op_times.json, or a base profile of another machine?)",
                                  path.string(), kind, in_f, out_f, mp.first, mp.second, scale, kInSituMinScale,
                                  kInSituMaxScale));
    base.in_situ_scales.push_back({kind, in_f, out_f, scale});
  }
  for (const InSituOp& o : earlier_ops)
    if (!seen.count({o.kind, o.shape})) base.in_situ_ops.push_back(o);
  for (const InSituScale& x : earlier_scales)
    if (!ratio.count({x.kind, x.in, x.out})) base.in_situ_scales.push_back(x);
  const std::string source = std::filesystem::absolute(run_dir).lexically_normal().string();
  base.in_situ_source = earlier_source.empty() ? source : earlier_source + "; " + source;
  return base;
}

int run_in_situ_calibrate_command(const std::string& run_dir, const std::string& base_path,
                                  const std::string& out_path) {
  if (run_dir.empty()) throw ConfigError("calibrate --from-run '': give the folder of a run trained with --profile-ops");
  if (base_path.empty()) throw ConfigError("calibrate --base '': give the profile to start from");
  if (out_path.empty()) throw ConfigError("calibrate --out '': give the profile file to write");
  {  // the same file under two names (relative, absolute, through links) counts as the same
    std::error_code ec;
    const bool same = std::filesystem::exists(out_path, ec) ? std::filesystem::equivalent(out_path, base_path, ec)
                                                            : std::filesystem::weakly_canonical(out_path, ec) ==
                                                                  std::filesystem::weakly_canonical(base_path, ec);
    if (same && !ec)
      throw ConfigError(fmt::format("calibrate --out '{}' is the base profile (--base '{}'): writing it would replace "
                                    "the base profile; choose another --out",
                                    out_path, base_path));
  }
  {  // nor the run's own op times, which it reads
    std::error_code ec;
    const std::filesystem::path ops = std::filesystem::path(run_dir) / "op_times.json";
    if (std::filesystem::exists(out_path, ec) && std::filesystem::equivalent(out_path, ops, ec) && !ec)
      throw ConfigError(
          fmt::format("calibrate --out '{}' is the run's own op_times.json (--from-run '{}'): writing "
                      "it would replace what the profile is made from; choose another --out",
                      out_path, run_dir));
  }
  check_profile_out(out_path);
  std::size_t zero_sized = 0;
  const HardwareProfile profile = in_situ_profile(HardwareProfile::load(base_path), run_dir, &zero_sized);
  fmt::print("moeflex calibrate --from-run {}: base profile {}\n", run_dir, base_path);
  fmt::print("in-situ: {} ops at their exact shapes", profile.in_situ_ops.size());
  if (zero_sized > 0) fmt::print(" ({} zero-sized calls left out: they cost 0)", zero_sized);
  if (!profile.in_situ_scales.empty()) {
    fmt::print("; grouped GEMMs measured / modelled:");
    for (const InSituScale& x : profile.in_situ_scales)
      fmt::print(" {} [{}, {}] x{:.3f}", x.kind, x.in, x.out, x.scale);
  }
  fmt::print("\n");
  write_profile(profile, out_path);
  fmt::print("wrote {}\n", out_path);
  return 0;
}

}  // namespace moeflex
