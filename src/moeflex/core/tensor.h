// Tensors: a shape, a dtype and a block of arena memory, owned (RAII) or viewed.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "moeflex/core/arena.h"
#include "moeflex/core/bf16.h"

namespace moeflex {

/// Element types: f32 (fp32 activations, master weights, gradients), i32 (token
/// ids, routing indices) and bf16 (the mixed-precision engine's activations and
/// working weights, core/bf16.h).
enum class DType : int { f32, i32, bf16 };

/// Size of one element in bytes.
constexpr Bytes dtype_size(DType t) { return t == DType::bf16 ? 2 : 4; }
/// "f32", "i32" or "bf16".
const char* to_string(DType t);

/// A pointer to tensor elements together with their type: what the backend's
/// activation and weight arguments take (ops/backend.h), so that one op serves the
/// fp32 and the bf16 engine and a wrong type is an error rather than garbage.
/// Converts implicitly from float* and bf16*; offsets (+) count elements and keep
/// a null view null.
struct View {
  void* data = nullptr;
  DType dtype = DType::f32;
  View() = default;
  View(std::nullptr_t) {}
  View(float* p) : data(p), dtype(DType::f32) {}
  View(bf16* p) : data(p), dtype(DType::bf16) {}
  View(void* p, DType t) : data(p), dtype(t) {}
  View operator+(std::int64_t elements) const {
    return data ? View(static_cast<char*>(data) + elements * dtype_size(dtype), dtype) : *this;
  }
  explicit operator bool() const { return data != nullptr; }
  /// The data as float* (null stays null); throws Error when the view is not f32.
  float* f32() const;
  /// The data as bf16* (null stays null); throws Error when the view is not bf16.
  bf16* bf() const;
};

/// The read-only View.
struct CView {
  const void* data = nullptr;
  DType dtype = DType::f32;
  CView() = default;
  CView(std::nullptr_t) {}
  CView(const float* p) : data(p), dtype(DType::f32) {}
  CView(const bf16* p) : data(p), dtype(DType::bf16) {}
  CView(const void* p, DType t) : data(p), dtype(t) {}
  CView(View v) : data(v.data), dtype(v.dtype) {}
  CView operator+(std::int64_t elements) const {
    return data ? CView(static_cast<const char*>(data) + elements * dtype_size(dtype), dtype) : *this;
  }
  explicit operator bool() const { return data != nullptr; }
  const float* f32() const;
  const bf16* bf() const;
};

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

  /// The data as float*; throws Error when the tensor is not f32.
  float* f32() { return view().f32(); }
  const float* f32() const { return view().f32(); }
  /// The data as bf16*; throws Error when the tensor is not bf16.
  bf16* bf() { return view().bf(); }
  const bf16* bf() const { return view().bf(); }
  std::int32_t* i32() { return static_cast<std::int32_t*>(data_); }
  const std::int32_t* i32() const { return static_cast<const std::int32_t*>(data_); }
  void* raw() { return data_; }
  const void* raw() const { return data_; }
  /// The data with its dtype (for the backend's ops).
  View view() { return View(data_, dtype_); }
  CView view() const { return CView(data_, dtype_); }
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
