// The time cost model and its hardware profile (see cost_model.h for how a time is
// formed). The profile's JSON:
//   {"format": "moeflex-hardware-profile", "version": 2, "name": "...", "device": "cpu",
//    "threads": 2,
//    "launch_overhead_s": ..., "memory_bandwidth_Bps": ...,
//    "h2d_bandwidth_Bps": ..., "d2h_bandwidth_Bps": ..., "copy_latency_s": ...,
//    "all_to_all_bandwidth_Bps": 0, "all_to_all_latency_s": 0, "time_sharing_efficiency": 1,
//    "nap_cost_s": 0, "nap_overshoot_s": 0,
//    "gemm": [{"M": .., "N": .., "K": .., "flops_per_s": .., "layout": "nt"}, ...],
//    "op_tables": {"rmsnorm_forward": [{"bytes": .., "seconds": ..}, ...], ...}}
// A sample's "layout" is "nt", "nn" or "tn", or absent (GemmLayout::any); version 1
// files never have one and are read as such.
#include "moeflex/provision/cost_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>

#include "moeflex/core/error.h"

namespace moeflex {

// ---- op_bytes -------------------------------------------------------------------

namespace op_bytes {

Bytes add_inplace(std::int64_t n) { return 3 * n * kActivationBytes; }
Bytes rmsnorm_forward(std::int64_t n, std::int64_t d) { return (2 * n * d + d + n) * kActivationBytes; }
Bytes rmsnorm_backward(std::int64_t n, std::int64_t d) { return (3 * n * d + 2 * d + n) * kActivationBytes; }
Bytes rope(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t hd) {
  return 2 * B * S * H * hd * kActivationBytes;
}
Bytes rope_tables(std::int64_t S, std::int64_t hd) { return 2 * S * (hd / 2) * kActivationBytes; }
Bytes swiglu_forward(std::int64_t n) { return 3 * n * kActivationBytes; }
Bytes swiglu_backward(std::int64_t n) { return 5 * n * kActivationBytes; }
Bytes router_forward(std::int64_t n, std::int64_t E, std::int64_t k) {
  return (2 * n * E + 2 * n * k) * kActivationBytes;
}
Bytes router_backward(std::int64_t n, std::int64_t E, std::int64_t k) {
  return (2 * n * E + 2 * n * k) * kActivationBytes;
}
Bytes permute(std::int64_t n, std::int64_t k, std::int64_t d) { return (2 * n * k * d + n * k) * kActivationBytes; }
Bytes cross_entropy(std::int64_t n, std::int64_t V) { return (2 * n * V + 2 * n) * kActivationBytes; }
Bytes attention_softmax_forward(std::int64_t B, std::int64_t S, std::int64_t H) {
  return 2 * B * H * S * S * kActivationBytes;
}
Bytes attention_softmax_backward(std::int64_t B, std::int64_t S, std::int64_t H) {
  return 3 * B * H * S * S * kActivationBytes;
}

}  // namespace op_bytes

const char* to_string(GemmLayout layout) {
  switch (layout) {
    case GemmLayout::nt: return "nt";
    case GemmLayout::nn: return "nn";
    case GemmLayout::tn: return "tn";
    default: return "any";
  }
}

// ---- JSON -----------------------------------------------------------------------

namespace {

using nlohmann::json;

[[noreturn]] void bad_field(const std::string& source, const std::string& field, const std::string& rule) {
  throw DataError(fmt::format("hardware profile '{}': field '{}' {}", source, field, rule));
}

const json& member(const json& obj, const char* key, const std::string& source, const std::string& field) {
  if (!obj.is_object()) bad_field(source, field, "is inside something that is not a JSON object");
  auto it = obj.find(key);
  if (it == obj.end()) bad_field(source, field, "is missing");
  return *it;
}

double number(const json& obj, const char* key, const std::string& source, const std::string& field) {
  const json& v = member(obj, key, source, field);
  if (!v.is_number()) bad_field(source, field, "must be a number");
  const double x = v.get<double>();
  if (!std::isfinite(x)) bad_field(source, field, "must be finite");
  return x;
}

double positive(const json& obj, const char* key, const std::string& source, const std::string& field) {
  const double x = number(obj, key, source, field);
  if (!(x > 0)) bad_field(source, field, fmt::format("must be > 0 (got {})", x));
  return x;
}

double non_negative(const json& obj, const char* key, const std::string& source, const std::string& field) {
  const double x = number(obj, key, source, field);
  if (x < 0) bad_field(source, field, fmt::format("must be >= 0 (got {})", x));
  return x;
}

std::int64_t positive_int(const json& obj, const char* key, const std::string& source, const std::string& field) {
  const json& v = member(obj, key, source, field);
  if (!v.is_number_integer()) bad_field(source, field, "must be an integer");
  const std::int64_t x = v.get<std::int64_t>();
  if (x <= 0) bad_field(source, field, fmt::format("must be >= 1 (got {})", x));
  return x;
}

/// " (did you mean 'x'?)" for the known name closest to `name` when it is within 3
/// edits, else "" ; followed by the list of known names.
std::string suggest(const std::string& name, const std::vector<std::string>& known) {
  std::string list;
  for (const std::string& k : known) list += (list.empty() ? "" : ", ") + k;
  return did_you_mean(name, known) + fmt::format("; known: {}", list);
}

/// Refuses a key of `obj` outside `known`, naming `field` (the object's path).
void only_known_keys(const json& obj, const std::vector<std::string>& known, const std::string& source,
                     const std::string& field) {
  for (const auto& [key, value] : obj.items())
    if (std::find(known.begin(), known.end(), key) == known.end())
      bad_field(source, field.empty() ? key : field + "." + key, "is not a known key" + suggest(key, known));
}

/// An extent of an in-situ shape: a JSON integer within int64 and >= `min`.
std::int64_t shape_extent(const json& d, std::int64_t min, const std::string& source, const std::string& field) {
  if (!d.is_number_integer()) bad_field(source, field, fmt::format("must be an integer (got {})", d.dump()));
  if (d.is_number_unsigned() && d.get<std::uint64_t>() > std::uint64_t(std::numeric_limits<std::int64_t>::max()))
    bad_field(source, field, fmt::format("is out of range (got {})", d.dump()));
  const std::int64_t x = d.get<std::int64_t>();
  if (x < min) bad_field(source, field, fmt::format("must be >= {} (got {})", min, x));
  return x;
}

std::vector<std::string> names_of(const char* const* begin, const char* const* end) {
  return std::vector<std::string>(begin, end);
}

/// The "in_situ" section of a profile: {source, ops: [{kind, shape, seconds}],
/// scales: [{kind, in, out, scale}]}, every key, kind and bound checked (see
/// cost_model.h, kInSitu*), duplicates refused naming both entries.
void parse_in_situ(const json& s, const std::string& source, HardwareProfile& p) {
  if (!s.is_object()) bad_field(source, "in_situ", "must be an object {source, ops, scales}");
  only_known_keys(s, {"source", "ops", "scales"}, source, "in_situ");
  if (auto src = s.find("source"); src != s.end()) {
    if (!src->is_string()) bad_field(source, "in_situ.source", "must be a string");
    p.in_situ_source = src->get<std::string>();
  }
  const std::vector<std::string> exact = names_of(std::begin(kInSituExactKinds), std::end(kInSituExactKinds));
  const std::vector<std::string> scaled = names_of(std::begin(kInSituScaledKinds), std::end(kInSituScaledKinds));
  if (auto ops = s.find("ops"); ops != s.end()) {
    if (!ops->is_array()) bad_field(source, "in_situ.ops", "must be an array of {kind, shape, seconds}");
    std::map<std::pair<std::string, std::vector<std::int64_t>>, std::size_t> seen;
    for (std::size_t i = 0; i < ops->size(); ++i) {
      const json& e = (*ops)[i];
      const std::string f = fmt::format("in_situ.ops[{}]", i);
      if (!e.is_object()) bad_field(source, f, "must be an object {kind, shape, seconds}");
      only_known_keys(e, {"kind", "shape", "seconds"}, source, f);
      const json& kind = member(e, "kind", source, f + ".kind");
      if (!kind.is_string()) bad_field(source, f + ".kind", fmt::format("must be a string (got {})", kind.dump()));
      InSituOp op;
      op.kind = kind.get<std::string>();
      if (std::find(exact.begin(), exact.end(), op.kind) == exact.end())
        bad_field(source, f + ".kind", fmt::format("'{}' is not an in-situ op kind{}", op.kind, suggest(op.kind, exact)));
      const json& shape = member(e, "shape", source, f + ".shape");
      const std::size_t rank = in_situ_shape_rank(op.kind);
      if (!shape.is_array() || shape.size() != rank)
        bad_field(source, f + ".shape",
                  fmt::format("must be an array of {} integers for {} (got {})", rank, op.kind, shape.dump()));
      for (std::size_t d = 0; d < shape.size(); ++d)
        op.shape.push_back(shape_extent(shape[d], 1, source, fmt::format("{}.shape[{}]", f, d)));
      op.seconds = number(e, "seconds", source, f + ".seconds");
      if (!(op.seconds > 0) || op.seconds > kInSituMaxSeconds)
        bad_field(source, f + ".seconds", fmt::format("must be in (0, {}] (got {})", kInSituMaxSeconds, op.seconds));
      const auto [at, fresh] = seen.emplace(std::make_pair(op.kind, op.shape), i);
      if (!fresh)
        bad_field(source, f, fmt::format("repeats in_situ.ops[{}] ({} at {}); keep one", at->second, op.kind,
                                         shape.dump()));
      p.in_situ_ops.push_back(std::move(op));
    }
  }
  if (auto sc = s.find("scales"); sc != s.end()) {
    if (!sc->is_array()) bad_field(source, "in_situ.scales", "must be an array of {kind, in, out, scale}");
    std::map<std::tuple<std::string, std::int64_t, std::int64_t>, std::size_t> seen;
    for (std::size_t i = 0; i < sc->size(); ++i) {
      const json& e = (*sc)[i];
      const std::string f = fmt::format("in_situ.scales[{}]", i);
      if (!e.is_object()) bad_field(source, f, "must be an object {kind, in, out, scale}");
      only_known_keys(e, {"kind", "in", "out", "scale"}, source, f);
      const json& kind = member(e, "kind", source, f + ".kind");
      if (!kind.is_string()) bad_field(source, f + ".kind", fmt::format("must be a string (got {})", kind.dump()));
      InSituScale x;
      x.kind = kind.get<std::string>();
      if (std::find(scaled.begin(), scaled.end(), x.kind) == scaled.end())
        bad_field(source, f + ".kind",
                  fmt::format("'{}' is not a scaled in-situ kind{}", x.kind, suggest(x.kind, scaled)));
      x.in = shape_extent(member(e, "in", source, f + ".in"), 1, source, f + ".in");
      x.out = shape_extent(member(e, "out", source, f + ".out"), 1, source, f + ".out");
      x.scale = number(e, "scale", source, f + ".scale");
      if (!(x.scale >= kInSituMinScale && x.scale <= kInSituMaxScale))
        bad_field(source, f + ".scale",
                  fmt::format("must be in [{}, {}] (got {})", kInSituMinScale, kInSituMaxScale, x.scale));
      const auto [at, fresh] = seen.emplace(std::make_tuple(x.kind, x.in, x.out), i);
      if (!fresh)
        bad_field(source, f, fmt::format("repeats in_situ.scales[{}] ({} [{}, {}]); keep one", at->second, x.kind,
                                         x.in, x.out));
      p.in_situ_scales.push_back(std::move(x));
    }
  }
}

}  // namespace

std::size_t in_situ_shape_rank(const std::string& kind) {
  static const std::map<std::string, std::size_t> rank = {
      {"linear_forward", 3},        {"linear_backward", 3},        {"linear_backward_dx", 3}, {"linear_backward_dw", 3},
      {"attention_forward", 4},     {"attention_backward", 4},     {"rmsnorm_forward", 2},    {"rmsnorm_backward", 2},
      {"swiglu_forward", 1},        {"swiglu_backward", 1},        {"router_forward", 3},     {"router_backward", 3},
      {"permute_forward", 3},       {"permute_backward", 3},       {"unpermute_forward", 3},  {"unpermute_backward", 3},
      {"cross_entropy_forward", 2}, {"cross_entropy_backward", 2}, {"rope_forward", 4},       {"rope_backward", 4},
      {"add_inplace", 1},           {"embedding_forward", 2},      {"embedding_backward", 2}, {"aux_loss_forward", 3},
      {"aux_loss_backward", 3},     {"z_loss_forward", 2},         {"z_loss_backward", 2}};
  auto it = rank.find(kind);
  return it == rank.end() ? 0 : it->second;
}

nlohmann::json HardwareProfile::to_json() const {
  json j;
  j["format"] = kHardwareProfileFormat;
  j["version"] = kHardwareProfileVersion;
  j["name"] = name;
  j["device"] = device;
  if (!blas_core.empty()) j["blas_core"] = blas_core;
  j["threads"] = threads;
  j["launch_overhead_s"] = launch_overhead;
  j["memory_bandwidth_Bps"] = memory_bandwidth;
  j["h2d_bandwidth_Bps"] = h2d_bandwidth;
  j["d2h_bandwidth_Bps"] = d2h_bandwidth;
  j["copy_latency_s"] = copy_latency;
  j["all_to_all_bandwidth_Bps"] = all_to_all_bandwidth;
  j["all_to_all_latency_s"] = all_to_all_latency;
  j["time_sharing_efficiency"] = time_sharing_efficiency;
  j["nap_cost_s"] = nap_cost;
  j["nap_overshoot_s"] = nap_overshoot;
  json g = json::array();
  for (const GemmSample& s : gemm) {
    json e = {{"M", s.M}, {"N", s.N}, {"K", s.K}, {"flops_per_s", s.rate}};
    if (s.layout != GemmLayout::any) e["layout"] = to_string(s.layout);
    g.push_back(std::move(e));
  }
  j["gemm"] = std::move(g);
  json ops = json::object();
  for (const auto& [op, points] : op_tables) {
    json arr = json::array();
    for (const OpSample& p : points) arr.push_back({{"bytes", p.bytes}, {"seconds", p.seconds}});
    ops[op] = std::move(arr);
  }
  j["op_tables"] = std::move(ops);
  if (!in_situ_source.empty() || !in_situ_ops.empty() || !in_situ_scales.empty()) {
    json o = json::array(), sc = json::array();
    for (const InSituOp& x : in_situ_ops) o.push_back({{"kind", x.kind}, {"shape", x.shape}, {"seconds", x.seconds}});
    for (const InSituScale& x : in_situ_scales)
      sc.push_back({{"kind", x.kind}, {"in", x.in}, {"out", x.out}, {"scale", x.scale}});
    j["in_situ"] = {{"source", in_situ_source}, {"ops", o}, {"scales", sc}};
  }
  return j;
}

HardwareProfile HardwareProfile::from_json(const nlohmann::json& j, const std::string& source) {
  if (!j.is_object()) bad_field(source, "(top level)", "must be a JSON object");
  const json& format = member(j, "format", source, "format");
  if (!format.is_string() || format.get<std::string>() != kHardwareProfileFormat)
    bad_field(source, "format", fmt::format("must be \"{}\"", kHardwareProfileFormat));
  const json& version = member(j, "version", source, "version");
  if (!version.is_number_integer())
    bad_field(source, "version", fmt::format("must be an integer (got {})", version.dump()));
  if (const auto v = version.get<std::int64_t>(); v < kHardwareProfileOldestVersion || v > kHardwareProfileVersion)
    bad_field(source, "version",
              fmt::format("is {}, but this moeflex reads versions {} to {}{}", v, kHardwareProfileOldestVersion,
                          kHardwareProfileVersion,
                          v > kHardwareProfileVersion ? " (written by a newer moeflex?)"
                                                      : " (run `moeflex calibrate` again)"));

  // Every key save() writes; another is a typo or a field this moeflex would ignore.
  only_known_keys(
      j,
      {"format", "version", "name", "device", "blas_core", "threads", "launch_overhead_s", "memory_bandwidth_Bps",
       "h2d_bandwidth_Bps", "d2h_bandwidth_Bps", "copy_latency_s", "all_to_all_bandwidth_Bps", "all_to_all_latency_s",
       "time_sharing_efficiency", "nap_cost_s", "nap_overshoot_s", "gemm", "op_tables", "in_situ"},
      source, "");

  HardwareProfile p;
  const json& name = member(j, "name", source, "name");
  if (!name.is_string()) bad_field(source, "name", "must be a string");
  p.name = name.get<std::string>();
  if (const auto it = j.find("device"); it != j.end()) {  // absent in files before the field: a CPU's
    if (!it->is_string() || (it->get<std::string>() != "cpu" && it->get<std::string>() != "cuda"))
      bad_field(source, "device", fmt::format("must be \"cpu\" or \"cuda\" (got {})", it->dump()));
    p.device = it->get<std::string>();
  }
  if (const auto it = j.find("blas_core"); it != j.end()) {
    if (!it->is_string()) bad_field(source, "blas_core", "must be a string");
    p.blas_core = it->get<std::string>();
  }
  p.threads = static_cast<int>(positive_int(j, "threads", source, "threads"));
  p.launch_overhead = non_negative(j, "launch_overhead_s", source, "launch_overhead_s");
  p.memory_bandwidth = positive(j, "memory_bandwidth_Bps", source, "memory_bandwidth_Bps");
  p.h2d_bandwidth = positive(j, "h2d_bandwidth_Bps", source, "h2d_bandwidth_Bps");
  p.d2h_bandwidth = positive(j, "d2h_bandwidth_Bps", source, "d2h_bandwidth_Bps");
  p.copy_latency = non_negative(j, "copy_latency_s", source, "copy_latency_s");
  p.all_to_all_bandwidth = non_negative(j, "all_to_all_bandwidth_Bps", source, "all_to_all_bandwidth_Bps");
  p.all_to_all_latency = non_negative(j, "all_to_all_latency_s", source, "all_to_all_latency_s");
  if (j.contains("time_sharing_efficiency")) {  // absent in files before the field: not measured
    const json& e = j["time_sharing_efficiency"];
    if (!e.is_number() || !(e.get<double>() > 0 && e.get<double>() <= 1))
      bad_field(source, "time_sharing_efficiency", fmt::format("must be a number in (0, 1] (got {})", e.dump()));
    p.time_sharing_efficiency = e.get<double>();
  }
  // Absent in files before the fields: not measured.
  if (j.contains("nap_cost_s")) p.nap_cost = non_negative(j, "nap_cost_s", source, "nap_cost_s");
  if (j.contains("nap_overshoot_s")) p.nap_overshoot = non_negative(j, "nap_overshoot_s", source, "nap_overshoot_s");

  const json& g = member(j, "gemm", source, "gemm");
  if (!g.is_array() || g.empty()) bad_field(source, "gemm", "must be a non-empty array of {M, N, K, flops_per_s}");
  for (std::size_t i = 0; i < g.size(); ++i) {
    const std::string f = fmt::format("gemm[{}]", i);
    if (!g[i].is_object()) bad_field(source, f, "must be an object {M, N, K, flops_per_s}");
    GemmSample s;
    s.M = positive_int(g[i], "M", source, f + ".M");
    s.N = positive_int(g[i], "N", source, f + ".N");
    s.K = positive_int(g[i], "K", source, f + ".K");
    s.rate = positive(g[i], "flops_per_s", source, f + ".flops_per_s");
    if (auto l = g[i].find("layout"); l != g[i].end()) {
      const std::string name = l->is_string() ? l->get<std::string>() : std::string();
      if (name == "nt") s.layout = GemmLayout::nt;
      else if (name == "nn") s.layout = GemmLayout::nn;
      else if (name == "tn") s.layout = GemmLayout::tn;
      else bad_field(source, f + ".layout", fmt::format("must be \"nt\", \"nn\" or \"tn\" (got {})", l->dump()));
    }
    p.gemm.push_back(s);
  }

  if (auto it = j.find("op_tables"); it != j.end()) {
    if (!it->is_object()) bad_field(source, "op_tables", "must be an object of op name -> [{bytes, seconds}]");
    const std::vector<std::string> known(std::begin(op_names::kAll), std::end(op_names::kAll));
    for (const auto& [op, arr] : it->items()) {
      const std::string f = "op_tables." + op;
      // A misspelt table would be ignored, and its op priced by the fallback.
      if (std::find(known.begin(), known.end(), op) == known.end())
        bad_field(source, "op_tables", fmt::format("'{}' is not an op table{}", op, suggest(op, known)));
      if (!arr.is_array() || arr.empty()) bad_field(source, f, "must be a non-empty array of {bytes, seconds}");
      std::vector<OpSample> points;
      for (std::size_t i = 0; i < arr.size(); ++i) {
        const std::string fi = fmt::format("{}[{}]", f, i);
        if (!arr[i].is_object()) bad_field(source, fi, "must be an object {bytes, seconds}");
        OpSample s;
        s.bytes = positive_int(arr[i], "bytes", source, fi + ".bytes");
        s.seconds = non_negative(arr[i], "seconds", source, fi + ".seconds");
        if (!points.empty() && s.bytes <= points.back().bytes)
          bad_field(source, fi + ".bytes", "must be larger than the previous point's (points sorted by bytes)");
        points.push_back(s);
      }
      p.op_tables[op] = std::move(points);
    }
  }
  if (auto it = j.find("in_situ"); it != j.end()) parse_in_situ(*it, source, p);
  return p;
}

void HardwareProfile::save(const std::filesystem::path& path) const {
  std::error_code ec;
  if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path(), ec);
  if (ec) throw DataError(fmt::format("cannot create the folder of hardware profile '{}': {}", path.string(), ec.message()));
  std::ofstream out(path);
  if (!out) throw DataError(fmt::format("cannot write hardware profile '{}'", path.string()));
  out << to_json().dump(2) << "\n";
  out.close();
  if (!out) throw DataError(fmt::format("cannot write hardware profile '{}' (disk full?)", path.string()));
}

HardwareProfile HardwareProfile::load(const std::filesystem::path& path) {
  if (std::filesystem::is_directory(path))
    throw DataError(fmt::format("hardware profile '{}' is a directory; give the profile file (calibrate writes "
                                "DIR/this-machine.json)", path.string()));
  std::ifstream in(path);
  if (!in) throw DataError(fmt::format("hardware profile '{}' cannot be opened (run `moeflex calibrate`?)", path.string()));
  json j;
  try {
    j = json::parse(in);
  } catch (const json::parse_error& e) {
    throw DataError(fmt::format("hardware profile '{}' is not valid JSON: {}", path.string(), e.what()));
  }
  return from_json(j, path.string());
}

// ---- CostModel --------------------------------------------------------------------

namespace {

/// Samples blended by the nearest-neighbour fallback of gemm_rate.
constexpr std::size_t kGemmNeighbours = 4;

double flops(std::int64_t M, std::int64_t N, std::int64_t K) { return 2.0 * double(M) * double(N) * double(K); }

}  // namespace

void make_nondecreasing(std::vector<Seconds>& t) {
  // Pool adjacent violators: blocks of (mean, count), merged while a block's mean
  // falls below its predecessor's.
  std::vector<std::pair<double, std::size_t>> blocks;
  for (Seconds x : t) {
    blocks.emplace_back(x, 1);
    while (blocks.size() > 1 && blocks[blocks.size() - 2].first > blocks.back().first) {
      const auto [m2, n2] = blocks.back();
      blocks.pop_back();
      auto& [m1, n1] = blocks.back();
      m1 = (m1 * double(n1) + m2 * double(n2)) / double(n1 + n2);
      n1 += n2;
    }
  }
  std::size_t i = 0;
  for (const auto& [mean, count] : blocks)
    for (std::size_t k = 0; k < count; ++k) t[i++] = mean;
}

namespace {

}  // namespace

CostModel::CostModel(HardwareProfile profile) : profile_(std::move(profile)) {
  // A profile that did not come through from_json (one built in code) is checked here.
  if (profile_.gemm.empty()) bad_field("profile", "gemm", "must hold at least one sample");
  if (!(profile_.memory_bandwidth > 0)) bad_field("profile", "memory_bandwidth_Bps", "must be > 0");
  if (!(profile_.h2d_bandwidth > 0)) bad_field("profile", "h2d_bandwidth_Bps", "must be > 0");
  if (!(profile_.d2h_bandwidth > 0)) bad_field("profile", "d2h_bandwidth_Bps", "must be > 0");
  for (std::size_t i = 0; i < profile_.gemm.size(); ++i) {
    const GemmSample& s = profile_.gemm[i];
    if (s.M <= 0 || s.N <= 0 || s.K <= 0 || !(s.rate > 0) || !std::isfinite(s.rate))
      bad_field("profile", fmt::format("gemm[{}]", i), "must have positive extents and a positive finite rate");
    const Seconds t = flops(s.M, s.N, s.K) / s.rate;
    for (const GemmLayout pool : {GemmLayout::any, s.layout}) {
      Lines& lines = lines_[int(pool)];
      lines[0][{s.N, s.K}].emplace_back(s.M, t);
      lines[1][{s.M, s.K}].emplace_back(s.N, t);
      lines[2][{s.M, s.N}].emplace_back(s.K, t);
      if (pool == s.layout) break;  // a sample without a layout goes to the `any` pool once
    }
  }
  for (Lines& pool : lines_) {
    for (auto& axis : pool) {
      for (auto& [key, line] : axis) {
        std::sort(line.begin(), line.end());
        // A shape measured twice keeps the mean of its times.
        Line merged;
        for (std::size_t i = 0; i < line.size();) {
          std::size_t j = i;
          Seconds sum = 0;
          while (j < line.size() && line[j].first == line[i].first) sum += line[j++].second;
          merged.emplace_back(line[i].first, sum / double(j - i));
          i = j;
        }
        std::vector<Seconds> times;
        for (const auto& pt : merged) times.push_back(pt.second);
        make_nondecreasing(times);
        for (std::size_t i = 0; i < merged.size(); ++i) merged[i].second = times[i];
        line = std::move(merged);
      }
    }
  }
  for (const InSituOp& x : profile_.in_situ_ops) in_situ_ops_[{x.kind, x.shape}] = x.seconds;
  for (const InSituScale& x : profile_.in_situ_scales) in_situ_scales_[{x.kind, x.in, x.out}] = x.scale;
  for (auto& [op, points] : profile_.op_tables) {
    std::sort(points.begin(), points.end(), [](const OpSample& a, const OpSample& b) { return a.bytes < b.bytes; });
    std::vector<Seconds> times;
    for (const OpSample& pt : points) times.push_back(pt.seconds);
    make_nondecreasing(times);
    for (std::size_t i = 0; i < points.size(); ++i) points[i].seconds = times[i];
  }
}

FlopsPerSecond CostModel::gemm_rate(std::int64_t M, std::int64_t N, std::int64_t K, GemmLayout layout) const {
  FlopsPerSecond rate = 0;
  if (layout != GemmLayout::any && line_rate(lines_[int(layout)], M, N, K, &rate)) return rate;
  if (line_rate(lines_[int(GemmLayout::any)], M, N, K, &rate)) return rate;

  // 3. Nearest samples in log-extent space.
  std::vector<std::pair<double, double>> dist_lograte;  // (squared distance, log rate)
  dist_lograte.reserve(profile_.gemm.size());
  for (const GemmSample& s : profile_.gemm) {
    const double dm = std::log2(double(M) / double(s.M)), dn = std::log2(double(N) / double(s.N)),
                 dk = std::log2(double(K) / double(s.K));
    dist_lograte.emplace_back(dm * dm + dn * dn + dk * dk, std::log(s.rate));
  }
  const std::size_t k = std::min(kGemmNeighbours, dist_lograte.size());
  std::partial_sort(dist_lograte.begin(), dist_lograte.begin() + std::ptrdiff_t(k), dist_lograte.end());
  double wsum = 0, acc = 0;
  for (std::size_t i = 0; i < k; ++i) {
    const double w = 1.0 / dist_lograte[i].first;  // distance > 0: exact shapes returned above
    wsum += w;
    acc += w * dist_lograte[i].second;
  }
  return std::exp(acc / wsum);
}

bool CostModel::line_rate(const Lines& lines, std::int64_t M, std::int64_t N, std::int64_t K, FlopsPerSecond* rate) {
  const std::int64_t ext[3] = {M, N, K};
  const double f = flops(M, N, K);
  // 2. Lines through the query (an exact sample is a line point at distance 0).
  double best_span = std::numeric_limits<double>::infinity();
  Seconds best_time = 0;
  double nearest_end = std::numeric_limits<double>::infinity();
  FlopsPerSecond nearest_end_rate = 0;
  for (int a = 0; a < 3; ++a) {
    const LineKey key = a == 0 ? LineKey{N, K} : a == 1 ? LineKey{M, K} : LineKey{M, N};
    auto it = lines[a].find(key);
    if (it == lines[a].end()) continue;
    const Line& line = it->second;
    const std::int64_t x = ext[a];
    auto hi = std::lower_bound(line.begin(), line.end(), std::pair<std::int64_t, Seconds>{x, -1.0});
    if (hi != line.end() && hi->first == x) {  // 1. exact
      *rate = f / hi->second;
      return true;
    }
    if (hi != line.begin() && hi != line.end()) {
      const auto lo = hi - 1;
      const double span = std::log(double(hi->first) / double(lo->first));
      if (span < best_span) {
        best_span = span;
        const double w = double(x - lo->first) / double(hi->first - lo->first);
        best_time = lo->second + w * (hi->second - lo->second);
      }
      continue;
    }
    const auto& end = hi == line.end() ? line.back() : line.front();
    const double dist = std::abs(std::log(double(x) / double(end.first)));
    if (dist < nearest_end) {
      nearest_end = dist;
      const std::int64_t e[3] = {a == 0 ? end.first : M, a == 1 ? end.first : N, a == 2 ? end.first : K};
      nearest_end_rate = flops(e[0], e[1], e[2]) / end.second;
    }
  }
  if (std::isfinite(best_span)) {
    *rate = f / best_time;
    return true;
  }
  if (std::isfinite(nearest_end)) {
    *rate = nearest_end_rate;
    return true;
  }
  return false;
}

Seconds CostModel::gemm(std::int64_t M, std::int64_t N, std::int64_t K, GemmLayout layout) const {
  if (M <= 0 || N <= 0) return 0;
  if (K <= 0) return elementwise(M * N * kActivationBytes);
  return flops(M, N, K) / gemm_rate(M, N, K, layout);
}

Seconds CostModel::grouped_gemm(const std::vector<std::int64_t>& rows_per_group, std::int64_t N, std::int64_t K,
                                GemmLayout layout) const {
  Seconds t = 0;
  for (std::int64_t rows : rows_per_group)
    if (rows > 0) t += gemm(rows, N, K, layout);
  return t;
}

Seconds CostModel::elementwise(Bytes bytes_moved) const {
  if (bytes_moved <= 0) return 0;
  auto it = profile_.op_tables.find(op_names::kElementwise);
  if (it != profile_.op_tables.end() && !it->second.empty())
    return table_time(it->second, bytes_moved, profile_.launch_overhead);
  return profile_.launch_overhead + double(bytes_moved) / profile_.memory_bandwidth;
}

Seconds CostModel::copy_h2d(Bytes bytes) const {
  if (bytes <= 0) return 0;
  auto it = profile_.op_tables.find(op_names::kCopyH2D);
  if (it != profile_.op_tables.end() && !it->second.empty()) return table_time(it->second, bytes, profile_.copy_latency);
  return profile_.copy_latency + double(bytes) / profile_.h2d_bandwidth;
}

Seconds CostModel::copy_d2h(Bytes bytes) const {
  if (bytes <= 0) return 0;
  auto it = profile_.op_tables.find(op_names::kCopyD2H);
  if (it != profile_.op_tables.end() && !it->second.empty()) return table_time(it->second, bytes, profile_.copy_latency);
  return profile_.copy_latency + double(bytes) / profile_.d2h_bandwidth;
}

Seconds CostModel::op(const std::string& name, Bytes bytes) const {
  if (bytes <= 0) return 0;
  auto it = profile_.op_tables.find(name);
  if (it == profile_.op_tables.end() || it->second.empty()) return elementwise(bytes);
  return table_time(it->second, bytes, profile_.launch_overhead);
}

Seconds CostModel::table_time(const std::vector<OpSample>& pts, Bytes bytes, Seconds zero_time) {
  const double x = double(bytes);
  if (bytes <= pts.front().bytes) {
    const double w = x / double(pts.front().bytes);
    return zero_time + w * (pts.front().seconds - zero_time);
  }
  if (bytes >= pts.back().bytes) return pts.back().seconds * x / double(pts.back().bytes);
  auto hi = std::lower_bound(pts.begin(), pts.end(), bytes, [](const OpSample& p, Bytes b) { return p.bytes < b; });
  const auto lo = hi - 1;
  const double w = (x - double(lo->bytes)) / double(hi->bytes - lo->bytes);
  return lo->seconds + w * (hi->seconds - lo->seconds);
}

Seconds CostModel::rmsnorm_forward(std::int64_t n, std::int64_t d) const {
  if (n <= 0 || d <= 0) return 0;
  if (const Seconds* t = in_situ("rmsnorm_forward", {n, d})) return *t;
  return op(op_names::kRmsnormForward, op_bytes::rmsnorm_forward(n, d));
}

Seconds CostModel::rmsnorm_backward(std::int64_t n, std::int64_t d) const {
  if (n <= 0 || d <= 0) return 0;
  if (const Seconds* t = in_situ("rmsnorm_backward", {n, d})) return *t;
  return op(op_names::kRmsnormBackward, op_bytes::rmsnorm_backward(n, d));
}

Seconds CostModel::rope(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t hd) const {
  if (B <= 0 || S <= 0 || H <= 0 || hd <= 0) return 0;
  return op(op_names::kRopeTables, op_bytes::rope_tables(S, hd)) + op(op_names::kRope, op_bytes::rope(B, S, H, hd));
}

Seconds CostModel::rope_forward(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t hd) const {
  if (B <= 0 || S <= 0 || H <= 0 || hd <= 0) return 0;
  if (const Seconds* t = in_situ("rope_forward", {B, S, H, hd})) return *t;
  return rope(B, S, H, hd);
}

Seconds CostModel::rope_backward(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t hd) const {
  if (B <= 0 || S <= 0 || H <= 0 || hd <= 0) return 0;
  if (const Seconds* t = in_situ("rope_backward", {B, S, H, hd})) return *t;
  return rope(B, S, H, hd);
}

Seconds CostModel::add_inplace(std::int64_t n) const {
  if (n <= 0) return 0;
  if (const Seconds* t = in_situ("add_inplace", {n})) return *t;
  return elementwise(op_bytes::add_inplace(n));
}

Seconds CostModel::embedding_forward(std::int64_t n, std::int64_t d) const {
  if (n <= 0 || d <= 0) return 0;
  if (const Seconds* t = in_situ("embedding_forward", {n, d})) return *t;
  return elementwise(Bytes(2) * n * d * kActivationBytes);
}

Seconds CostModel::embedding_backward(std::int64_t n, std::int64_t d) const {
  if (n <= 0 || d <= 0) return 0;
  if (const Seconds* t = in_situ("embedding_backward", {n, d})) return *t;
  return elementwise(op_bytes::add_inplace(n * d));
}

Seconds CostModel::aux_loss_forward(std::int64_t n, std::int64_t E, std::int64_t k) const {
  if (n <= 0) return 0;
  if (const Seconds* t = in_situ("aux_loss_forward", {n, E, k})) return *t;
  return elementwise(Bytes(n) * (E + k) * kActivationBytes);
}

Seconds CostModel::aux_loss_backward(std::int64_t n, std::int64_t E, std::int64_t k) const {
  if (n <= 0) return 0;
  if (const Seconds* t = in_situ("aux_loss_backward", {n, E, k})) return *t;
  return elementwise(Bytes(n) * (E + k) * kActivationBytes);
}

Seconds CostModel::z_loss_forward(std::int64_t n, std::int64_t E) const {
  if (n <= 0) return 0;
  if (const Seconds* t = in_situ("z_loss_forward", {n, E})) return *t;
  return elementwise(Bytes(n) * E * kActivationBytes);
}

Seconds CostModel::z_loss_backward(std::int64_t n, std::int64_t E) const {
  if (n <= 0) return 0;
  if (const Seconds* t = in_situ("z_loss_backward", {n, E})) return *t;
  return elementwise(Bytes(2) * n * E * kActivationBytes);
}

Seconds CostModel::attention_forward(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t hd) const {
  if (B <= 0 || S <= 0 || H <= 0 || hd <= 0) return 0;
  if (const Seconds* t = in_situ("attention_forward", {B, S, H, hd})) return *t;
  if (profile_.op_tables.count(op_names::kAttentionForward))
    return double(B * H) * op(op_names::kAttentionForward, op_bytes::attention_softmax_forward(1, S, 1));
  const Seconds per_head = gemm(S, S, hd, GemmLayout::nt) + gemm(S, hd, S, GemmLayout::nn);
  return double(B * H) * per_head +
         op(op_names::kAttentionSoftmaxForward, op_bytes::attention_softmax_forward(B, S, H));
}

Seconds CostModel::attention_backward(std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t hd) const {
  if (B <= 0 || S <= 0 || H <= 0 || hd <= 0) return 0;
  if (const Seconds* t = in_situ("attention_backward", {B, S, H, hd})) return *t;
  if (profile_.op_tables.count(op_names::kAttentionBackward))
    return double(B * H) * op(op_names::kAttentionBackward, op_bytes::attention_softmax_forward(1, S, 1));
  // dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q.
  const Seconds per_head = 2 * gemm(S, hd, S, GemmLayout::tn) + gemm(S, hd, S, GemmLayout::nn) +
                           gemm(S, S, hd, GemmLayout::nt);
  return double(B * H) * per_head +
         op(op_names::kAttentionSoftmaxBackward, op_bytes::attention_softmax_backward(B, S, H));
}

Seconds CostModel::swiglu_forward(std::int64_t n) const {
  if (n <= 0) return 0;
  if (const Seconds* t = in_situ("swiglu_forward", {n})) return *t;
  return op(op_names::kSwigluForward, op_bytes::swiglu_forward(n));
}

Seconds CostModel::swiglu_backward(std::int64_t n) const {
  if (n <= 0) return 0;
  if (const Seconds* t = in_situ("swiglu_backward", {n})) return *t;
  return op(op_names::kSwigluBackward, op_bytes::swiglu_backward(n));
}

Seconds CostModel::router_forward(std::int64_t n, std::int64_t E, std::int64_t k) const {
  if (n <= 0) return 0;
  if (const Seconds* t = in_situ("router_forward", {n, E, k})) return *t;
  return op(op_names::kRouterForward, op_bytes::router_forward(n, E, k));
}

Seconds CostModel::router_backward(std::int64_t n, std::int64_t E, std::int64_t k) const {
  if (n <= 0) return 0;
  if (const Seconds* t = in_situ("router_backward", {n, E, k})) return *t;
  return op(op_names::kRouterBackward, op_bytes::router_backward(n, E, k));
}

Seconds CostModel::permute_forward(std::int64_t n, std::int64_t k, std::int64_t d) const {
  if (n <= 0) return 0;
  if (const Seconds* t = in_situ("permute_forward", {n, k, d})) return *t;
  return op(op_names::kPermuteForward, op_bytes::permute(n, k, d));
}

Seconds CostModel::permute_backward(std::int64_t n, std::int64_t k, std::int64_t d) const {
  if (n <= 0) return 0;
  if (const Seconds* t = in_situ("permute_backward", {n, k, d})) return *t;
  return op(op_names::kPermuteBackward, op_bytes::permute(n, k, d));
}

Seconds CostModel::unpermute_forward(std::int64_t n, std::int64_t k, std::int64_t d) const {
  if (n <= 0) return 0;
  if (const Seconds* t = in_situ("unpermute_forward", {n, k, d})) return *t;
  return op(op_names::kUnpermuteForward, op_bytes::permute(n, k, d));
}

Seconds CostModel::unpermute_backward(std::int64_t n, std::int64_t k, std::int64_t d) const {
  if (n <= 0) return 0;
  if (const Seconds* t = in_situ("unpermute_backward", {n, k, d})) return *t;
  return op(op_names::kUnpermuteBackward, op_bytes::permute(n, k, d));
}

Seconds CostModel::combine_topk_grad(std::int64_t n, std::int64_t k, std::int64_t d, std::int64_t rows) const {
  if (n <= 0 || rows <= 0) return 0;
  return elementwise((2 * rows * d + n * k) * kActivationBytes);
}

Seconds CostModel::cross_entropy_forward(std::int64_t n, std::int64_t V) const {
  if (n <= 0) return 0;
  if (const Seconds* t = in_situ("cross_entropy_forward", {n, V})) return *t;
  return op(op_names::kCrossEntropyForward, op_bytes::cross_entropy(n, V));
}

Seconds CostModel::cross_entropy_backward(std::int64_t n, std::int64_t V) const {
  if (n <= 0) return 0;
  if (const Seconds* t = in_situ("cross_entropy_backward", {n, V})) return *t;
  return op(op_names::kCrossEntropyBackward, op_bytes::cross_entropy(n, V));
}

Seconds CostModel::linear_forward(std::int64_t n, std::int64_t in, std::int64_t out) const {
  if (n > 0)
    if (const Seconds* t = in_situ("linear_forward", {n, in, out})) return *t;
  return gemm(n, out, in, GemmLayout::nt);
}

Seconds CostModel::linear_backward(std::int64_t n, std::int64_t in, std::int64_t out, bool want_dx,
                                   bool want_dw) const {
  if (n <= 0) return 0;  // the kernel's dw GEMM has K = 0 and changes nothing
  if (want_dx && want_dw)
    if (const Seconds* t = in_situ("linear_backward", {n, in, out})) return *t;
  Seconds t = 0;
  if (want_dx) {
    const Seconds* m = in_situ("linear_backward_dx", {n, in, out});
    t += m ? *m : gemm(n, in, out, GemmLayout::nn);
  }
  if (want_dw) {
    const Seconds* m = in_situ("linear_backward_dw", {n, in, out});
    t += m ? *m : gemm(out, in, n, GemmLayout::tn);
  }
  return t;
}

Seconds CostModel::grouped_linear_forward(const std::vector<std::int64_t>& rows_per_group, std::int64_t in,
                                          std::int64_t out) const {
  return in_situ_scale("grouped_linear_forward", in, out) * grouped_gemm(rows_per_group, out, in, GemmLayout::nt);
}

Seconds CostModel::grouped_linear_backward(const std::vector<std::int64_t>& rows_per_group, std::int64_t in,
                                           std::int64_t out, bool want_dx, bool want_dw) const {
  Seconds dx = 0, dw = 0;
  for (std::int64_t rows : rows_per_group) {
    if (rows <= 0) continue;  // skipped by the kernel, like the forward
    if (want_dx) dx += gemm(rows, in, out, GemmLayout::nn);
    if (want_dw) dw += gemm(out, in, rows, GemmLayout::tn);
  }
  return in_situ_scale("grouped_linear_backward_dx", in, out) * dx +
         in_situ_scale("grouped_linear_backward_dw", in, out) * dw;
}

const Seconds* CostModel::in_situ(const char* kind, std::initializer_list<std::int64_t> shape) const {
  if (in_situ_ops_.empty()) return nullptr;
  auto it = in_situ_ops_.find({std::string(kind), std::vector<std::int64_t>(shape)});
  return it == in_situ_ops_.end() ? nullptr : &it->second;
}

double CostModel::in_situ_scale(const char* kind, std::int64_t in, std::int64_t out) const {
  if (in_situ_scales_.empty()) return 1.0;
  auto it = in_situ_scales_.find({std::string(kind), in, out});
  return it == in_situ_scales_.end() ? 1.0 : it->second;
}

Seconds overlapped(Seconds extra, Seconds available) { return std::max<Seconds>(0, extra - available); }

}  // namespace moeflex
