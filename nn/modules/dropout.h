// Dropout and Dropout2d: zero elements (or whole channels) with probability p in training
// mode, scaling the rest by 1 / (1 - p); the identity in eval mode.
//
//   kiln::nn::Dropout drop(0.1);           // or DropoutOptions().p(0.1)
//   model->eval();                         // turns every dropout off
#pragma once

#include <ostream>

#include "nn/functional.h"
#include "nn/module.h"

namespace kiln::nn {

struct DropoutOptions {
  DropoutOptions(double p = 0.5) : p_(p) {}  // NOLINT: implicit, as libtorch
  KILN_ARG(double, p);
  KILN_ARG(bool, inplace) = false;
};
using Dropout2dOptions = DropoutOptions;

class DropoutImpl : public Module {
 public:
  explicit DropoutImpl(const DropoutOptions& options = {});
  Tensor forward(const Tensor& input);
  void pretty_print(std::ostream& stream) const override;
  std::shared_ptr<Module> clone(const std::optional<Device>& device = std::nullopt) const override;

  DropoutOptions options;
};
KILN_MODULE(Dropout);

// Drops whole channels: input [N, C, H, W] or [C, H, W]; one draw per (sample, channel).
class Dropout2dImpl : public Module {
 public:
  explicit Dropout2dImpl(const Dropout2dOptions& options = {});
  Tensor forward(const Tensor& input);
  void pretty_print(std::ostream& stream) const override;
  std::shared_ptr<Module> clone(const std::optional<Device>& device = std::nullopt) const override;

  Dropout2dOptions options;
};
KILN_MODULE(Dropout2d);

}  // namespace kiln::nn
