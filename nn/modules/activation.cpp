// Activation modules.
#include "nn/modules/activation.h"

#include "tensor/ops.h"

namespace kiln::nn {

Tensor ReLUImpl::forward(const Tensor& input) { return functional::relu(input, options.inplace()); }

void ReLUImpl::pretty_print(std::ostream& stream) const {
  stream << "kiln::nn::ReLU(";
  if (options.inplace()) stream << "inplace=true";
  stream << ")";
}

Tensor LeakyReLUImpl::forward(const Tensor& input) {
  return functional::leaky_relu(input, functional::LeakyReLUFuncOptions()
                                           .negative_slope(options.negative_slope())
                                           .inplace(options.inplace()));
}

void LeakyReLUImpl::pretty_print(std::ostream& stream) const {
  stream << "kiln::nn::LeakyReLU(negative_slope=" << options.negative_slope();
  if (options.inplace()) stream << ", inplace=true";
  stream << ")";
}

GELUImpl::GELUImpl(GELUOptions options_) : options(std::move(options_)) {
  KILN_CHECK(options.approximate() == "none" || options.approximate() == "tanh",
             "[GELU] approximate must be \"none\" or \"tanh\", got \"", options.approximate(),
             "\"");
}

Tensor GELUImpl::forward(const Tensor& input) {
  return functional::gelu(input, functional::GELUFuncOptions().approximate(options.approximate()));
}

void GELUImpl::pretty_print(std::ostream& stream) const {
  stream << "kiln::nn::GELU(";
  if (options.approximate() != "none") stream << "approximate='" << options.approximate() << "'";
  stream << ")";
}

Tensor SiLUImpl::forward(const Tensor& input) { return functional::silu(input); }
void SiLUImpl::pretty_print(std::ostream& stream) const { stream << "kiln::nn::SiLU()"; }

Tensor TanhImpl::forward(const Tensor& input) { return input.tanh(); }
void TanhImpl::pretty_print(std::ostream& stream) const { stream << "kiln::nn::Tanh()"; }

Tensor SigmoidImpl::forward(const Tensor& input) { return input.sigmoid(); }
void SigmoidImpl::pretty_print(std::ostream& stream) const { stream << "kiln::nn::Sigmoid()"; }

Tensor SoftmaxImpl::forward(const Tensor& input, std::optional<ScalarType> dtype) {
  return functional::softmax(input, options.dim(), dtype);
}

void SoftmaxImpl::pretty_print(std::ostream& stream) const {
  stream << "kiln::nn::Softmax(dim=" << options.dim() << ")";
}

Tensor LogSoftmaxImpl::forward(const Tensor& input, std::optional<ScalarType> dtype) {
  return functional::log_softmax(input, options.dim(), dtype);
}

void LogSoftmaxImpl::pretty_print(std::ostream& stream) const {
  stream << "kiln::nn::LogSoftmax(dim=" << options.dim() << ")";
}

// Built from the same options, then given this module's values (nn/module.h, clone_layer).
std::shared_ptr<Module> ReLUImpl::clone(const std::optional<Device>& device) const {
  return internal::clone_layer(*this, std::make_shared<ReLUImpl>(options), device);
}
std::shared_ptr<Module> LeakyReLUImpl::clone(const std::optional<Device>& device) const {
  return internal::clone_layer(*this, std::make_shared<LeakyReLUImpl>(options), device);
}
std::shared_ptr<Module> GELUImpl::clone(const std::optional<Device>& device) const {
  return internal::clone_layer(*this, std::make_shared<GELUImpl>(options), device);
}
std::shared_ptr<Module> SiLUImpl::clone(const std::optional<Device>& device) const {
  return internal::clone_layer(*this, std::make_shared<SiLUImpl>(), device);
}
std::shared_ptr<Module> TanhImpl::clone(const std::optional<Device>& device) const {
  return internal::clone_layer(*this, std::make_shared<TanhImpl>(), device);
}
std::shared_ptr<Module> SigmoidImpl::clone(const std::optional<Device>& device) const {
  return internal::clone_layer(*this, std::make_shared<SigmoidImpl>(), device);
}
std::shared_ptr<Module> SoftmaxImpl::clone(const std::optional<Device>& device) const {
  return internal::clone_layer(*this, std::make_shared<SoftmaxImpl>(options), device);
}
std::shared_ptr<Module> LogSoftmaxImpl::clone(const std::optional<Device>& device) const {
  return internal::clone_layer(*this, std::make_shared<LogSoftmaxImpl>(options), device);
}

}  // namespace kiln::nn
