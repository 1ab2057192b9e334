// AdamW: the options and the call into the shared Adam update with decoupled weight decay.
#include "nn/optim/adamw.h"

#include "nn/optim/adam.h"

namespace kiln::optim {

AdamWOptions::AdamWOptions(double lr) : lr_(lr) {}

std::unique_ptr<OptimizerOptions> AdamWOptions::clone() const {
  return std::make_unique<AdamWOptions>(*this);
}

std::map<std::string, double> AdamWOptions::to_values() const {
  return internal::adam_to_values(*this);
}

void AdamWOptions::from_values(const std::map<std::string, double>& v) {
  internal::adam_from_values(*this, v);
}

std::map<std::string, double> AdamWOptions::optional_values() const {
  return internal::adam_optional_values();
}

AdamW::AdamW(const std::vector<OptimizerParamGroup>& param_groups, const AdamWOptions& defaults)
    : Optimizer("AdamW", param_groups, defaults.clone()) {
  internal::check_adam("AdamW", defaults);
  for (const OptimizerParamGroup& g : this->param_groups()) {
    internal::check_adam("AdamW", internal::options_as<AdamWOptions>(g.options(), "AdamW"));
  }
}

AdamW::AdamW(std::vector<Tensor> params, const AdamWOptions& defaults)
    : AdamW(std::vector<OptimizerParamGroup>{OptimizerParamGroup(std::move(params))}, defaults) {}

void AdamW::update(Tensor& param, const OptimizerOptions& options, OptimizerParamState& state) {
  const auto& o = internal::options_as<AdamWOptions>(options, "AdamW");
  internal::check_adam("AdamW", o);
  internal::adam_update(param, internal::adam_step(o, /*decoupled_weight_decay=*/true), state);
}

std::optional<std::vector<std::string>> AdamW::state_buffer_names(
    const OptimizerOptions& options) const {
  if (internal::options_as<AdamWOptions>(options, "AdamW").amsgrad()) {
    return std::vector<std::string>{"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  }
  return std::vector<std::string>{"exp_avg", "exp_avg_sq"};
}

}  // namespace kiln::optim

namespace kiln::optim {

void AdamW::update_group(OptimizerParamGroup& group, const Tensor& grad_factor) {
  const auto& o = internal::options_as<AdamWOptions>(group.options(), "AdamW");
  internal::check_adam("AdamW", o);
  internal::adam_update_group(group.params(),
                              internal::adam_step(o, /*decoupled_weight_decay=*/true), state(),
                              grad_factor);
}

Device AdamW::step_device(const Tensor& param) const { return internal::adam_step_device(param); }

ScalarType AdamW::state_dtype_for(const Tensor& param, const OptimizerOptions& options) const {
  return internal::adam_state_dtype(
      param, internal::options_as<AdamWOptions>(options, "AdamW").state_in_param_dtype());
}

}  // namespace kiln::optim
