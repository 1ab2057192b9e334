// LayerNorm, RMSNorm and BatchNorm2d.
#include "nn/modules/normalization.h"

#include "autograd/grad_mode.h"
#include "nn/init.h"
#include "tensor/ops.h"

namespace kiln::nn {

namespace {

void print_shape(std::ostream& stream, const std::vector<int64_t>& shape) {
  stream << "[";
  for (size_t i = 0; i < shape.size(); ++i) stream << (i ? ", " : "") << shape[i];
  stream << "]";
}

void check_shape(const std::vector<int64_t>& shape, const char* op) {
  for (int64_t s : shape) {
    KILN_CHECK(s >= 0, "[", op, "] normalized_shape must be non-negative, got ", shape_str(shape));
  }
}

}  // namespace

// --- LayerNorm -----------------------------------------------------------------------------------

LayerNormImpl::LayerNormImpl(LayerNormOptions options_) : options(std::move(options_)) {
  check_shape(options.normalized_shape(), "LayerNorm");
  if (options.elementwise_affine()) {
    weight = register_parameter("weight", kiln::empty(options.normalized_shape()));
    bias = options.bias() ? register_parameter("bias", kiln::empty(options.normalized_shape()))
                          : register_parameter("bias", Tensor(), /*requires_grad=*/false);
  } else {
    weight = register_parameter("weight", Tensor(), /*requires_grad=*/false);
    bias = register_parameter("bias", Tensor(), /*requires_grad=*/false);
  }
  reset_parameters();
}

void LayerNormImpl::reset_parameters() {
  if (weight.defined()) init::ones_(weight);
  if (bias.defined()) init::zeros_(bias);
}

Tensor LayerNormImpl::forward(const Tensor& input) {
  return functional::layer_norm(input, functional::LayerNormFuncOptions(options.normalized_shape())
                                           .weight(weight)
                                           .bias(bias)
                                           .eps(options.eps()));
}

void LayerNormImpl::pretty_print(std::ostream& stream) const {
  stream << std::boolalpha << "kiln::nn::LayerNorm(";
  print_shape(stream, options.normalized_shape());
  stream << ", eps=" << options.eps() << ", elementwise_affine=" << options.elementwise_affine();
  if (options.elementwise_affine() && !options.bias()) stream << ", bias=false";
  stream << ")";
}

// --- RMSNorm -------------------------------------------------------------------------------------

RMSNormImpl::RMSNormImpl(RMSNormOptions options_) : options(std::move(options_)) {
  check_shape(options.normalized_shape(), "RMSNorm");
  weight = options.elementwise_affine()
               ? register_parameter("weight", kiln::empty(options.normalized_shape()))
               : register_parameter("weight", Tensor(), /*requires_grad=*/false);
  reset_parameters();
}

void RMSNormImpl::reset_parameters() {
  if (weight.defined()) init::ones_(weight);
}

Tensor RMSNormImpl::forward(const Tensor& input) {
  return functional::rms_norm(
      input,
      functional::RMSNormFuncOptions(options.normalized_shape()).weight(weight).eps(options.eps()));
}

void RMSNormImpl::pretty_print(std::ostream& stream) const {
  stream << std::boolalpha << "kiln::nn::RMSNorm(";
  print_shape(stream, options.normalized_shape());
  stream << ", eps=";
  if (options.eps()) {
    stream << *options.eps();
  } else {
    stream << "None";
  }
  stream << ", elementwise_affine=" << options.elementwise_affine() << ")";
}

// --- BatchNorm2d ---------------------------------------------------------------------------------

BatchNorm2dImpl::BatchNorm2dImpl(const BatchNorm2dOptions& options_) : options(options_) {
  const int64_t c = options.num_features();
  KILN_CHECK(c > 0, "[BatchNorm2d] num_features must be positive, got ", c);
  if (options.affine()) {
    weight = register_parameter("weight", kiln::empty({c}));
    bias = register_parameter("bias", kiln::empty({c}));
  } else {
    weight = register_parameter("weight", Tensor(), /*requires_grad=*/false);
    bias = register_parameter("bias", Tensor(), /*requires_grad=*/false);
  }
  if (options.track_running_stats()) {
    running_mean = register_buffer("running_mean", zeros({c}));
    running_var = register_buffer("running_var", ones({c}));
    num_batches_tracked = register_buffer("num_batches_tracked", zeros({}, kInt64));
  } else {
    running_mean = register_buffer("running_mean", Tensor());
    running_var = register_buffer("running_var", Tensor());
    num_batches_tracked = register_buffer("num_batches_tracked", Tensor());
  }
  reset_parameters();
}

void BatchNorm2dImpl::reset_running_stats() {
  if (!options.track_running_stats()) return;
  NoGradGuard no_grad;
  running_mean.zero_();
  running_var.fill_(1);
  num_batches_tracked.zero_();
}

void BatchNorm2dImpl::reset_parameters() {
  reset_running_stats();
  if (weight.defined()) init::ones_(weight);
  if (bias.defined()) init::zeros_(bias);
}

Tensor BatchNorm2dImpl::forward(const Tensor& input) {
  KILN_CHECK(input.dim() == 4, "[BatchNorm2d] expected a 4-D input [N, C, H, W], got ",
             shape_str(input.sizes()));
  KILN_CHECK(input.size(1) == options.num_features(), "[BatchNorm2d] expected ",
             options.num_features(), " channels (dim 1), got input of shape ",
             shape_str(input.sizes()));
  double momentum = options.momentum().value_or(0.0);
  if (is_training() && options.track_running_stats()) {
    {
      NoGradGuard no_grad;
      num_batches_tracked.add_(1);
    }
    if (!options.momentum()) momentum = 1.0 / num_batches_tracked.item<double>();
  }
  // Batch statistics in training, and also in eval when there are no running statistics.
  const bool use_batch_stats = is_training() || !options.track_running_stats();
  return functional::batch_norm(input, running_mean, running_var,
                                functional::BatchNormFuncOptions()
                                    .weight(weight)
                                    .bias(bias)
                                    .training(use_batch_stats)
                                    .momentum(momentum)
                                    .eps(options.eps()));
}

void BatchNorm2dImpl::pretty_print(std::ostream& stream) const {
  stream << std::boolalpha << "kiln::nn::BatchNorm2d(" << options.num_features()
         << ", eps=" << options.eps() << ", momentum=";
  if (options.momentum()) {
    stream << *options.momentum();
  } else {
    stream << "None";
  }
  stream << ", affine=" << options.affine()
         << ", track_running_stats=" << options.track_running_stats() << ")";
}

// Built from the same options, then given this module's values (nn/module.h, clone_layer).
std::shared_ptr<Module> LayerNormImpl::clone(const std::optional<Device>& device) const {
  return internal::clone_layer(*this, std::make_shared<LayerNormImpl>(options), device);
}
std::shared_ptr<Module> RMSNormImpl::clone(const std::optional<Device>& device) const {
  return internal::clone_layer(*this, std::make_shared<RMSNormImpl>(options), device);
}
std::shared_ptr<Module> BatchNorm2dImpl::clone(const std::optional<Device>& device) const {
  return internal::clone_layer(*this, std::make_shared<BatchNorm2dImpl>(options), device);
}

}  // namespace kiln::nn
