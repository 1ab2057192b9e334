// ConvTranspose1d and ConvTranspose2d: transposed convolutions (the adjoint of Conv1d/Conv2d,
// "deconvolution"), as libtorch's, over [N, C, L] / [N, C, H, W] (or unbatched) inputs.
//
//   kiln::nn::ConvTranspose2d up(
//       kiln::nn::ConvTranspose2dOptions(64, 32, /*kernel_size=*/4).stride(2).padding(1));
//   auto y = up(x);                   // [N, 64, H, W] -> [N, 32, 2H, 2W]
//   auto z = up(x, {{2 * H + 1, 2 * W + 1}});  // output_size picks output_padding
//
// weight is [in_channels, out_channels / groups, *kernel_size] (PyTorch's layout). Output size
// per dim: (in - 1) * stride - 2 * padding + dilation * (kernel - 1) + output_padding + 1.
// Initialisation as PyTorch: weight kaiming_uniform_(a = sqrt(5)) and bias
// U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = weight.size(1) * prod(kernel_size).
// Only zero padding (padding_mode "zeros") exists, as in PyTorch's transposed convolutions.
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <vector>

#include "nn/functional.h"
#include "nn/module.h"

namespace kiln::nn {

template <size_t D>
struct ConvTransposeOptions {
  ConvTransposeOptions(int64_t in_channels, int64_t out_channels, ExpandingArray<D> kernel_size)
      : in_channels_(in_channels), out_channels_(out_channels), kernel_size_(kernel_size) {}
  KILN_ARG(int64_t, in_channels);
  KILN_ARG(int64_t, out_channels);
  KILN_ARG(ExpandingArray<D>, kernel_size);
  KILN_ARG(ExpandingArray<D>, stride) = 1;
  KILN_ARG(ExpandingArray<D>, padding) = 0;  // cropped from both sides of the output
  KILN_ARG(ExpandingArray<D>, output_padding) = 0;
  KILN_ARG(int64_t, groups) = 1;
  KILN_ARG(bool, bias) = true;
  KILN_ARG(ExpandingArray<D>, dilation) = 1;
};
using ConvTranspose1dOptions = ConvTransposeOptions<1>;
using ConvTranspose2dOptions = ConvTransposeOptions<2>;

template <size_t D>
class ConvTransposeImplBase : public Module {
 public:
  explicit ConvTransposeImplBase(const ConvTransposeOptions<D>& options);
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;

  ConvTransposeOptions<D> options;
  Tensor weight;  // [in_channels, out_channels / groups, *kernel_size]
  Tensor bias;    // [out_channels], undefined without bias

 protected:
  // output_padding for the requested output_size (the D spatial sizes, or N, C and them), as
  // PyTorch's _output_padding: each size within [min, min + stride - 1].
  ExpandingArray<D> output_padding_for(const Tensor& input,
                                       const std::optional<std::vector<int64_t>>& output_size,
                                       const char* name) const;
};

class ConvTranspose1dImpl : public ConvTransposeImplBase<1> {
 public:
  ConvTranspose1dImpl(int64_t in_channels, int64_t out_channels, ExpandingArray<1> kernel_size)
      : ConvTranspose1dImpl(ConvTranspose1dOptions(in_channels, out_channels, kernel_size)) {}
  explicit ConvTranspose1dImpl(const ConvTranspose1dOptions& options)
      : ConvTransposeImplBase<1>(options) {}
  std::shared_ptr<Module> clone(const std::optional<Device>& device = std::nullopt) const override;
  // input [N, C_in, L] or [C_in, L].
  Tensor forward(const Tensor& input,
                 const std::optional<std::vector<int64_t>>& output_size = std::nullopt);
};
KILN_MODULE(ConvTranspose1d);

class ConvTranspose2dImpl : public ConvTransposeImplBase<2> {
 public:
  ConvTranspose2dImpl(int64_t in_channels, int64_t out_channels, ExpandingArray<2> kernel_size)
      : ConvTranspose2dImpl(ConvTranspose2dOptions(in_channels, out_channels, kernel_size)) {}
  explicit ConvTranspose2dImpl(const ConvTranspose2dOptions& options)
      : ConvTransposeImplBase<2>(options) {}
  std::shared_ptr<Module> clone(const std::optional<Device>& device = std::nullopt) const override;
  // input [N, C_in, H, W] or [C_in, H, W].
  Tensor forward(const Tensor& input,
                 const std::optional<std::vector<int64_t>>& output_size = std::nullopt);
};
KILN_MODULE(ConvTranspose2d);

}  // namespace kiln::nn
