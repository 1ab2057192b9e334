// kiln::optim::Optimizer: the base of SGD, Adam and AdamW, in libtorch's spelling.
//
//   kiln::optim::AdamW opt(model->parameters(), kiln::optim::AdamWOptions(1e-3).weight_decay(0.1));
//   for (...) {
//     opt.zero_grad();              // grads to undefined (set_to_none = true, as libtorch)
//     loss.backward();
//     opt.step();                   // under NoGradGuard; parameters without a grad are skipped
//   }
//   opt.set_lr(3e-4);               // every group; or per group, as in libtorch:
//   static_cast<kiln::optim::AdamWOptions&>(opt.param_groups()[0].options()).lr(3e-4);
//   opt.save("opt.safetensors");    // state and options; opt2.load(...) resumes bit-exactly
//
// Parameter groups carry their own options (e.g. no weight decay for norms and biases):
//
//   std::vector<kiln::optim::OptimizerParamGroup> groups;
//   groups.emplace_back(decay_params);   // takes the optimizer's defaults
//   groups.emplace_back(no_decay_params, std::make_unique<kiln::optim::AdamWOptions>(
//                                            kiln::optim::AdamWOptions(1e-3).weight_decay(0)));
//   kiln::optim::AdamW opt(groups, kiln::optim::AdamWOptions(1e-3).weight_decay(0.1));
//
// State: per parameter, a step count and named buffers ("momentum_buffer"; "exp_avg",
// "exp_avg_sq", "max_exp_avg_sq"), kept in f32 (f64 for f64 parameters; Adam and AdamW with
// state_in_param_dtype: the parameter's dtype), created on the parameter's first step. The
// checkpoint is a safetensors file: tensors "state.<index>.<buffer>" where <index> counts
// parameters over all groups in order (as PyTorch's state_dict), and metadata holding the step
// counts and every group's options.
//
// What changes from step to step lives in tensors that the update ops take as inputs (as
// PyTorch's capturable Adam keeps state['step'] and a tensor lr), so that a recorded training
// step (kiln::compile) replays with the current values rather than step 1's:
// - each parameter's step count is a 0-d int64 tensor (OptimizerParamState::step), advanced
//   by one increment_ op call per update call: on the CPU, or, for Adam and AdamW, on a GPU
//   parameter's GPU (step_device), where a CUDA graph's update reads it (adam.h);
// - each group's learning rate is a 0-d f64 CPU tensor owned by the group's options
//   (lr_tensor()); set_lr and lr(v) write it in place, so the tensor a recorded step holds stays
//   the group's. Copying options copies the value into a new tensor (see LrTensor): groups never
//   share one.
//
// Pitfalls:
// - State is keyed by the parameter's TensorImpl: replacing a parameter by a new tensor (rather
//   than updating it in place) loses its state.
// - load() needs the same group structure (groups, parameters per group, shapes) and the same
//   optimizer type; it restores every group's options (lr included), as PyTorch does. Each
//   state holds exactly the buffers the optimizer keeps (a missing second moment, an unknown
//   buffer are errors), floating point ones (a float dtype other than the state's is converted,
//   as torch casts state to the parameter's).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "nn/safetensors.h"
#include "tensor/error.h"
#include "tensor/tensor.h"

// Declares a builder-style option: `opts.name(v)` sets it and returns the options,
// `opts.name()` reads it (as libtorch's TORCH_ARG).
#define KILN_OPTIM_ARG(T, name)                        \
 public:                                               \
  auto name(const T& new_##name) -> decltype(*this) {  \
    name##_ = new_##name;                              \
    return *this;                                      \
  }                                                    \
  const T& name() const noexcept { return name##_; }   \
  T& name() noexcept { return name##_; }               \
                                                       \
 private:                                              \
  T name##_

// Declares the learning rate of an options class, in a tensor (LrTensor): `opts.lr(v)` writes it
// and returns the options, `opts.lr()` reads it; the class's get_lr, set_lr and lr_tensor
// overrides use lr_.
#define KILN_OPTIM_LR_ARG()                    \
 public:                                       \
  auto lr(double new_lr) -> decltype(*this) {  \
    lr_.set(new_lr);                           \
    return *this;                              \
  }                                            \
  double lr() const { return lr_.get(); }      \
                                               \
 private:                                      \
  ::kiln::optim::LrTensor lr_

namespace kiln::optim {

// A learning rate held in a 0-d f64 CPU tensor, which the update ops take as an input: set()
// writes the value in place and never replaces the tensor. Copies are deep: a copy (and so
// OptimizerOptions::clone, and the options every parameter group gets) has its own tensor
// holding the same value, so that changing one group's lr never changes another's or the
// defaults'. Assignment writes the other's value into this tensor, keeping its identity.
class LrTensor {
 public:
  explicit LrTensor(double lr);
  LrTensor(const LrTensor& other) : LrTensor(other.get()) {}
  LrTensor& operator=(const LrTensor& other);

  double get() const;
  void set(double lr);
  const Tensor& tensor() const { return tensor_; }

 private:
  Tensor tensor_;
};

// The options of one optimizer (and of one parameter group). Derived options add their
// hyper-parameters with KILN_OPTIM_ARG, their lr with KILN_OPTIM_LR_ARG, and say how they are
// written to a checkpoint.
class OptimizerOptions {
 public:
  virtual ~OptimizerOptions() = default;
  // A copy with its own lr tensor (LrTensor).
  virtual std::unique_ptr<OptimizerOptions> clone() const = 0;
  virtual double get_lr() const = 0;
  // Writes the lr tensor in place.
  virtual void set_lr(double lr) = 0;
  // The 0-d f64 CPU tensor holding the lr, which the update ops take: the same tensor for the
  // options' whole life.
  virtual const Tensor& lr_tensor() const = 0;
  // Every hyper-parameter as a number (bools as 0/1), by name; read back by from_values.
  virtual std::map<std::string, double> to_values() const = 0;
  virtual void from_values(const std::map<std::string, double>& values) = 0;
  // The keys of to_values that checkpoints written before the key existed lack, with the value
  // load() assumes for them (any other missing key is an error).
  virtual std::map<std::string, double> optional_values() const { return {}; }
};

// A list of parameters with, optionally, its own options (else the optimizer's defaults).
class OptimizerParamGroup {
 public:
  OptimizerParamGroup(std::vector<Tensor> params)  // NOLINT: implicit, as in libtorch
      : params_(std::move(params)) {}
  OptimizerParamGroup(std::vector<Tensor> params, std::unique_ptr<OptimizerOptions> options)
      : params_(std::move(params)), options_(std::move(options)) {}
  OptimizerParamGroup(const OptimizerParamGroup& other);
  OptimizerParamGroup& operator=(const OptimizerParamGroup& other);
  OptimizerParamGroup(OptimizerParamGroup&&) noexcept = default;
  OptimizerParamGroup& operator=(OptimizerParamGroup&&) noexcept = default;

  bool has_options() const { return options_ != nullptr; }
  OptimizerOptions& options();
  const OptimizerOptions& options() const;
  void set_options(std::unique_ptr<OptimizerOptions> options) { options_ = std::move(options); }
  std::vector<Tensor>& params() { return params_; }
  const std::vector<Tensor>& params() const { return params_; }

 private:
  std::vector<Tensor> params_;
  std::unique_ptr<OptimizerOptions> options_;
};

// What an optimizer keeps for one parameter.
struct OptimizerParamState {
  // The number of steps taken: a 0-d int64 tensor on the optimizer's step_device for the
  // parameter (the CPU; for Adam and AdamW a GPU parameter's GPU), created on the first step and
  // advanced in place by the increment_ op of each step; undefined (0 steps) before. load()
  // creates it from the checkpoint, on that device.
  Tensor step;
  std::map<std::string, Tensor> buffers;

  // The count as a number (read from the GPU when it is there: waits for the device).
  int64_t step_count() const;
  // The step tensor on `device`, created (0) if undefined, moved there if it is elsewhere (a
  // count set by hand): what an update call increments.
  const Tensor& step_tensor(Device device = Device(kCPU));
};

class Optimizer {
 public:
  // Recomputes the loss (with grad mode on) before the update; step() returns its value.
  using LossClosure = std::function<Tensor()>;

  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;
  virtual ~Optimizer() = default;

  // Adds a group; a group without options gets a copy of the defaults. Parameters must be
  // floating-point leaves and appear in one group only.
  void add_param_group(const OptimizerParamGroup& group);

  // Clears every parameter's gradient: undefined when set_to_none, else zeroed in place
  // (detached from any graph first, as libtorch).
  void zero_grad(bool set_to_none = true);

  // One update of every parameter that has a gradient; returns the closure's loss (or an
  // undefined tensor without a closure).
  Tensor step(const LossClosure& closure = nullptr);

  // step() with every gradient multiplied by `grad_factor` as the update reads it, the gradients
  // themselves left as they are: gradient clipping folded into the update, which reads every
  // gradient anyway (one pass over them fewer than foreach_mul_ then step()).
  //
  //   const Tensor coef = (max_norm / (total_norm + 1e-6)).clamp_max(1.0);  // on the GPU
  //   opt.step_with_grad_factor(coef);   // the bits of foreach_mul_(grads, coef); opt.step()
  //
  // grad_factor: a 0-d floating tensor on the parameters' device (read there: no host sync) or
  // on the CPU; undefined is step(). Adam and AdamW support it (supports_grad_factor()); other
  // optimizers refuse it. Like torch's fused Adam's grad_scale (which GradScaler sets as an
  // attribute for the next step), it is a tensor, so a recorded step (kiln::compile) replays
  // with its current value; unlike an attribute, it is an argument of this one step.
  Tensor step_with_grad_factor(const Tensor& grad_factor, const LossClosure& closure = nullptr);
  // Whether step_with_grad_factor folds the factor into the update (Adam, AdamW).
  virtual bool supports_grad_factor() const { return false; }

  std::vector<OptimizerParamGroup>& param_groups() { return param_groups_; }
  const std::vector<OptimizerParamGroup>& param_groups() const { return param_groups_; }
  OptimizerOptions& defaults() { return *defaults_; }
  const OptimizerOptions& defaults() const { return *defaults_; }
  // All parameters over all groups, in order.
  std::vector<Tensor> parameters() const;
  // The number of parameters over all groups.
  size_t size() const;

  // Sets the learning rate of every group; get_lr reads the first group's.
  void set_lr(double lr);
  double get_lr() const;

  const std::string& name() const { return name_; }
  std::unordered_map<const TensorImpl*, OptimizerParamState>& state() { return state_; }
  const std::unordered_map<const TensorImpl*, OptimizerParamState>& state() const {
    return state_;
  }

  // The state as named tensors plus metadata (the layout described at the top of this file),
  // and back. load_state_dict copies the tensors onto the parameters' devices.
  TensorMap state_dict(SafetensorsMetadata* metadata) const;
  void load_state_dict(const TensorMap& tensors, const SafetensorsMetadata& metadata);
  // The same through a safetensors file (written atomically).
  void save(const std::string& path) const;
  void load(const std::string& path);

  // The dtype in which state is kept for `param`: f64 for f64 parameters, else f32.
  static ScalarType state_dtype(const Tensor& param);
  // A zero state buffer shaped like `param`, on its device, in state_dtype.
  static Tensor zero_state(const Tensor& param);

 protected:
  Optimizer(std::string name, std::vector<OptimizerParamGroup> param_groups,
            std::unique_ptr<OptimizerOptions> defaults);

  // Updates `param` (whose grad is defined) by the rule of the optimizer, with `options` of
  // its group. Runs under NoGradGuard.
  virtual void update(Tensor& param, const OptimizerOptions& options,
                      OptimizerParamState& state) = 0;

  // Updates every parameter of `group` that has a gradient (under NoGradGuard), each gradient
  // multiplied by `grad_factor` when it is defined (only where supports_grad_factor()). The
  // default calls update() for each; SGD, Adam and AdamW override it to update the group with one
  // multi-tensor op call (sgd_update_, adam_update_) per device and dtype.
  virtual void update_group(OptimizerParamGroup& group, const Tensor& grad_factor);

  // The dtype of `param`'s state buffers under `options` (its group's): state_dtype by default.
  // load_state_dict converts loaded buffers to it, as torch casts floating state to the
  // parameter's dtype.
  virtual ScalarType state_dtype_for(const Tensor& param, const OptimizerOptions& options) const;

  // The buffers a parameter's state holds once it has taken a step under `options` (its
  // group's): load_state_dict requires exactly these. nullopt (the default) accepts any.
  virtual std::optional<std::vector<std::string>> state_buffer_names(
      const OptimizerOptions& options) const;

  // The device of `param`'s step count: the CPU by default; Adam and AdamW keep a GPU
  // parameter's on its GPU. load_state_dict creates the loaded counts there.
  virtual Device step_device(const Tensor& param) const;

 private:
  std::string name_;
  std::vector<OptimizerParamGroup> param_groups_;
  std::unique_ptr<OptimizerOptions> defaults_;
  std::unordered_map<const TensorImpl*, OptimizerParamState> state_;
};

namespace internal {
// `options` as the options type O of optimizer `name`, failing clearly when a group was given
// another optimizer's options.
template <typename O>
const O& options_as(const OptimizerOptions& options, const char* name) {
  const O* o = dynamic_cast<const O*>(&options);
  KILN_CHECK(o != nullptr, "[", name, "] a parameter group has the options of another optimizer");
  return *o;
}
}  // namespace internal

}  // namespace kiln::optim
