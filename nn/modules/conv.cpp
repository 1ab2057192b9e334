// Conv2d.
#include "nn/modules/conv.h"

#include <cmath>

#include "nn/init.h"
#include "tensor/ops.h"

namespace kiln::nn {

namespace {

std::ostream& operator<<(std::ostream& stream, const ExpandingArray<2>& a) {
  return stream << "[" << a[0] << ", " << a[1] << "]";
}

}  // namespace

Conv2dImpl::Conv2dImpl(const Conv2dOptions& options_) : options(options_) {
  const int64_t in = options.in_channels(), out = options.out_channels(), g = options.groups();
  KILN_CHECK(g > 0, "[Conv2d] groups must be positive, got ", g);
  KILN_CHECK(in > 0 && out > 0, "[Conv2d] in_channels and out_channels must be positive, got ", in,
             " and ", out);
  KILN_CHECK(in % g == 0 && out % g == 0, "[Conv2d] in_channels (", in, ") and out_channels (", out,
             ") must be divisible by groups (", g, ")");
  const auto& k = options.kernel_size();
  KILN_CHECK(k[0] > 0 && k[1] > 0, "[Conv2d] kernel_size must be positive, got [", k[0], ", ", k[1],
             "]");
  for (int i = 0; i < 2; ++i) {
    KILN_CHECK(options.stride()[i] > 0 && options.dilation()[i] > 0 && options.padding()[i] >= 0,
               "[Conv2d] stride and dilation must be positive and padding non-negative");
  }
  weight = register_parameter("weight", kiln::empty({out, in / g, k[0], k[1]}));
  bias = options.bias() ? register_parameter("bias", kiln::empty({out}))
                        : register_parameter("bias", Tensor(), /*requires_grad=*/false);
  reset_parameters();
}

void Conv2dImpl::reset_parameters() {
  init::kaiming_uniform_(weight, std::sqrt(5.0));
  if (bias.defined()) {
    const auto [fan_in, fan_out] = init::calculate_fan_in_and_fan_out(weight);
    const double bound = fan_in > 0 ? 1.0 / std::sqrt(static_cast<double>(fan_in)) : 0.0;
    init::uniform_(bias, -bound, bound);
  }
}

Tensor Conv2dImpl::forward(const Tensor& input) {
  return functional::conv2d(input, weight,
                            functional::Conv2dFuncOptions()
                                .bias(bias)
                                .stride(options.stride())
                                .padding(options.padding())
                                .dilation(options.dilation())
                                .groups(options.groups()));
}

void Conv2dImpl::pretty_print(std::ostream& stream) const {
  stream << "kiln::nn::Conv2d(" << options.in_channels() << ", " << options.out_channels()
         << ", kernel_size=" << options.kernel_size() << ", stride=" << options.stride();
  if (options.padding() != ExpandingArray<2>(0)) stream << ", padding=" << options.padding();
  if (options.dilation() != ExpandingArray<2>(1)) stream << ", dilation=" << options.dilation();
  if (options.groups() != 1) stream << ", groups=" << options.groups();
  if (!options.bias()) stream << ", bias=false";
  stream << ")";
}

// Built from the same options, then given this module's values (nn/module.h, clone_layer).
std::shared_ptr<Module> Conv2dImpl::clone(const std::optional<Device>& device) const {
  return internal::clone_layer(*this, std::make_shared<Conv2dImpl>(options), device);
}

}  // namespace kiln::nn
