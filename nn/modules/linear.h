// Linear, Identity and Flatten modules.
//
//   kiln::nn::Linear fc(4, 1);                                       // y = x W^T + b
//   kiln::nn::Linear proj(kiln::nn::LinearOptions(512, 512).bias(false));
//   auto y = fc(x);                     // x [..., 4] -> [..., 1]
//   fc->weight;                         // [out_features, in_features]
//
// Initialisation as PyTorch: weight kaiming_uniform_(a = sqrt(5)), i.e. U(-1/sqrt(in),
// 1/sqrt(in)), and bias U(-1/sqrt(in), 1/sqrt(in)); reset_parameters() draws them again.
#pragma once

#include <cstdint>
#include <ostream>

#include "nn/functional.h"
#include "nn/module.h"

namespace kiln::nn {

struct LinearOptions {
  LinearOptions(int64_t in_features, int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  KILN_ARG(int64_t, in_features);
  KILN_ARG(int64_t, out_features);
  KILN_ARG(bool, bias) = true;
};

class LinearImpl : public Module {
 public:
  LinearImpl(int64_t in_features, int64_t out_features)
      : LinearImpl(LinearOptions(in_features, out_features)) {}
  explicit LinearImpl(const LinearOptions& options);

  // Draws the weight and bias again, as at construction.
  void reset_parameters();
  Tensor forward(const Tensor& input);
  void pretty_print(std::ostream& stream) const override;
  std::shared_ptr<Module> clone(const std::optional<Device>& device = std::nullopt) const override;

  LinearOptions options;
  Tensor weight;  // [out_features, in_features]
  Tensor bias;    // [out_features], undefined without bias
};
KILN_MODULE(Linear);

// Returns its input.
class IdentityImpl : public Module {
 public:
  Tensor forward(const Tensor& input);
  void pretty_print(std::ostream& stream) const override;
  std::shared_ptr<Module> clone(const std::optional<Device>& device = std::nullopt) const override;
};
KILN_MODULE(Identity);

struct FlattenOptions {
  KILN_ARG(int64_t, start_dim) = 1;
  KILN_ARG(int64_t, end_dim) = -1;
};

// Flattens dims start_dim..end_dim (by default all but the batch dim).
class FlattenImpl : public Module {
 public:
  explicit FlattenImpl(const FlattenOptions& options = {});
  Tensor forward(const Tensor& input);
  void pretty_print(std::ostream& stream) const override;
  std::shared_ptr<Module> clone(const std::optional<Device>& device = std::nullopt) const override;

  FlattenOptions options;
};
KILN_MODULE(Flatten);

}  // namespace kiln::nn
