// Adam and AdamW's step: the state (created, or converted to the dtype the options ask for) and,
// per device, parameter dtype and state dtype, one increment_ call for the step counts and one
// adam_update_ call with the group's lr tensor (tensor/ops/optim.cpp, whose kernels and
// decomposition do the arithmetic). On a GPU the counts live on the parameters' device and the
// call takes a GPU copy of the lr (capturable: see adam.h).
#include "nn/optim/adam.h"

#include <map>
#include <tuple>
#include <utility>
#include <vector>

#include "autograd/grad_mode.h"
#include "tensor/error.h"
#include "tensor/ops.h"
#include "tensor/ops/optim.h"

namespace kiln::optim {

namespace internal {

Device adam_step_device(const Tensor& param) {
  return param.is_cuda() ? param.device() : Device(kCPU);
}

ScalarType adam_state_dtype(const Tensor& param, bool state_in_param_dtype) {
  return state_in_param_dtype ? param.dtype() : Optimizer::state_dtype(param);
}

void check_adam_options(const char* name, double lr, double beta1, double beta2, double eps,
                        double weight_decay) {
  KILN_CHECK(lr >= 0, "[", name, "] invalid learning rate: ", lr);
  KILN_CHECK(eps >= 0, "[", name, "] invalid epsilon value: ", eps);
  KILN_CHECK(beta1 >= 0 && beta1 < 1, "[", name, "] invalid beta parameter at index 0: ", beta1);
  KILN_CHECK(beta2 >= 0 && beta2 < 1, "[", name, "] invalid beta parameter at index 1: ", beta2);
  KILN_CHECK(weight_decay >= 0, "[", name, "] invalid weight_decay value: ", weight_decay);
}

namespace {

// Creates the state buffers on the parameter's first step, in the dtype the options ask for.
// Buffers of another dtype (created under the other setting of state_in_param_dtype, or set by
// hand) are converted to it, as load() converts a checkpoint's.
void ensure_state(const Tensor& param, const AdamStep& s, OptimizerParamState& state) {
  const ScalarType dtype = adam_state_dtype(param, s.state_in_param_dtype);
  const TensorOptions options = TensorOptions().dtype(dtype).device(param.device());
  auto& bufs = state.buffers;
  if (bufs.find("exp_avg") == bufs.end()) {
    bufs["exp_avg"] = zeros(param.sizes(), options);
    bufs["exp_avg_sq"] = zeros(param.sizes(), options);
  }
  if (s.amsgrad && bufs.find("max_exp_avg_sq") == bufs.end()) {
    bufs["max_exp_avg_sq"] = zeros(param.sizes(), options);
  }
  for (const char* name : {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}) {
    const auto it = bufs.find(name);
    if (it != bufs.end() && it->second.dtype() != dtype) {
      it->second = it->second.to(dtype).contiguous();
    }
  }
}

// The lists of one adam_update_ call.
struct AdamLists {
  std::vector<Tensor> params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps;

  // Adds `param` (grad defined), its state created or converted, and its step count (run
  // increments it).
  void add(const Tensor& param, const AdamStep& s, OptimizerParamState& state) {
    ensure_state(param, s, state);
    auto& bufs = state.buffers;
    params.push_back(param);
    const Tensor& g = param.grad();
    grads.push_back(g.dtype() == param.dtype() ? g : g.to(param.dtype()));
    exp_avgs.push_back(bufs.at("exp_avg"));
    exp_avg_sqs.push_back(bufs.at("exp_avg_sq"));
    if (s.amsgrad) max_exp_avg_sqs.push_back(bufs.at("max_exp_avg_sq"));
    steps.push_back(state.step_tensor(adam_step_device(param)));
  }

  // One increment_ call for every step count, then the update, which reads the counts, the lr
  // (a copy on the parameters' device when the counts are there) and the gradient factor, if
  // defined (on the parameters' device unless it is a CPU tensor).
  void run(const AdamStep& s, const Tensor& grad_factor) const {
    NoGradGuard no_grad;
    increment_(steps);
    Tensor factor = grad_factor;
    const Device d = params[0].device();
    if (factor.defined() && !factor.is_cpu() && factor.device() != d) factor = factor.to(d);
    const Tensor lr = steps[0].device() == s.lr.device() ? s.lr : s.lr.to(steps[0].device());
    adam_update_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps, lr, s.beta1, s.beta2,
                 s.weight_decay, s.eps, s.amsgrad, s.decoupled_weight_decay, factor);
  }
};

}  // namespace

void adam_update_group(std::vector<Tensor>& params, const AdamStep& s,
                       std::unordered_map<const TensorImpl*, OptimizerParamState>& states,
                       const Tensor& grad_factor) {
  // One call per device, parameter dtype and state dtype.
  std::map<std::tuple<DeviceType, int, ScalarType, ScalarType>, AdamLists> calls;
  for (Tensor& p : params) {
    if (!p.grad().defined()) continue;
    const Device d = p.device();
    calls[{d.type(), d.index(), p.dtype(), adam_state_dtype(p, s.state_in_param_dtype)}].add(
        p, s, states[p.impl()]);
  }
  for (const auto& [key, lists] : calls) lists.run(s, grad_factor);
}

void adam_update(Tensor& param, const AdamStep& s, OptimizerParamState& state) {
  AdamLists lists;
  lists.add(param, s, state);
  lists.run(s, Tensor());
}

}  // namespace internal

AdamOptions::AdamOptions(double lr) : lr_(lr) {}

std::unique_ptr<OptimizerOptions> AdamOptions::clone() const {
  return std::make_unique<AdamOptions>(*this);
}

std::map<std::string, double> AdamOptions::to_values() const {
  return internal::adam_to_values(*this);
}

void AdamOptions::from_values(const std::map<std::string, double>& v) {
  internal::adam_from_values(*this, v);
}

std::map<std::string, double> AdamOptions::optional_values() const {
  return internal::adam_optional_values();
}

Adam::Adam(const std::vector<OptimizerParamGroup>& param_groups, const AdamOptions& defaults)
    : Optimizer("Adam", param_groups, defaults.clone()) {
  internal::check_adam("Adam", defaults);
  for (const OptimizerParamGroup& g : this->param_groups()) {
    internal::check_adam("Adam", internal::options_as<AdamOptions>(g.options(), "Adam"));
  }
}

Adam::Adam(std::vector<Tensor> params, const AdamOptions& defaults)
    : Adam(std::vector<OptimizerParamGroup>{OptimizerParamGroup(std::move(params))}, defaults) {}

void Adam::update_group(OptimizerParamGroup& group, const Tensor& grad_factor) {
  const auto& o = internal::options_as<AdamOptions>(group.options(), "Adam");
  internal::check_adam("Adam", o);
  internal::adam_update_group(group.params(),
                              internal::adam_step(o, /*decoupled_weight_decay=*/false), state(),
                              grad_factor);
}

Device Adam::step_device(const Tensor& param) const { return internal::adam_step_device(param); }

ScalarType Adam::state_dtype_for(const Tensor& param, const OptimizerOptions& options) const {
  return internal::adam_state_dtype(
      param, internal::options_as<AdamOptions>(options, "Adam").state_in_param_dtype());
}

std::optional<std::vector<std::string>> Adam::state_buffer_names(
    const OptimizerOptions& options) const {
  if (internal::options_as<AdamOptions>(options, "Adam").amsgrad()) {
    return std::vector<std::string>{"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  }
  return std::vector<std::string>{"exp_avg", "exp_avg_sq"};
}

void Adam::update(Tensor& param, const OptimizerOptions& options, OptimizerParamState& state) {
  const auto& o = internal::options_as<AdamOptions>(options, "Adam");
  internal::check_adam("Adam", o);
  internal::adam_update(param, internal::adam_step(o, /*decoupled_weight_decay=*/false), state);
}

}  // namespace kiln::optim
