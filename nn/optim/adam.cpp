// Adam and AdamW's update: a fused CPU loop for contiguous f32 parameters, kiln ops otherwise.
#include "nn/optim/adam.h"

#include <cmath>
#include <map>
#include <string>
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

void check_adam_options(const char* name, double lr, double beta1, double beta2, double eps,
                        double weight_decay) {
  KILN_CHECK(lr >= 0, "[", name, "] invalid learning rate: ", lr);
  KILN_CHECK(eps >= 0, "[", name, "] invalid epsilon value: ", eps);
  KILN_CHECK(beta1 >= 0 && beta1 < 1, "[", name, "] invalid beta parameter at index 0: ", beta1);
  KILN_CHECK(beta2 >= 0 && beta2 < 1, "[", name, "] invalid beta parameter at index 1: ", beta2);
  KILN_CHECK(weight_decay >= 0, "[", name, "] invalid weight_decay value: ", weight_decay);
}

namespace {

// Creates the state buffers on the parameter's first step.
void ensure_state(const Tensor& param, const AdamStep& s, OptimizerParamState& state) {
  auto& bufs = state.buffers;
  if (bufs.find("exp_avg") == bufs.end()) {
    bufs["exp_avg"] = Optimizer::zero_state(param);
    bufs["exp_avg_sq"] = Optimizer::zero_state(param);
  }
  if (s.amsgrad && bufs.find("max_exp_avg_sq") == bufs.end()) {
    bufs["max_exp_avg_sq"] = Optimizer::zero_state(param);
  }
}

#ifdef KILN_WITH_CUDA
// Whether the multi-tensor kernel can update `param`: a contiguous f32/bf16/f16 GPU tensor
// whose state buffers are contiguous f32 on its device (loaded state may be otherwise).
bool multi_tensor_eligible(const Tensor& param, const OptimizerParamState& state, bool amsgrad) {
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
    if (b.dtype() != kFloat || !b.is_contiguous() || b.device() != param.device() ||
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
  std::map<std::pair<int, ScalarType>, std::vector<cuda::internal::AdamTensor>> batches;
  std::vector<Tensor> updated;
  std::vector<Tensor> grads;  // converted or packed grads, alive until their launch is queued
#endif
  for (Tensor& p : params) {
    if (!p.grad().defined()) continue;
    OptimizerParamState& state = states[p.impl()];
#ifdef KILN_WITH_CUDA
    if (p.is_cuda()) {
      ensure_state(p, s, state);
      if (multi_tensor_eligible(p, state, s.amsgrad)) {
        Tensor g = p.grad();
        if (g.dtype() != p.dtype() || !g.is_contiguous()) {
          g = g.to(p.dtype()).contiguous();
          grads.push_back(g);
        }
        const int64_t t = ++state.step;
        const StepScalars k = step_scalars(s, t);
        auto& bufs = state.buffers;
        batches[{p.device().index(), p.dtype()}].push_back(
            {p.data_ptr(), g.data_ptr(), bufs["exp_avg"].data_ptr<float>(),
             bufs["exp_avg_sq"].data_ptr<float>(),
             s.amsgrad ? bufs["max_exp_avg_sq"].data_ptr<float>() : nullptr, p.numel(),
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
  const cuda::internal::AdamHyper hyper{static_cast<float>(1 - s.lr * s.weight_decay),
                                        static_cast<float>(s.weight_decay),
                                        static_cast<float>(1 - s.beta1),
                                        static_cast<float>(s.beta2),
                                        static_cast<float>(1 - s.beta2),
                                        static_cast<float>(s.eps),
                                        s.decoupled_weight_decay,
                                        s.amsgrad};
  for (const auto& [key, tensors] : batches) {
    cuda::internal::multi_tensor_adam(key.second, key.first, tensors, hyper);
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

  // Op by op, in the state dtype (f32 for f16/bf16 parameters, copied back at the end).
  const ScalarType dtype = m.dtype();
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

void Adam::update(Tensor& param, const OptimizerOptions& options, OptimizerParamState& state) {
  const auto& o = internal::options_as<AdamOptions>(options, "Adam");
  internal::check_adam("Adam", o);
  internal::adam_update(param, internal::adam_step(o, /*decoupled_weight_decay=*/false), state);
}

}  // namespace kiln::optim
