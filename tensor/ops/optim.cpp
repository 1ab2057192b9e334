// adam_update_ and sgd_update_, the optimizer updates as multi-tensor in-place registry ops (as
// torch._fused_adam_ / _fused_adamw_ / _fused_sgd_), with their decompositions, and increment_,
// which advances the optimizers' step counts (call layout: tensor/ops/optim.h; kernels:
// kernels/cpu/optim.cpp and kernels/cuda/optim.cu, which compute in f32; callers:
// nn/optim/adam.cpp, adamw.cpp, sgd.cpp; tests: tests/tensor/optim_test.cpp,
// tests/kernels/gpu_optim_test.cpp). They have no backward: optimizers call them under
// NoGradGuard.
//
// What changes from step to step is an input, never an attribute, so that a recorded training
// step (kiln::compile freezes attributes) replays with the current values: the learning rate is
// a 0-d f64 tensor, each parameter's step count a 0-d int64 tensor (its optimizer state, advanced
// by increment_). On the CPU they join inputs on any device (allow_cpu_scalars) and kernels read
// them on the host. adam_update_ also takes them on the parameters' device (lr and counts all on
// the CPU or all there): its CUDA kernel then reads them and derives the bias corrections on the
// device, so that a CUDA graph of the update replays with the current values (PyTorch's
// capturable Adam); Adam and AdamW keep a GPU parameter's count on its GPU and pass a GPU copy of
// the group's lr (nn/optim/adam.h). The meta rules check their dtype, shape and device and never
// read them (tracing runs on data-less proxies); the values are checked (lr >= 0, counts >= 1)
// where kernels and decompositions decode them on the host (not those the CUDA kernel reads on
// the device).
//
// increment_(tensors[n]; n) adds 1 to each 0-d int64 tensor, all on the CPU or all on one GPU
// (one call for all the step counts of an update call; on a GPU one kernel, kernels/cuda/optim.cu).
//
// adam_update_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr
// [, grad_factor]; n, beta1, beta2, eps, weight_decay, decoupled_weight_decay, amsgrad) writes
// params, exp_avgs, exp_avg_sqs and max_exp_avg_sqs. For each parameter, with t its step count
// (state_steps[i], already incremented):
//   g = grad * grad_factor                 (with a factor; the grads themselves are not written)
//   p = p * (1 - lr * weight_decay)        (decoupled: AdamW)    g = g + weight_decay * p  (Adam)
//   m = lerp(m, g, 1 - beta1),  v = beta2 * v + (1 - beta2) * g * g,  v_max = max(v_max, v)
//   p = p - lr / (1 - beta1^t) * m / (sqrt(v or v_max) / sqrt(1 - beta2^t) + eps)
// sgd_update_(params, grads, momentum_buffers, lr; n, momentum, dampening, weight_decay,
// nesterov, new_buffers) writes params and momentum_buffers:
//   g = g + weight_decay * p,  b = g (new buffer) or momentum * b + (1 - dampening) * g,
//   g = nesterov ? g + momentum * b : b,  p = p - lr * g
//
// The gradient factor folds a scaling of the gradients (gradient clipping's coefficient) into
// the update, which reads every gradient anyway, instead of a pass that rewrites them
// (foreach_mul_) before it. It is a 0-d floating tensor on the parameters' device (read there:
// nothing waits for the GPU) or on the CPU. The product is formed exactly as foreach_mul_(grads,
// factor) forms it: the factor read in the compute dtype (f32 for f32/bf16/f16 grads, f64 for f64),
// each product rounded once to the grad's dtype, then read by the update as it reads a grad. So a
// call with a factor gives the bits of foreach_mul_(grads, factor) followed by the call without it
// (for bf16/f16 grads the rounding costs two conversions per element). One exception: a 0-d
// f32/bf16/f16 grad with an f64 factor, which foreach_mul_ multiplies in f64 (t.mul_'s promotion
// of two 0-d operands); the update multiplies in f32 whatever the shape.
//
// One call holds parameters of one dtype on one device, grads of their dtype and shape, and
// state of one dtype: the parameters' (f32 for f32, f64 for f64, or bf16/f16 with
// state_in_param_dtype) or f32 for bf16/f16 parameters. The arithmetic is in the compute dtype
// (f32, f64 for f64), each stored value rounded once into its tensor's dtype; any strides.
#include "tensor/ops/optim.h"

#include <cmath>
#include <limits>
#include <string>

#include "tensor/ops.h"
#include "tensor/registry.h"
#include "tensor/storage.h"
#include "tensor/tensor_impl.h"

namespace kiln {

namespace internal {

namespace {

// Attribute indices.
enum AdamAttr : size_t { kAdamN, kBeta1, kBeta2, kEps, kAdamWd, kDecoupled, kAmsgrad };
enum SgdAttr : size_t { kSgdN, kMomentum, kDampening, kSgdWd, kNesterov, kNewBuffers };

constexpr double kUndecoded = std::numeric_limits<double>::quiet_NaN();

int64_t list_length(const OpCall& c, size_t attr) {
  const int64_t n = c.attr<int64_t>(attr);
  KILN_CHECK(n >= 0, "[", c.name(), "] the list length n must be non-negative, got ", n);
  return n;
}

TensorList list(const OpCall& c, int64_t index, int64_t n) {
  return TensorList(c.inputs.data() + index * n, static_cast<size_t>(n));
}

// The value of a 0-d CPU tensor the meta rule accepted (a proxy has none: a clear error).
template <typename T>
T host_value(const Tensor& t) {
  return *t.const_data_ptr<T>();
}

// The value of a 0-d tensor on the CPU, or on a GPU (copied to the host: waits for the device;
// a traced call's proxy has none, see the error).
template <typename T>
T any_value(const OpCall& c, const Tensor& t) {
  if (t.is_cpu()) return host_value<T>(t);
  KILN_CHECK(!t.impl()->storage()->is_proxy(), "[", c.name(),
             "] the decomposition (f64 parameters) reads the lr and step counts on the host, "
             "which a call traced by kiln::compile on ",
             t.device().str(),
             " cannot: train in f32, bf16 or f16, or keep the update out of the compiled function");
  return t.item<T>();
}

double decode_lr(const OpCall& c, const Tensor& lr_tensor) {
  const double lr = any_value<double>(c, lr_tensor);
  KILN_CHECK(lr >= 0, "[", c.name(), "] invalid learning rate: ", lr);
  return lr;
}

}  // namespace

ScalarType optim_compute_dtype(const OpCall& call) {
  // Input 0 is params[0] when the call has parameters (n > 0, attribute 0 of both updates).
  return call.attr<int64_t>(0) > 0 && call.input(0).dtype() == kDouble ? kDouble : kFloat;
}

AdamUpdateCall::AdamUpdateCall(const OpCall& c, OptimDecode decode)
    : lr(kUndecoded),
      beta1(c.attr<double>(kBeta1)),
      beta2(c.attr<double>(kBeta2)),
      eps(c.attr<double>(kEps)),
      weight_decay(c.attr<double>(kAdamWd)),
      decoupled_weight_decay(c.attr<bool>(kDecoupled)),
      amsgrad(c.attr<bool>(kAmsgrad)) {
  const int64_t n = list_length(c, kAdamN);
  const int64_t lists = amsgrad ? 5 : 4;
  const int64_t inputs = static_cast<int64_t>(c.inputs.size());
  KILN_CHECK(inputs == (lists + 1) * n + 1 || inputs == (lists + 1) * n + 2,
             "[adam_update_] expected ", (lists + 1) * n + 1, " tensors for n = ", n,
             " (params, grads, exp_avgs, exp_avg_sqs", amsgrad ? ", max_exp_avg_sqs" : "",
             ", state_steps, then lr) or ", (lists + 1) * n + 2, " with a grad_factor, got ",
             c.inputs.size());
  params = list(c, 0, n);
  grads = list(c, 1, n);
  exp_avgs = list(c, 2, n);
  exp_avg_sqs = list(c, 3, n);
  max_exp_avg_sqs = amsgrad ? list(c, 4, n) : TensorList();
  state_steps = list(c, lists, n);
  lr_tensor = c.inputs[static_cast<size_t>((lists + 1) * n)];
  if (inputs == (lists + 1) * n + 2) grad_factor = c.inputs.back();
  device_scalars = n > 0 && lr_tensor.defined() && !lr_tensor.is_cpu() && !lr_tensor.is_meta();
  if (decode == OptimDecode::kLayout || (decode == OptimDecode::kHostValues && device_scalars)) {
    return;
  }
  lr = decode_lr(c, lr_tensor);
  step_values_.reserve(state_steps.size());
  for (size_t i = 0; i < state_steps.size(); ++i) {
    const int64_t t = any_value<int64_t>(c, state_steps[i]);
    KILN_CHECK(t >= 1, "[adam_update_] state_steps[", i, "] is ", t, ": step counts start at 1");
    step_values_.push_back(t);
  }
  steps = IntArrayRef(step_values_.data(), step_values_.size());
}

AdamStepScalars AdamUpdateCall::step_scalars(size_t i) const {
  KILN_CHECK(i < steps.size(), "[adam_update_] step_scalars(", i,
             ") of a call decoded without its values (OptimDecode::kLayout, or kHostValues with "
             "the scalars on the device)");
  const double t = static_cast<double>(steps[i]);
  const double bc1 = 1 - std::pow(beta1, t);
  const double bc2 = 1 - std::pow(beta2, t);
  return {1 - lr * weight_decay, lr / bc1, std::sqrt(bc2)};
}

SgdUpdateCall::SgdUpdateCall(const OpCall& c, OptimDecode decode)
    : lr(kUndecoded),
      momentum(c.attr<double>(kMomentum)),
      dampening(c.attr<double>(kDampening)),
      weight_decay(c.attr<double>(kSgdWd)),
      nesterov(c.attr<bool>(kNesterov)) {
  const int64_t n = list_length(c, kSgdN);
  const int64_t lists = momentum != 0 ? 3 : 2;
  KILN_CHECK(static_cast<int64_t>(c.inputs.size()) == lists * n + 1, "[sgd_update_] expected ",
             lists * n + 1, " tensors for n = ", n, " (params, grads",
             momentum != 0 ? ", momentum_buffers" : "", ", then lr), got ", c.inputs.size());
  const Shape& fresh = c.attr<Shape>(kNewBuffers);
  const int64_t flags = momentum != 0 ? n : 0;
  KILN_CHECK(static_cast<int64_t>(fresh.size()) == flags, "[sgd_update_] expected ", flags,
             " new_buffers flags (one per momentum buffer), got ", fresh.size());
  params = list(c, 0, n);
  grads = list(c, 1, n);
  momentum_buffers = momentum != 0 ? list(c, 2, n) : TensorList();
  lr_tensor = c.inputs.back();
  new_buffers = IntArrayRef(fresh.data(), fresh.size());
  if (decode == OptimDecode::kValues) lr = decode_lr(c, lr_tensor);
}

}  // namespace internal

namespace {

using internal::AdamUpdateCall;
using internal::OptimDecode;
using internal::SgdUpdateCall;

// "params[3]": entry i of a list, for messages.
std::string entry(const char* list, size_t i) {
  return std::string(list) + "[" + std::to_string(i) + "]";
}

// A tensor the kernels read on the host: 0-d, of `dtype`, on the CPU (or a meta proxy of one,
// while tracing: a proxy cannot join real tensors, common_device sees to that). Never reads it.
void check_host_scalar(const char* op, const std::string& name, const Tensor& t, ScalarType dtype) {
  KILN_CHECK(t.defined(), "[", op, "] ", name, " is undefined");
  KILN_CHECK(t.dtype() == dtype && t.dim() == 0 && (t.is_cpu() || t.is_meta()), "[", op, "] ", name,
             " must be a 0-d ", dtype_name(dtype), " CPU tensor, got a ", dtype_name(t.dtype()),
             " tensor of shape ", shape_str(t.sizes()), " on ", t.device().str());
}

// The lr and step counts of adam_update_: 0-d f64 and int64 tensors, all on the CPU (or meta
// proxies of CPU tensors) or all on the parameters' device. Never reads them.
void check_adam_scalars(const AdamUpdateCall& a) {
  const Device d = !a.params.empty() && a.params[0].defined() ? a.params[0].device() : Device(kCPU);
  const Tensor& lr = a.lr_tensor;
  auto on_host = [](const Tensor& t) { return t.is_cpu() || t.is_meta(); };
  KILN_CHECK(lr.defined(), "[adam_update_] lr is undefined");
  KILN_CHECK(lr.dtype() == kDouble && lr.dim() == 0 && (on_host(lr) || lr.device() == d),
             "[adam_update_] lr must be a 0-d float64 CPU tensor, got a ", dtype_name(lr.dtype()),
             " tensor of shape ", shape_str(lr.sizes()), " on ", lr.device().str(),
             " (or a 0-d float64 tensor on the params' device, ", d.str(), ", read there)");
  const bool host = on_host(lr);
  for (size_t i = 0; i < a.state_steps.size(); ++i) {
    const Tensor& t = a.state_steps[i];
    KILN_CHECK(t.defined(), "[adam_update_] ", entry("state_steps", i), " is undefined");
    KILN_CHECK(t.dtype() == kInt64 && t.dim() == 0 && (host ? on_host(t) : t.device() == d),
               "[adam_update_] ", entry("state_steps", i), " must be a 0-d int64 ",
               host ? std::string("CPU tensor") : "tensor on " + d.str(), ", got a ",
               dtype_name(t.dtype()), " tensor of shape ", shape_str(t.sizes()), " on ",
               t.device().str(),
               " (the step counts are where the lr is: all on the CPU or all on the params' "
               "device)");
  }
}

// Parameters of one floating dtype and device; grads of their dtype and shape on their device.
void check_params_and_grads(const char* op, TensorList params, TensorList grads) {
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor& p = params[i];
    const Tensor& g = grads[i];
    KILN_CHECK(p.defined(), "[", op, "] ", entry("params", i), " is undefined");
    KILN_CHECK(g.defined(), "[", op, "] ", entry("grads", i), " is undefined");
    KILN_CHECK(is_floating_point(p.dtype()), "[", op, "] expected floating-point params, got ",
               dtype_name(p.dtype()), " for ", entry("params", i));
    const Tensor& p0 = params[0];
    KILN_CHECK(p.dtype() == p0.dtype(), "[", op, "] ", entry("params", i), " has dtype ",
               dtype_name(p.dtype()), " but params[0] has ", dtype_name(p0.dtype()),
               ": one call takes parameters of one dtype");
    KILN_CHECK(p.device() == p0.device(), "[", op, "] ", entry("params", i), " is on ",
               p.device().str(), " but params[0] is on ", p0.device().str());
    KILN_CHECK(g.sizes() == p.sizes(), "[", op, "] ", entry("grads", i), " has shape ",
               shape_str(g.sizes()), " but ", entry("params", i), " has shape ",
               shape_str(p.sizes()));
    KILN_CHECK(g.dtype() == p.dtype(), "[", op, "] ", entry("grads", i), " has dtype ",
               dtype_name(g.dtype()), " but ", entry("params", i), " has dtype ",
               dtype_name(p.dtype()));
    KILN_CHECK(g.device() == p.device(), "[", op, "] ", entry("grads", i), " is on ",
               g.device().str(), " but ", entry("params", i), " is on ", p.device().str());
  }
}

// A state list (exp_avgs, ...): one dtype for all the call's state (the parameters', or f32 for
// bf16/f16 parameters), each tensor shaped like its parameter, on its device.
void check_state(const char* op, const char* name, TensorList state, TensorList params,
                 ScalarType state_dtype) {
  for (size_t i = 0; i < state.size(); ++i) {
    const Tensor& s = state[i];
    const Tensor& p = params[i];
    KILN_CHECK(s.defined(), "[", op, "] ", entry(name, i), " is undefined");
    KILN_CHECK(s.dtype() == state_dtype, "[", op, "] ", entry(name, i), " has dtype ",
               dtype_name(s.dtype()), " but the call's state has ", dtype_name(state_dtype),
               ": one call takes state of one dtype");
    KILN_CHECK(s.sizes() == p.sizes(), "[", op, "] ", entry(name, i), " has shape ",
               shape_str(s.sizes()), " but ", entry("params", i), " has shape ",
               shape_str(p.sizes()));
    KILN_CHECK(s.device() == p.device(), "[", op, "] ", entry(name, i), " is on ", s.device().str(),
               " but ", entry("params", i), " is on ", p.device().str());
  }
}

void check_state_dtype(const char* op, const char* name, ScalarType state, ScalarType param) {
  KILN_CHECK(state == param || (state == kFloat && is_reduced_float(param)), "[", op, "] ", name,
             "[0] has dtype ", dtype_name(state), ": the state takes the params' dtype (",
             dtype_name(param), ")", is_reduced_float(param) ? " or float32" : "");
}

// The mutated tensors' specs, in the order of the call's outputs.
SpecList mutated_specs(const TensorVec& mutated) {
  SpecList specs;
  for (const Tensor& t : mutated) specs.push_back({to_shape(t.sizes()), t.dtype(), t.device()});
  return specs;
}

// --- increment_ ----------------------------------------------------------------------------------

void increment_mutated(const OpCall& c, TensorVec& out) {
  out.insert(out.end(), c.inputs.begin(), c.inputs.end());
}

SpecList increment_meta(const OpCall& c) {
  const int64_t n = internal::list_length(c, 0);
  KILN_CHECK(static_cast<int64_t>(c.inputs.size()) == n, "[increment_] expected ", n,
             " tensors for n = ", n, ", got ", c.inputs.size());
  for (size_t i = 0; i < c.inputs.size(); ++i) {
    const Tensor& t = c.inputs[i];
    KILN_CHECK(t.defined(), "[increment_] ", entry("tensors", i), " is undefined");
    const Device d = c.inputs[0].device();
    KILN_CHECK(t.dtype() == kInt64 && t.dim() == 0 && t.device() == d, "[increment_] ",
               entry("tensors", i), " must be a 0-d int64 ",
               d.is_cpu() ? std::string("CPU tensor") : "tensor on " + d.str(), ", got a ",
               dtype_name(t.dtype()), " tensor of shape ", shape_str(t.sizes()), " on ",
               t.device().str(), " (one call's counts share a device: the CPU or one GPU)");
  }
  TensorVec mutated;
  increment_mutated(c, mutated);
  return mutated_specs(mutated);
}

// --- adam_update_ -------------------------------------------------------------------------------

// The optional gradient factor: 0-d floating, on the parameters' device or the CPU, and none of
// the tensors the call writes (the CUDA kernel reads it while other blocks write them).
void check_grad_factor(const OpCall& c, const AdamUpdateCall& a) {
  const size_t lists = a.amsgrad ? 5 : 4;
  if (c.inputs.size() == (lists + 1) * a.params.size() + 1) return;  // no factor
  const Tensor& f = a.grad_factor;
  KILN_CHECK(f.defined(), "[adam_update_] grad_factor is undefined (leave it out for none)");
  KILN_CHECK(f.dim() == 0 && is_floating_point(f.dtype()),
             "[adam_update_] grad_factor must be a 0-d floating-point tensor, got a ",
             dtype_name(f.dtype()), " tensor of shape ", shape_str(f.sizes()), " on ",
             f.device().str());
  if (a.params.empty()) return;
  const Device d = a.params[0].device();
  KILN_CHECK(f.device() == d || f.is_cpu(), "[adam_update_] grad_factor is on ", f.device().str(),
             " but the params are on ", d.str(),
             ": the factor must be on the parameters' device or on the CPU");
  for (TensorList l : {a.params, a.exp_avgs, a.exp_avg_sqs, a.max_exp_avg_sqs}) {
    for (const Tensor& t : l) {
      KILN_CHECK(!t.defined() || !t.is_same(f),
                 "[adam_update_] grad_factor is a tensor the call writes: pass a copy");
    }
  }
}

void adam_mutated(const OpCall& c, TensorVec& out) {
  const AdamUpdateCall a(c, OptimDecode::kLayout);
  for (TensorList l : {a.params, a.exp_avgs, a.exp_avg_sqs, a.max_exp_avg_sqs}) {
    out.insert(out.end(), l.begin(), l.end());
  }
}

SpecList adam_update_meta(const OpCall& c) {
  const AdamUpdateCall a(c, OptimDecode::kLayout);
  KILN_CHECK(a.eps >= 0, "[adam_update_] invalid epsilon value: ", a.eps);
  KILN_CHECK(a.beta1 >= 0 && a.beta1 < 1, "[adam_update_] invalid beta1: ", a.beta1);
  KILN_CHECK(a.beta2 >= 0 && a.beta2 < 1, "[adam_update_] invalid beta2: ", a.beta2);
  KILN_CHECK(a.weight_decay >= 0, "[adam_update_] invalid weight_decay value: ", a.weight_decay);
  check_adam_scalars(a);
  check_params_and_grads("adam_update_", a.params, a.grads);
  check_grad_factor(c, a);
  if (!a.params.empty()) {
    const ScalarType sd = a.exp_avgs[0].defined() ? a.exp_avgs[0].dtype() : a.params[0].dtype();
    check_state_dtype("adam_update_", "exp_avgs", sd, a.params[0].dtype());
    check_state("adam_update_", "exp_avgs", a.exp_avgs, a.params, sd);
    check_state("adam_update_", "exp_avg_sqs", a.exp_avg_sqs, a.params, sd);
    check_state("adam_update_", "max_exp_avg_sqs", a.max_exp_avg_sqs, a.params, sd);
  }
  TensorVec mutated;
  adam_mutated(c, mutated);
  return mutated_specs(mutated);
}

// Today's op-by-op update, per parameter, in the compute dtype: on the tensors themselves where
// they have it (any strides), else on copies stored back (rounded once). The f32 kernels do the
// same float operations in the same order, so for f32 arithmetic this gives their bits on the
// CPU (tests/tensor/optim_test.cpp); CUDA's elementwise ops may contract a * b + c into an FMA.
// It reads the lr and step counts when it runs, as the kernels do.
TensorVec adam_update_decomposition(const OpCall& c) {
  const AdamUpdateCall a(c);
  const ScalarType ct = internal::optim_compute_dtype(c);
  auto in_ct = [ct](const Tensor& t) { return t.dtype() == ct ? t : t.to(ct); };
  for (size_t i = 0; i < a.params.size(); ++i) {
    const internal::AdamStepScalars k = a.step_scalars(i);
    Tensor p = in_ct(a.params[i]);
    Tensor g = a.grads[i];
    // The factor read in the compute dtype, the product rounded to the grad's dtype (foreach_mul_'s
    // bits), then read as a grad is.
    if (a.grad_factor.defined()) g = g.mul(a.grad_factor.to(ct)).to(g.dtype());
    g = g.to(ct);
    Tensor m = in_ct(a.exp_avgs[i]);
    Tensor v = in_ct(a.exp_avg_sqs[i]);
    Tensor vmax = a.amsgrad ? in_ct(a.max_exp_avg_sqs[i]) : Tensor();
    if (a.weight_decay != 0) {
      if (a.decoupled_weight_decay) {
        p.mul_(k.decay);
      } else {
        g = g.add(p, a.weight_decay);
      }
    }
    m.lerp_(g, 1 - a.beta1);
    v.mul_(a.beta2).add_(g * g, 1 - a.beta2);
    Tensor denom;
    if (a.amsgrad) {
      vmax.copy_(maximum(vmax, v));
      denom = vmax.sqrt();
    } else {
      denom = v.sqrt();
    }
    denom.div_(k.bc2_sqrt).add_(a.eps);
    p.add_(m / denom, -k.step_size);
    auto store = [](Tensor target, const Tensor& value) {
      if (target.impl() != value.impl()) target.copy_(value);
    };
    store(a.params[i], p);
    store(a.exp_avgs[i], m);
    store(a.exp_avg_sqs[i], v);
    if (a.amsgrad) store(a.max_exp_avg_sqs[i], vmax);
  }
  TensorVec mutated;
  adam_mutated(c, mutated);
  return mutated;
}

// --- sgd_update_ --------------------------------------------------------------------------------

void sgd_mutated(const OpCall& c, TensorVec& out) {
  const SgdUpdateCall s(c, OptimDecode::kLayout);
  for (TensorList l : {s.params, s.momentum_buffers}) out.insert(out.end(), l.begin(), l.end());
}

SpecList sgd_update_meta(const OpCall& c) {
  const SgdUpdateCall s(c, OptimDecode::kLayout);
  KILN_CHECK(s.momentum >= 0, "[sgd_update_] invalid momentum value: ", s.momentum);
  KILN_CHECK(s.weight_decay >= 0, "[sgd_update_] invalid weight_decay value: ", s.weight_decay);
  KILN_CHECK(!s.nesterov || (s.momentum > 0 && s.dampening == 0),
             "[sgd_update_] Nesterov momentum requires a momentum and zero dampening (momentum ",
             s.momentum, ", dampening ", s.dampening, ")");
  for (size_t i = 0; i < s.new_buffers.size(); ++i) {
    KILN_CHECK(s.new_buffers[i] == 0 || s.new_buffers[i] == 1, "[sgd_update_] new_buffers[", i,
               "] is ", s.new_buffers[i], ", expected 0 or 1");
  }
  check_host_scalar("sgd_update_", "lr", s.lr_tensor, kDouble);
  check_params_and_grads("sgd_update_", s.params, s.grads);
  if (!s.momentum_buffers.empty()) {
    const Tensor& b0 = s.momentum_buffers[0];
    const ScalarType sd = b0.defined() ? b0.dtype() : s.params[0].dtype();
    check_state_dtype("sgd_update_", "momentum_buffers", sd, s.params[0].dtype());
    check_state("sgd_update_", "momentum_buffers", s.momentum_buffers, s.params, sd);
  }
  TensorVec mutated;
  sgd_mutated(c, mutated);
  return mutated_specs(mutated);
}

// Today's op-by-op update (bit for bit the CPU kernel's, see above), per parameter.
TensorVec sgd_update_decomposition(const OpCall& c) {
  // The lr as a tensor (the op's last input), never read on the host: a compiled program that
  // runs this decomposition (on a GPU, where the op has no kernel) reads its value at every run,
  // a scheduler's, where a number read while tracing would be frozen into the program.
  const SgdUpdateCall s(c, internal::OptimDecode::kLayout);
  const ScalarType ct = internal::optim_compute_dtype(c);
  Tensor lr;  // on the parameters' device, in the compute dtype
  if (!s.params.empty()) {
    lr = s.lr_tensor.device() == s.params[0].device() ? s.lr_tensor
                                                      : s.lr_tensor.to(s.params[0].device());
    lr = lr.to(ct);
  }
  for (size_t i = 0; i < s.params.size(); ++i) {
    Tensor param = s.params[i];
    Tensor g = s.grads[i].to(ct, /*copy=*/true);  // a fresh tensor, never the grad itself
    const Tensor p = param.dtype() == ct ? param : param.to(ct);
    if (s.weight_decay != 0) g.add_(p, s.weight_decay);
    if (s.momentum != 0) {
      Tensor target = s.momentum_buffers[i];
      Tensor buf = target.dtype() == ct ? target : target.to(ct);
      if (s.new_buffers[i] != 0) {
        buf.copy_(g);
      } else {
        buf.mul_(s.momentum).add_(g, 1 - s.dampening);
      }
      if (buf.impl() != target.impl()) target.copy_(buf);
      if (s.nesterov) {
        g.add_(buf, s.momentum);
      } else {
        g = buf;
      }
    }
    if (param.dtype() == ct) {
      param.sub_(g * lr);
    } else {
      param.copy_(p.sub(g * lr));
    }
  }
  TensorVec mutated;
  sgd_mutated(c, mutated);
  return mutated;
}

}  // namespace

// Attributes: 0 n (int64).
KILN_DEFINE_OP(increment_, OpKind::kInplace, increment_meta, OpFlags{.mutated = increment_mutated});
// Attributes: 0 n (int64), 1 beta1, 2 beta2, 3 eps, 4 weight_decay (double),
// 5 decoupled_weight_decay, 6 amsgrad (bool). The lr, the step counts and the optional gradient
// factor are inputs.
KILN_DEFINE_OP(adam_update_, OpKind::kInplace, adam_update_meta, OpFlags{.mutated = adam_mutated});
KILN_REGISTER_DECOMPOSITION(adam_update_, adam_update_decomposition);
// Attributes: 0 n (int64), 1 momentum, 2 dampening, 3 weight_decay (double), 4 nesterov (bool),
// 5 new_buffers (Shape). The lr is an input.
KILN_DEFINE_OP(sgd_update_, OpKind::kInplace, sgd_update_meta, OpFlags{.mutated = sgd_mutated});
KILN_REGISTER_DECOMPOSITION(sgd_update_, sgd_update_decomposition);

namespace {
void append(TensorVec& inputs, TensorList list) {
  inputs.insert(inputs.end(), list.begin(), list.end());
}
}  // namespace

void increment_(TensorList tensors) {
  static const OpDef& op = KILN_OP(increment_);
  call_op(op, TensorVec(tensors.begin(), tensors.end()), {static_cast<int64_t>(tensors.size())});
}

void adam_update_(TensorList params, TensorList grads, TensorList exp_avgs, TensorList exp_avg_sqs,
                  TensorList max_exp_avg_sqs, TensorList state_steps, const Tensor& lr,
                  double beta1, double beta2, double weight_decay, double eps, bool amsgrad,
                  bool decoupled_weight_decay) {
  adam_update_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, beta1, beta2,
               weight_decay, eps, amsgrad, decoupled_weight_decay, Tensor());
}

void adam_update_(TensorList params, TensorList grads, TensorList exp_avgs, TensorList exp_avg_sqs,
                  TensorList max_exp_avg_sqs, TensorList state_steps, const Tensor& lr,
                  double beta1, double beta2, double weight_decay, double eps, bool amsgrad,
                  bool decoupled_weight_decay, const Tensor& grad_factor) {
  static const OpDef& op = KILN_OP(adam_update_);
  KILN_CHECK(grads.size() == params.size() && exp_avgs.size() == params.size() &&
                 exp_avg_sqs.size() == params.size() &&
                 max_exp_avg_sqs.size() == (amsgrad ? params.size() : 0) &&
                 state_steps.size() == params.size(),
             "[adam_update_] expected ", params.size(),
             " grads, exp_avgs, exp_avg_sqs and state_steps and ", amsgrad ? params.size() : 0,
             " max_exp_avg_sqs, got ", grads.size(), ", ", exp_avgs.size(), ", ",
             exp_avg_sqs.size(), ", ", state_steps.size(), " and ", max_exp_avg_sqs.size());
  TensorVec inputs;
  inputs.reserve(params.size() * (amsgrad ? 6 : 5) + 2);
  for (TensorList l : {params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps}) {
    append(inputs, l);
  }
  inputs.push_back(lr);
  if (grad_factor.defined()) inputs.push_back(grad_factor);
  call_op(op, std::move(inputs),
          {static_cast<int64_t>(params.size()), beta1, beta2, eps, weight_decay,
           decoupled_weight_decay, amsgrad});
}

void sgd_update_(TensorList params, TensorList grads, TensorList momentum_buffers,
                 IntArrayRef new_buffers, const Tensor& lr, double momentum, double dampening,
                 double weight_decay, bool nesterov) {
  static const OpDef& op = KILN_OP(sgd_update_);
  const size_t buffers = momentum != 0 ? params.size() : 0;
  KILN_CHECK(grads.size() == params.size() && momentum_buffers.size() == buffers &&
                 new_buffers.size() == buffers,
             "[sgd_update_] expected ", params.size(), " grads and ", buffers,
             " momentum_buffers and new_buffers flags, got ", grads.size(), ", ",
             momentum_buffers.size(), " and ", new_buffers.size());
  TensorVec inputs;
  inputs.reserve(params.size() + grads.size() + buffers + 1);
  for (TensorList l : {params, grads, momentum_buffers}) append(inputs, l);
  inputs.push_back(lr);
  call_op(op, std::move(inputs),
          {static_cast<int64_t>(params.size()), momentum, dampening, weight_decay, nesterov,
           Shape(new_buffers.begin(), new_buffers.end())});
}

}  // namespace kiln
