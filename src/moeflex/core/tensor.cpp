#include "moeflex/core/tensor.h"

#include <cstring>

#include <fmt/format.h>

#include "moeflex/core/device.h"
#include "moeflex/core/error.h"

namespace moeflex {

const char* to_string(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::i32: return "i32";
    case DType::bf16: return "bf16";
  }
  return "?";
}

namespace {
[[noreturn]] void wrong_dtype(DType have, DType want) {
  throw Error(fmt::format("a {} tensor was passed where an op expects {}", to_string(have), to_string(want)));
}
}  // namespace

float* View::f32() const {
  if (data && dtype != DType::f32) wrong_dtype(dtype, DType::f32);
  return static_cast<float*>(data);
}
bf16* View::bf() const {
  if (data && dtype != DType::bf16) wrong_dtype(dtype, DType::bf16);
  return static_cast<bf16*>(data);
}
const float* CView::f32() const {
  if (data && dtype != DType::f32) wrong_dtype(dtype, DType::f32);
  return static_cast<const float*>(data);
}
const bf16* CView::bf() const {
  if (data && dtype != DType::bf16) wrong_dtype(dtype, DType::bf16);
  return static_cast<const bf16*>(data);
}

std::int64_t shape_numel(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

Tensor::Tensor(Arena& arena, std::vector<std::int64_t> shape, MemCategory category,
               std::string_view name, DType dtype)
    : arena_(&arena), shape_(std::move(shape)), dtype_(dtype), category_(category) {
  numel_ = shape_numel(shape_);
  data_ = arena.allocate(nbytes(), category, name);
}

Tensor& Tensor::operator=(Tensor&& o) noexcept {
  if (this != &o) {
    reset();
    arena_ = std::exchange(o.arena_, nullptr);
    data_ = std::exchange(o.data_, nullptr);
    shape_ = std::move(o.shape_);
    numel_ = std::exchange(o.numel_, 0);
    dtype_ = o.dtype_;
    category_ = o.category_;
  }
  return *this;
}

void Tensor::reset() {
  if (data_ && arena_) arena_->deallocate(data_, nbytes(), category_);
  data_ = nullptr;
  arena_ = nullptr;
  shape_.clear();
  numel_ = 0;
}

void Tensor::zero() {
  if (!data_) return;
  if (Device* dev = arena_ ? arena_->device() : nullptr) dev->zero(data_, nbytes());
  else std::memset(data_, 0, static_cast<std::size_t>(nbytes()));
}

}  // namespace moeflex
