// AdamW: the options and the call into the shared Adam update with decoupled weight decay.
#include "nn/optim/adamw.h"

#include "nn/optim/adam.h"

namespace kiln::optim {

AdamWOptions::AdamWOptions(double lr) : lr_(lr) {}

std::unique_ptr<OptimizerOptions> AdamWOptions::clone() const {
  return std::make_unique<AdamWOptions>(*this);
}

std::map<std::string, double> AdamWOptions::to_values() const {
  return {{"lr", lr_},
          {"beta1", std::get<0>(betas_)},
          {"beta2", std::get<1>(betas_)},
          {"eps", eps_},
          {"weight_decay", weight_decay_},
          {"amsgrad", amsgrad_ ? 1.0 : 0.0}};
}

void AdamWOptions::from_values(const std::map<std::string, double>& v) {
  lr_ = v.at("lr");
  betas_ = {v.at("beta1"), v.at("beta2")};
  eps_ = v.at("eps");
  weight_decay_ = v.at("weight_decay");
  amsgrad_ = v.at("amsgrad") != 0;
}

namespace {
void check(const AdamWOptions& o) {
  internal::check_adam_options("AdamW", o.lr(), std::get<0>(o.betas()), std::get<1>(o.betas()),
                               o.eps(), o.weight_decay());
}
}  // namespace

AdamW::AdamW(const std::vector<OptimizerParamGroup>& param_groups, const AdamWOptions& defaults)
    : Optimizer("AdamW", param_groups, defaults.clone()) {
  check(defaults);
  for (const OptimizerParamGroup& g : this->param_groups()) {
    check(internal::options_as<AdamWOptions>(g.options(), "AdamW"));
  }
}

AdamW::AdamW(std::vector<Tensor> params, const AdamWOptions& defaults)
    : AdamW(std::vector<OptimizerParamGroup>{OptimizerParamGroup(std::move(params))}, defaults) {}

void AdamW::update(Tensor& param, const OptimizerOptions& options, OptimizerParamState& state) {
  const auto& o = internal::options_as<AdamWOptions>(options, "AdamW");
  check(o);
  internal::adam_update(param, {o.lr(), std::get<0>(o.betas()), std::get<1>(o.betas()), o.eps(),
                                o.weight_decay(), o.amsgrad(), /*decoupled_weight_decay=*/true},
                        state);
}

}  // namespace kiln::optim
