// The cross-backend op harness, CUDA part (STYLE habit 4; the CPU part is
// op_harness.h). Each CUDA op test:
//   - builds random inputs in double, rounds them to the device's storage type
//     (float or bf16) and runs the CPU reference op (ops/*.h) in double on exactly
//     those rounded values, so the comparison measures the GPU op's own error;
//   - pre-fills "=" outputs with NaN (an element the kernel forgets stays NaN and
//     fails the comparison) and "+=" outputs with random values;
//   - compares with relative error in norm, ||gpu - ref|| / ||ref||: 1e-2 for bf16
//     outputs, 1e-5 for fp32 outputs;
//   - times the op with CUDA events (median of kTimedRuns after warm-up) and reports
//     one row per (op, dtype, shape): printed, and appended as tab-separated values
//     to the file named by MOEFLEX_OP_REPORT (scripts/gpu-check.sh reads it).
// Without a GPU every test skips with "skipped: no GPU (<reason>)".
// MOEFLEX_OP_BENCH=1 enables test_cuda_bench.cpp's timing-only runs at training-size shapes.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "moeflex/core/bf16.h"
#include "moeflex/core/cuda/buffer.h"
#include "moeflex/core/cuda/cuda_check.h"
#include "moeflex/core/cuda/device.h"
#include "moeflex/core/cuda/stream.h"
#include "moeflex/ops/cuda/blas.h"
#include "op_harness.h"

/// Skips the calling test visibly when CUDA reports no usable device.
#define MOEFLEX_REQUIRE_GPU()                                                                     \
  do {                                                                                            \
    if (::moeflex::cuda::device_count() == 0)                                                     \
      GTEST_SKIP() << "skipped: no GPU (" << ::moeflex::cuda::no_device_reason() << ")";          \
  } while (0)

namespace moeflex::test {

namespace cu = moeflex::cuda;

/// Tolerances of the harness: relative error in norm against the double reference.
constexpr double kTolBf16 = 1e-2;
constexpr double kTolF32 = 1e-5;

template <typename T>
constexpr double tol() {
  return std::is_same_v<T, bf16> ? kTolBf16 : kTolF32;
}

template <typename T>
const char* dtype_name() {
  if constexpr (std::is_same_v<T, bf16>) return "bf16";
  else if constexpr (std::is_same_v<T, float>) return "f32";
  else return "i32";
}

/// size_t of a non-negative int64 (sizes of host vectors).
inline std::size_t sz(std::int64_t v) { return static_cast<std::size_t>(v); }

/// The device, one stream, a device arena and a cuBLAS handle, made once per process.
struct Gpu {
  cu::DeviceArena arena;
  cu::Stream stream;
  ops::cuda::Cublas blas;

  Gpu() : arena(budget()), stream(0), blas(arena, stream.get()) {}

  /// MOEFLEX_TEST_GPU_BYTES, else half the free device memory, at most 24 GiB.
  static Bytes budget() {
    if (const char* s = std::getenv("MOEFLEX_TEST_GPU_BYTES")) return parse_size(s);
    cu::set_device(0);
    std::size_t free_b = 0, total_b = 0;
    MOEFLEX_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    return std::min<Bytes>(24 * kGiB, Bytes(free_b / 2));
  }
  cudaStream_t s() const { return stream.get(); }
  void sync() const { stream.synchronize(); }
};

inline Gpu& gpu() {
  static Gpu g;
  return g;
}

/// Storage-type values of `v` (float: rounded to float; bf16: to nearest even).
template <typename T>
std::vector<T> to_storage(const std::vector<double>& v) {
  std::vector<T> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    if constexpr (std::is_same_v<T, bf16>) out[i] = to_bf16(static_cast<float>(v[i]));
    else out[i] = static_cast<T>(v[i]);
  }
  return out;
}

/// Exact widening of storage values to double.
template <typename T>
std::vector<double> widen(const std::vector<T>& v) {
  std::vector<double> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    if constexpr (std::is_same_v<T, bf16>) out[i] = to_float(v[i]);
    else out[i] = static_cast<double>(v[i]);
  }
  return out;
}

/// `v` as the device will see it after upload as T.
template <typename T>
std::vector<double> quantize(const std::vector<double>& v) {
  return widen(to_storage<T>(v));
}

/// A device array of n elements of T from the test arena (activations category).
template <typename T>
class DevArray {
 public:
  DevArray(std::int64_t n, const char* name)
      : n_(n), buf_(gpu().arena, std::max<std::int64_t>(n, 1) * Bytes(sizeof(T)), MemCategory::activations, name) {}
  DevArray(const std::vector<double>& values, const char* name) : DevArray(std::int64_t(values.size()), name) {
    upload(values);
  }

  T* get() const { return buf_.as<T>(); }
  std::int64_t size() const { return n_; }

  void upload_raw(const std::vector<T>& v) {
    EXPECT_EQ(std::int64_t(v.size()), n_);
    if (n_ > 0)
      MOEFLEX_CUDA_CHECK(cudaMemcpyAsync(get(), v.data(), sizeof(T) * v.size(), cudaMemcpyHostToDevice, gpu().s()));
    gpu().sync();
  }
  void upload(const std::vector<double>& v) { upload_raw(to_storage<T>(v)); }
  std::vector<T> download_raw() const {
    std::vector<T> v(static_cast<std::size_t>(n_));
    gpu().sync();
    if (n_ > 0)
      MOEFLEX_CUDA_CHECK(cudaMemcpyAsync(v.data(), get(), sizeof(T) * v.size(), cudaMemcpyDeviceToHost, gpu().s()));
    gpu().sync();
    return v;
  }
  std::vector<double> download() const { return widen(download_raw()); }
  /// Every byte 0xff: NaN for float and bf16 (and -1 for int32).
  void fill_nan() {
    MOEFLEX_CUDA_CHECK(cudaMemsetAsync(get(), 0xff, sizeof(T) * std::size_t(std::max<std::int64_t>(n_, 1)), gpu().s()));
  }

 private:
  std::int64_t n_;
  cu::Buffer buf_;
};

/// Fills a (large) device array with random values quickly: one random block of at
/// most 2^20 values from the host, then copied over the rest on the device (periodic
/// data; enough for timings).
template <typename T>
void fill_random(DevArray<T>& a, std::uint64_t stream, double scale = 0.5) {
  const std::int64_t n = a.size(), block = std::min<std::int64_t>(n, std::int64_t(1) << 20);
  if (n <= 0) return;
  const std::vector<T> host = to_storage<T>(random_vec(std::size_t(block), stream, scale));
  MOEFLEX_CUDA_CHECK(cudaMemcpyAsync(a.get(), host.data(), sizeof(T) * host.size(), cudaMemcpyHostToDevice, gpu().s()));
  for (std::int64_t done = block; done < n; done *= 2) {
    const std::int64_t len = std::min(done, n - done);
    MOEFLEX_CUDA_CHECK(cudaMemcpyAsync(a.get() + done, a.get(), sizeof(T) * std::size_t(len), cudaMemcpyDeviceToDevice,
                                       gpu().s()));
  }
  gpu().sync();
}

/// int32 device arrays (indices, offsets).
class DevInts {
 public:
  DevInts(std::int64_t n, const char* name)
      : n_(n), buf_(gpu().arena, std::max<std::int64_t>(n, 1) * 4, MemCategory::activations, name) {}
  DevInts(const std::vector<std::int32_t>& v, const char* name) : DevInts(std::int64_t(v.size()), name) {
    if (n_ > 0)
      MOEFLEX_CUDA_CHECK(cudaMemcpyAsync(get(), v.data(), 4 * v.size(), cudaMemcpyHostToDevice, gpu().s()));
    gpu().sync();
  }
  std::int32_t* get() const { return buf_.as<std::int32_t>(); }
  std::vector<std::int32_t> download() const {
    std::vector<std::int32_t> v(static_cast<std::size_t>(n_));
    gpu().sync();
    if (n_ > 0)
      MOEFLEX_CUDA_CHECK(cudaMemcpyAsync(v.data(), get(), 4 * v.size(), cudaMemcpyDeviceToHost, gpu().s()));
    gpu().sync();
    return v;
  }
  void fill(int byte) { MOEFLEX_CUDA_CHECK(cudaMemsetAsync(get(), byte, 4 * std::size_t(std::max<std::int64_t>(n_, 1)), gpu().s())); }

 private:
  std::int64_t n_;
  cu::Buffer buf_;
};

/// True when the MOEFLEX_OP_BENCH environment variable asks for the training-size runs.
inline bool bench_mode() {
  const char* s = std::getenv("MOEFLEX_OP_BENCH");
  return s && *s && std::string(s) != "0";
}

/// Runs of each op in a timing (after two warm-up runs).
constexpr int kTimedRuns = 10;

/// Median milliseconds of `f` on the test stream (CUDA events around each run).
template <typename F>
double time_ms(F&& f, int runs = kTimedRuns) {
  f();
  f();
  cu::Event start(true), stop(true);
  std::vector<float> ms;
  for (int i = 0; i < runs; ++i) {
    start.record(gpu().stream);
    f();
    stop.record(gpu().stream);
    stop.synchronize();
    ms.push_back(cu::Event::elapsed_ms(start, stop));
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

/// One harness row: the op's error against the CPU reference (NaN for timing-only
/// rows), its tolerance, its median time and its work.
struct OpRow {
  OpRow(std::string op_, std::string dtype_, std::string shape_,
        double err_ = std::numeric_limits<double>::quiet_NaN(), double tol_ = std::numeric_limits<double>::quiet_NaN())
      : op(std::move(op_)), dtype(std::move(dtype_)), shape(std::move(shape_)), err(err_), tol(tol_) {}
  std::string op, dtype, shape;
  double err = std::numeric_limits<double>::quiet_NaN();
  double tol = std::numeric_limits<double>::quiet_NaN();
  double ms = std::numeric_limits<double>::quiet_NaN();
  double flops = 0;  ///< floating-point operations per run (0: memory-bound op)
  double bytes = 0;  ///< bytes read and written per run
  std::string note;
};

/// Prints the row and appends it to $MOEFLEX_OP_REPORT (tab-separated: op, dtype,
/// shape, err, tol, ms, TFLOP/s, GB/s, note).
inline void report(const OpRow& r) {
  const double tflops = r.flops > 0 && r.ms > 0 ? r.flops / (r.ms * 1e-3) / 1e12 : 0.0;
  const double gbs = r.bytes > 0 && r.ms > 0 ? r.bytes / (r.ms * 1e-3) / 1e9 : 0.0;
  std::printf("[ harness  ] %-22s %-5s %-44s err %-10.3g tol %-7.0e %9.4f ms %8.2f TFLOP/s %8.1f GB/s %s\n",
              r.op.c_str(), r.dtype.c_str(), r.shape.c_str(), r.err, r.tol, r.ms, tflops, gbs, r.note.c_str());
  if (const char* path = std::getenv("MOEFLEX_OP_REPORT")) {
    if (FILE* f = std::fopen(path, "a")) {
      std::fprintf(f, "%s\t%s\t%s\t%.4g\t%.0e\t%.5f\t%.3f\t%.1f\t%s\n", r.op.c_str(), r.dtype.c_str(), r.shape.c_str(),
                   r.err, r.tol, r.ms, tflops, gbs, r.note.c_str());
      std::fclose(f);
    }
  }
}

/// Checks err < tol (NaN fails) with a message naming what was compared.
inline void expect_close(const std::string& what, double err, double tol) {
  EXPECT_TRUE(err < tol) << what << ": relative error " << err << " (tolerance " << tol << ")";
}

/// Directional finite-difference check of a GPU op's gradient, for fp32 ops: with
/// L(x) = <forward(x), probe>, compares (L(x + eps u) - L(x - eps u)) / (2 eps) with
/// <grad, u>. Independent of the CPU reference; fp32 forward noise limits it to
/// about 1e-3.
inline void expect_directional_derivative(const std::string& what, double analytic,
                                          double loss_plus, double loss_minus, double eps, double tol = 2e-3) {
  const double numeric = (loss_plus - loss_minus) / (2 * eps);
  const double err = std::abs(numeric - analytic) / std::max(std::abs(analytic), 1e-12);
  EXPECT_TRUE(err < tol) << what << ": directional derivative " << analytic << " vs finite difference " << numeric
                         << " (relative error " << err << ")";
}

/// "B=2,S=77,H=3,hd=64"-style shape strings.
inline std::string shape_str(std::initializer_list<std::pair<const char*, std::int64_t>> dims) {
  std::string s;
  for (const auto& [k, v] : dims) {
    if (!s.empty()) s += ',';
    s.append(k).append("=").append(std::to_string(v));
  }
  return s;
}

/// Element-wise a + s * b.
inline std::vector<double> axpy(const std::vector<double>& a, double s, const std::vector<double>& b) {
  std::vector<double> out(a.size());
  for (std::size_t i = 0; i < a.size(); ++i) out[i] = a[i] + s * b[i];
  return out;
}

template <typename T>
bool bit_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

}  // namespace moeflex::test
