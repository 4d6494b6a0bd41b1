// Token embedding lookup.
//   ids: [n] in [0, V); table, dtable: [V, d]; out, dout: [n, d].
//   forward:  out[n,d] = table[ids[i], :]          (=)
//   backward: dtable[ids[i], :] += dout[i, :]       (+=, tokens summed in index order)
// The backward is a scatter-add; to keep it deterministic without atomics, threads
// split the d columns and each walks all tokens in index order, so every element of
// dtable receives its contributions in token order whatever the thread count.
#include "moeflex/ops/embedding.h"

#include <algorithm>
#include <cstring>
#include <omp.h>
#include <string>

#include "moeflex/core/error.h"

namespace moeflex::ops {
namespace {

/// Columns per work item in the backward: one 64-byte cache line of floats, so two
/// threads never write the same line of dtable.
constexpr std::int64_t kColumnBlock = 16;

/// Rows of d elements below which a parallel region costs more than it saves.
constexpr std::int64_t kParallelMinElements = 1 << 14;

/// The header does not pass V, so only negative ids can be caught here; the data
/// loader checks the upper bound against the vocabulary.
void check_ids(const std::int32_t* ids, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0) {
      throw DataError("embedding: token id " + std::to_string(ids[i]) + " at position " + std::to_string(i) +
                      " is negative");
    }
  }
}

}  // namespace

template <typename T>
void embedding_forward(const std::int32_t* ids, const T* table, T* out, std::int64_t n, std::int64_t d) {
  check_ids(ids, n);
#pragma omp parallel for schedule(static) if (n * d >= kParallelMinElements)
  for (std::int64_t i = 0; i < n; ++i) {
    std::memcpy(out + i * d, table + static_cast<std::int64_t>(ids[i]) * d, sizeof(T) * static_cast<std::size_t>(d));
  }
}

template <typename T>
void embedding_backward(const std::int32_t* ids, const T* dout, T* dtable, std::int64_t n, std::int64_t d) {
  check_ids(ids, n);
  const std::int64_t blocks = (d + kColumnBlock - 1) / kColumnBlock;
#pragma omp parallel if (n * d >= kParallelMinElements)
  {
    // One contiguous column range per thread, so each thread reads ids once.
    const std::int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    const std::int64_t j0 = std::min(d, (blocks * t / nt) * kColumnBlock);
    const std::int64_t j1 = std::min(d, (blocks * (t + 1) / nt) * kColumnBlock);
    for (std::int64_t i = 0; i < n && j0 < j1; ++i) {
      T* dst = dtable + static_cast<std::int64_t>(ids[i]) * d;
      const T* src = dout + i * d;
      for (std::int64_t j = j0; j < j1; ++j) dst[j] += src[j];
    }
  }
}

template void embedding_forward<float>(const std::int32_t*, const float*, float*, std::int64_t, std::int64_t);
template void embedding_forward<double>(const std::int32_t*, const double*, double*, std::int64_t, std::int64_t);
template void embedding_backward<float>(const std::int32_t*, const float*, float*, std::int64_t, std::int64_t);
template void embedding_backward<double>(const std::int32_t*, const double*, double*, std::int64_t, std::int64_t);

}  // namespace moeflex::ops
