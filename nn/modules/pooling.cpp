// MaxPool2d and AvgPool2d.
#include "nn/modules/pooling.h"

namespace kiln::nn {

namespace {

std::ostream& operator<<(std::ostream& stream, const ExpandingArray<2>& a) {
  return stream << "[" << a[0] << ", " << a[1] << "]";
}

}  // namespace

Tensor MaxPool2dImpl::forward(const Tensor& input) {
  return functional::max_pool2d(input, options);
}

std::tuple<Tensor, Tensor> MaxPool2dImpl::forward_with_indices(const Tensor& input) {
  return functional::max_pool2d_with_indices(input, options);
}

void MaxPool2dImpl::pretty_print(std::ostream& stream) const {
  stream << std::boolalpha << "kiln::nn::MaxPool2d(kernel_size=" << options.kernel_size()
         << ", stride=" << options.stride() << ", padding=" << options.padding()
         << ", dilation=" << options.dilation() << ", ceil_mode=" << options.ceil_mode() << ")";
}

Tensor AvgPool2dImpl::forward(const Tensor& input) {
  return functional::avg_pool2d(input, options);
}

void AvgPool2dImpl::pretty_print(std::ostream& stream) const {
  stream << "kiln::nn::AvgPool2d(kernel_size=" << options.kernel_size()
         << ", stride=" << options.stride() << ", padding=" << options.padding() << ")";
}

// Built from the same options, then given this module's values (nn/module.h, clone_layer).
std::shared_ptr<Module> MaxPool2dImpl::clone(const std::optional<Device>& device) const {
  return internal::clone_layer(*this, std::make_shared<MaxPool2dImpl>(options), device);
}
std::shared_ptr<Module> AvgPool2dImpl::clone(const std::optional<Device>& device) const {
  return internal::clone_layer(*this, std::make_shared<AvgPool2dImpl>(options), device);
}

}  // namespace kiln::nn
