// Conv2d: 2-D convolution (cross-correlation, as PyTorch) over [N, C, H, W] inputs.
//
//   kiln::nn::Conv2d conv(kiln::nn::Conv2dOptions(3, 64, /*kernel_size=*/3).padding(1));
//   auto y = conv(x);          // [N, 3, H, W] -> [N, 64, H, W]
//
// Initialisation as PyTorch: weight kaiming_uniform_(a = sqrt(5)), bias U(-1/sqrt(fan_in),
// 1/sqrt(fan_in)) with fan_in = in_channels / groups * kh * kw.
#pragma once

#include <cstdint>
#include <ostream>

#include "nn/functional.h"
#include "nn/module.h"

namespace kiln::nn {

struct Conv2dOptions {
  Conv2dOptions(int64_t in_channels, int64_t out_channels, ExpandingArray<2> kernel_size)
      : in_channels_(in_channels), out_channels_(out_channels), kernel_size_(kernel_size) {}
  KILN_ARG(int64_t, in_channels);
  KILN_ARG(int64_t, out_channels);
  KILN_ARG(ExpandingArray<2>, kernel_size);
  KILN_ARG(ExpandingArray<2>, stride) = 1;
  KILN_ARG(ExpandingArray<2>, padding) = 0;  // zeros on both sides
  KILN_ARG(ExpandingArray<2>, dilation) = 1;
  KILN_ARG(int64_t, groups) = 1;
  KILN_ARG(bool, bias) = true;
};

class Conv2dImpl : public Module {
 public:
  Conv2dImpl(int64_t in_channels, int64_t out_channels, ExpandingArray<2> kernel_size)
      : Conv2dImpl(Conv2dOptions(in_channels, out_channels, kernel_size)) {}
  explicit Conv2dImpl(const Conv2dOptions& options);

  void reset_parameters();
  // input [N, C_in, H, W] or [C_in, H, W].
  Tensor forward(const Tensor& input);
  void pretty_print(std::ostream& stream) const override;
  std::shared_ptr<Module> clone(const std::optional<Device>& device = std::nullopt) const override;

  Conv2dOptions options;
  Tensor weight;  // [out_channels, in_channels / groups, kh, kw]
  Tensor bias;    // [out_channels], undefined without bias
};
KILN_MODULE(Conv2d);

}  // namespace kiln::nn
