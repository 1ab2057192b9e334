// Normalisation layers: LayerNorm, RMSNorm and BatchNorm2d.
//
//   kiln::nn::LayerNorm ln(kiln::nn::LayerNormOptions({512}).eps(1e-6));
//   kiln::nn::RMSNorm norm(kiln::nn::RMSNormOptions({512}).eps(1e-5));
//   kiln::nn::BatchNorm2d bn(kiln::nn::BatchNorm2dOptions(64).momentum(0.01));
//
// Affine weights start at one and biases at zero, as PyTorch. BatchNorm2d normalises with the
// batch statistics in training mode (updating running_mean/running_var in place) and with the
// running statistics in eval mode; its num_batches_tracked buffer counts training batches
// (used as a cumulative average when momentum is nullopt).
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <vector>

#include "nn/functional.h"
#include "nn/module.h"

namespace kiln::nn {

struct LayerNormOptions {
  LayerNormOptions(std::vector<int64_t> normalized_shape)  // NOLINT: implicit, as libtorch
      : normalized_shape_(std::move(normalized_shape)) {}
  KILN_ARG(std::vector<int64_t>, normalized_shape);
  KILN_ARG(double, eps) = 1e-5;
  KILN_ARG(bool, elementwise_affine) = true;
  // With elementwise_affine: whether to learn a bias too (PyTorch's bias=).
  KILN_ARG(bool, bias) = true;
};

class LayerNormImpl : public Module {
 public:
  explicit LayerNormImpl(LayerNormOptions options);

  void reset_parameters();
  Tensor forward(const Tensor& input);
  void pretty_print(std::ostream& stream) const override;
  std::shared_ptr<Module> clone(const std::optional<Device>& device = std::nullopt) const override;

  LayerNormOptions options;
  Tensor weight;  // normalized_shape, undefined without elementwise_affine
  Tensor bias;
};
KILN_MODULE(LayerNorm);

struct RMSNormOptions {
  RMSNormOptions(std::vector<int64_t> normalized_shape)  // NOLINT: implicit, as libtorch
      : normalized_shape_(std::move(normalized_shape)) {}
  KILN_ARG(std::vector<int64_t>, normalized_shape);
  // nullopt: the machine epsilon of the input's dtype, as PyTorch.
  KILN_ARG(std::optional<double>, eps) = std::nullopt;
  KILN_ARG(bool, elementwise_affine) = true;
};

class RMSNormImpl : public Module {
 public:
  explicit RMSNormImpl(RMSNormOptions options);

  void reset_parameters();
  Tensor forward(const Tensor& input);
  void pretty_print(std::ostream& stream) const override;
  std::shared_ptr<Module> clone(const std::optional<Device>& device = std::nullopt) const override;

  RMSNormOptions options;
  Tensor weight;  // normalized_shape, undefined without elementwise_affine
};
KILN_MODULE(RMSNorm);

struct BatchNorm2dOptions {
  BatchNorm2dOptions(int64_t num_features) : num_features_(num_features) {}  // NOLINT
  KILN_ARG(int64_t, num_features);
  KILN_ARG(double, eps) = 1e-5;
  // nullopt: a cumulative moving average over the batches seen.
  KILN_ARG(std::optional<double>, momentum) = 0.1;
  KILN_ARG(bool, affine) = true;
  KILN_ARG(bool, track_running_stats) = true;
};

class BatchNorm2dImpl : public Module {
 public:
  explicit BatchNorm2dImpl(int64_t num_features)
      : BatchNorm2dImpl(BatchNorm2dOptions(num_features)) {}
  explicit BatchNorm2dImpl(const BatchNorm2dOptions& options);

  void reset_running_stats();
  void reset_parameters();
  // input [N, C, H, W].
  Tensor forward(const Tensor& input);
  void pretty_print(std::ostream& stream) const override;
  std::shared_ptr<Module> clone(const std::optional<Device>& device = std::nullopt) const override;

  BatchNorm2dOptions options;
  Tensor weight;  // [C], undefined without affine
  Tensor bias;
  Tensor running_mean;         // [C], undefined without track_running_stats
  Tensor running_var;          // [C]
  Tensor num_batches_tracked;  // int64 scalar
};
KILN_MODULE(BatchNorm2d);

}  // namespace kiln::nn
