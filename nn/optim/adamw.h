// kiln::optim::AdamW: Adam with decoupled weight decay, exactly as torch.optim.AdamW:
//
//   p = p * (1 - lr * weight_decay)              (before the Adam step; the gradient is untouched)
//   then Adam's update of m, v (v_max) and p, with bias correction (see adam.h)
//
//   kiln::optim::AdamW opt(model->parameters(), kiln::optim::AdamWOptions(1e-3).weight_decay(0.1));
//
// Defaults as PyTorch: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 1e-2, no amsgrad.
// step() runs the kiln::adam_update_ op (fused CPU and multi-tensor CUDA kernels, see adam.h);
// state is f32 (f64 for f64 parameters) by default. state_in_param_dtype (default false):
//
//   kiln::optim::AdamWOptions(1e-3).weight_decay(0.1).state_in_param_dtype(true)
//
// true keeps exp_avg, exp_avg_sq and max_exp_avg_sq in the parameter's dtype, as
// torch.optim.AdamW does (14 bytes moved per bf16 parameter and step instead of 22); the update
// arithmetic stays f32 and each moment is rounded to the parameter dtype when stored. CPU and
// GPU give the same bits either way; amsgrad, checkpoints, per-group use and the capturable GPU
// state (step counts on the GPU, a GPU copy of the lr) as in adam.h.
#pragma once

#include <tuple>

#include "nn/optim/optimizer.h"

namespace kiln::optim {

class AdamWOptions : public OptimizerOptions {
 public:
  using betas_t = std::tuple<double, double>;
  AdamWOptions(double lr = 1e-3);  // NOLINT: implicit, as in libtorch
  // The lr, in a tensor that the update ops take (see optimizer.h).
  KILN_OPTIM_LR_ARG();
  KILN_OPTIM_ARG(betas_t, betas) = {0.9, 0.999};
  KILN_OPTIM_ARG(double, eps) = 1e-8;
  KILN_OPTIM_ARG(double, weight_decay) = 1e-2;
  KILN_OPTIM_ARG(bool, amsgrad) = false;
  // Moments in the parameter's dtype (torch's behaviour) instead of f32; see the banner.
  KILN_OPTIM_ARG(bool, state_in_param_dtype) = false;

 public:
  std::unique_ptr<OptimizerOptions> clone() const override;
  double get_lr() const override { return lr_.get(); }
  void set_lr(double lr) override { lr_.set(lr); }
  const Tensor& lr_tensor() const override { return lr_.tensor(); }
  std::map<std::string, double> to_values() const override;
  void from_values(const std::map<std::string, double>& values) override;
  std::map<std::string, double> optional_values() const override;
};

class AdamW : public Optimizer {
 public:
  AdamW(const std::vector<OptimizerParamGroup>& param_groups, const AdamWOptions& defaults = {});
  AdamW(std::vector<Tensor> params, const AdamWOptions& defaults = {});
  // step_with_grad_factor folds the factor into the adam_update_ op (see optimizer.h).
  bool supports_grad_factor() const override { return true; }

 protected:
  void update(Tensor& param, const OptimizerOptions& options, OptimizerParamState& state) override;
  void update_group(OptimizerParamGroup& group, const Tensor& grad_factor) override;
  ScalarType state_dtype_for(const Tensor& param, const OptimizerOptions& options) const override;
  std::optional<std::vector<std::string>> state_buffer_names(
      const OptimizerOptions& options) const override;
  Device step_device(const Tensor& param) const override;
};

}  // namespace kiln::optim
