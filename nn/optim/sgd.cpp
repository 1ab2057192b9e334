// SGD's step: the momentum buffers and, per device, parameter dtype and buffer dtype, one
// increment_ call for the step counts and one sgd_update_ call with the group's lr tensor
// (tensor/ops/optim.cpp, whose kernel and decomposition do the arithmetic).
#include "nn/optim/sgd.h"

#include <map>
#include <tuple>
#include <vector>

#include "autograd/grad_mode.h"
#include "tensor/error.h"
#include "tensor/ops.h"

namespace kiln::optim {

namespace {

void check_options(const SGDOptions& o) {
  KILN_CHECK(o.lr() >= 0, "[SGD] invalid learning rate: ", o.lr());
  KILN_CHECK(o.momentum() >= 0, "[SGD] invalid momentum value: ", o.momentum());
  KILN_CHECK(o.weight_decay() >= 0, "[SGD] invalid weight_decay value: ", o.weight_decay());
  KILN_CHECK(!o.nesterov() || (o.momentum() > 0 && o.dampening() == 0),
             "[SGD] Nesterov momentum requires a momentum and zero dampening (momentum ",
             o.momentum(), ", dampening ", o.dampening(), ")");
}

// The lists of one sgd_update_ call.
struct SgdLists {
  std::vector<Tensor> params, grads, momentum_buffers, steps;
  std::vector<int64_t> new_buffers;

  // Adds `param` (grad defined): its momentum buffer (new ones, and buffers of another dtype
  // than the state's, are created in the state dtype) and its step count (run increments it).
  void add(const Tensor& param, const SGDOptions& o, OptimizerParamState& state) {
    params.push_back(param);
    const Tensor& g = param.grad();
    grads.push_back(g.dtype() == param.dtype() ? g : g.to(param.dtype()));
    if (o.momentum() != 0) {
      auto it = state.buffers.find("momentum_buffer");
      const bool fresh = it == state.buffers.end();
      if (fresh) {
        it = state.buffers.emplace("momentum_buffer", Optimizer::zero_state(param)).first;
      } else if (it->second.dtype() != Optimizer::state_dtype(param)) {
        it->second = it->second.to(Optimizer::state_dtype(param)).contiguous();
      }
      momentum_buffers.push_back(it->second);
      new_buffers.push_back(fresh ? 1 : 0);
    }
    steps.push_back(state.step_tensor());
  }

  void run(const SGDOptions& o) const {
    NoGradGuard no_grad;
    increment_(steps);
    sgd_update_(params, grads, momentum_buffers, new_buffers, o.lr_tensor(), o.momentum(),
                o.dampening(), o.weight_decay(), o.nesterov());
  }
};

}  // namespace

SGDOptions::SGDOptions(double lr) : lr_(lr) {}

std::unique_ptr<OptimizerOptions> SGDOptions::clone() const {
  return std::make_unique<SGDOptions>(*this);
}

std::map<std::string, double> SGDOptions::to_values() const {
  return {{"lr", lr()},
          {"momentum", momentum_},
          {"dampening", dampening_},
          {"weight_decay", weight_decay_},
          {"nesterov", nesterov_ ? 1.0 : 0.0}};
}

void SGDOptions::from_values(const std::map<std::string, double>& v) {
  lr_.set(v.at("lr"));
  momentum_ = v.at("momentum");
  dampening_ = v.at("dampening");
  weight_decay_ = v.at("weight_decay");
  nesterov_ = v.at("nesterov") != 0;
}

SGD::SGD(const std::vector<OptimizerParamGroup>& param_groups, const SGDOptions& defaults)
    : Optimizer("SGD", param_groups, defaults.clone()) {
  check_options(defaults);
  for (const OptimizerParamGroup& g : this->param_groups()) {
    check_options(internal::options_as<SGDOptions>(g.options(), "SGD"));
  }
}

SGD::SGD(std::vector<Tensor> params, const SGDOptions& defaults)
    : SGD(std::vector<OptimizerParamGroup>{OptimizerParamGroup(std::move(params))}, defaults) {}

void SGD::update(Tensor& param, const OptimizerOptions& options, OptimizerParamState& state) {
  const auto& o = internal::options_as<SGDOptions>(options, "SGD");
  check_options(o);  // options may have been changed through param_groups()
  SgdLists lists;
  lists.add(param, o, state);
  lists.run(o);
}

void SGD::update_group(OptimizerParamGroup& group, const Tensor& grad_factor) {
  KILN_CHECK(!grad_factor.defined(), "[SGD] no gradient factor (supports_grad_factor is false)");
  const auto& o = internal::options_as<SGDOptions>(group.options(), "SGD");
  check_options(o);
  // One call per device, parameter dtype and buffer dtype.
  std::map<std::tuple<DeviceType, int, ScalarType, ScalarType>, SgdLists> calls;
  for (Tensor& p : group.params()) {
    if (!p.grad().defined()) continue;
    const Device d = p.device();
    calls[{d.type(), d.index(), p.dtype(), Optimizer::state_dtype(p)}].add(p, o, state()[p.impl()]);
  }
  for (const auto& [key, lists] : calls) lists.run(o);
}

std::optional<std::vector<std::string>> SGD::state_buffer_names(
    const OptimizerOptions& options) const {
  if (internal::options_as<SGDOptions>(options, "SGD").momentum() != 0) {
    return std::vector<std::string>{"momentum_buffer"};
  }
  return std::vector<std::string>{};
}

}  // namespace kiln::optim
