// The op-case registry's machinery (op_cases.h): tensors of a case on a backend, the
// helpers cases are written with, the registry and the timing mode's table.
#include "op_cases.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <stdexcept>

#include <gtest/gtest.h>

#include "moeflex/core/bf16.h"
#include "moeflex/core/rng.h"
#include "op_harness.h"

namespace moeflex::test {

// ---------------------------------------------------------------------------------
// OpTensors

OpTensors::OpTensors(ops::Backend& backend, Arena& arena, DType act, std::vector<TensorSpec> specs)
    : backend_(backend), act_(act), specs_(std::move(specs)) {
  slots_.resize(specs_.size());
  for (std::size_t s = 0; s < specs_.size(); ++s) {
    const TensorSpec& t = specs_[s];
    if (!t.init.empty() && std::int64_t(t.init.size()) != t.numel)
      throw std::logic_error("op case tensor " + t.name + ": init has " + std::to_string(t.init.size()) +
                             " values for " + std::to_string(t.numel) + " elements");
    for (std::size_t o = 0; o < s; ++o)
      if (specs_[o].name == t.name) throw std::logic_error("op case tensor " + t.name + " declared twice");
    if (t.elem == Elem::host_i32) {
      slots_[s].host.assign(std::size_t(std::max<std::int64_t>(t.numel, 1)), -1);
    } else {
      // At least one element: an empty tensor still has a valid pointer.
      slots_[s].tensor = Tensor(arena, {std::max<std::int64_t>(t.numel, 1)}, MemCategory::activations, t.name,
                                dtype_of(t.elem));
    }
  }
  reset();
}

DType OpTensors::dtype_of(Elem e) const {
  switch (e) {
    case Elem::act: return act_;
    case Elem::f32: return DType::f32;
    default: return DType::i32;
  }
}

std::size_t OpTensors::index(std::string_view name) const {
  for (std::size_t s = 0; s < specs_.size(); ++s)
    if (specs_[s].name == name) return s;
  throw std::logic_error("op case has no tensor named " + std::string(name));
}

const TensorSpec& OpTensors::spec(std::string_view name) const { return specs_[index(name)]; }

View OpTensors::v(std::string_view name) {
  Slot& s = slots_[index(name)];
  if (!s.tensor.defined()) throw std::logic_error("op case tensor " + std::string(name) + " is a host array");
  return s.tensor.view();
}

std::int32_t* OpTensors::i(std::string_view name) {
  Slot& s = slots_[index(name)];
  return s.tensor.defined() ? s.tensor.i32() : s.host.data();
}

void OpTensors::set(std::string_view name, const std::vector<double>& values) {
  const std::size_t s = index(name);
  const TensorSpec& t = specs_[s];
  Slot& slot = slots_[s];
  if (t.elem == Elem::host_i32) {
    if (values.empty()) std::fill(slot.host.begin(), slot.host.end(), -1);
    for (std::size_t e = 0; e < values.size(); ++e) slot.host[e] = std::int32_t(values[e]);
    return;
  }
  const DType dt = slot.tensor.dtype();
  const Bytes bytes = slot.tensor.nbytes();
  std::vector<unsigned char> raw(std::size_t(bytes), 0xff);  // NaN for f32 and bf16 when no values
  for (std::size_t e = 0; e < values.size(); ++e) {
    if (dt == DType::f32) reinterpret_cast<float*>(raw.data())[e] = float(values[e]);
    else if (dt == DType::bf16) reinterpret_cast<bf16*>(raw.data())[e] = to_bf16(float(values[e]));
    else reinterpret_cast<std::int32_t*>(raw.data())[e] = std::int32_t(values[e]);
  }
  backend_.copy_from_host(slot.tensor.raw(), raw.data(), bytes);
}

std::vector<double> OpTensors::read(std::string_view name) const {
  const std::size_t s = index(name);
  const TensorSpec& t = specs_[s];
  const Slot& slot = slots_[s];
  std::vector<double> out(std::size_t(t.numel));
  if (t.elem == Elem::host_i32) {
    for (std::size_t e = 0; e < out.size(); ++e) out[e] = slot.host[e];
    return out;
  }
  std::vector<unsigned char> raw(std::size_t(slot.tensor.nbytes()));
  backend_.copy_to_host(raw.data(), slot.tensor.raw(), slot.tensor.nbytes());
  const DType dt = slot.tensor.dtype();
  for (std::size_t e = 0; e < out.size(); ++e) {
    if (dt == DType::f32) out[e] = reinterpret_cast<const float*>(raw.data())[e];
    else if (dt == DType::bf16) out[e] = to_float(reinterpret_cast<const bf16*>(raw.data())[e]);
    else out[e] = reinterpret_cast<const std::int32_t*>(raw.data())[e];
  }
  return out;
}

std::vector<double> OpTensors::stored_init(std::string_view name) const {
  const std::size_t s = index(name);
  std::vector<double> v = specs_[s].init;
  const DType dt = slots_[s].tensor.defined() ? slots_[s].tensor.dtype() : DType::i32;
  for (double& x : v) {
    if (dt == DType::f32) x = float(x);
    else if (dt == DType::bf16) x = to_float(to_bf16(float(x)));
    else x = double(std::int32_t(x));
  }
  return v;
}

void OpTensors::reset() {
  for (const TensorSpec& t : specs_) set(t.name, t.init);
}

// ---------------------------------------------------------------------------------
// Helpers for cases

namespace {

TensorSpec tensor(std::string name, Elem elem, std::int64_t numel, Role role, std::vector<double> init = {}) {
  TensorSpec t;
  t.name = std::move(name);
  t.elem = elem;
  t.numel = numel;
  t.role = role;
  t.init = std::move(init);
  t.compare = role == Role::output || role == Role::saved;
  return t;
}

}  // namespace

TensorSpec input(std::string name, Elem elem, std::int64_t numel, std::uint64_t stream, double scale) {
  return tensor(std::move(name), elem, numel, Role::input, random_vec(std::size_t(numel), stream, scale));
}

TensorSpec input_values(std::string name, Elem elem, std::vector<double> values) {
  const auto n = std::int64_t(values.size());
  return tensor(std::move(name), elem, n, Role::input, std::move(values));
}

TensorSpec in_place(std::string name, Elem elem, std::int64_t numel, std::uint64_t stream, double scale) {
  TensorSpec t = input(std::move(name), elem, numel, stream, scale);
  t.compare = true;
  return t;
}

TensorSpec output(std::string name, Elem elem, std::int64_t numel) {
  return tensor(std::move(name), elem, numel, Role::output);
}

TensorSpec saved(std::string name, Elem elem, std::int64_t numel, bool compare) {
  TensorSpec t = tensor(std::move(name), elem, numel, Role::saved);
  t.compare = compare;
  return t;
}

TensorSpec scratch(std::string name, Elem elem, std::int64_t numel) {
  return tensor(std::move(name), elem, numel, Role::scratch);
}

TensorSpec seed(std::string name, std::string of, Elem elem, std::int64_t numel, std::uint64_t stream) {
  TensorSpec t = tensor(std::move(name), elem, numel, Role::seed, random_vec(std::size_t(numel), stream));
  t.of = std::move(of);
  return t;
}

TensorSpec seed_in_place(std::string name, std::string of, std::string grad_of, Elem elem, std::int64_t numel,
                         std::uint64_t stream) {
  TensorSpec t = seed(std::move(name), std::move(of), elem, numel, stream);
  t.grad_of = std::move(grad_of);
  return t;
}

TensorSpec grad(std::string name, std::string of, Elem elem, std::int64_t numel) {
  TensorSpec t = tensor(std::move(name), elem, numel, Role::grad);
  t.of = std::move(of);
  return t;
}

TensorSpec grad_acc(std::string name, std::string of, Elem elem, std::int64_t numel, std::uint64_t stream) {
  TensorSpec t = tensor(std::move(name), elem, numel, Role::grad, random_vec(std::size_t(numel), stream));
  t.of = std::move(of);
  t.accumulate = true;
  return t;
}

std::vector<std::int32_t> skewed_topk(std::int64_t n, std::int64_t E, std::int64_t k, std::int32_t hot,
                                      std::int64_t cold, std::uint64_t stream) {
  const std::int64_t warm = E - cold;  // experts [0, warm) may be picked
  std::vector<std::int32_t> idx(std::size_t(n * k));
  for (std::int64_t i = 0; i < n; ++i) {
    std::vector<std::int32_t> order(static_cast<std::size_t>(warm));
    std::iota(order.begin(), order.end(), 0);
    // A per-token shuffle of the warm experts (Fisher-Yates on fixed draws)...
    for (std::int64_t j = warm - 1; j > 0; --j) {
      const auto r = std::int64_t(uniform01(1234, stream, std::uint64_t(i * E + j)) * double(j + 1));
      std::swap(order[std::size_t(j)], order[std::size_t(std::min(r, j))]);
    }
    // ...then the hot expert first for about 70% of the tokens.
    if (uniform01(4321, stream, std::uint64_t(i)) < 0.7) {
      const auto it = std::find(order.begin(), order.end(), hot);
      std::rotate(order.begin(), it, it + 1);
    }
    for (std::int64_t j = 0; j < k; ++j) idx[std::size_t(i * k + j)] = order[std::size_t(j)];
  }
  return idx;
}

std::vector<double> separated_router_logits(std::int64_t n, std::int64_t E, std::int64_t k, std::int32_t hot,
                                            std::int64_t cold, double gap, std::uint64_t stream) {
  // Rank r of a row gets the logit (E - 1 - r) * 2 gap + noise in [-gap/2, gap/2): the
  // top-k of skewed_topk come first (in its order), the remaining experts after them.
  const auto topk = skewed_topk(n, E, k, hot, cold, stream);
  std::vector<double> logits(std::size_t(n * E));
  const auto noise = random_vec(std::size_t(n * E), stream + 1, gap / 2);
  for (std::int64_t i = 0; i < n; ++i) {
    std::vector<std::int32_t> order(topk.begin() + i * k, topk.begin() + (i + 1) * k);
    for (std::int32_t e = 0; e < std::int32_t(E); ++e)
      if (std::find(order.begin(), order.end(), e) == order.end()) order.push_back(e);
    for (std::int64_t r = 0; r < E; ++r) {
      const std::size_t at = std::size_t(i * E + order[std::size_t(r)]);
      logits[at] = double(E - 1 - r) * 2 * gap + noise[at] - double(E) * gap;  // centred near 0
    }
  }
  return logits;
}

std::string shape_of(std::initializer_list<std::pair<const char*, std::int64_t>> dims) {
  std::string s;
  for (const auto& [k, v] : dims) {
    if (!s.empty()) s += ',';
    s.append(k).append("=").append(std::to_string(v));
  }
  return s;
}

// ---------------------------------------------------------------------------------
// Registry

const std::vector<OpCase>& op_cases() {
  static const std::vector<OpCase> cases = [] {
    std::vector<OpCase> c;
    add_dense_cases(c);
    add_moe_cases(c);
    for (std::size_t a = 0; a < c.size(); ++a)
      for (std::size_t b = 0; b < a; ++b)
        if (c[a].name == c[b].name) throw std::logic_error("op case " + c[a].name + " registered twice");
    return c;
  }();
  return cases;
}

std::vector<const OpCase*> all_op_case_pointers() {
  std::vector<const OpCase*> out;
  for (const OpCase& c : op_cases()) out.push_back(&c);
  return out;
}

std::vector<const OpCase*> op_cases_for_gradients() {
  std::vector<const OpCase*> out;
  for (const OpCase& c : op_cases())
    if (c.backward && !c.timing_size) out.push_back(&c);
  return out;
}

std::string gradient_input(const TensorSpec& t) {
  if (t.role == Role::grad) return t.of;
  if (t.role == Role::seed) return t.grad_of;
  return "";
}

std::vector<double> gradient_written(const OpTensors& tensors, const TensorSpec& t) {
  std::vector<double> g = tensors.read(t.name);
  if (t.accumulate) {
    const std::vector<double> prior = tensors.stored_init(t.name);
    for (std::size_t e = 0; e < g.size(); ++e) g[e] -= prior[e];
  }
  return g;
}

namespace {

bool is_integer(Elem e) { return e == Elem::i32 || e == Elem::host_i32; }

void expect_match(const std::string& where, bool integer, const std::vector<double>& got,
                  const std::vector<double>& want, double tol) {
  if (integer) {
    EXPECT_EQ(got, want) << where;
    return;
  }
  const double err = rel_err(got, want);
  EXPECT_TRUE(err <= tol) << where << ": relative error " << err << " (tolerance " << tol << ")";
}

}  // namespace

void expect_runs_match(const OpCase& c, OpRun tested, OpRun reference, double tol) {
  std::vector<TensorSpec> specs = c.build();
  for (TensorSpec& t : specs) {
    if (t.elem != Elem::act || tested.act != DType::bf16) continue;
    for (double& x : t.init) x = to_float(to_bf16(float(x)));
  }
  OpTensors want(reference.backend, reference.arena, reference.act, specs);
  OpTensors got(tested.backend, tested.arena, tested.act, specs);
  const std::string run = c.name + " (" + c.shape + ") " + to_string(tested.backend.kind()) + " " +
                          to_string(tested.act) + " against " + to_string(reference.backend.kind()) + " " +
                          to_string(reference.act) + ": ";
  const double loss_want = c.forward(reference.backend, want), loss_got = c.forward(tested.backend, got);
  expect_match(run + "the forward's scalar", false, {loss_got}, {loss_want}, tol);
  for (const TensorSpec& t : specs)
    if (t.compare && t.role != Role::scratch)
      expect_match(run + t.name + " (forward)", is_integer(t.elem), got.read(t.name), want.read(t.name), tol);
  if (!c.backward) return;
  c.backward(reference.backend, want);
  c.backward(tested.backend, got);
  for (const TensorSpec& t : specs) {
    if (gradient_input(t).empty()) continue;
    expect_match(run + t.name + (t.accumulate ? " (backward, +=)" : " (backward)"), false, gradient_written(got, t),
                 gradient_written(want, t), tol);
  }
}

// ---------------------------------------------------------------------------------
// Timing

Arena& cpu_arena() {
  static ops::DeviceContext ctx = ops::make_cpu_context(Arena::kUnlimited);
  return *ctx.arena;
}

double median_ms(ops::Backend& backend, const std::function<void()>& run) {
  using clock = std::chrono::steady_clock;
  constexpr int kMinRuns = 5, kMaxRuns = 200;
  constexpr double kMinTotalMs = 200;
  for (int w = 0; w < 2; ++w) run();
  backend.synchronize();
  std::vector<double> ms;
  double total = 0;
  while (int(ms.size()) < kMinRuns || (total < kMinTotalMs && int(ms.size()) < kMaxRuns)) {
    const auto t0 = clock::now();
    run();
    backend.synchronize();
    const double t = std::chrono::duration<double, std::milli>(clock::now() - t0).count();
    ms.push_back(t);
    total += t;
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

TimingRow time_case(const OpCase& c, ops::Backend& backend, Arena& arena, DType act) {
  OpTensors t(backend, arena, act, c.build());
  TimingRow row{to_string(backend.kind()), to_string(act), c.name, c.shape};
  row.forward_flops = c.forward_flops;
  row.backward_flops = c.backward_flops;
  row.forward_ms = median_ms(backend, [&] { c.forward(backend, t); });
  if (c.backward) {
    t.reset();
    c.forward(backend, t);
    row.backward_ms = median_ms(backend, [&] { c.backward(backend, t); });
  }
  return row;
}

void print_timing_table(const std::vector<TimingRow>& rows) {
  auto gflops = [](double flops, double ms) {
    char buf[32];
    if (flops <= 0 || ms <= 0) return std::string("-");
    std::snprintf(buf, sizeof buf, "%.2f", flops / (ms * 1e-3) / 1e9);
    return std::string(buf);
  };
  std::printf("\n%-5s %-5s %-34s %-36s %11s %9s %11s %9s\n", "dev", "dtype", "case", "shape", "fwd ms", "GFLOP/s",
              "bwd ms", "GFLOP/s");
  for (const TimingRow& r : rows) {
    char bwd[32] = "-";
    if (r.backward_ms >= 0) std::snprintf(bwd, sizeof bwd, "%.4f", r.backward_ms);
    std::printf("%-5s %-5s %-34s %-36s %11.4f %9s %11s %9s\n", r.device.c_str(), r.dtype.c_str(), r.name.c_str(),
                r.shape.c_str(), r.forward_ms, gflops(r.forward_flops, r.forward_ms).c_str(), bwd,
                r.backward_ms >= 0 ? gflops(r.backward_flops, r.backward_ms).c_str() : "-");
  }
  std::fflush(stdout);
}

namespace {

/// The timing rows of this program, printed as one table after the last test.
class TimingTable : public ::testing::Environment {
 public:
  static std::vector<TimingRow>& rows() {
    static std::vector<TimingRow> r;
    return r;
  }
  void TearDown() override {
    if (!rows().empty()) print_timing_table(rows());
  }
};
[[maybe_unused]] ::testing::Environment* const kTimingTable = ::testing::AddGlobalTestEnvironment(new TimingTable);

}  // namespace

void record_timing(const TimingRow& row) {
  TimingTable::rows().push_back(row);
}

bool timing_requested() {
  const char* s = std::getenv("MOEFLEX_OP_TIMING");
  return s && *s && std::string(s) != "0";
}

}  // namespace moeflex::test
