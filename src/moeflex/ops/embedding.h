// Token embedding lookup.
//   forward:  out[n,d] = table[ids[i], :]          (=)
//   backward: dtable[ids[i], :] += dout[i, :]       (+=, tokens summed in index order)
#pragma once
#include <cstdint>

namespace moeflex::ops {

template <typename T>
void embedding_forward(const std::int32_t* ids, const T* table, T* out, std::int64_t n, std::int64_t d);

template <typename T>
void embedding_backward(const std::int32_t* ids, const T* dout, T* dtable, std::int64_t n, std::int64_t d);

}  // namespace moeflex::ops
