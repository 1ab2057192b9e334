// MaxPool2d and AvgPool2d over [N, C, H, W] (or [C, H, W]) inputs.
//
//   kiln::nn::MaxPool2d pool(kiln::nn::MaxPool2dOptions(2));             // stride = kernel
//   kiln::nn::AvgPool2d avg(kiln::nn::AvgPool2dOptions({3, 3}).stride(1).padding(1));
//
// The options are those of the functional forms (kiln::nn::functional::max_pool2d), as
// libtorch's.
#pragma once

#include <ostream>
#include <tuple>

#include "nn/functional.h"
#include "nn/module.h"

namespace kiln::nn {

using MaxPool2dOptions = functional::MaxPool2dFuncOptions;
using AvgPool2dOptions = functional::AvgPool2dFuncOptions;

class MaxPool2dImpl : public Module {
 public:
  explicit MaxPool2dImpl(ExpandingArray<2> kernel_size)
      : MaxPool2dImpl(MaxPool2dOptions(kernel_size)) {}
  explicit MaxPool2dImpl(const MaxPool2dOptions& options) : options(options) {}
  Tensor forward(const Tensor& input);
  // (values, flat indices into each input plane), as MaxPool2d(return_indices=True).
  std::tuple<Tensor, Tensor> forward_with_indices(const Tensor& input);
  void pretty_print(std::ostream& stream) const override;
  std::shared_ptr<Module> clone(const std::optional<Device>& device = std::nullopt) const override;

  MaxPool2dOptions options;
};
KILN_MODULE(MaxPool2d);

class AvgPool2dImpl : public Module {
 public:
  explicit AvgPool2dImpl(ExpandingArray<2> kernel_size)
      : AvgPool2dImpl(AvgPool2dOptions(kernel_size)) {}
  explicit AvgPool2dImpl(const AvgPool2dOptions& options) : options(options) {}
  Tensor forward(const Tensor& input);
  void pretty_print(std::ostream& stream) const override;
  std::shared_ptr<Module> clone(const std::optional<Device>& device = std::nullopt) const override;

  AvgPool2dOptions options;
};
KILN_MODULE(AvgPool2d);

}  // namespace kiln::nn
