// The activations of the gated MLPs (swiglu, geglu_tanh) and their derivatives, shared by the
// CPU (kernels/cpu/glu.cpp) and CUDA (kernels/cuda/glu.cu) kernels so that both compute the same
// formulas. M is the arithmetic type (float, or double for f64 tensors).
//
//   const float a = SiluAct::act(g), da = SiluAct::grad(g);
//
// The formulas are those of kiln's silu and gelu(approximate="tanh") (kernels/cpu/unary.cpp).
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
KILN_GATED_HD float tanh_of(float x) { return ::tanhf(x); }
KILN_GATED_HD double tanh_of(double x) { return ::tanh(x); }

// Each activation is a formula around one transcendental: SiluAct's exp(-g), GeluTanhAct's
// tanh(u(g)). arg(g) is that function's argument, and act_of / act_and_grad_of finish the formula
// from its value, so that a kernel can compute the transcendental in vector loops of its own
// (kernels/cpu/glu.cpp) with the rest of the arithmetic shared.

// silu(g) = g * sigmoid(g); silu'(g) = s * (1 + g * (1 - s)) with s = sigmoid(g).
struct SiluAct {
  static constexpr bool kTanh = false;  // the transcendental is exp
  template <typename M>
  static KILN_GATED_HD M arg(M g) {
    return -g;
  }
  // From e = exp(-g).
  template <typename M>
  static KILN_GATED_HD M act_of(M g, M e) {
    return g / (M(1) + e);
  }
  template <typename M>
  static KILN_GATED_HD void act_and_grad_of(M g, M e, M* a, M* da) {
    const M d = M(1) + e;
    const M s = M(1) / d;
    *a = g / d;
    *da = s * (M(1) + g * (M(1) - s));
  }
  template <typename M>
  static KILN_GATED_HD M act(M g) {
    return act_of(g, exp_of(arg(g)));
  }
  template <typename M>
  static KILN_GATED_HD M grad(M g) {
    const M s = M(1) / (M(1) + exp_of(-g));
    return s * (M(1) + g * (M(1) - s));
  }
  // act(g) and grad(g) from one exp, with the same bits as the two calls.
  template <typename M>
  static KILN_GATED_HD void act_and_grad(M g, M* a, M* da) {
    act_and_grad_of(g, exp_of(arg(g)), a, da);
  }
};

// gelu_tanh(g) = g / 2 * (1 + tanh(u)), u = sqrt(2 / pi) * (g + 0.044715 g^3);
// its derivative (1 + t) / 2 + g / 2 * (1 - t^2) * sqrt(2 / pi) * (1 + 3 * 0.044715 g^2).
struct GeluTanhAct {
  static constexpr bool kTanh = true;  // the transcendental is tanh
  static constexpr double kSqrt2OverPi = 0.7978845608028654;
  static constexpr double kCoeff = 0.044715;
  template <typename M>
  static KILN_GATED_HD M arg(M g) {
    return M(kSqrt2OverPi) * (g + M(kCoeff) * g * g * g);
  }
  // From t = tanh(arg(g)).
  template <typename M>
  static KILN_GATED_HD M act_of(M g, M t) {
    return M(0.5) * g * (M(1) + t);
  }
  template <typename M>
  static KILN_GATED_HD void act_and_grad_of(M g, M t, M* a, M* da) {
    *a = M(0.5) * g * (M(1) + t);
    *da = M(0.5) * (M(1) + t) +
          M(0.5) * g * (M(1) - t * t) * M(kSqrt2OverPi) * (M(1) + M(3 * kCoeff) * g * g);
  }
  template <typename M>
  static KILN_GATED_HD M act(M g) {
    return act_of(g, tanh_of(arg(g)));
  }
  template <typename M>
  static KILN_GATED_HD M grad(M g) {
    const M t = tanh_of(arg(g));
    return M(0.5) * (M(1) + t) +
           M(0.5) * g * (M(1) - t * t) * M(kSqrt2OverPi) * (M(1) + M(3 * kCoeff) * g * g);
  }
  // act(g) and grad(g) from one tanh, with the same bits as the two calls.
  template <typename M>
  static KILN_GATED_HD void act_and_grad(M g, M* a, M* da) {
    act_and_grad_of(g, tanh_of(arg(g)), a, da);
  }
};

}  // namespace kiln::gated

#undef KILN_GATED_HD
