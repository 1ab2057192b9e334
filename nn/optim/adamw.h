// kiln::optim::AdamW: Adam with decoupled weight decay, exactly as torch.optim.AdamW:
//
//   p = p * (1 - lr * weight_decay)              (before the Adam step; the gradient is untouched)
//   then Adam's update of m, v (v_max) and p, with bias correction (see adam.h)
//
//   kiln::optim::AdamW opt(model->parameters(), kiln::optim::AdamWOptions(1e-3).weight_decay(0.1));
//
// Defaults as PyTorch: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 1e-2, no amsgrad.
// Contiguous f32 CPU parameters take the fused loop of adam.cpp (one pass per tensor), CUDA
// parameters the multi-tensor kernel (a few launches per group); state is f32 (see adam.h).
#pragma once

#include <tuple>

#include "nn/optim/optimizer.h"

namespace kiln::optim {

class AdamWOptions : public OptimizerOptions {
 public:
  using betas_t = std::tuple<double, double>;
  AdamWOptions(double lr = 1e-3);  // NOLINT: implicit, as in libtorch
  KILN_OPTIM_ARG(double, lr);
  KILN_OPTIM_ARG(betas_t, betas) = {0.9, 0.999};
  KILN_OPTIM_ARG(double, eps) = 1e-8;
  KILN_OPTIM_ARG(double, weight_decay) = 1e-2;
  KILN_OPTIM_ARG(bool, amsgrad) = false;

 public:
  std::unique_ptr<OptimizerOptions> clone() const override;
  double get_lr() const override { return lr_; }
  void set_lr(double lr) override { lr_ = lr; }
  std::map<std::string, double> to_values() const override;
  void from_values(const std::map<std::string, double>& values) override;
};

class AdamW : public Optimizer {
 public:
  AdamW(const std::vector<OptimizerParamGroup>& param_groups, const AdamWOptions& defaults = {});
  AdamW(std::vector<Tensor> params, const AdamWOptions& defaults = {});

 protected:
  void update(Tensor& param, const OptimizerOptions& options,
              OptimizerParamState& state) override;
  void update_group(OptimizerParamGroup& group) override;
};

}  // namespace kiln::optim
