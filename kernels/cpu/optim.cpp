// CPU kernels of the optimizer updates adam_update_ and sgd_update_ (tensor/ops/optim.cpp): one
// fused, multi-threaded pass per parameter over contiguous f32 memory, for f32, bf16 and f16
// parameters (f64 runs the decomposition). Tensors that are not contiguous f32 (16-bit
// parameters or state, strided views) are copied to f32 first and stored back afterwards, each
// value rounded once. The lr and step counts are 0-d CPU tensors, decoded by AdamUpdateCall and
// SgdUpdateCall. And increment_, which advances the step counts (the only device they live on).
//
// Each line of a loop rounds to float where the decomposition's kiln ops do (every kiln op
// rounds its result to f32 and reads its scalars as float), in the same order, and nothing
// contracts a * b + c into an FMA: the loops give the decomposition's bits, and the CUDA kernel
// (kernels/cuda/optim.cu) gives these.
//
// With a gradient factor s (adam_update_'s optional input, read on the host from a CPU tensor as
// f32), each gradient is G(g * s) with G the grad's dtype: foreach_mul_'s product, rounded where
// it rounds (the decomposition multiplies the same way).
//
// The options that change a loop's shape are template parameters, so that each variant is a
// branch-free loop the compiler vectorises. The file is compiled with -fno-math-errno (see
// CMakeLists.txt): sqrt setting errno is a branch that blocks vectorisation, and the vector
// sqrt (sqrtps) is correctly rounded like the scalar one.
#include "tensor/ops/optim.h"

#include <cmath>
#include <optional>
#include <type_traits>

#include "tensor/ops.h"
#include "tensor/parallel.h"
#include "tensor/registry.h"

namespace kiln::cpu {
namespace {

// Runs body<flags...>() for the runtime flags, each a template parameter.
template <bool... kFlags, typename Body, typename... Rest>
void with_flags(Body&& body, bool flag, Rest... rest) {
  if constexpr (sizeof...(Rest) == 0) {
    flag ? body.template operator()<kFlags..., true>()
         : body.template operator()<kFlags..., false>();
  } else {
    flag ? with_flags<kFlags..., true>(body, rest...) : with_flags<kFlags..., false>(body, rest...);
  }
}

// A tensor as contiguous f32 memory a loop reads and writes: the tensor itself when it is one,
// else an f32 copy that store() writes back into it.
class F32Buffer {
 public:
  explicit F32Buffer(const Tensor& t)
      : target_(t),
        data_(t.dtype() == kFloat && t.is_contiguous()
                  ? t
                  : t.to(t.device(), kFloat, /*non_blocking=*/false, /*copy=*/true).contiguous()) {}
  float* data() const { return data_.data_ptr<float>(); }
  void store() {
    if (data_.impl() != target_.impl()) target_.copy_(data_);
  }

 private:
  Tensor target_;
  Tensor data_;
};

// The f32 update computes in f32 (f32, bf16 and f16 parameters); f64 runs the decomposition.
bool computes_in_f32(const OpCall& c) { return internal::optim_compute_dtype(c) == kFloat; }

// --- adam_update_ --------------------------------------------------------------------------------

struct AdamArgs {
  float* p;
  const float* g;
  float* m;
  float* v;
  float* vmax;
  float decay, wd, w1, b2, w2, bc2_sqrt, eps, neg_step;
  float grad_factor;  // read when G is not void
};

// G: void without a gradient factor, else the grad's dtype, which each product g * factor is
// rounded to (float, BFloat16 or Half).
template <typename G, bool kDecay, bool kL2, bool kAmsgrad, bool kLerpFromStart>
void adam_range(const AdamArgs& a, int64_t begin, int64_t end) {
  float* __restrict p = a.p;
  const float* __restrict g_in = a.g;
  float* __restrict m = a.m;
  float* __restrict v = a.v;
  float* __restrict vmax = a.vmax;
  for (int64_t i = begin; i < end; ++i) {
    float pv = p[i];
    float g = g_in[i];
    if constexpr (!std::is_void_v<G>) g = static_cast<float>(static_cast<G>(g * a.grad_factor));
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

void adam_update_cpu(OpCall& c) {
  const internal::AdamUpdateCall a(c);
  const bool decay = a.decoupled_weight_decay && a.weight_decay != 0;
  const bool l2 = !a.decoupled_weight_decay && a.weight_decay != 0;
  const float w1 = static_cast<float>(1 - a.beta1);
  float grad_factor = 1.0f;
  if (a.grad_factor.defined()) {
    grad_factor =
        visit_floating(a.grad_factor.dtype(), "adam_update_", [&]<typename S>(TypeTag<S>) {
          return static_cast<float>(*a.grad_factor.const_data_ptr<S>());
        });
  }
  for (size_t i = 0; i < a.params.size(); ++i) {
    const int64_t n = a.params[i].numel();
    if (n == 0) continue;
    const internal::AdamStepScalars k = a.step_scalars(i);
    F32Buffer p(a.params[i]), m(a.exp_avgs[i]), v(a.exp_avg_sqs[i]);
    std::optional<F32Buffer> vmax;
    if (a.amsgrad) vmax.emplace(a.max_exp_avg_sqs[i]);
    const Tensor g = a.grads[i].to(kFloat).contiguous();
    const AdamArgs args{p.data(),
                        g.data_ptr<float>(),
                        m.data(),
                        v.data(),
                        vmax ? vmax->data() : nullptr,
                        static_cast<float>(k.decay),
                        static_cast<float>(a.weight_decay),
                        w1,
                        static_cast<float>(a.beta2),
                        static_cast<float>(1 - a.beta2),
                        static_cast<float>(k.bc2_sqrt),
                        static_cast<float>(a.eps),
                        static_cast<float>(-k.step_size),
                        grad_factor};
    auto run = [&]<typename G>(TypeTag<G>) {
      with_flags(
          [&]<bool... kFlags>() {
            kiln::internal::parallel_for(
                0, n, kiln::internal::kGrainSize / 4,
                [&](int64_t b, int64_t e) { adam_range<G, kFlags...>(args, b, e); });
          },
          decay, l2, a.amsgrad, std::abs(w1) < 0.5f);
    };
    const ScalarType gd = a.grads[i].dtype();
    if (!a.grad_factor.defined()) {
      run(TypeTag<void>{});
    } else if (gd == kBFloat16) {
      run(TypeTag<BFloat16>{});
    } else if (gd == kHalf) {
      run(TypeTag<Half>{});
    } else {
      run(TypeTag<float>{});
    }
    p.store();
    m.store();
    v.store();
    if (vmax) vmax->store();
  }
}

// --- sgd_update_ ---------------------------------------------------------------------------------

struct SgdArgs {
  float* p;
  const float* g;
  float* buf;
  float wd, momentum, w, neg_lr;  // w = 1 - dampening
};

template <bool kL2, bool kMomentum, bool kNewBuffer, bool kNesterov>
void sgd_range(const SgdArgs& a, int64_t begin, int64_t end) {
  float* __restrict p = a.p;
  const float* __restrict g_in = a.g;
  float* __restrict buf = a.buf;
  for (int64_t i = begin; i < end; ++i) {
    float g = g_in[i];
    if constexpr (kL2) g = g + a.wd * p[i];
    if constexpr (kMomentum) {
      float b;
      if constexpr (kNewBuffer) {
        b = g;
      } else {
        b = buf[i] * a.momentum;
        b = b + a.w * g;
      }
      buf[i] = b;
      if constexpr (kNesterov) {
        g = g + a.momentum * b;
      } else {
        g = b;
      }
    }
    p[i] = p[i] + a.neg_lr * g;
  }
}

void sgd_update_cpu(OpCall& c) {
  const internal::SgdUpdateCall s(c);
  const bool momentum = s.momentum != 0;
  for (size_t i = 0; i < s.params.size(); ++i) {
    const int64_t n = s.params[i].numel();
    if (n == 0) continue;
    F32Buffer p(s.params[i]);
    std::optional<F32Buffer> buf;
    if (momentum) buf.emplace(s.momentum_buffers[i]);
    const Tensor g = s.grads[i].to(kFloat).contiguous();
    const SgdArgs args{p.data(),
                       g.data_ptr<float>(),
                       buf ? buf->data() : nullptr,
                       static_cast<float>(s.weight_decay),
                       static_cast<float>(s.momentum),
                       static_cast<float>(1 - s.dampening),
                       static_cast<float>(-s.lr)};
    with_flags(
        [&]<bool... kFlags>() {
          kiln::internal::parallel_for(
              0, n, kiln::internal::kGrainSize / 4,
              [&](int64_t b, int64_t e) { sgd_range<kFlags...>(args, b, e); });
        },
        s.weight_decay != 0, momentum, momentum && s.new_buffers[i] != 0, s.nesterov);
    p.store();
    if (buf) buf->store();
  }
}

// --- increment_ ----------------------------------------------------------------------------------

void increment_cpu(OpCall& c) {
  for (const Tensor& t : c.outputs) ++*t.data_ptr<int64_t>();
}

}  // namespace

KILN_REGISTER_KERNEL(increment_, kCPU, increment_cpu);
KILN_REGISTER_KERNEL_IF(adam_update_, kCPU, "fused", adam_update_cpu, computes_in_f32);
KILN_REGISTER_KERNEL_IF(sgd_update_, kCPU, "fused", sgd_update_cpu, computes_in_f32);

}  // namespace kiln::cpu
