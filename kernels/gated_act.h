// The activations of the gated MLPs (swiglu, geglu_tanh) and their derivatives, shared by the
// CPU (kernels/cpu/glu.cpp) and CUDA (kernels/cuda/glu.cu) kernels so that both compute the same
// formulas. M is the arithmetic type (float, or double for f64 tensors).
//
//   const float a = SiluAct::act(g), da = SiluAct::grad(g);
//
// The functions are those of kiln's silu and gelu(approximate="tanh") (kernels/cpu/unary.cpp);
// gelu's is computed through exp (below).
// Internal to kernels/.
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define KILN_GATED_HD __host__ __device__ __forceinline__
#else
#define KILN_GATED_HD inline
#endif

namespace kiln::gated {

KILN_GATED_HD float exp_of(float x) { return ::expf(x); }
KILN_GATED_HD double exp_of(double x) { return ::exp(x); }

// Both activations are g * sigmoid(z(g)) (silu: z = g; gelu_tanh: z = 2u), so one exp, e =
// exp(-z), gives the activation and its derivative g * sigmoid(z) and s * (1 + g (1 - s) z') with
// s = sigmoid(z) = 1 / (1 + e). exp_arg(g) = -z(g) is the exp's argument and act_of_exp /
// act_and_grad_of_exp finish the formulas from e, so that a kernel can compute the exps in vector
// loops of its own (kernels/cpu/glu.cpp) with the same arithmetic; act, grad and act_and_grad
// (the last with the same bits as the first two) take the exp themselves.
template <typename Act>
struct GatedSigmoid {
  template <typename M>
  static KILN_GATED_HD M exp_arg(M g) {
    return -Act::z(g);
  }
  template <typename M>
  static KILN_GATED_HD M act_of_exp(M g, M e) {
    return g / (M(1) + e);
  }
  template <typename M>
  static KILN_GATED_HD void act_and_grad_of_exp(M g, M e, M* a, M* da) {
    const M d = M(1) + e;
    const M s = M(1) / d;
    *a = g / d;
    *da = s * (M(1) + g * (M(1) - s) * Act::dz(g));
  }
  template <typename M>
  static KILN_GATED_HD M act(M g) {
    return act_of_exp(g, exp_of(exp_arg(g)));
  }
  template <typename M>
  static KILN_GATED_HD M grad(M g) {
    M a, da;
    act_and_grad_of_exp(g, exp_of(exp_arg(g)), &a, &da);
    return da;
  }
  template <typename M>
  static KILN_GATED_HD void act_and_grad(M g, M* a, M* da) {
    act_and_grad_of_exp(g, exp_of(exp_arg(g)), a, da);
  }
};

// silu(g) = g * sigmoid(g); silu'(g) = s * (1 + g * (1 - s)).
struct SiluAct : GatedSigmoid<SiluAct> {
  template <typename M>
  static KILN_GATED_HD M z(M g) {
    return g;
  }
  template <typename M>
  static KILN_GATED_HD M dz(M) {
    return M(1);
  }
};

// gelu_tanh(g) = g / 2 * (1 + tanh(u)), u = sqrt(2 / pi) * (g + 0.044715 g^3), computed as
// g * sigmoid(2u) (1 + tanh(u) = 2 sigmoid(2u)): the same function, without the cancellation of
// 1 + tanh(u) where tanh(u) is near -1 (negative g). There a tanh with a few ulp of absolute
// error (Eigen's vectorised one) gave a relative error of 3e-5 in f32 at g = -3, and below
// g = -5 1 + tanh(u) is under f32's spacing near 1, so the tanh form keeps no digit; the exp's
// relative error carries over unchanged.
struct GeluTanhAct : GatedSigmoid<GeluTanhAct> {
  static constexpr double kSqrt2OverPi = 0.7978845608028654;
  static constexpr double kCoeff = 0.044715;
  template <typename M>
  static KILN_GATED_HD M z(M g) {
    return M(2 * kSqrt2OverPi) * (g + M(kCoeff) * g * g * g);
  }
  template <typename M>
  static KILN_GATED_HD M dz(M g) {
    return M(2 * kSqrt2OverPi) * (M(1) + M(3 * kCoeff) * g * g);
  }
};

}  // namespace kiln::gated

#undef KILN_GATED_HD
