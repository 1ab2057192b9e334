// Transforms in torch::data::transforms' spelling: what MapDataset applies to each batch.
//
//   using namespace kiln::data;
//   auto ds = datasets::MNIST(root)
//                 .map(transforms::Normalize<>(0.1307, 0.3081))   // per example, on data only
//                 .map(transforms::Lambda<Example<>>([](Example<> e) {  // any per-example code
//                   e.data = e.data.flatten();
//                   return e;
//                 }))
//                 .map(transforms::Stack<>());      // vector<Example<>> -> one Example<> [B, ...]
//
// - BatchTransform<In, Out>: apply_batch(In) -> Out, on whole batches (Stack, BatchLambda).
// - Transform<In, Out>: apply(In) -> Out per example; apply_batch maps it over a vector.
// - TensorTransform<Target>: a Transform of Example<Tensor, Target> that rewrites the data
//   tensor through operator() (Normalize, TensorLambda).
// - Normalize<Target>(mean, stddev): (data - mean) / stddev, with one value (any data shape) or
//   one value per channel (dimension -3 of the data: [C, H, W]).
#pragma once

#include <functional>
#include <utility>
#include <vector>

#include "datasets/example.h"
#include "tensor/ops.h"
#include "tensor/tensor_data.h"

namespace kiln::data::transforms {

template <typename InputBatch, typename OutputBatch>
class BatchTransform {
 public:
  using InputBatchType = InputBatch;
  using OutputBatchType = OutputBatch;

  virtual ~BatchTransform() = default;
  virtual OutputBatch apply_batch(InputBatch input_batch) = 0;
};

template <typename Input, typename Output>
class Transform : public BatchTransform<std::vector<Input>, std::vector<Output>> {
 public:
  using InputType = Input;
  using OutputType = Output;

  virtual Output apply(Input input) = 0;

  std::vector<Output> apply_batch(std::vector<Input> input_batch) override {
    std::vector<Output> output;
    output.reserve(input_batch.size());
    for (auto& input : input_batch) output.push_back(apply(std::move(input)));
    return output;
  }
};

// A per-example transform from a function.
template <typename Input, typename Output = Input>
class Lambda : public Transform<Input, Output> {
 public:
  using FunctionType = std::function<Output(Input)>;
  explicit Lambda(FunctionType function) : function_(std::move(function)) {}
  Output apply(Input input) override { return function_(std::move(input)); }

 private:
  FunctionType function_;
};

// A whole-batch transform from a function.
template <typename Input, typename Output = Input>
class BatchLambda : public BatchTransform<Input, Output> {
 public:
  using FunctionType = std::function<Output(Input)>;
  explicit BatchLambda(FunctionType function) : function_(std::move(function)) {}
  Output apply_batch(Input input) override { return function_(std::move(input)); }

 private:
  FunctionType function_;
};

template <typename Target = Tensor>
class TensorTransform : public Transform<Example<Tensor, Target>, Example<Tensor, Target>> {
 public:
  using E = Example<Tensor, Target>;
  virtual Tensor operator()(Tensor input) = 0;
  E apply(E input) override {
    input.data = (*this)(std::move(input.data));
    return input;
  }
};

template <typename Target = Tensor>
class TensorLambda : public TensorTransform<Target> {
 public:
  using FunctionType = std::function<Tensor(Tensor)>;
  explicit TensorLambda(FunctionType function) : function_(std::move(function)) {}
  Tensor operator()(Tensor input) override { return function_(std::move(input)); }

 private:
  FunctionType function_;
};

template <typename Target = Tensor>
class Normalize : public TensorTransform<Target> {
 public:
  // One value per channel ([C, 1, 1], broadcast over [C, H, W] data) or a single value.
  Normalize(ArrayRef<double> mean, ArrayRef<double> stddev)
      : mean(to_tensor(mean, "mean")), stddev(to_tensor(stddev, "stddev")) {}
  Normalize(double mean, double stddev)
      : Normalize(ArrayRef<double>(&mean, 1), ArrayRef<double>(&stddev, 1)) {}

  // Floating data keeps its dtype; integer data (uint8 pixels) becomes float32.
  Tensor operator()(Tensor input) override {
    const ScalarType t = input.is_floating_point() ? input.dtype() : kFloat32;
    return input.sub(mean.to(input.device(), t)).div(stddev.to(input.device(), t));
  }

  Tensor mean, stddev;

 private:
  static Tensor to_tensor(ArrayRef<double> values, const char* what) {
    KILN_CHECK(!values.empty(), "[Normalize] ", what, " is empty");
    std::vector<double> v(values.begin(), values.end());
    // A single value is 0-d, so that it leaves the data's shape alone whatever its rank.
    if (v.size() == 1) return kiln::scalar_tensor(v[0], kFloat32);
    return kiln::tensor(v, kFloat32).view({-1, 1, 1});
  }
};

// Stacks a batch of examples into one: data and targets each get a leading batch dimension.
template <typename E = Example<>>
struct Stack;

template <>
struct Stack<Example<>> : public BatchTransform<std::vector<Example<>>, Example<>> {
  Example<> apply_batch(std::vector<Example<>> examples) override {
    KILN_CHECK(!examples.empty(), "[Stack] cannot stack an empty batch");
    std::vector<Tensor> data, targets;
    data.reserve(examples.size());
    targets.reserve(examples.size());
    for (auto& e : examples) {
      data.push_back(std::move(e.data));
      targets.push_back(std::move(e.target));
    }
    return {kiln::stack(data), kiln::stack(targets)};
  }
};

template <>
struct Stack<TensorExample> : public BatchTransform<std::vector<TensorExample>, TensorExample> {
  TensorExample apply_batch(std::vector<TensorExample> examples) override {
    KILN_CHECK(!examples.empty(), "[Stack] cannot stack an empty batch");
    std::vector<Tensor> data;
    data.reserve(examples.size());
    for (auto& e : examples) data.push_back(std::move(e.data));
    return kiln::stack(data);
  }
};

}  // namespace kiln::data::transforms
