// CPU kernels of the elementwise unary ops (tensor/ops/unary.cpp holds their dtype rules).
//
// Each op is a small functor. Float ops have one or two spellings of the same formula:
//   - apply(x): the scalar formula of kernels/scalar_fn.h (shared with the CUDA kernels), used
//     on strided tensors, and for f16/bf16, which compute in float;
//   - vector(a): an Eigen array expression used on contiguous f32/f64. GCC cannot vectorise
//     calls into libm (tanh, erf, log, sin, ...) without -ffast-math; Eigen's packet math
//     is faster on one core (8M floats, SSE2: tanh 12x, erf 10x, log1p 3.5x, log, sin and
//     cos 2x, expm1 1.5x).
// Ops without a vector spelling stay scalar on purpose: sqrt, rsqrt and reciprocal must be
// correctly rounded (Eigen's fast packet sqrt is not) and GCC vectorises the division itself;
// Eigen's packet exp clamps its input, so exp(-inf) would be 3e-39 instead of 0, while
// glibc's expf is nearly as fast (exp, sigmoid, silu).
#include <Eigen/Core>
#include <cmath>
#include <type_traits>
#include <unsupported/Eigen/SpecialFunctions>

#include "kernels/cpu/loops.h"
#include "kernels/scalar_fn.h"
#include "tensor/registry.h"

namespace kiln::cpu {
namespace {

// --- Float ops (outputs are floating; integer inputs were promoted by the meta rule) --------

template <typename T>
using ArrayMap = Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>;
template <typename T>
using ConstArrayMap = Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>;

// A float op with an Eigen spelling: functor `Name` is scalar::Name (the shared scalar formula,
// kernels/scalar_fn.h) plus `vector(a)`, the same formula as an Eigen array expression in a
// (element type T). Ops without one are the scalar:: functors themselves.
#define KILN_VECTOR_OP(Name, vector_expr) \
  struct Name : scalar::Name {            \
    static constexpr bool kVector = true; \
    template <typename T, typename A>     \
    static auto vector(const A& a) {      \
      return vector_expr;                 \
    }                                     \
  }

// Whether Op has an Eigen spelling.
template <typename Op>
concept Vectorised = Op::kVector;

using scalar::kGeluTanhCoeff;
using scalar::kSqrt1_2;
using scalar::kSqrt2OverPi;

KILN_VECTOR_OP(Log, a.log());
KILN_VECTOR_OP(Log1p, a.log1p());
KILN_VECTOR_OP(Expm1, a.expm1());
KILN_VECTOR_OP(Sin, a.sin());
KILN_VECTOR_OP(Cos, a.cos());
KILN_VECTOR_OP(Tanh, a.tanh());
KILN_VECTOR_OP(Erf, a.erf());
KILN_VECTOR_OP(GeluExact, T(0.5) * a * (T(1) + (a * T(kSqrt1_2)).erf()));
KILN_VECTOR_OP(GeluTanh,
               T(0.5) * a * (T(1) + (T(kSqrt2OverPi) * (a + T(kGeluTanhCoeff) * a.cube())).tanh()));
#undef KILN_VECTOR_OP

// The Eigen-vectorised path for contiguous f32/f64 of ops that have one. A function template
// (not a branch inside the generic lambda below) so that ops without `vector` never
// instantiate it, on every compiler.
template <typename Op, typename T>
bool run_vectorised(const Tensor& out, const Tensor& in) {
  if constexpr (Vectorised<Op> && std::is_floating_point_v<T>) {
    if (!in.is_contiguous() || !out.is_contiguous()) return false;
    const T* src = static_cast<const T*>(in.data_ptr());
    T* dst = static_cast<T*>(out.data_ptr());
    internal::parallel_for(0, out.numel(), internal::kGrainSize, [&](int64_t b, int64_t e) {
      ArrayMap<T>(dst + b, e - b) = Op::template vector<T>(ConstArrayMap<T>(src + b, e - b));
    });
    return true;
  } else {
    return false;
  }
}

template <typename Op>
void float_unary(const Tensor& out, const Tensor& input, std::string_view name) {
  const Tensor in = as_dtype(input, out.dtype());
  visit_floating(out.dtype(), name, [&]<typename T>(TypeTag<T>) {
    using M = opmath_t<T>;
    if (run_vectorised<Op, T>(out, in)) return;
    elementwise<T, T>(
        out, [](T v) { return T(Op::apply(M(v))); }, in);
  });
}

// Serves the functional op and its in-place form (where outputs[0] is inputs[0]).
template <typename Op>
void float_unary_cpu(OpCall& c) {
  float_unary<Op>(c.outputs[0], c.input(0), c.name());
}

void gelu_cpu(OpCall& c) {
  if (c.attr<std::string>(0) == "tanh") {
    float_unary<GeluTanh>(c.outputs[0], c.input(0), "gelu");
  } else {
    float_unary<GeluExact>(c.outputs[0], c.input(0), "gelu");
  }
}

// --- Ops that keep the dtype (integers included) --------------------------------------------

template <typename Op>
void numeric_unary_cpu(OpCall& c) {
  const Tensor& out = c.outputs[0];
  const Tensor in = as_dtype(c.input(0), out.dtype());  // square: bool -> int64
  visit_dtype(out.dtype(), [&]<typename T>(TypeTag<T>) {
    if constexpr (std::is_same_v<T, bool>) {
      // Only sign keeps bool (the meta rules reject bool for the others): sign(b) = b.
      KILN_CHECK((std::is_same_v<Op, scalar::Sign>), "[", c.name(),
                 "] not supported for bool tensors");
      elementwise<bool, bool>(
          out, [](bool v) { return v; }, in);
    } else {
      using M = opmath_t<T>;
      elementwise<T, T>(
          out, [](T v) { return T(Op::apply(M(v))); }, in);
    }
  });
}

void logical_not_cpu(OpCall& c) {
  const Tensor& in = c.input(0);
  visit_dtype(in.dtype(), [&]<typename T>(TypeTag<T>) {
    using M = opmath_t<T>;
    elementwise_typed<bool, T>(
        c.outputs[0], [](T v) { return static_cast<M>(v) == M(0); }, in);
  });
}

void bitwise_not_cpu(OpCall& c) {
  const Tensor& out = c.outputs[0];
  visit_dtype(out.dtype(), [&]<typename T>(TypeTag<T>) {
    if constexpr (std::is_same_v<T, bool>) {
      elementwise<bool, bool>(
          out, [](bool v) { return !v; }, c.input(0));
    } else if constexpr (std::is_integral_v<T>) {
      elementwise<T, T>(
          out, [](T v) { return static_cast<T>(~v); }, c.input(0));
    } else {
      KILN_FAIL("[bitwise_not] not supported for ", dtype_name(out.dtype()));
    }
  });
}

// --- pow(tensor, scalar) ---------------------------------------------------------------------

template <typename T>
void pow_floating(const Tensor& out, const Tensor& in, double exponent) {
  using M = opmath_t<T>;
  const M e = static_cast<M>(exponent);
  scalar::visit_pow_kind(exponent, [&]<scalar::PowKind kKind>() {
    elementwise<T, T>(
        out, [e](T v) { return T(scalar::pow_scalar<kKind>(M(v), e)); }, in);
  });
}

void pow_tensor_scalar_cpu(OpCall& c) {
  const Tensor& out = c.outputs[0];
  const Tensor in = as_dtype(c.input(0), out.dtype());
  const Scalar& exponent = c.attr<Scalar>(0);
  visit_dtype(out.dtype(), [&]<typename T>(TypeTag<T>) {
    if constexpr (std::is_same_v<T, bool>) {
      KILN_FAIL("[pow] not supported for bool results");
    } else if constexpr (std::is_integral_v<T>) {
      const int64_t n = exponent.toLong();  // >= 0: the meta rule rejects negative ones
      elementwise<T, T>(
          out, [n](T x) { return scalar::int_pow_scalar(x, n); }, in);
    } else {
      pow_floating<T>(out, in, exponent.toDouble());
    }
  });
}

}  // namespace

KILN_REGISTER_KERNEL(exp, kCPU, float_unary_cpu<scalar::Exp>);
KILN_REGISTER_KERNEL(exp_, kCPU, float_unary_cpu<scalar::Exp>);
KILN_REGISTER_KERNEL(log, kCPU, float_unary_cpu<Log>);
KILN_REGISTER_KERNEL(log1p, kCPU, float_unary_cpu<Log1p>);
KILN_REGISTER_KERNEL(expm1, kCPU, float_unary_cpu<Expm1>);
KILN_REGISTER_KERNEL(sqrt, kCPU, float_unary_cpu<scalar::Sqrt>);
KILN_REGISTER_KERNEL(sqrt_, kCPU, float_unary_cpu<scalar::Sqrt>);
KILN_REGISTER_KERNEL(rsqrt, kCPU, float_unary_cpu<scalar::Rsqrt>);
KILN_REGISTER_KERNEL(sin, kCPU, float_unary_cpu<Sin>);
KILN_REGISTER_KERNEL(cos, kCPU, float_unary_cpu<Cos>);
KILN_REGISTER_KERNEL(tanh, kCPU, float_unary_cpu<Tanh>);
KILN_REGISTER_KERNEL(sigmoid, kCPU, float_unary_cpu<scalar::Sigmoid>);
KILN_REGISTER_KERNEL(silu, kCPU, float_unary_cpu<scalar::Silu>);
KILN_REGISTER_KERNEL(erf, kCPU, float_unary_cpu<Erf>);
KILN_REGISTER_KERNEL(reciprocal, kCPU, float_unary_cpu<scalar::Reciprocal>);
KILN_REGISTER_KERNEL(gelu, kCPU, gelu_cpu);
KILN_REGISTER_KERNEL(neg, kCPU, numeric_unary_cpu<scalar::Neg>);
KILN_REGISTER_KERNEL(neg_, kCPU, numeric_unary_cpu<scalar::Neg>);
KILN_REGISTER_KERNEL(abs, kCPU, numeric_unary_cpu<scalar::Abs>);
KILN_REGISTER_KERNEL(relu, kCPU, numeric_unary_cpu<scalar::Relu>);
KILN_REGISTER_KERNEL(relu_, kCPU, numeric_unary_cpu<scalar::Relu>);
KILN_REGISTER_KERNEL(sign, kCPU, numeric_unary_cpu<scalar::Sign>);
KILN_REGISTER_KERNEL(square, kCPU, numeric_unary_cpu<scalar::Square>);
KILN_REGISTER_KERNEL(floor, kCPU, numeric_unary_cpu<scalar::Floor>);
KILN_REGISTER_KERNEL(ceil, kCPU, numeric_unary_cpu<scalar::Ceil>);
KILN_REGISTER_KERNEL(round, kCPU, numeric_unary_cpu<scalar::Round>);
KILN_REGISTER_KERNEL(logical_not, kCPU, logical_not_cpu);
KILN_REGISTER_KERNEL(bitwise_not, kCPU, bitwise_not_cpu);
KILN_REGISTER_KERNEL(pow_tensor_scalar, kCPU, pow_tensor_scalar_cpu);

}  // namespace kiln::cpu
