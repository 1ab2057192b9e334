// kiln::data::Example: one sample of a dataset, a data tensor and its target, as
// torch::data::Example.
//
//   kiln::data::Example<> e{image, label};          // Example<Tensor, Tensor>
//   e.data; e.target;
//   kiln::data::TensorExample t{features};          // no target: Example<Tensor, NoTarget>
//
// Batches of examples are std::vector<Example<>> until a transform (transforms::Stack<>) turns
// them into one Example whose data and target have a leading batch dimension.
#pragma once

#include <utility>

#include "tensor/tensor.h"

namespace kiln::data {

namespace example {
// The target type of an example that has none.
struct NoTarget {};
}  // namespace example

template <typename Data = Tensor, typename Target = Tensor>
struct Example {
  using DataType = Data;
  using TargetType = Target;

  Example() = default;
  Example(Data data, Target target) : data(std::move(data)), target(std::move(target)) {}

  Data data;
  Target target;
};

// An example without a target: only `data`, and it converts to its data.
template <typename Data>
struct Example<Data, example::NoTarget> {
  using DataType = Data;
  using TargetType = example::NoTarget;

  Example() = default;
  Example(Data data) : data(std::move(data)) {}  // NOLINT: implicit as in libtorch

  operator Data&() { return data; }              // NOLINT
  operator const Data&() const { return data; }  // NOLINT

  Data data;
};

using TensorExample = Example<Tensor, example::NoTarget>;

}  // namespace kiln::data
