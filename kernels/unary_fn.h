// The elementwise unary ops (tensor/ops/unary.cpp holds their dtype rules) written once for the
// CPU kernels (kernels/cpu/unary.cpp) and the CUDA kernels (kernels/cuda/unary.cu): the dtype
// dispatch, the attribute decoding, the per-element functors around the formulas of
// kernels/scalar_fn.h, and the list of the ops with their kernels.
//
// A device file supplies its elementwise loop as a `Backend` type and registers
// UnaryKernels<Backend>:
//
//   struct CpuUnary {
//     // out[i] = f(in[i]...), the inputs broadcast to out's shape, of element types Ins.
//     template <typename Out, typename... Ins, typename F>
//     static void map(const Tensor& out, const F& f, TensorFor<Ins>... in);
//     // `t` converted to dtype (a no-op when it already has it).
//     static Tensor as_dtype(const Tensor& t, ScalarType dtype);
//     // Runs float op Op on T a faster way if the device has one for this call (the CPU's Eigen
//     // spellings); false leaves it to map().
//     template <typename Op, typename T>
//     static bool vectorised(const Tensor& out, const Tensor& in);
//   };
//   #define REGISTER(op, fn) KILN_REGISTER_KERNEL(op, kCPU, scalar::UnaryKernels<CpuUnary>::fn);
//   KILN_UNARY_OPS(REGISTER)
//
// Functors compute in opmath_t<T> (float for f16/bf16). Internal to kernels/.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

#include "kernels/scalar_fn.h"
#include "tensor/dtype.h"
#include "tensor/error.h"
#include "tensor/registry.h"
#include "tensor/scalar.h"

namespace kiln::scalar {

// Every unary op and its kernel in UnaryKernels: X(op, function). In-place forms (exp_, ...) share
// the functional op's kernel (outputs[0] is then inputs[0]).
#define KILN_UNARY_OPS(X)                        \
  X(exp, float_unary<scalar::Exp>)               \
  X(exp_, float_unary<scalar::Exp>)              \
  X(log, float_unary<scalar::Log>)               \
  X(log1p, float_unary<scalar::Log1p>)           \
  X(expm1, float_unary<scalar::Expm1>)           \
  X(sqrt, float_unary<scalar::Sqrt>)             \
  X(sqrt_, float_unary<scalar::Sqrt>)            \
  X(rsqrt, float_unary<scalar::Rsqrt>)           \
  X(sin, float_unary<scalar::Sin>)               \
  X(cos, float_unary<scalar::Cos>)               \
  X(tanh, float_unary<scalar::Tanh>)             \
  X(sigmoid, float_unary<scalar::Sigmoid>)       \
  X(silu, float_unary<scalar::Silu>)             \
  X(erf, float_unary<scalar::Erf>)               \
  X(reciprocal, float_unary<scalar::Reciprocal>) \
  X(gelu, gelu)                                  \
  X(neg, numeric_unary<scalar::Neg>)             \
  X(neg_, numeric_unary<scalar::Neg>)            \
  X(abs, numeric_unary<scalar::Abs>)             \
  X(relu, numeric_unary<scalar::Relu>)           \
  X(relu_, numeric_unary<scalar::Relu>)          \
  X(sign, numeric_unary<scalar::Sign>)           \
  X(square, numeric_unary<scalar::Square>)       \
  X(floor, numeric_unary<scalar::Floor>)         \
  X(ceil, numeric_unary<scalar::Ceil>)           \
  X(round, numeric_unary<scalar::Round>)         \
  X(logical_not, logical_not)                    \
  X(bitwise_not, bitwise_not)                    \
  X(pow_tensor_scalar, pow_tensor_scalar)

// --- Per-element functors ----------------------------------------------------------------------

// Op::apply (a scalar:: functor) on the element's opmath value.
template <typename T, typename Op>
struct UnaryFn {
  KILN_SCALAR_HD T operator()(T v) const {
    using M = opmath_t<T>;
    return T(Op::apply(static_cast<M>(v)));
  }
};

// sign of bools (the one numeric op that keeps bool): sign(b) = b.
struct BoolIdentity {
  KILN_SCALAR_HD bool operator()(bool v) const { return v; }
};

template <typename T>
struct LogicalNot {
  KILN_SCALAR_HD bool operator()(T v) const {
    using M = opmath_t<T>;
    return static_cast<M>(v) == M(0);
  }
};

template <typename T>
struct BitwiseNot {
  KILN_SCALAR_HD T operator()(T v) const {
    if constexpr (std::is_same_v<T, bool>) {
      return !v;
    } else {
      return static_cast<T>(~v);
    }
  }
};

// pow(tensor, scalar) of integers: x^n for n >= 0 by squaring, wrapping on overflow.
template <typename T>
struct IntPowScalar {
  int64_t n;
  KILN_SCALAR_HD T operator()(T x) const { return int_pow_scalar(x, n); }
};

// pow(tensor, scalar) of floats, with the exponent's special cases (pow_kind).
template <typename T, PowKind kKind>
struct FloatPowScalar {
  opmath_t<T> e;
  KILN_SCALAR_HD T operator()(T v) const {
    return T(pow_scalar<kKind>(static_cast<opmath_t<T>>(v), e));
  }
};

// --- The kernels ---------------------------------------------------------------------------------

// The kernels of the unary ops on the device that `Backend` describes (see the banner).
template <typename Backend>
struct UnaryKernels {
  // Float ops: outputs are floating (integer inputs were promoted by the meta rule).
  template <typename Op>
  static void float_unary(OpCall& c) {
    float_unary_of<Op>(c.outputs[0], c.input(0), c.name());
  }

  static void gelu(OpCall& c) {
    if (c.attr<std::string>(0) == "tanh") {
      float_unary_of<GeluTanh>(c.outputs[0], c.input(0), "gelu");
    } else {
      float_unary_of<GeluExact>(c.outputs[0], c.input(0), "gelu");
    }
  }

  // Ops that keep the dtype (integers included).
  template <typename Op>
  static void numeric_unary(OpCall& c) {
    const Tensor& out = c.outputs[0];
    const Tensor in = Backend::as_dtype(c.input(0), out.dtype());  // square: bool -> int64
    visit_dtype(out.dtype(), [&]<typename T>(TypeTag<T>) {
      if constexpr (std::is_same_v<T, bool>) {
        // Only sign keeps bool (the meta rules reject bool for the others).
        KILN_CHECK((std::is_same_v<Op, Sign>), "[", c.name(), "] not supported for bool tensors");
        Backend::template map<bool, bool>(out, BoolIdentity{}, in);
      } else {
        Backend::template map<T, T>(out, UnaryFn<T, Op>{}, in);
      }
    });
  }

  static void logical_not(OpCall& c) {
    const Tensor& in = c.input(0);
    visit_dtype(in.dtype(), [&]<typename T>(TypeTag<T>) {
      Backend::template map<bool, T>(c.outputs[0], LogicalNot<T>{}, in);
    });
  }

  static void bitwise_not(OpCall& c) {
    const Tensor& out = c.outputs[0];
    visit_dtype(out.dtype(), [&]<typename T>(TypeTag<T>) {
      if constexpr (std::is_integral_v<T>) {  // bool included
        Backend::template map<T, T>(out, BitwiseNot<T>{}, c.input(0));
      } else {
        KILN_FAIL("[bitwise_not] not supported for ", dtype_name(out.dtype()));
      }
    });
  }

  static void pow_tensor_scalar(OpCall& c) {
    const Tensor& out = c.outputs[0];
    const Tensor in = Backend::as_dtype(c.input(0), out.dtype());
    const Scalar& exponent = c.attr<Scalar>(0);
    visit_dtype(out.dtype(), [&]<typename T>(TypeTag<T>) {
      if constexpr (std::is_same_v<T, bool>) {
        KILN_FAIL("[pow] not supported for bool results");
      } else if constexpr (std::is_integral_v<T>) {
        // >= 0: the meta rule rejects negative exponents of integers.
        Backend::template map<T, T>(out, IntPowScalar<T>{exponent.toLong()}, in);
      } else {
        const opmath_t<T> e = static_cast<opmath_t<T>>(exponent.toDouble());
        visit_pow_kind(exponent.toDouble(), [&]<PowKind kKind>() {
          Backend::template map<T, T>(out, FloatPowScalar<T, kKind>{e}, in);
        });
      }
    });
  }

 private:
  template <typename Op>
  static void float_unary_of(const Tensor& out, const Tensor& input, std::string_view name) {
    const Tensor in = Backend::as_dtype(input, out.dtype());
    visit_floating(out.dtype(), name, [&]<typename T>(TypeTag<T>) {
      if (Backend::template vectorised<Op, T>(out, in)) return;
      Backend::template map<T, T>(out, UnaryFn<T, Op>{}, in);
    });
  }
};

}  // namespace kiln::scalar
