// Shapes and strides: the small integer vectors every tensor carries, and the rules on them
// (contiguous strides, broadcasting, dim wrapping) that ops share.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <initializer_list>
#include <ostream>
#include <string>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/types/span.h"

namespace kiln {

// Sizes or strides, stored inline up to 5 dims (no allocation for typical tensors).
using Shape = absl::InlinedVector<int64_t, 5>;
// A read-only view of sizes or dims passed to ops, as c10::IntArrayRef: accepts a Shape, a
// std::vector, a {2, 3} literal, or a single integer (`t.view(-1)`, `t.sum(0)`). It does not
// own its elements: like std::string_view, keep it only as long as what it points at.
class IntArrayRef {
 public:
  using value_type = int64_t;
  using const_iterator = const int64_t*;
  using iterator = const int64_t*;

  constexpr IntArrayRef() = default;
  IntArrayRef(const int64_t& one) : data_(&one), size_(1) {}  // NOLINT: as c10::ArrayRef
  constexpr IntArrayRef(const int64_t* data, size_t size) : data_(data), size_(size) {}
  // The list lives until the end of the full expression that calls the op, as with
  // c10::ArrayRef and std::span.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winit-list-lifetime"
#endif
  IntArrayRef(std::initializer_list<int64_t> list)  // NOLINT
      : data_(list.begin()), size_(list.size()) {}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
  template <typename C>
    requires requires(const C& c) {
      { c.data() } -> std::convertible_to<const int64_t*>;
      { c.size() } -> std::convertible_to<size_t>;
    }
  IntArrayRef(const C& c) : data_(c.data()), size_(c.size()) {}  // NOLINT: Shape, vector, Span

  const int64_t* data() const { return data_; }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  const int64_t* begin() const { return data_; }
  const int64_t* end() const { return data_ + size_; }
  const int64_t& operator[](size_t i) const { return data_[i]; }
  const int64_t& front() const { return data_[0]; }
  const int64_t& back() const { return data_[size_ - 1]; }
  IntArrayRef subspan(size_t pos, size_t len = static_cast<size_t>(-1)) const {
    return IntArrayRef(data_ + pos, std::min(len, size_ - pos));
  }
  std::vector<int64_t> vec() const { return std::vector<int64_t>(begin(), end()); }
  operator absl::Span<const int64_t>() const { return {data_, size_}; }  // NOLINT

  friend bool operator==(IntArrayRef a, IntArrayRef b) {
    return a.size_ == b.size_ && std::equal(a.begin(), a.end(), b.begin());
  }

 private:
  const int64_t* data_ = nullptr;
  size_t size_ = 0;
};

inline Shape to_shape(IntArrayRef s) { return Shape(s.begin(), s.end()); }
// "[2, 3]"
std::string shape_str(IntArrayRef sizes);
// `std::cout << t.sizes()` prints "[2, 3]", as libtorch.
inline std::ostream& operator<<(std::ostream& os, IntArrayRef sizes) {
  return os << shape_str(sizes);
}
// The element count; an error when it overflows int64 (a shape with a 0 has none, whatever the
// other sizes).
int64_t numel_of(IntArrayRef sizes);
// Row-major strides; an error when they overflow int64.
Shape contiguous_strides(IntArrayRef sizes);
// The elements a layout spans from its first one, 1 + sum((size - 1) * stride), 0 when empty;
// an error naming `op` for negative sizes or strides or when the sum overflows int64.
int64_t layout_extent(IntArrayRef sizes, IntArrayRef strides, const char* op);
// numel_of(sizes) * element_size in bytes; an error naming `op` when it overflows int64.
size_t nbytes_of(IntArrayRef sizes, size_t element_size, const char* op);
// The strides of a dense tensor of `sizes` whose dims are laid out in the memory order of
// `strides` (PyTorch's preserve_format for outputs of elementwise ops): dims by decreasing
// stride, ties in their logical order, size-1 dims with the stride they would have in that
// place. A layout with a broadcast dim (stride 0 on a dim of size > 1) or a negative stride gives
// contiguous strides. The [B, H, T, D] view of a [B, T, H, D] tensor gives [B, T, H, D]'s dense
// strides permuted back: {T*H*D, D, H*D, 1}.
Shape dense_strides_like(IntArrayRef sizes, IntArrayRef strides);
// True when (sizes, strides) describe a C-contiguous layout (size-1 dims may have any stride).
bool is_contiguous_layout(IntArrayRef sizes, IntArrayRef strides);
// Maps a possibly negative dim into [0, ndim); fails naming `op` when out of range. A 0-d
// tensor accepts dims -1 and 0, as PyTorch.
int64_t wrap_dim(int64_t dim, int64_t ndim, const char* op);
// The broadcast shape of a and b (numpy rules); fails naming `op` and both shapes.
Shape broadcast_shapes(IntArrayRef a, IntArrayRef b, const char* op);
// Resolves one -1 in `sizes` so that the product equals numel; fails naming `op`.
Shape infer_size(IntArrayRef sizes, int64_t numel, const char* op);
// A sorted set of wrapped dims; empty `dims` means all dims. Duplicates fail naming `op`.
Shape reduction_dims(IntArrayRef dims, int64_t ndim, const char* op);

}  // namespace kiln
