// Linear, Identity and Flatten.
#include "nn/modules/linear.h"

#include <cmath>

#include "nn/init.h"
#include "tensor/ops.h"

namespace kiln::nn {

LinearImpl::LinearImpl(const LinearOptions& options_) : options(options_) {
  KILN_CHECK(options.in_features() >= 0 && options.out_features() >= 0,
             "[Linear] in_features and out_features must be non-negative, got ",
             options.in_features(), " and ", options.out_features());
  weight =
      register_parameter("weight", kiln::empty({options.out_features(), options.in_features()}));
  bias = options.bias() ? register_parameter("bias", kiln::empty({options.out_features()}))
                        : register_parameter("bias", Tensor(), /*requires_grad=*/false);
  reset_parameters();
}

void LinearImpl::reset_parameters() {
  init::kaiming_uniform_(weight, std::sqrt(5.0));
  if (bias.defined()) {
    const int64_t fan_in = options.in_features();
    const double bound = fan_in > 0 ? 1.0 / std::sqrt(static_cast<double>(fan_in)) : 0.0;
    init::uniform_(bias, -bound, bound);
  }
}

Tensor LinearImpl::forward(const Tensor& input) { return functional::linear(input, weight, bias); }

void LinearImpl::pretty_print(std::ostream& stream) const {
  stream << std::boolalpha << "kiln::nn::Linear(in_features=" << options.in_features()
         << ", out_features=" << options.out_features() << ", bias=" << options.bias() << ")";
}

Tensor IdentityImpl::forward(const Tensor& input) { return input; }

void IdentityImpl::pretty_print(std::ostream& stream) const { stream << "kiln::nn::Identity()"; }

FlattenImpl::FlattenImpl(const FlattenOptions& options_) : options(options_) {}

Tensor FlattenImpl::forward(const Tensor& input) {
  return input.flatten(options.start_dim(), options.end_dim());
}

void FlattenImpl::pretty_print(std::ostream& stream) const {
  stream << "kiln::nn::Flatten(start_dim=" << options.start_dim()
         << ", end_dim=" << options.end_dim() << ")";
}

// Built from the same options, then given this module's values (nn/module.h, clone_layer).
std::shared_ptr<Module> LinearImpl::clone(const std::optional<Device>& device) const {
  return internal::clone_layer(*this, std::make_shared<LinearImpl>(options), device);
}
std::shared_ptr<Module> IdentityImpl::clone(const std::optional<Device>& device) const {
  return internal::clone_layer(*this, std::make_shared<IdentityImpl>(), device);
}
std::shared_ptr<Module> FlattenImpl::clone(const std::optional<Device>& device) const {
  return internal::clone_layer(*this, std::make_shared<FlattenImpl>(options), device);
}

}  // namespace kiln::nn
