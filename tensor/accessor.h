// kiln::TensorAccessor: fast element access into a CPU tensor of known dtype and rank, as
// libtorch's t.accessor<T, N>().
//
//   auto a = t.accessor<float, 2>();     // checks: CPU, dtype float32, 2 dims
//   for (int64_t i = 0; i < a.size(0); ++i)
//     for (int64_t j = 0; j < a.size(1); ++j) a[i][j] *= 2;
//
// The accessor reads the tensor's sizes and strides in place (any strides): keep the tensor alive
// and unchanged in shape while it is used; t.accessor() on a temporary does not compile.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tensor/shape.h"

namespace kiln {

template <typename T, size_t N>
class TensorAccessor {
 public:
  TensorAccessor(T* data, const int64_t* sizes, const int64_t* strides)
      : data_(data), sizes_(sizes), strides_(strides) {}

  TensorAccessor<T, N - 1> operator[](int64_t i) const {
    return TensorAccessor<T, N - 1>(data_ + strides_[0] * i, sizes_ + 1, strides_ + 1);
  }
  int64_t size(int64_t d) const { return sizes_[d]; }
  int64_t stride(int64_t d) const { return strides_[d]; }
  IntArrayRef sizes() const { return IntArrayRef(sizes_, N); }
  IntArrayRef strides() const { return IntArrayRef(strides_, N); }
  T* data() const { return data_; }

 private:
  T* data_;
  const int64_t* sizes_;
  const int64_t* strides_;
};

template <typename T>
class TensorAccessor<T, 1> {
 public:
  TensorAccessor(T* data, const int64_t* sizes, const int64_t* strides)
      : data_(data), sizes_(sizes), strides_(strides) {}

  T& operator[](int64_t i) const { return data_[strides_[0] * i]; }
  int64_t size(int64_t d) const { return sizes_[d]; }
  int64_t stride(int64_t d) const { return strides_[d]; }
  IntArrayRef sizes() const { return IntArrayRef(sizes_, 1); }
  IntArrayRef strides() const { return IntArrayRef(strides_, 1); }
  T* data() const { return data_; }

 private:
  T* data_;
  const int64_t* sizes_;
  const int64_t* strides_;
};

}  // namespace kiln
