// Activation modules: ReLU, LeakyReLU, GELU, SiLU, Tanh, Sigmoid, Softmax, LogSoftmax.
//
//   kiln::nn::Sequential mlp(kiln::nn::Linear(4, 16),
//                            kiln::nn::GELU(kiln::nn::GELUOptions().approximate("tanh")),
//                            kiln::nn::Linear(16, 1));
//   kiln::nn::Softmax softmax(/*dim=*/-1);
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>

#include "nn/functional.h"
#include "nn/module.h"

namespace kiln::nn {

struct ReLUOptions {
  ReLUOptions(bool inplace = false) : inplace_(inplace) {}  // NOLINT: implicit, as libtorch
  KILN_ARG(bool, inplace);
};

class ReLUImpl : public Module {
 public:
  explicit ReLUImpl(const ReLUOptions& options = {}) : options(options) {}
  Tensor forward(const Tensor& input);
  void pretty_print(std::ostream& stream) const override;
  std::shared_ptr<Module> clone(const std::optional<Device>& device = std::nullopt) const override;

  ReLUOptions options;
};
KILN_MODULE(ReLU);

struct LeakyReLUOptions {
  KILN_ARG(double, negative_slope) = 1e-2;
  KILN_ARG(bool, inplace) = false;
};

// x where x > 0, negative_slope * x elsewhere (F::leaky_relu).
class LeakyReLUImpl : public Module {
 public:
  explicit LeakyReLUImpl(const LeakyReLUOptions& options = {}) : options(options) {}
  Tensor forward(const Tensor& input);
  void pretty_print(std::ostream& stream) const override;
  std::shared_ptr<Module> clone(const std::optional<Device>& device = std::nullopt) const override;

  LeakyReLUOptions options;
};
KILN_MODULE(LeakyReLU);

struct GELUOptions {
  KILN_ARG(std::string, approximate) = "none";  // "none" (erf) or "tanh"
};

class GELUImpl : public Module {
 public:
  explicit GELUImpl(GELUOptions options = {});
  Tensor forward(const Tensor& input);
  void pretty_print(std::ostream& stream) const override;
  std::shared_ptr<Module> clone(const std::optional<Device>& device = std::nullopt) const override;

  GELUOptions options;
};
KILN_MODULE(GELU);

// x * sigmoid(x).
class SiLUImpl : public Module {
 public:
  Tensor forward(const Tensor& input);
  void pretty_print(std::ostream& stream) const override;
  std::shared_ptr<Module> clone(const std::optional<Device>& device = std::nullopt) const override;
};
KILN_MODULE(SiLU);

class TanhImpl : public Module {
 public:
  Tensor forward(const Tensor& input);
  void pretty_print(std::ostream& stream) const override;
  std::shared_ptr<Module> clone(const std::optional<Device>& device = std::nullopt) const override;
};
KILN_MODULE(Tanh);

class SigmoidImpl : public Module {
 public:
  Tensor forward(const Tensor& input);
  void pretty_print(std::ostream& stream) const override;
  std::shared_ptr<Module> clone(const std::optional<Device>& device = std::nullopt) const override;
};
KILN_MODULE(Sigmoid);

struct SoftmaxOptions {
  SoftmaxOptions(int64_t dim) : dim_(dim) {}  // NOLINT: implicit, as libtorch
  KILN_ARG(int64_t, dim);
};
using LogSoftmaxOptions = SoftmaxOptions;

class SoftmaxImpl : public Module {
 public:
  explicit SoftmaxImpl(int64_t dim) : SoftmaxImpl(SoftmaxOptions(dim)) {}
  explicit SoftmaxImpl(const SoftmaxOptions& options) : options(options) {}
  Tensor forward(const Tensor& input, std::optional<ScalarType> dtype = std::nullopt);
  void pretty_print(std::ostream& stream) const override;
  std::shared_ptr<Module> clone(const std::optional<Device>& device = std::nullopt) const override;

  SoftmaxOptions options;
};
KILN_MODULE(Softmax);

class LogSoftmaxImpl : public Module {
 public:
  explicit LogSoftmaxImpl(int64_t dim) : LogSoftmaxImpl(LogSoftmaxOptions(dim)) {}
  explicit LogSoftmaxImpl(const LogSoftmaxOptions& options) : options(options) {}
  Tensor forward(const Tensor& input, std::optional<ScalarType> dtype = std::nullopt);
  void pretty_print(std::ostream& stream) const override;
  std::shared_ptr<Module> clone(const std::optional<Device>& device = std::nullopt) const override;

  LogSoftmaxOptions options;
};
KILN_MODULE(LogSoftmax);

}  // namespace kiln::nn
