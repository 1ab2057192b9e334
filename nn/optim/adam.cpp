// Adam and AdamW's update: a fused CPU loop for contiguous f32 parameters (and f32 copies of
// 16-bit state), kiln ops otherwise; CUDA parameters through the multi-tensor kernel.
#include "nn/optim/adam.h"

#include <cmath>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "tensor/error.h"
#include "tensor/ops.h"
#include "tensor/parallel.h"
#ifdef KILN_WITH_CUDA
#include "kernels/cuda/optim.h"
#endif

namespace kiln::optim {

namespace internal {

namespace {

// The scalars of one step, derived in double as PyTorch derives them in Python.
struct StepScalars {
  double decay;      // AdamW: 1 - lr * weight_decay
  double step_size;  // lr / (1 - beta1^t)
  double bc2_sqrt;   // sqrt(1 - beta2^t)
};

StepScalars step_scalars(const AdamStep& s, int64_t t) {
  const double bc1 = 1 - std::pow(s.beta1, static_cast<double>(t));
  const double bc2 = 1 - std::pow(s.beta2, static_cast<double>(t));
  return {1 - s.lr * s.weight_decay, s.lr / bc1, std::sqrt(bc2)};
}

// The options that change the loop's shape are template parameters, so that each variant is a
// branch-free loop the compiler vectorises. The file is compiled with -fno-math-errno (see
// CMakeLists.txt): sqrt setting errno is a branch that blocks vectorisation, and the vector
// sqrt (sqrtps) is correctly rounded like the scalar one.
struct FusedArgs {
  float* p;
  const float* g;
  float* m;
  float* v;
  float* vmax;
  float decay, wd, w1, b2, w2, bc2_sqrt, eps, neg_step;
};

template <bool kDecay, bool kL2, bool kAmsgrad, bool kLerpFromStart>
void fused_adam_range(const FusedArgs& a, int64_t begin, int64_t end) {
  float* __restrict p = a.p;
  const float* __restrict g_in = a.g;
  float* __restrict m = a.m;
  float* __restrict v = a.v;
  float* __restrict vmax = a.vmax;
  for (int64_t i = begin; i < end; ++i) {
    float pv = p[i];
    float g = g_in[i];
    if constexpr (kDecay) pv = pv * a.decay;
    if constexpr (kL2) g = g + a.wd * pv;
    // lerp(m, g, w1), from the nearer end as kiln's lerp kernel computes it.
    const float diff = g - m[i];
    float mi;
    if constexpr (kLerpFromStart) {
      mi = m[i] + a.w1 * diff;
    } else {
      mi = g - diff * (1.0f - a.w1);
    }
    m[i] = mi;
    float vi = v[i] * a.b2;
    const float gg = g * g;
    vi = vi + a.w2 * gg;
    v[i] = vi;
    if constexpr (kAmsgrad) {
      const float mx = vmax[i];
      vi = ((mx > vi) | (mx != mx)) ? mx : vi;  // maximum, propagating nan (no branch)
      vmax[i] = vi;
    }
    float denom = std::sqrt(vi) / a.bc2_sqrt;
    denom = denom + a.eps;
    const float ratio = mi / denom;
    p[i] = pv + a.neg_step * ratio;
  }
}

template <bool... kFlags, typename... Rest>
void dispatch_fused(const FusedArgs& a, int64_t n, bool flag, Rest... rest) {
  if constexpr (sizeof...(Rest) == 0) {
    auto run = [&]<bool kLast>() {
      kiln::internal::parallel_for(0, n, kiln::internal::kGrainSize / 4, [&](int64_t b, int64_t e) {
        fused_adam_range<kFlags..., kLast>(a, b, e);
      });
    };
    flag ? run.template operator()<true>() : run.template operator()<false>();
  } else {
    flag ? dispatch_fused<kFlags..., true>(a, n, rest...)
         : dispatch_fused<kFlags..., false>(a, n, rest...);
  }
}

// One pass over a contiguous f32 parameter. Each line rounds to float where the op path below
// does (every kiln op rounds its result to f32 and reads scalars as float), so both paths do
// the same float arithmetic.
void fused_adam_f32(float* p, const float* g, float* m, float* v, float* vmax, int64_t n,
                    const AdamStep& s, const StepScalars& k) {
  const FusedArgs a{p,
                    g,
                    m,
                    v,
                    vmax,
                    static_cast<float>(k.decay),
                    static_cast<float>(s.weight_decay),
                    static_cast<float>(1 - s.beta1),
                    static_cast<float>(s.beta2),
                    static_cast<float>(1 - s.beta2),
                    static_cast<float>(k.bc2_sqrt),
                    static_cast<float>(s.eps),
                    static_cast<float>(-k.step_size)};
  const bool decay = s.decoupled_weight_decay && s.weight_decay != 0;
  const bool l2 = !s.decoupled_weight_decay && s.weight_decay != 0;
  dispatch_fused(a, n, decay, l2, vmax != nullptr, std::abs(a.w1) < 0.5f);
}

bool fusable(const Tensor& param, const Tensor& grad) {
  return param.is_cpu() && param.dtype() == kFloat32 && param.is_contiguous() && grad.is_cpu() &&
         grad.dtype() == kFloat32 && grad.numel() == param.numel();
}

}  // namespace

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

#ifdef KILN_WITH_CUDA
// The scalars shared by a group, as the kernel takes them (the CPU loop's FusedArgs).
cuda::internal::AdamHyper adam_hyper(const AdamStep& s) {
  return {static_cast<float>(1 - s.lr * s.weight_decay),
          static_cast<float>(s.weight_decay),
          static_cast<float>(1 - s.beta1),
          static_cast<float>(s.beta2),
          static_cast<float>(1 - s.beta2),
          static_cast<float>(s.eps),
          s.decoupled_weight_decay,
          s.amsgrad};
}

// Whether the multi-tensor kernel can update `param`: a contiguous f32/bf16/f16 GPU tensor
// whose state buffers are contiguous on its device, in `state_dtype` (f32, or the parameter's
// dtype with state_in_param_dtype); anything else (say, state changed by hand) takes the op
// path rather than being misread.
bool multi_tensor_eligible(const Tensor& param, const OptimizerParamState& state, bool amsgrad,
                           ScalarType state_dtype) {
  const ScalarType dt = param.dtype();
  if (!param.is_cuda() || !param.is_contiguous() ||
      !(dt == kFloat || dt == kBFloat16 || dt == kHalf)) {
    return false;
  }
  if (param.grad().device() != param.device()) return false;
  for (const char* name : {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}) {
    if (!amsgrad && std::string(name) == "max_exp_avg_sq") continue;
    const auto it = state.buffers.find(name);
    if (it == state.buffers.end()) return false;
    const Tensor& b = it->second;
    if (b.dtype() != state_dtype || !b.is_contiguous() || b.device() != param.device() ||
        b.numel() != param.numel()) {
      return false;
    }
  }
  return true;
}
#endif

}  // namespace

void adam_update_group(std::vector<Tensor>& params, const AdamStep& s,
                       std::unordered_map<const TensorImpl*, OptimizerParamState>& states) {
#ifdef KILN_WITH_CUDA
  // One batch per device, parameter dtype and state dtype.
  std::map<std::tuple<int, ScalarType, ScalarType>, std::vector<cuda::internal::AdamTensor>>
      batches;
  std::vector<Tensor> updated;
  std::vector<Tensor> grads;  // converted or packed grads, alive until their launch is queued
#endif
  for (Tensor& p : params) {
    if (!p.grad().defined()) continue;
    OptimizerParamState& state = states[p.impl()];
#ifdef KILN_WITH_CUDA
    if (p.is_cuda()) {
      ensure_state(p, s, state);
      const ScalarType state_dtype = adam_state_dtype(p, s.state_in_param_dtype);
      if (multi_tensor_eligible(p, state, s.amsgrad, state_dtype)) {
        Tensor g = p.grad();
        if (g.dtype() != p.dtype() || !g.is_contiguous()) {
          g = g.to(p.dtype()).contiguous();
          grads.push_back(g);
        }
        const int64_t t = ++state.step;
        const StepScalars k = step_scalars(s, t);
        auto& bufs = state.buffers;
        batches[{p.device().index(), p.dtype(), state_dtype}].push_back(
            {p.data_ptr(), g.data_ptr(), bufs["exp_avg"].data_ptr(), bufs["exp_avg_sq"].data_ptr(),
             s.amsgrad ? bufs["max_exp_avg_sq"].data_ptr() : nullptr, p.numel(),
             static_cast<float>(-k.step_size), static_cast<float>(k.bc2_sqrt)});
        updated.push_back(p);
        continue;
      }
    }
#endif
    adam_update(p, s, state);
  }
#ifdef KILN_WITH_CUDA
  if (batches.empty()) return;
  const cuda::internal::AdamHyper hyper = adam_hyper(s);
  for (const auto& [key, tensors] : batches) {
    const auto& [device, param_dtype, state_dtype] = key;
    cuda::internal::multi_tensor_adam(param_dtype, state_dtype, device, tensors, hyper);
  }
  for (Tensor& p : updated) p.impl()->bump_version();
#endif
}

void adam_update(Tensor& param, const AdamStep& s, OptimizerParamState& state) {
  ensure_state(param, s, state);
  auto& bufs = state.buffers;
  Tensor& m = bufs["exp_avg"];
  Tensor& v = bufs["exp_avg_sq"];
  Tensor* vmax = s.amsgrad ? &bufs["max_exp_avg_sq"] : nullptr;
  const int64_t t = ++state.step;
  const StepScalars k = step_scalars(s, t);
  const Tensor& grad = param.grad();

  if (fusable(param, grad) && m.is_contiguous() && v.is_contiguous() &&
      (vmax == nullptr || vmax->is_contiguous())) {
    const Tensor g = grad.contiguous();
    fused_adam_f32(param.data_ptr<float>(), g.data_ptr<float>(), m.data_ptr<float>(),
                   v.data_ptr<float>(), vmax != nullptr ? vmax->data_ptr<float>() : nullptr,
                   param.numel(), s, k);
    param.impl()->bump_version();
    return;
  }

  // 16-bit state (state_in_param_dtype): the f32 arithmetic of the fused pass (or, on a GPU,
  // of the multi-tensor kernel) on f32 copies of everything, each value rounded once when
  // copied back, so CPU and GPU give the same bits. The op path below would round every
  // intermediate to the state dtype.
  const ScalarType dtype = m.dtype();
  if (dtype == kBFloat16 || dtype == kHalf) {
    const Device device = param.device();
    auto f32 = [&](const Tensor& x) {
      KILN_CHECK(x.numel() == param.numel(), "[adam] a state buffer of shape ",
                 shape_str(x.sizes()), " does not match its parameter of shape ",
                 shape_str(param.sizes()));
      return x.to(device, kFloat32, /*non_blocking=*/false, /*copy=*/true).contiguous();
    };
    Tensor p32 = f32(param), g32 = f32(grad), m32 = f32(m), v32 = f32(v);
    Tensor x32 = vmax != nullptr ? f32(*vmax) : Tensor();
    float* x = vmax != nullptr ? x32.data_ptr<float>() : nullptr;
    if (device.is_cpu()) {
      fused_adam_f32(p32.data_ptr<float>(), g32.data_ptr<float>(), m32.data_ptr<float>(),
                     v32.data_ptr<float>(), x, p32.numel(), s, k);
    } else {
#ifdef KILN_WITH_CUDA
      KILN_CHECK(device.is_cuda(), "[adam] no update for parameters on ", device.str());
      cuda::internal::multi_tensor_adam(
          kFloat, kFloat, device.index(),
          {{p32.data_ptr(), g32.data_ptr(), m32.data_ptr(), v32.data_ptr(), x, p32.numel(),
            static_cast<float>(-k.step_size), static_cast<float>(k.bc2_sqrt)}},
          adam_hyper(s));
#else
      KILN_CHECK(false, "[adam] no update for parameters on ", device.str());
#endif
    }
    param.copy_(p32);
    m.copy_(m32);
    v.copy_(v32);
    if (vmax != nullptr) vmax->copy_(x32);
    return;
  }

  // Op by op, in the state dtype (f32 for f16/bf16 parameters, copied back at the end).
  const bool same = param.dtype() == dtype;
  Tensor p = same ? param : param.to(dtype);
  Tensor g = grad.to(dtype);
  if (s.weight_decay != 0) {
    if (s.decoupled_weight_decay) {
      p.mul_(k.decay);
    } else {
      g = g.add(p, s.weight_decay);
    }
  }
  m.lerp_(g, 1 - s.beta1);
  v.mul_(s.beta2).add_(g * g, 1 - s.beta2);
  Tensor denom;
  if (vmax != nullptr) {
    vmax->copy_(maximum(*vmax, v));
    denom = vmax->sqrt();
  } else {
    denom = v.sqrt();
  }
  denom.div_(k.bc2_sqrt).add_(s.eps);
  p.add_(m / denom, -k.step_size);
  if (!same) param.copy_(p);
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

void Adam::update_group(OptimizerParamGroup& group) {
  const auto& o = internal::options_as<AdamOptions>(group.options(), "Adam");
  internal::check_adam("Adam", o);
  internal::adam_update_group(group.params(),
                              internal::adam_step(o, /*decoupled_weight_decay=*/false), state());
}

ScalarType Adam::state_dtype_for(const Tensor& param, const OptimizerOptions& options) const {
  return internal::adam_state_dtype(
      param, internal::options_as<AdamOptions>(options, "Adam").state_in_param_dtype());
}

void Adam::update(Tensor& param, const OptimizerOptions& options, OptimizerParamState& state) {
  const auto& o = internal::options_as<AdamOptions>(options, "Adam");
  internal::check_adam("Adam", o);
  internal::adam_update(param, internal::adam_step(o, /*decoupled_weight_decay=*/false), state);
}

}  // namespace kiln::optim
