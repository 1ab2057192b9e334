// Elementwise unary ops: their registry entries (meta rules with PyTorch's dtype rules and
// argument checks) and the public functions and Tensor methods. Kernels: kernels/cpu/unary.cpp.
//
// Dtype rules, as PyTorch:
//   - float ops (exp, log, sqrt, sin, tanh, sigmoid, erf, reciprocal, ...) promote integer and
//     bool inputs to the default dtype;
//   - gelu and silu need a floating input (PyTorch has no integer kernel for them);
//   - neg, abs, relu, floor, ceil, round keep the dtype and reject bool; sign keeps any dtype;
//     square is pow(x, 2), so bool becomes int64;
//   - logical_not returns bool; bitwise_not (operator~) takes bool and integers only;
//   - pow(tensor, scalar) follows result_type(tensor, scalar).
#include "tensor/ops.h"
#include "tensor/registry.h"

namespace kiln {
namespace {

TensorSpec same_shape(const Tensor& x, ScalarType dtype) {
  return {to_shape(x.sizes()), dtype, x.device()};
}

ScalarType float_result_type(ScalarType t) { return is_floating_point(t) ? t : default_dtype(); }

SpecList float_meta(const OpCall& c) {
  const Tensor& x = c.input(0);
  return {same_shape(x, float_result_type(x.dtype()))};
}

void check_floating_input(const OpCall& c) {
  KILN_CHECK(is_floating_point(c.input(0).dtype()), "[", c.name(),
             "] expected a floating-point tensor, got ", dtype_name(c.input(0).dtype()),
             " with shape ", shape_str(c.input(0).sizes()));
}

SpecList floating_meta(const OpCall& c) {
  check_floating_input(c);
  return {same_shape(c.input(0), c.input(0).dtype())};
}

void check_approximate(const OpCall& c) {
  const std::string& approximate = c.attr<std::string>(0);
  KILN_CHECK(approximate == "none" || approximate == "tanh", "[", c.name(),
             "] approximate must be 'none' or 'tanh', got '", approximate, "'");
}

SpecList gelu_meta(const OpCall& c) {
  check_approximate(c);
  return floating_meta(c);
}

// gelu_backward(grad, self; approximate) -> grad * gelu'(self), PyTorch's gelu_backward: gelu's
// backward rule (autograd/unary_backward.cpp) in one pass, computed in f32 for f16/bf16 (f64 for
// f64); kernels: kernels/binary_fn.h on both devices, the formulas in kernels/scalar_fn.h
// (GeluExactGrad, GeluTanhGrad). The compiler's matmul_epilogue runs it inside the product that
// makes grad where cuBLASLt can (mm_dgelu, tensor/ops/linalg.cpp).
SpecList gelu_backward_meta(const OpCall& c) {
  KILN_CHECK(c.inputs.size() == 2 && c.attrs.size() == 1,
             "[gelu_backward] expected inputs (grad, self) and the attribute approximate");
  check_approximate(c);
  const Tensor& g = c.input(0);
  const Tensor& x = c.input(1);
  KILN_CHECK(is_floating_point(x.dtype()), "[gelu_backward] expected a floating-point self, got ",
             dtype_name(x.dtype()));
  KILN_CHECK(g.dtype() == x.dtype() && g.sizes() == x.sizes(), "[gelu_backward] grad (",
             dtype_name(g.dtype()), " ", shape_str(g.sizes()), ") and self (",
             dtype_name(x.dtype()), " ", shape_str(x.sizes()),
             ") must have the same shape and dtype");
  KILN_CHECK(g.device() == x.device(), "[gelu_backward] grad is on ", g.device().str(),
             " but self is on ", x.device().str());
  return {{to_shape(x.sizes()), x.dtype(), x.device()}};
}

// The formulas in plain ops, in the compute dtype:
//   exact: Phi(x) + x phi(x);
//   tanh:  (1 + t) / 2 + x (1 - t^2) u' / 2, t = tanh(u), u = sqrt(2/pi) (x + 0.044715 x^3).
TensorVec gelu_backward_decomposition(const OpCall& c) {
  const Tensor& self = c.input(1);
  const ScalarType ct = self.dtype() == kDouble ? kDouble : kFloat;
  const Tensor x = self.to(ct);
  Tensor d;
  if (c.attr<std::string>(0) == "tanh") {
    const double k = 0.79788456080286535588;
    const Tensor t = ((x + x.pow(3) * 0.044715) * k).tanh();
    const Tensor du = (1 + x.square() * (3 * 0.044715)) * k;
    d = (1 + t) * 0.5 + x * 0.5 * (1 - t.square()) * du;
  } else {
    const Tensor cdf = ((x * 0.70710678118654752440).erf() + 1) * 0.5;
    d = cdf + x * (x.square() * -0.5).exp() * 0.39894228040143267794;
  }
  return {(c.input(0).to(ct) * d).to(self.dtype())};
}

void check_not_bool(const OpCall& c) {
  const Tensor& x = c.input(0);
  if (c.name() == "neg" || c.name() == "neg_") {
    KILN_CHECK(x.dtype() != kBool, "[", c.name(), "] negation of a bool tensor (shape ",
               shape_str(x.sizes()), ") is not supported; use ~ or logical_not() to invert a mask");
  }
  KILN_CHECK(x.dtype() != kBool, "[", c.name(), "] not supported for bool tensors, got shape ",
             shape_str(x.sizes()));
}

// neg, abs, relu, floor, ceil, round: same dtype, no bool (floor/ceil/round of integers are
// copies).
SpecList numeric_meta(const OpCall& c) {
  check_not_bool(c);
  return {same_shape(c.input(0), c.input(0).dtype())};
}

SpecList sign_meta(const OpCall& c) { return {same_shape(c.input(0), c.input(0).dtype())}; }

SpecList square_meta(const OpCall& c) {
  const ScalarType t = c.input(0).dtype();
  return {same_shape(c.input(0), t == kBool ? kInt64 : t)};
}

SpecList logical_not_meta(const OpCall& c) { return {same_shape(c.input(0), kBool)}; }

SpecList bitwise_not_meta(const OpCall& c) {
  const Tensor& x = c.input(0);
  KILN_CHECK(is_integral(x.dtype(), /*include_bool=*/true), "[bitwise_not] expected a bool or ",
             "integer tensor, got ", dtype_name(x.dtype()), " with shape ", shape_str(x.sizes()));
  return {same_shape(x, x.dtype())};
}

// torch.result_type(tensor, scalar) for pow: a floating tensor keeps its dtype; a float
// exponent promotes integer and bool tensors to the default dtype; an integer exponent lifts
// bool to int64.
ScalarType pow_result_type(ScalarType t, const Scalar& e) {
  if (is_floating_point(t)) return t;
  if (e.is_floating_point()) return default_dtype();
  if (t == kBool && e.is_integral(/*include_bool=*/false)) return kInt64;
  return t;
}

SpecList pow_meta(const OpCall& c) {
  const Tensor& x = c.input(0);
  const Scalar& e = c.attr<Scalar>(0);
  const ScalarType out = pow_result_type(x.dtype(), e);
  KILN_CHECK(!(is_integral(out, true) && e.is_integral(true) && e.toLong() < 0),
             "[pow] integers to negative integer powers are not allowed (", dtype_name(x.dtype()),
             " tensor of shape ", shape_str(x.sizes()), ", exponent ", e, ")");
  KILN_CHECK(out != kBool, "[pow] not supported for a bool tensor with a bool exponent (shape ",
             shape_str(x.sizes()), ")");
  return {same_shape(x, out)};
}

// In-place forms write into input 0, which must hold the result dtype and must not have
// elements that share memory (an expanded tensor).
void check_writable(const OpCall& c, ScalarType result) {
  const Tensor& x = c.input(0);
  KILN_CHECK(result == x.dtype(), "[", c.name(), "] result type ", dtype_name(result),
             " can't be cast to the desired output type ", dtype_name(x.dtype()));
  for (int64_t d = 0; d < x.dim(); ++d) {
    KILN_CHECK(x.strides()[d] != 0 || x.sizes()[d] <= 1, "[", c.name(),
               "] more than one element of the written-to tensor refers to a single memory ",
               "location (shape ", shape_str(x.sizes()), ", strides ", shape_str(x.strides()),
               "); clone() it first");
  }
}

SpecList float_inplace_meta(const OpCall& c) {
  check_writable(c, float_result_type(c.input(0).dtype()));
  return {};
}

SpecList numeric_inplace_meta(const OpCall& c) {
  check_not_bool(c);
  check_writable(c, c.input(0).dtype());
  return {};
}

}  // namespace

KILN_DEFINE_OP(exp, OpKind::kFunctional, float_meta);
KILN_DEFINE_OP(log, OpKind::kFunctional, float_meta);
KILN_DEFINE_OP(log1p, OpKind::kFunctional, float_meta);
KILN_DEFINE_OP(expm1, OpKind::kFunctional, float_meta);
KILN_DEFINE_OP(sqrt, OpKind::kFunctional, float_meta);
KILN_DEFINE_OP(rsqrt, OpKind::kFunctional, float_meta);
KILN_DEFINE_OP(sin, OpKind::kFunctional, float_meta);
KILN_DEFINE_OP(cos, OpKind::kFunctional, float_meta);
KILN_DEFINE_OP(tanh, OpKind::kFunctional, float_meta);
KILN_DEFINE_OP(sigmoid, OpKind::kFunctional, float_meta);
KILN_DEFINE_OP(erf, OpKind::kFunctional, float_meta);
KILN_DEFINE_OP(reciprocal, OpKind::kFunctional, float_meta);
KILN_DEFINE_OP(silu, OpKind::kFunctional, floating_meta);
// attrs: approximate ("none" or "tanh").
KILN_DEFINE_OP(gelu, OpKind::kFunctional, gelu_meta);
KILN_DEFINE_OP(gelu_backward, OpKind::kFunctional, gelu_backward_meta);
KILN_REGISTER_DECOMPOSITION(gelu_backward, gelu_backward_decomposition);
KILN_DEFINE_OP(neg, OpKind::kFunctional, numeric_meta);
KILN_DEFINE_OP(abs, OpKind::kFunctional, numeric_meta);
KILN_DEFINE_OP(relu, OpKind::kFunctional, numeric_meta);
KILN_DEFINE_OP(floor, OpKind::kFunctional, numeric_meta);
KILN_DEFINE_OP(ceil, OpKind::kFunctional, numeric_meta);
KILN_DEFINE_OP(round, OpKind::kFunctional, numeric_meta);
KILN_DEFINE_OP(sign, OpKind::kFunctional, sign_meta);
KILN_DEFINE_OP(square, OpKind::kFunctional, square_meta);
KILN_DEFINE_OP(logical_not, OpKind::kFunctional, logical_not_meta);
KILN_DEFINE_OP(bitwise_not, OpKind::kFunctional, bitwise_not_meta);
// aten's pow.Tensor_Scalar; attrs: exponent (Scalar). pow(tensor, tensor) is a binary op.
KILN_DEFINE_OP(pow_tensor_scalar, OpKind::kFunctional, pow_meta);
KILN_DEFINE_OP(exp_, OpKind::kInplace, float_inplace_meta);
KILN_DEFINE_OP(sqrt_, OpKind::kInplace, float_inplace_meta);
KILN_DEFINE_OP(neg_, OpKind::kInplace, numeric_inplace_meta);
KILN_DEFINE_OP(relu_, OpKind::kInplace, numeric_inplace_meta);

// The free function kiln::name(t) and the method t.name() of a one-input, no-attribute op.
#define KILN_UNARY_API(name)                \
  Tensor name(const Tensor& a) {            \
    static const OpDef& op = KILN_OP(name); \
    return call_op1(op, {a});               \
  }                                         \
  Tensor Tensor::name() const { return kiln::name(*this); }

KILN_UNARY_API(neg)
KILN_UNARY_API(abs)
KILN_UNARY_API(exp)
KILN_UNARY_API(log)
KILN_UNARY_API(log1p)
KILN_UNARY_API(expm1)
KILN_UNARY_API(sqrt)
KILN_UNARY_API(rsqrt)
KILN_UNARY_API(sin)
KILN_UNARY_API(cos)
KILN_UNARY_API(tanh)
KILN_UNARY_API(sigmoid)
KILN_UNARY_API(relu)
KILN_UNARY_API(silu)
KILN_UNARY_API(erf)
KILN_UNARY_API(reciprocal)
KILN_UNARY_API(sign)
KILN_UNARY_API(floor)
KILN_UNARY_API(ceil)
KILN_UNARY_API(round)
KILN_UNARY_API(square)
KILN_UNARY_API(logical_not)
#undef KILN_UNARY_API

// The in-place method t.name() of a one-input op.
#define KILN_UNARY_INPLACE_API(name)        \
  Tensor& Tensor::name() {                  \
    static const OpDef& op = KILN_OP(name); \
    call_op(op, {*this});                   \
    return *this;                           \
  }

KILN_UNARY_INPLACE_API(neg_)
KILN_UNARY_INPLACE_API(exp_)
KILN_UNARY_INPLACE_API(relu_)
KILN_UNARY_INPLACE_API(sqrt_)
#undef KILN_UNARY_INPLACE_API

Tensor gelu(const Tensor& a, std::string_view approximate) {
  static const OpDef& op = KILN_OP(gelu);
  return call_op1(op, {a}, {std::string(approximate)});
}
Tensor Tensor::gelu(std::string_view approximate) const { return kiln::gelu(*this, approximate); }

Tensor pow(const Tensor& a, const Scalar& exponent) {
  static const OpDef& op = KILN_OP(pow_tensor_scalar);
  return call_op1(op, {a}, {exponent});
}
Tensor Tensor::pow(const Scalar& exponent) const { return kiln::pow(*this, exponent); }

Tensor operator-(const Tensor& a) { return neg(a); }

Tensor operator~(const Tensor& a) {
  static const OpDef& op = KILN_OP(bitwise_not);
  return call_op1(op, {a});
}

}  // namespace kiln
