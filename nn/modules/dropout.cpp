// Dropout and Dropout2d.
#include "nn/modules/dropout.h"

#include "tensor/ops.h"

namespace kiln::nn {

namespace {

void check_p(double p, const char* op) {
  KILN_CHECK(p >= 0 && p <= 1, "[", op, "] dropout probability has to be between 0 and 1, got ", p);
}

void print(std::ostream& stream, const char* name, const DropoutOptions& o) {
  stream << std::boolalpha << "kiln::nn::" << name << "(p=" << o.p() << ", inplace=" << o.inplace()
         << ")";
}

}  // namespace

DropoutImpl::DropoutImpl(const DropoutOptions& options_) : options(options_) {
  check_p(options.p(), "Dropout");
}

Tensor DropoutImpl::forward(const Tensor& input) {
  return functional::dropout(input, functional::DropoutFuncOptions()
                                        .p(options.p())
                                        .training(is_training())
                                        .inplace(options.inplace()));
}

void DropoutImpl::pretty_print(std::ostream& stream) const { print(stream, "Dropout", options); }

Dropout2dImpl::Dropout2dImpl(const Dropout2dOptions& options_) : options(options_) {
  check_p(options.p(), "Dropout2d");
}

Tensor Dropout2dImpl::forward(const Tensor& input) {
  KILN_CHECK(input.dim() == 3 || input.dim() == 4,
             "[Dropout2d] expected a 3-D [C, H, W] or 4-D [N, C, H, W] input, got ",
             shape_str(input.sizes()));
  if (!is_training() || options.p() == 0) return input;
  // One keep/drop draw per channel, broadcast over the spatial dims.
  Shape mask_shape(input.sizes().begin(), input.sizes().end());
  mask_shape[mask_shape.size() - 1] = 1;
  mask_shape[mask_shape.size() - 2] = 1;
  if (options.p() == 1) return input * zeros(mask_shape, input.options());
  const Tensor mask =
      bernoulli(zeros(mask_shape, input.options()), 1 - options.p()).div(1 - options.p());
  if (options.inplace()) {
    Tensor out = input;
    return out.mul_(mask);
  }
  return input * mask;
}

void Dropout2dImpl::pretty_print(std::ostream& stream) const {
  print(stream, "Dropout2d", options);
}

// Built from the same options, then given this module's values (nn/module.h, clone_layer).
std::shared_ptr<Module> DropoutImpl::clone(const std::optional<Device>& device) const {
  return internal::clone_layer(*this, std::make_shared<DropoutImpl>(options), device);
}
std::shared_ptr<Module> Dropout2dImpl::clone(const std::optional<Device>& device) const {
  return internal::clone_layer(*this, std::make_shared<Dropout2dImpl>(options), device);
}

}  // namespace kiln::nn
