// SGD's update, in kiln ops (in place, under the NoGradGuard of Optimizer::step).
#include "nn/optim/sgd.h"

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

}  // namespace

SGDOptions::SGDOptions(double lr) : lr_(lr) {}

std::unique_ptr<OptimizerOptions> SGDOptions::clone() const {
  return std::make_unique<SGDOptions>(*this);
}

std::map<std::string, double> SGDOptions::to_values() const {
  return {{"lr", lr_},
          {"momentum", momentum_},
          {"dampening", dampening_},
          {"weight_decay", weight_decay_},
          {"nesterov", nesterov_ ? 1.0 : 0.0}};
}

void SGDOptions::from_values(const std::map<std::string, double>& v) {
  lr_ = v.at("lr");
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
  const ScalarType dtype = state_dtype(param);
  // Computed in the state dtype; `g` is always a fresh tensor, never the grad itself.
  Tensor g = param.grad().to(dtype, /*copy=*/true);
  const Tensor p = param.dtype() == dtype ? param : param.to(dtype);
  if (o.weight_decay() != 0) g.add_(p, o.weight_decay());
  if (o.momentum() != 0) {
    auto it = state.buffers.find("momentum_buffer");
    if (it == state.buffers.end()) {
      it = state.buffers.emplace("momentum_buffer", g.clone()).first;
    } else {
      it->second.mul_(o.momentum()).add_(g, 1 - o.dampening());
    }
    const Tensor& buf = it->second;
    if (o.nesterov()) {
      g.add_(buf, o.momentum());
    } else {
      g = buf;
    }
  }
  ++state.step;
  if (param.dtype() == dtype) {
    param.add_(g, -o.lr());
  } else {
    param.copy_(p.add(g, -o.lr()));
  }
}

}  // namespace kiln::optim
