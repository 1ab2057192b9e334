// kiln::optim::Adam, exactly as torch.optim.Adam (L2 weight decay added to the gradient):
//
//   t = t + 1
//   g = grad + weight_decay * p
//   m = beta1 * m + (1 - beta1) * g             (as lerp(m, g, 1 - beta1))
//   v = beta2 * v + (1 - beta2) * g * g
//   v_max = max(v_max, v)                        (amsgrad; v_max replaces v below)
//   p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//
//   kiln::optim::Adam opt(model->parameters(),
//                         kiln::optim::AdamOptions(1e-3).betas({0.9, 0.999}).eps(1e-8));
//
// State: step (a 0-d int64 tensor, see optimizer.h: on the parameter's GPU for a GPU parameter,
// else on the CPU), "exp_avg", "exp_avg_sq", and "max_exp_avg_sq" with amsgrad, by default in f32
// for f32, bf16 and f16 parameters (f64 for f64): a bf16-true model keeps f32 moments (22 bytes
// moved per bf16 parameter and step), unlike torch.optim.Adam, whose state takes the
// parameter's dtype.
//
//   kiln::optim::AdamOptions(1e-3).state_in_param_dtype(true)
//
// true keeps exp_avg, exp_avg_sq and max_exp_avg_sq in the parameter's dtype, as
// torch.optim.Adam(W) does (bf16 moments for a bf16 parameter: 14 bytes per step); the update
// arithmetic stays f32 and each moment is rounded to the parameter dtype when stored. With
// amsgrad, v_max is the f32 maximum of the stored (rounded) v_max and the new, unrounded v; the
// denominator uses that f32 value and v_max is rounded when stored. The option may differ per
// parameter group and is saved in checkpoints (older checkpoints load as false); state created
// or loaded under the other setting is converted to the dtype the option asks for (on load, and
// at the next step when the option is changed), as torch casts loaded state to the parameter's
// dtype.
//
// step() runs, per device, parameter dtype and state dtype, one kiln::increment_ op (the step
// counts t) and one kiln::adam_update_ op, which takes the counts and the group's lr tensor as
// inputs (tensor/ops/optim.cpp): on the CPU a fused, multi-threaded pass per tensor, on a GPU a
// multi-tensor kernel that updates a whole group in a few launches; f64 parameters take the op's
// decomposition into kiln ops. All do the same float arithmetic, so CPU and GPU give the same
// bits, for 16-bit state too.
//
// Capturable on a GPU, as PyTorch's Adam(capturable=True): a GPU parameter's step count lives on
// its GPU (incremented there by increment_'s kernel), and adam_update_ takes a GPU copy of the
// group's lr (one 8-byte host-to-device copy per call, queued without waiting), so the update
// reads both when it runs and derives the bias corrections on the device, in f64 as the host
// does (kernels/cuda/optim.cu). A compiled training step then captures the update in its CUDA
// graph (docs/compiler.md, "CUDA graphs"): the lr a scheduler sets on the host is written into
// the graph's copy before each launch. Checkpoints are unchanged: the count is saved as a number
// and loaded onto the parameter's device (Optimizer::step_device).
//
// step_with_grad_factor(coef) (optimizer.h) passes a gradient factor (gradient clipping's
// coefficient) to adam_update_, which multiplies each gradient as it reads it: the bits of
// foreach_mul_(grads, coef) then step(), one pass over the gradients fewer.
#pragma once

#include <tuple>

#include "nn/optim/optimizer.h"

namespace kiln::optim {

class AdamOptions : public OptimizerOptions {
 public:
  using betas_t = std::tuple<double, double>;
  AdamOptions(double lr = 1e-3);  // NOLINT: implicit, as in libtorch
  // The lr, in a tensor that the update ops take (see optimizer.h).
  KILN_OPTIM_LR_ARG();
  KILN_OPTIM_ARG(betas_t, betas) = {0.9, 0.999};
  KILN_OPTIM_ARG(double, eps) = 1e-8;
  KILN_OPTIM_ARG(double, weight_decay) = 0;
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

class Adam : public Optimizer {
 public:
  Adam(const std::vector<OptimizerParamGroup>& param_groups, const AdamOptions& defaults = {});
  Adam(std::vector<Tensor> params, const AdamOptions& defaults = {});
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

namespace internal {

// The hyper-parameters of one Adam or AdamW step.
struct AdamStep {
  Tensor lr;  // the group's lr tensor (OptimizerOptions::lr_tensor)
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  bool amsgrad;
  bool decoupled_weight_decay;  // AdamW: p *= 1 - lr * weight_decay, gradient untouched
  bool state_in_param_dtype;    // moments in the parameter's dtype (else f32, f64 for f64)
};

// The dtype of a parameter's moments: the parameter's with state_in_param_dtype, else
// Optimizer::state_dtype (f64 for f64 parameters, f32 otherwise).
ScalarType adam_state_dtype(const Tensor& param, bool state_in_param_dtype);

// Where a parameter's step count lives: on its GPU for a GPU parameter (capturable), else the CPU.
Device adam_step_device(const Tensor& param);

void check_adam_options(const char* name, double lr, double beta1, double beta2, double eps,
                        double weight_decay);

// One Adam/AdamW update of `param` (grad defined) and its state: its state created (or
// converted to the options' dtype), then an increment_ op of its step count and an adam_update_
// op.
void adam_update(Tensor& param, const AdamStep& s, OptimizerParamState& state);

// The update of every parameter of `params` that has a gradient: one increment_ op call (the
// step counts) and one adam_update_ op call per device, parameter dtype and state dtype, each
// taking `grad_factor` when it is defined (moved to the call's device unless it is a CPU tensor).
void adam_update_group(std::vector<Tensor>& params, const AdamStep& s,
                       std::unordered_map<const TensorImpl*, OptimizerParamState>& states,
                       const Tensor& grad_factor = Tensor());

// What AdamOptions and AdamWOptions share (they differ only in the weight-decay default and in
// how the decay is applied): checkpoint values, checks and the step's hyper-parameters.
template <typename O>
std::map<std::string, double> adam_to_values(const O& o) {
  return {{"lr", o.lr()},
          {"beta1", std::get<0>(o.betas())},
          {"beta2", std::get<1>(o.betas())},
          {"eps", o.eps()},
          {"weight_decay", o.weight_decay()},
          {"amsgrad", o.amsgrad() ? 1.0 : 0.0},
          {"state_in_param_dtype", o.state_in_param_dtype() ? 1.0 : 0.0}};
}

// Keys that checkpoints written before they existed lack, with the value to assume.
inline std::map<std::string, double> adam_optional_values() {
  return {{"state_in_param_dtype", 0.0}};
}

template <typename O>
void adam_from_values(O& o, const std::map<std::string, double>& v) {
  o.lr(v.at("lr"));
  o.betas({v.at("beta1"), v.at("beta2")});
  o.eps(v.at("eps"));
  o.weight_decay(v.at("weight_decay"));
  o.amsgrad(v.at("amsgrad") != 0);
  const auto it = v.find("state_in_param_dtype");
  o.state_in_param_dtype(it != v.end() && it->second != 0);
}

template <typename O>
void check_adam(const char* name, const O& o) {
  check_adam_options(name, o.lr(), std::get<0>(o.betas()), std::get<1>(o.betas()), o.eps(),
                     o.weight_decay());
}

template <typename O>
AdamStep adam_step(const O& o, bool decoupled_weight_decay) {
  return {o.lr_tensor(), std::get<0>(o.betas()), std::get<1>(o.betas()),  o.eps(), o.weight_decay(),
          o.amsgrad(),   decoupled_weight_decay, o.state_in_param_dtype()};
}

}  // namespace internal

}  // namespace kiln::optim
