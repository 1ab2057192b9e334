// CUDA kernels of the elementwise unary ops (tensor/ops/unary.cpp holds their dtype rules; the
// CPU kernels are kernels/cpu/unary.cpp). The CPU's formulas (kernels/scalar_fn.h), computed in
// opmath_t (float for f16/bf16) through the elementwise machinery of kernels/cuda/loops.cuh.
// Integer results are bit-identical to the CPU's; float results differ from glibc's by the few ulps
// of CUDA's math library.
#include <type_traits>

#include "kernels/cuda/loops.cuh"
#include "kernels/scalar_fn.h"

namespace kiln::cuda {
namespace {

using loops::as_dtype;
using loops::elementwise;

// --- Float ops (outputs are floating; integer inputs were promoted by the meta rule) --------

// Op::apply (a scalar:: functor) on the element's opmath value; serves the ops of both sections.
template <typename T, typename Op>
struct UnaryFn {
  __device__ T operator()(T v) const {
    using M = opmath_t<T>;
    return T(Op::apply(static_cast<M>(v)));
  }
};

template <typename Op>
void float_unary(const Tensor& out, const Tensor& input, std::string_view name) {
  const Tensor in = as_dtype(input, out.dtype());
  visit_floating(out.dtype(), name,
                 [&]<typename T>(TypeTag<T>) { elementwise<T, T>(out, UnaryFn<T, Op>{}, in); });
}

// Serves the functional op and its in-place form (where outputs[0] is inputs[0]).
template <typename Op>
void float_unary_cuda(OpCall& c) {
  float_unary<Op>(c.outputs[0], c.input(0), c.name());
}

void gelu_cuda(OpCall& c) {
  if (c.attr<std::string>(0) == "tanh") {
    float_unary<scalar::GeluTanh>(c.outputs[0], c.input(0), "gelu");
  } else {
    float_unary<scalar::GeluExact>(c.outputs[0], c.input(0), "gelu");
  }
}

// --- Ops that keep the dtype (integers included) --------------------------------------------

struct Identity {
  __device__ bool operator()(bool v) const { return v; }
};

template <typename Op>
void numeric_unary_cuda(OpCall& c) {
  const Tensor& out = c.outputs[0];
  const Tensor in = as_dtype(c.input(0), out.dtype());  // square: bool -> int64
  visit_dtype(out.dtype(), [&]<typename T>(TypeTag<T>) {
    if constexpr (std::is_same_v<T, bool>) {
      // Only sign keeps bool (the meta rules reject bool for the others): sign(b) = b.
      KILN_CHECK((std::is_same_v<Op, scalar::Sign>), "[", c.name(),
                 "] not supported for bool tensors");
      elementwise<bool, bool>(out, Identity{}, in);
    } else {
      elementwise<T, T>(out, UnaryFn<T, Op>{}, in);
    }
  });
}

template <typename T>
struct LogicalNot {
  __device__ bool operator()(T v) const {
    using M = opmath_t<T>;
    return static_cast<M>(v) == M(0);
  }
};

void logical_not_cuda(OpCall& c) {
  const Tensor& in = c.input(0);
  visit_dtype(in.dtype(), [&]<typename T>(TypeTag<T>) {
    elementwise<bool, T>(c.outputs[0], LogicalNot<T>{}, in);
  });
}

template <typename T>
struct BitwiseNot {
  __device__ T operator()(T v) const {
    if constexpr (std::is_same_v<T, bool>) {
      return !v;
    } else {
      return static_cast<T>(~v);
    }
  }
};

void bitwise_not_cuda(OpCall& c) {
  const Tensor& out = c.outputs[0];
  visit_dtype(out.dtype(), [&]<typename T>(TypeTag<T>) {
    if constexpr (std::is_integral_v<T>) {  // bool included
      elementwise<T, T>(out, BitwiseNot<T>{}, c.input(0));
    } else {
      KILN_FAIL("[bitwise_not] not supported for ", dtype_name(out.dtype()));
    }
  });
}

// --- pow(tensor, scalar) ---------------------------------------------------------------------

// x^n for n >= 0 by squaring, wrapping on overflow.
template <typename T>
struct IntPowScalar {
  int64_t n;
  __device__ T operator()(T x) const { return scalar::int_pow_scalar(x, n); }
};

template <typename T, scalar::PowKind kKind>
struct FloatPowScalar {
  opmath_t<T> e;
  __device__ T operator()(T v) const {
    return T(scalar::pow_scalar<kKind>(static_cast<opmath_t<T>>(v), e));
  }
};

// The CPU's special cases (scalar::pow_kind), so that results agree.
template <typename T>
void pow_floating(const Tensor& out, const Tensor& in, double exponent) {
  const opmath_t<T> e = static_cast<opmath_t<T>>(exponent);
  scalar::visit_pow_kind(exponent, [&]<scalar::PowKind kKind>() {
    elementwise<T, T>(out, FloatPowScalar<T, kKind>{e}, in);
  });
}

void pow_tensor_scalar_cuda(OpCall& c) {
  const Tensor& out = c.outputs[0];
  const Tensor in = as_dtype(c.input(0), out.dtype());
  const Scalar& exponent = c.attr<Scalar>(0);
  visit_dtype(out.dtype(), [&]<typename T>(TypeTag<T>) {
    if constexpr (std::is_same_v<T, bool>) {
      KILN_FAIL("[pow] not supported for bool results");
    } else if constexpr (std::is_integral_v<T>) {
      elementwise<T, T>(out, IntPowScalar<T>{exponent.toLong()}, in);
    } else {
      pow_floating<T>(out, in, exponent.toDouble());
    }
  });
}

}  // namespace

KILN_REGISTER_KERNEL(exp, kCUDA, float_unary_cuda<scalar::Exp>);
KILN_REGISTER_KERNEL(exp_, kCUDA, float_unary_cuda<scalar::Exp>);
KILN_REGISTER_KERNEL(log, kCUDA, float_unary_cuda<scalar::Log>);
KILN_REGISTER_KERNEL(log1p, kCUDA, float_unary_cuda<scalar::Log1p>);
KILN_REGISTER_KERNEL(expm1, kCUDA, float_unary_cuda<scalar::Expm1>);
KILN_REGISTER_KERNEL(sqrt, kCUDA, float_unary_cuda<scalar::Sqrt>);
KILN_REGISTER_KERNEL(sqrt_, kCUDA, float_unary_cuda<scalar::Sqrt>);
KILN_REGISTER_KERNEL(rsqrt, kCUDA, float_unary_cuda<scalar::Rsqrt>);
KILN_REGISTER_KERNEL(sin, kCUDA, float_unary_cuda<scalar::Sin>);
KILN_REGISTER_KERNEL(cos, kCUDA, float_unary_cuda<scalar::Cos>);
KILN_REGISTER_KERNEL(tanh, kCUDA, float_unary_cuda<scalar::Tanh>);
KILN_REGISTER_KERNEL(sigmoid, kCUDA, float_unary_cuda<scalar::Sigmoid>);
KILN_REGISTER_KERNEL(silu, kCUDA, float_unary_cuda<scalar::Silu>);
KILN_REGISTER_KERNEL(erf, kCUDA, float_unary_cuda<scalar::Erf>);
KILN_REGISTER_KERNEL(reciprocal, kCUDA, float_unary_cuda<scalar::Reciprocal>);
KILN_REGISTER_KERNEL(gelu, kCUDA, gelu_cuda);
KILN_REGISTER_KERNEL(neg, kCUDA, numeric_unary_cuda<scalar::Neg>);
KILN_REGISTER_KERNEL(neg_, kCUDA, numeric_unary_cuda<scalar::Neg>);
KILN_REGISTER_KERNEL(abs, kCUDA, numeric_unary_cuda<scalar::Abs>);
KILN_REGISTER_KERNEL(relu, kCUDA, numeric_unary_cuda<scalar::Relu>);
KILN_REGISTER_KERNEL(relu_, kCUDA, numeric_unary_cuda<scalar::Relu>);
KILN_REGISTER_KERNEL(sign, kCUDA, numeric_unary_cuda<scalar::Sign>);
KILN_REGISTER_KERNEL(square, kCUDA, numeric_unary_cuda<scalar::Square>);
KILN_REGISTER_KERNEL(floor, kCUDA, numeric_unary_cuda<scalar::Floor>);
KILN_REGISTER_KERNEL(ceil, kCUDA, numeric_unary_cuda<scalar::Ceil>);
KILN_REGISTER_KERNEL(round, kCUDA, numeric_unary_cuda<scalar::Round>);
KILN_REGISTER_KERNEL(logical_not, kCUDA, logical_not_cuda);
KILN_REGISTER_KERNEL(bitwise_not, kCUDA, bitwise_not_cuda);
KILN_REGISTER_KERNEL(pow_tensor_scalar, kCUDA, pow_tensor_scalar_cuda);

}  // namespace kiln::cuda
