// kiln::tensor({...}): tensors from (nested) initializer lists and vectors, as torch::tensor.
//
//   kiln::tensor({1.0, 2.0, 3.0})                 // float32 [3]
//   kiln::tensor({{1, 2}, {3, 4}})                // int64 [2, 2]
//   kiln::tensor({true, false})                   // bool [2]
//   kiln::tensor(std::vector<float>{...}, kiln::kFloat64)
//
// The dtype is inferred as PyTorch does (any float -> default dtype, else int64, else bool)
// unless the options give one. Ragged nesting fails with the offending sizes.
#pragma once

#include <initializer_list>
#include <vector>

#include "tensor/tensor.h"

namespace kiln {

class TensorData {
 public:
  TensorData(const Scalar& v) : sizes_(), values_{v} {}  // NOLINT
  template <typename T>
    requires(std::is_arithmetic_v<T>)
  TensorData(T v) : TensorData(Scalar(v)) {}  // NOLINT
  TensorData(std::initializer_list<TensorData> list);
  template <typename T>
  TensorData(const std::vector<T>& v) : sizes_{static_cast<int64_t>(v.size())} {  // NOLINT
    values_.reserve(v.size());
    for (const T& x : v) values_.emplace_back(x);
  }

  const Shape& sizes() const { return sizes_; }
  const std::vector<Scalar>& values() const { return values_; }
  ScalarType inferred_dtype() const;

 private:
  Shape sizes_;
  std::vector<Scalar> values_;
};

Tensor tensor(const TensorData& data, const TensorOptions& options = {});

}  // namespace kiln
