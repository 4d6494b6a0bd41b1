// Helpers of the memory walk's two files (memory_plan.cpp, memory_walk_blocks.cpp):
// activation ids of literal names interned once per call site, and arena sizes.
#pragma once
#include <initializer_list>
#include <string_view>
#include <vector>

#include "moeflex/core/arena.h"
#include "moeflex/model/ledger.h"

namespace moeflex::walk {

/// The activation id of a literal name, interned once per call site.
#define ID(name) ([]() -> int { static const int id_ = activation_id(name); return id_; }())
/// The ids of literal names, interned once per call site.
#define IDS(...)                                                                    \
  ([]() -> const std::vector<int>& {                                                \
    static const std::vector<int> ids_ = [] {                                       \
      std::vector<int> v;                                                           \
      for (std::string_view n : std::initializer_list<std::string_view>{__VA_ARGS__}) \
        v.push_back(activation_id(n));                                              \
      return v;                                                                     \
    }();                                                                            \
    return ids_;                                                                    \
  }())

/// Arena bytes of a tensor of `numel` elements of `elem` bytes each (f32 and i32: 4;
/// activations: ModelConfig::activation_bytes(), 2 in the bf16 engine).
inline Bytes rounded(std::int64_t numel, Bytes elem) { return Arena::round_up(std::max<Bytes>(1, numel * elem)); }


}  // namespace moeflex::walk
