// Backward rules of the unary elementwise ops (tensor/ops/unary.cpp), written in kiln ops so
// that they differentiate again. `x` is the input, `y` the output, `g` the output gradient.
#include <cmath>
#include <numbers>

#include "autograd/backward_util.h"

namespace kiln::autograd {
namespace {

const Tensor& x(const BackwardCall& c) { return c.input(0); }
const Tensor& y(const BackwardCall& c) { return c.output(0); }
const Tensor& g(const BackwardCall& c) { return c.grad(); }

TensorVec zero_backward(const BackwardCall& c) { return {zeros_like(g(c))}; }
TensorVec neg_backward(const BackwardCall& c) { return {-g(c)}; }
TensorVec abs_backward(const BackwardCall& c) { return {g(c) * x(c).sign()}; }
TensorVec exp_backward(const BackwardCall& c) { return {g(c) * y(c)}; }
TensorVec log_backward(const BackwardCall& c) { return {g(c) / x(c)}; }
TensorVec log1p_backward(const BackwardCall& c) { return {g(c) / (x(c) + 1)}; }
TensorVec expm1_backward(const BackwardCall& c) { return {g(c) * (y(c) + 1)}; }
TensorVec sqrt_backward(const BackwardCall& c) { return {g(c) / (y(c) * 2)}; }
TensorVec rsqrt_backward(const BackwardCall& c) { return {g(c) * y(c).pow(3) * -0.5}; }
TensorVec sin_backward(const BackwardCall& c) { return {g(c) * x(c).cos()}; }
TensorVec cos_backward(const BackwardCall& c) { return {-g(c) * x(c).sin()}; }
TensorVec tanh_backward(const BackwardCall& c) { return {g(c) * (1 - y(c).square())}; }
TensorVec sigmoid_backward(const BackwardCall& c) { return {g(c) * y(c) * (1 - y(c))}; }
TensorVec relu_backward(const BackwardCall& c) {
  return {g(c) * (y(c) > 0).to(g(c).dtype())};
}
TensorVec reciprocal_backward(const BackwardCall& c) { return {-g(c) * y(c).square()}; }
TensorVec square_backward(const BackwardCall& c) { return {g(c) * x(c) * 2}; }

TensorVec erf_backward(const BackwardCall& c) {
  return {g(c) * (-x(c).square()).exp() * (2.0 / std::sqrt(std::numbers::pi))};
}

TensorVec silu_backward(const BackwardCall& c) {
  const Tensor s = x(c).sigmoid();
  return {g(c) * s * (1 + x(c) * (1 - s))};
}

// gelu: one gelu_backward call (tensor/ops/unary.cpp), the gradient in x's dtype.
TensorVec gelu_backward_rule(const BackwardCall& c) {
  static const OpDef& op = KILN_OP(gelu_backward);
  const Tensor& grad = g(c).dtype() == x(c).dtype() ? g(c) : g(c).to(x(c).dtype());
  return {call_op1(op, {grad, x(c)}, {c.attr<std::string>(0)})};
}

// gelu_backward(grad, x) = grad * gelu'(x): d/dgrad is gelu'(x) again, d/dx is grad * gelu''(x):
//   exact: gelu'' = phi(x) (2 - x^2);
//   tanh:  gelu'' = (1 - t^2) (u' + x (u'' - 2 t u'^2) / 2), t = tanh(u), u = k (x + c x^3),
//          u' = k (1 + 3 c x^2), u'' = 6 k c x.
TensorVec gelu_backward_backward(const BackwardCall& c) {
  static const OpDef& op = KILN_OP(gelu_backward);
  const std::string& approximate = c.attr<std::string>(0);
  const Tensor& gg = c.grad();
  const Tensor& grad = c.input(0);
  const Tensor& in = c.input(1);
  Tensor d_grad, d_in;
  if (c.needs_grad(0)) d_grad = call_op1(op, {gg, in}, {approximate});
  if (c.needs_grad(1)) {
    Tensor second;
    if (approximate == "tanh") {
      const double k = std::sqrt(2.0 / std::numbers::pi), cc = 0.044715;
      const Tensor t = ((in + in.pow(3) * cc) * k).tanh();
      const Tensor du = (1 + in.square() * (3 * cc)) * k;
      const Tensor ddu = in * (6 * k * cc);
      second = (1 - t.square()) * (du + in * 0.5 * (ddu - t * du.square() * 2));
    } else {
      const Tensor pdf = (in.square() * -0.5).exp() * (1.0 / std::sqrt(2 * std::numbers::pi));
      second = pdf * (2 - in.square());
    }
    d_in = gg * grad * second;
  }
  return {d_grad, d_in};
}

TensorVec pow_tensor_scalar_backward(const BackwardCall& c) {
  const Scalar& p = c.attr<Scalar>(0);
  if (p.toDouble() == 0.0) return {zeros_like(g(c))};
  return {g(c) * x(c).pow(p.toDouble() - 1.0) * p};
}

}  // namespace

constexpr uint32_t kX = save_inputs({0});
KILN_REGISTER_BACKWARD(neg, neg_backward, kSaveNone, false);
KILN_REGISTER_BACKWARD(neg_, neg_backward, kSaveNone, false);
KILN_REGISTER_BACKWARD(abs, abs_backward, kX, false);
KILN_REGISTER_BACKWARD(exp, exp_backward, kSaveNone, true);
KILN_REGISTER_BACKWARD(exp_, exp_backward, kSaveNone, true);
KILN_REGISTER_BACKWARD(log, log_backward, kX, false);
KILN_REGISTER_BACKWARD(log1p, log1p_backward, kX, false);
KILN_REGISTER_BACKWARD(expm1, expm1_backward, kSaveNone, true);
KILN_REGISTER_BACKWARD(sqrt, sqrt_backward, kSaveNone, true);
KILN_REGISTER_BACKWARD(sqrt_, sqrt_backward, kSaveNone, true);
KILN_REGISTER_BACKWARD(rsqrt, rsqrt_backward, kSaveNone, true);
KILN_REGISTER_BACKWARD(sin, sin_backward, kX, false);
KILN_REGISTER_BACKWARD(cos, cos_backward, kX, false);
KILN_REGISTER_BACKWARD(tanh, tanh_backward, kSaveNone, true);
KILN_REGISTER_BACKWARD(sigmoid, sigmoid_backward, kSaveNone, true);
KILN_REGISTER_BACKWARD(relu, relu_backward, kSaveNone, true);
KILN_REGISTER_BACKWARD(relu_, relu_backward, kSaveNone, true);
KILN_REGISTER_BACKWARD(reciprocal, reciprocal_backward, kSaveNone, true);
KILN_REGISTER_BACKWARD(square, square_backward, kX, false);
KILN_REGISTER_BACKWARD(erf, erf_backward, kX, false);
KILN_REGISTER_BACKWARD(silu, silu_backward, kX, false);
KILN_REGISTER_BACKWARD(gelu, gelu_backward_rule, kX, false);
KILN_REGISTER_BACKWARD(gelu_backward, gelu_backward_backward, kSaveAll, false);
KILN_REGISTER_BACKWARD(pow_tensor_scalar, pow_tensor_scalar_backward, kX, false);
KILN_REGISTER_BACKWARD(sign, zero_backward, kSaveNone, false);
KILN_REGISTER_BACKWARD(floor, zero_backward, kSaveNone, false);
KILN_REGISTER_BACKWARD(ceil, zero_backward, kSaveNone, false);
KILN_REGISTER_BACKWARD(round, zero_backward, kSaveNone, false);

}  // namespace kiln::autograd
