// kiln::optim::SGD: stochastic gradient descent with momentum, dampening, Nesterov momentum
// and L2 weight decay, exactly as torch.optim.SGD:
//
//   g = grad + weight_decay * p
//   b = g                                   on the first step (momentum != 0)
//   b = momentum * b + (1 - dampening) * g  afterwards
//   g = nesterov ? g + momentum * b : b
//   p = p - lr * g
//
//   kiln::optim::SGD opt(model->parameters(),
//                        kiln::optim::SGDOptions(0.01).momentum(0.9).nesterov(true));
//
// State: "momentum_buffer" (only when momentum != 0), f32 (f64 for f64 parameters). Nesterov
// needs momentum > 0 and zero dampening. step() runs, per device and dtype, one kiln::increment_
// op (the step counts, which checkpoints keep) and one kiln::sgd_update_ op, which
// takes the group's lr tensor as an input (tensor/ops/optim.cpp): a fused pass per tensor on the
// CPU, the op's decomposition into kiln ops on a GPU.
#pragma once

#include "nn/optim/optimizer.h"

namespace kiln::optim {

class SGDOptions : public OptimizerOptions {
 public:
  SGDOptions(double lr);  // NOLINT: implicit, as in libtorch
  // The lr, in a tensor that the update ops take (see optimizer.h).
  KILN_OPTIM_LR_ARG();
  KILN_OPTIM_ARG(double, momentum) = 0;
  KILN_OPTIM_ARG(double, dampening) = 0;
  KILN_OPTIM_ARG(double, weight_decay) = 0;
  KILN_OPTIM_ARG(bool, nesterov) = false;

 public:
  std::unique_ptr<OptimizerOptions> clone() const override;
  double get_lr() const override { return lr_.get(); }
  void set_lr(double lr) override { lr_.set(lr); }
  const Tensor& lr_tensor() const override { return lr_.tensor(); }
  std::map<std::string, double> to_values() const override;
  void from_values(const std::map<std::string, double>& values) override;
};

class SGD : public Optimizer {
 public:
  SGD(const std::vector<OptimizerParamGroup>& param_groups, const SGDOptions& defaults);
  SGD(std::vector<Tensor> params, const SGDOptions& defaults);

 protected:
  void update(Tensor& param, const OptimizerOptions& options, OptimizerParamState& state) override;
  void update_group(OptimizerParamGroup& group, const Tensor& grad_factor) override;
  std::optional<std::vector<std::string>> state_buffer_names(
      const OptimizerOptions& options) const override;
};

}  // namespace kiln::optim
