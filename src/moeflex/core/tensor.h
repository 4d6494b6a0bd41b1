// Tensors: a shape, a dtype and a block of arena memory, owned (RAII) or viewed.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "moeflex/core/arena.h"

namespace moeflex {

enum class DType : int { f32, i32 };

/// Size of one element in bytes.
constexpr Bytes dtype_size(DType t) { return 4; }

/// A dense row-major tensor. Owning tensors return their block to the arena on
/// destruction; a default-constructed tensor is empty (no data).
class Tensor {
 public:
  Tensor() = default;
  /// Allocates numel(shape) elements from `arena`; throws OutOfMemoryError.
  Tensor(Arena& arena, std::vector<std::int64_t> shape, MemCategory category, std::string_view name,
         DType dtype = DType::f32);
  ~Tensor() { reset(); }
  Tensor(Tensor&& o) noexcept { *this = std::move(o); }
  Tensor& operator=(Tensor&& o) noexcept;
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;

  /// Frees the block (if any) and leaves the tensor empty.
  void reset();
  bool defined() const { return data_ != nullptr; }
  const std::vector<std::int64_t>& shape() const { return shape_; }
  std::int64_t dim(int i) const { return shape_.at(static_cast<std::size_t>(i < 0 ? int(shape_.size()) + i : i)); }
  std::int64_t numel() const { return numel_; }
  Bytes nbytes() const { return numel_ * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  MemCategory category() const { return category_; }

  float* f32() { return static_cast<float*>(data_); }
  const float* f32() const { return static_cast<const float*>(data_); }
  std::int32_t* i32() { return static_cast<std::int32_t*>(data_); }
  const std::int32_t* i32() const { return static_cast<const std::int32_t*>(data_); }
  void* raw() { return data_; }
  const void* raw() const { return data_; }
  /// Sets every byte to zero (through the arena's device, in stream order, when it
  /// has one).
  void zero();
  /// The arena the block came from (null when empty).
  Arena* arena() const { return arena_; }

 private:
  friend class Arena;  // Arena::compact() re-points relocated tensors
  Arena* arena_ = nullptr;
  void* data_ = nullptr;
  std::vector<std::int64_t> shape_;
  std::int64_t numel_ = 0;
  DType dtype_ = DType::f32;
  MemCategory category_ = MemCategory::workspace;
};

/// Product of the dimensions.
std::int64_t shape_numel(const std::vector<std::int64_t>& shape);

}  // namespace moeflex
