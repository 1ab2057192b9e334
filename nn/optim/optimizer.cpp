// The optimizer base: groups, zero_grad, the step loop and the checkpoint layout.
#include "nn/optim/optimizer.h"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <unordered_set>

#include "autograd/grad_mode.h"
#include "tensor/error.h"
#include "tensor/ops.h"

namespace kiln::optim {

namespace {

// Numbers in metadata round-trip exactly: the shortest decimal that reads back as the same
// double ("0.1", not "0.10000000000000001").
std::string format_double(double v) {
  char buf[64];
  const std::to_chars_result r = std::to_chars(buf, buf + sizeof(buf), v);
  return std::string(buf, r.ptr);
}

double parse_double(const std::string& s, const std::string& key) {
  double v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  KILN_CHECK(!s.empty() && ec == std::errc() && end == s.data() + s.size(),
             "[Optimizer::load] metadata entry \"", key, "\" is not a number: \"", s, "\"");
  return v;
}

int64_t parse_int(const std::string& s, const std::string& key) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  KILN_CHECK(!s.empty() && end == s.c_str() + s.size() && errno == 0,
             "[Optimizer::load] metadata entry \"", key, "\" is not an integer: \"", s, "\"");
  return static_cast<int64_t>(v);
}

// "exp_avg, exp_avg_sq".
std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

const std::string& metadata_at(const SafetensorsMetadata& metadata, const std::string& key) {
  auto it = metadata.find(key);
  KILN_CHECK(it != metadata.end(), "[Optimizer::load] the checkpoint has no metadata entry \"", key,
             "\"");
  return it->second;
}

// A 0-d CPU tensor holding `value`, made without an op call (options may be made anywhere).
template <typename T>
Tensor host_scalar(T value) {
  Tensor t = empty(IntArrayRef(), TensorOptions().dtype(dtype_of<T>()));
  *t.data_ptr<T>() = value;
  return t;
}

}  // namespace

// --- LrTensor, OptimizerParamState -------------------------------------------------------------

LrTensor::LrTensor(double lr) : tensor_(host_scalar(lr)) {}

LrTensor& LrTensor::operator=(const LrTensor& other) {
  set(other.get());
  return *this;
}

double LrTensor::get() const { return *tensor_.data_ptr<double>(); }

void LrTensor::set(double lr) {
  *tensor_.data_ptr<double>() = lr;
  tensor_.impl()->bump_version();
}

int64_t OptimizerParamState::step_count() const {
  return step.defined() ? step.item<int64_t>() : 0;
}

const Tensor& OptimizerParamState::step_tensor(Device device) {
  if (!step.defined()) {
    step = device.is_cpu() ? host_scalar(int64_t{0})
                           : zeros(IntArrayRef(), TensorOptions().dtype(kInt64).device(device));
  } else if (step.device() != device) {
    step = step.to(device);
  }
  return step;
}

// --- OptimizerParamGroup -----------------------------------------------------------------------

OptimizerParamGroup::OptimizerParamGroup(const OptimizerParamGroup& other)
    : params_(other.params_), options_(other.options_ ? other.options_->clone() : nullptr) {}

OptimizerParamGroup& OptimizerParamGroup::operator=(const OptimizerParamGroup& other) {
  if (this != &other) {
    params_ = other.params_;
    options_ = other.options_ ? other.options_->clone() : nullptr;
  }
  return *this;
}

OptimizerOptions& OptimizerParamGroup::options() {
  KILN_CHECK(options_ != nullptr, "[OptimizerParamGroup] the group has no options");
  return *options_;
}

const OptimizerOptions& OptimizerParamGroup::options() const {
  KILN_CHECK(options_ != nullptr, "[OptimizerParamGroup] the group has no options");
  return *options_;
}

// --- Optimizer ---------------------------------------------------------------------------------

Optimizer::Optimizer(std::string name, std::vector<OptimizerParamGroup> param_groups,
                     std::unique_ptr<OptimizerOptions> defaults)
    : name_(std::move(name)), defaults_(std::move(defaults)) {
  for (const OptimizerParamGroup& group : param_groups) add_param_group(group);
}

void Optimizer::add_param_group(const OptimizerParamGroup& group) {
  std::unordered_set<const TensorImpl*> seen;
  for (const OptimizerParamGroup& g : param_groups_) {
    for (const Tensor& p : g.params()) seen.insert(p.impl());
  }
  for (const Tensor& p : group.params()) {
    KILN_CHECK(p.defined(), "[", name_, "] a parameter is an undefined tensor");
    KILN_CHECK(p.is_floating_point(), "[", name_,
               "] can only optimize floating-point tensors, got dtype ", dtype_name(p.dtype()));
    KILN_CHECK(p.is_leaf(), "[", name_, "] can't optimize a non-leaf tensor");
    KILN_CHECK(seen.insert(p.impl()).second, "[", name_,
               "] some parameters appear in more than one parameter group (or twice in one)");
  }
  OptimizerParamGroup added(group.params());
  added.set_options(group.has_options() ? group.options().clone() : defaults_->clone());
  param_groups_.push_back(std::move(added));
}

void Optimizer::zero_grad(bool set_to_none) {
  for (OptimizerParamGroup& group : param_groups_) {
    for (Tensor& p : group.params()) {
      Tensor& g = p.mutable_grad();
      if (!g.defined()) continue;
      if (set_to_none) {
        g = Tensor();
      } else {
        if (g.grad_fn() != nullptr) {
          g = g.detach();
        } else if (g.requires_grad()) {
          g.requires_grad_(false);
        }
        g.zero_();
      }
    }
  }
}

Tensor Optimizer::step(const LossClosure& closure) {
  return step_with_grad_factor(Tensor(), closure);
}

Tensor Optimizer::step_with_grad_factor(const Tensor& grad_factor, const LossClosure& closure) {
  if (grad_factor.defined()) {
    KILN_CHECK(supports_grad_factor(), "[", name_, "] step_with_grad_factor: ", name_,
               " does not fold a gradient factor into its update; multiply the gradients "
               "(foreach_mul_) and call step()");
    KILN_CHECK(grad_factor.dim() == 0 && grad_factor.is_floating_point(), "[", name_,
               "] step_with_grad_factor: the factor must be a 0-d floating-point tensor, got a ",
               dtype_name(grad_factor.dtype()), " tensor of shape ",
               shape_str(grad_factor.sizes()));
  }
  Tensor loss;
  if (closure) {
    AutoGradMode enable(true);
    loss = closure();
  }
  NoGradGuard no_grad;
  for (OptimizerParamGroup& group : param_groups_) update_group(group, grad_factor);
  return loss;
}

void Optimizer::update_group(OptimizerParamGroup& group, const Tensor& grad_factor) {
  KILN_CHECK(!grad_factor.defined(), "[", name_,
             "] update_group: a gradient factor needs an update_group that applies it");
  for (Tensor& p : group.params()) {
    if (!p.grad().defined()) continue;
    update(p, group.options(), state_[p.impl()]);
  }
}

std::vector<Tensor> Optimizer::parameters() const {
  std::vector<Tensor> out;
  for (const OptimizerParamGroup& g : param_groups_) {
    out.insert(out.end(), g.params().begin(), g.params().end());
  }
  return out;
}

size_t Optimizer::size() const {
  size_t n = 0;
  for (const OptimizerParamGroup& g : param_groups_) n += g.params().size();
  return n;
}

void Optimizer::set_lr(double lr) {
  for (OptimizerParamGroup& g : param_groups_) g.options().set_lr(lr);
}

double Optimizer::get_lr() const {
  KILN_CHECK(!param_groups_.empty(), "[", name_, "] get_lr: the optimizer has no parameter groups");
  return param_groups_.front().options().get_lr();
}

ScalarType Optimizer::state_dtype(const Tensor& param) {
  return param.dtype() == kFloat64 ? kFloat64 : kFloat32;
}

ScalarType Optimizer::state_dtype_for(const Tensor& param, const OptimizerOptions& options) const {
  (void)options;
  return state_dtype(param);
}

std::optional<std::vector<std::string>> Optimizer::state_buffer_names(
    const OptimizerOptions& options) const {
  (void)options;
  return std::nullopt;
}

Device Optimizer::step_device(const Tensor& param) const {
  (void)param;
  return Device(kCPU);
}

Tensor Optimizer::zero_state(const Tensor& param) {
  return zeros(param.sizes(), TensorOptions().dtype(state_dtype(param)).device(param.device()));
}

// --- Checkpoints -------------------------------------------------------------------------------

TensorMap Optimizer::state_dict(SafetensorsMetadata* metadata) const {
  KILN_CHECK(metadata != nullptr, "[", name_, "] state_dict needs a metadata map to fill");
  TensorMap tensors;
  SafetensorsMetadata& meta = *metadata;
  meta["kiln.optimizer"] = name_;
  meta["param_groups"] = std::to_string(param_groups_.size());
  int64_t index = 0;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const OptimizerParamGroup& group = param_groups_[g];
    const std::string prefix = "param_groups." + std::to_string(g) + ".";
    meta[prefix + "num_params"] = std::to_string(group.params().size());
    for (const auto& [key, value] : group.options().to_values()) {
      meta[prefix + key] = format_double(value);
    }
    for (const Tensor& p : group.params()) {
      auto it = state_.find(p.impl());
      if (it != state_.end()) {
        const std::string sp = "state." + std::to_string(index) + ".";
        meta[sp + "step"] = std::to_string(it->second.step_count());
        for (const auto& [name, buffer] : it->second.buffers) tensors[sp + name] = buffer;
      }
      ++index;
    }
  }
  return tensors;
}

void Optimizer::load_state_dict(const TensorMap& tensors, const SafetensorsMetadata& metadata) {
  const std::string saved_name = metadata_at(metadata, "kiln.optimizer");
  KILN_CHECK(saved_name == name_, "[", name_, "::load] the checkpoint holds the state of ",
             saved_name, ", not ", name_);
  const int64_t num_groups = parse_int(metadata_at(metadata, "param_groups"), "param_groups");
  KILN_CHECK(num_groups == static_cast<int64_t>(param_groups_.size()), "[", name_,
             "::load] the checkpoint has ", num_groups, " parameter groups, the optimizer ",
             param_groups_.size());
  // Check everything before changing anything, so that a failed load leaves the optimizer
  // as it was.
  std::vector<std::map<std::string, double>> group_values(param_groups_.size());
  std::vector<std::unique_ptr<OptimizerOptions>> loaded_options;
  int64_t index = 0;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const std::string prefix = "param_groups." + std::to_string(g) + ".";
    const int64_t n =
        parse_int(metadata_at(metadata, prefix + "num_params"), prefix + "num_params");
    KILN_CHECK(n == static_cast<int64_t>(param_groups_[g].params().size()), "[", name_,
               "::load] group ", g, " has ", n, " parameters in the checkpoint, ",
               param_groups_[g].params().size(), " in the optimizer");
    const OptimizerOptions& options = param_groups_[g].options();
    const std::map<std::string, double> optional = options.optional_values();
    for (const auto& [key, unused] : options.to_values()) {
      const auto opt = optional.find(key);
      if (opt != optional.end() && metadata.find(prefix + key) == metadata.end()) {
        group_values[g][key] = opt->second;  // a checkpoint written before the key existed
        continue;
      }
      group_values[g][key] = parse_double(metadata_at(metadata, prefix + key), prefix + key);
    }
    // The group's options as the load will set them: they decide the state's dtype.
    loaded_options.push_back(options.clone());
    loaded_options.back()->from_values(group_values[g]);
    index += n;
  }
  const int64_t num_params = index;
  std::vector<std::pair<const TensorImpl*, OptimizerParamState>> loaded;
  std::unordered_set<std::string> used;
  index = 0;
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    for (const Tensor& p : param_groups_[g].params()) {
      const ScalarType dtype = state_dtype_for(p, *loaded_options[g]);
      const std::string sp = "state." + std::to_string(index++) + ".";
      auto step_it = metadata.find(sp + "step");
      if (step_it == metadata.end()) continue;
      OptimizerParamState st;
      st.step = host_scalar(parse_int(step_it->second, sp + "step"));
      if (step_device(p) != st.step.device()) st.step = st.step.to(step_device(p));
      const auto expected = state_buffer_names(*loaded_options[g]);
      if (expected) {
        for (const std::string& b : *expected) {
          KILN_CHECK(tensors.contains(sp + b), "[", name_, "::load] the checkpoint has no \"", sp,
                     b, "\" (parameter ", index - 1, " has taken ", step_it->second,
                     " steps; its state must hold ", join(*expected), ")");
        }
      }
      for (auto it = tensors.lower_bound(sp); it != tensors.end() && it->first.starts_with(sp);
           ++it) {
        const Tensor& t = it->second;
        const std::string buffer = it->first.substr(sp.size());
        KILN_CHECK(
            !expected || std::find(expected->begin(), expected->end(), buffer) != expected->end(),
            "[", name_, "::load] unexpected tensor \"", it->first, "\" in the checkpoint (", name_,
            " keeps ", expected && !expected->empty() ? join(*expected) : "no buffers",
            " for a parameter)");
        KILN_CHECK(is_floating_point(t.dtype()), "[", name_, "::load] \"", it->first, "\" is ",
                   dtype_name(t.dtype()), ", not a floating-point buffer (the state is ",
                   dtype_name(dtype), ")");
        KILN_CHECK(t.sizes() == p.sizes(), "[", name_, "::load] \"", it->first, "\" has shape ",
                   shape_str(t.sizes()), " but its parameter has shape ", shape_str(p.sizes()));
        // Own the data (the loaded tensor may alias a file mapping), on the parameter's device,
        // in the dtype the group's options ask for (converted when saved in another).
        st.buffers[buffer] =
            t.to(p.device(), dtype, /*non_blocking=*/false, /*copy=*/true).contiguous();
        used.insert(it->first);
      }
      loaded.emplace_back(p.impl(), std::move(st));
    }
  }
  for (const auto& [key, unused] : tensors) {
    KILN_CHECK(used.count(key) != 0, "[", name_, "::load] unexpected tensor \"", key,
               "\" in the checkpoint (the optimizer has ", num_params, " parameters)");
  }
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    param_groups_[g].options().from_values(group_values[g]);
  }
  state_.clear();
  for (auto& [impl, st] : loaded) state_[impl] = std::move(st);
}

void Optimizer::save(const std::string& path) const {
  SafetensorsMetadata metadata;
  TensorMap tensors = state_dict(&metadata);
  save_safetensors(tensors, path, metadata);
}

void Optimizer::load(const std::string& path) {
  SafetensorsMetadata metadata;
  TensorMap tensors = load_safetensors(path, &metadata);
  load_state_dict(tensors, metadata);
}

}  // namespace kiln::optim
