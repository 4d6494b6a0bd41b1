// Unit-bearing aliases used across moeflex (STYLE habit 10).
#pragma once
#include <cstdint>

namespace moeflex {

using Bytes = std::int64_t;         ///< a size in bytes
using Seconds = double;             ///< a duration in seconds
using BytesPerSecond = double;      ///< a bandwidth
using FlopsPerSecond = double;      ///< a compute rate

constexpr Bytes kKiB = 1024;
constexpr Bytes kMiB = 1024 * kKiB;
constexpr Bytes kGiB = 1024 * kMiB;

}  // namespace moeflex
